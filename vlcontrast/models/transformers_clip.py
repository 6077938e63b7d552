"""open_clip CLIP <-> Hugging Face transformers ``CLIPModel``: configs, tensors, tokenizer, processor.

A ViT image tower with open_clip's own text transformer is the same network as transformers'
``CLIPModel``; only names and a few layouts differ. Both directions map every tensor by name and
refuse the rest:

=========================================  ==============================================
open_clip                                  transformers ``CLIPModel``
=========================================  ==============================================
``visual.conv1.weight``                    ``vision_model.embeddings.patch_embedding.weight``
``visual.class_embedding``                 ``vision_model.embeddings.class_embedding``
``visual.positional_embedding``            ``vision_model.embeddings.position_embedding.weight``
``visual.ln_pre``                          ``vision_model.pre_layrnorm``
``visual.transformer.resblocks.N``         ``vision_model.encoder.layers.N``
``visual.ln_post``                         ``vision_model.post_layernorm``
``visual.proj`` [width, D]                 ``visual_projection.weight`` [D, width] (transposed)
``token_embedding.weight``                 ``text_model.embeddings.token_embedding.weight``
``positional_embedding``                   ``text_model.embeddings.position_embedding.weight``
``transformer.resblocks.N``                ``text_model.encoder.layers.N``
``ln_final``                               ``text_model.final_layer_norm``
``text_projection`` [width, D]             ``text_projection.weight`` [D, width] (transposed)
``logit_scale``                            ``logit_scale``
=========================================  ==============================================

Inside a block: ``ln_1``/``ln_2`` -> ``layer_norm1``/``layer_norm2``; ``attn.in_proj_weight``
(and ``_bias``), q, k and v stacked in that order, -> ``self_attn.{q,k,v}_proj``;
``attn.out_proj`` -> ``self_attn.out_proj``; ``mlp.c_fc``/``mlp.c_proj`` -> ``mlp.fc1``/``mlp.fc2``.
A text tower under ``text.`` (open_clip's ``CustomTextCLIP``) maps the same way.

What the two agree on without a tensor: the activation (open_clip's ``quick_gelu`` flag ->
``hidden_act`` ``quick_gelu``, else exact ``gelu``), the layer-norm epsilon (1e-5 unless
``norm_kwargs`` says otherwise), attention scaled by ``head_dim ** -0.5``, the image tower
pooling its class token after ``ln_post``, and the text tower pooling its end-of-text token:
open_clip takes the position of the largest token id (``argmax``; ``<|endoftext|>`` = 49407 is
the largest id of the CLIP BPE), transformers the first ``eos_token_id`` = 49407, the same
position for every text the tokenizer makes. The tokenizer is open_clip's CLIP BPE, written as
transformers' ``CLIPTokenizer`` (same vocabulary and merges; ids equal up to the padding id for
text open_clip's ftfy and HTML-entity cleaning leaves alone; ``model_max_length`` the context);
the image processor is open_clip's evaluation transform (resize the shortest side, bicubic,
centre crop, mean/std) up to the crop offset's rounding. docs/evaluation.md ("How close, and
when") gives the measured differences.

What does not map is refused with one line naming the part: ResNet and timm image towers,
Hugging Face text towers, attentional or average pooling, layer scale, custom attention blocks,
a logit bias (SigLIP), another tokenizer, non-square images.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from vlcontrast.checkpoints import TRANSFORMERS_CONFIG_FILE as CONFIG_FILE
from vlcontrast.checkpoints import TRANSFORMERS_MODEL_TYPE as MODEL_TYPE
from vlcontrast.checkpoints import is_transformers_clip  # noqa: F401 - part of this module's API
from vlcontrast.errors import ConfigError

WEIGHTS_FILE = "model.safetensors"
BOS_ID, EOS_ID = 49406, 49407
"""``<|startoftext|>`` and ``<|endoftext|>`` in the CLIP BPE (open_clip's ``sot``/``eot``)."""
LAYER_NORM_EPS = 1e-5
"""torch's ``nn.LayerNorm`` default: what open_clip's towers use unless ``norm_kwargs`` says."""
ACTIVATIONS = {True: "quick_gelu", False: "gelu"}
"""open_clip's ``quick_gelu`` flag -> transformers' ``hidden_act`` (``nn.GELU()`` is exact gelu)."""
RESAMPLE = {"nearest": 0, "bilinear": 2, "bicubic": 3}
"""open_clip's interpolation names -> PIL's resampling codes, which transformers stores."""
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)

VISION_DEFAULTS_THAT_MAP = {
    "ls_init_value": None, "attentional_pool": False, "no_ln_pre": False,
    "pos_embed_type": "learnable", "pool_type": "tok", "act_kwargs": None,
    "block_type": None, "qk_norm": False, "scaled_cosine_attn": False, "scale_heads": False,
    "scale_attn_inner": False, "scale_attn": False, "scale_fc": False, "timm_model_name": None,
}
"""open_clip vision options that have no ``CLIPModel`` counterpart unless left at these values."""
TEXT_DEFAULTS_THAT_MAP = {
    "hf_model_name": None, "hf_tokenizer_name": None, "tokenizer_mode": None,
    "tokenizer_kwargs": None, "ls_init_value": None, "embed_cls": False, "no_causal_mask": False,
    "final_ln_after_pool": False, "pool_type": "argmax", "proj_bias": False,
    "proj_type": "linear", "act_kwargs": None, "block_type": None, "qk_norm": False,
    "scaled_cosine_attn": False, "scale_heads": False, "scale_attn_inner": False,
    "scale_attn": False, "scale_fc": False, "vocab_size": 49408,
}
"""The same for the text tower (``vocab_size``: the CLIP BPE's, the only tokenizer that maps)."""
WHY = {
    "timm_model_name": "a timm image tower",
    "attentional_pool": "an attentional pooler",
    "pool_type": "a pooling other than the class token (or, for text, the end-of-text token)",
    "ls_init_value": "layer scale",
    "no_ln_pre": "no layer norm before the image transformer",
    "pos_embed_type": "fixed sin-cos position embeddings",
    "embed_cls": "a text class token",
    "no_causal_mask": "text attention without the causal mask",
    "final_ln_after_pool": "the text layer norm after pooling",
    "proj_bias": "a text projection with a bias",
    "proj_type": "a text projection other than one matrix",
    "hf_model_name": "a Hugging Face text tower",
    "hf_tokenizer_name": "a tokenizer other than open_clip's CLIP BPE",
    "tokenizer_mode": "a tokenizer other than open_clip's CLIP BPE",
    "tokenizer_kwargs": "tokenizer options",
    "vocab_size": "a vocabulary other than the CLIP BPE's 49408 tokens",
    "act_kwargs": "activation options",
}


def refuse(part: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{part}={value!r}: {why}, which a transformers CLIPModel does not have; "
                       "export it with --format open_clip instead")


# ------------------------------------------------------------------------------------------------
# open_clip -> transformers


def _layer_norm_eps(cfg: dict, part: str) -> float:
    norm = cfg.get("norm_kwargs") or {}
    unknown = sorted(set(norm) - {"eps"})
    if unknown:
        raise refuse(f"{part}.norm_kwargs", norm, f"layer-norm options {unknown}")
    return float(norm.get("eps", LAYER_NORM_EPS))


def _check_options(cfg: dict, defaults: dict, part: str) -> None:
    for key, expected in defaults.items():
        value = cfg.get(key, expected)
        if value != expected and not (expected is None and value in (None, "", "default")):
            raise refuse(f"{part}.{key}", value, WHY.get(key, f"open_clip's {key} option"))


def check_mappable(model_cfg: dict, state: dict[str, torch.Tensor],
                   preprocess_cfg: dict | None = None) -> None:
    """Raise a one-line :class:`ConfigError` naming the first part of an open_clip model that a
    transformers ``CLIPModel`` cannot hold."""
    vision, text = model_cfg.get("vision_cfg", {}), model_cfg.get("text_cfg", {})
    if isinstance(vision.get("layers"), (list, tuple)):
        raise refuse("vision_cfg.layers", vision["layers"], "a ResNet image tower")
    _check_options(vision, VISION_DEFAULTS_THAT_MAP, "vision_cfg")
    _check_options(text, TEXT_DEFAULTS_THAT_MAP, "text_cfg")
    for key in ("image_size", "patch_size"):
        value = vision.get(key)
        if isinstance(value, (list, tuple)) and len(set(value)) != 1:
            raise refuse(f"vision_cfg.{key}", value, "a non-square image or patch")
    if model_cfg.get("nonscalar_logit_scale"):
        raise refuse("nonscalar_logit_scale", True, "a logit scale of shape [1]")
    if "logit_bias" in state:
        raise refuse("logit_bias", float(state["logit_bias"].reshape(-1)[0]),
                     "a learned logit bias (a SigLIP-trained model)")
    if (preprocess_cfg or {}).get("resize_mode", "shortest") == "longest":
        raise refuse("preprocess resize_mode", "longest",
                     "resizing the longest side and padding")
    interpolation = (preprocess_cfg or {}).get("interpolation", "bicubic")
    if interpolation not in RESAMPLE:
        raise refuse("preprocess interpolation", interpolation, "this interpolation")


def _split_state(state: dict[str, torch.Tensor]) -> tuple[str, str]:
    """The prefixes of the image tower and of the text tower in an open_clip state dict."""
    text = "text." if "text.token_embedding.weight" in state else ""
    if f"{text}token_embedding.weight" not in state:
        raise refuse("text tower", "hf", "a text tower other than open_clip's transformer")
    if "visual.conv1.weight" not in state or "visual.class_embedding" not in state:
        raise refuse("visual", "not a ViT", "an image tower other than open_clip's ViT")
    return "visual.", text


BLOCK_NAMES = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.out_proj": "self_attn.out_proj",
               "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}


def _block_to_transformers(source: dict[str, torch.Tensor], prefix: str, target: str,
                           out: dict[str, torch.Tensor], used: set[str]) -> int:
    layers = 0
    while f"{prefix}{layers}.ln_1.weight" in source:
        block, dest = f"{prefix}{layers}.", f"{target}{layers}."
        for ours, theirs in BLOCK_NAMES.items():
            for kind in ("weight", "bias"):
                out[f"{dest}{theirs}.{kind}"] = source[f"{block}{ours}.{kind}"]
                used.add(f"{block}{ours}.{kind}")
        for kind in ("weight", "bias"):
            fused = source[f"{block}attn.in_proj_{kind}"]
            used.add(f"{block}attn.in_proj_{kind}")
            for name, part in zip("qkv", fused.chunk(3, dim=0)):
                out[f"{dest}self_attn.{name}_proj.{kind}"] = part
        layers += 1
    return layers


def to_transformers_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """open_clip names -> ``CLIPModel`` names (see the module table); every tensor must be used."""
    visual, text = _split_state(state)
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(ours: str, theirs: str, transpose: bool = False) -> None:
        value = state[ours]
        out[theirs] = value.t() if transpose else value
        used.add(ours)

    take(f"{visual}conv1.weight", "vision_model.embeddings.patch_embedding.weight")
    take(f"{visual}class_embedding", "vision_model.embeddings.class_embedding")
    take(f"{visual}positional_embedding", "vision_model.embeddings.position_embedding.weight")
    for ours, theirs in (("ln_pre", "pre_layrnorm"), ("ln_post", "post_layernorm")):
        for kind in ("weight", "bias"):
            take(f"{visual}{ours}.{kind}", f"vision_model.{theirs}.{kind}")
    take(f"{visual}proj", "visual_projection.weight", transpose=True)
    _block_to_transformers(state, f"{visual}transformer.resblocks.",
                           "vision_model.encoder.layers.", out, used)

    take(f"{text}token_embedding.weight", "text_model.embeddings.token_embedding.weight")
    take(f"{text}positional_embedding", "text_model.embeddings.position_embedding.weight")
    for kind in ("weight", "bias"):
        take(f"{text}ln_final.{kind}", f"text_model.final_layer_norm.{kind}")
    take(f"{text}text_projection", "text_projection.weight", transpose=True)
    _block_to_transformers(state, f"{text}transformer.resblocks.", "text_model.encoder.layers.",
                           out, used)
    take("logit_scale", "logit_scale")
    out["logit_scale"] = out["logit_scale"].reshape(())
    left = sorted(k for k in state if k not in used and not k.endswith("attn_mask"))
    if left:
        raise refuse("state dict key", left[0], "a tensor with no place in CLIPModel")
    return {key: value.detach().to("cpu").contiguous() for key, value in out.items()}


def _size(value) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def transformers_config(model_cfg: dict, state: dict[str, torch.Tensor],
                        extra: dict | None = None) -> dict:
    """The ``config.json`` of the ``CLIPModel`` holding ``state`` (open_clip's names)."""
    vision, text = model_cfg["vision_cfg"], model_cfg["text_cfg"]
    act = ACTIVATIONS[bool(model_cfg.get("quick_gelu", False))]
    vision_width, text_width = int(vision.get("width", 768)), int(text.get("width", 512))
    _, text_prefix = _split_state(state)
    vision_layers = sum(1 for k in state if k.startswith("visual.transformer.resblocks.")
                        and k.endswith(".ln_1.weight"))
    text_layers = sum(1 for k in state if k.startswith(f"{text_prefix}transformer.resblocks.")
                      and k.endswith(".ln_1.weight"))
    vision_mlp = state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0]
    text_mlp = state[f"{text_prefix}transformer.resblocks.0.mlp.c_fc.weight"].shape[0]
    config = {
        "architectures": ["CLIPModel"],
        "model_type": MODEL_TYPE,
        "projection_dim": int(model_cfg["embed_dim"]),
        "logit_scale_init_value": float(state["logit_scale"].reshape(())),
        "text_config": {
            "model_type": "clip_text_model",
            "vocab_size": int(text.get("vocab_size", 49408)),
            "hidden_size": text_width,
            "intermediate_size": int(text_mlp),
            "projection_dim": int(model_cfg["embed_dim"]),
            "num_hidden_layers": text_layers,
            "num_attention_heads": int(text.get("heads", 8)),
            "max_position_embeddings": int(text.get("context_length", 77)),
            "hidden_act": act,
            "layer_norm_eps": _layer_norm_eps(text, "text_cfg"),
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "pad_token_id": EOS_ID,
        },
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": vision_width,
            "intermediate_size": int(vision_mlp),
            "projection_dim": int(model_cfg["embed_dim"]),
            "num_hidden_layers": vision_layers,
            "num_attention_heads": vision_width // int(vision.get("head_width", 64)),
            "image_size": _size(vision.get("image_size", 224)),
            "patch_size": _size(vision.get("patch_size", 16)),
            "hidden_act": act,
            "layer_norm_eps": _layer_norm_eps(vision, "vision_cfg"),
            "num_channels": 3,
        },
    }
    config.update(extra or {})
    return config


def image_processor_config(preprocess_cfg: dict, image_size: int) -> dict:
    """transformers ``CLIPImageProcessor`` settings for open_clip's evaluation transform. It has no
    setting for the two differences left: it rounds the centre crop's offset down where
    torchvision rounds to nearest (one pixel off when the resized side minus the crop is 3 mod 4),
    and its default torchvision backend resizes slightly unlike PIL (``backend="pil"`` does not)."""
    size = _size(preprocess_cfg.get("size", image_size))
    squash = preprocess_cfg.get("resize_mode", "shortest") == "squash"
    return {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": True,
        "size": {"height": size, "width": size} if squash else {"shortest_edge": size},
        "resample": RESAMPLE[preprocess_cfg.get("interpolation", "bicubic")],
        "do_center_crop": not squash,
        "crop_size": {"height": size, "width": size},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(preprocess_cfg.get("mean", OPENAI_MEAN)),
        "image_std": list(preprocess_cfg.get("std", OPENAI_STD)),
        "do_convert_rgb": True,
    }


def clip_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """open_clip's CLIP BPE (its shipped ``bpe_simple_vocab_16e6.txt.gz``) as transformers'
    vocabulary and merges: the same ids, the special tokens under transformers' names."""
    from open_clip.tokenizer import SimpleTokenizer

    simple = SimpleTokenizer()
    vocab = dict(simple.encoder)
    vocab["<|startoftext|>"] = vocab.pop("<start_of_text>")
    vocab["<|endoftext|>"] = vocab.pop("<end_of_text>")
    merges = [merge for merge, _ in sorted(simple.bpe_ranks.items(), key=lambda item: item[1])]
    return vocab, merges


def clip_tokenizer(context_length: int):
    """transformers' ``CLIPTokenizer`` over open_clip's CLIP BPE, whose ``model_max_length`` is
    ``context_length``: ``truncation=True`` cuts there as open_clip does (without it, as in the
    zero-shot pipeline, a longer text is not cut and the model refuses it).

    It pads with ``<|endoftext|>`` (transformers' convention; open_clip pads with 0): the text
    tower pools the first end-of-text token and attends causally, so padding never reaches it.
    """
    from transformers import CLIPTokenizer

    vocab, merges = clip_bpe()
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=int(context_length))


def write_tokenizer_files(folder: Path, context_length: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` (transformers 5), plus ``vocab.json`` and
    ``merges.txt`` (what the slow ``CLIPTokenizer`` of transformers 4 reads)."""
    tokenizer = clip_tokenizer(context_length)
    tokenizer.save_pretrained(folder)
    vocab, merges = clip_bpe()
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges)
                                       + "\n")
    return tokenizer


# ------------------------------------------------------------------------------------------------
# transformers -> open_clip


def _activation(config: dict, what: str) -> bool:
    act = config.get("hidden_act", "quick_gelu")
    if act not in ("quick_gelu", "gelu"):
        raise ConfigError(f"{what}: {config.get('model_type', 'clip')}.hidden_act={act!r}; open_clip "
                          "builds quick_gelu or exact gelu only")
    return act == "quick_gelu"


def open_clip_config(config: dict, what: str = "model.pretrained") -> dict:
    """The open_clip model config of a ``CLIPModel`` ``config.json`` (the inverse of
    :func:`transformers_config`); one-line errors for what open_clip cannot build."""
    vision, text = config.get("vision_config") or {}, config.get("text_config") or {}
    quick_vision, quick_text = _activation(vision, what), _activation(text, what)
    if quick_vision != quick_text:
        raise ConfigError(f"{what}: vision hidden_act {vision.get('hidden_act')!r} but text "
                          f"hidden_act {text.get('hidden_act')!r}; open_clip uses one activation "
                          "for both towers")
    for part, cfg in (("vision_config", vision), ("text_config", text)):
        if int(cfg.get("hidden_size", 1)) % int(cfg.get("num_attention_heads", 1)):
            raise ConfigError(f"{what}: {part}.hidden_size is not a multiple of its heads")
    size = vision.get("image_size", 224)
    if isinstance(size, (list, tuple)) and len(set(size)) != 1:
        raise ConfigError(f"{what}: vision_config.image_size={size}; only square images map")
    vision_width, text_width = int(vision.get("hidden_size", 768)), int(text.get("hidden_size", 512))
    heads = int(vision.get("num_attention_heads", 12))
    cfg: dict[str, Any] = {
        "embed_dim": int(config.get("projection_dim", 512)),
        "vision_cfg": {
            "image_size": _size(size),
            "layers": int(vision.get("num_hidden_layers", 12)),
            "width": vision_width,
            "head_width": vision_width // heads,
            "mlp_ratio": int(vision.get("intermediate_size", 3072)) / vision_width,
            "patch_size": _size(vision.get("patch_size", 32)),
        },
        "text_cfg": {
            "context_length": int(text.get("max_position_embeddings", 77)),
            "vocab_size": int(text.get("vocab_size", 49408)),
            "width": text_width,
            "heads": int(text.get("num_attention_heads", 8)),
            "layers": int(text.get("num_hidden_layers", 12)),
            "mlp_ratio": int(text.get("intermediate_size", 2048)) / text_width,
        },
    }
    if quick_vision:
        cfg["quick_gelu"] = True
    for part, source in (("vision_cfg", vision), ("text_cfg", text)):
        eps = float(source.get("layer_norm_eps", LAYER_NORM_EPS))
        if eps != LAYER_NORM_EPS:
            cfg[part]["norm_kwargs"] = {"eps": eps}
    if cfg["text_cfg"]["vocab_size"] != 49408:
        raise ConfigError(f"{what}: text_config.vocab_size={cfg['text_cfg']['vocab_size']}; "
                          "open_clip's transformer text tower maps only with the CLIP BPE "
                          "(49408 tokens)")
    return cfg


def _block_from_transformers(source: dict[str, torch.Tensor], prefix: str, target: str,
                             out: dict[str, torch.Tensor], used: set[str]) -> None:
    layer = 0
    while f"{prefix}{layer}.layer_norm1.weight" in source:
        block, dest = f"{prefix}{layer}.", f"{target}{layer}."
        for ours, theirs in BLOCK_NAMES.items():
            for kind in ("weight", "bias"):
                out[f"{dest}{ours}.{kind}"] = source[f"{block}{theirs}.{kind}"]
                used.add(f"{block}{theirs}.{kind}")
        for kind in ("weight", "bias"):
            names = [f"{block}self_attn.{name}_proj.{kind}" for name in "qkv"]
            out[f"{dest}attn.in_proj_{kind}"] = torch.cat([source[name] for name in names])
            used.update(names)
        layer += 1


def from_transformers_state_dict(state: dict[str, torch.Tensor], what: str = "model.pretrained"
                                 ) -> dict[str, torch.Tensor]:
    """``CLIPModel`` names -> open_clip ``CLIP`` names (the inverse of
    :func:`to_transformers_state_dict`); every tensor must be used."""
    state = {key.removeprefix("model."): value for key, value in state.items()}
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(theirs: str, ours: str, transpose: bool = False) -> None:
        if theirs not in state:
            raise ConfigError(f"{what}: the CLIPModel weights lack {theirs!r}; is it a complete "
                              "CLIPModel (vision and text towers, both projections)?")
        value = state[theirs]
        out[ours] = value.t() if transpose else value
        used.add(theirs)

    take("vision_model.embeddings.patch_embedding.weight", "visual.conv1.weight")
    take("vision_model.embeddings.class_embedding", "visual.class_embedding")
    take("vision_model.embeddings.position_embedding.weight", "visual.positional_embedding")
    for theirs, ours in (("pre_layrnorm", "ln_pre"), ("post_layernorm", "ln_post")):
        for kind in ("weight", "bias"):
            take(f"vision_model.{theirs}.{kind}", f"visual.{ours}.{kind}")
    take("visual_projection.weight", "visual.proj", transpose=True)
    _block_from_transformers(state, "vision_model.encoder.layers.",
                             "visual.transformer.resblocks.", out, used)
    take("text_model.embeddings.token_embedding.weight", "token_embedding.weight")
    take("text_model.embeddings.position_embedding.weight", "positional_embedding")
    for kind in ("weight", "bias"):
        take(f"text_model.final_layer_norm.{kind}", f"ln_final.{kind}")
    take("text_projection.weight", "text_projection", transpose=True)
    _block_from_transformers(state, "text_model.encoder.layers.", "transformer.resblocks.", out,
                             used)
    take("logit_scale", "logit_scale")
    out["logit_scale"] = out["logit_scale"].reshape(())
    left = sorted(k for k in state if k not in used and not k.endswith("position_ids"))
    if left:
        raise ConfigError(f"{what}: the CLIPModel tensor {left[0]!r} has no place in open_clip's "
                          "CLIP (a projection bias, another pooling?); it cannot be loaded")
    return {key: value.contiguous() for key, value in out.items()}


def read_transformers_weights(folder: Path, what: str = "model.pretrained"
                              ) -> dict[str, torch.Tensor]:
    """The tensors of a ``CLIPModel`` directory: ``model.safetensors`` (or its shards), else a
    ``pytorch_model.bin`` read as tensors only."""
    from safetensors.torch import load_file

    folder = Path(folder)
    files = sorted(folder.glob("model*.safetensors"))
    if files:
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file)))
        return state
    pickled = folder / "pytorch_model.bin"
    if pickled.is_file():
        return torch.load(pickled, map_location="cpu", weights_only=True)
    raise ConfigError(f"{what}={str(folder)!r}: a CLIPModel config.json but no model.safetensors "
                      "(nor pytorch_model.bin) beside it")


def check_tokenizer(folder: Path, what: str = "model.pretrained") -> None:
    """Refuse a ``CLIPModel`` directory whose tokenizer is not the CLIP BPE open_clip uses (a
    directory without tokenizer files is taken as the default CLIP BPE)."""
    vocab = None
    if (folder / "vocab.json").is_file():
        vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    elif (folder / "tokenizer.json").is_file():
        model = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8")).get("model", {})
        vocab = model.get("vocab") if isinstance(model.get("vocab"), dict) else None
    if vocab is None:
        return
    expected, _ = clip_bpe()
    if vocab != expected:
        differing = next((token for token, index in expected.items() if vocab.get(token) != index),
                         "its size")
        raise ConfigError(f"{what}={str(folder)!r}: its tokenizer is not open_clip's CLIP BPE "
                          f"(first difference: {differing!r}); open_clip's text tower would read "
                          "other token ids")


def read_preprocess(folder: Path) -> dict:
    """open_clip's ``preprocess_cfg`` from a ``preprocessor_config.json`` (empty: defaults)."""
    path = folder / "preprocessor_config.json"
    if not path.is_file():
        return {}
    processor = json.loads(path.read_text())
    names = {code: name for name, code in RESAMPLE.items()}
    result: dict[str, Any] = {}
    if "image_mean" in processor:
        result["mean"] = tuple(float(v) for v in processor["image_mean"])
    if "image_std" in processor:
        result["std"] = tuple(float(v) for v in processor["image_std"])
    if processor.get("resample") in names:
        result["interpolation"] = names[processor["resample"]]
    if processor.get("do_center_crop", True) is False:
        result["resize_mode"] = "squash"
    return result


def load_transformers_clip(folder: str | Path, what: str = "model.pretrained"
                           ) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """``(open_clip model config, open_clip state dict, preprocess overrides)`` of a ``CLIPModel``
    directory; the ``init_logit_scale`` is the model's trained value."""
    folder = Path(folder)
    config = json.loads((folder / CONFIG_FILE).read_text())
    model_cfg = open_clip_config(config, f"{what}={str(folder)!r}")
    check_tokenizer(folder, what)
    state = from_transformers_state_dict(read_transformers_weights(folder, what),
                                         f"{what}={str(folder)!r}")
    return model_cfg, state, read_preprocess(folder)


def default_preprocess() -> dict:
    """open_clip's own defaults, to tell which overrides matter."""
    from open_clip.transform import PreprocessCfg

    return asdict(PreprocessCfg())


def preprocess_overrides(preprocess: dict) -> dict:
    """The entries of ``preprocess`` that differ from open_clip's defaults, as the keyword
    arguments of ``open_clip.create_model_and_transforms`` (``image_mean`` ...)."""
    defaults = default_preprocess()
    names = {"mean": "image_mean", "std": "image_std", "interpolation": "image_interpolation",
             "resize_mode": "image_resize_mode"}
    result = {}
    for key, argument in names.items():
        if key not in preprocess:
            continue
        value, default = preprocess[key], defaults[key]
        if isinstance(value, (list, tuple)):
            if all(math.isclose(a, b, rel_tol=0, abs_tol=1e-7) for a, b in zip(value, default)):
                continue
            value = tuple(value)
        elif value == default:
            continue
        result[argument] = value
    return result
