"""The one rule for an existing output (:func:`vlcontrast.outputs.check_replaceable`) names the way
to replace it that its caller gives: ``--overwrite`` on the command line, ``overwrite=True`` for
the Python API. Its callers pass the words instead of rewriting the error, so a path that holds
``--overwrite`` is named as it is."""

import json

import numpy as np
import pytest

from vlcontrast.errors import ConfigError
from vlcontrast.outputs import check_replaceable


def test_the_rule_names_the_flag_it_is_given():
    rule = dict(kind="an eval record", noun="it")
    with pytest.raises(ConfigError, match=r"^out='r.json' exists \(a record\); add overwrite=True "
                                          r"to replace it, or name a new file$"):
        check_replaceable("out='r.json'", "a record", is_kind=True, overwrite=False,
                          flag="overwrite=True", **rule)
    with pytest.raises(ConfigError, match=r"so overwrite=True will not replace it"):
        check_replaceable("out='r.json'", "not JSON", is_kind=False, overwrite=True,
                          flag="overwrite=True", **rule)
    with pytest.raises(ConfigError, match=r"; add --overwrite to replace it"):
        check_replaceable("--out 'r.json'", "a record", is_kind=True, overwrite=False, **rule)


def test_embed_names_a_path_holding_the_flags_words_as_it_is(tmp_path):
    from vlcontrast.inference.embed import check_output

    out = tmp_path / "--overwrite-old" / "e.npy"
    out.parent.mkdir()
    np.save(out, np.zeros((3, 4), dtype=np.float32))
    (out.parent / "e.npy.ids.txt").write_text("a\nb\nc\n")
    with pytest.raises(ConfigError) as python_api:
        check_output(out, option="out")
    assert str(python_api.value).startswith(f"out={str(out)!r} exists (3 embeddings")
    assert "; add overwrite=True to replace them, or name a new file" in str(python_api.value)
    with pytest.raises(ConfigError) as command_line:
        check_output(out, option="--out")
    assert str(command_line.value).startswith(f"--out {str(out)!r} exists (3 embeddings")
    assert "; add --overwrite to replace them" in str(command_line.value)


def test_diagnose_names_a_path_holding_the_flags_words_as_it_is(tmp_path):
    from vlcontrast.diagnose.report import check_out

    out = tmp_path / "--overwrite-runs" / "bias"
    out.mkdir(parents=True)
    (out / "gradient_bias.json").write_text(json.dumps({"checkpoint": "runs/a", "rows": [],
                                                        "settings": {}}))
    with pytest.raises(ConfigError) as python_api:
        check_out(out, option="out")
    assert str(python_api.value).startswith(f"out={str(out)!r} exists (gradient-bias of")
    assert "; add overwrite=True to replace it, or name a new folder" in str(python_api.value)
    with pytest.raises(ConfigError, match=r"; add --overwrite to replace it"):
        check_out(out, option="--out")
    check_out(out, overwrite=True, option="out")  # an earlier result is replaced when asked
