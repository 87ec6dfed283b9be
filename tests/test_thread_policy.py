"""The thread policy a server sets at start (calibrl.threads): the user's OpenMP wait
policy wins, torch's thread count is set and reported, bad values are refused at load."""

from __future__ import annotations

import pytest

from calibrl.errors import ConfigError
from calibrl.threads import apply_thread_policy, passive_openmp


def test_passive_openmp_is_a_default_the_user_overrides(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    passive_openmp()
    import os

    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    passive_openmp()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_the_policy_sets_and_reports_torch_threads(monkeypatch, caplog):
    import logging

    import torch

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    try:
        with caplog.at_level(logging.INFO, logger="calibrl.threads"):
            policy = apply_thread_policy(2, "judge server")
        assert torch.get_num_threads() == 2
        assert policy == {"torch_threads": "2", "omp_wait_policy": "PASSIVE"}
        assert "judge server thread policy: 2 torch thread(s)" in caplog.text
        assert apply_thread_policy(0, "judge server")["torch_threads"] == "2"  # 0 keeps what is set
    finally:
        torch.set_num_threads(before)


def test_judge_server_config_refuses_negative_threads_and_cache():
    from calibrl.config import load_config
    from calibrl.judge_server.config import JudgeServerConfig

    with pytest.raises(ConfigError, match="torch_threads=-1"):
        load_config(JudgeServerConfig, None, ["rubrics=x", "torch_threads=-1"])
    with pytest.raises(ConfigError, match="judge.embedder_cache_size=-2"):
        load_config(JudgeServerConfig, None, ["rubrics=x", "judge.embedder_cache_size=-2"])
    config = load_config(JudgeServerConfig, None, ["rubrics=x", "torch_threads=3"])
    assert config.torch_threads == 3 and config.judge.embedder_backend == "auto"


def test_retrieval_config_refuses_a_negative_cache():
    from calibrl.config import load_config
    from calibrl.retrieval_server.config import RetrievalServerConfig

    with pytest.raises(ConfigError, match="embedding_cache_size=-1"):
        load_config(RetrievalServerConfig, None, ["index_dir=x", "embedding_cache_size=-1"])


def test_a_server_lowers_the_gil_switch_interval_and_never_raises_it():
    import sys

    from calibrl.threads import SERVER_SWITCH_INTERVAL_S, responsive_gil

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        assert responsive_gil() == pytest.approx(SERVER_SWITCH_INTERVAL_S)
        sys.setswitchinterval(0.0005)
        assert responsive_gil() == pytest.approx(0.0005)  # a lower value the user chose stays
    finally:
        sys.setswitchinterval(before)
