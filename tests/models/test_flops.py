"""The analytic FLOP count of vlcontrast/models/flops.py against torch's own counter."""

from __future__ import annotations

import pytest
import torch

MODELS = {
    "vit": {"embed_dim": 64,
            "vision_cfg": {"image_size": 64, "layers": 2, "width": 96, "head_width": 32,
                           "patch_size": 8},
            "text_cfg": {"context_length": 20, "vocab_size": 49408, "width": 64, "heads": 2,
                         "layers": 2}},
    "rn": {"embed_dim": 64,
           "vision_cfg": {"image_size": 64, "layers": [1, 2, 1, 1], "width": 16,
                          "head_width": 32},
           "text_cfg": {"context_length": 20, "vocab_size": 49408, "width": 64, "heads": 2,
                        "layers": 1}},
}


def _counted_forward_flops(model_config: dict) -> float:
    import open_clip
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = open_clip.model.CLIP(**model_config)
    size = model_config["vision_cfg"]["image_size"]
    images = torch.randn(2, 3, size, size)
    texts = torch.randint(1, 1000, (2, model_config["text_cfg"]["context_length"]))
    counter = FlopCounterMode(display=False)
    # The CPU's fused attention kernel has no FLOP formula registered; the math path is counted
    # as the matrix products it is made of.
    with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(images, texts)
    return counter.get_total_flops() / 2


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_analytic_count_matches_torchs_flop_counter(name):
    from vlcontrast.models.flops import forward_flops_per_sample, train_flops_per_sample

    counted = _counted_forward_flops(MODELS[name])
    analytic = forward_flops_per_sample(MODELS[name])
    assert analytic == pytest.approx(counted, rel=0.03), (analytic, counted)
    assert train_flops_per_sample(MODELS[name]) == pytest.approx(3 * analytic)
    # A model bundle's model_config holds open_clip's under "model_cfg".
    assert forward_flops_per_sample({"model_name": name, "model_cfg": MODELS[name]}) == analytic


@pytest.mark.parametrize("name, gflops", [("ViT-B-32", 44.3), ("RN50", 54.5)])
def test_full_size_towers_cost_what_the_issue_measured(name, gflops):
    """The training FLOPs per pair the GPU step table's MFU uses (3 x forward)."""
    from vlcontrast.models import resolve_model_config
    from vlcontrast.models.flops import train_flops_per_sample

    _, config = resolve_model_config(name)
    assert train_flops_per_sample(config) / 1e9 == pytest.approx(gflops, rel=0.03)


def test_peak_is_looked_up_by_device_name_and_overridable():
    from vlcontrast.models.flops import mfu, peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H100 NVL") == 835e12  # before the SXM entry it contains
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("Some GPU") is None
    assert peak_flops("Some GPU", override_tflops=100.0) == 100e12
    assert mfu(1000.0, 1e9, 1e13) == pytest.approx(0.1)
    assert mfu(1000.0, None, 1e13) is None
