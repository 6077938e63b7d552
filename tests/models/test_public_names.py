"""``vlcontrast.models`` names its public API in ``__all__``, as the other subpackages do: what
``from vlcontrast.models import *`` gives is the documented functions, not the module's imports
(``torch``, ``json``) or its helpers."""


def test_models_has_an_all_of_its_public_functions():
    import vlcontrast.models as models

    assert {"ModelBundle", "build_model", "load_model_from_checkpoint", "load_pretrained_model",
            "check_pretrained", "resolve_model_config"} <= set(models.__all__)
    assert all(hasattr(models, name) for name in models.__all__)
    assert len(set(models.__all__)) == len(models.__all__)
    names: dict = {}
    exec("from vlcontrast.models import *", names)
    assert not {"torch", "json", "Path", "shutil"} & set(names)
