"""Distillation inside ``vlcontrast train``: online against offline, GradCache, resume, the frozen
teacher, and the one-line errors before step 1.

The student is ``vlc-micro`` (32 px, width 32, context 16); the teacher ``vlc-tiny`` (64 px, width
64, context 32) with seeded weights from a file, so every sample is transformed and tokenized once
per model and the ``features``/``interactive`` kinds need the projection.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.train.helpers import tiny_config
from vlcontrast.errors import ConfigError


def _teacher(teacher_file, **extra):
    return {"distill__teacher": "vlc-tiny", "distill__teacher_pretrained": str(teacher_file),
            **extra}


def _train(config):
    from vlcontrast.train.loop import train

    return train(config)


def _losses(run: Path, key: str = "loss") -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row[key] for row in rows if row.get("kind") == "train"]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from vlcontrast.checkpoints import resolve_weights

    return torch.load(resolve_weights(str(run)) / "model.pt", weights_only=True)


def _max_difference(first: dict, second: dict) -> float:
    assert first.keys() == second.keys()
    return max(float((first[k].float() - second[k].float()).abs().max()) for k in first)


def test_offline_equals_online(data, teacher_file, tmp_path):
    """K = 2 stored augmentations cover the 2 epochs of the run (48 samples per epoch at batch 8
    is 6 steps; 9 steps cross into epoch 1): the same losses, distillation terms and weights."""
    from vlcontrast.distill.offline import write_teacher_features

    features = tmp_path / "teacher.pt"
    summary = write_teacher_features(str(data / "train"), features, teacher="vlc-tiny",
                                     pretrained=str(teacher_file), augmentations=2,
                                     dtype="float32")
    assert summary["samples"] == 96 and summary["dim"] == 64
    common = dict(train__steps=14, loss__name="dcl", distill__kind="logits", data__batch_size=8)
    online = tmp_path / "online"
    _train(tiny_config(data, online, **_teacher(teacher_file, distill__augmentations=2), **common))
    offline = tmp_path / "offline"
    _train(tiny_config(data, offline, distill__teacher_features=str(features), **common))
    assert _losses(online, "distill_loss") == pytest.approx(_losses(offline, "distill_loss"),
                                                rel=1e-5, abs=1e-6)
    assert _losses(online) == pytest.approx(_losses(offline), rel=1e-5, abs=1e-6)
    assert _max_difference(_weights(online), _weights(offline)) < 1e-5
    # each run's results say what it learned from
    said = {run: json.loads((run / "results.json").read_text()) for run in (online, offline)}
    assert said[online]["distill"] == "logits x 1 from vlc-tiny"
    assert said[offline]["distill"] == f"logits x 1 from stored features {features}"
    assert "| distill | logits x 1 from vlc-tiny |" in (online / "report.md").read_text()
    # and the teacher mattered: a run without it trains differently
    alone = tmp_path / "alone"
    _train(tiny_config(data, alone, **common))
    assert _max_difference(_weights(online), _weights(alone)) > 1e-4
    assert "distill" not in json.loads((alone / "results.json").read_text())


def test_offline_views_are_the_teachers(data, teacher_file, tmp_path):
    """The stored embedding of (sample, augmentation k) is the teacher's output on its own view of
    that sample seeded for k (checked for a few samples, outside the loader)."""
    from vlcontrast.data.loader import build_train_loader
    from vlcontrast.config import DataConfig
    from vlcontrast.distill.offline import TeacherFeatures, write_teacher_features
    from vlcontrast.distill.teacher import Teacher, image_transforms
    from vlcontrast.distill.views import augmentation_key, seeded

    path = tmp_path / "teacher.pt"
    write_teacher_features(str(data / "train"), path, teacher="vlc-tiny",
                           pretrained=str(teacher_file), augmentations=3, dtype="float32")
    stored = TeacherFeatures(path)
    teacher = Teacher.load("vlc-tiny", str(teacher_file))
    train, _ = image_transforms(teacher.model, {})
    images = {}

    def remember(image):
        images.setdefault(len(images), image.copy())
        return torch.zeros(1)

    loader = build_train_loader(DataConfig(train=str(data / "train"), batch_size=1, workers=0,
                               shuffle_buffer=0), remember, teacher.tokenizer, seed=0,
                                rank=0, world_size=1, needs_sample_ids=True)
    for position, batch in enumerate(loader):
        if position == 3:
            break
        image = images[position]
        for k in range(3):
            view = seeded(train, image, augmentation_key(image, k))
            expected = teacher.embed_images(view[None])[0]
            found = stored.lookup(batch.sample_ids, torch.tensor([k])).image[0]
            torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(stored.image[:, 0], stored.image[:, 1])


@pytest.mark.parametrize("kind", ["logits", "features", "interactive"])
def test_gradcache_equals_one_batch(data, teacher_file, tmp_path, kind):
    """Two micro-batches of 4 (GradCache) train like one batch of 8, the projection included."""
    extra = _teacher(teacher_file, distill__kind=kind, distill__projection=kind != "logits",
                     distill__weight=2.0, train__steps=3, optim__warmup_steps=1)
    _train(tiny_config(data, tmp_path / "one", data__batch_size=8, **extra))
    _train(tiny_config(data, tmp_path / "accum", data__batch_size=4, train__accum_steps=2,
                       **extra))
    one, accum = _weights(tmp_path / "one"), _weights(tmp_path / "accum")
    assert _losses(tmp_path / "accum", "distill_loss") == pytest.approx(
        _losses(tmp_path / "one", "distill_loss"), rel=1e-5)
    assert _losses(tmp_path / "accum") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)
    # AdamW turns float noise in near-zero gradients (attention key biases) into differences of
    # ~2e-5 after 3 steps, without a teacher too; a lost gradient would differ by ~lr per step.
    assert _max_difference(one, accum) < 1e-4
    if kind != "logits":
        assert "distill_projection.weight" in one
        difference = one["distill_projection.weight"] - accum["distill_projection.weight"]
        assert float(difference.abs().max()) < 1e-5
        start = _projection_start(teacher_file, data, tmp_path)
        assert float((one["distill_projection.weight"] - start).abs().max()) > 1e-5


def _projection_start(teacher_file, data, tmp_path):
    from vlcontrast.config import ModelConfig
    from vlcontrast.distill import Distiller
    from vlcontrast.models import build_model
    from vlcontrast.train.precision import Precision

    config = tiny_config(data, tmp_path / "x", **_teacher(teacher_file, distill__kind="features",
                                               distill__projection=True))
    bundle = build_model(ModelConfig(name="vlc-micro"))
    distiller = Distiller(config.distill, bundle.model, bundle.model_config, data=config.data,
                          augment={}, seed=config.seed, zero_stage=0,
                          device=torch.device("cpu"), precision=Precision("fp32"))
    return distiller.projection.weight.detach().clone()


def test_resume_is_exact_and_the_teacher_is_not_saved(data, teacher_file, tmp_path):
    from vlcontrast.train import StopRequested

    extra = _teacher(teacher_file, distill__kind="interactive", distill__projection=True,
                     train__steps=6, checkpoint__every=3, loss__name="decl")
    _train(tiny_config(data, tmp_path / "full", **extra))
    with pytest.raises(StopRequested):
        _train(tiny_config(data, tmp_path / "split", train__stop_at_step=3, **extra))
    _train(tiny_config(data, tmp_path / "split", train__resume="latest", **extra))
    full, split = _weights(tmp_path / "full"), _weights(tmp_path / "split")
    assert _max_difference(full, split) <= 1e-6
    student = _weights(tmp_path / "full").keys() - {"distill_projection.weight"}
    from vlcontrast.config import ModelConfig
    from vlcontrast.models import build_model

    assert student == set(build_model(ModelConfig(name="vlc-micro")).model.state_dict())
    # a distilled run loads as the plain student (the projection is a training aid)
    import vlcontrast

    model, _, _ = vlcontrast.load(tmp_path / "full", device="cpu")
    assert not hasattr(model, "distill_projection")


def test_teacher_is_frozen_and_in_eval_mode(teacher_file):
    from vlcontrast.distill.teacher import Teacher

    teacher = Teacher.load("vlc-tiny", str(teacher_file), compute_dtype=torch.bfloat16)
    assert not teacher.model.training
    assert not any(p.requires_grad for p in teacher.model.parameters())
    assert teacher.dtype == torch.bfloat16  # the run's compute precision
    batch = teacher.embed(torch.rand(2, 3, 64, 64), torch.zeros(2, 32, dtype=torch.long))
    assert batch.image.dtype == torch.float32 and not batch.image.requires_grad


def _one_line_error(data, output_dir, **overrides) -> str:
    """The ConfigError of loading the config or of starting the run, checked to be one line."""
    with pytest.raises(ConfigError) as caught:
        _train(tiny_config(data, output_dir, **overrides))
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_bad_teacher_name_is_one_line(data, tmp_path):
    import torch

    torch.save({"w": torch.zeros(1)}, tmp_path / "x.pt")  # its weights exist: the name is wrong
    message = _one_line_error(data, tmp_path / "r", distill__teacher="no-such-model",
                              distill__teacher_pretrained=str(tmp_path / "x.pt"))
    assert "distill.teacher='no-such-model'" in message
    assert not (tmp_path / "r" / "metrics.jsonl").exists() or not _losses(tmp_path / "r")


def test_teacher_without_weights_is_one_line(data, tmp_path):
    message = _one_line_error(data, tmp_path / "r", distill__teacher="vlc-tiny")
    assert "distill.teacher_pretrained" in message


@pytest.mark.parametrize("value", ["/some/runs/teachr", "runs/teachr", "teacher.pt"])
def test_a_teacher_path_that_does_not_exist_is_not_a_model_name(data, tmp_path, value):
    message = _one_line_error(data, tmp_path / "r", distill__teacher=value)
    assert message.startswith(f"distill.teacher={value!r}: the path does not exist")
    assert "a model name needs" not in message


def test_teacher_weights_of_another_model_are_one_line(data, teacher_file, tmp_path):
    """A vlc-tiny weights file for a vlc-micro teacher: open_clip's assertion, as one line."""
    from vlcontrast.config import ModelConfig
    from vlcontrast.export import export_open_clip
    from vlcontrast.models import build_model

    checkpoint = tmp_path / "tiny" / "checkpoints" / "step_00000001"
    checkpoint.mkdir(parents=True)
    bundle = build_model(ModelConfig(name="vlc-tiny"))
    torch.save(torch.load(teacher_file, weights_only=True), checkpoint / "model.pt")
    (checkpoint / "model_config.json").write_text(json.dumps(bundle.model_config))
    (checkpoint.parent / "latest").write_text("step_00000001\n")
    export_open_clip(tmp_path / "tiny", tmp_path / "oc")
    weights = tmp_path / "oc" / "open_clip_model.safetensors"
    message = _one_line_error(data, tmp_path / "r", distill__teacher="vlc-micro",
                              distill__teacher_pretrained=str(weights))
    assert message.startswith(f"distill.teacher_pretrained={str(weights)!r}: ")
    assert "does not fit this model (distill.teacher='vlc-micro')" in message
    assert "here distill.teacher=vlc-tiny" in message


def test_teacher_features_folder_is_named_a_folder(data, tmp_path):
    (tmp_path / "feats").mkdir()
    message = _one_line_error(data, tmp_path / "r", distill__teacher_features=str(tmp_path))
    assert message.startswith(f"distill.teacher_features={str(tmp_path)!r}: a folder")
    assert "vlcontrast prep teacher" in message and "does not exist" not in message


@pytest.mark.parametrize("option,value", [("kind", "features"), ("projection", True),
                                          ("weight", 5.0), ("augmentations", 2)])
def test_distill_options_without_a_teacher_are_one_line(option, value):
    from vlcontrast.config import load_config

    with pytest.raises(ConfigError) as caught:
        load_config(overrides=["train.steps=1", f"distill.{option}={value}"])
    message = str(caught.value)
    assert message.startswith(f"distill.{option}={value!r}: applies only with a teacher")
    assert "set distill.teacher" in message and f"drop distill.{option}" in message


@pytest.mark.parametrize("kind", ["features", "interactive"])
def test_width_mismatch_without_projection_is_one_line(data, teacher_file, tmp_path, kind):
    message = _one_line_error(data, tmp_path / "r",
                              **_teacher(teacher_file, distill__kind=kind))
    assert "width 32" in message and "64" in message and "distill.projection=true" in message


def test_features_of_other_data_or_teacher_are_one_line(data, teacher_file, tmp_path):
    from vlcontrast.data.prep.synthetic import write_synthetic
    from vlcontrast.distill.offline import write_teacher_features

    other = tmp_path / "other"
    write_synthetic(other, train=96, val=16, zeroshot_per_class=1, seed=1, image_size=32,
                    shard_size=32, workers=1, progress=False)
    features = tmp_path / "other.pt"
    write_teacher_features(str(other / "train"), features, teacher="vlc-tiny",
                           pretrained=str(teacher_file), augmentations=1)
    message = _one_line_error(data, tmp_path / "r",
                              distill__teacher_features=str(features))
    assert "made for another run" in message and "data" in message
    # the right data, but the run names another teacher
    mine = tmp_path / "mine.pt"
    write_teacher_features(str(data / "train"), mine, teacher="vlc-tiny",
                           pretrained=str(teacher_file), augmentations=1)
    torch.manual_seed(8)
    from vlcontrast.config import ModelConfig
    from vlcontrast.models import build_model

    second = tmp_path / "second.pt"
    torch.save(build_model(ModelConfig(name="vlc-tiny")).model.state_dict(), second)
    message = _one_line_error(data, tmp_path / "r2", distill__teacher_features=str(mine),
                              distill__teacher="vlc-tiny",
                              distill__teacher_pretrained=str(second))
    assert "teacher" in message and "made for another run" in message
    # and a file that is not one
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a file of ours")
    message = _one_line_error(data, tmp_path / "r3",
                              distill__teacher_features=str(junk))
    assert "not a teacher-features file" in message


def test_distillation_refuses_normalize_on_device(data, teacher_file, tmp_path):
    message = _one_line_error(data, tmp_path / "r", data__normalize_on_device=True,
                              **_teacher(teacher_file))
    assert "data.normalize_on_device" in message


def test_distillation_refuses_gpu_decode(data, teacher_file, tmp_path):
    message = _one_line_error(data, tmp_path / "r", data__decode="gpu", **_teacher(teacher_file))
    assert "data.decode" in message and "data.decode=cpu" in message


def test_with_a_teacher_the_cuda_default_normalises_in_the_loader(data):
    """Unset, normalize_on_device is on for CUDA; with a teacher it is off, since the loader packs
    the teacher's view beside the student's, each normalised with its own model's statistics."""
    from vlcontrast.config import ModelConfig
    from vlcontrast.models import build_model
    from vlcontrast.train.loop import train_transform

    config = tiny_config(data, "unused")
    bundle = build_model(ModelConfig(name=config.model.name))
    cuda = torch.device("cuda")  # only compared, never used
    assert config.data.normalize_on_device is None
    assert train_transform(config.data, bundle, cuda)[1] is not None
    assert train_transform(config.data, bundle, cuda, distilling=True)[1] is None


def test_prep_teacher_command(data, teacher_file, tmp_path, capsys):
    from vlcontrast.cli import main
    from vlcontrast.distill.offline import TeacherFeatures

    out = tmp_path / "teacher.pt"
    assert main(["prep", "teacher", str(data / "train"), str(out), "--teacher", "vlc-tiny",
                 "--teacher-pretrained", str(teacher_file), "--augmentations", "2",
                 "--no-progress"]) == 0
    stored = TeacherFeatures(out)
    assert stored.augmentations == 2 and stored.image.shape == (96, 2, 64)
    assert stored.image.dtype == torch.float16
    out_line = capsys.readouterr().out.strip()  # one summary line; the key stays in the file
    assert out_line.startswith("prep teacher: 96 samples, 192 views (2 augmentations)")
    assert str(out) in out_line and "\n" not in out_line and "shard_list" not in out_line
    assert stored.key["data"]["shard_list"]
    assert main(["prep", "teacher", str(data / "train"), str(tmp_path / "x.pt"), "--teacher",
                 "no-such-model", "--teacher-pretrained", "x"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "--teacher='no-such-model'" in error


def _prep_teacher_error(capsys, *argv) -> str:
    from vlcontrast.cli import main

    assert main(["prep", "teacher", *map(str, argv)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and error.startswith("vlcontrast: error: ")
    return error


def test_prep_teacher_progress_has_a_total(data, teacher_file, tmp_path, capsys):
    from vlcontrast.cli import main

    assert main(["prep", "teacher", str(data / "train"), str(tmp_path / "t.pt"), "--teacher",
                 "vlc-tiny", "--teacher-pretrained", str(teacher_file), "--augmentations",
                 "0"]) == 0
    err = capsys.readouterr().err
    assert "prep teacher -> " in err and "96/96" in err


def test_prep_teacher_device_defaults_to_auto():
    from vlcontrast.cli import build_parser

    args = build_parser().parse_args(["prep", "teacher", "s", "o.pt", "--teacher", "t"])
    assert args.device == "auto"


def test_prep_teacher_unknown_augment_key_is_model_augments_error(data, tmp_path, capsys):
    error = _prep_teacher_error(capsys, data / "train", tmp_path / "t.pt", "--teacher",
                                "vlc-tiny", "--augment", '{"scal": [0.5, 1.0]}')
    assert error.startswith("vlcontrast: error: --augment='{\"scal\": [0.5, 1.0]}': key scal=")
    assert "unknown augmentation option" in error and "'scale'" in error


def test_prep_teacher_names_shards(data, teacher_file, tmp_path, capsys):
    error = _prep_teacher_error(capsys, tmp_path / "nowhere", tmp_path / "t.pt", "--teacher",
                                "vlc-tiny", "--teacher-pretrained", teacher_file)
    assert "SHARDS pattern" in error and "data.train" not in error


def test_prep_teacher_shards_without_numeric_ids(data, teacher_file, tmp_path, capsys):
    """Keys that are not numbers: the SHARDS argument, why (rows looked up by sample id) and the
    fix, not the training loader's words about data.train and a loss."""
    import tarfile

    shards = tmp_path / "named"
    shards.mkdir()
    with tarfile.open(data / "train" / "00000.tar") as source, \
            tarfile.open(shards / "00000.tar", "w") as target:
        for member in source.getmembers():
            payload = source.extractfile(member).read()
            member.name = "img_" + member.name
            target.addfile(member, __import__("io").BytesIO(payload))
    error = _prep_teacher_error(capsys, shards, tmp_path / "t.pt", "--teacher", "vlc-tiny",
                                "--teacher-pretrained", teacher_file)
    assert f"SHARDS={str(shards)!r}" in error and "whose key is not a number" in error
    assert "looked up by sample id" in error and "vlcontrast prep wds" in error
    assert "data.train" not in error and "per-sample state" not in error


def test_prep_teacher_weights_of_another_model(data, teacher_file, tmp_path, capsys):
    error = _prep_teacher_error(capsys, data / "train", tmp_path / "t.pt", "--teacher",
                                "vlc-micro", "--teacher-pretrained", teacher_file)
    assert f"--teacher-pretrained={str(teacher_file)!r}" in error
    assert "does not fit this model (--teacher='vlc-micro')" in error


def test_prep_teacher_mistyped_path(data, tmp_path, capsys):
    (tmp_path / "teacher").mkdir()
    error = _prep_teacher_error(capsys, data / "train", tmp_path / "t.pt", "--teacher",
                                tmp_path / "teachr")
    assert f"--teacher={str(tmp_path / 'teachr')!r}: the path does not exist" in error
    assert f"did you mean {str(tmp_path / 'teacher')!r}" in error


def test_an_unknown_teacher_tag_is_vlcontrasts_line_only(data, tmp_path, capsys, caplog):
    """open_clip logged its own ``error: Pretrained tag or path (openai) ... not found`` before
    vlcontrast's line, which repeated it as ``Pretrained value 'openai' is not a known tag``."""
    import logging

    with caplog.at_level(logging.INFO):
        error = _prep_teacher_error(capsys, data / "train", tmp_path / "t.pt", "--teacher",
                                    "vlc-tiny", "--teacher-pretrained", "openai")
        message = _one_line_error(data, tmp_path / "r", distill__teacher="vlc-tiny",
                                  distill__teacher_pretrained="openai")
    assert not [r for r in caplog.records if "openai" in r.getMessage()]
    assert error == ("vlcontrast: error: --teacher-pretrained='openai': no such file or folder, "
                     "and not a pretrained tag of --teacher='vlc-tiny' (open_clip has no "
                     "pretrained tags for it; name a weights file, a vlcontrast run, checkpoint "
                     "or export directory, or a transformers CLIPModel directory)")
    assert message.startswith("distill.teacher_pretrained='openai': no such file or folder, and "
                              "not a pretrained tag of distill.teacher='vlc-tiny' (")


def test_a_folder_of_no_model_as_teacher_names_the_option_once(data, tmp_path, capsys):
    """``distill.teacher='notclip': not a ... (distill.teacher 'notclip': no model.pt ...)``."""
    folder = tmp_path / "notclip"
    folder.mkdir()
    (folder / "foo.txt").write_text("x\n")
    message = _one_line_error(data, tmp_path / "r", distill__teacher=str(folder))
    assert message.startswith(f"distill.teacher={str(folder)!r}: no model.pt, no "
                              "checkpoints/latest and no open_clip_model.safetensors there")
    assert message.count(str(folder)) == 1, message
    error = _prep_teacher_error(capsys, data / "train", tmp_path / "t.pt", "--teacher", folder)
    assert error.startswith(f"vlcontrast: error: --teacher={str(folder)!r}: no model.pt")
    assert error.count(str(folder)) == 1, error


def _two_rank_runs(rank, world_size, data, teacher_file, out):
    from vlcontrast.train import StopRequested

    extra = _teacher(teacher_file, distill__kind="interactive", distill__projection=True,
                     train__steps=4, checkpoint__every=2, deepspeed__zero_stage=2,
                     train__accum_steps=2, data__batch_size=4, loss__chunk_size=3)
    _train(tiny_config(data, out / "full", **extra))
    try:
        _train(tiny_config(data, out / "split", train__stop_at_step=2, **extra))
    except StopRequested:
        pass
    _train(tiny_config(data, out / "split", train__resume="latest", **extra))
    return True


@pytest.mark.slow
def test_two_processes_zero2_gradcache_chunked_resume(data, teacher_file, tmp_path):
    """2 gloo ranks, ZeRO-2, GradCache, chunked rows, the projection: a run stopped at step 2 and
    resumed ends with the weights of the uninterrupted run, and the projection trained."""
    from tests.distributed import run_distributed

    run_distributed(_two_rank_runs, 2, data, teacher_file, tmp_path, timeout=600)
    full, split = _weights(tmp_path / "full"), _weights(tmp_path / "split")
    assert _max_difference(full, split) <= 1e-6
    midway = torch.load(tmp_path / "full" / "checkpoints" / "step_00000002" / "model.pt",
                        weights_only=True)
    difference = full["distill_projection.weight"] - midway["distill_projection.weight"]
    assert float(difference.abs().max()) > 1e-5


def test_features_of_other_augmentations_name_model_augment_and_the_flag(data):
    """Was "made for another run (augment differ from this run's)", naming neither
    model.augment nor prep teacher's --augment."""
    from vlcontrast.config import load_config
    from vlcontrast.distill.offline import TeacherFeatures, shards_digest
    from vlcontrast.errors import ConfigError

    config = load_config(None, ["train.steps=1", f"data.train={data}/train",
                                "model.augment={scale: [0.8, 1.0]}"])
    features = TeacherFeatures.__new__(TeacherFeatures)
    features.path = "t.pt"
    features.key = {"data": shards_digest(config.data), "members": [config.data.image_key,
                    config.data.caption_key], "augment": {"scale": [0.5, 1.0]},
                    "augmentations": 1}
    with pytest.raises(ConfigError, match=r"^distill\.teacher_features='t\.pt': made for another "
                                          r"run \(it differs from this run in: augmentation \(the "
                                          r"file's \{'scale': \[0\.5, 1\.0\]\}, this run's "
                                          r"model\.augment=\{'scale': \[0\.8, 1\.0\]\}\)\); "
                                          r"remake it with vlcontrast prep teacher --augment "
                                          r"'\{\"scale\": \[0\.8, 1\.0\]\}' for these shards"):
        features.check(data=config.data, augment=config.model.augment, teacher=None)
    features.key["augment"] = {"scale": [0.8, 1.0]}
    features.check(data=config.data, augment=config.model.augment, teacher=None)


def test_the_teachers_transform_with_colour_jitter_warns_nothing():
    """open_clip calls colour jitter "unused" although it applies it; the student's transform
    was built without that warning, the teacher's (same options) printed it."""
    import warnings

    from vlcontrast.config import ModelConfig
    from vlcontrast.distill.teacher import image_transforms
    from vlcontrast.models import build_model

    model = build_model(ModelConfig(name="vlc-micro")).model
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train, _ = image_transforms(model, {"color_jitter": [0.4, 0.4, 0.4, 0.1],
                                            "color_jitter_prob": 0.5})
    assert "color_jitter" in repr(train)  # applied, as the student's is
