"""Shared by the tests of ``bench/``: a mocked CUDA host for subprocesses, the GPU check's
subprocess runs, and the scan of what the GPU check imports."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SITECUSTOMIZE = '''\
"""A CUDA host on a CPU machine, for every Python process started with this folder on PYTHONPATH:
torch.cuda says one GPU is there, and the first `import deepspeed` of each process logs the
DS_ACCELERATOR it found (DeepSpeed locks its accelerator at that import)."""
import importlib.abc
import json
import os
import sys

import torch

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1

_LOG = os.environ.get("VLC_DS_IMPORT_LOG")


class _FirstDeepSpeedImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "deepspeed" and _LOG:
            sys.meta_path.remove(self)
            with open(_LOG, "a") as handle:
                handle.write(json.dumps({"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR"),
                                         "argv": sys.argv[:3]}) + "\\n")
        return None


sys.meta_path.insert(0, _FirstDeepSpeedImport())
'''


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without DS_ACCELERATOR (conftest sets it) or launcher
    variables, with the repository on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DS_ACCELERATOR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                        "MASTER_PORT")}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def cuda_host_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """(environment of a mocked CUDA host, the log of DeepSpeed's first imports)."""
    site = tmp_path / "cuda-host"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "deepspeed-imports.jsonl"
    env = clean_env(VLC_DS_IMPORT_LOG=str(log))
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)])
    return env, log


def deepspeed_imports(log: Path) -> list[dict]:
    if not log.is_file():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def run_gpu_check(args: list[str], env: dict | None = None, timeout: int = 900):
    return subprocess.run([sys.executable, "-m", "bench.gpu_check", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env=env if env is not None else clean_env())


# --------------------------------------------------------------------------------------------
# what the GPU check imports

GPU_CHECK_SOURCES = ("vlcontrast", "bench/gpu_check", "bench/openclip_launch.py")

OPTIONAL_IMPORTS = {
    "wandb": "logging.wandb only (off in every run of the check)",
    "img2dataset": "CC3M preparation (vlcontrast prep cc3m), not the check",
    "pyarrow": "CC3M preparation, not the check",
    "bitsandbytes": "open_clip_train.main with --use-bnb-linear only",
    "horovod": "open_clip_train with --horovod only",
    "imagenetv2_pytorch": "open_clip_train's ImageNet-v2 evaluation only",
}


def imported_names(paths: list[Path]) -> dict[str, set[str]]:
    """Top-level module names imported anywhere in ``paths`` (files or folders), outside
    ``try`` blocks (optional imports), by name -> files."""
    names: dict[str, set[str]] = {}
    for root in paths:
        files = [root] if root.is_file() else sorted(root.rglob("*.py"))
        for path in files:
            tree = ast.parse(path.read_text())
            guarded = {id(n) for node in ast.walk(tree) if isinstance(node, ast.Try)
                       for stmt in node.body for n in ast.walk(stmt)}
            for node in ast.walk(tree):
                if id(node) in guarded:
                    continue
                if isinstance(node, ast.Import):
                    modules = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    names.setdefault(module.split(".")[0], set()).add(str(path))
    return names


def third_party_imports() -> dict[str, set[str]]:
    """What the GPU check's code, vlcontrast and the open_clip trainer it launches import that is
    neither the standard library nor this repository."""
    import open_clip_train

    paths = [REPO / p for p in GPU_CHECK_SOURCES] + [Path(open_clip_train.__file__).parent]
    local = {"vlcontrast", "bench", "tests", "open_clip_train"}
    return {name: files for name, files in imported_names(paths).items()
            if name not in sys.stdlib_module_names and name not in local
            and name not in OPTIONAL_IMPORTS and name != "__future__"}


def kill_writes_before_the_rename(monkeypatch) -> None:
    """Every whole-file write (``vlcontrast.outputs.write_text_atomic``) is cut after its
    temporary file was written and before it replaces the target: a device call's time limit
    striking mid-write. A plain ``write_text`` would not be stopped, and would change the file."""
    from vlcontrast import outputs

    def killed(*args, **kwargs):
        raise OSError("killed mid-write")

    monkeypatch.setattr(outputs.os, "replace", killed)
