"""A rubric that fails its gate says why; --pass-threshold auto; feedback with other field names."""

import contextlib
import io
import json

import grpc
import pytest

from calibrl.errors import ConfigError
from calibrl.v1 import judge_pb2 as pb
from calibrl.v1 import judge_pb2_grpc
from calibrl.judge_server import cli
from calibrl.judge_server.authoring import validation
from calibrl.api import judge_wire as wire
from calibrl.judge_server.config import JudgeServerConfig
from calibrl.judge_server.authoring.distill import text_key
from calibrl.judge_server.authoring.feedback import FeedbackRecord, parse_field_map, read_feedback, write_feedback
from calibrl.judge_server.rubric import load_rubric
from calibrl.judge_server.server import start
from calibrl.testing import SYNTHETIC_GLOSSARY, synthetic_feedback
from calibrl.api.judge import CriterionScore, ItemScore, JudgeItem
from calibrl.judge_server.authoring.validation import ValidationOptions, agreement, pick_pass_threshold, read_records

# Another team's names for the documented fields (documented=theirs).
# Tolerances: an explicit one says the error it allows and why (tests/tolerances.py). A bare
# pytest.approx(x) (rel 1e-6, ~17 float32 roundings) compares values a few float operations
# from their reference (float64 arithmetic or a handful of float32 steps): below 1e-7 on any CPU.

FIELD_MAP = "grade=score,output=rewrite,error_tags=issues,query=question"


def _score(total: float) -> ItemScore:
    return ItemScore(total=total, criteria=(CriterionScore(name="entities", score=total, weight=1.0),))


def _record(grade: int, n: int) -> FeedbackRecord:
    return FeedbackRecord(query=f"q{n}", output=f"o{n}", grade=grade)


def test_auto_threshold_picks_the_best_kappa_split_and_prefers_the_default_on_ties():
    # Experts pass grades 4-5; the judge's totals separate them exactly between 0.3 and 0.35.
    records = [_record(g, n) for n, g in enumerate([1, 2, 3, 4, 5, 4])]
    scores = [_score(t) for t in [0.1, 0.2, 0.3, 0.35, 0.5, 0.4]]
    choice = pick_pass_threshold(records, scores)
    assert choice.threshold == pytest.approx(0.325) and choice.kappa == pytest.approx(1.0)
    assert choice.n_items == 6 and choice.expert_pass_rate == pytest.approx(0.5)
    # Every threshold in (0.5, 1] fails everything: kappa 0 for all of them; the one nearest 0.6 wins
    # only among equals, never over a better kappa.
    flat = pick_pass_threshold([_record(5, 0), _record(1, 1)], [_score(0.9), _score(0.2)])
    assert flat.kappa == pytest.approx(1.0) and 0.2 < flat.threshold <= 0.9
    with pytest.raises(ConfigError, match="all expert 'pass'"):
        pick_pass_threshold([_record(5, 0), _record(4, 1)], [_score(0.1), _score(0.2)])
    with pytest.raises(ConfigError, match="at least 2"):
        pick_pass_threshold([_record(5, 0)], [_score(0.1)])


def test_a_failed_gate_says_the_kappa_the_gate_the_threshold_and_what_to_look_at():
    from calibrl.judge_server.rubric import parse_rubric

    rubric = parse_rubric(
        "id: r\nversion: '1'\ncriteria:\n  - name: entities\n    kind: programmatic\n    scorer: entity_coverage\n"
        "    weight: 1.0\n    tags: [missing_entity]\n", "r.yaml")
    golden = [_record(5, n) for n in range(8)] + [_record(1, n) for n in range(8, 12)]
    scores = [_score(0.55)] * 8 + [_score(0.2)] * 4  # the judge ranks well but never reaches 0.6
    record = agreement(rubric, "m", golden, scores, ValidationOptions(pass_threshold=0.6))
    assert not record.passed and record.pass_threshold_source == "given"
    for needed in ("kappa 0.000 [0.00, 0.00] < min_kappa 0.6", "pass_threshold 0.6", "Experts passed 67%", "the judge 0%",
                   "too strict", "--pass-threshold auto"):
        assert needed in record.reason, (needed, record.reason)
    # The same judge at a threshold below its pass scores agrees perfectly, and says so.
    record = agreement(rubric, "m", golden, scores, ValidationOptions(pass_threshold=0.5))
    assert record.passed and "kappa 1.000 [1.00, 1.00] >= min_kappa 0.6" in record.reason and "pass_threshold 0.5" in record.reason


def test_field_map_reads_another_teams_names():
    assert parse_field_map("grade=score, output=rewrite") == {"score": "grade", "rewrite": "output"}
    for bad, message in (("grade", "DOCUMENTED=THEIRS"), ("mark=score", "'mark' is not a feedback field"),
                         ("grade=score,verdict=score", "maps a field twice")):
        with pytest.raises(ConfigError, match=message):
            parse_field_map(bad)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Synthetic feedback written with another team's field names, distilled with --field-map."""
    import torch

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("threshold")
    records = synthetic_feedback(120, seed=3)
    write_feedback(root / "documented.jsonl", records)
    renamed = dict(pair.split("=") for pair in FIELD_MAP.split(","))  # documented -> theirs
    with open(root / "theirs.jsonl", "w", encoding="utf-8") as out:
        for record in records:
            data = {renamed.get(k, k): v for k, v in record.to_json().items()}
            out.write(json.dumps(data) + "\n")
    (root / "glossary.txt").write_text("\n".join(SYNTHETIC_GLOSSARY) + "\n")
    (root / "rubrics").mkdir()
    common = ["--id", "funds", "--criteria", "programmatic", "--glossary", str(root / "glossary.txt")]
    assert _run(cli.distill, ["--feedback", str(root / "theirs.jsonl"), "--field-map", FIELD_MAP, "--out",
                              str(root / "rubrics" / "funds.yaml"), "--golden-out", str(root / "golden.jsonl"),
                              *common])[0] == 0
    assert _run(cli.distill, ["--feedback", str(root / "documented.jsonl"), "--out", str(root / "same.yaml"),
                              "--golden-out", str(root / "same-golden.jsonl"), *common])[0] == 0
    return root


def _run(command, argv):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = command(argv)
    return code, stdout.getvalue()


def test_distill_with_a_field_map_equals_distilling_the_documented_names(workspace):
    assert load_rubric(workspace / "rubrics" / "funds.yaml").hash == load_rubric(workspace / "same.yaml").hash
    assert (workspace / "golden.jsonl").read_bytes() == (workspace / "same-golden.jsonl").read_bytes()
    # Without the map the first unknown field is named, with the line.
    assert cli.distill(["--feedback", str(workspace / "theirs.jsonl"), "--out", str(workspace / "x.yaml"),
                        "--golden-out", str(workspace / "x.jsonl")]) == 2


def test_validate_auto_threshold_is_picked_off_the_golden_set_and_recorded(workspace, monkeypatch, capsys):
    rubric, golden = workspace / "rubrics" / "funds.yaml", workspace / "golden.jsonl"
    base = ["--rubric", str(rubric), "--golden", str(golden), "--judge", "programmatic"]
    code, out = _run(cli.validate, [*base, "--pass-threshold", "0.999", "--no-record"])
    assert code == 1 and "gate FAILED" in out and "pass_threshold 0.999" in out and "too strict" in out
    code, out = _run(cli.validate, [*base, "--gate", "lower-bound", "--no-record"])
    summary = json.loads(out[out.index("{"):out.rindex("}") + 1])
    low, high = summary["kappa_95_interval"]
    assert summary["gate"] == "lower_bound" and low <= summary["kappa"] <= high
    assert code == (0 if low >= summary["min_kappa"] else 1) and f"[{low:.2f}, {high:.2f}]" in out

    assert cli.validate([*base, "--pass-threshold", "auto"]) == 2
    assert "--pass-threshold auto needs --feedback" in capsys.readouterr().err

    seen = []
    real_pick = validation.pick_pass_threshold

    def spy(records, scores, pass_grade=4, prefer=0.6):
        seen.extend(records)
        return real_pick(records, scores, pass_grade, prefer)

    monkeypatch.setattr(validation, "pick_pass_threshold", spy)
    code, out = _run(cli.validate, [*base, "--pass-threshold", "auto", "--feedback", str(workspace / "theirs.jsonl"),
                                    "--field-map", FIELD_MAP])
    golden_records = read_feedback(golden)
    all_records = read_feedback(workspace / "documented.jsonl")
    assert len(seen) == len(all_records) - len(golden_records) > 0
    assert not {r.record_hash for r in seen} & {r.record_hash for r in golden_records}  # never the golden set
    assert not {text_key(r) for r in seen} & {text_key(r) for r in golden_records}  # nor a golden text
    [record] = read_records(str(rubric) + ".validation.json")
    selection = record.metrics["threshold_selection"]
    assert record.pass_threshold_source == "auto" and record.pass_threshold == selection["threshold"]
    assert selection["n_items"] == len(seen) and "non-golden" in out
    assert json.loads(out[out.index("{"):out.rindex("}") + 1])["pass_threshold_source"] == "auto"
    assert code == (0 if record.passed else 1)


async def test_get_rubric_names_the_gate_and_the_threshold_and_a_refusal_says_why(workspace):
    rubric_path, golden = workspace / "rubrics" / "funds.yaml", workspace / "golden.jsonl"
    assert _run(cli.validate, ["--rubric", str(rubric_path), "--golden", str(golden), "--judge", "programmatic",
                               "--pass-threshold", "0.999"])[0] == 1  # a failing record, written
    config = JudgeServerConfig(rubrics=str(workspace / "rubrics"))
    config.serving.port = 0
    running = await start(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = judge_pb2_grpc.JudgeServiceStub(channel)
            rubric = await stub.GetRubric(pb.GetRubricRequest(rubric_id="funds"))
            v = rubric.validation
            assert (v.passed, v.min_kappa, v.pass_threshold, v.pass_threshold_source) == (False, 0.6, 0.999, "given")
            assert v.threshold == v.min_kappa and "pass_threshold 0.999" in v.reason
            item = JudgeItem.make("vtsax expense ratio", "What is the expense ratio of the VTSAX fund?")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Score(pb.ScoreRequest(rubric_id="funds", items=[wire.item_to_proto(item)]))
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            details = caught.value.details()
            for needed in ("min_kappa 0.6", "pass_threshold 0.999", "too strict", "--pass-threshold auto"):
                assert needed in details, (needed, details)
    finally:
        await running.stop(0)


def test_the_readme_field_map_line_reads_another_teams_feedback(tmp_path, monkeypatch):
    import pathlib
    import re
    import shlex

    from calibrl.cli import main as calibrl_main

    readme = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "guides" / "rubric-from-feedback.md").read_text(
        encoding="utf-8")
    section = readme[readme.index("<!-- section:judge -->"):readme.index("<!-- /section:judge -->")]
    [line] = [text for block in re.findall(r"```sh\n(.*?)```", section, re.S) for text in block.splitlines()
              if "--field-map" in text]
    argv = shlex.split(line)
    pairs = dict(pair.split("=") for pair in argv[argv.index("--field-map") + 1].split(","))  # documented -> theirs
    monkeypatch.chdir(tmp_path)
    records = synthetic_feedback(60, seed=4)
    with open("their_feedback.jsonl", "w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps({pairs.get(k, k): v for k, v in record.to_json().items()}) + "\n")
    assert "score" in open("their_feedback.jsonl").readline()  # the file really uses the other names
    pathlib.Path("rubrics").mkdir()
    assert calibrl_main(argv[1:]) == 0
    write_feedback("documented.jsonl", records)
    same = [a if a not in ("their_feedback.jsonl", "rubrics/funds.yaml", "golden.jsonl") else
            {"their_feedback.jsonl": "documented.jsonl", "rubrics/funds.yaml": "same.yaml",
             "golden.jsonl": "same-golden.jsonl"}[a] for a in argv[1:]]
    field_map_at = same.index("--field-map")
    del same[field_map_at:field_map_at + 2]
    assert calibrl_main(same) == 0
    assert pathlib.Path("rubrics/funds.yaml").read_bytes() == pathlib.Path("same.yaml").read_bytes()
    assert pathlib.Path("golden.jsonl").read_bytes() == pathlib.Path("same-golden.jsonl").read_bytes()


def test_auto_threshold_leaves_out_every_review_of_a_golden_text(workspace, monkeypatch):
    """A second review of a golden (query, output) text (another id, another grade) is golden
    too: it never decides the threshold."""
    import dataclasses

    from calibrl.config import load_config
    from calibrl.judge_server.config import JudgeConfig

    golden = read_feedback(workspace / "golden.jsonl")
    feedback = read_feedback(workspace / "documented.jsonl")
    regraded = [dataclasses.replace(r, id=f"again-{n}", grade=6 - (r.grade or 3), notes="a second reviewer")
                for n, r in enumerate(golden)]
    seen = []
    real_pick = validation.pick_pass_threshold

    def spy(records, scores, pass_grade=4, prefer=0.6):
        seen.extend(records)
        return real_pick(records, scores, pass_grade, prefer)

    monkeypatch.setattr(validation, "pick_pass_threshold", spy)
    config = load_config(JudgeConfig, None, ["backend=programmatic", "allow_unvalidated=true", "cache_size=0"])
    validation.validate_judge(load_rubric(workspace / "rubrics" / "funds.yaml"), golden, config, ValidationOptions(),
                              calibration=feedback + regraded)
    assert seen and not {text_key(r) for r in seen} & {text_key(r) for r in golden}
    assert len(seen) == len(feedback) - len(golden)


def test_every_kappa_carries_its_interval_and_the_gate_can_decide_on_its_lower_bound():
    from calibrl.judge_server.rubric import parse_rubric

    rubric = parse_rubric("id: r\nversion: '1'\ncriteria:\n  - name: entities\n    kind: programmatic\n"
                          "    scorer: entity_coverage\n    weight: 1.0\n", "r.yaml")
    # 12 items, the judge agrees on 11: kappa 0.833, but 12 items cannot pin it down.
    golden = [_record(g, n) for n, g in enumerate([5, 5, 5, 5, 5, 5, 1, 1, 1, 1, 1, 1])]
    scores = [_score(t) for t in [0.9] * 5 + [0.1] + [0.1] * 6]
    estimate = agreement(rubric, "m", golden, scores, ValidationOptions(pass_threshold=0.5))
    lower = agreement(rubric, "m", golden, scores, ValidationOptions(pass_threshold=0.5, gate="lower_bound"))
    for record in (estimate, lower):
        assert record.kappa == pytest.approx(5 / 6)
        assert record.kappa_low < 0.6 < record.kappa <= record.kappa_high
        assert record.kappa_text() in record.reason  # the decision line states the interval
        assert record.metrics["pass_fail"]["kappa_low"] == record.kappa_low
    assert estimate.passed and estimate.gate == "estimate"
    # The gate follows the interval: its low end is below min_kappa, so the lower-bound gate fails.
    assert not lower.passed and lower.gate == "lower_bound" and "reaches below min_kappa 0.6" in lower.reason
    with pytest.raises(ConfigError, match="gate="):
        ValidationOptions(gate="median").validate()
