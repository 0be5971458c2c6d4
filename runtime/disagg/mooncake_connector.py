"""KV transfers through Mooncake's transfer engine (`mooncake-transfer-engine-non-cuda`).

The transfer engine moves bytes by one-sided writes into memory the receiver registered
(RDMA between machines where there is a NIC for it, TCP otherwise: the `tcp` protocol
is what runs on a CPU-only host). Here the decode side registers a staging buffer; per
request, over a small control connection to the receiver's `port`:

    sender -> receiver   RESERVE  id length u32 BE | request id | payload length u64 BE
    receiver -> sender   status u8 (0 ok, 1 too large, 2 no room) | region address u64 BE
                         | session name length u16 BE | session name (UTF-8)
    sender               transfer_sync_write(session, payload, region address, length)
    sender -> receiver   COMMIT   status u8 (0 written, 1 the write failed)
    receiver -> sender   FILED    0 (after a successful write)

and the receiver takes the payload (KVTransfer.to_bytes()) out of its region, frees the
region and files it by request id, as the socket transport does, before answering. A
sender that dies between RESERVE and COMMIT closes the control connection: the region is
freed and nothing is filed. Writing the blocks straight into the decode engine's KV pool (registering the
pool instead of a staging buffer) would save the receiver's copy; it needs the engine to
allocate the blocks before the write, which this connector does not do yet.

Needs Debian's libibverbs1 and librdmacm1 even for TCP (the library links them).
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import torch

from .. import failpoints
from .connector import (_header, _Listener, _ListeningConnector, _Mailbox, _read_exact,
                        _read_header, check_cores)
from .kv_transfer import KVTransfer

_GRANT = struct.Struct(">BQH")  # status, region address, session name length
OK, TOO_LARGE, NO_ROOM = 0, 1, 2
WRITTEN, WRITE_FAILED = 0, 1
FILED = 0  # the receiver's last byte: the transfer is waiting for its request
RESERVE_WAIT_S = 10.0  # how long a RESERVE waits for room before answering NO_ROOM
INSTALL_HINT = ("pip install mooncake-transfer-engine-non-cuda, and Debian's libibverbs1 "
                "and librdmacm1 (apt-get install libibverbs1 librdmacm1)")


def _engine(host: str):
    """A TransferEngine on `host` with peer-to-peer handshakes over TCP."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise RuntimeError(f"the mooncake KV transport needs Mooncake's transfer engine "
                           f"({e}): {INSTALL_HINT}.") from None
    engine = TransferEngine()
    rc = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"Mooncake's transfer engine did not start on {host} (code {rc}).")
    return engine


class _Regions:
    """First-fit allocation of byte ranges in the staging buffer, with waiting."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._used: dict[int, int] = {}  # offset -> length
        self._cond = threading.Condition()

    def _find(self, n: int) -> int | None:
        at = 0
        for off, length in sorted(self._used.items()):
            if off - at >= n:
                return at
            at = off + length
        return at if self.size - at >= n else None

    def take(self, n: int, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while (off := self._find(n)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            self._used[off] = n
            return off

    def free(self, off: int) -> None:
        with self._cond:
            self._used.pop(off, None)
            self._cond.notify_all()

    def in_use(self) -> int:
        with self._cond:
            return len(self._used)


class MooncakeKVConnector(_ListeningConnector):
    """The receiver (decode side): `MooncakeKVConnector.receiver(buffer_bytes=...)`, its
    control port in `.port`. The sender (prefill side): `.sender(port, host=...)`; one
    transfer engine per sending process is shared by its senders."""

    _shared_sender_engine = None
    _shared_lock = threading.Lock()

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, listen: bool,
                 buffer_bytes: int = 256 << 20, receive_cores=None) -> None:
        self.host = host
        self._mailbox = _Mailbox()
        self._server: _Listener | None = None
        if listen:
            self._engine = _engine(host)
            self.session = f"{host}:{self._engine.get_rpc_port()}"
            # the staging buffer the senders write into: [buffer_bytes] uint8
            self._buffer = torch.empty(buffer_bytes, dtype=torch.uint8)
            rc = self._engine.register_memory(self._buffer.data_ptr(), buffer_bytes)
            if rc != 0:
                raise RuntimeError(f"Mooncake could not register the {buffer_bytes}-byte KV "
                                   f"staging buffer (code {rc}).")
            self._regions = _Regions(buffer_bytes)
            self._server = _Listener(host, port, self._serve, check_cores(receive_cores))
            self.port = self._server.port
        else:
            self.port = port

    @classmethod
    def receiver(cls, host: str = "127.0.0.1", port: int = 0, **kw) -> "MooncakeKVConnector":
        return cls(host, port, listen=True, **kw)

    @classmethod
    def sender(cls, port: int, host: str = "127.0.0.1", **kw) -> "MooncakeKVConnector":
        return cls(host, port, listen=False, **kw)

    @classmethod
    def _sender_engine(cls):
        with cls._shared_lock:
            if cls._shared_sender_engine is None:
                cls._shared_sender_engine = _engine("127.0.0.1")
            return cls._shared_sender_engine

    # -- receiver ---------------------------------------------------------------------
    def _serve(self, conn: socket.socket) -> None:
        """One control connection: RESERVE / grant / COMMIT, repeated."""
        session = self.session.encode("utf-8")
        with conn:
            while True:
                try:
                    header = _read_header(conn)
                    if header is None:
                        return
                    rid, n = header
                    off = None
                    if n > self._regions.size:
                        status = TOO_LARGE
                    else:
                        off = self._regions.take(max(n, 1), RESERVE_WAIT_S)
                        status = OK if off is not None else NO_ROOM
                    addr = self._buffer.data_ptr() + (off or 0)
                    if off is None:
                        conn.sendall(_GRANT.pack(status, addr, len(session)) + session)
                        continue
                    try:
                        conn.sendall(_GRANT.pack(status, addr, len(session)) + session)
                        done = _read_exact(conn, 1)  # None: the sender went away
                        data = (bytearray(self._buffer[off:off + n].numpy())
                                if done == bytes([WRITTEN]) else None)
                    finally:
                        self._regions.free(off)
                except OSError:
                    return
                if done is None:
                    return
                if data is not None:
                    self._file(rid, data)
                    try:
                        conn.sendall(bytes([FILED]))
                    except OSError:
                        return

    def regions_in_use(self) -> int:
        """Staging regions reserved and not yet committed or given back."""
        return self._regions.in_use() if self._server is not None else 0

    # -- sender -----------------------------------------------------------------------
    def send(self, request_id: str, transfer: KVTransfer) -> None:
        if self._server is not None:
            raise ValueError("this connector is a receiver; send from a "
                             "MooncakeKVConnector.sender(port).")
        # the payload as one contiguous [n] uint8 tensor (the engine reads its address)
        payload = torch.frombuffer(transfer.to_buffer(), dtype=torch.uint8)
        engine = self._sender_engine()
        with socket.create_connection((self.host, self.port)) as conn:
            conn.sendall(_header(request_id, payload.numel()))
            grant = _read_exact(conn, _GRANT.size)
            if grant is None:
                raise ConnectionError("the Mooncake KV receiver closed the control "
                                      "connection before granting a region.")
            status, addr, name_len = _GRANT.unpack(grant)
            name = _read_exact(conn, name_len)
            if status == TOO_LARGE:
                raise ValueError(f"the KV transfer ({payload.numel()} bytes) is larger than "
                                 f"the receiver's Mooncake staging buffer: start the decode "
                                 f"worker with a larger one.")
            if status != OK or name is None:
                raise ConnectionError(f"the Mooncake KV receiver had no room for "
                                      f"{payload.numel()} bytes within {RESERVE_WAIT_S:g} s.")
            rc = engine.transfer_sync_write(name.decode("utf-8"), payload.data_ptr(), addr,
                                            payload.numel())
            if failpoints.active("kv-send-partial"):  # written, never committed
                failpoints.die("kv-send-partial")
            conn.sendall(bytes([WRITTEN if rc == 0 else WRITE_FAILED]))
            if rc != 0:
                raise ConnectionError(f"Mooncake's transfer engine failed to write the KV "
                                      f"to {name.decode('utf-8')} (code {rc}).")
            if _read_exact(conn, 1) != bytes([FILED]):
                raise ConnectionError("the Mooncake KV receiver closed the control "
                                      "connection before filing the transfer.")

    def close(self) -> None:
        if self._server is not None and not self._server.closed:
            self._server.close()
            self._engine.unregister_memory(self._buffer.data_ptr())


def available() -> bool:
    """Whether Mooncake's transfer engine imports here (package and system libraries)."""
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return False
    return True

