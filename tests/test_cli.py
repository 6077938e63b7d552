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
import re
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


def one_error_line(capsys, *args: str) -> str:
    """The one line ``vlcontrast ARGS`` prints for a user error (exit code 2, nothing on stdout)."""
    capsys.readouterr()
    assert cli.main(list(args)) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("vlcontrast: error: ")
    return captured.err.strip().removeprefix("vlcontrast: error: ")


@pytest.mark.parametrize("task", [["retrieval", "--data", "d"], ["zeroshot", "--data", "d"],
                                  ["compare", "c", "--retrieval", "d", "--out", "o"]])
@pytest.mark.parametrize("option, value, line", [
    ("--batch-size", "0", "--batch-size 0: must be >= 1 (e.g. --batch-size 64)"),
    ("--batch-size", "-1", "--batch-size -1: must be >= 1 (e.g. --batch-size 64)"),
    ("--workers", "-1", "--workers -1: must be >= 0 (0 reads the data in the main process)"),
])
def test_eval_counts_are_one_line_errors_before_any_loading(tmp_path, monkeypatch, capsys, task,
                                                             option, value, line):
    monkeypatch.chdir(tmp_path)  # "c" and "d" do not exist: the counts are checked first
    args = task[:1] + (["--checkpoint", "c"] if task[0] != "compare" else []) + task[1:]
    assert one_error_line(capsys, "eval", *args, option, value) == line
    assert list(tmp_path.iterdir()) == []


def test_eval_max_samples_below_zero_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for args in (["retrieval", "--checkpoint", "c", "--data", "d"],
                 ["compare", "c", "--retrieval", "d", "--out", "o"]):
        assert one_error_line(capsys, "eval", *args, "--max-samples", "-3") == (
            "--max-samples -3: must be >= 0 (0 evaluates every sample)")


def test_eval_names_a_missing_classnames_or_templates_file(tmp_path, capsys):
    (tmp_path / "data" / "a").mkdir(parents=True)
    (tmp_path / "data" / "b").mkdir()
    missing = str(tmp_path / "nothere.txt")
    assert one_error_line(capsys, "eval", "zeroshot", "--checkpoint", str(tmp_path / "c"),
                          "--data", str(tmp_path / "data"), "--classnames", missing) == (
        f"--classnames {missing!r}: no such file; give a file with one class name per line")
    assert one_error_line(capsys, "eval", "zeroshot", "--checkpoint", str(tmp_path / "c"),
                          "--data", str(tmp_path / "data"), "--templates", missing) == (
        f"--templates {missing!r}: no such file; give a file with one prompt per line with {{c}}")
    assert one_error_line(capsys, "eval", "zeroshot", "--checkpoint", str(tmp_path / "c"),
                          "--data", str(tmp_path / "data"), "--classnames",
                          str(tmp_path / "data")).startswith(
        f"--classnames {str(tmp_path / 'data')!r}: a folder, not a file; name a file")


def test_eval_checkpoint_naming_a_weights_file_names_its_folder(tmp_path, capsys):
    folder = tmp_path / "run" / "checkpoints" / "step_00000002"
    folder.mkdir(parents=True)
    (folder / "model.pt").write_bytes(b"")
    line = one_error_line(capsys, "eval", "retrieval", "--checkpoint", str(folder / "model.pt"),
                          "--data", str(tmp_path), "--device", "cpu")
    assert line.startswith(f"--checkpoint {str(folder / 'model.pt')!r}: a file, not a folder; "
                           f"give the folder holding it: --checkpoint {str(folder)!r}")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this host has a GPU")
def test_eval_device_without_a_gpu_names_the_option(tmp_path, capsys):
    assert one_error_line(capsys, "eval", "retrieval", "--checkpoint", str(tmp_path), "--data",
                          str(tmp_path), "--device", "cuda") == (
        "--device cuda: this process sees 0 usable CUDA device(s); use --device cpu (or auto)")


def test_device_contradicting_ds_accelerator_names_the_option(monkeypatch):
    from vlcontrast.cli.environment import prepare_environment
    from vlcontrast.errors import DeviceError

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    with pytest.raises(DeviceError) as error:
        prepare_environment("cuda", option="--device")
    assert str(error.value) == (
        "--device cuda: computes on cuda but DS_ACCELERATOR='cpu' is set: DeepSpeed and the model "
        "would use different devices (unset DS_ACCELERATOR or give --device cpu)")
    with pytest.raises(DeviceError, match=r"^train.device='cuda'"):  # the trainer's own words
        prepare_environment("cuda")


@pytest.mark.parametrize("argv, options", [
    (["train", "loss.name=dcl", "--nproc", "2", "train.steps=3"], {"nproc": 2}),
    (["train", "loss.name=dcl", "--config", "c.yaml", "train.steps=3", "--debug"],
     {"config": "c.yaml", "debug": True}),
    (["config", "loss.name=dcl", "--config", "c.yaml", "train.steps=3"], {"config": "c.yaml"}),
    (["study", "loss.name=dcl", "--config", "c.yaml", "train.steps=3", "--plan"],
     {"config": "c.yaml", "plan": True}),
])
def test_overrides_and_options_mix_in_any_order(argv, options):
    """argparse alone ends the overrides at the first option after them ("unrecognized
    arguments: train.steps=3")."""
    args = cli.build_parser().parse_args(argv)
    assert args.overrides == ["loss.name=dcl", "train.steps=3"]
    assert {key: getattr(args, key) for key in options} == options


def test_train_passes_overrides_after_an_option_to_the_ranks(monkeypatch):
    from vlcontrast.cli import launch

    launched = []
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    monkeypatch.setattr(launch, "launch_local",
                        lambda nproc, argv: launched.append((nproc, argv)) or 0)
    assert cli.main(["train", "loss.name=dcl", "--nproc", "2", "train.steps=3"]) == 0
    assert launched == [(2, ["loss.name=dcl", "train.steps=3"])]


@pytest.mark.parametrize("step, launches", [(None, True), ("batch", True), ("0", False)])
def test_train_nproc_in_a_batch_step_launches_its_ranks(monkeypatch, tmp_path, step, launches):
    """An sbatch script's batch step has SLURM_PROCID=0 but no srun step: `train --nproc 2`
    there launches its ranks (it trained one process, world size 1, with --nproc ignored); a
    task srun started is a rank itself."""
    from vlcontrast.cli import launch

    launched = []
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_STEPID", raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    if step is None:
        monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    else:
        monkeypatch.setenv("SLURM_STEP_ID", step)
    monkeypatch.setattr(launch, "launch_local",
                        lambda nproc, argv: launched.append((nproc, argv)) or 0)
    if launches:
        assert cli.main(["train", "--nproc", "2", "train.steps=3"]) == 0
        assert launched == [(2, ["train.steps=3"])]
    else:
        trained = []
        monkeypatch.setattr("vlcontrast.train.train", lambda config: trained.append(config))
        assert cli.main(["train", "--nproc", "2", "train.steps=3",
                         f"output_dir={tmp_path / 'run'}"]) == 0
        assert launched == [] and len(trained) == 1


def test_intermixed_parsing_keeps_the_errors_and_help(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.build_parser().parse_args(["train", "a.b=1", "--bogus", "c.d=2"])
    assert stop.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        cli.build_parser().parse_args(["study", "a.b=1", "--plan"])
    assert stop.value.code == 2
    assert "the following arguments are required: --config" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        cli.build_parser().parse_args(["train", "a.b=1", "--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("usage: vlcontrast train [-h] [--config CONFIG]")


def test_config_lists_each_losss_options(capsys):
    from vlcontrast.losses import LOSSES, loss_option_defaults

    assert cli.main(["config"]) == 0
    out = capsys.readouterr().out
    sections = {}  # loss name -> the option keys listed under it
    for line in out.splitlines():
        if line.startswith("loss.name="):
            sections[line.removeprefix("loss.name=").removesuffix(": no options")] = keys = []
        elif line.startswith("  loss."):
            keys.append(line.split()[0])
    assert {name: keys for name, keys in sections.items()} == {
        name: [f"loss.{option}" for option in loss_option_defaults(name)] for name in LOSSES}
    assert re.search(r"\n  loss\.tau_min +0\.01 +bounds of the individual temperatures\.\n", out)
    assert "\nloss.name=dcl: no options\n" in out


def test_warnings_keep_one_format_before_and_after_a_library_logs_through_the_root():
    """The first warnings of a command used to print bare and, once open_clip had called
    ``logging.warning()`` (building a model), every later one as ``WARNING:name:message``."""
    import subprocess
    import sys

    script = ("import logging\n"
              "from vlcontrast.cli import main\n"
              "main(['config'])\n"
              "logging.getLogger('vlcontrast.checkpoints').warning('before')\n"
              "logging.warning('open_clip says')\n"
              "logging.getLogger('vlcontrast.data.loader').warning('after %d', 3)\n"
              "logging.getLogger('vlcontrast.data.loader').info('not shown')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[-3:] == ["vlcontrast: warning: before",
                                             "warning: open_clip says",
                                             "vlcontrast: warning: after 3"], done.stderr


def test_ctrl_c_ends_a_command_as_one_line_with_the_shell_s_status(capsys, monkeypatch):
    """A KeyboardInterrupt in a command without a stop of its own printed Python's traceback."""
    from vlcontrast.cli import eval as eval_cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(eval_cli, "run_eval", interrupted)  # the parser is built in main()
    monkeypatch.delenv("VLCONTRAST_DEBUG", raising=False)
    argv = ["eval", "retrieval", "--checkpoint", "m", "--data", "d"]
    assert cli.main(argv) == 130
    assert capsys.readouterr().err == "vlcontrast: eval retrieval: interrupted (Ctrl-C)\n"
    from vlcontrast.cli import train as train_cli

    monkeypatch.setattr(train_cli, "run_train", interrupted)
    assert cli.main(["train", "--config", "c.yaml"]) == 130
    assert capsys.readouterr().err.startswith(
        "vlcontrast: train: interrupted (Ctrl-C); train.resume=latest continues from the last "
        "checkpoint")
    monkeypatch.setenv("VLCONTRAST_DEBUG", "1")  # --debug keeps the traceback
    with pytest.raises(KeyboardInterrupt):
        cli.main(argv)


def test_deepspeed_warnings_take_the_same_one_line_format():
    """DeepSpeed's logger printed on stdout in its own format past the CLI's
    (``[time] [WARNING] [base_optimizer.py:343:...] MPU is not provided ...`` on a resume)."""
    import subprocess
    import sys

    script = ("from vlcontrast.cli import main\n"
              "main(['config'])\n"
              "from vlcontrast.train.engine import deepspeed_logs_as_lines\n"
              "deepspeed_logs_as_lines()\n"
              "from deepspeed.utils import logger\n"
              "logger.warning('MPU is not provided')\n"
              "logger.info('not shown')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[-1] == "deepspeed: warning: MPU is not provided", done.stderr
    assert "MPU" not in done.stdout and "not shown" not in done.stdout + done.stderr


@pytest.mark.parametrize("nproc", ["0", "-1"])
def test_train_refuses_fewer_than_one_process(capsys, nproc):
    """--nproc 0 and -1 ran as one process without a word."""
    assert cli.main(["train", "--nproc", nproc, "train.steps=1"]) == 2
    assert capsys.readouterr().err == (f"vlcontrast: error: --nproc {nproc}: must be >= 1 (the "
                                       "local processes: 1, or one per GPU)\n")


def test_config_shows_a_config_that_would_not_train_and_the_loss_options_in_effect(capsys):
    """`vlcontrast config loss.name=decl` printed only the check's error (the defaults set no
    train.steps), and a resolved config named only the loss options that were set."""
    import yaml

    assert cli.main(["config", "loss.name=decl", "loss.gamma=0.5"]) == 2
    captured = capsys.readouterr()
    shown = yaml.safe_load(captured.out)
    assert shown["loss"]["name"] == "decl" and shown["loss"]["gamma"] == 0.5
    assert ("# loss options in effect (decl): estimator='buffer', u_mode='mean', gamma=0.5, "
            "schedule='alternate'") in captured.out
    assert captured.err == ("vlcontrast: error: this config would not train: train.steps=0: set "
                            "train.steps or train.epochs to a positive value\n")
    assert cli.main(["config", "loss.name=decl", "train.steps=5"]) == 0


@pytest.mark.parametrize("overrides, error", [
    (["train.steps=10", "loss.name=hcl", "loss.betta=0.5"],
     "loss.betta=0.5: is not an option of loss 'hcl' (did you mean 'beta'?)"),
    (["loss.name=dlc"], "loss.name='dlc': must be one of"),
])
def test_config_lists_no_loss_options_in_effect_for_a_loss_section_that_fails(capsys, overrides,
                                                                               error):
    """`loss.betta=0.5` was listed among "# loss options in effect (hcl)" before the error, and
    `loss.name=dlc` alone was hidden behind "train.steps=0"."""
    assert cli.main(["config", *overrides]) == 2
    captured = capsys.readouterr()
    assert "loss options in effect" not in captured.out
    assert captured.err.startswith(f"vlcontrast: error: this config would not train: {error}")
