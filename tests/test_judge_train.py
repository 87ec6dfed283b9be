"""`calibrl rubric train-judge`: a tiny random Llama built here learns the SME tags of
synthetic feedback, the transformers judge loading its output beats the untrained model
on the golden records (never trained on), `calibrl rubric validate` binds the trained
model's id, and bad input is refused naming file, line and field."""

import json
import pathlib
import random
import re
import shlex

import pytest

from tests.conftest import torch_threads_one

from calibrl.cli import main as calibrl_main
from calibrl.errors import ConfigError
from calibrl.judge_server.authoring.distill import split_golden, text_key
from calibrl.judge_server.authoring.feedback import FeedbackRecord, read_feedback, write_feedback
from calibrl.judge_server.rubric import Criterion, load_rubric
from calibrl.testing import build_tiny_causal_lm
from calibrl.judge_server.authoring.train_judge import TrainJudgeOptions, criterion_target, read_training_record, train_judge
from calibrl.judge_server.authoring.validation import golden_digest, read_records

torch = pytest.importorskip("torch")

README = pathlib.Path(__file__).resolve().parent.parent / "docs" / "guides" / "rubric-from-feedback.md"
FUNDS = ["VTSAX", "VFIAX", "VBTLX", "VTIAX", "VGSLX", "VWIAX"]
TOPICS = ["expense ratio", "minimum investment", "dividend schedule", "turnover rate"]
# Seeded runs (bases of seeds 0, 1, 2) reach 1.0 golden balanced accuracy on every criterion
# after 4 epochs; untrained bases average 0.50-0.71. The margins leave room for another
# CPU's float rounding and a less lucky initialisation.
MIN_TRAINED_BALANCED_ACCURACY = 0.8
MIN_GAIN_OVER_UNTRAINED = 0.25


def learnable_feedback(n: int, seed: int) -> list[FeedbackRecord]:
    """SME-graded rewrites whose tags show in the text: vague words (underspecified), a
    fund the query never named (invented_entity), the ticker replaced by "this fund"
    (missing_entity). No retrieved passages, to keep prompts short. The context (not part
    of the prompt) makes every record's item distinct, so a spy can tell them apart."""
    rng = random.Random(seed)
    records = []
    for index in range(n):
        ticker, topic = rng.choice(FUNDS), rng.choice(TOPICS)
        kind = rng.choice(["clean"] * 4 + ["vague"] * 2 + ["invented"] * 2 + ["missing"] * 2)
        if kind == "clean":
            output, grade, tags = rng.choice([f"{ticker} {topic}", f"what is the {topic} of {ticker}"]), 5, ()
        elif kind == "vague":
            output, grade, tags = rng.choice(["some info about stuff", "things and details please"]), 2, (
                "underspecified",)
        elif kind == "invented":
            output, grade, tags = f"{ticker} {topic} versus Morningstar Fidelity ratings", 2, ("invented_entity",)
        else:
            output, grade, tags = f"the {topic} of this fund", 3, ("missing_entity",)
        records.append(FeedbackRecord(query=f"{ticker} {topic}", output=output, grade=grade, error_tags=tags,
                                      context=(("sample", str(index)),), id=f"fb-{seed}-{index:03d}"))
    return records


one_torch_thread = pytest.fixture(scope="module", autouse=True)(torch_threads_one)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Feedback, a rubric and golden set distilled by the CLI, a base model, and a judge
    trained from them by the CLI (stdout kept)."""
    folder = tmp_path_factory.mktemp("train-judge")
    write_feedback(folder / "feedback.jsonl", learnable_feedback(120, seed=0))
    assert calibrl_main(["rubric", "distill", "--feedback", str(folder / "feedback.jsonl"), "--out",
                         str(folder / "rubric.yaml"), "--golden-out", str(folder / "golden.jsonl"), "--id", "funds",
                         "--criteria", "llm"]) == 0
    base = build_tiny_causal_lm(folder / "base", seed=0)
    return folder, base


@pytest.fixture(scope="module")
def trained(workspace):
    import contextlib
    import io

    folder, base = workspace
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = calibrl_main(["rubric", "train-judge", "--feedback", str(folder / "feedback.jsonl"), "--rubric",
                             str(folder / "rubric.yaml"), "--base", str(base), "--out", str(folder / "judge"),
                             "--epochs", "4", "--lr", "3e-3", "--batch-size", "16", "--device", "cpu",
                             "--no-progress"])
    assert code == 0, stdout.getvalue()
    return folder / "judge", stdout.getvalue()


def balanced_accuracy(flagged: list[bool], tagged: list[bool]) -> float:
    """Mean of the recall on tagged and on untagged records: 0.5 for any constant answer."""
    recalls = []
    for cls in (True, False):
        rows = [f for f, t in zip(flagged, tagged) if t == cls]
        assert rows, "the golden set needs records of both classes"
        recalls.append(sum(f == cls for f in rows) / len(rows))
    return sum(recalls) / 2


def golden_balanced_accuracy(model_folder, rubric, golden) -> dict[str, float]:
    """Per LLM criterion, as the transformers judge backend scores the golden records."""
    from calibrl.judge_server.backends.hf import TransformersJudge

    backend = TransformersJudge(model_folder, device="cpu")
    scores = backend.score([r.to_item() for r in golden], rubric.llm_criteria, rubric.instructions)
    out = {}
    for column, criterion in enumerate(rubric.llm_criteria):
        flagged = [row[column] < 0.5 for row in scores]
        tagged = [bool(set(criterion.tags) & set(r.error_tags)) for r in golden]
        out[criterion.name] = balanced_accuracy(flagged, tagged)
    return out


def test_trained_judge_beats_untrained_on_golden(workspace, trained):
    folder, base = workspace
    judge_folder, _ = trained
    rubric = load_rubric(folder / "rubric.yaml")
    golden = read_feedback(folder / "golden.jsonl")
    assert [c.name for c in rubric.llm_criteria] == ["specificity", "entities", "no_invented_entities"]
    untrained = golden_balanced_accuracy(base, rubric, golden)
    after = golden_balanced_accuracy(judge_folder, rubric, golden)
    for name in after:
        assert after[name] >= MIN_TRAINED_BALANCED_ACCURACY, (name, after, untrained)
    # per criterion a random model can land on the right side by chance (another seed's
    # base scored 0.96 on one criterion); the mean over criteria cannot
    mean = lambda figures: sum(figures.values()) / len(figures)
    assert mean(after) >= mean(untrained) + MIN_GAIN_OVER_UNTRAINED, (after, untrained)


def test_validate_binds_the_trained_model_id(workspace, trained):
    folder, _ = workspace
    judge_folder, _ = trained
    record = read_training_record(judge_folder)
    code = calibrl_main(["rubric", "validate", "--rubric", str(folder / "rubric.yaml"), "--golden",
                         str(folder / "golden.jsonl"), "--judge", f"transformers:{judge_folder}",
                         "embedder=hashed-ngrams", "device=cpu"])
    assert code in (0, 1)
    [validation] = read_records(str(folder / "rubric.yaml") + ".validation.json")
    assert validation.model_id == record["model_ids"]["transformers"] + "[hashed-ngrams]"
    assert validation.rubric_hash == record["rubric"]["hash"]
    # the set validation measured on is exactly the set training held out
    assert validation.golden_sha256 == record["feedback"]["golden_sha256"]
    # the tags are learnt, so the gate on expert pass/fail passes too
    assert validation.passed, validation.reason


def test_record_and_printed_figures(workspace, trained):
    folder, _ = workspace
    judge_folder, stdout = trained
    record = read_training_record(judge_folder)
    records = read_feedback(folder / "feedback.jsonl")
    train, golden = split_golden(records, 0.3)
    assert record["feedback"]["n_train"] == len(train) and record["feedback"]["n_held_out"] == len(golden)
    assert record["feedback"]["train_sha256"] == golden_digest(train)
    assert record["rubric"]["hash"] == load_rubric(folder / "rubric.yaml").hash
    assert record["base"]["model_id"].startswith("transformers:base@")
    assert record["model_ids"]["transformers"].startswith("transformers:judge@")
    for name, figures in record["criteria"].items():
        assert figures["final"]["loss"] < figures["before"]["loss"] / 10, (name, figures)
        assert figures["final"]["agreement"] >= 0.9, (name, figures)
        assert figures["final"]["n"] == len(train)
    epochs = [line for line in stdout.splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in epochs] == [f"epoch {i}/4" for i in range(1, 5)]
    for line in epochs:
        assert re.search(r"specificity: loss \d+\.\d+ agree \d\.\d+", line), line
        assert "no_invented_entities: loss" in line and "entities: loss" in line


def test_golden_records_are_never_trained_on(workspace, tmp_path, monkeypatch):
    """Spy on every prompt prefix built for training: none is a golden record's, also
    for records that only an extra --golden file holds out."""
    from calibrl.judge_server.backends.encoding import PromptEncoder

    folder, base = workspace
    records = read_feedback(folder / "feedback.jsonl")
    golden = read_feedback(folder / "golden.jsonl")
    extra = [r for r in records if r not in golden][:10]  # trainable by the split, held out by the file
    write_feedback(tmp_path / "golden-extra.jsonl", golden + extra)
    encoded = []
    original = PromptEncoder.encode_prefix

    def spy(self, item, instructions):
        encoded.append(item)
        return original(self, item, instructions)

    monkeypatch.setattr(PromptEncoder, "encode_prefix", spy)
    result = train_judge(folder / "feedback.jsonl", folder / "rubric.yaml", base, tmp_path / "judge",
                         TrainJudgeOptions(epochs=1, lr=1e-3, batch_size=32, device="cpu"),
                         golden_path=tmp_path / "golden-extra.jsonl", progress=False, echo=lambda line: None)
    held = {r.to_item() for r in golden + extra}
    assert encoded and not held & set(encoded)
    # a record is held out when its (query, output) text is a golden file record's, whoever graded it
    held_keys = {text_key(r) for r in golden + extra}
    n_held = sum(text_key(r) in held_keys for r in records)
    assert len(encoded) == len(records) - n_held == len(result.train)
    assert result.record["feedback"]["n_held_out"] == n_held


def test_lora_writes_merged_weights(workspace, tmp_path):
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, base_fp32 = workspace
    base = tmp_path / "base-bf16"  # a bf16 base, trained in float32, is saved as bf16 again
    AutoModelForCausalLM.from_pretrained(base_fp32, dtype=torch.bfloat16).save_pretrained(base)
    AutoTokenizer.from_pretrained(base_fp32).save_pretrained(base)
    result = train_judge(folder / "feedback.jsonl", folder / "rubric.yaml", base, tmp_path / "lora-judge",
                         TrainJudgeOptions(epochs=1, lr=3e-3, batch_size=32, lora=True, lora_rank=4, device="cpu"),
                         progress=False, echo=lambda line: None)
    assert not list(result.out.glob("adapter_*")), "LoRA adapters must be merged into ordinary weights"
    trained_model = AutoModelForCausalLM.from_pretrained(result.out, local_files_only=True, dtype="auto")
    base_model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True, dtype="auto")
    assert trained_model.dtype == base_model.dtype == torch.bfloat16
    changed = [name for name, p in trained_model.state_dict().items()
               if not torch.equal(p, base_model.state_dict()[name])]
    assert any("q_proj" in name for name in changed)
    for figures in result.record["criteria"].values():
        assert figures["final"]["loss"] < figures["before"]["loss"]


# --------------------------------------------------------------------------- targets


def test_targets_follow_tags_grades_and_verdicts():
    clean = FeedbackRecord(query="q", output="o", grade=5)
    tagged = FeedbackRecord(query="q", output="o", grade=2, error_tags=("vague",))  # alias of underspecified
    failed = FeedbackRecord(query="q", output="o", verdict="fail")
    specific = Criterion("specificity", "llm", 1.0, question="?", tags=("underspecified",))
    invented = Criterion("invented", "llm", 0.5, penalty=True, question="?", good_answer="no",
                         tags=("invented_entity",))
    overall = Criterion("overall", "llm", 1.0, question="?")
    likert = Criterion("quality", "llm", 1.0, question="?", scale="likert_1_5", tags=("underspecified",))
    likert_untagged = Criterion("grade", "llm", 1.0, question="?", scale="likert_1_5")
    assert [criterion_target(specific, r) for r in (clean, tagged)] == ["yes", "no"]
    assert [criterion_target(invented, r) for r in (clean, tagged)] == ["no", "no"]
    assert criterion_target(invented, FeedbackRecord(query="q", output="o", grade=1,
                                                     error_tags=("hallucination",))) == "yes"
    assert [criterion_target(overall, r) for r in (clean, tagged, failed)] == ["yes", "no", "no"]
    assert [criterion_target(likert, r) for r in (clean, tagged, failed)] == ["5", "2", "5"]
    assert [criterion_target(likert_untagged, r) for r in (clean, tagged, failed)] == ["5", "2", "1"]


# --------------------------------------------------------------------------- bad input


def run_cli(capsys, *argv) -> tuple[int, str]:
    code = calibrl_main(["rubric", "train-judge", *map(str, argv), "--no-progress", "--device", "cpu"])
    return code, capsys.readouterr().err


def test_bad_feedback_line_names_file_line_field(workspace, tmp_path, capsys):
    folder, base = workspace
    lines = (folder / "feedback.jsonl").read_text().splitlines()
    lines[6] = json.dumps({"query": "q", "output": "o", "grade": 9})
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    code, err = run_cli(capsys, "--feedback", tmp_path / "bad.jsonl", "--rubric", folder / "rubric.yaml",
                        "--base", base, "--out", tmp_path / "out")
    assert code == 2 and f"{tmp_path / 'bad.jsonl'}:7: grade: must be an integer 1..5" in err
    assert not (tmp_path / "out").exists()


def test_rubric_without_llm_criteria_is_refused(workspace, tmp_path, capsys):
    folder, base = workspace
    assert calibrl_main(["rubric", "distill", "--feedback", str(folder / "feedback.jsonl"), "--out",
                         str(tmp_path / "prog.yaml"), "--golden-out", str(tmp_path / "g.jsonl"),
                         "--criteria", "programmatic"]) == 0
    capsys.readouterr()
    code, err = run_cli(capsys, "--feedback", folder / "feedback.jsonl", "--rubric", tmp_path / "prog.yaml",
                        "--base", base, "--out", tmp_path / "out")
    assert code == 2 and f"{tmp_path / 'prog.yaml'}: criteria: rubric" in err and "no llm criterion" in err


def test_unknown_and_programmatic_criteria_are_refused(workspace, tmp_path, capsys):
    folder, base = workspace
    common = ("--feedback", folder / "feedback.jsonl", "--rubric", folder / "rubric.yaml", "--base", base,
              "--out", tmp_path / "out")
    code, err = run_cli(capsys, *common, "--criteria", "specifity")
    assert code == 2 and "--criteria: unknown criterion 'specifity'" in err and "'specificity'" in err
    assert calibrl_main(["rubric", "distill", "--feedback", str(folder / "feedback.jsonl"), "--out",
                         str(tmp_path / "both.yaml"), "--golden-out", str(tmp_path / "g.jsonl")]) == 0
    capsys.readouterr()
    code, err = run_cli(capsys, "--feedback", folder / "feedback.jsonl", "--rubric", tmp_path / "both.yaml",
                        "--base", base, "--out", tmp_path / "out", "--criteria", "entities")
    assert code == 2 and "--criteria: criterion 'entities'" in err and "is programmatic, not llm" in err


def test_criterion_without_any_tagged_training_record_names_its_line(workspace, tmp_path, capsys):
    folder, base = workspace
    text = (folder / "rubric.yaml").read_text().replace("- missing_entity", "- wrong_time_period")
    (tmp_path / "rubric.yaml").write_text(text)
    code, err = run_cli(capsys, "--feedback", folder / "feedback.jsonl", "--rubric", tmp_path / "rubric.yaml",
                        "--base", base, "--out", tmp_path / "out")
    line = 1 + text.splitlines().index(next(l for l in text.splitlines() if l.strip() == "- name: entities"))
    assert code == 2 and f"{tmp_path / 'rubric.yaml'}:{line}: criteria[1].tags: criterion 'entities'" in err, err


def test_base_that_is_not_a_causal_lm_is_refused(workspace, tmp_path, capsys):
    from transformers import DistilBertConfig

    folder, _ = workspace
    DistilBertConfig(vocab_size=100, dim=16, n_layers=1, n_heads=2, hidden_dim=32).save_pretrained(tmp_path / "enc")
    (tmp_path / "empty").mkdir()
    common = ("--feedback", folder / "feedback.jsonl", "--rubric", folder / "rubric.yaml", "--out", tmp_path / "out")
    code, err = run_cli(capsys, *common, "--base", tmp_path / "enc")
    assert code == 2 and f"--base {tmp_path / 'enc'}: model_type 'distilbert' is not a causal LM" in err
    code, err = run_cli(capsys, *common, "--base", tmp_path / "empty")
    assert code == 2 and "no config.json" in err
    code, err = run_cli(capsys, *common, "--base", tmp_path / "missing")
    assert code == 2 and "no such folder" in err


def test_tokenizer_without_single_token_answers_is_refused(workspace, tmp_path, capsys):
    from calibrl.testing import save_tiny_policy

    folder, _ = workspace
    policy = save_tiny_policy(tmp_path / "policy")  # its BPE never saw "yes": no single-token spelling
    code, err = run_cli(capsys, "--feedback", folder / "feedback.jsonl", "--rubric", folder / "rubric.yaml",
                        "--base", policy, "--out", tmp_path / "out")
    assert code == 2 and f"--base {policy}: the judge tokenizer has no single-token spelling of" in err, err


def test_out_folder_is_never_overwritten(workspace, tmp_path, capsys):
    folder, base = workspace
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    code, err = run_cli(capsys, "--feedback", folder / "feedback.jsonl", "--rubric", folder / "rubric.yaml",
                        "--base", base, "--out", tmp_path / "out")
    assert code == 2 and "exists and is not an empty folder" in err
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    with pytest.raises(ConfigError, match="epochs=0: must be >= 1"):
        TrainJudgeOptions(epochs=0).validate()


# --------------------------------------------------------------------------- README


def test_readme_train_judge_commands_run(workspace, tmp_path, monkeypatch, capsys):
    """The README's "Train a judge" lines (```sh block of the judge section), with the
    tiny base as /models/base."""
    text = README.read_text()
    section = text[text.index("<!-- section:judge -->"): text.index("<!-- /section:judge -->")]
    [block] = [b for b in re.findall(r"```sh\n(.*?)```", section, re.S) if "train-judge" in b]
    commands = [shlex.split(line) for line in block.splitlines() if line.startswith("calibrl ")]
    assert [c[1:3] for c in commands] == [["rubric", "distill"], ["rubric", "train-judge"], ["rubric", "validate"]]
    folder, base = workspace
    monkeypatch.chdir(tmp_path)
    write_feedback("feedback.jsonl", learnable_feedback(120, seed=0))
    codes = []
    for argv in commands:
        argv = [a.replace("/models/base", str(base)) for a in argv[1:]]
        if argv[1] == "train-judge":
            argv += ["--epochs", "1", "--lr", "1e-3", "--batch-size", "32", "--device", "cpu"]
        if argv[1] == "validate":
            argv += ["embedder=hashed-ngrams", "device=cpu"]
        codes.append(calibrl_main(argv))
        if argv[1] == "train-judge":
            printed = capsys.readouterr()
            assert re.search(r"train-judge: 100%.*\| (\d+)/\1 \[", printed.err), printed.err  # the progress bar
            assert "epoch 1/1: specificity: loss" in printed.out
    assert codes[:2] == [0, 0] and codes[2] in (0, 1), capsys.readouterr()
    [validation] = read_records(next(pathlib.Path("rubrics").glob("*.validation.json")))
    assert validation.model_id.startswith("transformers:")
