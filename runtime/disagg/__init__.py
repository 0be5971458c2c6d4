"""Prefill/decode disaggregation: moving a request's KV blocks between two engines.

    prefill_engine.add_request("p1", prompt_ids, one_token, hold_kv=True)  # ... run it
    transfer = export_request(prefill_engine, "p1", prompt_ids)
    prefill_engine.release_kv("p1")
    connector.send("r1", transfer)                          # runtime/disagg/connector.py
    got = connector.recv("r1", timeout=30)
    import_prefix(decode_engine, got)                       # full blocks: prefix cache
    decode_engine.add_request("r1", prompt_ids, params, kv_tail=got.tail())
    # computes only the prompt's last token, then decodes

Names load on first use: the router's modules (selection, admission, prefix_tree) import
this package without loading torch.
"""

_WHERE = {
    "InMemoryKVConnector": "connector", "KVConnector": "connector",
    "SocketKVConnector": "connector", "available_transports": "connector",
    "create_connector": "connector", "register_transport": "connector",
    "export_prefix": "kv_export", "export_request": "kv_export",
    "ImportResult": "kv_import", "NotEnoughKVBlocks": "kv_import",
    "check_transfer": "kv_import", "import_prefix": "kv_import",
    "ImportPlan": "kv_import", "StagedImports": "kv_import", "write_import": "kv_import",
    "KVLayout": "kv_transfer", "KVTransfer": "kv_transfer", "KVTransferError": "kv_transfer",
    "KVTransferMismatch": "kv_transfer",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f".{_WHERE[name]}", __name__), name)
