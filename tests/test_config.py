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
