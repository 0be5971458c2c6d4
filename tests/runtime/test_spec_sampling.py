"""Rejection sampling preserves the target distribution, checked statistically.

Each test draws many seeded samples and runs Pearson's chi-square goodness-of-fit test of
the observed token sequences against the exact target probabilities, at a fixed
significance ALPHA = 1e-3 (the runs are seeded, so each test's outcome is deterministic).
The same tests run with the acceptance rule deliberately broken (every draft accepted)
and must then reject the fit: the check has the power to see a wrong sampler.
"""

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from scipy.stats import chi2

from qserve.runtime.engine import EngineConfig
from qserve.runtime.llm import LLM
from qserve.runtime.loaded_model import load
from qserve.runtime.sampler import SamplingState
from qserve.runtime.sampling_params import SamplingParams
from qserve.runtime.spec import rejection_sampler
from qserve.runtime.spec.proposer import make_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_hidden_draft_head, write_tiny_llama  # noqa: E402

ALPHA = 1e-3


def chi_square_pvalue(observed: Counter, expected_probs: dict, n: int) -> float:
    """Pearson chi-square p-value; cells with expected count < 5 are pooled into one, and a
    sample outside the support counts in a cell of (almost) zero expected mass."""
    cells = set(expected_probs) | set(observed)
    pairs = [(observed.get(c, 0), n * expected_probs.get(c, 0.0)) for c in cells]
    big = [(o, e) for o, e in pairs if e >= 5]
    small = [(o, e) for o, e in pairs if e < 5]
    if small:
        big.append((sum(o for o, _ in small), max(sum(e for _, e in small), 1e-9)))
    stat = sum((o - e) ** 2 / e for o, e in big)
    return float(chi2.sf(stat, max(len(big) - 1, 1)))


def always_accept(u, p_draft, q_draft):
    return torch.ones_like(u, dtype=torch.bool)


# -- the sampler alone, on a Markov-chain "model" over 5 tokens -------------------------
V = 5
G = torch.Generator().manual_seed(0)
TARGET = torch.randn(V, V, generator=G) * 1.5  # logits of next | last token
DRAFT = torch.softmax(torch.randn(V, V, generator=G) * 1.5, dim=-1)  # q(next | last)


def _markov_pairs(num: int, k: int = 2) -> Counter:
    """First two tokens after token 0, sampled by drafting k tokens from DRAFT and
    verifying against TARGET, as the engine does."""
    params = SamplingParams(temperature=1.0, max_tokens=8)
    out = Counter()
    draw_gen = torch.Generator().manual_seed(1)
    for s in range(num):
        state = SamplingState(SamplingParams(temperature=1.0, seed=s), [0])
        seq = [0]
        while len(seq) < 3:
            drafts, qs, last = [], [], seq[-1]
            for _ in range(k):
                q = DRAFT[last]
                last = int(torch.multinomial(q, 1, generator=draw_gen))
                drafts.append(last)
                qs.append(q)
            logits = TARGET[[seq[-1]] + drafts]  # [k+1, V]: rows given each context
            v = rejection_sampler.verify(logits, drafts, torch.stack(qs), state)
            seq += v.token_ids
        out[tuple(seq[1:3])] += 1
    del params
    return out


def _markov_expected() -> dict:
    p = torch.softmax(TARGET, dim=-1)
    return {(a, b): float(p[0, a] * p[a, b]) for a in range(V) for b in range(V)}


def test_sampler_matches_target_markov_chain():
    n = 1500
    assert chi_square_pvalue(_markov_pairs(n), _markov_expected(), n) > ALPHA


def test_sampler_check_catches_always_accept(monkeypatch):
    monkeypatch.setattr(rejection_sampler, "accept_mask", always_accept)
    n = 1500
    assert chi_square_pvalue(_markov_pairs(n), _markov_expected(), n) < ALPHA


# -- the whole engine on a tiny model: early-exit drafts (q from the first layer) and
# hidden-state drafts (q from an untrained head over 250 of the 300 tokens: zero elsewhere)
@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    torch.set_num_threads(1)
    return load(str(write_tiny_llama(tmp_path_factory.mktemp("specs") / "t")), torch.float32)


@pytest.fixture(scope="module")
def specs(lm, tmp_path_factory):
    head = write_tiny_hidden_draft_head(tmp_path_factory.mktemp("head") / "h.safetensors", lm, 250)
    return {"early_exit": make_config("early_exit", 2, num_layers=1),
            "hidden_draft": make_config("hidden_draft", 2, head=str(head), ngram=False)}


PROMPT = [5, 17, 42, 99, 3, 250, 61]
TOP_K = 3


def _engine_samples(lm, num: int, spec) -> Counter:
    """(t1, t2, t3) of `num` seeded requests; t2 and t3 come from speculative steps."""
    llm = LLM(lm, config=EngineConfig(num_kv_blocks=1024, max_num_batched_tokens=4096,
                                      max_num_seqs=512, kv_dtype="bf16", decode_impl="eager",
                                      speculative=spec))
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=TOP_K, seed=s, ignore_eos=True)
              for s in range(num)]
    outs = llm.generate([PROMPT] * num, params)
    assert llm.engine.stats().spec.proposed >= num  # every request verified a draft
    return Counter(tuple(o.token_ids) for o in outs)


@torch.inference_mode()
def _engine_expected(lm) -> dict:
    """Exact P(t1, t2, t3) of top-3 sampling at temperature 1 from the target alone."""
    from qserve.runtime.attention import AttentionMetadata, DenseAttention

    def dist(ids):  # top-k renormalised next-token distribution after `ids`
        hidden = lm.model(torch.tensor(ids), torch.arange(len(ids)),
                          AttentionMetadata.single(len(ids)), _Bf16KV(DenseAttention()))
        logits = lm.model.compute_logits(hidden[-1:])[0]
        top = torch.topk(logits, TOP_K)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()))

    out = {}
    for a, pa in dist(PROMPT).items():
        for b, pb in dist(PROMPT + [a]).items():
            for c, pc in dist(PROMPT + [a, b]).items():
                out[(a, b, c)] = pa * pb * pc
    return out


class _Bf16KV:
    """K/V rounded to bf16, as the engine's bf16 pool stores them."""

    def __init__(self, inner):
        self.inner = inner

    def forward(self, spec, q, k, v, meta):
        k, v = (t.to(torch.bfloat16).to(t.dtype) for t in (k, v))
        return self.inner.forward(spec, q, k, v, meta)


@pytest.mark.parametrize("proposer", ["early_exit", "hidden_draft"])
def test_engine_speculative_sampling_matches_target(lm, specs, proposer):
    n = 1500
    got = _engine_samples(lm, n, specs[proposer])
    assert chi_square_pvalue(got, _engine_expected(lm), n) > ALPHA


@pytest.mark.parametrize("proposer", ["early_exit", "hidden_draft"])
def test_engine_check_catches_always_accept(lm, specs, monkeypatch, proposer):
    monkeypatch.setattr(rejection_sampler, "accept_mask", always_accept)
    n = 1500
    got = _engine_samples(lm, n, specs[proposer])
    assert chi_square_pvalue(got, _engine_expected(lm), n) < ALPHA
