"""A server under test as a child process on a loopback port: start, wait healthy, stop."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import httpx

from .errors import BenchmarkError


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """Runs `cmd` (which must listen on `port`), logging to `log`; a context manager."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path,
                 env: dict | None = None, startup_timeout: float = 900.0) -> None:
        self.name, self.cmd, self.port, self.log = name, cmd, port, log
        self.env = dict(os.environ, **(env or {}))
        self.startup_timeout = startup_timeout
        self.base = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def __enter__(self) -> "ServerProcess":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._out = open(self.log, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._out, stderr=subprocess.STDOUT,
                                     env=self.env)
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                self._close()
                tail = self.log.read_text(errors="replace")[-2000:]
                raise BenchmarkError(f"{self.name} exited with {self.proc.returncode} while "
                                     f"starting; last output:\n{tail}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise BenchmarkError(f"{self.name} did not become healthy in "
                                     f"{self.startup_timeout:.0f}s; see {self.log}")
            time.sleep(0.5)

    def _close(self) -> None:
        if not self._out.closed:
            self._out.close()

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close()
