"""No OpenAI request field is silently ignored: every field of the `openai` package's own
chat and completions request types is declared by the server's request models and is
either honoured or refused with a 400 that names it."""

import typing

import pytest

from conftest import assert_error, client_for, run
from qserve.runtime.server.openai_fields import (CHAT_HONOURED, CHAT_REFUSED,
                                                 COMPLETION_HONOURED, COMPLETION_REFUSED)
from qserve.runtime.server.protocol import ChatCompletionRequest, CompletionRequest


def _openai_fields(module) -> set[str]:
    return set(typing.get_type_hints(module.CompletionCreateParamsBase)) | {"stream"}


def test_every_openai_chat_field_is_declared_and_honoured_or_refused():
    from openai.types.chat import completion_create_params

    fields = _openai_fields(completion_create_params)
    assert fields - (CHAT_HONOURED | set(CHAT_REFUSED)) == set()
    assert fields - set(ChatCompletionRequest.model_fields) == set()
    assert not CHAT_HONOURED & set(CHAT_REFUSED)


def test_every_openai_completions_field_is_declared_and_honoured_or_refused():
    from openai.types import completion_create_params

    fields = _openai_fields(completion_create_params)
    assert fields - (COMPLETION_HONOURED | set(COMPLETION_REFUSED)) == set()
    assert fields - set(CompletionRequest.model_fields) == set()


# a value of each refused field that would change the answer
CHAT_VALUES = {"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
               "prediction": {"type": "content", "content": "x"},
               "web_search_options": {}, "functions": [{"name": "f"}],
               "function_call": "auto", "reasoning_effort": "high", "verbosity": "low",
               "store": True, "metadata": {"k": "v"}, "service_tier": "flex",
               "moderation": {"model": "m"}, "prompt_cache_options": {"mode": "x"},
               "prompt_cache_retention": "24h"}


@pytest.mark.parametrize("field", sorted(CHAT_REFUSED))
def test_each_refused_chat_field_is_a_400_naming_it(app, field):
    async def main():
        async with client_for(app) as c:
            return await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                field: CHAT_VALUES[field]})

    err = assert_error(run(main()), 400, field, "unsupported_parameter")
    assert field in err["message"]


def test_refused_fields_at_their_no_op_values_are_accepted(app):
    async def main():
        async with client_for(app) as c:
            return await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "modalities": ["text"], "store": False, "service_tier": "auto",
                "reasoning_effort": None, "prompt_cache_retention": "in_memory",
                "user": "u1", "safety_identifier": "s", "prompt_cache_key": "k"})

    assert run(main()).status_code == 200
