"""Greedy speculative decoding on the two real models equals the non-speculative engine,
for every proposer. fp32 weights and bf16 KV: speculation scores k+1 tokens in one pass,
so its matmuls have other shapes than one-token steps and sum in another order; fp32 keeps
those differences (~1e-6) far below the logit gaps between top tokens on these prompts,
while FP8 activation rounding would amplify them into occasional near-tie flips that say
nothing about speculation. The draft model is the target's own checkpoint run in bf16
(same tokenizer, mostly but not always the same argmax: both accept and reject paths).
The hidden-state draft's head is untrained (its drafts are mostly rejected; n-gram lookup
goes first, as served, and its drafts are accepted on these prompts)."""

import sys
from pathlib import Path

import pytest
import torch

from qserve.runtime.engine import EngineConfig
from qserve.runtime.llm import LLM
from qserve.runtime.loaded_model import load
from qserve.runtime.sampling_params import SamplingParams
from qserve.runtime.spec.proposer import make_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_hidden_draft_head  # noqa: E402

pytestmark = pytest.mark.real_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]
EXIT_LAYER = {"smollm2": 8, "gemma3": 6}


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def target(request):
    torch.set_num_threads(2)
    ckpt = request.getfixturevalue(f"{request.param}_dir")
    return request.param, ckpt, load(str(ckpt), torch.float32)


@torch.inference_mode()
def test_greedy_identical_every_proposer(target, tmp_path):
    name, ckpt, lm = target
    head = write_tiny_hidden_draft_head(tmp_path / "head.safetensors", lm, num_tokens=4096)
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

    def run(spec=None):
        cfg = EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64, kv_dtype="bf16",
                           decode_impl="eager", speculative=spec)
        llm = LLM(lm, config=cfg)
        return [o.token_ids for o in llm.generate(prompts, params)], llm.engine.stats()

    ref, _ = run()
    specs = {"ngram": make_config("ngram", 4),
             "early_exit": make_config("early_exit", 3, num_layers=EXIT_LAYER[name]),
             "draft_model": make_config("draft_model", 4,
                                        path=load(str(ckpt), torch.bfloat16)),
             "hidden_draft": make_config("hidden_draft", 4, head=str(head), min_prob=0.0)}
    for proposer, spec in specs.items():
        got, stats = run(spec)
        assert got == ref, proposer
        assert stats.spec.proposed > 0 and stats.spec.accepted > 0, proposer
        assert stats.kv_blocks_free == stats.kv_blocks_total
