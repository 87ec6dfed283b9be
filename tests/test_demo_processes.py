"""The demo's training runs as processes (calibrl.demo.services.TrainingProcesses): at most
``jobs`` at once, a failed run stops the others and reports its log, Ctrl-C stops them all,
and two real `calibrl train` runs sharing one judge server give the metrics each gives alone."""

from __future__ import annotations

import json
import pathlib
import shutil
import signal
import sys
import time

import pytest

from calibrl.demo.services import RunSpan, TrainingFailed, TrainingProcesses, overlap_seconds
from tests.test_trainer_support import RUBRIC_ID, one_torch_thread, trainer_world  # noqa: F401  (fixtures)

ROOT = pathlib.Path(__file__).resolve().parent.parent
# each run's "overrides" is a Python program: the supervisor, not the trainer, is under test
PYTHON = [sys.executable, "-c"]


def test_runs_start_in_order_at_most_jobs_at_once(tmp_path: pathlib.Path) -> None:
    runs = {name: [f"import time; time.sleep({seconds}); print('{name} ok')"]
            for name, seconds in (("a", 3.0), ("b", 0.5), ("c", 0.2))}
    finished = []
    spans = TrainingProcesses(runs, tmp_path, jobs=2, poll_s=0.05, command=PYTHON).run(
        on_exit=lambda name, span: finished.append((name, span.returncode)))
    assert list(spans) == ["a", "b", "c"] and finished == [("b", 0), ("c", 0), ("a", 0)]
    # a and b started together; c waited for b's slot, so never more than two ran
    assert spans["b"].start_s < spans["a"].end_s and overlap_seconds(spans["a"], spans["b"]) > 0.3
    assert spans["c"].start_s >= spans["b"].end_s
    assert "a ok" in (tmp_path / "train_a.log").read_text()


def test_a_failed_run_stops_the_other_and_reports_its_log(tmp_path: pathlib.Path) -> None:
    runs = {"long": ["import time; time.sleep(120)"],
            "bad": ["import sys; print('policy.path=/nowhere: no such folder'); sys.exit(3)"]}
    processes = TrainingProcesses(runs, tmp_path, jobs=2, poll_s=0.05, command=PYTHON)
    started = time.monotonic()
    with pytest.raises(TrainingFailed, match=r"training run bad failed \(exit 3\)") as info:
        processes.run()
    assert "policy.path=/nowhere: no such folder" in str(info.value)  # the log's tail
    assert time.monotonic() - started < 30  # the long run was stopped, not waited for
    assert processes.spans["long"].returncode == -signal.SIGTERM


def test_ctrl_c_stops_every_running_process(tmp_path: pathlib.Path) -> None:
    runs = {name: ["import time; time.sleep(120)"] for name in ("one", "two", "three")}
    processes = TrainingProcesses(runs, tmp_path, jobs=2, poll_s=0.05, command=PYTHON)

    def interrupt(seconds: float, running: list[str]) -> None:
        if seconds > 0.5:
            raise KeyboardInterrupt  # what Ctrl-C raises in the demo's main thread

    with pytest.raises(KeyboardInterrupt):
        processes.run(on_tick=interrupt)
    assert {n: s.returncode for n, s in processes.spans.items()} == {"one": -signal.SIGTERM, "two": -signal.SIGTERM}


def test_overlap_seconds() -> None:
    assert overlap_seconds(RunSpan("a", 0.0, 10.0), RunSpan("b", 4.0, 20.0)) == 6.0
    assert overlap_seconds(RunSpan("a", 0.0, 3.0), RunSpan("b", 4.0, 20.0)) == 0.0
    with pytest.raises(ValueError, match="jobs=0"):
        TrainingProcesses({}, pathlib.Path("."), jobs=0)


def _metrics(run_dir: pathlib.Path) -> list[dict]:
    """metrics.jsonl without the timing/* keys (wall-clock seconds, which depend on the load)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("timing/")} for r in records]


@pytest.mark.slow
def test_two_runs_sharing_one_judge_server_give_what_each_gives_alone(trainer_world, tmp_path):  # noqa: F811
    """Two real `calibrl train` processes against one real judge server (two rubrics) and
    one retrieval server, at the same time and then each alone: the same metrics, exactly
    (each reward is a pure function of its inputs, the trainer is seeded; both sides run
    the same float operations in the same order, so equal to the last bit)."""
    from calibrl.config import load_config
    from calibrl.judge_server.config import JudgeServerConfig
    from calibrl.judge_server.server import start as start_judge
    from calibrl.testing import start_test_server
    from calibrl.trainer.aio import BackgroundLoop

    rubrics = tmp_path / "rubrics"
    shutil.copytree(trainer_world.rubric_dir, rubrics)
    shutil.copy(ROOT / "configs" / "rubrics" / "search-steps.yaml", rubrics)  # the second agent's rubric

    def runs(phase: str, retrieval: int, judge: int) -> dict[str, list[str]]:
        services = [f"services.retrieval=127.0.0.1:{retrieval}", f"services.judge=127.0.0.1:{judge}",
                    "services.timeout_s=60", "steps=3", "checkpoint_every=0"]
        return {"first": trainer_world.overrides(tmp_path / phase / "first", *services, "seed=0"),
                "second": trainer_world.overrides(tmp_path / phase / "second", *services, "seed=1",
                                                  "reward.rubric_id=search-steps")}

    spans = {}
    for phase, jobs in (("together", 2), ("alone", 1)):
        judge_config = load_config(JudgeServerConfig, None, [  # a fresh server (and cache) per phase
            f"rubrics={rubrics}", "serving.port=0", "serving.host=127.0.0.1", "serving.grace_seconds=1",
            "judge.allow_unvalidated=true", "judge.embedder=hashed-ngrams"])
        with BackgroundLoop(name="test-servers") as servers:
            retrieval = servers.run(start_test_server(trainer_world.index_dir, retriever=trainer_world.retriever))
            judge = servers.run(start_judge(judge_config))
            try:
                spans[phase] = TrainingProcesses(runs(phase, retrieval.port, judge.port), tmp_path / phase / "logs",
                                                 jobs=jobs).run()
            finally:
                servers.run(retrieval.stop(grace=1.0))
                servers.run(judge.stop(grace=1.0))

    together, alone = spans["together"], spans["alone"]
    assert overlap_seconds(together["first"], together["second"]) > 0  # they did run at the same time
    assert overlap_seconds(alone["first"], alone["second"]) == 0
    for name in ("first", "second"):
        shared, single = _metrics(tmp_path / "together" / name), _metrics(tmp_path / "alone" / name)
        assert [r["step"] for r in shared] == [1, 2, 3]
        assert all(0.0 < r["rewards/rubric/mean"] <= 1.0 for r in shared)  # the judge scored every step
        assert shared == single, name
    # two rubrics, two seeds: the runs themselves differ (the comparison above could fail)
    assert _metrics(tmp_path / "together" / "first") != _metrics(tmp_path / "together" / "second")
