"""Tokenizer: text <-> token ids, and chat messages -> prompt text.

Reads `tokenizer.json` (HF `tokenizers`) and `tokenizer_config.json` from a checkpoint or
artifact directory. The chat template is rendered with a sandboxed Jinja environment set
up as transformers sets it up (trim_blocks, lstrip_blocks, `raise_exception`, `tojson`),
so prompts are byte-identical to what the model was trained with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from .formats.errors import CheckpointError, QserveError


class ChatTemplateError(QserveError):
    """The model has no chat template, or the template rejected the messages."""


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        return value.get("content")
    return value


@dataclass
class Tokenizer:
    hf: HFTokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos: bool = False
    eos_token_ids: tuple[int, ...] = ()
    special_ids: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def from_dir(cls, path: str | Path, generation_config: dict | None = None) -> "Tokenizer":
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise CheckpointError(f"{tok_file}: missing; qserve needs an HF tokenizer.json.")
        try:
            hf = HFTokenizer.from_file(str(tok_file))
        except Exception as e:
            raise CheckpointError(f"{tok_file}: not a valid tokenizer file ({e}).") from None
        cfg = {}
        cfg_file = root / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{cfg_file}: not valid JSON ({e}).") from None
        template = cfg.get("chat_template")
        if template is None and (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        bos = _token_text(cfg.get("bos_token"))
        eos = _token_text(cfg.get("eos_token"))
        eos_ids: list[int] = []
        gen_eos = (generation_config or {}).get("eos_token_id")
        for tid in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if isinstance(tid, int):
                eos_ids.append(tid)
        if eos is not None and hf.token_to_id(eos) is not None and hf.token_to_id(eos) not in eos_ids:
            eos_ids.append(hf.token_to_id(eos))
        special = {tok.content for tok in hf.get_added_tokens_decoder().values() if tok.special}
        special_ids = frozenset(hf.token_to_id(t) for t in special if hf.token_to_id(t) is not None)
        return cls(
            hf=hf,
            chat_template=template,
            bos_token=bos,
            eos_token=eos,
            add_bos=bool(cfg.get("add_bos_token", False)),
            eos_token_ids=tuple(eos_ids),
            special_ids=special_ids,
        )

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. `add_special_tokens` lets the post-processor add BOS."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Render chat messages to the prompt text the model expects. `tools`: OpenAI tool
        definitions, for a template that renders them (runtime/tools/prompt.py)."""
        if not self.chat_template:
            raise ChatTemplateError(
                "this model has no chat template; use completions (a plain prompt), or give "
                "the model a template in tokenizer_config.json."
            )
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ChatTemplateError(f"chat template: {message}")

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed to render: {e}") from None
