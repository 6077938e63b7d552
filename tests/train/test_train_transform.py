"""data.augment: the loader's training transform is open_clip's training or evaluation transform."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vlcontrast.config import ConfigError, load_config
from vlcontrast.models import build_model
from vlcontrast.train.batches import SeededTransform
from vlcontrast.train.loop import train_transform


@pytest.fixture(scope="module")
def bundle():
    from vlcontrast.config import ModelConfig

    return build_model(ModelConfig(name="vlc-micro"))


def _images(n=4):
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (40, 40 + 7 * i, 3), dtype=np.uint8))
            for i in range(n)]


def _config(*overrides):
    return load_config(None, ["data.train=x", "model.name=vlc-micro", "train.steps=1", *overrides])


def test_augment_off_trains_on_the_evaluation_transform(bundle):
    transform, normalizer = train_transform(_config("data.augment=false").data, bundle)
    assert normalizer is None
    for im in _images():
        assert torch.equal(transform(im), bundle.preprocess_val(im))
    # the default is open_clip's random training transform
    assert train_transform(_config().data, bundle)[0] is bundle.preprocess_train


def test_augment_off_with_normalize_on_device_gives_the_same_values(bundle):
    head, normalizer = train_transform(_config("data.augment=false", "data.normalize_on_device=true").data,
                                        bundle)
    shipped = torch.stack([SeededTransform(head, 0, random=False)(im) for im in _images()])
    assert shipped.dtype == torch.uint8
    expected = torch.stack([bundle.preprocess_val(im) for im in _images()])
    assert torch.equal(normalizer(shipped, torch.device("cpu"), torch.float32), expected)


def test_model_augment_with_augment_off_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"model\.augment.*data\.augment=false"):
        _config("data.augment=false", "model.augment={gray_scale_prob: 0.2}")


@pytest.mark.parametrize("augment", [False, True])
def test_the_training_loader_caches_after_a_deterministic_transform_only(bundle, tmp_path, augment):
    # data.cache_mb reaches the rank's loader; with data.augment=false the transformed tensor is
    # kept, with augmentation the decoded image (the transform runs again each epoch).
    from types import SimpleNamespace

    from tests.data.helpers import make_shards
    from vlcontrast.train.loop import _train_batches

    make_shards(tmp_path, [8, 8])
    config = _config(f"data.train={tmp_path}", f"data.augment={str(augment).lower()}",
                     "data.cache_mb=16", "data.batch_size=4", "data.workers=0")
    transform, _ = train_transform(config.data, bundle)
    batches = _train_batches(config.data, config.seed, config.train.accum_steps,
                             SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu")),
                             bundle.tokenizer, transform)
    cache = batches.loader._stream.cache
    assert cache.max_bytes == 16 << 20 and cache.after_transform is (not augment)
    first = batches.next_step()[0]
    assert len(cache) >= 4 and first.images.shape == (4, 3, 32, 32)


def test_a_cpu_run_on_a_gpu_host_does_not_pin_memory(bundle, tmp_path, monkeypatch):
    """The loader pins memory for the training device, not because CUDA exists: a CPU run on a GPU
    host would otherwise open a CUDA context in every worker for nothing."""
    from types import SimpleNamespace

    from tests.data.helpers import make_shards
    from vlcontrast.train.loop import _train_batches

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    make_shards(tmp_path, [8])
    config = _config(f"data.train={tmp_path}", "data.batch_size=4", "data.workers=0")
    transform, _ = train_transform(config.data, bundle)
    for device, pinned in ((torch.device("cpu"), False), (torch.device("cuda", 0), True)):
        batches = _train_batches(config.data, config.seed, 1,
                                 SimpleNamespace(rank=0, world_size=1, device=device),
                                 bundle.tokenizer, transform)
        assert batches.loader.loader_options["pin_memory"] is pinned


def test_normalizing_on_the_device_is_the_default_on_cuda_only(bundle):
    from vlcontrast.data.transforms import BatchNormalizer

    data = _config().data
    assert data.normalize_on_device is None
    assert train_transform(data, bundle, torch.device("cpu"))[1] is None
    head, normalizer = train_transform(data, bundle, torch.device("cuda"))
    assert isinstance(normalizer, BatchNormalizer) and head is not bundle.preprocess_train
    off = _config("data.normalize_on_device=false").data
    assert train_transform(off, bundle, torch.device("cuda"))[1] is None


def test_decode_gpu_gives_the_workers_a_plan_and_refuses_a_cpu_run(bundle):
    from vlcontrast.data.gpu_decode import GpuBatchTransform

    data = _config("data.decode=gpu").data
    with pytest.raises(ConfigError, match="data.decode=gpu: the training device is cpu"):
        train_transform(data, bundle, torch.device("cpu"))
    plan, batch_transform = train_transform(data, bundle, torch.device("cuda"))
    assert isinstance(batch_transform, GpuBatchTransform)
    assert SeededTransform(plan, 0).gpu_plan is plan.gpu_plan
    assert plan.gpu_plan.size == tuple(bundle.preprocess_train.transforms[0].size)
