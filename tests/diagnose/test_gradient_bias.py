"""The gradient-bias diagnostic on cases whose answer is known.

Features are random unit vectors (positives correlated with their anchors) so every case runs in
a second or two; the parameter-gradient and end-to-end tests use a tiny open_clip model.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.nn import functional as F

from vlcontrast.diagnose.estimators import (BufferEstimator, Features, expand_losses,
                                            full_log_means)
from vlcontrast.diagnose.montecarlo import (DETECTION_FACTOR, compare, estimate_cell,
                                            replicate_count)

ALL_LOSSES = ("infonce", "dcl", "dclw", "decl", "debiased", "siglip", "sogclr", "fastclip")


def random_features(size: int, dim: int = 8, scale: float = 5.0, noise: float = 0.8,
                    seed: int = 0) -> Features:
    generator = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(size, dim, generator=generator, dtype=torch.float64), dim=1)
    text = F.normalize(image + noise * torch.randn(size, dim, generator=generator,
                                                   dtype=torch.float64), dim=1)
    return Features(image, text, torch.tensor(scale, dtype=torch.float64),
                    torch.tensor(-3.0, dtype=torch.float64))


def measure(estimator, features, batch_size, replicates, seed=0):
    target = estimator.full_gradient(features)
    cell = estimate_cell(estimator, features, batch_size, replicates=replicates, seed=seed)
    return compare(cell.mean, target, cell.mc_variance, cell.batch_variance), cell


def test_full_batch_has_no_bias_for_every_loss():
    """At B = N the batch is the data: every estimator, DeCL's buffers included, gives g_N."""
    features = random_features(40)
    estimators = expand_losses(ALL_LOSSES, 40, chunk_size=16)  # g_N through the chunked losses
    assert [e.name for e in estimators] == ["infonce", "dcl", "dclw", "decl_loss1",
                                            "decl_loss1_fixed", "decl_loss2", "debiased",
                                            "siglip", "siglip_rescaled", "sogclr", "fastclip"]
    for estimator in estimators:
        statistics, cell = measure(estimator, features, 40, replicates=2)
        # float64 features; DeCL keeps log u in float32, hence the looser bound.
        assert statistics.relative_bias < 1e-6, estimator.name
        assert statistics.cosine == pytest.approx(1.0, abs=1e-9), estimator.name
        assert not statistics.detected, estimator.name
        assert statistics.relative_mc_error < 1e-6, estimator.name


def test_infonce_bias_shrinks_as_the_batch_grows():
    features = random_features(96)
    infonce = expand_losses(["infonce"], 96, chunk_size=0)[0]
    biases = []
    for batch_size in (4, 12, 48):
        statistics, _ = measure(infonce, features, batch_size,
                                replicates=replicate_count(96, batch_size, 64, 8, 1))
        assert statistics.detected or batch_size == 48, batch_size
        biases.append(statistics.relative_bias)
    assert biases[0] > biases[1] > biases[2] > 0
    # The bias is the dominant error at small B: the direction itself is off.
    assert biases[0] > 0.2


def test_decl_with_converged_buffer_is_unbiased():
    """Given U = 1/m (the buffer's fixed point), DeCL's loss_1 is decomposable: its batch
    gradient is unbiased, while InfoNCE's is clearly biased at the same small B."""
    features = random_features(32, scale=4.0)
    estimators = {e.name: e for e in expand_losses(["infonce", "decl"], 32, chunk_size=0)}
    infonce, _ = measure(estimators["infonce"], features, 8, replicates=16)
    decl, _ = measure(estimators["decl_loss1_fixed"], features, 8, replicates=48)
    assert infonce.detected
    assert not decl.detected
    assert decl.relative_bias <= DETECTION_FACTOR * decl.relative_mc_error
    assert decl.relative_bias_corrected < infonce.relative_bias / 4
    assert decl.relative_mc_error < infonce.relative_bias / 2  # the check could have seen it


def test_decl_buffer_reaches_its_fixed_point():
    features = random_features(32)
    live = expand_losses(["decl"], 32, chunk_size=0)[0]
    assert isinstance(live, BufferEstimator) and not live.fixed
    assert live.warmup_epochs(0.9) == 6 and live.warmup_epochs(1.0) == 1
    assert 0.5 ** live.warmup_epochs(0.5) < 1e-6 <= 0.5 ** (live.warmup_epochs(0.5) - 1)
    assert live.decorrelation_epochs(0.9) == 0 and live.decorrelation_epochs(0.5) == 3
    info = live.begin(features, 32, torch.Generator().manual_seed(0))  # B = N: deterministic
    assert info["buffer_log_error"] < 1e-6
    reference = full_log_means(features, chunk_size=7)
    assert torch.allclose(live.loss.log_u.double(), reference, atol=1e-6)
    # At a small batch the steady state is noisy, and centred on the fixed point.
    info = live.begin(features, 4, torch.Generator().manual_seed(0))
    assert info["buffer_log_error"] > 1e-3


def test_sogclr_and_fastclip_rows_are_buffer_estimators_measured_at_a_fixed_state():
    """SogCLR's and FastCLIP's moving average is warmed to its steady state like DeCL's. With
    gamma = 1 the average is the batch itself and the batch gradient is tau times DCL's (an
    independent implementation; the global objective is tau log g); FastCLIP's temperature modes and cosine schedule reduce to a fixed
    temperature and the floor gamma, which is SogCLR's gradient at that gamma."""
    features = random_features(32)
    indices = torch.tensor([3, 7, 11, 19, 25, 30])
    dcl = expand_losses(["dcl"], 32, chunk_size=0)[0]
    tau = 1 / float(features.logit_scale)
    options = {"sogclr": {"gamma": 1.0}, "fastclip": {"gamma": 1.0}}
    for row in expand_losses(["sogclr", "fastclip"], 32, chunk_size=0, options=options):
        assert isinstance(row, BufferEstimator) and not row.fixed and row.name in options
        row.begin(features, 8, torch.Generator().manual_seed(0))
        assert torch.allclose(row.batch_gradient(features, indices),
                              tau * dcl.batch_gradient(features, indices), atol=1e-6), row.name
    sogclr, fastclip = expand_losses(
        ["sogclr", "fastclip"], 32, chunk_size=0,
        options={"sogclr": {"gamma": 0.5}, "fastclip": {"gamma": 0.5, "temperature": "individual",
                                                         "gamma_schedule": "cosine",
                                                         "gamma_decay_steps": 100}})
    assert (fastclip.loss.temperature, fastclip.loss.gamma_schedule) == ("fixed", "constant")
    for row in (sogclr, fastclip):
        info = row.begin(features, 32, torch.Generator().manual_seed(0))  # B = N: u = m exactly
        assert info["warmup_epochs"] == row.warmup_epochs(0.5) and info["buffer_log_error"] < 1e-6
        row.begin(features, 8, torch.Generator().manual_seed(1))
    assert torch.allclose(sogclr.loss.log_u, fastclip.loss.log_u)
    assert torch.allclose(sogclr.batch_gradient(features, indices),
                          fastclip.batch_gradient(features, indices), atol=1e-9)
    # the full-data target is the global objective's gradient: tau times DCL's over all N
    assert torch.allclose(sogclr.full_gradient(features), tau * dcl.full_gradient(features),
                          atol=1e-6)


def test_statistics_and_detection_rule():
    target = torch.tensor([3.0, 4.0])
    exact = compare(target.clone(), target, mc_variance=0.0, batch_variance=2.5)
    assert exact.relative_bias == 0 and not exact.detected and exact.cosine == pytest.approx(1)
    assert exact.relative_variance == pytest.approx(0.1)
    biased = compare(target + torch.tensor([0.0, 1.0]), target, mc_variance=0.04,
                     batch_variance=0.0)
    assert biased.relative_bias == pytest.approx(0.2) and biased.detected
    assert biased.relative_mc_error == pytest.approx(0.04)
    assert biased.relative_bias_corrected == pytest.approx(math.sqrt(1 - 0.04) / 5)
    noisy = compare(target + torch.tensor([0.0, 1.0]), target, mc_variance=0.5,
                    batch_variance=0.0)
    assert not noisy.detected  # 0.2 < 2 * sqrt(0.5) / 5


def test_batch_sizes_outside_the_data_are_rejected():
    features = random_features(8)
    infonce = expand_losses(["infonce"], 8, chunk_size=0)[0]
    with pytest.raises(ValueError, match="batch size 9"):
        estimate_cell(infonce, features, 9, replicates=2)
    with pytest.raises(ValueError, match="unknown loss 'nope'"):
        expand_losses(["nope"], 8, chunk_size=0)
    with pytest.raises(ValueError, match="not in losses"):
        expand_losses(["infonce"], 8, chunk_size=0, options={"decl": {"gamma": 0.5}})


# ------------------------------------------------------------------- through the towers (tiny model)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.evaluation.helpers import tiny_model

    return tiny_model(tmp_path_factory.mktemp("configs"), seed=0)


def test_parameter_gradient_equals_autograd_through_the_model(tiny):
    """Pushing g_N back through the towers in chunks == autograd of the loss on the model."""
    from vlcontrast.diagnose.gradient_bias import compute_features
    from vlcontrast.diagnose.pushback import TowerPushback, encode_pairs, tower_parameters
    from vlcontrast.losses import build_loss

    model, _, tokenizer = tiny
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(20, 3, 32, 32, generator=generator)
    tokens = tokenizer([f"a photo of thing {i} number {i * 7 % 5}" for i in range(20)])
    features = compute_features(model, images, tokens, chunk_size=8, dtype=torch.float32)
    estimator = expand_losses(["dcl"], 20, chunk_size=6)[0]
    target = estimator.full_gradient(features)
    pushback = TowerPushback(model, images, tokens, chunk_size=7)
    pushed = pushback.push_full([target])[0]

    names = [name for name, _ in tower_parameters(model)]
    assert "logit_scale" not in names
    parameters = [p for _, p in tower_parameters(model)]
    image, text = encode_pairs(model, images, tokens)
    loss = build_loss("dcl")(image, text, model.logit_scale.exp().detach())["loss"]
    reference = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, parameters)])
    assert torch.allclose(pushed.float(), reference, rtol=1e-4, atol=1e-6)

    # A batch's gradient lives on its rows only: pushing those rows alone gives the same. The
    # towers run in float32 on chunks of other sizes (3 rows against 7), so the sums differ in
    # their last bits (seen: 3e-5 relative on an entry of 3e-4); a wrong row would differ by O(1).
    rows = torch.tensor([3, 11, 17])
    full = torch.zeros_like(target)
    full[rows] = target[rows]
    assert torch.allclose(pushback.push(rows, [target[rows]])[0], pushback.push_full([full])[0],
                          rtol=1e-4, atol=1e-6)


def test_cli_writes_the_report(tiny, tmp_path, capsys):
    from tests.evaluation.helpers import write_clip_benchmark_wds, write_fake_checkpoint
    from vlcontrast.cli import main

    run = tmp_path / "run"
    write_fake_checkpoint(run, tiny[0])
    write_clip_benchmark_wds(tmp_path / "data", num_samples=20, per_shard=8, task="retrieval")
    out = tmp_path / "out"
    args = ["diagnose", "gradient-bias", "--checkpoint", str(run), "--data",
            str(tmp_path / "data"), "--losses", "infonce,decl", "--batch-sizes", "4,16",
            "--num-samples", "16", "--batches-per-size", "4", "--min-replicates", "2",
            "--parameter-groups", "2", "--parameter-batches", "2", "--chunk-size", "10",
            "--option", "decl.gamma=0.5", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out  # the table on the console too, then where it was written
    assert "| infonce | 4 |" in printed and printed.strip().splitlines()[-1].startswith(
        "gradient-bias: 8 rows in ")
    report = json.loads((out / "gradient_bias.json").read_text())
    assert report["num_samples"] == 16 and report["decl_gamma"] == 0.5
    # IEEE fp32 and deterministic cuDNN, set before anything is computed and recorded
    assert report["numerics"] == {"float32_matmul_precision": "highest",
                                  "cudnn_allow_tf32": False, "cudnn_deterministic": True,
                                  "cudnn_benchmark": False}
    rows = report["rows"]
    assert [(r["estimator"], r["batch_size"]) for r in rows] == [
        (name, size) for name in ("infonce", "decl_loss1", "decl_loss1_fixed", "decl_loss2")
        for size in (4, 16)]
    for row in rows:
        if row["batch_size"] == 16:
            assert row["feature_relative_bias"] < 1e-6 and row["parameter_relative_bias"] < 1e-5
        assert row["replicates"] % 2 == 0
    assert (out / "gradient_bias.png").stat().st_size > 1000
    assert "| infonce | 4 |" in (out / "gradient_bias.md").read_text()
    assert (out / "gradient_bias.csv").read_text().count("\n") == len(rows) + 1

    assert main(args[:-2] + ["--batch-sizes", "4,17", "--out", str(out)]) == 2
    assert "17 is outside [2, --num-samples=16]" in capsys.readouterr().err
    assert main(args[:-2] + ["--batch-sizes", "4,abc", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        "vlcontrast: error: --batch-sizes '4,abc': 'abc' is not a whole number; give sizes such "
        "as 16,32,64")

    # A second run into the same --out is refused (what is there, and the fixes) ...
    assert main(args + ["--seed", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"vlcontrast: error: --out {str(out)!r} exists (gradient-bias of "
                          f"{report['checkpoint']!r}, 8 rows, made "), err
    assert err.endswith("add --overwrite to replace it, or name a new folder"), err
    assert json.loads((out / "gradient_bias.json").read_text())["settings"]["seed"] == 0
    # ... and --overwrite replaces the earlier result.
    assert main(args + ["--seed", "1", "--overwrite"]) == 0
    replaced = json.loads((out / "gradient_bias.json").read_text())
    assert replaced["settings"]["seed"] == 1 and replaced["settings"]["overwrite"] is True


def test_lock_image_pushes_back_through_the_text_tower_only(tiny, tmp_path):
    """--lock-image measures the parameter gradient a locked-image run trains: the text tower's
    parameters only, all of them, and the bias is still measured there."""
    from tests.evaluation.helpers import write_clip_benchmark_wds, write_fake_checkpoint
    from vlcontrast.cli import main
    from vlcontrast.diagnose.pushback import NON_TOWER_PARAMETERS

    run = tmp_path / "run"
    write_fake_checkpoint(run, tiny[0])
    write_clip_benchmark_wds(tmp_path / "data", num_samples=20, per_shard=8, task="retrieval")
    reports = {}
    for lock in (False, True):
        out = tmp_path / f"out-{lock}"
        assert main(["diagnose", "gradient-bias", "--checkpoint", str(run), "--data",
                     str(tmp_path / "data"), "--losses", "sogclr", "--batch-sizes", "4",
                     "--num-samples", "16", "--batches-per-size", "4", "--min-replicates", "2",
                     "--parameter-groups", "2", "--parameter-batches", "2", "--chunk-size", "10",
                     "--out", str(out)] + (["--lock-image"] if lock else [])) == 0
        reports[lock] = json.loads((out / "gradient_bias.json").read_text())
    text = sum(p.numel() for name, p in tiny[0].named_parameters()
               if not name.startswith("visual.") and name not in NON_TOWER_PARAMETERS)
    assert reports[True]["tower_parameters"] == text < reports[False]["tower_parameters"]
    assert reports[True]["settings"]["lock_image"] is True
    assert reports[True]["buffer_gamma"] == {"sogclr": 0.9}
    locked, both = reports[True]["rows"][0], reports[False]["rows"][0]
    assert locked["feature_relative_bias"] == both["feature_relative_bias"]  # same draws
    assert locked["parameter_relative_bias"] != both["parameter_relative_bias"] > 0


def test_the_fast_clip_recipe_is_a_one_line_error_naming_the_fix():
    """fast_clip's recipe follows the data epoch (gamma 1 in the first); the diagnostic has no
    epochs, so it says what to pass instead of stopping inside the loss."""
    from vlcontrast.diagnose.estimators import expand_losses

    for name in ("sogclr", "fastclip"):
        with pytest.raises(ValueError, match=rf"^{name}: recipe='fast_clip' .*pass {name}.gamma"):
            expand_losses([name], 32, chunk_size=0, options={name: {"recipe": "fast_clip"}})
