"""The `hermes` tool-call format (Qwen2.5 and Qwen3 templates, Hermes, and qserve's
generic prompt for templates without tool support):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, any text before them. A reply that is nothing but one call's JSON
object, bare or in a ```json fence (Qwen2.5-Coder writes its calls so), is that call:
while a reply may still turn out to be one, its text is held back. The parser streams a call's name as soon as
`{"name": "...", "arguments": ` has arrived and then the arguments object as it is
written; a block that does not hold a JSON object with a known name and an arguments
object makes the output plain content (when not streamed: streamed text has left),
except a last block that max_tokens cut after whole calls, which is dropped.
"""

from __future__ import annotations

import json
import re

from ..structured.spec import GrammarError, GrammarSpec
from .definitions import ToolChoice, ToolDef
from .format import (FORMATS, ParsedOutput, StreamEvent, ToolCall, ToolCallFormat,
                     ToolCallParser, new_call_id)

BEGIN, END = "<tool_call>", "</tool_call>"
# a block's head, up to the first character of the arguments value
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
# a call's JSON may hold this much whitespace in a row (a small model left unbounded can
# fill max_tokens with it)
MAX_WHITESPACE = 1


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class _ValueScanner:
    """Finds where one JSON object or array ends, fed piece by piece from its opening
    bracket (strings and escapes respected)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escape = False
        self.done = False

    def feed(self, text: str) -> int:
        """How many leading characters of `text` belong to the value (all, until it ends)."""
        for i, ch in enumerate(text):
            if self.done:
                return i
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class HermesParser(ToolCallParser):
    def __init__(self, tools: tuple[ToolDef, ...]) -> None:
        self.names = {t.name for t in tools}
        self.text = ""  # the whole output
        self._buf = ""  # not yet consumed
        self._in_call = False
        self._space = ""  # whitespace held back (dropped where it only separates calls)
        self._after_call = False  # no text since the last block
        self._bare: str | None = ""  # the reply so far while it may be a bare JSON call
        self.content = ""
        self.calls: list[ToolCall] = []
        self.invalid = False
        self._new_call()

    def _new_call(self) -> None:
        self._raw = ""  # the current block's text
        self._id: str | None = None  # set once its head (name) has been streamed
        self._args_at = 0
        self._scanned = 0
        self._scanner = _ValueScanner()

    # -- ToolCallParser -----------------------------------------------------------------
    def feed(self, text: str) -> list[StreamEvent]:
        self.text += text
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[StreamEvent]:
        events = self._drain(final=True)
        if self._bare is not None:  # the whole reply was held: a bare call, or content
            held, self._bare = self._bare, None
            call = self._parse(_unfenced(held))
            if call is not None:
                self._id = new_call_id()
                events += [StreamEvent("call", call[0], 0, self._id),
                           StreamEvent("arguments", call[1], 0)]
                self.calls.append(ToolCall(self._id, *call))
                self._new_call()
            else:
                events += self._text(held)
        if self._in_call:  # cut off inside a block (max_tokens)
            events += self._close(cut=True)
            self._in_call = False
        if self._space and not self.calls:
            events += self._emit_content(self._space)
        self._space = ""
        return events

    def result(self) -> ParsedOutput:
        if self.invalid or not self.calls:
            return ParsedOutput(self.text or None, [])
        content = self.content.strip()
        return ParsedOutput(content or None, list(self.calls))

    # -- internals ------------------------------------------------------------------------
    def _drain(self, final: bool) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        while True:
            if not self._in_call:
                at = self._buf.find(BEGIN)
                if at >= 0:
                    events += self._hold(self._buf[:at])
                    events += self._release()  # a block begins: no bare call
                    self._buf = self._buf[at + len(BEGIN):]
                    self._space = ""  # whitespace right before a call is not content
                    self._in_call = True
                    self._new_call()
                    continue
                keep = 0 if final else _held_prefix(self._buf, BEGIN)
                events += self._hold(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return events
            at = self._buf.find(END)
            piece = self._buf if at < 0 else self._buf[:at]
            if at < 0 and not final:
                piece = piece[:len(piece) - _held_prefix(piece, END)]
            self._raw += piece
            self._buf = self._buf[len(piece):]
            events += self._advance()
            if at < 0:
                return events
            self._buf = self._buf[len(END):]
            events += self._close(cut=False)
            self._in_call = False
            self._after_call = True

    def _hold(self, text: str) -> list[StreamEvent]:
        """Text outside the blocks: held while the reply may be a bare call, else _text."""
        if self._bare is None:
            return self._text(text)
        self._bare += text
        return [] if _may_be_bare_call(self._bare) else self._release()

    def _release(self) -> list[StreamEvent]:
        held, self._bare = self._bare, None
        return self._text(held) if held else []

    def _text(self, text: str) -> list[StreamEvent]:
        """Text outside the blocks is content as written, except the whitespace next to a
        block (held back until text follows it; dropped when a block does)."""
        body = text.rstrip()
        if not body:
            self._space += text
            return []
        lead = "" if self._after_call else self._space
        if self._after_call:
            body = body.lstrip()
        self._space = text[len(text.rstrip()):]
        self._after_call = False
        return self._emit_content(lead + body)

    def _emit_content(self, text: str) -> list[StreamEvent]:
        self.content += text
        return [StreamEvent("content", text)]

    def _advance(self) -> list[StreamEvent]:
        """Stream what the block's new text settles: its name, then its arguments."""
        events = []
        index = len(self.calls)
        if self._id is None:
            m = _HEAD.match(self._raw)
            if m is None:
                return []
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                return []
            if name not in self.names or self._raw[m.end()] != "{":
                return []  # settled when the block closes (arguments as a string, say)
            self._id = new_call_id()
            self._args_at = self._scanned = m.end()
            events.append(StreamEvent("call", name, index, self._id))
        if not self._scanner.done:
            new = self._raw[self._scanned:]
            n = self._scanner.feed(new)
            self._scanned += n
            if n:
                events.append(StreamEvent("arguments", new[:n], index))
        return events

    def _close(self, cut: bool) -> list[StreamEvent]:
        """The block ended (or the output did, inside it): record the call or fail it."""
        index = len(self.calls)
        call = None if cut else self._parse(self._raw)
        events: list[StreamEvent] = []
        if cut and self.calls and not self.invalid:
            self._new_call()  # max_tokens cut a call after whole ones: those are the answer
            return events
        if call is None:
            self.invalid = True
            if self._id is None:  # nothing of it was streamed as a call: it is content
                events += self._emit_content(BEGIN + self._raw + ("" if cut else END))
        else:
            name, args = call
            if self._id is None:  # not streamed head-first (e.g. arguments before name)
                self._id = new_call_id()
                events += [StreamEvent("call", name, index, self._id),
                           StreamEvent("arguments", args, index)]
            elif self._scanner.done:  # the arguments' exact text, as streamed
                args = self._raw[self._args_at:self._scanned]
            self.calls.append(ToolCall(self._id, name, args))
        self._new_call()
        return events

    def _parse(self, raw: str) -> tuple[str, str] | None:
        """(name, arguments JSON) of a valid block, else None."""
        try:
            obj = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = obj.get("arguments", obj.get("parameters"))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return obj["name"], json.dumps(args, ensure_ascii=False)


def _may_be_bare_call(text: str) -> bool:
    """Whether a reply beginning with `text` may still be one JSON call, bare or fenced."""
    t = text.lstrip()
    return (not t or "```json".startswith(t) or t.startswith("```json")
            or t.startswith("{"))


def _unfenced(text: str) -> str:
    """The JSON inside a ```json fence (or the text as it is)."""
    t = text.strip()
    if t.startswith("```json") and t.endswith("```"):
        t = t[len("```json"):-3].strip()
    return t


class HermesFormat(ToolCallFormat):
    name = "hermes"
    template_markers = ("<tool_call>",)

    def parser(self, tools: tuple[ToolDef, ...]) -> HermesParser:
        return HermesParser(tools)

    @staticmethod
    def _tag(tool: ToolDef) -> dict:
        return {"type": "tag",
                "begin": f'{BEGIN}\n{{"name": "{tool.name}", "arguments": ',
                "content": {"type": "json_schema", "json_schema": tool.parameters,
                            "max_whitespace_cnt": MAX_WHITESPACE},
                "end": f"}}\n{END}"}

    def grammar(self, tools: tuple[ToolDef, ...], choice: ToolChoice, parallel: bool,
                content: GrammarSpec | None = None) -> GrammarSpec | None:
        offered = choice.offered(tools)
        if not offered:
            return content
        tags = [self._tag(t) for t in offered]
        calls = {"type": "tags_with_separator", "tags": tags, "separator": "\n",
                 "at_least_one": True, "stop_after_first": not parallel}
        if choice.mode == "named":
            fmt = tags[0] if not parallel else calls
        elif choice.mode == "required":
            fmt = calls
        elif content is None:  # auto: any text, and every call it begins is valid
            fmt = {"type": "triggered_tags", "triggers": [BEGIN], "tags": tags,
                   "stop_after_first": not parallel}
        elif content.kind in ("json_schema", "json_object"):  # auto: calls, or the reply
            fmt = {"type": "or", "elements": [calls, {"type": "json_schema",
                                                      "json_schema": content.loads()}]}
        else:
            raise GrammarError("tools with tool_choice 'auto' combine only with a JSON "
                               "response_format (json_schema or json_object).",
                               "response_format")
        return GrammarSpec.structural_tag({"type": "structural_tag", "format": fmt})

    def system_prompt(self, tools: tuple[ToolDef, ...]) -> str:
        lines = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to help with the user's "
                "request. The functions, as JSON signatures within <tools></tools>:\n"
                f"<tools>\n{lines}\n</tools>\n\nTo call a function, answer with a JSON "
                "object holding its name and arguments within <tool_call></tool_call> tags, "
                "one block per call:\n"
                f'{BEGIN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{END}')

    def history_call(self, name: str, arguments: object) -> str:
        args = json.dumps(arguments, ensure_ascii=False)
        return f'{BEGIN}\n{{"name": "{name}", "arguments": {args}}}\n{END}'

    def tool_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


FORMATS.register(HermesFormat())
