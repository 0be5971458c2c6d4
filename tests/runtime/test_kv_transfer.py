"""Moving a prompt's KV blocks from a prefill engine to a decode engine (runtime/disagg):
the decode engine then generates exactly what one engine doing both would, from blocks
byte-identical to its own, and refuses transfers it must not use. fp32 tiny models, CPU."""

import dataclasses
import sys
import time
from pathlib import Path

import pytest
import torch

from qserve.quantize.pipeline import quantize
from qserve.quantize.recipe import recipe_from_dict
from qserve.runtime.disagg import (
    ImportResult,
    InMemoryKVConnector,
    KVTransfer,
    KVTransferError,
    KVTransferMismatch,
    NotEnoughKVBlocks,
    SocketKVConnector,
    available_transports,
    create_connector,
    export_prefix,
    export_request,
    import_prefix,
    StagedImports,
    write_import,
)
from qserve.runtime.kv_tail import KVTail
from qserve.runtime.engine import EngineConfig, LLMEngine
from qserve.runtime.loaded_model import load
from qserve.runtime.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_deepseek, write_tiny_gemma3, write_tiny_llama  # noqa: E402

BS = 8
PROMPT = torch.randint(2, 300, (45,), generator=torch.Generator().manual_seed(3)).tolist()
FULL = 40  # tokens in the prompt's 5 full blocks


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kv dtype -> tiny Llama: bf16 KV over the checkpoint, FP8 KV over its quantized
    artifact (calibrated k/v scales)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("kvx")
    tiny = write_tiny_llama(root / "tiny")
    art = root / "art"
    quantize(str(tiny), art, recipe_from_dict({"calibration": {"num_samples": 4, "seq_len": 64}}),
             dtype=torch.float32)
    return {"bf16": load(str(tiny), torch.float32), "fp8": load(str(art), torch.float32)}


def _engine(lm, kv_dtype="bf16", **kw):
    base = dict(num_kv_blocks=32, block_size=BS, kv_dtype=kv_dtype, max_num_batched_tokens=64,
                decode_impl="eager")
    base.update(kw)
    return LLMEngine.from_model(lm, EngineConfig(**base))


def _run(engine, rid, prompt, max_tokens=10):
    """Greedy tokens of one request run to completion, and its cached prompt tokens."""
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                   ignore_eos=True))
    tokens, cached = [], None
    while engine.has_unfinished:
        for out in engine.step():
            tokens += out.token_ids
            cached = out.num_cached_tokens
    return tokens, cached


def _exported(lm, kv_dtype="bf16", prompt=PROMPT, **kw):
    """Prefill engine A: compute the prompt (max_tokens=1), export its full blocks."""
    a = _engine(lm, kv_dtype, **kw)
    _run(a, "p", prompt, max_tokens=1)
    transfer = export_prefix(a, prompt)
    assert a.blocks.num_free_blocks == a.blocks.num_blocks  # nothing leaked, all reclaimable
    return transfer


def _exported_with_tail(lm, kv_dtype="bf16", prompt=PROMPT, **kw):
    """Prefill engine A: compute the prompt holding its blocks, export full blocks and the
    tail, release; nothing may stay held or leak."""
    a = _engine(lm, kv_dtype, **kw)
    a.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                  hold_kv=True)
    while a.has_unfinished:
        a.step()
    assert a.stats().num_held == 1 and a.blocks.num_free_blocks < a.blocks.num_blocks
    transfer = export_request(a, "p", prompt)
    assert a.release_kv("p") and not a.release_kv("p")
    assert a.stats().num_held == 0 and a.blocks.num_free_blocks == a.blocks.num_blocks
    return transfer


def _slot_bytes(engine, rid, start, end):
    """Per layer: (K, V) bytes at positions start..end-1 of a running request, as uint8."""
    cache, tables = engine.kv_cache, engine.blocks.block_tables(rid)
    bs = cache.spec.block_size
    out = []
    for layer, kv in enumerate(cache.layers):
        table = tables[cache.group_of(layer)]
        rows = [(table[p // bs], p % bs) for p in range(start, end)]
        out.append(tuple(torch.stack([pool.view(torch.uint8)[b, o] for b, o in rows])
                         for pool in (kv.k_pool, kv.v_pool)))
    return out


def _block_bytes(engine, prompt):
    """Per layer: (K, V) bytes of the prompt's cached full blocks, as uint8."""
    ids = engine.blocks.cached_prefix_blocks(prompt)
    out = []
    for layer, kv in enumerate(engine.kv_cache.layers):
        group_ids = torch.tensor([b for b, _ in ids[engine.kv_cache.group_of(layer)]])
        out.append(tuple(p.view(torch.uint8)[group_ids].clone() for p in (kv.k_pool, kv.v_pool)))
    return out


def _assert_unchanged(engine, free, cached):
    assert (engine.blocks.num_free_blocks, engine.blocks.num_cached_blocks) == (free, cached)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_socket_transfer_makes_decode_engine_equal_colocated(models, kv_dtype):
    lm = models[kv_dtype]
    c = _engine(lm, kv_dtype)  # colocated: prefill and decode in one engine
    want, _ = _run(c, "c", PROMPT)
    transfer = _exported(lm, kv_dtype)
    assert (transfer.num_blocks, transfer.layout.kv_dtype) == (5, kv_dtype)
    with SocketKVConnector.receiver() as rx, SocketKVConnector.sender(rx.port) as tx:
        tx.send("req-1", transfer)
        got = rx.recv("req-1", timeout=30)
    b = _engine(lm, kv_dtype)
    assert import_prefix(b, got) == ImportResult(5, 0, 5, FULL)
    assert b.blocks.num_free_blocks == b.blocks.num_blocks  # cached, unreferenced
    assert b.blocks.num_cached_blocks == 5
    # the placed blocks hold exactly the bytes C computed for the same prompt
    mine, theirs = _block_bytes(b, PROMPT), _block_bytes(c, PROMPT)
    assert len(mine) == 2 and all(t.shape[0] == 5 for kv in mine for t in kv)
    assert any(bool(t.any()) for kv in theirs for t in kv)
    for (bk, bv), (ck, cv) in zip(mine, theirs):
        assert torch.equal(bk, ck) and torch.equal(bv, cv)
    tokens, cached = _run(b, "d", PROMPT)
    assert cached == FULL
    assert b.stats().tokens_computed == (45 - FULL) + 9
    assert tokens == want
    assert b.blocks.num_free_blocks == b.blocks.num_blocks  # no leak on the decode side


def test_gemma3_transfer_covers_every_kv_group(tmp_path):
    """Sliding-window layers keep block tables of their own (3 KV groups): each group's
    blocks travel and hit, and the decode engine equals the colocated one."""
    torch.set_num_threads(1)
    glm = load(str(write_tiny_gemma3(tmp_path / "gemma", sliding_window=8)), torch.float32)
    prompt = list(range(2, 32))  # 30 tokens, block size 4: 7 full blocks
    kw = dict(block_size=4, num_kv_blocks=64)
    c = _engine(glm, **kw)
    want, _ = _run(c, "c", prompt, max_tokens=12)
    transfer = _exported(glm, prompt=prompt, **kw)
    assert transfer.layout.windows == (None, 8, 8)
    assert [len(h) for h in transfer.block_hashes] == [7, 7, 7]
    b = _engine(glm, **kw)
    channel = InMemoryKVConnector()
    InMemoryKVConnector(channel).send("g", transfer)
    assert import_prefix(b, channel.recv("g", timeout=1)) == ImportResult(7, 0, 7, 28)
    assert b.blocks.num_cached_blocks == 21
    for (bk, bv), (ck, cv) in zip(_block_bytes(b, prompt), _block_bytes(c, prompt)):
        assert torch.equal(bk, ck) and torch.equal(bv, cv)
    tokens, cached = _run(b, "d", prompt, max_tokens=12)
    assert (tokens, cached) == (want, 28)
    assert b.blocks.num_free_blocks == 64


def test_latent_transfer_carries_the_latent_once(tmp_path):
    """A DeepSeek (MLA) engine's transfer: one tensor per layer (c_kv + RoPE key), read
    back as key and value, half the bytes a K/V pair of that width would take; the decode
    engine equals the colocated one, blocks byte-identical."""
    torch.set_num_threads(1)
    dlm = load(str(write_tiny_deepseek(tmp_path / "ds", 2)), torch.float32)
    c = _engine(dlm)
    want, _ = _run(c, "c", PROMPT)
    transfer = _exported(dlm)
    assert transfer.layout.values_in_keys and transfer.layout.block_shape == (BS, 1, 40)
    assert transfer.payload_nbytes == 3 * 5 * BS * 40 * 2  # layers x blocks x tokens x bf16
    wire = transfer.to_bytes()
    got = KVTransfer.from_bytes(wire)
    assert len(wire) < transfer.payload_nbytes + 4096
    b = _engine(dlm)
    assert import_prefix(b, got) == ImportResult(5, 0, 5, FULL)
    for (bk, _), (ck, _) in zip(_block_bytes(b, PROMPT), _block_bytes(c, PROMPT)):
        assert torch.equal(bk, ck)
    tokens, cached = _run(b, "d", PROMPT)
    assert (tokens, cached) == (want, FULL)


def test_blocks_already_cached_are_skipped(models):
    lm = models["bf16"]
    transfer = _exported(lm)
    b = _engine(lm)
    _run(b, "own", PROMPT[:17], max_tokens=1)  # computes the first 2 full blocks itself
    assert import_prefix(b, transfer) == ImportResult(5, 2, 3, FULL)
    assert import_prefix(b, transfer) == ImportResult(5, 5, 0, FULL)
    assert b.blocks.num_cached_blocks == 5
    assert b.blocks.num_free_blocks == b.blocks.num_blocks


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_a_staged_import_is_invisible_until_committed_and_then_equals_one_import(models,
                                                                                 kv_dtype):
    lm = models[kv_dtype]
    transfer = _exported(lm, kv_dtype)
    one = _engine(lm, kv_dtype)
    want = import_prefix(one, transfer)
    b = _engine(lm, kv_dtype)
    _run(b, "own", PROMPT[:17], max_tokens=1)  # the first 2 full blocks are cached here
    imports = StagedImports()
    plan = imports.reserve(b, transfer)
    assert (plan.hits, plan.num_written, len(imports)) == (2, 3, 1)
    # reserved: 3 new blocks and the 2 cached ones held, and no request can hit the new
    # ones before they are written
    assert b.blocks.num_free_blocks == b.blocks.num_blocks - 5
    assert [len(g) for g in b.blocks.cached_prefix_blocks(PROMPT)] == [2]
    assert b.blocks.probe_prefix(PROMPT) == 16
    # the engine steps on (another request) while the copy runs on another thread
    import threading
    copy = threading.Thread(target=write_import, args=(b.kv_cache, plan))
    b.add_request("other", list(range(100, 120)),
                  SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    copy.start()
    while b.has_unfinished:
        b.step()
    copy.join()
    assert imports.commit(b, plan) == ImportResult(5, 2, 3, FULL)
    assert len(imports) == 0
    assert b.blocks.num_free_blocks == b.blocks.num_blocks
    assert want == ImportResult(5, 0, 5, FULL)
    for (bk, bv), (ok, ov) in zip(_block_bytes(b, PROMPT), _block_bytes(one, PROMPT)):
        assert bk.shape[0] == 5 and torch.equal(bk, ok) and torch.equal(bv, ov)
    assert _run(b, "d", PROMPT)[1] == FULL  # a request with the prompt hits all 5


def test_a_staged_import_never_claimed_is_given_back(models):
    lm = models["bf16"]
    transfer = _exported(lm)
    b = _engine(lm)
    now = [0.0]
    imports = StagedImports(ttl_s=60, clock=lambda: now[0])
    stale = imports.reserve(b, transfer)  # its request never comes
    write_import(b.kv_cache, stale)
    assert b.blocks.num_free_blocks == b.blocks.num_blocks - 5
    now[0] = 61.0
    fresh = imports.reserve(b, transfer)  # the stale plan is cancelled first
    assert len(imports) == 1 and fresh.hits == 0  # nothing of the stale one was cached
    assert b.blocks.num_free_blocks == b.blocks.num_blocks - 5
    with pytest.raises(ValueError, match="given back before its request came"):
        imports.commit(b, stale)
    assert imports.cancel(b, fresh) and not imports.cancel(b, fresh)  # idempotent
    assert (b.blocks.num_free_blocks, b.blocks.num_cached_blocks) == (b.blocks.num_blocks, 0)


def test_refuses_another_model_layout_or_scales_changing_nothing(models):
    lm = models["bf16"]
    transfer = _exported(lm)
    b = _engine(lm)
    free, cached = b.blocks.num_free_blocks, b.blocks.num_cached_blocks
    other = dataclasses.replace(transfer, namespace="another-artifact:torch.float32:bf16")
    with pytest.raises(KVTransferMismatch, match="namespace 'another-artifact"):
        import_prefix(b, other)
    with pytest.raises(KVTransferMismatch, match="namespace"):  # FP8 KV: another namespace
        import_prefix(_engine(models["fp8"], "fp8"), transfer)
    with pytest.raises(KVTransferMismatch, match="block_size: 16 vs 8"):
        import_prefix(_engine(lm, block_size=16), transfer)
    _assert_unchanged(b, free, cached)

    fp8 = _exported(models["fp8"], "fp8")
    bf = _engine(models["fp8"], "fp8")
    doubled = dataclasses.replace(fp8, k_scales=tuple(s * 2 for s in fp8.k_scales))
    with pytest.raises(KVTransferMismatch, match=r"scales .* at layers \[0, 1\]"):
        import_prefix(bf, doubled)
    _assert_unchanged(bf, bf.blocks.num_blocks, 0)


def test_refuses_tampered_tokens_or_hashes(models):
    transfer = _exported(models["bf16"])
    b = _engine(models["bf16"])
    tokens = list(transfer.token_ids)
    tokens[20] = tokens[20] + 1 if tokens[20] < 299 else 2
    with pytest.raises(KVTransferMismatch, match="block 2 of KV group 0"):
        import_prefix(b, dataclasses.replace(transfer, token_ids=tuple(tokens)))
    hashes = list(transfer.block_hashes[0])
    hashes[4] = bytes(32)
    with pytest.raises(KVTransferMismatch, match="block 4 of KV group 0"):
        import_prefix(b, dataclasses.replace(transfer, block_hashes=(tuple(hashes),)))
    _assert_unchanged(b, b.blocks.num_blocks, 0)


def test_refuses_when_blocks_run_out_changing_nothing(models):
    lm = models["bf16"]
    transfer = _exported(lm)
    b = _engine(lm, num_kv_blocks=6)
    # another prompt (no shared blocks): holds 3 blocks, 2 of them full and cached
    b.add_request("busy", list(range(2, 22)), SamplingParams(max_tokens=20, ignore_eos=True))
    b.step()
    free, cached = b.blocks.num_free_blocks, b.blocks.num_cached_blocks
    assert (free, cached) == (3, 2)
    with pytest.raises(NotEnoughKVBlocks, match="3 free blocks"):
        import_prefix(b, transfer)
    _assert_unchanged(b, free, cached)
    b.abort_request("busy")
    assert b.blocks.num_free_blocks == 6


def test_refuses_when_prefix_caching_is_off(models):
    transfer = _exported(models["bf16"])
    with pytest.raises(ValueError, match="prefix caching off"):
        import_prefix(_engine(models["bf16"], enable_prefix_caching=False), transfer)


def test_wire_format_round_trips_bit_exact_and_detects_damage(models):
    transfer = _exported(models["fp8"], "fp8")
    data = transfer.to_bytes()
    back = KVTransfer.from_bytes(data)
    assert (back.namespace, back.layout, back.token_ids, back.block_hashes) == (
        transfer.namespace, transfer.layout, transfer.token_ids, transfer.block_hashes)
    for x, y in zip(transfer.k + transfer.v + transfer.k_scales + transfer.v_scales,
                    back.k + back.v + back.k_scales + back.v_scales):
        assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    assert len(data) > transfer.payload_nbytes == 2 * 2 * 5 * BS * 2 * 16
    damaged = bytearray(data)
    damaged[-1] ^= 1
    with pytest.raises(KVTransferError, match="CRC-32"):
        KVTransfer.from_bytes(damaged)
    with pytest.raises(KVTransferError, match="truncated"):
        KVTransfer.from_bytes(data[:-10])
    newer = bytearray(data)
    newer[4:8] = (99).to_bytes(4, "big")
    with pytest.raises(KVTransferMismatch, match="version 99"):
        KVTransfer.from_bytes(newer)
    with pytest.raises(KVTransferError, match="not a KV transfer"):
        KVTransfer.from_bytes(b"GIF89a" + data[6:])


def test_a_frame_is_read_in_place_from_a_writable_buffer(models):
    """`to_buffer` is the frame `to_bytes` gives; `from_bytes` of a writable buffer (what
    the socket and Mooncake receivers hand it) makes its tensors views of that buffer, of
    a read-only one views of a copy, with the same bytes either way."""
    import ctypes

    transfer = _exported_with_tail(models["bf16"])
    frame = transfer.to_buffer()
    assert isinstance(frame, bytearray) and bytes(frame) == transfer.to_bytes()
    start = ctypes.addressof((ctypes.c_char * len(frame)).from_buffer(frame))
    in_place, copied = KVTransfer.from_bytes(frame), KVTransfer.from_bytes(bytes(frame))
    for t in in_place.k + in_place.v + in_place.tail_k:
        assert start <= t.data_ptr() < start + len(frame)
    for x, y, z in zip(transfer.k + transfer.tail_v, in_place.k + in_place.tail_v,
                       copied.k + copied.tail_v):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        assert torch.equal(x.view(torch.uint8), z.view(torch.uint8))
        assert not start <= z.data_ptr() < start + len(frame)


def test_connectors_deliver_by_request_id_and_time_out(models):
    a, b = _exported(models["bf16"]), _exported(models["bf16"], prompt=PROMPT[:20])
    assert available_transports() == ["memory", "mooncake", "socket"]
    with pytest.raises(ValueError, match=r"registered: \['memory', 'mooncake', 'socket'\]"):
        create_connector("nixl")
    tx = create_connector("memory")
    rx = InMemoryKVConnector(tx)
    tx.send("a", a)
    tx.send("b", b)
    assert rx.recv("b", timeout=1).num_blocks == 2
    assert rx.recv("a", timeout=1).num_blocks == 5
    with pytest.raises(TimeoutError, match="'a'"):
        rx.recv("a", timeout=0.01)  # each transfer is received once
    tx.send("c", a)
    assert rx.discard("c") and not rx.discard("c")
    with pytest.raises(TimeoutError, match="'c'"):
        rx.recv("c", timeout=0.01)
    with create_connector("socket", listen=True) as srx, SocketKVConnector.sender(srx.port) as stx:
        stx.send("a", a)
        stx.send("b", b)
        assert srx.recv("b", timeout=30).token_ids == b.token_ids
        assert srx.recv("a", timeout=30).token_ids == a.token_ids
        with pytest.raises(TimeoutError, match="'zz'"):
            srx.recv("zz", timeout=0.05)
        with pytest.raises(ValueError, match="is a sender"):
            stx.recv("a")
    with pytest.raises(ValueError, match="loopback"):
        SocketKVConnector.receiver(host="0.0.0.0")


def test_block_manager_lookups_read_only_and_cover_the_last_full_block():
    from qserve.runtime.block_manager import BlockManager

    bm = BlockManager(16, 4, namespace="ns", windows=(None, 8))
    tokens = list(range(10, 22))  # 3 full blocks
    table = bm.allocate("r", tokens, 12).block_table
    tables = bm.block_tables("r")
    bm.free("r")
    before = (bm.prefix_stats, bm.num_free_blocks, bm.num_cached_blocks)
    found = bm.cached_prefix_blocks(tokens + [5, 6])  # the partial tail block is ignored
    assert [[b for b, _ in g] for g in found] == [list(t) for t in tables]
    assert [b for b, _ in found[0]] == table
    assert tuple(tuple(h for _, h in g) for g in found) == bm.block_hashes(tokens)
    assert bm.block_hashes(tokens)[0] != bm.block_hashes(tokens)[1]  # per-group namespaces
    assert (bm.prefix_stats, bm.num_free_blocks, bm.num_cached_blocks) == before
    assert [len(g) for g in bm.cached_prefix_blocks(tokens[:4] + [0] * 8)] == [1, 1]
    assert bm.probe_prefix(tokens) == 8  # allocate keeps the last token to compute


def test_receivers_check_frames_on_arrival_on_their_receive_cores(models):
    """A frame is checked on the listener's thread when it arrives: a damaged one fails its
    own `recv` (with the check's error), the next one still arrives. `receive_cores` pins
    those threads; cores the process may not use are refused."""
    import os
    import socket
    import threading

    from qserve.runtime.disagg.connector import _header

    good = _exported(models["bf16"])
    damaged = bytearray(good.to_bytes())
    damaged[-1] ^= 1
    cores = frozenset({min(os.sched_getaffinity(0))})
    with SocketKVConnector.receiver(receive_cores=cores) as rx:
        with socket.create_connection(("127.0.0.1", rx.port)) as raw:
            raw.sendall(_header("bad", len(damaged)) + bytes(damaged))
            raw.sendall(_header("good", len(good.to_bytes())) + good.to_bytes())
            with pytest.raises(KVTransferError, match="CRC-32"):
                rx.recv("bad", timeout=30)
            assert rx.recv("good", timeout=30).token_ids == good.token_ids
            readers = [t for t in threading.enumerate() if t.name == "kv-connector"]
            assert len(readers) == 2  # the accept loop and this connection's reader
            assert all(os.sched_getaffinity(t.native_id) == cores for t in readers)
    with pytest.raises(ValueError, match="not CPUs this machine lets"):
        SocketKVConnector.receiver(receive_cores={10**6})


def test_a_transfer_nobody_claims_is_dropped_after_its_ttl():
    from qserve.runtime.disagg.connector import _Mailbox

    box = _Mailbox(ttl_s=0.05)
    box.put("orphan", b"x")
    time.sleep(0.1)
    box.put("fresh", b"y")            # an arrival drops what expired
    assert box.pending() == 1 and box.take("fresh", 0) == b"y"
    with pytest.raises(TimeoutError):
        box.take("orphan", 0)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_tail_transfer_leaves_only_the_last_prompt_token_to_compute(models, kv_dtype):
    """The prompt's 4 tokens past its last full block travel as a tail: the decode engine
    writes them into the request's own block, computes one prompt token, and generates
    what the colocated engine does, from bytes identical to the colocated engine's."""
    lm = models[kv_dtype]
    c = _engine(lm, kv_dtype)
    c.add_request("c", PROMPT, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    want = []
    want += c.step()[0].token_ids  # the prompt is computed (one step: budget 64)
    colocated_tail = _slot_bytes(c, "c", FULL, 44)
    while c.has_unfinished:
        want += [t for o in c.step() for t in o.token_ids]
    transfer = _exported_with_tail(lm, kv_dtype)
    assert (transfer.num_blocks, transfer.tail_token_ids) == (5, tuple(PROMPT[FULL:44]))
    assert transfer.num_tokens == 44
    with SocketKVConnector.receiver() as rx, SocketKVConnector.sender(rx.port) as tx:
        tx.send("req-1", transfer)
        got = rx.recv("req-1", timeout=30)
    assert got.tail_token_ids == transfer.tail_token_ids
    b = _engine(lm, kv_dtype)
    assert import_prefix(b, got) == ImportResult(5, 0, 5, FULL)
    b.add_request("d", PROMPT, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                  kv_tail=got.tail())
    first = b.step()
    assert b.stats().tokens_computed == 1 and b.stats().tokens_imported == 4
    assert first[0].num_cached_tokens == 44
    for (bk, bv), (ck, cv) in zip(_slot_bytes(b, "d", FULL, 44), colocated_tail):
        assert torch.equal(bk, ck) and torch.equal(bv, cv)
    tokens, _ = first[0].token_ids, None
    while b.has_unfinished:
        tokens += [t for o in b.step() for t in o.token_ids]
    assert tokens == want
    assert b.stats().tokens_computed == 1 + 9
    assert b.blocks.num_free_blocks == b.blocks.num_blocks


def test_a_tail_without_its_blocks_is_ignored_and_a_wrong_one_refused(models):
    lm = models["bf16"]
    want, _ = _run(_engine(lm), "c", PROMPT)
    tail = _exported_with_tail(lm).tail()
    b = _engine(lm)  # the full blocks were never placed: the request computes everything
    b.add_request("d", PROMPT, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                  kv_tail=tail)
    tokens = []
    while b.has_unfinished:
        tokens += [t for o in b.step() for t in o.token_ids]
    assert tokens == want and b.stats().tokens_computed == 45 + 9
    assert b.stats().tokens_imported == 0
    other = list(PROMPT)
    other[41] = other[41] + 1 if other[41] < 299 else 2
    with pytest.raises(ValueError, match="not the prompt's at positions 40..43"):
        b.add_request("x", other, SamplingParams(max_tokens=2), kv_tail=tail)
    with pytest.raises(ValueError, match="past the 44-token prompt's last token"):
        b.add_request("y", PROMPT[:44], SamplingParams(max_tokens=2), kv_tail=tail)
    with pytest.raises(ValueError, match="block boundary"):
        b.add_request("z", PROMPT, SamplingParams(max_tokens=2),
                      kv_tail=KVTail(39, tail.token_ids, tail.k, tail.v))
    with pytest.raises(ValueError, match="prefix caching"):
        _engine(lm, enable_prefix_caching=False).add_request(
            "w", PROMPT, SamplingParams(max_tokens=2), kv_tail=tail)
    assert b.blocks.num_free_blocks == b.blocks.num_blocks


def test_held_blocks_are_freed_by_release_or_abort(models):
    lm = models["bf16"]
    a = _engine(lm)
    a.add_request("p", PROMPT, SamplingParams(max_tokens=1, ignore_eos=True), hold_kv=True)
    while a.has_unfinished:
        a.step()
    assert a.blocks.num_free_blocks == a.blocks.num_blocks - 6  # 5 full + the partial one
    with pytest.raises(ValueError, match="already in use"):
        a.add_request("p", PROMPT, SamplingParams(max_tokens=1))
    assert a.abort_request("p") and a.stats().num_held == 0
    assert a.blocks.num_free_blocks == a.blocks.num_blocks
    # an aborted (not finished) held request is freed at once
    a.add_request("q", PROMPT, SamplingParams(max_tokens=5, ignore_eos=True), hold_kv=True)
    a.step()
    assert a.abort_request("q") and a.stats().num_held == 0
    assert a.blocks.num_free_blocks == a.blocks.num_blocks


@pytest.mark.parametrize("arch", ["gemma3", "deepseek"])
def test_tail_transfer_on_window_groups_and_a_latent_cache(tmp_path, arch):
    """Gemma 3 (three KV groups, sliding windows) and DeepSeek (one latent tensor per
    layer): the tail lands in every group's block, and the decode engine equals the
    colocated one computing one prompt token."""
    torch.set_num_threads(1)
    if arch == "gemma3":
        lm = load(str(write_tiny_gemma3(tmp_path / "m", sliding_window=8)), torch.float32)
        prompt, kw = list(range(2, 32)), dict(block_size=4, num_kv_blocks=64)  # 30 tokens
    else:
        lm = load(str(write_tiny_deepseek(tmp_path / "m", 2)), torch.float32)
        prompt, kw = PROMPT, {}
    want, _ = _run(_engine(lm, **kw), "c", prompt, max_tokens=12)
    transfer = _exported_with_tail(lm, prompt=prompt, **kw)
    bs = transfer.layout.block_size
    full = (len(prompt) - 1) // bs
    assert transfer.num_blocks == full and transfer.num_tokens == len(prompt) - 1
    got = KVTransfer.from_bytes(transfer.to_bytes())
    if arch == "deepseek":
        assert all(k is v for k, v in zip(got.tail_k, got.tail_v))
    b = _engine(lm, **kw)
    import_prefix(b, got)
    b.add_request("d", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                  kv_tail=got.tail())
    tokens = []
    while b.has_unfinished:
        tokens += [t for o in b.step() for t in o.token_ids]
    assert tokens == want
    assert b.stats().tokens_computed == 1 + 11
    assert b.blocks.num_free_blocks == b.blocks.num_blocks


def test_a_decode_request_places_its_kv_beside_the_engine_and_a_cancelled_one_gives_it_back(
        models, monkeypatch):
    """The decode route's path (runtime/server/disagg_routes.py `kv_before`): the copy runs
    on the writer thread and the blocks are cached only by the request's hook; a request
    cancelled during the copy gives its blocks back only after the copy has finished."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from qserve.runtime.async_engine import AsyncEngine
    from qserve.runtime.disagg import kv_import
    from qserve.runtime.server.disagg_routes import KV_HEADER, DisaggRole, kv_before

    lm = models["bf16"]
    transfer = _exported(lm)
    engine = AsyncEngine(_engine(lm))
    blocks = engine.engine.blocks
    channel = InMemoryKVConnector()
    role = DisaggRole("decode", receiver=channel)
    state = SimpleNamespace(engine=engine, disagg=role)
    started, release = threading.Event(), threading.Event()
    original = kv_import.write_import

    def held_write(cache, plan):  # the copy waits until the test lets it go
        started.set()
        release.wait(timeout=30)
        original(cache, plan)

    monkeypatch.setattr(kv_import, "write_import", held_write)

    async def main():
        request = SimpleNamespace(headers={KV_HEADER: "gone"})
        InMemoryKVConnector(channel).send("gone", transfer)
        task = asyncio.create_task(kv_before(state, request))
        await asyncio.to_thread(started.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.2)
        # the copy still runs: its blocks stay reserved
        assert (len(engine.engine.kv_imports), blocks.num_free_blocks) == (1, blocks.num_blocks - 5)
        # ... as the snapshot other threads read says (published after the command)
        assert (engine.stats().num_staged_imports, engine.stats().kv_blocks_free) == \
            (1, blocks.num_blocks - 5)
        release.set()
        for _ in range(100):
            if len(engine.engine.kv_imports) == 0:
                break
            await asyncio.sleep(0.05)
        assert (len(engine.engine.kv_imports), blocks.num_free_blocks, blocks.num_cached_blocks) == \
            (0, blocks.num_blocks, 0)

        InMemoryKVConnector(channel).send("kept", transfer)
        hook = await kv_before(state, SimpleNamespace(headers={KV_HEADER: "kept"}))
        assert blocks.num_cached_blocks == 0  # written, not yet registered
        tail = await engine.call(hook)
        assert tail == transfer.tail() and len(engine.engine.kv_imports) == 0
        assert (blocks.num_cached_blocks, blocks.num_free_blocks) == (5, blocks.num_blocks)

    try:
        asyncio.run(main())
    finally:
        release.set()
        engine.shutdown()
