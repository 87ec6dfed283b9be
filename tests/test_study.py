"""`calibrl study` (issue 11, "A study with power"): one tiny seed end to end with the
real retrieval and judge servers, the report's structure and the consistency of its
numbers; the aggregation over seeds on hand-made records; the per-question scores
against ``calibrl.trainer.eval``; the command line's errors."""

from __future__ import annotations

import dataclasses
import json
import re
import types

import pytest

from calibrl.studies import search_arms_report as study_report
from calibrl.studies.search_arms import ARMS, SETTINGS, StudyPlan, main, parse_seeds, question_scores, run_study
from tests.test_trainer_support import TrainerWorld, one_torch_thread, trainer_world  # noqa: F401  (fixtures)

# the hand-made records' arms (the aggregation is the same for any arms)
ARM_NAMES = ["grpo", "calibadv", "grpo_steps", "calibadv_steps"]
TINY_ARMS = [a for a in ARMS if a.name in ("grpo", "calibadv", "calibadv_silver")]  # the study's default arms
# Means of a few dozen numbers in [0, 1], summed in different orders: equal to 1e-12.
SUM_TOL = 1e-12


def _tiny_plan() -> StudyPlan:
    from calibrl.demo.cli import QUICK

    design = QUICK.search.with_overrides(steps=2, prompts_per_step=2, warm_steps=20)
    demo = dataclasses.replace(QUICK, name="tiny", search=design, rewrite_examples=200)
    return StudyPlan(demo, seeds=(0,), heldout_limit=4)


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    report = run_study(_tiny_plan(), out, command="calibrl study (test)")
    return out, report


def test_the_study_writes_its_report_tables_and_plots(tiny_study):
    out, report = tiny_study
    text = report.read_text(encoding="utf-8")
    for heading in ("## What the data shows", "## Held-out answer F1, normal setting",
                    "## Held-out answer F1, stress setting", "## Held-out answer F1, long setting",
                    "## Collapse signals per step"):
        assert heading in text
    lines = text.splitlines()
    for label in [a.label for a in TINY_ARMS] + ["base search agent (untrained)",
                                                "best constant answer per aspect (no search)"]:
        # per setting, a row of the F1 table ("| label | 41.7 [35.0, 48.3] | ...")
        assert sum(bool(re.match(rf"\| {re.escape(label)} \| [\d.]+ \[", line)) for line in lines) == 3
    for arm in TINY_ARMS:  # and a row of the collapse table per setting
        assert sum(line.startswith(tuple(f"| {s} | {arm.label} | " for s in SETTINGS)) for line in lines) == 3
    # Per setting: three pairs of arms, three arm-vs-base and three arm-vs-best-constant rows of F1, six
    # rows of exact match, and six of search recall (pairs and vs the base); each with its interval over
    # questions and over seeds, then questions.
    assert sum(bool(re.search(r"\| (yes|no) \| [+-][\d.]+ \[[+-][\d.]+, [+-][\d.]+\] \|$", line))
               for line in lines) == 3 * (3 + 3 + 3 + 6 + 6)
    assert sum(line.startswith("Exact-match gain over the base (") for line in lines) == 3
    assert sum(line.startswith("Search recall (") for line in lines) == 3
    # H1 and H2 are answered in the verdict, for both CalibAdv arms
    verdict = text.split("## What the data shows")[1].split("##")[0]
    for label in ("CalibAdv (gold as silver)", "CalibAdv (authors' silver)"):
        assert sum(label in line and "points of search recall" in line for line in verdict.splitlines()) == 1
    # the long run: held-out figures at every checkpoint, and last - best with its interval
    assert "Held-out figures along the long run" in text
    assert sum(line.startswith(f"| {a.label} | recall | ") for a in TINY_ARMS for line in lines) == 3
    assert "CalibAdv" in text.split("## What the data shows")[1].split("##")[0]
    for stem in ("well_formed", "searches_per_trajectory", "repeated_share", "entropy", "ref_ppl", "reward"):
        assert (out / "plots" / f"{stem}.png").stat().st_size > 1000
        assert f"plots/{stem}.png" in text


def test_the_numbers_are_consistent(tiny_study):
    out, _ = tiny_study
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    summary, seed = results["summary"], results["seeds"][0]
    assert summary["questions_per_seed"] == {"0": 4} and len(seed["base"]["f1"]) == 4
    base_mean = sum(seed["base"]["f1"]) / 4
    assert summary["base"]["f1"]["estimate"] == pytest.approx(base_mean, abs=SUM_TOL)
    for setting in SETTINGS:
        arms = summary["settings"][setting]["arms"]
        means = {name: arm["f1"]["estimate"] for name, arm in arms.items()}
        means["base"] = base_mean
        means["best_constant"] = sum(seed["constant"]["f1"]) / 4
        for name, arm in arms.items():
            scores = seed["runs"][setting][name]["scores"]
            assert arm["per_seed_f1"]["0"] == pytest.approx(sum(scores["f1"]) / 4, abs=SUM_TOL)
            assert arm["f1"]["low"] <= arm["f1"]["estimate"] <= arm["f1"]["high"]
            assert all(0.0 <= v <= 1.0 for v in scores["f1"] + scores["well_formed"])
        pairs = summary["settings"][setting]["paired"]
        assert len(pairs) == 9
        recall = {(p["a"], p["b"]): p for p in summary["settings"][setting]["paired_recall"]}
        seed_recall = {name: sum(seed["runs"][setting][name]["scores"]["recall"]) / 4 for name in arms}
        seed_recall["base"] = sum(seed["base"]["recall"]) / 4
        for (a, b), pair in recall.items():
            assert pair["estimate"] == pytest.approx(seed_recall[a] - seed_recall[b], abs=SUM_TOL)
        for pair in pairs:  # the paired difference is the difference of the means on the same questions
            assert pair["estimate"] == pytest.approx(means[pair["a"]] - means[pair["b"]], abs=SUM_TOL)
            assert pair["low"] <= pair["estimate"] <= pair["high"]
            # one seed: the hierarchical bootstrap draws that seed every time, so its interval is the
            # clustered one's up to the bootstrap's own noise, around the same estimate
            between = pair["between_seeds"]
            assert between["estimate"] == pytest.approx(pair["estimate"], abs=SUM_TOL)
            assert between["low"] <= between["estimate"] <= between["high"]


def test_every_run_logged_its_collapse_signals_each_step(tiny_study):
    out, _ = tiny_study
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    plan = results["plan"]
    assert plan["stress_lr"] == pytest.approx(5 * plan["lr"], rel=1e-12)
    assert plan["long_steps"] == 4 * plan["search_steps"]
    for setting in SETTINGS:
        for arm in TINY_ARMS:
            run = results["seeds"][0]["runs"][setting][arm.name]
            steps = run["steps"]
            assert [s["step"] for s in steps] == list(range(1, 1 + (8 if setting == "long" else 2)))
            if setting == "long":  # held-out figures at each of its four checkpoints, the last the final policy's
                assert [c["step"] for c in run["curve"]] == [2, 4, 6, 8]
                assert run["curve"][-1]["f1"] == run["scores"]["f1"]
                assert all(len(c["recall"]) == 4 for c in run["curve"])
            for record in steps:
                assert 0.0 <= record["search/well_formed"] <= 1.0
                assert record["search/searches_per_trajectory"] >= 0.0
                assert record["policy/ref_ppl"] >= 1.0 and record["entropy"] >= 0.0
                assert ("steps/reward/mean" in record) == arm.step_rewards
            curve = results["summary"]["settings"][setting]["signals"][arm.name]["policy/ref_ppl"]
            assert curve == pytest.approx([s["policy/ref_ppl"] for s in steps], rel=1e-12)
    # The judge server for the search-step rubric was started (the step-rewarded arms, --arms, call it).
    assert (out / "seed_0" / "logs" / "serve_judge.log").exists()


# --------------------------------------------------------------------------- aggregation on hand-made records


def _record(seed: int, questions: list[str], base: list[float], arms: dict[str, list[float]]) -> dict:
    def scores(f1):
        return {"f1": f1, "em": [float(v == 1.0) for v in f1], "well_formed": [1.0] * len(f1),
                "searches": [2] * len(f1), "category": ["correct" if v > 0.5 else "wrong_answer" for v in f1]}

    step = {"step": 1, "search/well_formed": 1.0, "search/searches_per_trajectory": 2.0,
            "search/repeated_share": 0.0, "entropy": 1.0, "policy/ref_ppl": 3.0, "reward": 0.5,
            "frac_reward_zero_std": 0.25, "calibadv/frac_tokens_softened": 0.125,
            "calibadv/frac_groups_answer_zeroed": 0.5}
    runs = {setting: {name: {"scores": scores(f1), "steps": [dict(step)], "wall_s": 1.0} for name, f1 in arms.items()}
            for setting in ("normal", "stress")}
    return {"seed": seed, "questions": [{"task_id": q, "question": q} for q in questions], "base": scores(base),
            "runs": runs}


PLAN = {"mode": "hand", "seeds": [0, 1], "arms": ARM_NAMES, "settings": ["normal", "stress"], "search_steps": 1,
        "questions_per_step": 1, "group_size": 2, "lr": 1e-4, "stress_lr": 5e-4, "kl_beta": 0.1, "max_turns": 3,
        "search_top_k": 2, "w_steps": 0.5, "warm_agent_steps": 1, "heldout_limit": 0}


def _hand_records(shared: bool) -> list[dict]:
    import random

    rng = random.Random(0)
    records = []
    for seed in (0, 1):
        names = [f"q{i}" for i in range(40)] if shared else [f"s{seed}-q{i}" for i in range(40 + 10 * seed)]
        base = [rng.random() * 0.6 for _ in names]
        arms = {"grpo": [b + 0.2 for b in base], "calibadv": [b + 0.2 for b in base],
                "grpo_steps": [max(0.0, b - 0.1) for b in base], "calibadv_steps": list(base)}
        records.append(_record(seed, names, base, arms))
    return records


@pytest.mark.parametrize("shared", [True, False])
def test_aggregation_over_seeds_on_hand_made_records(shared, tmp_path):
    records = _hand_records(shared)
    summary = study_report.summarize(PLAN, records)
    assert summary["shared_questions"] is shared
    normal = summary["settings"]["normal"]
    by_pair = {(p["a"], p["b"]): p for p in normal["paired"]}
    # GRPO and CalibAdv are identical: exactly 0. GRPO is the base + 0.2 on every question: the interval at 0.2.
    assert (by_pair[("grpo", "calibadv")]["low"], by_pair[("grpo", "calibadv")]["high"]) == (0.0, 0.0)
    grpo_vs_base = by_pair[("grpo", "base")]
    assert grpo_vs_base["low"] == pytest.approx(0.2, abs=SUM_TOL) and grpo_vs_base["high"] == pytest.approx(
        0.2, abs=SUM_TOL)
    units = 40 if shared else 90  # shared: questions averaged over seeds; else every (seed, question)
    assert normal["arms"]["grpo"]["f1"]["units"] == units
    all_base = [v for r in records for v in r["base"]["f1"]]
    if not shared:  # the pooled mean weighs each (seed, question) once
        assert summary["base"]["f1"]["estimate"] == pytest.approx(sum(all_base) / 90, abs=SUM_TOL)
    for seed in ("0", "1"):
        record = records[int(seed)]
        assert normal["arms"]["calibadv_steps"]["per_seed_f1"][seed] == pytest.approx(
            sum(record["base"]["f1"]) / len(record["base"]["f1"]), abs=SUM_TOL)
    path = study_report.write_study(PLAN, records, tmp_path, command="hand", wall_s=1.0,
                                    arm_labels={a.name: a.label for a in ARMS})
    verdict = path.read_text(encoding="utf-8").split("## What the data shows")[1].split("##")[0]
    assert "the study cannot tell them apart" in verdict  # CalibAdv vs GRPO: identical arms
    assert "GRPO beats base search agent (untrained)" in verdict
    assert "GRPO + step rewards does worse than GRPO" in verdict
    # Under stress too, GRPO + step rewards sits 0.1 below the base on every question: flagged, and only it.
    assert "Signs of collapse: GRPO + step rewards (held-out F1 below the base's (paired interval below 0))." in verdict
    assert "12.5% of the trained tokens" in verdict and "answer advantages of 50.0% of the groups" in verdict
    assert "25.0% of the groups had all-equal rewards" in verdict
    base_correct = sum(v > 0.5 for r in records for v in r["base"]["f1"]) / sum(len(r["base"]["f1"]) for r in records)
    assert summary["base"]["categories"]["correct"] == pytest.approx(base_correct, abs=SUM_TOL)
    assert "| policy | correct % | wrong_answer % |" in path.read_text(encoding="utf-8")
    # exact match, paired the same way: an arm that answers one more question exactly per seed
    for record in records:
        record["runs"]["normal"]["grpo"]["scores"]["em"][0] = 1.0
    em_summary = study_report.summarize(PLAN, records)["settings"]["normal"]["paired_em_vs_base"]
    em_grpo = {p["a"]: p for p in em_summary}["grpo"]
    questions = 40 if shared else 90
    assert em_grpo["estimate"] == pytest.approx((1 if shared else 2) / questions, abs=SUM_TOL)
    assert {p["a"]: p for p in em_summary}["calibadv"]["estimate"] == 0.0
    assert "Exact-match gain over the base (normal)" in study_report.write_study(
        PLAN, records, tmp_path, command="hand", wall_s=1.0,
        arm_labels={a.name: a.label for a in ARMS}).read_text(encoding="utf-8")


def test_phrasings_of_one_question_are_resampled_together(tmp_path):
    """Task ids ``<question>-<n>`` are phrasings of one question: the units stay the tasks,
    but a bootstrap draws whole questions (wider than drawing phrasings one by one)."""
    import random

    rng = random.Random(3)
    per_question = [rng.choice((0.0, 1.0)) for _ in range(20)]
    records = []
    for seed in (0, 1):
        names = [f"ms-q{i}-{n}" for i in range(20) for n in range(3)]
        arms = {name: [per_question[k // 3] for k in range(60)] for name in ARM_NAMES}
        records.append(_record(seed, names, [0.0] * 60, arms))
    assert study_report.question_clusters(records) is not None
    assert study_report.question_clusters(_hand_records(False)) is None  # "s0-q1": no phrasing number
    clustered = study_report.paired(records, "normal", "grpo", "base")
    flat = [dict(r, questions=[{"task_id": f"t{k}", "question": ""} for k in range(60)]) for r in records]
    assert study_report.question_clusters(flat) is None
    loose = study_report.paired(flat, "normal", "grpo", "base")
    assert clustered.estimate == pytest.approx(loose.estimate, abs=SUM_TOL)
    assert clustered.high - clustered.low > 1.3 * (loose.high - loose.low)
    assert study_report.summarize(PLAN, records)["clustered"] is True


def test_best_constant_and_readout_join_the_summary_and_bridges_cluster(tmp_path):
    """Seeds with a best-constant baseline and read-out fields: the constant is compared like
    the base, read-out rates are pooled over (seed, question), and the questions through one
    bridge document are resampled together."""
    records = _hand_records(False)
    for record in records:
        count = len(record["questions"])
        for i, question in enumerate(record["questions"]):
            question["bridge"] = f"s{record['seed']}-bridge{i // 5}"
        record["constant"] = {"answers": {"risk_rating": "2"}, "aspect": ["risk_rating"] * count,
                              "f1": [0.25] * count, "em": [0.0] * count}
        grpo = record["runs"]["normal"]["grpo"]["scores"]
        grpo["found_answer_doc"] = [1.0] * (count // 2) + [0.0] * (count - count // 2)
        grpo["em"] = [1.0] * (count // 4) + [0.0] * (count - count // 4)  # exact on half of what it found
        grpo["grounded"] = [1.0] * count
    summary = study_report.summarize(PLAN, records)
    normal = summary["settings"]["normal"]
    by_pair = {(p["a"], p["b"]): p for p in normal["paired"]}
    assert summary["constant"]["f1"]["estimate"] == pytest.approx(0.25, abs=SUM_TOL)
    assert ("grpo", study_report.CONSTANT) in by_pair and len(normal["paired"]) == 6 + 4 + 4
    assert normal["arms"]["grpo"]["readout_rate"] == pytest.approx((10 + 12) / (20 + 25), abs=SUM_TOL)
    assert normal["arms"]["grpo"]["grounded_share"] == 1.0 and "readout_rate" not in normal["arms"]["calibadv"]
    assert study_report.question_clusters(records) is not None  # 5 questions per bridge
    text = study_report.write_study(PLAN, records, tmp_path, command="hand", wall_s=1.0,
                                    arm_labels={a.name: a.label for a in ARMS}).read_text(encoding="utf-8")
    assert "| best constant answer per aspect (no search) | 25.0 [" in text
    assert "best arm vs answering each aspect's most frequent training answer" in text


def test_question_scores_average_to_the_evaluators_metrics(trainer_world: TrainerWorld):
    from calibrl.trainer.aio import BackgroundLoop
    from calibrl.trainer.eval import EvalSettings, evaluate_models
    from calibrl.trainer.tasks import load_tasks

    retrieval, _ = trainer_world.clients(judge=False)
    tasks = load_tasks(trainer_world.search_tasks)
    settings = EvalSettings(top_k=2, max_new_tokens=12, max_turns=2, search_top_k=2, max_obs_tokens=24,
                            batch_size=3, device="cpu")
    with BackgroundLoop(name="test-study") as background:
        clients = types.SimpleNamespace(retrieval=retrieval, background=background)
        scores = question_scores(trainer_world.policy_dir, tasks, clients, settings)
        row = evaluate_models([str(trainer_world.policy_dir)], tasks, retrieval, settings, run_async=background.run)[0]
    assert len(scores["f1"]) == len(tasks)
    for name in ("f1", "em", "well_formed", "searches"):
        assert sum(scores[name]) / len(tasks) == pytest.approx(row.metrics[name], abs=SUM_TOL), name


# --------------------------------------------------------------------------- command line


def test_parse_seeds():
    assert parse_seeds("0,1,2") == (0, 1, 2) and parse_seeds("7") == (7,)
    for bad in ("", "a,b", "1,1", "-1"):
        with pytest.raises(ValueError, match="--seeds"):
            parse_seeds(bad)


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "x"], "--seeds 'x': expected comma-separated integers"),
    (["--jobs", "0"], "--jobs=0: must be >= 1"),
    (["--heldout-limit", "-1"], "--heldout-limit=-1: must be >= 0"),
])
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys, tmp_path):
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err


def test_a_folder_holding_something_else_is_not_replaced(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["--out", str(tmp_path)]) == 2
    assert "not empty and holds no earlier study" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_a_study_stopped_part_way_reports_the_runs_every_seed_finished(tmp_path):
    from calibrl.studies.search_arms import SEED_RESULT, STUDY_FILE

    records = _hand_records(shared=False)
    del records[1]["runs"]["stress"]  # seed 1 stopped after the normal setting ...
    del records[0]["runs"]["normal"]["calibadv_steps"]  # ... and seed 0 lacks one normal run
    plan = {**PLAN, "seeds": [0, 1, 2]}  # seed 2 was started, but wrote no record before the stop
    (tmp_path / STUDY_FILE).write_text(json.dumps({"command": "calibrl study --seeds 0,1,2", "plan": plan,
                                                    "started": 0.0, "jobs": 2}))
    (tmp_path / "seed_2").mkdir()
    for record in records:
        (tmp_path / f"seed_{record['seed']}").mkdir()
        (tmp_path / f"seed_{record['seed']}" / SEED_RESULT).write_text(json.dumps(record))
    assert main(["--report-only", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["summary"]["settings"]) == ["normal"]
    assert list(results["summary"]["settings"]["normal"]["arms"]) == ["grpo", "calibadv", "grpo_steps"]
    assert results["summary"]["missing_runs"] == [
        "normal/grpo (seed 2)", "normal/calibadv (seed 2)", "normal/grpo_steps (seed 2)",
        "normal/calibadv_steps (seed 0, 2)", "stress/grpo (seed 1, 2)", "stress/calibadv (seed 1, 2)",
        "stress/grpo_steps (seed 1, 2)", "stress/calibadv_steps (seed 1, 2)"]
    text = (tmp_path / "report.md").read_text()
    assert "seed 1 |" in text and "seed 2 |" not in text  # no column for a seed without a record
    assert "**Stopped part way**" in text and "## Held-out answer F1, stress setting" not in text
    assert "CalibAdv + step rewards" not in text.split("## Held-out answer F1, normal setting")[1]
    # the docs' generated block says the same from the same record
    from calibrl.demo import results_tables

    (tmp_path / "study").mkdir()
    results["command"] += f" --out {tmp_path}"
    (tmp_path / "study" / "results.json").write_text(json.dumps(results))
    block = results_tables.render_text("<!-- BEGIN generated: study -->\n<!-- END generated: study -->\n", tmp_path)
    assert "seeds planned 0, 1, 2, with records from seeds 0, 1" in block
    assert str(tmp_path) not in block  # a study's scratch folder is no part of its result
    assert f"wall time {results['wall_s']:.0f} s" in block and "Seconds per seed: seed 0:" in block
    assert "Stopped part way" in block and "stress/grpo (seed 1, 2)" in block
    assert "Held-out answer F1, normal setting:" in block and "stress setting" not in block.split("not run:")[1]
    assert "| GRPO | the base |" in block  # each arm against the base, with its intervals
    verdict = results_tables.render_text(
        "<!-- BEGIN generated: study-verdict -->\n<!-- END generated: study-verdict -->\n", tmp_path)
    assert "Stopped part way" in verdict and "| GRPO |" not in verdict  # the summary alone, no tables
    first_line = verdict.split("\n- ", 1)[1].split("\n")[0]
    assert first_line and first_line in block


def _study_folder(folder, command, plan, records, started=0.0):
    from calibrl.studies.search_arms import SEED_RESULT, STUDY_FILE

    folder.mkdir()
    (folder / STUDY_FILE).write_text(json.dumps({"command": command, "plan": plan, "started": started,
                                                 "machine": f"machine of {command}"}))
    for record in records:
        (folder / f"seed_{record['seed']}").mkdir()
        (folder / f"seed_{record['seed']}" / SEED_RESULT).write_text(json.dumps(record))


def test_studies_run_apart_merge_into_one_report_naming_each(tmp_path, capsys):
    """Seeds run in two sittings give the report one study of all of them would: the same
    summary, with each sitting's command and seeds named, and a seed neither ran named as not run."""
    records = _hand_records(shared=False)
    _study_folder(tmp_path / "first", "calibrl study --seeds 0,2 --out /x/first", {**PLAN, "seeds": [0, 2]},
                  records[:1])
    _study_folder(tmp_path / "second", "calibrl study --seeds 1 --out /x/second", {**PLAN, "seeds": [1]},
                  records[1:])
    out = tmp_path / "merged"
    assert main(["--out", str(out), "--merge", str(tmp_path / "first"), "--merge", str(tmp_path / "second")]) == 0
    merged = json.loads((out / "results.json").read_text())
    alone = study_report.summarize({**PLAN, "seeds": [0, 1, 2]}, records)
    assert merged["summary"] == json.loads(json.dumps(study_report._json_safe(alone)))
    assert merged["plan"]["seeds"] == [0, 1, 2]
    assert [(p["command"], p["seeds"]) for p in merged["parts"]] == [
        ("calibrl study --seeds 0,2 --out /x/first", [0]), ("calibrl study --seeds 1 --out /x/second", [1])]
    assert all((out / f"seed_{seed}" / "seed_result.json").is_file() for seed in (0, 1))
    text = (out / "report.md").read_text()
    assert ("Records from 2 studies of the same plan, run apart: `calibrl study --seeds 0,2 --out /x/first` for "
            "seeds 0 (wall time ") in text and "machine of calibrl study --seeds 1 --out /x/second" in text
    assert "normal/grpo (seed 2)" in text  # planned by the first sitting, run by neither
    # the merged folder merges again as a report folder, keeping both sittings
    records_3 = [dict(records[0], seed=3)]
    _study_folder(tmp_path / "third", "calibrl study --seeds 3 --out /x/third", {**PLAN, "seeds": [3]}, records_3)
    assert main(["--out", str(out), "--merge", str(out), "--merge", str(tmp_path / "third")]) == 0
    again = json.loads((out / "results.json").read_text())
    assert [p["seeds"] for p in again["parts"]] == [[0], [1], [3]] and again["plan"]["seeds"] == [0, 1, 2, 3]
    # the docs' generated line names every sitting, without its folders
    from calibrl.demo import results_tables

    (tmp_path / "study").mkdir()
    (tmp_path / "study" / "results.json").write_text(json.dumps(again))
    verdict = results_tables.render_text(
        "<!-- BEGIN generated: study-verdict -->\n<!-- END generated: study-verdict -->\n", tmp_path)
    assert ("(`calibrl study --seeds 0,2 --out <dir>` for seeds 0; `calibrl study --seeds 1 --out <dir>` for seeds 1; "
            "`calibrl study --seeds 3 --out <dir>` for seeds 3; seeds planned 0, 1, 2, 3") in verdict
    assert "/x/" not in verdict
    block = results_tables.render_text("<!-- BEGIN generated: study -->\n<!-- END generated: study -->\n", tmp_path)
    assert "Records from 3 studies of the same plan, run apart" in block
    assert "`calibrl study --seeds 1 --out <dir>` for seeds 1 (wall time" in block  # each sitting's own time


@pytest.mark.parametrize("change, message", [
    ({"lr": 2e-4}, "its plan differs from"),
    ({}, "seed 0 has records in"),
])
def test_a_merge_refuses_other_plans_and_a_seed_given_twice(change, message, tmp_path, capsys):
    records = _hand_records(shared=False)
    _study_folder(tmp_path / "a", "calibrl study --seeds 0", {**PLAN, "seeds": [0]}, records[:1])
    _study_folder(tmp_path / "b", "calibrl study --seeds 0", {**PLAN, "seeds": [0], **change}, records[:1])
    assert main(["--out", str(tmp_path / "out"), "--merge", str(tmp_path / "a"), "--merge", str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err
    assert message in err and str(tmp_path / "b") in err
    assert not (tmp_path / "out" / "results.json").exists()


def test_a_merge_needs_study_or_report_folders(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["--out", str(tmp_path / "out"), "--merge", str(tmp_path / "empty")]) == 1
    assert "neither study.json" in capsys.readouterr().err


def test_report_only_needs_a_study_folder(tmp_path, capsys):
    assert main(["--report-only", "--out", str(tmp_path)]) == 1
    assert "study.json is missing" in capsys.readouterr().err


def test_the_headline_arms_run_first_under_every_setting():
    plan = _tiny_plan()
    assert plan.normal_from_long
    order = [(setting, arm.name) for setting, arm in plan.run_order()]
    # the long runs give the normal setting (the headline) too, so they run first and no normal run is trained
    assert order[:3] == [("long", "grpo"), ("long", "calibadv"), ("long", "calibadv_silver")]
    assert sorted(order) == sorted((s, a.name) for s in SETTINGS if s != "normal" for a in TINY_ARMS)
    everything = dataclasses.replace(plan, arms=ARMS)
    names = [(s, a.name) for s, a in everything.run_order()]
    assert names.index(("stress", "calibadv_silver")) < names.index(("long", "grpo_steps"))
    without_long = dataclasses.replace(plan, settings=("normal", "stress"))
    assert not without_long.normal_from_long
    assert [(s, a.name) for s, a in without_long.run_order()][:3] == [("normal", a.name) for a in TINY_ARMS]


def test_the_normal_run_read_off_the_long_run_is_the_normal_run_trained_apart(tiny_study, tmp_path):
    """The study reads the normal setting off the long run's checkpoint at the normal run's last
    step; a normal run trained on its own gives the same steps and held-out figures, bit for bit."""
    out, _ = tiny_study
    derived = json.loads((out / "seed_0" / "seed_result.json").read_text(encoding="utf-8"))["runs"]["normal"]
    assert all(derived[a.name]["from_long"] for a in TINY_ARMS)
    grpo = [a for a in TINY_ARMS if a.name == "grpo"]
    apart = dataclasses.replace(_tiny_plan(), arms=tuple(grpo), settings=("normal",))
    run_study(apart, tmp_path / "apart", command="calibrl study (test, normal apart)")
    trained = json.loads((tmp_path / "apart" / "seed_0" / "seed_result.json").read_text(encoding="utf-8"))
    normal = trained["runs"]["normal"]["grpo"]
    assert "from_long" not in normal and normal["wall_s"] > 0
    assert normal["steps"] == derived["grpo"]["steps"]  # every per-step metric, exactly
    assert normal["scores"] == derived["grpo"]["scores"]  # every held-out question's figures, exactly


def _without_times(record):
    """A seed record without what depends on the clock (seconds of stages, runs and evaluations)."""
    if isinstance(record, dict):
        return {k: _without_times(v) for k, v in record.items() if k not in ("timings", "wall_s", "eval_s")}
    if isinstance(record, list):
        return [_without_times(v) for v in record]
    return record


@pytest.mark.slow
def test_tasks_in_worker_processes_give_the_record_one_process_writes(tiny_study, tmp_path, capsys):
    """--jobs 2: the seed's base, then each run, as a worker process of its own, two at a time;
    the seed's record is put together in run order and equals the one-process record, bit for bit."""
    out, _ = tiny_study
    tasks = tmp_path / "tasks"
    run_study(_tiny_plan(), tasks, jobs=2, command="calibrl study (test, tasks)", native_kernels=True)
    one = json.loads((out / "seed_0" / "seed_result.json").read_text(encoding="utf-8"))
    put_together = json.loads((tasks / "seed_0" / "seed_result.json").read_text(encoding="utf-8"))
    assert put_together["complete"]
    assert list(put_together["runs"]) == list(one["runs"])  # settings, and arms within each, in run order
    assert [list(runs) for runs in put_together["runs"].values()] == [list(runs) for runs in one["runs"].values()]
    assert _without_times(put_together) == _without_times(one)
    timings = put_together["timings"]
    assert timings["seed_s"] > timings["arms_s"] > 0 and timings["base_agent_s"] > 0
    printed = capsys.readouterr().out
    runs = _tiny_plan().run_order()
    assert printed.count("seed 0 base done") == 1
    assert sum(f"seed 0 {s} {a.name} done" in printed for s, a in runs) == len(runs)
    # the run workers ran two at a time: some run started before another had ended
    spans = []
    for setting, arm in runs:
        log = tasks / "seed_0" / f"worker-{setting}-{arm.name}.log"
        assert log.is_file()
        result = tasks / "seed_0" / "run_results" / f"{setting}__{arm.name}.json"
        spans.append((result.stat().st_mtime - json.loads(result.read_text(encoding="utf-8"))["task_s"],
                      result.stat().st_mtime))
    spans.sort()
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:]))


def test_a_failed_task_stops_the_study_and_names_it(tmp_path, monkeypatch):
    """A worker that exits non-zero stops the study with its name and its log's end."""
    from calibrl.studies import search_arms

    def fail_at_once(plan, out, task, command, env, native_kernels, targets):
        import subprocess
        import sys

        (out / f"seed_{task.seed}").mkdir(parents=True, exist_ok=True)
        log = open(out / f"seed_{task.seed}" / "worker-base.log", "w", encoding="utf-8")
        process = subprocess.Popen([sys.executable, "-c", "import sys; print('no index here'); sys.exit(3)"],
                                   stdout=log, stderr=subprocess.STDOUT)
        return task, process, log

    monkeypatch.setattr(search_arms, "_start_task", fail_at_once)
    with pytest.raises(search_arms.StudyError, match=r"seed 0 base failed \(exit 3\)[\s\S]*no index here"):
        search_arms._run_tasks_in_processes(_tiny_plan(), tmp_path, jobs=2, native_kernels=False)


def test_bases_come_first_then_long_runs_then_the_rest():
    from calibrl.studies.search_arms import _Task

    plan = dataclasses.replace(_tiny_plan(), seeds=(6, 7))
    tasks = [_Task(seed, s, a.name) for seed in (7, 6) for s, a in plan.run_order()] + [_Task(7), _Task(6)]
    ordered = sorted(tasks, key=lambda t: t.priority(plan))
    assert [t.name for t in ordered[:2]] == ["seed 6 base", "seed 7 base"]
    settings = [t.setting for t in ordered[2:]]
    assert settings == sorted(settings, key=lambda s: s != "long")  # every long run before any other run
    assert [t.seed for t in ordered[2:5]] == [6, 6, 6]


def test_h3_is_decided_by_the_last_minus_best_intervals_of_the_long_setting():
    def curve(recall, well_formed):
        return {"last_minus_best_recall": dict(zip(("estimate", "low", "high"), recall), best_step=80),
                "last_minus_best_well_formed": dict(zip(("estimate", "low", "high"), well_formed), best_step=40)}

    labels = {"grpo": "GRPO", "calibadv": "CalibAdv", "calibadv_silver": "CalibAdv (silver)"}
    summary = {"settings": {"long": {"curves": {
        "grpo": curve((-0.06, -0.10, -0.02), (0.0, 0.0, 0.0)),  # recall dropped: interval below 0
        "calibadv": curve((-0.02, -0.05, 0.01), (-0.01, -0.03, 0.01)),  # intervals include 0
        "calibadv_silver": curve((0.0, 0.0, 0.0), (-0.04, -0.07, -0.01))}}}}  # well-formed dropped
    lines = study_report.long_lines(summary, labels)
    assert "GRPO (long setting)" in lines[0] and lines[0].endswith("degraded in search recall.")
    assert lines[1].endswith("no drop the intervals show.")
    assert "search recall -6.00 [-10.00, -2.00]" in lines[0]
    assert lines[3] == "H3 for CalibAdv: supported (GRPO degraded and it did not)."
    assert lines[4] == "H3 for CalibAdv (silver): not supported (it degraded too)."
    summary["settings"]["long"]["curves"]["grpo"] = curve((0.0, -0.01, 0.01), (0.0, 0.0, 0.0))
    assert study_report.long_lines(summary, labels)[3] == "H3 for CalibAdv: not supported (GRPO did not degrade)."
    assert study_report.long_lines({"settings": {}}, labels) == []


def test_a_difference_over_questions_that_the_seeds_variance_undoes_is_worded_as_a_tie():
    labels = {"grpo": "GRPO", "calibadv": "CalibAdv"}
    pair = {"a": "grpo", "b": "calibadv", "estimate": -0.02, "low": -0.03, "high": -0.01,
            "between_seeds": {"estimate": -0.02, "low": -0.05, "high": 0.004}}
    line = study_report._compare(pair, labels, "normal setting", reverse=True)
    assert line.startswith("CalibAdv vs GRPO (normal setting): +2.00 points of answer F1 [95% CI +1.00, +3.00]")
    assert "[-0.40, +5.00] over seeds, then questions" in line and "cannot tell them apart" in line
    pair["between_seeds"] = {"estimate": -0.02, "low": -0.05, "high": -0.001}
    assert study_report._compare(pair, labels, "normal setting", reverse=True).startswith("CalibAdv beats GRPO")
