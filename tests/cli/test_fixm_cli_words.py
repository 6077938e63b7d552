"""Words of the command line: a missing subcommand names the choices, every --checkpoint says
what it takes, and a suggested command quotes a path with spaces so it can be pasted."""

from __future__ import annotations

import re
import shlex

import pytest

from vlcontrast import cli


def _run(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = cli.main(list(args))
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("command, choices", [
    ("eval", "retrieval, zeroshot, compare"),
    ("prep", "synthetic, cc3m, folder, csv, wds, check, teacher"),
])
def test_a_missing_subcommand_names_the_choices(capsys, command, choices):
    code, out, err = _run(capsys, command)
    assert code == 2 and out == ""
    last = err.strip().splitlines()[-1]
    assert last == (f"vlcontrast {command}: error: choose a subcommand: {choices}; "
                    f"`vlcontrast {command} SUBCOMMAND --help` describes one"), err
    assert "required: what" not in err


def _help(capsys, *args: str) -> str:
    code, out, _ = _run(capsys, *args, "--help")
    assert code == 0
    return " ".join(out.split())


def test_every_checkpoint_option_says_what_it_takes(capsys):
    texts = {name: _help(capsys, *name.split()) for name in
             ("eval retrieval", "eval zeroshot", "classify", "embed")}
    for name, text in texts.items():
        described = text.split("options:")[1].split("--checkpoint CHECKPOINT ")[1]
        assert described.startswith("run directory (its latest checkpoint), checkpoint "
                                    "directory, `vlcontrast export` directory or transformers "
                                    "CLIPModel directory"), (name, described[:200])


def test_the_suggested_embed_command_quotes_a_path_with_spaces(tmp_path, capsys):
    folder = tmp_path / "my shärds dir"
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "00000.tar").write_bytes(b"")
    code, out, err = _run(capsys, "classify", "--checkpoint", str(tmp_path / "no_run"),
                          "--labels", "cat,dog", str(folder))
    assert code == 2 and out == "" and err.count("\n") == 1, err
    suggested = re.search(r"`(vlcontrast embed --images [^`]*)`", err)
    assert suggested, err
    assert shlex.split(suggested.group(1)) == ["vlcontrast", "embed", "--images",
                                               str(folder / "train")]
