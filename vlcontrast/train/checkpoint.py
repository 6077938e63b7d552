"""Atomic checkpoints: DeepSpeed engine state plus everything else a resume needs.

Layout of one checkpoint (:mod:`vlcontrast.checkpoints`; docs/training.md, "Checkpoints")::

    checkpoints/step_00000100/
        engine/              DeepSpeed save_checkpoint (model, optimizer, scheduler, loss scaler)
        model.pt             consolidated true-fp32 weights (the optimizer's fp32 master under
                             bf16/fp16 and ZeRO 0-3), open_clip's names and shapes
        model_config.json    open_clip model config and model name
        trainer_state.pt     the run-wide stateful objects: train state (step, samples seen,
                             epoch), divergence counts, loss state (DeCL's buffer), EMA towers
        rank_00000.pt ...    per-rank stateful objects: data-loader position and RNG states
        config.yaml          resolved run config
        universal/           after a ZeRO 1-3 resume with another world size: engine/ as
                             DeepSpeed's universal checkpoint (:func:`universal_checkpoint`)
    checkpoints/latest       name of the newest complete checkpoint

State goes in through one dict of stateful objects per kind (run-wide, per rank): each has
``state_dict()``/``load_state_dict()``, and its entry's key names it in the file. Every file this
module writes holds tensors and plain containers only and is read back with
``torch.load(weights_only=True)``: a file carrying a pickled object is refused
(:class:`CheckpointError`) instead of run. DeepSpeed reads ``engine/`` itself, with its own
``torch.load(weights_only=False)``; its files are scanned first and refused when their pickles name
anything but tensors, plain containers and DeepSpeed's few known classes
(:func:`check_engine_files`). See docs/training.md for what that means for trusting a checkpoint
directory.

Everything is written into ``step_XXXXXXXX.tmp/`` and renamed when complete, so a crash mid-write
leaves the previous checkpoint usable; ``latest`` is replaced atomically after the rename.

Write failures (full disk, read-only or unwritable directory, a file-size limit) are agreed on by
all ranks: before the engine's save every rank checks the free space and rank 0 creates the
temporary directory; the engine's save follows (a failed write inside DeepSpeed's collective
save is held until its closing barrier, :meth:`Checkpointer._save_engine`), then every rank's own
files are written and checked; any failure raises :class:`CheckpointError` on every rank, naming
the step, the reason, the previous checkpoint, which stays intact, and the fix. (A DeepSpeed
failure before its writes, in its own collectives, is raised as DeepSpeed raises it, and may
leave the other ranks waiting until the process-group timeout, ``train.dist_timeout_s``.)
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from vlcontrast import distributed as dist_utils
from vlcontrast import checkpoints
from vlcontrast.checkpoints import (LATEST, check_engine_files, damaged_fix, load_file,
                                    missing_engine_file)
from vlcontrast.errors import CheckpointError
from vlcontrast.outputs import write_text_atomic


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# --------------------------------------------------------------------------------------------
# random state as tensors and lists


class RNGState:
    """Python's, NumPy's, torch's and this rank's CUDA random generator, as tensors and lists.

    Only the current device's CUDA state: with one GPU per task a rank sees one device, and a
    state of all devices saved on a node that saw eight would not load on it."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        kind, keys, position, has_gauss, cached = np.random.get_state(legacy=True)
        state = {"python": [version, list(internal), gauss],
                 "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                           "position": int(position), "has_gauss": int(has_gauss),
                           "cached_gaussian": float(cached)},
                 "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        numpy = state["numpy"]
        np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32),
                             numpy["position"], numpy["has_gauss"], numpy["cached_gaussian"]))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            cuda = state["cuda"]
            if isinstance(cuda, (list, tuple)):  # older checkpoints: every device's state
                cuda = cuda[torch.cuda.current_device() % len(cuda)]
            torch.cuda.set_rng_state(cuda, torch.cuda.current_device())


# --------------------------------------------------------------------------------------------
# true fp32 weights


def _fp16_optimizer_masters(engine) -> dict[int, torch.Tensor]:
    """The fp32 masters of DeepSpeed's ZeRO-0 16-bit optimizers, by working parameter: the fused
    one keeps them as one flat buffer per group, the unfused one (client optimizers such as
    torch's AdamW; bf16 at ZeRO 0 too) as one fp32 tensor per parameter."""
    optimizer = getattr(engine, "optimizer", None)
    groups = getattr(optimizer, "fp16_groups", None)
    if not groups:
        return {}
    flats, masters_by_group = (getattr(optimizer, "fp32_groups_flat", None),
                               getattr(optimizer, "fp32_groups", None))
    if flats:
        from torch._utils import _unflatten_dense_tensors

        masters_by_group = [_unflatten_dense_tensors(flat, params)
                            for flat, params in zip(flats, groups)]
    masters = {}
    for params, group_masters in zip(groups, masters_by_group or []):
        for param, master in zip(params, group_masters):
            if master.shape == param.shape:
                masters[id(param)] = master
    return masters


def full_fp32_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """The model's weights as the optimizer holds them, in fp32, on rank 0 (None elsewhere).

    Under bf16/fp16 the module's parameters are 16-bit working copies; the fp32 master lives in
    the optimizer (flat, or partitioned over ranks under ZeRO 1-3). ``safe_get_full_fp32_param``
    assembles it (a collective under ZeRO 1-3: every rank calls, in the same parameter order).
    Frozen parameters have no master: their own values (gathered under ZeRO-3) are the weights.
    """
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    from vlcontrast.train.engine import open_clip_state_dict

    module = engine.module
    is_main = dist_utils.is_main_process()
    masters = _fp16_optimizer_masters(engine)
    by_tensor: dict[int, torch.Tensor] = {}
    for param in module.parameters():  # the same order on every rank
        full = safe_get_full_fp32_param(param) if param.requires_grad else None
        if full is None and hasattr(param, "ds_id"):
            with deepspeed.zero.GatheredParameters([param]):
                full = param.detach().clone()
        if full is None:
            full = masters.get(id(param), param)
        if is_main:
            by_tensor[id(param)] = full.detach().float().cpu().clone()
    if not is_main:
        return None
    parameters = dict(module.named_parameters(remove_duplicate=False))
    state = {}
    for name, value in module.state_dict().items():
        param = parameters.get(name)
        state[name] = (by_tensor[id(param)].reshape(getattr(param, "ds_shape", param.shape))
                       if param is not None else value.detach().float().cpu().clone()
                       if value.is_floating_point() else value.detach().cpu().clone())
    return open_clip_state_dict(module, state)


# --------------------------------------------------------------------------------------------
# the checkpointer


class Checkpointer:
    """Saves and resumes a run: when a checkpoint is due, retention, the last good checkpoint.

    ``run_states`` are written once (rank 0, ``trainer_state.pt``), ``rank_states`` by every rank
    (``rank_RRRRR.pt``); both map a name to an object with ``state_dict``/``load_state_dict``.
    """

    def __init__(self, run_dir: Path, engine, *, every: int, keep: int,
                 run_states: dict[str, Stateful], rank_states: dict[str, Stateful],
                 model_config: dict, config_yaml: str, expected_bytes: int = 0,
                 param_layout: list[list[str]] | None = None,
                 legacy_layout: list[list[str]] | None = None):
        self.root = Path(run_dir) / "checkpoints"
        self.engine = engine
        self.every = every
        self.keep = keep
        self.run_states = run_states
        self.rank_states = rank_states
        self.model_config = model_config
        self.config_yaml = config_yaml
        self.expected_bytes = expected_bytes
        self.param_layout = param_layout
        """Parameter names per optimizer group, in order (:func:`group_layout`): the order
        DeepSpeed's flat optimizer state follows. Saved with each checkpoint and compared on
        resume, so a state laid out in another order is refused instead of loaded shifted."""
        self.legacy_layout = legacy_layout
        """The order checkpoints written before the layout was recorded used (groups without
        alignment); such a checkpoint resumes only where it equals ``param_layout``."""
        self.last_good: Path | None = None
        """The newest checkpoint written or resumed from (named when a run fails)."""
        self._saved_step = -1

    # -- resume --------------------------------------------------------------------------------

    def resume(self, path: Path | None) -> bool | None:
        """Restore from the checkpoint ``path`` (``train.resume`` as the preflight resolved it,
        :func:`~vlcontrast.checkpoints.find_resume`; collective). None: nothing to resume. True:
        every state restored. False: run states restored, per-rank states not (the world size
        changed; under ZeRO 1-3 the engine state comes from :func:`universal_checkpoint`). A file
        missing from the checkpoint is a CheckpointError on every rank."""
        if path is None:
            return None
        world, rank = dist_utils.get_world_size(), dist_utils.get_rank()
        rank_file = path / f"rank_{rank:05d}.pt"
        fix = damaged_fix(path)
        error: CheckpointError | None = None
        run_state = rank_state = None
        saved_world, universal = world, False
        try:
            # Ours first: a file carrying code is refused before DeepSpeed reads its own files.
            run_state = load_file(path / "trainer_state.pt", fix=fix)
        except CheckpointError as err:
            error = err
        if run_state is not None:
            saved_world = int(run_state.get(WORLD_KEY) or len(list(path.glob("rank_*.pt")))
                              or world)
            universal = checkpoints.universal_resume(path, world)
            if universal and not loads_universal(self.engine):
                raise CheckpointError(f"{path}: written by {saved_world} ranks under ZeRO 1-3 "
                                      f"and resumed by {world}, which needs an engine built with "
                                      "load_universal=True (build_engine)")
            # A universal checkpoint is made from every rank's partition, else a rank reads its
            # own.
            ranks = range(saved_world) if universal else [rank]
            lost = next(filter(None, (missing_engine_file(path / "engine", r) for r in ranks)),
                        None)
            if saved_world == world and not rank_file.is_file():
                error = CheckpointError(
                    f"{rank_file}: missing; the checkpoint was written by as many ranks as this "
                    f"run has ({world}), and that file holds this rank's data position and random "
                    f"state; {fix}")
            elif lost is not None:
                error = CheckpointError(f"{lost}: missing, so this checkpoint's optimizer state "
                                        f"cannot be read; {fix}")
            elif saved_world == world:
                try:  # read here, so that a damaged one stops every rank, not this one alone
                    rank_state = load_file(rank_file, fix=fix)
                except CheckpointError as err:
                    error = err
        # Agreed before DeepSpeed's load: a rank failing alone there leaves the others waiting.
        dist_utils.raise_on_any_rank(error, CheckpointError)
        assert run_state is not None
        self._check_layout(run_state, path)
        check_engine_files(path / "engine", fix)
        source = universal_checkpoint(path, saved_world) if universal else path
        if universal:  # reused from an earlier resume: read as warily
            check_engine_files(source, checkpoints.engine_fix(source))
        try:
            self.engine.load_checkpoint(str(source), tag="engine", load_module_strict=True)
        except FileNotFoundError as err:  # DeepSpeed's own files: one lost or never copied
            raise CheckpointError(f"{err.filename}: missing, so this checkpoint's optimizer "
                                  f"state cannot be read; {damaged_fix(path)}") from None
        if universal:
            _restore_group_settings(self.engine, source / "engine" / "zero" / "optimizer_state.pt")
        _load_states(self.run_states, run_state, path / "trainer_state.pt")
        if rank_state is not None:
            _load_states(self.rank_states, rank_state, rank_file)
        elif dist_utils.get_rank() == 0:
            import logging

            how = (f" through a universal checkpoint ({source}, DeepSpeed's ZeRO state split "
                   "anew)" if universal else "")
            epoch = (run_state.get("train") or {}).get("epoch")
            at = f" (epoch {int(epoch)}) from its beginning" if epoch is not None else ""
            logging.getLogger(__name__).warning(
                "resuming %s, written by %d rank(s), with %d%s%s: weights, optimizer and loss "
                "state resume; the data loader restarts the saved epoch%s", path, saved_world,
                world, how, self._batch_change(path, saved_world, world), at)
        if dist_utils.get_rank() == 0:
            self._warn_sample_state(path, rank_state)
        self.last_good = path
        self._saved_step = int(run_state.get("train", {}).get("step", -1))
        return rank_state is not None

    def _batch_change(self, path: Path, saved_world: int, world: int) -> str:
        """``; the global batch changes from 32 to 16 samples a step (...)`` for a resume with
        another world size, read from the checkpoint's config.yaml and this run's; '' when the
        global batch stays (or is unknown)."""
        import yaml

        try:
            saved = checkpoints.saved_config(path) or {}
        except Exception:  # checked in the preflight already; a warning adds nothing here
            return ""
        now = yaml.safe_load(self.config_yaml or "") or {}
        if not isinstance(saved, dict) or not isinstance(now, dict):
            return ""

        def batch(config: dict, ranks: int) -> tuple[int, int, int] | None:
            size = (config.get("data") or {}).get("batch_size")
            accum = (config.get("train") or {}).get("accum_steps") or 1
            if not isinstance(size, int) or not isinstance(accum, int):
                return None
            return size * ranks * accum, size, accum

        was, new = batch(saved, saved_world), batch(now, world)
        if was is None or new is None or was[0] == new[0]:
            return ""
        lr = (now.get("optim") or {}).get("lr")
        keep = (f"; to keep {was[0]}, set data.batch_size={was[0] // (world * new[2])}"
                if was[0] % (world * new[2]) == 0 else "")
        return (f"; the global batch changes from {was[0]} (data.batch_size={was[1]} x "
                f"{saved_world} rank(s) x train.accum_steps={was[2]}) to {new[0]} "
                f"(data.batch_size={new[1]} x {world} x train.accum_steps={new[2]}) samples a "
                f"step, and optim.lr={lr} is not rescaled{keep}")

    def _warn_sample_state(self, path: Path, rank_state: dict[str, Any] | None) -> None:
        """A loss with per-sample state indexed by sample id (decl, sogclr, fastclip individual)
        resumed on other training shards (their digest, in the loader's saved state, differs
        from this run's): the ids now name other samples, so the resumed state belongs to
        the samples the checkpoint trained on. A warning: an id space of another size is refused
        when the loss state loads."""
        import logging

        loss = self.run_states.get("loss")
        data = self.rank_states.get("data")
        if not getattr(loss, "needs_sample_ids", False) or data is None:
            return
        saved = (rank_state or {}).get("data")
        if saved is None:
            try:
                saved = load_file(path / "rank_00000.pt").get("data")
            except Exception:  # a lost file: the resume said so, or the world size changed
                return
        try:
            was = (saved.get("ranks", [saved])[0] if isinstance(saved, dict) else {}
                   ).get("shards_digest")
            now = data.state_dict().get("shards_digest")
        except Exception:
            return
        if not was or not now or was == now:
            return
        config = checkpoints.saved_config(path) or {}
        saved_train = (config.get("data") or {}).get("train")
        trained = f" (data.train={saved_train!r})" if saved_train else ""
        logging.getLogger(__name__).warning(
            "resuming %s: its training shards%s are not this run's (shard list digest %s, now "
            "%s), and loss %r keeps per-sample state indexed by sample id, which follows the "
            "id, not the sample: a sample these shards give an id that named another sample "
            "there inherits that sample's state; resume with the data it trained on, or start "
            "a new run from its weights "
            "(model.pretrained=%s)", path, trained, was, now,
            getattr(loss, "name", type(loss).__name__), path)

    def _check_layout(self, run_state: dict[str, Any], path: Path) -> None:
        if self.param_layout is None:
            return
        saved = run_state.get(LAYOUT_KEY)
        if saved is None:
            if self.legacy_layout is None or self.legacy_layout == self.param_layout:
                return
            raise CheckpointError(
                f"{path}: written before checkpoints recorded the optimizer's parameter order, "
                "and this version puts odd-sized parameters (logit_scale) last in each group under "
                "ZeRO 1-3 and bf16/fp16, so its flat optimizer state would load shifted; resume it "
                "with the vlcontrast that wrote it, or start a new run from it "
                "(model.pretrained=CHECKPOINT_DIR)")
        if [list(group) for group in saved] != self.param_layout:
            import yaml

            try:
                now = yaml.safe_load(self.config_yaml or "") or {}
                changed = checkpoints.parameter_set_changes(checkpoints.saved_config(path),
                                                            now if isinstance(now, dict) else {})
            except Exception:  # an unreadable config.yaml: the words without the option
                changed = []
            if changed:  # the options that changed the parameter set, named (config.yaml's)
                fixes = " ".join(change.split(" there")[0] for change in changed)
                raise CheckpointError(
                    f"{path}: written with other parameters to train ({'; '.join(changed)}), so "
                    f"its optimizer state does not fit this run's "
                    f"({_first_difference(saved, self.param_layout)}); resume with {fixes} (its "
                    f"config.yaml), or start a new run from its weights with "
                    f"model.pretrained={path}")
            raise CheckpointError(
                f"{path}: its optimizer state is laid out in another parameter order "
                f"({_first_difference(saved, self.param_layout)}); resume with the config and "
                "vlcontrast version that wrote it, or start a new run from it "
                "(model.pretrained=CHECKPOINT_DIR)")

    # -- save ----------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0 and step != self._saved_step

    def maybe_save(self, step: int, *, force: bool = False) -> Path | None:
        """Save when a checkpoint is due at ``step`` (or ``force``), once per step (collective)."""
        if step == self._saved_step or not (force or self.due(step)):
            return None
        path = self.save(step)
        self.last_good, self._saved_step = path, step
        return path

    def save(self, step: int) -> Path:
        """Collective: every rank calls it. Returns the final checkpoint directory.

        Raises :class:`CheckpointError` on every rank when any rank cannot write; the previous
        checkpoint and ``latest`` are untouched then.
        """
        rank = dist_utils.get_rank()
        name = f"step_{step:08d}"
        final, tmp = self.root / name, self.root / (name + ".tmp")

        def agree(error: BaseException | None) -> None:
            if error is not None:
                # The newest complete checkpoint before this step, as the disk has it now (never
                # the step being written, which another process may have written meanwhile).
                previous = checkpoints.earlier_checkpoint(final)
                error = CheckpointError(
                    f"checkpoint at step {step} could not be written to {tmp} "
                    f"({_reason(error)}); the previous checkpoint "
                    f"({previous or 'none'}) is intact{self._fix(error)}")
            try:
                dist_utils.raise_on_any_rank(error, CheckpointError)
            except CheckpointError:
                if rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise

        error: BaseException | None = None
        try:
            checkpoints.check_free_space(self.root, self.expected_bytes, "checkpoint")
            if rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
        except OSError as err:
            error = err
        agree(error)

        agree(self._save_engine(tmp))
        weights = full_fp32_state_dict(self.engine)  # collective under ZeRO 1-3
        run_state = {key: obj.state_dict() for key, obj in self.run_states.items()}
        if self.param_layout is not None:
            run_state[LAYOUT_KEY] = self.param_layout
        run_state[WORLD_KEY] = dist_utils.get_world_size()
        rank_state = {key: obj.state_dict() for key, obj in self.rank_states.items()}
        try:
            checkpoints.save_file(rank_state, tmp / f"rank_{rank:05d}.pt")
            if rank == 0:
                checkpoints.save_file(weights, tmp / "model.pt")
                checkpoints.save_file(run_state, tmp / "trainer_state.pt")
                (tmp / "model_config.json").write_text(json.dumps(self.model_config, indent=2))
                (tmp / "config.yaml").write_text(self.config_yaml)
        except (OSError, RuntimeError) as err:  # torch.save reports a failed write as RuntimeError
            error = err
        agree(error)

        if rank == 0:
            try:
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
                write_text_atomic(self.root / LATEST, name + "\n")
            except OSError as err:
                error = err
        agree(error)
        if rank == 0:
            prune(self.root, self.keep, newest=final)
        dist_utils.barrier()
        return final

    def _save_engine(self, tmp: Path) -> BaseException | None:
        """The engine's own files into ``tmp`` (``engine.save_checkpoint``): the error of a write
        that failed on this rank, for every rank to agree on, or None.

        The torch engine's save is rank 0's write alone (``save_has_collectives`` false), so a
        failed write meets the other ranks in the agreement that follows. DeepSpeed's save holds
        collectives: a barrier and the tag check before its writes, a barrier after them. Its
        writes go through ``engine.checkpoint_engine.save``; one that fails is kept here and the
        save goes on (this rank's later writes are left out), so that this rank still meets the
        others at DeepSpeed's closing barrier. An ``OSError`` raised once this rank's writes began
        (rank 0's copy of DeepSpeed's recovery script) leaves that barrier alone to meet, which
        this rank then does. Anything else, or a DeepSpeed without ``checkpoint_engine``, is
        raised as it is: a rank that fails before DeepSpeed's own collectives cannot tell where
        the others wait."""
        engine = self.engine

        def save() -> None:
            engine.save_checkpoint(str(tmp), tag="engine", save_latest=False)

        if dist_utils.get_world_size() == 1 or not getattr(engine, "save_has_collectives", True):
            try:
                save()
            except (OSError, RuntimeError) as err:  # torch.save: a RuntimeError without errno
                return err
            return None
        writer = getattr(engine, "checkpoint_engine", None)
        write = getattr(writer, "save", None)
        if not callable(write):
            save()
            return None
        failed: list[BaseException] = []
        began: list[str] = []

        def guarded(state_dict, path, *args, **kwargs):
            began.append(str(path))
            if failed:  # this rank's part of the checkpoint is lost already
                return None
            try:
                return write(state_dict, path, *args, **kwargs)
            except (OSError, RuntimeError) as err:
                failed.append(err)
                return None

        own = "save" in getattr(writer, "__dict__", {})  # else the class's method
        writer.save = guarded
        try:
            save()
        except OSError as err:
            if not began:
                raise
            failed.append(err)
            dist_utils.barrier()  # the one DeepSpeed's save ends with, where the others wait
        finally:
            if own:
                writer.save = write
            else:
                del writer.save
        return failed[0] if failed else None

    def _fix(self, error: BaseException) -> str:
        """What to do about a write that failed with ``error``: a full disk is the common case
        (torch.save reports it as a RuntimeError without an errno, hence the free-space check),
        then a read-only file system, a process file-size limit (``ulimit -f``; torch.save's
        error names no errno either) and missing permissions."""
        code = error.errno if isinstance(error, OSError) else None
        full = code in (errno.ENOSPC, errno.EDQUOT)
        if not full and code not in (errno.EROFS, errno.EFBIG, errno.EACCES, errno.EPERM):
            try:
                full = checkpoints.free_bytes(self.root) < self.expected_bytes
            except OSError:
                pass
        again = "then resume with train.resume=latest"
        if full:
            return (f"; the disk holding {self.root} is full: free space there, keep fewer "
                    f"checkpoints (checkpoint.keep={self.keep}), or point output_dir at a "
                    f"larger disk, {again}")
        if code == errno.EROFS:
            return (f"; {self.root} is on a read-only file system: make it writable (remount it "
                    f"read-write) or point output_dir at a writable disk, {again}")
        limit = file_size_limit()
        if code == errno.EFBIG or (code is None and limit is not None
                                   and (not self.expected_bytes or limit < self.expected_bytes)):
            said = f" ({limit / 1e6:.1f} MB)" if limit is not None else ""
            return (f"; a file larger than this process's file-size limit{said} was refused: "
                    "raise the limit (`ulimit -f unlimited` in the shell or job script that "
                    f"starts the run; one checkpoint needs about {self.expected_bytes / 1e9:.2f} "
                    f"GB), {again}")
        if isinstance(error, PermissionError):
            return f"; make {self.root} writable, or point output_dir elsewhere, {again}"
        return ""


def _reason(error: BaseException) -> str:
    """Why a write failed, in one line: an OSError's words and file without the ``[Errno N]``
    prefix, anything else with its type."""
    if isinstance(error, OSError) and error.strerror:
        where = f": {error.filename!r}" if error.filename else ""
        return f"{error.strerror}{where}"
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def file_size_limit() -> int | None:
    """This process's file-size limit in bytes (``ulimit -f``, ``RLIMIT_FSIZE``'s soft limit), or
    None when there is none (or the platform has no such limit)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    except (ImportError, AttributeError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY or soft < 0 else int(soft)


UNIVERSAL = "universal"
"""The folder inside a checkpoint that holds its universal form (:func:`universal_checkpoint`)."""


def universal_checkpoint(path: Path, saved_world: int) -> Path:
    """``path/universal``: the checkpoint's DeepSpeed state as a universal checkpoint, which any
    world size loads (collective; ``saved_world`` ranks wrote ``path``, named in errors).

    Rank 0 converts it once (:func:`convert_to_universal`) into ``universal.tmp/``, renamed when
    complete, while the others wait; a later resume reuses it, and a ``.tmp`` left by an
    interrupted conversion is converted anew, never used. Any failure is a CheckpointError on
    every rank."""
    final, tmp = path / UNIVERSAL, path / (UNIVERSAL + ".tmp")
    error: CheckpointError | None = None
    if dist_utils.get_rank() == 0 and not final.is_dir():
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            needed = sum(f.stat().st_size for f in (path / "engine").glob("*.pt"))
            checkpoints.check_free_space(path, needed, "universal checkpoint")
            convert_to_universal(path / "engine", tmp / "engine")
            os.replace(tmp, final)
        except Exception as err:  # noqa: BLE001 - DeepSpeed's converter asserts and raises anything
            shutil.rmtree(tmp, ignore_errors=True)
            first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
            error = CheckpointError(
                f"{path}: its ZeRO state could not be converted into a universal checkpoint for "
                f"another world size ({type(err).__name__}: {first[:300]}); resume with "
                f"{saved_world} ranks (vlcontrast train --nproc {saved_world}), or start a new run "
                f"from its weights (model.pretrained={path})")
    dist_utils.raise_on_any_rank(error, CheckpointError)  # also the barrier the others wait at
    return final


def convert_to_universal(source: Path, target: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` from the engine folder ``source`` into ``target``, in this
    process (no worker pool inside a training rank), its printing and progress bars kept off the
    console. vlcontrast's engine records no tensor- or pipeline-parallel layout for it to read
    (``inject_missing_state``)."""
    import argparse
    import contextlib
    import io

    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(source), output_folder=str(target),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                              strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal.main(args)


def loads_universal(engine) -> bool:
    """Whether ``engine`` was built to load universal checkpoints (DeepSpeed's
    ``checkpoint.load_universal``)."""
    check = getattr(engine, "load_universal_checkpoint", None)
    return bool(check()) if callable(check) else False


def _restore_group_settings(engine, optimizer_state: Path) -> None:
    """Give each optimizer group the settings it was saved with (weight decay, learning rate).
    DeepSpeed 0.19's ZeRO-3 universal load gives every group the first group's, which would
    drop the weight decay of the decayed group; stages 1 and 2 restore them as saved already."""
    saved = checkpoints.load_engine_file(optimizer_state).get("param_groups") or []
    groups = engine.optimizer.param_groups
    if len(saved) != len(groups):
        raise CheckpointError(f"{optimizer_state}: {len(saved)} optimizer groups saved, "
                              f"{len(groups)} now; resume with the config that wrote it")
    for group, settings in zip(groups, saved):
        group.update({key: value for key, value in settings.items() if key != "params"})


LAYOUT_KEY = "param_layout"
WORLD_KEY = "world_size"
"""How many ranks wrote the checkpoint (older ones: counted from their ``rank_*.pt`` files)."""


def _first_difference(saved: list[list[str]], current: list[list[str]]) -> str:
    if len(saved) != len(current):
        return f"{len(saved)} optimizer groups saved, {len(current)} now"
    for index, (old, new) in enumerate(zip(saved, current)):
        for position, (a, b) in enumerate(zip(old, new)):
            if a != b:
                return f"group {index}, position {position}: {a!r} saved, {b!r} now"
        if len(old) != len(new):
            return f"group {index}: {len(old)} parameters saved, {len(new)} now"
    return "same names"


def _load_states(objects: dict[str, Stateful], saved: dict[str, Any], path: Path) -> None:
    missing = sorted(set(objects) - set(saved))
    if missing:
        raise CheckpointError(f"{path}: has no state for {missing} (it holds {sorted(saved)}); "
                              "was it written by this version of vlcontrast?")
    for key, obj in objects.items():
        try:
            obj.load_state_dict(saved[key])
        except (RuntimeError, KeyError, ValueError, TypeError) as err:
            first = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
            first = (first or type(err).__name__)[:300]
            raise CheckpointError(
                f"{path}: its {key!r} state does not fit this run's ({type(obj).__name__}: "
                f"{first}); resume with the config that wrote it (config.yaml beside it), or "
                "start a new run from its weights (model.pretrained=CHECKPOINT_DIR)") from err


def prune(root: Path, keep: int, newest: Path | None = None) -> None:
    """Keep the ``keep`` newest checkpoints up to ``newest`` (the one just written), which is
    always kept; folders of later steps (a history this run resumed before) are left alone."""
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
                  and (newest is None or p.name <= newest.name))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob("step_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# one writer per run folder


LOCK_FILE = ".train.lock"
"""The file in the run folder that the process writing the run (rank 0) holds an ``flock`` on,
and that names it (pid, host, start) for a second ``vlcontrast train`` refused there."""

_LOCKS_UNSUPPORTED_SAID = False


class RunLock:
    """An exclusive ``flock`` on ``RUN/.train.lock``, held from the start of ``train()`` to its
    end. The operating system releases it when the process dies (a crash, SIGKILL, a SLURM
    requeue), so no stale lock outlives its holder; :meth:`release` also removes the file."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    def release(self) -> None:
        """Remove the file (only while it is still the one this lock holds) and let go of the
        lock. Idempotent and quiet: a second call, as a failed start's clean-up makes, does
        nothing, and a close that fails (a network file system's EIO) is not raised over the
        error that ended the run. The descriptor is forgotten before it is closed, so no later
        call can act on the number once the system has handed it to another file (the next
        holder's lock, in a process that trains more than once)."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            if _same_file(fd, self.path):  # while still held: nobody else's file goes
                self.path.unlink()
        except OSError:
            pass
        try:
            os.close(fd)
        except OSError:
            pass  # Linux frees the descriptor (and the lock) whatever close reports


def _same_file(fd: int, path: Path) -> bool:
    try:
        held, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)


def lock_run_folder(output_dir: str | Path) -> RunLock | None:
    """Lock the run folder ``output_dir`` for this process (it is created when missing), or a
    one-line :class:`~vlcontrast.errors.ConfigError` naming the process that holds it (pid, host)
    and the fix. Two processes writing one run delete each other's checkpoints in progress and
    mix their metrics. None, with a warning once per process, where the file system has no
    locks; None too where the folder cannot be written (the preflight names why)."""
    import errno
    import fcntl
    import json
    import logging
    import socket
    import time

    from vlcontrast.errors import ConfigError

    global _LOCKS_UNSUPPORTED_SAID
    folder = Path(output_dir)
    path = folder / LOCK_FILE
    for _ in range(20):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                holder = _holder(fd)
                os.close(fd)
                raise ConfigError(f"output_dir={str(output_dir)!r} is in use by another "
                                  f"`vlcontrast train` ({holder}; it holds {path}); wait for it "
                                  "to end (or stop it), or give another output_dir") from None
            os.close(fd)
            if not _LOCKS_UNSUPPORTED_SAID:
                _LOCKS_UNSUPPORTED_SAID = True
                logging.getLogger(__name__).warning(
                    "output_dir=%r: its file system does not support file locks (%s), so a second "
                    "`vlcontrast train` on this folder would not be refused; run one at a time",
                    str(output_dir), err.strerror or err)
            return None
        # Its last holder may have removed the file between our open and our lock (and another
        # process made it anew): a lock on a removed file guards nothing, so take the one there.
        if not _same_file(fd, path):
            os.close(fd)
            continue
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        except OSError:
            pass  # the lock holds without the words
        return RunLock(path, fd)
    return None


def _holder(fd: int) -> str:
    """``pid 123 on host gpu-07, since 2026-11-28 14:05:00``: what the lock file says of its
    holder (which writes it right after taking the lock)."""
    import json

    try:
        said = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {said['pid']} on host {said['host']}, since {said['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not said which yet"
