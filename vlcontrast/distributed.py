"""Process-group helpers shared by losses, training and evaluation.

Launch environments are read in one place (:func:`launch_env`): ``torchrun``/``deepspeed``
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``) and SLURM ``srun`` (``SLURM_PROCID``,
``SLURM_NTASKS``, ``SLURM_LOCALID``, master address from ``SLURM_JOB_NODELIST``). Gathers come in two
kinds: :func:`gather_with_grad` for losses (gradients flow back to the owning rank) and
:func:`all_gather_variable` for evaluation (ranks may hold different numbers of rows).

Device choice lives here too (:func:`select_device`, called by :func:`init_distributed`): the
device is chosen and set, and DeepSpeed's accelerator (``DS_ACCELERATOR``) agreed with it, *before*
the process group exists. NCCL binds a communicator to the current device at its first collective;
a collective issued before ``torch.cuda.set_device`` puts every local rank on cuda:0 ("Duplicate GPU
detected").

Decisions every rank must take alike (skip this step, stop now, a checkpoint failed) go through
:func:`any_rank` and :func:`raise_on_any_rank`: one rank acting alone would leave the others waiting
in a collective until the process-group timeout.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import subprocess
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vlcontrast.errors import ConfigError, DeviceError, VlcontrastError


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: str
    source: str
    device: torch.device | None = None
    """The device this process computes on; set by :func:`init_distributed`."""


def _first_slurm_host(nodelist: str) -> str:
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=10, check=True).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return first_host(nodelist)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list without ``scontrol``: its first entry (the commas
    inside brackets belong to the entry), each bracket replaced by its first value:
    ``gpu[01-03,07]`` -> gpu01, ``rack1-[01-02]-ib`` -> rack1-01-ib, ``a[1-2]-b[3-4],c`` -> a1-b3."""
    depth, end = 0, len(nodelist)
    for at, char in enumerate(nodelist):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            end = at
            break
    entry = nodelist[:end]
    return re.sub(r"\[([^\]]*)\]", lambda found: found.group(1).split(",")[0].split("-")[0],
                  entry) or nodelist


SLURM_SPECIAL_STEPS = ("batch", "extern", "interactive", "4294967294", "4294967292",
                       "4294967290")
"""What SLURM_STEP_ID reads outside a step that srun started: the batch script's step, the
extern step (a login through pam_slurm_adopt), salloc's interactive step, by name or number."""


def started_by_srun(environ: dict[str, str]) -> bool:
    """Whether this process is a task of a job step that ``srun`` started: srun sets
    ``SLURM_STEP_ID`` (older releases ``SLURM_STEPID``) to the step's number in every task it
    starts. The batch script runs in no such step (sbatch(1) lists no SLURM_STEP_ID among the
    batch job's variables), yet it has ``SLURM_PROCID=0`` and the job's ``SLURM_NTASKS``."""
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID", "")).strip()
    return step.isdigit() and step not in SLURM_SPECIAL_STEPS


def launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    """Rank, world and rendezvous of this process, from torchrun/deepspeed or SLURM variables.

    A launcher's own variables (``RANK``/``WORLD_SIZE``, set by torchrun and the deepspeed
    launcher) win over SLURM's, so ``torchrun`` inside an allocation behaves like torchrun.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        launched = _checked(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                            "RANK", "WORLD_SIZE")
        source = "deepspeed" if "CROSS_RANK" in env or "LOCAL_SIZE" in env else "torchrun"
        return LaunchEnv(*launched, env.get("MASTER_ADDR", "127.0.0.1"),
                         env.get("MASTER_PORT", "29500"), source)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        tasks = env["SLURM_NTASKS"]
        if tasks.isdigit() and int(tasks) > 1 and not started_by_srun(env):
            step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
            why = ("SLURM_STEP_ID is not set, as in the batch script" if step is None else
                   f"SLURM_STEP_ID={step!r}, not a step that srun started")
            raise ConfigError(
                f"launch environment: SLURM_NTASKS={tasks} and SLURM_PROCID="
                f"{env['SLURM_PROCID']}, but this process was not started by srun ({why}): "
                f"it would wait for {int(tasks) - 1} rank(s) that never start; start the "
                f"{tasks} tasks with srun (`srun vlcontrast train ...` in the batch script, as "
                "slurm/train_1node.sbatch does)")
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "127.0.0.1")
        # All tasks of a job derive the same port from the job id; two jobs on a node differ.
        port = env.get("MASTER_PORT") or str(20000 + int(env.get("SLURM_JOB_ID", "9500")) % 20000)
        launched = _checked(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                            int(env.get("SLURM_LOCALID", 0)), "SLURM_PROCID", "SLURM_NTASKS")
        return LaunchEnv(*launched, env.get("MASTER_ADDR") or _first_slurm_host(nodelist), port,
                         "slurm")
    return LaunchEnv(0, 1, 0, "127.0.0.1", env.get("MASTER_PORT", "29500"), "single")


def _checked(rank: int, world_size: int, local_rank: int, rank_key: str,
             world_key: str) -> tuple[int, int, int]:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"launch environment: {rank_key}={rank} is not in [0, {world_key}="
                         f"{world_size})")
    return rank, world_size, local_rank


def local_world_size(environ: dict[str, str] | None = None) -> int:
    """Processes of this job on this node (to share the CPU cores among them)."""
    env = os.environ if environ is None else environ
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = env.get(key, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return launch_env(env).world_size


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def usable_cuda_devices() -> int:
    """CUDA devices this process can see (0 without a driver or with CUDA_VISIBLE_DEVICES='')."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_accelerator(requested: str = "auto") -> str:
    """``"cuda"`` or ``"cpu"`` for ``train.device=requested``; sets ``DS_ACCELERATOR`` when unset.

    DeepSpeed picks its accelerator once, at its first import, from ``DS_ACCELERATOR`` or by probing
    for CUDA. Choosing both here keeps the model's device and DeepSpeed's accelerator the same: a
    user's explicit ``DS_ACCELERATOR=cpu`` makes ``auto`` mean CPU, and contradicting it is an error.
    """
    preset = os.environ.get("DS_ACCELERATOR", "")
    if requested == "cpu":
        kind = "cpu"
    elif requested == "cuda":
        kind = "cuda"
    elif preset:
        kind = "cpu" if preset == "cpu" else "cuda"
    else:
        kind = "cuda" if usable_cuda_devices() > 0 else "cpu"
    if preset and (preset == "cpu") != (kind == "cpu"):
        raise DeviceError(f"train.device={requested!r} computes on {kind} but DS_ACCELERATOR="
                          f"{preset!r} is set: DeepSpeed and the model would use different devices "
                          "(unset DS_ACCELERATOR or make train.device agree with it)")
    locked = locked_accelerator()
    if locked is not None and (locked == "cpu") != (kind == "cpu"):
        raise DeviceError(f"train.device={requested!r} computes on {kind} but DeepSpeed was imported "
                          f"before the device was chosen and locked its accelerator to {locked!r}: "
                          "choose the device (vlcontrast.distributed.choose_accelerator, or "
                          "DS_ACCELERATOR) before the first `import deepspeed`")
    if not preset:
        os.environ["DS_ACCELERATOR"] = kind
    return kind


def locked_accelerator() -> str | None:
    """The accelerator DeepSpeed already settled on in this process (``"cpu"``, ``"cuda"``, ...),
    or None while it has not (DeepSpeed not imported, or its accelerator not yet asked for)."""
    import sys

    module = sys.modules.get("deepspeed.accelerator.real_accelerator")
    accelerator = getattr(module, "ds_accelerator", None)
    if accelerator is None:
        return None
    try:
        return str(accelerator.device_name())
    except Exception:  # noqa: BLE001 - an accelerator that cannot name itself decides nothing
        return None


def select_device(requested: str, local_rank: int, rank: int = 0) -> torch.device:
    """Choose and set this process's device for ``train.device=requested`` (auto|cpu|cuda).

    CUDA: both launch styles work. One process per node-local GPU (torchrun, ``srun
    --gpus-per-node``): local rank r -> cuda:r. One GPU per task (``srun --gpus-per-task=1``,
    ``--gpu-bind=single:1``): each task sees one device, so local rank 6 -> cuda:0. More local
    ranks than visible devices otherwise (two ranks would share a GPU, which NCCL refuses with
    "Duplicate GPU detected") is a :class:`DeviceError` naming both numbers.
    """
    if choose_accelerator(requested) == "cpu":
        return torch.device("cpu")
    count = usable_cuda_devices()
    if count == 0:
        raise DeviceError(
            f"train.device={requested!r}: rank {rank} (local rank {local_rank}) sees no usable CUDA "
            f"device (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}); "
            "check the job's GPU binding, or use train.device=cpu")
    # One visible device: a task bound to its GPU. SLURM_GPUS_PER_TASK alone says nothing:
    # torchrun's children inherit it from `srun --gpus-per-task=8`, and all see 8 GPUs.
    per_task = count == 1
    ranks_here = next((int(os.environ[key]) for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")
                       if os.environ.get(key, "").isdigit()), local_rank + 1)
    if not per_task and max(ranks_here, local_rank + 1) > count:
        raise DeviceError(
            f"train.device={requested!r}: {max(ranks_here, local_rank + 1)} processes on this node "
            f"(local rank {local_rank}) but only {count} visible CUDA devices "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}): two "
            "ranks would share a GPU; start one process per GPU (--nproc / --ntasks-per-node) or "
            "give each task its own GPU (--gpus-per-task=1)")
    device = torch.device("cuda", 0 if per_task else local_rank)
    torch.cuda.set_device(device)
    return device


_DEVICE: torch.device | None = None
"""This process's device once :func:`init_distributed` chose it (the flag tensors' home)."""


def set_gpu_defaults() -> None:
    """open_clip's CUDA settings: TF32 matmuls and convolutions, cuDNN autotuning.

    TF32 keeps fp32 storage and range with a 10-bit mantissa in the tensor-core products (fp32
    runs and amp_bf16's fp32 ops); cuDNN benchmarks its convolution algorithms once per input
    shape, and the training shapes do not change. Set through ``set_float32_matmul_precision``
    and ``cudnn.allow_tf32``, not the per-backend ``fp32_precision`` attributes: once those are set,
    torch raises on ``get_float32_matmul_precision()`` and ``matmul.allow_tf32``, which
    ``torch.compile`` and user code read. Training and offline evaluation both call this, so
    their numbers agree.
    """
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True


def init_distributed(backend: str | None = None, timeout_s: int = 600,
                     device: str = "auto") -> LaunchEnv:
    """Choose and set the device, then initialise the default process group (also for a single
    process, so code paths stay one). Returns the launch environment with ``device`` filled in.

    Order matters on GPUs: ``set_device`` first, then ``init_process_group`` with ``device_id``
    (NCCL binds this rank's communicator to that device eagerly), then any collective.
    """
    global _DEVICE
    env = launch_env()
    if is_initialized():
        if _DEVICE is None:  # a group made elsewhere (tests): its backend says where flags live
            _DEVICE = (torch.device("cuda", torch.cuda.current_device())
                       if dist.get_backend() == "nccl" else torch.device("cpu"))
            os.environ.setdefault("DS_ACCELERATOR", _DEVICE.type)
        return dataclasses.replace(env, device=_DEVICE)
    chosen = select_device(device, env.local_rank, env.rank)
    _DEVICE = chosen
    env = dataclasses.replace(env, device=chosen)
    if env.source == "single" and "MASTER_PORT" not in os.environ:
        # A lone process needs no agreed port: take a free one, so concurrent runs don't collide.
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            env = dataclasses.replace(env, master_port=str(sock.getsockname()[1]))
    # LOCAL_RANK carries the chosen device index: DeepSpeed reads it again and calls
    # set_device(LOCAL_RANK), which must not be 6 on a task that sees one GPU.
    device_index = chosen.index if chosen.type == "cuda" else env.local_rank
    for key, value in (("RANK", env.rank), ("WORLD_SIZE", env.world_size),
                       ("LOCAL_RANK", device_index), ("MASTER_ADDR", env.master_addr),
                       ("MASTER_PORT", env.master_port)):
        os.environ[str(key)] = str(value)
    if backend is None:
        backend = "nccl" if chosen.type == "cuda" else "gloo"
    kwargs = {"device_id": chosen} if backend == "nccl" else {}

    def create() -> None:
        # The current CUDA device is each thread's own: the helper thread that waits here
        # (meet_the_other_ranks) starts on cuda:0.
        if chosen.type == "cuda" and torch.cuda.current_device() != chosen.index:
            torch.cuda.set_device(chosen)
        dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)

    try:
        meet_the_other_ranks(create, env)
    except RuntimeError as error:  # torch's DistStoreError, DistNetworkError, ...
        late = rendezvous_timeout(error, env, timeout_s)
        if late is None:
            raise
        raise late from error
    return env


class RendezvousStopped(VlcontrastError):
    """A stop signal (SIGTERM, SIGUSR1) came while this rank waited for the others at the
    rendezvous: it stops at once, before step 1, with nothing to save (``vlcontrast train`` ends
    it as a stop by that signal: exit 0, and rank 0's ``preempted.json`` asks the scheduler to run
    the job again)."""

    signalled = True


RENDEZVOUS_GRACE_S = 5.0
"""How long a rank that heard a stop signal at the rendezvous still lets ``init_process_group``
finish: ranks that are all there meet within it and stop together at step 1 (the stop goes through
the training's flag collective), instead of one rank stopping alone while a peer that met goes on
to its first collective and waits there for ``train.dist_timeout_s``."""


def meet_the_other_ranks(create, env: LaunchEnv) -> None:
    """``create()`` (``init_process_group``) where the stop signals and Ctrl-C are heard.

    The rendezvous waits in torch's C++ code for the ranks that have not come (until
    ``train.dist_timeout_s``: 600 s by default), and a Python signal handler only runs once that
    returns: a rank whose peers never start (a node of the job that failed) ignored ``scancel``
    and Ctrl-C until the timeout. Here the wait runs in a helper thread and this thread listens:
    Ctrl-C raises ``KeyboardInterrupt`` at once. A stop signal that a handler of this process
    takes (``vlcontrast train``'s, which keeps it as well) gives the rendezvous
    :data:`RENDEZVOUS_GRACE_S` more: ranks that meet within it go on, and the signal they hold
    stops them all at step 1; a rendezvous still waiting then raises :class:`RendezvousStopped`
    (so does one that failed meanwhile: a peer that stopped). A signal left to its default action
    ends the process anyway.

    A helper thread left inside torch's C++ code, or what a rendezvous that failed left there,
    aborts the interpreter's normal exit ("terminate called without an active exception", exit
    134 and a core dump, where the stop meant exit 0): the ``vlcontrast`` command then leaves
    through :func:`_leave_now` (its exit functions run, logs and output flushed, then
    ``os._exit`` with the command's code)."""
    import signal
    import threading
    import time

    from vlcontrast.requeue import STOP_SIGNALS

    if env.world_size == 1 or threading.current_thread() is not threading.main_thread():
        create()
        return
    heard: list[int] = []
    previous: dict[int, object] = {}

    def listen(signum: int, frame) -> None:
        heard.append(signum)
        handler = previous.get(signum)
        if callable(handler):
            handler(signum, frame)  # the command's own handler still takes it

    for sig in STOP_SIGNALS:
        if callable(signal.getsignal(sig)):  # SIG_DFL ends the process, SIG_IGN ignores it
            previous[sig] = signal.signal(sig, listen)
    outcome: list[BaseException] = []
    # Not Thread.is_alive(): a join() that Ctrl-C interrupts marks a thread that still runs as
    # ended (Python 3.11).
    done = threading.Event()

    def wait() -> None:
        try:
            create()
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
            outcome.append(error)
        finally:
            done.set()

    def stopped() -> RendezvousStopped:
        return RendezvousStopped(
            f"stopped by {_signal_words(heard[0])} before step 1, while rank {env.rank} of "
            f"{env.world_size} waited at the rendezvous ({env.master_addr}:{env.master_port}) "
            "for the others; nothing was trained: start the job again")

    helper = threading.Thread(target=wait, name="vlcontrast-rendezvous", daemon=True)
    heard_at: float | None = None
    try:
        helper.start()
        while not done.wait(0.1):
            if heard:  # met meanwhile: the held signal stops at step 1
                heard_at = time.monotonic() if heard_at is None else heard_at
                if time.monotonic() - heard_at >= RENDEZVOUS_GRACE_S:
                    _leave_now_at_exit(0)
                    raise stopped()
    except KeyboardInterrupt:
        if not done.is_set():
            _leave_now_at_exit(130)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if outcome:
        # What a failed rendezvous leaves in torch's C++ code aborts the teardown as well.
        _leave_now_at_exit(0 if heard else 1)
        if heard:  # the rendezvous failed after the signal: a peer that stopped at it
            raise stopped() from outcome[0]
        raise outcome[0]


_COMMAND_MODULES = ("vlcontrast.__main__", "vlcontrast.cli.__main__", "vlcontrast.cli")


def _vlcontrast_command() -> bool:
    """Whether this process is the ``vlcontrast`` command (``vlcontrast ...``, ``python -m
    vlcontrast``, torchrun's ``-m vlcontrast.cli``), whose exit codes :func:`_leave_now` knows;
    not a test or another program that imports vlcontrast (its exit code is its own)."""
    import sys

    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None:
        return spec.name in _COMMAND_MODULES
    return os.path.basename(sys.argv[0] if sys.argv else "") == "vlcontrast"


_LEAVING: dict[str, int] = {}
"""Set once the rendezvous thread was left inside torch's C++ code: the exit code the command
returns on that path (:func:`_leave_now_at_exit`)."""


def _leave_now_at_exit(code: int) -> None:
    """The ``vlcontrast`` command, which left the rendezvous thread inside torch's C++ code, ends
    through :func:`_leave_now` at its exit: with ``code`` (0 after a stop, the command's
    ``RendezvousStopped`` path; 130 after Ctrl-C; 1 after a failed rendezvous), or the code of an
    error reported after it (:func:`vlcontrast.cli.failure.report`), or 1 (130 for Ctrl-C) after
    an error nothing caught."""
    import atexit

    if not _vlcontrast_command() or _LEAVING:
        return
    _LEAVING["code"] = code
    atexit.register(_leave_now)  # the last registered: the first to run


def _leave_now() -> None:
    """At the command's exit: the other exit functions (``atexit``: the logs' handlers flushed and
    closed, ...) run, stdout and stderr are flushed, then ``os._exit`` with the command's code,
    before the interpreter's teardown, where torch's C++ code left from the rendezvous aborts."""
    import atexit
    import sys

    code = _LEAVING.get("code", 0)
    failure = sys.modules.get("vlcontrast.cli.failure")  # loaded by the command; not imported here
    reported = getattr(failure, "reported_code", None)
    if reported is not None:
        code = reported
    uncaught = getattr(sys, "last_value", None)  # an error nothing caught: its traceback is out
    if uncaught is not None:
        code = 130 if isinstance(uncaught, KeyboardInterrupt) else 1
    try:
        atexit.unregister(_leave_now)
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _signal_words(number: int) -> str:
    import signal

    try:
        return f"signal {number} ({signal.Signals(number).name})"
    except ValueError:
        return f"signal {number}"


class RendezvousTimeout(VlcontrastError, RuntimeError):
    """Not every rank reached the rendezvous within ``train.dist_timeout_s`` (one line, exit 1)."""


def rendezvous_timeout(error: BaseException, env: LaunchEnv,
                       timeout_s: int) -> RendezvousTimeout | None:
    """The one-line error for a rendezvous that timed out (torch's ``DistStoreError: Timed out
    after 31 seconds waiting for clients. 1/2 clients joined.`` on rank 0, a connect timeout on
    the others); None for any other failure of ``init_process_group``."""
    text = str(error)
    if not re.search(r"timed out|timeout", text, re.IGNORECASE):
        return None
    joined = re.search(r"(\d+)\s*/\s*(\d+) clients joined", text)
    arrived = (f"only {joined.group(1)} of {env.world_size} ranks arrived" if joined else
               f"rank {env.rank} of {env.world_size} did not meet the others")
    world = {"slurm": "SLURM_NTASKS"}.get(env.source, "WORLD_SIZE")
    return RendezvousTimeout(
        f"launch environment: {arrived} within train.dist_timeout_s={timeout_s} (rendezvous at "
        f"{env.master_addr}:{env.master_port}, {world}={env.world_size}); start all "
        f"{env.world_size} ranks with the same MASTER_ADDR and MASTER_PORT (a rank that failed "
        "to start says why in its own output), or raise train.dist_timeout_s if they start slowly")


def gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate ``tensor`` from every rank along dim 0; gradients flow back to their owners.

    Every rank must pass the same shape. With one process this is the identity.
    """
    if get_world_size() == 1:
        return tensor
    import warnings

    import torch.distributed.nn.functional as dist_fn

    with warnings.catch_warnings():
        # Deprecated in favour of a private functional-collectives API; still the public,
        # autograd-aware all_gather, so keep it and keep the logs clean.
        warnings.simplefilter("ignore", FutureWarning)
        return torch.cat(dist_fn.all_gather(tensor.contiguous()), dim=0)


def gather_no_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-shaped tensors from every rank along dim 0, without gradient."""
    if get_world_size() == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=0)


def all_gather_variable(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate tensors whose first dimension differs across ranks (evaluation shards)."""
    world = get_world_size()
    if world == 1:
        return tensor
    size = torch.tensor([tensor.shape[0]], device=tensor.device, dtype=torch.long)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([p[:n] for p, n in zip(parts, lengths)], dim=0)


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    if get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def barrier() -> None:
    if get_world_size() > 1:
        dist.barrier()


def _flag_device() -> torch.device:
    # NCCL reduces CUDA tensors only (this rank's own device, chosen by init_distributed: never
    # "the current device", which is cuda:0 on every rank until set_device); gloo reduces CPU ones.
    if is_initialized() and dist.get_backend() == "nccl":
        if _DEVICE is not None and _DEVICE.type == "cuda":
            return _DEVICE
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def flag_device() -> torch.device:
    """Where a tensor for a small decision collective (:func:`all_reduce_sum`) must live."""
    return _flag_device()


def count_ranks(flag: bool) -> int:
    """How many ranks pass a true ``flag`` (collective: every rank calls it)."""
    value = torch.tensor([1.0 if flag else 0.0], device=_flag_device())
    return int(all_reduce_sum(value).item())


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on at least one (collective)."""
    return count_ranks(flag) > 0


def raise_on_any_rank(error: BaseException | None, exc_type: type[Exception] = RuntimeError) -> None:
    """Collective: when any rank has an ``error``, every rank raises.

    A rank with an error re-raises it; the others raise ``exc_type`` with the first failing rank's
    message, so all ranks stop at the same point instead of waiting for each other.
    """
    if not any_rank(error is not None):
        return
    messages: list[str | None] = [None] * get_world_size()
    mine = None if error is None else str(error)
    if get_world_size() > 1:
        dist.all_gather_object(messages, mine)
    if error is not None:
        raise error
    rank, message = next((r, m) for r, m in enumerate(messages) if m is not None)
    raise exc_type(f"{message} [reported by rank {rank}]")
