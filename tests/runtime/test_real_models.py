"""Our models against transformers on the real checkpoints (fp32, same weights).

The oracle is transformers loading the same bf16 reference checkpoint that our GGUF
converter wrote (the converter itself is checked against transformers' own GGUF loader
in tests/quantize/test_gguf.py). Both run in fp32.
"""

import pytest
import torch

from qserve.runtime.formats.checkpoint import open_checkpoint
from qserve.runtime.attention import AttentionMetadata, DenseAttention
from qserve.runtime.generate import GenerationParams, generate
from qserve.runtime.models.loader import load_model
from qserve.runtime.tokenizer import Tokenizer

pytestmark = pytest.mark.real_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes,",
    "Once upon a time, in a small village by the sea, there lived",
]
# Real-model logits are ~1e1 in size; fp32 sums in a different order differ by ~1e-5
# relative per layer, so after 30 layers an absolute gap of a few 1e-4 is expected.
LOGIT_ATOL = 2e-3


def _ours_and_theirs(ckpt_dir):
    from transformers import AutoModelForCausalLM

    ours = load_model(open_checkpoint(ckpt_dir), dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(
        ckpt_dir, dtype=torch.float32, attn_implementation="eager").eval()
    tok = Tokenizer.from_dir(ckpt_dir, open_checkpoint(ckpt_dir).generation_config)
    return ours, theirs, tok


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def pair(request):
    ckpt_dir = request.getfixturevalue(f"{request.param}_dir")
    return _ours_and_theirs(ckpt_dir)


@torch.inference_mode()
def test_logits_match_transformers(pair):
    _assert_logits_match(pair)


@torch.inference_mode()
def test_qwen_coder_logits_match_transformers(qwen_coder_dir):
    """The larger Qwen2 model (q/k/v biases, untied head, 24 layers): logits at every
    position of the prompts; its greedy runs cost more than they add here."""
    _assert_logits_match(_ours_and_theirs(qwen_coder_dir))


def _assert_logits_match(pair):
    ours, theirs, tok = pair
    batch = [tok.encode(p) for p in PROMPTS]
    flat = torch.tensor([t for ids in batch for t in ids])
    positions = torch.cat([torch.arange(len(ids)) for ids in batch])
    meta = AttentionMetadata.from_lengths([len(ids) for ids in batch])
    logits = ours.compute_logits(ours(flat, positions, meta, DenseAttention()))
    start = 0
    for ids in batch:
        ref = theirs(torch.tensor([ids])).logits[0].float()  # [L, vocab]
        got = logits[start:start + len(ids)]
        start += len(ids)
        diff = (got - ref).abs().max().item()
        assert diff < LOGIT_ATOL, f"max abs logit diff {diff:.2e} on {tok.decode(ids)!r}"
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


@torch.inference_mode()
def test_greedy_32_tokens_identical(pair):
    ours, theirs, tok = pair
    for prompt in PROMPTS[:2]:
        ids = tok.encode(prompt)
        params = GenerationParams(max_new_tokens=32, stop_token_ids=tok.eos_token_ids)
        mine = list(generate(ours, ids, params))
        ref = theirs.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                              pad_token_id=0)
        ref_new = ref[0, len(ids):].tolist()
        assert mine == ref_new, (tok.decode(mine), tok.decode(ref_new))
        assert len(mine) == 32 or mine[-1] in tok.eos_token_ids


@torch.inference_mode()
def test_engine_matches_reference_on_smollm2(smollm2_dir):
    """The continuous-batching engine (paged bf16 KV, chunked prefill) on the real model
    gives the reference loop's greedy tokens; fp32 weights, K/V rounded to bf16 in both."""
    from qserve.runtime.engine import EngineConfig
    from qserve.runtime.llm import LLM
    from qserve.runtime.loaded_model import load
    from qserve.runtime.sampling_params import SamplingParams

    class Bf16KV:
        def __init__(self, inner):
            self.inner = inner

        def forward(self, spec, q, k, v, meta):
            k, v = (t.to(torch.bfloat16).to(t.dtype) for t in (k, v))
            return self.inner.forward(spec, q, k, v, meta)

    lm = load(str(smollm2_dir), torch.float32)
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    llm = LLM(lm, config=EngineConfig(num_kv_blocks=64, max_num_batched_tokens=16,
                                      kv_dtype="bf16"))
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        ref = list(generate(lm.model, ids, GenerationParams(max_new_tokens=16), Bf16KV))
        assert out.token_ids == ref


LONG_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from "
    "those used to make wine. Before that, books in Europe were copied by hand, usually in "
    "monasteries, and a single Bible could take a scribe more than a year. The new press "
    "could produce hundreds of pages a day. Within fifty years, printing shops had opened "
    "in more than two hundred cities, and millions of books were in circulation. Prices "
    "fell, literacy rose, and ideas travelled faster than ever before: scientists could "
    "compare observations, reformers could spread pamphlets, and merchants could print "
    "standard forms and price lists. Historians still debate how much of the Renaissance, "
    "the Reformation and the Scientific Revolution we owe to this one machine, but few "
    "doubt that it changed how knowledge was made and shared. In the centuries that "
    "followed, the basic design changed surprisingly little until steam power arrived.")
INVARIANCE_PROMPTS = PROMPTS + [
    LONG_PROMPT,
    "Question: What is the boiling point of water in Fahrenheit?\nAnswer:",
    "import numpy as np\n\ndef moving_average(values, window):\n",
    LONG_PROMPT[:400] + " To summarise in one sentence:",
]


@pytest.fixture(scope="module", params=[("smollm2-135m", "smollm2_dir"),
                                        ("gemma3-270m", "gemma3_dir")], ids=lambda p: p[0])
def builtin_recipe_artifact(request, tmp_path_factory):
    """The model quantized with its built-in recipe on this CPU class (int8 W8A16 weights,
    bf16 KV), as `qserve serve MODEL` serves it, with a quicker calibration and no budget
    search. Its source is the session's converted checkpoint (conftest.py; skipped without
    the model's package)."""
    import yaml

    from qserve.quantize.builtin_artifact import builtin_recipe_path
    from qserve.quantize.pipeline import quantize
    from qserve.quantize.recipe import recipe_from_dict

    name, source_fixture = request.param
    request.getfixturevalue(source_fixture)
    raw = yaml.safe_load(builtin_recipe_path(name).read_text())
    raw.pop("budget", None)
    raw["calibration"] = {"num_samples": 2, "seq_len": 256}
    torch.set_num_threads(2)
    out = tmp_path_factory.mktemp("builtin-recipe") / name
    quantize(name, out, recipe_from_dict(raw))
    return out


def test_builtin_artifacts_give_each_prompt_its_tokens_alone_in_any_batch(
        builtin_recipe_artifact):
    """A built-in artifact in bf16, as served: 8 real prompts (5 to ~190 tokens) together
    (one prompt step of all of them, then 8-row decode steps; and again under a 64-token
    budget, chunked and with the prefix cache warm) and each alone: the same 64 greedy
    tokens, and the same top-2 logprobs bit for bit, on whatever CPU class this is."""
    from qserve.runtime.engine import EngineConfig
    from qserve.runtime.llm import LLM
    from qserve.runtime.sampling_params import SamplingParams

    torch.set_num_threads(2)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, logprobs=2)
    llm = LLM(str(builtin_recipe_artifact), dtype="bfloat16", config=EngineConfig(
        num_kv_blocks=256, max_num_batched_tokens=1024, enable_prefix_caching=False))
    assert llm.engine.runner.native is not None
    prompts = [llm.lm.tokenizer.encode(p) for p in INVARIANCE_PROMPTS]
    assert max(map(len, prompts)) > 150

    def results(outs):
        return [[(t, lp.logprob, tuple(lp.top)) for t, lp in zip(o.token_ids, o.logprobs)]
                for o in outs]

    alone = [results(llm.generate([p], params))[0] for p in prompts]
    together = results(llm.generate(prompts, params))
    chunked = LLM(llm.lm, config=EngineConfig(num_kv_blocks=256, max_num_batched_tokens=64))
    warm = [results(chunked.generate(prompts[::-1], params))[::-1] for _ in range(2)]
    for i, want in enumerate(alone):
        assert together[i] == want, f"prompt {i} ({len(prompts[i])} tokens), batched"
        for run, got in enumerate(warm):
            assert got[i] == want, f"prompt {i}, chunked by 64, run {run}"
    assert chunked.engine.stats().tokens_cached > 0  # the second run hit the prefix cache


