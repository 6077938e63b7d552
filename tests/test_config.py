"""Config: defaults, overrides, and one clear error naming the key for every kind of bad input."""

import pytest
import yaml

from vlcontrast.config import ConfigError, RunConfig, describe, load_config, save_config, to_dict


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_yaml_and_overrides(tmp_path):
    path = write(tmp_path, "data:\n  batch_size: 32\ntrain:\n  steps: 10\nloss:\n  name: dcl\n")
    config = load_config(path, ["optim.lr=0.01", "train.precision=bf16", "deepspeed.zero_stage=2"])
    assert config.data.batch_size == 32
    assert config.optim.lr == pytest.approx(0.01)
    assert config.train.precision == "bf16"
    assert config.deepspeed.zero_stage == 2
    assert config.loss.name == "dcl"


def test_loss_options_are_flat_and_round_trip(tmp_path):
    config = load_config(None, ["train.steps=5", "loss.name=debiased", "loss.tau_plus=0.05"])
    assert config.loss.options == {"tau_plus": 0.05}
    save_config(config, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["loss"] == {"name": "debiased", "chunk_size": 0, "tau_plus": 0.05}
    again = load_config(tmp_path / "config.yaml")
    assert to_dict(again) == to_dict(config)


@pytest.mark.parametrize("override, needle", [
    ("data.batchsize=3", "data.batchsize: unknown key"),
    ("data.batch_size=0", "data.batch_size=0"),
    ("data.batch_size=abc", "data.batch_size='abc': expected an integer"),
    ("train.precision=fp8", "train.precision='fp8'"),
    ("deepspeed.zero_stage=4", "deepspeed.zero_stage=4"),
    ("loss.name=nope", "loss.name='nope'"),
    ("loss.tau_plus=0.1", "loss.tau_plus"),          # infonce has no tau_plus
    ("optim.lr=-1", "optim.lr=-1"),
    ("optim.betas=[0.9]", "optim.betas"),
    ("bogus=1", "bogus: unknown key; known: checkpoint, data,"),
    ("optim.lrr=0.1", "optim.lrr: unknown key (did you mean 'lr'?); known: betas, eps,"),
])
def test_errors_name_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.steps=5", override])
    assert needle in str(err.value)


def test_a_loss_option_typo_is_named_with_the_option_it_is_close_to():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.steps=5", "loss.name=decl", "loss.gammma=0.5"]).check()
    assert str(err.value).startswith("loss.gammma=0.5: is not an option of loss 'decl' (did you "
                                     "mean 'gamma'?); its options: ema_decay, estimator, gamma,")
    with pytest.raises(ConfigError) as err:  # nothing close: no guess
        load_config(None, ["train.steps=5", "loss.name=decl", "loss.zzz=1"]).check()
    assert "did you mean" not in str(err.value)


def test_steps_or_epochs_required():
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(None, [])


def test_steps_and_epochs_together_are_refused(tmp_path):
    """Both set used to train train.steps and ignore train.epochs without a word."""
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "train:\n  epochs: 30\n"), ["train.steps=100"])
    assert str(err.value) == ("train.steps=100 and train.epochs=30.0: both set the run's length; "
                              "set one of them and leave the other 0 (e.g. add train.epochs=0 "
                              "to run train.steps)")
    assert load_config(None, ["train.epochs=2"]).train.steps == 0  # each alone is fine
    assert load_config(None, ["train.steps=2", "train.epochs=0"]).train.steps == 2


@pytest.mark.parametrize("override, needle", [
    ("eval.every=-1", "eval.every=-1: must be >= 0 (N: evaluate every N optimizer steps and at "
                      "the end; 0: only at the end)"),
    ("eval.batch_size=0", "eval.batch_size=0: must be >= 1"),
    ("eval.max_samples=-5", "eval.max_samples=-5: must be >= 0 (0: every sample)"),
    ("checkpoint.every=-2", "checkpoint.every=-2: must be >= 0 (N: save every N optimizer steps"),
    ("checkpoint.keep=0", "checkpoint.keep=0: must be >= 1 (the newest N checkpoints are kept)"),
    ("train.log_every=-1", "train.log_every=-1: must be >= 1 (a metrics.jsonl line every N"),
    ("data.shuffle_buffer=-1", "data.shuffle_buffer=-1: must be >= 0 (0: no shuffle buffer)"),
])
def test_negative_cadences_are_refused(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.steps=5", override])
    assert str(err.value).startswith(needle) and "\n" not in str(err.value)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, "data: [unclosed\n"))
    # where and what, on one line (yaml's own text spans four, with a caret)
    assert str(caught.value).startswith(f"config file {str(tmp_path / 'run.yaml')!r} is not "
                                        "valid YAML (line 2, column 1: expected ',' or ']'")
    assert str(caught.value).endswith("; fix it there") and "\n" not in str(caught.value)


def test_every_option_is_documented():
    rows = describe()
    keys = {key for key, _, _ in rows}
    for key in ("output_dir", "seed", "data.train", "data.val", "data.num_samples", "data.batch_size",
                "data.workers", "model.name", "loss.name", "optim.lr", "optim.weight_decay",
                "optim.warmup_steps", "train.steps", "train.epochs", "train.precision",
                "train.accum_steps", "train.resume", "deepspeed.zero_stage", "checkpoint.every",
                "checkpoint.keep", "eval.every", "eval.zeroshot", "eval.retrieval"):
        assert key in keys
    undocumented = [key for key, _, doc in rows if not doc]
    assert not undocumented, undocumented
    assert isinstance(RunConfig().data.batch_size, int)


def test_scientific_notation_without_dot_is_a_number():
    config = load_config(None, ["train.steps=5", "optim.lr=2e-3"])
    assert config.optim.lr == pytest.approx(2e-3)


def test_choices_are_literals_checked_from_the_type():
    """train.precision, train.device, data.mode, deepspeed.zero_stage and the losses' choice
    options (DeCL's estimator, FastCLIP's temperature) are Literal types: a wrong value is named
    with its choices, whether it came from YAML, the command line or code."""
    import typing

    from vlcontrast.config import DataConfig, DeepSpeedConfig, TrainConfig

    hints = {**typing.get_type_hints(TrainConfig), **typing.get_type_hints(DataConfig),
             **typing.get_type_hints(DeepSpeedConfig)}
    for key in ("precision", "device", "mode", "zero_stage"):
        assert typing.get_origin(hints[key]) is typing.Literal, key
    base = ["data.train=x", "train.steps=1"]
    with pytest.raises(ConfigError, match="loss.estimator='bufer': must be one of buffer, momentum"):
        load_config(None, base + ["loss.name=decl", "loss.estimator=bufer"])
    with pytest.raises(ConfigError, match="loss.temperature='local': must be one of fixed, global"):
        load_config(None, base + ["loss.name=fastclip", "loss.temperature=local"])
    assert load_config(None, base + ["deepspeed.zero_stage=2"]).deepspeed.zero_stage == 2
    config = load_config(None, base)
    config.train.precision = "fp8"  # set in code, not parsed
    with pytest.raises(ConfigError, match="train.precision='fp8': must be one of fp32"):
        config.check()


@pytest.mark.parametrize("overrides, line", [
    (["loss.name=sogclr", "loss.gamma=1.5"],
     "loss.gamma=1.5: must be in (0, 1] (loss.name=sogclr); set loss.gamma to a value"),
    (["loss.name=fastclip", "loss.gamma=0"], "loss.gamma=0.0: must be in (0, 1]"),
    (["loss.name=sogclr", "loss.gamma=abc"], "loss.gamma='abc': expected a number"),
    (["loss.name=hcl", "loss.beta=abc"], "loss.beta='abc': expected a number"),
    (["loss.name=debiased", "loss.tau_plus=2"], "loss.tau_plus=2.0: must be in [0, 1)"),
    (["loss.name=dclw", "loss.sigma=0"], "loss.sigma=0.0: must be > 0"),
    (["loss.name=fastclip", "loss.tau_min=0.5", "loss.tau_max=0.1"],
     "loss.tau_min=0.5, loss.tau_max=0.1: need 0 < tau_min < tau_max (loss.name=fastclip); "
     "set loss.tau_min or loss.tau_max to"),
    (["loss.name=infonce", "loss.chunk_size=-1"], "loss.chunk_size=-1: must be >= 0"),
    (["loss.name=sogclr", "loss.eps=0.1"], "loss.eps=0.1: belongs to recipe='fast_clip'"),
    (["loss.name=fastclip", "loss.recipe=fast_clip", "loss.gamma_decay_steps=5"],
     "loss.gamma_decay_steps=5: recipe='fast_clip' counts the gamma schedule in epochs"),
    # BCL: alpha and beta are mixture weights of the eCDF densities; outside [0, 1] the weights
    # go NaN, and alpha = beta = 1 (or 0) makes every weight 0 (loss 0, no gradient).
    (["loss.name=bcl", "loss.alpha=-1"], "loss.alpha=-1.0: must be in [0, 1] (a mixture weight"),
    (["loss.name=bcl", "loss.alpha=1.5"], "loss.alpha=1.5: must be in [0, 1] (a mixture weight"),
    (["loss.name=bcl", "loss.beta=5"], "loss.beta=5.0: must be in [0, 1] (a mixture weight"),
    (["loss.name=bcl", "loss.beta=-0.1"], "loss.beta=-0.1: must be in [0, 1] (a mixture weight"),
    (["loss.name=bcl", "loss.alpha=nan"], "loss.alpha=nan: must be in [0, 1] (a mixture weight"),
    (["loss.name=bcl", "loss.alpha=1.0"],
     "loss.alpha=1.0, loss.beta=1.0: alpha = beta = 1 (or 0) makes every weight 0"),
    (["loss.name=bcl", "loss.alpha=0", "loss.beta=0"],
     "loss.alpha=0.0, loss.beta=0.0: alpha = beta = 1 (or 0) makes every weight 0"),
    (["loss.name=balanced", "loss.lam=-1"], "loss.lam=-1.0: must be > 0 and finite"),
    (["loss.name=balanced", "loss.lam=0"], "loss.lam=0.0: must be > 0 and finite"),
    (["loss.name=balanced", "loss.lam=inf"], "loss.lam=inf: must be > 0 and finite"),
    (["loss.name=balanced", "loss.alpha=nan"], "loss.alpha=nan: must be > 0"),
    (["loss.name=decl", "loss.schedule=weighted", "loss.lambda_c=-1"],
     "loss.lambda_c=-1.0: must be >= 0 (lam_t = min(1, lambda_c / t)"),
    (["loss.name=dclw", "loss.sigma=nan"], "loss.sigma=nan: must be > 0"),
    (["loss.name=hcl", "loss.beta=nan"], "loss.beta=nan: must be >= 0"),
    (["loss.name=fastclip", "loss.temperature=global", "loss.rho=nan"],
     "loss.rho=nan: must be a finite number"),
    (["loss.name=fastclip", "loss.temperature=individual", "loss.tau_lr=nan"],
     "loss.tau_lr=nan: must be >= 0"),
])
def test_a_loss_options_value_is_checked_with_the_config_naming_its_key(overrides, line):
    """The losses' own range checks run when the config is checked (before any model is built),
    as one line naming the ``loss.*`` key and the loss, not the class that raised."""
    from vlcontrast.config import ConfigError, load_config

    with pytest.raises(ConfigError) as caught:
        load_config(None, ["train.steps=1", *overrides]).check()
    assert str(caught.value).startswith(line), str(caught.value)
    assert "\n" not in str(caught.value) and "decl:" not in str(caught.value)


@pytest.mark.parametrize("overrides", [
    ["loss.name=bcl", "loss.alpha=1", "loss.beta=0.5"],     # alpha's edges, beta inside
    ["loss.name=bcl", "loss.alpha=0", "loss.beta=1"],
    ["loss.name=bcl", "loss.alpha=1", "loss.beta=0"],       # beta's edges, alpha != beta
    ["loss.name=bcl", "loss.alpha=0.5", "loss.beta=0"],
    ["loss.name=bcl", "loss.alpha=0", "loss.beta=0.5", "loss.tau_plus=0"],
    ["loss.name=balanced", "loss.lam=1e-3"],
    ["loss.name=decl", "loss.schedule=weighted", "loss.lambda_c=0"],   # lambda_t = 0: loss_2
    ["loss.name=dclw", "loss.sigma=inf"],                   # the documented DCL limit
])
def test_a_loss_options_edge_value_is_accepted(overrides):
    """The edges of the ranges the losses check still build (and ``check`` passes)."""
    load_config(None, ["train.steps=1", *overrides]).check()


def test_loss_options_are_converted_to_their_declared_types():
    from vlcontrast.config import load_config

    config = load_config(None, ["train.steps=1", "loss.name=sogclr", "loss.gamma=1",
                                "loss.shard_buffer=true"])
    config.check()
    assert config.loss.options["gamma"] == 1.0 and type(config.loss.options["gamma"]) is float
    assert config.loss.options["shard_buffer"] is True


def test_deepspeed_overrides_pass_numbers_yaml_reads_as_text():
    """``5e8`` is text to YAML 1.1, and DeepSpeed's schema refuses text where it wants a number."""
    config = load_config(None, ["train.steps=1",
                                "deepspeed.overrides.zero_optimization.reduce_bucket_size=5e8",
                                "deepspeed.overrides.optimizer.params.eps=1e-8",
                                "deepspeed.overrides.comms_logger.prof_ops=[5e2]",
                                "deepspeed.overrides.tag=v5e8"])
    overrides = config.deepspeed.overrides
    assert overrides["zero_optimization"]["reduce_bucket_size"] == 500_000_000
    assert isinstance(overrides["zero_optimization"]["reduce_bucket_size"], int)
    assert overrides["optimizer"]["params"]["eps"] == 1e-8
    assert overrides["comms_logger"]["prof_ops"] == [500] and overrides["tag"] == "v5e8"


def test_the_momentum_estimator_under_zero_3_is_refused_with_the_config():
    """It was refused only once DeepSpeed had started (with its warnings before the line)."""
    with pytest.raises(ConfigError, match=r"^deepspeed\.zero_stage=3: with loss\.estimator="
                                          r"'momentum' .* must be <= 2"):
        load_config(None, ["train.steps=1", "loss.name=decl", "loss.estimator=momentum",
                           "deepspeed.zero_stage=3"])
    load_config(None, ["train.steps=1", "loss.name=decl", "loss.estimator=momentum",
                       "deepspeed.zero_stage=2"])


@pytest.mark.parametrize("override, message", [
    ("loss.nme=dcl", "loss.nme='dcl': is not an option of loss 'infonce' (did you mean 'name'?); "
                     "its options: none"),
    ("loss.chunk_sise=8", "loss.chunk_sise=8: is not an option of loss 'infonce' (did you mean "
                          "'chunk_size'?); its options: none"),
    ("loss.gamma=0.5", "loss.gamma=0.5: is not an option of loss 'infonce' (an option of decl, "
                       "fastclip, sogclr); its options: none"),
    ("loss.options.gamma=0.5", "loss.options={'gamma': 0.5}: the options go flat in the loss "
                               "section: set loss.gamma=0.5 (YAML: gamma under loss), not "
                               "loss.options.gamma=0.5"),
])
def test_a_key_of_the_loss_section_that_fits_no_option_says_what_was_meant(override, message):
    """Typos of the section's own keys read "its options: none"; loss.options (listed by
    `vlcontrast config`) was refused as an option of the loss."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.steps=1", override])
    assert str(err.value) == message


def test_nested_loss_options_are_refused_with_the_users_own_keys_and_values():
    """`loss.options.beta=0.5` was answered with a fixed "loss.gamma=0.5" example."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.steps=10", "loss.name=hcl", "loss.options.beta=0.5"])
    assert str(err.value) == ("loss.options={'beta': 0.5}: the options go flat in the loss "
                              "section: set loss.beta=0.5 (YAML: beta under loss), not "
                              "loss.options.beta=0.5")


@pytest.mark.parametrize("overrides, message", [
    (["loss.name=dlc"], "loss.name='dlc': must be one of balanced, bcl, dcl, dclw, debiased, "
                        "decl, fastclip, hcl, infonce, siglip, sogclr (did you mean 'dcl'?); "
                        "set loss.name to one of these"),
    (["loss.name=HCL"], "loss.name='HCL': must be one of balanced, bcl, dcl, dclw, debiased, "
                        "decl, fastclip, hcl, infonce, siglip, sogclr (did you mean 'hcl'?); "
                        "set loss.name to one of these"),
    (["loss.name=decl", "loss.estimator=buffr"],
     "loss.estimator='buffr': must be one of buffer, momentum, batch (did you mean 'buffer'?) "
     "(loss.name=decl); set loss.estimator to one of these"),
    (["loss.name=sogclr", "loss.recipe=fastclip"],
     "loss.recipe='fastclip': must be one of paper, fast_clip (did you mean 'fast_clip'?) "
     "(loss.name=sogclr); set loss.recipe to one of these"),
    (["loss.name=decl", "loss.estimator=zzz"],
     "loss.estimator='zzz': must be one of buffer, momentum, batch (loss.name=decl); set "
     "loss.estimator to one of these"),
])
def test_a_mistyped_loss_or_choice_says_what_was_meant_and_how_to_fix_it(overrides, message):
    """`loss.name=dlc` and `loss.estimator=buffr` gave the choices with no did-you-mean, no loss
    named and no fix."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.steps=10", *overrides])
    assert str(err.value) == message


def test_the_loss_section_is_checked_before_the_would_not_train_checks():
    """With the defaults (train.steps=0), `loss.name=dlc` was hidden behind "train.steps=0"."""
    with pytest.raises(ConfigError, match=r"^loss\.name='dlc': .*\(did you mean 'dcl'\?\)"):
        load_config(None, ["loss.name=dlc"])
    with pytest.raises(ConfigError, match=r"^loss\.betta=0\.5: is not an option of loss 'hcl'"):
        load_config(None, ["loss.name=hcl", "loss.betta=0.5"])
    with pytest.raises(ConfigError, match=r"^train\.steps=0"):
        load_config(None, ["loss.name=hcl", "loss.beta=0.5"])
