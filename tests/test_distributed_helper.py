"""tests/distributed.py: the backend choice of the spawn helper and the NCCL device order."""

from __future__ import annotations

import queue

import pytest
import torch
import torch.distributed as dist

from tests import distributed as helper


def _return_rank(rank, world_size):
    return rank * 10 + world_size


def test_default_backend_from_environment(monkeypatch):
    monkeypatch.delenv("VLC_TEST_BACKEND", raising=False)
    assert helper.default_backend() == "gloo"
    monkeypatch.setenv("VLC_TEST_BACKEND", "nccl")
    assert helper.default_backend() == "nccl"
    monkeypatch.setenv("VLC_TEST_BACKEND", "mpi")
    with pytest.raises(ValueError, match="VLC_TEST_BACKEND='mpi'"):
        helper.default_backend()


def test_nccl_needs_enough_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match="needs 2 GPUs, this machine has 1"):
        helper.run_distributed(_return_rank, 2, backend="nccl")


def test_nccl_worker_sets_device_before_init(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device",
                                                                               device)))
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kwargs: calls.append(("init", backend,
                                                                kwargs.get("device_id"))))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    # _worker sets these (it normally runs in a fresh process): restored at teardown.
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(key, "unset")
    threads = torch.get_num_threads()
    results = queue.Queue()
    try:
        helper._worker(3, 4, 12345, "nccl", _return_rank, (), results)
    finally:
        torch.set_num_threads(threads)
    assert results.get_nowait() == (3, "ok", 34)
    # rank 3 on a 2-GPU node maps to cuda:1, bound before the process group exists.
    assert calls == [("set_device", torch.device("cuda", 1)),
                     ("init", "nccl", torch.device("cuda", 1))]


def test_gloo_runs_two_ranks():
    assert helper.run_distributed(_return_rank, 2, backend="gloo") == [2, 12]
