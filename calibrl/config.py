"""Typed configuration: one dataclass per process, loaded from YAML plus overrides.

Every field is declared with :func:`option` (a default and one line of doc).
:func:`load_config` reads a YAML file, applies ``dotted.key=value`` overrides
(values parsed as YAML, so ``lr=1e-5`` and ``modes=[dense,bm25]`` work), checks
types, rejects unknown keys with the closest valid name, and finally calls the
config's ``validate()`` hook, which raises :class:`~calibrl.errors.ConfigError`
with a message that names the values and the fix.

Variants are tagged unions: a field annotated ``A | B`` (dataclasses that both
have a ``type: Literal[...]`` field) picks the class by the ``type`` key.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import pathlib
import types
import typing
from typing import Any, Literal, TypeVar, Union

import yaml

from calibrl.errors import ConfigError

T = TypeVar("T")

_MISSING = dataclasses.MISSING


def option(default: Any = _MISSING, doc: str = "", *, factory: Any = _MISSING) -> Any:
    """Declare a config field with its default and its one-line documentation."""
    if default is not _MISSING and factory is not _MISSING:
        raise TypeError("option(): give default or factory, not both")
    if isinstance(default, (list, dict, set)):
        raise TypeError("option(): mutable default; use factory=")
    return dataclasses.field(default=default, default_factory=factory, metadata={"doc": doc})


def describe(cls: type, prefix: str = "", defaults: Any = None) -> list[str]:
    """Human-readable lines `key = default  # doc` for every field, nested included.

    Nested sections show the defaults their parent's factory gives them (a server may
    default ``serving.port`` differently from ``ServingConfig`` itself)."""
    lines: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if defaults is not None:
            default = getattr(defaults, f.name)
        elif f.default is not _MISSING:
            default = f.default
        elif f.default_factory is not _MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = "required"
        if dataclasses.is_dataclass(hint):
            nested = default if dataclasses.is_dataclass(default) else None
            lines.extend(describe(hint, prefix + f.name + ".", nested))
            continue
        if isinstance(default, enum.Enum):
            default = default.value
        lines.append(f"{prefix}{f.name} = {default!r}  # {f.metadata.get('doc', '')}")
    return lines


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        members = [a for a in args if a is not type(None)]
        dataclass_members = [a for a in members if dataclasses.is_dataclass(a)]
        if dataclass_members and isinstance(value, dict):
            return _pick_variant(value, dataclass_members, where)
        errors = []
        for member in members:
            try:
                return _coerce(value, member, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{where}: {value!r} is not a valid {_type_name(hint)}")
    if origin is Literal:
        if isinstance(value, bool) and ("on" if value else "off") in args:
            value = "on" if value else "off"  # YAML 1.1 reads a bare on/off as a boolean
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(hint):
        if isinstance(hint, type) and isinstance(value, hint):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {hint.__name__} fields, got {value!r}")
        return from_dict(hint, value, where)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        if isinstance(value, hint):
            return value
        try:
            return hint(value)
        except ValueError:
            raise ConfigError(
                f"{where}: {value!r} is not one of {[m.value for m in hint]}"
            ) from None
    if origin in (list, tuple, set, frozenset) or hint in (list, tuple):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item_hint = args[0] if args else Any
        items = [_coerce(v, item_hint, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or hint is tuple) else items
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        value_hint = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(v, value_hint, f"{where}.{k}") for k, v in value.items()}
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if hint is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if hint is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    if hint is pathlib.Path:
        return pathlib.Path(str(value))
    return value


def _pick_variant(value: dict, variants: list[type], where: str) -> Any:
    tags = {}
    for variant in variants:
        tag_hint = typing.get_type_hints(variant).get("type")
        for tag in typing.get_args(tag_hint):
            tags[tag] = variant
    tag = value.get("type")
    if tag not in tags:
        raise ConfigError(f"{where}.type: {tag!r} is not one of {sorted(tags)}")
    return from_dict(tags[tag], value, where)


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build ``cls`` from a plain mapping, checking names and types."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            close = difflib.get_close_matches(key, sorted(names), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {sorted(names)}"
            raise ConfigError(f"{path}: unknown key{hint}")
        kwargs[key] = _coerce(_over_field_default(cls, key, hints[key], value), hints[key], path)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in kwargs and f.default is _MISSING and f.default_factory is _MISSING:  # type: ignore[misc]
            path = f"{where}.{f.name}" if where else f.name
            raise ConfigError(f"{path}: required, no default ({f.metadata.get('doc', '')})")
    return cls(**kwargs)


def _over_field_default(cls: type, name: str, hint: Any, value: Any) -> Any:
    """A section given in part keeps the rest of its field's own default: with ``serving:
    {port: 0}`` (or ``serving.port=0``) a judge's serving section keeps the judge's defaults
    (its ``default_factory``), not the section class's."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)  # type: ignore[arg-type]
    if (not isinstance(value, dict) or field.default_factory is _MISSING  # type: ignore[misc]
            or not (isinstance(hint, type) and dataclasses.is_dataclass(hint))):
        return value
    default = field.default_factory()  # type: ignore[misc]
    if type(default) is not hint:
        return value
    return _merged(to_dict(default), value)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def to_dict(config: Any) -> dict[str, Any]:
    """Plain, YAML-serialisable mapping of a config (enums as values, paths as strings)."""

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, enum.Enum):
            return value.value
        if isinstance(value, pathlib.Path):
            return str(value)
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(config)


def apply_overrides(data: dict[str, Any], overrides: typing.Iterable[str], cls: type | None = None) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a nested mapping (a copy is returned).
    Values are read as YAML, except that a key of ``cls`` typed ``str`` takes the
    text as it is (``prompt_template=Q: {query}`` is a string, not a mapping)."""
    import copy

    result = copy.deepcopy(data)
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {override!r}: expected key=value, e.g. lr=1e-5")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        if cls is not None and not isinstance(value, str) and _is_text_field(cls, key.strip().split(".")):
            value = raw
        node = result
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {override!r}: {part!r} is not a section")
        node[parts[-1]] = value
    return result


def _is_text_field(cls: type, parts: list[str]) -> bool:
    """Whether the dotted key ``parts`` names a plain ``str`` field of the config
    class ``cls`` (through nested config classes; not through tagged unions)."""
    for n, part in enumerate(parts):
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            return False
        hint = typing.get_type_hints(cls).get(part)
        if hint is None:
            return False
        if n == len(parts) - 1:
            return hint is str
        cls = hint
    return False


def load_config(
    cls: type[T], path: str | pathlib.Path | None = None, overrides: typing.Iterable[str] = ()
) -> T:
    """Load ``cls`` from an optional YAML file and overrides, then validate it."""
    data: dict[str, Any] = {}
    if path is not None:
        path = pathlib.Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path}: not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: top level must be a mapping")
        data = loaded
    data = apply_overrides(data, overrides, cls)
    config = from_dict(cls, data)
    validate(config)
    return config


def validate(config: Any) -> None:
    """Run ``validate()`` on a config and on every nested config inside it."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            validate(value)
    hook = getattr(config, "validate", None)
    if callable(hook):
        hook()
