"""Helpers for tests, benchmarks and examples, shared by all of them (they are not
part of the services). Nothing here downloads anything; heavy modules load on first use.

- tiny models (:mod:`calibrl.testing.tiny_lm`): ``build_tiny_causal_lm`` (a judge-sized
  model folder), ``build_tokenizer`` / ``build_model`` / ``save_tiny_policy`` (a tiny
  policy), ``SIMPLE_CHAT_TEMPLATE``;
- SME feedback (:mod:`calibrl.testing.feedback`): ``synthetic_feedback``,
  ``SYNTHETIC_GLOSSARY``;
- retrieval (:mod:`calibrl.testing.retrieval`): ``TINY_CORPUS``, ``build_test_index``,
  ``config_for_tests``, ``start_test_server`` (a real server on a free loopback port);
- log-probs (:mod:`calibrl.testing.logprobs`): ``sequence_logprobs``, a model's log-prob of
  every position of a batch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SIMPLE_CHAT_TEMPLATE": "tiny_lm",
    "build_tiny_causal_lm": "tiny_lm",
    "build_tokenizer": "tiny_lm",
    "build_model": "tiny_lm",
    "save_tiny_policy": "tiny_lm",
    "synthetic_feedback": "feedback",
    "SYNTHETIC_GLOSSARY": "feedback",
    "TINY_CORPUS": "retrieval",
    "build_test_index": "retrieval",
    "config_for_tests": "retrieval",
    "start_test_server": "retrieval",
    "sequence_logprobs": "logprobs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'calibrl.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"calibrl.testing.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
