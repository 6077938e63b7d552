"""ZeRO 0 without DeepSpeed's wrapper: the step a plain PyTorch loop takes, behind the engine's face.

At ZeRO 0 with fp32 parameters (``train.precision`` fp32 or amp_bf16) DeepSpeed adds nothing the
step needs and costs the host time a small per-GPU batch cannot hide. Per optimizer step its
engine: all-reduces the gradients after the backward has finished, flattened into buckets and
copied back (no overlap with the backward); clips with a norm that it all-reduces once more and
with two scalars built on the host (``torch.tensor([max_norm], device=...)``: a blocking
pageable copy each on CUDA); zeroes every gradient with one kernel per parameter; and runs its
timers, hooks and checks around each call. :class:`TorchEngine` does the same arithmetic as a plain
step: autocast forward, backward through ``DistributedDataParallel`` (bucketed all-reduce
overlapped with the backward; none on one rank), clipping and the overflow check from one
``_foreach_norm`` on the device, torch's fused AdamW, gradients set to None.

It answers the calls the loop makes of DeepSpeed's engine (``engine(images, texts)``,
``backward``, ``step``, ``module``, ``optimizer``, ``lr_scheduler``, ``get_lr``,
``get_global_grad_norm``, ``save_checkpoint``/``load_checkpoint``, ``compile``) with the same
meaning, and writes and reads DeepSpeed's ZeRO-0 checkpoint file (``engine/mp_rank_00_model_states.pt``
with the same keys): a run resumes under either engine. ``train.engine`` picks it (``auto``: here
whenever it applies); docs/training.md, "The step at ZeRO 0".
"""

from __future__ import annotations

import contextlib
import errno
import warnings
from pathlib import Path
from typing import Any

import torch

from vlcontrast.errors import CheckpointError, ConfigError

MODEL_STATES = "mp_rank_00_model_states.pt"
"""DeepSpeed's ZeRO-0 checkpoint file (model, optimizer, schedule and counters), one per run."""


class TorchEngine:
    """The ZeRO-0 step without DeepSpeed (see the module docstring).

    ``module``: the model, already on its device; ``optimizer``: a
    :class:`~vlcontrast.train.optimizer.FiniteCheckedAdamW` (the overflow check and the skip stay
    on the device); ``scheduler``: its per-step schedule; ``accum_steps``: micro-batches per
    optimizer step (each backward is divided by it, as DeepSpeed does); ``grad_clip``: the
    gradients' global norm limit (0: none); ``autocast``: run the forward under bf16 autocast.
    """

    save_has_collectives = False
    """:meth:`save_checkpoint` is rank 0's file write alone: a rank whose write failed meets the
    others in the checkpointer's agreement (DeepSpeed's save holds barriers of its own)."""

    reduces_last_micro_batch = True
    """Only the boundary micro-batch's backward reduces (DDP): GradCache puts the gradients of
    parameters outside the towers' forward (temperature, bias, projection) on that pass."""

    def __init__(self, module: torch.nn.Module, optimizer, scheduler, *, accum_steps: int,
                 grad_clip: float, autocast: bool, micro_batch_size: int, world_size: int):
        self.module = module
        self.optimizer = optimizer
        self.basic_optimizer = optimizer  # DeepSpeed's name for the client optimizer
        self.lr_scheduler = scheduler
        self.accum_steps = accum_steps
        self.grad_clip = grad_clip
        self.world_size = world_size
        self.train_batch_size = micro_batch_size * accum_steps * world_size
        self.device = next(module.parameters()).device
        self._autocast = autocast
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._grad_norm: torch.Tensor | None = None
        self.cudagraphs = False
        """The compiled forward and backward replay as CUDA graphs (``train.compile_mode``)."""
        self._ddp = None
        self._forward = module
        self._reached: set[int] = set()
        self._probes: list = []
        self._temperature: list[torch.nn.Parameter] = []
        """Trainable ``logit_scale``/``logit_bias`` under DDP: a loss may leave them out (SogCLR,
        FastCLIP and balanced keep their own temperature; InfoNCE has no use for a bias), and DDP
        cannot reduce a parameter the backward gave no gradient, so each backward gives them an
        exact zero one (AdamW moves a parameter with zero gradient, moments and no weight decay
        by exactly nothing, as DeepSpeed's engine leaves one without a gradient)."""
        if world_size > 1:
            self._temperature = [p for name, p in module.named_parameters()
                                 if p.requires_grad and name in ("logit_scale", "logit_bias")]
            # Which parameters the first update's backward reached: DDP gives each one a
            # gradient (a view into its bucket) whether or not the backward did.
            for param in module.parameters():
                if param.requires_grad:
                    self._probes.append(param.register_post_accumulate_grad_hook(
                        lambda p: self._reached.add(id(p))))
            from torch.nn.parallel import DistributedDataParallel

            # Buffers (batch-norm statistics) stay each rank's own, as under DeepSpeed; gradients
            # are views into DDP's buckets (no copy before the optimizer reads them).
            device_ids = None
            if self.device.type == "cuda":  # this rank's one GPU ("cuda" alone: the current one)
                device_ids = [self.device.index if self.device.index is not None
                              else torch.cuda.current_device()]
            with warnings.catch_warnings():
                # torch 2.14 deprecates broadcast_buffers and itself says to keep it for buffers
                # that must not be synchronised at start (its successor still syncs them there).
                warnings.filterwarnings("ignore", message=".*broadcast_buffers.*")
                self._ddp = DistributedDataParallel(module, device_ids=device_ids,
                                                    broadcast_buffers=False,
                                                    gradient_as_bucket_view=True)
            self._forward = self._ddp

    # -- the step ------------------------------------------------------------------------------

    def is_gradient_accumulation_boundary(self) -> bool:
        """The next :meth:`step` applies the update (DeepSpeed's rule)."""
        return (self.micro_steps + 1) % self.accum_steps == 0

    def __call__(self, *inputs, **kwargs):
        if self._ddp is not None:
            # Micro-batches before the boundary accumulate locally; the last one's backward
            # reduces the sum (what DDP's no_sync() sets, without a context spanning two calls).
            self._ddp.require_backward_grad_sync = self.is_gradient_accumulation_boundary()
        context = (torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
                   if self._autocast else contextlib.nullcontext())
        with context:
            return self._forward(*inputs, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss`` divided by ``accum_steps`` (DeepSpeed's scaling, which the
        GradCache surrogate expects)."""
        if self._temperature:
            loss = loss + sum(p.sum() for p in self._temperature) * 0.0
        (loss / self.accum_steps if self.accum_steps > 1 else loss).backward()

    def step(self) -> None:
        """Count a micro-batch; at the boundary clip, update (skipped on the device when a
        gradient is non-finite), advance the schedule and drop the gradients."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        params = [p for group in self.optimizer.param_groups for p in group["params"]
                  if p.grad is not None]
        if self._probes:
            self._check_every_parameter_has_a_gradient()
        norm = None
        if params:
            # One pass over the gradients gives the clip and the overflow check.
            norm = torch.linalg.vector_norm(torch.stack(
                torch._foreach_norm([p.grad for p in params])).float())
            if self.grad_clip > 0:
                coefficient = (self.grad_clip / (norm + 1e-6)).clamp(max=1.0)
                torch._foreach_mul_([p.grad for p in params], coefficient)
        self._grad_norm = norm
        self.optimizer.step(grad_norm=norm)
        # With DDP's bucket views the gradients are zeroed in place (one foreach kernel);
        # alone, dropped as a plain loop drops them.
        self.optimizer.zero_grad(set_to_none=self._ddp is None)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1
        self.global_samples += self.train_batch_size

    def _check_every_parameter_has_a_gradient(self) -> None:
        """DDP reduces only parameters whose gradient the backward produced; one that got none
        would stall the next step's reduction on every rank. Checked once, at the first update."""
        for probe in self._probes:
            probe.remove()
        self._probes = []
        missing = [name for name, p in self.module.named_parameters()
                   if p.requires_grad and id(p) not in self._reached]
        if missing:
            raise ConfigError(
                f"train.engine=torch: parameters {missing[:3]} got no gradient in the first step, "
                "which DistributedDataParallel cannot reduce; lock their tower (model.lock_image "
                "or model.lock_text), or use train.engine=deepspeed")

    def was_step_applied(self) -> bool:
        """Always True on the host: the skip is decided on the device (``optimizer.found_inf``)."""
        return True

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> torch.Tensor | None:
        """The last update's gradient norm before clipping (a device tensor; read at log steps)."""
        return self._grad_norm

    # -- mode, compile, teardown ---------------------------------------------------------------

    def train(self, mode: bool = True) -> "TorchEngine":
        self.module.train(mode)
        return self

    def eval(self) -> "TorchEngine":
        return self.train(False)

    def compile(self, compile_kwargs: dict[str, Any] | None = None) -> None:
        """torch.compile what runs the forward, in place (DDP's wrapper when there is one, so
        the compiler splits the graph at its buckets); parameter names stay the eager model's.
        ``compile_kwargs``: ``torch.compile``'s (DeepSpeed's ``engine.compile`` signature)."""
        self._forward.compile(**(compile_kwargs or {}))

    def destroy(self) -> None:
        self._ddp = None
        self._forward = self.module

    # -- checkpoints (DeepSpeed's ZeRO-0 file) -------------------------------------------------

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool = False) -> None:
        """Rank 0 writes ``save_dir/tag/mp_rank_00_model_states.pt`` with DeepSpeed's keys."""
        from vlcontrast import distributed as dist_utils

        if not dist_utils.is_main_process():
            return
        import deepspeed

        folder = Path(save_dir) / tag
        folder.mkdir(parents=True, exist_ok=True)
        state = {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "lr_scheduler": (self.lr_scheduler.state_dict()
                                  if self.lr_scheduler is not None else None),
                 "skipped_steps": self.skipped_steps, "global_steps": self.global_steps,
                 "global_samples": self.global_samples, "dp_world_size": self.world_size,
                 "mp_world_size": 1, "ds_version": deepspeed.__version__,
                 "param_shapes": None, "buffer_names": [n for n, _ in self.module.named_buffers()]}
        torch.save(state, folder / MODEL_STATES)

    def load_checkpoint(self, load_dir: str, tag: str, load_module_strict: bool = True):
        """Read a ZeRO-0 file written by this engine or by DeepSpeed's (the caller has checked
        its pickles, :func:`vlcontrast.checkpoints.check_engine_files`)."""
        path = Path(load_dir) / tag / MODEL_STATES
        if not path.is_file():  # the checkpoint's format was checked with its config.yaml
            raise FileNotFoundError(errno.ENOENT, "missing", str(path))
        # Tensors, plain containers and DeepSpeed's few classes only (weights_only=True, as the
        # scan before this allows); a damaged or refused file is one line naming it and the fix.
        from vlcontrast.checkpoints import load_engine_file

        state: dict[str, Any] = load_engine_file(path, map_location=self.device, mmap=False)
        if state.get("optimizer") is None:
            # ZeRO 1-3 keep the optimizer in per-rank partition files, not in this one.
            raise CheckpointError(f"{path}: its optimizer state is not in this file (it was "
                                  "written under ZeRO 1-3, which partition it); resume with the "
                                  "deepspeed.zero_stage that wrote it")
        self.module.load_state_dict(state["module"], strict=load_module_strict)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.global_steps = int(state.get("global_steps", 0))
        self.global_samples = int(state.get("global_samples", 0))
        self.micro_steps = self.global_steps * self.accum_steps
        return str(path.parent), {}
