"""Tiny open_clip models and generated evaluation data for the evaluation tests."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

TINY_NAME = "vlc-eval-tiny"
TINY_CFG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}
WORDS = ("red green blue small large dog cat bird car tree house boat cloud river stone "
         "flower road bright dark old new happy quiet").split()


def register_tiny(folder: str | Path) -> str:
    import open_clip

    if TINY_NAME not in open_clip.list_models():
        path = Path(folder) / f"{TINY_NAME}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(TINY_CFG))
        open_clip.add_model_config(path)
    return TINY_NAME


def tiny_model(config_folder: str | Path, seed: int = 0):
    """(model, preprocess_val, tokenizer), identical weights for identical seeds (any process)."""
    import open_clip

    name = register_tiny(config_folder)
    torch.manual_seed(seed)
    model, _, preprocess = open_clip.create_model_and_transforms(name, output_dict=True)
    model.eval()
    return model, preprocess, open_clip.get_tokenizer(name)


def image_bytes(index: int, fmt: str = "JPEG", size: int = 40) -> bytes:
    rng = np.random.default_rng(index)
    base = rng.integers(0, 256, size=(1, 1, 3))
    pixels = np.clip(base + rng.normal(0, 60, size=(size, size, 3)), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def caption(index: int, variant: int = 0) -> str:
    rng = np.random.default_rng(10_000 + 97 * index + variant)
    return "a photo of " + " ".join(rng.choice(WORDS, size=4))


def _add(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))


def write_retrieval_shards(folder, num_samples: int, per_shard: int, captions_per_image=1,
                           style: str = "txt", sizes_json: bool = True, broken=()):
    """img2dataset-layout shards; returns the captions of each sample in order.

    ``style``: "txt" (one caption per line), "json" (a ``captions`` list in .json, .txt holds the
    first). ``captions_per_image``: an int or a function of the sample index. ``broken``: sample
    indices whose image bytes are garbage.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    all_captions, sizes = [], {}
    for shard in range((num_samples + per_shard - 1) // per_shard):
        name = f"{shard:05d}.tar"
        rows = range(shard * per_shard, min((shard + 1) * per_shard, num_samples))
        with tarfile.open(folder / name, "w") as archive:
            for row, index in enumerate(rows):
                key = f"{shard * 10_000 + row:09d}"
                count = captions_per_image(index) if callable(captions_per_image) else captions_per_image
                texts = [caption(index, v) for v in range(count)]
                all_captions.append(texts)
                data = b"not an image" if index in broken else image_bytes(index)
                _add(archive, f"{key}.jpg", data)
                meta = {"key": key, "caption": texts[0]}
                if style == "json":
                    meta["captions"] = texts
                    _add(archive, f"{key}.txt", texts[0].encode())
                else:
                    _add(archive, f"{key}.txt", "\n".join(texts).encode())
                _add(archive, f"{key}.json", json.dumps(meta).encode())
        sizes[name] = len(rows)
    if sizes_json:
        (folder / "sizes.json").write_text(json.dumps(sizes))
    return all_captions


def write_clip_benchmark_wds(folder, num_samples: int, per_shard: int, *, task: str,
                             labels=None, classnames=None, templates=None, captions_per_image=2):
    """CLIP_benchmark's webdataset layout (``test/nshards.txt``, ``test/0.tar`` ...)."""
    folder = Path(folder)
    (folder / "test").mkdir(parents=True, exist_ok=True)
    count = (num_samples + per_shard - 1) // per_shard
    captions = []
    for shard in range(count):
        with tarfile.open(folder / "test" / f"{shard}.tar", "w") as archive:
            for index in range(shard * per_shard, min((shard + 1) * per_shard, num_samples)):
                key = f"s{index:07d}"
                _add(archive, f"{key}.webp", image_bytes(index, "WEBP"))
                if task == "retrieval":
                    texts = [caption(index, v) for v in range(captions_per_image)]
                    captions.append(texts)
                    _add(archive, f"{key}.txt", "\n".join(texts).encode())
                else:
                    _add(archive, f"{key}.cls", str(labels[index]).encode())
    (folder / "test" / "nshards.txt").write_text(str(count))
    if task == "retrieval":
        (folder / "dataset_type.txt").write_text("retrieval")
    else:
        (folder / "classnames.txt").write_text("\n".join(classnames) + "\n")
        (folder / "zeroshot_classification_templates.txt").write_text("\n".join(templates) + "\n")
    return captions


def write_image_folder(folder, class_dirs, per_class: int, start: int = 0):
    """ImageFolder with ``per_class`` images in each of ``class_dirs``; returns (path, label) list."""
    folder = Path(folder)
    samples, index = [], start
    for label, name in enumerate(sorted(class_dirs)):
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            path = folder / name / f"img_{i:03d}.png"
            path.write_bytes(image_bytes(index, "PNG"))
            samples.append((str(path), label))
            index += 1
    return samples


def write_fake_checkpoint(run_dir, model, step: int = 100) -> Path:
    """The documented checkpoint layout (model.pt, model_config.json, config.yaml, latest)."""
    folder = Path(run_dir) / "checkpoints" / f"step_{step:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), folder / "model.pt")
    (folder / "model_config.json").write_text(json.dumps(
        {"model_name": TINY_NAME, "model_cfg": TINY_CFG, "init_logit_scale": float(np.log(1 / 0.07)),
         "init_logit_bias": None}))
    (folder / "config.yaml").write_text(f"model:\n  name: {TINY_NAME}\n")
    (Path(run_dir) / "checkpoints" / "latest").write_text(folder.name)
    return folder


def naive_ranks(image_features, text_features, text_to_image):
    """Reference: full score matrix, stable descending argsort, first positive's position."""
    text_to_image = torch.as_tensor(text_to_image)
    scores = text_features.double() @ image_features.double().t()
    order = torch.sort(-scores, dim=1, stable=True).indices
    text_ranks = (order == text_to_image.unsqueeze(1)).int().argmax(dim=1)
    order_i = torch.sort(-scores.t(), dim=1, stable=True).indices
    positive = text_to_image[order_i] == torch.arange(image_features.shape[0]).unsqueeze(1)
    image_ranks = positive.int().argmax(dim=1)
    return image_ranks, text_ranks
