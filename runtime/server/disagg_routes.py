"""The prefill and decode roles of `qserve serve` (prefill/decode disaggregation).

    qserve serve ARTIFACT --role prefill     POST /v1/disagg/prefill
    qserve serve ARTIFACT --role decode      a KV receiver; generation requests that carry
                                             `x-qserve-kv-request-id: ID` import that KV first
    every role                               GET /v1/disagg/info (the router reads it)

Prefill: the worker computes the prompt (one greedy token, whose KV is then complete for
the prompt), exports the prompt's KV (its full blocks from the prefix cache, and the
tail after them from the request's blocks, held until exported; runtime/disagg) and
sends them to the decode worker's receiver named in the request, keyed by the
request id; it answers with the sizes and times. Its prefix cache keeps the blocks, so a
prompt sharing a prefix with an earlier one is computed only from where they differ.

Decode: a generation request with the header waits (up to the KV timeout) for that
transfer, checks it against this engine (same artifact namespace, KV layout, FP8 scales,
block hashes that follow from the tokens: a mismatch is a 409 before any work), then
places it in three moves (runtime/disagg/kv_import.py): the engine thread reserves blocks
between two steps; a writer thread (on the KV receive cores when given) copies the bytes
into them while the engine steps on; the engine thread registers them in the prefix cache
right before adding the request with the tail, so the request computes only its last
prompt token. The decode steps of other requests pay for bookkeeping only, not for the
copy. If the pool has no room at that moment the request computes its prompt itself
(same tokens, logged).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request

from .. import telemetry
from .. import failpoints
from ..sampling_params import SamplingParams
from .body import parse_body
from .errors import ApiError, bad_request
from .generation import ServerState
from .protocol import PrefillRequest

log = logging.getLogger("qserve.server")

ROLES = ("both", "prefill", "decode")
KV_HEADER = "x-qserve-kv-request-id"


@dataclass
class DisaggRole:
    role: str = "both"
    receiver: object | None = None       # a KVConnector (decode role)
    kv_transport: str = "socket"         # the receiver's transport (runtime/disagg/connector.py)
    # how long a decode request waits for its KV (the engine keeps reserved import blocks
    # EngineConfig.kv_import_ttl_s, 4x this, before it gives them back)
    kv_timeout_s: float = 30.0
    receive_cores: frozenset[int] | None = None  # where received KV is copied (None: any)
    _writer: ThreadPoolExecutor | None = field(default=None, repr=False)

    def writer(self) -> ThreadPoolExecutor:
        """The one thread that copies received KV into the pool, pinned to receive_cores."""
        if self._writer is None:
            cores = self.receive_cores
            self._writer = ThreadPoolExecutor(
                1, thread_name_prefix="kv-import",
                initializer=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
        return self._writer


async def kv_before(state: ServerState, request: Request):
    """For a request that names a KV transfer: wait for it, check it, and return the
    `before(engine)` hook that places it; None for a plain request."""
    rid = request.headers.get(KV_HEADER)
    if not rid:
        return None
    role: DisaggRole = state.disagg
    if role.receiver is None:
        raise bad_request(f"this server is not a decode worker (--role {role.role}); send "
                          f"requests without the {KV_HEADER} header.", None, "not_decode_worker")
    from ..disagg import KVTransferError, NotEnoughKVBlocks

    try:
        transfer = await asyncio.to_thread(role.receiver.recv, rid, role.kv_timeout_s)
    except TimeoutError:
        raise ApiError(504, f"the KV transfer for request {rid!r} did not arrive within "
                            f"{role.kv_timeout_s:g} s.", code="kv_transfer_timeout",
                       type="server_error") from None
    except KVTransferError as e:
        raise ApiError(502, f"the KV transfer for request {rid!r} is damaged: {e}",
                       code="kv_transfer_damaged", type="server_error") from None
    if failpoints.active("decode-exit-on-kv"):
        failpoints.die("decode-exit-on-kv")
    engine = state.engine
    try:  # checked against the engine and blocks reserved, in its thread
        plan = await engine.call(lambda e: e.reserve_kv_import(transfer))
    except KVTransferError as e:
        raise ApiError(409, str(e), code="kv_mismatch") from None
    except NotEnoughKVBlocks as e:
        log.warning("request %s computes its prompt here: %s", rid, e)
        return None
    copy = asyncio.get_running_loop().run_in_executor(role.writer(), engine.write_kv_import,
                                                      plan)
    try:
        await asyncio.shield(copy)  # a cancelled request does not stop a running copy ...
    except BaseException:  # the client left, or the copy failed: give the blocks back,
        # ... so only once the copy is over (else it could write into blocks reused)
        copy.add_done_callback(lambda _: engine.post(lambda e: e.cancel_kv_import(plan)))
        raise

    def before(e):
        try:
            e.commit_kv_import(plan)
        except ValueError as err:  # expired before the request came
            log.warning("request %s computes its prompt here: %s", rid, err)
            return None
        return transfer.tail()  # the request computes only its last prompt token

    return before


def install_disagg_routes(app: FastAPI, state: ServerState) -> None:
    role: DisaggRole = state.disagg

    @app.get("/v1/disagg/info")
    async def info():  # the engine's layout and its last published stats only
        layout, stats = state.engine.layout, state.engine.stats()
        return {"role": role.role, "model": state.model_name, "namespace": layout.namespace,
                "block_size": layout.block_size, "kv_dtype": layout.kv_dtype,
                "total_kv_blocks": layout.num_blocks, "free_kv_blocks": stats.kv_blocks_free,
                "in_flight": state.metrics.in_flight,
                "kv_port": getattr(role.receiver, "port", None),
                "kv_transport": role.kv_transport if role.receiver is not None else None,
                "pending_kv_transfers": role.receiver.pending()
                if role.receiver is not None else 0,
                "held_kv_requests": stats.num_held,
                "staged_kv_imports": stats.num_staged_imports,
                "kv_receive_cores": sorted(role.receive_cores) if role.receive_cores else None,
                # {sequences: seconds} of its recent decode steps (runtime/step_times.py)
                "decode_step_s": {str(n): s for n, s in stats.decode_step_s.items()}}

    @app.post("/v1/disagg/prefill")
    async def prefill(request: Request):
        if role.role == "decode":
            raise bad_request("this server is a decode worker; prefill on a --role prefill "
                              "(or both) server.", None, "not_prefill_worker")
        from .chat import chat_prompt_ids, tool_request
        from .completions import completion_prompts

        req = await parse_body(request, state, PrefillRequest)
        rid, port = req.request_id, req.kv_port
        if req.messages is not None:
            ids = chat_prompt_ids(state, req.messages, req.add_generation_prompt,
                                  *tool_request(req.tools, req.tool_choice))
        elif req.prompt is not None:
            prompts = completion_prompts(state, req.prompt)
            if len(prompts) != 1:
                raise bad_request(f"one prompt per prefill, got {len(prompts)}.", "prompt")
            ids = prompts[0][1]
        else:
            raise bad_request("give messages (chat) or prompt (completions).", "messages")
        t0 = time.monotonic()
        span = telemetry.start_span("serve.disagg_prefill", {"qserve.request_id": rid},
                                    parent=telemetry.extract(request.headers), kind="server")
        try:
            return await _prefill_and_send(req, ids, rid, port, t0, span)
        finally:
            telemetry.end(span)

    async def _prefill_and_send(req, ids, rid, port, t0, span):
        from ..disagg import create_connector

        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        held = f"prefill-{rid}"
        cached = 0
        try:
            async for out in state.engine.generate(held, ids, params, hold_kv=True):
                cached = max(cached, out.num_cached_tokens)
            t1 = time.monotonic()
            transfer = await state.engine.call(lambda e: e.export_kv(held, ids))
        finally:  # the client left or the engine failed: free the held blocks anyway
            await state.engine.abort(held)

        def send() -> None:
            with create_connector(req.kv_transport, host="127.0.0.1", port=port,
                                  listen=False) as sender:
                sender.send(rid, transfer)

        try:
            await asyncio.to_thread(send)
        except (OSError, RuntimeError, ValueError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else e
            raise ApiError(502, f"cannot hand the KV to the decode worker's {req.kv_transport} "
                                f"receiver on port {port}: {why}.",
                           code="kv_receiver_unreachable", type="server_error") from None
        t2 = time.monotonic()
        telemetry.record_span("serve.prefill", t0, t1, {"qserve.prompt_tokens": len(ids),
                                                        "qserve.cached_tokens": cached}, span)
        telemetry.record_span("serve.kv_send", t1, t2, {"qserve.kv_bytes":
                                                        transfer.payload_nbytes}, span)
        return {"request_id": rid, "prompt_tokens": len(ids), "cached_tokens": cached,
                "num_blocks": transfer.num_blocks,
                "kv_tokens": transfer.num_tokens, "kv_bytes": transfer.payload_nbytes,
                "prefill_s": round(t1 - t0, 6), "transfer_s": round(t2 - t1, 6)}
