"""SeededTransform: augmentation as a function of (seed, epoch, image), leaving other RNG alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms

from vlcontrast.train.loop import SeededTransform


def image(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (24, 24, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture
def augment():
    return SeededTransform(transforms.Compose([transforms.RandomResizedCrop(16, scale=(0.3, 1.0)),
                                               transforms.ToTensor()]), seed=7)


def test_same_image_and_epoch_give_the_same_augmentation(augment):
    first = augment(image(0))
    torch.rand(5)  # whatever else draws in between
    assert torch.equal(augment(image(0)), first)
    assert not torch.equal(augment(image(1))[:, :8, :8], first[:, :8, :8])
    augment.epoch = 1
    assert not torch.equal(augment(image(0)), first)  # a new epoch draws new crops


def test_the_callers_random_stream_is_untouched(augment):
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    augment(image(2))
    assert torch.equal(torch.rand(4), expected)


def test_only_the_cpu_generator_is_seeded(augment, monkeypatch):
    # torch.manual_seed would queue a lazy CUDA seed (formatting the Python stack) per image.
    monkeypatch.setattr(torch, "manual_seed", lambda seed: pytest.fail("torch.manual_seed called"))
    augment(image(3))


def test_an_unseeded_transform_is_called_as_is_and_leaves_the_generators_alone(monkeypatch):
    # data.augment=false: the evaluation transform has no randomness to seed, so nothing is
    # hashed or seeded per image.
    calls = []
    plain = SeededTransform(lambda im: calls.append(im) or "out", seed=7, random=False)
    class Untouchable:
        def __getattr__(self, name):
            pytest.fail(f"{name} used per image")

    import vlcontrast.train.batches as batches

    monkeypatch.setattr(torch, "default_generator", Untouchable())
    monkeypatch.setattr(batches, "zlib", Untouchable())
    im = image(4)
    assert plain(im) == "out" and calls == [im]
