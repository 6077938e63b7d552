"""``resolve_zeroshot_data`` names the zero-shot folder by the key its caller gives: a flag
(``--data 'x'``), a config key (``eval.zeroshot='x'``, which may be left empty) or a Python
parameter (``data_dir='x'``, which has no empty form: the config's hint is not offered)."""

import pytest

from vlcontrast.errors import ConfigError
from vlcontrast.evaluation.datasets import resolve_zeroshot_data


def test_a_python_parameter_is_named_without_the_config_keys_hint(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=rf"^data_dir={str(missing)!r}: no such folder; give an "
                                          r"ImageNet-style .*\(docs/evaluation.md\)$"):
        resolve_zeroshot_data(str(missing), keys=("data_dir", "classnames", "templates"))
    with pytest.raises(ConfigError, match=rf"^--data {str(missing)!r}: no such folder; .*"
                                          r"\(docs/evaluation.md\)$"):
        resolve_zeroshot_data(str(missing))
    with pytest.raises(ConfigError, match=r", or leave eval.zeroshot empty$"):
        resolve_zeroshot_data(str(missing), keys=("eval.zeroshot", "eval.classnames",
                                                  "eval.templates"))
