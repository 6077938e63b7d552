"""``--config`` given twice: argparse kept the last value, so ``--config base.yaml --config
change.yaml`` ran on ``change.yaml`` alone without a word. Refused in one line naming both files
and the fix (one merged file, or ``section.key=value`` overrides), exit 2."""

from __future__ import annotations

import signal

import pytest
import yaml

from vlcontrast import cli


@pytest.fixture(autouse=True)
def no_held_signals():
    """``train`` holds SIGTERM/SIGUSR1 in this process (the command line's first act): undone."""
    yield
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)


@pytest.fixture
def two_configs(tmp_path):
    first, second = tmp_path / "base.yaml", tmp_path / "change.yaml"
    first.write_text(yaml.safe_dump({"model": {"name": "vlc-micro"}, "train": {"steps": 4}}))
    second.write_text(yaml.safe_dump({"model": {"name": "vlc-micro"}, "train": {"steps": 8}}))
    return str(first), str(second)


@pytest.mark.parametrize("command", [["train", "--nproc", "2"], ["config"], ["study", "--plan"]])
def test_a_second_config_is_refused_naming_both(command, two_configs, capsys):
    first, second = two_configs
    assert cli.main([*command, "--config", first, "data.train=x", f"--config={second}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"vlcontrast: error: {command[0]} --config given twice ({first!r}, "
                          f"then {second!r}): ")
    assert f"vlcontrast {command[0]} --config {first} section.key=value" in err


def test_the_same_config_twice_is_one_config(two_configs, capsys):
    first, _ = two_configs
    assert cli.main(["config", "--config", first, "--config", first]) == 0
    assert "steps: 4" in capsys.readouterr().out
