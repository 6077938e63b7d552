"""Model building: open_clip names, JSON configs, a local Hugging Face text tower, SigLIP init."""

import json
import math

import pytest
import torch

from vlcontrast.config import ModelConfig
from vlcontrast.checkpoints import resolve_weights
from vlcontrast.models import build_model


def test_json_config_builds_with_open_clip_tokenizer_and_transforms():
    bundle = build_model(ModelConfig(name="vlc-micro"))
    tokens = bundle.tokenizer(["a small red circle", "two blue squares"])
    assert tokens.shape == (2, 16) and tokens.dtype == torch.long
    image = torch.rand(2, 3, 32, 32)
    out = bundle.model(image, tokens)
    assert out["image_features"].shape == (2, 32)
    assert torch.allclose(out["image_features"].norm(dim=-1), torch.ones(2), atol=1e-5)
    assert out["logit_scale"].item() == pytest.approx(1 / 0.07, rel=1e-4)
    assert bundle.model_config["model_name"] == "vlc-micro"


def test_siglip_initialisation():
    bundle = build_model(ModelConfig(name="vlc-micro"), siglip=True)
    assert bundle.model.logit_scale.exp().item() == pytest.approx(10.0, rel=1e-4)
    assert bundle.model.logit_bias.item() == pytest.approx(-10.0)


def test_hf_text_tower_from_local_directory(hf_text_dir):
    bundle = build_model(ModelConfig(name="vlc-micro", hf_model_dir=str(hf_text_dir)))
    assert "hf" in bundle.model_name
    assert bundle.model_config["model_cfg"]["text_cfg"]["hf_model_name"] == str(hf_text_dir.resolve())
    tokens = bundle.tokenizer(["a red circle", "two blue squares"])
    assert tokens.shape[0] == 2
    # The local vocabulary is used: "a red circle" -> ids 5, 6, 8 (this WordLevel tokenizer adds no [CLS]).
    assert tokens[0, :3].tolist() == [5, 6, 8]
    out = bundle.model(torch.rand(2, 3, 32, 32), tokens)
    assert out["text_features"].shape == (2, 32)
    assert torch.isfinite(out["text_features"]).all()


def test_bad_hf_directory_is_named(tmp_path):
    with pytest.raises(ValueError, match="model.hf_model_dir"):
        build_model(ModelConfig(name="vlc-micro", hf_model_dir=str(tmp_path)))


def test_resolve_checkpoint_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        resolve_weights(tmp_path)
    step = tmp_path / "checkpoints" / "step_00000003"
    step.mkdir(parents=True)
    (step / "model.pt").write_bytes(b"")
    (tmp_path / "checkpoints" / "latest").write_text("step_00000003\n")
    assert resolve_weights(tmp_path) == step


# --------------------------------------------------------------------------------------------
# model configs ship in the package; registering them leaves no folder per call


def test_shipped_configs_are_found_from_any_directory(tmp_path, monkeypatch):
    from vlcontrast.models import PACKAGE_CONFIG_DIR, resolve_model_config

    monkeypatch.chdir(tmp_path)
    name, cfg = resolve_model_config("vlc-tiny")
    assert name == "vlc-tiny" and cfg == json.loads((PACKAGE_CONFIG_DIR / "vlc-tiny.json").read_text())
    # configs/models/ under the current directory is the user's folder, and it comes first.
    (tmp_path / "configs" / "models").mkdir(parents=True)
    mine = dict(cfg, embed_dim=16)
    (tmp_path / "configs" / "models" / "vlc-tiny.json").write_text(json.dumps(mine))
    assert resolve_model_config("vlc-tiny")[1]["embed_dim"] == 16


def test_build_model_leaves_one_registry_folder_per_process(tmp_path, monkeypatch):
    import tempfile

    from vlcontrast import models

    models.remove_registry()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for embed_dim in (32, 32, 16):  # same config twice, then a changed one under the same name
        cfg_path = tmp_path / "custom-micro.json"
        cfg = json.loads((models.PACKAGE_CONFIG_DIR / "vlc-micro.json").read_text())
        cfg_path.write_text(json.dumps(dict(cfg, embed_dim=embed_dim)))
        bundle = build_model(ModelConfig(name=str(cfg_path)))
        assert bundle.model.text_projection.shape[-1] == embed_dim
    assert len(list(tmp_path.glob("vlcontrast-model-*"))) == 1
    models.remove_registry()
    assert list(tmp_path.glob("vlcontrast-model-*")) == []


@pytest.mark.slow
def test_built_wheel_finds_vlc_tiny_from_another_directory(tmp_path):
    """pip wheel + pip install --target: the installed package, run outside the repository, finds
    its shipped model configs (no source tree needed)."""
    import subprocess
    import sys
    from pathlib import Path

    import shutil

    root = Path(__file__).resolve().parents[2]
    # Build from a copy of the package sources: setuptools writes build/ and *.egg-info there.
    source = tmp_path / "source"
    shutil.copytree(root / "vlcontrast", source / "vlcontrast",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, source / name)
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheels), str(source)], check=True, cwd=tmp_path)
    wheel = next(wheels.glob("vlcontrast-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True, cwd=tmp_path)
    code = ("import vlcontrast, vlcontrast.models as m; print(vlcontrast.__file__); "
            "name, cfg = m.resolve_model_config('vlc-tiny'); print(name, cfg['embed_dim'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, check=True, text=True,
                         capture_output=True, env={**__import__("os").environ,
                                                   "PYTHONPATH": str(target)}).stdout.split()
    assert out[0].startswith(str(target)), out  # the installed copy, not the source tree
    assert out[1:] == ["vlc-tiny", "64"]


# --------------------------------------------------------------------------------------------
# model.pretrained from a vlcontrast checkpoint; locked towers (LiT)


def _write_checkpoint(folder, model):
    from vlcontrast.train.engine import open_clip_state_dict

    step = folder / "checkpoints" / "step_00000007"
    step.mkdir(parents=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(open_clip_state_dict(model, state), step / "model.pt")
    (folder / "checkpoints" / "latest").write_text("step_00000007\n")
    return step


def test_pretrained_from_a_vlcontrast_run_directory(tmp_path):
    torch.manual_seed(1)
    source = build_model(ModelConfig(name="vlc-rn-micro")).model
    with torch.no_grad():
        source.logit_scale.fill_(3.0)
    _write_checkpoint(tmp_path, source)
    torch.manual_seed(2)
    loaded = build_model(ModelConfig(name="vlc-rn-micro", pretrained=str(tmp_path))).model
    for (name, a), b in zip(source.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="model.pretrained=.*does not fit this model"):
        build_model(ModelConfig(name="vlc-micro", pretrained=str(tmp_path)))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="model.pretrained=.*not a vlcontrast run"):
        build_model(ModelConfig(name="vlc-micro", pretrained=str(empty)))


def test_frozen_batch_norm_checkpoint_loads_into_a_plain_model(tmp_path):
    from vlcontrast.models import load_model_from_checkpoint

    locked = build_model(ModelConfig(name="vlc-rn-micro", lock_image=True,
                                     lock_image_freeze_bn_stats=True))
    step = _write_checkpoint(tmp_path, locked.model)
    (step / "model_config.json").write_text(json.dumps(locked.model_config))
    assert not any(k.endswith("num_batches_tracked") for k in torch.load(step / "model.pt"))
    restored = load_model_from_checkpoint(tmp_path)
    assert torch.equal(restored.model.visual.bn1.running_var, locked.model.visual.bn1.running_var)


def _trainable(model):
    return {name for name, p in model.named_parameters() if p.requires_grad}


def test_lock_image_tower_as_open_clip_does():
    model = build_model(ModelConfig(name="vlc-micro", lock_image=True)).model
    assert not any(n.startswith("visual.") for n in _trainable(model))
    assert "logit_scale" in _trainable(model) and "text_projection" in _trainable(model)
    # ViT: the last group is (last block, ln_post), then proj: 2 groups unlock both.
    partial = build_model(ModelConfig(name="vlc-micro", lock_image=True,
                                      lock_image_unlocked_groups=2)).model
    visual = {n for n in _trainable(partial) if n.startswith("visual.")}
    assert "visual.proj" in visual and "visual.ln_post.weight" in visual
    assert "visual.conv1.weight" not in visual


def test_lock_image_freezes_batch_norm_statistics():
    from torchvision.ops.misc import FrozenBatchNorm2d

    model = build_model(ModelConfig(name="vlc-rn-micro", lock_image=True,
                                    lock_image_freeze_bn_stats=True)).model
    norms = [m for m in model.visual.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    frozen = [m for m in model.visual.modules() if isinstance(m, FrozenBatchNorm2d)]
    assert norms == [] and frozen
    before = [m.running_mean.clone() for m in frozen]
    model.train()(torch.rand(4, 3, 32, 32) * 5, torch.zeros(4, 16, dtype=torch.long))
    assert all(torch.equal(a, m.running_mean) for a, m in zip(before, frozen))
    with pytest.raises(ValueError, match="model.lock_image_unlocked_groups=1"):
        build_model(ModelConfig(name="vlc-rn-micro", lock_image=True, lock_image_unlocked_groups=1))


def test_lock_text_tower_as_open_clip_does():
    model = build_model(ModelConfig(name="vlc-tiny", lock_text=True,
                                    lock_text_unlocked_layers=1)).model
    text = {n for n in _trainable(model) if not n.startswith("visual.") and n != "logit_scale"}
    # open_clip unlocks the last block with the final norm and the projection.
    assert text and all(n.startswith(("transformer.resblocks.3.", "ln_final.", "text_projection"))
                        for n in text), text
    assert "token_embedding.weight" not in text
    with pytest.raises(ValueError, match="model.lock_text_freeze_layer_norm=false"):
        build_model(ModelConfig(name="vlc-micro", lock_text=True, lock_text_freeze_layer_norm=False))


def test_lock_options_without_the_lock_are_config_errors():
    from vlcontrast.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.lock_image_unlocked_groups=2.*model.lock_image=true"):
        load_config(None, ["data.train=x", "train.steps=1", "model.lock_image_unlocked_groups=2"])
    with pytest.raises(ConfigError, match="model.lock_text_unlocked_layers=-1"):
        load_config(None, ["data.train=x", "train.steps=1", "model.lock_text=true",
                           "model.lock_text_unlocked_layers=-1"])


# --------------------------------------------------------------------------------------------
# channels-last ResNet towers on CUDA; batch norms under bf16 weights


def test_channels_last_for_resnet_towers_only():
    from vlcontrast.models import use_channels_last

    resnet = build_model(ModelConfig(name="vlc-rn-micro")).model
    assert use_channels_last(resnet)
    seen = []
    resnet.visual.conv1.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    resnet.visual(torch.rand(2, 3, 32, 32))
    assert seen[0].is_contiguous(memory_format=torch.channels_last)
    assert not use_channels_last(build_model(ModelConfig(name="vlc-micro")).model)


def test_channels_last_towers_keep_weights_deepspeed_can_view_as_bytes():
    """DeepSpeed's initial broadcast views every parameter as uint8: a channels-last weight fails."""
    resnet = build_model(ModelConfig(name="vlc-rn-micro"), device="cpu").model
    for param in resnet.parameters():
        if param.ndim:  # 0-dim logit_scale: the engine gives it shape [1] first
            param.data.view(torch.uint8)  # raises for a channels-last 4-d weight
    seen = []
    resnet.visual.conv1.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    resnet.visual(torch.rand(2, 3, 32, 32))
    assert seen[0].is_contiguous(memory_format=torch.channels_last)


def test_build_model_uses_channels_last_on_every_device(monkeypatch):
    """build_model converts ResNet towers on CPU and CUDA (CUDA creation mocked onto the CPU)."""
    import open_clip

    from vlcontrast import models

    create = open_clip.create_model_and_transforms
    monkeypatch.setattr(open_clip, "create_model_and_transforms",
                        lambda *a, **kw: create(*a, **{**kw, "device": "cpu"}))
    calls = []
    monkeypatch.setattr(models, "use_channels_last", lambda model: calls.append(model) or True)
    on_cpu = build_model(ModelConfig(name="vlc-rn-micro"), device="cpu")
    assert calls == [on_cpu.model]
    on_cuda = build_model(ModelConfig(name="vlc-rn-micro"), device="cuda")
    assert calls == [on_cpu.model, on_cuda.model]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_batch_norm_with_low_precision_weights_and_fp32_statistics(dtype):
    import copy

    from torchvision.ops.misc import FrozenBatchNorm2d

    from vlcontrast.models.norms import keep_batch_norm_statistics_fp32

    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.BatchNorm2d(4), FrozenBatchNorm2d(4))
    with torch.no_grad():
        reference[0].weight.uniform_(0.5, 1.5)
        reference[1].running_var.uniform_(0.5, 1.5)
    model = copy.deepcopy(reference)
    assert keep_batch_norm_statistics_fp32(model) == 2
    for p in model.parameters():  # what DeepSpeed's bf16/fp16 modes do: parameters only
        p.data = p.data.to(dtype)
    x = torch.randn(8, 4, 5, 5)
    out = model(x.to(dtype))
    assert out.dtype == dtype and model[0].running_mean.dtype == torch.float32
    expected = reference(x.to(dtype).float())
    assert torch.allclose(out.float(), expected, atol=0.05, rtol=0.02)
    assert torch.allclose(model[0].running_mean, reference[0].running_mean, atol=1e-2)
    out.float().sum().backward()
    assert model[0].weight.grad.dtype == dtype


def test_augmentation_options_reach_open_clips_train_transform():
    from PIL import Image

    from vlcontrast.config import ConfigError, load_config

    config = load_config(None, ["model.name=vlc-micro", "train.steps=1",
                                "model.augment={gray_scale_prob: 1.0, scale: [0.5, 1.0]}"])
    bundle = build_model(config.model)
    names = [type(t).__name__ for t in bundle.preprocess_train.transforms]
    assert "gray_scale" in names
    crop = bundle.preprocess_train.transforms[0]
    assert tuple(crop.scale) == (0.5, 1.0)
    red = Image.new("RGB", (32, 32), (220, 20, 20))
    out = bundle.preprocess_train(red)
    # Every channel equal before normalisation: undo open_clip's per-channel normalisation.
    mean = torch.tensor((0.48145466, 0.4578275, 0.40821073)).view(3, 1, 1)
    std = torch.tensor((0.26862954, 0.26130258, 0.27577711)).view(3, 1, 1)
    raw = out * std + mean
    assert torch.allclose(raw[0], raw[1], atol=1e-4) and torch.allclose(raw[1], raw[2], atol=1e-4)
    # The evaluation transform is never augmented.
    assert "gray_scale" not in [type(t).__name__ for t in bundle.preprocess_val.transforms]
    with pytest.raises(ConfigError, match="model.augment.grey"):
        load_config(None, ["train.steps=1", "model.augment={grey: 0.5}"])
    with pytest.raises(ConfigError, match="re_prob.*use_timm"):
        load_config(None, ["train.steps=1", "model.augment={re_prob: 0.5}"])


@pytest.mark.parametrize("value, why", [
    ("{scale: 0.5}", r"must be two numbers \[min, max\] with 0 < min <= max"),  # TypeError
    ("{scale: [0.5]}", r"must be two numbers"),            # IndexError in torchvision
    ("{scale: [1.0, 0.5]}", r"must be two numbers"),       # every image failed: "shards damaged"
    ("{scale: [0.5, 1.0, 2]}", r"must be two numbers"),    # silently cropped by [0.5, 1.0]
    ("{gray_scale_prob: 2}", r"must be a probability in \[0, 1\]"),  # AssertionError
    ("{gray_scale_prob: abc}", r"must be a probability"),  # TypeError
    ("{color_jitter: [0.4, 0.4, 0.4, 0.1]}", r"applies only with model\.augment\."
                                             r"color_jitter_prob"),  # silently no jitter
    ("{color_jitter_prob: 0.5}", r"applies only with model\.augment\.color_jitter "),
    ("{color_jitter: 0.4, color_jitter_prob: 0.5}", r"must be four strengths"),  # TypeError
    ("{color_jitter: [0.1, 0.2, 0.3, 0.9], color_jitter_prob: 0.5}", r"its hue .* <= 0\.5"),
])
def test_a_bad_augmentation_value_is_one_line_naming_it(value, why):
    """Each of these was a traceback in the loader, every image failing its transform, or an
    option open_clip silently drops."""
    from vlcontrast.config import ConfigError, load_config

    key = value[1:value.index(":")]
    with pytest.raises(ConfigError, match=rf"^model\.augment\.{key}=.*: {why}"):
        load_config(None, ["train.steps=1", f"model.augment={value}"])
    load_config(None, ["train.steps=1", "model.augment={scale: [0.8, 1], color_jitter_prob: 0.8, "
                                        "color_jitter: [0.4, 0.4, 0.4, 0.1]}"])
    load_config(None, ["train.steps=1", "model.augment={use_timm: true, color_jitter: 0.4}"])


# --------------------------------------------------------------------------------------------
# model.pretrained from an open_clip export; weights of another model; the random-init notice


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    """A vlc-tiny run directory and its ``vlcontrast export --format open_clip`` directory."""
    from vlcontrast.export import export_open_clip

    root = tmp_path_factory.mktemp("tiny-export")
    torch.manual_seed(3)
    bundle = build_model(ModelConfig(name="vlc-tiny"))
    step = _write_checkpoint(root / "run", bundle.model)
    (step / "model_config.json").write_text(json.dumps(bundle.model_config))
    export_open_clip(root / "run", root / "oc")
    return bundle.model, root / "run", root / "oc"


def test_pretrained_from_an_open_clip_export_directory(tiny_export):
    source, _, export = tiny_export
    loaded = build_model(ModelConfig(name="vlc-tiny", pretrained=str(export))).model
    for (name, a), b in zip(source.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("form", ["file", "export", "run"])
def test_weights_of_another_model_are_one_line_naming_the_right_model(tiny_export, form):
    """open_clip's own loader asserts ("text pos_embed width changed!") on a file of another
    model; every form says, in one line, that the weights do not fit and which model.name does."""
    from vlcontrast.errors import ConfigError

    _, run, export = tiny_export
    pretrained = {"file": export / "open_clip_model.safetensors", "export": export,
                  "run": run}[form]
    with pytest.raises(ConfigError) as caught:
        build_model(ModelConfig(name="vlc-micro", pretrained=str(pretrained)))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"model.pretrained={str(pretrained)!r}: ")
    assert "does not fit this model (model.name='vlc-micro')" in message
    assert "model.name must be the checkpoint's model, here model.name=vlc-tiny" in message


def test_a_directory_without_weights_names_the_forms_it_takes(tmp_path):
    from vlcontrast.errors import ConfigError

    with pytest.raises(ConfigError, match="not a vlcontrast run, checkpoint or export, nor a "
                                          "transformers CLIPModel directory"):
        build_model(ModelConfig(name="vlc-micro", pretrained=str(tmp_path)))


def test_from_scratch_model_has_no_random_init_notice(caplog):
    """model.pretrained empty: random weights are the request, open_clip's root-logger notice
    only repeats it; other warnings still show."""
    import logging

    from vlcontrast.models import RANDOM_INIT_WARNING

    with caplog.at_level(logging.WARNING):
        build_model(ModelConfig(name="vlc-micro"))
        logging.getLogger().warning("another warning")
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if m.startswith(RANDOM_INIT_WARNING)]
    assert "another warning" in messages


def test_model_name_takes_the_folder_of_an_export_a_run_or_a_checkpoint(tmp_path, monkeypatch):
    """``model.pretrained`` took these folders and a transformers directory was a model.name too,
    but an open_clip export (or a run) as model.name was refused with a list of open_clip names."""
    from vlcontrast.config import ConfigError
    from vlcontrast.models import PACKAGE_CONFIG_DIR, resolve_model_config

    micro = json.loads((PACKAGE_CONFIG_DIR / "vlc-micro.json").read_text())
    export = tmp_path / "export"
    export.mkdir()
    (export / "open_clip_config.json").write_text(json.dumps({"model_cfg": micro}))
    (export / "open_clip_model.safetensors").write_bytes(b"")
    (export / "my-micro.json").write_text(json.dumps(micro))
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.pt").write_bytes(b"")
    (checkpoint / "model_config.json").write_text(json.dumps({"model_name": "my-run-micro",
                                                              "model_cfg": micro}))
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_00000004\n")
    assert resolve_model_config(str(export)) == ("my-micro", micro)
    for folder in (tmp_path / "run", checkpoint):
        assert resolve_model_config(str(folder)) == ("my-run-micro", micro)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^model.name='.*empty': a folder, but not a vlcontrast "
                                          r"run, checkpoint or export"):
        resolve_model_config(str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "RN50").mkdir()  # a folder named like an open_clip model: the model wins
    assert resolve_model_config("RN50")[0] == "RN50"


def test_pretrained_naming_a_folder_of_models_names_the_ones_inside(tmp_path):
    from vlcontrast.config import ConfigError
    from vlcontrast.models import pretrained_weights

    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "open_clip_config.json").write_text("{}")
    (tmp_path / "export" / "open_clip_model.safetensors").write_bytes(b"")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_00000002\n")
    (tmp_path / "notes").mkdir()
    with pytest.raises(ConfigError, match=r"nor a transformers CLIPModel directory .*; it holds "
                                          r"export \(open_clip export\), run \(vlcontrast run\): "
                                          r"name one, e.g. model.pretrained=.*export$"):
        pretrained_weights(str(tmp_path))
    with pytest.raises(ConfigError, match=r"config.json of a CLIP model\)$"):
        pretrained_weights(str(tmp_path / "notes"))


def test_a_model_name_one_typo_away_names_the_one_meant():
    """``vlc-mirco`` listed open_clip's first names but not the shipped ``vlc-micro`` it meant."""
    from vlcontrast.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^model\.name='vlc-mirco' \(did you mean 'vlc-micro'\?\): "
                       "not an open_clip model"):
        build_model(ModelConfig(name="vlc-mirco"))
    with pytest.raises(ConfigError, match=r"^model\.name='ViT-B-23' \(did you mean 'ViT-B-32'\?\)"):
        build_model(ModelConfig(name="ViT-B-23"))
    with pytest.raises(ConfigError, match=r"^model\.name='no-such-tower': not an open_clip"):
        build_model(ModelConfig(name="no-such-tower"))


# --------------------------------------------------------------------------------------------
# model.pretrained checked before the model is built: paths, tags, a transformers weights file


@pytest.fixture
def nothing_built(monkeypatch):
    """open_clip building a model fails the test: the check comes before it."""
    import open_clip

    def refuse(*args, **kwargs):
        raise AssertionError("open_clip built a model before model.pretrained was checked")

    monkeypatch.setattr(open_clip, "create_model_and_transforms", refuse)


@pytest.mark.parametrize("value, meant", [
    ("runs/teachr", "runs/teacher"),
    ("runs/teacher/nope/model.safetensors", None),
    ("weights.pt", None),
    ("hf-t/model.safetensor", "hf-t/model.safetensors"),
])
def test_a_pretrained_path_that_does_not_exist_is_one_line(tmp_path, monkeypatch, nothing_built,
                                                           value, meant):
    """It was open_clip's 30-line traceback (RuntimeError: Pretrained value ... is not a known tag
    or valid file path), exit 1; now one line, with the path meant when one is a typo away."""
    from vlcontrast.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "teacher").mkdir(parents=True)
    (tmp_path / "hf-t").mkdir()
    (tmp_path / "hf-t" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as caught:
        build_model(ModelConfig(name="vlc-micro", pretrained=value))
    message = str(caught.value)
    hint = f" (did you mean {meant!r}?)" if meant else ""
    assert message.startswith(f"model.pretrained={value!r}: the path does not exist{hint}; name "
                              "a weights file, a vlcontrast run"), message
    assert "\n" not in message


def test_an_unknown_tag_names_the_tags_of_the_model(caplog, nothing_built):
    """``model.pretrained=openai`` for a model without that tag: one line with the model's tags
    (none for a shipped config), and no open_clip log line before it."""
    import logging

    from vlcontrast.errors import ConfigError
    from vlcontrast.models import check_pretrained

    with caplog.at_level(logging.INFO), pytest.raises(ConfigError) as caught:
        build_model(ModelConfig(name="vlc-micro", pretrained="openai"))
    assert str(caught.value) == (
        "model.pretrained='openai': no such file or folder, and not a pretrained tag of "
        "model.name='vlc-micro' (open_clip has no pretrained tags for it; name a weights file, a "
        "vlcontrast run, checkpoint or export directory, or a transformers CLIPModel directory)")
    assert not caplog.records
    with pytest.raises(ConfigError, match=r"^model\.pretrained='opnai' \(did you mean 'openai'\?"
                                          r"\): .* tag of model\.name='ViT-B-32' \(its tags: "
                                          r"'openai', .* and \d+ more; name one of them or a "):
        check_pretrained(ModelConfig(name="ViT-B-32", pretrained="opnai"))
    check_pretrained(ModelConfig(name="ViT-B-32", pretrained="openai"))  # a tag: nothing read
    check_pretrained(ModelConfig(name="ViT-B-32", pretrained="OpenAI"))  # open_clip's spelling


def _transformers_folder(folder, keys=142):
    """A stand-in transformers CLIPModel export: config.json and HF-named tensors."""
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "clip"}))
    names = ["logit_scale"] + [f"text_model.encoder.layers.{i}.weight" for i in range(keys // 2)]
    names += [f"vision_model.encoder.layers.{i}.weight" for i in range(keys - len(names))]
    save_file({name: torch.zeros(1) for name in names}, str(folder / "model.safetensors"))
    return folder / "model.safetensors"


def test_the_weights_file_of_a_transformers_export_names_its_folder(tmp_path, nothing_built):
    """``model.pretrained=hf-t/model.safetensors`` was a 9 KB line of 142 unexpected keys that
    never said to pass the folder."""
    import shutil

    from vlcontrast.errors import ConfigError

    weights = _transformers_folder(tmp_path / "hf-t")
    with pytest.raises(ConfigError) as caught:
        build_model(ModelConfig(name="vlc-micro", pretrained=str(weights)))
    message = str(caught.value)
    assert message == (f"model.pretrained={str(weights)!r}: a file, not a folder: the weights "
                       "file of a transformers CLIPModel export (tensor names open_clip does not "
                       "read; they load with the folder's config.json); give the folder holding "
                       f"it: model.pretrained={str(tmp_path / 'hf-t')!r}")
    copied = tmp_path / "w.safetensors"  # taken out of its folder
    shutil.copy(weights, copied)
    with pytest.raises(ConfigError, match=r"^model\.pretrained='.*w\.safetensors': holds a "
                                          r"transformers CLIPModel's tensors .* give that folder"):
        build_model(ModelConfig(name="vlc-micro", pretrained=str(copied)))


def test_weights_that_do_not_fit_name_a_few_keys_and_a_count(tmp_path):
    """torch lists every unexpected key: a line of kilobytes. A few names and the count."""
    from vlcontrast.errors import ConfigError

    state = build_model(ModelConfig(name="vlc-micro")).model.state_dict()
    state.update({f"extra.{i:03d}": torch.zeros(1) for i in range(120)})
    weights = tmp_path / "weights.pt"  # open_clip's loader: strict, torch's whole list
    torch.save(state, weights)
    checkpoint = tmp_path / "ckpt"  # vlcontrast's loader of a checkpoint folder
    checkpoint.mkdir()
    torch.save(state, checkpoint / "model.pt")
    for pretrained in (weights, checkpoint):
        with pytest.raises(ConfigError) as caught:
            build_model(ModelConfig(name="vlc-micro", pretrained=str(pretrained)))
        message = str(caught.value)
        assert "does not fit this model (model.name='vlc-micro')" in message
        assert ("unexpected 120 keys ('extra.000', 'extra.001', 'extra.002' and 117 more)"
                in message), message
        assert len(message) < 400 and "\n" not in message


def test_fit_detail_caps_torchs_lists():
    from vlcontrast.models import fit_detail

    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(6)])
    state = {f"x{i}": torch.zeros(1) for i in range(10)}
    state.update({f"{i}.weight": torch.zeros(3, 3) for i in range(6)})
    with pytest.raises(RuntimeError) as caught:
        model.load_state_dict(state)
    detail = fit_detail(caught.value)
    assert detail.startswith("missing 6 keys ('0.bias', '1.bias', '2.bias' and 3 more); "
                             "unexpected 10 keys ('x0', 'x1', 'x2' and 7 more); size mismatch for "
                             "0.weight: copying a param with shape torch.Size([3, 3])"), detail
    assert detail.endswith("(and 5 more size mismatches)")
    assert fit_detail(AssertionError("text pos_embed width changed!")) == \
        "text pos_embed width changed!"


def test_check_pretrained_reads_no_weights_of_a_good_value(tmp_path):
    """The preflight's check: an empty value, a folder of a model and a weights file pass."""
    from vlcontrast.errors import ConfigError
    from vlcontrast.models import check_pretrained

    check_pretrained(ModelConfig(name="vlc-micro"))
    (tmp_path / "w.pt").write_bytes(b"")
    check_pretrained(ModelConfig(name="vlc-micro", pretrained=str(tmp_path / "w.pt")))
    (tmp_path / "notes").mkdir()
    with pytest.raises(ConfigError, match=r"^distill\.teacher_pretrained='.*notes': a directory, "
                                          r"but not a vlcontrast run"):
        check_pretrained(ModelConfig(name="vlc-micro", pretrained=str(tmp_path / "notes")),
                         option="distill.teacher_pretrained")
