"""TrainBatches with a DeviceFeed: the next step prepared on a side stream, synced correctly, and a
position that still resumes exactly.

torch.cuda is replaced by a recorder (streams, ``wait_stream``, the stream context) and
``Tensor.record_stream`` is patched, so the call order a GPU would see is checked on the CPU.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.data.helpers import make_shards
from vlcontrast.config import DataConfig
from vlcontrast.data.loader import build_train_loader
from vlcontrast.train.batches import DeviceFeed, SeededTransform, TrainBatches


class FakeStream:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other: "FakeStream") -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def __repr__(self) -> str:
        return self.name


class FakeCuda:
    """The parts of torch.cuda a DeviceFeed uses, recording each call."""

    def __init__(self):
        self.log: list = []
        self.compute = FakeStream("compute", self.log)
        self.active = self.compute

    def Stream(self, device=None):  # noqa: N802 - torch.cuda's name
        self.log.append(("new_stream", str(device)))
        return FakeStream("side", self.log)

    def current_stream(self, device=None):
        return self.active

    @contextlib.contextmanager
    def stream(self, stream):
        self.log.append(("enter", stream.name))
        previous, self.active = self.active, stream
        try:
            yield
        finally:
            self.active = previous
            self.log.append(("exit", stream.name))


class RecordingTransform:
    """A per-batch transform that notes the stream it was enqueued on."""

    def __init__(self, cuda: FakeCuda):
        self.cuda = cuda

    def __call__(self, images, device, dtype):
        self.cuda.log.append(("transform", self.cuda.active.name))
        return images.to(torch.float32).div(255).to(dtype)


@pytest.fixture
def recorded(monkeypatch):
    cuda = FakeCuda()

    def record_stream(tensor, stream):
        cuda.log.append(("record_stream", stream.name, tuple(tensor.shape)))

    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    return cuda


def _feed(cuda: FakeCuda) -> DeviceFeed:
    feed = DeviceFeed("cpu", torch.float32, RecordingTransform(cuda), cuda=cuda)
    # A CPU device has no side stream; the fake one stands for a CUDA device's.
    feed.stream = cuda.Stream(device="cuda:0")
    return feed


def _loader(pattern: str, batch_size: int = 4, workers: int = 0):
    from torchvision.transforms import PILToTensor

    def build(resume_state=None):
        cfg = DataConfig(train=pattern, batch_size=batch_size, workers=workers, shuffle_buffer=8)
        return build_train_loader(cfg, SeededTransform(PILToTensor(), 3, random=False),
                                  lambda texts: torch.zeros(len(texts), 4, dtype=torch.long),
                                  seed=3, rank=0, world_size=1, resume_state=resume_state,
                                  device="cpu")
    return build


@pytest.fixture(scope="module")
def pattern(tmp_path_factory):
    directory = tmp_path_factory.mktemp("feed")
    make_shards(directory, [12, 12])
    return str(directory / "{00000..00001}.tar")


def test_next_step_hands_over_after_the_side_stream_and_prefetch_prepares_the_next(
        pattern, recorded):
    batches = TrainBatches(_loader(pattern), SeededTransform(None, 3, random=False), 2,
                           feed=_feed(recorded))
    recorded.log.clear()
    first = batches.next_step()
    log = recorded.log
    # Step 1 is prepared on the side stream, without waiting for the compute stream (the step
    # just launched would hold its copies back), then the compute stream waits for it and
    # records its use of every tensor.
    prepare = [("enter", "side"), ("transform", "side"), ("transform", "side"), ("exit", "side")]
    assert log[:4] == prepare
    assert log[4] == ("wait_stream", "compute", "side")
    records = log[5:]
    assert [r[0] for r in records] == ["record_stream"] * 6
    assert {r[1] for r in records} == {"compute"}
    assert all(b.images.dtype == torch.float32 for b in first)

    # Once step 1 is launched, the loop asks for step 2: enqueued on the side stream, it runs
    # while step 1 computes. Asking again changes nothing.
    log.clear()
    batches.prefetch()
    batches.prefetch()
    assert log == prepare
    log.clear()
    batches.next_step()  # hands over what prefetch prepared, prepares nothing
    assert log[0] == ("wait_stream", "compute", "side")
    assert not [entry for entry in log if entry[0] == "transform"]


def test_the_loop_prefetches_after_launching_the_step_and_not_after_the_last(monkeypatch,
                                                                            tmp_path):
    """The next batches' host work and nvJPEG's wait come after the step's kernels are queued,
    not before (where they would delay the launch), and the last step prefetches nothing."""
    from tests.data.helpers import make_shards
    from tests.train.helpers import tiny_config
    from vlcontrast.train import loop, train

    order = []
    real_step, real_prefetch = loop.train_step, TrainBatches.prefetch

    def step(*args, **kwargs):
        order.append("train_step")
        return real_step(*args, **kwargs)

    def prefetch(self):
        order.append("prefetch")
        return real_prefetch(self)

    monkeypatch.setattr(loop, "train_step", step)
    monkeypatch.setattr(TrainBatches, "prefetch", prefetch)
    make_shards(tmp_path / "data" / "train", [16])
    config = tiny_config(tmp_path / "data", tmp_path / "run", train__steps=3, checkpoint__every=0)
    train(config)
    assert order == ["train_step", "prefetch"] * 2 + ["train_step"]


def test_prefetching_reports_the_position_of_the_batches_handed_out(pattern, recorded):
    plain = TrainBatches(_loader(pattern), SeededTransform(None, 3, random=False), 1)
    fed = TrainBatches(_loader(pattern), SeededTransform(None, 3, random=False), 1,
                       feed=_feed(recorded))
    for step in range(5):  # crosses the epoch boundary (24 samples, batch 4: 6 steps)
        ours, theirs = fed.next_step(), plain.next_step()
        if step % 2:
            fed.prefetch()  # the next batch taken from the loader: still not handed out
        assert torch.equal(ours[0].sample_ids, theirs[0].sample_ids)
        assert torch.equal(ours[0].images, theirs[0].images.to(torch.float32) / 255)
        assert fed.state_dict() == plain.state_dict()
        assert fed.epoch == plain.epoch
    # A run resumed from the prefetching run's state continues with the batch it had prepared.
    state = fed.state_dict()
    upcoming = fed.next_step()[0].sample_ids
    resumed = TrainBatches(_loader(pattern), SeededTransform(None, 3, random=False), 1)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.next_step()[0].sample_ids, upcoming)


def test_a_cpu_device_moves_without_streams():
    feed = DeviceFeed("cpu", torch.bfloat16)
    assert feed.stream is None
    from vlcontrast.data.loader import Batch

    batch = Batch(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.zeros(2, 5, dtype=torch.long),
                  torch.arange(2))
    ready = feed.hand_over(feed.prepare([batch]))
    assert ready[0].images.dtype == torch.bfloat16


@pytest.mark.cuda
def test_a_real_side_stream_gives_the_values_of_a_plain_move():
    from vlcontrast.data.loader import Batch
    from vlcontrast.data.transforms import BatchNormalizer

    normalizer = BatchNormalizer((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))
    feed = DeviceFeed("cuda", torch.bfloat16, normalizer)
    assert feed.stream is not None
    host = [Batch(torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8).pin_memory(),
                  torch.randint(0, 100, (8, 5)).pin_memory(), torch.arange(8).pin_memory())
            for _ in range(3)]
    ahead = feed.prepare(host[:1])
    for k in range(3):
        ready = feed.hand_over(ahead)
        if k + 1 < 3:
            ahead = feed.prepare(host[k + 1:k + 2])
        expected = normalizer(host[k].images, "cuda", torch.bfloat16)
        assert torch.equal(ready[0].images, expected)
        assert torch.equal(ready[0].texts.cpu(), host[k].texts)
        assert ready[0].images.device.type == "cuda"


def test_fallback_counts_join_the_workers_and_the_training_process(recorded):
    from vlcontrast.data.loader import Batch

    class Loader:
        epoch, steps_per_epoch, id_space = 0, 2, 0

        def __iter__(self):
            for _ in range(self.steps_per_epoch):
                yield Batch(torch.zeros(2, 3, 4, 4, dtype=torch.uint8),
                            torch.zeros(2, 5, dtype=torch.long), torch.arange(2))

        def set_epoch(self, epoch):
            self.epoch = epoch

        def mark(self):
            return {"bad_samples": {"empty_caption": 1}, "fallback_samples": {"not_jpeg": 3}}

    feed = _feed(recorded)
    feed.transform.fallbacks = {"gpu_decode_failed": 2, "not_jpeg": 1}
    batches = TrainBatches(lambda resume_state=None: Loader(),
                           SeededTransform(None, 3, random=False), 1, feed=feed)
    batches.next_step()
    assert batches.fallback_samples == {"not_jpeg": 4, "gpu_decode_failed": 2}
    assert batches.bad_samples == {"empty_caption": 1}
