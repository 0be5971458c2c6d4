"""Benchmark: peak memory of `qserve quantize` grows with the largest block, not the model.

Builds random Llama checkpoints that differ only in depth (same block size), quantizes
each in a fresh process, and reports the peak resident memory of that process:

    python -m qserve.runtime.benchmark.quantize_memory [--hidden 1024] [--layers 4 16] [--out DIR]

The checkpoints are written one shard per block, so writing them is bounded too; the
artifact is written in 64 MiB shards, so finished tensors do not pile up in memory. The
tokenizer is the default model's (its vocabulary sets the embedding size).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_random_llama(root: Path, layers: int, hidden: int, tokenizer_dir: Path,
                       vocab: int, seed: int = 0) -> int:
    """A random bf16 Llama checkpoint, one safetensors shard per block. Returns bytes."""
    root.mkdir(parents=True)
    inter, heads = 4 * hidden, hidden // 64
    kv_heads = max(1, heads // 4)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(torch.bfloat16)

    weight_map, total = {}, 0
    shards = [{"model.embed_tokens.weight": rand(vocab, hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
               "lm_head.weight": rand(vocab, hidden)}]
    for i in range(layers):
        p = f"model.layers.{i}"
        shards.append({
            f"{p}.self_attn.q_proj.weight": rand(heads * 64, hidden),
            f"{p}.self_attn.k_proj.weight": rand(kv_heads * 64, hidden),
            f"{p}.self_attn.v_proj.weight": rand(kv_heads * 64, hidden),
            f"{p}.self_attn.o_proj.weight": rand(hidden, heads * 64),
            f"{p}.mlp.gate_proj.weight": rand(inter, hidden),
            f"{p}.mlp.up_proj.weight": rand(inter, hidden),
            f"{p}.mlp.down_proj.weight": rand(hidden, inter),
            f"{p}.input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            f"{p}.post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        })
    for n, tensors in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(root / name))
        weight_map.update({k: name for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    shards.clear()
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16"}))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tokenizer_dir / f).is_file():
            shutil.copyfile(tokenizer_dir / f, root / f)
    return total


class AnonPeak:
    """Samples this process's anonymous resident memory (RssAnon: heap and tensors, what
    quantizing really holds) every 20 ms; the peak RSS also counts file pages mapped from
    the checkpoint and artifact files, which the kernel can drop and reread."""

    def __init__(self) -> None:
        self.peak_kib: int | None = 0 if Path("/proc/self/status").is_file() else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        self.peak_kib = max(self.peak_kib, int(line.split()[1]))
            self._stop.wait(0.02)

    def __enter__(self) -> "AnonPeak":
        if self.peak_kib is not None:  # Linux only; elsewhere the column shows "-"
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def _child(src: str, out: str, samples: int, seq_len: int, threads: int) -> None:
    from ...quantize.pipeline import quantize
    from ...quantize.recipe import recipe_from_dict

    torch.set_num_threads(threads)
    recipe = recipe_from_dict({"calibration": {"num_samples": samples, "seq_len": seq_len}})
    t0 = time.perf_counter()
    with AnonPeak() as anon:
        quantize(src, out, recipe, shard_bytes=64 << 20)  # small shards: a bounded write buffer
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    anon_mib = None if anon.peak_kib is None else anon.peak_kib / 1024
    print(json.dumps({"peak_rss_mib": peak_mib, "peak_anon_mib": anon_mib,
                      "seconds": time.perf_counter() - t0}))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args.child[0], args.child[1], args.samples, args.seq_len, args.threads)

    from ..tokenizer import Tokenizer
    from ..formats.sources import DEFAULT_MODEL, resolve_source

    tok_dir = resolve_source(DEFAULT_MODEL).checkpoint_dir
    vocab = Tokenizer.from_dir(tok_dir).vocab_size
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layers in args.layers:
            src = Path(tmp) / f"llama-{layers}"
            size = write_random_llama(src, layers, args.hidden, tok_dir, vocab)
            out = subprocess.run(
                [sys.executable, "-m", "qserve.runtime.benchmark.quantize_memory", "--child", str(src),
                 str(Path(tmp) / f"art-{layers}"), "--samples", str(args.samples),
                 "--seq-len", str(args.seq_len), "--threads", str(args.threads)],
                check=True, capture_output=True, text=True)
            stats = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append((layers, size / 2**20, stats["peak_rss_mib"], stats["peak_anon_mib"],
                         stats["seconds"]))
            shutil.rmtree(src)
    print(f"hidden {args.hidden}, calibration {args.samples} x {args.seq_len} tokens, "
          f"{args.threads} threads")
    print(f"{'layers':>6} {'checkpoint MiB':>15} {'peak RSS MiB':>13} {'peak anon MiB':>14} "
          f"{'seconds':>8}")
    for layers, size, peak, anon, secs in rows:
        shown = "-" if anon is None else f"{anon:.0f}"
        print(f"{layers:>6} {size:>15.0f} {peak:>13.0f} {shown:>14} {secs:>8.1f}")


if __name__ == "__main__":
    main()
