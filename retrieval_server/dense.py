"""Dense search over unit-normalised passage embeddings: FAISS or torch.

Index types (chosen at build time, recorded in the manifest):
- ``flat``: exact inner product (``IndexFlatIP``); the default.
- ``hnsw``: graph search (``IndexHNSWFlat``, inner product); for large corpora.
- ``ivf``: inverted lists over k-means cells (``IndexIVFFlat``); for large corpora.
- ``torch``: no FAISS file; exact inner product with ``torch.topk`` on the chosen
  device (CUDA when present), so the GPU retrieval path is measurable without faiss-gpu.

Every index folder also keeps the raw embeddings (``embeddings.npy``), so the torch
backend can serve any index, and a ``torch`` index can be served by FAISS flat.

Batch invariance: a query's scores never depend on the other queries searched with it.
FAISS scores queries with per-query inner products below
``faiss.cvar.distance_compute_blas_threshold`` and through one BLAS matrix product
above it; older releases compare the query count with it, faiss 1.15 (measured) the
query count times the dimension. :class:`FaissSearcher` therefore searches in chunks
of fewer than threshold / dimension queries, one query at a time when that is below
one (HNSW is per query anyway); a GPU FAISS index gets fixed blocks like torch (not
verified here: no faiss-gpu on the machines we test on). ``torch`` multiplies fixed blocks of
:data:`QUERY_BLOCK` rows, the unused rows zero: every query then goes through a
product of one shape, and a row's result does not depend on its neighbours (a product
of varying shape changes every row: ``benchmarks/bench_invariance.py --probe``).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import numpy as np

from calibrl.errors import ConfigError, InvalidArgument

log = logging.getLogger(__name__)

INDEX_TYPES = ("flat", "hnsw", "ivf", "torch")
FAISS_FILE = "dense.faiss"
EMBEDDINGS_FILE = "embeddings.npy"
QUERY_BLOCK = 32  # rows of every torch score product (see the module doc)
FAISS_QUERY_CHUNK = 1024  # queries per FAISS call at most, fewer where the BLAS threshold needs it


class DenseSearcher(Protocol):
    def search(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """vectors: (n, d) float32 -> (scores (n, k'), indices (n, k')), best first; -1 pads."""
        ...


def default_ivf_nlist(doc_count: int) -> int:
    """About 4 * sqrt(n) cells, but at least 39 training points per cell (FAISS's rule)."""
    return max(1, min(int(4 * doc_count**0.5), doc_count // 39))


def build_faiss_index(embeddings: np.ndarray, index_type: str, *, hnsw_m: int = 32, ivf_nlist: int = 0) -> Any:
    """A FAISS inner-product index over ``embeddings`` (n, d), trained where needed."""
    import faiss

    count, dimension = embeddings.shape
    if index_type == "flat":
        index = faiss.IndexFlatIP(dimension)
    elif index_type == "hnsw":
        index = faiss.IndexHNSWFlat(dimension, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = max(40, 2 * hnsw_m)
    elif index_type == "ivf":
        nlist = ivf_nlist or default_ivf_nlist(count)
        if nlist > count:
            raise InvalidArgument("ivf_nlist", f"{nlist} cells for {count} passages; use at most {count}")
        quantizer = faiss.IndexFlatIP(dimension)
        index = faiss.IndexIVFFlat(quantizer, dimension, nlist, faiss.METRIC_INNER_PRODUCT)
        index.train(embeddings)
    else:
        raise InvalidArgument("index_type", f"{index_type!r} has no FAISS index; use one of flat, hnsw, ivf")
    index.add(embeddings)
    return index


class FaissSearcher:
    """A FAISS index, moved to the GPU when faiss-gpu is installed and a CUDA device is chosen."""

    def __init__(self, index: Any, *, device: str = "cpu", ef_search: int = 128, nprobe: int = 16) -> None:
        import faiss

        self.on_gpu = False
        if hasattr(index, "hnsw"):
            index.hnsw.efSearch = ef_search
        if hasattr(index, "nprobe"):
            index.nprobe = min(nprobe, index.nlist)
        if device.startswith("cuda") and hasattr(faiss, "StandardGpuResources") and not hasattr(index, "hnsw"):
            gpu_id = int(device.partition(":")[2] or 0)
            self._resources = faiss.StandardGpuResources()
            index = faiss.index_cpu_to_gpu(self._resources, gpu_id, index)
            self.on_gpu = True
            log.info("FAISS index moved to GPU %d", gpu_id)
        self.index = index

    def search(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        import faiss

        k = min(k, self.index.ntotal)
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if self.on_gpu:  # a GPU index multiplies every call's queries at once: fixed-shape blocks, as torch
            return self._search_blocks(vectors, k)
        threshold = int(faiss.cvar.distance_compute_blas_threshold)
        chunk = max(1, min(FAISS_QUERY_CHUNK, (threshold - 1) // max(1, vectors.shape[1])))
        parts = [self.index.search(vectors[start : start + chunk], k) for start in range(0, len(vectors), chunk)]
        if not parts:
            return np.zeros((0, k), dtype=np.float32), np.zeros((0, k), dtype=np.int64)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def _search_blocks(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        scores = np.zeros((len(vectors), k), dtype=np.float32)
        indices = np.zeros((len(vectors), k), dtype=np.int64)
        for start in range(0, len(vectors), QUERY_BLOCK):
            rows = vectors[start : start + QUERY_BLOCK]
            block = np.zeros((QUERY_BLOCK, vectors.shape[1]), dtype=np.float32)
            block[: len(rows)] = rows
            block_scores, block_indices = self.index.search(block, k)
            scores[start : start + len(rows)] = block_scores[: len(rows)]
            indices[start : start + len(rows)] = block_indices[: len(rows)]
        return scores, indices


class TorchSearcher:
    """Exact inner product and ``torch.topk`` over the embedding matrix on one device,
    in fixed blocks of :data:`QUERY_BLOCK` queries (see the module doc)."""

    def __init__(self, embeddings: np.ndarray, device: str = "cpu") -> None:
        import torch

        self.device = torch.device(device)
        self.matrix = torch.from_numpy(np.ascontiguousarray(embeddings, dtype=np.float32)).to(self.device)

    def search(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        import torch

        k = min(k, self.matrix.shape[0])
        count = len(vectors)
        scores = np.zeros((count, k), dtype=np.float32)
        indices = np.zeros((count, k), dtype=np.int64)
        with torch.inference_mode():
            queries = torch.from_numpy(np.ascontiguousarray(vectors, dtype=np.float32))
            for start in range(0, count, QUERY_BLOCK):
                rows = queries[start : start + QUERY_BLOCK]
                block = torch.zeros((QUERY_BLOCK, self.matrix.shape[1]), dtype=torch.float32)
                block[: len(rows)] = rows
                top = torch.topk(block.to(self.device) @ self.matrix.T, k, dim=1)
                scores[start : start + len(rows)] = top.values[: len(rows)].cpu().numpy()
                indices[start : start + len(rows)] = top.indices[: len(rows)].cpu().numpy()
        return scores, indices


def load_searcher(
    index_dir: Any,
    index_type: str,
    *,
    backend: str = "auto",
    device: str = "cpu",
    ef_search: int = 128,
    nprobe: int = 16,
) -> DenseSearcher:
    """The dense searcher of an index folder.

    backend: ``auto`` (the index's own type), ``faiss`` (a ``torch`` index is served by an
    in-memory flat index) or ``torch`` (exact search over ``embeddings.npy``).
    """
    import pathlib

    index_dir = pathlib.Path(index_dir)
    if backend not in ("auto", "faiss", "torch"):
        raise ConfigError(f"dense_backend={backend!r}: use auto, faiss or torch")
    if backend == "torch" or (backend == "auto" and index_type == "torch"):
        return TorchSearcher(np.load(index_dir / EMBEDDINGS_FILE), device=device)
    import faiss

    if index_type == "torch":
        index = build_faiss_index(np.load(index_dir / EMBEDDINGS_FILE), "flat")
    else:
        index = faiss.read_index(str(index_dir / FAISS_FILE))
    return FaissSearcher(index, device=device, ef_search=ef_search, nprobe=nprobe)
