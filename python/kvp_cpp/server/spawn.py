"""Running ``python -m kvp_cpp.server`` in a child process on a free loopback port (tests, benchmarks)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``with ServerProcess(["--kv-budget", "128"]) as server:`` ... ``server.url`` is ``http://127.0.0.1:PORT``.

    The server's output goes to ``log_path`` (or is discarded); ``env`` replaces the environment (say, to select
    the patched llama.cpp). ``pid`` identifies the child for memory readings.
    """

    def __init__(self, args: List[str], log_path: Optional[str] = None, timeout: float = 120.0,
                 env: Optional[Dict[str, str]] = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "kvp_cpp.server", "--port", str(self.port)] + list(args)
        self.log_path = log_path
        self.timeout = timeout
        self.env = env
        self.process: Optional[subprocess.Popen] = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def __enter__(self) -> "ServerProcess":
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        deadline = time.monotonic() + self.timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.process.returncode}: {self.args}")
            try:
                self.get("/v1/models")
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    raise TimeoutError(f"the server did not answer within {self.timeout} s")
                time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def get(self, path: str) -> Dict[str, Any]:
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return json.load(response)

    def post(self, path: str, body: Dict[str, Any]) -> Dict[str, Any]:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.load(response)

    def rss_bytes(self) -> int:
        """The server process's resident memory (VmRSS)."""
        with open(f"/proc/{self.pid}/status") as status:
            line = next(line for line in status if line.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024


def environment_threads() -> List[str]:
    """``--n_threads``/``--n_threads_batch`` flags leaving one CPU to the client and whatever else runs: llama.cpp's
    threads spin at barriers, and a generation slows down several-fold when one of them is descheduled (on 2 busy
    cores, 2 threads took 3.5 times as long as 1)."""
    n = str(max(1, (os.cpu_count() or 2) - 1))
    return ["--n_threads", n, "--n_threads_batch", n]
