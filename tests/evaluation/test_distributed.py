"""Two gloo processes evaluate exactly what one process does."""

import pytest

from tests.distributed import run_distributed
from tests.evaluation.helpers import tiny_model, write_image_folder, write_retrieval_shards


def _evaluate_all(rank, world_size, config_dir, uneven_shards, one_shard, folder):
    from vlcontrast.evaluation import evaluate_retrieval, evaluate_zeroshot

    model, preprocess, tokenizer = tiny_model(config_dir, seed=0)
    common = dict(batch_size=4, device="cpu", progress=False)
    return {
        # 3 shards of 10, 10, 3 samples: rank 0 reads 20, rank 1 reads 3 (lock-step dummies).
        "uneven": evaluate_retrieval(model, preprocess, tokenizer, uneven_shards, workers=0, **common),
        # One shard for two ranks: split by sample index; one loader worker per rank.
        "one_shard": evaluate_retrieval(model, preprocess, tokenizer, one_shard, workers=1,
                                        max_samples=9, **common),
        # 5 classes split 2/3 across ranks for the classifier; images split by index.
        "zeroshot": evaluate_zeroshot(model, preprocess, tokenizer, folder,
                                      templates=["a photo of a {c}.", "a {c}"], workers=0, **common),
    }


@pytest.mark.slow
def test_two_process_evaluation_equals_single_process(tmp_path):
    uneven, one = tmp_path / "uneven", tmp_path / "one"
    write_retrieval_shards(uneven, 23, per_shard=10, captions_per_image=lambda i: 1 + i % 2)
    write_retrieval_shards(one, 11, per_shard=11, captions_per_image=2, style="json")
    write_image_folder(tmp_path / "folder", [f"class_{i}" for i in range(5)], per_class=3)
    args = (str(tmp_path / "configs"), str(uneven), str(one), str(tmp_path / "folder"))
    single = _evaluate_all(0, 1, *args)
    results = run_distributed(_evaluate_all, 2, *args)
    assert results[0] == results[1]  # every rank returns the same dict
    assert single["uneven"]["num_images"] == 23 and single["one_shard"]["num_images"] == 9
    assert single["zeroshot"]["num_images"] == 15
    for task in single:
        for key, value in single[task].items():
            assert results[0][task][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (task, key)
