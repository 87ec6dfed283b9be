from dataclasses import dataclass, field
from typing import Literal

import pytest

from calibrl.config import describe, load_config, option, to_dict
from calibrl.errors import ConfigError


@dataclass
class Adam:
    type: Literal["adamw"] = option("adamw", "optimizer kind")
    lr: float = option(1e-5, "learning rate")


@dataclass
class Sgd:
    type: Literal["sgd"] = option("sgd", "optimizer kind")
    momentum: float = option(0.9, "momentum")


@dataclass
class Inner:
    top_k: int = option(5, "hits per query")

    def validate(self):
        if self.top_k <= 0:
            raise ConfigError(f"inner.top_k={self.top_k}: must be > 0")


@dataclass
class Outer:
    name: str = option("run", "run name")
    weights: list[float] = option(factory=lambda: [0.7, 0.3], doc="blend weights")
    inner: Inner = option(factory=Inner, doc="nested")
    optim: Adam | Sgd = option(factory=Adam, doc="optimizer")
    flag: bool = option(False, "a flag")


def test_defaults_file_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: a\ninner:\n  top_k: 3\noptim:\n  type: sgd\n")
    config = load_config(Outer, path, ["inner.top_k=7", "flag=true", "weights=[0.5,0.5]"])
    assert config.name == "a"
    assert config.inner.top_k == 7
    assert isinstance(config.optim, Sgd) and config.optim.momentum == 0.9
    assert config.flag is True
    assert config.weights == [0.5, 0.5]
    assert to_dict(config)["optim"] == {"type": "sgd", "momentum": 0.9}


@dataclass
class Prompted:
    template: str = option("", "a text option")
    inner: Inner = option(factory=Inner, doc="nested")
    label: str | None = option(None, "optional text")


def test_a_text_option_takes_the_override_text_as_it_is():
    """YAML would read ``Q: {query}`` as a mapping and ``123`` as a number: a str
    field takes the text after ``=`` verbatim; other fields still read YAML."""
    config = load_config(Prompted, None, ["template=Q: {query} [short]"])
    assert config.template == "Q: {query} [short]"
    assert load_config(Prompted, None, ["template=123"]).template == "123"
    assert load_config(Prompted, None, ['template="quoted: {query}"']).template == "quoted: {query}"
    assert load_config(Prompted, None, ["inner.top_k=7"]).inner.top_k == 7
    with pytest.raises(ConfigError, match="inner.top_k"):
        load_config(Prompted, None, ["inner.top_k=a: b"])
    assert load_config(Prompted, None, ["label=null"]).label is None  # an optional text keeps YAML's null


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"inner.top_kk: unknown key; did you mean 'top_k'"):
        load_config(Outer, None, ["inner.top_kk=3"])


def test_bad_type_and_validate_hook_name_the_field():
    with pytest.raises(ConfigError, match=r"inner.top_k: expected an integer"):
        load_config(Outer, None, ["inner.top_k=abc"])
    with pytest.raises(ConfigError, match=r"inner.top_k=0: must be > 0"):
        load_config(Outer, None, ["inner.top_k=0"])
    with pytest.raises(ConfigError, match=r"optim.type: 'rmsprop' is not one of"):
        load_config(Outer, None, ["optim.type=rmsprop"])


def test_describe_lists_docs():
    text = "\n".join(describe(Outer))
    assert "inner.top_k = 5  # hits per query" in text


@dataclass
class WithCustomNested:
    inner: Inner = option(factory=lambda: Inner(top_k=9), doc="nested with its own default")


def test_describe_shows_the_parents_nested_defaults():
    assert "inner.top_k = 9  # hits per query" in describe(WithCustomNested)


def test_a_judge_serving_section_given_in_part_keeps_the_judges_defaults(tmp_path):
    """`calibrl serve judge --port 0` sets serving.port; the judge's own serving defaults
    (port 50052, units of 0.1 s, workers at niceness 5) must survive it, from an override
    and from a YAML file alike."""
    from calibrl.judge_server.config import JudgeServerConfig

    from_override = load_config(JudgeServerConfig, None, ["rubrics=x", "serving.port=0",
                                                         "serving.telemetry.enabled=true"])
    path = tmp_path / "judge.yaml"
    path.write_text("rubrics: x\nserving:\n  host: 0.0.0.0\n  telemetry:\n    enabled: true\n")
    from_file = load_config(JudgeServerConfig, path)
    for config in (from_override, from_file):
        assert (config.serving.compute_nice, config.serving.max_unit_cost_s) == (5, 0.1)
        assert config.serving.telemetry.enabled
    assert from_override.serving.port == 0 and from_file.serving.port == 50052
    assert from_file.serving.host == "0.0.0.0"
