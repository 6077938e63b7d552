"""Export round trip: vlcontrast checkpoint -> open_clip -> same embeddings -> CLIP_benchmark
(its Python API, and its command line on transparent PNGs read with ``--alpha drop``)."""

import io
import json
import tarfile

import open_clip
import pytest
import torch
from torch.utils.data import DataLoader

from tests.evaluation.helpers import TINY_NAME, write_clip_benchmark_wds
from vlcontrast.evaluation import evaluate_retrieval, evaluate_zeroshot
from vlcontrast.export import export_open_clip


@pytest.fixture(scope="module")
def exported(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("exported")
    return out, export_open_clip(str(tiny_checkpoint), out)


def embeddings(model, preprocess, tokenizer):
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    pixels = (torch.rand(3, 40, 40, 3, generator=generator) * 255).to(torch.uint8).numpy()
    images = torch.stack([preprocess(Image.fromarray(p)) for p in pixels])
    with torch.no_grad():
        return (model.encode_image(images, normalize=True),
                model.encode_text(tokenizer(["a dog", "two red cars", "a house"]), normalize=True))


def test_export_writes_open_clip_files(exported, tiny):
    from safetensors.torch import load_file

    out, info = exported
    assert info["model_name"] == TINY_NAME
    assert json.loads((out / f"{TINY_NAME}.json").read_text())["embed_dim"] == 32
    config = json.loads((out / "open_clip_config.json").read_text())
    assert config["model_cfg"]["embed_dim"] == 32
    assert config["vlcontrast"]["trained_alpha"] == "white"
    assert "composited on white" in (out / "README.md").read_text()
    # safetensors only: no pickle travels with an export
    assert info["weights"].endswith("open_clip_model.safetensors")
    assert not list(out.glob("*.bin")) and not list(out.glob("*.pt"))
    state = load_file(info["weights"])
    assert set(state) == set(tiny[0].state_dict())
    for key, value in tiny[0].state_dict().items():
        assert torch.equal(state[key], value), key


def test_open_clip_loads_export_without_unpickling(exported, tiny, monkeypatch):
    """``local-dir:`` (and ``hf-hub:``, which looks for the same file first) finds the
    safetensors file; torch.load, the only way to unpickle, is never called."""
    out, _ = exported

    def no_pickles(*args, **kwargs):
        raise AssertionError("torch.load called: the export was unpickled")

    monkeypatch.setattr(torch, "load", no_pickles)
    local, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{out}")
    local.eval()
    images, texts = embeddings(local, preprocess, open_clip.get_tokenizer(f"local-dir:{out}"))
    expected_images, expected_texts = embeddings(*tiny)
    torch.testing.assert_close(images, expected_images, atol=1e-6, rtol=0)
    torch.testing.assert_close(texts, expected_texts, atol=1e-6, rtol=0)


def test_older_pickled_export_still_loads(exported, tiny, tmp_path):
    """An export written before safetensors (``open_clip_pytorch_model.bin``) is read as tensors
    only, and gives the same model."""
    import shutil

    from vlcontrast.models import load_model_from_checkpoint

    out, info = exported
    old = tmp_path / "old"
    old.mkdir()
    for name in (f"{TINY_NAME}.json", "open_clip_config.json"):
        shutil.copy(out / name, old / name)
    torch.save(tiny[0].state_dict(), old / "open_clip_pytorch_model.bin")
    bundle = load_model_from_checkpoint(old)
    images, _ = embeddings(bundle.model, tiny[1], bundle.tokenizer)
    torch.testing.assert_close(images, embeddings(*tiny)[0], atol=1e-6, rtol=0)


def test_open_clip_loads_export_with_same_embeddings(exported, tiny):
    out, info = exported
    model, preprocess, tokenizer = tiny
    expected_images, expected_texts = embeddings(model, preprocess, tokenizer)
    open_clip.add_model_config(info["model_config"])
    loaded, _, loaded_preprocess = open_clip.create_model_and_transforms(
        info["model_name"], pretrained=info["weights"])
    loaded.eval()
    images, texts = embeddings(loaded, loaded_preprocess, open_clip.get_tokenizer(info["model_name"]))
    torch.testing.assert_close(images, expected_images, atol=1e-6, rtol=0)
    torch.testing.assert_close(texts, expected_texts, atol=1e-6, rtol=0)
    torch.testing.assert_close(loaded.logit_scale, model.logit_scale)

    local, _, local_preprocess = open_clip.create_model_and_transforms(f"local-dir:{out}")
    local.eval()
    images, _ = embeddings(local, local_preprocess, open_clip.get_tokenizer(info["model_name"]))
    torch.testing.assert_close(images, expected_images, atol=1e-6, rtol=0)


def test_clip_benchmark_retrieval_on_export_matches_ours(exported, tiny, tmp_path):
    from clip_benchmark.datasets.builder import build_dataset, image_captions_collate_fn
    from clip_benchmark.metrics import zeroshot_retrieval

    _, info = exported
    open_clip.add_model_config(info["model_config"])
    model, _, preprocess = open_clip.create_model_and_transforms(info["model_name"],
                                                                 pretrained=info["weights"])
    model.eval()
    tokenizer = open_clip.get_tokenizer(info["model_name"])
    write_clip_benchmark_wds(tmp_path, 30, 8, task="retrieval", captions_per_image=3)
    dataset = build_dataset("wds/tiny_retrieval", root=str(tmp_path), transform=preprocess,
                            split="test", task="zeroshot_retrieval")
    loader = DataLoader(dataset, batch_size=8, collate_fn=image_captions_collate_fn)
    theirs = zeroshot_retrieval.evaluate(model, loader, tokenizer, device="cpu", amp=False,
                                         recall_k_list=[1, 5, 10])
    ours = evaluate_retrieval(tiny[0], tiny[1], tiny[2], str(tmp_path), batch_size=8, workers=0,
                              progress=False)
    assert ours["num_images"] == 30 and ours["num_texts"] == 90
    for k in (1, 5, 10):
        assert ours[f"image_to_text_R@{k}"] == pytest.approx(theirs[f"text_retrieval_recall@{k}"])
        assert ours[f"text_to_image_R@{k}"] == pytest.approx(theirs[f"image_retrieval_recall@{k}"])
    assert 0 < ours["text_to_image_R@10"] < 1  # the check is not vacuous


def test_clip_benchmark_zeroshot_on_export_matches_ours(exported, tiny, tmp_path, monkeypatch):
    from clip_benchmark.datasets.builder import build_dataset
    from clip_benchmark.metrics import zeroshot_classification

    def accuracy(output, target, topk=(1,)):  # CLIP_benchmark's, with .item() for numpy 2
        pred = output.topk(max(topk), 1, True, True)[1].t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))
        return [correct[:k].reshape(-1).float().sum().item() / len(target) for k in topk]

    monkeypatch.setattr(zeroshot_classification, "accuracy", accuracy)
    _, info = exported
    open_clip.add_model_config(info["model_config"])
    model, _, preprocess = open_clip.create_model_and_transforms(info["model_name"],
                                                                 pretrained=info["weights"])
    model.eval()
    tokenizer = open_clip.get_tokenizer(info["model_name"])
    classnames = ["cat", "dog", "car", "tree", "boat", "house"]
    templates = ["a photo of a {c}.", "a drawing of the {c}"]
    labels = [i % 6 for i in range(24)]
    write_clip_benchmark_wds(tmp_path, 24, 10, task="classification", labels=labels,
                             classnames=classnames, templates=templates)
    dataset = build_dataset("wds/tiny_cls", root=str(tmp_path), transform=preprocess, split="test")
    loader = DataLoader(dataset, batch_size=8)
    theirs = zeroshot_classification.evaluate(model, loader, tokenizer, dataset.classes,
                                              dataset.templates, device="cpu", amp=False)
    ours = evaluate_zeroshot(tiny[0], tiny[1], tiny[2], str(tmp_path), batch_size=8, workers=0,
                             progress=False)
    assert ours["num_images"] == 24 and ours["num_classes"] == 6
    assert ours["top1"] == pytest.approx(theirs["acc1"])
    assert ours["top5"] == pytest.approx(theirs["acc5"])
    assert ours["mean_per_class_recall"] == pytest.approx(theirs["mean_per_class_recall"])


def transparent_png(index: int) -> bytes:
    """A PNG with transparency: RGBA with varied alpha over coloured transparent pixels, a
    grey-with-alpha (LA) image, or a palette image with a transparent entry."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(500 + index)
    size = 40 + 4 * (index % 3)
    colour = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    alpha = np.where(rng.random((size, size)) < 0.5, 0, rng.integers(1, 256, (size, size)))
    kind = index % 3
    if kind == 0:
        image = Image.fromarray(np.dstack([colour, alpha.astype(np.uint8)]), "RGBA")
    elif kind == 1:
        image = Image.fromarray(np.dstack([colour[..., 0], alpha.astype(np.uint8)]), "LA")
    else:
        image = Image.fromarray(colour).convert("P", palette=Image.ADAPTIVE, colors=16)
        image.info["transparency"] = 3
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", **({"transparency": 3} if kind == 2 else {}))
    return buffer.getvalue()


def write_transparent_wds(folder, labels, classnames, templates):
    (folder / "test").mkdir(parents=True)
    with tarfile.open(folder / "test" / "0.tar", "w") as archive:
        for index, label in enumerate(labels):
            for name, data in ((f"s{index:07d}.png", transparent_png(index)),
                               (f"s{index:07d}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    (folder / "test" / "nshards.txt").write_text("1")
    (folder / "classnames.txt").write_text("\n".join(classnames) + "\n")
    (folder / "zeroshot_classification_templates.txt").write_text("\n".join(templates) + "\n")


def test_alpha_drop_reproduces_clip_benchmark_cli_on_transparent_pngs(exported, tmp_path,
                                                                      monkeypatch, capsys):
    """CLIP_benchmark's own command line on the export and `vlcontrast eval zeroshot --alpha drop`
    on the same webdataset folder of transparent PNGs give the same numbers, to the bit; the
    default rule (white) reads other pixels."""
    import sys

    from clip_benchmark import cli as clip_benchmark_cli
    from clip_benchmark.metrics import zeroshot_classification
    from PIL import Image

    from vlcontrast.data.samples import decode_image, has_transparency
    from vlcontrast.evaluation import run_zeroshot_cli

    def accuracy(output, target, topk=(1,)):  # CLIP_benchmark's, with .item() for numpy 2
        pred = output.topk(max(topk), 1, True, True)[1].t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))
        return [correct[:k].reshape(-1).float().sum().item() / len(target) for k in topk]

    monkeypatch.setattr(zeroshot_classification, "accuracy", accuracy)
    out, _ = exported
    classnames = ["cat", "dog", "car", "tree", "boat", "house"]
    labels = [i % 6 for i in range(36)]
    write_transparent_wds(tmp_path / "wds", labels, classnames, ["a photo of a {c}.", "the {c}"])
    assert all(has_transparency(Image.open(io.BytesIO(transparent_png(i)))) for i in range(36))

    theirs_file = tmp_path / "theirs.json"
    monkeypatch.setattr(sys, "argv", [
        "clip_benchmark", "eval", "--model", f"local-dir:{out}", "--pretrained", "export",
        "--dataset", "wds/transparent", "--dataset_root", str(tmp_path / "wds"),
        "--task", "zeroshot_classification", "--no_amp", "--num_workers", "0",
        "--batch_size", "8", "--output", str(theirs_file), "--quiet"])
    clip_benchmark_cli.main()
    theirs = json.loads(theirs_file.read_text())["metrics"]

    capsys.readouterr()
    dropped = run_zeroshot_cli(str(out), str(tmp_path / "wds"), batch_size=8, workers=0,
                               device="cpu", alpha="drop")
    err = capsys.readouterr().err
    assert "36 of 36 images had transparency; --alpha drop" in err
    ours = dropped["metrics"]
    assert ours["num_images"] == 36 and ours["num_transparent"] == 36
    assert dropped["alpha"] == "drop"
    for mine, their in (("top1", "acc1"), ("top5", "acc5"),
                        ("mean_per_class_recall", "mean_per_class_recall")):
        # the same numbers; ours pass through torchmetrics' float32, theirs are float64
        assert ours[mine] == pytest.approx(theirs[their], rel=1e-7, abs=0), mine
    assert round(ours["top1"] * 36) == round(theirs["acc1"] * 36)  # the same count of images

    # the pixels the model sees are the same, bit for bit, as CLIP_benchmark's reader gives
    from clip_benchmark.datasets.builder import build_dataset

    from vlcontrast.evaluation.datasets import build_zeroshot_loader, resolve_zeroshot_data

    _, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{out}")
    reference = [image for image, _ in build_dataset(
        "wds/transparent", root=str(tmp_path / "wds"), transform=preprocess, split="test")]
    loader = build_zeroshot_loader(resolve_zeroshot_data(str(tmp_path / "wds")), preprocess,
                                   batch_size=36, alpha="drop")
    images, read_labels, _, notes = next(iter(loader.loader))
    assert torch.equal(images, torch.stack(reference)) and notes.transparent == 36
    assert read_labels.tolist() == labels

    white = run_zeroshot_cli(str(out), str(tmp_path / "wds"), batch_size=8, workers=0,
                             device="cpu")
    assert white["alpha"] == "white" and white["metrics"]["num_transparent"] == 36
    # the two rules hand the model different pixels for every one of these images
    for index in range(36):
        on_white, _ = decode_image(transparent_png(index), alpha="white")
        as_dropped, _ = decode_image(transparent_png(index), alpha="drop")
        assert on_white.tobytes() != as_dropped.tobytes()


def test_export_into_a_folder_that_holds_files(tiny_checkpoint, tmp_path, capsys):
    """A non-empty OUT is refused (formats used to mix there); ``--overwrite`` replaces an earlier
    vlcontrast export whole, and never a folder of other files."""
    from vlcontrast.cli import main

    out = tmp_path / "exp"
    assert main(["export", "--format", "open_clip", str(tiny_checkpoint), str(out)]) == 0
    first = sorted(p.name for p in out.iterdir())
    capsys.readouterr()
    assert main(["export", "--format", "transformers", str(tiny_checkpoint), str(out)]) == 2
    assert capsys.readouterr().err.strip().startswith(
        f"vlcontrast: error: export OUT {str(out)!r}: not empty (README.md, open_clip_config.json"
        ", open_clip_model.safetensors, ")
    assert sorted(p.name for p in out.iterdir()) == first  # untouched
    # an export that fails half-way leaves the earlier one as it was, and no staging folder
    assert main(["export", "--overwrite", "--format", "transformers", str(tmp_path / "nope"),
                 str(out)]) != 0
    assert "export RUN " in capsys.readouterr().err  # the positional, as typed
    assert sorted(p.name for p in out.iterdir()) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]
    assert main(["export", "--overwrite", "--format", "open_clip", str(tiny_checkpoint),
                 str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["weights"] == str(out / "open_clip_model.safetensors")
    assert sorted(p.name for p in out.iterdir()) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    assert main(["export", "--overwrite", str(tiny_checkpoint), str(other)]) == 2
    assert "not a vlcontrast export (notes.txt), which --overwrite would delete" in \
        capsys.readouterr().err
    assert (other / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_exported_weights_follow_the_umask_as_the_other_files(tiny_checkpoint, tmp_path, umask):
    """safetensors creates its file 0600 whatever the umask: the weights of an export on a shared
    cluster were unreadable to colleagues who could read its config and README."""
    import os
    import stat

    from vlcontrast.export import export_model

    old = os.umask(umask)
    try:
        for format in ("open_clip", "transformers"):
            out = tmp_path / format
            info = export_model(str(tiny_checkpoint), out, format)
            modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
            assert set(modes.values()) == {0o666 & ~umask}, modes
            assert os.path.basename(info["weights"]) in modes
    finally:
        os.umask(old)


def test_the_documented_clip_benchmark_commands_run(exported, tmp_path, monkeypatch):
    """docs/evaluation.md's CLIP_benchmark commands crashed with the pinned numpy (its
    ``accuracy`` calls ``float()`` on a 1-element array), and a retrieval folder needs
    ``dataset_type.txt``: the documented script and commands run, on both tasks."""
    import re
    import sys
    from pathlib import Path

    from clip_benchmark.metrics import zeroshot_classification

    doc = (Path(__file__).resolve().parents[2] / "docs" / "evaluation.md").read_text()
    assert "TypeError: only 0-dimensional arrays\ncan be converted to Python scalars" in doc
    assert "`dataset_type.txt`\ncontaining `retrieval`" in doc
    script = re.search(r"```python\n(import sys\n\nfrom clip_benchmark import cli\n.*?)```", doc,
                       re.S).group(1)
    commands = re.findall(r"python cb.py (eval .*? --output \S+)", doc.replace("\\\n    ", ""))
    assert len(commands) == 2
    script_file = tmp_path / "cb.py"
    script_file.write_text(script)
    monkeypatch.setattr(zeroshot_classification, "accuracy", zeroshot_classification.accuracy)
    out, _ = exported
    write_clip_benchmark_wds(tmp_path / "zs", 12, 6, task="classification",
                             labels=[i % 3 for i in range(12)], classnames=["cat", "dog", "car"],
                             templates=["a {c}"])
    write_clip_benchmark_wds(tmp_path / "ret", 6, 3, task="retrieval")
    assert (tmp_path / "ret" / "dataset_type.txt").read_text() == "retrieval"
    paths = {"exported/my_run": str(out), "data/mine_zs": str(tmp_path / "zs"),
             "data/mine_ret": str(tmp_path / "ret"), "cb_zs.json": str(tmp_path / "cb_zs.json"),
             "cb_ret.json": str(tmp_path / "cb_ret.json")}
    for command in commands:
        for name, path in paths.items():
            command = command.replace(name, path)
        monkeypatch.setattr(sys, "argv", ["cb.py", *command.split(), "--num_workers", "0",
                                          "--no_amp", "--quiet"])
        with pytest.raises(SystemExit) as done:
            exec(compile(script, str(script_file), "exec"), {"__name__": "__main__"})
        assert not done.value.code
    assert set(json.loads((tmp_path / "cb_zs.json").read_text())["metrics"]) >= {"acc1", "acc5"}
    assert "image_retrieval_recall@5" in json.loads((tmp_path / "cb_ret.json").read_text())[
        "metrics"]
