"""``vlcontrast classify``: the user's own images, zero-shot, against labels they name."""

import json

import pytest
import torch
import torch.nn.functional as F

from tests.evaluation.helpers import write_image_folder
from tests.inference.helpers import (BROKEN, reference_image_features, reference_text_features,
                                     run_cli)
from vlcontrast.inference import DEFAULT_TEMPLATES, find_images, parse_labels
from vlcontrast.errors import ConfigError

LABELS = ["cat", "dog", "car", "tree"]


def classify_json(capsys, run_dir, *args):
    code, out, err = run_cli(capsys, "classify", "--checkpoint", str(run_dir), "--json",
                             "--workers", "0", "--no-progress", *args)
    assert code == 0, err
    return json.loads(out), err


def test_folder_with_an_unreadable_image_and_odd_names(trained, user_images, capsys):
    folder, readable = user_images
    result, err = classify_json(capsys, trained[1], "--labels", ",".join(LABELS), "--top-k", "3",
                                str(folder))
    assert [item["image"] for item in result["images"]] == [str(p) for p in readable]
    assert result["num_images"] == 5 and result["num_skipped"] == 1
    assert result["skipped"] == [str(folder / BROKEN)]
    assert result["skipped_reasons"] == {"undecodable_image": 1}
    assert "skipped 1 of 6 images (undecodable_image: 1)" in err and BROKEN in err
    for item in result["images"]:
        probs = [entry["prob"] for entry in item["top"]]
        assert len(probs) == 3 and probs == sorted(probs, reverse=True)
        assert len({entry["label"] for entry in item["top"]}) == 3
        assert 0 < sum(probs) <= 1 + 1e-6


def test_probabilities_equal_a_hand_computation(trained, user_images, tmp_path, capsys):
    (model, preprocess, tokenizer), run_dir = trained
    templates = ["a photo of a {c}.", "{c}, drawn badly", "my {c}"]
    (tmp_path / "templates.txt").write_text("\n".join(templates) + "\n")
    (tmp_path / "labels.txt").write_text("\n".join(LABELS) + "\n")
    paths = user_images[1]
    result, _ = classify_json(capsys, run_dir, "--labels-file", str(tmp_path / "labels.txt"),
                              "--templates", str(tmp_path / "templates.txt"), "--top-k", "9",
                              *map(str, paths[::-1]))
    assert result["templates"] == templates
    # By hand: each label's prompts embedded and normalised, averaged, normalised again; the
    # softmax over labels of exp(logit_scale) * cosine.
    classes = torch.stack([F.normalize(reference_text_features(
        model, tokenizer, [t.replace("{c}", label) for t in templates]).mean(0), dim=0)
        for label in LABELS])
    images = reference_image_features(model, preprocess, paths[::-1])
    expected = (model.logit_scale.detach().exp() * images @ classes.t()).softmax(dim=-1)
    assert [item["image"] for item in result["images"]] == [str(p) for p in paths[::-1]]
    for row, item in zip(expected, result["images"]):
        assert len(item["top"]) == len(LABELS)  # --top-k larger than the labels: all of them
        got = {entry["label"]: entry["prob"] for entry in item["top"]}
        for label, prob in zip(LABELS, row.tolist()):
            assert got[label] == pytest.approx(prob, abs=1e-5)
        assert item["top"][0]["label"] == LABELS[int(row.argmax())]


def test_default_templates_and_table_output(trained, user_images, capsys):
    code, out, err = run_cli(capsys, "classify", "--checkpoint", str(trained[1]), "--labels",
                             "cat, dog ,car", "--top-k", "2", "--workers", "0", "--no-progress",
                             str(user_images[1][0]), str(user_images[1][3]))
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0].split() == ["image", "top", "1", "top", "2"]
    # Each header stands over its column: "top 2" starts where every row's second label starts.
    second = [line.index(")  ") + 3 for line in lines[1:]]
    assert len(set(second)) == 1 and lines[0].index("top 2") == second[0]
    assert len(lines) == 3 and user_images[1][3].name in lines[2]  # long paths are shortened
    assert all(line.count("(0.") + line.count("(1.0") == 2 for line in lines[1:])
    assert err == ""  # nothing skipped, no progress, no open_clip warning
    assert len(DEFAULT_TEMPLATES) == 7 and all("{c}" in t for t in DEFAULT_TEMPLATES)


@pytest.mark.parametrize("args, message", [
    (["--labels", " , "], "--labels: 0 label(s); zero-shot classification needs at least two"),
    (["--labels", "cat,dog,Cat"], "label 'Cat' is given twice; give each label once"),
    (["--labels", "cat,dog", "--labels-file", "x.txt"], "give one of them, not both"),
    (["--labels", "cat,dog", "--templates", "TEMPLATES"], "template 'a photo' has no {c} "
     "placeholder"),
    (["--labels", "cat,dog", "--top-k", "0"], "--top-k 0: must be at least 1"),
    (["--labels-file", "missing.txt"], "--labels-file 'missing.txt': no such file"),
    (["--labels-file", "TMP"], "--labels-file 'TMP': a folder, not a file; name a file with one "
     "label per line, e.g. --labels-file 'TMP/templates.txt'"),
    (["--labels", "cat,dog", "--batch-size", "0"], "--batch-size 0: must be >= 1"),
    (["--labels", "cat,dog", "--workers", "-1"], "--workers -1: must be >= 0"),
    (["--labels", "cat,dog", "--figure", "TMP"], "--figure 'TMP': a folder; name a file"),
    (["--labels", "cat,dog", "--figure", "TMP/x.jpgg"], "--figure 'TMP/x.jpgg': unknown format "
     "'.jpgg'; end it in .png (or one of "),
    (["--labels", "cat,dog", "--figure", "TMP/x"], "--figure 'TMP/x': no format suffix; end it "
     "in .png (or one of "),
])
def test_bad_input_is_a_one_line_error_before_the_model(tmp_path, user_images, capsys, args,
                                                        message):
    (tmp_path / "templates.txt").write_text("a photo\n")
    args = [str(tmp_path / "templates.txt") if a == "TEMPLATES" else a.replace("TMP", str(tmp_path))
            for a in args]
    message = message.replace("TMP", str(tmp_path))
    # A checkpoint that does not exist: the error must come from the inputs, before any loading.
    code, out, err = run_cli(capsys, "classify", "--checkpoint", str(tmp_path / "no_run"), *args,
                             str(user_images[0]))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("vlcontrast: error: ") and message in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["templates.txt"]  # nothing written


def test_no_images_found(tmp_path, capsys):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "readme.txt").write_text("x")
    code, _, err = run_cli(capsys, "classify", "--checkpoint", str(tmp_path), "--labels", "a,b",
                           str(tmp_path / "empty"))
    assert code == 2 and err.count("\n") == 1
    assert "no images found in" in err and ".gif" in err
    with pytest.raises(ConfigError, match="'nope' does not exist"):
        find_images(["nope"])
    # A dataset folder of shards (prep's train/ and val/): the error names the shard folders.
    for split in ("train", "val"):
        (tmp_path / "mine" / split).mkdir(parents=True)
        (tmp_path / "mine" / split / "00000.tar").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"no images found in .*mine .*; it holds shards in "
                                          r".*mine/train, .*mine/val: give one of those folders"):
        find_images([str(tmp_path / "mine")], what="--images", reads_shards=True)


def test_labels_file_and_find_images_order(tmp_path, user_images):
    (tmp_path / "labels.json").write_text(json.dumps(["a cat", "a dog"]))
    assert parse_labels(labels_file=tmp_path / "labels.json") == ["a cat", "a dog"]
    folder, readable = user_images
    found = find_images([folder, readable[0]])  # a file named twice is taken once
    assert found == [*readable[:2], folder / BROKEN, *readable[2:]]  # notes.txt is no image
    assert find_images([readable[3], folder / "nested"]) == [readable[3], readable[2],
                                                             readable[4]]


def test_eval_zeroshot_class_names_file_of_the_wrong_length(trained, tmp_path, capsys):
    write_image_folder(tmp_path / "data", ["a_dir", "b_dir"], per_class=1)
    (tmp_path / "three.txt").write_text("x\ny\nz\n")
    code, out, err = run_cli(capsys, "eval", "zeroshot", "--checkpoint", str(tmp_path / "no_run"),
                             "--data", str(tmp_path / "data"), "--classnames",
                             str(tmp_path / "three.txt"), "--device", "cpu")
    assert code == 2 and err.count("\n") == 1
    assert f"--classnames '{tmp_path / 'three.txt'}': 3 class names, but the data has 2 classes" in err


def test_figure_draws_the_images_with_their_top_labels(trained, user_images, tmp_path, capsys):
    from PIL import Image

    figure = tmp_path / "fig" / "top3.png"
    code, out, err = run_cli(capsys, "classify", "--checkpoint", str(trained[1]), "--labels",
                             "cat,dog,car", "--workers", "0", "--no-progress", "--figure",
                             str(figure), str(user_images[1][0]), str(user_images[1][3]))
    assert code == 0, err
    assert f"figure {figure}" in err
    with Image.open(figure) as image:
        width, height = image.size
    assert width > 500 and height > 200  # a 4-column grid with one row of two images
    assert not list(figure.parent.glob("*.tmp.png"))


def test_figure_refuses_an_existing_file_unless_overwrite(trained, user_images, tmp_path,
                                                         capsys, monkeypatch):
    """``--figure fig.png`` used to replace an unrelated file there without asking."""
    from PIL import Image

    figure = tmp_path / "fig.png"
    Image.new("RGB", (30, 20)).save(figure)
    before = figure.read_bytes()
    args = ["classify", "--checkpoint", str(tmp_path / "no_run"), "--labels", "cat,dog",
            "--workers", "0", "--no-progress", "--figure", str(figure), str(user_images[1][0])]
    code, out, err = run_cli(capsys, *args)  # refused before the (missing) model is looked at
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"vlcontrast: error: --figure {str(figure)!r} exists (a 30x20 PNG "
                          "image, made ")
    assert err.endswith("); add --overwrite to replace it, or name a new file\n")
    assert figure.read_bytes() == before
    args[2] = str(trained[1])
    code, _, err = run_cli(capsys, *args, "--overwrite")
    assert code == 0, err
    with Image.open(figure) as image:
        assert image.size != (30, 20)


def test_figure_rows_leave_room_for_three_labels(trained, user_images, tmp_path):
    """Each image's three label lines sit below the file name of the image above them."""
    import matplotlib.pyplot as plt

    from vlcontrast.inference.classify import classify, draw_classification
    from vlcontrast.inference import find_images

    (model, preprocess, tokenizer), _ = trained
    paths = find_images([str(user_images[0])]) * 2  # 12 images: three rows of four
    result = classify(model, preprocess, tokenizer, paths, LABELS, top_k=3, progress=False)
    figure = draw_classification(result, columns=4, top=3)
    try:
        renderer = figure.canvas.get_renderer()
        axes = figure.axes
        for below, above in zip(axes[4:], axes):
            if not below.images or not above.images:
                continue
            title = below.title if below.title.get_text() else below._left_title
            assert title.get_text().count("\n") == 2
            name = [t for t in above.texts if t.get_text()][0]
            assert (title.get_window_extent(renderer).y1
                    < name.get_window_extent(renderer).y0), "labels overlap the name above"
        for axis in axes:  # nothing drawn outside the figure
            for text in [axis._left_title, *axis.texts]:
                box = text.get_window_extent(renderer)
                assert box.y0 >= 0 and box.y1 <= figure.bbox.y1
    finally:
        plt.close(figure)


def test_figure_failure_leaves_no_temporary_file(trained, user_images, tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from vlcontrast.inference.classify import classify, plot_classification

    (model, preprocess, tokenizer), _ = trained
    result = classify(model, preprocess, tokenizer, user_images[1][:2], LABELS, progress=False)

    def broken(self, fname, **kwargs):
        open(fname, "wb").write(b"half")
        raise OSError(28, "No space left on device", str(fname))

    monkeypatch.setattr(Figure, "savefig", broken)
    with pytest.raises(OSError):
        plot_classification(result, tmp_path / "fig.png")
    assert list(tmp_path.iterdir()) == []


def test_figure_format_follows_the_suffix(trained, user_images, tmp_path):
    from vlcontrast.inference.classify import classify, plot_classification

    (model, preprocess, tokenizer), _ = trained
    result = classify(model, preprocess, tokenizer, user_images[1][:2], LABELS, progress=False)
    assert plot_classification(result, tmp_path / "f.pdf").read_bytes().startswith(b"%PDF")
    assert plot_classification(result, tmp_path / "f.JPG").read_bytes().startswith(b"\xff\xd8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.JPG", "f.pdf"]


def test_classify_of_shards_says_it_takes_images_and_embed_reads_shards(tmp_path, capsys):
    # prep's output (train/ and val/ shard sets), or one shard set: classify reads no shards, so
    # the hint must not send the user to a shard folder.
    for split in ("train", "val"):
        (tmp_path / "mine" / split).mkdir(parents=True)
        (tmp_path / "mine" / split / "00000.tar").write_bytes(b"")
    for given, shown in (("mine", "mine/train, mine/val"), ("mine/train", "mine/train")):
        code, out, err = run_cli(capsys, "classify", "--checkpoint", str(tmp_path / "no_run"),
                                 "--labels", "cat,dog", str(tmp_path / given))
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert (f"it holds webdataset shards ({tmp_path}/{shown.replace(', ', f', {tmp_path}/')}), "
                "which classify does not read: give image files or folders holding them "
                f"(`vlcontrast embed --images {tmp_path / given.split('/')[0] / 'train'}` embeds "
                "shards)") in err, err
        assert "give one of those folders" not in err
