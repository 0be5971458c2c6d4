"""Offline batch generation: `LLM(model).generate(prompts, params)`.

    llm = LLM("artifacts/smollm2-fp8")
    for out in llm.generate(["The capital of France is"], SamplingParams(max_tokens=16)):
        print(out.text)

All prompts go through one engine loop (continuous batching), not one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator

import torch

from .engine import EngineConfig, LLMEngine
from .loaded_model import LoadedModel, load, resolve_dtype
from .sampler import TokenLogprobs
from .sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0


class LLM:
    """dtype: the compute dtype, a torch.dtype or its name as vLLM takes it ("bfloat16",
    "float32", "auto"); a LoadedModel keeps the dtype it was loaded with. device: where the
    engine computes ("auto", "cpu", "cuda", "cuda:N"; overrides config.device)."""

    def __init__(self, model: str | LoadedModel, dtype: str | torch.dtype = "auto",
                 config: EngineConfig | None = None, device: str | None = None) -> None:
        dtype = resolve_dtype(dtype)
        if device is not None:  # "auto" | "cpu" | "cuda" | "cuda:N" (EngineConfig.device)
            config = replace(config or EngineConfig(), device=device)
        self.lm = model if isinstance(model, LoadedModel) else load(model, dtype)
        self.engine = LLMEngine.from_model(self.lm, config)
        self._next_id = 0

    def _add(self, prompt: str | list[int], params: SamplingParams
             ) -> tuple[list[str], list[int]]:
        """Mutates the engine: adds the prompt (text is encoded) under fresh request ids,
        one per sample (n > 1: the samples fork from the first); returns (ids, prompt
        token ids)."""
        ids = prompt if isinstance(prompt, list) else self.lm.tokenizer.encode(prompt)
        rid = f"llm-{self._next_id}"
        self._next_id += 1
        rids = [rid] + [f"{rid}-{i}" for i in range(1, params.n)]
        for i, sample_id in enumerate(rids):
            self.engine.add_request(sample_id, ids, params.for_sample(i),
                                    fork_of=rid if i else None)
        return rids, ids

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None
               ) -> Iterator[CompletionOutput]:
        """One prompt, as the engine produces it: a CompletionOutput per engine step with
        that step's new text and tokens; the last has the finish reason. Closing the
        iterator early aborts the request."""
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"stream() follows one sample; got n={params.n}: use generate().")
        (rid,), ids = self._add(prompt, params)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id != rid:
                        continue
                    finished = out.finished
                    yield CompletionOutput(rid, list(ids), out.text, list(out.token_ids),
                                           out.finish_reason if finished else None,
                                           list(out.logprobs),
                                           num_cached_tokens=out.num_cached_tokens)
        finally:
            if not finished:
                self.engine.abort_request(rid)

    def generate(self, prompts: list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[CompletionOutput]:
        """One CompletionOutput per prompt and sample, in prompt order (a prompt with
        params.n > 1 gives n in a row, sample 0 first)."""
        if params is None:
            params = SamplingParams()
        per = params if isinstance(params, list) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per)} sampling params.")
        results: dict[str, CompletionOutput] = {}
        order = []
        for prompt, p in zip(prompts, per):
            rids, ids = self._add(prompt, p)
            for rid in rids:
                results[rid] = CompletionOutput(rid, list(ids))
                order.append(rid)
        pending = set(order)
        while pending:
            for out in self.engine.step():
                r = results[out.request_id]
                r.text += out.text
                r.token_ids += out.token_ids
                r.logprobs += out.logprobs
                r.num_cached_tokens = out.num_cached_tokens
                if out.prompt_logprobs is not None:
                    r.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    r.finish_reason = out.finish_reason
                    pending.discard(out.request_id)
        return [results[rid] for rid in order]
