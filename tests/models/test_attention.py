"""Both towers' attention runs through ``F.scaled_dot_product_attention`` (flash or
memory-efficient kernels on a GPU): open_clip's blocks call ``nn.MultiheadAttention`` with
``need_weights=False`` (and the ResNet's attention pool ``F.multi_head_attention_forward`` likewise),
whose functional form hands q, k, v to SDPA. Counted here by wrapping SDPA: one call per
transformer block of each tower, plus the ResNet's attention pool."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("name, image_calls", [("vlc-micro", None), ("vlc-rn-micro", 1)])
def test_every_attention_call_of_both_towers_is_sdpa(name, image_calls, monkeypatch):
    import torch.nn.functional as F

    from vlcontrast.config import ModelConfig
    from vlcontrast.models import build_model

    bundle = build_model(ModelConfig(name=name), device="cpu")
    model, config = bundle.model.train(), bundle.model_config["model_cfg"]
    calls = []
    real = F.scaled_dot_product_attention

    def counted(query, key, value, *args, **kwargs):
        # torch's multi-head attention passes (attn_mask, dropout_p, is_causal) positionally.
        mask = args[0] if args else kwargs.get("attn_mask")
        causal = args[2] if len(args) > 2 else kwargs.get("is_causal", False)
        calls.append((tuple(query.shape), mask is not None or bool(causal)))
        return real(query, key, value, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    size = config["vision_cfg"]["image_size"]
    images = torch.randn(2, 3, size, size)
    texts = torch.randint(1, 1000, (2, config["text_cfg"]["context_length"]))
    model.encode_image(images)
    vision_calls = len(calls)
    model.encode_text(texts)
    text_calls = len(calls) - vision_calls
    vision_layers = config["vision_cfg"]["layers"]
    expected_vision = image_calls if image_calls is not None else vision_layers
    assert vision_calls == expected_vision
    assert text_calls == config["text_cfg"]["layers"]
    # The text tower's causal mask goes in as an explicit mask (memory-efficient kernel, not
    # flash, on a GPU: docs/training.md, "Compiled towers and attention"); the image tower's
    # attention is unmasked.
    assert all(masked for _, masked in calls[vision_calls:])
    assert not any(masked for _, masked in calls[:vision_calls])
