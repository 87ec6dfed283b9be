"""`calibrl eval`: greedy held-out metrics of a base model, a trained (LoRA)
checkpoint and the raw-query baseline, side by side, through a real index; and the
prompt each model gets (its training template, or a flag's)."""

from __future__ import annotations

import json
import math

import pytest

from calibrl.cli import main as calibrl_main
from calibrl.errors import ConfigError
from tests.test_trainer_support import one_torch_thread, trainer_world  # noqa: F401  (fixtures)
from calibrl.trainer.aio import BackgroundLoop
from calibrl.trainer.config import load_train_config
from calibrl.trainer.eval import (
    EvalSettings,
    PromptChoice,
    evaluate_models,
    format_table,
    load_eval_tasks,
    resolve_model_path,
)
from calibrl.trainer.loop import train


@pytest.fixture(scope="module")
def lora_run(trainer_world, tmp_path_factory):
    pytest.importorskip("peft")
    out = tmp_path_factory.mktemp("lora-run")
    retrieval, _ = trainer_world.clients(judge=False)
    config = load_train_config(None, trainer_world.overrides(
        out, "steps=1", "policy.lora.enabled=true", "policy.lora.r=4", "optimizer.lr=5e-2", judge=False))
    train(config, retrieval=retrieval, judge=None)
    return out


def test_cli_compares_models_side_by_side_and_writes_json(trainer_world, lora_run, tmp_path, capsys):
    out = tmp_path / "eval.json"
    code = calibrl_main([
        "eval", "--model", str(trainer_world.policy_dir), "--model", str(lora_run), "--name", "base",
        "--name", "trained", "--tasks", str(trainer_world.rewrite_tasks), "--index", str(trainer_world.index_dir),
        "--raw-query-baseline", "--max-new-tokens", "6", "--device", "cpu", "--top-k", "5", "--out", str(out),
    ])
    assert code == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:4] == ["model", "tasks", "hit@k", "all_gold@k"]
    assert [line.split()[0] for line in table[2:]] == ["raw", "base", "trained"]
    payload = json.loads(out.read_text())
    assert payload["num_tasks"] == 12 and payload["settings"]["top_k"] == 5
    rows = {row["name"]: row for row in payload["results"]}
    assert rows["trained"]["model"].endswith("step_000001/model")
    # The original queries name their passage: the baseline retrieves almost all of them.
    assert rows["raw query"]["metrics"]["hit@k"] >= 0.75
    for row in rows.values():
        metrics = row["metrics"]
        assert 0.0 <= metrics["all_gold@k"] <= metrics["hit@k"] <= 1.0
        assert 0.0 <= metrics["mrr"] <= 1.0 and 0.0 <= metrics["empty_rewrite_rate"] <= 1.0


def test_greedy_eval_is_deterministic_and_covers_the_search_agent(trainer_world):
    retrieval, _ = trainer_world.clients(judge=False)
    tasks = load_eval_tasks(str(trainer_world.rewrite_tasks), limit=6)
    settings = EvalSettings(max_new_tokens=6, device="cpu")
    with BackgroundLoop() as loop:
        first = evaluate_models([str(trainer_world.policy_dir)], tasks, retrieval, settings, run_async=loop.run)
        second = evaluate_models([str(trainer_world.policy_dir)], tasks, retrieval, settings, run_async=loop.run)
        assert first[0].metrics == second[0].metrics and first[0].num_tasks == 6
        search_tasks = load_eval_tasks(str(trainer_world.search_tasks))
        search = evaluate_models([str(trainer_world.policy_dir)], search_tasks, retrieval,
                                 EvalSettings(max_new_tokens=8, max_turns=2, max_obs_tokens=24, device="cpu"),
                                 run_async=loop.run, names=["base"])
    metrics = search[0].metrics
    assert set(metrics) == {"em", "f1", "answered", "well_formed", "searches", "gold_doc_recall"}
    assert all(0.0 <= metrics[k] <= 1.0 for k in ("em", "f1", "answered", "well_formed"))
    assert 0.0 <= metrics["searches"] <= 1.0  # at most one search fits in two turns
    assert math.isnan(metrics["gold_doc_recall"]) or 0.0 <= metrics["gold_doc_recall"] <= 1.0
    assert "em" in format_table(search).splitlines()[0]


def test_task_by_task_rewrite_hits_average_to_the_evaluators_hit(trainer_world):
    """The demo's paired rewriter comparisons decode each task as the evaluator does: the
    per-task hits (and the raw query's) average exactly to the evaluation's hit@k."""
    from calibrl.demo.rewrite_analysis import greedy_rewrite_hits

    retrieval, _ = trainer_world.clients(judge=False)
    tasks = load_eval_tasks(str(trainer_world.rewrite_tasks), limit=8)
    settings = EvalSettings(top_k=2, max_new_tokens=6, device="cpu", batch_size=3)
    with BackgroundLoop() as loop:
        raw, model = evaluate_models([str(trainer_world.policy_dir)], tasks, retrieval, settings, run_async=loop.run,
                                     raw_query_baseline=True)
        hits = greedy_rewrite_hits(str(trainer_world.policy_dir), tasks, retrieval, settings, loop.run)
        raw_hits = greedy_rewrite_hits(None, tasks, retrieval, settings, loop.run)
    assert len(hits) == 8 and set(hits) <= {0.0, 1.0}
    # means of 8 values in {0, 1}: exact in float64
    assert sum(hits) / 8 == model.metrics["hit@k"] and sum(raw_hits) / 8 == raw.metrics["hit@k"]


def test_model_paths_resolve_and_held_out_split_matches_training(trainer_world, lora_run, tmp_path):
    assert resolve_model_path(trainer_world.policy_dir) == trainer_world.policy_dir
    checkpoint_model = lora_run / "checkpoints" / "step_000001" / "model"
    assert resolve_model_path(lora_run) == checkpoint_model
    assert resolve_model_path(lora_run / "checkpoints" / "step_000001") == checkpoint_model
    with pytest.raises(ConfigError, match="not a model folder"):
        resolve_model_path(tmp_path)
    from calibrl.trainer.tasks import load_tasks, split_tasks

    train_part, heldout = split_tasks(load_tasks(trainer_world.rewrite_tasks), 0.25, 7)
    evaluated = load_eval_tasks(str(trainer_world.rewrite_tasks), heldout_fraction=0.25, seed=7)
    assert [t.task_id for t in evaluated] == [t.task_id for t in heldout]
    assert not {t.task_id for t in evaluated} & {t.task_id for t in train_part}


# --------------------------------------------------------------------------- prompt templates

TRAINED_TEMPLATE = "Templated tiny policy, rewrite this.\n{context}Q: {query}\nQuery:"
OVERRIDE_TEMPLATE = "Override prompt from a flag.\nQ: {query}\nQuery:"
CHAT_TEMPLATE = ("{% for m in messages %}<|user|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


class RecordingEngines:
    """Stands in for ``calibrl.trainer.engines.make_engine``: makes the real engine and records
    the decoded prompts of every ``generate`` call, one list per engine made."""

    def __init__(self) -> None:
        from calibrl.trainer.engines import make_engine

        self.make = make_engine
        self.prompts: list[list[str]] = []

    def __call__(self, kind, policy, **kwargs):
        seen: list[str] = []
        self.prompts.append(seen)
        return _RecordingEngine(self.make(kind, policy, **kwargs), policy.tokenizer, seen)


class _RecordingEngine:
    def __init__(self, engine, tokenizer, seen):
        self.engine, self.tokenizer, self.seen = engine, tokenizer, seen

    def generate(self, prompts, **kwargs):
        self.seen.extend(self.tokenizer.decode(ids) for ids in prompts)
        return self.engine.generate(prompts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.fixture(scope="module")
def templated_run(trainer_world, tmp_path_factory):
    """A one-step full-weight run trained with TRAINED_TEMPLATE from an @file, and the
    prompts its rollouts sent to the engine."""
    out = tmp_path_factory.mktemp("templated-run")
    template_file = out / "prompt.txt"
    template_file.write_text(TRAINED_TEMPLATE, encoding="utf-8")
    retrieval, _ = trainer_world.clients(judge=False)
    config = load_train_config(None, trainer_world.overrides(
        out / "run", "steps=1", f"rollout.prompt_template=@{template_file}", judge=False))
    engines = RecordingEngines()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("calibrl.trainer.engines.make_engine", engines)
        train(config, retrieval=retrieval, judge=None)
    template_file.unlink()  # the run must not need the file any more
    return out / "run", engines.prompts


def test_training_rollouts_use_the_configured_template_and_chat_choice(trainer_world, tmp_path):
    from calibrl.trainer.engines import make_engine
    from calibrl.trainer.sampling import rollout_settings
    from calibrl.trainer.task_kinds import task_kind
    from calibrl.trainer.policy import load_policy
    from calibrl.trainer.search_format import REWRITE_TEMPLATE, SEARCH_TEMPLATE
    from calibrl.trainer.tasks import load_tasks

    policy = load_policy(str(trainer_world.policy_dir), device="cpu")
    policy.tokenizer.chat_template = CHAT_TEMPLATE  # an instruction-tuned tokenizer
    engine = make_engine("transformers", policy)
    retrieval, _ = trainer_world.clients(judge=False)
    custom = 'rollout.prompt_template="Custom instruction.\\n{context}Q: {query}\\nA:"'
    with BackgroundLoop() as background:
        for kind, path, builtin in (("rewrite", trainer_world.rewrite_tasks, REWRITE_TEMPLATE),
                                    ("search", trainer_world.search_tasks, SEARCH_TEMPLATE)):
            tasks = load_tasks(path)[:2]
            for template, chat, wrapped in ((custom, "auto", True), (custom, "off", False), ("", "on", True)):
                config = load_train_config(None, trainer_world.overrides(
                    tmp_path, *([template] if template else []), f"rollout.chat_template={chat}",
                    "rollout.group_size=2", "rollout.max_new_tokens=3", "rollout.max_turns=1", judge=False))
                registered = task_kind(kind)
                batch = registered.rollout(engine, policy.tokenizer, tasks, rollout_settings(config, registered, 0),
                                           retrieval, background.run)
                for row in (0, 2):  # the first rollout of each task
                    prompt = policy.tokenizer.decode(batch.input_ids[row, : batch.prompt_lengths[row]])
                    task = tasks[row // 2]
                    assert f"Q: {task.query}\nA:" in prompt if template else builtin.split("{")[0] in prompt
                    assert ("Custom instruction." in prompt) == bool(template)
                    assert prompt.startswith("<|user|>") == wrapped  # else "<s>": the tokenizer's own BOS
                    assert ("<|assistant|>" in prompt) == wrapped
                    assert prompt.endswith("<think>") == (kind == "search")


def test_a_custom_template_is_saved_in_the_checkpoint_and_eval_uses_it(trainer_world, templated_run, tmp_path,
                                                                       capsys, monkeypatch):
    import hashlib

    import yaml

    from calibrl.trainer.search_format import REWRITE_TEMPLATE

    run, train_prompts = templated_run
    assert train_prompts and train_prompts[0]
    assert all(p.startswith("<s>Templated tiny policy, rewrite this.\nQ: ") for p in train_prompts[0])
    saved = yaml.safe_load((run / "checkpoints" / "step_000001" / "config.yaml").read_text())
    assert saved["rollout"]["prompt_template"] == TRAINED_TEMPLATE  # the text, not the @path

    engines = RecordingEngines()
    monkeypatch.setattr("calibrl.trainer.engines.make_engine", engines)
    out = tmp_path / "eval.json"
    common = ["eval", "--tasks", str(trainer_world.rewrite_tasks), "--limit", "3", "--index",
              str(trainer_world.index_dir), "--max-new-tokens", "4", "--device", "cpu", "--out", str(out)]
    assert calibrl_main([*common, "--model", str(run), "--name", "trained",
                         "--model", str(trainer_world.policy_dir), "--name", "base"]) == 0
    trained_prompts, base_prompts = engines.prompts
    queries = [t.query for t in load_eval_tasks(str(trainer_world.rewrite_tasks), limit=3)]
    assert trained_prompts == [f"<s>Templated tiny policy, rewrite this.\nQ: {q}\nQuery:" for q in queries]
    assert base_prompts == ["<s>" + REWRITE_TEMPLATE.format(query=q, context="") for q in queries]
    rows = {row["name"]: row["prompt"] for row in json.loads(out.read_text())["results"]}
    digest = hashlib.sha256(TRAINED_TEMPLATE.encode()).hexdigest()
    assert rows["trained"] == {
        "builtin": False, "sha256": digest[:12], "template": TRAINED_TEMPLATE, "template_source": "checkpoint",
        "chat_template": "auto", "chat_template_source": "checkpoint", "chat_template_applied": False,
    }
    assert rows["base"]["builtin"] is True and rows["base"]["template"] == REWRITE_TEMPLATE
    assert rows["base"]["template_source"] == "default"
    table = {line.split()[0]: line.split()[-1] for line in capsys.readouterr().out.splitlines()[2:]}
    assert table == {"trained": f"custom:{digest[:8]}", "base": "built-in"}

    # A flag overrides what the checkpoint was trained with.
    (tmp_path / "override.txt").write_text(OVERRIDE_TEMPLATE)
    engines.prompts.clear()
    assert calibrl_main([*common, "--model", str(run), "--prompt-template", f"@{tmp_path / 'override.txt'}"]) == 0
    assert engines.prompts[0] == [f"<s>Override prompt from a flag.\nQ: {q}\nQuery:" for q in queries]
    prompt = json.loads(out.read_text())["results"][0]["prompt"]
    assert (prompt["template"], prompt["template_source"], prompt["chat_template_source"]) == (
        OVERRIDE_TEMPLATE, "flag", "checkpoint")


def test_eval_prompt_overrides_and_their_errors(trainer_world, templated_run, capsys):
    from calibrl.trainer.search_format import REWRITE_TEMPLATE

    run, _ = templated_run
    retrieval, _ = trainer_world.clients(judge=False)
    tasks = load_eval_tasks(str(trainer_world.rewrite_tasks), limit=2)
    settings = EvalSettings(max_new_tokens=4, device="cpu")
    with BackgroundLoop() as loop:
        forced = evaluate_models([str(run / "checkpoints" / "step_000001" / "model")], tasks, retrieval, settings,
                                 run_async=loop.run, prompt_template="")  # "" forces the built-in template
        assert forced[0].prompt["builtin"] and forced[0].prompt["template"] == REWRITE_TEMPLATE
        assert forced[0].prompt["template_source"] == "flag"
        with pytest.raises(ConfigError, match=r"chat_template=on \(--chat-template\) but the tokenizer of .* has "
                                              r"no chat template; use auto or off"):
            evaluate_models([str(run)], tasks, retrieval, settings, run_async=loop.run, chat_template="on")
        with pytest.raises(ConfigError, match=r"prompt_template='Q: \{question\}': has the unknown placeholder"):
            evaluate_models([str(run)], tasks, retrieval, settings, run_async=loop.run, prompt_template="Q: {question}")
    # A bad flag is refused before any model or index loads.
    args = ["eval", "--model", str(run), "--tasks", str(trainer_world.rewrite_tasks), "--index", "/nonexistent"]
    assert calibrl_main([*args, "--prompt-template", "no placeholder"]) == 2
    assert "--prompt-template='no placeholder': has no {query} placeholder" in capsys.readouterr().err
    assert calibrl_main([*args, "--prompt-template", "@/nonexistent/prompt.txt"]) == 2
    assert "--prompt-template='@/nonexistent/prompt.txt': the file /nonexistent/prompt.txt cannot be read" in (
        capsys.readouterr().err)


def test_prompt_choice_follows_the_checkpoint_config(trainer_world, tmp_path):
    from calibrl.trainer.eval import checkpoint_config_path, choose_prompt

    assert checkpoint_config_path(trainer_world.policy_dir) is None  # a base model
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000004"
    (checkpoint / "model").mkdir(parents=True)
    (checkpoint / "model" / "config.json").write_text("{}")
    (checkpoint / "state.json").write_text("{}")
    config = checkpoint / "config.yaml"
    for path in (tmp_path / "run", checkpoint, checkpoint / "model"):
        assert checkpoint_config_path(path) == config

    # A run from before these options: the built-in prompt it was trained with.
    config.write_text("rollout: {group_size: 4}\ntasks: {kind: rewrite}\n")
    assert choose_prompt(checkpoint, "rewrite") == PromptChoice("", "auto", "checkpoint", "checkpoint")
    config.write_text("rollout: {prompt_template: 'Q: {query}', chat_template: off}\n")
    assert choose_prompt(tmp_path / "run", "search", chat_template="on") == PromptChoice(
        "Q: {query}", "on", "checkpoint", "flag")
    assert choose_prompt(trainer_world.policy_dir, "search") == PromptChoice()
    config.write_text("rollout: {prompt_template: 'no query here'}\n")
    with pytest.raises(ConfigError, match=r"step_000004/config.yaml: rollout.prompt_template='no query here': has no"):
        choose_prompt(checkpoint, "rewrite")
    config.write_text("[not, a, config]\n")
    with pytest.raises(ConfigError, match=r"config.yaml: no 'rollout' section"):
        choose_prompt(checkpoint, "rewrite")
