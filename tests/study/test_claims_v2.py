"""The prose of ``docs/loss-study.md``'s "What the results say" (study v2) is what the committed
final cells say.

The generated blocks are checked in ``test_findings.py``; the hand-written interpretation quotes
no number of its own, so each of its statements is checked here as a statement: which comparisons
survive Holm–Bonferroni and where, which trainings learn, how batch size compares with the loss,
zero-shot against the starting checkpoints, and the measured gradient bias against the gains.
A changed cell that breaks a statement fails here, naming it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vlcontrast.study import load_study_config, report_v2
from vlcontrast.study.design import read_selected
from vlcontrast.study.stats import mean_interval

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "loss-study.md"
R1, ZS = "mean_R@1", "zeroshot/top1"


@pytest.fixture(scope="module")
def final(request):
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.chdir(ROOT)  # the study config's paths are relative to the repository
    request.addfinalizer(monkeypatch.undo)
    config = load_study_config(ROOT / "configs" / "study" / "v2.yaml")
    results = report_v2.final_results(config)
    if len(results.rows) < len(results.planned):
        pytest.fail(f"{len(results.rows)} of {len(results.planned)} final cells: the prose "
                    "describes the finished study")
    return config, results


def _survivors(results, sign):
    return {(t.dataset, t.arms, t.candidate, t.baseline, t.global_batch)
            for t in results.family if t.survives and sign * t.result.difference.mean > 0}


def test_the_section_is_on_the_page():
    text = DOC.read_text()
    assert "### What the results say" in text and "tests/study/test_claims_v2.py" in text


def test_equal_steps_only_siglip_at_32_on_clipart_is_better(final):
    _, results = final
    better = _survivors(results, +1)
    # arms == ("steps", "samples") is B = 256, trained once for both arms
    in_steps = {s for s in better if "steps" in s[1]}
    assert in_steps == {("clipart", ("steps",), "siglip", "infonce", 32)}


def test_every_gain_is_at_16_or_32_and_the_compute_matched_ones_carry_an_estimate(final):
    _, results = final
    better = _survivors(results, +1)
    assert {s[4] for s in better} <= {16, 32}
    in_samples = {(d, c, b, size) for d, arms, c, b, size in better if arms == ("samples",)}
    assert in_samples == {
        ("synthetic", "decl", "infonce", 16), ("clipart", "decl", "infonce", 16),
        ("synthetic", "decl", "infonce", 32), ("synthetic", "sogclr", "infonce", 32),
        ("clipart", "decl", "dcl", 16),  # DeCL beats DCL: the buffer helps, not decoupling
    }
    assert not any(c.startswith("fastclip") for _, _, c, _, _ in better)


def test_from_64_up_nothing_beats_infonce_and_these_are_worse(final):
    _, results = final
    assert not any(size >= 64 for *_, size in _survivors(results, +1))
    worse = _survivors(results, -1)
    assert worse == {("clipart", ("samples",), "siglip", "infonce", 64),
                     ("clipart", ("samples",), "siglip", "infonce", 1024),
                     ("clipart", ("steps",), "debiased", "infonce", 1024),
                     ("synthetic", ("samples",), "fastclip-individual", "infonce", 1024)}
    config, _ = final
    # "the arm's shortest training": B = 1024 is the samples arm's fewest steps
    steps = {size: n for size, n in report_v2.arm_sizes(config, "samples")}
    assert min(steps, key=steps.get) == 1024


def _learns(config, results, dataset, arm):
    out = {}
    for setting in config.grid.losses:
        for size, _ in report_v2.arm_sizes(config, arm):
            interval = report_v2.gain_over_start(config, results.rows, dataset, arm, setting, size)
            out[(setting, size)] = interval
    return out


def test_learns_check_as_the_prose_says(final):
    config, results = final
    for dataset in config.datasets:
        steps = _learns(config, results, dataset, "steps")
        failing = [key for key, iv in steps.items() if iv.low <= 0]
        assert all(size <= 64 for _, size in failing), (dataset, failing)
        samples = _learns(config, results, dataset, "samples")
        failing = [key for key, iv in samples.items() if iv.low <= 0]
        assert all(size <= 32 or size == 1024 for _, size in failing), (dataset, failing)
        assert len(failing) < len(samples) / 2  # "most trainings learn"
    # synthetic, steps arm: most trainings at B <= 64 do not learn, and some end below the start
    steps = _learns(config, results, "synthetic", "steps")
    small = {key: iv for key, iv in steps.items() if key[1] <= 64}
    assert sum(iv.low <= 0 for iv in small.values()) > len(small) / 2
    assert any(iv.mean < 0 for iv in small.values())


def _mean(values_by_seed):
    return sum(values_by_seed.values()) / len(values_by_seed)


def test_batch_size_moves_r1_more_than_the_loss(final):
    config, results = final
    sizes = config.grid.global_batch_sizes
    for dataset in config.datasets:
        rise = {}
        for arm in config.arms:
            data = report_v2.values(results.rows, dataset, arm, R1)
            rise[arm] = _mean(data[("infonce", max(sizes))]) - _mean(data[("infonce", min(sizes))])
        largest_gain = max(t.result.difference.mean for t in results.family
                           if t.dataset == dataset and t.baseline == "infonce")
        assert rise["steps"] > largest_gain > 0, dataset


def _zero_shot_gains(config, results, dataset):
    out = {}
    for row in results.rows:
        if row["dataset"] != dataset:
            continue
        start = report_v2.start_metrics(config, dataset, row["start"], ZS)
        for arm in row["arms"]:
            key = (arm, row["setting"], row["global_batch"])
            out.setdefault(key, []).append(row[ZS] - start)
    return {key: mean_interval(gains) for key, gains in out.items()}


def test_zero_shot_against_the_starts(final):
    config, results = final
    clipart = _zero_shot_gains(config, results, "clipart")
    assert not any(iv.low > 0 for iv in clipart.values())  # none ends above its start
    assert any(iv.high < 0 for iv in clipart.values())  # "a few end below it"
    assert sum(iv.high < 0 for iv in clipart.values()) < len(clipart) / 4
    synthetic = _zero_shot_gains(config, results, "synthetic")
    assert sum(iv.low > 0 for iv in synthetic.values()) > len(synthetic) / 4  # "many do"


def test_the_bias_does_not_predict_the_gains(final):
    config, results = final
    bias = {d: report_v2.read_bias(report_v2.bias_csvs(config, d)) for d in config.datasets}
    # DeCL's gains at B = 16 on both datasets; its buffer step is more biased than InfoNCE on
    # the synthetic start and less on the clip-art start
    assert {d for d, _, c, b, size in _survivors(results, +1)
            if (c, b, size) == ("decl", "infonce", 16)} == {"synthetic", "clipart"}
    assert bias["synthetic"][("decl_loss1", 16)] > bias["synthetic"][("infonce", 16)]
    assert bias["clipart"][("decl_loss1", 16)] < bias["clipart"][("infonce", 16)]
    # at B = 1024 the two largest are SigLIP and debiased at its tuned tau_plus (several times
    # InfoNCE's); FastCLIP's estimator is low there
    for dataset in config.datasets:
        at_1024 = {name: value for (name, size), value in bias[dataset].items() if size == 1024}
        assert sorted(at_1024, key=at_1024.get)[-2:] in (["debiased", "siglip"],
                                                         ["siglip", "debiased"])
        assert at_1024["debiased"] > 5 * at_1024["infonce"]
        assert at_1024["fastclip"] < at_1024["infonce"]
    # the figure's debiased row is the one measured at the tau_plus its tuning chose
    run = (ROOT / "results" / "loss-study-v2" / "gradient-bias" / "run.sh").read_text()
    assert "--losses debiased --option debiased.tau_plus=0.01 --out $out/tuned-debiased" in run
    for dataset in config.datasets:
        paths = [str(path) for path in report_v2.bias_csvs(config, dataset)]
        assert paths[-1].endswith("tuned-debiased/gradient_bias.csv")  # read last: it wins
    selected = read_selected(config)
    chosen = [choice["options"]["tau_plus"] for name, choice in selected["chosen"].items()
              if "/debiased/b1024/" in name]
    assert chosen and set(chosen) == {0.01}  # "the τ⁺ its tuning chose" at B = 1024


def test_only_the_siglip_win_has_a_learning_rate_at_an_edge(final):
    config, results = final
    chosen = read_selected(config)["chosen"]
    at_edge = set()
    for t in results.family:
        if t.survives:
            for setting in (t.candidate, t.baseline):
                if chosen[f"{t.dataset}/{setting}/b{t.global_batch}/n{t.steps}"]["lr_at_edge"]:
                    at_edge.add((t.dataset, setting, t.global_batch, t.steps))
    assert at_edge == {("clipart", "siglip", 32, 500)}
    siglip = chosen["clipart/siglip/b32/n500"]
    assert siglip["lr_factor"] == min(map(float, siglip["lr_candidates"]))  # the smallest tried
