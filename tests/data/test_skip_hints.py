"""Skip messages that say how to fix them: training's bad-sample error names
``data.max_image_pixels`` after decompression bombs; ``prep folder``'s example of a JSON sidecar
without a caption names the keys it has and the keys read."""

import json

import pytest

from tests.data.helpers import PREPROCESS, CountingTokenizer, config, make_shards, run_epoch
from tests.data.test_prep_byod import image_file
from vlcontrast import cli
from vlcontrast.data.loader import LoaderError, build_train_loader
from vlcontrast.data.prep.folder import prepare_folder
from vlcontrast.data.samples import bad_rate_error

READ = "a caption is read from captions, caption or text"


def test_training_bad_sample_error_names_data_max_image_pixels():
    error = bad_rate_error({"decompression_bomb": 11}, 366, 0.01, "data (rank 0)", 89_478_485)
    assert str(error).endswith("; raise data.max_image_pixels (now 89,478,485) if you trust "
                               "these files")
    other = bad_rate_error({"undecodable_image": 11}, 366, 0.01, "data (rank 0)", 89_478_485)
    assert "max_image_pixels" not in str(other)


def test_training_loader_stops_on_bombs_naming_the_config_key(tmp_path):
    make_shards(tmp_path, [40, 40], defects={(s, r): "bomb" for s in range(2)
                                             for r in range(0, 40, 2)})
    cfg = config(str(tmp_path / "{00000..00001}.tar"), num_samples=40, batch_size=4,
                 max_bad_fraction=0.05, workers=1)
    cfg.max_image_pixels = 32 * 32  # the bomb PNG is 64 x 64
    loader = build_train_loader(cfg, PREPROCESS, CountingTokenizer(), seed=0, rank=0,
                                world_size=1)
    with pytest.raises(LoaderError, match=r"decompression_bomb.*; raise data\.max_image_pixels "
                                          r"\(now 1,024\) if you trust these files$"):
        run_epoch(loader)


def test_prep_folder_names_the_keys_of_a_sidecar_without_a_caption(tmp_path, capsys):
    src = tmp_path / "src"
    image_file(src / "cat.png")
    (src / "cat.json").write_text(json.dumps({"title": "a cat", "url": "http://x/cat"}))
    image_file(src / "art" / "dog.png")
    (src / "art" / "dog.json").write_text(json.dumps({"caption": 7}))
    image_file(src / "bare.png")
    (src / "bare.json").write_text("{}")
    image_file(src / "ok.png")
    (src / "ok.json").write_text(json.dumps({"text": "fine"}))
    image_file(src / "nocap.png")                       # no sidecar at all: the path alone
    report = prepare_folder(src, tmp_path / "out", progress=False, workers=1, image_size=16)
    assert report["num_samples"] == 1 and report["skipped"] == {"missing_caption": 4}
    assert report["examples"]["missing_caption"] == [
        f"art/dog.png: dog.json's caption holds 7, not text or a list of texts; {READ}",
        f"bare.png: bare.json has no keys; {READ}",
        f"cat.png: cat.json has keys title, url; {READ}",
        "nocap.png"]

    code = cli.main(["prep", "folder", str(src), str(tmp_path / "out2"), "--workers", "1",
                     "--no-progress", "--image-size", "16", "--json"])
    shown = json.loads(capsys.readouterr().out)
    assert code == 0 and f"cat.png: cat.json has keys title, url; {READ}" in \
        shown["examples"]["missing_caption"]
