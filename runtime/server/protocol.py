"""Request bodies of the OpenAI API, validated by pydantic.

Types are strict: `"max_tokens": "5"` or `"stream": "yes"` is an error, not a guess.
Every field of OpenAI's own request schemas is declared: the ones qserve serves are
honoured, the others are refused with a 400 naming them when set (openai_fields.py keeps
that table). Fields no OpenAI schema has (other vendors' extensions) are ignored, except
vLLM's structured-output fields, which are honoured. Range checks live here when they
concern one field; `make_params` turns a request into the engine's SamplingParams, whose
own validation catches the rest.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from ..sampling_params import MAX_LOGPROBS

# limits on the size of one request (beyond the body size limit)
MAX_STOP = 16
MAX_MESSAGES = 1024

Number = Annotated[float, Field(allow_inf_nan=False)]  # ints accepted, not strings
MAX_INT32 = 2**31 - 1
TokenIds = list[Annotated[StrictInt, Field(ge=0, le=MAX_INT32)]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1, le=MAX_INT32)
    min_p: Number | None = Field(None, ge=0, le=1)
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**64 - 1)  # torch.Generator's range
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: TokenIds | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_INT32)
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    repetition_penalty: Number | None = Field(None, gt=0)
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    user: StrictStr | None = None
    # token id (as a string, JSON keys are strings) -> bias in [-100, 100]
    logit_bias: dict[str, Number] | None = None
    # structured outputs (server/constraints.py): OpenAI's response_format (chat, and
    # completions as vLLM takes it), and vLLM's fields for the same
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_decoding_backend: StrictStr | None = None
    guided_whitespace_pattern: StrictStr | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Common):
    # str | list[str] | list[int] | list[list[int]], checked by the route with a clearer
    # message than a four-way union error
    prompt: Any = Field(json_schema_extra={"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "string"}},
        {"type": "array", "items": {"type": "integer", "minimum": 0}},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0}}}]})
    max_tokens: StrictInt | None = Field(16, ge=0)
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: StrictStr
    arguments: StrictStr  # JSON text of the arguments object, as OpenAI sends it


class ToolCallMessage(BaseModel):
    """A call in an assistant message of the history."""
    model_config = ConfigDict(extra="ignore", strict=True)
    id: StrictStr
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCallMessage] | None = None  # assistant: the calls it made
    tool_call_id: StrictStr | None = None  # tool: the call this is the result of

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        # only an assistant turn may come without content (as OpenAI allows for one that
        # called tools); any other role without text would reach the model as nothing
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (a string, or a list of "
                             f"text parts); this one has none.")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"a {self.role} message cannot carry tool_calls; only "
                             f"assistant messages do.")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id: the id of the call it "
                             "answers.")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"content part type {part.type!r} is not supported "
                                     f"(only 'text').")
                texts.append(part.text)
            content = "".join(texts)
        return content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    # tool calling (runtime/tools): checked there, with messages naming the field
    tools: list | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool = True
    # OpenAI fields that change nothing this server produces differently, or that it
    # refuses when set (openai_fields.py)
    service_tier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    store: Any = None
    metadata: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    functions: Any = None
    function_call: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: StrictStr | None = None
    tokens: TokenIds


class PrefillRequest(BaseModel):
    """POST /v1/disagg/prefill (disagg_routes.py): the router asks a prefill worker to
    compute a prompt and ship its KV to the decode worker's receiver on `kv_port`."""
    model_config = ConfigDict(extra="ignore", strict=True)
    request_id: StrictStr = Field(min_length=1, max_length=256)
    kv_port: StrictInt = Field(ge=1, le=65535)
    kv_transport: Literal["socket", "mooncake"] = "socket"  # the receiver's
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    prompt: Any = None    # as /v1/completions takes it (one prompt)
    add_generation_prompt: StrictBool = True
    tools: list | None = None    # with messages: the prompt renders them as the chat does
    tool_choice: Any = None
