"""KV connector: how a request's KVTransfer gets from the prefill engine to the decode one.

Shaped after vLLM's KV connector: a producer (prefill) side sends a request's transfer,
a consumer (decode) side receives it by request id, waiting up to a timeout. Transports
are registered by name (`register_transport`, `create_connector`):

    "memory"  InMemoryKVConnector: both sides in one process, over a shared channel (tests)
    "socket"  SocketKVConnector: TCP on the loopback interface, one machine; frames are
              request id length u32 BE | request id (UTF-8) | length u64 BE |
              KVTransfer.to_bytes()
    "mooncake" MooncakeKVConnector (mooncake_connector.py): Mooncake's transfer engine
              writes the same bytes into a buffer the receiver registered (RDMA or TCP)

Another transport (e.g. NIXL) plugs in as a KVConnector subclass registered under its
own name (`register_transport`).

A transfer nobody receives stays pending in the receiver until `discard`ed, closed, or
PENDING_TTL_S after it arrived (dropped at the next arrival). A receiver checks each frame
(format, CRC-32) as it arrives, on its listener's threads; `recv` hands over the transfer
or raises what the check found. `receive_cores` pins those threads (reading the socket,
the check) to other cores than the decode engine's: on one machine the copy of each
frame then does not preempt a decode step.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import threading
import time
from abc import ABC, abstractmethod
from typing import Callable

from .. import failpoints
from .kv_transfer import KVTransfer, KVTransferError

_ID_LEN = struct.Struct(">I")
_PAYLOAD_LEN = struct.Struct(">Q")


class KVConnector(ABC):
    """One side (or both) of a KV transfer channel."""

    # -- producer (prefill) side
    @abstractmethod
    def send(self, request_id: str, transfer: KVTransfer) -> None:
        """Hand `transfer` over for `request_id`; returns once it is on its way."""

    # -- consumer (decode) side
    @abstractmethod
    def recv(self, request_id: str, timeout: float | None = None) -> KVTransfer:
        """The transfer sent for `request_id`, waiting up to `timeout` seconds (None: for
        ever). Raises TimeoutError when none arrived in time. Each transfer is received
        once."""

    @abstractmethod
    def discard(self, request_id: str) -> bool:
        """Drop a pending transfer (e.g. the request was aborted). False if none."""

    def pending(self) -> int:
        """Transfers received and not yet claimed (0 on a sender)."""
        return 0

    def close(self) -> None:
        """Release sockets and threads. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


PENDING_TTL_S = 600.0   # a received transfer nobody claimed is dropped after this long


def _checked(data: bytes | bytearray) -> KVTransfer | KVTransferError:
    """A received frame as its transfer, or the error its check raised (for `recv`)."""
    try:
        return KVTransfer.from_bytes(data)
    except KVTransferError as e:
        return e
    except Exception as e:  # a reader bug must not leave the request waiting for nothing
        return KVTransferError(f"the KV transfer could not be read: {e!r}")


def _handed_over(item: KVTransfer | KVTransferError) -> KVTransfer:
    if isinstance(item, KVTransferError):
        raise item
    return item


class _Mailbox:
    """Received transfers (or the errors their check raised) by request id, with waiting.
    A transfer whose request never comes (the decode request failed, the client left) is
    dropped after `ttl_s`, so orphaned KV bytes do not pile up in the receiver."""

    def __init__(self, ttl_s: float = PENDING_TTL_S) -> None:
        self._items: dict[str, KVTransfer | KVTransferError] = {}
        self._arrived: dict[str, float] = {}
        self._cond = threading.Condition()
        self.ttl_s = ttl_s

    def put(self, request_id: str, data: KVTransfer | KVTransferError) -> None:
        now = time.monotonic()
        with self._cond:
            for rid in [r for r, t in self._arrived.items() if now - t > self.ttl_s]:
                self._items.pop(rid, None)
                self._arrived.pop(rid, None)
            self._items[request_id] = data
            self._arrived[request_id] = now
            self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return len(self._items)

    def take(self, request_id: str, timeout: float | None) -> KVTransfer | KVTransferError:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while request_id not in self._items:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no KV transfer for request {request_id!r} arrived "
                                       f"within {timeout} s: is the prefill side sending "
                                       f"to this connector?")
                self._cond.wait(left)
            self._arrived.pop(request_id, None)
            return self._items.pop(request_id)

    def discard(self, request_id: str) -> bool:
        with self._cond:
            self._arrived.pop(request_id, None)
            return self._items.pop(request_id, None) is not None


class InMemoryKVConnector(KVConnector):
    """Sender and receiver in one process: connectors made with the same `channel`
    (another InMemoryKVConnector, or None for a new channel) see each other's sends.
    Transfers go through `to_bytes`/`from_bytes`, as over a wire."""

    def __init__(self, channel: "InMemoryKVConnector | None" = None) -> None:
        self._mailbox = channel._mailbox if channel is not None else _Mailbox()

    def send(self, request_id: str, transfer: KVTransfer) -> None:
        self._mailbox.put(request_id, _checked(transfer.to_bytes()))

    def recv(self, request_id: str, timeout: float | None = None) -> KVTransfer:
        return _handed_over(self._mailbox.take(request_id, timeout))

    def discard(self, request_id: str) -> bool:
        return self._mailbox.discard(request_id)

    def pending(self) -> int:
        return self._mailbox.pending()


def _require_loopback(host: str) -> None:
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise ValueError(f"the socket KV transport is for one machine (loopback), not "
                         f"{host!r}: between machines use a network transport (Mooncake, "
                         f"NIXL) registered with register_transport.")


def _read_exact(conn: socket.socket, n: int) -> bytearray | None:
    """n bytes (writable: a KV frame's tensors become views of them), or None when the
    peer closed the connection first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return buf


def _read_header(conn: socket.socket) -> tuple[str, int] | None:
    """A frame's request id and payload length (both transports' frames start so), or
    None when the peer closed the connection first."""
    head = _read_exact(conn, _ID_LEN.size)
    if head is None:
        return None
    rid = _read_exact(conn, _ID_LEN.unpack(head)[0])
    size = _read_exact(conn, _PAYLOAD_LEN.size)
    if rid is None or size is None:
        return None
    return rid.decode("utf-8", errors="replace"), _PAYLOAD_LEN.unpack(size)[0]


def _header(request_id: str, payload_len: int) -> bytes:
    rid = request_id.encode("utf-8")
    return _ID_LEN.pack(len(rid)) + rid + _PAYLOAD_LEN.pack(payload_len)


class _Listener:
    """A receiver's listening TCP socket: each connection it accepts is served by
    `serve(conn)` in a daemon thread (which closes it); `close` stops them all. `cores`:
    the CPUs those threads run on (None: the process's)."""

    def __init__(self, host: str, port: int, serve: Callable[[socket.socket], None],
                 cores: frozenset[int] | None = None) -> None:
        self._serve = serve
        self._cores = cores
        self._lock = threading.Lock()
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._peers: list[socket.socket] = []
        self._server = socket.create_server((host, port))
        self.port = self._server.getsockname()[1]
        self._spawn(self._accept_loop)

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=self._pinned, args=(target, *args), daemon=True,
                             name="kv-connector")
        self._threads.append(t)
        t.start()

    def _pinned(self, target, *args) -> None:
        if self._cores is not None:
            os.sched_setaffinity(0, self._cores)  # 0: this thread (Linux)
        target(*args)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:  # closed
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._peers.append(conn)
            self._spawn(self._serve, conn)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the listener and every accepted connection; join the threads.
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            socks = [self._server, *self._peers]
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)


class _ListeningConnector(KVConnector):
    """A transport whose receiver files whole frames in a _Mailbox (`self._mailbox`)
    and whose sender has no listener (`self._server is None`)."""

    _mailbox: _Mailbox
    _server: "_Listener | None"

    def recv(self, request_id: str, timeout: float | None = None) -> KVTransfer:
        if self._server is None:
            raise ValueError(f"this connector is a sender; receive on a "
                             f"{type(self).__name__}.receiver().")
        return _handed_over(self._mailbox.take(request_id, timeout))

    def _file(self, request_id: str, data: bytearray) -> None:
        """A whole frame arrived (on a listener thread): check it and file it."""
        self._mailbox.put(request_id, _checked(data))

    def discard(self, request_id: str) -> bool:
        return self._mailbox.discard(request_id)

    def pending(self) -> int:
        return self._mailbox.pending()


def check_cores(cores) -> frozenset[int] | None:
    """`receive_cores` as a set of CPUs a thread of this process can be moved to (tried on
    a short-lived thread: a worker pinned to other cores may still place its threads on
    any CPU its cgroup allows); ValueError when it cannot. None stays None."""
    if cores is None:
        return None
    cores = frozenset(int(c) for c in cores)
    errors: list[OSError] = []

    def attempt() -> None:
        try:
            os.sched_setaffinity(0, cores)
        except OSError as e:
            errors.append(e)

    if not cores or not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"receive cores {sorted(cores)}: pinning threads needs Linux and at "
                         "least one CPU.")
    t = threading.Thread(target=attempt)
    t.start()
    t.join()
    if errors:
        raise ValueError(f"receive cores {sorted(cores)} are not CPUs this machine lets the "
                         f"process use ({errors[0].strerror}).")
    return cores


class SocketKVConnector(_ListeningConnector):
    """KV transfers over TCP on the loopback interface.

    The receiver (decode side) listens: `SocketKVConnector.receiver(port=0)`, its bound
    port in `.port`. The sender (prefill side) connects: `SocketKVConnector.sender(port)`.
    Frames larger than `max_frame_bytes` close the connection (a misbehaving peer)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, listen: bool,
                 max_frame_bytes: int = 1 << 34, receive_cores=None) -> None:
        _require_loopback(host)
        self.host, self.max_frame_bytes = host, max_frame_bytes
        self._mailbox = _Mailbox()
        self._lock = threading.Lock()
        self._closed = False
        self._conn: socket.socket | None = None  # a sender's connection
        self._server = (_Listener(host, port, self._read_loop, check_cores(receive_cores))
                        if listen else None)
        self.port = self._server.port if listen else port

    @classmethod
    def receiver(cls, host: str = "127.0.0.1", port: int = 0, **kw) -> "SocketKVConnector":
        return cls(host, port, listen=True, **kw)

    @classmethod
    def sender(cls, port: int, host: str = "127.0.0.1", **kw) -> "SocketKVConnector":
        return cls(host, port, listen=False, **kw)

    def _read_loop(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    header = _read_header(conn)
                    if header is None or header[1] > self.max_frame_bytes:
                        return
                    rid, n = header
                    data = _read_exact(conn, n)
                except OSError:
                    return
                if data is None:
                    return
                self._file(rid, data)

    def send(self, request_id: str, transfer: KVTransfer) -> None:
        if self._server is not None:
            raise ValueError("this connector is a receiver; send from a "
                             "SocketKVConnector.sender(port).")
        payload = transfer.to_buffer()
        with self._lock:
            if self._closed:
                raise ValueError("this KV connector is closed.")
            if self._conn is None:
                self._conn = socket.create_connection((self.host, self.port))
            self._conn.sendall(_header(request_id, len(payload)))
            if failpoints.active("kv-send-partial"):
                self._conn.sendall(memoryview(payload)[:len(payload) // 2])
                failpoints.die("kv-send-partial")
            self._conn.sendall(payload)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conn = self._conn
        if self._server is not None:
            self._server.close()
        if conn is not None:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()


def _mooncake(**kwargs) -> KVConnector:
    from .mooncake_connector import MooncakeKVConnector  # imports its library on use only

    return MooncakeKVConnector(**kwargs)


_TRANSPORTS: dict[str, Callable[..., KVConnector]] = {
    "memory": InMemoryKVConnector,
    "socket": SocketKVConnector,
    "mooncake": _mooncake,
}


def register_transport(name: str, factory: Callable[..., KVConnector]) -> None:
    """Make `create_connector(name, ...)` build connectors with `factory(...)`."""
    if name in _TRANSPORTS:
        raise ValueError(f"KV transport {name!r} is already registered.")
    _TRANSPORTS[name] = factory


def available_transports() -> list[str]:
    return sorted(_TRANSPORTS)


def create_connector(name: str, **kwargs) -> KVConnector:
    """A connector of the transport registered as `name`, e.g.
    create_connector("socket", port=0, listen=True)."""
    factory = _TRANSPORTS.get(name)
    if factory is None:
        raise ValueError(f"unknown KV transport {name!r}; registered: "
                         f"{available_transports()}.")
    return factory(**kwargs)
