"""Device, dtype and host-sync discipline of the losses (what a CPU can say about a GPU run).

A loss run on the ``meta`` device under a dispatch mode that sees every ATen call (backward
included) must create and touch no tensor on any other device: a tensor made without ``device=``
lands on the CPU, which on a GPU is a crash (``cpu += cuda``) or a hidden copy. Meta tensors have
no data, so the same run also proves that the host never reads a value. DeCL's step is checked
again on the CPU by counting the calls that make the host wait for the device.

On the meta device BCL takes its accelerator path (ranks by ``searchsorted``, no tie search by
``nonzero``), which is checked against the CPU path below.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tests.losses import references
from vlcontrast.losses import LOSSES, build_loss

# Calls after which the host has a device value in hand (a sync on a GPU).
HOST_READS = {"aten._local_scalar_dense.default", "aten.nonzero.default",
              "aten._unique2.default", "aten.unique_dim.default", "aten.masked_select.default",
              "aten.unique_consecutive.default", "aten.equal.default", "aten.is_nonzero.default"}


class DeviceAudit(TorchDispatchMode):
    """Records every ATen call that touches a tensor off ``device``, and every host read."""

    def __init__(self, device: str):
        super().__init__()
        self.device = device
        self.off_device: list[tuple[str, str]] = []
        self.host_reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name in HOST_READS:
            self.host_reads.append(name)
        if name.startswith("aten.index") or name.startswith("aten.index_put"):
            indices = args[1] if len(args) > 1 else []
            if any(torch.is_tensor(i) and i.dtype == torch.bool for i in indices or []):
                self.host_reads.append(f"{name} with a boolean mask")
        out = func(*args, **kwargs)
        for value in tree_flatten((args, kwargs, out))[0]:
            if torch.is_tensor(value) and value.device.type != self.device:
                self.off_device.append((name, str(value.device)))
        return out


def loss_options(name):
    return {"id_space": 64} if name in ("decl", "sogclr", "fastclip") else {}


META_CASES = [(name, chunk) for name in sorted(LOSSES) for chunk in (0, 3)]
# (DeCL's u_mode=sample draws from a generator on the features' device; meta has none, so that
# variant is checked on the CPU below.)
META_CASES += [("decl-momentum", 3), ("decl-batch", 0)]


def build_case(label, chunk):
    name, _, variant = label.partition("-")
    options = loss_options(name)
    if variant == "sample":
        options["u_mode"] = "sample"
    elif variant in ("momentum", "batch"):
        options = {"estimator": variant}
    return build_loss(name, chunk_size=chunk, **options)


def run_loss(loss_fn, device, dtype=torch.float32, batch=8, dim=4, step=1):
    image = torch.randn(batch, dim, device=device, dtype=dtype, requires_grad=True)
    text = torch.randn(batch, dim, device=device, dtype=dtype, requires_grad=True)
    scale = torch.tensor(10.0, device=device, requires_grad=True)
    bias = torch.tensor(-2.0, device=device, requires_grad=True)
    momentum = (torch.randn(batch, dim, device=device, dtype=dtype),
                torch.randn(batch, dim, device=device, dtype=dtype))
    out = loss_fn(image, text, scale, logit_bias=bias if loss_fn.uses_logit_bias else None,
                  sample_ids=torch.arange(batch, device=device), step=step,
                  momentum_features=momentum)
    out["loss"].backward()
    return out, image, text, scale


@pytest.mark.parametrize("label, chunk", META_CASES)
def test_no_tensor_off_the_features_device(label, chunk):
    loss_fn = build_case(label, chunk).to("meta")
    audit = DeviceAudit("meta")
    with audit:
        out, image, text, scale = run_loss(loss_fn, "meta")
    assert audit.off_device == [], audit.off_device[:5]
    assert audit.host_reads == []
    assert image.grad is not None and image.grad.device.type == "meta"
    # Balanced scales by its own alpha; SogCLR and FastCLIP (fixed) do not train the temperature.
    if label not in ("balanced", "sogclr", "fastclip"):
        assert scale.grad is not None and scale.grad.device.type == "meta"


def test_the_audit_sees_a_cpu_accumulator_in_backward():
    """The defect this guards against: a float64 accumulator made on the CPU in backward."""

    class CpuAccumulator(torch.autograd.Function):
        @staticmethod
        def forward(ctx, value):
            return value * 2

        @staticmethod
        def backward(ctx, grad):
            total = torch.zeros((), dtype=torch.float64)  # no device=: the bug
            total += grad.double().sum()
            return grad * 2

    value = torch.ones(3, device="meta", requires_grad=True)
    audit = DeviceAudit("meta")
    with audit:
        CpuAccumulator.apply(value).sum().backward()
    assert any(device == "cpu" for _, device in audit.off_device)


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("chunk", [0, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_dtypes_of_loss_and_gradients(name, chunk, dtype):
    loss_fn = build_loss(name, chunk_size=chunk, **loss_options(name))
    out, image, text, scale = run_loss(loss_fn, "cpu", dtype=dtype)
    # Row reductions run in at least float32; gradients come back in the features' dtype.
    expected = torch.float64 if dtype == torch.float64 else torch.float32
    assert out["loss"].dtype == expected
    assert image.grad.dtype == dtype and text.grad.dtype == dtype
    assert torch.isfinite(image.grad.float()).all()
    # Balanced scales by its own alpha; SogCLR and FastCLIP (fixed) do not train the temperature.
    if name not in ("balanced", "sogclr", "fastclip"):
        assert scale.grad.dtype == scale.dtype == torch.float32
        assert torch.isfinite(scale.grad)


class HostReadCounter(torch.overrides.TorchFunctionMode):
    """Counts the Python-level calls that turn a tensor into a host value."""

    NAMES = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu",
             "unique", "unique_consecutive", "nonzero", "masked_select"}

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.NAMES:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


DECL_VARIANTS = [
    {"gamma": 0.7},
    {"gamma": 0.7, "chunk_size": 3},
    {"u_mode": "sample", "schedule": "weighted"},
    {"shard_buffer": True},
    {"estimator": "momentum"},
    {"estimator": "batch", "u_mode": "sample"},
]


@pytest.mark.parametrize("options", DECL_VARIANTS)
def test_decl_step_reads_nothing_back_to_the_host(options):
    options = dict(options)
    chunk = options.pop("chunk_size", 0)
    loss_fn = build_loss("decl", chunk_size=chunk, id_space=32, **options)
    image, text = references.random_pairs(8, 6, seed=3)
    image, text = image.float(), text.float()
    ids = torch.tensor([3, 9, 3, 20, 21, 22, 23, 31])  # a repeated id: the dedup path
    counter, audit = HostReadCounter(), DeviceAudit("cpu")
    for step in (1, 2):
        with counter, audit:
            out = loss_fn(image.requires_grad_(), text.requires_grad_(), torch.tensor(12.0),
                          sample_ids=ids, step=step, momentum_features=(image.detach(),
                                                                        text.detach()))
            out["loss"].backward()
            loss_fn.rollback() if step == 2 else None
    assert counter.calls == []
    assert audit.host_reads == []
    if loss_fn.needs_sample_ids:  # the diagnostic stays a tensor until someone logs it
        assert torch.is_tensor(out["buffer_coverage"])
        assert float(out["buffer_coverage"]) == pytest.approx(7 / 32)


def test_the_counter_sees_the_old_host_reads():
    """``unique``, ``int()`` and boolean masks, as the DeCL step used to do, are all counted."""
    counter, audit = HostReadCounter(), DeviceAudit("cpu")
    ids = torch.tensor([1, 2, 2])
    with counter, audit:
        unique = torch.unique(ids)
        int((ids > 1).sum())
        ids[ids > 1]
    assert {"unique", "__int__"} <= set(counter.calls)
    assert "aten._local_scalar_dense.default" in audit.host_reads
    assert any("boolean mask" in read for read in audit.host_reads) and unique.numel() == 2


@pytest.mark.parametrize("options", [{}, {"alpha": 0.7, "beta": 0.6, "tau_plus": 0.2}])
def test_bcl_accelerator_path_equals_the_cpu_path_with_ties(options):
    loss = build_loss("bcl", **options)
    torch.manual_seed(0)
    values = torch.randn(7, 40).round(decimals=1)  # many ties
    values[2, :] = 0.5  # a row that is one tie run
    positives = torch.arange(7) * 3
    values[torch.arange(7), positives] = -math.inf
    expected = torch.zeros_like(values)
    loss.add_log_weights_(expected, values, 39)
    table = loss._table(39, values)
    device_path = torch.zeros_like(values)
    loss._add_log_weights_on_device_(device_path, values, table)
    negatives = torch.ones_like(values, dtype=torch.bool)
    negatives[torch.arange(7), positives] = False
    torch.testing.assert_close(device_path[negatives], expected[negatives], rtol=0, atol=0)


@pytest.mark.parametrize("chunk", [0, 3])
def test_bcl_loss_on_the_accelerator_path_equals_the_cpu_path(chunk, monkeypatch):
    from vlcontrast.losses import bcl as bcl_module

    image, text = references.random_pairs(10, 6, seed=12)

    def run():
        i, t = image.clone().requires_grad_(), text.clone().requires_grad_()
        s = torch.tensor(14.29, dtype=torch.float64, requires_grad=True)
        loss = build_loss("bcl", chunk_size=chunk, alpha=0.7)(i, t, s)["loss"]
        return (loss.detach(), *torch.autograd.grad(loss, (i, t, s)))

    expected = run()
    monkeypatch.setattr(bcl_module, "_sync_free_ranks", lambda values: True)
    for got, want in zip(run(), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
