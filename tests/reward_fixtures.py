"""Fixtures shared by the reward and client tests: a real tiny index, its retriever, and a
folder holding a programmatic rubric. Import the fixtures into a test module to use them."""

from __future__ import annotations

import pytest

from calibrl.retrieval_server.retriever import Retriever
from calibrl.testing import build_test_index

RUBRIC_YAML = """\
id: rewrite-test
version: "1"
description: Programmatic test rubric for query rewrites.
criteria:
  - {name: coverage, kind: programmatic, scorer: entity_coverage, weight: 0.5}
  - {name: specific, kind: programmatic, scorer: specificity, weight: 0.3}
  - {name: length, kind: programmatic, scorer: length, weight: 0.2}
"""


@pytest.fixture(scope="module")
def tiny_index(tmp_path_factory):
    return build_test_index(tmp_path_factory.mktemp("reward-fixtures") / "index")


@pytest.fixture(scope="module")
def retriever(tiny_index):
    return Retriever.load(tiny_index, device="cpu")


@pytest.fixture(scope="module")
def rubric_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rubrics")
    (folder / "rewrite-test.yaml").write_text(RUBRIC_YAML)
    return folder
