"""Every field of OpenAI's chat and completions request bodies, and what qserve does with
it: each is honoured, or refused with a 400 that names it, whenever it is set to a value
that would change the answer. None is silently ignored (tests/server/test_openai_fields.py
checks this table against the `openai` package's own request types).

    refuse_unserved(req, CHAT_REFUSED)     # raises ApiError(400, param=<field>)
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from .errors import ApiError


class Refusal(NamedTuple):
    allowed: Callable[[Any, Any], bool]  # (value, request) -> True when it changes nothing
    message: str  # what is not served, and what to send instead


def _one_of(*values) -> Callable[[Any, Any], bool]:
    return lambda value, _req: any(value == v and type(value) is type(v) for v in values) \
        or value is None


CHAT_HONOURED = frozenset({
    "messages", "model", "stream", "stream_options", "temperature", "top_p", "n", "seed",
    "stop", "max_tokens", "max_completion_tokens", "frequency_penalty", "presence_penalty",
    "logit_bias", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice",
    "parallel_tool_calls",
    # identifiers and hints that change no token: accepted as they are
    "user", "safety_identifier", "prompt_cache_key",
})
CHAT_REFUSED = {
    "audio": Refusal(_one_of(None), "audio output is not supported: this server generates "
                     "text; remove 'audio'."),
    "modalities": Refusal(_one_of(None, ["text"]), "only the text modality is served; send "
                          "modalities [\"text\"] or leave it out."),
    "prediction": Refusal(_one_of(None), "predicted outputs are not supported; remove "
                          "'prediction'."),
    "web_search_options": Refusal(_one_of(None), "web search is not available; remove "
                                  "'web_search_options'."),
    "functions": Refusal(_one_of(None), "the deprecated 'functions' field is not served: "
                         "send the functions as 'tools' ({\"type\": \"function\", "
                         "\"function\": {...}})."),
    "function_call": Refusal(_one_of(None), "the deprecated 'function_call' field is not "
                             "served: send 'tool_choice' instead."),
    "reasoning_effort": Refusal(_one_of(None, "none"), "this model has no reasoning mode; "
                                "leave 'reasoning_effort' out."),
    "verbosity": Refusal(_one_of(None, "medium"), "'verbosity' is not served; leave it out "
                         "(or 'medium')."),
    "store": Refusal(_one_of(None, False), "stored completions are not supported; leave "
                     "'store' out or false."),
    "metadata": Refusal(_one_of(None, {}), "'metadata' is kept only with stored "
                        "completions, which are not supported; leave it out."),
    "service_tier": Refusal(_one_of(None, "auto", "default"), "this server has one service "
                            "tier; send 'auto' or 'default', or leave 'service_tier' out."),
    "moderation": Refusal(_one_of(None), "moderation is not available here; remove "
                          "'moderation' (the gateway's guardrails screen requests)."),
    "prompt_cache_options": Refusal(_one_of(None), "'prompt_cache_options' is not served: "
                                    "prompts are cached automatically; remove it."),
    "prompt_cache_retention": Refusal(_one_of(None, "in_memory"), "cached prompts live in "
                                      "memory only; send 'in_memory' or leave "
                                      "'prompt_cache_retention' out."),
}

COMPLETION_HONOURED = frozenset({
    "prompt", "model", "stream", "stream_options", "temperature", "top_p", "n", "seed",
    "stop", "max_tokens", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs",
    "echo", "user",
})
COMPLETION_REFUSED = {
    "best_of": Refusal(lambda value, req: value is None or value == req.n,
                       "best_of (more samples than returned, ranked) is not served; send "
                       "best_of equal to n, or leave it out."),
    "suffix": Refusal(_one_of(None, ""), "suffix (insertion) is not served; remove it."),
}

# vLLM's extensions for structured outputs that change how they are enforced
VLLM_REFUSED = {
    "guided_decoding_backend": Refusal(_one_of(None, "auto", "xgrammar"),
                                       "this server's grammar engine is xgrammar; send "
                                       "'xgrammar' or 'auto', or leave it out."),
    "guided_whitespace_pattern": Refusal(_one_of(None), "a custom whitespace pattern is not "
                                         "served (JSON is written with fixed separators); "
                                         "remove 'guided_whitespace_pattern'."),
}


def refuse_unserved(req, refused: dict[str, Refusal]) -> None:
    """Raise a 400 naming the first field of `refused` that `req` sets to a value that is
    not a no-op."""
    for name, rule in refused.items():
        value = getattr(req, name, None)
        if not rule.allowed(value, req):
            raise ApiError(400, f"{name}: {rule.message}", param=name,
                           code="unsupported_parameter")
