"""Bring your own data, end to end: un-keyed webdataset shards train with InfoNCE as they are,
DeCL's buffer stops before the model is built naming ``prep wds``, and trains after it; the
folder and CSV converters' output trains."""

from __future__ import annotations

from pathlib import Path

from tests.data.helpers import write_shard
from tests.distributed import run_distributed
from vlcontrast.data.tar_reader import read_shard


def _hex_copy(synthetic_data: Path, out: Path) -> Path:
    """The synthetic training shards as another tool might write them: hex uids for keys, no
    json key, open_clip-style shard names, no sizes.json or manifest."""
    out.mkdir(parents=True)
    for index, shard in enumerate(sorted((synthetic_data / "train").glob("*.tar"))):
        rows = []
        for _, key, members in read_shard(str(shard)):
            rows.append({"__key__": f"uid_{int(key) * 2654435761 % 16**8:08x}",
                         "jpg": members["jpg"], "txt": members["txt"]})
        write_shard(out / f"data-{index:03d}.tar", rows)
    return out


def _train_cases(rank, world_size, synthetic_data, tmp_path):
    import vlcontrast.train.loop as loop
    from tests.train.helpers import tiny_config
    from vlcontrast.data.loader import LoaderError
    from vlcontrast.data.prep.folder import prepare_folder
    from vlcontrast.data.prep.wds import prepare_wds

    outcome: dict = {}
    hexed = _hex_copy(synthetic_data, tmp_path / "hex")
    data_root = tmp_path / "roots"
    (data_root / "hex").mkdir(parents=True)
    (data_root / "hex" / "train").symlink_to(hexed)

    def run(name: str, train_dir: Path, **extra):
        root = tmp_path / "roots" / name
        root.mkdir(parents=True, exist_ok=True)
        if not (root / "train").exists():
            (root / "train").symlink_to(train_dir)
        return loop.train(tiny_config(root, tmp_path / "runs" / name, train__steps=2, **extra))

    outcome["infonce_hex"] = run("hex", hexed)["step"]
    built = []
    real_build = loop.build_model
    loop.build_model = lambda *a, **k: built.append(1) or real_build(*a, **k)
    try:
        run("hex_decl", hexed, loss__name="decl")
    except LoaderError as err:
        outcome["decl_hex"] = (str(err), len(built))
    finally:
        loop.build_model = real_build
    report = prepare_wds(str(hexed), tmp_path / "rekeyed", progress=False, workers=1)
    outcome["rekeyed_samples"] = report["num_samples"]
    outcome["decl_rekeyed"] = run("rekeyed_decl", tmp_path / "rekeyed", loss__name="decl")["step"]

    folder = tmp_path / "folder"
    folder.mkdir()
    for i, (_, _, members) in enumerate(read_shard(str(next(hexed.glob("*.tar"))))):
        (folder / f"{i:03d}.jpg").write_bytes(members["jpg"])
        (folder / f"{i:03d}.txt").write_bytes(members["txt"])
    prepare_folder(folder, tmp_path / "from_folder", progress=False, workers=1, image_size=32,
                   shard_size=16)
    outcome["folder"] = run("folder", tmp_path / "from_folder")["step"]
    return outcome


def test_unkeyed_shards_train_and_id_losses_stop_before_the_model(synthetic_data, tmp_path):
    (outcome,) = run_distributed(_train_cases, 1, synthetic_data, tmp_path, timeout=600)
    assert outcome["infonce_hex"] == 2
    message, models_built = outcome["decl_hex"]
    assert models_built == 0 and "prep wds" in message and "uid_" in message
    assert "loss=decl" in message and "\n" not in message
    assert outcome["rekeyed_samples"] == 256 and outcome["decl_rekeyed"] == 2
    assert outcome["folder"] == 2
