"""Field documentation, read from the string literal under each field in ``schema.py``.

Each field is documented once, where it is defined; ``megatron-gndpo --help``,
``megatron-gndpo config fields`` and docs/CONFIG.md print what this module collects. A key whose
names live in a registry outside ``config/`` (``algorithm.estimator``: the methods') says so in
its doc; the caller, which may import the registry, passes the names (``names``) and they are
appended, so adding a method never touches the schema.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import textwrap
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from megatron_gndpo.config.loader import type_name
from megatron_gndpo.config.schema import Config


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` for a dataclass whose fields carry attribute docstrings (those
    of the dataclasses it derives from included)."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            docs |= _own_field_docs(base)
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, following in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    key: str
    type: str
    default: Any
    doc: str


def with_names(doc: str, names: Sequence[str]) -> str:
    """A field's doc followed by the names the key takes (none: the doc as it is)."""
    return f"{doc} One of: {', '.join(names)}." if names else doc


def iter_fields(
    cls: type = Config, prefix: str = "", names: Mapping[str, Sequence[str]] | None = None
) -> Iterator[FieldDoc]:
    """Every leaf field of the config tree, in definition order, with its dotted key.

    ``names``: by dotted key, the names a key takes, appended to its doc (:func:`with_names`).
    """
    for fd in _iter_nested(cls, cls(), prefix):
        yield dataclasses.replace(fd, doc=with_names(fd.doc, (names or {}).get(fd.key, ())))


def _iter_nested(cls: type, value: Any, prefix: str) -> Iterator[FieldDoc]:
    # Nested sections may have defaults different from the class's (teacher.model is larger).
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        sub = getattr(value, f.name)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            yield from _iter_nested(tp, sub, f"{prefix}{f.name}.")
            continue
        entry = list_entry(tp)
        if entry is not None:  # a list of sections (teachers): the keys of one entry
            yield from _iter_nested(entry, entry(), f"{prefix}{f.name}[].")
            continue
        yield FieldDoc(f"{prefix}{f.name}", type_name(tp), sub, docs.get(f.name, ""))
        optional = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if len(optional) == 1:  # an optional section (model.vision): its keys when it is given
            section = typing.cast(type, optional[0])
            yield from _iter_nested(section, sub or section(), f"{prefix}{f.name}.")


def list_entry(tp: Any) -> type | None:
    """The section type of a list-of-sections field (``tuple[Section, ...]``), else None."""
    if typing.get_origin(tp) is tuple:
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):
            return typing.cast(type, args[0])
    return None


def format_fields(width: int = 100, names: Mapping[str, Sequence[str]] | None = None) -> str:
    """A plain-text reference of every field: key, type, default, and its documentation
    (``names``: as :func:`iter_fields`)."""
    lines = []
    for fd in iter_fields(names=names):
        default = "null" if fd.default is None else repr(fd.default)
        lines.append(f"  {fd.key} ({fd.type}; default {default})")
        lines.extend(textwrap.wrap(fd.doc, width=width, initial_indent="      ",
                                   subsequent_indent="      "))  # fmt: skip
    return "\n".join(lines)
