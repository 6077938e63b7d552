"""``kill`` (SIGTERM) of a local ``vlcontrast study``: the running cell is passed the signal, as a
SLURM array task passes it, checkpoints and stops; the study waits for it, says so in one line
and exits 143; run again, it counts the stage's finished cells and the stopped cell resumes.

The study runs as its command line (``tests/test_slurm_study.py``'s stand-in interpreter, which
runs the real ``vlcontrast`` with the cells' training replaced by the trainer below, in real
subprocesses)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

from tests.test_slurm_study import FAKE_PYTHON, REPO, _study

TRAINER = r'''
"""`vlcontrast train` as a cell runs it, at once; the first cell that starts once FAKE_HOLD_AFTER
results exist trains until SIGTERM (it says so in RUN/holding), then checkpoints, leaves
vlcontrast.requeue's marker and exits 0; train.resume=latest continues from its checkpoint."""
import json, os, signal, sys, time
from pathlib import Path
args = sys.argv[1:]
value = lambda key: [a.split("=", 1)[1] for a in args if a.startswith(key + "=")][-1]
out, steps = Path(value("output_dir")), int(value("train.steps"))
resume = any(a == "train.resume=latest" for a in args)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
metrics = open(out / "metrics.jsonl", "a")
first = int((out / "checkpoints" / "latest").read_text().split("_")[1]) + 1 if resume else 1
results = Path(os.environ["FAKE_RESULTS"])
hold = (not resume and os.environ.get("FAKE_HOLD_AFTER") is not None
        and len(list(results.glob("*.json"))) >= int(os.environ["FAKE_HOLD_AFTER"]))
for step in range(first, steps + 1):
    metrics.write(json.dumps({"kind": "train", "step": step, "samples_seen": 8 * step,
                              "loss": 1.0 / step}) + "\n")
    metrics.flush()
    if hold:
        (out / "holding").write_text("")
        deadline = time.time() + 120
        while not stop and time.time() < deadline:
            time.sleep(0.02)
    if stop:
        (out / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (out / "checkpoints" / "latest").write_text(f"step_{step}")
        (out / "preempted.json").write_text("{}")
        sys.exit(0)
(out / "results.json").write_text(json.dumps({"metrics": {
    "step": steps, "samples_seen": 8 * steps, "retrieval/text_to_image_R@1": 0.3,
    "retrieval/image_to_text_R@1": 0.3}}))
'''


def _study_command(tmp_path: Path, config: Path, **env_extra: str) -> subprocess.Popen:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, source in (("fake-python", FAKE_PYTHON), ("fake-trainer", TRAINER)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{source}")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "VLC_STUDY"))}
    env.update(PYTHONPATH=str(REPO), FAKE_LOG=str(tmp_path / "fake.log"),
               FAKE_TRAINER=str(bin_dir / "fake-trainer"), TOKENIZERS_PARALLELISM="false",
               FAKE_RESULTS=str(tmp_path / "res" / "cells" / "web" / "sweep-lr"), **env_extra)
    return subprocess.Popen([str(bin_dir / "fake-python"), "-m", "vlcontrast.cli", "study",
                             "--config", str(config), "--stage", "sweep", "parallel=1",
                             "sweep.extend_edges=0"],  # the lr sweep: 2 settings x 2 lr factors
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_a_killed_study_stops_its_running_cell_with_a_checkpoint_and_resumes_it(tmp_path):
    """Before: exit 143 with no line, the running cell SIGKILLed (no checkpoint: its rerun
    started over), and the rerun said "0 of 2 cells done" of a stage part with 2 of 4 done."""
    config = _study(tmp_path)
    cells = tmp_path / "out" / "cells" / "web" / "sweep-lr"
    study = _study_command(tmp_path, config, FAKE_HOLD_AFTER="2")
    try:
        deadline = time.monotonic() + 120
        while not list(cells.glob("*/holding")):  # the third cell trains
            assert study.poll() is None and time.monotonic() < deadline, study.stderr.read()
            time.sleep(0.05)
        study.send_signal(signal.SIGTERM)
        out, err = study.communicate(timeout=120)
    finally:
        if study.poll() is None:
            study.kill()
    assert study.returncode == 143, err
    (held,) = [path.parent for path in cells.glob("*/holding")]
    assert err.strip().splitlines()[-1] == (
        "study: stopped by signal 15; 1 running cell(s) stopped with a checkpoint and resume "
        "from it; run the same command to continue")
    record = json.loads((held / "study_cell.json").read_text())
    assert record["status"] == "stopped" and record["returncode"] == 0
    assert (held / "preempted.json").is_file()
    assert len(list((tmp_path / "res" / "cells" / "web" / "sweep-lr").glob("*.json"))) == 2

    again = _study_command(tmp_path, config)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert err.splitlines()[0] == "study: 2 of 4 cells done, running 2"
    assert f"study: web/sweep-lr/{held.name}: resuming an earlier attempt from" in err
    result = json.loads((tmp_path / "res" / "cells" / "web" / "sweep-lr" /
                         f"{held.name}.json").read_text())
    assert [point[0] for point in result["loss_curve"]] == [8, 16, 24, 32]
