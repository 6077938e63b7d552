"""The prose of ``docs/loss-study.md``'s "What the results say" and "what the tests and the tuning
rest on" (study v2), and the README's short reading, are what the committed cells say.

The generated blocks are checked in ``test_findings.py``. Each hand-written statement is checked
here as a statement, and each number it quotes is recomputed from the cells: which comparisons
survive Holm–Bonferroni and where, which trainings learn or end below their start, batch size
against the loss in each arm, zero-shot against the starts and chance, the start as the unit of
replication, the identical settings and the tuning's caveats, and the measured gradient bias
against the gains. A changed cell that breaks a statement fails here, naming it.
"""

from __future__ import annotations

import json
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


def _normal(text: str) -> str:
    """Markdown prose with its line breaks and emphasis taken out, for phrase matching."""
    return " ".join(text.replace("**", "").replace("*", "").split())


def _rise(config, results, dataset, arm):
    """InfoNCE's mean R@1 at the largest batch minus at the smallest, in one arm (points)."""
    sizes = config.grid.global_batch_sizes
    data = report_v2.values(results.rows, dataset, arm, R1)
    return 100 * (_mean(data[("infonce", max(sizes))]) - _mean(data[("infonce", min(sizes))]))


def _difference(results, dataset, candidate, baseline, size, arm):
    return next(t for t in results.family if t.dataset == dataset and t.candidate == candidate
                and t.baseline == baseline and t.global_batch == size and arm in t.arms)


def test_batch_size_against_the_loss_arm_by_arm(final):
    """"In the equal-steps arm, batch size moves R@1 more than the choice of loss" (+5.8, +5.0);
    "in the equal-samples arm ... similar amounts": +2.8 and +2.0 against DeCL's +2.5 and +4.0."""
    config, results = final
    text = _normal(DOC.read_text())
    quoted = {"synthetic": ("+5.8", "+2.8", "+2.5"), "clipart": ("+5.0", "+2.0", "+4.0")}
    for dataset in config.datasets:
        largest_gain = max(t.result.difference.mean for t in results.family
                           if t.dataset == dataset and t.baseline == "infonce")
        steps, samples = _rise(config, results, dataset, "steps"), _rise(config, results, dataset, "samples")
        assert steps > 100 * largest_gain > 0, dataset
        decl = 100 * _difference(results, dataset, "decl", "infonce", 16, "samples").result.difference.mean
        assert [f"{steps:+.1f}", f"{samples:+.1f}", f"{decl:+.1f}"] == list(quoted[dataset])
        for number in quoted[dataset]:
            assert number in text
    # on clip art the equal-samples rise is smaller than DeCL's gain at B = 16
    assert _rise(config, results, "clipart", "samples") < 100 * _difference(
        results, "clipart", "decl", "infonce", 16, "samples").result.difference.mean
    assert "In the equal-steps arm, batch size moves R@1 more than the choice of loss" in text
    assert "Batch size moves R@1 more than the choice of loss" not in text


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
    synthetic = _zero_shot_gains(config, results, "synthetic")
    assert sum(iv.low > 0 for iv in synthetic.values()) > len(synthetic) / 4  # "many do"


def test_clipart_zero_shot_is_at_chance_from_the_start_and_left_out(final):
    """"The three starts score 3.5–6.5% with 21 classes (chance 4.8%), and the final cells
    average 5.3%": the figure and tables leave it out, the synthetic world's keep it."""
    config, results = final
    starts = [100 * report_v2.start_metrics(config, "clipart", k, ZS) for k in range(3)]
    finals = [100 * row[ZS] for row in results.rows if row["dataset"] == "clipart"]
    chance = next(json.loads((config.results_path / f"{row['cell']}.json").read_text())
                  ["chance"][ZS] for row in results.rows if row["dataset"] == "clipart")
    text = _normal(DOC.read_text())
    assert f"{min(starts):.1f}–{max(starts):.1f}%" == "3.5–6.5%"
    assert f"{100 * chance:.1f}" == "4.8" and round(1 / chance) == 21
    assert "starts score 3.5–6.5% with 21 classes (chance 4.8%)" in text
    assert f"{sum(finals) / len(finals):.1f}" == "5.3" and "final cells average 5.3%" in text
    assert min(starts) < 100 * chance < max(starts)
    assert not report_v2.above_chance(config, "clipart", ZS)
    assert report_v2.above_chance(config, "synthetic", ZS)
    readme = _normal((ROOT / "README.md").read_text())
    assert "![R@1 against batch size, both arms, clip art]" in readme
    assert "zero-shot" not in readme[readme.index("In short"):readme.index("Findings per dataset")]
    # the unsupported explanation is gone
    assert "improves clip-art retrieval, not zero-shot classification" not in text


def test_at_batch_16_the_synthetic_trainings_end_below_their_start(final):
    """"In the steps arm at batch 16, 8 of the 9 losses end significantly below their own
    starting checkpoint (−1.3 to −2.2 points R@1); the ninth, SigLIP, does not end above it";
    with 8,000 steps "InfoNCE ends 0.93 points below its own starting checkpoint, while DeCL ends
    above its start"."""
    config, results = final
    text = _normal(DOC.read_text())
    steps = _learns(config, results, "synthetic", "steps")
    at_16 = {setting: iv for (setting, size), iv in steps.items() if size == 16}
    below = {s: iv for s, iv in at_16.items() if iv.high < 0}
    assert len(below) == 8 and len(at_16) == 9
    (ninth,) = set(at_16) - set(below)
    assert ninth == "siglip" and at_16[ninth].low <= 0
    means = [100 * iv.mean for iv in below.values()]
    assert (f"{max(means):.1f}", f"{min(means):.1f}") == ("-1.3", "-2.2")
    assert "8 of the 9 losses end significantly below their own starting checkpoint (−1.3 to −2.2 points R@1)" in text
    samples = _learns(config, results, "synthetic", "samples")
    assert f"{100 * samples[('infonce', 16)].mean:.2f}" == "-0.93" and samples[("infonce", 16)].high < 0
    assert samples[("decl", 16)].low > 0
    assert "InfoNCE ends 0.93 points below its own starting checkpoint" in text
    assert "barely move" not in text
    readme = _normal((ROOT / "README.md").read_text())
    assert "at batch 16 on the synthetic world it ends below its own start (as 8 of 9 losses do there at 500 steps)" in readme


def test_the_estimate_is_shown_to_help_on_clipart_only(final):
    """DeCL − DCL +3.9 (Holm 0.047) on clip art; on the synthetic world DCL gets +1.9 of DeCL's
    +2.5 and DeCL − DCL does not survive."""
    _, results = final
    text = _normal(DOC.read_text())
    clipart = _difference(results, "clipart", "decl", "dcl", 16, "samples")
    assert clipart.survives and f"{100 * clipart.result.difference.mean:+.1f}" == "+3.9"
    assert f"{clipart.holm_p:.3f}" == "0.047"
    assert "by +3.9 points (Holm p = 0.047)" in text
    synthetic_dcl = _difference(results, "synthetic", "dcl", "infonce", 16, "samples")
    synthetic_decl = _difference(results, "synthetic", "decl", "infonce", 16, "samples")
    assert f"{100 * synthetic_dcl.result.difference.mean:+.1f}" == "+1.9"
    assert f"{100 * synthetic_decl.result.difference.mean:+.1f}" == "+2.5"
    assert synthetic_dcl.result.difference.mean > synthetic_decl.result.difference.mean / 2  # "most"
    assert not _difference(results, "synthetic", "decl", "dcl", 16, "samples").survives
    assert "gains +1.9 over InfoNCE, most of DeCL's +2.5, and DeCL − DCL does not survive" in text
    assert "So there the buffer is what helps" not in text


def test_the_readme_names_the_regime_and_the_siglip_caveat(final):
    config, _ = final
    readme = _normal((ROOT / "README.md").read_text())
    short = readme[readme.index("In short"):]
    first = short[:short.index(". ")]
    assert "32–64 px with a locked image tower on these two datasets" in first
    assert "no loss beat InfoNCE" in first  # the recommendation, in the same sentence
    assert "only SigLIP beat it (batch 32, clip art), at the low edge of its extended lr sweep" in short
    siglip = read_selected(config)["chosen"]["clipart/siglip/b32/n500"]
    assert siglip["lr_at_edge"] and siglip["lr_factor"] == min(map(float, siglip["lr_candidates"]))
    assert "With the start as the unit of replication nothing survives the correction" in short
    assert "an audit's check on other images did not find DeCL's gain" in short


def test_with_the_start_as_the_unit_no_comparison_survives(final):
    config, results = final
    by_start = report_v2.tested_family_by_start(config, results.rows)
    assert len(by_start) == report_v2.planned_family_size(config)
    assert all(t.result.difference.n == config.starts.count for t in by_start)
    assert not any(t.survives for t in by_start)
    assert "no comparison survives the correction" in _normal(DOC.read_text())


def test_the_out_of_sample_check_is_worded_as_the_audits(final):
    text = _normal(DOC.read_text())
    assert "An independent audit of the study reports an out-of-sample check on other real images" in text
    assert "per-seed differences of +0.5, −3.2 and +4.0" in text
    assert "the numbers are its report, not a measurement of ours" in text


def test_what_the_tests_and_the_tuning_rest_on(final):
    """The caveats' prose: identical settings in the trainings shorter than one epoch, the build
    effect larger than a paired difference's spread, most lr choices won by less than it, and
    debiased tuned at tau_plus 0.1 but run at 0.01."""
    from vlcontrast.study import caveats
    from vlcontrast.study.design import reference_options, settings

    config, results = final
    text = _normal(DOC.read_text())
    same = caveats.identical_settings(config, results.rows)
    from vlcontrast.study.config import datasets

    train_pairs = datasets(config)["synthetic"].generate["train"]
    short = {(row["dataset"], row["global_batch"], row["steps"]) for row in results.rows
             if row["global_batch"] * row["steps"] < train_pairs and row["dataset"] == "synthetic"}
    assert set(same) == short == {("synthetic", 16, 500), ("synthetic", 32, 500)}
    assert train_pairs == 20000 and "fewer than the synthetic world's 20,000 training pairs" in text
    for pairs in same.values():
        assert sorted(pairs) == [("dcl", "decl"), ("sogclr", "fastclip-individual")]
    counts = caveats.repeated_tests(config, results.rows, results.family)
    assert {(t.candidate, t.baseline) for t in counts.degenerate} == {("decl", "dcl")}
    assert {(t.candidate, t.baseline) for t in counts.duplicates} == {
        ("decl", "infonce"), ("fastclip-individual", "infonce")}
    builds = caveats.build_counts(config, results.rows)
    tuning = caveats.tuning_counts(config, results.family)
    assert builds.same_build_pairs > 0 and builds.same_build_equal == builds.same_build_pairs
    assert max(map(abs, builds.cross_build)) > tuning.noise  # "by more than the spread"
    assert builds.lr_sweeps["clipart"][0] == builds.option_sweeps["clipart"][0] == 0
    assert builds.lr_sweeps["synthetic"][0] > builds.lr_sweeps["synthetic"][1] / 2  # "most"
    assert "The build alone moves validation R@1 by more than the spread of a paired difference" in text
    for dataset, (close, total) in tuning.close_lr.items():
        assert close > total / 2, dataset  # "most learning-rate choices"
    debiased = settings(config)["debiased"]
    assert reference_options(debiased)["tau_plus"] == 0.1
    assert tuning.off_reference["debiased"][0] > tuning.off_reference["debiased"][1] / 2
    chosen = read_selected(config)["chosen"]
    assert {e["options"]["tau_plus"] for k, e in chosen.items() if "/debiased/" in k
            and e["options"] != reference_options(debiased)} == {0.01}
    assert "debiased, for one, was tuned at τ⁺ = 0.1 and runs at τ⁺ = 0.01" in text


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
