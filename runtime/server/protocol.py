"""Request bodies of the OpenAI API (the fields qserve honours), validated by pydantic.

Types are strict: `"max_tokens": "5"` or `"stream": "yes"` is an error, not a guess.
Unknown fields are ignored, as OpenAI clients send fields this server does not use.
Range checks live here when they concern one field; `to_sampling_params` turns a request
into the engine's SamplingParams, whose own validation catches the rest.
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
    n: StrictInt = 1
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    repetition_penalty: Number | None = Field(None, gt=0)
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    user: StrictStr | None = None
    logit_bias: dict | None = None

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


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        # only an assistant turn may come without content (as OpenAI allows for one that
        # called tools); any other role without text would reach the model as nothing
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (a string, or a list of "
                             f"text parts); this one has none.")
        return self

    def to_template(self) -> dict:
        """The message as chat templates expect it: content as one string."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"content part type {part.type!r} is not supported "
                                     f"(only 'text').")
                texts.append(part.text)
            content = "".join(texts)
        msg = {"role": self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        return msg


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    tools: list | None = None


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
