"""The tools of a chat request and its tool_choice, checked as OpenAI defines them.

    tools = parse_tools([{"type": "function", "function": {"name": ..., "parameters": ...}}])
    choice = parse_tool_choice("auto" | "none" | "required" | {"type": "function",
                               "function": {"name": ...}}, tools)

Every mistake is a ToolError naming the request field (`tools[1].function.parameters`)
and what to send instead.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..structured.spec import GrammarError, GrammarSpec

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
NO_ARGUMENTS = {"type": "object", "properties": {}}


class ToolError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolDef:
    name: str
    description: str | None
    parameters: dict  # a JSON schema for the arguments object
    strict: bool = False

    def openai(self) -> dict:
        """The tool as OpenAI's request names it (what chat templates iterate over)."""
        fn = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function, for "named"

    def offered(self, tools: tuple[ToolDef, ...]) -> tuple[ToolDef, ...]:
        """The tools the model may call under this choice."""
        if self.mode == "none":
            return ()
        if self.mode == "named":
            return tuple(t for t in tools if t.name == self.name)
        return tools


def parse_tools(raw: Any) -> tuple[ToolDef, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ToolError("tools must be a list of {\"type\": \"function\", \"function\": "
                        "{...}} objects.", "tools")
    if len(raw) > MAX_TOOLS:
        raise ToolError(f"{len(raw)} tools; at most {MAX_TOOLS}.", "tools")
    out, names = [], set()
    for i, item in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(item, dict) or item.get("type") != "function":
            raise ToolError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}"
                            f"; only function tools are supported.", f"{where}.type")
        fn = item.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{where}.function must be an object with a name and parameters.",
                            f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"{where}.function.name must be 1-64 letters, digits, '_' or "
                            f"'-', got {name!r}.", f"{where}.function.name")
        if name in names:
            raise ToolError(f"two tools are named {name!r}; tool names must be unique.",
                            f"{where}.function.name")
        names.add(name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolError(f"{where}.function.description must be a string.",
                            f"{where}.function.description")
        params = fn.get("parameters", NO_ARGUMENTS)
        if not isinstance(params, dict):
            raise ToolError(f"{where}.function.parameters must be a JSON schema object, got "
                            f"{type(params).__name__}.", f"{where}.function.parameters")
        if params.get("type", "object") != "object":
            raise ToolError(f"{where}.function.parameters must describe an object (the "
                            f"arguments), got type {params.get('type')!r}.",
                            f"{where}.function.parameters")
        try:
            GrammarSpec.json_schema(params)
        except GrammarError as e:
            raise ToolError(f"{where}.function.parameters: {e}",
                            f"{where}.function.parameters") from None
        strict = fn.get("strict", False)
        if not isinstance(strict, bool):
            raise ToolError(f"{where}.function.strict must be true or false.",
                            f"{where}.function.strict")
        out.append(ToolDef(name, description, params, strict))
    return tuple(out)


def parse_tool_choice(raw: Any, tools: tuple[ToolDef, ...]) -> ToolChoice:
    """OpenAI's default: "auto" with tools, "none" without."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if raw in ("none", "auto", "required"):
        if raw != "none" and not tools:
            raise ToolError(f"tool_choice {raw!r} needs tools: send the tools the model may "
                            f"call.", "tool_choice")
        return ToolChoice(raw)
    if isinstance(raw, dict) and raw.get("type") == "function":
        fn = raw.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ToolError("tool_choice {\"type\": \"function\"} needs function.name.",
                            "tool_choice.function.name")
        if name not in {t.name for t in tools}:
            raise ToolError(f"tool_choice names the function {name!r}, which is not among the "
                            f"tools ({', '.join(t.name for t in tools) or 'none given'}); "
                            f"add it to tools or name one of them.", "tool_choice")
        return ToolChoice("named", name)
    raise ToolError(f"tool_choice must be \"none\", \"auto\", \"required\" or "
                    f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got "
                    f"{json.dumps(raw)[:100]}.", "tool_choice")
