"""Shared material of the trainer tests: a tiny real world to train in.

- a tiny random Llama policy with a BPE tokenizer trained here (calibrl.testing);
- a real retrieval index (MiniLM + FAISS + BM25) over calibrl.testing's
  twelve passages;
- a programmatic rubric (no LLM) for the judge;
- rewrite and search task files over those passages.

``trainer_world`` builds them once per test module. The few tests here check the
material itself, so a broken fixture fails loudly instead of skewing other tests.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any

import pytest

RUBRIC_ID = "rewriter-test"
RUBRIC_YAML = f"""\
id: {RUBRIC_ID}
version: "1"
description: Programmatic rubric for the trainer tests.
criteria:
  - name: entities
    kind: programmatic
    scorer: entity_coverage
    weight: 0.5
  - name: specific
    kind: programmatic
    scorer: specificity
    weight: 0.3
  - name: length
    kind: programmatic
    scorer: length
    weight: 0.2
"""

SEARCH_TASKS = [
    {"id": "q-penicillin", "question": "Who discovered penicillin?", "answers": ["Alexander Fleming"],
     "gold_doc_ids": ["penicillin"]},
    {"id": "q-eiffel", "question": "In which city is the Eiffel Tower?", "answers": ["Paris"],
     "gold_doc_ids": ["eiffel"]},
    {"id": "q-flute", "question": "Who wrote The Magic Flute?", "answers": ["Mozart"], "gold_doc_ids": ["mozart"]},
    {"id": "q-insulin", "question": "Which organ makes insulin?", "answers": ["the pancreas"],
     "gold_doc_ids": ["insulin"]},
]


@dataclass
class TrainerWorld:
    root: pathlib.Path
    policy_dir: pathlib.Path
    index_dir: pathlib.Path
    rubric_dir: pathlib.Path
    rewrite_tasks: pathlib.Path
    search_tasks: pathlib.Path
    retriever: Any

    def overrides(self, output_dir: pathlib.Path, *extra: str, judge: bool = True) -> list[str]:
        """Config overrides of a small, fast rewrite run in this world."""
        base = [
            f"policy.path={self.policy_dir}",
            "policy.device=cpu",
            f"tasks.path={self.rewrite_tasks}",
            f"services.index_dir={self.index_dir}",
            f"services.rubric_dir={self.rubric_dir}",
            "services.inprocess_judge.allow_unvalidated=true",
            "services.inprocess_judge.embedder=hashed-ngrams",
            f"reward.rubric_id={RUBRIC_ID}",
            "rollout.group_size=4",
            "rollout.prompts_per_step=4",
            "rollout.max_new_tokens=6",
            "optimizer.lr=1e-3",
            "steps=2",
            f"output_dir={output_dir}",
            "progress_bar=false",
            "tensorboard=false",
        ]
        if not judge:
            base += ["services.judge=none", "reward.w_rubric=0", "reward.w_retrieval=1.0"]
        return base + list(extra)

    def clients(self, judge: bool = True) -> tuple[Any, Any]:
        from calibrl.judge_server.config import JudgeConfig
        from calibrl.judge_server.judge import Judge
        from calibrl.trainer.inprocess import InProcessJudgeClient, InProcessRetrievalClient

        judge_client = None
        if judge:
            config = JudgeConfig(allow_unvalidated=True, embedder="hashed-ngrams", cache_size=0)
            judge_client = InProcessJudgeClient(Judge.from_config(config, self.rubric_dir))
        return InProcessRetrievalClient(self.retriever), judge_client


def build_world(root: pathlib.Path) -> TrainerWorld:
    from calibrl.embedding import SentenceEmbedder
    from calibrl.retrieval_server.retriever import Retriever
    from calibrl.testing import TINY_CORPUS, build_test_index
    from calibrl.testing import save_tiny_policy

    policy_dir = save_tiny_policy(root / "policy")
    embedder = SentenceEmbedder(None, device="cpu")  # MiniLM, loaded once for building and serving
    index_dir = build_test_index(root / "index", embedder=embedder, show_progress=False)
    rubric_dir = root / "rubrics"
    rubric_dir.mkdir()
    (rubric_dir / "rewriter.yaml").write_text(RUBRIC_YAML)
    rewrite_tasks = root / "rewrite.jsonl"
    with rewrite_tasks.open("w") as out:
        for passage in TINY_CORPUS:
            record = {"id": passage["_id"], "query": f"tell me about {passage['title'].lower()}",
                      "gold_doc_ids": [passage["_id"]]}
            out.write(json.dumps(record) + "\n")
    search_tasks = root / "search.jsonl"
    search_tasks.write_text("".join(json.dumps(t) + "\n" for t in SEARCH_TASKS))
    retriever = Retriever.load(index_dir, device="cpu", embedder=embedder)
    return TrainerWorld(root, policy_dir, index_dir, rubric_dir, rewrite_tasks, search_tasks, retriever)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models on a shared, oversubscribed 2-core machine run an order of
    magnitude faster on one intra-op thread (no spin-waiting for descheduled
    workers). Restored after the module."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def trainer_world(tmp_path_factory: pytest.TempPathFactory) -> TrainerWorld:
    return build_world(tmp_path_factory.mktemp("trainer-world"))


def test_world_is_real_and_consistent(trainer_world: TrainerWorld) -> None:
    from calibrl.api.retrieval import ScoreItem
    from calibrl.trainer.tasks import load_tasks

    tasks = load_tasks(trainer_world.rewrite_tasks)
    assert len(tasks) == 12 and all(t.kind == "rewrite" for t in tasks)
    # The raw query already finds its passage for most tasks: the index is real.
    scores = trainer_world.retriever.score([ScoreItem(t.query, t.gold_doc_ids) for t in tasks], top_k=3)
    assert sum(s.hit for s in scores) >= 9
    assert (trainer_world.policy_dir / "config.json").exists()


def train_against_real_services(world: TrainerWorld, out: pathlib.Path, *overrides: str,
                                then: Any = None) -> tuple[int, Any]:
    """``calibrl train`` over ``world`` against a real retrieval and a real judge server on
    loopback (in-process, on a background loop), with ``overrides``; ``then(retrieval_port)``
    runs while the servers are still up. Returns (exit code, what ``then`` returned)."""
    from calibrl.trainer.aio import BackgroundLoop
    from calibrl.cli import main as calibrl_main
    from calibrl.config import load_config
    from calibrl.judge_server.config import JudgeServerConfig
    from calibrl.judge_server.server import start as start_judge
    from calibrl.testing import start_test_server

    judge_config = load_config(JudgeServerConfig, None, [
        f"rubrics={world.rubric_dir}", "serving.port=0", "serving.host=127.0.0.1", "serving.grace_seconds=1",
        "judge.allow_unvalidated=true", "judge.embedder=hashed-ngrams",
    ])
    with BackgroundLoop(name="test-servers") as servers:
        retrieval = servers.run(start_test_server(world.index_dir, retriever=world.retriever))
        judge = servers.run(start_judge(judge_config))
        try:
            code = calibrl_main([
                "train", *world.overrides(out, *overrides),
                f"services.retrieval=127.0.0.1:{retrieval.port}", f"services.judge=127.0.0.1:{judge.port}",
                "services.timeout_s=60",
            ])
            return code, (then(retrieval.port) if then is not None else None)
        finally:
            servers.run(retrieval.stop(grace=1.0))
            servers.run(judge.stop(grace=1.0))
