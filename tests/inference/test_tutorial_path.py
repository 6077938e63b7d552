"""The own-data tutorial's path (docs/tutorial-own-data.md) on a small clip-art-like folder the
test draws itself: category folders of PNGs named like openclipart's (titles with authors and
copy marks, transparency), converted with ``prep folder`` twice (captions from names; class
folders for zero-shot), trained from configs/own-data.yaml, then evaluated, classified (with the
figure) and embedded: every command of the tutorial, in the same order, through the CLI."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from PIL import Image, ImageDraw

from tests.train.helpers import REPO, cli, process_env

CATEGORIES = {"animals": "ellipse", "buildings": "rectangle", "plants": "polygon"}
AUTHORS = ["john_doe", "anna_rossi", "ken_ito"]


def draw_corpus(root):
    for c, (category, shape) in enumerate(CATEGORIES.items()):
        for i in range(16):
            image = Image.new("RGBA", (48, 40), (0, 0, 0, 0))  # transparent, as clip art is
            draw = ImageDraw.Draw(image)
            colour = (40 + 60 * c, 200 - 8 * i, 90 + 5 * i, 255)
            if shape == "ellipse":
                draw.ellipse((6, 6, 42, 34), fill=colour)
            elif shape == "rectangle":
                draw.rectangle((8, 4, 40, 36), fill=colour)
            else:
                draw.polygon([(24, 2), (44, 38), (4, 38)], fill=colour)
            name = f"{shape}_{['red', 'green', 'blue', 'tall'][i % 4]}_{AUTHORS[i % 3]}_{i:02d}.png"
            folder = root / category / ("sub" if i % 5 == 0 else "")
            folder.mkdir(parents=True, exist_ok=True)
            image.save(folder / name)


def run(*args, cwd):
    done = subprocess.run(cli(*args), cwd=cwd, env=process_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_the_tutorials_commands_on_a_small_drawn_corpus(tmp_path):
    corpus = tmp_path / "png"
    draw_corpus(corpus)
    run("prep", "folder", str(corpus), "data/art", "--caption-from", "name", "--caption-template",
        "{name}, {path} clip art", "--val-fraction", "0.25", "--image-size", "32",
        "--workers", "1", "--no-progress", cwd=tmp_path)
    run("prep", "folder", str(corpus), "data/art-classes", "--caption-from", "class",
        "--template", "clip art of a {c}.", "--val-fraction", "0.25", "--image-size", "32",
        "--workers", "1", "--no-progress", cwd=tmp_path)
    train = json.loads((tmp_path / "data/art/train/manifest.json").read_text())["num_samples"]
    val = json.loads((tmp_path / "data/art/val/manifest.json").read_text())["num_samples"]
    assert train + val == 48 and val > 0
    # the class shards hold out the same files: one split rule
    assert json.loads((tmp_path / "data/art-classes/val/manifest.json").read_text())[
        "num_samples"] == val
    run("prep", "check", "data/art/train", "--no-progress", cwd=tmp_path)

    run("train", "--config", str(REPO / "configs/own-data.yaml"), "output_dir=runs/art",
        "data.train=data/art/train", "data.val=data/art/val", "data.batch_size=8",
        "data.workers=0", "model.name=vlc-micro", "train.steps=6", "train.log_every=2",
        "optim.warmup_steps=2", "checkpoint.every=0", "eval.zeroshot=data/art-classes/val",
        "eval.batch_size=16", "logging.progress=false", "logging.tensorboard=false", cwd=tmp_path)
    metrics = json.loads((tmp_path / "runs/art/results.json").read_text())["metrics"]
    assert "zeroshot/top1" in metrics and "retrieval/text_to_image_R@1" in metrics

    zeroshot = run("eval", "zeroshot", "--checkpoint", "runs/art", "--data",
                   "data/art-classes/val", "--workers", "0", "--out", "zs.json", cwd=tmp_path)
    record = json.loads((tmp_path / "zs.json").read_text())
    assert record["metrics"]["top1"] == pytest.approx(metrics["zeroshot/top1"])
    assert "initialized randomly" not in zeroshot.stderr

    classes = tmp_path / "data/art-classes/val/classnames.txt"
    done = run("classify", "--checkpoint", "runs/art", "--labels-file", str(classes),
               "--top-k", "3", "--json", "--workers", "0", "--no-progress", "--figure",
               "top3.png", str(corpus / "animals"), cwd=tmp_path)
    result = json.loads(done.stdout)
    assert result["num_images"] == 16 and result["num_skipped"] == 0
    assert all(len(item["top"]) == 3 for item in result["images"])
    assert (tmp_path / "top3.png").is_file()

    run("embed", "--checkpoint", "runs/art", "--images", "data/art/val", "--out", "val.npy",
        "--no-progress", cwd=tmp_path)
    embeddings = np.load(tmp_path / "val.npy")
    assert embeddings.shape[0] == val
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, rtol=1e-5)
    ids = (tmp_path / "val.npy.ids.txt").read_text().splitlines()
    assert len(ids) == val
