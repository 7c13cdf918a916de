"""A teacher's own prompt (``teacher.context``): what it sees that the student does not.

The template is rendered from the data row: ``{prompt}`` is the student's prompt, ``{answer}``
its reference answer, any other ``{name}`` the row's field of that name (worked examples, an
instruction, a hint). The teacher then scores the student's sampled response after *its*
prompt (``teacher/cross_tokenizer.py`` builds that row: the teacher's prompt, then the student's
response ids unchanged when the tokenizer is the student's), while the student samples, trains
and is evaluated on the plain prompt alone. With the student's own weights as the teacher
(``teacher.weights``), this is on-policy context distillation (docs/TEACHERS.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from megatron_gndpo.config.schema import TeacherContextConfig
from megatron_gndpo.data.datasets import EncodedPrompt, PromptExample
from megatron_gndpo.data.tokenizer import Tokenizer
from megatron_gndpo.errors import DataError


def _values(example: PromptExample) -> dict[str, str]:
    values = dict(example.fields)
    values["prompt"] = example.prompt
    if example.answer is not None:
        values["answer"] = example.answer
    return values


@dataclasses.dataclass(frozen=True)
class Rendered:
    """The teacher's conversation for one row: its prompt, system prompt and earlier turns."""

    prompt: str
    system: str | None = None  # None: the chat template's own
    turns: tuple[tuple[str, str], ...] = ()


def render(context: TeacherContextConfig, example: PromptExample) -> Rendered:
    """The teacher's conversation for ``example``; every field it names must be in the row
    (:func:`check_fields`)."""
    values = _values(example)
    system = None if context.system is None else context.system.format_map(values)
    turns = tuple((u.format_map(values), a.format_map(values)) for u, a in context.turns)
    return Rendered(context.template.format_map(values), system, turns)


def prompt_ids(
    tokenizer: Tokenizer, context: TeacherContextConfig | None, example: PromptExample
) -> list[int]:
    """The teacher's prompt ids for ``example``: its own (``context``) in the tokenizer's chat
    template, or the student's prompt when it has none."""
    if context is None:
        return tokenizer.apply_chat_template(example.prompt)
    r = render(context, example)
    return tokenizer.apply_chat_template(r.prompt, system=r.system, turns=r.turns)


def check_fields(
    key: str, context: TeacherContextConfig, prompts: Sequence[EncodedPrompt], spec: str
) -> None:
    """Every row of ``prompts`` (read from ``spec``) has the fields ``context`` names: a
    DataError naming the first row and field that is missing, before any model is built."""
    names = context.fields()
    for p in prompts:
        values = _values(p.example)
        missing = [n for n in names if n not in values]
        if missing:
            where = p.example.where or f"{spec}, prompt {p.example.index}"
            what = ", ".join(
                "reference answer (data.answer_key)" if n == "answer" else f"field {n!r}"
                for n in missing
            )
            raise DataError(
                f"{where}: {key}.context names {{{missing[0]}}} but this record has no "
                f"{what}; add it to every record of {spec}, or take it out of {key}.context"
            )
