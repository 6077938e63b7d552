"""The config check against a fuzzer's values (/tmp/probe_cfg, findings F1-F16): each bad value is
one line naming the key, the value and the fix, from the check ``vlcontrast config`` and
``vlcontrast train`` share, before any model or run folder; valid values keep working."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from vlcontrast import cli
from vlcontrast.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
BASE = ["train.steps=2", "output_dir=runs/fuzz"]


def refused(overrides, path=None) -> str:
    """The one line the config check gives for ``overrides``."""
    with pytest.raises(ConfigError) as caught:
        load_config(path, BASE + list(overrides))
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def run_cli(argv) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(list(argv))
    return code, err.getvalue()


INT_KEYS = ["seed", "data.num_samples", "data.batch_size", "data.workers", "data.shuffle_buffer",
            "data.id_space", "data.max_image_pixels", "data.cache_mb",
            "model.lock_image_unlocked_groups", "model.lock_text_unlocked_layers",
            "loss.chunk_size", "optim.warmup_steps", "train.steps", "train.accum_steps",
            "train.log_every", "train.max_bad_steps", "train.dist_timeout_s",
            "train.stop_at_step", "checkpoint.every", "checkpoint.keep",
            "distill.augmentations", "eval.every", "eval.batch_size", "eval.max_samples"]


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
@pytest.mark.parametrize("key", INT_KEYS)
def test_f1_a_non_finite_integer_is_one_line(key, value):
    """int(inf) was an OverflowError traceback, int(nan) a ValueError one."""
    shown = {".inf": "inf", "-.inf": "-inf", ".nan": "nan"}[value]
    assert refused([f"{key}={value}"]) == (f"{key}={shown}: expected an integer; set {key} to a "
                                            f"whole number (e.g. {key}=10)")


@pytest.mark.parametrize("overrides, key", [
    (["loss.name=decl", "loss.seed=.nan"], "loss.seed"),
    (["loss.name=fastclip", "loss.gamma_schedule=cosine", "loss.gamma_decay_steps=.inf"],
     "loss.gamma_decay_steps"),
])
def test_f1_a_non_finite_integer_loss_option_is_one_line(overrides, key):
    with pytest.raises(ConfigError, match=rf"^{key}=(nan|inf): expected an integer"):
        load_config(None, BASE + overrides)


def test_f1_a_non_finite_integer_in_a_yaml_file_is_one_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  steps: .inf\n")
    with pytest.raises(ConfigError, match=r"^train\.steps=inf: expected an integer"):
        load_config(path)


@pytest.mark.parametrize("value, shown", [(".nan", "nan"), ("-1", "-1.0"), ("-.inf", "-inf"),
                                          ("1e300", "1e+300"), (".inf", "inf"), ("0.01", "0.01")])
def test_f2_min_lr_must_be_finite_and_at_most_lr(value, shown):
    """NaN gave a run that exited 0 with every weight NaN; below 0 gradient ascent; above lr a
    rising rate."""
    assert refused([f"optim.min_lr={value}", "optim.lr=0.001"]) == (
        f"optim.min_lr={shown}: must be finite and in [0, optim.lr=0.001] (the floor the cosine "
        "schedule decays to; 0: decay to zero)")


@pytest.mark.parametrize("value", ["0", "0.0005", "0.001"])
def test_f2_min_lr_in_range_is_accepted(value):
    assert load_config(None, BASE + [f"optim.min_lr={value}", "optim.lr=0.001"]).optim.min_lr \
        == float(value)


@pytest.mark.parametrize("override, line", [
    ("optim.betas=[2.0,-1.0]", "optim.betas=[2.0, -1.0]: each must be in [0, 1) (AdamW's moment "
                               "decays; open_clip's: [0.9, 0.98])"),
    ("optim.betas=[.nan,0.98]", "optim.betas=[nan, 0.98]: each must be in [0, 1)"),
    ("optim.betas=[0.9,1.0]", "optim.betas=[0.9, 1.0]: each must be in [0, 1)"),
    ("optim.eps=-1", "optim.eps=-1.0: must be > 0 and finite (AdamW's epsilon, e.g. 1e-6)"),
    ("optim.eps=0", "optim.eps=0.0: must be > 0 and finite"),
    ("optim.eps=.nan", "optim.eps=nan: must be > 0 and finite"),
    ("optim.eps=-.inf", "optim.eps=-inf: must be > 0 and finite"),
    ("optim.eps=.inf", "optim.eps=inf: must be > 0 and finite"),
    ("optim.eps=1e300", "optim.eps=1e+300: must be > 0 and finite"),
])
def test_f3_betas_and_eps_are_checked_with_the_config(override, line):
    """torch refused them with a traceback after the model was built; eps=1e300 trained nothing
    and exited 0."""
    assert refused([override]).startswith(line)


FLOAT_KEYS = ["optim.lr", "optim.weight_decay", "optim.grad_clip", "optim.temperature_lr",
              "model.init_logit_scale", "model.init_logit_bias", "train.epochs",
              "train.peak_tflops", "distill.weight"]


@pytest.mark.parametrize("value, shown", [(".nan", "nan"), (".inf", "inf"), ("-.inf", "-inf"),
                                          ("1e300", "1e+300"), ("-1e300", "-1e+300")])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_f4_f14_a_number_option_must_be_finite_in_float32(key, value, shown):
    """Accepted, they ran steps and stopped on non-finite losses (lr, weight_decay,
    init_logit_*), or were clamped without a word (init_logit_scale), or were a traceback
    (train.epochs=inf: ceil(inf))."""
    extra = ["train.steps=0"] if key == "train.epochs" else []
    extra += ["distill.teacher=ViT-B-32"] if key == "distill.weight" else []
    message = refused([f"{key}={value}", *extra])
    assert message.startswith(f"{key}={shown}: must be a finite number, at most 3.4e+38 in size "
                              "(float32, which training computes in)"), message
    assert message.endswith(f"; set {key} to one")


@pytest.mark.parametrize("loss, option", [("balanced", "alpha"), ("balanced", "lam"),
                                          ("hcl", "beta"), ("fastclip", "tau_lr"),
                                          ("fastclip", "tau_max"), ("fastclip", "rho")])
@pytest.mark.parametrize("value", [".inf", "1e300"])
def test_f4_f14_a_loss_number_option_must_be_finite(loss, option, value):
    """They built and trained (non-finite losses after the model was built), or fastclip's
    individual temperatures trained at tau_lr=inf and exited 0."""
    temperature = ["loss.temperature=individual"] if loss == "fastclip" else []
    message = refused([f"loss.name={loss}", *temperature, f"loss.{option}={value}"])
    assert message.startswith(f"loss.{option}=") and "finite" in message, message
    assert f"(loss.name={loss})" in message


def test_f4_an_infinite_loss_option_with_a_meaning_is_kept():
    """dclw's sigma=inf is the documented DCL limit: finite checks go where inf means nothing."""
    load_config(None, BASE + ["loss.name=dclw", "loss.sigma=inf"])


@pytest.mark.parametrize("loss, options, line", [
    ("balanced", {"alpha": 1e300}, "balanced: alpha=1e+300: must be > 0 and finite (at most "
                                   "3.4e+38, float32's largest)"),
    ("balanced", {"lam": 1e300}, "balanced: lam=1e+300: must be > 0 and finite"),
    ("hcl", {"beta": 1e39}, "hcl: beta=1e+39: must be >= 0 and finite (at most 3.4e+38"),
    ("hcl", {"beta": float("inf")}, "hcl: beta=inf: must be >= 0 and finite"),
])
def test_f4_the_losses_own_range_checks_refuse_values_infinite_in_float32(loss, options, line):
    """For callers who build the loss in code (the config check says it first)."""
    from vlcontrast.errors import LossOptionError
    from vlcontrast.losses import build_loss

    with pytest.raises(LossOptionError) as caught:
        build_loss(loss, **options)
    assert str(caught.value).startswith(line)
    build_loss("balanced", alpha=1e38, lam=1e37)  # large, finite in float32: the loss's call
    build_loss("hcl", beta=0.0)


@pytest.mark.parametrize("override, line", [
    ("data.max_image_pixels=-1", "data.max_image_pixels=-1: must be >= 1 (images with more "
                                 "pixels are skipped; the default is PIL's 89478485)"),
    ("data.max_image_pixels=0", "data.max_image_pixels=0: must be >= 1"),
    ("data.id_space=-1", "data.id_space=-1: must be >= 0 (the number of distinct sample ids; 0 "
                         "reads manifest.json)"),
])
def test_f4_f7_data_sizes_are_checked_with_the_config(override, line):
    """max_image_pixels <= 0 made every image "bad" after the model was built; id_space=-1
    trained."""
    assert refused([override]).startswith(line)


def test_f8_a_yaml_list_or_scalar_is_one_line_naming_the_file_also_with_overrides(tmp_path):
    """With an override: AttributeError: 'list' object has no attribute 'setdefault'."""
    for text, kind in (("- data\n- model\n", "a list"), ("hello\n", "a string ('hello')")):
        path = tmp_path / "c.yaml"
        path.write_text(text)
        for overrides in ([], ["train.steps=2"]):
            with pytest.raises(ConfigError) as caught:
                load_config(path, overrides)
            assert str(caught.value) == (f"config file {str(path)!r}: expected a mapping of "
                                         f"sections (data:, model:, train:, ...), got {kind}; "
                                         "see configs/ for examples")


def test_f9_a_file_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == (f"config file {str(path)!r} is not a UTF-8 text file; name a "
                                 "YAML file (configs/ has examples)")


@pytest.mark.parametrize("override, line", [
    ("seed=18446744073709551617", "seed=18446744073709551617: must be a 64-bit integer, in "
                                  "[-2**63, 2**63 - 1] (rank r seeds with seed + r), e.g. seed=0"),
    ("seed=-9223372036854775809", "seed=-9223372036854775809: must be a 64-bit integer"),
    ("train.dist_timeout_s=99999999999999",
     "train.dist_timeout_s=99999999999999: must be in [1, 1000000000] (seconds;"),
])
def test_f10_seed_and_timeout_ranges(override, line):
    """torch.manual_seed's and timedelta's tracebacks, after preflight."""
    assert refused([override]).startswith(line)


@pytest.mark.parametrize("override", ["seed=-1", "seed=99999999999999", "seed=9223372036854775807",
                                      "train.dist_timeout_s=1000000000"])
def test_f10_values_that_work_are_kept(override):
    load_config(None, BASE + [override])


@pytest.mark.parametrize("override", ["output_dir=", "output_dir=null", "output_dir=' '"])
def test_f11_an_empty_output_dir_is_refused(override):
    """It wrote the run into the current directory."""
    message = refused([override])
    assert message.startswith("output_dir=") and message.endswith(
        ": set the run directory (e.g. output_dir=runs/mine); an empty one would write the run "
        "into the current directory")


@pytest.mark.parametrize("section, first", [("model", "name"), ("data", "train"),
                                            ("train", "steps"), ("loss", "name")])
@pytest.mark.parametrize("value", ["", "null"])
def test_f12_an_empty_section_override_is_refused(section, first, value):
    """`model=` replaced the YAML's model section by the defaults without a word."""
    assert refused([f"{section}={value}"]) == (f"override '{section}={value}': {section} is a "
                                               f"section; set its keys ({section}.{first}=...)")


def test_f12_an_empty_section_in_the_yaml_takes_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\ntrain:\n  steps: 2\n")
    assert load_config(path, ["model.name=vlc-micro"]).model.name == "vlc-micro"


@pytest.mark.parametrize("text, key, line", [
    ("train:\n  steps: 2\ntrain:\n  steps: 5\n", "train", "line 3, column 1"),
    ("data: {batch_size: 8, batch_size: 16}\ntrain:\n  steps: 2\n", "batch_size",
     "line 1, column 23"),
])
def test_f13_a_key_given_twice_is_refused(tmp_path, text, key, line):
    """The last one won without a word."""
    path = tmp_path / "d.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == (f"config file {str(path)!r} is not valid YAML ({line}: key "
                                 f"{key!r} appears twice (first on line 1); keep one); fix it "
                                 "there")


def test_f13_merge_keys_still_override(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("train: &t\n  steps: 2\n  log_every: 1\neval:\n  every: 0\n")
    assert load_config(path).train.steps == 2
    import yaml

    from vlcontrast.config import _UniqueKeyLoader

    assert yaml.load("a: &b {s: 2, l: 3}\nc:\n  <<: *b\n  s: 5\n", Loader=_UniqueKeyLoader) == {
        "a": {"s": 2, "l": 3}, "c": {"s": 5, "l": 3}}


@pytest.mark.parametrize("key", ["classnames", "templates"])
def test_f14_zero_shot_files_without_a_zero_shot_set_are_refused(key):
    """The missing file was never looked at."""
    assert refused([f"eval.{key}=/no/such/file"]) == (
        f"eval.{key}='/no/such/file': applies only with a zero-shot set: set eval.zeroshot (an "
        f"ImageFolder or an ImageNet val folder), or drop eval.{key}")


@pytest.mark.parametrize("overrides, line", [
    (["loss.tau_lr=0.02"], "loss.tau_lr=0.02: applies only with loss.temperature=individual "
                           "(loss.name=fastclip, loss.temperature=fixed); set "
                           "loss.temperature=individual, or drop loss.tau_lr"),
    (["loss.temperature=global", "loss.tau_max=0.5"],
     "loss.tau_max=0.5: applies only with loss.temperature=individual (loss.name=fastclip, "
     "loss.temperature=global)"),
    (["loss.tau_init=0.05"], "loss.tau_init=0.05: applies only with loss.temperature=individual"),
    (["loss.tau_min=0.02"], "loss.tau_min=0.02: applies only with loss.temperature=individual"),
    (["loss.rho=7"], "loss.rho=7.0: applies only with loss.temperature=global or "
                     "loss.temperature=individual (loss.name=fastclip, loss.temperature=fixed); "
                     "set loss.temperature=global, or drop loss.rho"),
    (["loss.gamma_decay_steps=-1"], "loss.gamma_decay_steps=-1: applies only with "
                                    "loss.gamma_schedule=cosine (loss.name=fastclip, "
                                    "loss.gamma_schedule=constant)"),
    (["loss.recipe=fast_clip", "loss.gamma_decay_epochs=2"],
     "loss.gamma_decay_epochs=2: applies only with loss.gamma_schedule=cosine"),
])
def test_f14_fastclip_options_that_nothing_reads_are_refused(overrides, line):
    assert refused(["loss.name=fastclip", *overrides]).startswith(line)


@pytest.mark.parametrize("overrides", [
    ["loss.temperature=individual", "loss.tau_lr=0.02", "loss.tau_min=0.02", "loss.tau_max=0.5",
     "loss.tau_init=0.05", "loss.rho=7"],
    ["loss.temperature=global", "loss.rho=7"],
    ["loss.gamma_schedule=cosine", "loss.gamma_decay_steps=10"],
    ["loss.recipe=fast_clip", "loss.gamma_schedule=cosine", "loss.gamma_decay_epochs=2"],
    ["loss.tau_lr=0.01"],  # its default: not "set"
])
def test_f14_fastclip_options_where_they_apply_are_accepted(overrides):
    load_config(None, BASE + ["loss.name=fastclip", *overrides])


def test_f14_a_logit_bias_with_a_loss_without_one_is_kept():
    """Not a no-op: the model gets a logit_bias parameter, so that one checkpoint starts every
    loss (configs/study/cell-v2.yaml, the study's v2 starts)."""
    assert load_config(None, BASE + ["model.init_logit_bias=-10"]).model.init_logit_bias == -10.0


@pytest.mark.parametrize("text, value", [("1e3", 1000), ("1.0e3", 1000), ("2E2", 200),
                                         ("'1e3'", 1000), ("10", 10)])
def test_f16_an_integer_written_with_an_exponent_is_an_integer(tmp_path, text, value):
    """YAML 1.1 reads 1e3 as a string: it was "train.steps='1e3': expected an integer"."""
    assert load_config(None, ["output_dir=r", f"train.steps={text}"]).train.steps == value
    path = tmp_path / "c.yaml"
    path.write_text(f"train:\n  steps: {text}\n")
    assert load_config(path).train.steps == value


@pytest.mark.parametrize("text", ["1.5e0", "1e-3", "abc", "1e400"])
def test_f16_an_exponent_that_is_no_integer_is_refused(text):
    assert refused([f"train.log_every={text}"]).startswith("train.log_every=")


@pytest.mark.parametrize("override, hint", [
    ("train.batch_size=8", "train.batch_size: unknown key (did you mean 'data.batch_size' or "
                           "'eval.batch_size'?); known: accum_steps,"),
    ("batch_size=8", "batch_size: unknown key (did you mean 'data.batch_size' or "
                     "'eval.batch_size'?); known: checkpoint,"),
    ("data.steps=3", "data.steps: unknown key (did you mean 'train.steps'?)"),
    ("train.seed=3", "train.seed: unknown key (did you mean 'seed'?)"),
    ("data.batchsize=8", "data.batchsize: unknown key (did you mean 'batch_size'?)"),
    ("loss.lr=0.1", "loss.lr=0.1: is not an option of loss 'infonce' (did you mean 'optim.lr'?)"),
])
def test_f16_a_key_in_the_wrong_section_names_the_right_one(override, hint):
    assert refused([override]).startswith(hint)


@pytest.mark.parametrize("override, fix", [
    ("train.steps=abc", "; set train.steps to a whole number (e.g. train.steps=10)"),
    ("optim.lr=abc", "; set optim.lr to one (e.g. optim.lr=0.5 or optim.lr=1e-3)"),
    ("train.compile=maybe", "; set train.compile=true or train.compile=false"),
    ("model.name=[a,b]", "; quote it (model.name='...')"),
])
def test_f16_type_errors_name_the_fix(override, fix):
    assert refused([override]).endswith(fix)


def test_f16_an_empty_model_name_says_so():
    """It was resolved as the current directory: "a folder, but not a vlcontrast run ..."."""
    assert refused(["model.name="]) == (
        "model.name='': is empty; give a model name (e.g. model.name=vlc-tiny, an open_clip name "
        "such as ViT-B-32, or a run or export folder)")


@pytest.mark.parametrize("command", ["train", "config"])
def test_f16_a_config_that_is_a_directory_says_so(tmp_path, command):
    (tmp_path / "a.yaml").write_text("train:\n  steps: 2\n")
    code, err = run_cli([command, "--config", str(tmp_path)])
    assert code == 2
    assert err.strip() == (f"vlcontrast: error: config file {str(tmp_path)!r} is a directory; "
                           "name a YAML file in it (a.yaml)")
    code, err = run_cli([command, "--config", str(tmp_path / "a.yaml" / "x")])
    assert code == 2 and "does not exist" in err


def test_f16_a_study_config_that_is_a_directory_says_so(tmp_path):
    code, err = run_cli(["study", "--config", str(tmp_path)])
    assert code == 2
    assert err.strip() == (f"vlcontrast: error: study config {str(tmp_path)!r} is a directory; "
                           "name a YAML file (configs/ has examples)")


def test_f16_prep_folder_into_its_own_image_folder_is_refused(tmp_path):
    """It wrote 00000.tar, manifest.json and _prep_state.json into the class-folder tree."""
    from PIL import Image

    (tmp_path / "cat").mkdir()
    Image.new("RGB", (8, 8), "red").save(tmp_path / "cat" / "a.jpg")
    (tmp_path / "cat" / "a.txt").write_text("a red cat")
    for out in (str(tmp_path), str(tmp_path) + "/", str(tmp_path / "cat" / "..")):
        code, err = run_cli(["prep", "folder", str(tmp_path), out, "--no-progress"])
        assert code == 2
        assert err.strip().startswith(f"vlcontrast: error: prep folder: OUT {out!r} is the image "
                                      "folder DIR itself; name another folder for the shards")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cat"]


def test_f16_prep_check_refuses_negative_workers(tmp_path):
    code, err = run_cli(["prep", "check", str(tmp_path), "--workers", "-1", "--no-progress"])
    assert code == 2
    assert err.strip() == ("vlcontrast: error: --workers -1: must be >= 0 (0 reads the data in "
                           "the main process)")


@pytest.mark.parametrize("overrides", [["train.steps=.inf"], ["optim.min_lr=.nan"],
                                       ["output_dir="], ["seed=18446744073709551617"]])
def test_config_and_train_refuse_alike_before_any_run_folder(tmp_path, monkeypatch, overrides):
    monkeypatch.chdir(tmp_path)
    base = ["train.steps=2", "output_dir=run"]
    config_code, config_err = run_cli(["config", *base, *overrides])
    train_code, train_err = run_cli(["train", *base, *overrides])
    assert config_code == train_code == 2
    line = train_err.strip()
    assert "\n" not in line and line.startswith("vlcontrast: error: ")
    assert line.removeprefix("vlcontrast: error: ") in config_err
    assert list(tmp_path.iterdir()) == []


RUN_CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml")
                     if "study" not in p.parts or p.name.startswith("cell"))


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_run_config_passes_vlcontrast_config(path):
    """Including the study's cell bases (configs/study/cell*.yaml), which every cell trains."""
    code, err = run_cli(["config", "--config", str(path)])
    assert code == 0, err
