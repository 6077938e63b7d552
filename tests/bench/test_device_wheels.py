"""The device machine's wheels (bench/device_wheels.py, .whl/): every package the GPU check imports
and every requirement of every carried wheel is in the device image or carried."""

from __future__ import annotations

import zipfile

import pytest

from bench import device_wheels
from tests.bench.helpers import OPTIONAL_IMPORTS, REPO, third_party_imports

WHEELS = REPO / ".whl"


def test_image_list_is_read_and_names_are_normalised():
    have = device_wheels.device_packages()
    assert {"torch", "torchvision", "numpy", "pyyaml", "typing-extensions", "timm"} <= have
    assert not {"deepspeed", "open-clip-torch", "webdataset", "braceexpand", "ftfy"} & have
    assert device_wheels.normalize("Typing_Extensions") == "typing-extensions"


def test_every_root_and_its_needs_are_pinned():
    locked = device_wheels.locked_versions()
    for name in device_wheels.ROOTS:
        assert device_wheels.normalize(name) in locked, name


def test_requirements_skip_extras_and_foreign_markers(tmp_path):
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("demo-1.0.dist-info/METADATA", "\n".join([
            "Name: demo", "Requires-Dist: pydantic>=2.0.0", "Requires-Dist: Typing_Extensions",
            'Requires-Dist: pytest; extra == "dev"', 'Requires-Dist: pywin32; sys_platform == "win32"',
            'Requires-Dist: tomli; python_version < "3.11"']))
    assert device_wheels.requirements(wheel) == ["pydantic", "typing-extensions"]


def _carried() -> dict[str, str]:
    return {device_wheels.wheel_name(w): w.name for w in WHEELS.glob("*.whl")}


@pytest.mark.slow
@pytest.mark.skipif(not any(WHEELS.glob("*.whl")), reason="no .whl/ (python bench/device_wheels.py)")
def test_wheel_folder_completes_the_device_image_for_the_gpu_check():
    import importlib.metadata

    have = device_wheels.device_packages()
    carried = _carried()
    provided = have | set(carried)
    distributions = importlib.metadata.packages_distributions()
    missing = {}
    # 1. Every third-party module the check, vlcontrast and open_clip's trainer import.
    for module, files in third_party_imports().items():
        names = [device_wheels.normalize(d) for d in distributions.get(module, [])]
        if not names:
            missing[module] = f"no distribution installed here provides it ({sorted(files)[:2]})"
        elif not set(names) & provided:
            missing[module] = f"{names} neither in the image nor in .whl ({sorted(files)[:2]})"
    # 2. Every requirement of every carried wheel.
    for wheel in WHEELS.glob("*.whl"):
        for name in device_wheels.requirements(wheel):
            if name not in provided:
                missing[f"{wheel.name} -> {name}"] = "neither in the image nor in .whl"
    assert not missing, missing
    # One version of each, only what the image lacks, and well under the 64 MiB the tree carries.
    assert len(carried) == len(list(WHEELS.glob("*.whl")))
    assert set(carried) & have == set(device_wheels.CARRY_ANYWAY), set(carried) & have
    assert {device_wheels.normalize(r) for r in device_wheels.ROOTS} <= set(carried)
    size = sum(w.stat().st_size for w in WHEELS.glob("*.whl"))
    assert size < 32 * 2**20, size
    # Pinned: each carried wheel is the version requirements.lock names.
    locked = device_wheels.locked_versions()
    for name, filename in carried.items():
        assert f"-{locked[name]}-" in filename, (name, filename)


def test_optional_imports_are_named_with_a_reason():
    assert all(reason for reason in OPTIONAL_IMPORTS.values())
