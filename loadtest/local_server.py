"""Start and stop `orcinus serve` on a free loopback port, for the load-test scripts."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(flags: list[str], log=subprocess.DEVNULL, timeout: float = 300,
                  env: dict[str, str] | None = None, root: Path = ROOT) -> tuple[subprocess.Popen, str]:
    """`orcinus serve --port P *flags` from the checkout `root` (with `env` added to this process's); returns it and
    its URL once healthy."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`orcinus serve {' '.join(flags)}` exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)  # a start takes seconds: polling more coarsely would add up to this much to each
    proc.kill()
    raise RuntimeError(f"`orcinus serve {' '.join(flags)}` was not healthy within {timeout:.0f} s")


def stop_server(proc: subprocess.Popen, timeout: float = 60) -> list[str]:
    """SIGTERM (graceful: in-flight requests finish), then the server's /dev/shm segments still there (should be none)."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return sorted(p.name for p in Path("/dev/shm").glob(f"orcinus_{proc.pid}_*"))


async def chat_chunks(http: httpx.AsyncClient, url: str, body: dict):
    """The parsed SSE chunks of one streamed chat completion; an error status raises."""
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {series: value}; an engine replica's series also summed over replicas, under its name
    without the `replica` label (`orcinus_kv_blocks_used` beside `orcinus_kv_blocks_used{replica="0"}`)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
            if 'replica="' in name:
                total = re.sub(r',?replica="[^"]*"', "", name).replace("{,", "{").replace("{}", "")
                out[total] = out.get(total, 0.0) + float(value)
    return out


def scrape_metrics(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", headers=headers, timeout=30).text)
