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
