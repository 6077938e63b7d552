"""Using a trained model: :func:`load` it with open_clip's conventions, :func:`classify` your own
images zero-shot, embed images or texts (:func:`embed_images`, :func:`embed_texts`) and write them
(:func:`write_embeddings`).

Everything here reads models through :func:`vlcontrast.models.load_model_from_checkpoint` (the
loader of ``vlcontrast eval``) and images through the evaluation readers, so a run directory, a
checkpoint directory and an export give the same numbers everywhere.
"""

from vlcontrast.inference.classify import (DEFAULT_TEMPLATES, Classification, classify,
                                           format_classification, parse_labels)
from vlcontrast.inference.embed import (Embeddings, check_output, embed_images, embed_texts,
                                        read_texts, write_embeddings)
from vlcontrast.inference.images import find_images
from vlcontrast.inference.model import load, resolve_device

__all__ = [
    "DEFAULT_TEMPLATES",
    "Classification",
    "Embeddings",
    "check_output",
    "classify",
    "embed_images",
    "embed_texts",
    "find_images",
    "format_classification",
    "load",
    "parse_labels",
    "read_texts",
    "resolve_device",
    "write_embeddings",
]
