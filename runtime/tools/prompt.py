"""Chat messages with tools -> what the chat template renders.

A template that renders tools itself (Qwen2.5's, and others with a `tools` variable) gets
the tools and the history as OpenAI sends them, except that each call's arguments are a
JSON object rather than its text (templates write them with `tojson`). Any other template
gets the tool format's system prompt (merged into the first system message) and the
history as text in that format: an assistant's calls as its content, tool results as a
user turn.

    messages, template_tools = render_tool_messages(messages, tools, fmt, chat_template)
"""

from __future__ import annotations

import json

from .definitions import ToolDef, ToolError
from .format import ToolCallFormat, template_has_tools


def _arguments(call: dict, where: str) -> object:
    try:
        return json.loads(call["arguments"])
    except ValueError as e:
        raise ToolError(f"{where}.function.arguments is not valid JSON ({e}).",
                        f"{where}.function.arguments") from None


def render_tool_messages(messages: list[dict], tools: tuple[ToolDef, ...],
                         fmt: ToolCallFormat, chat_template: str | None
                         ) -> tuple[list[dict], list[dict] | None]:
    """messages: dicts with role and content (a string), and where they have them name,
    tool_calls ([{"id", "name", "arguments"}]) and tool_call_id. Returns the messages and
    the `tools` variable for the template (None: the template is not given tools)."""
    native = template_has_tools(chat_template)
    out: list[dict] = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") or []
        if m["role"] == "assistant" and calls:
            where = f"messages[{i}].tool_calls"
            parsed = [(c, _arguments(c, f"{where}[{j}]")) for j, c in enumerate(calls)]
            if native:
                out.append({"role": "assistant", "content": m.get("content") or "",
                            "tool_calls": [{"id": c["id"], "type": "function",
                                            "function": {"name": c["name"], "arguments": a}}
                                           for c, a in parsed]})
            else:
                text = "\n".join([m["content"]] if m.get("content") else []
                                 + [fmt.history_call(c["name"], a) for c, a in parsed])
                out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool" and not native:
            result = fmt.tool_result(m["content"])
            if out and out[-1].get("_tool_results"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_tool_results": True})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool_results", None)
    if native:
        return out, [t.openai() for t in tools] or None
    if tools:
        prompt = fmt.system_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{prompt}")
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None
