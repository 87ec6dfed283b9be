"""Reward scoring latency: in-process cores vs the two gRPC services, and concurrent vs
sequential service calls.

    python benchmarks/bench_rewards.py --batch 64 --repeats 7

Builds the 12-passage test index and a programmatic rubric, starts both services on
loopback, and times ``RewardModel.score_rewrites`` on one batch of rewrites:

- ``inprocess``: InProcessRetrievalClient + InProcessJudgeClient (no network);
- ``grpc``: the gRPC clients, retrieval and judge calls concurrent (the default);
- ``grpc_sequential``: ``rubric_sees_retrieval=true``, the judge call waits for retrieval.

The judge cache is off so every repeat really scores. Prints the median and the
ratios within this run (numbers from a shared machine are noisy; compare ratios).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RUBRIC_YAML = """\
id: bench-rewriter
version: "1"
description: Programmatic rubric for the benchmark.
criteria:
  - {name: entities, kind: programmatic, scorer: entity_coverage, weight: 0.4}
  - {name: intent, kind: programmatic, scorer: intent_similarity, weight: 0.3}
  - {name: specific, kind: programmatic, scorer: specificity, weight: 0.2}
  - {name: length, kind: programmatic, scorer: length, weight: 0.1}
"""


async def run(batch: int, repeats: int, workdir: pathlib.Path) -> dict[str, float]:
    from calibrl.serving import ServingConfig
    from calibrl.judge_server import server as judge_server
    from calibrl.judge_server.config import JudgeConfig, JudgeServerConfig
    from calibrl.judge_server.judge import Judge
    from calibrl.judge_server.rubric import load_rubric_dir
    from calibrl.retrieval_server.retriever import Retriever
    from calibrl.testing import TINY_CORPUS, build_test_index, start_test_server
    from calibrl.trainer.grpc_clients import GrpcJudgeClient, GrpcRetrievalClient
    from calibrl.trainer.inprocess import InProcessJudgeClient, InProcessRetrievalClient
    from calibrl.trainer.rewards import RewardConfig, RewardModel
    from calibrl.trainer.kinds.rewrite import RewriteRollout, score_rewrites
    from calibrl.trainer.tasks import Task

    index_dir = build_test_index(workdir / "index")
    (workdir / "rubrics").mkdir()
    (workdir / "rubrics" / "bench-rewriter.yaml").write_text(RUBRIC_YAML)
    retriever = Retriever.load(index_dir, device="cpu")
    judge_config = JudgeConfig(allow_unvalidated=True, cache_size=0)
    judge = Judge(load_rubric_dir(workdir / "rubrics"), judge_config)

    rollouts = []
    for i in range(batch):
        doc = TINY_CORPUS[i % len(TINY_CORPUS)]
        task = Task(f"t{i}", "rewrite", f"Tell me about {doc['title']}", (doc["_id"],))
        words = doc["text"].split()
        rollouts.append(RewriteRollout(task, " ".join(words[i % 5: i % 5 + 4 + i % 7])))

    retrieval_running = await start_test_server(index_dir, retriever=retriever)
    judge_running = await judge_server.start(
        JudgeServerConfig(rubrics=str(workdir / "rubrics"), judge=judge_config, serving=ServingConfig(port=0)),
        judge=judge)
    grpc_retrieval = GrpcRetrievalClient(retrieval_running.address)
    grpc_judge = GrpcJudgeClient(f"127.0.0.1:{judge_running.port}")
    setups = {
        "inprocess": (RewardConfig(rubric_id="bench-rewriter"), InProcessRetrievalClient(retriever),
                      InProcessJudgeClient(judge)),
        "grpc": (RewardConfig(rubric_id="bench-rewriter"), grpc_retrieval, grpc_judge),
        "grpc_sequential": (RewardConfig(rubric_id="bench-rewriter", rubric_sees_retrieval=True), grpc_retrieval,
                            grpc_judge),
    }
    medians = {}
    try:
        for name, (config, retrieval, judging) in setups.items():
            model = RewardModel(config, retrieval, judging)
            await score_rewrites(model, rollouts)  # warm-up (embedder, channels)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                await score_rewrites(model, rollouts)
                times.append(time.perf_counter() - start)
            medians[name] = statistics.median(times)
    finally:
        await grpc_retrieval.close()
        await grpc_judge.close()
        await retrieval_running.stop(1.0)
        await judge_running.stop(1.0)
    return medians


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description="Reward scoring latency (see module docstring).")
    parser.add_argument("--batch", type=int, default=64, help="rewrites per batch")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per setup")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        medians = asyncio.run(run(args.batch, args.repeats, pathlib.Path(scratch)))
    print(f"batch of {args.batch} rewrites, median of {args.repeats} repeats")
    for name, seconds in medians.items():
        print(f"  {name:16s} {seconds * 1000:8.1f} ms   {args.batch / seconds:8.0f} rewrites/s")
    print(f"  grpc / inprocess          {medians['grpc'] / medians['inprocess']:.2f}x")
    print(f"  grpc_sequential / grpc    {medians['grpc_sequential'] / medians['grpc']:.2f}x")
    return medians


if __name__ == "__main__":
    main()
