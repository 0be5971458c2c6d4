"""The request and response bodies the gateway touches: the text in them (for guardrails,
difficulty and token estimates), and conversions between a streamed response and one JSON
body (the cache stores bodies; a hit is replayed as a stream when the client asks for one).

Chat bodies carry text in messages[*].content (a string or a list of text parts); completion
bodies in prompt (a string or a list of strings; token-id prompts carry no text).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

CHARS_PER_TOKEN = 4   # a rough, tokenizer-free estimate for admission; settled by usage


def map_text(body: dict, fn: Callable[[str], str]) -> dict:
    """A copy of a request body with `fn` applied to every piece of input text."""
    out = copy.deepcopy(body)
    for msg in out.get("messages") or []:
        content = msg.get("content")
        if isinstance(content, str):
            msg["content"] = fn(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    part["text"] = fn(part["text"])
    prompt = out.get("prompt")
    if isinstance(prompt, str):
        out["prompt"] = fn(prompt)
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        out["prompt"] = [fn(p) for p in prompt]
    return out


def input_text(body: dict) -> str:
    texts: list[str] = []
    map_text(body, lambda t: texts.append(t) or t)
    return "\n".join(texts)


def estimate_tokens(body: dict, default_max_tokens: int) -> int:
    """Prompt tokens (characters / 4, or the ids of a token prompt) plus the most the
    response may use (max_tokens x n)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompt_tokens = len(prompt)
    else:
        prompt_tokens = -(-len(input_text(body)) // CHARS_PER_TOKEN)
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens
    n = body.get("n") or 1
    return prompt_tokens + int(limit) * int(n)


def is_chat(path: str) -> bool:
    return path.endswith("/chat/completions")


def choice_text(choice: dict, chat: bool) -> str | None:
    """The text of one choice of a response body (message.content / text) or of a stream
    chunk (delta.content / text)."""
    if not chat:
        return choice.get("text")
    part = choice.get("message") or choice.get("delta") or {}
    return part.get("content")


def set_choice_text(choice: dict, chat: bool, text: str) -> None:
    if not chat:
        choice["text"] = text
    else:
        key = "message" if "message" in choice else "delta"
        choice.setdefault(key, {})["content"] = text


def tool_calls(choice: dict) -> list[dict]:
    """The tool calls of one chat choice: a body's message.tool_calls or a stream chunk's
    delta.tool_calls (fragments), or []."""
    part = choice.get("message") or choice.get("delta") or {}
    calls = part.get("tool_calls")
    return calls if isinstance(calls, list) else []


def has_content(event: dict, chat: bool) -> bool:
    """Whether a stream chunk carries output: text, tool calls or a finish reason."""
    for c in event.get("choices") or []:
        if choice_text(c, chat) or c.get("finish_reason") is not None:
            return True
        if chat and (c.get("delta") or {}).get("tool_calls"):
            return True
    return False


class StreamAssembler:
    """Stream chunks -> the equivalent non-streaming response body."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.head: dict = {}
        self.texts: dict[int, list[str]] = {}
        self.finish: dict[int, str | None] = {}
        self.usage: dict | None = None
        # choice -> call index -> {"id", "type", "function": {"name", "arguments"}}
        self.calls: dict[int, dict[int, dict]] = {}
        self.cacheable = True   # False once a chunk holds what a body cannot replay

    def add(self, event: dict) -> None:
        if not self.head:
            self.head = {k: event.get(k) for k in ("id", "created", "model")}
        if event.get("usage"):
            self.usage = event["usage"]
        for c in event.get("choices") or []:
            i = c.get("index", 0)
            text = choice_text(c, self.chat)
            if text:
                self.texts.setdefault(i, []).append(text)
            else:
                self.texts.setdefault(i, [])
            if c.get("finish_reason") is not None:
                self.finish[i] = c["finish_reason"]
            for d in tool_calls(c) if self.chat else ():
                call = self.calls.setdefault(i, {}).setdefault(d.get("index", 0), {
                    "id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                call["id"] = d.get("id") or call["id"]
                fn = d.get("function") or {}
                call["function"]["name"] += fn.get("name") or ""
                call["function"]["arguments"] += fn.get("arguments") or ""
            if c.get("logprobs"):
                self.cacheable = False

    def body(self) -> dict:
        choices = []
        for i in sorted(self.texts):
            text = "".join(self.texts[i])
            if self.chat:
                message = {"role": "assistant", "content": text}
                calls = self.calls.get(i)
                if calls:
                    message["content"] = text or None
                    message["tool_calls"] = [calls[k] for k in sorted(calls)]
                choices.append({"index": i, "message": message,
                                "finish_reason": self.finish.get(i)})
            else:
                choices.append({"index": i, "text": text, "finish_reason": self.finish.get(i)})
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self.head, "object": obj, "choices": choices, "usage": self.usage}

    def text(self, index: int = 0) -> str:
        return "".join(self.texts.get(index, []))


def replay_events(body: dict, chat: bool, include_usage: bool) -> list[dict]:
    """A stored response body as the chunks of a stream: per choice one chunk with the
    whole text and one with the finish reason, then the usage chunk if asked for."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": body.get("id"), "object": obj, "created": body.get("created") or int(time.time()),
            "model": body.get("model")}
    events = []
    for c in body.get("choices") or []:
        i, text = c.get("index", 0), choice_text(c, chat) or ""
        calls = []
        if chat:
            first = {"index": i, "delta": {"role": "assistant", "content": text},
                     "finish_reason": None}
            last = {"index": i, "delta": {}, "finish_reason": c.get("finish_reason")}
            calls = [{**head, "choices": [{"index": i, "delta": {"tool_calls": [
                dict(call, index=k)]}, "finish_reason": None}]}
                for k, call in enumerate(tool_calls(c))]
        else:
            first = {"index": i, "text": text, "finish_reason": None}
            last = {"index": i, "text": "", "finish_reason": c.get("finish_reason")}
        events += [{**head, "choices": [first]}, *calls, {**head, "choices": [last]}]
    if include_usage and body.get("usage"):
        events.append({**head, "choices": [], "usage": body["usage"]})
    return events
