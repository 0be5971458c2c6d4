"""The `mooncake` KV transport: Mooncake's transfer engine (TCP protocol on this CPU-only
host) writes a transfer's bytes into the receiver's registered staging buffer; it arrives
bit-exact, by request id, and a sender that dies mid-transfer leaves nothing behind.
Runs where `mooncake-transfer-engine-non-cuda` and libibverbs1/librdmacm1 are installed
(.ci/setup installs them as root)."""

import socket
import struct
import threading

import pytest
import torch

from qserve.runtime.disagg import KVLayout, KVTransfer, create_connector
from qserve.runtime.disagg.mooncake_connector import (
    INSTALL_HINT,
    MooncakeKVConnector,
    available,
)

pytestmark = pytest.mark.skipif(not available(), reason=f"Mooncake's transfer engine does "
                                                        f"not import here: {INSTALL_HINT}")


def _transfer(num_blocks: int, seed: int, tail: int = 0) -> KVTransfer:
    """A bf16 transfer of random bytes: 2 layers, block size 4, 2 KV heads of 8."""
    lay = KVLayout(4, 2, 2, 8, "bf16", (None,), (0, 0), (0, 0))
    g = torch.Generator().manual_seed(seed)

    def t(*shape):
        return torch.randn(*shape, generator=g).bfloat16()

    return KVTransfer("ns", lay, tuple(range(num_blocks * 4)),
                      (tuple(bytes([i]) * 32 for i in range(num_blocks)),),
                      tuple(t(num_blocks, 4, 2, 8) for _ in range(2)),
                      tuple(t(num_blocks, 4, 2, 8) for _ in range(2)),
                      tail_token_ids=tuple(range(tail)),
                      tail_k=tuple(t(tail, 2, 8) for _ in range(2)) if tail else (),
                      tail_v=tuple(t(tail, 2, 8) for _ in range(2)) if tail else ())


def test_transfers_arrive_bit_exact_by_request_id():
    a, b = _transfer(5, 1, tail=3), _transfer(2, 2)
    with create_connector("mooncake", listen=True, buffer_bytes=1 << 20) as rx:
        with MooncakeKVConnector.sender(rx.port) as tx:
            tx.send("a", a)
            tx.send("b", b)
        assert rx.pending() == 2 and rx.regions_in_use() == 0
        got_b, got_a = rx.recv("b", timeout=10), rx.recv("a", timeout=10)
        assert got_a.to_bytes() == a.to_bytes() and got_b.to_bytes() == b.to_bytes()
        assert got_a.tail_token_ids == (0, 1, 2)
        with pytest.raises(TimeoutError):
            rx.recv("a", timeout=0.01)


def test_concurrent_senders_share_the_staging_buffer():
    sent = {f"r{i}": _transfer(3 + i, i) for i in range(6)}
    # room for about two transfers at a time: the others wait for a region
    size = 2 * len(sent["r5"].to_bytes()) + 64
    with MooncakeKVConnector.receiver(buffer_bytes=size) as rx:
        errors = []

        def send(rid):
            try:
                with MooncakeKVConnector.sender(rx.port) as tx:
                    tx.send(rid, sent[rid])
            except Exception as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=send, args=(rid,)) for rid in sent]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        for rid, transfer in sent.items():
            assert rx.recv(rid, timeout=10).to_bytes() == transfer.to_bytes()
        assert rx.regions_in_use() == 0


def test_too_large_and_a_sender_that_dies_mid_transfer():
    with MooncakeKVConnector.receiver(buffer_bytes=4096) as rx:
        with MooncakeKVConnector.sender(rx.port) as tx, \
                pytest.raises(ValueError, match="larger than the receiver's Mooncake"):
            tx.send("big", _transfer(8, 3))
        # a sender that reserves a region and goes away without committing
        rid = b"gone"
        with socket.create_connection(("127.0.0.1", rx.port)) as conn:
            conn.sendall(struct.pack(">I", len(rid)) + rid + struct.pack(">Q", 1000))
            status = conn.recv(1)
            assert status == b"\x00"  # granted
        small = _transfer(1, 4)
        with MooncakeKVConnector.sender(rx.port) as tx:
            tx.send("next", small)  # the dead sender's region was given back
        assert rx.recv("next", timeout=10).to_bytes() == small.to_bytes()
        with pytest.raises(TimeoutError):
            rx.recv("gone", timeout=0.05)
        assert rx.pending() == 0 and rx.regions_in_use() == 0
