"""Prefill/decode disaggregation: moving a request's KV blocks between two engines.

    transfer = export_prefix(prefill_engine, prompt_ids)   # after the prompt was computed
    connector.send("r1", transfer)                          # runtime/disagg/connector.py
    import_prefix(decode_engine, connector.recv("r1", timeout=30))
    decode_engine.add_request("r1", prompt_ids, params)    # its full blocks hit the cache
"""

from .connector import (
    InMemoryKVConnector,
    KVConnector,
    SocketKVConnector,
    available_transports,
    create_connector,
    register_transport,
)
from .kv_export import export_prefix
from .kv_import import ImportResult, NotEnoughKVBlocks, check_transfer, import_prefix
from .kv_transfer import KVLayout, KVTransfer, KVTransferError, KVTransferMismatch

__all__ = [
    "ImportResult",
    "InMemoryKVConnector",
    "KVConnector",
    "KVLayout",
    "KVTransfer",
    "KVTransferError",
    "KVTransferMismatch",
    "NotEnoughKVBlocks",
    "SocketKVConnector",
    "available_transports",
    "check_transfer",
    "create_connector",
    "export_prefix",
    "import_prefix",
    "register_transport",
]
