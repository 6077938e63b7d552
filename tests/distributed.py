"""The one helper that runs a function in several processes under a process group (tests only).

``run_distributed(fn, world_size, *args, backend=None)`` spawns ``world_size`` processes,
initialises a process group in each, calls ``fn(rank, world_size, *args)`` and returns the list of
its return values (picklable), rank order. A failure in any rank raises here with that rank's
traceback.

The backend is ``gloo`` (CPU) unless the caller or the environment variable ``VLC_TEST_BACKEND``
says ``nccl``: then each rank binds ``cuda:rank`` *before* the process group exists (NCCL refuses
two ranks on one device) and the same exactness tests run on a multi-GPU machine. A test that
builds tensors uses :func:`rank_device` so they land on the rank's GPU under NCCL.
"""

from __future__ import annotations

import os
import socket
import traceback

import torch.multiprocessing as mp

BACKENDS = ("gloo", "nccl")


def default_backend() -> str:
    """``VLC_TEST_BACKEND`` or ``gloo``."""
    backend = os.environ.get("VLC_TEST_BACKEND", "gloo") or "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"VLC_TEST_BACKEND={backend!r} is not one of {list(BACKENDS)}")
    return backend


def backend_params(world_size: int) -> list:
    """``pytest.param``s of the backends an exactness test runs under: ``VLC_TEST_BACKEND`` alone
    when set, else ``gloo`` and, on a machine with ``world_size`` GPUs, ``nccl`` (marked cuda)."""
    import pytest
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = pytest.param("nccl", marks=[pytest.mark.cuda, pytest.mark.skipif(
        gpus < world_size, reason=f"nccl with {world_size} ranks needs {world_size} GPUs")])
    if os.environ.get("VLC_TEST_BACKEND"):
        return [nccl if default_backend() == "nccl" else pytest.param("gloo")]
    return [pytest.param("gloo"), nccl]


def world_backend_params(*world_sizes: int) -> list:
    """``pytest.param(world_size, backend)`` for each world size and each of its backends."""
    import pytest

    return [pytest.param(world_size, param.values[0], marks=param.marks,
                         id=f"{world_size}-{param.values[0]}")
            for world_size in world_sizes for param in backend_params(world_size)]


def rank_device(backend: str | None = None):
    """The device a rank's tensors live on under ``backend``: ``cuda`` (current) or ``cpu``."""
    import torch

    if (backend or default_backend()) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, backend, fn, args, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        if backend == "nccl":
            # The device first: a collective issued before set_device lands on cuda:0 everywhere.
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def check_backend(backend: str, world_size: int) -> None:
    """Raise a clear error when ``backend`` cannot run ``world_size`` ranks here."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {list(BACKENDS)}")
    if backend == "nccl":
        import torch

        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if available < world_size:
            raise RuntimeError(f"backend nccl with {world_size} ranks needs {world_size} GPUs, "
                               f"this machine has {available}")


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0,
                    backend: str | None = None):
    backend = backend or default_backend()
    check_backend(backend, world_size)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.terminate()
    if errors:
        raise RuntimeError("distributed worker failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
