"""The whole slice: synthetic shards -> 2-process DeepSpeed training -> evaluation -> run directory.

One real run with ``torchrun``-style launch (``vlcontrast train --nproc 2``) on a tiny model; the
checks are that the loss falls, retrieval is far above chance, the run directory is complete, and
that the verifier rejects a run whose loss is broken.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlcontrast.data.prep.synthetic import write_synthetic
from vlcontrast.verify import verify_results

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    write_synthetic(out, train=2400, val=200, seed=3, image_size=32, shard_size=300,
                    zeroshot_per_class=10, progress=False)
    return out


def _fresh_environment() -> dict[str, str]:
    """This process's environment without a rendezvous: a training run in this interpreter (an
    earlier test in the same worker) leaves its rank and port there while its process group still
    listens on that port; a run launched from here must choose its own."""
    from vlcontrast.cli.launch import INHERITED_RENDEZVOUS

    return {k: v for k, v in os.environ.items() if k not in INHERITED_RENDEZVOUS}


def _train(dataset, run_dir, *extra, nproc=2, timeout=600):
    env = dict(_fresh_environment(), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "vlcontrast.cli", "train", "--nproc", str(nproc),
           "--config", str(ROOT / "configs" / "demo.yaml"),
           f"output_dir={run_dir}", f"data.train={dataset}/train", f"data.val={dataset}/val",
           f"eval.zeroshot={dataset}/zeroshot", "model.name=vlc-micro", "data.batch_size=32",
           "data.workers=1", "train.steps=240", "train.log_every=20", "optim.lr=5e-3",
           "optim.warmup_steps=20", "checkpoint.every=120", "checkpoint.keep=2",
           "eval.batch_size=100", "loss.name=infonce",
           # The random crop, as in the library default (the demo trains without it): this tiny
           # model learns with it in 240 steps; the cache then holds decoded images and
           # exercises the two-rank path.
           "data.augment=true", "data.cache_mb=64", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


@pytest.mark.slow
def test_two_process_training_learns_and_writes_a_complete_run(dataset, tmp_path):
    run_dir = tmp_path / "run"
    proc = _train(dataset, run_dir)

    for name in ("config.yaml", "metrics.jsonl", "results.json", "report.md", "loss_curve.png"):
        assert (run_dir / name).is_file(), name
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == "step_00000240"
    for name in ("model.pt", "model_config.json", "trainer_state.pt", "rank_00000.pt",
                 "rank_00001.pt", "config.yaml", "engine"):
        assert (run_dir / "checkpoints" / latest / name).exists(), name
    assert (run_dir / "checkpoints" / "step_00000120").is_dir()

    # ZeRO 0 in fp32: train.engine=auto ran the torch engine, which writes no DeepSpeed config.
    assert json.loads((run_dir / "results.json").read_text())["engine"] == "torch"
    assert not (run_dir / "deepspeed.json").exists()

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(20, 241, 20))
    for key in ("samples_seen", "loss", "lr", "logit_scale", "samples_per_s", "time/forward"):
        assert key in train[-1], key
    assert train[-1]["samples_seen"] == 240 * 64
    # Each logged loss is one batch's (it swings by ±0.2 from step to step here), so the means of
    # the first and last three are compared. Across three sets of augmentation draws (the crop
    # keys of before and after data.decode=gpu, and a third) the fall was 0.63, 0.36 and 0.27.
    # The retrieval check below gates on learning as well.
    first = sum(r["loss"] for r in train[:3]) / 3
    last = sum(r["loss"] for r in train[-3:]) / 3
    assert last < first - 0.2, (first, last)

    metrics = json.loads((run_dir / "results.json").read_text())["metrics"]
    ok, rows = verify_results(metrics, min_ratio=3.0,
                              keys=("retrieval/text_to_image_R@5", "retrieval/image_to_text_R@5"))
    assert ok, rows
    assert "zeroshot/top1" in metrics and metrics["zeroshot/num_classes"] == 10
    assert "| metric | value |" in proc.stdout  # the results table is printed at the end
    report = (run_dir / "report.md").read_text()
    assert "loss_curve.png" in report and "retrieval/text_to_image_R@1" in report


def test_verifier_rejects_chance_level_results():
    chance_run = {"retrieval/text_to_image_R@1": 0.006, "retrieval/image_to_text_R@1": 0.004,
                  "retrieval/num_images": 200, "retrieval/num_texts": 200,
                  "zeroshot/top1": 0.13, "zeroshot/num_classes": 8}
    ok, rows = verify_results(chance_run)
    assert not ok
    assert rows[0]["chance"] == pytest.approx(1 / 200)
    good_run = dict(chance_run, **{"retrieval/text_to_image_R@1": 0.2,
                                   "retrieval/image_to_text_R@1": 0.2, "zeroshot/top1": 0.6})
    assert verify_results(good_run)[0]


BROKEN_LOSS_SCRIPT = """
import sys
import torch
import vlcontrast.losses as losses

class MisalignedInfoNCE(losses.LOSSES["infonce"]):
    # A plausible bug: captions paired with the wrong images (off by one).
    def forward(self, image_features, text_features, *args, **kwargs):
        return super().forward(image_features, torch.roll(text_features, 1, dims=0), *args, **kwargs)

losses.LOSSES["infonce"] = MisalignedInfoNCE
from vlcontrast.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_broken_loss_fails_verification(dataset, tmp_path):
    script = tmp_path / "broken.py"
    script.write_text(BROKEN_LOSS_SCRIPT)
    run_dir = tmp_path / "broken-run"
    env = dict(_fresh_environment(), DS_ACCELERATOR="cpu")
    cmd = [sys.executable, str(script), "train", "--config", str(ROOT / "configs" / "demo.yaml"),
           f"output_dir={run_dir}", f"data.train={dataset}/train", f"data.val={dataset}/val",
           "eval.zeroshot=", "model.name=vlc-micro", "data.batch_size=64", "data.workers=1",
           "train.steps=120", "optim.lr=5e-3", "optim.warmup_steps=20", "checkpoint.every=0",
           "eval.batch_size=100", "logging.progress=false", "loss.name=infonce"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    verify = subprocess.run([sys.executable, "-m", "vlcontrast.cli", "verify", str(run_dir)],
                            cwd=ROOT, capture_output=True, text=True)
    assert verify.returncode == 1, verify.stdout
    assert "FAIL" in verify.stdout


def test_verifier_takes_a_threshold_per_metric_and_fails_a_missing_one(tmp_path):
    from vlcontrast.verify import verify_run

    run = {"retrieval/text_to_image_R@1": 0.2, "retrieval/image_to_text_R@1": 0.2,
           "retrieval/num_images": 1000, "retrieval/num_texts": 1000,
           "zeroshot/top1": 0.45, "zeroshot/num_classes": 10}
    keys = ("retrieval/text_to_image_R@1:50", "zeroshot/top1:5")
    ok, rows = verify_results(run, 3.0, keys)
    assert not ok and [r["passed"] for r in rows] == [True, False]  # 4.5x < 5x chance
    assert [r["required"] for r in rows] == [50.0, 5.0]
    assert verify_results(dict(run, **{"zeroshot/top1": 0.5}), 3.0, keys)[0]
    # The demo gates on zero-shot: a run that did not evaluate it must not pass; a plain key
    # (no threshold of its own) that was not evaluated is skipped, as before.
    without = {k: v for k, v in run.items() if not k.startswith("zeroshot")}
    assert not verify_results(without, 3.0, keys)[0]
    assert verify_results(without, 3.0, ("retrieval/text_to_image_R@1", "zeroshot/top1"))[0]
    (tmp_path / "results.json").write_text(json.dumps({"metrics": without}))
    ok, table = verify_run(tmp_path, 3.0, keys)
    assert not ok and "| zeroshot/top1 | missing |" in table and "FAIL" in table
    with pytest.raises(ValueError, match="KEY:RATIO"):
        verify_results(run, 3.0, ("zeroshot/top1:many",))


@pytest.mark.parametrize("args, line", [
    (["{run}", "--metrics", "zeroshot/top:2"],
     "verify --metrics 'zeroshot/top:2': 'zeroshot/top' is not a metric verify can compare with "
     "chance; this run has retrieval/image_to_text_R@1, retrieval/text_to_image_R@1, zeroshot/top1"),
    (["{run}", "--min-over-chance", "-1"], "verify --min-over-chance=-1: must be > 0"),
    (["{tmp}/runs/teachr"], "verify RUN '{tmp}/runs/teachr': no such folder; give a finished run's"),
    (["{tmp}"], "verify RUN '{tmp}': holds no results.json; a run writes it when it finishes"),
])
def test_verify_refuses_bad_input_in_one_line(tmp_path, capsys, args, line):
    from vlcontrast.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps({"metrics": {
        "retrieval/text_to_image_R@1": 0.2, "retrieval/image_to_text_R@1": 0.2,
        "retrieval/num_images": 100, "retrieval/num_texts": 100,
        "zeroshot/top1": 0.45, "zeroshot/num_classes": 10}}))
    given = [a.format(run=run, tmp=tmp_path) for a in args]
    assert main(["verify", *given]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vlcontrast: error: " + line.format(tmp=tmp_path)) and "\n" not in err
    # the results file itself is a run too
    assert main(["verify", str(run / "results.json")]) == 0


# The held-out split of the clip-art tutorial (docs/tutorial-own-data.md §5): 22 classes, one of
# them ("computer") 202 of the 777 images, one with no image at all.
CLIPART_COUNTS = [202, 145, 106, 64, 42, 39, 33, 28, 23, 17, 16, 15, 14, 11, 6, 4, 4, 3, 2, 2, 1, 0]


def _clipart_labels():
    import torch

    return torch.cat([torch.full((n,), c, dtype=torch.long) for c, n in enumerate(CLIPART_COUNTS)])


def _zeroshot_run(logits, labels) -> dict:
    """``zeroshot/*`` metrics as a run records them (the trainer's prefix on zeroshot_metrics)."""
    from vlcontrast.evaluation import zeroshot_metrics

    metrics = {f"zeroshot/{k}": v for k, v in zeroshot_metrics(logits, labels).items()}
    return dict(metrics, **{"zeroshot/num_classes": logits.shape[1]})


def test_zeroshot_chance_is_the_constant_guessers_on_an_imbalanced_set(tmp_path, capsys):
    """Always answering the largest class scores its share: that is top-1's chance, not 1/K, so
    a model at that level fails (it passed at 5.7x "chance" 1/22 before)."""
    from collections import Counter

    import torch

    from vlcontrast.cli import main

    labels = _clipart_labels()
    counts = Counter(labels.tolist())
    largest = [n for _, n in counts.most_common()]
    constant = torch.tensor(CLIPART_COUNTS, dtype=torch.float32).expand(len(labels), -1)
    run = _zeroshot_run(constant, labels)  # the best label-blind guesser
    assert run["zeroshot/top1"] == pytest.approx(202 / 777)

    ok, rows = verify_results(run)
    assert not ok
    top1, recall = rows
    assert [top1["metric"], recall["metric"]] == ["zeroshot/top1",
                                                  "zeroshot/mean_per_class_recall"]
    assert top1["chance"] == pytest.approx(largest[0] / len(labels))   # 0.2600, not 1/22
    assert top1["ratio"] == pytest.approx(1.0)
    assert recall["chance"] == pytest.approx(1 / len(counts))          # 1/21: classes present
    assert recall["ratio"] == pytest.approx(1.0)
    top5 = verify_results(run, 1.0, ("zeroshot/top5",))[1][0]
    assert top5["chance"] == pytest.approx(sum(largest[:5]) / len(labels))  # 0.7194
    assert top5["ratio"] == pytest.approx(1.0) and top5["passed"]

    # The walkthrough's model: 15.2% top-1 is below what "always computer" scores.
    walkthrough = dict(run, **{"zeroshot/top1": 0.1519, "zeroshot/mean_per_class_recall": 0.0497})
    (tmp_path / "results.json").write_text(json.dumps({"metrics": walkthrough}))
    assert main(["verify", str(tmp_path)]) == 1
    table = capsys.readouterr().out
    assert "| zeroshot/top1 | 0.1519 | 0.2600 | largest class 26.0% | 0.6 | 3x | FAIL |" in table
    assert ("| zeroshot/mean_per_class_recall | 0.0497 | 0.0476 | 1/21 classes present | 1.0 | "
            "3x | FAIL |") in table
    assert "cannot pass" not in table  # 3x 26% is within reach
    # Top-5's chance is the five largest classes, 559 of 777: 3x that is out of reach, and the
    # table says so.
    assert main(["verify", str(tmp_path), "--metrics", "zeroshot/top5"]) == 1
    table = capsys.readouterr().out
    assert "| zeroshot/top5 | 0.7194 | 0.7194 | 5 largest classes 71.9% | 1.0 | 3x | FAIL |" \
        in table
    assert "note: zeroshot/top5 cannot pass: 3x its chance 0.7194 is above 1; check " in table
    # A model that names the classes passes on the per-class mean, with the same chance.
    good = dict(walkthrough, **{"zeroshot/mean_per_class_recall": 0.2})
    ok, rows = verify_results(good, 3.0, ("zeroshot/mean_per_class_recall",))
    assert ok and rows[0]["ratio"] == pytest.approx(0.2 * 21)


def test_mean_per_class_recall_is_checked_with_chance_one_over_classes(tmp_path, capsys):
    from vlcontrast.cli import main

    run = tmp_path / "run"
    run.mkdir()
    metrics = {"zeroshot/top1": 0.45, "zeroshot/mean_per_class_recall": 0.25,
               "zeroshot/num_classes": 10}
    (run / "results.json").write_text(json.dumps({"metrics": metrics}))
    assert main(["verify", str(run), "--metrics", "zeroshot/mean_per_class_recall:2"]) == 0
    assert "| zeroshot/mean_per_class_recall | 0.2500 | 0.1000 | 1/10 classes | 2.5 | 2x | ok |" \
        in capsys.readouterr().out
    assert main(["verify", str(run), "--metrics", "zeroshot/mean_per_class_recall:3"]) == 1
    out = capsys.readouterr().out
    assert "| zeroshot/mean_per_class_recall | 0.2500 | 0.1000 | 1/10 classes | 2.5 | 3x | FAIL |" \
        in out
    assert ("| zeroshot/top1 | 0.4500 | 0.1000 | 1/10, class balance unknown | 4.5 |  | "
            "(not checked) |") in out


def test_results_without_class_counts_fall_back_to_one_over_classes_and_say_so(tmp_path, capsys):
    """An older results.json has num_classes only: top-k's chance is k/K, and the table says the
    classes' balance is unknown."""
    from vlcontrast.cli import main

    old = {"zeroshot/top1": 0.1519, "zeroshot/top5": 0.3436, "zeroshot/num_classes": 22}
    ok, rows = verify_results(old, 3.0, ("zeroshot/top1", "zeroshot/top5"))
    assert [r["chance"] for r in rows] == [pytest.approx(1 / 22), pytest.approx(5 / 22)]
    assert [r["chance_from"] for r in rows] == ["1/22, class balance unknown",
                                               "5/22, class balance unknown"]
    (tmp_path / "results.json").write_text(json.dumps({"metrics": old}))
    assert main(["verify", str(tmp_path)]) == 0
    assert ("| zeroshot/top1 | 0.1519 | 0.0455 | 1/22, class balance unknown | 3.3 | 3x | ok |"
            in capsys.readouterr().out)
    # On a balanced set the recorded chance is k/K, and the table says the classes are balanced.
    balanced = dict(old, **{"zeroshot/chance_top1": 1 / 22, "zeroshot/chance_top5": 5 / 22})
    assert [r["chance_from"] for r in verify_results(balanced, 3.0, ("zeroshot/top1",
                                                                    "zeroshot/top5"))[1]] == \
        ["1/22, balanced classes", "5/22, balanced classes"]


def test_retrieval_chance_is_k_over_candidates(tmp_path):
    run = {"retrieval/text_to_image_R@5": 0.2, "retrieval/image_to_text_R@10": 0.2,
           "retrieval/num_images": 777, "retrieval/num_texts": 1554}
    rows = verify_results(run, 3.0, tuple(k for k in run if "_R@" in k))[1]
    assert [r["chance"] for r in rows] == [pytest.approx(5 / 777), pytest.approx(10 / 777)]
    assert [r["chance_from"] for r in rows] == ["5/777 images", "10/777 images"]


def test_verify_reads_an_eval_out_record(tmp_path, capsys):
    """``vlcontrast eval zeroshot|retrieval --out F.json`` records: their metrics are read under
    the run's names (``top1`` -> ``zeroshot/top1``)."""
    from vlcontrast.cli import main

    record = {"task": "zeroshot", "checkpoint": "runs/x/checkpoints/step_00000040",
              "dataset": "data/openclipart-classes/val", "N": 777,
              "metrics": {"top1": 0.151866152882576, "top5": 0.3436293303966522,
                          "mean_per_class_recall": 0.04971606011330755, "num_images": 777,
                          "num_classes": 22, "num_templates": 2, "num_skipped": 0},
              "world_size": 1}
    (tmp_path / "zs.json").write_text(json.dumps(record))
    assert main(["verify", str(tmp_path / "zs.json")]) == 1  # 1/22 for mean per-class recall
    out = capsys.readouterr().out
    assert "| zeroshot/top1 | 0.1519 | 0.0455 | 1/22, class balance unknown | 3.3 | 3x | ok |" in out
    assert "| zeroshot/mean_per_class_recall | 0.0497 | 0.0455 | 1/22 classes | 1.1 | 3x | FAIL |" \
        in out
    retrieval = {"task": "retrieval", "N": 100, "num_texts": 200,
                 "metrics": {"image_to_text_R@1": 0.2, "text_to_image_R@1": 0.15,
                             "num_images": 100, "num_texts": 200}}
    (tmp_path / "r.json").write_text(json.dumps(retrieval))
    assert main(["verify", str(tmp_path / "r.json")]) == 0
    assert "| retrieval/text_to_image_R@1 | 0.1500 | 0.0100 | 1/100 images | 15.0 | 3x | ok |" in \
        capsys.readouterr().out


@pytest.mark.parametrize("content, line", [
    ([{"checkpoint": "runs/a", "zeroshot/top1": 0.3}],
     "verify RUN '{path}': an `eval compare` table (a list of rows), not one run; verify reads a "
     "run's results.json or one `eval retrieval|zeroshot --out` record (OUT/0_zeroshot.json)"),
    ({"task": "retrieval", "N": 3},
     "verify RUN '{path}': no 'metrics' object; verify reads a run's results.json or one "
     "`eval retrieval|zeroshot --out` record"),
])
def test_verify_refuses_a_json_it_cannot_read_in_one_line(tmp_path, capsys, content, line):
    from vlcontrast.cli import main

    path = tmp_path / "comparison.json"
    path.write_text(json.dumps(content))
    assert main(["verify", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "vlcontrast: error: " + line.format(path=path)


@pytest.mark.slow
def test_normalizing_on_the_device_trains_exactly_like_the_per_image_transform(dataset, tmp_path):
    # data.normalize_on_device moves ToTensor + Normalize from the loader to the batch; the
    # values are bit-identical, so the whole run is too.
    losses = {}
    for flag in ("false", "true"):
        run_dir = tmp_path / f"run-{flag}"
        _train(dataset, run_dir, "train.steps=12", "train.log_every=4", "eval.every=0",
               "checkpoint.every=0", "eval.zeroshot=", f"data.normalize_on_device={flag}",
               nproc=1)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        losses[flag] = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses["true"]) == 3
    assert losses["true"] == losses["false"]
