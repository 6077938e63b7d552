"""``vlcontrast diagnose`` on the command line, without running the diagnostic: an earlier result
in ``--out`` is refused before anything heavy starts, ``--overwrite`` replaces only a result of
its own, a bare ``diagnose`` lists its subcommands, the help shows the defaults, and options that
cancel each other are refused."""

from __future__ import annotations

import json

import pytest

from vlcontrast.cli import main
from vlcontrast.errors import ConfigError

EARLIER_CHECKPOINT = "/runs/b16-decl/checkpoints/step_20000"


def write_earlier_result(out, rows: int = 3) -> None:
    """What an earlier ``diagnose gradient-bias`` left in ``out`` (its JSON keys, fewer rows)."""
    out.mkdir(parents=True, exist_ok=True)
    report = {"settings": {"checkpoint": "/runs/b16-decl", "out": str(out)},
              "checkpoint": EARLIER_CHECKPOINT, "num_samples": 16,
              "rows": [{"estimator": "infonce", "batch_size": 4}] * rows}
    (out / "gradient_bias.json").write_text(json.dumps(report))
    for kind in ("csv", "md", "png"):
        (out / f"gradient_bias.{kind}").write_text("earlier\n")


def args_for(out, *extra: str) -> list[str]:
    return ["diagnose", "gradient-bias", "--checkpoint", "no-such-run", "--data", "no-such-data",
            "--out", str(out), *extra]


@pytest.fixture
def heavy(monkeypatch):
    """The diagnostic itself (and the model loader under it) fail the test if they are reached;
    ``heavy.calls`` records the settings it was called with when ``heavy.allow`` is set."""
    import vlcontrast.diagnose
    import vlcontrast.models

    class Heavy:
        allow = False
        calls: list = []
        progress: list = []

    def run(settings, progress=True, flags=False):
        assert flags, "the command line's errors name its flags"
        if not Heavy.allow:
            raise AssertionError("the diagnostic started")
        Heavy.calls.append(settings)
        Heavy.progress.append(progress)
        return {"rows": [], "seconds": 0.0}

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(vlcontrast.diagnose, "run_gradient_bias", run)
    monkeypatch.setattr(vlcontrast.models, "load_model_from_checkpoint", load)
    return Heavy


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_an_earlier_result_is_refused_before_the_diagnostic_starts(tmp_path, heavy, capsys):
    out = tmp_path / "out"
    write_earlier_result(out)
    assert main(args_for(out)) == 2
    err = error_line(capsys)
    assert err.startswith(f"vlcontrast: error: --out {str(out)!r} exists (gradient-bias of "
                          f"{EARLIER_CHECKPOINT!r}, 3 rows, made 2"), err
    assert err.endswith("; add --overwrite to replace it, or name a new folder"), err
    assert json.loads((out / "gradient_bias.json").read_text())["checkpoint"] == EARLIER_CHECKPOINT


def test_the_library_refuses_an_earlier_result_before_loading_the_model(tmp_path, heavy):
    from vlcontrast.diagnose.gradient_bias import GradientBiasSettings, run_gradient_bias

    out = tmp_path / "out"
    write_earlier_result(out)
    with pytest.raises(ConfigError, match=r"^out='.*' exists \(gradient-bias of .*add "
                                          r"overwrite=True to replace it"):
        run_gradient_bias(GradientBiasSettings(checkpoint="no-such-run", data="x", out=str(out)))


def test_overwrite_lets_the_diagnostic_replace_an_earlier_result(tmp_path, heavy):
    out = tmp_path / "out"
    write_earlier_result(out)
    heavy.allow = True
    assert main(args_for(out, "--overwrite")) == 0
    assert [settings.overwrite for settings in heavy.calls] == [True]


def test_a_new_or_empty_folder_needs_no_overwrite(tmp_path, heavy):
    heavy.allow = True
    (tmp_path / "empty").mkdir()
    assert main(args_for(tmp_path / "empty")) == 0
    assert main(args_for(tmp_path / "new" / "out")) == 0
    assert not (tmp_path / "new").exists()  # the check creates nothing
    assert len(heavy.calls) == 2


@pytest.mark.parametrize("content", ["foreign", "not-a-report", "a-file"])
def test_what_is_not_a_diagnose_result_is_refused_even_with_overwrite(tmp_path, heavy, capsys,
                                                                       content):
    out = tmp_path / "out"
    if content == "a-file":
        out.write_text("notes\n")
    else:
        out.mkdir()
        if content == "foreign":  # say, a training run named by mistake
            (out / "config.yaml").write_text("train: {}\n")
            (out / "checkpoints").mkdir()
        else:
            (out / "gradient_bias.json").write_text("[1, 2, 3]\n")
    for extra in ((), ("--overwrite",)):
        assert main(args_for(out, *extra)) == 2
        err = error_line(capsys)
        if content == "a-file":
            assert err == f"vlcontrast: error: --out {str(out)!r}: a file, not a folder; name a folder"
        else:
            assert err.startswith(f"vlcontrast: error: --out {str(out)!r} exists and is not a "
                                  "gradient-bias result ("), err
            assert "--overwrite will not replace it; name a new folder" in err
    if content == "foreign":
        assert "holds checkpoints, config.yaml" in err
        assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "config.yaml"]


def test_bare_diagnose_lists_its_subcommands(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["diagnose"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "required: what" not in err
    assert err.strip().splitlines()[-1] == (
        "vlcontrast diagnose: error: name what to diagnose: gradient-bias; "
        "`vlcontrast diagnose gradient-bias --help` describes it")


def test_gradient_bias_help_shows_the_defaults(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps long defaults at their hyphens
    with pytest.raises(SystemExit) as exit:
        main(["diagnose", "gradient-bias", "--help"])
    assert exit.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: runs/diagnose/gradient-bias)", "(default: 4096)",
                    "(default: 16,32,64,128,256,512,1024)", "(default: auto)",
                    "(default: infonce,dcl,dclw,decl,debiased,siglip,sogclr,fastclip)",
                    "(default: 0)"):
        assert default in text, default
    assert "--overwrite" in text


def test_lock_image_without_the_parameter_gradient_is_refused(tmp_path, heavy, capsys):
    assert main(args_for(tmp_path / "out", "--lock-image", "--no-parameters")) == 2
    err = error_line(capsys)
    assert err.startswith("vlcontrast: error: --lock-image has no effect with --no-parameters"), err


def test_python_and_the_command_line_share_one_default_loss_set(tmp_path, heavy):
    """The CLI measured six losses by default, Python eight (DEFAULT_LOSSES): the same diagnosis
    cost more and gave more rows from Python. Both now take DEFAULT_LOSSES."""
    from vlcontrast.diagnose import DEFAULT_LOSSES, GradientBiasSettings

    heavy.allow = True
    assert main(args_for(tmp_path / "out")) == 0
    assert heavy.calls[-1].losses == DEFAULT_LOSSES
    assert GradientBiasSettings(checkpoint="run", data="data").losses == DEFAULT_LOSSES
    assert {"sogclr", "fastclip"} <= set(DEFAULT_LOSSES)


def test_no_progress_reaches_the_diagnostic(tmp_path, heavy):
    heavy.allow = True
    assert main(args_for(tmp_path / "a")) == 0
    assert main(args_for(tmp_path / "b", "--no-progress")) == 0
    assert heavy.progress == [True, False]


@pytest.mark.parametrize("option, message", [
    ("decl.gamma=1.5", "--option decl.gamma=1.5: must be in (0, 1]"),
    ("decl.gamm=0.5", "--option decl.gamm=0.5: loss 'decl' has no option(s) ['gamm']; valid "
                      "options: "),
    ("sogclr.recipe=fast_clip", "--option sogclr.recipe=fast_clip sets gamma by data epoch"),
])
def test_a_bad_loss_option_is_named_by_its_flag_before_the_diagnostic(tmp_path, heavy, capsys,
                                                                       option, message):
    loss = option.split(".")[0]
    assert main(args_for(tmp_path / "out", "--losses", f"infonce,{loss}", "--option",
                         option)) == 2
    err = error_line(capsys)
    assert err.startswith(f"vlcontrast: error: {message}"), err
    assert main(args_for(tmp_path / "out", "--option", "hcl.beta=0.5")) == 2
    assert error_line(capsys).startswith(
        "vlcontrast: error: --option given for ['hcl'], which are not in --losses ")


def test_the_library_names_the_settings_fields_not_the_flags(tmp_path, heavy):
    """run_gradient_bias is called from Python: its errors name GradientBiasSettings' fields."""
    from vlcontrast.diagnose.estimators import expand_losses
    from vlcontrast.diagnose.gradient_bias import GradientBiasSettings, run_gradient_bias

    def refused(settings, pattern):
        with pytest.raises(ConfigError, match=pattern) as err:
            run_gradient_bias(settings)
        assert "--" not in str(err.value) and "\n" not in str(err.value), str(err.value)

    base = dict(checkpoint="no-such-run", data="x", out=str(tmp_path / "out"))
    refused(GradientBiasSettings(**base, num_samples=1), r"^num_samples must be >= 2, got 1$")
    refused(GradientBiasSettings(**base, num_samples=16, batch_sizes=(4, 17)),
            r"^batch_sizes: 17 is outside \[2, num_samples=16\]$")
    refused(GradientBiasSettings(**base, lock_image=True, parameters=False),
            r"^lock_image=True has no effect with parameters=False")
    refused(GradientBiasSettings(**base, workers=-1), r"^workers must be >= 0, got -1$")
    with pytest.raises(FileNotFoundError, match=r"^checkpoint 'no-such-run': no such folder"):
        run_gradient_bias(GradientBiasSettings(**base))
    with pytest.raises(ConfigError, match=r"^losses: unknown loss 'nope'"):
        expand_losses(["nope"], 8, chunk_size=0)
    with pytest.raises(ConfigError, match=r"^loss_options given for \['decl'\], which are not "
                                          r"in losses \['infonce'\]"):
        expand_losses(["infonce"], 8, chunk_size=0, options={"decl": {"gamma": 0.5}})
    # The command line's wording is the same check, named by the flags.
    with pytest.raises(ConfigError, match=r"^--batch-sizes: 17 is outside \[2, "
                                          r"--num-samples=16\]$"):
        GradientBiasSettings(**base, num_samples=16, batch_sizes=(4, 17)).validate(flags=True)
