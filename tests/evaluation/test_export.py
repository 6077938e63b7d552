"""Export round trip: vlcontrast checkpoint -> open_clip -> same embeddings -> CLIP_benchmark."""

import json

import open_clip
import pytest
import torch
from torch.utils.data import DataLoader

from tests.evaluation.helpers import TINY_NAME, write_clip_benchmark_wds
from vlcontrast.evaluation import evaluate_retrieval, evaluate_zeroshot
from vlcontrast.export import export_open_clip


@pytest.fixture(scope="module")
def exported(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("exported")
    return out, export_open_clip(str(tiny_checkpoint), out)


def embeddings(model, preprocess, tokenizer):
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    pixels = (torch.rand(3, 40, 40, 3, generator=generator) * 255).to(torch.uint8).numpy()
    images = torch.stack([preprocess(Image.fromarray(p)) for p in pixels])
    with torch.no_grad():
        return (model.encode_image(images, normalize=True),
                model.encode_text(tokenizer(["a dog", "two red cars", "a house"]), normalize=True))


def test_export_writes_open_clip_files(exported, tiny):
    out, info = exported
    assert info["model_name"] == TINY_NAME
    assert json.loads((out / f"{TINY_NAME}.json").read_text())["embed_dim"] == 32
    assert json.loads((out / "open_clip_config.json").read_text())["model_cfg"]["embed_dim"] == 32
    state = torch.load(info["weights"], weights_only=True)
    assert set(state) == set(tiny[0].state_dict())


def test_open_clip_loads_export_with_same_embeddings(exported, tiny):
    out, info = exported
    model, preprocess, tokenizer = tiny
    expected_images, expected_texts = embeddings(model, preprocess, tokenizer)
    open_clip.add_model_config(info["model_config"])
    loaded, _, loaded_preprocess = open_clip.create_model_and_transforms(
        info["model_name"], pretrained=info["weights"])
    loaded.eval()
    images, texts = embeddings(loaded, loaded_preprocess, open_clip.get_tokenizer(info["model_name"]))
    torch.testing.assert_close(images, expected_images, atol=1e-6, rtol=0)
    torch.testing.assert_close(texts, expected_texts, atol=1e-6, rtol=0)
    torch.testing.assert_close(loaded.logit_scale, model.logit_scale)

    local, _, local_preprocess = open_clip.create_model_and_transforms(f"local-dir:{out}")
    local.eval()
    images, _ = embeddings(local, local_preprocess, open_clip.get_tokenizer(info["model_name"]))
    torch.testing.assert_close(images, expected_images, atol=1e-6, rtol=0)


def test_clip_benchmark_retrieval_on_export_matches_ours(exported, tiny, tmp_path):
    from clip_benchmark.datasets.builder import build_dataset, image_captions_collate_fn
    from clip_benchmark.metrics import zeroshot_retrieval

    _, info = exported
    open_clip.add_model_config(info["model_config"])
    model, _, preprocess = open_clip.create_model_and_transforms(info["model_name"],
                                                                 pretrained=info["weights"])
    model.eval()
    tokenizer = open_clip.get_tokenizer(info["model_name"])
    write_clip_benchmark_wds(tmp_path, 30, 8, task="retrieval", captions_per_image=3)
    dataset = build_dataset("wds/tiny_retrieval", root=str(tmp_path), transform=preprocess,
                            split="test", task="zeroshot_retrieval")
    loader = DataLoader(dataset, batch_size=8, collate_fn=image_captions_collate_fn)
    theirs = zeroshot_retrieval.evaluate(model, loader, tokenizer, device="cpu", amp=False,
                                         recall_k_list=[1, 5, 10])
    ours = evaluate_retrieval(tiny[0], tiny[1], tiny[2], str(tmp_path), batch_size=8, workers=0,
                              progress=False)
    assert ours["num_images"] == 30 and ours["num_texts"] == 90
    for k in (1, 5, 10):
        assert ours[f"image_to_text_R@{k}"] == pytest.approx(theirs[f"text_retrieval_recall@{k}"])
        assert ours[f"text_to_image_R@{k}"] == pytest.approx(theirs[f"image_retrieval_recall@{k}"])
    assert 0 < ours["text_to_image_R@10"] < 1  # the check is not vacuous


def test_clip_benchmark_zeroshot_on_export_matches_ours(exported, tiny, tmp_path, monkeypatch):
    from clip_benchmark.datasets.builder import build_dataset
    from clip_benchmark.metrics import zeroshot_classification

    def accuracy(output, target, topk=(1,)):  # CLIP_benchmark's, with .item() for numpy 2
        pred = output.topk(max(topk), 1, True, True)[1].t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))
        return [correct[:k].reshape(-1).float().sum().item() / len(target) for k in topk]

    monkeypatch.setattr(zeroshot_classification, "accuracy", accuracy)
    _, info = exported
    open_clip.add_model_config(info["model_config"])
    model, _, preprocess = open_clip.create_model_and_transforms(info["model_name"],
                                                                 pretrained=info["weights"])
    model.eval()
    tokenizer = open_clip.get_tokenizer(info["model_name"])
    classnames = ["cat", "dog", "car", "tree", "boat", "house"]
    templates = ["a photo of a {c}.", "a drawing of the {c}"]
    labels = [i % 6 for i in range(24)]
    write_clip_benchmark_wds(tmp_path, 24, 10, task="classification", labels=labels,
                             classnames=classnames, templates=templates)
    dataset = build_dataset("wds/tiny_cls", root=str(tmp_path), transform=preprocess, split="test")
    loader = DataLoader(dataset, batch_size=8)
    theirs = zeroshot_classification.evaluate(model, loader, tokenizer, dataset.classes,
                                              dataset.templates, device="cpu", amp=False)
    ours = evaluate_zeroshot(tiny[0], tiny[1], tiny[2], str(tmp_path), batch_size=8, workers=0,
                             progress=False)
    assert ours["num_images"] == 24 and ours["num_classes"] == 6
    assert ours["top1"] == pytest.approx(theirs["acc1"])
    assert ours["top5"] == pytest.approx(theirs["acc5"])
    assert ours["mean_per_class_recall"] == pytest.approx(theirs["mean_per_class_recall"])
