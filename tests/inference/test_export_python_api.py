"""``export_open_clip`` / ``export_transformers`` from Python keep the command line's promise: the
folder must be new or empty, ``overwrite=True`` replaces only an earlier vlcontrast export, and
the export moves in whole when complete. They used to write their files beside whatever the
folder held (replacing a README.md there), and name ``--checkpoint`` in their errors."""

from __future__ import annotations

import pytest

from vlcontrast.errors import ConfigError
from vlcontrast.export import export_open_clip, export_transformers

EXPORTERS = {"open_clip": export_open_clip, "transformers": export_transformers}


def listing(folder):
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("format", list(EXPORTERS))
def test_a_folder_holding_other_files_is_refused_and_left_alone(trained, tmp_path, format):
    export = EXPORTERS[format]
    out = tmp_path / "mine"
    out.mkdir()
    (out / "README.md").write_text("my notes")
    with pytest.raises(ConfigError, match=rf"^out_dir={str(out)!r}: not empty \(README.md\); "
                                          r"name a new folder, or add overwrite=True to replace "
                                          r"an earlier vlcontrast export there$"):
        export(trained[1], out)
    with pytest.raises(ConfigError, match=rf"^out_dir={str(out)!r}: holds files that are not a "
                                          r"vlcontrast export \(README.md\), which "
                                          r"overwrite=True would delete; name a new folder$"):
        export(trained[1], out, overwrite=True)
    assert listing(out) == ["README.md"] and (out / "README.md").read_text() == "my notes"
    assert listing(tmp_path) == ["mine"]  # no staging folder left


@pytest.mark.parametrize("format", list(EXPORTERS))
def test_overwrite_true_replaces_an_earlier_export_whole(trained, tmp_path, format, monkeypatch):
    import vlcontrast.export as export_module

    export = EXPORTERS[format]
    out = tmp_path / "exp"
    first = export(trained[1], out)
    files = listing(out)
    assert all(str(out) in value for key, value in first.items()
               if key not in ("checkpoint", "model_name"))  # paths in out, not in the staging
    with pytest.raises(ConfigError, match=rf"^out_dir={str(out)!r}: not empty .* add "
                                          r"overwrite=True"):
        export(trained[1], out)
    # A failure while writing leaves the earlier export as it was, and nothing beside it.
    weights = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(export_module, "_save_safetensors", broken)
    with pytest.raises(OSError, match="disk full"):
        export(trained[1], out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == weights
    assert listing(tmp_path) == ["exp"]
    monkeypatch.undo()
    again = export(trained[1], out, overwrite=True)
    assert listing(out) == files and again.keys() == first.keys()
    assert listing(tmp_path) == ["exp"]


def test_errors_name_the_python_parameters(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^checkpoint '.*nope': no such folder") as err:
        export_open_clip(tmp_path / "nope", tmp_path / "x1")
    assert "--" not in str(err.value)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^out_dir='.*file': a file; name a folder$"):
        export_transformers(tmp_path / "nope", tmp_path / "file")
    assert not (tmp_path / "x1").exists()


def test_the_command_line_keeps_its_flags(trained, tmp_path, capsys):
    from vlcontrast.cli import main

    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    assert main(["export", str(trained[1]), str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"vlcontrast: error: export OUT {str(out)!r}: not empty (notes.txt); name a new folder, "
        "or add --overwrite to replace an earlier vlcontrast export there")
