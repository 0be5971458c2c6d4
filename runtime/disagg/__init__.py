"""Prefill/decode disaggregation: moving a request's KV blocks between two engines.

    transfer = export_prefix(prefill_engine, prompt_ids)   # after the prompt was computed
    connector.send("r1", transfer)                          # runtime/disagg/connector.py
    import_prefix(decode_engine, connector.recv("r1", timeout=30))
    decode_engine.add_request("r1", prompt_ids, params)    # its full blocks hit the cache

Names load on first use: the router's modules (selection, admission, prefix_tree) import
this package without loading torch.
"""

_WHERE = {
    "InMemoryKVConnector": "connector", "KVConnector": "connector",
    "SocketKVConnector": "connector", "available_transports": "connector",
    "create_connector": "connector", "register_transport": "connector",
    "export_prefix": "kv_export",
    "ImportResult": "kv_import", "NotEnoughKVBlocks": "kv_import",
    "check_transfer": "kv_import", "import_prefix": "kv_import",
    "KVLayout": "kv_transfer", "KVTransfer": "kv_transfer", "KVTransferError": "kv_transfer",
    "KVTransferMismatch": "kv_transfer",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f".{_WHERE[name]}", __name__), name)
