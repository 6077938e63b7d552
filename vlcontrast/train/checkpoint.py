"""Atomic checkpoints: DeepSpeed engine state plus everything else a resume needs.

Layout of one checkpoint (see docs/architecture.md)::

    checkpoints/step_00000100/
        engine/              DeepSpeed save_checkpoint (model, optimizer, scheduler, loss scaler)
        model.pt             consolidated fp32 state dict (evaluation, export)
        model_config.json    open_clip model config and model name
        trainer_state.pt     step, samples seen, loss state (DeCL buffer), EMA towers
        rank_00000.pt ...    per-rank data-loader position and RNG states
        config.yaml          resolved run config
    checkpoints/latest       name of the newest complete checkpoint

Everything is written into ``step_XXXXXXXX.tmp/`` and renamed when complete, so a crash mid-write
leaves the previous checkpoint usable; ``latest`` is replaced atomically after the rename.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlcontrast import distributed as dist_utils


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def consolidated_state_dict(engine, zero_stage: int) -> dict[str, torch.Tensor] | None:
    """Full fp32 model weights on rank 0, in open_clip's shapes (collective under ZeRO-3)."""
    from vlcontrast.train.engine import open_clip_state_dict

    if zero_stage == 3:
        state = engine._zero3_consolidated_16bit_state_dict()  # all ranks must call
        if state is None:
            return None
        state = {k: v.float().cpu() for k, v in state.items()}
    elif not dist_utils.is_main_process():
        return None
    else:
        state = {k: v.detach().float().cpu().clone() for k, v in engine.module.state_dict().items()}
    return open_clip_state_dict(engine.module, state)


def save_checkpoint(root: Path, step: int, engine, *, zero_stage: int, trainer_state: dict,
                    rank_state: dict, model_config: dict, config_yaml: str, keep: int) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory."""
    rank = dist_utils.get_rank()
    name = f"step_{step:08d}"
    final = root / name
    tmp = root / (name + ".tmp")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist_utils.barrier()
    engine.save_checkpoint(str(tmp), tag="engine", save_latest=False)
    state = consolidated_state_dict(engine, zero_stage)
    torch.save(rank_state, tmp / f"rank_{rank:05d}.pt")
    if rank == 0:
        torch.save(state, tmp / "model.pt")
        torch.save(trainer_state, tmp / "trainer_state.pt")
        (tmp / "model_config.json").write_text(json.dumps(model_config, indent=2))
        (tmp / "config.yaml").write_text(config_yaml)
    dist_utils.barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write_text(root / "latest", name + "\n")
        prune(root, keep)
    dist_utils.barrier()
    return final


def prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob("step_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def find_resume(resume: str, output_dir: Path) -> Path | None:
    """The checkpoint directory named by ``train.resume`` (``latest`` may find none: fresh start)."""
    if not resume:
        return None
    if resume == "latest":
        latest = output_dir / "checkpoints" / "latest"
        if not latest.is_file():
            return None
        path = output_dir / "checkpoints" / latest.read_text().strip()
    else:
        path = Path(resume)
        if (path / "checkpoints" / "latest").is_file():
            path = path / "checkpoints" / (path / "checkpoints" / "latest").read_text().strip()
    if not (path / "trainer_state.pt").is_file():
        raise FileNotFoundError(f"train.resume={resume!r}: {path} is not a complete checkpoint "
                                "(no trainer_state.pt)")
    return path


def load_checkpoint(path: Path, engine) -> tuple[dict, dict | None]:
    """Restore the engine; return (trainer_state, this rank's state or None if world size changed)."""
    engine.load_checkpoint(str(path), tag="engine", load_module_strict=True)
    trainer_state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
    rank_file = path / f"rank_{dist_utils.get_rank():05d}.pt"
    ranks_saved = len(list(path.glob("rank_*.pt")))
    rank_state = None
    if rank_file.is_file() and ranks_saved == dist_utils.get_world_size():
        rank_state = torch.load(rank_file, map_location="cpu", weights_only=False)
    return trainer_state, rank_state
