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
    """A log's last `chars`, led by the first error line above them (a server's traceback
    often ends in a wrapper's error, the cause dozens of lines up)."""
    import re

    with open(path, errors="replace") as f:
        text = f.read()
    end = text[-chars:]
    causes = [
        line.strip()
        for line in text[: len(text) - len(end)].splitlines()
        if re.match(r"\s*(\(.*?\)\s*)?([\w.]*(Error|Exception)): ", line)
    ]
    return f"{causes[0]}\n...\n{end}" if causes and causes[0] not in end else end
