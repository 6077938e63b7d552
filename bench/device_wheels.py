"""Fill ``.whl/`` (ignored) with exactly the wheels the device machine lacks for the GPU check.

The device machine (docs/training.md, "GPU check on the device machine") has Python 3.12 with
torch and most of the scientific stack (``bench/device_image_packages.txt``) but not DeepSpeed,
open_clip, webdataset, braceexpand or ftfy, and it cannot reach a registry. Starting from those
roots this script fetches each one's wheel at the version pinned in ``requirements.lock``, reads
its ``Requires-Dist`` (extras skipped, markers evaluated for CPython 3.12 on x86-64 Linux) and
fetches every requirement the image does not hold, until nothing is missing. DeepSpeed publishes
only an sdist: it is built here into a pure-Python wheel (``DS_BUILD_OPS=0``: no op is compiled
ahead; the check uses torch's fused AdamW and needs none).

    .venv/bin/python bench/device_wheels.py    # (a Python with torch: DeepSpeed's build imports it)
    bench/device_run.sh GROUP                  # on the device machine, with .whl carried

Prints each wheel and the folder's size (it travels with the working tree: 64 MiB at most).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOTS = ("deepspeed", "open_clip_torch", "webdataset", "braceexpand", "ftfy")
PLATFORM_ARGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                 "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64",
                 "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
                 "--platform", "manylinux1_x86_64", "--platform", "any"]
CARRY_ANYWAY = {
    "typing-extensions": "pydantic 2.14 and pydantic-core need >= 4.16.0; the image's version is not "
                         "recorded, and a newer typing_extensions only adds",
}
"""Packages the image holds that are carried anyway, with the reason (a version floor of a carried
wheel that the image's copy may not meet)."""
MARKER_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython",
              "extra": ""}


def normalize(name: str) -> str:
    """PEP 503 name: ``Typing_Extensions`` -> ``typing-extensions``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def device_packages(path: Path = ROOT / "bench" / "device_image_packages.txt") -> set[str]:
    return {normalize(line.strip()) for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")}


def locked_versions(path: Path = ROOT / "requirements.lock") -> dict[str, str]:
    versions = {}
    for line in path.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            versions[normalize(name)] = version.strip()
    return versions


def wheel_metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return archive.read(name).decode()


def wheel_name(wheel: Path) -> str:
    return normalize(wheel.name.split("-")[0])


def requirements(wheel: Path) -> list[str]:
    """Normalised names of the wheel's ``Requires-Dist`` that apply on the device (no extras)."""
    from packaging.requirements import Requirement

    names = []
    for line in wheel_metadata(wheel).splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = Requirement(line.split(":", 1)[1].strip())
        if requirement.marker is not None and not requirement.marker.evaluate(MARKER_ENV):
            continue
        names.append(normalize(requirement.name))
    return names


def fetch(name: str, version: str, dest: Path) -> Path:
    """The wheel of ``name==version`` in ``dest``: downloaded for the device, or built from the
    sdist when the registry has no wheel (DeepSpeed)."""
    before = set(dest.glob("*.whl"))
    spec = f"{name}=={version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", *PLATFORM_ARGS,
           "-d", str(dest), spec]
    if subprocess.run(cmd).returncode != 0:
        print(f"  no wheel of {spec} for the device: building one from its sdist", flush=True)
        env = dict(os.environ, DS_BUILD_OPS="0")
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                        "--no-build-isolation", "-w", str(dest), spec], env=env, check=True)
    new = sorted(set(dest.glob("*.whl")) - before) or sorted(
        w for w in dest.glob("*.whl") if wheel_name(w) == normalize(name))
    if not new:
        raise SystemExit(f"device_wheels: no wheel of {spec} came")
    return new[0]


def fill(dest: Path, roots: tuple[str, ...] = ROOTS) -> list[Path]:
    have = device_packages()
    locked = locked_versions()
    roots = tuple(roots) + tuple(CARRY_ANYWAY)
    dest.mkdir(parents=True, exist_ok=True)
    present = {wheel_name(w): w for w in dest.glob("*.whl")}
    queue, done, wheels = list(roots), set(), []
    while queue:
        name = normalize(queue.pop(0))
        if name in done or (name in have and name not in CARRY_ANYWAY):
            continue
        done.add(name)
        version = locked.get(name)
        if version is None:
            raise SystemExit(f"device_wheels: {name} is needed on the device but not pinned in "
                             "requirements.lock")
        wheel = present.get(name)
        if wheel is None or f"-{version}-" not in wheel.name:
            if wheel is not None:
                wheel.unlink()  # one version of each: two stop the whole install
            wheel = fetch(name, version, dest)
        print(f"  {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB)", flush=True)
        wheels.append(wheel)
        queue += requirements(wheel)
    for stray in set(dest.glob("*.whl")) - set(wheels):
        print(f"  removing {stray.name}: not needed", flush=True)
        stray.unlink()
    return wheels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", default=str(ROOT / ".whl"))
    args = parser.parse_args(argv)
    dest = Path(args.dest)
    print(f"filling {dest} for the device machine (CPython 3.12, x86-64 Linux)", flush=True)
    wheels = fill(dest)
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB in {dest}")
    if size > 48 * 2**20:
        print("warning: the working tree travels with a 64 MiB limit", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
