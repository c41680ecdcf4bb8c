"""sentence-transformers' module classes, where this installed version keeps them."""

from __future__ import annotations

from types import SimpleNamespace


def st_modules() -> SimpleNamespace:
    """`Transformer`, `Pooling`, `Dense` and `Normalize` (sentence-transformers 6 moved them
    from `sentence_transformers.models`)."""
    try:
        from sentence_transformers.base.modules import Dense, Normalize, Transformer
        from sentence_transformers.sentence_transformer.modules import Pooling
    except ImportError:
        from sentence_transformers.models import Dense, Normalize, Pooling, Transformer
    return SimpleNamespace(
        Transformer=Transformer, Pooling=Pooling, Dense=Dense, Normalize=Normalize
    )
