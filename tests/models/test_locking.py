"""Locked towers under DeepSpeed, every ZeRO stage: the locked parameters never move, the optimizer
holds state for the trainable parameters only, frozen batch-norm statistics stay put, and the
towers can come from a vlcontrast checkpoint (``model.pretrained``)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed


def _full(param):
    """The whole parameter as fp32 on every rank (gathers a ZeRO-3 partitioned one)."""
    if hasattr(param, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            return param.detach().float().clone()
    return param.detach().float().clone()


def _train_locked(rank, world_size, checkpoint, cases):
    from torchvision.ops.misc import FrozenBatchNorm2d

    from vlcontrast.config import ModelConfig, load_config
    from vlcontrast.losses import build_loss
    from vlcontrast.models import build_model
    from vlcontrast.train.engine import build_engine
    from vlcontrast.train.precision import Precision

    from vlcontrast.checkpoints import resolve_weights

    reference = torch.load(resolve_weights(checkpoint) / "model.pt", weights_only=True)
    tolerance = {"fp32": 0.0, "amp_bf16": 0.0, "bf16": 1e-2}
    outcome = {}
    for stage, precision in cases:
        torch.manual_seed(0)
        model_cfg = ModelConfig(name="vlc-rn-micro", pretrained=checkpoint, lock_image=True,
                                lock_image_freeze_bn_stats=True, lock_text=True,
                                lock_text_unlocked_layers=1)
        bundle = build_model(model_cfg)
        trainable = {n for n, p in bundle.model.named_parameters() if p.requires_grad}
        trainable_numel = sum(p.numel() for p in bundle.model.parameters() if p.requires_grad)
        config = load_config(None, ["data.train=x", "train.steps=10", "data.batch_size=4",
                                    f"deepspeed.zero_stage={stage}", f"train.precision={precision}",
                                    "optim.lr=1e-2", "optim.warmup_steps=0"])
        engine, _ = build_engine(bundle.model, optim=config.optim, train=config.train, deepspeed=config.deepspeed,
                             micro_batch_size=config.data.batch_size, total_steps=10, world_size=world_size)
        params = dict(engine.module.named_parameters())
        start = {n: _full(p) for n, p in params.items()}
        frozen = [m for m in engine.module.modules() if isinstance(m, FrozenBatchNorm2d)]
        stats = [m.running_mean.clone() for m in frozen]
        loss_fn = build_loss("infonce")
        generator = torch.Generator().manual_seed(rank)
        texts = bundle.tokenizer([f"a caption {rank} {i}" for i in range(4)])
        for _ in range(2):
            images = torch.rand(4, 3, 32, 32, generator=generator).to(Precision(precision).parameter_dtype)
            out = engine(images, texts)
            result = loss_fn(out["image_features"], out["text_features"], out["logit_scale"],
                             sample_ids=torch.arange(4) + 4 * rank)
            engine.backward(result["loss"])
            engine.step()
        moved = {n for n, p in params.items() if not torch.equal(start[n], _full(p))}
        held = sum(state["exp_avg"].numel() for state in engine.basic_optimizer.state.values())
        outcome[(stage, precision)] = {
            "trainable": trainable, "trainable_numel": trainable_numel,
            "total_numel": sum(getattr(p, "ds_numel", p.numel()) for p in params.values()),
            "moved": moved, "optimizer_numel": held,
            "frozen": len(frozen),
            "stats_kept": all(torch.equal(a, m.running_mean) for a, m in zip(stats, frozen)),
            # The image tower is the checkpoint's (bf16: up to its rounding).
            "not_from_checkpoint": [
                n for n in params if n.startswith("visual.") and not torch.allclose(
                    start[n], reference[n].float().reshape(start[n].shape),
                    atol=tolerance[precision], rtol=tolerance[precision])],
        }
    return outcome


CASES = [(stage, "fp32") for stage in (0, 1, 2, 3)] + [(1, "bf16"), (2, "amp_bf16")]


@pytest.mark.slow
def test_locked_towers_under_every_zero_stage(tmp_path):
    from vlcontrast.config import ModelConfig
    from vlcontrast.models import build_model
    from vlcontrast.train.engine import open_clip_state_dict

    # The towers come from a "trained" vlcontrast checkpoint (here: a seeded random model).
    torch.manual_seed(123)
    source = build_model(ModelConfig(name="vlc-rn-micro")).model
    step = tmp_path / "checkpoints" / "step_00000001"
    step.mkdir(parents=True)
    torch.save(open_clip_state_dict(source, dict(source.state_dict())), step / "model.pt")
    (tmp_path / "checkpoints" / "latest").write_text("step_00000001\n")

    outcomes = run_distributed(_train_locked, 2, str(tmp_path), CASES, timeout=600)
    for case in CASES:
        result = outcomes[0][case]
        # Only trainable parameters moved, on every rank alike, and all of them did.
        assert result["moved"] == result["trainable"], (case, result["moved"] ^ result["trainable"])
        assert outcomes[1][case]["moved"] == result["moved"], case
        assert not any(n.startswith(("visual.", "token_embedding")) for n in result["trainable"])
        assert "logit_scale" in result["trainable"]
        # Optimizer state (Adam's moments; the fp32 master under ZeRO/bf16) only for those:
        # each rank all of it (ZeRO 0) or its partition (ZeRO >= 1; summed over the ranks), plus
        # DeepSpeed's alignment padding.
        held = (result["optimizer_numel"] if case[0] == 0
                else sum(outcome[case]["optimizer_numel"] for outcome in outcomes))
        assert result["trainable_numel"] <= held <= result["trainable_numel"] + 2 * 64, case
        assert result["trainable_numel"] < result["total_numel"] / 2, case
        # Frozen batch-norm statistics did not move in training mode.
        assert result["frozen"] > 0 and result["stats_kept"], case
        assert result["not_from_checkpoint"] == [], case
