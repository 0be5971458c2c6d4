"""What a prefill/decode hand-off costs for one prompt: KV bytes, bytes per token, and the
time of each stage, in one process (runtime/disagg: the path a `--role prefill` worker and a
`--role decode` worker take, without HTTP and scheduling around it).

    python -m qserve.runtime.benchmark.kv_handoff ARTIFACT [ARTIFACT ...] \\
        --prompt-len 1024 --reps 10 --transport socket --threads 2

Per artifact: one engine prefills a prompt of held-out text (max_tokens=1, its blocks
held; the median of 3 from an empty prefix cache, after 2 warm-ups), exports it
(`export_request`: the full blocks and the tail), sends it through the named transport to
a receiver in this process (`to_bytes`, the send, the receiver's `from_bytes` with its
CRC-32 check) and imports it into a second engine over the same weights
(`import_prefix`). Printed: the frame's bytes, bytes per token and per layer, the
prefill time, and the median of `--reps` repetitions (after 2 warm-ups) of export, send
plus receive, and import, each also as a share of the prefill. The import is also split
as a decode worker runs it: what its engine thread spends between steps (reserving and
registering the blocks) and the copy its writer thread makes beside the steps. An MLA
artifact's latent cache travels once per token and layer (K = V), a GQA one's K and V.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from ..formats.errors import CheckpointError


def _prompt_ids(lm, n: int) -> list[int]:
    """The first n tokens of the held-out text (evals/golden), the model's tokenizer."""
    from ...evals.golden_text import heldout_token_ids

    ids = heldout_token_ids(lm.tokenizer)
    if len(ids) < n:
        raise SystemExit(f"--prompt-len {n}: the held-out text has only {len(ids)} tokens "
                         f"for this tokenizer; give a shorter length.")
    return ids[:n]


PREFILL_REPS = 3  # timed prefills (after 2 warm-ups), each from an empty prefix cache


def _median_ms(fn, reps: int) -> tuple[float, object]:
    out, times = None, []
    for i in range(reps + 2):  # 2 warm-ups
        t0 = time.perf_counter()
        out = fn()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def measure(path: str, prompt_len: int, reps: int, transport: str) -> dict:
    import torch

    from ..disagg import StagedImports, create_connector, export_request, write_import
    from ..engine import EngineConfig, LLMEngine
    from ..loaded_model import load
    from ..sampling_params import SamplingParams

    lm = load(path, torch.bfloat16)
    ids = _prompt_ids(lm, prompt_len)
    blocks = 2 * (prompt_len // 16 + 2)
    config = EngineConfig(num_kv_blocks=blocks, max_num_batched_tokens=512)
    prefill, decode = (LLMEngine.from_model(lm, config) for _ in range(2))
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def prefill_once():  # the prompt from scratch each time, its blocks held after it
        prefill.release_kv("p")
        prefill.blocks.reset_prefix_cache()
        prefill.add_request("p", ids, one, hold_kv=True)
        while prefill.has_unfinished:
            prefill.step()

    prefill_ms, _ = _median_ms(prefill_once, PREFILL_REPS)

    export_ms, transfer = _median_ms(lambda: export_request(prefill, "p", ids), reps)
    prefill.release_kv("p")
    frame = transfer.to_bytes()

    with create_connector(transport, host="127.0.0.1", port=0, listen=True) as receiver, \
            create_connector(transport, host="127.0.0.1", port=receiver.port,
                             listen=False) as sender:
        counter = iter(range(10**9))

        def send_recv():
            rid = f"r{next(counter)}"
            sender.send(rid, transfer)
            return receiver.recv(rid, timeout=60)

        wire_ms, got = _median_ms(send_recv, reps)

    imports, split = StagedImports(), []  # split: (engine thread ms, copy ms) per call

    def import_once():
        decode.blocks.reset_prefix_cache()  # each repetition imports every block again
        t0 = time.perf_counter()
        plan = imports.reserve(decode, got)
        t1 = time.perf_counter()
        write_import(decode.kv_cache, plan)
        t2 = time.perf_counter()
        result = imports.commit(decode, plan)
        split.append(((t1 - t0 + time.perf_counter() - t2) * 1e3, (t2 - t1) * 1e3))
        return result

    import_ms, result = _median_ms(import_once, reps)
    engine_ms = statistics.median(e for e, _ in split[2:])
    copy_ms = statistics.median(c for _, c in split[2:])
    lay = transfer.layout
    return {"artifact": path, "kv_dtype": lay.kv_dtype, "latent": lay.values_in_keys,
            "prompt_tokens": len(ids), "kv_tokens": transfer.num_tokens,
            "frame_bytes": len(frame), "payload_bytes": transfer.payload_nbytes,
            "bytes_per_token": transfer.payload_nbytes / transfer.num_tokens,
            "bytes_per_token_layer": transfer.payload_nbytes / transfer.num_tokens
            / lay.num_layers,
            "blocks_imported": result.num_written,
            "prefill_ms": round(prefill_ms, 1), "export_ms": round(export_ms, 2),
            "send_recv_ms": round(wire_ms, 2), "import_ms": round(import_ms, 2),
            "import_engine_thread_ms": round(engine_ms, 2), "import_copy_ms": round(copy_ms, 2),
            "transport": transport, "reps": reps}


def _print(r: dict) -> None:
    kind = "latent (K = V)" if r["latent"] else "K and V"
    share = lambda ms: f"{ms:.2f} ms ({100 * ms / r['prefill_ms']:.1f}% of prefill)"  # noqa: E731
    print(f"{r['artifact']}: {r['kv_dtype']} KV, {kind}")
    print(f"  prompt {r['prompt_tokens']} tokens, KV of {r['kv_tokens']} travels: "
          f"{r['payload_bytes']:,} bytes ({r['bytes_per_token']:,.0f} per token, "
          f"{r['bytes_per_token_layer']:,.0f} per token and layer); frame "
          f"{r['frame_bytes']:,} bytes")
    print(f"  prefill {r['prefill_ms']:.1f} ms; export {share(r['export_ms'])}, "
          f"{r['transport']} send + receive {share(r['send_recv_ms'])}, import "
          f"{share(r['import_ms'])}; median of {r['reps']}")
    print(f"  import as a decode worker splits it: engine thread "
          f"{r['import_engine_thread_ms']:.2f} ms (reserve, register), writer thread "
          f"{r['import_copy_ms']:.2f} ms (copy)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qserve.runtime.benchmark.kv_handoff",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("artifacts", nargs="+", metavar="ARTIFACT")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--transport", default="socket")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the results")
    args = ap.parse_args(argv)
    if args.prompt_len < 2 or args.reps < 1:
        raise SystemExit("--prompt-len must be >= 2 and --reps >= 1.")
    import torch

    from ..disagg.connector import available_transports

    if args.transport not in available_transports():
        raise SystemExit(f"--transport {args.transport}: not available here; choose one "
                         f"of {', '.join(available_transports())}.")
    torch.set_num_threads(args.threads)
    results = []
    for path in args.artifacts:
        try:
            results.append(measure(path, args.prompt_len, args.reps, args.transport))
        except CheckpointError as e:  # a path that is no artifact: the message, no traceback
            raise SystemExit(f"kv_handoff: {e}") from None
        _print(results[-1])
    if args.json:
        from ..atomic_file import write_json_atomic

        write_json_atomic(args.json, {"command": " ".join(sys.argv), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
