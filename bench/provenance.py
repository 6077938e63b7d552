"""One provenance line for a results file: UTC date, machine, CPU, and the versions that matter."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions(packages: tuple[str, ...] = ()) -> str:
    found = [f"python {platform.python_version()}"]
    for name in ("torch", *packages):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return ", ".join(found)


def line(packages: tuple[str, ...] = ()) -> str:
    """``run <date>: <machine>, <cores> cores (<cpu>), <platform>; python x, torch y, ...``"""
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    try:
        load = "load average {:.1f}/{:.1f}/{:.1f}".format(*os.getloadavg())
    except OSError:
        load = "load average unknown"
    return (f"run {date}: {platform.machine()}, {os.cpu_count()} logical cores ({cpu_name()}), "
            f"{platform.platform()}, {load}; {versions(packages)}")
