"""What ZeRO and 16-bit training must not change: ``model.pt`` holds the optimizer's true fp32
weights (not 16-bit working copies) under bf16/fp16 and ZeRO 0-3; evaluation of a ZeRO-3 model
whose projections are partitioned runs and agrees with evaluating the saved ``model.pt``.
Two processes; the backend is the test helper's (``VLC_TEST_BACKEND``)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import default_backend, rank_device, run_distributed



def _combinations():
    """bf16 under every ZeRO stage; fp16 (DeepSpeed's flat fp16 optimizer at ZeRO 0, ZeRO's at 2)
    where the accelerator supports it (GPUs; DeepSpeed's CPU accelerator does not)."""
    from deepspeed.accelerator import get_accelerator

    fp16 = [(0, "fp16"), (2, "fp16")] if get_accelerator().is_fp16_supported() else []
    return [(stage, "bf16") for stage in (0, 1, 2, 3)] + fp16


def _saved_weights_against_working_copies(rank, world_size, combinations):
    import deepspeed

    from vlcontrast.config import load_config
    from vlcontrast.train.checkpoint import full_fp32_state_dict
    from vlcontrast.train.engine import build_engine

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    outcome = {}
    for stage, precision in combinations:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.GELU(), torch.nn.Linear(64, 2))
        config = load_config(None, [
            "data.train=x", "train.steps=10", "data.batch_size=2", "optim.warmup_steps=1",
            f"deepspeed.zero_stage={stage}", f"train.precision={precision}",
            "deepspeed.overrides.fp16.initial_scale_power=4",
            "deepspeed.overrides.zero_optimization.stage3_param_persistence_threshold=1"])
        engine, _ = build_engine(model, optim=config.optim, train=config.train, deepspeed=config.deepspeed,
                             micro_batch_size=config.data.batch_size, total_steps=10, world_size=world_size)
        device = next(engine.module.parameters()).device
        for _ in range(3):
            inputs = torch.randn(2, 4, device=device).to(dtypes[precision])
            engine.backward(engine(inputs).float().pow(2).sum())
            engine.step()
        saved = full_fp32_state_dict(engine)  # collective
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params) if stage == 3 else _nothing():
            working = {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}
        if rank == 0:
            dtype = dtypes[precision]
            outcome[(stage, precision)] = {
                "fp32": all(v.dtype == torch.float32 for v in saved.values()),
                # the 16-bit working copy is the saved weight rounded: the same weights...
                "rounds_to_working": all(torch.equal(saved[n].to(dtype), working[n])
                                         for n in working),
                # ...with the fp32 master's extra bits (a 16-bit copy would have none).
                "finer_than_16_bit": any(not torch.equal(saved[n], saved[n].to(dtype).float())
                                         for n in working),
            }
    return outcome


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.slow
def test_model_pt_holds_the_fp32_master_under_16_bit_training_and_every_zero_stage():
    combinations = _combinations()
    outcomes = run_distributed(_saved_weights_against_working_copies, 2, combinations,
                               timeout=400, backend=default_backend())
    for combination in combinations:
        assert outcomes[0][combination] == {"fp32": True, "rounds_to_working": True,
                                            "finer_than_16_bit": True}, combination


def _zero3_evaluation(rank, world_size, data_dir, out_dir):
    import vlcontrast.train.evaluate as evaluate_module
    from tests.train.helpers import tiny_config
    from vlcontrast.evaluation import evaluate_retrieval
    from vlcontrast.models import load_model_from_checkpoint
    from vlcontrast.train import train

    partitioned = []
    real = evaluate_module.gathered_weights

    def spy(module):
        partitioned.extend(name for name, param in module.named_parameters()
                           if getattr(param, "ds_status", None) is not None
                           and param.ds_status.name == "NOT_AVAILABLE")
        return real(module)

    evaluate_module.gathered_weights = spy
    config = tiny_config(data_dir, out_dir, train__steps=2, deepspeed__zero_stage=3,
                         eval__retrieval=str(data_dir / "val"), **{
                             "deepspeed__overrides__zero_optimization__"
                             "stage3_param_persistence_threshold": 1})
    results = train(config)
    bundle = load_model_from_checkpoint(out_dir, device=rank_device())
    again = evaluate_retrieval(bundle.model, bundle.preprocess_val, bundle.tokenizer,
                               config.eval.retrieval, batch_size=config.eval.batch_size,
                               workers=0, device=rank_device(), max_samples=config.eval.max_samples,
                               progress=False)
    return sorted(set(partitioned)), results, again


@pytest.mark.slow
def test_zero3_evaluation_with_partitioned_projections_matches_the_saved_model(
        synthetic_data, tmp_path):
    outcomes = run_distributed(_zero3_evaluation, 2, synthetic_data, tmp_path, timeout=400)
    for partitioned, results, again in outcomes:
        assert "text_projection" in partitioned, partitioned
        assert any("proj" in name for name in partitioned if name != "text_projection")
        metrics = {k.removeprefix("retrieval/"): v for k, v in results.items()
                   if k.startswith("retrieval/")}
        assert metrics and metrics["text_to_image_R@1"] >= 0
        for key, value in metrics.items():
            assert again[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
