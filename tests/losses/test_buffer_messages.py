"""The losses built on DeCL's per-sample buffer (``decl``, ``sogclr``, ``fastclip``) say, in one
line, which loss needs what and how to pass it: they all said ``decl: estimator 'buffer' needs
sample_ids`` and ``build_loss('decl', id_space=...)``, whichever loss the user had built."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlcontrast.losses import build_loss


def features(n: int = 8, d: int = 16):
    generator = torch.Generator().manual_seed(0)
    return (F.normalize(torch.randn(n, d, generator=generator), dim=-1),
            F.normalize(torch.randn(n, d, generator=generator), dim=-1), torch.tensor(14.0))


@pytest.mark.parametrize("name", ["decl", "sogclr", "fastclip"])
def test_buffer_errors_name_the_loss_and_the_argument(name):
    image, text, scale = features()
    cases = [
        (dict(id_space=64), dict(step=1),
         rf"^{name}: its per-sample buffer needs the batch's dataset ids: call the loss with "
         r"sample_ids="),
        (dict(), dict(sample_ids=torch.arange(8), step=1),
         rf"^{name}: its per-sample buffer needs id_space > 0 .*build_loss\('{name}', "
         r"id_space="),
        (dict(id_space=4), dict(sample_ids=torch.arange(8), step=1),
         rf"^{name}: a sample id is outside the declared id space \[0, 4\); build the loss with "
         r"the dataset's id_space="),
        (dict(id_space=64), dict(sample_ids=torch.arange(4), step=1),
         rf"^{name}: 4 sample_ids for 8 pairs; give sample_ids= one id per pair"),
    ]
    for built, called, pattern in cases:
        with pytest.raises(ValueError, match=pattern) as err:
            build_loss(name, **built)(image, text, scale, **called)
        assert "\n" not in str(err.value)


def test_a_zero_step_says_steps_are_one_based():
    image, text, scale = features()
    loss = build_loss("decl", id_space=64, schedule="weighted")
    with pytest.raises(ValueError, match=r"^decl: step is 1-based \(the optimizer step, starting "
                                         r"at 1\), got step=0$"):
        loss(image, text, scale, sample_ids=torch.arange(8), step=0)


def test_the_guide_says_step_is_one_based_at_its_first_snippet():
    """docs/losses-guide.md's first snippet passes step=step; that step counts from 1 is said
    next to it, not 100 lines further down."""
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[2] / "docs" / "losses-guide.md").read_text()
    snippet = guide.index("step=step)")
    near = guide[snippet:guide.index("\n## ", snippet)]
    assert "1-based" in near
