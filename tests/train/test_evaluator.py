"""The Evaluator owns the eval section: data resolved once, its own schedule, training's autocast."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.evaluation.helpers import write_image_folder
from vlcontrast.config import EvalConfig
from vlcontrast.errors import ConfigError
from vlcontrast.train.evaluate import Evaluator
from vlcontrast.train.precision import Precision


def test_retrieval_shards_fall_back_to_data_val_and_none_skips():
    assert Evaluator(EvalConfig(), val_shards="v/{0..1}.tar").retrieval_shards == "v/{0..1}.tar"
    assert Evaluator(EvalConfig(retrieval="r.tar"), val_shards="v.tar").retrieval_shards == "r.tar"
    assert Evaluator(EvalConfig(retrieval="none"), val_shards="v.tar").retrieval_shards == ""


def test_should_evaluate_every_n_steps_but_not_the_last():
    evaluator = Evaluator(EvalConfig(every=3))
    assert [s for s in range(1, 10) if evaluator.should_evaluate(s, total_steps=9)] == [3, 6]
    assert not any(Evaluator(EvalConfig()).should_evaluate(s, 9) for s in range(1, 10))


def test_check_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match="eval.zeroshot='/nope': no such folder; give an "):
        Evaluator(EvalConfig(zeroshot="/nope")).check()
    with pytest.raises(ConfigError, match=r"data\.val pattern"):
        Evaluator(EvalConfig(), val_shards=str(tmp_path / "{0..1}.tar")).check()


def test_check_resolves_the_zero_shot_set_before_training(tmp_path):
    """A folder that is no zero-shot set (shards without their class names, say) or whose class
    names do not fit is refused by the check, before any step, with the key and the reason."""
    shards = tmp_path / "classes"
    shards.mkdir()
    (shards / "00000.tar").write_bytes(b"")
    with pytest.raises(ConfigError, match="eval.zeroshot=.*no class sub-folders"):
        Evaluator(EvalConfig(zeroshot=str(shards))).check()
    folder = tmp_path / "folder"
    write_image_folder(folder, ["cat", "dog"], per_class=1)  # an empty class folder is refused
    (tmp_path / "names.txt").write_text("cat\ndog\nbird\n")
    with pytest.raises(ConfigError) as err:
        Evaluator(EvalConfig(zeroshot=str(folder), classnames=str(tmp_path / "names.txt"))).check()
    assert str(err.value) == (
        f"eval.classnames={str(tmp_path / 'names.txt')!r}: 3 class names, but the data has 2 "
        f"classes (the class folders of eval.zeroshot={str(folder)!r}: cat, dog); give one name "
        "per class, in the classes' order")
    Evaluator(EvalConfig(zeroshot=str(folder))).check()  # a plain ImageFolder passes


def test_class_names_and_templates_are_checked_once_with_the_keys_named(tmp_path):
    """resolve_zeroshot_data is the one check of eval.classnames and eval.templates (it was
    repeated, less well, here: a folder given for a file read "no such file"); its errors name
    the config key and its value, the file's content and both fixes."""
    folder = tmp_path / "folder"
    write_image_folder(folder, ["cat", "dog"], per_class=1)  # an empty class folder is refused
    missing = str(tmp_path / "names.txt")
    with pytest.raises(ConfigError) as err:
        Evaluator(EvalConfig(zeroshot=str(folder), classnames=missing)).check()
    assert str(err.value) == (f"eval.classnames={missing!r}: no such file; give a file with one "
                              "class name per line, or leave it empty for the folder's own")
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "mine.txt").write_text("a photo of a {c}.\n")
    with pytest.raises(ConfigError) as err:
        Evaluator(EvalConfig(zeroshot=str(folder), templates=str(tmp_path / "prompts"))).check()
    assert str(err.value) == (
        f"eval.templates={str(tmp_path / 'prompts')!r}: a folder, not a file; name a file with "
        f"one prompt per line with {{c}}, e.g. eval.templates="
        f"{str(tmp_path / 'prompts' / 'mine.txt')!r}, or leave it empty for the folder's own")
    (tmp_path / "bad.txt").write_text("a photo\n")
    with pytest.raises(ConfigError, match=r"^eval\.templates='.*bad\.txt': template 'a photo' "
                       r"has no \{c\} placeholder"):
        Evaluator(EvalConfig(zeroshot=str(folder), templates=str(tmp_path / "bad.txt"))).check()
    Evaluator(EvalConfig(zeroshot=str(folder),
                         templates=str(tmp_path / "prompts" / "mine.txt"))).check()


@pytest.mark.parametrize("precision,expected", [("fp32", False), ("amp_bf16", True)])
def test_evaluation_runs_under_the_training_autocast(monkeypatch, precision, expected):
    """amp_bf16 trains under bf16 autocast; evaluating in fp32 outside it would be 2-3x slower on
    a GPU and measure another model. Evaluation uses the same autocast."""
    import vlcontrast.evaluation as evaluation

    seen = []

    def fake_retrieval(module, *args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu"))
        return {"text_to_image_R@1": 1.0}

    monkeypatch.setattr(evaluation, "evaluate_retrieval", fake_retrieval)
    evaluator = Evaluator(EvalConfig(), val_shards="v.tar", precision=Precision(precision))
    bundle = SimpleNamespace(preprocess_val=None, tokenizer=None)
    results = evaluator.evaluate(torch.nn.Linear(2, 2), bundle, torch.device("cpu"))
    assert seen == [expected] and results == {"retrieval/text_to_image_R@1": 1.0}


def _seen_by_the_evaluations(monkeypatch, argument: str, **overrides) -> dict:
    """What train() hands the in-training evaluations as ``argument`` (by task), given the config
    ``overrides``: the loop stops as soon as it has made its Evaluator, which evaluates once."""
    import vlcontrast.evaluation as evaluation
    from tests.train.helpers import tiny_config
    from vlcontrast.train import loop

    seen = {}

    def recorder(task):
        return lambda *args, **kwargs: seen.update({task: kwargs[argument]}) or {}

    monkeypatch.setattr(evaluation, "evaluate_retrieval", recorder("retrieval"))
    monkeypatch.setattr(evaluation, "evaluate_zeroshot", recorder("zeroshot"))

    class Built(Exception):
        pass

    def evaluator(*args, **kwargs):
        built = Evaluator(EvalConfig(retrieval="r.tar", zeroshot="z"), progress=kwargs["progress"],
                          max_image_pixels=kwargs["max_image_pixels"])
        built.evaluate(torch.nn.Linear(1, 1), SimpleNamespace(preprocess_val=None, tokenizer=None),
                       "cpu")
        raise Built

    monkeypatch.setattr(loop, "Evaluator", evaluator)
    monkeypatch.setattr(loop, "StopSignal", lambda: None)  # this process keeps its handlers
    monkeypatch.setattr(loop.dist_utils, "init_distributed", lambda **kw: SimpleNamespace(
        device=torch.device("cpu"), rank=0))
    with pytest.raises(Built):
        loop.train(tiny_config("data", "run", **overrides))
    return seen


@pytest.mark.parametrize("progress", [True, False])
def test_logging_progress_reaches_the_evaluations_progress(monkeypatch, progress):
    """``logging.progress=false`` silenced the training steps only: the embedding passes of the
    in-training evaluation were always shown (evaluate_* default to progress=True)."""
    seen = _seen_by_the_evaluations(monkeypatch, "progress", logging__progress=progress)
    assert seen == {"retrieval": progress, "zeroshot": progress}


@pytest.mark.parametrize("pixels,expected", [(None, None), (1000, 1000)])
def test_data_max_image_pixels_reaches_the_evaluations(monkeypatch, pixels, expected):
    """The in-training evaluations kept PIL's limit whatever data.max_image_pixels said; the
    default still passes None (PIL's limit, and the image-feature cache stays on)."""
    overrides = {"data__max_image_pixels": pixels} if pixels else {}
    seen = _seen_by_the_evaluations(monkeypatch, "max_image_pixels", **overrides)
    assert seen == {"retrieval": expected, "zeroshot": expected}


def test_files_the_folder_holds_are_named_after_eval_zeroshot(tmp_path):
    """A bad file inside the zero-shot folder is the folder's fault: the error starts with
    eval.zeroshot and names the file in it (it named no key, or the wrong one, when the Evaluator
    told the two kinds apart by the message's first words)."""
    folder = tmp_path / "folder"
    write_image_folder(folder, ["cat", "dog"], per_class=1)  # an empty class folder is refused
    def refusal() -> str:
        with pytest.raises(ConfigError) as err:
            Evaluator(EvalConfig(zeroshot=str(folder))).check()
        return str(err.value)

    (folder / "templates.txt").write_text("a photo\n")
    assert refusal().startswith(f"eval.zeroshot={str(folder)!r}: templates.txt: template "
                                "'a photo' has no {c} placeholder")
    (folder / "templates.txt").write_text("a {c}\n")
    (folder / "classnames.txt").write_text("cat\n")
    assert refusal().startswith(f"eval.zeroshot={str(folder)!r}: classnames.txt: 1 class names, "
                                "but the data has 2 classes")
    (folder / "classnames.txt").write_text("cat\ndog\n")
    Evaluator(EvalConfig(zeroshot=str(folder))).check()  # fixed, it passes
    afile = tmp_path / "set.txt"
    afile.write_text("x")
    with pytest.raises(ConfigError, match=r"^eval\.zeroshot='.*set\.txt': a file; give an "
                       r"ImageNet-style"):
        Evaluator(EvalConfig(zeroshot=str(afile))).check()


def test_shards_without_class_names_say_what_is_missing(tmp_path):
    from vlcontrast.evaluation.datasets import ZeroShotDataError

    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "nshards.txt").write_text("1\n")
    with pytest.raises(ZeroShotDataError) as err:
        Evaluator(EvalConfig(zeroshot=str(tmp_path))).check()
    assert str(err.value) == (f"eval.zeroshot={str(tmp_path)!r}: shards without classnames.txt; "
                              "add it beside them (one class name per line) or give "
                              "eval.classnames")
    assert isinstance(err.value, FileNotFoundError)  # what evaluation's callers caught before
