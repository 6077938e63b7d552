"""The preflight against a fuzzer's values (/tmp/probe_cfg, findings F5, F6, F7, F10, F14, F16):
what only the data, the files or the machine can tell is one line before the model is built
(and before the run folder is made, where the preflight can say it first), not a traceback or
an allocation after work started."""

from __future__ import annotations

import copy
import logging
import math
import os
from types import SimpleNamespace

import pytest
import torch

from vlcontrast.errors import ConfigError, DataLayoutError



def _config(data, run, **extra):
    from tests.train.helpers import tiny_config

    return tiny_config(data, run, **extra)


# -- F10: model.pretrained that is not weights ------------------------------------------------


def test_f10_a_pretrained_file_that_is_not_weights_is_refused_before_the_run_folder(tiny_data,
                                                                                   tmp_path):
    """It was a 37-line UnpicklingError from open_clip's load_checkpoint inside build_model."""
    from vlcontrast.train.preflight import preflight

    not_weights = tmp_path / "base.yaml"
    not_weights.write_text("output_dir: runs/x\n")
    run = tmp_path / "run"
    with pytest.raises(ConfigError) as caught:
        preflight(_config(tiny_data, run, model__pretrained=str(not_weights)))
    assert str(caught.value) == (
        f"model.pretrained={str(not_weights)!r}: not a weights file (it starts with "
        "b'output_dir: ', not as a PyTorch checkpoint (a zip or a pickle) does); name an "
        "open_clip weights file (.pt, .pth, .bin, .safetensors, .npz), a vlcontrast run or "
        "checkpoint folder, or a pretrained tag")
    assert not run.exists()


@pytest.mark.parametrize("name, content", [
    ("w.pt", b""), ("w.safetensors", b"not safetensors at all"), ("w.npz", b"PK\x03\x04junk"),
    ("w.bin", b"\x89PNG\r\n\x1a\n"), ("w.npy", b"hello"),
])
def test_f10_weights_headers_that_no_loader_reads_are_refused(tmp_path, name, content):
    from vlcontrast.train.preflight import check_weights_header

    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=rf"^distill\.teacher_pretrained='.*{name}': "):
        check_weights_header(path, "distill.teacher_pretrained")


def test_f10_real_weights_files_pass_the_header_check(tmp_path):
    import numpy as np
    from safetensors.torch import save_file

    from vlcontrast.train.preflight import check_weights_header

    state = {"w": torch.ones(2)}
    torch.save(state, tmp_path / "zip.pt")
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), tmp_path / "script.pt")
    save_file(state, tmp_path / "w.safetensors")
    np.savez(tmp_path / "w.npz", w=np.ones(2))
    np.save(tmp_path / "w.npy", np.ones(2))
    for path in sorted(tmp_path.iterdir()):
        check_weights_header(path, "model.pretrained")


# -- F10, F14: deepspeed.overrides -------------------------------------------------------------


@pytest.mark.parametrize("override, line", [
    ("deepspeed.overrides.bogus=1",
     r"^deepspeed\.overrides\.bogus=1: not a DeepSpeed setting \(DeepSpeed would ignore it\); "
     r"its top-level keys: .*\bzero_optimization\b"),
    ("deepspeed.overrides.wall_clock_breakdwn=true",
     r"^deepspeed\.overrides\.wall_clock_breakdwn=True: not a DeepSpeed setting \(did you mean "
     r"'wall_clock_breakdown'\?\)"),
    ("deepspeed.overrides.train_batch_size=7",
     r"^deepspeed\.overrides\.train_batch_size=7: vlcontrast sets it \(train_batch_size=8 from "
     r"data\.batch_size=8 x train\.accum_steps=1 x 1 rank\(s\)\); set those instead and drop "
     r"deepspeed\.overrides\.train_batch_size$"),
    ("deepspeed.overrides.gradient_accumulation_steps=4",
     r"^deepspeed\.overrides\.gradient_accumulation_steps=4: vlcontrast sets it"),
    ("deepspeed.overrides={zero_optimization: {stage: 9}}",
     r"^deepspeed\.overrides\.zero_optimization=\{'stage': 9\}: DeepSpeed refuses it "
     r"\(DeepSpeedZeroConfig: stage: Input should be .*\); fix it or drop it$"),
    ("deepspeed.overrides={fp16: {enabled: x}}",
     r"^deepspeed\.overrides\.fp16=\{'enabled': 'x'\}: DeepSpeed refuses it "
     r"\(DeepSpeedFP16Config: enabled: "),
])
def test_f10_f14_deepspeed_overrides_are_checked_before_the_model_and_the_run_folder(
        tiny_data, tmp_path, override, line):
    """Unknown keys were ignored without a word; DeepSpeed's refusals were 30-40-line tracebacks
    from deepspeed.initialize, after the model was built."""
    from tests.train.helpers import tiny_overrides
    from vlcontrast.config import load_config
    from vlcontrast.train.preflight import preflight

    run = tmp_path / "run"
    config = load_config(None, tiny_overrides(tiny_data, run) + [override])
    with pytest.raises(ConfigError, match=line) as caught:
        preflight(config)
    assert "\n" not in str(caught.value)
    assert not run.exists()


@pytest.mark.parametrize("override", ["deepspeed.overrides.wall_clock_breakdown=true",
                                      "deepspeed.overrides.train_batch_size=8",
                                      "deepspeed.overrides={zero_optimization: {stage: 1}}"])
def test_f10_valid_deepspeed_overrides_pass(tiny_data, tmp_path, override):
    from tests.train.helpers import tiny_overrides
    from vlcontrast.config import load_config
    from vlcontrast.train.preflight import preflight

    preflight(load_config(None, tiny_overrides(tiny_data, tmp_path / "run") + [override]))


# -- F6: data.workers, eval.batch_size ---------------------------------------------------------


def test_f6_more_workers_than_the_machine_can_run_are_refused(tiny_data, tmp_path):
    """99999999999999 was an allocation traceback (1.6 PB) after the model was built."""
    from vlcontrast.train import preflight as checks
    from vlcontrast.train.preflight import preflight

    if getattr(checks, "_process_limit", lambda: True)() is None:
        pytest.skip("this system names no process limit")

    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^data\.workers=99999999999999: 99999999999999 loader "
                                          r"processes \(99999999999999 x 1 rank\(s\) on this "
                                          r"machine\) are more than it can run \(.*\); set "
                                          r"data\.workers to at most \d+ "):
        preflight(_config(tiny_data, run, data__workers=99999999999999))
    assert not run.exists()


def test_f6_more_workers_than_cores_is_a_warning_not_an_error(tiny_data, tmp_path, caplog):
    from vlcontrast.train.preflight import preflight

    cores = len(os.sched_getaffinity(0))
    with caplog.at_level(logging.WARNING, logger="vlcontrast.train.preflight"):
        preflight(_config(tiny_data, tmp_path / "run", data__workers=cores + 1))
    assert any(record.getMessage().startswith(f"data.workers={cores + 1}: {cores + 1} loader "
                                              f"processes") for record in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vlcontrast.train.preflight"):
        preflight(_config(tiny_data, tmp_path / "run2", data__workers=1))
    assert not caplog.records


def test_f6_an_eval_batch_larger_than_the_evaluation_sets_is_capped_to_them(tiny_data, tmp_path):
    """The final evaluation died with a MemoryError (a list of 1e14 entries per batch) after the
    whole run had trained; the config keeps the value given."""
    from vlcontrast.train.evaluate import Evaluator
    from vlcontrast.train.preflight import preflight

    config = _config(tiny_data, tmp_path / "run", eval__batch_size=99999999999999,
                     eval__retrieval="", data__val=str(tiny_data / "val"))
    evaluator = Evaluator(config.eval, val_shards=config.data.val)
    preflight(config, evaluator)
    assert evaluator.config.batch_size == 8  # the 8 validation pairs
    assert config.eval.batch_size == 99999999999999
    config = _config(tiny_data, tmp_path / "run2", eval__batch_size=99999999999999,
                     eval__retrieval="", data__val=str(tiny_data / "val"),
                     eval__zeroshot=str(tiny_data / "zeroshot"))
    evaluator = Evaluator(config.eval, val_shards=config.data.val)
    preflight(config, evaluator)
    assert evaluator.config.batch_size == 10  # the larger set: one zero-shot image per class
    config = _config(tiny_data, tmp_path / "run3", eval__batch_size=5,
                     eval__retrieval="", data__val=str(tiny_data / "val"))
    evaluator = Evaluator(config.eval, val_shards=config.data.val)
    preflight(config, evaluator)
    assert evaluator.config.batch_size == 5


# -- F16: data.train that is a run folder ------------------------------------------------------


def test_f16_a_run_folder_as_training_data_is_named_as_one(tiny_data, tmp_path):
    """It said the folder "holds images" (the run's loss_curve.png) and to convert them."""
    from vlcontrast.train.preflight import preflight

    earlier = tmp_path / "earlier"
    (earlier / "checkpoints").mkdir(parents=True)
    (earlier / "config.yaml").write_text(f"data:\n  train: {tiny_data / 'train'}\n")
    (earlier / "loss_curve.png").write_bytes(b"\x89PNG")
    run = tmp_path / "run"
    config = _config(tiny_data, run)
    config.data.train = str(earlier)
    with pytest.raises(ConfigError) as caught:
        preflight(config)
    assert str(caught.value) == (
        f"data.train={str(earlier)!r}: a vlcontrast run folder (config.yaml, checkpoints/), not "
        f"shards; name a folder or pattern of .tar shards (that run trained on "
        f"data.train={str(tiny_data / 'train')!r})")
    assert not run.exists()


# -- F5, F6, F7: the accumulated batch and the id space, where the preflight reads the data ------


def test_f5_an_accumulated_batch_larger_than_an_epoch_is_refused_before_the_model(
        tiny_data, tmp_path, no_model):
    """A step read micro-batches for ever (across epochs) and SIGTERM could not stop it."""
    config = _config(tiny_data, tmp_path / "run", train__accum_steps=99999999999999)
    with pytest.raises(DataLayoutError) as caught:
        no_model.train(config)
    assert str(caught.value) == (
        "train.accum_steps=99999999999999: a step's accumulated batch (8 x 1 rank(s) x "
        "99999999999999 = 799999999999992 samples) is larger than an epoch (64 samples); set "
        "train.accum_steps to at most 8, or train on more data")
    assert not (tmp_path / "run").exists()
    config.train.accum_steps = 8  # one epoch exactly
    with pytest.raises(AssertionError, match="the model was built"):
        no_model.train(config)


def test_f5_check_batch_fits_counts_ranks_and_accumulation():
    from vlcontrast.data.sources import check_batch_fits

    data = SimpleNamespace(batch_size=4, train="d")
    shards = SimpleNamespace(num_samples=40, urls=["d/00000.tar"])
    check_batch_fits(data, shards, 2, accum_steps=5)  # 4 x 2 x 5 = 40
    with pytest.raises(DataLayoutError, match=r"^train\.accum_steps=6: .*\(4 x 2 rank\(s\) x 6 = "
                                              r"48 samples\) is larger than an epoch \(40 "
                                              r"samples\); set train\.accum_steps to at most 5"):
        check_batch_fits(data, shards, 2, accum_steps=6)
    check_batch_fits(data, shards, 2)  # the loader's own check: no accumulation to judge


@pytest.mark.parametrize("id_space, needs_ids, line", [
    (3, True, r"^data\.id_space=3: the shards hold sample ids up to 10031 \(in '.*00001\.tar'\), "
              r"which would be skipped as out of range; set data\.id_space to at least 10032, or "
              r"0 to read manifest\.json \(20000 ids\)$"),
    (3, False, r"^data\.id_space=3: the shards hold sample ids up to 10031"),
    (10031, True, r"^data\.id_space=10031: .*at least 10032"),
    (99999999999999, True,
     r"^data\.id_space=99999999999999: the loss's per-sample buffer would hold 99999999999999 "
     r"rows \(at least .* GiB\), more than this machine's .* GiB of memory; set data\.id_space "
     r"to the number of distinct sample ids \(0 reads manifest\.json\)$"),
])
def test_f6_f7_an_id_space_the_shards_do_not_fit_is_refused(tiny_data, id_space, needs_ids, line):
    """id_space=3 trained until 61 of 64 samples were "bad"; a huge one (decl) was an
    allocation traceback of 800 TB after the model was built."""
    from vlcontrast.config import DataConfig
    from vlcontrast.data.sources import check_ids_available

    data = DataConfig(train=str(tiny_data / "train"), batch_size=8, workers=0, id_space=id_space)
    with pytest.raises(DataLayoutError, match=line):
        check_ids_available(data, needs_ids)


def test_f6_f7_id_spaces_that_fit_are_kept(tiny_data, caplog):
    """The manifest's id_space is a bound (key stride x shards), not a count: 10032 holds every
    id of these shards (up to 10031) though the manifest says 20000. Above the manifest's
    bound the buffer has rows no sample uses: a warning."""
    from vlcontrast.config import DataConfig
    from vlcontrast.data.sources import check_ids_available

    for id_space in (10032, 20000, 0):
        data = DataConfig(train=str(tiny_data / "train"), workers=0, id_space=id_space)
        assert check_ids_available(data, True).id_space == (id_space or 20000)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    with caplog.at_level(logging.WARNING, logger="vlcontrast.data.sources"):
        data = DataConfig(train=str(tiny_data / "train"), workers=0, id_space=30000)
        assert check_ids_available(data, True).id_space == 30000
        data = DataConfig(train=str(tiny_data / "train"), workers=0, id_space=99999999999999)
        check_ids_available(data, False)  # no buffer: nothing allocated from it
    assert [r.getMessage() for r in caplog.records] == [
        "data.id_space=30000 is above the 20000 ids the manifest.json of the shards declares: "
        "the loss's buffer keeps 10000 rows no sample uses (data.id_space=0 reads the manifest)"]


def test_f7_a_small_id_space_stops_the_run_before_the_model(tiny_data, tmp_path, no_model):
    config = _config(tiny_data, tmp_path / "run", loss__name="decl", data__id_space=3)
    with pytest.raises(DataLayoutError, match=r"^data\.id_space=3: the shards hold sample ids"):
        no_model.train(config)
    assert not (tmp_path / "run").exists()


# -- F5: the learning-rate table -----------------------------------------------------------------


@pytest.mark.parametrize("warmup, total, ratio", [(0, 1, 0.0), (2, 8, 0.0), (100, 1000, 0.1),
                                                  (10, 200_000, 0.05), (5, 65_536, 0.0),
                                                  (5, 65_535, 0.3)])
def test_f5_the_lr_table_is_bit_identical_to_the_whole_schedule(warmup, total, ratio):
    from vlcontrast.train.optimizer import LrFactors, cosine_with_warmup

    factor = cosine_with_warmup(warmup, total, ratio)
    whole = torch.tensor([factor(step) for step in range(total + 1)], dtype=torch.float32)
    assert torch.equal(LrFactors(factor, total).full(), whole)
    table = LrFactors(factor, total)
    for step in (0, 1, 65_535, 65_536, 70_000, 131_072, total):
        part = table.covering(step)
        assert part.numel() > min(step, total)
        assert torch.equal(part, whole[:part.numel()])


def test_f5_a_huge_run_builds_no_table_of_every_step():
    """train.steps=99999999999999 spent minutes and GBs on a Python list of every step's factor
    before the first step (and SIGTERM could not stop it)."""
    from vlcontrast.config import OptimConfig
    # LrFactors first: without it build_optimizer would try to make the whole list (and take
    # every byte of the machine before failing).
    from vlcontrast.train.optimizer import LrFactors, build_optimizer

    model = torch.nn.Linear(4, 3)
    optimizer, _ = build_optimizer(model, OptimConfig(lr=1e-2, warmup_steps=2), 99999999999999,
                                   finite_checked=True)
    assert isinstance(optimizer.lr_factors, LrFactors)
    assert optimizer.lr_factors.table.numel() == 1 << 16


def test_f5_the_device_schedule_follows_a_table_that_grows_and_a_resumed_state(monkeypatch):
    """Past the table's first piece and after loading a state from a checkpoint, the kernel's
    rate is still initial_lr * factor(applied steps), as with one table of every step."""
    from vlcontrast.config import OptimConfig
    from vlcontrast.train.optimizer import LrFactors, build_optimizer, cosine_with_warmup

    monkeypatch.setattr(LrFactors, "FIRST", 4)
    monkeypatch.setattr(LrFactors, "PIECE", 3)
    optim = OptimConfig(lr=1e-2, warmup_steps=2, weight_decay=0.0)
    total = 40
    factor = cosine_with_warmup(2, total)

    def model():
        torch.manual_seed(0)
        return torch.nn.Linear(4, 3)

    def train(optimizer, net, steps):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
        for _ in range(steps):
            net(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()

    checked_model, reference_model = model(), model()
    checked, _ = build_optimizer(checked_model, optim, total, finite_checked=True)
    reference, _ = build_optimizer(reference_model, optim, total, finite_checked=False)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    for applied in range(12):
        checked_model(x).square().sum().backward()
        checked.step()
        checked.zero_grad()
        for group in reference.param_groups:
            group["lr"] = group["initial_lr"] * float(torch.tensor(factor(applied),
                                                                   dtype=torch.float32))
        reference_model(x).square().sum().backward()
        reference.step()
        reference.zero_grad()
        for a, b in zip(checked_model.parameters(), reference_model.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    assert 12 <= checked.lr_factors.table.numel() < total + 1  # grown, not the whole schedule

    resumed_model = model()
    resumed, _ = build_optimizer(resumed_model, optim, total, finite_checked=True)
    resumed_model.load_state_dict(checked_model.state_dict())
    resumed.load_state_dict(copy.deepcopy(checked.state_dict()))  # as from a checkpoint file
    assert resumed.lr_factors.table.numel() == 4
    train(resumed, resumed_model, 3)
    train(checked, checked_model, 3)
    for a, b in zip(checked_model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
    assert math.isclose(float(resumed.state[resumed_model.weight]["step"]), 15)


def test_f5_a_state_written_without_load_state_dict_is_read_at_the_first_step(monkeypatch):
    """DeepSpeed's universal-checkpoint load writes the step count into the optimizer's state
    directly, without load_state_dict: the first step must still index the schedule by that
    count (it used factor(FIRST - 1), the table's end, until the table grew past it)."""
    import copy

    from vlcontrast.config import OptimConfig
    from vlcontrast.train.optimizer import LrFactors, build_optimizer, cosine_with_warmup

    monkeypatch.setattr(LrFactors, "FIRST", 4)
    monkeypatch.setattr(LrFactors, "PIECE", 3)
    optim = OptimConfig(lr=1e-2, warmup_steps=2, weight_decay=0.0)
    total, done = 40, 12
    factor = cosine_with_warmup(2, total)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))

    def model():
        torch.manual_seed(0)
        return torch.nn.Linear(4, 3)

    trained = model()
    first, _ = build_optimizer(trained, optim, total, finite_checked=True)
    for _ in range(done):
        trained(x).square().sum().backward()
        first.step()
        first.zero_grad()
    resumed_model, reference_model = model(), model()
    resumed_model.load_state_dict(trained.state_dict())
    reference_model.load_state_dict(trained.state_dict())
    resumed, _ = build_optimizer(resumed_model, optim, total, finite_checked=True)
    reference, _ = build_optimizer(reference_model, optim, total, finite_checked=False)
    for target, optimizer in ((resumed_model, resumed), (reference_model, reference)):
        for p, q in zip(target.parameters(), trained.parameters()):
            optimizer.state[p] = copy.deepcopy(first.state[q])  # not through load_state_dict
    for group in reference.param_groups:
        group["lr"] = group["initial_lr"] * float(torch.tensor(factor(done), dtype=torch.float32))
    for net, optimizer in ((resumed_model, resumed), (reference_model, reference)):
        net(x).square().sum().backward()
        optimizer.step()
    for a, b in zip(resumed_model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
