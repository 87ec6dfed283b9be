"""Rubric files: parsing, canonical hash, and errors that name the file, line and field."""

import textwrap

import pytest

from calibrl.errors import ConfigError
from calibrl.judge_server.rubric import RubricError, dump_rubric, load_rubric, load_rubric_dir, parse_rubric

RUBRIC = textwrap.dedent(
    """\
    id: rewriter
    version: "2"
    description: test rubric
    glossary: [VTSAX, expense ratio]
    criteria:
      - name: entities
        kind: programmatic
        scorer: entity_coverage
        weight: 0.6
        severity: 2.5
        tags: [missing_entity]
      - name: intent_llm
        kind: llm
        question: Does the output keep the intent of the query?
        weight: 0.4
      - name: quality
        kind: llm
        question: How good is the rewrite?
        scale: likert_1_5
        weight: 0.2
      - name: no_leak
        kind: programmatic
        scorer: compliance_leak
        params:
          patterns: {ticket: "TCK-\\\\d+"}
        weight: 0.9
        penalty: true
    """
)


def test_parse_fills_defaults_and_round_trips():
    rubric = parse_rubric(RUBRIC, "r.yaml")
    assert [c.name for c in rubric.criteria] == ["entities", "intent_llm", "quality", "no_leak"]
    assert [c.name for c in rubric.llm_criteria] == ["intent_llm", "quality"]
    assert rubric.criteria[1].good_answer == "yes" and rubric.criteria[1].scale == "yes_no"
    assert rubric.criteria[3].penalty and rubric.criteria[3].params == {"patterns": {"ticket": "TCK-\\d+"}}
    assert rubric.glossary == ("expense ratio", "VTSAX")
    again = parse_rubric(dump_rubric(rubric), "again.yaml")
    assert again.hash == rubric.hash
    assert again.criteria == rubric.criteria


def test_hash_is_content_not_formatting():
    rubric = parse_rubric(RUBRIC)
    # Reordered keys, explicit defaults, a float written as an int: same content, same hash.
    reformatted = RUBRIC.replace("weight: 0.6\n", "weight: 0.60\n").replace(
        "    question: Does the output keep the intent of the query?\n",
        "    good_answer: 'yes'\n    question: Does the output keep the intent of the query?\n")
    reformatted = reformatted.replace("scorer: entity_coverage\n", "scorer: entity_coverage\n    params: {glossary: []}\n")
    assert parse_rubric(reformatted).hash == rubric.hash
    # Access control is not judging content.
    assert parse_rubric(RUBRIC + "tenants: [team-a]\n").hash == rubric.hash
    # Any change of content changes it.
    assert parse_rubric(RUBRIC.replace("weight: 0.4", "weight: 0.5")).hash != rubric.hash
    assert parse_rubric(RUBRIC.replace('version: "2"', 'version: "3"')).hash != rubric.hash
    assert parse_rubric(RUBRIC.replace("keep the intent", "keep the meaning")).hash != rubric.hash
    assert len(rubric.hash) == 64 and int(rubric.hash, 16) >= 0


def test_glossary_file_is_part_of_the_content(tmp_path):
    (tmp_path / "terms.txt").write_text("# fund names\nVFIAX\n\nturnover rate\n")
    path = tmp_path / "r.yaml"
    path.write_text(RUBRIC + "glossary_file: terms.txt\n")
    first = load_rubric(path)
    assert first.glossary == ("expense ratio", "turnover rate", "VFIAX", "VTSAX")
    (tmp_path / "terms.txt").write_text("VFIAX\n")
    assert load_rubric(path).hash != first.hash


@pytest.mark.parametrize(
    "old, new, line, field, problem",
    [
        ("weight: 0.4", "weight: -1", 15, "criteria[1].weight", "must be in [0.0, 1000000.0], got -1"),
        ("weight: 0.4", "weight: high", 15, "criteria[1].weight", "expected a number, got 'high'"),
        ("scorer: entity_coverage", "scorer: entity_coverag", 8, "criteria[0].scorer", "did you mean 'entity_coverage'"),
        ("severity: 2.5", "severty: 2.5", 10, "criteria[0].severty", "unknown key; did you mean 'severity'"),
        ("kind: llm\n    question: How", "kind: llm\n    quest: How", 18, "criteria[2].quest", "unknown key"),
        ("scale: likert_1_5", "scale: stars", 19, "criteria[2].scale", "'stars' is not one of ['yes_no', 'likert_1_5']"),
        ('ticket: "TCK-\\\\d+"', 'ticket: "TCK-(\\\\d+"', 24, "criteria[3].params", "not a valid regular expression"),
        ("scorer: compliance_leak", "scorer: compliance_leak\n    question: leak?", 24, "criteria[3].question",
         "only llm criteria have a question"),
        ("weight: 0.9", "weight: 1.5", 26, "criteria[3].weight", "must be <= 1"),
        ("name: quality", "name: entities", 16, "criteria[2].name", "duplicate criterion name 'entities'"),
        ("id: rewriter", "id: 'bad id!'", 1, "id", "must match"),
        ("scorer: entity_coverage\n", "scorer: entity_coverage\n    params: {min_terms: 3}\n", 9,
         "criteria[0].params", "unknown parameter 'min_terms' for scorer 'entity_coverage'"),
    ],
)
def test_malformed_rubric_names_file_line_and_field(old, new, line, field, problem):
    assert old in RUBRIC
    with pytest.raises(RubricError) as info:
        parse_rubric(RUBRIC.replace(old, new, 1), "rubrics/r.yaml")
    error = info.value
    assert (error.line, error.field) == (line, field), str(error)
    assert problem in error.problem
    assert str(error).startswith(f"rubrics/r.yaml:{line}: {field}: ")


def test_structural_errors():
    with pytest.raises(RubricError, match=r"r.yaml:4: \(syntax\): not valid YAML"):
        parse_rubric("id: a\nversion: 1\ncriteria: [\n  - x: : y\n", "r.yaml")
    with pytest.raises(RubricError, match="missing required key 'criteria'"):
        parse_rubric("id: a\nversion: '1'\n", "r.yaml")
    with pytest.raises(RubricError, match="an llm criterion needs a 'question'"):
        parse_rubric("id: a\nversion: '1'\ncriteria:\n  - {name: x, kind: llm, weight: 1}\n")
    with pytest.raises(RubricError, match="at least one non-penalty criterion needs a weight > 0"):
        parse_rubric("id: a\nversion: '1'\ncriteria:\n  - {name: x, kind: programmatic, scorer: length, weight: 0}\n")
    with pytest.raises(RubricError, match=r"the file is empty"):
        parse_rubric("", "empty.yaml")


def test_rubric_dir_rejects_duplicate_ids(tmp_path):
    (tmp_path / "a.yaml").write_text(RUBRIC)
    (tmp_path / "notes.txt").write_text("ignored")
    assert [r.id for r in load_rubric_dir(tmp_path)] == ["rewriter"]
    (tmp_path / "b.yml").write_text(RUBRIC)
    with pytest.raises(ConfigError, match="rubric id 'rewriter' is already used by"):
        load_rubric_dir(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_rubric_dir(tmp_path / "missing")


def test_tenant_visibility():
    shared = parse_rubric(RUBRIC + "tenants: ['*']\n")
    owned = parse_rubric(RUBRIC + "tenants: [team-a]\n")
    unowned = parse_rubric(RUBRIC)
    assert all(r.visible_to(None) for r in (shared, owned, unowned))
    assert shared.visible_to("team-b") and owned.visible_to("team-a")
    assert not owned.visible_to("team-b") and not unowned.visible_to("team-a")
