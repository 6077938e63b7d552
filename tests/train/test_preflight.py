"""Checks before heavy work: bad shard patterns name the option, using the loader's own rules."""

import pytest

from vlcontrast.config import ConfigError, load_config
from vlcontrast.train.loop import preflight


def test_bad_patterns_name_their_key(synthetic_data, tmp_path):
    base = ["train.steps=1", f"data.train={synthetic_data}/train", f"output_dir={tmp_path / 'run'}"]
    preflight(load_config(None, base + [f"data.val={synthetic_data}/val"]))
    with pytest.raises(ConfigError, match=r"data\.val pattern '/nope/\{0\.\.2\}\.tar' matches no shard"):
        preflight(load_config(None, base + ["data.val=/nope/{0..2}.tar"]))
    with pytest.raises(ConfigError, match=r"eval\.retrieval=.*empty source"):
        preflight(load_config(None, base + [f"eval.retrieval={synthetic_data}/val::::{synthetic_data}/val"]))
    with pytest.raises(ConfigError, match=r"data\.train source .*weight 0 must be > 0"):
        preflight(load_config(None, base[:1] + [f"data.train={synthetic_data}/train@0",
                                                 f"output_dir={tmp_path / 'run'}"]))
