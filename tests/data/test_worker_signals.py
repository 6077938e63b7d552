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


CHILD = textwrap.dedent("""
    import multiprocessing, sys
    import torch
    from torch.utils.data import DataLoader, IterableDataset
    from vlcontrast.data.loader import dataloader_options

    class Numbers(IterableDataset):
        def __iter__(self):
            yield from (torch.tensor([i]) for i in range(8))

    def cell():  # a study cell: loaders in a multiprocessing child, alive when it returns
        global iterator
        iterator = iter(DataLoader(Numbers(), **dataloader_options(2, "cpu")))
        print("read", sum(1 for _ in iterator), flush=True)

    if __name__ == "__main__":
        method = sys.argv[1]
        if method == "main":
            cell()
        else:
            child = multiprocessing.get_context(method).Process(target=cell)
            child.start()
            child.join()
            print("exitcode", child.exitcode, flush=True)
""")


@pytest.mark.parametrize("method", ["main", "fork", "forkserver"])
def test_a_process_whose_workers_are_alive_at_its_end_still_ends(tmp_path, method):
    """The workers take their parent's SIGTERM as it exits: at interpreter exit, and at the end
    of a multiprocessing child (the study's cells), where atexit hooks never run (a cell hung
    there for good with a first version)."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = subprocess.run([sys.executable, str(script), method], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "read 16" in out.stdout and "killed by signal" not in out.stderr, out.stderr[-2000:]
    if method != "main":
        assert "exitcode 0" in out.stdout
