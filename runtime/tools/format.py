"""How a model family writes tool calls: one ToolCallFormat per format, by name.

A format knows four things: how to read calls out of the model's text, streamed or not
(`parser`); the grammar that makes the model's calls valid (`grammar`, for every
tool_choice); how to describe the tools to a model whose chat template has no tool
support (`system_prompt`), and how earlier calls and their results read in the history
(`history_call`, `tool_result`). `pick_format` chooses one from the chat template.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import NamedTuple

from ..structured.spec import GrammarSpec
from .definitions import ToolChoice, ToolDef


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class StreamEvent(NamedTuple):
    kind: str  # "content": text; "call": a call begins (text = its name); "arguments": a
    #            fragment of the current call's arguments JSON
    text: str
    index: int = 0  # the call's position among this output's calls
    call_id: str | None = None  # with "call"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


@dataclass
class ParsedOutput:
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallParser:
    """Reads one output as it arrives. `feed(delta)` and `finish()` return StreamEvents;
    `result()` (after finish) the whole output: its calls when every call was valid,
    else all of it as content."""

    def feed(self, text: str) -> list[StreamEvent]:
        raise NotImplementedError

    def finish(self) -> list[StreamEvent]:
        raise NotImplementedError

    def result(self) -> ParsedOutput:
        raise NotImplementedError


class ToolCallFormat:
    name: str = ""
    # a chat template containing any of these writes calls in this format
    template_markers: tuple[str, ...] = ()

    def parser(self, tools: tuple[ToolDef, ...]) -> ToolCallParser:
        raise NotImplementedError

    def grammar(self, tools: tuple[ToolDef, ...], choice: ToolChoice, parallel: bool,
                content: GrammarSpec | None = None) -> GrammarSpec | None:
        """What constrains the output: None (free text) or a grammar. `content`: the
        grammar the request's response_format puts on a reply that is not a call."""
        raise NotImplementedError

    def system_prompt(self, tools: tuple[ToolDef, ...]) -> str:
        raise NotImplementedError

    def history_call(self, name: str, arguments: object) -> str:
        raise NotImplementedError

    def tool_result(self, content: str) -> str:
        raise NotImplementedError


class _Registry:
    def __init__(self) -> None:
        self._formats: dict[str, ToolCallFormat] = {}

    def register(self, fmt: ToolCallFormat) -> ToolCallFormat:
        if fmt.name in self._formats:
            raise ValueError(f"tool-call format {fmt.name!r} is registered twice.")
        self._formats[fmt.name] = fmt
        return fmt

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._formats))

    def get(self, name: str) -> ToolCallFormat:
        try:
            return self._formats[name]
        except KeyError:
            raise ValueError(f"unknown tool-call parser {name!r}; one of "
                             f"{', '.join(self.names())}, or 'auto'.") from None

    def all(self) -> tuple[ToolCallFormat, ...]:
        return tuple(self._formats[n] for n in self.names())


FORMATS = _Registry()
DEFAULT_FORMAT = "hermes"


def pick_format(chat_template: str | None, requested: str = "auto") -> ToolCallFormat:
    """The named format, or for "auto" the one whose markers the template contains (a
    template without tool support gets the default format, described in a system prompt)."""
    if requested != "auto":
        return FORMATS.get(requested)
    for fmt in FORMATS.all():
        if chat_template and any(m in chat_template for m in fmt.template_markers):
            return fmt
    return FORMATS.get(DEFAULT_FORMAT)


def template_has_tools(chat_template: str | None) -> bool:
    """The template renders a `tools` list itself (else the format's system prompt does)."""
    return bool(chat_template) and "tools" in chat_template
