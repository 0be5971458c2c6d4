"""Structured outputs and tool calls on a real model, in-process: validity over the schema
corpus, decode speed constrained against unconstrained, the mask's cost a step, grammar
compile times, what a request with a new schema does to 16 running streams, and tool-call
validity on a labelled set.

    python -m qserve.runtime.benchmark.structured MODEL --threads 2 \
        [--parts corpus,speed,jump,compile,stall,tools] [--tokens 64] [--reps 3]

MODEL: a built-in name (its cached artifact when one was made, else its bf16 source), an
artifact or a checkpoint. Greedy and seeded sampling; every output is parsed and checked
with the `jsonschema` package, string formats included (schema_corpus.validate).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from contextlib import contextmanager

import torch

from .schema_corpus import CORPUS, validate

ASK = "Answer with JSON only. "


def _pct(values, q):
    values = sorted(values)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


# ---------------------------------------------------------------------------- harness
class Served:
    """The model behind the HTTP app, served by uvicorn on a loopback port in a thread
    (streams arrive chunk by chunk, as a client sees them)."""

    def __init__(self, lm, max_num_seqs: int = 64) -> None:
        import socket
        import threading

        import uvicorn

        from ..async_engine import AsyncEngine
        from ..engine import EngineConfig, LLMEngine
        from ..server import create_app
        from ..server.generation import ServerLimits

        self.lm = lm
        self.engine = AsyncEngine(LLMEngine.from_model(lm, EngineConfig(
            kv_cache_gib=1.0, max_num_seqs=max_num_seqs, max_num_batched_tokens=512)))
        self.app = create_app(self.engine, lm.tokenizer, "m",
                              limits=ServerLimits(max_in_flight=256))
        self.chat = bool(lm.tokenizer.chat_template)
        self.engine.grammars.warm_up()  # as `qserve serve` does beside its startup
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def client(self):
        import httpx

        return httpx.AsyncClient(base_url=self.url, timeout=600,
                                 limits=httpx.Limits(max_connections=64))

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.shutdown()


async def _request(client, served: Served, prompt: str, extra: dict, stream: bool):
    """(text of choice 0 or the tool-call JSON, finish_reason, seconds to first token,
    chunk arrival times)."""
    if served.chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", {"prompt": prompt + "\n"}
    body.update(extra, stream=stream)
    t0 = time.perf_counter()
    if not stream:
        r = await client.post(path, json=body)
        r.raise_for_status()
        ch = r.json()["choices"][0]
        text = ch["message"]["content"] if served.chat else ch["text"]
        return text, ch, time.perf_counter() - t0, []
    text, ch, first, times = "", {}, None, []
    async with client.stream("POST", path, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:]).get("choices") or []:
                piece = (c.get("delta") or {}).get("content") if served.chat else c.get("text")
                if piece:
                    now = time.perf_counter()
                    first = first if first is not None else now - t0
                    times.append(now)
                    text += piece
                if c.get("finish_reason"):
                    ch = c
    return text, ch, first, times


def _response_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "out", "schema": schema}}}


# ----------------------------------------------------------------------------- parts
def part_corpus(served: Served, max_tokens: int) -> None:
    print(f"\n## Schema corpus ({len(CORPUS)} schemas, max_tokens {max_tokens})\n")
    print("| mode | valid | finished by length |")
    print("|---|---|---|")
    failures = []

    async def run(mode: str, sampled: bool, stream: bool):
        async with served.client() as client:
            extra = {"max_tokens": max_tokens, "temperature": 0.8 if sampled else 0.0,
                     "seed": 7}
            outs = await asyncio.gather(*[
                _request(client, served, ASK + c.prompt, dict(extra, **_response_format(
                    c.schema)), stream) for c in CORPUS])
        valid = length = 0
        for case, (text, ch, _, _) in zip(CORPUS, outs):
            if ch.get("finish_reason") == "length":
                length += 1
            try:
                validate(json.loads(text), case.schema)
                valid += 1
            except Exception as e:  # parse or validation error: counted, named below
                failures.append(f"{mode} {case.name}: {type(e).__name__}: {str(e)[:120]}")
        return valid, length

    for sampled in (False, True):
        for stream in (False, True):
            mode = f"{'sampled (T=0.8)' if sampled else 'greedy'}, " \
                   f"{'streamed' if stream else 'whole'}"
            valid, length = asyncio.run(run(mode, sampled, stream))
            print(f"| {mode} | {valid}/{len(CORPUS)} | {length} |")
    for f in failures:
        print(f"- {f}")


@contextmanager
def _timed(module, name: str, totals: dict):
    real = getattr(module, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            totals["s"] = totals.get("s", 0.0) + time.perf_counter() - t
            totals["calls"] = totals.get("calls", 0) + 1

    setattr(module, name, wrapper)
    try:
        yield
    finally:
        setattr(module, name, real)


# a schema the model cannot finish within the benchmark's tokens: every step is masked
LONG = {"type": "object", "properties": {"lines": {
    "type": "array", "minItems": 500, "items": {"type": "string", "maxLength": 60}}},
    "required": ["lines"]}


def part_speed(lm, tokens: int, reps: int, batches: list[int]) -> None:
    from dataclasses import replace

    from .. import sampler as sampler_module
    from ..decode_rate import story_prompts, warm_up
    from ..engine import LLMEngine
    from ..llm import LLM
    from ..sampling_params import SamplingParams
    from ..structured import GrammarSpec

    llm = LLM(lm)
    warm_up(llm, max(batches))
    plain = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=tokens, temperature=0.0,
                                 structured=GrammarSpec.json_schema(LONG))
    on = llm.engine.config
    off = replace(on, jump_forward_tokens=0)
    print(f"\n## Decode speed, constrained against unconstrained ({tokens} greedy tokens per "
          f"request, best of {reps}, same prompts; the schema: an array of strings longer "
          f"than the tokens, so every step is masked)\n")
    print("| streams | unconstrained tok/s | JSON schema tok/s (ratio) | same, jump-forward off "
          "(ratio) | mask µs/step | jump-forward µs/step |")
    print("|---|---|---|---|---|---|")
    llm.generate(story_prompts(2), constrained)  # compile once, outside the timing
    for batch in batches:
        prompts = story_prompts(batch)
        runs = (("plain", plain, on), ("json", constrained, on), ("json-nojf", constrained, off))
        best = dict.fromkeys((name for name, _, _ in runs), float("inf"))
        cost = {}
        for _ in range(reps):  # the three alternate, so a slow minute hits all of them
            for name, params, config in runs:
                llm.engine.config = config
                mask: dict = {}
                jump: dict = {}
                with _timed(sampler_module, "apply_grammar", mask), \
                        _timed(LLMEngine, "_jump_forward", jump):
                    t = time.perf_counter()
                    outs = llm.generate(prompts, params)
                    wall = time.perf_counter() - t
                if not all(len(o.token_ids) == tokens for o in outs):
                    raise SystemExit("a request ended before its tokens: raise LONG's minItems")
                if wall < best[name]:
                    best[name], cost[name] = wall, (mask, jump)
        rates = {name: batch * tokens / wall for name, wall in best.items()}
        mask, jump = cost["json-nojf"]
        _, jump_on = cost["json"]
        print(f"| {batch} | {rates['plain']:.1f} | {rates['json']:.1f} "
              f"({rates['json'] / rates['plain']:.3f}) | {rates['json-nojf']:.1f} "
              f"({rates['json-nojf'] / rates['plain']:.3f}) | "
              f"{mask.get('s', 0) / max(1, mask.get('calls', 1)) * 1e6:.0f} | "
              f"{jump_on.get('s', 0) / max(1, jump_on.get('calls', 1)) * 1e6:.0f} |")
    llm.engine.config = on


def part_jump_forward(lm, reps: int) -> None:
    """Jump-forward on replies as the corpus asks for them (objects with keys, whose
    punctuation and keys the grammar forces): the same greedy tokens with it on and off,
    so the wall times compare directly; one request at a time and 16 at once."""
    from dataclasses import replace

    from ..llm import LLM
    from ..sampling_params import SamplingParams
    from ..structured import GrammarSpec

    llm = LLM(lm)
    cases = CORPUS[:16]
    tok = lm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": ASK + c.prompt}])
               if tok.chat_template else ASK + c.prompt + "\n" for c in cases]
    params = [SamplingParams(max_tokens=128, temperature=0.0,
                             structured=GrammarSpec.json_schema(c.schema)) for c in cases]
    original = llm.engine.config
    # on at every batch and whatever its acceptance, here
    on = replace(original, jump_forward_max_batch=64, jump_forward_min_acceptance=0.0)
    off = replace(on, jump_forward_tokens=0)
    print(f"\n## Jump-forward on corpus replies ({len(cases)} schemas, greedy, max_tokens 128, "
          f"best of {reps}, on and off alternating; identical tokens on and off)\n")
    print("| requests at once | tokens | jump-forward off tok/s | on tok/s | ratio | "
          "forced tokens accepted / drafted |")
    print("|---|---|---|---|---|---|")
    llm.generate(prompts, params)  # compile and warm up
    for batch in (1, 4, 16):
        best = {"off": float("inf"), "on": float("inf")}
        texts, moved = {}, (0, 0)
        for _ in range(reps):
            for name, config in (("off", off), ("on", on)):
                llm.engine.config = config
                jf = llm.engine.jump_forward
                before = (jf.accepted, jf.proposed)
                t = time.perf_counter()
                outs = [o for i in range(0, len(prompts), batch)
                        for o in llm.generate(prompts[i:i + batch], params[i:i + batch])]
                best[name] = min(best[name], time.perf_counter() - t)
                texts[name] = [o.token_ids for o in outs]
                if name == "on":
                    moved = (jf.accepted - before[0], jf.proposed - before[1])
        tokens = sum(len(t) for t in texts["on"])
        same = "" if texts["on"] == texts["off"] else " (TOKENS DIFFER)"
        print(f"| {batch} | {tokens}{same} | {tokens / best['off']:.1f} | "
              f"{tokens / best['on']:.1f} | {best['off'] / best['on']:.3f} | "
              f"{moved[0]} / {moved[1]} |")
    llm.engine.config = original


def part_compile(lm) -> None:
    from ..structured import GrammarSpec
    from ..structured.compiler import GrammarCompiler
    from ..tools import FORMATS, parse_tool_choice, parse_tools

    compiler = GrammarCompiler(lm.tokenizer, max(lm.tokenizer.vocab_size,
                                                 lm.model.config.vocab_size))
    t = time.perf_counter()
    compiler.warm_up()
    tables = time.perf_counter() - t
    specs = [GrammarSpec.json_schema(c.schema) for c in CORPUS]
    tools = parse_tools([{"type": "function", "function": {"name": c.name, "parameters":
                          c.schema}} for c in CORPUS if c.schema.get("type") == "object"])
    hermes = FORMATS.get("hermes")
    specs += [hermes.grammar(tools, parse_tool_choice(mode, tools), True)
              for mode in ("auto", "required")]
    cold, cached = [], []
    for spec in specs:
        t = time.perf_counter()
        compiler.compile(spec)
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        compiler.compile(spec)
        cached.append(time.perf_counter() - t)
    print(f"\n## Grammar compilation ({len(specs)} grammars: the corpus and the tool-call "
          f"grammars of {len(tools)} tools)\n")
    print(f"tokenizer tables, once per model: {tables * 1e3:.0f} ms\n")
    print("| | p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|")
    for name, xs in (("cold", cold), ("cached", cached)):
        print(f"| {name} | {_pct(xs, 50) * 1e3:.2f} | {_pct(xs, 99) * 1e3:.2f} | "
              f"{max(xs) * 1e3:.2f} |")


def part_stall(served: Served, tokens: int) -> None:
    """16 greedy streams decode; once each has tokens, one more request arrives: with a
    schema never seen before (compiled then), or unconstrained (the baseline). Its TTFT,
    and the 16 streams' inter-token gaps while it is admitted, against the gaps before."""
    from ..decode_rate import story_prompts

    prompts = story_prompts(16)

    async def run(new_schema: dict | None):
        async with served.client() as client:
            started = asyncio.Event()
            arrivals: list[list[float]] = [[] for _ in prompts]

            async def stream(i):
                body = {"prompt": prompts[i], "max_tokens": tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            arrivals[i].append(time.perf_counter())
                            if all(len(a) >= 8 for a in arrivals):
                                started.set()

            tasks = [asyncio.create_task(stream(i)) for i in range(len(prompts))]
            await started.wait()
            extra = {"max_tokens": 8, "temperature": 0}
            if new_schema is not None:
                extra.update(_response_format(new_schema))
            sent = time.perf_counter()
            _, _, ttft, _ = await _request(client, served, ASK + "Describe a person.", extra,
                                           True)
            first = sent + ttft
            await asyncio.gather(*tasks)
        during, before = [], []
        for a in arrivals:
            for x, y in zip(a, a[1:]):
                if sent <= y <= first + 0.05:
                    during.append(y - x)
                elif y < sent:
                    before.append(y - x)
        return ttft, during, before

    print("\n## A new schema while 16 streams decode\n")
    print("| 17th request | its TTFT ms | streams' ITL p50 / p99 ms before | "
          "while it is admitted |")
    print("|---|---|---|---|")
    nonce = int(time.time() * 1000)
    for name, schema in (("unconstrained", None),
                         ("new JSON schema", dict(CORPUS[-1].schema, title=f"n{nonce}"))):
        ttft, during, before = asyncio.run(run(schema))
        print(f"| {name} | {ttft * 1e3:.0f} | {_pct(before, 50) * 1e3:.1f} / "
              f"{_pct(before, 99) * 1e3:.1f} | {_pct(during, 50) * 1e3:.1f} / "
              f"{_pct(during, 99) * 1e3:.1f} ({len(during)} gaps) |")


TOOL_DEFS = [
    {"type": "function", "function": {"name": "get_weather",
     "description": "Current weather in a city.", "parameters": {"type": "object",
     "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time",
     "description": "The current time in a timezone, e.g. Europe/Paris.",
     "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                    "required": ["timezone"]}}},
    {"type": "function", "function": {"name": "convert_currency",
     "description": "Convert an amount between currencies.",
     "parameters": {"type": "object", "properties": {
         "amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}},
         "required": ["amount", "from", "to"]}}},
]
# (request, the tool a call is expected of, or None where no call is)
TOOL_CASES = [
    ("What's the weather in Tokyo right now?", "get_weather"),
    ("Is it raining in London?", "get_weather"),
    ("How warm is it in Cairo today?", "get_weather"),
    ("Tell me the weather forecast for Sydney.", "get_weather"),
    ("What time is it in New York?", "get_time"),
    ("Current time in the Asia/Kolkata timezone?", "get_time"),
    ("What is the local time in Berlin?", "get_time"),
    ("Convert 100 US dollars to euros.", "convert_currency"),
    ("How many Japanese yen is 50 British pounds?", "convert_currency"),
    ("Change 20 EUR into CHF.", "convert_currency"),
    ("Write a haiku about the sea.", None),
    ("What is the capital of Italy?", None),
    ("Explain what a prime number is in one sentence.", None),
    ("Say hello in French.", None),
    ("What is 2 + 2?", None),
    ("Give me a synonym for 'happy'.", None),
]


def part_tools(served: Served, max_tokens: int) -> None:
    if not served.chat:
        print("\n## Tool calls\n\nno chat template: this model takes no tool calls.")
        return

    async def run():
        async with served.client() as client:
            return await asyncio.gather(*[client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": q}], "tools": TOOL_DEFS,
                "temperature": 0, "max_tokens": max_tokens}) for q, _ in TOOL_CASES])

    rows = asyncio.run(run())
    hit = right = false_calls = valid = calls = 0
    expected = sum(1 for _, t in TOOL_CASES if t)
    for (q, tool), r in zip(TOOL_CASES, rows):
        msg = r.json()["choices"][0]["message"]
        made = msg.get("tool_calls") or []
        for c in made:
            calls += 1
            try:
                schema = next(t["function"]["parameters"] for t in TOOL_DEFS
                              if t["function"]["name"] == c["function"]["name"])
                validate(json.loads(c["function"]["arguments"]), schema)
                valid += 1
            except (StopIteration, ValueError, Exception):
                pass
        if tool and made:
            hit += 1
            right += made[0]["function"]["name"] == tool
        if not tool and made:
            false_calls += 1
    print(f"\n## Tool calls, tool_choice auto ({len(TOOL_CASES)} labelled requests, "
          f"{len(TOOL_DEFS)} tools, greedy)\n")
    print("| expected a call: called | the expected tool | no call expected: called | "
          "calls with valid arguments |")
    print("|---|---|---|---|")
    print(f"| {hit}/{expected} | {right}/{expected} | {false_calls}/{len(TOOL_CASES) - expected}"
          f" | {valid}/{calls} |")


def main(argv: list[str] | None = None) -> None:
    from ...quantize.builtin_artifact import cached_builtin_artifact
    from ..loaded_model import load

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parts", default="corpus,speed,jump,compile,stall,tools")
    ap.add_argument("--tokens", type=int, default=64, help="Tokens a request in the speed "
                    "and stall parts.")
    ap.add_argument("--max-tokens", type=int, default=256,
                    help="max_tokens of the corpus and tool requests.")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    unknown = parts - {"corpus", "speed", "jump", "compile", "stall", "tools"}
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}")
    torch.set_num_threads(args.threads)
    model = cached_builtin_artifact(args.model)
    lm = load(model, args.dtype)
    print(f"{model} ({lm.dtype}), {args.threads} thread(s)")
    if "compile" in parts:
        part_compile(lm)
    if "speed" in parts:
        part_speed(lm, args.tokens, args.reps, [int(b) for b in args.batch.split(",")])
    if "jump" in parts:
        part_jump_forward(lm, args.reps)
    if parts & {"corpus", "stall", "tools"}:
        served = Served(lm)
        try:
            if "corpus" in parts:
                part_corpus(served, args.max_tokens)
            if "stall" in parts:
                part_stall(served, max(args.tokens, 96))
            if "tools" in parts:
                part_tools(served, args.max_tokens)
        finally:
            served.close()


if __name__ == "__main__":
    main()
