"""What the benchmark scripts share: `orcinus serve` started and stopped on a free loopback port, its /metrics read,
JSON reports written whole, and the provenance every report records (command, commit, machine, date)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent  # the checkout: bench/ sits at its top


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(
    flags: list[str], log=subprocess.DEVNULL, timeout: float = 300, env: dict[str, str] | None = None, root: Path = ROOT
) -> tuple[subprocess.Popen, str]:
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


def serve_flags(args, *names: str) -> list[str]:
    """`--name value` for each of the script's options `names` (argparse dests) that is set: the limits a comparison
    gives each of its servers alike."""
    return [
        word
        for name in names
        if getattr(args, name, None)
        for word in (f"--{name.replace('_', '-')}", str(getattr(args, name)))
    ]


@contextlib.contextmanager
def served(flags: list[str], log: Path | None = None, stop_timeout: float = 60, **launch) -> Iterator[str]:
    """`launch_server(flags, **launch)` for a with-block, yielding its URL, its output into the file `log` if given;
    stopped however the block leaves."""
    with contextlib.ExitStack() as stack:
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            launch["log"] = stack.enter_context(log.open("w"))
        proc, url = launch_server(flags, **launch)
        try:
            yield url
        finally:
            stop_server(proc, stop_timeout)


@contextlib.contextmanager
def served_all(
    variants: dict[str, list[str]], log: Callable[[str], Path] | None = None, **kwargs
) -> Iterator[dict[str, str]]:
    """One server per name, all up at once (a comparison alternates between them): yields {name: URL}; every one
    started is stopped on leaving, a later one failing to start included. `log(name)`: where its output goes."""
    with contextlib.ExitStack() as stack:
        yield {
            name: stack.enter_context(served(flags, log(name) if log else None, **kwargs))
            for name, flags in variants.items()
        }


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


def write_json(path: str | Path, data) -> None:
    """Replace `path` with `data` as JSON atomically (a temporary file beside it, then a rename): a reader,
    or an archive taken at any moment, sees the previous whole report or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def write_report(path: str | Path, data: dict) -> None:
    """`write_json` of a benchmark's report with its provenance: keys the report sets itself (a richer `machine`,
    say) stay as they are, the rest of `provenance()` is filled in, so no result lacks its command, commit,
    machine and date."""
    write_json(path, {**provenance(), **data})


def command() -> str:
    """This process's command line as it can be typed again: `python -m bench.<group>.<name> ARGS` for a module."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    argv = ["python", "-m", spec.name, *sys.argv[1:]] if spec is not None else sys.argv
    return " ".join(shlex.quote(a) for a in argv)


def provenance() -> dict[str, str]:
    return {
        "command": command(),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "machine": subprocess.run(["uname", "-srm"], capture_output=True, text=True).stdout.strip(),
        "cpu": cpu(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def cpu() -> str:
    """The CPU's model and widest vector set: these machines are one of several kinds, and the kernels differ."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in info.splitlines())}
    flags = set(fields.get("flags", "").split())
    vector = next((v for v in ("avx512_vnni", "avx512f", "avx2") if v in flags), "no avx2")
    return f"{fields.get('model name', '?')}, {vector}" + (", amx" if "amx_int8" in flags else "")
