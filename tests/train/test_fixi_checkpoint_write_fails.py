"""A checkpoint write that fails inside the engine's save on one rank of two ends as the one-line
checkpoint error on every rank (no traceback, no rank left waiting), with the fix, and leaves the
previous checkpoint as ``latest``: the torch engine (rank 0 writes its file alone) and DeepSpeed
ZeRO-2 (whose save holds barriers of its own), each rank's write refused by a file-size limit
(``RLIMIT_FSIZE``, what ``ulimit -f`` sets) or rank 0's copy of DeepSpeed's recovery script
refused by a full disk. Two gloo ranks, ``train.dist_timeout_s=60``: a rank left waiting would
fail with a timeout instead of the checkpoint error."""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.train.helpers import latest_step

LIMIT = 1 << 20
"""Below every engine file of vlc-micro (its fp32 weights alone are about 4 MB), above the small
files a rank writes besides."""

CASES = {
    "torch_rank0": ({"train__engine": "torch"}, 0, "limit"),
    "zero2_rank1": ({"train__engine": "deepspeed", "deepspeed__zero_stage": 2}, 1, "limit"),
    "zero2_rank0": ({"train__engine": "deepspeed", "deepspeed__zero_stage": 2}, 0, "limit"),
    "zero2_script": ({"train__engine": "deepspeed", "deepspeed__zero_stage": 2}, 0, "script"),
}


def _train_with_a_failing_save(rank, world_size, data_dir, run, extra, failing_rank, how):
    import errno
    import resource

    from vlcontrast.errors import CheckpointError
    from vlcontrast.train import train
    from vlcontrast.train.checkpoint import Checkpointer
    from tests.train.helpers import tiny_config

    save = Checkpointer.save
    patched = []

    def failing_save(self, step):
        if step == 4 and rank == failing_rank:
            if how == "limit":
                resource.setrlimit(resource.RLIMIT_FSIZE,
                                   (LIMIT, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            else:  # DeepSpeed's copy of zero_to_fp32.py, after its own files
                from deepspeed.runtime.engine import DeepSpeedEngine

                def no_room(engine, save_path):
                    raise OSError(errno.ENOSPC, "No space left on device",
                                  f"{save_path}/zero_to_fp32.py")

                patched.append(DeepSpeedEngine._copy_recovery_script)
                DeepSpeedEngine._copy_recovery_script = no_room
        return save(self, step)

    Checkpointer.save = failing_save
    try:
        train(tiny_config(data_dir, run, train__steps=4, checkpoint__every=2,
                          train__dist_timeout_s=60, **extra))
        return None
    except CheckpointError as error:
        return str(error)
    finally:
        Checkpointer.save = save
        if patched:
            from deepspeed.runtime.engine import DeepSpeedEngine

            DeepSpeedEngine._copy_recovery_script = patched[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_write_failing_inside_the_engine_s_save_on_one_rank_is_one_line_on_every_rank(
        tiny_data, tmp_path, case, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    extra, failing_rank, how = CASES[case]
    run = tmp_path / "run"
    messages = run_distributed(_train_with_a_failing_save, 2, tiny_data, run, extra, failing_rank,
                               how, timeout=300)
    tmp = run / "checkpoints" / "step_00000004.tmp"
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} ended without the checkpoint error"
        assert message.startswith(f"checkpoint at step 4 could not be written to {tmp} ("), message
        assert "step_00000002) is intact" in message
        assert "\n" not in message and "[Errno" not in message and "Traceback" not in message
        fix = "ulimit -f" if how == "limit" else "is full: free space there"
        assert fix in message and "train.resume=latest" in message, message
        assert ("reported by rank" in message) == (rank != failing_rank), message
    assert latest_step(run) == 2
    assert not list((run / "checkpoints").glob("*.tmp"))
