"""Checkpoints: the one resolver, files that load without running code (a pickled object is
refused on resume, before DeepSpeed reads anything), random state as tensors and lists; and the
plain progress lines of a run whose output is not a terminal."""

from __future__ import annotations

import argparse
import random
import subprocess

import numpy as np
import pytest
import torch

from tests.train.helpers import REPO, cli, process_env, tiny_overrides


def _fake_checkpoint(folder, *, weights=True, state=True):
    folder.mkdir(parents=True)
    if weights:
        (folder / "model.pt").write_bytes(b"")
    if state:
        (folder / "trainer_state.pt").write_bytes(b"")
    return folder


def test_one_resolver_for_run_dirs_checkpoint_dirs_and_latest(tmp_path):
    from vlcontrast.checkpoints import resolve_weights
    from vlcontrast.checkpoints import find_resume, latest_checkpoint, resolve_checkpoint

    run = tmp_path / "run"
    root = run / "checkpoints"
    old = _fake_checkpoint(root / "step_00000002")
    new = _fake_checkpoint(root / "step_00000004")
    (root / "latest").write_text("step_00000004\n")
    for named in (run, root, new):
        assert resolve_checkpoint(named) == new
        assert resolve_weights(named) == new
    assert resolve_checkpoint(old) == old
    assert latest_checkpoint(root) == new
    assert find_resume("latest", run) == new
    assert find_resume(str(run), tmp_path / "elsewhere") == new
    assert find_resume("", run) is None
    # An incomplete newest checkpoint is not resumed from (the newest complete one is, with a
    # warning: the policy of train.resume=latest); weights-only use still finds model.pt.
    (new / "trainer_state.pt").unlink()
    assert resolve_checkpoint(run) == old and resolve_weights(run) == new
    assert resolve_checkpoint(new) is None
    with pytest.raises(FileNotFoundError, match="is not a complete checkpoint .*; the newest "
                                                "complete one there is .*step_00000002"):
        find_resume(str(new), run)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(FileNotFoundError, match="no model.pt there"):
        resolve_weights(tmp_path / "nothing")


def test_a_wrong_resume_path_says_what_it_is_and_what_to_give(tmp_path):
    """A missing path, a file or an empty folder each said "is not a complete checkpoint ... nor a
    run directory with one", with no fix."""
    from vlcontrast.checkpoints import find_resume

    run = tmp_path / "run"
    step = _fake_checkpoint(run / "checkpoints" / "step_00000002")
    (run / "checkpoints" / "latest").write_text("step_00000002\n")
    forms = (r"train\.resume=latest \(this output_dir's newest checkpoint\), a run directory or "
             r"a checkpoint directory \(RUN/checkpoints/step_\*\)")
    with pytest.raises(FileNotFoundError, match=rf"^train\.resume='{tmp_path}/nope': no such "
                                                rf"folder; give {forms}$"):
        find_resume(str(tmp_path / "nope"), run)
    with pytest.raises(FileNotFoundError, match=r"^train\.resume='LATEST': no such folder; .*; "
                                                r"did you mean train\.resume=latest\?$"):
        find_resume("LATEST", run)
    for file in (step / "model.pt", run / "checkpoints" / "latest"):
        with pytest.raises(FileNotFoundError, match=rf"^train\.resume='{file}': a file, not a "
                                                    rf"folder; give the folder holding it, "
                                                    rf"train\.resume='{file.parent}', or {forms}$"):
            find_resume(str(file), run)
        assert find_resume(str(file.parent), run) == step  # the folder it names does resume
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"^train\.resume='.*empty': .*empty is not a "
                                                rf"complete checkpoint .* with one; give {forms}$"):
        find_resume(str(tmp_path / "empty"), run)


def test_export_of_a_wrong_run_path_says_what_it_is(tmp_path):
    """`vlcontrast export` of a missing folder, a file or an export said "no model.pt there and
    no checkpoints/latest" for all three; an export now names the checkpoint it came from."""
    import json

    from vlcontrast.checkpoints import resolve_weights

    step = _fake_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000002")
    with pytest.raises(FileNotFoundError, match=r"^export RUN '.*nope': no such folder; give a "
                                                r"run directory or a checkpoint directory"):
        resolve_weights(tmp_path / "nope", "export RUN")
    with pytest.raises(FileNotFoundError, match=rf"^export RUN '{step}/model\.pt': a file, not a "
                                                rf"folder; give the folder holding it: export "
                                                rf"RUN '{step}' "):
        resolve_weights(step / "model.pt", "export RUN")
    export = tmp_path / "hf"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"model_type": "clip", "vlcontrast": {
        "checkpoint": str(step)}}))
    with pytest.raises(FileNotFoundError, match=rf"^export RUN '{export}': a `vlcontrast export` "
                                                rf"or transformers CLIPModel directory, not a "
                                                rf"run; .*, e\.g\. the one it was exported from: "
                                                rf"export RUN '{step}'$"):
        resolve_weights(export, "export RUN")


def test_random_state_is_stored_as_tensors_and_lists(tmp_path):
    from vlcontrast.train.checkpoint import RNGState

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = tmp_path / "rng.pt"
    torch.save(RNGState().state_dict(), path)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    RNGState().load_state_dict(torch.load(path, weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


def test_a_pickled_object_is_refused_with_a_clear_error(tmp_path):
    from vlcontrast.checkpoints import CheckpointError, load_file

    path = tmp_path / "trainer_state.pt"
    torch.save({"train": argparse.Namespace(step=3)}, path)
    with pytest.raises(CheckpointError, match="refused to load: it holds a pickled Python object"):
        load_file(path)


@pytest.fixture(scope="module")
def cli_run(synthetic_data, tmp_path_factory):
    """One 3-step run through the CLI with its output on a pipe (not a terminal)."""
    run = tmp_path_factory.mktemp("cli") / "run"
    overrides = tiny_overrides(synthetic_data, run, train__steps=3, checkpoint__every=2,
                               logging__progress=True)
    done = subprocess.run(cli("train", *overrides), env=process_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run, done.stdout + done.stderr, synthetic_data


def test_a_non_terminal_run_logs_plain_progress_lines(cli_run):
    _, output, _ = cli_run
    assert "\r" not in output
    lines = [line for line in output.splitlines() if line.startswith("train ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"], output[-2000:]
    assert all("loss" in line and "ETA" in line for line in lines), lines


def test_a_finished_run_ends_by_saying_where_its_results_are(cli_run):
    """The table was the last thing printed, with no path to results.json or the weights."""
    run, output, _ = cli_run
    assert (f"vlcontrast: results in {run / 'results.json'}, report in {run / 'report.md'}; "
            f"weights in {run / 'checkpoints' / 'step_00000003'} (vlcontrast eval ... "
            f"--checkpoint {run})") in output.splitlines()


def test_results_and_report_name_every_loss_option_in_effect(cli_run, tmp_path):
    """config.yaml holds only the options a user set; results.json and report.md now hold every
    option the loss ran with, defaults included, so two runs can be told apart."""
    import json

    from vlcontrast.losses.registry import loss_option_defaults
    from vlcontrast.train.report import write_report

    run, _, _ = cli_run
    results = json.loads((run / "results.json").read_text())
    assert results["loss_options"] == loss_option_defaults(results["loss"])
    options = {**loss_option_defaults("decl"), "gamma": 0.5}
    report = write_report(tmp_path, {"retrieval/text_to_image_R@1": 0.5},
                          {"loss": "decl", "loss_options": options})
    text = report.read_text()
    assert "| loss.gamma | 0.5000 |" in text and "| loss.estimator | buffer |" in text


def test_the_logged_lr_is_the_rate_the_step_used(cli_run):
    """The record read the engine's rate after the scheduler had stepped: the next step's (with
    warmup 2, step 1 logged the full rate it had not used, the last step 0)."""
    import json

    import yaml

    from vlcontrast.train.optimizer import cosine_with_warmup

    run, _, _ = cli_run
    optim = yaml.safe_load((run / "config.yaml").read_text())["optim"]
    factor = cosine_with_warmup(optim["warmup_steps"], 3, optim["min_lr"] / optim["lr"])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["lr"] for r in records if "lr" in r}
    assert sorted(logged) == [1, 2, 3]
    assert logged == pytest.approx({s: optim["lr"] * factor(s - 1) for s in (1, 2, 3)})
    assert logged[1] == pytest.approx(optim["lr"] / 2)  # warmup 2: half the rate at step 1


def test_a_resumed_run_says_where_it_resumed_on_the_console(cli_run, tmp_path):
    """The resume used to be written to metrics.jsonl only; a resume of a finished run re-ran its
    final evaluation without a word."""
    import shutil

    from vlcontrast.train.loop import resume_line

    source, _, data = cli_run
    run = tmp_path / "run"
    shutil.copytree(source, run)
    done = subprocess.run(cli("train", *tiny_overrides(data, run, train__steps=4,
                                                       train__resume="latest")),
                          env=process_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (f"vlcontrast: resumed from {run / 'checkpoints' / 'step_00000003'} at step 3 of 4\n"
            in done.stderr), done.stderr[-3000:]
    assert resume_line(run, 4, 4).endswith("at step 4, which ends the run (4 steps): nothing left "
                                           "to train; evaluating and writing its results again "
                                           "(raise train.steps to train on)")


def test_checkpoint_files_load_without_running_code(cli_run):
    run, _, _ = cli_run
    folder = run / "checkpoints" / "step_00000003"
    state = torch.load(folder / "trainer_state.pt", weights_only=True)
    assert state["train"] == {"step": 3, "samples_seen": 24, "epoch": 0}
    assert set(state) == {"train", "guard", "loss", "param_layout", "world_size"}
    assert state["world_size"] == 1
    # ZeRO 0 in fp32: the groups keep the model's order, logit_scale first among the no-decay.
    assert [group[0] for group in state["param_layout"]] == ["logit_scale", "positional_embedding"]
    rank = torch.load(folder / "rank_00000.pt", weights_only=True)
    assert set(rank) == {"rng", "data"} and rank["data"]["steps_done"] == 3
    weights = torch.load(folder / "model.pt", weights_only=True)
    assert all(w.dtype == torch.float32 for w in weights.values() if w.is_floating_point())


@pytest.mark.parametrize("tampered, message", [
    ("trainer_state.pt", "refused to load: it holds a pickled Python object"),
    ("rank_00000.pt", "refused to load: it holds a pickled Python object"),
    # DeepSpeed's own file (it loads it with weights_only=False): scanned and refused first.
    ("engine/mp_rank_00_model_states.pt",
     "refused to load: DeepSpeed would unpickle it with weights_only=False and it names "
     "['argparse.Namespace']")])
def test_resuming_from_a_checkpoint_with_a_pickled_object_is_refused(cli_run, tampered, message):
    run, _, data = cli_run
    folder = run / "checkpoints" / "step_00000003"
    original = (folder / tampered).read_bytes()
    saved = torch.load(folder / tampered, weights_only=False)
    saved["injected"] = argparse.Namespace(command="echo pwned")
    torch.save(saved, folder / tampered)
    try:
        overrides = tiny_overrides(data, run, train__steps=4, train__resume="latest")
        done = subprocess.run(cli("train", *overrides), env=process_env(), cwd=REPO,
                              capture_output=True, text=True, timeout=300)
    finally:
        (folder / tampered).write_bytes(original)
    assert done.returncode != 0
    assert f"{tampered}: {message}" in done.stderr, done.stderr[-3000:]


# -- the optimizer's parameter order is part of a checkpoint --------------------------------------


def _layout_checker(tmp_path, layout, legacy):
    from vlcontrast.train.checkpoint import Checkpointer

    return Checkpointer(tmp_path, engine=None, every=0, keep=1, run_states={}, rank_states={},
                        model_config={}, config_yaml="", param_layout=layout, legacy_layout=legacy)


def test_resume_refuses_an_optimizer_state_laid_out_in_another_order(tmp_path):
    from vlcontrast.checkpoints import CheckpointError

    aligned = [["ln.weight", "ln.bias", "logit_scale"], ["proj.weight"]]
    legacy = [["logit_scale", "ln.weight", "ln.bias"], ["proj.weight"]]
    checker = _layout_checker(tmp_path, aligned, legacy)
    checker._check_layout({"param_layout": [list(g) for g in aligned]}, tmp_path)  # same: fine
    with pytest.raises(CheckpointError, match="group 0, position 0: 'logit_scale' saved, "
                                              "'ln.weight' now"):
        checker._check_layout({"param_layout": legacy}, tmp_path)
    with pytest.raises(CheckpointError, match="2 optimizer groups saved, 1 now"):
        _layout_checker(tmp_path, [["a"]], None)._check_layout({"param_layout": [["a"], ["b"]]},
                                                                tmp_path)
    # Written before layouts were recorded: resumable only where nothing moved.
    with pytest.raises(CheckpointError, match="before checkpoints recorded the optimizer's "
                                              "parameter order"):
        checker._check_layout({}, tmp_path)
    _layout_checker(tmp_path, legacy, legacy)._check_layout({}, tmp_path)


# -- a write that fails names the path and the fix ------------------------------------------------


class _FullDiskEngine:
    """DeepSpeed's engine as the checkpointer sees it, on a disk that is full."""

    def save_checkpoint(self, path, tag, save_latest):
        import errno

        raise OSError(errno.ENOSPC, "No space left on device", f"{path}/{tag}/model_states.pt")


def test_a_full_disk_inside_deepspeed_s_save_is_a_checkpoint_error_with_the_fix(tmp_path):
    from vlcontrast.errors import CheckpointError
    from vlcontrast.train.checkpoint import Checkpointer

    checkpointer = Checkpointer(tmp_path, engine=_FullDiskEngine(), every=2, keep=3, run_states={},
                                rank_states={}, model_config={}, config_yaml="")
    with pytest.raises(CheckpointError) as raised:
        checkpointer.save(4)
    message = str(raised.value)
    tmp = tmp_path / "checkpoints" / "step_00000004.tmp"
    assert message.startswith(f"checkpoint at step 4 could not be written to {tmp} (No space "
                              f"left on device: '{tmp}/engine/model_states.pt')")
    assert "[Errno" not in message
    assert f"the disk holding {tmp_path / 'checkpoints'} is full: free space there" in message
    assert "checkpoint.keep=3" in message and "train.resume=latest" in message
    assert not tmp.exists()


def test_a_write_error_without_an_errno_is_called_a_full_disk_when_the_disk_is_full(tmp_path,
                                                                                    monkeypatch):
    from vlcontrast import checkpoints
    from vlcontrast.train.checkpoint import Checkpointer

    checkpointer = Checkpointer(tmp_path, engine=None, every=2, keep=2, run_states={},
                                rank_states={}, model_config={}, config_yaml="",
                                expected_bytes=10_000)
    written = RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    monkeypatch.setattr(checkpoints, "free_bytes", lambda path: 1_000)
    assert "is full: free space there" in checkpointer._fix(written)
    monkeypatch.setattr(checkpoints, "free_bytes", lambda path: 10**12)
    assert checkpointer._fix(written) == ""
    assert "make" in checkpointer._fix(PermissionError(13, "Permission denied"))


def test_resume_latest_never_starts_fresh_over_checkpoints(tmp_path, caplog):
    """A damaged newest checkpoint (or a lost ``latest``) used to make ``resume=latest`` start
    from step 0: its checkpoints overwrote the damaged one and retention deleted the good one."""
    import logging

    from vlcontrast.checkpoints import find_resume
    from vlcontrast.errors import ConfigError

    run = tmp_path / "run"
    root = run / "checkpoints"
    old = _fake_checkpoint(root / "step_00000003")
    new = _fake_checkpoint(root / "step_00000006")
    (root / "latest").write_text("step_00000006\n")
    (new / "trainer_state.pt").unlink()
    with caplog.at_level(logging.WARNING):
        assert find_resume("latest", run) == old
        assert find_resume("latest", run, warn=False) == old  # ranks but 0 resolve it quietly
    warned = [r.getMessage() for r in caplog.records if "train.resume=latest" in r.getMessage()]
    assert warned == ["train.resume=latest: checkpoints/latest names 'step_00000006', which is "
                      "incomplete (no trainer_state.pt); resuming from the newest complete "
                      "checkpoint, step_00000003"]
    (root / "latest").unlink()
    assert find_resume("latest", run) == old
    (old / "trainer_state.pt").unlink()
    with pytest.raises(ConfigError, match=r"holds 2 checkpoint folder\(s\) \(step_00000006 "
                                          r"\.\.\.\) and none is complete"):
        find_resume("latest", run)
    assert find_resume("latest", tmp_path / "fresh") is None  # no checkpoint yet: a fresh start


# -- a damaged checkpoint names the lost file and the one before it -------------------------------


class _EngineMissing:
    """An engine whose files were lost: load_checkpoint raises as DeepSpeed's torch.load does."""

    def load_checkpoint(self, path, tag, load_module_strict):
        import errno

        raise FileNotFoundError(errno.ENOENT, "No such file or directory",
                                f"{path}/{tag}/zero_pp_rank_1_mp_rank_00_optim_states.pt")


class _Loaded:
    def __init__(self):
        self.state = None

    def state_dict(self):
        return {"n": 1}

    def load_state_dict(self, state):
        self.state = state


def _resumable(tmp_path, world_size, rank_files, engine=None):
    """A checkpoint (and the one before it) written by ``world_size`` ranks that kept only
    ``rank_files``; a checkpointer whose engine loads nothing (or ``engine``)."""
    from vlcontrast.train.checkpoint import WORLD_KEY, Checkpointer

    class Engine:
        def load_checkpoint(self, path, tag, load_module_strict):
            return path, {}

    root = tmp_path / "run" / "checkpoints"
    _fake_checkpoint(root / "step_00000002")
    folder = root / "step_00000004"
    folder.mkdir(parents=True)
    torch.save({"train": {"step": 4}, **({WORLD_KEY: world_size} if world_size else {})},
               folder / "trainer_state.pt")
    for rank in rank_files:
        torch.save({"data": {"n": rank}}, folder / f"rank_{rank:05d}.pt")
    (folder / "engine").mkdir()
    torch.save({}, folder / "engine" / "mp_rank_00_model_states.pt")
    data = _Loaded()
    checkpointer = Checkpointer(tmp_path / "run", engine=engine or Engine(), every=0, keep=2,
                                run_states={}, rank_states={"data": data}, model_config={},
                                config_yaml="")
    return checkpointer, folder, data


def test_a_lost_rank_file_is_an_error_not_a_silently_inexact_resume(tmp_path):
    """A checkpoint written by as many ranks as the run has, with this rank's file gone, used to
    resume with that rank's data position and random state left at their start (and, on more
    ranks, the others' kept: ranks that read different samples)."""
    from vlcontrast.errors import CheckpointError

    checkpointer, folder, data = _resumable(tmp_path, 1, rank_files=[])
    with pytest.raises(CheckpointError, match=r"rank_00000.pt: missing; the checkpoint was written "
                                              r"by as many ranks as this run has \(1\), .*resume "
                                              r"from the one before it \(train.resume=.*"
                                              r"step_00000002\), or start a new run"):
        checkpointer.resume(folder)
    # Written before the world size was recorded, with no rank file at all: the same verdict.
    checkpointer, folder, data = _resumable(tmp_path / "old", 0, rank_files=[])
    with pytest.raises(CheckpointError, match="rank_00000.pt: missing"):
        checkpointer.resume(folder)
    checkpointer, folder, data = _resumable(tmp_path / "whole", 1, rank_files=[0])
    assert checkpointer.resume(folder) is True and data.state == {"n": 0}


def test_another_world_size_resumes_without_the_rank_files_and_says_so(tmp_path, caplog):
    import logging

    checkpointer, folder, data = _resumable(tmp_path, 2, rank_files=[0, 1])
    with caplog.at_level(logging.WARNING):
        assert checkpointer.resume(folder) is False
    assert data.state is None and checkpointer.last_good == folder
    assert any("written by 2 rank(s), with 1" in r.getMessage() and "restarts the saved epoch"
               in r.getMessage() for r in caplog.records)


def test_a_lost_engine_file_names_it_and_the_checkpoint_before(tmp_path):
    """It used to be DeepSpeed's bare FileNotFoundError (and, with train.engine=torch, a message
    blaming the ZeRO stage)."""
    from vlcontrast.errors import CheckpointError

    checkpointer, folder, _ = _resumable(tmp_path, 1, rank_files=[0], engine=_EngineMissing())
    with pytest.raises(CheckpointError, match=r"engine/zero_pp_rank_1_mp_rank_00_optim_states.pt: "
                                              r"missing, so this checkpoint's optimizer state "
                                              r"cannot be read; resume from the one before it"):
        checkpointer.resume(folder)



@pytest.mark.parametrize("files, rank, missing", [
    (["mp_rank_00_model_states.pt"], 1, None),  # ZeRO 0: one file, read by every rank
    ([], 0, "mp_rank_00_model_states.pt"),
    (["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"], 1,
     "zero_pp_rank_1_mp_rank_00_optim_states.pt"),  # ZeRO 1-2: a partition per rank
    (["mp_rank_00_model_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"], 0,
     "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    (["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
      "zero_pp_rank_1_mp_rank_00_optim_states.pt"], 1,
     "zero_pp_rank_1_mp_rank_00_model_states.pt"),  # ZeRO 3: model states per rank too
    (["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"],
     0, None),
])
def test_the_engine_file_a_rank_will_read_is_found_missing_before_deepspeed_reads(
        tmp_path, files, rank, missing):
    from vlcontrast.checkpoints import missing_engine_file

    for name in files:
        (tmp_path / name).write_bytes(b"")
    found = missing_engine_file(tmp_path, rank)
    assert (found.name if found else None) == missing


def _resume_with_rank_1s_partition_lost(rank, world_size, tmp_path):
    from vlcontrast.errors import CheckpointError

    # Each rank its own copy (no two processes make one folder); both lost rank 1's partition.
    checkpointer, folder, _ = _resumable(tmp_path / f"rank{rank}", 2, rank_files=[0, 1])
    (folder / "engine" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    try:
        checkpointer.resume(folder)
    except CheckpointError as error:
        return str(error)
    return "resumed"


def test_a_partition_lost_on_one_rank_stops_every_rank_before_deepspeed_s_load(tmp_path):
    """Rank 1 alone would fail inside DeepSpeed's load while rank 0 waited in its collectives
    until the process-group timeout."""
    from tests.distributed import run_distributed

    messages = run_distributed(_resume_with_rank_1s_partition_lost, 2, tmp_path, timeout=120)
    assert messages[1].startswith(str(tmp_path / "rank1" / "run" / "checkpoints" / "step_00000004"
                                      / "engine" / "zero_pp_rank_1_mp_rank_00_optim_states.pt: "
                                      "missing, so this checkpoint's optimizer state"))
    assert messages[0] == messages[1] + " [reported by rank 1]"


def test_retention_keeps_the_checkpoint_just_written_over_later_steps_of_another_history(
        tmp_path):
    """Resumed from step 2 of a run that had reached step 4: the step-3 checkpoint the resumed run
    writes is kept (sorting by name alone kept step 4 and deleted it), and step 4 is left alone."""
    from vlcontrast.train.checkpoint import prune

    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        (root / f"step_{step:08d}").mkdir(parents=True)
    prune(root, keep=1, newest=root / "step_00000003")
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003", "step_00000004"]
    prune(root, keep=1)  # without a newest: the highest steps, as before
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004"]
