"""The command line: ``python -m vlcontrast``, and the scripts in eval/ and data_prep/ as shims.

The scripts must be thin shims over :mod:`vlcontrast.cli`: no parser of their own (so their
options and defaults cannot drift from the CLI's), the same ``--help``, the same behaviour.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlcontrast import cli

ROOT = Path(__file__).resolve().parents[1]
SHIMS = {
    "eval/zeroshot.py": ["eval", "zeroshot"],
    "eval/retrieval.py": ["eval", "retrieval"],
    "eval/compare_checkpoints.py": ["eval", "compare"],
    "data_prep/check_shards.py": ["prep", "check"],
    "data_prep/make_synthetic.py": ["prep", "synthetic"],
    "data_prep/prepare_cc3m.py": ["prep", "cc3m"],
}


def load_script(relative: str):
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem + "_shim", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def help_text(call) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        call()
    assert exit_info.value.code == 0
    return out.getvalue()


def test_python_dash_m_vlcontrast_help():
    env = dict(os.environ, COLUMNS="100")
    result = subprocess.run([sys.executable, "-m", "vlcontrast", "--help"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: vlcontrast ")
    for command in ("train", "prep", "eval", "export", "verify", "config"):
        assert command in result.stdout


def test_every_script_in_eval_and_data_prep_is_a_listed_shim():
    scripts = {str(path.relative_to(ROOT)) for folder in ("eval", "data_prep")
               for path in (ROOT / folder).glob("*.py")}
    assert scripts == set(SHIMS)


@pytest.mark.parametrize("script", sorted(SHIMS))
def test_shim_has_no_parser_of_its_own(script):
    tree = ast.parse((ROOT / script).read_text())
    calls = {node.func.attr for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    assert not calls & {"add_argument", "ArgumentParser", "add_parser"}, script
    assert load_script(script).COMMAND == SHIMS[script]


@pytest.mark.parametrize("script", sorted(SHIMS))
def test_shim_help_is_the_cli_help(script, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    module = load_script(script)
    shim_help = help_text(lambda: module.main(["--help"]))
    cli_help = help_text(lambda: cli.main([*SHIMS[script], "--help"]))
    assert shim_help == cli_help
    assert "--" in shim_help  # it does list options


def test_shim_passes_its_arguments_through(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "main", lambda argv: seen.append(argv) or 0)
    module = load_script("eval/retrieval.py")
    monkeypatch.setattr(module, "cli_main", cli.main)
    monkeypatch.setattr(sys, "argv", ["eval/retrieval.py", "--checkpoint", "x", "--data", "y"])
    assert module.main() == 0
    assert seen == [["eval", "retrieval", "--checkpoint", "x", "--data", "y"]]


def test_eval_defaults_agree_between_tasks():
    parser = cli.build_parser()
    retrieval = parser.parse_args(["eval", "retrieval", "--checkpoint", "c", "--data", "d"])
    zeroshot = parser.parse_args(["eval", "zeroshot", "--checkpoint", "c", "--data", "d"])
    compare = parser.parse_args(["eval", "compare", "c", "--out", "o", "--retrieval", "d"])
    for key in ("workers", "batch_size", "device"):
        assert getattr(retrieval, key) == getattr(zeroshot, key) == getattr(compare, key)


def test_compare_without_data_is_an_error(capsys):
    assert cli.main(["eval", "compare", "ckpt", "--out", "o"]) == 2
    assert "--retrieval and/or --zeroshot" in capsys.readouterr().err


def test_script_runs_as_a_script_from_another_directory(tmp_path):
    env = dict(os.environ, COLUMNS="100")
    result = subprocess.run([sys.executable, str(ROOT / "data_prep" / "check_shards.py"),
                             "--help"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: vlcontrast prep check")
