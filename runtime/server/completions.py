"""POST /v1/completions, and what it shares with /v1/chat/completions (chat.py).

Both share the flow: validate and tokenize (400 on anything wrong, before any engine
work), admit (429 when full), then either collect the outputs into one JSON response or
stream them as SSE chunks (`data: {chunk}` ... `data: [DONE]`). A prompt whose engine
stream fails mid-way gets an error chunk in the stream, then [DONE].

Scoring (lm-eval's local-completions): `echo` + `logprobs` returns the prompt's own token
logprobs before the generated ones; with `max_tokens: 0` only the prompt is returned.
The engine always generates at least one token, so max_tokens=0 runs one and drops it.
"""

from __future__ import annotations

import asyncio
import json
import time

import anyio
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine import RequestOutput
from ..sampling_params import SamplingParams
from ..structured.spec import GrammarSpec
from .constraints import compile_constraint, grammar_for
from .errors import ApiError, bad_request
from .disagg_routes import kv_before
from .generation import Generation, ServerState, StreamInterrupted, error_for
from .logprobs import CompletionLogprobs
from .openai_fields import COMPLETION_REFUSED, VLLM_REFUSED, refuse_unserved
from .protocol import MAX_STOP, CompletionRequest, _Common

SSE_PING_S = 15
SHUTDOWN_MARGIN_S = 0.5  # past the drain time, for a stream to send its error event and [DONE]


# ------------------------------------------------------------------------ validation
def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                            f"{state.model_name!r} (see GET /v1/models).",
                       param="model", code="model_not_found")


def check_common(state: ServerState, req: _Common) -> None:
    if req.n > state.limits.max_n:
        raise bad_request(f"n={req.n} is more samples than this server gives one request "
                          f"(--max-n {state.limits.max_n}); send n <= {state.limits.max_n} "
                          f"or several requests.", "n")
    refuse_unserved(req, VLLM_REFUSED)
    if len(req.stop_list()) > MAX_STOP:
        raise bad_request(f"at most {MAX_STOP} stop strings, got {len(req.stop_list())}.", "stop")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true.", "stream_options")


def fit_max_tokens(state: ServerState, num_prompt: int, max_tokens: int | None,
                   prompt_param: str, tokens_param: str = "max_tokens") -> int:
    """The max_tokens to run with: the request's, or the server's default cut to what
    fits in the context."""
    limit = state.max_model_len
    if num_prompt >= limit:
        raise ApiError(400, f"the prompt has {num_prompt} tokens; this model's context holds "
                            f"{limit} tokens including at least one generated token. "
                            f"Shorten the prompt.",
                       param=prompt_param, code="context_length_exceeded")
    room = limit - num_prompt
    if max_tokens is None:
        return min(room, state.limits.max_tokens_default)
    if max_tokens > room:
        raise ApiError(400, f"{tokens_param}={max_tokens} does not fit: the prompt has "
                            f"{num_prompt} tokens and the context {limit}; ask for at most "
                            f"{room}.", param=tokens_param, code="context_length_exceeded")
    return max_tokens


def logit_bias(state: ServerState, req: _Common) -> dict[int, float]:
    """The request's logit_bias with token ids as integers, each checked against this
    model's vocabulary (400 naming the bad key)."""
    out = {}
    vocab = state.grammars.vocab_size
    for key, value in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if str(token) != key.strip() or not 0 <= token < vocab:
            raise bad_request(f"logit_bias key {key!r} is not a token id of this model: keys "
                              f"are token ids in [0, {vocab}) (see POST /tokenize).",
                              "logit_bias")
        out[token] = value  # its range: SamplingParams checks it (a 400 naming logit_bias)
    return out


def make_params(state: ServerState, req: _Common, max_tokens: int, logprobs: int | None,
                prompt_logprobs: int | None = None,
                structured: GrammarSpec | None = None) -> SamplingParams:
    kw = dict(max_tokens=max_tokens, stop=tuple(req.stop_list()),
              stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
              logprobs=logprobs, prompt_logprobs=prompt_logprobs, n=req.n,
              skip_special_tokens=req.skip_special_tokens, seed=req.seed,
              logit_bias=logit_bias(state, req), structured=structured)
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        word = str(e).split(" ", 1)[0]
        raise bad_request(str(e), word if word in SamplingParams.field_names() else None) from None


def check_ids(state: ServerState, ids: list[int], param: str) -> None:
    if not ids:
        raise bad_request("the prompt is empty (no tokens).", param)
    vocab = state.tokenizer.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token ids must be in [0, {vocab}), got {bad[:5]}.", param)


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def error_event(exc: Exception) -> str:
    return json.dumps(error_for(exc).body())


def _shutdown_error() -> str:
    return json.dumps(ApiError(503, "the server is shutting down and this stream did not end "
                                    "within its drain time; retry the request.",
                               code="server_shutting_down").body())


def event(data: str) -> bytes:
    """One SSE event, encoded: what sse-starlette writes for a yielded string (sep "\n"),
    made here so that several events go out in one write."""
    return b"data: " + data.encode() + b"\n\n"


DONE = event("[DONE]")


class ChunkTemplate:
    """json.dumps(dict(head, choices=[choice])), byte for byte, with the head's JSON
    made once per response rather than once per chunk."""

    def __init__(self, head: dict) -> None:
        self._prefix = json.dumps(head)[:-1] + ', "choices": ['

    def __call__(self, choice: dict) -> str:
        return self._prefix + json.dumps(choice) + "]}"


def sse(events, gen: Generation) -> EventSourceResponse:
    """The stream as SSE, then [DONE]: `events` yields encoded events (bytes, see
    `event`), each yield one write to the socket. On shutdown (SIGTERM) it keeps streaming for the
    server's drain time; a stream still running then ends with an error event and [DONE]
    rather than a cut connection. The drain is watched by one task per stream, not on
    every token: a token's way to the socket has no timer and no task of its own."""
    shutdown = anyio.Event()  # set by sse-starlette when the server begins to stop
    drain_s = gen.state.limits.shutdown_drain_s

    async def interrupt_after_drain():
        await shutdown.wait()
        await asyncio.sleep(drain_s)
        gen.interrupt()

    async def guarded():
        watcher = asyncio.ensure_future(interrupt_after_drain())
        try:
            async for data in events:
                yield data
            yield DONE
        except StreamInterrupted:
            yield event(_shutdown_error()) + DONE
        finally:
            watcher.cancel()
            gen.close()

    async def close():  # a coroutine: starlette runs a plain function in a worker thread
        gen.close()

    return EventSourceResponse(guarded(), sep="\n", ping=SSE_PING_S,
                               background=BackgroundTask(close), shutdown_event=shutdown,
                               shutdown_grace_period=drain_s + SHUTDOWN_MARGIN_S)


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects. Called once the body has been read, so the
    next ASGI message can only be the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(gen: Generation, choices: list, request: Request) -> bool:
    """Feed every output to its choice. False if the client left first: its engine work
    is then aborted (KV blocks freed) rather than run to the end for no one."""
    async def consume():
        async for index, item in gen.outputs():
            if isinstance(item, Exception):
                raise error_for(item)
            choices[index].add(item)

    work = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            work.result()  # raises the ApiError of a failed prompt
            return True
        return False
    finally:
        work.cancel()
        gone.cancel()
        gen.close()


def client_left() -> Response:
    # nobody reads it; 499 ("client closed request") is what the access log shows
    return Response(status_code=499)


# ----------------------------------------------------------------------- completions
class _CompletionChoice:
    def __init__(self, state: ServerState, index: int, text: str | None, ids: list[int],
                 req: CompletionRequest, echo_only: bool) -> None:
        self.state, self.index, self.ids = state, index, ids
        self._prompt_text = text
        self.echo, self.echo_only = req.echo, echo_only
        self.lp = CompletionLogprobs(state.tokenizer) if req.logprobs is not None else None
        self.text = ""
        self.started = False
        self.completion_tokens = 0
        self.cached = 0
        self.finish_reason = self.stop_reason = None
        self.grammar_incomplete = False

    @property
    def prompt_text(self) -> str:
        if self._prompt_text is None:
            self._prompt_text = self.state.tokenizer.decode(self.ids, skip_special_tokens=False)
        return self._prompt_text

    def add(self, out: RequestOutput) -> str:
        """Account for one output; returns the text it adds (echo included)."""
        text = ""
        if not self.started:
            self.started = True
            self.cached = out.num_cached_tokens
            if self.echo:
                text = self.prompt_text
                if self.lp is not None:
                    self.lp.add_prompt(self.ids, out.prompt_logprobs or [None] * len(self.ids))
                    self.lp.offset = len(text)
        if not self.echo_only:
            text += out.text
            self.completion_tokens += len(out.token_ids)
            if self.lp is not None:
                for lp in out.logprobs:
                    self.lp.add(lp.token_id, lp)
        if out.finished:
            self.finish_reason = "length" if self.echo_only else out.finish_reason
            self.stop_reason = None if self.echo_only else out.stop_reason
            self.grammar_incomplete = out.grammar_incomplete
        self.text += text
        return text

    def json(self, text: str) -> dict:
        out = {"index": self.index, "text": text,
               "logprobs": self.lp.take() if self.lp is not None else None,
               "finish_reason": self.finish_reason, "stop_reason": self.stop_reason}
        if self.grammar_incomplete:
            out["grammar_incomplete"] = True  # see README: the text does not follow it
        return out


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def completion_prompts(state: ServerState, prompt) -> list[tuple[str | None, list[int]]]:
    if isinstance(prompt, str):
        items = [prompt]
    elif isinstance(prompt, list) and not prompt:
        raise bad_request("prompt is an empty list.", "prompt")
    elif isinstance(prompt, list) and all(_is_id(x) for x in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and all(
            isinstance(x, str) or (isinstance(x, list) and all(_is_id(t) for t in x))
            for x in prompt):
        items = list(prompt)
    else:
        raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids "
                            "(integers), or a list of token-id lists.", "prompt", "invalid_type")
    if len(items) > state.limits.max_prompts:
        raise ApiError(413, f"{len(items)} prompts in one request; at most "
                            f"{state.limits.max_prompts}. Split the batch.",
                       param="prompt", code="too_many_prompts")
    result = []
    for item in items:
        if isinstance(item, str):
            ids = state.tokenizer.encode(item, add_special_tokens=True)
            result.append((item, ids))
        else:
            result.append((None, list(item)))
        check_ids(state, result[-1][1], "prompt")
    return result


async def create_completion(state: ServerState, req: CompletionRequest, request: Request):
    check_model(state, req.model)
    check_common(state, req)
    refuse_unserved(req, COMPLETION_REFUSED)
    echo_only = req.max_tokens == 0
    if echo_only and not req.echo:
        raise bad_request("max_tokens=0 generates nothing: it is only allowed with echo=true "
                          "(to score the prompt).", "max_tokens")
    spec, field = grammar_for(req)  # checked either way; echo only generates nothing
    if echo_only:
        spec = None
    prompts = completion_prompts(state, req.prompt)
    params = []
    for _, ids in prompts:
        if echo_only:
            fit_max_tokens(state, len(ids), 1, "prompt")
            params.append(make_params(state, req, 1, None, req.logprobs))
        else:
            max_tokens = fit_max_tokens(state, len(ids), req.max_tokens, "prompt")
            params.append(make_params(state, req, max_tokens, req.logprobs,
                                      req.logprobs if req.echo else None, spec))
    await compile_constraint(state.grammars, spec, field)
    rid = state.next_id("cmpl")
    before = await kv_before(state, request) if len(prompts) == 1 else None
    n = 1 if echo_only else req.n
    gen = state.start(rid, [ids for _, ids in prompts], params, before, n=n,
                      headers=request.headers)
    # choice index = prompt index * n + sample index, as OpenAI numbers them
    choices = [_CompletionChoice(state, p * n + i, text, ids, req, echo_only)
               for p, (text, ids) in enumerate(prompts) for i in range(n)]
    head = {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": state.model_name}

    def totals():  # the prompts count once, however many samples each has
        return usage(sum(len(ids) for _, ids in prompts),
                     sum(c.completion_tokens for c in choices),
                     sum(c.cached for c in choices[::n]))

    if not req.stream:
        if not await collect(gen, choices, request):
            return client_left()
        body = dict(head, choices=[c.json(c.text) for c in choices], usage=totals())
        return JSONResponse(body)

    template = ChunkTemplate(head)

    async def events():  # one write per engine step: that step's chunks of every choice
        async for batch in gen.batches():
            out = []
            for index, item in batch:
                if isinstance(item, Exception):
                    out.append(event(error_event(item)))
                    continue
                c = choices[index]
                out.append(event(template(c.json(c.add(item)))))
            yield b"".join(out)
        if req.stream_options is not None and req.stream_options.include_usage:
            yield event(json.dumps(dict(head, choices=[], usage=totals())))

    return sse(events(), gen)
