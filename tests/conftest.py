"""Fixtures and hooks shared across test folders: DeepSpeed's accelerator on a host without CUDA,
the ``cuda`` marker (skipped without CUDA)."""

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
