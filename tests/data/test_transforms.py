"""data.normalize_on_device: uint8 from the loader, normalised per batch, equal to open_clip's transform."""

from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image

from vlcontrast.config import ConfigError, ModelConfig
from vlcontrast.data.transforms import BatchNormalizer, ToUInt8Tensor, split_normalization
from vlcontrast.models import build_model
from vlcontrast.train.batches import SeededTransform
from vlcontrast.train.step import _to_device


def _images(n=6, size=48, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size + 5 * i, 3), dtype=np.uint8))
            for i in range(n)]


@pytest.fixture(scope="module")
def bundle():
    return build_model(ModelConfig(name="vlc-micro"))


def test_split_transform_then_batch_normalizer_equals_open_clips_transform_bit_for_bit(bundle):
    full = SeededTransform(bundle.preprocess_train, seed=3)
    head, normalizer = split_normalization(bundle.preprocess_train)
    split = SeededTransform(head, seed=3)
    images = _images()
    expected = torch.stack([full(im) for im in images])
    shipped = torch.stack([split(im) for im in images])
    assert shipped.dtype == torch.uint8 and shipped.shape == expected.shape
    got = normalizer(shipped, torch.device("cpu"), torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got, expected)  # same random crop, same arithmetic in the same order


def test_normalizer_computes_in_float32_and_casts_last():
    normalizer = BatchNormalizer((0.5, 0.25, 0.125), (0.2, 0.3, 0.4))
    images = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    reference = (images.float() / 255 - torch.tensor([0.5, 0.25, 0.125]).view(1, 3, 1, 1)) \
        / torch.tensor([0.2, 0.3, 0.4]).view(1, 3, 1, 1)
    out = normalizer(images, torch.device("cpu"), torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, reference.to(torch.bfloat16))  # not bf16 arithmetic on the way
    with pytest.raises(TypeError, match="uint8"):
        normalizer(images.float(), torch.device("cpu"), torch.float32)


def test_normalizer_copies_uint8_to_the_device_and_creates_its_constants_there():
    # The host-to-device copy must move the uint8 tensor (a quarter of the bytes), and mean/std
    # must be made on the target device once, not on the host and copied every step.
    normalizer = BatchNormalizer((0.5,) * 3, (0.25,) * 3)
    images = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    device = torch.device("cpu")
    original, calls = torch.Tensor.to, []

    def recording_to(self, *args, **kwargs):
        calls.append((self.dtype, args, kwargs))
        return original(self, *args, **kwargs)

    with mock.patch.object(torch.Tensor, "to", recording_to), \
            mock.patch("vlcontrast.data.transforms.torch.tensor", side_effect=torch.tensor) as make:
        for _ in range(3):
            normalizer(images, device, torch.float32)
    assert calls[0] == (torch.uint8, (), {"device": device, "non_blocking": True})
    assert all(call.kwargs.get("device") == device for call in make.call_args_list)
    # made once, not per batch: on a GPU each would be a pageable copy that waits for the stream
    assert make.call_count == 2


def test_to_device_uses_the_normalizer_for_images_only():
    normalizer = BatchNormalizer((0.0,) * 3, (1.0,) * 3)
    batch = (torch.full((2, 3, 2, 2), 255, dtype=torch.uint8), torch.ones(2, 5, dtype=torch.long),
             torch.arange(2))
    images, texts, ids = _to_device(batch, torch.device("cpu"), torch.float32, normalizer)
    assert images.dtype == torch.float32 and torch.all(images == 1.0)
    assert texts.dtype == torch.long and torch.equal(ids, torch.arange(2))


def test_uint8_tensor_of_grayscale_and_rgb_images():
    gray = Image.fromarray(np.arange(12, dtype=np.uint8).reshape(3, 4))
    assert ToUInt8Tensor()(gray).shape == (1, 3, 4)
    rgb = np.arange(24, dtype=np.uint8).reshape(2, 4, 3)
    out = ToUInt8Tensor()(Image.fromarray(rgb))
    assert out.is_contiguous() and torch.equal(out, torch.from_numpy(rgb).permute(2, 0, 1))


def test_a_transform_without_trailing_normalize_is_refused_by_name():
    from torchvision import transforms as T
    with pytest.raises(ConfigError, match="data.normalize_on_device"):
        split_normalization(T.Compose([T.Resize(8), T.ToTensor()]))
    with pytest.raises(ConfigError, match="use_timm"):
        split_normalization(lambda image: image)


def test_the_batch_normaliser_divides_by_device_tensors_only(monkeypatch):
    """CUDA turns a division by a Python scalar into a multiplication by its rounded reciprocal,
    which is not bit-identical to ToTensor's division by 255; every divisor must be a tensor."""
    from vlcontrast.data.transforms import BatchNormalizer

    divisors = []
    real_div = torch.Tensor.div_

    def div_(self, other, *args, **kwargs):
        divisors.append(type(other))
        return real_div(self, other, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "div_", div_)
    normalizer = BatchNormalizer((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    images = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    out = normalizer(images, "cpu", torch.float32)
    assert divisors and all(kind is torch.Tensor for kind in divisors)
    expected = (images.float() / 255 - 0.5) / 0.25
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
