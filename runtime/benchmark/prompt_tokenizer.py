"""The tokenizer that sizes benchmark prompts: the server's own, or a local copy of it.

Prompt lengths must be true token counts for the server under test. The server's
`/tokenize` and `/detokenize` endpoints are the authority; the request body below is
understood both by vLLM-shaped servers (qserve, vLLM: `prompt`, `add_special_tokens`)
and by llama.cpp's server (`content`, `add_special`). Where a server has no such
endpoint, a local tokenizer of the same model (`qserve.runtime.tokenizer`) is used.
"""

from __future__ import annotations

from typing import Protocol

import httpx

from .errors import BenchmarkError


class PromptTokenizer(Protocol):
    name: str  # where the token counts come from, for the report

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without special tokens (no BOS)."""

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`."""


class ServerTokenizer:
    """Tokenizes through the server's /tokenize and /detokenize (loopback HTTP)."""

    def __init__(self, base_url: str, model: str | None, timeout: float = 30.0) -> None:
        self.base = base_url.rstrip("/")
        self.model = model
        self.name = f"server {self.base}/tokenize"
        self.client = httpx.Client(timeout=timeout)

    def _post(self, path: str, body: dict) -> dict:
        if self.model:
            body["model"] = self.model
        try:
            r = self.client.post(self.base + path, json=body)
        except httpx.HTTPError as e:
            raise BenchmarkError(f"cannot reach {self.base}{path}: {e}") from None
        if r.status_code != 200:
            raise BenchmarkError(f"{self.base}{path} answered {r.status_code}: {r.text[:200]}")
        return r.json()

    def encode(self, text: str) -> list[int]:
        data = self._post("/tokenize", {"prompt": text, "content": text,
                                        "add_special_tokens": False, "add_special": False})
        tokens = data.get("tokens")
        if not isinstance(tokens, list):
            raise BenchmarkError(f"{self.base}/tokenize gave no token list: {str(data)[:200]}")
        return [t if isinstance(t, int) else t["id"] for t in tokens]

    def decode(self, ids: list[int]) -> str:
        data = self._post("/detokenize", {"tokens": list(ids)})
        text = data.get("prompt", data.get("content"))
        if not isinstance(text, str):
            raise BenchmarkError(f"{self.base}/detokenize gave no text: {str(data)[:200]}")
        return text

    @staticmethod
    def available(base_url: str, timeout: float = 10.0) -> bool:
        """True if the server tokenizes (probed with one short request)."""
        try:
            r = httpx.post(base_url.rstrip("/") + "/tokenize", timeout=timeout,
                           json={"prompt": "hi", "content": "hi"})
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and isinstance(r.json().get("tokens"), list)


class LocalTokenizer:
    """The model's tokenizer loaded in this process (a built-in name, a checkpoint or
    artifact directory, or a .gguf file)."""

    def __init__(self, spec: str) -> None:
        from pathlib import Path

        from qserve.runtime.formats.errors import QserveError
        from qserve.runtime.tokenizer import Tokenizer

        try:
            path = Path(spec)
            if not path.is_dir():
                from qserve.runtime.formats.sources import resolve_source

                path = resolve_source(spec).checkpoint_dir
            self.tok = Tokenizer.from_dir(path)
        except QserveError as e:
            raise BenchmarkError(f"--tokenizer {spec}: {e}") from None
        self.name = f"local tokenizer of {spec}"

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)


def open_tokenizer(base_url: str, model: str | None, local: str | None) -> PromptTokenizer:
    """The server's tokenizer if it has one, else the local one named by `local`."""
    if local is not None:
        return LocalTokenizer(local)
    if ServerTokenizer.available(base_url):
        return ServerTokenizer(base_url, model)
    raise BenchmarkError(
        f"{base_url} has no /tokenize endpoint (or is not reachable); pass --tokenizer "
        "MODEL (a built-in name or a checkpoint directory) to size prompts locally")
