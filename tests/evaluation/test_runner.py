import io
import json
import re

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from tests.evaluation.helpers import (image_bytes, write_clip_benchmark_wds,
                                      write_image_folder, write_retrieval_shards)
from vlcontrast.evaluation import (build_zeroshot_classifier, clip_validation_loss,
                                   evaluate_retrieval, evaluate_zeroshot, retrieval_metrics,
                                   run_retrieval_cli, run_zeroshot_cli, zeroshot_metrics)


def reference_embeddings(model, preprocess, tokenizer, captions):
    images = torch.stack([preprocess(Image.open(io.BytesIO(image_bytes(i))).convert("RGB"))
                          for i in range(len(captions))])
    with torch.no_grad():
        image_features = F.normalize(model.encode_image(images), dim=-1)
        flat = [t for texts in captions for t in texts]
        text_features = F.normalize(model.encode_text(tokenizer(flat)), dim=-1)
    t2i = torch.arange(len(captions)).repeat_interleave(torch.tensor([len(c) for c in captions]))
    return image_features, text_features, t2i


@pytest.mark.parametrize("workers", [0, 2])
def test_evaluate_retrieval_equals_metrics_on_direct_embeddings(tmp_path, tiny, workers):
    model, preprocess, tokenizer = tiny
    captions = write_retrieval_shards(tmp_path, 23, per_shard=5,
                                      captions_per_image=lambda i: 1 + i % 3, style="json")
    result = evaluate_retrieval(model, preprocess, tokenizer, str(tmp_path), batch_size=4,
                                workers=workers, device="cpu", progress=False)
    images, texts, t2i = reference_embeddings(model, preprocess, tokenizer, captions)
    expected = retrieval_metrics(images, texts, t2i)
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, abs=1e-9), key
    first = torch.tensor([0] + torch.cumsum(torch.tensor([len(c) for c in captions]), 0).tolist()[:-1])
    scale = model.logit_scale.exp().item()
    assert result["val_loss"] == pytest.approx(clip_validation_loss(images, texts[first], scale, 4),
                                               rel=1e-5)
    assert result["val_loss_batch_size"] == 4 and result["num_skipped"] == 0
    assert result["num_texts"] == sum(len(c) for c in captions)
    json.dumps(result)
    assert model.training is False
    # a set smaller than the batch: the loss is over the whole set, and says so
    whole = evaluate_retrieval(model, preprocess, tokenizer, str(tmp_path), batch_size=64,
                               workers=workers, device="cpu", progress=False)
    assert whole["val_loss_batch_size"] == 23
    assert whole["val_loss"] == pytest.approx(clip_validation_loss(images, texts[first], scale, 23),
                                              rel=1e-5)


def _rewrite_members(source, target, rewrite):
    """Copy shards, passing each sample's members through ``rewrite(members) -> members``."""
    import tarfile

    target.mkdir()
    for shard in sorted(source.glob("*.tar")):
        samples: dict = {}
        with tarfile.open(shard) as archive:
            for member in archive.getmembers():
                key, ext = member.name.split(".", 1)
                samples.setdefault(key, {})[ext] = archive.extractfile(member).read()
        with tarfile.open(target / shard.name, "w") as archive:
            for key, members in samples.items():
                for ext, data in rewrite(members).items():
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    archive.addfile(info, io.BytesIO(data))


def test_retrieval_reads_the_members_training_reads(tmp_path, tiny):
    """``data.caption_key``/``data.image_key`` reach the retrieval evaluation (training's own
    evaluation and ``eval retrieval --caption-key``), so that shards whose captions are elsewhere
    than ``.txt`` evaluate as they train."""
    from vlcontrast.data.samples import Members

    model, preprocess, tokenizer = tiny
    captions = write_retrieval_shards(tmp_path / "plain", 9, per_shard=5)
    expected = evaluate_retrieval(model, preprocess, tokenizer, str(tmp_path / "plain"),
                                  batch_size=4, workers=0, progress=False)

    def custom(members):  # the caption in a .json field of its own, the image as .png
        meta = json.loads(members["json"])
        return {"png": members["jpg"], "json": json.dumps({"title": meta["caption"]}).encode()}

    _rewrite_members(tmp_path / "plain", tmp_path / "custom", custom)
    with pytest.raises(ValueError, match=r"\(9 skipped\).*data.caption_key"):
        # no .txt, no known .json field: every caption missing, and the error says what to set
        evaluate_retrieval(model, preprocess, tokenizer, str(tmp_path / "custom"), batch_size=4,
                           workers=0, progress=False)
    got = evaluate_retrieval(model, preprocess, tokenizer, str(tmp_path / "custom"), batch_size=4,
                             workers=0, progress=False,
                             members=Members.parse("png", "json:title"))
    assert got["num_skipped"] == 0 and got["num_texts"] == len(captions)
    for key in ("image_to_text_R@1", "text_to_image_R@1", "val_loss"):
        assert got[key] == pytest.approx(expected[key]), key

    def json_only(members):  # no .txt: the .json's caption, read as training reads it
        return {k: v for k, v in members.items() if k != "txt"}

    _rewrite_members(tmp_path / "plain", tmp_path / "json-only", json_only)
    got = evaluate_retrieval(model, preprocess, tokenizer, str(tmp_path / "json-only"),
                             batch_size=4, workers=0, progress=False,
                             members=Members.parse("", "json:caption"))
    assert got["num_skipped"] == 0
    assert got["text_to_image_R@1"] == pytest.approx(expected["text_to_image_R@1"])


def test_evaluate_retrieval_restores_training_mode_and_honours_max_samples(tmp_path, tiny):
    model, preprocess, tokenizer = tiny
    write_retrieval_shards(tmp_path, 12, per_shard=5)
    model.train()
    try:
        result = evaluate_retrieval(model, preprocess, tokenizer, str(tmp_path), batch_size=5,
                                    workers=0, max_samples=8, logit_scale=10.0, progress=False)
        assert model.training
    finally:
        model.eval()
    assert result["num_images"] == 8 and result["num_texts"] == 8


def test_evaluate_zeroshot_image_folder_equals_direct_computation(tmp_path, tiny):
    model, preprocess, tokenizer = tiny
    samples = write_image_folder(tmp_path / "data", ["c0", "c1", "c2", "c3", "c4", "c5"], per_class=3)
    templates = ["a photo of a {c}.", "a blurry {c}."]
    names = ["cat", "dog", "car", "tree", "boat", "house"]
    result = evaluate_zeroshot(model, preprocess, tokenizer, str(tmp_path / "data"), names, templates,
                               batch_size=4, workers=0, progress=False)
    classifier = build_zeroshot_classifier(model, tokenizer, names, templates)
    images = torch.stack([preprocess(Image.open(p).convert("RGB")) for p, _ in samples])
    with torch.no_grad():
        features = F.normalize(model.encode_image(images), dim=-1)
    expected = zeroshot_metrics(100.0 * features @ classifier, torch.tensor([l for _, l in samples]))
    for key, value in expected.items():
        assert result[key] == pytest.approx(value), key
    assert result["num_images"] == 18 and result["num_classes"] == 6 and result["num_templates"] == 2


def test_cli_helpers_write_json_records(tmp_path, tiny_checkpoint, capsys):
    write_retrieval_shards(tmp_path / "shards", 7, per_shard=4)
    out = tmp_path / "out" / "retrieval.json"
    record = run_retrieval_cli(str(tiny_checkpoint), str(tmp_path / "shards"), str(out),
                               batch_size=4, workers=0, max_samples=0, device="cpu")
    saved = json.loads(out.read_text())
    assert saved == record
    assert saved["checkpoint"].endswith("step_00000100") and saved["N"] == 7
    assert saved["dataset"] == str(tmp_path / "shards") and "timestamp" in saved
    assert 0.0 <= saved["metrics"]["image_to_text_R@1"] <= 1.0
    assert "image_to_text_R@1" in capsys.readouterr().out

    write_clip_benchmark_wds(tmp_path / "cls", 6, 3, task="classification", labels=[0, 1, 2, 0, 1, 2],
                             classnames=["cat", "dog", "car"], templates=["a {c}", "the {c}"])
    out = tmp_path / "zs.json"
    record = run_zeroshot_cli(str(tiny_checkpoint), str(tmp_path / "cls"), str(out), batch_size=4,
                              workers=0, device="cpu")
    saved = json.loads(out.read_text())
    assert saved["task"] == "zeroshot" and saved["N"] == 6
    assert saved["metrics"]["num_classes"] == 3 and saved["metrics"]["num_templates"] == 2


def test_compare_checkpoints_script_writes_table(tmp_path, tiny_checkpoint, monkeypatch):
    import importlib.util
    import sys
    from pathlib import Path

    write_retrieval_shards(tmp_path / "shards", 6, per_shard=3)
    path = Path(__file__).resolve().parents[2] / "eval" / "compare_checkpoints.py"
    spec = importlib.util.spec_from_file_location("compare_checkpoints", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["compare", str(tiny_checkpoint), str(tiny_checkpoint),
                                      "--retrieval", str(tmp_path / "shards"), "--workers", "0",
                                      "--device", "cpu", "--out", str(tmp_path / "cmp")])
    module.main()
    table = (tmp_path / "cmp" / "comparison.md").read_text().splitlines()
    assert table[0].startswith("| checkpoint | retrieval/image_to_text_R@1")
    assert len(table) == 4 and table[2] .split("|")[2] == table[3].split("|")[2]
    assert json.loads((tmp_path / "cmp" / "comparison.json").read_text())[0]["retrieval/num_images"] == 6


def test_retrieval_alpha_rule_counts_and_reads_transparent_images(tmp_path, tiny):
    """``alpha`` reaches the retrieval reader: transparent images are counted, ``drop`` reads
    them as ``convert("RGB")`` does, and without ``alpha`` the result is the trainer's (no new
    keys, white)."""
    from tests.evaluation.test_export import transparent_png

    model, preprocess, tokenizer = tiny
    write_retrieval_shards(tmp_path / "plain", 8, per_shard=4)
    made = iter(range(8))

    def transparent_half(members):
        index = next(made)
        if index % 2:
            members = {k: v for k, v in members.items() if k != "jpg"}
            members["png"] = transparent_png(3 * index)  # RGBA, LA or palette transparency
        return members

    _rewrite_members(tmp_path / "plain", tmp_path / "mixed", transparent_half)
    common = dict(batch_size=4, workers=0, device="cpu", progress=False)
    trainer = evaluate_retrieval(model, preprocess, tokenizer, str(tmp_path / "mixed"), **common)
    white = evaluate_retrieval(model, preprocess, tokenizer, str(tmp_path / "mixed"),
                               alpha="white", **common)
    dropped = evaluate_retrieval(model, preprocess, tokenizer, str(tmp_path / "mixed"),
                                 alpha="drop", **common)
    assert "num_transparent" not in trainer
    assert white["num_transparent"] == dropped["num_transparent"] == 4
    assert {k: v for k, v in white.items() if k != "num_transparent"} == trainer
    assert dropped["val_loss"] != white["val_loss"]


def test_compare_checks_every_checkpoint_before_evaluating_any(tmp_path, tiny_checkpoint,
                                                               monkeypatch, capsys):
    from vlcontrast import cli
    from vlcontrast.evaluation import runner

    write_retrieval_shards(tmp_path / "shards", 6, per_shard=3)
    evaluated = []
    monkeypatch.setattr(runner, "run_retrieval_cli", lambda *a, **k: evaluated.append(a))
    missing = str(tmp_path / "run_b")
    assert cli.main(["eval", "compare", str(tiny_checkpoint), missing, "--retrieval",
                     str(tmp_path / "shards"), "--workers", "0", "--device", "cpu", "--out",
                     str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err
    assert err == (f"vlcontrast: error: eval compare: checkpoint {missing!r}: no such folder; give "
                   "a run directory, a checkpoint directory, a `vlcontrast export` directory or "
                   "a transformers CLIPModel directory\n")
    assert evaluated == [] and not (tmp_path / "cmp").exists()


def test_verify_reads_an_eval_zeroshot_record(tmp_path, tiny_checkpoint, capsys):
    """``eval zeroshot --out`` records the chance levels of its set; ``verify`` reads the record
    and compares with them (here 4 of 6 images are one class: top-1 chance 4/6, not 1/3)."""
    from collections import Counter

    from vlcontrast.cli import main

    labels = [0, 0, 1, 0, 2, 0]
    write_clip_benchmark_wds(tmp_path / "cls", 6, 3, task="classification", labels=labels,
                             classnames=["cat", "dog", "car"], templates=["a {c}", "the {c}"])
    out = tmp_path / "zs.json"
    run_zeroshot_cli(str(tiny_checkpoint), str(tmp_path / "cls"), str(out), batch_size=4,
                     workers=0, device="cpu")
    metrics = json.loads(out.read_text())["metrics"]
    share = Counter(labels).most_common(1)[0][1] / len(labels)
    assert metrics["chance_top1"] == pytest.approx(share)
    assert metrics["chance_mean_per_class_recall"] == pytest.approx(1 / 3)
    capsys.readouterr()
    assert main(["verify", str(out)]) == 1  # 3x of 4/6 is out of reach
    table = capsys.readouterr().out
    assert (f"| zeroshot/top1 | {metrics['top1']:.4f} | 0.6667 | largest class 66.7% | "
            f"{metrics['top1'] / share:.1f} | 3x | FAIL |") in table
    assert "| zeroshot/mean_per_class_recall |" in table


def test_eval_commands_take_no_progress(tmp_path, tiny_checkpoint, capsys):
    from tests.inference.helpers import run_cli

    write_retrieval_shards(tmp_path / "shards", 4, per_shard=2)
    write_image_folder(tmp_path / "classes", ["cat", "dog"], per_class=1)
    common = ["--workers", "0", "--device", "cpu", "--batch-size", "2"]
    commands = {
        "retrieval": ["eval", "retrieval", "--checkpoint", str(tiny_checkpoint), "--data",
                      str(tmp_path / "shards"), *common],
        "zeroshot": ["eval", "zeroshot", "--checkpoint", str(tiny_checkpoint), "--data",
                     str(tmp_path / "classes"), "--templates", str(tmp_path / "t.txt"), *common],
        "compare": ["eval", "compare", str(tiny_checkpoint), "--retrieval",
                    str(tmp_path / "shards"), "--zeroshot", str(tmp_path / "classes"),
                    "--templates", str(tmp_path / "t.txt"), "--out", str(tmp_path / "cmp"),
                    *common],
    }
    (tmp_path / "t.txt").write_text("a {c}\n")
    for name, args in commands.items():
        code, _, err = run_cli(capsys, *args)
        assert code == 0 and "embed" in err and "(100%)" in err, (name, err)  # progress lines
        again = ["--overwrite"] if name == "compare" else []  # its folder exists now
        code, _, err = run_cli(capsys, *args, "--no-progress", *again)
        assert code == 0 and "(100%)" not in err and "batch/s" not in err, (name, err)


def test_eval_zeroshot_names_the_skipped_images(tmp_path, tiny_checkpoint, capsys):
    from tests.inference.helpers import run_cli

    write_image_folder(tmp_path / "classes", ["cat", "dog"], per_class=2)
    for name in ("cat/broken.png", "dog/empty.png"):
        (tmp_path / "classes" / name).write_bytes(b"not an image" if "broken" in name else b"")
    code, out, err = run_cli(capsys, "eval", "zeroshot", "--checkpoint", str(tiny_checkpoint),
                             "--data", str(tmp_path / "classes"), "--workers", "0", "--device",
                             "cpu", "--no-progress")
    assert code == 0 and re.search(r"num_skipped +2\n", out)
    assert (f"vlcontrast eval zeroshot: skipped 2 of 6 images (undecodable_image: 2): "
            f"{tmp_path / 'classes' / 'cat' / 'broken.png'}, "
            f"{tmp_path / 'classes' / 'dog' / 'empty.png'}\n") in err


def test_zeroshot_record_says_where_names_and_templates_came_from(tmp_path, tiny_checkpoint):
    """The record used to say ``"classnames": null, "templates": null`` when the folder's own
    files or the default 80 templates were used."""
    write_image_folder(tmp_path / "classes", ["cat", "dog"], per_class=1)
    (tmp_path / "classes" / "classnames.txt").write_text("kitten\npuppy\n")
    out = tmp_path / "zs.json"
    run_zeroshot_cli(str(tiny_checkpoint), str(tmp_path / "classes"), str(out), batch_size=4,
                     workers=0, device="cpu", progress=False)
    record = json.loads(out.read_text())
    assert record["classnames"] == {"source": "data", "count": 2,
                                    "file": str(tmp_path / "classes" / "classnames.txt")}
    assert record["templates"] == {"source": "default", "count": 80,
                                   "table": "open_clip OPENAI_IMAGENET_TEMPLATES"}
    (tmp_path / "t.txt").write_text("a {c}\n")
    record = run_zeroshot_cli(str(tiny_checkpoint), str(tmp_path / "classes"),
                              classnames=["a", "b"], templates=str(tmp_path / "t.txt"),
                              batch_size=4, workers=0, device="cpu", progress=False)
    assert record["classnames"] == {"source": "list", "count": 2}
    assert record["templates"] == {"source": "--templates", "file": str(tmp_path / "t.txt"),
                                   "count": 1}


@pytest.mark.parametrize("case", ["config", "weights", "compare"])
def test_a_file_given_as_checkpoint_names_its_folder_only_when_it_holds_a_model(
        tmp_path, tiny_checkpoint, capsys, case):
    from tests.inference.helpers import run_cli

    write_retrieval_shards(tmp_path / "shards", 2, per_shard=2)
    weights = tiny_checkpoint / "checkpoints" / "step_00000100" / "model.pt"
    (tmp_path / "run.yaml").write_text("output_dir: runs/x\n")
    given = {"config": tmp_path / "run.yaml", "weights": weights, "compare": weights}[case]
    if case == "compare":
        args = ["eval", "compare", str(given), "--retrieval", str(tmp_path / "shards"), "--out",
                str(tmp_path / "cmp")]
    else:
        args = ["eval", "retrieval", "--checkpoint", str(given), "--data", str(tmp_path / "shards")]
    code, out, err = run_cli(capsys, *args, "--device", "cpu")
    expected = {
        "config": f"--checkpoint {str(given)!r}: a file, not a model; give a run directory (its "
                  "latest checkpoint), a checkpoint directory (RUN/checkpoints/step_*), a "
                  "`vlcontrast export` directory or a transformers CLIPModel directory",
        "weights": f"--checkpoint {str(given)!r}: a file, not a folder; give the folder holding "
                   f"it: --checkpoint {str(weights.parent)!r}",
        "compare": f"eval compare: checkpoint {str(given)!r}: a file, not a folder; give the "
                   f"folder holding it: {str(weights.parent)!r}"}[case]
    assert code == 2 and out == "" and err == f"vlcontrast: error: {expected}\n"


def test_retrieval_data_of_images_says_to_evaluate_the_converted_shards(
        tmp_path, tiny_checkpoint, capsys, monkeypatch):
    from tests.inference.helpers import run_cli
    from vlcontrast.evaluation import runner

    monkeypatch.setattr(runner, "_load", lambda *a: pytest.fail("the model was loaded"))
    write_image_folder(tmp_path / "photos", ["cat"], per_class=2)
    code, _, err = run_cli(capsys, "eval", "retrieval", "--checkpoint", str(tiny_checkpoint),
                           "--data", str(tmp_path / "photos"), "--device", "cpu")
    assert code == 2 and "and train on OUT" not in err
    assert err.endswith(f"`vlcontrast prep folder {tmp_path / 'photos'} OUT` (captions from "
                        ".txt/.json sidecars, class folders or file names) and evaluate OUT "
                        "(--data OUT)\n")
    code, _, err = run_cli(capsys, "eval", "retrieval", "--checkpoint", str(tiny_checkpoint),
                           "--data", str(tmp_path / "photos" / "cat" / "img_000.png"),
                           "--device", "cpu")
    assert code == 2 and err.endswith("run `vlcontrast prep folder DIR OUT` and evaluate OUT "
                                      "(--data OUT)\n")
