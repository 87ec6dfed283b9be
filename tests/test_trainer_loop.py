"""The training loop end to end on a tiny real world: a random Llama policy, a real
MiniLM/FAISS/BM25 index and a programmatic rubric judge, through the in-process
clients. Every test trains for real; nothing is mocked except the failures injected
into a retrieval client to check what the loop does when rewards fail."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import threading

import pytest
import torch

from calibrl.errors import RewardError, Unavailable
from tests.test_trainer_support import TrainerWorld, one_torch_thread, trainer_world  # noqa: F401  (fixtures)
from tests.tolerances import entropy_error, log_softmax_error
from calibrl.trainer.checkpoint import find_checkpoint, load_train_state
from calibrl.trainer.config import load_train_config
from calibrl.trainer.diagnostics import read_log
from calibrl.trainer.loop import train

TRL_NAMES = (
    "reward", "reward_std", "frac_reward_zero_std", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
    "clip_ratio/region_mean", "grad_norm", "completions/mean_length", "completions/min_length",
    "completions/max_length", "learning_rate", "loss",
)


def _weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for shard in sorted((folder).glob("*.safetensors")):
        state.update(load_file(str(shard)))
    return state


class FlakyRetrieval:
    """A real in-process retrieval client whose ``score`` fails (UNAVAILABLE) from the
    ``fail_from``-th call on: a retrieval replica that went down mid-run."""

    def __init__(self, inner, fail_from: int) -> None:
        self.inner, self.fail_from, self.calls = inner, fail_from, 0

    async def search(self, *args, **kwargs):
        return await self.inner.search(*args, **kwargs)

    async def score(self, *args, **kwargs):
        self.calls += 1
        if self.calls > self.fail_from:
            raise Unavailable("retrieval replica down")
        return await self.inner.score(*args, **kwargs)


RESUME_SETTINGS = ("steps=3", "gradient_accumulation_steps=2", "optimizer.schedule=cosine",
                   "optimizer.warmup_steps=1", "checkpoint_every=0")


@pytest.fixture(scope="module")
def straight_run(trainer_world: TrainerWorld, tmp_path_factory):
    """Three uninterrupted steps: the reference of the resume tests."""
    out = tmp_path_factory.mktemp("straight")
    retrieval, judge = trainer_world.clients()
    config = load_train_config(None, trainer_world.overrides(out, *RESUME_SETTINGS, "tensorboard=true"))
    result = train(config, retrieval=retrieval, judge=judge)
    return out, result


def test_run_logs_trl_metrics_tensorboard_and_a_final_checkpoint(trainer_world, straight_run):
    out, result = straight_run
    assert result.stopped == "completed" and result.steps_done == 3
    records = read_log(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        for name in (*TRL_NAMES, "rewards/retrieval/mean", "rewards/rubric/mean", "timing/generation",
                     "timing/reward_wait", "timing/update", "health/warnings_total"):
            assert name in record and math.isfinite(record[name]), name
        # The logged reward is the 0.7 / 0.3 blend of the logged component means.
        blend = 0.7 * record["rewards/retrieval/mean"] + 0.3 * record["rewards/rubric/mean"]
        assert record["reward"] == pytest.approx(blend, abs=1e-6)
        assert 0 <= record["frac_reward_zero_std"] <= 1
    # Step 1 samples from the reference itself: the KL is exactly zero, later it is not.
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-7)
    assert records[2]["kl"] > 0
    # Warmup of one step then cosine decay to 0 at the last step.
    assert [r["learning_rate"] for r in records] == pytest.approx([1e-3, 1e-3, 0.0], abs=1e-12)

    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(out / "tensorboard"))
    accumulator.Reload()
    assert [e.step for e in accumulator.Scalars("reward")] == [1, 2, 3]
    assert "frac_reward_zero_std" in accumulator.Tags()["scalars"]

    checkpoint = find_checkpoint(out)
    assert checkpoint.name == "step_000003" and checkpoint == result.last_checkpoint
    state = load_train_state(checkpoint)
    assert state.step == 3 and state.reason == "final"
    for name in ("optimizer.pt", "scheduler.pt", "rng_rank0.pt", "config.yaml", "model/config.json",
                 "model/tokenizer.json"):
        assert (checkpoint / name).exists(), name
    trained, initial = _weights(checkpoint / "model"), _weights(trainer_world.policy_dir)
    assert set(trained) == set(initial)
    assert any(not torch.equal(trained[k], initial[k]) for k in trained)


def test_sigterm_checkpoints_and_resume_reproduces_step_three_bitwise(trainer_world, straight_run, tmp_path):
    straight_out, _ = straight_run
    retrieval, judge = trainer_world.clients()
    config = load_train_config(None, trainer_world.overrides(tmp_path, *RESUME_SETTINGS))

    def preempt(step, metrics):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler sends before killing the job

    first = train(config, retrieval=retrieval, judge=judge, on_step=preempt)
    assert first.stopped == "sigterm" and first.steps_done == 2
    assert load_train_state(first.last_checkpoint).reason == "sigterm"
    assert signal.getsignal(signal.SIGTERM) is not None  # the loop restored the previous handler

    second = train(config, retrieval=retrieval, judge=judge, resume=tmp_path)
    assert second.stopped == "completed" and second.steps_done == 3 and len(second.history) == 1

    straight, resumed = read_log(straight_out / "metrics.jsonl"), read_log(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for a, b in zip(straight, resumed):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] and a["reward"] == b["reward"]
    final_a = _weights(find_checkpoint(straight_out) / "model")
    final_b = _weights(find_checkpoint(tmp_path) / "model")
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


def test_failed_reward_stops_with_checkpoint_and_resume_retries_the_step(trainer_world, straight_run, tmp_path):
    straight_out, _ = straight_run
    retrieval, judge = trainer_world.clients()
    # Two generation chunks per step -> two score calls; the third call (step 2) fails.
    flaky = FlakyRetrieval(retrieval, fail_from=2)
    config = load_train_config(None, trainer_world.overrides(
        tmp_path, *RESUME_SETTINGS, "reward.max_attempts=2", "reward.retry_backoff_s=0"))
    with pytest.raises(RewardError, match=r"step 2: .*retrieval replica down.*checkpoint written"):
        train(config, retrieval=flaky, judge=judge)
    # Nothing half-scored was trained on or logged: step 2 is absent, the
    # checkpoint holds the state at the start of step 2.
    assert [r["step"] for r in read_log(tmp_path / "metrics.jsonl")] == [1]
    checkpoint = find_checkpoint(tmp_path)
    state = load_train_state(checkpoint)
    assert (checkpoint.name, state.step, state.reason) == ("step_000001", 1, "reward_error")

    resumed = train(config, retrieval=retrieval, judge=judge, resume=checkpoint)
    assert resumed.steps_done == 3
    straight = read_log(straight_out / "metrics.jsonl")
    again = read_log(tmp_path / "metrics.jsonl")
    assert [r["loss"] for r in again] == [r["loss"] for r in straight]


def test_gradient_accumulation_and_aggregation_do_not_change_the_update(trainer_world, tmp_path):
    retrieval, _ = trainer_world.clients(judge=False)
    finals = {}
    for aggregation in ("token_mean", "sequence_mean"):
        for accumulation in (1, 4):
            out = tmp_path / f"{aggregation}-{accumulation}"
            config = load_train_config(None, trainer_world.overrides(
                out, "steps=1", f"gradient_accumulation_steps={accumulation}", f"loss.aggregation={aggregation}",
                "max_grad_norm=0", judge=False))
            result = train(config, retrieval=retrieval, judge=None)
            finals[aggregation, accumulation] = (result.history[0], _weights(result.last_checkpoint / "model"))
    for aggregation in ("token_mean", "sequence_mean"):
        (m1, w1), (m4, w4) = finals[aggregation, 1], finals[aggregation, 4]
        assert m1["reward"] == m4["reward"]  # same rollouts
        assert m4["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-4)
        assert m4["loss"] == pytest.approx(m1["loss"], rel=1e-4, abs=1e-7)
        assert all(torch.allclose(w1[k], w4[k], atol=1e-6) for k in w1)
    # The two aggregations are different objectives: their gradients differ.
    assert finals["token_mean", 1][0]["grad_norm"] != finals["sequence_mean", 1][0]["grad_norm"]


def test_reward_scoring_overlaps_generation_of_the_next_chunk(trainer_world, tmp_path):
    """Chunk 1's score call must still be running when chunk 2's arrives: the loop
    generated chunk 2 without waiting for chunk 1's rewards."""
    retrieval, _ = trainer_world.clients(judge=False)

    class Recorder:
        def __init__(self):
            self.second_arrived = None
            self.overlapped = []

        async def search(self, *args, **kwargs):
            return await retrieval.search(*args, **kwargs)

        async def score(self, *args, **kwargs):
            if self.second_arrived is None:
                self.second_arrived = asyncio.Event()
                try:
                    await asyncio.wait_for(self.second_arrived.wait(), timeout=60)
                    self.overlapped.append(True)
                except asyncio.TimeoutError:
                    self.overlapped.append(False)
            else:
                self.second_arrived.set()
            return await retrieval.score(*args, **kwargs)

    recorder = Recorder()
    config = load_train_config(None, trainer_world.overrides(tmp_path, "steps=1", "rollout.chunk_prompts=2",
                                                              judge=False))
    train(config, retrieval=recorder, judge=None)
    assert recorder.overlapped == [True]


def test_search_agent_with_calibadv_trains_and_logs_its_metrics(trainer_world, tmp_path):
    retrieval, _ = trainer_world.clients(judge=False)
    config = load_train_config(None, trainer_world.overrides(
        tmp_path, f"tasks.path={trainer_world.search_tasks}", "advantage.type=calibadv", "advantage.use_gold=true",
        "rollout.prompts_per_step=2", "rollout.max_new_tokens=8", "rollout.max_turns=2", "rollout.max_obs_tokens=24",
        "steps=1", judge=False))
    result = train(config, retrieval=retrieval, judge=None)
    record = result.history[0]
    assert {"calibadv/frac_groups_answer_zeroed", "calibadv/mean_step_score", "rewards/answer/mean"} <= set(record)
    assert 0 <= record["calibadv/mean_step_score"] <= 1
    assert math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])


def test_search_step_scores_follow_calibadv_per_group():
    from calibrl.api.retrieval import Hit, RetrievalScore
    from calibrl.trainer.config import CalibAdvAdvantage
    from calibrl.trainer.calibadv import search_step_scores
    from calibrl.trainer.kinds.search.records import SearchRollout, SearchStepRecord
    from calibrl.trainer.tasks import Task

    def step(think, *doc_ids):
        hits = tuple(Hit(d, d, 1.0, i + 1) for i, d in enumerate(doc_ids))
        score = RetrievalScore(hits=hits, hit=False, all_gold=False, recall=0.0, mrr=0.0, ndcg=0.0, first_gold_rank=0)
        return SearchStepRecord(think=think, query=think, result=score)

    task = Task("t", "search", "q?", gold_doc_ids=("g",), answers=("paris",))
    best = SearchRollout(task, (step("find city", "a", "s1"), step("find country", "s2", "b")), "paris", True)
    worse = SearchRollout(task, (step("look up tower", "s1", "x"), step("look up tower", "s2", "y")), "rome", True)
    broken = SearchRollout(task, (step("hmm", "s1", "s2"),), "rome", False)
    other = SearchRollout(task, (step("alpha", "s1"),), None, True)
    rollouts = [best, worse, broken, other]
    group_index = torch.tensor([0, 0, 0, 1])
    segment_index = torch.tensor([[0, 1, 2], [0, 1, 2], [0, 1, -1], [0, 1, -1]])
    scores = search_step_scores(rollouts, group_index, segment_index, CalibAdvAdvantage())
    nan = float("nan")
    # Group 0: the best rollout (F1 1 >= 0.7) retrieved {a, s1, s2, b}: those are silver.
    expected = torch.tensor([[1.0, 1.0, nan], [0.5, 0.0, nan], [0.0, nan, nan], [0.0, nan, nan]])
    # worse: step 2 repeats step 1's think text -> 0; broken: not well formed -> 0;
    # other: its group's best F1 is 0 < 0.7 -> no silver docs -> 0.
    assert torch.equal(torch.isnan(scores), torch.isnan(expected))
    assert torch.equal(torch.nan_to_num(scores), torch.nan_to_num(expected))
    gold = search_step_scores(rollouts, group_index, segment_index, CalibAdvAdvantage(use_gold=True))
    assert gold[3, 0] == 0.0 and gold[0, 0] == 0.0  # gold doc "g" was never retrieved


def test_lora_run_saves_only_the_adapter_and_resumes(trainer_world, tmp_path):
    pytest.importorskip("peft")
    retrieval, _ = trainer_world.clients(judge=False)
    config = load_train_config(None, trainer_world.overrides(
        tmp_path, "policy.lora.enabled=true", "policy.lora.r=4", "policy.lora.alpha=8", "optimizer.lr=1e-2",
        "loss.beta=0.1", judge=False))
    first = train(config, retrieval=retrieval, judge=None, stop_after=1)
    assert first.stopped == "stop_after" and first.steps_done == 1
    model_dir = first.last_checkpoint / "model"
    assert (model_dir / "adapter_config.json").exists() and (model_dir / "adapter_model.safetensors").exists()
    assert not (model_dir / "model.safetensors").exists()
    adapter_1 = _weights(model_dir)
    second = train(config, retrieval=retrieval, judge=None, resume=tmp_path)
    assert second.steps_done == 2
    assert second.history[0]["kl"] > 0  # the reference is the base without the adapter; the adapter moved
    adapter_2 = _weights(second.last_checkpoint / "model")
    assert any(not torch.equal(adapter_1[k], adapter_2[k]) for k in adapter_1)


def test_training_runs_off_the_main_thread_without_signal_handling(trainer_world, tmp_path):
    """Notebooks and services call train() from worker threads: no SIGTERM hook there."""
    retrieval, _ = trainer_world.clients(judge=False)
    config = load_train_config(None, trainer_world.overrides(tmp_path, "steps=1", judge=False))
    results = []
    worker = threading.Thread(target=lambda: results.append(train(config, retrieval=retrieval, judge=None)))
    worker.start()
    worker.join(120)
    assert results and results[0].stopped == "completed"


def test_completion_logprobs_equal_the_policy_logprobs_on_generated_tokens():
    """The loop projects only the completion columns to the vocabulary; the values
    must be those of calibrl.testing.logprobs.sequence_logprobs, for full and LoRA models."""
    from calibrl.testing import build_model, build_tokenizer
    from calibrl.trainer.policy import LoraSettings, Policy, _forward_accepts, make_reference, wrap_lora
    from calibrl.testing.logprobs import sequence_logprobs
    from calibrl.trainer.update import micro_batch
    from calibrl.trainer.update import micro_logprobs as completion_logprobs
    from calibrl.trainer.rollout import RolloutBatch, assemble_rows

    tokenizer = build_tokenizer()
    model = build_model(tokenizer).train()
    rows = [[([1, 5, 6, 7], False), ([8, 9, 10], True)], [([1, 5], False), ([11, 12, 13, 14, 15], True)],
            [([1, 5, 6, 7, 8, 9], False), ([3], True), ([20, 21], False), ([4, 4], True)]]
    batch = RolloutBatch(**assemble_rows(rows, 0), group_index=torch.tensor([0, 0, 1]), completion_texts=[""] * 3,
                         rollouts=[None] * 3)
    micro = micro_batch(batch, None, [0, 1, 2])
    assert micro.start == 2 and micro.mask.shape == (3, batch.input_ids.shape[1] - 2)
    logp, entropy = completion_logprobs(model, micro, 0.7, with_entropy=True)
    full, full_entropy = sequence_logprobs(model, batch.input_ids, batch.attention_mask, temperature=0.7,
                                        return_entropy=True)
    # Same hidden states, but the head and the log-softmax run on another slice (logits_to_keep): the
    # two may round differently in the head's dot product and the vocabulary sums (tests/tolerances.py).
    max_logit = _max_abs_scaled_logit(model, batch, 0.7)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    logp_tolerance = log_softmax_error(vocab, hidden, max_logit)
    assert torch.allclose(logp[micro.mask], full[:, 2:][micro.mask], atol=logp_tolerance, rtol=0)
    assert entropy == pytest.approx(float(full_entropy.detach()[:, 2:][micro.mask].mean()),
                                    abs=entropy_error(vocab, hidden, max_logit), rel=0)
    assert _forward_accepts(model, "logits_to_keep")
    pytest.importorskip("peft")
    lora = Policy(model=wrap_lora(model, LoraSettings(r=2)), tokenizer=tokenizer, device=torch.device("cpu"),
                  model_id="")
    reference = make_reference(lora)
    assert _forward_accepts(lora.model, "logits_to_keep") and _forward_accepts(reference, "logits_to_keep")
    with torch.no_grad():
        ref_logp, _ = completion_logprobs(reference, micro, 0.7)
    # LoRA B starts at 0, so the reference is the same function computed through the peft wrapper.
    assert torch.allclose(ref_logp[micro.mask], full[:, 2:][micro.mask], atol=logp_tolerance, rtol=0)


def _logp_tolerance(model, batch, temperature=1.0):
    max_logit = _max_abs_scaled_logit(model, batch, temperature)
    return log_softmax_error(model.config.vocab_size, model.config.hidden_size, max_logit)


def _max_abs_scaled_logit(model, batch, temperature):
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    return float(logits.abs().max()) / temperature


# ------------------------------------------------------------------ one step off-policy

OFF_POLICY = "rollout.off_policy_steps=1"


@pytest.fixture(scope="module")
def straight_off_policy_run(trainer_world: TrainerWorld, tmp_path_factory):
    """Three uninterrupted steps one step off-policy, every checkpoint kept."""
    out = tmp_path_factory.mktemp("straight-off-policy")
    retrieval, judge = trainer_world.clients()
    config = load_train_config(None, trainer_world.overrides(
        out, *RESUME_SETTINGS, OFF_POLICY, "checkpoint_every=1", "keep_checkpoints=0"))
    return out, train(config, retrieval=retrieval, judge=judge)


class ScoreOrder:
    """A real in-process retrieval client that records, in order, each score call
    and each finished step (``on_step``)."""

    def __init__(self, inner) -> None:
        self.inner, self.events = inner, []

    async def search(self, *args, **kwargs):
        return await self.inner.search(*args, **kwargs)

    async def score(self, *args, **kwargs):
        self.events.append("score")
        return await self.inner.score(*args, **kwargs)

    def on_step(self, step, metrics):
        self.events.append(f"step {step}")


@pytest.mark.parametrize("off_policy", [0, 1])
def test_off_policy_scores_the_next_steps_rollouts_before_this_steps_update(trainer_world, tmp_path, off_policy):
    retrieval, _ = trainer_world.clients(judge=False)
    recorder = ScoreOrder(retrieval)
    config = load_train_config(None, trainer_world.overrides(
        tmp_path, "steps=3", "rollout.chunk_prompts=4", f"rollout.off_policy_steps={off_policy}", judge=False))
    result = train(config, retrieval=recorder, judge=None, on_step=recorder.on_step)
    if off_policy:
        # Step 2's rollouts went out for scoring before step 1's update finished;
        # the last step generates nothing ahead.
        assert recorder.events == ["score", "score", "step 1", "score", "step 2", "step 3"]
        assert [m["rollout/staleness"] for m in result.history] == [0.0, 1.0, 1.0]
        assert not list(find_checkpoint(tmp_path).glob("pending_rank*.pt"))  # the final one holds none
    else:
        assert recorder.events == ["score", "step 1", "score", "step 2", "score", "step 3"]
        assert [m["rollout/staleness"] for m in result.history] == [0.0, 0.0, 0.0]


def test_off_policy_behaviour_logprobs_are_those_of_the_weights_that_sampled(trainer_world, straight_off_policy_run):
    """The rollouts of step k + 1 were sampled by the weights after step k - 1
    (before step k's update): their stored behaviour log-probs are those weights',
    not the ones that train on them."""
    from calibrl.trainer.policy import load_policy
    from calibrl.testing.logprobs import sequence_logprobs

    out, result = straight_off_policy_run
    checkpoints = out / "checkpoints"
    weights = [trainer_world.policy_dir, checkpoints / "step_000001" / "model", checkpoints / "step_000002" / "model"]
    for k in (1, 2):
        pending = torch.load(checkpoints / f"step_{k:06d}" / "pending_rank0.pt", weights_only=False)
        assert pending["step"] == k + 1 and pending["breakdowns"] is not None  # settled before saving
        batch, behaviour = pending["batch"], pending["behaviour_logp"]
        mask = batch.completion_mask
        assert behaviour is not None and mask.any()
        for n, source in enumerate(weights):
            model = load_policy(str(source), device="cpu").model
            with torch.no_grad():
                logp = sequence_logprobs(model, batch.input_ids, batch.attention_mask)
            # Same weights, another slice through the head (logits_to_keep) and the log-softmax.
            close = torch.allclose(behaviour[mask], logp[mask], atol=_logp_tolerance(model, batch), rtol=0)
            assert close is (n == k - 1), (k, source)
    assert [m["rollout/staleness"] for m in result.history] == [0.0, 1.0, 1.0]
    assert result.history[0]["clip_ratio/region_mean"] == 0.0  # on-policy the ratio is exactly 1
    assert all(math.isfinite(m["loss"]) for m in result.history)


def test_off_policy_sigterm_resume_is_bitwise(trainer_world, straight_off_policy_run, tmp_path):
    straight_out, _ = straight_off_policy_run
    retrieval, judge = trainer_world.clients()
    config = load_train_config(None, trainer_world.overrides(tmp_path, *RESUME_SETTINGS, OFF_POLICY))

    def preempt(step, metrics):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    first = train(config, retrieval=retrieval, judge=judge, on_step=preempt)
    assert first.stopped == "sigterm" and first.steps_done == 2
    assert (first.last_checkpoint / "pending_rank0.pt").exists()  # step 3's rollouts, sampled before update 2
    second = train(config, retrieval=retrieval, judge=judge, resume=tmp_path)
    assert second.steps_done == 3 and len(second.history) == 1
    straight, resumed = read_log(straight_out / "metrics.jsonl"), read_log(tmp_path / "metrics.jsonl")
    for a, b in zip(straight, resumed, strict=True):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] and a["reward"] == b["reward"]
    final_a = _weights(find_checkpoint(straight_out) / "model")
    final_b = _weights(find_checkpoint(tmp_path) / "model")
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


def test_off_policy_failed_reward_keeps_the_stale_rollouts_and_resume_retries(trainer_world, straight_off_policy_run,
                                                                               tmp_path):
    """Off-policy, step 2's rollouts exist only in memory (sampled by weights that
    are gone): the reward_error checkpoint keeps them unscored, and the resumed
    run scores them again and continues exactly like the uninterrupted run."""
    straight_out, _ = straight_off_policy_run
    retrieval, judge = trainer_world.clients()
    # Two chunks per step: calls 1-2 score step 1, calls 3-4 step 2 (sent during step 1).
    flaky = FlakyRetrieval(retrieval, fail_from=3)
    config = load_train_config(None, trainer_world.overrides(
        tmp_path, *RESUME_SETTINGS, OFF_POLICY, "reward.max_attempts=2", "reward.retry_backoff_s=0"))
    with pytest.raises(RewardError, match=r"step 2: .*retrieval replica down"):
        train(config, retrieval=flaky, judge=judge)
    checkpoint = find_checkpoint(tmp_path)
    assert (checkpoint.name, load_train_state(checkpoint).reason) == ("step_000001", "reward_error")
    pending = torch.load(checkpoint / "pending_rank0.pt", weights_only=False)
    assert pending["step"] == 2 and pending["breakdowns"] is None and pending["behaviour_logp"] is not None

    resumed = train(config, retrieval=retrieval, judge=judge, resume=checkpoint)
    assert resumed.steps_done == 3
    straight, again = read_log(straight_out / "metrics.jsonl"), read_log(tmp_path / "metrics.jsonl")
    assert [r["loss"] for r in again] == [r["loss"] for r in straight]


def test_a_pending_batch_of_the_wrong_step_is_refused(trainer_world, straight_off_policy_run, tmp_path):
    import shutil

    from calibrl.errors import ConfigError

    straight_out, _ = straight_off_policy_run
    altered = tmp_path / "step_000001"
    shutil.copytree(straight_out / "checkpoints" / "step_000001", altered)
    shutil.copy(straight_out / "checkpoints" / "step_000002" / "pending_rank0.pt", altered / "pending_rank0.pt")
    retrieval, judge = trainer_world.clients()
    config = load_train_config(None, trainer_world.overrides(tmp_path / "run", *RESUME_SETTINGS, OFF_POLICY))
    with pytest.raises(ConfigError, match=r"pending_rank0.pt holds rollouts of step 3, but the run resumes at step 2"):
        train(config, retrieval=retrieval, judge=judge, resume=altered)


def test_bf16_autocast_trains_with_float32_weights(trainer_world, tmp_path):
    """``precision=bf16`` runs the forward passes under bf16 autocast (on CPU here,
    the same code path as on GPU): same rollouts, a slightly different gradient,
    weights and optimizer state still float32."""
    retrieval, _ = trainer_world.clients(judge=False)
    runs = {}
    for precision in ("fp32", "bf16"):
        config = load_train_config(None, trainer_world.overrides(
            tmp_path / precision, "steps=1", f"precision={precision}", "max_grad_norm=0", judge=False))
        result = train(config, retrieval=retrieval, judge=None)
        runs[precision] = (result.history[0], _weights(result.last_checkpoint / "model"))
    (fp32, fp32_weights), (bf16, bf16_weights) = runs["fp32"], runs["bf16"]
    assert bf16["reward"] == fp32["reward"]  # generation is not autocast: the same samples
    assert math.isfinite(bf16["grad_norm"]) and bf16["grad_norm"] > 0
    assert bf16["grad_norm"] != fp32["grad_norm"]  # the loss really ran in bf16 ...
    assert bf16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=0.1)  # ... and stayed close
    assert all(w.dtype == torch.float32 for w in bf16_weights.values())
    assert any(not torch.equal(bf16_weights[k], fp32_weights[k]) for k in fp32_weights)


def test_cpu_bf16_autocast_runs_attention_at_every_kernel_level():
    """CPU bf16 autocast runs attention of a 200-token sequence through SDPA's math kernel:
    torch's CPU flash kernel fails on an AMX processor whose ATen kernels are held below
    AVX-512 (CI reruns this file under ATEN_CPU_CAPABILITY=default). The result is bf16
    and stays within bf16's error of float32 attention, and the context can be re-entered
    (the update enters it once per forward pass)."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from calibrl.trainer.update import CpuBf16Autocast

    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 4, 200, 32, generator=generator) for _ in range(3))
    reference = sdpa(query, key, value, is_causal=True)
    # bf16 keeps 8 significant bits (unit roundoff 2^-9). Rounding q and k moves each logit
    # q.k/sqrt(32) by at most 2 * 2^-9 * |q||k|/sqrt(32) (under 0.1 for these |q|, |k| < 12),
    # which moves the softmax weights by a relative 2 * 0.1 at most; the output, an average
    # of value rows (|v| < 6), by at most 0.2 * 6 plus v's and the output's own rounding.
    assert float(query.norm(dim=-1).max()) < 12 and float(key.norm(dim=-1).max()) < 12
    assert float(value.abs().max()) < 6
    bound = 2 * 2 * 2**-9 * 12 * 12 / 32**0.5 * 6 + 2 * 2**-9 * 6
    autocast = CpuBf16Autocast()
    for _ in range(2):
        with autocast:
            assert torch.is_autocast_enabled("cpu")
            out = sdpa(query, key, value, is_causal=True)
        assert not torch.is_autocast_enabled("cpu")
        assert out.dtype == torch.bfloat16
        assert float((out.float() - reference).abs().max()) < bound


def test_off_policy_behaviour_logprobs_ignore_lora_dropout(trainer_world, tmp_path):
    """The sampler draws in eval mode, so the behaviour log-probs must be eval-mode
    ones: with LoRA dropout 0.5 they still equal the sampling adapter's exactly."""
    pytest.importorskip("peft")
    from calibrl.trainer.policy import load_policy
    from calibrl.testing.logprobs import sequence_logprobs

    retrieval, _ = trainer_world.clients(judge=False)
    config = load_train_config(None, trainer_world.overrides(
        tmp_path, "steps=3", OFF_POLICY, "policy.lora.enabled=true", "policy.lora.r=4", "policy.lora.dropout=0.5",
        "optimizer.lr=1e-2", "checkpoint_every=1", "keep_checkpoints=0", judge=False))
    train(config, retrieval=retrieval, judge=None)
    checkpoints = tmp_path / "checkpoints"
    pending = torch.load(checkpoints / "step_000002" / "pending_rank0.pt", weights_only=False)
    batch = pending["batch"]
    sampler = load_policy(str(checkpoints / "step_000001" / "model"), device="cpu").model.eval()  # the adapter after step 1
    with torch.no_grad():
        logp = sequence_logprobs(sampler, batch.input_ids, batch.attention_mask)
    mask = batch.completion_mask
    # Same weights, another slice through the head (logits_to_keep) and the log-softmax.
    assert torch.allclose(pending["behaviour_logp"][mask], logp[mask], atol=_logp_tolerance(sampler, batch), rtol=0)
