"""Judge backends behind one interface, selected by a judge SPEC string.

=============================== ===========================================================
SPEC                            backend
=============================== ===========================================================
``programmatic``                no LLM: only programmatic criteria can be scored
``transformers:/path/to/model`` any Hugging Face causal LM from a local folder (CPU or GPU)
``vllm:/path/to/model``         vLLM with prefix caching (the ``gpu`` extra)
=============================== ===========================================================

An LLM backend scores the LLM criteria of a batch of items
(:meth:`LLMBackend.score`); programmatic criteria are scored by the judge itself
with every backend. The model id that validation records are bound to is
``<backend>:<model folder name>@<fingerprint>`` (the fingerprint hashes the model's
config, tokenizer files and the size and first and last MiB of each weight file, so a
retrained model at the same path gets a new id).
"""

from __future__ import annotations

import hashlib
import pathlib
from dataclasses import dataclass
from typing import Protocol, Sequence

from calibrl.errors import ConfigError
from calibrl.judge_server.rubric import Criterion, Rubric
from calibrl.api.judge import JudgeItem

BACKENDS = ("programmatic", "transformers", "vllm")


@dataclass(frozen=True)
class JudgeSpec:
    backend: str
    model_path: str = ""

    def __str__(self) -> str:
        return f"{self.backend}:{self.model_path}" if self.model_path else self.backend


def parse_spec(spec: str) -> JudgeSpec:
    """``programmatic`` | ``transformers:PATH`` | ``vllm:PATH``."""
    backend, _, path = spec.strip().partition(":")
    if backend not in BACKENDS:
        raise ConfigError(f"judge spec {spec!r}: backend must be one of {list(BACKENDS)} "
                          "(e.g. 'programmatic', 'transformers:/models/judge', 'vllm:/models/judge')")
    if backend == "programmatic":
        if path:
            raise ConfigError(f"judge spec {spec!r}: the programmatic backend takes no model path")
        return JudgeSpec("programmatic")
    if not path:
        raise ConfigError(f"judge spec {spec!r}: {backend} needs a model folder, e.g. '{backend}:/models/judge'")
    return JudgeSpec(backend, path)


class LLMBackend(Protocol):
    """Scores LLM criteria. Implementations: transformers (hf.py), vLLM (vllm_backend.py)."""

    model_id: str

    def check_rubric(self, rubric: Rubric) -> None:
        """Raise ConfigError when this model cannot score the rubric's LLM criteria."""
        ...

    def score(self, items: Sequence[JudgeItem], criteria: Sequence[Criterion], instructions: str) -> list[list[float]]:
        """Scores in [0, 1], one row per item, one column per criterion (all ``kind == 'llm'``)."""
        ...


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


def model_fingerprint(path: str | pathlib.Path) -> str:
    """A 12-hex-digit fingerprint of a model folder (see module doc); cheap on large models."""
    folder = pathlib.Path(path)
    if not folder.is_dir():
        raise ConfigError(f"judge model folder {folder} does not exist")
    digest = hashlib.sha256()
    for name in _CONFIG_FILES:
        file = folder / name
        if file.is_file():
            digest.update(name.encode() + b"\0" + file.read_bytes() + b"\0")
    weights = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    if not weights:
        raise ConfigError(f"judge model folder {folder} has no weight files ({', '.join(_WEIGHT_SUFFIXES)})")
    chunk = 1 << 20
    for file in weights:
        size = file.stat().st_size
        digest.update(f"{file.relative_to(folder)}\0{size}\0".encode())
        with file.open("rb") as handle:
            digest.update(handle.read(chunk))
            if size > chunk:
                handle.seek(max(chunk, size - chunk))
                digest.update(handle.read(chunk))
    return digest.hexdigest()[:12]


def model_id_for(backend: str, path: str | pathlib.Path) -> str:
    folder = pathlib.Path(path)
    return f"{backend}:{folder.resolve().name}@{model_fingerprint(folder)}"
