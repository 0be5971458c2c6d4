"""Greedy speculative decoding on the two real models equals the non-speculative engine,
for every proposer. fp32 weights and bf16 KV: speculation scores k+1 tokens in one pass,
so its matmuls have other shapes than one-token steps and sum in another order; fp32 keeps
those differences (~1e-5 in the logits of a verify chunk's first row) far below most logit
gaps between top tokens, while FP8 activation rounding would amplify them into frequent
near-tie flips that say nothing about speculation. The bf16 KV cache still carries them
on: a K or V value that lands on the other side of a bf16 rounding moves by one bf16 step,
so later logits differ by up to ~3e-2 (measured in fp64 on one machine without AMX, where
SmolLM2's top two tokens 0.004 apart flipped). So outputs must be identical up to the first
near-tie: a difference is accepted only where the reference's top two logits are within
NEAR_TIE of each other and the other run chose the runner-up; a wrong acceptance or KV
rollback differs at a clear choice. The draft model is the target's own checkpoint run in bf16
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
NEAR_TIE = 0.05  # logits; speculation bugs differ at clear choices (gaps of ~1 and more)


def assert_same_until_near_tie(lm, prompts, got, ref, what):
    """Each `got` equals `ref`, or first differs where the reference's two best tokens are
    within NEAR_TIE (dense forward of the prompt and the reference output before it, no KV
    rounding, so their order may differ from the engine's) and `got` took the other one."""
    from qserve.runtime.attention import AttentionMetadata, DenseAttention

    for prompt, g, r in zip(prompts, got, ref):
        i = next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), None)
        if i is None:
            assert len(g) == len(r), what
            continue
        ids = torch.tensor(prompt + r[:i])
        hidden = lm.model(ids, torch.arange(len(ids)), AttentionMetadata.from_lengths([len(ids)]),
                          DenseAttention())
        top = lm.model.compute_logits(hidden[-1:])[0].topk(2)
        gap = float(top.values[0] - top.values[1])
        assert sorted(top.indices.tolist()) == sorted([r[i], g[i]]) and gap < NEAR_TIE, (
            f"{what}: token {i} is {g[i]}, the reference's {r[i]}; the reference's best two "
            f"are {top.indices.tolist()} {gap:.4f} apart (not a near-tie)")


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
        assert_same_until_near_tie(lm, prompts, got, ref, proposer)
        assert stats.spec.proposed > 0 and stats.spec.accepted > 0, proposer
        assert stats.kv_blocks_free == stats.kv_blocks_total
