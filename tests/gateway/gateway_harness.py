"""A gateway in front of fake backends, each a real uvicorn server on a free loopback port
(streams, disconnects and timeouts behave as on a network)."""

import contextlib
import random

from fake_backend import FakeBackend, ServerThread

from qserve.runtime.gateway.app import create_gateway_app
from qserve.runtime.gateway.config import parse_config
from qserve.runtime.gateway.state import GatewayState

__all__ = ["FakeBackend", "running_gateway", "pair_config"]


@contextlib.contextmanager
def running_gateway(config: dict, backends: dict[str, FakeBackend], environ=None,
                    trace_path=None, version_refresh_s=None):
    """Start every fake backend, then a gateway whose config's backend URLs point at them
    (a backend entry's url may be left out; it is filled in by name)."""
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(ServerThread(b.app)) for name, b in backends.items()}
        cfg = dict(config)
        cfg["backends"] = [dict(b, url=b.get("url") or urls[b["name"]])
                           for b in config["backends"]]
        if trace_path is not None:
            cfg["trace"] = dict(cfg.get("trace") or {}, path=str(trace_path))
        state = GatewayState(parse_config(cfg, environ or {}), rng=random.Random(0))
        if version_refresh_s is not None:
            state.version_refresh_s = version_refresh_s
        url = stack.enter_context(ServerThread(create_gateway_app(state)))
        yield url, state


def pair_config(**extra) -> dict:
    cfg = {"backends": [{"name": "a", "models": ["m"],
                         "timeouts": {"first_token": 1.0, "total": 5}},
                        {"name": "b", "models": ["m"],
                         "timeouts": {"first_token": 1.0, "total": 5}}],
           "groups": [{"name": "small", "backends": ["a", "b"], "model": "m",
                       "aliases": ["fast"]}],
           "retries": {"max_attempts": 3, "base_delay": 0.01, "max_delay": 0.05}}
    cfg.update(extra)
    return cfg
