"""A tiny corpus, an index built from dicts, and a retrieval server on a free loopback
port, for tests and benchmarks.

    from calibrl.testing import TINY_CORPUS, build_test_index, start_test_server

    index_dir = build_test_index(tmp_path / "index")            # real MiniLM, FAISS, BM25
    running = await start_test_server(index_dir)                  # real grpc.aio on port 0
    ...
    await running.stop(grace=1.0)
"""

from __future__ import annotations

import pathlib
from typing import Any, Iterable

# Twelve short passages on distinct topics; two per topic family so rankings have
# a clear winner and a plausible runner-up.
TINY_CORPUS: list[dict[str, str]] = [
    {"_id": "eiffel", "title": "Eiffel Tower",
     "text": "The Eiffel Tower is a wrought-iron lattice tower in Paris, completed in 1889 for the World's Fair."},
    {"_id": "louvre", "title": "Louvre",
     "text": "The Louvre in Paris is the world's most visited art museum and home of the Mona Lisa."},
    {"_id": "photosynthesis", "title": "Photosynthesis",
     "text": "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide "
             "to make glucose and release oxygen."},
    {"_id": "chlorophyll", "title": "Chlorophyll",
     "text": "Chlorophyll is the green pigment in plant leaves that absorbs red and blue light."},
    {"_id": "python", "title": "Python (programming language)",
     "text": "Python is a high-level programming language created by Guido van Rossum and first released in 1991."},
    {"_id": "rust", "title": "Rust (programming language)",
     "text": "Rust is a systems programming language focused on memory safety without a garbage collector."},
    {"_id": "everest", "title": "Mount Everest",
     "text": "Mount Everest in the Himalayas is Earth's highest mountain above sea level, at 8,849 metres."},
    {"_id": "nile", "title": "Nile",
     "text": "The Nile is a major river in northeastern Africa flowing north into the Mediterranean Sea."},
    {"_id": "bach", "title": "Johann Sebastian Bach",
     "text": "Johann Sebastian Bach was a German composer of the Baroque period, known for the Brandenburg Concertos."},
    {"_id": "mozart", "title": "Wolfgang Amadeus Mozart",
     "text": "Mozart was a prolific Austrian composer of the Classical period who wrote The Magic Flute."},
    {"_id": "insulin", "title": "Insulin",
     "text": "Insulin is a hormone made by the pancreas that lets cells absorb glucose from the blood."},
    {"_id": "penicillin", "title": "Penicillin",
     "text": "Penicillin, discovered by Alexander Fleming in 1928, was the first widely used antibiotic."},
]


def build_test_index(out_dir: str | pathlib.Path, records: Iterable[dict[str, Any]] | None = None,
                     **options: Any) -> pathlib.Path:
    """Build an index folder from dicts (default: :data:`TINY_CORPUS`) on the CPU; returns its path."""
    from calibrl.retrieval_server.index import build_index_from_dicts

    options.setdefault("device", "cpu")
    build_index_from_dicts(TINY_CORPUS if records is None else records, out_dir, **options)
    return pathlib.Path(out_dir)


def config_for_tests(index_dir: str | pathlib.Path, *overrides: str) -> Any:
    """A RetrievalServerConfig for tests: loopback, port 0, CPU, short grace; plus ``key=value`` overrides."""
    from calibrl.config import load_config
    from calibrl.retrieval_server.config import RetrievalServerConfig

    base = [f"index_dir={index_dir}", "serving.port=0", "serving.host=127.0.0.1", "device=cpu",
            "serving.grace_seconds=2"]
    return load_config(RetrievalServerConfig, None, [*base, *overrides])


async def start_test_server(index_dir: str | pathlib.Path, *overrides: str, retriever: Any = None) -> Any:
    """Start a real retrieval server on a free loopback port in the running event loop."""
    from calibrl.retrieval_server.server import start

    return await start(config_for_tests(index_dir, *overrides), retriever=retriever)
