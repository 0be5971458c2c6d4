"""Compiles GrammarSpecs into grammars the matcher runs, once per distinct spec.

    compiler = GrammarCompiler(tokenizer, vocab_size=model_vocab)   # logits' width
    compiled = compiler.compile(spec)            # blocking; cached by spec.digest
    compiled = await compiler.compile_async(spec)  # in the compile thread, off the loop

The backend is xgrammar: its compiled grammar precomputes, per grammar state, which
tokens are allowed, so filling a step's mask costs microseconds. Its tokenizer tables are
built on first use (a fraction of a second for a 150k vocabulary), in whichever thread
compiles first. Compilation runs under a lock per spec: concurrent requests with the same
new schema compile it once. The cache is an LRU of `max_entries` compiled grammars.

Thread-safety: `compile` may be called from any thread; the engine loop calls it only for
specs the server compiled before admitting the request (a cache hit), or from offline use.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .spec import GrammarError, GrammarSpec

log = logging.getLogger("qserve.structured")


@dataclass(frozen=True)
class CompiledGrammar:
    spec: GrammarSpec
    grammar: object  # xgrammar.CompiledGrammar
    vocab_size: int  # the logits' width the masks cover


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...] | None = None,
                 max_entries: int = 256, threads: int = 1) -> None:
        """tokenizer: runtime.tokenizer.Tokenizer; vocab_size: the width of the model's
        logits (>= the tokenizer's vocabulary; ids past it are never allowed);
        stop_token_ids: what ends a finished grammar (default: the tokenizer's EOS ids)."""
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's "
                             f"{tokenizer.vocab_size} tokens.")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids if stop_token_ids is not None
                                    else tokenizer.eos_token_ids)
        self.max_entries = max_entries
        self.threads = threads
        self._backend = None
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.hits = 0
        self.misses = 0

    # -- public ---------------------------------------------------------------------------
    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar of `spec` (from the cache when it was compiled before).
        Raises GrammarError for a spec the engine cannot compile."""
        key = spec.digest
        hit = self._lookup(key)
        if hit is not None:
            return hit
        with self._cache_lock:
            lock = self._key_locks.setdefault(key, threading.Lock())
        with lock:
            hit = self._lookup(key)  # compiled by another thread while this one waited
            if hit is not None:
                return hit
            try:
                compiled = CompiledGrammar(spec, self._compile(spec), self.vocab_size)
            except BaseException:  # a spec that failed leaves no lock behind (new bad specs
                with self._cache_lock:  # keep coming)
                    self._key_locks.pop(key, None)
                raise
            with self._cache_lock:  # cached before its lock goes: no second compile of it
                self.misses += 1
                self._cache[key] = compiled
                while len(self._cache) > self.max_entries:
                    self._cache.popitem(last=False)
                self._key_locks.pop(key, None)
            return compiled

    async def compile_async(self, spec: GrammarSpec) -> CompiledGrammar:
        """`compile` in this compiler's own thread, so neither the event loop nor the
        engine loop waits for it; a cache hit returns at once."""
        hit = self._lookup(spec.digest)
        if hit is not None:
            return hit
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="qserve-grammar")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.compile, spec)

    def warm_up(self) -> None:
        """Build the tokenizer tables and import the schema validator now (otherwise the
        first structured request does both: ~1.4 s each here, holding the interpreter, so
        every stream would wait for them)."""
        from .spec import check_schema

        check_schema({"type": "object"})
        self._xgr()

    # -- internals ------------------------------------------------------------------------
    def _lookup(self, key: str) -> CompiledGrammar | None:
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
            return hit

    def _xgr(self):
        """(xgrammar module, its GrammarCompiler over this tokenizer), built once."""
        with self._backend_lock:
            if self._backend is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                t0 = time.perf_counter()
                hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.hf)
                info = xgr.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_token_ids))
                compiler = xgr.GrammarCompiler(info, max_threads=self.threads,
                                               cache_enabled=False)
                self._backend = (xgr, compiler)
                log.info("grammar tables for %d tokens built in %.2f s", self.vocab_size,
                         time.perf_counter() - t0)
            return self._backend

    def _compile(self, spec: GrammarSpec):
        xgr, compiler = self._xgr()
        try:
            grammar = _grammar(xgr, spec)
            return compiler.compile_grammar(_strict_json_strings(str(grammar)))
        except GrammarError:
            raise
        except Exception as e:  # the backend's parse errors: RuntimeError, ValueError, ...
            raise GrammarError(f"the {_WHAT[spec.kind]} does not compile: "
                               f"{_first_line(e)}") from None


def _grammar(xgr, spec: GrammarSpec):
    """The spec as an xgrammar Grammar (not yet compiled against the vocabulary)."""
    if spec.kind in ("json_schema", "json_object"):
        # fixed separators (", " and ": "): a small model left free to add whitespace
        # can fill max_tokens with it
        schema = json.dumps(strict_formats(spec.loads()), ensure_ascii=False)
        return xgr.Grammar.from_json_schema(schema, any_whitespace=False,
                                            strict_mode=spec.strict)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.source)
    if spec.kind == "choice":
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(
            json.dumps(c, ensure_ascii=False) for c in spec.loads()))
    if spec.kind == "grammar":
        if re.search(r"^\s*root\s*::=", spec.source, re.MULTILINE):
            return xgr.Grammar.from_ebnf(spec.source)
        return xgr.Grammar.from_lark(spec.source)
    if spec.kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(spec.source)
    raise GrammarError(f"unknown constraint kind {spec.kind!r}.")


# String formats whose built-in grammar lets invalid values through (any month's day 31,
# 2024-02-30, an IPv4 octet with a leading zero), written as patterns that admit only
# valid ones (dates never on 29 February: a leap year needs more than a regular language
# should carry; fractions of a second to milliseconds). A format with its own pattern
# beside it is left to that pattern. The fraction is spelled digit by digit: the engine
# mis-reads a JSON-string pattern whose optional group ends in a counted or `+` repeat,
# `(\.[0-9]+)?` accepting digits without the dot (docs/structured-outputs.md).
_DAY = ("((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
        "|02-(0[1-9]|1[0-9]|2[0-8]))")
_TIME = ("([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]([.][0-9][0-9]?[0-9]?)?"
         "(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])")
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
FORMAT_PATTERNS = {
    "date": f"^[0-9]{{4}}-{_DAY}$",
    "time": f"^{_TIME}$",
    "date-time": f"^[0-9]{{4}}-{_DAY}T{_TIME}$",
    "ipv4": f"^({_OCTET}[.]){{3}}{_OCTET}$",
}


def strict_formats(node):
    """A copy of a schema with each format of FORMAT_PATTERNS (without a pattern of its
    own) replaced by its pattern."""
    if isinstance(node, list):
        return [strict_formats(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict_formats(v) for k, v in node.items()}
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt in FORMAT_PATTERNS and "pattern" not in node \
            and node.get("type", "string") == "string":
        del out["format"]
        out["pattern"] = FORMAT_PATTERNS[fmt]
    return out


# The character class xgrammar writes for the characters of a length-bounded JSON string
# lets raw control characters through (U+0000..U+001F, which JSON requires escaped), so a
# model could write a string no JSON parser reads; its unbounded strings exclude them.
_LOOSE_JSON_CHAR = '[^\\"\\\\\\r\\n]'
_STRICT_JSON_CHAR = '[^\\0-\\x1f\\"\\\\\\r\\n]'


def _strict_json_strings(ebnf: str) -> str:
    """The grammar's text with every JSON string character class excluding control
    characters (tests/runtime/test_structured.py checks both sides of this)."""
    return ebnf.replace(_LOOSE_JSON_CHAR, _STRICT_JSON_CHAR)


_WHAT = {"json_schema": "JSON schema", "json_object": "JSON object constraint",
         "regex": "regex", "choice": "choice list", "grammar": "grammar",
         "structural_tag": "structural tag"}


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:500]
