"""Device choice happens in one place, before the process group exists (issue: a collective before
``torch.cuda.set_device`` puts every local rank of a node on cuda:0 and NCCL refuses).

``torch.cuda`` and ``torch.distributed`` are mocked: the tests record the order of
``set_device``, ``init_process_group`` and the first collective, on a CPU machine."""

from __future__ import annotations

import pytest
import torch

import vlcontrast.distributed as dist_utils


class Recorder:
    def __init__(self):
        self.calls: list[tuple] = []
        self.current = 0


@pytest.fixture
def fake_gpus(monkeypatch):
    """A node with 4 visible GPUs and no process group; records device and group calls."""
    recorder = Recorder()
    state = {"initialized": False, "backend": None}

    def set_device(device):
        index = torch.device(device).index if not isinstance(device, int) else device
        recorder.current = index
        recorder.calls.append(("set_device", index))

    def init_process_group(backend, **kwargs):
        recorder.calls.append(("init_process_group", backend, kwargs.get("device_id")))
        state.update(initialized=True, backend=backend)

    def all_reduce(tensor, op=None):
        recorder.calls.append(("all_reduce", str(tensor.device)))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: recorder.current)
    monkeypatch.setattr(dist_utils.dist, "is_initialized", lambda: state["initialized"])
    monkeypatch.setattr(dist_utils.dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist_utils.dist, "get_backend", lambda: state["backend"])
    monkeypatch.setattr(dist_utils.dist, "get_world_size", lambda: 8)
    monkeypatch.setattr(dist_utils.dist, "get_rank", lambda: 5)
    monkeypatch.setattr(dist_utils.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist_utils, "_DEVICE", None)
    # DeepSpeed, if an earlier test in this process imported it, locked the CPU accelerator; the
    # mocked node is a GPU node, where it would have locked CUDA.
    monkeypatch.setattr(dist_utils, "locked_accelerator", lambda: None)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(key, raising=False)
    return recorder


def _launch(monkeypatch, rank: int, local_rank: int, world: int = 8):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")


def test_device_is_set_before_the_group_and_before_any_collective(fake_gpus, monkeypatch):
    _launch(monkeypatch, rank=5, local_rank=1)
    env = dist_utils.init_distributed(timeout_s=5, device="auto")
    # Tensors cannot really be made on the fake GPU: the flag tensor is built, then "reduced".
    real_tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda data, device=None, **kw: _OnDevice(
        real_tensor(data, **kw), device))
    dist_utils.raise_on_any_rank(None)  # preflight's collective

    assert env.device == torch.device("cuda", 1)
    assert fake_gpus.calls[0] == ("set_device", 1)
    assert fake_gpus.calls[1] == ("init_process_group", "nccl", torch.device("cuda", 1))
    assert fake_gpus.calls[2] == ("all_reduce", "cuda:1")  # this rank's GPU, not cuda:0
    import os

    assert os.environ["DS_ACCELERATOR"] == "cuda"


class _OnDevice:
    """A CPU tensor that reports the device it was asked for (the fake GPU)."""

    def __init__(self, tensor, device):
        self.tensor, self.device = tensor, torch.device(device) if device else tensor.device

    def item(self):
        return self.tensor.item()


def test_flag_tensors_live_on_each_ranks_own_gpu(fake_gpus, monkeypatch):
    _launch(monkeypatch, rank=3, local_rank=3)
    dist_utils.init_distributed(timeout_s=5, device="cuda")
    assert dist_utils.flag_device() == torch.device("cuda", 3)
    fake_gpus.current = 0  # whatever the current device says, the chosen one is used
    assert dist_utils.flag_device() == torch.device("cuda", 3)


def test_one_gpu_per_task_maps_every_local_rank_to_its_only_device(fake_gpus, monkeypatch):
    # srun --gpus-per-task=1: each task sees one GPU, SLURM_LOCALID still counts 0..7.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    _launch(monkeypatch, rank=6, local_rank=6)
    env = dist_utils.init_distributed(timeout_s=5, device="cuda")
    assert env.device == torch.device("cuda", 0)
    assert fake_gpus.calls[0] == ("set_device", 0)


def test_torchrun_inside_a_task_that_holds_the_node_gives_each_local_rank_its_gpu(
        fake_gpus, monkeypatch):
    # srun --ntasks-per-node=1 --gpus-per-task=4 torchrun --nproc_per_node 4: the children
    # inherit SLURM_GPUS_PER_TASK and all see the 4 GPUs; each must take its own.
    monkeypatch.setenv("SLURM_GPUS_PER_TASK", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    _launch(monkeypatch, rank=3, local_rank=3, world=4)
    env = dist_utils.init_distributed(timeout_s=5, device="cuda")
    assert env.device == torch.device("cuda", 3) and fake_gpus.calls[0] == ("set_device", 3)


def test_a_task_without_a_usable_gpu_is_a_clear_error(fake_gpus, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    _launch(monkeypatch, rank=2, local_rank=2)
    with pytest.raises(dist_utils.DeviceError,
                       match=r"train.device='cuda': rank 2 \(local rank 2\) sees no usable CUDA "
                             r"device \(CUDA_VISIBLE_DEVICES=''\)"):
        dist_utils.init_distributed(timeout_s=5, device="cuda")
    assert not [c for c in fake_gpus.calls if c[0] == "init_process_group"]


def test_accelerator_and_device_are_chosen_together(fake_gpus, monkeypatch):
    # A user's DS_ACCELERATOR=cpu makes auto mean CPU (gloo), on a GPU machine too.
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    _launch(monkeypatch, rank=0, local_rank=0, world=1)
    env = dist_utils.init_distributed(timeout_s=5, device="auto")
    assert env.device == torch.device("cpu")
    assert fake_gpus.calls == [("init_process_group", "gloo", None)]
    # Contradicting it is an error naming both settings.
    with pytest.raises(dist_utils.DeviceError, match="train.device='cuda'.*DS_ACCELERATOR='cpu'"):
        dist_utils.select_device("cuda", local_rank=0)


def test_no_gpu_auto_chooses_cpu_and_tells_deepspeed(monkeypatch):
    import os

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert dist_utils.select_device("auto", local_rank=3) == torch.device("cpu")
    assert os.environ["DS_ACCELERATOR"] == "cpu"


def test_train_initialises_the_device_before_preflight(monkeypatch, tmp_path):
    """The loop's order: init_distributed (device, then group) comes before preflight's
    collective."""
    import vlcontrast.train.loop as loop
    from vlcontrast.config import load_config

    order = []

    class Stop(Exception):
        pass

    def init_distributed(**kwargs):
        order.append(("init_distributed", kwargs.get("device")))
        return dist_utils.LaunchEnv(0, 1, 0, "127.0.0.1", "1", "single", torch.device("cpu"))

    def preflight(config, evaluator=None):
        order.append(("preflight",))
        raise Stop

    monkeypatch.setattr(loop.dist_utils, "init_distributed", init_distributed)
    monkeypatch.setattr(loop, "preflight", preflight)
    config = load_config(None, ["data.train=x", "train.steps=1", "train.device=cpu",
                                f"output_dir={tmp_path}"])
    with pytest.raises(Stop):
        loop.train(config)
    assert order == [("init_distributed", "cpu"), ("preflight",)]


def test_a_precision_the_device_lacks_is_refused_before_the_run_directory_exists(monkeypatch,
                                                                               tmp_path):
    """fp16 on a CPU without fp16 kernels used to be refused after the preflight had made
    ``output_dir/checkpoints``: a refused run left an empty run directory behind."""
    import vlcontrast.train.loop as loop
    from vlcontrast.config import ConfigError, load_config
    from vlcontrast.train.precision import Precision

    def unsupported(self, device):
        raise ConfigError(f"train.precision={self.name!r}: not on this {device.type} device")

    monkeypatch.setattr(Precision, "check_supported", unsupported)
    monkeypatch.setattr(loop.dist_utils, "init_distributed", lambda **kwargs: dist_utils.LaunchEnv(
        0, 1, 0, "127.0.0.1", "1", "single", torch.device("cpu")))
    run = tmp_path / "run"
    config = load_config(None, ["data.train=x", "train.steps=1", "train.precision=fp16",
                                f"output_dir={run}"])
    with pytest.raises(ConfigError, match="train.precision='fp16'"):
        loop.train(config)
    assert not run.exists()


def test_one_gpu_per_task_exports_the_device_index_deepspeed_reads(fake_gpus, monkeypatch):
    """DeepSpeed re-reads LOCAL_RANK and calls set_device(LOCAL_RANK): with one GPU per task it
    must read the chosen index 0, not the task's local rank 6 (an invalid device ordinal)."""
    import os

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    _launch(monkeypatch, rank=6, local_rank=6)
    env = dist_utils.init_distributed(timeout_s=5, device="cuda")
    assert env.device == torch.device("cuda", 0) and env.local_rank == 6
    assert os.environ["LOCAL_RANK"] == "0"


def test_more_local_ranks_than_gpus_is_a_device_error_naming_both(fake_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    _launch(monkeypatch, rank=2, local_rank=2)  # 8 processes on a node that shows 4 GPUs
    with pytest.raises(dist_utils.DeviceError, match=r"8 processes on this node .* only 4 visible"):
        dist_utils.init_distributed(timeout_s=5, device="cuda")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    _launch(monkeypatch, rank=5, local_rank=5)  # local rank 5 of a node with 4 GPUs
    with pytest.raises(dist_utils.DeviceError, match=r"local rank 5\) but only 4 visible"):
        dist_utils.init_distributed(timeout_s=5, device="cuda")
    assert not [call for call in fake_gpus.calls if call[0] == "init_process_group"]


def test_checkpoint_rng_state_holds_only_this_ranks_cuda_generator(monkeypatch):
    from vlcontrast.train.checkpoint import RNGState

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: calls.append(("get", device))
                        or torch.zeros(4, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("all devices saved"))
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda state, device: calls.append(("set", device, len(state))))
    state = RNGState().state_dict()
    RNGState().load_state_dict(state)
    assert calls == [("get", 0), ("set", 0, 4)]
    # An older checkpoint with every device's state: this device's entry is restored.
    state["cuda"] = [torch.zeros(2, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8)]
    calls.clear()
    RNGState().load_state_dict(state)
    assert calls == [("set", 0, 2)]


def test_eval_commands_use_the_device_init_distributed_chose(fake_gpus, monkeypatch):
    from vlcontrast.evaluation import runner

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dist_utils, "set_gpu_defaults", lambda: fake_gpus.calls.append(("tf32",)))
    _launch(monkeypatch, rank=6, local_rank=6)
    assert runner._setup_device("auto") == "cuda:0"  # not cuda:6 from the raw LOCAL_RANK
    assert ("tf32",) in fake_gpus.calls  # evaluation sets training's numeric defaults
