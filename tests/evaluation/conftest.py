import pytest

from tests.evaluation.helpers import tiny_model, write_fake_checkpoint


@pytest.fixture(scope="session")
def model_config_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("open_clip_configs")


@pytest.fixture(scope="session")
def tiny(model_config_dir):
    """(model, preprocess, tokenizer) of a randomly initialised tiny open_clip model."""
    return tiny_model(model_config_dir, seed=0)


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny, tmp_path_factory):
    """A run directory holding the tiny model in the documented checkpoint layout."""
    run_dir = tmp_path_factory.mktemp("run")
    write_fake_checkpoint(run_dir, tiny[0])
    return run_dir
