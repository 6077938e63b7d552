"""EXIF orientation in ``vlcontrast.load``'s preprocess and ``embed``/``classify``'s file reader:
a JPEG stored 64x32 with orientation 6 is fed upright (32x64), as ``prep folder`` writes it."""

from __future__ import annotations

import torchvision.transforms as T
from PIL import Image

from vlcontrast.evaluation.datasets import build_image_files_loader
from vlcontrast.inference.model import WhiteBackground

STORED, UPRIGHT = (64, 32), (32, 64)


def write_jpeg(path, orientation: int | None) -> None:
    options = {}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        options["exif"] = exif.tobytes()
    Image.new("RGB", STORED, (10, 200, 30)).save(path, format="JPEG", **options)


def test_load_preprocess_turns_an_opened_photo_upright(tmp_path):
    write_jpeg(tmp_path / "tagged.jpg", 6)
    write_jpeg(tmp_path / "plain.jpg", None)
    preprocess = WhiteBackground(T.ToTensor())
    with Image.open(tmp_path / "tagged.jpg") as image:
        assert tuple(preprocess(image).shape) == (3, UPRIGHT[1], UPRIGHT[0])
    with Image.open(tmp_path / "plain.jpg") as image:
        assert tuple(preprocess(image).shape) == (3, STORED[1], STORED[0])


def test_embed_and_classify_read_files_upright(tmp_path):
    write_jpeg(tmp_path / "tagged.jpg", 6)
    write_jpeg(tmp_path / "plain.jpg", None)
    for name, size in (("tagged.jpg", UPRIGHT), ("plain.jpg", STORED)):
        for alpha in ("white", "drop"):
            loader = build_image_files_loader([tmp_path / name], T.ToTensor(), batch_size=1,
                                              alpha=alpha)
            images = next(iter(loader.loader))[0]
            assert tuple(images.shape) == (1, 3, size[1], size[0]), (name, alpha)


def test_classify_s_figure_shows_the_photo_as_the_model_saw_it(tmp_path):
    """The grid opened the file itself and drew a photo shot sideways as stored."""
    import matplotlib.pyplot as plt
    import torch

    from vlcontrast.inference.classify import Classification, draw_classification

    write_jpeg(tmp_path / "tagged.jpg", 6)
    result = Classification(labels=["a", "b"], templates=["{}"], paths=[tmp_path / "tagged.jpg"],
                            kept=[0], top_labels=torch.tensor([[0, 1]]),
                            top_probs=torch.tensor([[0.6, 0.4]]),
                            probs=torch.tensor([[0.6, 0.4]]), skipped=[], reasons={})
    figure = draw_classification(result)
    try:
        drawn = figure.axes[0].get_images()[0].get_array()
        assert drawn.shape[:2] == (UPRIGHT[1], UPRIGHT[0])
    finally:
        plt.close(figure)
