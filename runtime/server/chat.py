"""POST /v1/chat/completions: messages (and tools) -> engine -> OpenAI chat response.

The flow is the completions flow (completions.py) plus the chat template, tool calling
(runtime/tools: the tools rendered into the prompt, a grammar when tool_choice requires
calls or for the calls `auto` lets the model begin, the model's text parsed back into
`tool_calls`) and n choices. Streamed, each choice gets its role chunk, then content
and tool-call deltas (a call's id and name first, then its arguments in fragments), then
its finish chunk (`finish_reason: "tool_calls"` when it called tools).
"""

from __future__ import annotations

import json
import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from ..engine import RequestOutput
from ..structured.spec import GrammarError
from ..tools import ToolChoice, ToolDef, ToolError, parse_tool_choice, parse_tools
from ..tools.format import StreamEvent, ToolCallParser
from ..tools.prompt import render_tool_messages
from .completions import (ChunkTemplate, check_common, check_model, client_left, collect,
                          error_event, event, fit_max_tokens, make_params, sse, usage,
                          check_ids)
from .constraints import compile_constraint, grammar_for
from .disagg_routes import kv_before
from .errors import ApiError, bad_request
from .generation import ServerState
from .logprobs import chat_logprobs
from .openai_fields import CHAT_REFUSED, refuse_unserved
from .protocol import ChatCompletionRequest


def tool_request(raw_tools, raw_choice) -> tuple[tuple[ToolDef, ...], ToolChoice]:
    """The request's tools and tool_choice, or a 400 naming the field."""
    try:
        tools = parse_tools(raw_tools)
        return tools, parse_tool_choice(raw_choice, tools)
    except ToolError as e:
        raise bad_request(str(e), e.param) from None


def _message_dict(m) -> dict:
    out = {"role": m.role, "content": m.text()}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "name": c.function.name,
                              "arguments": c.function.arguments} for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def chat_prompt_ids(state: ServerState, messages, add_generation_prompt: bool,
                    tools: tuple[ToolDef, ...] = (), choice: ToolChoice | None = None
                    ) -> list[int]:
    """The prompt's token ids: the messages (and the tools the model may call) through the
    chat template."""
    from ..tokenizer import ChatTemplateError

    tok = state.tokenizer
    if not tok.chat_template:
        raise ApiError(400, f"the model {state.model_name!r} has no chat template, so it "
                            f"cannot take chat messages: use POST /v1/completions with a "
                            f"plain prompt instead.", param="messages",
                       code="chat_template_missing")
    offered = choice.offered(tools) if choice is not None else tools
    try:
        msgs = [_message_dict(m) for m in messages]
        if offered or any(m.get("tool_calls") or m["role"] == "tool" for m in msgs):
            msgs, template_tools = render_tool_messages(msgs, offered, state.tool_format,
                                                        tok.chat_template)
        else:
            template_tools = None
        text = tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt,
                                       tools=template_tools)
    except ToolError as e:
        raise bad_request(str(e), e.param) from None
    except (ValueError, ChatTemplateError) as e:
        raise bad_request(str(e), "messages") from None
    ids = tok.encode(text, add_special_tokens=False)
    check_ids(state, ids, "messages")
    return ids


class _ChatChoice:
    """One choice's output: text, logprobs, and (with tools) its parsed calls."""

    def __init__(self, state: ServerState, index: int, num_top: int | None,
                 parser: ToolCallParser | None) -> None:
        self.state, self.index, self.num_top, self.parser = state, index, num_top, parser
        self.text = ""
        self.logprobs: list[dict] = []
        self.completion_tokens = 0
        self.cached = 0
        self.finish_reason = self.stop_reason = None
        self.grammar_incomplete = False

    def add(self, out: RequestOutput) -> tuple[list[StreamEvent], list[dict]]:
        """Account for one output: (the stream events its text settles, its logprobs)."""
        if self.completion_tokens == 0:
            self.cached = out.num_cached_tokens
        self.completion_tokens += len(out.token_ids)
        lps = (chat_logprobs(self.state.tokenizer, out.logprobs, self.num_top)
               if self.num_top is not None else [])
        self.text += out.text
        self.logprobs += lps
        if self.parser is None:
            events = [StreamEvent("content", out.text)] if out.text else []
        else:
            events = self.parser.feed(out.text)
        if out.finished:
            if self.parser is not None:
                events += self.parser.finish()
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
            self.grammar_incomplete = out.grammar_incomplete
            if self.calls and self.finish_reason == "stop":
                self.finish_reason = "tool_calls"
        return events, lps

    @property
    def calls(self) -> list:
        return self.parser.result().calls if self.parser is not None else []

    def message(self) -> dict:
        msg = {"role": "assistant", "content": self.text, "refusal": None}
        if self.parser is not None:
            parsed = self.parser.result()
            msg["content"] = parsed.content
            if parsed.calls:
                msg["tool_calls"] = [c.openai() for c in parsed.calls]
        return msg

    def json(self) -> dict:
        out = {"index": self.index, "message": self.message(),
               "logprobs": {"content": self.logprobs} if self.num_top is not None else None,
               "finish_reason": self.finish_reason, "stop_reason": self.stop_reason}
        if self.grammar_incomplete:
            out["grammar_incomplete"] = True
        return out


def _delta(event: StreamEvent) -> dict:
    if event.kind == "content":
        return {"content": event.text}
    if event.kind == "call":
        return {"tool_calls": [{"index": event.index, "id": event.call_id, "type": "function",
                                "function": {"name": event.text, "arguments": ""}}]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest,
                                 request: Request):
    check_model(state, req.model)
    check_common(state, req)
    refuse_unserved(req, CHAT_REFUSED)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true.", "top_logprobs")
    tools, choice = tool_request(req.tools, req.tool_choice)
    offered = choice.offered(tools)
    spec, field = grammar_for(req)
    if offered:
        try:
            spec = state.tool_format.grammar(tools, choice, req.parallel_tool_calls, spec)
        except GrammarError as e:
            raise bad_request(str(e), e.param or "tools") from None
    ids = chat_prompt_ids(state, req.messages, req.add_generation_prompt, tools, choice)
    tokens_param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    max_tokens = fit_max_tokens(state, len(ids), req.max_completion_tokens or req.max_tokens,
                                "messages", tokens_param)
    await compile_constraint(state.grammars, spec, "tools" if offered else field)
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    params = make_params(state, req, max_tokens, num_top, structured=spec)
    rid = state.next_id("chatcmpl")
    gen = state.start(rid, [ids], [params], await kv_before(state, request), n=req.n,
                      headers=request.headers)
    choices = [_ChatChoice(state, i, num_top,
                           state.tool_format.parser(offered) if offered else None)
               for i in range(req.n)]
    created = int(time.time())

    def totals():
        return usage(len(ids), sum(c.completion_tokens for c in choices), choices[0].cached)

    if not req.stream:
        if not await collect(gen, choices, request):
            return client_left()
        body = {"id": rid, "object": "chat.completion", "created": created,
                "model": state.model_name, "choices": [c.json() for c in choices],
                "usage": totals()}
        return JSONResponse(body)

    head = {"id": rid, "object": "chat.completion.chunk", "created": created,
            "model": state.model_name}

    template = ChunkTemplate(head)

    def chunk(index: int, delta: dict, logprobs=None, finish=None, stop_reason=None,
              incomplete=False) -> bytes:
        c = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            c["stop_reason"] = stop_reason
            if incomplete:
                c["grammar_incomplete"] = True
        return event(template(c))

    async def events():  # one write per engine step: that step's chunks of every choice
        yield b"".join(chunk(c.index, {"role": "assistant", "content": ""}) for c in choices)
        async for batch in gen.batches():
            out = []
            for index, item in batch:
                if isinstance(item, Exception):
                    out.append(event(error_event(item)))
                    continue
                c = choices[index]
                deltas, lps = c.add(item)
                lp = {"content": lps} if num_top is not None else None
                if not deltas and lps:
                    out.append(chunk(index, {"content": ""}, lp))
                for i, ev in enumerate(deltas):
                    out.append(chunk(index, _delta(ev), lp if i == 0 else None))
                if item.finished:
                    out.append(chunk(index, {}, finish=c.finish_reason,
                                     stop_reason=c.stop_reason, incomplete=c.grammar_incomplete))
            if out:
                yield b"".join(out)
        if req.stream_options is not None and req.stream_options.include_usage:
            yield event(json.dumps(dict(head, choices=[], usage=totals())))

    return sse(events(), gen)
