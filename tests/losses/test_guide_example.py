"""The "Write your own loss" example of docs/losses-guide.md, run as written.

The code block of that section is extracted from the markdown and executed, so the guide's
example is always a loss that works: it matches a direct formula, reduces to ``infonce`` at
margin 0, chunks, and is exact across two ranks.
"""

from __future__ import annotations

import math
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.losses import references
from vlcontrast import losses

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "losses-guide.md"
SCALE = 14.29


def guide_example_code() -> str:
    text = GUIDE.read_text(encoding="utf-8")
    section = text.split("## Write your own loss", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert len(blocks) == 1, "the section should hold exactly one python example"
    return blocks[0]


def load_example() -> dict:
    """Run the example as the module ``guide_example`` (dataclasses look their module up)."""
    module = types.ModuleType("guide_example")
    sys.modules[module.__name__] = module
    code = compile(guide_example_code(), str(GUIDE), "exec", dont_inherit=True)
    exec(code, module.__dict__)  # noqa: S102 - the project's own docs
    return module.__dict__


@pytest.fixture
def example(monkeypatch):
    from vlcontrast.losses import registry

    copy = dict(losses.LOSSES)  # the registration stays local (the registry's dict, both names)
    monkeypatch.setattr(registry, "LOSSES", copy)
    monkeypatch.setattr(losses, "LOSSES", copy)
    return load_example()


def direct_margin_loss(image, text, scale, margin):
    """Both directions of ``log(e^{s(c_ii - m)} + sum_{j != i} e^{L_ij}) - s(c_ii - m)``."""
    total = 0.0
    for anchors, candidates in ((image, text), (text, image)):
        logits = scale * anchors @ candidates.T
        logits = logits - torch.diag(torch.full((len(anchors),), margin, dtype=anchors.dtype) * scale)
        total = total + (torch.logsumexp(logits, 1) - logits.diagonal()).mean()
    return total / 2


def loss_and_grads(loss_fn, image, text, scale):
    image, text = image.clone().requires_grad_(), text.clone().requires_grad_()
    scale = torch.tensor(scale, dtype=image.dtype, requires_grad=True)
    loss = loss_fn(image, text, scale)
    loss = loss["loss"] if isinstance(loss, dict) else loss
    return (loss.detach(), *torch.autograd.grad(loss, (image, text, scale)))


def assert_all_close(first, second, **tolerances):
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, **tolerances)


def test_example_registers_and_builds(example):
    assert losses.LOSSES["margin_infonce"] is example["MarginInfoNCE"]
    assert losses.loss_option_defaults("margin_infonce") == {"margin": 0.1}
    with pytest.raises(ValueError, match="margin"):
        losses.build_loss("margin_infonce", margin=-1.0)
    with pytest.raises(ValueError, match="no option"):
        losses.build_loss("margin_infonce", gamma=0.5)
    losses.build_loss("margin_infonce", id_space=10)  # accepted, not passed on


def test_example_refusal_is_the_configs_one_line(example):
    """The guide's ``LossOptionError`` becomes the config's line naming ``loss.margin``."""
    from vlcontrast.config import ConfigError, load_config

    with pytest.raises(ConfigError) as caught:
        load_config(None, ["train.steps=1", "loss.name=margin_infonce", "loss.margin=3"]).check()
    assert str(caught.value) == ("loss.margin=3.0: must be in [0, 2) (loss.name=margin_infonce); "
                                 "set loss.margin to a value that meets this")


def test_example_matches_its_formula_and_chunks(example):
    image, text = references.random_pairs(10, 8, seed=4)
    expected = loss_and_grads(lambda i, t, s: direct_margin_loss(i, t, s, 0.3), image, text, SCALE)
    dense = loss_and_grads(losses.build_loss("margin_infonce", margin=0.3), image, text, SCALE)
    chunked = loss_and_grads(losses.build_loss("margin_infonce", margin=0.3, chunk_size=3),
                             image, text, SCALE)
    assert_all_close(dense, expected, rtol=1e-10, atol=1e-12)
    assert_all_close(chunked, expected, rtol=1e-10, atol=1e-12)
    infonce = loss_and_grads(losses.build_loss("infonce"), image, text, SCALE)
    at_zero = loss_and_grads(losses.build_loss("margin_infonce", margin=0.0), image, text, SCALE)
    assert_all_close(at_zero, infonce, rtol=1e-10, atol=1e-12)
    assert dense[0] > infonce[0]  # a margin makes the task harder
    assert math.isfinite(float(dense[0]))


def _two_rank_worker(rank, world_size, image, text):
    load_example()  # a fresh process: register the example there too
    local = slice(rank * 4, rank * 4 + 4)
    image = torch.from_numpy(image)[local].clone().requires_grad_()
    text = torch.from_numpy(text)[local].clone().requires_grad_()
    scale = torch.tensor(SCALE, dtype=torch.float64)
    loss = losses.build_loss("margin_infonce", margin=0.2, chunk_size=3)(image, text, scale)["loss"]
    loss.backward()
    return float(loss.detach()), image.grad.numpy(), text.grad.numpy()


@pytest.mark.slow
def test_example_is_exact_across_two_ranks(example):
    image, text = references.random_pairs(8, 6, seed=5)
    expected = loss_and_grads(losses.build_loss("margin_infonce", margin=0.2), image, text, SCALE)
    results = run_distributed(_two_rank_worker, 2, image.numpy(), text.numpy())
    assert sum(r[0] for r in results) / 2 == pytest.approx(float(expected[0]), rel=1e-10)
    image_grad = torch.cat([torch.from_numpy(r[1]) for r in results]) / 2
    text_grad = torch.cat([torch.from_numpy(r[2]) for r in results]) / 2
    torch.testing.assert_close(image_grad, expected[1])
    torch.testing.assert_close(text_grad, expected[2])
