"""Loader workers and stop signals: a SIGTERM to the whole process group (how SLURM gives notice
to every process of a job step) leaves the workers serving the trainer, which stops on its own
terms; the trainer still ends its workers when it exits (no wait for a worker that ignores it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent("""
    import signal, sys, time
    import torch
    from torch.utils.data import DataLoader, IterableDataset
    from vlcontrast.data.loader import dataloader_options

    class Slow(IterableDataset):
        def __iter__(self):
            for i in range(40):
                time.sleep(0.05)
                yield torch.tensor([i])

    got = []
    signal.signal(signal.SIGTERM, lambda *_: got.append("SIGTERM"))  # as the trainer's StopSignal
    options = dataloader_options(2, "cpu")
    loader = DataLoader(Slow(), **{k: v for k, v in options.items() if k != "persistent_workers"},
                        persistent_workers=True)
    iterator = iter(loader)
    for n, batch in enumerate(iterator):
        if n == 0:
            print("ready", flush=True)
        if n == 30:
            print(got, flush=True)
    print("batches", n + 1, flush=True)
    # the iterator stays referenced: the workers are alive when the interpreter exits
""")


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="process groups")
def test_a_sigterm_to_the_group_reaches_the_trainer_not_its_workers(tmp_path):
    script = tmp_path / "feed.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGTERM)  # the trainer and both workers, as slurmstepd does
        out, err = proc.communicate(timeout=60)  # used to hang or die: a worker killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-2000:]
    assert "['SIGTERM']" in out and "batches 80" in out, out + err[-2000:]
    assert "killed by signal" not in err


def test_workers_of_both_loaders_get_the_init():
    from vlcontrast.data.loader import dataloader_options
    from vlcontrast.evaluation.datasets import _loader

    assert dataloader_options(2, "cpu")["worker_init_fn"] is not None
    assert "worker_init_fn" not in dataloader_options(0, "cpu")
    assert _loader(list(range(4)), 2, 1, lambda x: x).worker_init_fn is not None


def test_the_exiting_flag_is_set_before_multiprocessing_ends_the_workers(tmp_path):
    """The hook that lets workers take their parent's SIGTERM runs before multiprocessing's exit
    handler, whatever was imported first (a worker that ignored it would hang the exit)."""
    script = tmp_path / "order.py"
    script.write_text(textwrap.dedent("""
        import atexit, sys
        calls = []
        real_register = atexit.register
        def register(function, *args, **kwargs):
            calls.append(getattr(function, "__name__", repr(function)))
            return real_register(function, *args, **kwargs)
        atexit.register = register
        from vlcontrast.data import workers
        workers.stop_signal_init()
        print(calls)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    calls = eval(out.stdout.strip().splitlines()[-1])
    assert calls.index("_exit_function") < calls.index("_set_exiting"), calls
