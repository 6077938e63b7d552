"""``model.lock_image_features``: the locked tower's cached features are its exact output, a run
with the cache trains like one without (same losses and weights to float tolerance), a cache made
for another checkpoint is refused, and the starting checkpoint of a tiny study rebuilds bit for
bit on this machine."""

import json
import os
from pathlib import Path

import pytest
import torch

from vlcontrast.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
BASE = str(ROOT / "configs" / "study" / "cell.yaml")


def _data(tmp: Path) -> Path:
    from vlcontrast.data.prep.synthetic import write_synthetic

    root = tmp / "data"
    if not (root / "train" / "manifest.json").is_file():
        write_synthetic(root, train=192, val=32, seed=3, image_size=32, shard_size=96,
                        zeroshot_per_class=2, workers=1, progress=False)
    return root


def _overrides(tmp: Path, data: Path, out: str, *extra: str) -> list[str]:
    return [f"output_dir={tmp / out}", f"data.train={data / 'train'}", f"data.val={data / 'val'}",
            f"eval.zeroshot={data / 'zeroshot'}", "data.workers=0", "data.batch_size=32",
            "train.steps=6", "optim.warmup_steps=1", "train.log_every=1", "eval.every=0",
            "logging.progress=false", "checkpoint.every=0", "eval.batch_size=64", *extra]


def _train(overrides: list[str]):
    from vlcontrast.train.loop import train

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return train(load_config(BASE, overrides))


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from vlcontrast.checkpoints import resolve_weights

    return torch.load(resolve_weights(str(run)) / "model.pt", weights_only=True)


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if json.loads(line).get("kind") == "train"]


LIT = ["model.lock_image=true", "model.lock_image_freeze_bn_stats=true", "data.augment=false",
       "model.init_logit_bias=-10"]


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A tiny starting checkpoint (both towers, a few steps) and its data."""
    tmp = tmp_path_factory.mktemp("cache")
    data = _data(tmp)
    _train(_overrides(tmp, data, "start", "seed=0", "model.init_logit_bias=-10"))
    return tmp, data


def test_cached_features_are_the_towers_output(start, tmp_path):
    from vlcontrast.models import build_model
    from vlcontrast.train.feature_cache import CHUNK, write_feature_cache

    tmp, data = start
    config = load_config(BASE, _overrides(tmp, data, "x", f"model.pretrained={tmp / 'start'}", *LIT))
    summary = write_feature_cache(config.model, config.data, tmp_path / "f.pt")
    assert summary["samples"] == 192
    stored = torch.load(tmp_path / "f.pt", weights_only=True)
    assert torch.equal(stored["ids"], torch.sort(stored["ids"]).values)
    # the tower on the same images (the loader's evaluation transform), in the same chunk
    bundle = build_model(config.model, device="cpu")
    from vlcontrast.data.loader import build_train_loader
    from vlcontrast.train.batches import SeededTransform

    cfg = type(config.data)(**{**vars(config.data), "batch_size": 1, "shuffle_buffer": 0})
    loader = build_train_loader(cfg, SeededTransform(bundle.preprocess_val, 0, random=False),
                                bundle.tokenizer, seed=0, rank=0, world_size=1)
    batches = list(loader)
    images = torch.cat([b.images for b in batches[:CHUNK]])
    ids = torch.cat([b.sample_ids for b in batches[:CHUNK]])
    with torch.no_grad():
        direct = bundle.model.eval().encode_image(images)
    index = torch.searchsorted(stored["ids"], ids)
    assert torch.equal(stored["features"][index], direct)


def test_a_run_with_the_cache_trains_like_one_without(start, monkeypatch):
    from vlcontrast.train.feature_cache import LockedImageFeatures, write_feature_cache

    tmp, data = start
    pretrained = f"model.pretrained={tmp / 'start'}"
    config = load_config(BASE, _overrides(tmp, data, "x", pretrained, *LIT))
    write_feature_cache(config.model, config.data, tmp / "features.pt")
    _train(_overrides(tmp, data, "plain", pretrained, *LIT))
    swapped_in = []
    swap = LockedImageFeatures.swap

    def spy(self, micro_batches):
        swapped_in.extend(batch.images.shape for batch in micro_batches)
        return swap(self, micro_batches)

    monkeypatch.setattr(LockedImageFeatures, "swap", spy)
    _train(_overrides(tmp, data, "cached", pretrained, *LIT,
                      f"model.lock_image_features={tmp / 'features.pt'}"))
    # the loader never resized an image that the cache replaces: placeholders came in
    assert swapped_in and all(shape[1:] == (0,) for shape in swapped_in)
    plain, cached = _losses(tmp / "plain"), _losses(tmp / "cached")
    assert len(plain) == len(cached) == 6
    assert plain == pytest.approx(cached, rel=1e-5, abs=1e-6)
    a, b = _weights(tmp / "plain"), _weights(tmp / "cached")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=1e-5, atol=1e-6), key
    # evaluation ran the real tower in both: the same retrieval numbers
    ra = json.loads((tmp / "plain" / "results.json").read_text())["metrics"]
    rb = json.loads((tmp / "cached" / "results.json").read_text())["metrics"]
    assert ra["retrieval/text_to_image_R@1"] == rb["retrieval/text_to_image_R@1"]


def test_a_cache_for_other_weights_or_an_augmented_run_is_refused(start, tmp_path):
    from vlcontrast.train.feature_cache import LockedImageFeatures, write_feature_cache

    tmp, data = start
    config = load_config(BASE, _overrides(tmp, data, "x", f"model.pretrained={tmp / 'start'}", *LIT))
    write_feature_cache(config.model, config.data, tmp_path / "f.pt")
    other = load_config(BASE, _overrides(tmp, data, "x", f"model.pretrained={tmp / 'plain'}", *LIT))
    if (tmp / "plain").is_dir():
        with pytest.raises(ConfigError, match="image_tower_sha256"):
            LockedImageFeatures(tmp_path / "f.pt", other.model, other.data, "fp32")
    augmented = load_config(BASE, _overrides(tmp, data, "x", f"model.pretrained={tmp / 'start'}",
                                             *[o for o in LIT if "augment" not in o]))
    with pytest.raises(ConfigError, match="data.augment=false"):
        LockedImageFeatures(tmp_path / "f.pt", augmented.model, augmented.data, "fp32")
    with pytest.raises(ConfigError, match="applies only with model.lock_image=true"):
        load_config(BASE, _overrides(tmp, data, "x", f"model.lock_image_features={tmp_path}/f.pt"))


def test_the_starting_checkpoint_rebuilds_bit_for_bit(start):
    """Same seed, same data, one thread: the same model.pt (the study's starting checkpoints rely
    on it; docs/loss-study-v2.md names the pins)."""
    from vlcontrast.study.cells import model_digest

    tmp, data = start
    _train(_overrides(tmp, data, "start-again", "seed=0", "model.init_logit_bias=-10"))

    assert model_digest(tmp / "start") == model_digest(tmp / "start-again")


def test_the_cache_key_names_what_the_shards_hold_not_where_they_came_from(start, tmp_path):
    """A converter's source folder or table (an absolute path of one machine) is not part of the
    key: the same shards in a checkout elsewhere keep their cache. Another shard count is."""
    import shutil

    from vlcontrast.train.feature_cache import cache_key

    tmp, data = start
    keys = []
    for name, change in (("here", {"folder": "/work/a/images"}), ("there", {"folder": "/b/images"}),
                         ("table", {"table": "/c/list.csv"}), ("fewer", {"num_samples": 1})):
        train = tmp_path / name / "train"
        shutil.copytree(data / "train", train)
        manifest = json.loads((train / "manifest.json").read_text())
        (train / "manifest.json").write_text(json.dumps({**manifest, **change}))
        config = load_config(BASE, _overrides(tmp, data, "x", f"model.pretrained={tmp / 'start'}",
                                              *LIT, f"data.train={train}"))
        keys.append(cache_key(config.model, config.data)["manifests"])
    here, there, table, fewer = keys
    assert here == there == table and len(here) == 1
    assert fewer != here


def test_runs_sharing_a_feature_cache_share_their_zero_shot_image_features(start, tmp_path,
                                                                           monkeypatch):
    """The first run under model.lock_image_features keeps its zero-shot image features beside
    the cache (<cache>.eval/), its retrieval image features (the same folder) and its training
    rows (<cache>.rows/); the next run reads them, opens no zero-shot image, no retrieval shard
    and no training shard, and writes the same losses and metrics bit for bit."""
    import vlcontrast.data.stream as stream
    import vlcontrast.evaluation.runner as runner
    from vlcontrast.train.feature_cache import write_feature_cache

    tmp, data = start
    pretrained = f"model.pretrained={tmp / 'start'}"
    features = tmp_path / "features.pt"
    config = load_config(BASE, _overrides(tmp, data, "x", pretrained, *LIT))
    write_feature_cache(config.model, config.data, features)
    run = [pretrained, *LIT, f"model.lock_image_features={features}", "data.cache_mb=64"]
    _train(_overrides(tmp_path, data, "first", *run))
    assert len(list((tmp_path / "features.pt.eval").glob("zeroshot-*.pt"))) == 1
    assert len(list((tmp_path / "features.pt.rows").glob("rows-*.pt"))) == 1
    assert len(list((tmp_path / "features.pt.eval").glob("retrieval-*.pt"))) == 1
    import vlcontrast.evaluation.embed as embed

    monkeypatch.setattr(embed, "encode_retrieval_images",
                        lambda *a, **k: pytest.fail("the second run embedded retrieval images"))
    monkeypatch.setattr(runner, "build_zeroshot_loader",
                        lambda *a, **k: pytest.fail("the second run opened the zero-shot images"))
    monkeypatch.setattr(stream, "read_shard",
                        lambda *a, **k: pytest.fail("the second run read a training shard"))
    _train(_overrides(tmp_path, data, "second", *run))
    assert _losses(tmp_path / "first") == _losses(tmp_path / "second")
    first = json.loads((tmp_path / "first" / "results.json").read_text())["metrics"]
    second = json.loads((tmp_path / "second" / "results.json").read_text())["metrics"]
    assert any(key.startswith("zeroshot/") for key in first)
    assert {k: v for k, v in first.items() if not k.startswith("time")} == \
        {k: v for k, v in second.items() if not k.startswith("time")}
