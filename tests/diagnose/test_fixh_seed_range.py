"""The gradient-bias diagnostic's ``seed`` range: ``seed * 1000003 + B`` seeds a 64-bit generator.

A large seed overflowed it (``ValueError: Overflow when unpacking long long`` from inside
``estimate_cell``, after the checkpoint and features were computed) and a negative one wrapped
around to another seed's draws. Like DeCL's ``seed``, it must be in ``[0, 2**43 - 1]``.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from vlcontrast.diagnose.estimators import Features, expand_losses
from vlcontrast.diagnose.montecarlo import SEED_RANGE, check_seed, estimate_cell
from vlcontrast.errors import ConfigError
from vlcontrast.losses.decl import SEED_RANGE as DECL_SEED_RANGE


def features(size=12, dim=4):
    generator = torch.Generator().manual_seed(0)
    image = F.normalize(torch.randn(size, dim, generator=generator, dtype=torch.float64), dim=1)
    text = F.normalize(image + torch.randn(size, dim, generator=generator, dtype=torch.float64),
                       dim=1)
    return Features(image, text, torch.tensor(5.0, dtype=torch.float64),
                    torch.tensor(-3.0, dtype=torch.float64))


def test_the_range_tops_out_where_decls_does():
    # the same stride, so the same largest seed; diagnose takes no negative seeds (DeCL keeps
    # them for runs that used them)
    assert SEED_RANGE == (0, 2**43 - 1)
    assert DECL_SEED_RANGE == (-2**43, 2**43 - 1)


@pytest.mark.parametrize("seed", [-1, 2**43, 2**62, 2**70])
def test_estimate_cell_refuses_a_seed_outside_the_range(seed):
    infonce = expand_losses(["infonce"], 12, chunk_size=0)[0]
    with pytest.raises(ConfigError) as error:
        estimate_cell(infonce, features(), 4, replicates=2, seed=seed)
    message = str(error.value)
    assert message.startswith("seed must be an integer in [0, 2**43 - 1 = 8796093022207]")
    assert message.endswith(f"got {seed}") and "\n" not in message


def test_the_largest_seed_draws():
    infonce = expand_losses(["infonce"], 12, chunk_size=0)[0]
    cells = [estimate_cell(infonce, features(), 4, replicates=2, seed=seed)
             for seed in (SEED_RANGE[1], SEED_RANGE[1] - 1)]
    assert not torch.equal(cells[0].mean, cells[1].mean)  # different seeds, different draws


def test_the_command_line_names_its_flag():
    with pytest.raises(ConfigError, match=r"^--seed must be an integer .* got -5$"):
        check_seed(-5, flags=True)
    for bad in (1.5, True, "3"):
        with pytest.raises(ConfigError, match="^seed must be an integer"):
            check_seed(bad)
    check_seed(0)


def test_the_settings_check_refuses_the_seed_before_anything_is_loaded(tmp_path):
    """``GradientBiasSettings.validate`` (run before the checkpoint is read) names the seed."""
    from vlcontrast.diagnose import GradientBiasSettings
    from vlcontrast.errors import ConfigError

    settings = GradientBiasSettings(checkpoint=str(tmp_path / "missing"), data=str(tmp_path),
                                    out=str(tmp_path / "out"), seed=2**60)
    with pytest.raises(ConfigError, match=r"^--seed must be an integer in \[0, 2\*\*43"):
        settings.validate(flags=True)
