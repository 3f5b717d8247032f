"""The local servers the bench starts (ours and vLLM's): a free port, and waiting until one
answers /health (or saying why it did not start, from the tail of its log)."""

from __future__ import annotations

import subprocess
import time

from ..errors import LeapDecodeError


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log_path: str, limit_s: float = 900) -> None:
    import httpx

    deadline = time.time() + limit_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise LeapDecodeError(f"the server did not start: {tail(log_path)}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)
    raise LeapDecodeError(f"the server did not answer /health within {limit_s:.0f} s")


def tail(path: str, chars: int = 2000) -> str:
    with open(path) as f:
        return f.read()[-chars:]
