"""lm-eval model `qserve`: runs an artifact (or a source model) in-process through the engine.

    lm_eval --model qserve --model_args model=ARTIFACT,batch_size=256 --tasks ...

Every request of a call goes into one continuous-batching engine at once:
- loglikelihood: context + continuation as one prompt with prompt logprobs (top-1 for the
  greedy check), one generated token that is discarded;
- loglikelihood_rolling: lm-eval's disjoint rolling windows of `max_length` tokens, each
  scored as above;
- generate_until: greedy (or sampled, if the task asks) with the task's stop strings.
Tokenization mirrors lm-eval's `local-completions` client (BOS prepended when the model's
tokenizer adds one), so in-process and endpoint evaluations see the same tokens.
"""

from __future__ import annotations

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from ..runtime.engine import EngineConfig
from ..runtime.llm import LLM
from ..runtime.loaded_model import LoadedModel, load
from ..runtime.sampling_params import SamplingParams

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Sequences in flight at once: short generation items run faster than with 64 (fewer
# steps, each weight read serves more rows); scoring is bounded by the token budget anyway.
DEFAULT_BATCH = 256


def rolling_window_tokens(context_limit: int, requested: int | None = None) -> int:
    """Tokens per rolling perplexity window (lm-eval's `max_length` of this adapter).

    Each window is scored after one token of context, so a window of N tokens needs N + 1
    positions. lm-eval's API clients (local-completions) make windows of `max_length - 1`
    tokens, so the endpoint mode passes this value + 1 to score the very same windows.
    """
    return min(int(requested or 2048), context_limit - 1)


@register_model("qserve")
class QserveLM(TemplateLM):
    def __init__(self, model: str | LoadedModel | None = None, pretrained: str | None = None,
                 dtype: str = "bfloat16", max_length: int | None = None,
                 batch_size: int | str = DEFAULT_BATCH, kv_dtype: str | None = None,
                 max_num_batched_tokens: int = 2048, device: str = "auto",
                 **kwargs) -> None:
        super().__init__()
        spec = model or pretrained
        if spec is None:
            raise ValueError("model_args needs model=ARTIFACT (or a built-in model name).")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
        lm = spec if isinstance(spec, LoadedModel) else load(str(spec), DTYPES[dtype])
        self.lm = lm
        self.tok = lm.tokenizer
        limit = int(lm.checkpoint.config.get("max_position_embeddings", 2048))
        self._max_length = rolling_window_tokens(limit, max_length)
        batch = DEFAULT_BATCH if str(batch_size).startswith("auto") else int(batch_size)
        self.llm = LLM(lm, config=EngineConfig(kv_dtype=kv_dtype, max_num_seqs=batch,
                                               max_num_batched_tokens=max_num_batched_tokens,
                                               device=device))
        bos = self.tok.hf.token_to_id(self.tok.bos_token) if self.tok.bos_token else None
        self.bos_id = bos
        self.add_bos = bos is not None and self.tok.encode("a")[:1] == [bos]

    # -- tokens -------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_token_ids[0]

    @property
    def prefix_token_id(self) -> int:
        return self.bos_id if self.bos_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string, add_special_tokens=bool(add_special_tokens) or self.add_bos)

    def tok_decode(self, tokens: list[int], **kwargs) -> str:
        return self.tok.decode(tokens)

    # -- scoring ------------------------------------------------------------------------
    def _score(self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool = True
               ) -> list[tuple[float, bool]]:
        """(context ids, continuation ids) -> (sum of continuation logprobs, greedy?)."""
        prompts, params, lengths = [], [], []
        for ctx, cont in pairs:
            if not cont:
                raise ValueError("a loglikelihood request with an empty continuation.")
            ids = (ctx + cont)[-(self.max_length + 1):]
            if len(ids) <= len(cont):  # keep at least one token of context
                raise ValueError(f"a continuation of {len(cont)} tokens does not fit the "
                                 f"model's {self.max_length}-token context.")
            prompts.append(ids)
            lengths.append(len(cont))
            # only the continuation's rows go through the LM head
            params.append(SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1,
                                         prompt_logprobs_from=len(ids) - len(cont)))
        outs = self.llm.generate(prompts, params)
        results = []
        for out, n in zip(outs, lengths):
            tail = out.prompt_logprobs[-n:]
            ll = sum(t.logprob for t in tail)
            greedy = all(t.top and t.top[0][0] == t.token_id for t in tail)
            results.append((ll, greedy))
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        return self._score([(ctx, cont) for _, ctx, cont in requests], disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, req in enumerate(tqdm(requests, disable=disable_tqdm, desc="rolling windows")):
            (text,) = req.args
            tokens = self.tok_encode(text, add_special_tokens=False)
            if self.add_bos and tokens[:1] == [self.bos_id]:
                tokens = tokens[1:]  # the prefix token plays BOS's part
            for w in get_rolling_token_windows(token_list=tokens, prefix_token=self.prefix_token_id,
                                               max_seq_len=self.max_length, context_len=1):
                windows.append(make_disjoint_window(w))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, self._score(windows)):
            totals[i] += ll
        return totals

    # -- generation ---------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return self._generate([req.args for req in requests])

    def greedy(self, contexts: list[str], max_tokens: int) -> list[str]:
        """Greedy continuations of up to `max_tokens` tokens (stopping at EOS)."""
        return self._generate([(c, {"until": [], "max_gen_toks": max_tokens}) for c in contexts])

    def _generate(self, args: list[tuple[str, dict]]) -> list[str]:
        """Requests with the same generation settings run as one batch, apart from the
        others: batch composition changes bf16 rounding, so a task's outputs (e.g. the
        agreement prompts) are produced the same way whichever tasks run beside them."""
        groups: dict[str, list[int]] = {}
        for i, (_, kw) in enumerate(args):
            groups.setdefault(repr(sorted(kw.items())), []).append(i)
        out: list[str] = [""] * len(args)
        for idx in groups.values():
            for i, text in zip(idx, self._generate_batch([args[i] for i in idx])):
                out[i] = text
        return out

    def _generate_batch(self, args: list[tuple[str, dict]]) -> list[str]:
        prompts, params = [], []
        for context, kw in args:
            kw = dict(kw)
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.pop("max_gen_toks", 256))
            temperature = float(kw.pop("temperature", 0.0)) if kw.pop("do_sample", False) else 0.0
            ids = self.tok_encode(context)[-(self.max_length - max_new):]
            prompts.append(ids)
            params.append(SamplingParams(max_tokens=max_new, temperature=temperature,
                                         stop=tuple(until)))
        return [o.text for o in self.llm.generate(prompts, params)]
