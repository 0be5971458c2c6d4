"""Gateway traces -> an eval prompts file, so that real traffic feeds the next gate.

    export_prompts("traces.jsonl", "prompts.jsonl", failed=True)
    qserve eval ARTIFACT --prompts prompts.jsonl

Each line written is {"id", "prompt"} (a completion request) or {"id", "messages"} (a chat
request, rendered with the artifact's chat template at eval time), plus where it came from
("model", "status", "error"). `qserve eval` runs them as agreement prompts: the artifact's
greedy continuation against its bf16 source's. Failed requests are the ones whose status
was not 200 or that ended with an error; a sample draws N of the successful ones. Traces
written in zero-retention mode hold no text and are skipped (and counted).
"""

from __future__ import annotations

import json
import random

from ..atomic_file import write_text_atomic
from ..formats.errors import QserveError


def _read(path: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise QserveError(f"{path}:{n} is not a JSON line; is this a gateway trace "
                                  f"log (trace.path in the gateway config)?") from None
            if not isinstance(row, dict) or "id" not in row or "status" not in row:
                raise QserveError(f"{path}:{n} is not a gateway trace record (it needs 'id' "
                                  f"and 'status').")
            rows.append(row)
    return rows


def _prompt_record(row: dict) -> dict | None:
    req = row.get("request") or {}
    base = {"id": f"trace-{row['id']}", "model": row.get("model"), "status": row.get("status"),
            "error": row.get("error")}
    messages = req.get("messages")
    if isinstance(messages, list) and messages:
        return {**base, "messages": messages}
    prompt = req.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return {**base, "prompt": prompt}
    return None


def export_prompts(traces: str, out: str, failed: bool = False, sample: int | None = None,
                   seed: int = 0) -> tuple[int, int]:
    """Write the prompts file; returns (prompts written, traces skipped for lack of text)."""
    rows = _read(traces)
    if failed:
        chosen = [r for r in rows if r.get("status") != 200 or r.get("error")]
    else:
        ok = [r for r in rows if r.get("status") == 200 and not r.get("error")]
        chosen = random.Random(seed).sample(ok, min(sample or 0, len(ok)))
    records, skipped, seen = [], 0, set()
    for r in chosen:
        rec = _prompt_record(r)
        if rec is None:
            skipped += 1
            continue
        text = json.dumps(rec.get("messages") or rec.get("prompt"), sort_keys=True)
        if text not in seen:    # one prompt once, however often it was sent
            seen.add(text)
            records.append(rec)
    write_text_atomic(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return len(records), skipped
