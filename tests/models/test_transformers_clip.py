"""The transformers way out and in: a trained vlcontrast ViT run exported as a transformers
``CLIPModel`` gives the same embeddings and the same zero-shot top-1 as vlcontrast; a ``CLIPModel``
directory starts a run (or a teacher) with the same embeddings; what does not map is refused with
one line naming the part. Everything offline (``HF_HUB_OFFLINE``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from vlcontrast.config import load_config
from vlcontrast.errors import ConfigError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[2]
BASE = str(ROOT / "configs" / "study" / "cell.yaml")
TEXTS = ["a red circle", "two small blue squares on a green field", "x", "It's the dog's bone!",
         "ünïcode café " * 3]
TEMPLATE = "a photo of a {c}."


def _overrides(tmp: Path, data: Path, out: str, *extra: str) -> list[str]:
    return [f"output_dir={tmp / out}", f"data.train={data / 'train'}", f"data.val={data / 'val'}",
            f"eval.zeroshot={data / 'zeroshot'}", "data.workers=0", "data.batch_size=32",
            "model.name=vlc-micro", "loss.name=infonce", "train.steps=4", "optim.warmup_steps=1",
            "train.log_every=1", "eval.every=0", "logging.progress=false", "checkpoint.every=0",
            "eval.batch_size=64", *extra]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small ViT run trained a few steps (vlc-micro on the synthetic world), its data, and
    its export as a transformers CLIPModel."""
    from vlcontrast.data.prep.synthetic import write_synthetic
    from vlcontrast.export import export_transformers
    from vlcontrast.train.loop import train

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    tmp = tmp_path_factory.mktemp("hf")
    data = tmp / "data"
    write_synthetic(data, train=128, val=32, seed=5, image_size=32, shard_size=64,
                    zeroshot_per_class=2, workers=1, progress=False)
    train(load_config(BASE, _overrides(tmp, data, "run")))
    export_transformers(str(tmp / "run"), tmp / "exported")
    return tmp, data, tmp / "run", tmp / "exported"


def _ours(run):
    import vlcontrast

    model, preprocess, tokenizer = vlcontrast.load(str(run), device="cpu")
    return model, preprocess, tokenizer


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(7)
    sizes = [(32, 32), (40, 48), (48, 40), (64, 64), (33, 32)]
    images = []
    for width, height in sizes:
        base = rng.integers(0, 256, (1, 1, 3))
        pixels = np.clip(base + rng.normal(0, 50, (height, width, 3)), 0, 255).astype(np.uint8)
        images.append(Image.fromarray(pixels))
    return images


def _cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (F.normalize(a.float(), dim=-1) * F.normalize(b.float(), dim=-1)).sum(-1)


def _hf_features(output) -> torch.Tensor:
    return output.pooler_output if hasattr(output, "pooler_output") else output


def test_export_writes_a_transformers_directory(trained):
    _, _, _, out = trained
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "preprocessor_config.json", "tokenizer.json",
            "tokenizer_config.json", "vocab.json", "merges.txt", "README.md"} <= names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth"))]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "clip" and config["vision_config"]["hidden_act"] == "gelu"
    assert config["vlcontrast"]["trained_alpha"] == "white"
    processor = json.loads((out / "preprocessor_config.json").read_text())
    assert processor["size"] == {"shortest_edge": 32} and processor["resample"] == 3
    assert "composited on white" in (out / "README.md").read_text()


def test_transformers_embeddings_equal_vlcontrast(trained):
    from transformers import CLIPModel, CLIPProcessor

    _, _, run, out = trained
    model, preprocess, tokenizer = _ours(run)
    hf = CLIPModel.from_pretrained(out).eval()
    processor = CLIPProcessor.from_pretrained(out)
    images = _images()
    with torch.no_grad():
        pixels = torch.stack([preprocess(image) for image in images])
        ours_images = model.encode_image(pixels)
        # the network alone: the same pixels into both
        same_pixels = _hf_features(hf.get_image_features(pixel_values=pixels))
        # end to end: transformers' own processor
        theirs_images = _hf_features(hf.get_image_features(
            **processor(images=images, return_tensors="pt")))
        ours_texts = model.encode_text(tokenizer(TEXTS))
        theirs_texts = _hf_features(hf.get_text_features(
            **processor(text=TEXTS, padding=True, truncation=True, return_tensors="pt")))
    assert _cosines(ours_images, same_pixels).min() >= 0.99999
    torch.testing.assert_close(same_pixels, ours_images, atol=1e-5, rtol=0)
    assert _cosines(ours_images, theirs_images).min() >= 0.9999
    assert _cosines(ours_texts, theirs_texts).min() >= 0.9999
    torch.testing.assert_close(hf.logit_scale.detach(), model.logit_scale.detach().reshape(()))
    # not vacuous: the run trained (its weights left their start), and the texts differ
    assert _cosines(ours_texts[:1], ours_texts[1:2]).item() < 0.999


def test_tokenizer_ids_are_open_clips(trained):
    from transformers import AutoTokenizer

    _, _, run, out = trained
    _, _, tokenizer = _ours(run)
    ours = tokenizer(TEXTS)  # pads with 0 to the context length
    theirs = AutoTokenizer.from_pretrained(out)(TEXTS, padding="max_length", truncation=True,
                                                return_tensors="pt").input_ids
    after_end = torch.arange(ours.shape[1]) > ours.argmax(-1, keepdim=True)
    assert theirs.shape == ours.shape
    assert torch.equal(theirs, torch.where(after_end, 49407, ours))  # they pad with end-of-text


def test_a_wrong_activation_would_show(trained):
    """The checks can fail: the same tensors under the other activation drift. In a model this
    small the drift is too small for a cosine of 0.9999 to see (the MLPs contribute little), so
    the network alone is compared by value: the right mapping is within 1e-5 of vlcontrast, the
    wrong activation over 1e-3 away."""
    from transformers import CLIPConfig, CLIPModel

    _, _, run, out = trained
    model, preprocess, tokenizer = _ours(run)
    config = json.loads((out / "config.json").read_text())
    for part in ("vision_config", "text_config"):
        config[part]["hidden_act"] = "quick_gelu"
    wrong = CLIPModel(CLIPConfig(**config)).eval()
    wrong.load_state_dict(CLIPModel.from_pretrained(out).state_dict())
    pixels = torch.stack([preprocess(image) for image in _images()])
    with torch.no_grad():
        ours = model.encode_image(pixels)
        drift = (ours - _hf_features(wrong.get_image_features(pixel_values=pixels))).abs().max()
    assert drift > 1e-3


def test_pipeline_top1_equals_vlcontrast_classify(trained, tmp_path, capsys):
    from transformers import pipeline

    from tests.inference.helpers import run_cli

    _, data, run, out = trained
    folder = data / "zeroshot"
    paths = sorted(folder.rglob("*.jpg"))
    labels = [line.strip() for line in (folder / "classnames.txt").read_text().splitlines()
              if line.strip()]
    templates = tmp_path / "templates.txt"
    templates.write_text(TEMPLATE + "\n")
    code, stdout, _ = run_cli(capsys, "classify", *map(str, paths), "--checkpoint", str(run),
                              "--labels", ",".join(labels), "--templates", str(templates),
                              "--top-k", str(len(labels)), "--json", "--workers", "0",
                              "--device", "cpu", "--no-progress")
    assert code == 0
    ours = {item["image"]: {top["label"]: top["prob"] for top in item["top"]}
            for item in json.loads(stdout)["images"]}
    classify = pipeline("zero-shot-image-classification", model=str(out), device="cpu")
    theirs = {str(path): {result["label"]: result["score"] for result in classify(
        Image.open(path), candidate_labels=labels,
        hypothesis_template=TEMPLATE.replace("{c}", "{}"))} for path in paths}
    assert len(ours) == len(paths) == 20
    for path in ours:
        assert max(ours[path], key=ours[path].get) == max(theirs[path], key=theirs[path].get)
        for label in labels:  # every label's probability, not only the winner
            assert ours[path][label] == pytest.approx(theirs[path][label], abs=1e-4)
    # not vacuous: the probabilities are far from uniform
    assert max(max(p.values()) - min(p.values()) for p in ours.values()) > 0.05


def test_clipmodel_directory_starts_a_run_with_the_same_embeddings(trained):
    """vlcontrast -> transformers -> vlcontrast: ``model.pretrained=CLIPModel dir`` (and
    ``model.name`` the same dir) builds the trained model again, as does the teacher's loader."""
    from vlcontrast.models import build_model, load_model_from_checkpoint, load_pretrained_model

    tmp, data, run, out = trained
    model, preprocess, tokenizer = _ours(run)
    pixels = torch.stack([preprocess(image) for image in _images()])
    with torch.no_grad():
        expected_images, expected_texts = model.encode_image(pixels), model.encode_text(
            tokenizer(TEXTS))

    def same(candidate, tokenize=tokenizer):
        candidate.eval()
        with torch.no_grad():
            images, texts = candidate.encode_image(pixels), candidate.encode_text(tokenize(TEXTS))
        assert _cosines(images, expected_images).min() >= 0.99999
        assert _cosines(texts, expected_texts).min() >= 0.99999
        torch.testing.assert_close(candidate.logit_scale.detach().reshape(()),
                                   model.logit_scale.detach().reshape(()))

    for name in ("vlc-micro", str(out)):
        config = load_config(BASE, _overrides(tmp, data, "again", f"model.name={name}",
                                              f"model.pretrained={out}"))
        bundle = build_model(config.model, device="cpu")
        same(bundle.model, bundle.tokenizer)
    same(load_model_from_checkpoint(out).model)
    for source, pretrained in ((str(out), ""), ("vlc-micro", str(out)), (str(run), ""),
                               ("vlc-micro", str(run))):
        same(load_pretrained_model(source, pretrained, what="distill.teacher").model)


def test_fine_tuning_from_a_clipmodel_directory_trains(trained):
    """A run started from the export trains, and its first logged loss is the loss of the
    trained model, not of a random one."""
    from vlcontrast.train.loop import train

    tmp, data, run, out = trained

    def first_loss(folder):
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines
                if json.loads(line).get("kind") == "train"][0]

    train(load_config(BASE, _overrides(tmp, data, "from-hf", "train.steps=1",
                                       f"model.pretrained={out}")))
    train(load_config(BASE, _overrides(tmp, data, "from-run", "train.steps=1",
                                       f"model.pretrained={run}")))
    train(load_config(BASE, _overrides(tmp, data, "from-scratch", "train.steps=1")))
    assert first_loss(tmp / "from-hf") == pytest.approx(first_loss(tmp / "from-run"), rel=1e-4)
    assert first_loss(tmp / "from-hf") != pytest.approx(first_loss(tmp / "from-scratch"),
                                                        rel=1e-3)


def test_a_different_model_name_is_refused_naming_the_key(trained):
    from vlcontrast.models import build_model

    tmp, data, _, out = trained
    config = load_config(BASE, _overrides(tmp, data, "x", "model.name=vlc-tiny",
                                          f"model.pretrained={out}"))
    with pytest.raises(ConfigError) as error:
        build_model(config.model, device="cpu")
    message = str(error.value)
    assert "\n" not in message and "is a transformers CLIPModel whose" in message
    assert f"model.name={out}" in message


# ---------------------------------------------------------------------------- what does not map


def _state(model_cfg: dict, **kwargs) -> dict:
    import open_clip

    from vlcontrast.models import _register_config

    name = _register_config(f"hf-refusal-{abs(hash(json.dumps(model_cfg, sort_keys=True)))}",
                            model_cfg)
    model = open_clip.create_model(name, **kwargs)
    return model.state_dict(), dict(model.visual.preprocess_cfg)


MICRO = json.loads((ROOT / "vlcontrast" / "models" / "configs" / "vlc-micro.json").read_text())
RN = json.loads((ROOT / "vlcontrast" / "models" / "configs" / "vlc-rn-micro.json").read_text())


def _with(part: str, **values) -> dict:
    cfg = json.loads(json.dumps(MICRO))
    cfg[part].update(values)
    return cfg


@pytest.mark.parametrize("model_cfg, kwargs, named", [
    (RN, {}, "vision_cfg.layers"),
    (_with("vision_cfg", attentional_pool=True, attn_pooler_heads=2, attn_pooler_queries=4), {},
     "vision_cfg.attentional_pool"),
    (_with("vision_cfg", pool_type="avg"), {}, "vision_cfg.pool_type"),
    (_with("vision_cfg", ls_init_value=0.1), {}, "vision_cfg.ls_init_value"),
    (_with("text_cfg", pool_type="last"), {}, "text_cfg.pool_type"),
    (_with("text_cfg", proj_bias=True), {}, "text_cfg.proj_bias"),
    (MICRO, {"init_logit_bias": -10.0}, "logit_bias"),
])
def test_what_does_not_map_is_refused_in_one_line(model_cfg, kwargs, named):
    from vlcontrast.models.transformers_clip import check_mappable, to_transformers_state_dict

    state, preprocess = _state(model_cfg, **kwargs)
    with pytest.raises(ConfigError) as error:
        check_mappable(model_cfg, state, preprocess)
        to_transformers_state_dict(state)
    message = str(error.value)
    assert message.startswith(named) and "\n" not in message
    assert "does not have" in message and "--format open_clip" in message


def test_a_hugging_face_text_tower_is_refused(hf_text_dir):
    from vlcontrast.models import resolve_model_config
    from vlcontrast.models.transformers_clip import check_mappable

    _, cfg = resolve_model_config("vlc-micro", str(hf_text_dir))
    with pytest.raises(ConfigError, match=r"^text_cfg.hf_model_name=.*a Hugging Face text tower"):
        check_mappable(cfg, {}, {})


def test_export_command_refuses_a_resnet_run_before_writing(tmp_path, capsys):
    from tests.evaluation.helpers import write_fake_checkpoint
    from tests.inference.helpers import run_cli

    state, _ = _state(RN)
    folder = write_fake_checkpoint(tmp_path / "run", torch.nn.Module())
    torch.save(state, folder / "model.pt")
    (folder / "model_config.json").write_text(json.dumps(
        {"model_name": "vlc-rn-micro", "model_cfg": RN, "init_logit_scale": 2.659,
         "init_logit_bias": None}))
    code, _, err = run_cli(capsys, "export", "--format", "transformers", str(tmp_path / "run"),
                           str(tmp_path / "out"))
    assert code == 2
    assert "vision_cfg.layers=[1, 1, 1, 1]: a ResNet image tower" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_export_command_both_forms(trained, tmp_path, capsys):
    from tests.inference.helpers import run_cli

    _, _, run, _ = trained
    code, stdout, _ = run_cli(capsys, "export", "open_clip", "--checkpoint", str(run), "--out",
                              str(tmp_path / "a"))
    assert code == 0 and json.loads(stdout)["weights"].endswith("open_clip_model.safetensors")
    code, stdout, _ = run_cli(capsys, "export", "--format", "transformers", str(run),
                              str(tmp_path / "b"))
    assert code == 0 and (tmp_path / "b" / "model.safetensors").is_file()
    # the CLIPModel directory is a model directory for every vlcontrast reader
    code, stdout, _ = run_cli(capsys, "embed", "--checkpoint", str(tmp_path / "b"), "--texts",
                              str(_write(tmp_path / "t.txt", "a red circle\n")), "--out",
                              str(tmp_path / "t.npy"), "--device", "cpu", "--no-progress")
    assert code == 0 and np.load(tmp_path / "t.npy").shape == (1, 32)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_locked_tower_from_a_clipmodel_directory_keys_the_feature_cache_as_its_run(trained):
    """``model.lock_image_features`` with ``model.pretrained=CLIPModel dir``: the cache key names
    the same image tower as the run it was exported from (the mapping copies its tensors)."""
    from vlcontrast.train.feature_cache import cache_key

    tmp, data, run, out = trained
    keys = [cache_key(load_config(BASE, _overrides(tmp, data, "k", f"model.pretrained={start}"))
                      .model, load_config(BASE, _overrides(tmp, data, "k")).data)
            for start in (run, out)]
    assert keys[0]["image_tower_sha256"] == keys[1]["image_tower_sha256"] is not None


def test_a_clipmodel_directory_is_a_teacher(trained):
    """distill.teacher takes the forms model.pretrained takes: an exported CLIPModel directory
    teaches with the run's embeddings, and its weights name it in a teacher-features file."""
    from vlcontrast.distill.teacher import load_teacher_bundle, teacher_identity

    _, _, run, exported = trained
    teacher = load_teacher_bundle(str(exported), "")
    ours = _ours(run)[0]
    images = torch.rand(3, 3, 32, 32)
    with torch.no_grad():
        expected = F.normalize(ours.encode_image(images), dim=-1)
        got = F.normalize(teacher.model.encode_image(images), dim=-1)
    assert _cosines(got, expected).min() >= 0.9999
    identity = teacher_identity(str(exported), "")
    assert identity["weights_sha256"] == __import__("hashlib").sha256(
        (exported / "model.safetensors").read_bytes()).hexdigest()
    assert identity != teacher_identity(str(run), "")
