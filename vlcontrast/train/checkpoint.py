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

Write failures (full disk, unwritable directory) are agreed on by all ranks: before the collective
DeepSpeed save every rank checks the free space and rank 0 creates the temporary directory; after
it, every rank's own files are written and checked; any failure raises :class:`CheckpointError`
on every rank, naming the step and the previous checkpoint, which stays intact. (A write that
fails *inside* DeepSpeed's collective save leaves the other ranks waiting at its barrier until the
process-group timeout, ``train.dist_timeout_s``; the previous checkpoint is intact then too.)
"""

from __future__ import annotations

import errno
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


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the previous one is intact."""


BYTES_PER_PARAMETER = 20
"""Rough checkpoint size per model parameter: weights (4, or 2 + 4 fp32 master copy), AdamW's two
moments (8), the consolidated model.pt (4)."""


def checkpoint_bytes(num_parameters: int) -> int:
    """Estimated size of one checkpoint (all ranks' files together)."""
    return num_parameters * BYTES_PER_PARAMETER


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem holding ``path`` (its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def check_free_space(path: Path, needed: int, what: str) -> None:
    free = free_bytes(path)
    if free < needed:
        raise OSError(errno.ENOSPC, f"{what}: {path} has {free / 1e9:.2f} GB free, one checkpoint "
                      f"needs about {needed / 1e9:.2f} GB")


def _save_file(obj: Any, path: Path) -> None:
    """``torch.save`` (one place, so a test can simulate a full disk)."""
    torch.save(obj, path)


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
                    rank_state: dict, model_config: dict, config_yaml: str, keep: int,
                    expected_bytes: int = 0) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory.

    Raises :class:`CheckpointError` on every rank when any rank cannot write; the previous
    checkpoint and ``latest`` are untouched then.
    """
    rank = dist_utils.get_rank()
    name = f"step_{step:08d}"
    final = root / name
    tmp = root / (name + ".tmp")
    previous = latest_checkpoint(root)

    def agree(error: BaseException | None) -> None:
        if error is not None:
            error = CheckpointError(
                f"checkpoint at step {step} could not be written to {tmp} "
                f"({type(error).__name__}: {error}); the previous checkpoint "
                f"({previous or 'none'}) is intact")
        try:
            dist_utils.raise_on_any_rank(error, CheckpointError)
        except CheckpointError:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    error: BaseException | None = None
    try:
        check_free_space(root, expected_bytes, "checkpoint")
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
    except OSError as err:
        error = err
    agree(error)

    engine.save_checkpoint(str(tmp), tag="engine", save_latest=False)
    state = consolidated_state_dict(engine, zero_stage)  # collective under ZeRO-3
    try:
        _save_file(rank_state, tmp / f"rank_{rank:05d}.pt")
        if rank == 0:
            _save_file(state, tmp / "model.pt")
            _save_file(trainer_state, tmp / "trainer_state.pt")
            (tmp / "model_config.json").write_text(json.dumps(model_config, indent=2))
            (tmp / "config.yaml").write_text(config_yaml)
    except (OSError, RuntimeError) as err:  # torch.save reports a failed write as RuntimeError
        error = err
    agree(error)

    if rank == 0:
        try:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _atomic_write_text(root / "latest", name + "\n")
        except OSError as err:
            error = err
    agree(error)
    if rank == 0:
        prune(root, keep)
    dist_utils.barrier()
    return final


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint ``root/latest`` names, if it is complete."""
    latest = root / "latest"
    if not latest.is_file():
        return None
    path = root / latest.read_text().strip()
    return path if (path / "trainer_state.pt").is_file() else None


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
