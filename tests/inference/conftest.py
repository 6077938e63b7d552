import pytest

from tests.evaluation.helpers import tiny_model, write_fake_checkpoint
from tests.inference.helpers import write_user_images


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """(model, preprocess, tokenizer) of a tiny model saved as a run directory, and that run."""
    root = tmp_path_factory.mktemp("inference")
    model, preprocess, tokenizer = tiny_model(root / "configs", seed=3)
    run_dir = root / "run"
    write_fake_checkpoint(run_dir, model)
    return (model, preprocess, tokenizer), run_dir


@pytest.fixture(scope="session")
def exported(trained, tmp_path_factory):
    from vlcontrast.export import export_open_clip

    out = tmp_path_factory.mktemp("export")
    export_open_clip(str(trained[1]), out)
    return out


@pytest.fixture(scope="session")
def user_images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("photos")
    return folder, write_user_images(folder)
