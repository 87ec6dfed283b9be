"""The trainer config: loading, overrides, tagged unions, validation messages,
`calibrl train --print-config`, the example configs and the lr schedule."""

from __future__ import annotations

import math
import pathlib
import subprocess
import sys

import pytest

from calibrl.cli import main as calibrl_main
from calibrl.errors import ConfigError
from calibrl.trainer.config import CalibAdvAdvantage, GrpoAdvantage, TrainConfig, load_train_config
from calibrl.trainer.run_setup import lr_lambda

# Tolerances: an explicit one says the error it allows and why (tests/tolerances.py). A bare
# pytest.approx(x) (rel 1e-6, ~17 float32 roundings) compares values a few float operations
# from their reference (float64 arithmetic or a handful of float32 steps): below 1e-7 on any CPU.

ROOT = pathlib.Path(__file__).resolve().parent.parent
REQUIRED = ["policy.path=/models/p", "tasks.path=tasks.jsonl", "services.index_dir=/idx", "services.rubric_dir=/rub",
            "reward.rubric_id=r"]


def test_defaults_follow_the_design_and_overrides_are_typed():
    config = load_train_config(None, [*REQUIRED, "optimizer.lr=2e-5", "optimizer.betas=[0.9, 0.95]", "steps=7"])
    assert isinstance(config, TrainConfig)
    assert config.max_grad_norm == 0.5  # docs/design.md: grad norm clipped to 0.5 by default
    assert (config.reward.w_retrieval, config.reward.w_rubric) == (0.7, 0.3)
    assert isinstance(config.advantage, GrpoAdvantage) and config.advantage.scale == "group"
    assert config.optimizer.lr == 2e-5 and config.optimizer.betas == [0.9, 0.95] and config.steps == 7


def test_advantage_is_a_tagged_union_chosen_by_type(tmp_path):
    config = load_train_config(None, [*REQUIRED, "tasks.kind=search", "advantage.type=calibadv",
                                      "advantage.lambda_=1.5", "advantage.use_gold=true"])
    assert isinstance(config.advantage, CalibAdvAdvantage)
    assert config.advantage.params() == {"lambda_": 1.5}
    assert config.advantage.step_score_settings().use_gold is True
    assert GrpoAdvantage().step_score_settings() is None
    path = tmp_path / "run.yaml"
    path.write_text(config.to_yaml())
    again = load_train_config(path)  # the dumped YAML loads back to the same config
    assert again == config
    with pytest.raises(ConfigError, match=r"advantage.type: 'ppo' is not one of \['calibadv', 'grpo'\]"):
        load_train_config(None, [*REQUIRED, "advantage.type=ppo"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.group_size=1"], r"rollout.group_size=1: GRPO needs >= 2 rollouts per task .* use 4-16"),
        (["rollout.group_sise=4"], r"rollout.group_sise: unknown key; did you mean 'group_size'\?"),
        (["rollout.temperature=0"], r"rollout.temperature=0.0: .* greedy decoding is for `calibrl eval`"),
        (["tasks.kind=rewrite", "advantage.type=calibadv"], r"calibadv with tasks.kind=rewrite: .* use advantage.type=grpo"),
        (["services.judge=none"], r"services.judge=none but reward.w_rubric=0.3 .* set the rubric weights to 0"),
        (["services.index_dir="], r"services.retrieval=inprocess needs services.index_dir=<index folder>"),
        (["optimizer.warmup_steps=500", "steps=100"], r"warmup_steps=500 > steps=100"),
        (["loss.eps_low=1.0"], r"loss.eps_low=1.0: must be in \[0, 1\)"),
        (["max_grad_norm=-1"], r"max_grad_norm=-1.0: must be >= 0"),
        (["gradient_accumulation_steps=100", "rollout.prompts_per_step=2", "rollout.group_size=4"],
         r"gradient_accumulation_steps=100 > the step's 8 rollouts"),
        (["reward.w_retrieval=0", "reward.w_rubric=0"], r"reward.w_retrieval and reward.w_rubric are both 0"),
        (["optimizer.betas=[0.9]"], r"optimizer.betas=\[0.9\]: need two numbers"),
        (["health.max_frac_reward_zero_std=2"], r"health.max_frac_reward_zero_std=2.0: must be in \[0, 1\]"),
    ],
)
def test_bad_values_are_rejected_naming_the_value_and_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(None, [*REQUIRED, *overrides])


def test_required_paths_are_named():
    with pytest.raises(ConfigError, match=r"policy.path is empty: set policy.path="):
        load_train_config(None, [])


def test_print_config_lists_every_field_with_its_doc(capsys):
    assert calibrl_main(["train", "--print-config"]) == 0
    text = capsys.readouterr().out
    for key in ("policy.lora.r = 16", "reward.w_rubric = 0.3", "advantage.lambda_ = 1.0", "advantage.scale = 'group'",
                "loss.beta = 0.04", "optimizer.schedule = 'constant'", "max_grad_norm = 0.5",
                "health.kl_target = 0.5", "services.retrieval = 'inprocess'", "rollout.group_size = 8",
                "distributed.strategy = 'ddp'", "services.inprocess_judge.backend = 'programmatic'"):
        assert key in text, key
    # Every line that sets a value carries its documentation.
    assert all("  # " in line and not line.rstrip().endswith("#") for line in text.splitlines() if " = " in line)


def test_bad_config_exits_2_with_the_message(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout: {group_size: 1}\n")
    assert calibrl_main(["train", "--config", str(path), *REQUIRED]) == 2
    assert "rollout.group_size=1" in capsys.readouterr().err
    assert calibrl_main(["train", "--config", str(tmp_path / "missing.yaml")]) == 2


def test_print_resolved_applies_overrides(capsys, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 3\nrollout: {group_size: 4}\n")
    assert calibrl_main(["train", "--config", str(path), "--print-resolved", *REQUIRED, "steps=5"]) == 0
    out = capsys.readouterr().out
    assert "steps: 5" in out and "group_size: 4" in out


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_load_and_validate(path):
    config = load_train_config(path)
    assert config.policy.path and config.tasks.path


def test_help_does_not_import_torch():
    code = "import sys; from calibrl.cli import main; main(['train', '--print-config']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"


def _schedule(*overrides):
    config = load_train_config(None, [*REQUIRED, "steps=11", "optimizer.lr=1.0", *overrides])
    multiplier = lr_lambda(config)
    return [multiplier(n) for n in range(config.steps)]


def test_lr_schedules_warm_up_then_decay_to_the_floor():
    assert _schedule() == [1.0] * 11
    warm = _schedule("optimizer.warmup_steps=2")
    assert warm[:3] == [0.5, 1.0, 1.0]
    linear = _schedule("optimizer.schedule=linear", "optimizer.warmup_steps=1", "optimizer.min_lr_ratio=0.1")
    assert linear[0] == 1.0 and linear[1] == pytest.approx(1.0) and linear[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(linear, linear[1:]))
    cosine = _schedule("optimizer.schedule=cosine")
    # float64: 0.5 * (1 + cos(pi)) leaves ~1e-16; abs 1e-12 is ample, a wrong end point is off by >= 0.01.
    assert cosine[0] == 1.0 and cosine[-1] == pytest.approx(0.0, abs=1e-12)
    assert cosine[5] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


def test_readme_trainer_commands_use_real_flags(capsys):
    """Every --flag of a `calibrl train|eval` command on the docs' training page
    is one the command accepts (docs that cannot drift)."""
    import re

    readme = (ROOT / "docs" / "concepts" / "training.md").read_text()
    section = readme[readme.index("<!-- section:trainer -->"):readme.index("<!-- /section:trainer -->")]
    commands = re.findall(r"calibrl (train|eval)((?:[^\n]*\\\n)*[^\n]*)", section)
    assert {name for name, _ in commands} == {"train", "eval"}
    for name, text in commands:
        with pytest.raises(SystemExit):
            calibrl_main([name, "--help"])
        help_text = capsys.readouterr().out
        for flag in re.findall(r"(--[a-z][a-z-]*)", text):
            assert flag in help_text, f"docs/concepts/training.md uses calibrl {name} {flag}"


# --------------------------------------------------------------------------- prompt template


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("Question: {question}", r"rollout.prompt_template='Question: \{question\}': has the unknown placeholder "
                                 r"\{question\}; only \{query\} .* and \{context\}"),
        ("Answer briefly.", r"rollout.prompt_template='Answer briefly.': has no \{query\} placeholder; put \{query\} "
                            r"where the question goes .* or leave it empty for the built-in template"),
        ("Q: {query} {", r"Single '\{' encountered .*; write a literal brace as \{\{ or \}\}"),
        ("{}: {query}", r"unknown placeholder \{\}"),
        ("Q: {query!r}", r"unknown placeholder \{query!r\}"),
        ("Q: {{query}}", r"has no \{query\} placeholder"),  # an escaped brace is literal text, not the question
        ("Please " * 40 + "answer.", r"rollout.prompt_template='(Please ){8}Plea'\.\.\. \(287 chars\): has no \{query\}"),
    ],
)
def test_bad_prompt_templates_are_rejected_at_load(template, message):
    # Quoted so that YAML reads the override as text, as a user would on the command line.
    with pytest.raises(ConfigError, match=message):
        load_train_config(None, [*REQUIRED, f'rollout.prompt_template="{template}"'])


def test_prompt_template_files_that_cannot_be_used_are_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "latin1.txt").write_bytes("Frage: {query} \u00fcber".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "no_query.txt").write_text("Answer: {answer}\n")
    cases = {
        "@missing.txt": r"rollout.prompt_template='@missing.txt': the file missing.txt cannot be read \(No such file",
        "@latin1.txt": r"'@latin1.txt': the file latin1.txt is not UTF-8 text; give the path of a UTF-8 text file",
        "@empty.txt": r"'@empty.txt': the template in empty.txt is empty; write the template in it",
        "@no_query.txt": r"'@no_query.txt': the template in no_query.txt has the unknown placeholder \{answer\}",
    }
    for value, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_train_config(None, [*REQUIRED, f"rollout.prompt_template={value}"])
    assert calibrl_main(["train", *REQUIRED, "rollout.prompt_template=@missing.txt", "--print-resolved"]) == 2


def test_prompt_template_file_is_read_at_load_and_saved_as_text(tmp_path, monkeypatch):
    from calibrl.trainer.search_format import REWRITE_TEMPLATE, SEARCH_TEMPLATE

    default = load_train_config(None, REQUIRED).rollout
    assert default.prompt_template == "" and default.chat_template == "auto" and default.chat_template_flag() is None
    assert default.template_for("rewrite") == REWRITE_TEMPLATE and default.template_for("search") == SEARCH_TEMPLATE

    text = "You are a careful research assistant.\n{context}Question: {query}\nUse {{braces}} sparingly.\n"
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "mine.txt").write_text(text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)  # @paths are relative to the current directory
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("rollout:\n  prompt_template: '@prompts/mine.txt'\n  chat_template: off\n")
    config = load_train_config(run_yaml, REQUIRED)
    assert config.rollout.prompt_template == text  # the file's text replaces the path
    assert config.rollout.template_for("rewrite") == config.rollout.template_for("search") == text
    assert config.rollout.chat_template == "off" and config.rollout.chat_template_flag() is False  # bare YAML off
    assert load_train_config(None, [*REQUIRED, "rollout.chat_template=on"]).rollout.chat_template_flag() is True

    # The saved config (every checkpoint's config.yaml) holds the text and loads back
    # the same, from anywhere: the template file is not needed any more.
    saved = tmp_path / "saved.yaml"
    saved.write_text(config.to_yaml())
    (tmp_path / "prompts" / "mine.txt").unlink()
    monkeypatch.chdir(ROOT)
    assert load_train_config(saved) == config
    with pytest.raises(ConfigError, match=r"rollout.chat_template: 'maybe' is not one of \['auto', 'on', 'off'\]"):
        load_train_config(None, [*REQUIRED, "rollout.chat_template=maybe"])


def test_the_demo_and_study_runs_keep_the_forward_their_records_were_made_with(tmp_path):
    """A group's prompt runs once by default; the demo's, the study's and the living-rubric runs
    turn it off, because their published records were made with the one-pass forward."""
    import inspect
    import types

    from calibrl.demo import living_rubric, training
    from calibrl.demo.search_design import FULL_SEARCH, RECORDED_FORWARD, train_overrides
    from calibrl.demo.settings import FULL

    assert load_train_config(None, ["policy.path=p", "tasks.path=t", "services.retrieval=x:1",
                                    "services.judge=none", "reward.w_rubric=0"]).rollout.share_prompt_prefix
    search = train_overrides(FULL_SEARCH, "grpo", policy="p", tasks="t", output_dir=tmp_path, retrieval="x:1", seed=6)
    run = types.SimpleNamespace(settings=FULL, seed=6, out=tmp_path)
    clients = types.SimpleNamespace(retrieval_target="x:1")
    arm = types.SimpleNamespace(name="dense")
    rewrite = training._rewrite_overrides(run, arm, tmp_path, tmp_path, clients, False)
    for overrides in (search, rewrite):
        config = load_train_config(None, [*overrides, "services.judge=none", "reward.w_rubric=0"])
        assert config.rollout.share_prompt_prefix is False
    assert "RECORDED_FORWARD" in inspect.getsource(living_rubric._train)
    assert RECORDED_FORWARD == "rollout.share_prompt_prefix=false"


@pytest.mark.parametrize("prefix, generation, shared", [
    ("true", "auto", True), ("false", "auto", False), ("false", "on", True), ("true", "off", False)])
def test_the_engine_shares_prompts_as_share_generation_prompts_says(prefix, generation, shared):
    """``rollout.share_generation_prompts``: auto follows share_prompt_prefix; on / off set the
    engine's prefill sharing alone (the log-prob passes follow share_prompt_prefix)."""
    from calibrl.trainer.run_setup import _engine_kwargs

    config = load_train_config(None, ["policy.path=p", "tasks.path=t", "services.retrieval=x:1", "services.judge=none",
                                      "reward.w_rubric=0", f"rollout.share_prompt_prefix={prefix}",
                                      f"rollout.share_generation_prompts={generation}"])
    assert _engine_kwargs(config)["share_prompts"] is shared
    assert config.rollout.share_prompt_prefix is (prefix == "true")


def test_share_generation_prompts_refuses_other_values():
    with pytest.raises(Exception, match="share_generation_prompts"):
        load_train_config(None, ["policy.path=p", "tasks.path=t", "services.retrieval=x:1", "services.judge=none",
                                 "reward.w_rubric=0", "rollout.share_generation_prompts=sometimes"])


def test_a_search_design_passes_its_generation_knobs_to_the_trainer(tmp_path):
    """chunk_prompts and share_generation_prompts reach the trainer's config when a design sets
    them; at their defaults the overrides (and so a recorded run's command) are unchanged."""
    from calibrl.demo.search_design import FULL_SEARCH, describe_design, train_overrides

    def config(design):
        overrides = train_overrides(design, "grpo", policy="p", tasks="t", output_dir=tmp_path, retrieval="x:1", seed=6)
        return overrides, load_train_config(None, overrides).rollout

    defaults = FULL_SEARCH.with_overrides(chunk_prompts=0, share_generation_prompts="auto")
    plain, rollout = config(defaults)
    assert not any("chunk_prompts" in o or "share_generation_prompts" in o for o in plain)
    assert rollout.chunk_prompts == 0 and rollout.share_generation_prompts == "auto"
    changed = FULL_SEARCH.with_overrides(chunk_prompts=4, share_generation_prompts="on")
    _, rollout = config(changed)
    assert rollout.chunk_prompts == 4 and rollout.share_generation_prompts == "on"
    assert rollout.share_prompt_prefix is False  # the log-prob passes keep the recorded forward
    assert "4 questions per generation chunk" in describe_design(changed)
    assert "generation chunk" not in describe_design(defaults)
