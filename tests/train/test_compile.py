"""``train.compile=true``: DeepSpeed's ``engine.compile()`` (torch.compile, inductor) of the
towers gives the eager engine's loss and gradients; the eager path stays the reference."""

from __future__ import annotations

import pytest
import torch

from tests.train.test_gradcache import process_group  # noqa: F401 - the 1-process group fixture


def _engine_step(compiled: bool, batch):
    from vlcontrast.config import ModelConfig, load_config
    from vlcontrast.losses import build_loss
    from vlcontrast.models import build_model
    from vlcontrast.train.engine import build_engine

    torch.manual_seed(0)
    bundle = build_model(ModelConfig(name="vlc-micro"), device="cpu")
    config = load_config(None, ["data.batch_size=4", "train.steps=2",
                                f"train.compile={'true' if compiled else 'false'}"])
    engine, _ = build_engine(bundle.model, optim=config.optim, train=config.train,
                             deepspeed=config.deepspeed, micro_batch_size=4, total_steps=2,
                             world_size=1)
    engine.train()
    loss_fn = build_loss("infonce", id_space=4)
    images, texts = batch
    out = engine(images, texts)
    loss = loss_fn(out["image_features"], out["text_features"], out["logit_scale"])["loss"]
    engine.backward(loss)
    grads = {n: p.grad.detach().clone() for n, p in engine.module.named_parameters()
             if p.grad is not None}
    names = [n for n, _ in engine.module.named_parameters()]
    engine.destroy()
    return float(loss), grads, names


@pytest.mark.slow
def test_compiled_towers_give_the_eager_loss_and_gradients(process_group):
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randn(4, 3, 32, 32, generator=generator),
             torch.randint(1, 49407, (4, 16), generator=generator))
    eager_loss, eager_grads, eager_names = _engine_step(False, batch)
    compiled_loss, compiled_grads, compiled_names = _engine_step(True, batch)
    # Parameter names (and so checkpoints) are the eager model's.
    assert compiled_names == eager_names
    assert compiled_loss == pytest.approx(eager_loss, rel=1e-4)
    assert compiled_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-3, atol=1e-5)


MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def inductor_modes() -> dict[str, dict]:
    """torch.compile's mode -> the inductor options it sets (torch's own table)."""
    from torch._inductor import list_mode_options

    return {mode: list_mode_options(mode) for mode in MODES}


def test_compile_mode_reaches_torch_compile_under_both_engines(monkeypatch, process_group):
    """``train.compile_mode`` is handed to ``torch.compile`` (as DeepSpeed's ``compile_kwargs``
    or the torch engine's), and ``reduce-overhead`` marks the engine for CUDA graphs."""
    from vlcontrast.config import load_config
    from vlcontrast.train.engine import build_engine

    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, *args, **kwargs: seen.append((type(self).__name__, kwargs)))
    monkeypatch.setattr("deepspeed.runtime.engine.DeepSpeedEngine.compile",
                        lambda self, backend=None, compile_kwargs=None, **_: seen.append(
                            ("DeepSpeedEngine", compile_kwargs)))
    for kind in ("torch", "deepspeed"):
        for mode in MODES:
            config = load_config(None, ["data.train=x", "train.steps=2", "train.compile=true",
                                        f"train.compile_mode={mode}", f"train.engine={kind}"])
            engine, _ = build_engine(torch.nn.Linear(4, 2), optim=config.optim,
                                     train=config.train, deepspeed=config.deepspeed,
                                     micro_batch_size=2, total_steps=2, world_size=1)
            # inductor's own table says which modes record CUDA graphs
            assert engine.cudagraphs is bool(inductor_modes()[mode].get("triton.cudagraphs")), mode
    expected = [{} if mode == "default" else {"mode": mode} for mode in MODES]
    assert seen == [("Linear", k) for k in expected] + [("DeepSpeedEngine", k) for k in expected]


def test_cuda_graph_steps_are_marked_once_per_step(monkeypatch):
    """Under ``reduce-overhead`` each step tells the CUDA-graph trees that a new iteration begins
    (so the previous replay's outputs may be reused), once, before the forward."""
    from vlcontrast.config import ModelConfig, load_config
    from vlcontrast.losses import build_loss
    from vlcontrast.models import build_model
    from vlcontrast.train.engine import build_engine
    from vlcontrast.train.step import train_step
    from vlcontrast.train.steplog import StepTimer

    calls = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: calls.append("mark"))
    bundle = build_model(ModelConfig(name="vlc-micro"), device="cpu")
    config = load_config(None, ["data.train=x", "train.steps=2"])
    engine, _ = build_engine(bundle.model, optim=config.optim, train=config.train,
                             deepspeed=config.deepspeed, micro_batch_size=4, total_steps=2,
                             world_size=1)
    real_call = type(engine).__call__
    monkeypatch.setattr(type(engine), "__call__",
                        lambda self, *a, **k: (calls.append("forward"), real_call(self, *a, **k))[1])
    engine.cudagraphs = True
    loss_fn = build_loss("infonce", id_space=4)
    batch = (torch.randn(4, 3, 32, 32), torch.randint(1, 100, (4, 16)), torch.arange(4))
    for step in (1, 2):
        train_step(engine, loss_fn, [batch], step, torch.device("cpu"), torch.float32,
                   StepTimer(torch.device("cpu")))
    assert calls == ["mark", "forward", "mark", "forward"]
    engine.cudagraphs = False
    train_step(engine, loss_fn, [batch], 3, torch.device("cpu"), torch.float32,
               StepTimer(torch.device("cpu")))
    assert calls[-1] == "forward" and calls.count("mark") == 2


def test_cuda_graphs_with_gradcache_are_a_one_line_error():
    from vlcontrast.config import load_config
    from vlcontrast.errors import ConfigError

    for mode in ("reduce-overhead", "max-autotune"):  # both record CUDA graphs
        with pytest.raises(ConfigError, match=rf"train.compile_mode='{mode}': with "
                                              r"train.accum_steps=2: .*overwrites"):
            load_config(None, ["data.train=x", "train.steps=2", "train.compile=true",
                               "train.accum_steps=2", f"train.compile_mode={mode}"])
    load_config(None, ["data.train=x", "train.steps=2", "train.compile=true",
                       "train.accum_steps=2", "train.compile_mode=max-autotune-no-cudagraphs"])
    with pytest.raises(ConfigError, match="only with train.compile=true"):
        load_config(None, ["data.train=x", "train.steps=2", "train.compile_mode=max-autotune"])
