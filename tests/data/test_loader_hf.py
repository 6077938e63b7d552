"""The loader tokenises with a Hugging Face tokenizer (an HF text tower) inside its workers."""

from vlcontrast.config import DataConfig, ModelConfig
from vlcontrast.data.loader import build_train_loader
from vlcontrast.models import build_model
from tests.data.helpers import caption_of


def test_loader_uses_the_hf_tokenizer_of_an_hf_text_tower(hf_text_dir, uneven_shards):
    bundle = build_model(ModelConfig(name="vlc-micro", hf_model_dir=str(hf_text_dir)))
    pattern, _ = uneven_shards
    data = DataConfig(train=pattern, batch_size=4, workers=1, shuffle_buffer=0)
    loader = build_train_loader(data, bundle.preprocess_val, bundle.tokenizer, seed=0, rank=0,
                                world_size=1)
    batch = next(iter(loader))
    assert batch.images.shape == (4, 3, 32, 32)
    expected = bundle.tokenizer([caption_of(int(i)) for i in batch.sample_ids])
    assert batch.texts.shape == expected.shape
    assert (batch.texts == expected).all()
    assert (batch.texts[:, 0] == 5).all()  # "a" in the local vocabulary: the HF tokenizer was used
