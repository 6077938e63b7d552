"""Fixtures and hooks shared across test folders: DeepSpeed's accelerator on a host without CUDA,
the ``cuda`` marker (skipped without CUDA), the small synthetic worlds training tests read."""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()

# DeepSpeed picks its accelerator at import. Without CUDA it must be the CPU one; with CUDA the
# package chooses (vlcontrast.distributed), so nothing is forced here and GPU tests use the GPU.
if not CUDA:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA (run `make gpu-check` on a GPU machine)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def synthetic_world(tmp_path_factory, name: str = "synthetic", *, train: int, val: int,
                    zeroshot_per_class: int, shard_size: int, seed: int = 0):
    """A synthetic world of 32-px images (``train/``, ``val/``, ``zeroshot/``) in a new folder."""
    from vlcontrast.data.prep.synthetic import write_synthetic

    root = tmp_path_factory.mktemp(name)
    write_synthetic(root, train=train, val=val, zeroshot_per_class=zeroshot_per_class, seed=seed,
                    image_size=32, shard_size=shard_size, workers=1, progress=False)
    return root


@pytest.fixture(scope="session")
def synthetic_data(tmp_path_factory):
    """256 training samples in 4 shards, 32 validation, 2 zero-shot images per class."""
    return synthetic_world(tmp_path_factory, train=256, val=32, zeroshot_per_class=2,
                           shard_size=64)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """64 training samples in 2 shards, 8 validation, 1 zero-shot image per class."""
    return synthetic_world(tmp_path_factory, train=64, val=8, zeroshot_per_class=1, shard_size=32)


@pytest.fixture(scope="session")
def hf_text_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("hf-bert")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "red", "blue", "circle", "square",
             "small", "large", "two"]
    vocab = {w: i for i, w in enumerate(words)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", pad_token="[PAD]",
                                        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    tokenizer.save_pretrained(folder)
    config = BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=32)
    BertModel(config).save_pretrained(folder)
    return folder
