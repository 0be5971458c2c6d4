"""Per-request sampling parameters, validated once when the request arrives.

Semantics follow vLLM / the OpenAI API. Invalid values raise ValueError saying which
field is wrong, what was given, and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from .structured.spec import GrammarSpec

# Below this temperature sampling is greedy (argmax), as in vLLM.
GREEDY_TEMPERATURE = 1e-5
# Most top-logprob alternatives a request may ask for (the OpenAI API allows 20).
MAX_LOGPROBS = 20
# logit_bias values, as the OpenAI API bounds them: -100 bans a token, 100 forces it
MAX_LOGIT_BIAS = 100.0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: until a stop, EOS, or the model's context ends
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0  # nucleus: smallest set of top tokens with mass >= top_p
    min_p: float = 0.0  # drop tokens with prob < min_p * (max prob)
    seed: int | None = None  # per-request generator; same seed => same tokens
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of
    #                                  tokens in the prompt or the output (CTRL style)
    stop: tuple[str, ...] = ()  # stop strings; never part of the returned text
    stop_token_ids: tuple[int, ...] = ()  # stop even with ignore_eos
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: chosen token + k alternatives
    prompt_logprobs: int | None = None  # same, for every prompt token after the first
    # with prompt_logprobs: score only prompt tokens at positions >= this (earlier entries
    # are None); the LM head then runs on those rows alone (scoring a short continuation
    # after a long context costs one vocabulary-wide row per continuation token)
    prompt_logprobs_from: int = 0
    n: int = 1  # samples of the prompt: the engine runs one prefill and forks the rest
    skip_special_tokens: bool = True
    # token id -> value added to its logit before anything else (OpenAI's logit_bias);
    # given as a dict or pairs, kept as sorted (id, bias) pairs
    logit_bias: tuple[tuple[int, float], ...] = ()
    # the grammar the output must follow (runtime/structured); None: unconstrained
    structured: GrammarSpec | None = None

    def __post_init__(self):
        # normalise containers (a bare string is one stop string, not its characters)
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = bias.items()
        try:
            bias = tuple(sorted((k, v) for k, v in (bias or ())))
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to numbers, got "
                             f"{self.logit_bias!r}.") from None
        object.__setattr__(self, "logit_bias", bias)
        self._validate()

    def _validate(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer or None, "
                             f"got {self.max_tokens!r}.")
        for name in ("temperature", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or value != value:
                raise ValueError(f"{name} must be a number, got {value!r}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}.")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be a positive integer, or 0 / -1 to disable it, "
                             f"got {self.top_k!r}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        if not 0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be > 0 (1 disables it), "
                             f"got {self.repetition_penalty}.")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}.")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must hold token ids (integers >= 0), got {t!r}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], "
                                 f"got {value!r}.")
        if not _is_int(self.prompt_logprobs_from) or self.prompt_logprobs_from < 0:
            raise ValueError(f"prompt_logprobs_from must be an integer >= 0, got "
                             f"{self.prompt_logprobs_from!r}.")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}.")
        for token, bias in self.logit_bias:
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got "
                                 f"{token!r}.")
            if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {bias!r} for token {token}.")
        if self.structured is not None and not isinstance(self.structured, GrammarSpec):
            raise ValueError(f"structured must be a GrammarSpec or None, got "
                             f"{type(self.structured).__name__}.")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}.")

    def for_sample(self, index: int) -> "SamplingParams":
        """The parameters of sample `index` of an n > 1 request: n = 1, and with a seed,
        seed + index (so sample 0 equals an n = 1 request with the same seed, and `seed`
        with `n` reproduces every sample)."""
        if not 0 <= index < self.n:
            raise ValueError(f"sample index {index} is outside [0, {self.n}).")
        seed = None if self.seed is None else self.seed + index
        if seed is not None and seed >= 2**64:  # past torch.Generator's range: wrap
            seed -= 2**64
        return replace(self, n=1, seed=seed)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
