"""Cached features of a locked image tower (``model.lock_image_features``).

With the image tower locked (LiT) and a deterministic training transform (``data.augment=false``),
the tower maps each training image to the same feature vector at every step. A cell of the loss
study would recompute those vectors thousands of times; this module computes them once per
(starting checkpoint, training shards) and lets the training step look them up by sample id.

* :func:`write_feature_cache` builds the model exactly as training does (same ``model.*`` options,
  the same frozen batch norms, the same transform through the same loader), embeds every training
  sample once with ``encode_image`` and writes ``{ids, features, key}`` to one ``.pt`` file.
* :class:`LockedImageFeatures` loads it, refuses a file made from another checkpoint, other shards
  or another transform (its ``key``), swaps each micro-batch's images for the stored features
  (:meth:`swap`) and makes the model's ``encode_image`` pass such features through
  (:meth:`install`) while real images (evaluation) still go through the tower.

Exactness. The stored vectors are the tower's output for the same input tensors; the only
difference from running the tower inside the step is the batch they were computed in (a chunk of
:data:`CHUNK` here, the training batch there), which can change the last bits of a float
convolution. ``tests/train/test_feature_cache.py`` checks that a run with the cache and one without
give the same losses and weights to float tolerance (1e-5), and that the stored features equal
the tower's output on the same chunk bit for bit.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from vlcontrast.config import DataConfig, ModelConfig
from vlcontrast.errors import ConfigError

FORMAT = 2  # 2: manifests hashed without the converter's source location (SOURCE_LOCATION_KEYS)

# Where a converter read its input (``prep folder``'s folder, ``prep csv``'s table): absolute paths
# of one machine, not what the shards hold, so left out of the key. A checkout elsewhere, with the
# same shards, keeps its caches.
SOURCE_LOCATION_KEYS = ("folder", "table")
CHUNK = 256
"""Images embedded per forward pass when the cache is built."""


def tower_digest(weights: Path) -> str:
    """sha256 over the image tower's tensors (``visual.*``) of a ``model.pt``, or of a
    transformers ``CLIPModel`` directory's tensors mapped to open_clip's names: the cache does not
    depend on the text tower, the temperature or the bias (SigLIP's warm start changes those)."""
    from vlcontrast.checkpoints import is_transformers_clip
    from vlcontrast.evaluation.image_cache import tensors_digest

    if is_transformers_clip(weights):
        from vlcontrast.models.transformers_clip import load_transformers_clip

        _, state, _ = load_transformers_clip(weights)
    else:
        from vlcontrast.checkpoints import load_file

        state = load_file(Path(weights))  # damaged: one line naming it and the checkpoint before
    return tensors_digest({k: v for k, v in state.items() if k.startswith("visual.")})


def manifest_digest(path: Path) -> str:
    """sha256 of a shard folder's ``manifest.json`` without its source location."""
    manifest = json.loads(path.read_text())
    for key in SOURCE_LOCATION_KEYS:
        manifest.pop(key, None)
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]


def cache_key(model: ModelConfig, data: DataConfig) -> dict[str, Any]:
    """What the cached features depend on: the image tower's starting weights, the model and its
    locking, the training shards and their manifest, and the transform."""
    from vlcontrast.checkpoints import resolve_weights

    from vlcontrast.checkpoints import is_transformers_clip

    weights = (Path(model.pretrained) if is_transformers_clip(model.pretrained) else
               resolve_weights(model.pretrained) / "model.pt") if model.pretrained else None
    manifests = []
    for part in str(data.train).split("::"):
        path = Path(part.split("@")[0])
        folder = path if path.is_dir() else path.parent
        manifest = folder / "manifest.json"
        if manifest.is_file():
            manifests.append(manifest_digest(manifest))
    return {
        "format": FORMAT,
        "image_tower_sha256": tower_digest(weights) if weights else None,
        "model": model.name,
        "lock_image_freeze_bn_stats": model.lock_image_freeze_bn_stats,
        "train": str(data.train),
        "manifests": manifests,
        "transform": "preprocess_val",  # data.augment=false: open_clip's evaluation transform
    }


def check_cacheable(model: ModelConfig, data: DataConfig, precision: str) -> None:
    """The run may use cached features only where they are the tower's exact output."""
    problems = []
    if not model.lock_image or model.lock_image_unlocked_groups:
        problems.append("needs model.lock_image=true with model.lock_image_unlocked_groups=0")
    if not model.pretrained:
        problems.append("needs model.pretrained (features of random weights are not a study's "
                        "starting point)")
    if data.augment:
        problems.append("needs data.augment=false (random crops change the features every epoch)")
    if data.normalize_on_device:
        problems.append("does not work with data.normalize_on_device=true")
    if precision != "fp32":
        problems.append("is exact only in fp32 (train.precision=fp32)")
    if problems:
        raise ConfigError(f"model.lock_image_features={model.lock_image_features!r}: "
                          + "; ".join(problems))


@torch.no_grad()
def write_feature_cache(model_cfg: ModelConfig, data: DataConfig, out: str | Path, *,
                        precision: str = "fp32", siglip: bool = False) -> dict[str, Any]:
    """Embed every training sample of ``data.train`` with the locked tower of ``model_cfg`` and
    write the cache to ``out``; returns its summary. ``siglip``: build the model with a logit
    bias, as the run's loss will (it does not change the image features)."""
    from vlcontrast.data.loader import build_train_loader
    from vlcontrast.models import build_model
    from vlcontrast.train.batches import SeededTransform

    check_cacheable(model_cfg, data, precision)
    bundle = build_model(model_cfg, siglip=siglip, device="cpu")
    model = bundle.model.eval()
    data_cfg = type(data)(**{**vars(data), "batch_size": 1, "workers": 0,
                                    "shuffle_buffer": 0, "cache_mb": 0})
    loader = build_train_loader(data_cfg, SeededTransform(bundle.preprocess_val, 0, random=False),
                                bundle.tokenizer, seed=0, rank=0, world_size=1)
    ids, features, pending, pending_ids = [], [], [], []

    def flush():
        if pending:
            features.append(model.encode_image(torch.cat(pending)).float())
            ids.append(torch.cat(pending_ids))
            pending.clear()
            pending_ids.clear()

    for batch in loader:
        pending.append(batch.images)
        pending_ids.append(batch.sample_ids)
        if len(pending) == CHUNK:
            flush()
    flush()
    all_ids, all_features = torch.cat(ids), torch.cat(features)
    order = torch.argsort(all_ids)
    all_ids, all_features = all_ids[order], all_features[order].contiguous()
    if len(torch.unique(all_ids)) != len(all_ids):
        raise ConfigError(f"data.train={data.train!r}: sample ids are not unique; the "
                         "feature cache needs one id per sample")
    key = cache_key(model_cfg, data)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    torch.save({"key": key, "ids": all_ids, "features": all_features}, tmp)
    tmp.replace(out)
    return {"path": str(out), "samples": len(all_ids), "dim": all_features.shape[1], "key": key}


class ImagePlaceholder:
    """The training transform under a feature cache. The loader decodes no image for it
    (``image_ids``: the samples the cache holds; any other is skipped and counted as
    ``not_in_feature_cache``), and ``swap`` later puts each sample's stored feature in the place
    of the empty tensor it returns. The batches are the ones decoding would give: the cache holds
    exactly the samples whose image decoded and transformed when it was written."""

    def __init__(self, image_ids: torch.Tensor):
        self.image_ids = frozenset(image_ids.tolist())

    def __call__(self, image) -> torch.Tensor:
        return torch.empty(0)


class LockedImageFeatures:
    """The cached features of one run (see the module docstring)."""

    def __init__(self, path: str | Path, model: ModelConfig, data: DataConfig, precision: str):
        check_cacheable(model, data, precision)
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"model.lock_image_features={str(path)!r}: file does not exist "
                              "(vlcontrast.train.feature_cache.write_feature_cache makes it)")
        stored = read_cache(path)
        expected = cache_key(model, data)
        if stored.get("key") != expected:
            differs = sorted(k for k in expected if stored.get("key", {}).get(k) != expected[k])
            raise ConfigError(f"model.lock_image_features={str(path)!r}: made for another "
                              f"run ({', '.join(differs)} differ); rebuild it")
        self.ids: torch.Tensor = stored["ids"]
        self.features: torch.Tensor = stored["features"]

    def placeholder(self) -> ImagePlaceholder:
        """The training transform that stands for these features (no image decoded)."""
        return ImagePlaceholder(self.ids)

    def lookup(self, sample_ids: torch.Tensor) -> torch.Tensor:
        """The stored features of ``sample_ids`` (``[B, D]``); every id must be in the cache."""
        index = torch.searchsorted(self.ids, sample_ids).clamp_(max=len(self.ids) - 1)
        found = self.ids[index] == sample_ids
        if not bool(found.all()):
            missing = sample_ids[~found][:5].tolist()
            raise KeyError(f"model.lock_image_features: sample ids {missing} are not in the cache")
        return self.features[index]

    def swap(self, micro_batches: list) -> list:
        """Each micro-batch with its images replaced by their cached features."""
        return [batch._replace(images=self.lookup(batch.sample_ids)) for batch in micro_batches]

    @staticmethod
    def install(model: torch.nn.Module) -> None:
        """``model.encode_image`` passes ``[B, D]`` features through (normalised when asked) and
        sends ``[B, C, H, W]`` images to the tower as before. An instance attribute, so the state
        dict, the checkpoints and evaluation are unchanged."""
        tower_encode = model.encode_image

        def encode_image(image, normalize: bool = False):
            if image.dim() == 2:
                return F.normalize(image, dim=-1) if normalize else image
            return tower_encode(image, normalize=normalize)

        model.encode_image = encode_image

    @staticmethod
    def check_frozen(model: torch.nn.Module) -> None:
        """Batch norms of the tower must be frozen: in training mode a live batch norm normalises
        with the batch's statistics, so the tower's output would depend on the batch."""
        live = [name for name, module in model.visual.named_modules()
                if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)]
        if live:
            raise ConfigError("model.lock_image_features: the image tower has live batch norms "
                              f"({live[0]}, ...); set model.lock_image_freeze_bn_stats=true")


REBUILD = ("delete it and make it again (vlcontrast.train.feature_cache.write_feature_cache; a "
           "study makes a deleted one anew)")
"""The fix for a cache file that cannot be used."""


def read_cache(path: str | Path) -> dict[str, Any]:
    """The cache file ``path`` as written (``key``, ``ids``, ``features``): tensors only, never
    code. A damaged one (cut short, overwritten) or a file that is no feature cache is a one-line
    ConfigError naming it and :data:`REBUILD`, not torch's traceback."""
    from vlcontrast.checkpoints import load_file
    from vlcontrast.errors import CheckpointError

    path = Path(path)
    try:
        stored = load_file(path, fix=REBUILD, kind="feature cache")
    except CheckpointError as err:  # the option first, as every line of the cache's
        raise ConfigError(f"model.lock_image_features={str(path)!r}: "
                          f"{str(err).removeprefix(f'{path}: ')}") from None
    lacking = (sorted({"key", "ids", "features"} - set(stored)) if isinstance(stored, dict)
               else [])
    if not isinstance(stored, dict) or lacking:
        what = (f"a {type(stored).__name__}" if not isinstance(stored, dict) else
                f"a dict without {', '.join(lacking)}")
        raise ConfigError(f"model.lock_image_features={str(path)!r}: not a feature cache (it "
                          f"holds {what}); {REBUILD}")
    return stored


def describe(path: str | Path) -> str:
    stored = read_cache(path)
    return json.dumps({"samples": len(stored["ids"]), "dim": stored["features"].shape[1],
                       "key": stored["key"]})
