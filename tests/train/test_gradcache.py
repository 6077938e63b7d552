"""GradCache accumulation equals one large batch: k = 4 micro-batches of 8 give the parameter
gradients of one batch of 32, for every loss (1-process DeepSpeed engine, plain SGD so the update
is the gradient). The process group's backend is the test helper's (``VLC_TEST_BACKEND``: gloo on
CPU, nccl on a GPU machine, where the model and batches live on the GPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed import default_backend, free_port, rank_device

BATCH, K = 32, 4


@pytest.fixture(scope="module")
def process_group():
    """A 1-process gloo group, as DeepSpeed's engine needs one; torn down after the module."""
    import os

    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = default_backend()
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def tiny_models():
    """vlc-micro with and without SigLIP's logit bias; no dropout anywhere in it."""
    from vlcontrast.config import ModelConfig
    from vlcontrast.models import build_model

    torch.manual_seed(0)
    return {siglip: build_model(ModelConfig(name="vlc-micro"), siglip=siglip,
                                device=rank_device()).model
            for siglip in (False, True)}


def _engine(model, micro_batch: int, accum: int):
    import deepspeed

    from vlcontrast.train.engine import skip_cpu_inference_comm_op, vectorise_scalar_parameters

    skip_cpu_inference_comm_op()
    model = copy.deepcopy(model)
    vectorise_scalar_parameters(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accum,
              "train_batch_size": micro_batch * accum, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 0}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                      dist_init_required=False)
    return engine


def _batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(BATCH, 3, 32, 32, generator=generator)
    texts = torch.randint(1, 49407, (BATCH, 16), generator=generator)
    sample_ids = torch.arange(BATCH) + 100 * seed
    return images, texts, sample_ids


def _split(batch, k):
    return [tuple(t.chunk(k)[i] for t in batch) for i in range(k)]


def _params(engine):
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _run(engine, loss_fn, batches, k):
    from vlcontrast.train.loop import train_step
    from vlcontrast.train.steplog import StepTimer

    device = rank_device()
    timer = StepTimer(device)
    updates = []
    for step, batch in enumerate(batches, start=1):
        before = _params(engine)
        timer.start()
        outcome = train_step(engine, loss_fn, _split(batch, k), step, device, torch.float32, timer)
        settled = outcome.read()
        assert settled.skipped is None and not settled.stop_signalled
        after = _params(engine)
        updates.append({n: before[n] - after[n] for n in before})  # SGD, lr 1: the gradient
    assert set(timer.read()) >= {"forward", "loss", "backward", "step"}
    return updates, float(outcome.result["loss"].detach())


def _losses():
    from vlcontrast.losses import LOSSES

    return sorted(LOSSES) + ["fastclip-individual"]


VARIANTS = {"fastclip-individual": ("fastclip", {"temperature": "individual", "tau_lr": 0.01})}


@pytest.mark.parametrize("name", _losses())
def test_accumulated_micro_batches_give_the_large_batch_gradient(name, process_group, tiny_models):
    from vlcontrast.losses import build_loss

    name, options = VARIANTS.get(name, (name, {}))
    model = tiny_models[name == "siglip"]
    # DeCL: two steps, so its alternating schedule and its buffer move between them.
    buffered = name in ("decl", "sogclr", "fastclip")
    batches = [_batch(seed) for seed in ((1, 2) if buffered else (1,))]
    losses = {k: build_loss(name, id_space=1000, **options).to(rank_device()) for k in (1, K)}
    grads = {}
    for k, loss_fn in losses.items():
        grads[k], final_loss = _run(_engine(model, BATCH // k, k), loss_fn, batches, k)
        assert torch.isfinite(torch.tensor(final_loss))
    for step in range(len(batches)):
        large, accumulated = grads[1][step], grads[K][step]
        norm = max(float(g.abs().max()) for g in large.values())
        assert norm > 0, f"{name}: no gradient at step {step + 1}"
        for param in large:
            torch.testing.assert_close(accumulated[param], large[param], rtol=1e-3,
                                       atol=1e-5 * norm, msg=f"{name} step {step + 1} {param}")
    if buffered:
        # The buffer advanced once per optimizer step: every id of both steps written once,
        # with the values the large batch wrote.
        assert int(losses[K].visited) == int(losses[1].visited) == 2 * BATCH
        torch.testing.assert_close(losses[K].log_u, losses[1].log_u, rtol=1e-4, atol=1e-6)
