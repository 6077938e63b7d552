"""Zero-shot classification of the user's own images against labels they name.

Each label's prompts (``template`` with ``{c}`` replaced) are embedded, normalised, averaged and
normalised again (open_clip's zero-shot classifier, :func:`vlcontrast.evaluation.zeroshot.
build_zeroshot_classifier`); an image's probabilities are the softmax over labels of
``exp(logit_scale) * cosine(image, label)``, the model's own trained temperature.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from vlcontrast.data.samples import DEFAULT_MAX_IMAGE_PIXELS, to_rgb
from vlcontrast.errors import ConfigError

DEFAULT_TEMPLATES = ("itap of a {c}.", "a bad photo of the {c}.", "a origami {c}.",
                     "a photo of the large {c}.", "a {c} in a video game.", "art of the {c}.",
                     "a photo of the small {c}.")
"""CLIP's seven-prompt ImageNet ensemble (open_clip's ``SIMPLE_IMAGENET_TEMPLATES``)."""


def parse_labels(labels: str | None = None, labels_file: str | os.PathLike | None = None
                 ) -> list[str]:
    """The class labels from ``--labels "cat,dog"`` or ``--labels-file`` (one per line, or a JSON
    list); one-line errors for none, both, or what :func:`check_labels` refuses."""
    from vlcontrast.evaluation.datasets import check_list_file, read_list_file

    if labels and labels_file:
        raise ConfigError("--labels and --labels-file: give one of them, not both")
    if labels_file:
        check_list_file(labels_file, "--labels-file", "one label per line")
        names, source = read_list_file(labels_file), f"--labels-file {str(labels_file)!r}"
    else:
        names = [part.strip() for part in (labels or "").split(",") if part.strip()]
        source = "--labels"
    return check_labels(names, source,
                        example='--labels "cat,dog,car" or --labels-file labels.txt')


def check_labels(names: Sequence[str], source: str = "labels",
                 example: str = "labels=['cat', 'dog', 'car']") -> list[str]:
    """The labels of one classification, the one check of the command line (:func:`parse_labels`)
    and of :func:`classify`: at least two (one label would get every image with probability 1)
    and each once, case-insensitively (the tokenizer lowercases, so ``cat`` and ``Cat`` would
    split one label's probability in two). ``source`` names where they came from in the errors
    (``--labels``; ``labels``, the Python parameter), ``example`` shows what to give."""
    names = list(names)
    if len(names) < 2:
        raise ConfigError(f"{source}: {len(names)} label(s); zero-shot classification needs at "
                          f"least two, e.g. {example}")
    seen: set[str] = set()
    for name in names:
        if name.lower() in seen:
            raise ConfigError(f"{source}: label {name!r} is given twice; give each label once")
        seen.add(name.lower())
    return names


def check_top_k(top_k: int, what: str = "top_k=") -> int:
    """``top_k`` (labels shown per image) of at least 1; ``what`` names it (``--top-k ``)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"{what}{top_k!r}: must be at least 1")
    return top_k


@dataclass
class Classification:
    """Top-k labels per readable image, and the images that could not be read."""
    paths: list[Path]
    labels: list[str]
    templates: list[str]
    kept: list[int]                 # indices into paths, one per row of top_labels/top_probs
    top_labels: torch.Tensor        # [N_kept, k] label indices, most probable first
    top_probs: torch.Tensor         # [N_kept, k]
    probs: torch.Tensor             # [N_kept, C] every label's probability
    skipped: list[int]
    reasons: dict[str, int]
    alpha: str = "white"            # the transparency rule the images were read with
    transparent: int = 0            # read images that had transparency
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS   # the limit the images were read under

    def to_dict(self) -> dict:
        return {
            "labels": self.labels,
            "templates": self.templates,
            "images": [{"image": str(self.paths[index]),
                        "top": [{"label": self.labels[int(c)], "prob": float(p)}
                                for c, p in zip(classes, probs)]}
                       for index, classes, probs in zip(self.kept, self.top_labels,
                                                        self.top_probs)],
            "num_images": len(self.kept),
            "num_skipped": len(self.skipped),
            "skipped": [str(self.paths[index]) for index in self.skipped],
            "skipped_reasons": self.reasons,
            "alpha": self.alpha,
            "num_transparent": self.transparent,
        }


@torch.no_grad()
def classify(model, preprocess, tokenizer, paths: Sequence[str | os.PathLike],
             labels: Sequence[str], *, templates: Sequence[str] = DEFAULT_TEMPLATES,
             top_k: int = 5, device: str | torch.device | None = None, batch_size: int = 64,
             workers: int = 0, progress: bool = True, alpha: str = "white",
             max_image_pixels: int | None = None) -> Classification:
    """Classify the images at ``paths`` (files: :func:`~vlcontrast.inference.find_images` expands
    folders) among ``labels`` (a list of at least two, each once) with the prompts ``templates``
    (each with ``{c}``); see the module docstring. ``device``: None computes on the model's own
    device. ``alpha``: the transparency rule (:data:`~vlcontrast.data.samples.ALPHA_RULES`);
    images of more than ``max_image_pixels`` pixels (None: PIL's limit) are skipped as
    ``decompression_bomb``. Every argument is checked before any image is read: a one-line
    :class:`ConfigError` naming the parameter. Under a process group of several ranks
    (``torchrun``) every rank calls it and embeds every world-th image; the features are
    gathered, so every rank gets the whole result."""
    from vlcontrast.data.samples import check_alpha

    from vlcontrast.evaluation.datasets import check_templates
    from vlcontrast.evaluation.embed import unwrap_model
    from vlcontrast.evaluation.zeroshot import build_zeroshot_classifier
    from vlcontrast.inference.images import (check_count, check_image_paths, embed_image_files,
                                             given_list, shown, skipped_summary)
    from vlcontrast.inference.model import model_device

    paths = check_image_paths(paths)
    labels = check_labels(given_list(labels, "labels", "labels", "['cat', 'dog', 'car']"))
    templates = given_list(templates, "templates", "prompts with {c}", "['a photo of a {c}.']")
    templates = check_templates(templates, f"templates={shown(templates)}")
    alpha = check_alpha(alpha, "alpha")
    check_top_k(top_k)
    check_count(batch_size, "batch_size", 1)
    check_count(workers, "workers", 0)
    if max_image_pixels is not None:
        check_count(max_image_pixels, "max_image_pixels", 1)
    model = unwrap_model(model)
    device = model_device(model, device)
    model.eval()
    classifier = build_zeroshot_classifier(model, tokenizer, labels, templates,
                                           device=device, batch_size=batch_size)
    images = embed_image_files(model, preprocess, paths, device=device, batch_size=batch_size,
                               workers=workers, progress=progress, alpha=alpha,
                               max_image_pixels=max_image_pixels or DEFAULT_MAX_IMAGE_PIXELS)
    if not images.kept:
        raise ConfigError(f"none of the {len(paths)} images could be read ("
                          f"{skipped_summary(paths, images)}); check the files")
    scale = model.logit_scale.detach().float().exp().reshape(())
    logits = scale.to(device) * images.features.to(device) @ classifier
    probs = logits.softmax(dim=-1).cpu()
    top = probs.topk(min(top_k, len(labels)), dim=-1)
    return Classification(list(paths), list(labels), templates, images.kept, top.indices,
                          top.values, probs, images.skipped, images.reasons, alpha,
                          images.transparent, images.max_image_pixels)


def format_classification(result: Classification, as_json: bool = False) -> str:
    """A table (one image per row: its top labels with probabilities) or the JSON document; every
    column as wide as its widest cell, its header above it."""
    if as_json:
        return json.dumps(result.to_dict(), indent=2)
    names = [str(result.paths[index]) for index in result.kept]
    width = min(max(len("image"), *(len(n) for n in names)), 60)
    k = result.top_labels.shape[1]
    rows = []
    for name, classes, probs in zip(names, result.top_labels, result.top_probs):
        shown = name if len(name) <= width else "..." + name[-(width - 3):]
        rows.append([shown] + [f"{result.labels[int(c)]} ({float(p):.3f})"
                               for c, p in zip(classes, probs)])
    header = ["image"] + [f"top {i + 1}" for i in range(k)]
    widths = [width] + [max(len(row[column]) for row in [header] + rows)
                        for column in range(1, k + 1)]
    return "\n".join("  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths)).rstrip()
                     for row in [header] + rows)


def figure_formats() -> dict[str, str]:
    """The file suffixes matplotlib writes (``png``, ``pdf``, ``svg``, ``jpg`` ...) -> format."""
    from matplotlib.backend_bases import FigureCanvasBase

    return FigureCanvasBase.get_supported_filetypes()


def check_figure(path: str | os.PathLike, option: str = "--figure",
                 overwrite: bool | None = None) -> Path:
    """``--figure`` checked before any work: a writable file (not a folder) whose suffix names a
    format matplotlib writes; a one-line ConfigError naming ``option`` otherwise. ``overwrite``
    False: an existing file is refused (what it is, when it was made; ``--overwrite`` replaces
    it); None: not asked (the Python API replaces it, as ``savefig`` does)."""
    from vlcontrast.outputs import check_replaceable, made, writable_file

    out = writable_file(path, option)
    formats = figure_formats()
    suffix = out.suffix.lower().lstrip(".")
    if suffix not in formats:
        known = " ".join(f".{name}" for name in sorted(formats))
        found = f"unknown format {out.suffix!r}" if out.suffix else "no format suffix"
        raise ConfigError(f"{option} {str(path)!r}: {found}; end it in .png (or one of {known})")
    if overwrite is not None and out.exists():
        check_replaceable(f"{option} {str(path)!r}", f"{_describe_file(out)}, {made(out)}",
                          kind="a figure", is_kind=True, overwrite=overwrite)
    return out


def _describe_file(path: Path) -> str:
    """``a 1200x900 PNG image`` (from its header), else ``a file of 1,234 bytes``."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            return f"a {image.width}x{image.height} {image.format} image"
    except Exception:  # noqa: BLE001 - not an image PIL reads: say its size
        return f"a file of {path.stat().st_size:,} bytes"


TITLE_LINE_INCHES = 9 * 1.25 / 72
"""The height of one line of an image's labels (9 pt type, matplotlib's line spacing)."""
NAME_INCHES = 7 * 1.4 / 72 + 0.08
"""The height of the file name under an image (7 pt type) and the gap below it."""


def plot_classification(result: Classification, out: str | os.PathLike, *, limit: int = 12,
                        columns: int = 4, top: int = 3) -> Path:
    """A grid of the first ``limit`` classified images, each titled with its ``top`` labels and
    their probabilities, its file name under it; each row is as tall as its image plus these
    lines, so no label overlaps the name above it. The format follows the suffix of ``out``
    (:func:`check_figure`); written atomically: no temporary file is left on failure."""
    import matplotlib.pyplot as plt

    out = check_figure(out)
    figure = draw_classification(result, limit=limit, columns=columns, top=top)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp{out.suffix}")
    try:
        figure.savefig(tmp, dpi=90, format=out.suffix.lower().lstrip("."))
        tmp.replace(out)
    finally:
        plt.close(figure)
        tmp.unlink(missing_ok=True)
    return out


def draw_classification(result: Classification, *, limit: int = 12, columns: int = 4,
                        top: int = 3):
    """The figure :func:`plot_classification` writes (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    shown = list(zip(result.kept, result.top_labels, result.top_probs))[:limit]
    if not shown:
        raise ConfigError("--figure: no image was classified, nothing to draw")
    rows = -(-len(shown) // columns)
    image_inches = 3.0
    title_inches = min(top, result.top_labels.shape[1]) * TITLE_LINE_INCHES + 0.1
    height = (image_inches + title_inches + NAME_INCHES) * rows
    figure, axes = plt.subplots(rows, columns, squeeze=False, figsize=(3.2 * columns, height))
    # Each row: its labels, the image, its file name; the gaps between the images hold them.
    figure.subplots_adjust(left=0.02, right=0.98, wspace=0.08, top=1 - title_inches / height,
                           bottom=NAME_INCHES / height,
                           hspace=(title_inches + NAME_INCHES) / image_inches)
    for axis in axes.flat:
        axis.axis("off")
    for axis, (index, classes, probs) in zip(axes.flat, shown):
        with Image.open(result.paths[index]) as image:
            axis.imshow(to_rgb(image))  # as the model saw it: upright, transparency on white
        lines = [f"{result.labels[int(c)]} {float(p):.0%}" for c, p in
                 list(zip(classes, probs))[:top]]
        axis.set_title("\n".join(lines), fontsize=9, loc="left")
        axis.text(0.0, -0.02, Path(result.paths[index]).name[:40], transform=axis.transAxes,
                  fontsize=7, va="top", color="0.4")
    return figure
