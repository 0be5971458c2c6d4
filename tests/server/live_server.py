"""A real `qserve serve` process for tests (loopback only)."""

import os


class LiveServer:
    """`qserve serve` as a real process on a free loopback port, with tiny-model settings.

    Use as a context manager; `base` is the URL, `output` the process's combined output
    once it has stopped."""

    TINY_ARGS = ["--served-model-name", "tiny", "--dtype", "fp32", "--threads", "1",
                 "--kv-cache-gib", "0.002", "--kv-dtype", "bf16", "--max-num-batched-tokens",
                 "64", "--decode-impl", "eager"]

    def __init__(self, model_dir, api_key: str | None = None,
                 args: list[str] | None = None) -> None:
        """args: serve options replacing the tiny-model settings (TINY_ARGS)."""
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
        self.env.pop("QSERVE_API_KEY", None)
        if api_key is not None:
            self.env["QSERVE_API_KEY"] = api_key
        self.model_dir = model_dir
        self.args = self.TINY_ARGS if args is None else list(args)
        self.output = ""

    def __enter__(self) -> "LiveServer":
        import subprocess
        import sys
        import time

        import httpx

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qserve.runtime.cli", "serve", str(self.model_dir),
             "--host", "127.0.0.1", "--port", str(self.port), *self.args,
             "--log-level", "warning"],
            env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise AssertionError("server did not come up")
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        import subprocess

        self.proc.terminate()
        try:
            self.output, _ = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.output, _ = self.proc.communicate()
