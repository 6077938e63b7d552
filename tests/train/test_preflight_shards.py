"""The preflight refuses training data that could only fail later: the folder of an unfinished
``vlcontrast prep`` run, and shards with no member matching ``data.caption_key``/``image_key``."""

from __future__ import annotations

import json

import pytest

from vlcontrast.errors import ConfigError



def test_an_unfinished_prep_folder_is_refused_before_the_model_is_built(synthetic_data, tmp_path,
                                                                        no_model):
    from tests.data.helpers import make_shards
    from tests.train.helpers import tiny_config
    from vlcontrast.data.shards import PREP_STATE_FILE

    partial = tmp_path / "partial"
    make_shards(partial, [40], metadata=False)
    (partial / PREP_STATE_FILE).write_text(json.dumps({"fingerprint": "f", "shards": {
        "00000.tar": {"shard": "00000.tar", "written": 40, "skipped": {}, "examples": {}}}}))
    config = tiny_config(synthetic_data, tmp_path / "run")
    config.data.train = str(partial)
    with pytest.raises(ConfigError, match=(
            rf"^data\.train='{partial}': '{partial}' is an unfinished `vlcontrast prep` output "
            r"\(1 shard finished so far, .*run the same prep command again to finish it .*"
            r"then train$")):
        no_model.train(config)

    (partial / "manifest.json").write_text(json.dumps({"shards": {"00000.tar": 40}}))
    with pytest.raises(AssertionError, match="the model was built"):  # finished: trains
        no_model.train(config)


def test_captions_under_another_member_are_named_before_the_model_is_built(synthetic_data,
                                                                          tmp_path, no_model):
    from tests.data.test_shard_edges import _json_caption_shards
    from tests.train.helpers import tiny_config

    _json_caption_shards(tmp_path / "s")
    config = tiny_config(synthetic_data, tmp_path / "run")
    config.data.train = str(tmp_path / "s")
    with pytest.raises(ConfigError, match=(
            r"^data\.train: none of the first 8 samples of '.*00000\.tar' has a member matching "
            r"data\.caption_key='txt' \(sample '000000000' has \.jpg, \.json; its \.json has "
            r"'caption'\): set data\.caption_key=json:caption$")):
        no_model.train(config)
    config.data.caption_key = "json:caption"
    with pytest.raises(AssertionError, match="the model was built"):
        no_model.train(config)


def test_a_step_of_one_pair_is_refused_before_the_model_and_never_suggested(synthetic_data,
                                                                           tmp_path, no_model):
    """data.batch_size=1 on one process built the model and died at the first step with the
    loss's traceback ("needs a global batch of at least 2"); the too-small-data error even
    suggested it ("set data.batch_size to at most 1")."""
    from types import SimpleNamespace

    from tests.train.helpers import tiny_config
    from vlcontrast.data.sources import check_batch_fits
    from vlcontrast.errors import DataLayoutError

    config = tiny_config(synthetic_data, tmp_path / "run")
    config.data.batch_size = 1
    with pytest.raises(DataLayoutError, match=(
            r"^data\.batch_size=1 x 1 rank\(s\) x train\.accum_steps=1 gives a contrastive loss 1 "
            r"pair per step; it needs at least 2 .*set data\.batch_size to 2 or more$")):
        no_model.train(config)
    config.train.accum_steps = 2  # the loss sees the accumulated batch: two pairs
    with pytest.raises(AssertionError, match="the model was built"):
        no_model.train(config)

    data = SimpleNamespace(batch_size=4, train="d")
    one = SimpleNamespace(num_samples=1, urls=["d/00000.tar"])
    with pytest.raises(DataLayoutError, match=r"fewer than one global batch \(4 x 1 ranks = 4\); "
                       r"train on more data \(a contrastive step needs at least 2 pairs\)$"):
        check_batch_fits(data, one, 1, accum_steps=1)
    three = SimpleNamespace(num_samples=3, urls=["d/00000.tar"])
    with pytest.raises(DataLayoutError, match=r"set data\.batch_size to at most 3, or train"):
        check_batch_fits(data, three, 1, accum_steps=1)
    check_batch_fits(SimpleNamespace(batch_size=1, train="d"), three, 2, accum_steps=1)  # 2 ranks
