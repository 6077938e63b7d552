"""FLOPs of a CLIP model's training step, counted from its open_clip config, and the MFU they give.

The count is analytic: the matrix products and convolutions of one forward per sample (2 FLOPs
per multiply-add, what ``torch.utils.flop_counter.FlopCounterMode`` counts), for open_clip's ViT
and ModifiedResNet image towers and its text transformer; a training step is 3 forwards (the
backward costs two). Norms, activations, softmax and the loss's ``B x B`` logits are left out
(under 1% at CLIP sizes). ``tests/models/test_flops.py`` checks the count against
``FlopCounterMode`` on the CPU.

MFU (model FLOPs utilisation) = FLOPs per step x steps per second / the device's peak dense
bf16 FLOP/s: :func:`peak_flops` looks the peak up by device name (:data:`PEAK_TFLOPS`);
``train.peak_tflops`` overrides it.
"""

from __future__ import annotations

from typing import Any

PEAK_TFLOPS = {
    # Dense bf16 tensor-core peak per GPU, by a substring of torch.cuda.get_device_name (first
    # match wins: the more specific names come first).
    "GH200": 989.0,
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,  # SXM
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 70.0,
    "L4": 121.0,
    "V100": 125.0,  # fp16 (no bf16)
}
"""Dense bf16 peak TFLOP/s per GPU by device name (vendors' data sheets, without sparsity)."""


def _pair(value) -> tuple[int, int]:
    return (int(value[0]), int(value[1])) if isinstance(value, (list, tuple)) else (int(value),) * 2


def transformer_flops(tokens: int, width: int, layers: int, mlp_ratio: float = 4.0) -> float:
    """One forward of ``layers`` pre-norm blocks over ``tokens`` tokens of ``width``: the q/k/v and
    output projections, the two attention products, the MLP."""
    hidden = int(width * mlp_ratio)
    per_layer = (2 * tokens * width * 3 * width      # q, k, v
                 + 2 * 2 * tokens * tokens * width   # q k^T and attention x v
                 + 2 * tokens * width * width        # output projection
                 + 2 * 2 * tokens * width * hidden)  # MLP up and down
    return float(layers * per_layer)


def vit_flops(vision: dict[str, Any], embed_dim: int) -> float:
    height, width_px = _pair(vision.get("image_size", 224))
    patch_h, patch_w = _pair(vision.get("patch_size", 16))
    width = int(vision.get("width", 768))
    patches = (height // patch_h) * (width_px // patch_w)
    tokens = patches + 1  # the class token
    embed = 2 * patches * 3 * patch_h * patch_w * width
    blocks = transformer_flops(tokens, width, int(vision.get("layers", 12)),
                               float(vision.get("mlp_ratio", 4.0)))
    return embed + blocks + 2 * width * embed_dim


def _conv(cin: int, cout: int, kernel: int, size: int) -> float:
    return 2.0 * cin * cout * kernel * kernel * size * size


def resnet_flops(vision: dict[str, Any], embed_dim: int) -> float:
    """open_clip's ModifiedResNet: a 3-conv stem, bottlenecks with average-pool downsampling, an
    attention pool over the last grid (q/k/v and output projections over every position)."""
    size = _pair(vision.get("image_size", 224))[0]
    width = int(vision.get("width", 64))
    layers = vision.get("layers", (3, 4, 6, 3))
    head_width = int(vision.get("head_width", 64))
    flops = 0.0
    size //= 2  # conv1 has stride 2
    flops += _conv(3, width // 2, 3, size) + _conv(width // 2, width // 2, 3, size)
    flops += _conv(width // 2, width, 3, size)
    size //= 2  # stem average pool
    inplanes = width
    for index, blocks in enumerate(layers):
        planes = width * 2 ** index
        for block in range(int(blocks)):
            stride = 2 if (index > 0 and block == 0) else 1
            flops += _conv(inplanes, planes, 1, size) + _conv(planes, planes, 3, size)
            out = size // stride
            flops += _conv(planes, planes * 4, 1, out)
            if stride > 1 or inplanes != planes * 4:
                flops += _conv(inplanes, planes * 4, 1, out)
            inplanes, size = planes * 4, out
    channels = width * 32
    tokens = size * size + 1
    flops += 2 * tokens * channels * 3 * channels     # q, k, v over every position
    flops += 2 * 2 * tokens * tokens * channels       # attention
    flops += 2 * tokens * channels * embed_dim        # output projection (every position)
    del head_width  # heads split the width: the count does not depend on them
    return flops


def text_flops(text: dict[str, Any], embed_dim: int) -> float:
    tokens = int(text.get("context_length", 77))
    width = int(text.get("width", 512))
    blocks = transformer_flops(tokens, width, int(text.get("layers", 12)),
                               float(text.get("mlp_ratio", 4.0)))
    projection = 0.0 if text.get("proj_type", "linear") == "none" else 2 * width * embed_dim
    return blocks + projection


def forward_flops_per_sample(model_config: dict[str, Any]) -> float | None:
    """FLOPs of one image-text pair's forward through both towers; None for towers this count
    does not know (timm or Hugging Face towers). ``model_config`` is open_clip's model config, or
    a model bundle's ``model_config`` that holds it under ``model_cfg``."""
    model_config = model_config.get("model_cfg", model_config)
    vision, text = model_config.get("vision_cfg", {}), model_config.get("text_cfg", {})
    if vision.get("timm_model_name") or text.get("hf_model_name"):
        return None
    embed_dim = int(model_config.get("embed_dim", 512))
    layers = vision.get("layers", 12)
    image = (resnet_flops(vision, embed_dim) if isinstance(layers, (list, tuple))
             else vit_flops(vision, embed_dim))
    return image + text_flops(text, embed_dim)


def train_flops_per_sample(model_config: dict[str, Any], *, image_tower: bool = True,
                           text_tower: bool = True) -> float | None:
    """FLOPs of one pair in a training step: 3 forwards (forward, and a backward of twice its
    cost). A locked tower still runs its forward; it is counted as in the papers' MFU, 3x."""
    del image_tower, text_tower  # the usual convention counts every tower 3x
    forward = forward_flops_per_sample(model_config)
    return None if forward is None else 3.0 * forward


def peak_flops(device_name: str, override_tflops: float = 0.0) -> float | None:
    """Peak dense bf16 FLOP/s of the device named ``device_name`` (``override_tflops`` x 1e12 when
    set); None when unknown."""
    if override_tflops > 0:
        return override_tflops * 1e12
    for key, tflops in PEAK_TFLOPS.items():
        if key.lower() in device_name.lower():
            return tflops * 1e12
    return None


def mfu(samples_per_s: float, flops_per_sample: float | None, peak: float | None) -> float | None:
    """Model FLOPs utilisation, 0..1; None when either count is unknown."""
    if not flops_per_sample or not peak:
        return None
    return samples_per_s * flops_per_sample / peak
