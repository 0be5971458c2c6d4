"""What `qserve router` knows about its workers, and keeps current.

    state = RouterState(prefill_urls, decode_urls, RouterOptions(...))
    await state.start()        # read every worker's /v1/disagg/info; check they match
    state.poll_task()          # re-read it every second: free KV blocks, health, rejoin

Workers must serve the same artifact with the same KV layout (the KV a prefill worker
ships is only valid there): the first reachable worker sets the namespace, block size and
KV dtype, and a worker that differs is refused (logged, never routed to). A worker that
does not answer is marked unhealthy and rejoins when it answers again (a restarted worker
comes back by itself).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

from ..http_client import HttpClient
from ..upstream_client import UpstreamFailure, fetch
from .admission import AdmissionCounters, SloConfig
from .prefix_tree import ApproxPrefixTree
from .selection import LocalPrefillPolicy, SelectionPolicy
from .worker_state import Ewma, WorkerState

log = logging.getLogger("qserve.router")
POLL_S = 1.0
CHARS_PER_TOKEN = 4        # prompt size estimate before any prompt's tokens were reported
CONNECT_S = 2.0            # s to open a connection to a worker


@dataclass(frozen=True)
class RouterOptions:
    policy: SelectionPolicy = field(default_factory=SelectionPolicy)
    slo: SloConfig = field(default_factory=SloConfig)
    local_prefill: LocalPrefillPolicy = field(default_factory=LocalPrefillPolicy)
    max_attempts: int = 2            # prefill (and decode) workers tried per request
    prefill_timeout_s: float = 120.0
    decode_first_token_s: float = 120.0


def _step_table(reported) -> dict[int, float]:
    """A worker's {"sequences": seconds} as {int: float}; entries that are not a positive
    count and a positive finite time are dropped (an older or odd worker: no table)."""
    table = {}
    if isinstance(reported, dict):
        for k, v in reported.items():
            try:
                n, s = int(k), float(v)
            except (TypeError, ValueError):
                continue
            if n >= 1 and math.isfinite(s) and s > 0:
                table[n] = s
    return table


class RouterState:
    def __init__(self, prefill: list[str], decode: list[str],
                 options: RouterOptions | None = None) -> None:
        self.options = options or RouterOptions()
        self.prefill = [WorkerState(u.rstrip("/"), "prefill") for u in prefill]
        self.decode = [WorkerState(u.rstrip("/"), "decode") for u in decode]
        self.tree = ApproxPrefixTree()
        self.counters = AdmissionCounters()
        self.layout: dict | None = None          # namespace, block_size, kv_dtype
        self.kv_ports: dict[str, int] = {}       # decode worker -> its KV receiver port
        self.kv_transports: dict[str, str] = {}  # decode worker -> its receiver's transport
        self.refused: dict[str, str] = {}        # worker -> why it is not used
        self.kv_bytes = 0                         # shipped from prefill to decode
        self.kv_transfers = 0
        self.local_prefills = 0                   # prompts their decode worker computed
        # chars of the prompt text the router indexes per prompt token, by API path,
        # learned from the prompt tokens the prefill workers report (code, prose and CJK
        # text differ by 3x and more)
        self.prompt_chars_per_token: dict[str, Ewma] = {}
        self.client: HttpClient | None = None      # made in start(), on the loop
        self._poll: asyncio.Task | None = None

    @property
    def workers(self) -> list[WorkerState]:
        return self.prefill + self.decode

    def chars_per_token(self, path: str | None = None) -> float:
        """Prompt chars per token for requests to `path` (None: all paths' mean), as
        measured; CHARS_PER_TOKEN until measured."""
        learned = [e.value for p, e in self.prompt_chars_per_token.items()
                   if (path is None or p == path) and e.value]
        return sum(learned) / len(learned) if learned else float(CHARS_PER_TOKEN)

    def record_prompt_size(self, path: str, chars: int, tokens: int) -> None:
        """A prompt of `chars` indexed chars was `tokens` tokens (a prefill worker's count)."""
        if chars > 0 and tokens > 0:
            self.prompt_chars_per_token.setdefault(path, Ewma()).update(chars / tokens)

    async def start(self) -> None:
        self.client = HttpClient(user_agent="qserve-router")
        await self.refresh()
        for w in self.workers:
            if not w.healthy and w.url not in self.refused:
                log.warning("%s worker %s is not reachable; it joins when it answers",
                            w.role, w.url)

    def poll_task(self) -> asyncio.Task:
        async def loop():
            while True:
                await asyncio.sleep(POLL_S)
                await self.refresh()
                self.tree.evict(time.monotonic())
        self._poll = asyncio.get_running_loop().create_task(loop())
        return self._poll

    async def refresh(self) -> None:
        infos = await asyncio.gather(*(self._info(w) for w in self.workers))
        if self.layout is None:
            self.layout = self._common_layout(infos)
        for w, info in zip(self.workers, infos):
            if w.url not in self.refused:
                self._apply(w, info)

    async def _info(self, w: WorkerState) -> dict | None:
        if w.url in self.refused:
            return None
        got = await self.get_json(w.url + "/v1/disagg/info", 2.0)
        info = got[1] if got is not None and got[0] == 200 else None
        return info if isinstance(info, dict) else None

    @staticmethod
    def _layout_of(info: dict) -> dict:
        return {k: info.get(k) for k in ("namespace", "block_size", "kv_dtype")}

    def _common_layout(self, infos: list[dict | None]) -> dict | None:
        """The artifact and KV layout most answering workers share (ties: the first
        listed worker's), so that one odd worker cannot set the cluster's layout by
        answering first; None until a worker answers."""
        seen = [self._layout_of(i) for i in infos if i is not None]
        return max(seen, key=seen.count) if seen else None

    def _apply(self, w: WorkerState, info: dict | None) -> None:
        if info is None:
            if w.healthy:
                log.warning("%s worker %s stopped answering", w.role, w.url)
            w.mark(False)
            return
        why = self._mismatch(w, info)
        if why:
            self.refused[w.url] = why
            w.mark(False)
            log.error("refusing %s worker %s: %s", w.role, w.url, why)
            return
        if not w.healthy:
            log.warning("%s worker %s is back", w.role, w.url)
        w.mark(True)
        w.free_kv_blocks = info.get("free_kv_blocks")
        w.total_kv_blocks = info.get("total_kv_blocks")
        block_size = info.get("block_size")
        if w.role == "prefill" and isinstance(w.total_kv_blocks, int) \
                and isinstance(block_size, int) and w.total_kv_blocks > 0 and block_size > 0:
            # remember no more of its prompts than its KV cache holds (an odd report:
            # the tree's default cap stays)
            self.tree.set_cap(w.url, round(w.total_kv_blocks * block_size
                                           * self.chars_per_token()))
        if w.role == "decode":
            w.step_s_by_rows = _step_table(info.get("decode_step_s"))
            self.kv_ports[w.url] = info.get("kv_port")
            self.kv_transports[w.url] = info.get("kv_transport") or "socket"

    def _mismatch(self, w: WorkerState, info: dict) -> str | None:
        if info.get("role") not in (w.role, "both"):
            return f"it runs as --role {info.get('role')}, not {w.role}"
        if w.role == "decode" and not isinstance(info.get("kv_port"), int):
            return "it has no KV receiver (start it with --role decode)"
        mine = self._layout_of(info)
        if self.layout is None:
            self.layout = mine
            return None
        diff = [f"{k} {mine[k]!r} (the cluster's: {self.layout[k]!r})" for k in mine
                if mine[k] != self.layout[k]]
        if diff:
            return ("it serves another artifact or KV layout: " + "; ".join(diff) +
                    ". Start every worker from the same artifact with the same dtypes and "
                    "KV settings.")
        return None

    async def get_json(self, url: str, timeout: float) -> tuple[int, object] | None:
        """(status, parsed body) of GET `url`, or None when it fails or is not JSON."""
        try:
            reply = await fetch(self.client, "GET", url, timeout=timeout,
                                connect_timeout=CONNECT_S)
            return reply.status, reply.json()
        except UpstreamFailure:
            return None

    async def close(self) -> None:
        if self._poll is not None:
            self._poll.cancel()
        if self.client is not None:
            await self.client.close()
