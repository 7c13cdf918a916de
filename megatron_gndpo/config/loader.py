"""YAML + dotted command-line overrides -> typed, frozen :class:`Config`.

    cfg = load_config("examples/tiny_cpu.yaml", ["algorithm.kl_clip=3.0", "trainer.steps=2"])

Paths (the fields marked ``PATH`` in the schema) are expanded as a shell would: a leading
``~`` or ``~user``, and ``$VAR`` / ``${VAR}``; a variable that is not set is an error, not a
literal ``$VAR`` directory.

Strict: an unknown key (with a did-you-mean), a value of the wrong type, a key set twice (in the
file or among the overrides) and a section given a scalar are all :class:`ConfigError` naming the
dotted key and the fix. Values are never coerced between kinds, with one exception: a float field
accepts a string that parses as a float, because YAML 1.1 reads ``1e-6`` as a string.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import reprlib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from megatron_gndpo.config.schema import PATH, Config
from megatron_gndpo.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration problem; the message names the key and how to fix it."""


# --------------------------------------------------------------------------------------------
# YAML with duplicate-key detection


class _StrictLoader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise ConfigError(
                f"key {key!r} is set twice in {node.start_mark.name} (lines {seen[key]} and "
                f"{line}); keep one of them"
            )
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)

# The most values a config may expand to. YAML's aliases repeat a node without copying it, so a
# few hundred bytes can stand for billions of values (an "alias bomb"): walking or printing them
# would take the machine's memory. The largest real config holds a few hundred.
MAX_VALUES = 100_000
# How much of a value an error message quotes: two levels of four items (then "..."), and at
# most _QUOTED_CHARS characters in all.
_QUOTED = reprlib.Repr(maxlevel=2, maxlist=4, maxtuple=4, maxdict=4, maxstring=60, maxother=60)
_QUOTED_CHARS = 120


def _count_values(data: Any) -> int:
    """How many values ``data`` holds once its aliases are expanded (each shared node counted
    as often as it appears), computed without expanding them; at most ``MAX_VALUES + 1``."""
    sizes: dict[int, int] = {}

    def count(node: Any) -> int:
        if not isinstance(node, dict | list):
            return 1
        if id(node) not in sizes:
            children = node.values() if isinstance(node, dict) else node
            sizes[id(node)] = min(1 + sum(count(c) for c in children), MAX_VALUES + 1)
        return sizes[id(node)]

    return count(data)


def _load_yaml(source: Any, where: str) -> Any:
    """YAML of ``source`` (text or an open file), strictly, refused when its aliases expand to
    more than :data:`MAX_VALUES` values."""
    data = yaml.load(source, Loader=_StrictLoader)
    if _count_values(data) > MAX_VALUES:
        raise ConfigError(
            f"{where} expands to more than {MAX_VALUES:,} values (YAML anchors and aliases "
            "repeat what they name): no configuration is that large; write the values out"
        )
    return data


def quoted(value: Any) -> str:
    """``repr(value)`` cut to a few items and characters: what an error message quotes of a
    value the user gave (a long list, or a YAML alias bomb, would be megabytes)."""
    text = _QUOTED.repr(value)
    return text if len(text) <= _QUOTED_CHARS else text[: _QUOTED_CHARS - 3] + "..."


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(os.path.expanduser(path))
    if not path.is_file():  # a pipe (`--config <(...)`, /dev/stdin) is read like a file
        if path.is_dir():
            raise ConfigError(f"config file {str(path)!r} is a directory; name a YAML file")
        if not path.exists():
            raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        # From the open file, not its text, so error marks name the file ("<unicode string>" else).
        with path.open(encoding="utf-8") as stream:
            data = _load_yaml(stream, str(path))
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from err
    if data is None:  # nothing but comments: almost always the wrong file, not "all defaults"
        raise ConfigError(
            f"{path} is empty (no sections): write the sections to change (megatron-gndpo "
            "config show prints every one), `{}` to mean every default, or leave out --config "
            "for the embedded default"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of sections, got {type(data).__name__}")
    return data


# --------------------------------------------------------------------------------------------
# Overrides


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> ``{"a": {"b": 1}, "c": "x"}``; values are parsed as YAML."""
    nested: dict[str, Any] = {}
    seen: set[str] = set()
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip().removeprefix("--")
        if not sep or not key:
            raise ConfigError(
                f"override {item!r} is not of the form section.key=value "
                "(for example algorithm.kl_clip=3.0)"
            )
        if key in seen:
            raise ConfigError(f"override {key!r} is given twice on the command line; keep one")
        seen.add(key)
        try:
            value = _load_yaml(raw, f"override {key!r}") if raw.strip() else ""
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({err})") from err
        node = nested
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                prefix = ".".join(parts[: i + 1])
                raise ConfigError(f"override {key!r} conflicts with override {prefix!r}")
            node = child
        if isinstance(node.get(parts[-1]), dict):
            raise ConfigError(f"override {key!r} conflicts with an override of one of its keys")
        node[parts[-1]] = value
    return nested


def merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Recursive merge; ``update`` wins. Sections merge key by key."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


# --------------------------------------------------------------------------------------------
# Typed construction


def type_name(tp: Any) -> str:
    """How a field's type reads in a message and in the reference ("an integer", "a string or
    null", "a list of a number")."""
    if tp is type(None):
        return "null"
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in (types.UnionType, typing.Union):
        return " or ".join(type_name(a) for a in get_args(tp))
    if get_origin(tp) is tuple:
        return f"a list of {type_name(get_args(tp)[0])}"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


_NO_MATCH = object()


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} is a section: expected a mapping, got {quoted(value)}")
        return build(tp, value, prefix=f"{key}.")  # type: ignore[arg-type]
    if origin in (types.UnionType, typing.Union):
        sections = [a for a in get_args(tp) if dataclasses.is_dataclass(a)]
        if isinstance(value, Mapping) and len(sections) == 1:  # an optional section: its errors
            return build(sections[0], value, prefix=f"{key}.")  # type: ignore[arg-type]
        for arg in get_args(tp):
            result = _try_convert(value, arg, key)
            if result is not _NO_MATCH:
                return result
    elif origin is Literal:
        if value in get_args(tp) and type(value) is not bool:
            return value
    elif origin is tuple:
        if isinstance(value, list | tuple):
            return tuple(_convert(v, get_args(tp)[0], f"{key}[{i}]") for i, v in enumerate(value))
    else:
        result = _try_convert(value, tp, key)
        if result is not _NO_MATCH:
            return result
    raise ConfigError(
        f"{key}: expected {type_name(tp)}, got {quoted(value)} ({type(value).__name__})"
    )


def _try_convert(value: Any, tp: Any, key: str) -> Any:
    if tp is type(None):
        return None if value is None else _NO_MATCH
    if tp is bool:
        return value if isinstance(value, bool) else _NO_MATCH
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO_MATCH
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 1e-6 as a string
            try:
                number = float(value)
            except ValueError:
                return _NO_MATCH
        else:
            return _NO_MATCH
        if not math.isfinite(number):  # no setting means NaN or infinity: it fails later
            raise ConfigError(
                f"{key}={str(value)[:40]}: expected a finite number (NaN and infinities are "
                "never a valid setting)"
            )
        return number
    if tp is str:
        return value if isinstance(value, str) else _NO_MATCH
    try:
        return _convert(value, tp, key)
    except ConfigError:
        return _NO_MATCH


_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def expand_path(value: str, key: str) -> str:
    """``value`` with ``~`` / ``~user`` and ``$VAR`` / ``${VAR}`` expanded, as a shell would;
    :class:`ConfigError` naming ``key`` for an unknown user or an unset variable."""
    expanded = os.path.expanduser(value)
    if expanded.startswith("~"):
        user = expanded[1:].split("/", 1)[0]
        raise ConfigError(f"{key}={value}: there is no user {user!r} to expand ~{user} for")

    def variable(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in os.environ:
            raise ConfigError(
                f"{key}={value}: the environment variable {name} is not set; export it, or "
                "write the path out"
            )
        return os.environ[name]

    return _VARIABLE.sub(variable, expanded)


def _is_path(annotation: Any) -> bool:
    return get_origin(annotation) is typing.Annotated and PATH in annotation.__metadata__


def _under_default(field: dataclasses.Field[Any], value: Any) -> Any:
    """A section given in part keeps the rest of the field's own default (the teacher's model
    section defaults differ from the student's: ``teacher.model.num_layers=8`` keeps the
    teacher's hidden and FFN sizes), not the section class's defaults."""
    if not isinstance(value, Mapping) or field.default_factory is dataclasses.MISSING:
        return value
    default = field.default_factory()
    if not dataclasses.is_dataclass(default):
        return value
    return merge(to_dict(default), value)


def build[T](cls: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, strictly (see the module docstring)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), list(fields), n=1)
        hint = f"; did you mean {prefix}{close[0]}?" if close else ""
        section = prefix.rstrip(".") or "the top level"
        raise ConfigError(
            f"unknown key {prefix}{key}{hint} (keys of {section}: {', '.join(fields)})"
        )
    data = {name: _under_default(fields[name], value) for name, value in data.items()}
    kwargs = {name: _convert(value, hints[name], f"{prefix}{name}") for name, value in data.items()}
    marked = typing.get_type_hints(cls, include_extras=True)
    for name, value in kwargs.items():
        if isinstance(value, str) and _is_path(marked[name]):
            kwargs[name] = expand_path(value, f"{prefix}{name}")
    try:
        return cls(**kwargs)
    except ValueError as err:  # a section that checks itself (VisionConfig)
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {err}") from err


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain mapping (tuples as lists) that :func:`build` turns back into the same config."""

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, tuple):
            return [plain(v) for v in value]
        return value

    result = plain(cfg)
    assert isinstance(result, dict)
    return result


def to_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def load_config(
    path: str | Path | None = None, overrides: Sequence[str] = (), *, base: Config | None = None
) -> Config:
    """Defaults (or ``base``) <- YAML file <- dotted overrides, strictly typed."""
    data = to_dict(base) if base is not None else {}
    if path is not None:
        data = merge(data, read_yaml(path))
    data = merge(data, parse_overrides(overrides))
    return build(Config, data)


def save_resolved(cfg: Config, run_dir: str | Path) -> Path:
    """Write the resolved config to ``run_dir/config.yaml``; return its path."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(to_yaml(cfg), encoding="utf-8")
    tmp.replace(path)  # atomic: a crash never leaves a half-written config
    return path
