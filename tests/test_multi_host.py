"""Pipeline ranks on other "hosts": network namespaces joined by veth pairs, each with its own address, running the
server and the stage ranks exactly as docs/scaling-out.md's several-host lines say (env rendezvous, gloo over the links).
Two pipeline stages or two tensor-parallel ranks, one per host: greedy tokens equal one process's; a rank killed (its host gone) makes the server answer 503 until the ranks come
back; a rank whose driver goes away exits with one line and status 0. Ranks also start under torchrun.

Needs root and `ip` (iproute2): CI has both; elsewhere the namespace test skips, saying why."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import free_port

from engine import LLM, SamplingParams

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL = ("--model", "dummy:tiny", "--dtype", "float32", "--num-threads", "1")
PROMPTS = [[5, 17, 42, 99, 7], [3, 3, 3], [100, 200, 300, 400, 500, 600, 700, 800], [11]]
MAX_TOKENS = 12
SUBNET = "10.231.0"  # the "hosts'" network: the server's host is .1, the ranks' .2 and .3
HTTP = ("10.231.9.1", "10.231.9.2")  # the test's side and the server's side of the link clients use
MASTER_PORT = "29533"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def hosts():
    """Three namespaces ("server", "a", "b") on one bridge, plus a link from this namespace to the server's."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2) to make network namespaces")
    tag = str(os.getpid() % 100000)
    names = {role: f"orc{tag}{role}" for role in ("s", "a", "b")}
    try:
        ip("netns", "add", names["s"])
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot make network namespaces here (root and CAP_SYS_ADMIN needed): {e.stderr.strip()}")
    made = [names["s"]]
    uplink = f"o{tag}h"
    try:
        for role in ("a", "b"):
            ip("netns", "add", names[role])
            made.append(names[role])
        for ns in made:
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", names["s"], "link", "add", "br0", "type", "bridge")
        ip("-n", names["s"], "addr", "add", f"{SUBNET}.1/24", "dev", "br0")
        ip("-n", names["s"], "link", "set", "br0", "up")
        for i, role in enumerate(("a", "b"), start=2):
            ip(
                "link",
                "add",
                "eth0",
                "netns",
                names[role],
                "type",
                "veth",
                "peer",
                "name",
                f"p{role}",
                "netns",
                names["s"],
            )
            ip("-n", names["s"], "link", "set", f"p{role}", "master", "br0", "up")
            ip("-n", names[role], "addr", "add", f"{SUBNET}.{i}/24", "dev", "eth0")
            ip("-n", names[role], "link", "set", "eth0", "up")
        ip("link", "add", uplink, "type", "veth", "peer", "name", "up0", "netns", names["s"])
        ip("addr", "add", f"{HTTP[0]}/30", "dev", uplink)
        ip("link", "set", uplink, "up")
        ip("-n", names["s"], "addr", "add", f"{HTTP[1]}/30", "dev", "up0")
        ip("-n", names["s"], "link", "set", "up0", "up")
        yield names
    finally:
        for ns in made:
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), 9)
        with contextlib.suppress(subprocess.CalledProcessError):
            ip("link", "del", uplink)
        for ns in made:
            with contextlib.suppress(subprocess.CalledProcessError):
                ip("netns", "del", ns)


def in_ns(ns: str, env: dict[str, str], *cmd: str, log: Path) -> subprocess.Popen:
    """`cmd` on that "host", with `env` (and nothing of this machine's rendezvous variables)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    with open(log, "ab") as out:
        return subprocess.Popen(
            ["ip", "netns", "exec", ns, "env", *(f"{k}={v}" for k, v in env.items()), *cmd],
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=clean,
        )


def start_rank(hosts, role: str, rank: int, log: Path) -> subprocess.Popen:
    env = {"RANK": str(rank), "WORLD_SIZE": "3", "MASTER_ADDR": f"{SUBNET}.1", "MASTER_PORT": MASTER_PORT}
    return in_ns(hosts[role], env, sys.executable, "-m", "engine.parallel.stage", log=log)


def completions(url: str) -> list[str]:
    return [
        httpx.post(
            f"{url}/v1/completions",
            timeout=120,
            json={"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
        ).json()["choices"][0]["text"]
        for p in PROMPTS
    ]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
        time.sleep(0.25)


@pytest.fixture(scope="module")
def reference() -> list[str]:
    with LLM(model="dummy:tiny", dtype="float32", num_threads=1) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return [o.text for o in outs]


@pytest.mark.parametrize("grid", [("--pipeline-stages", "2"), ("--tensor-parallel-size", "2")], ids=["pp2", "tp2"])
def test_ranks_on_other_hosts_give_one_process_s_tokens_and_the_server_survives_a_lost_host(
    hosts, reference, tmp_path, grid
):
    log = tmp_path / "server.log"
    port = "8077"
    server = in_ns(
        hosts["s"],
        {"MASTER_ADDR": f"{SUBNET}.1", "MASTER_PORT": MASTER_PORT},
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--host",
        HTTP[1],
        "--port",
        port,
        *MODEL,
        *grid,
        "--external-stages",
        log=log,
    )
    url = f"http://{HTTP[1]}:{port}"
    rank_logs = [tmp_path / "rank1.log", tmp_path / "rank2.log"]
    ranks = [start_rank(hosts, "a", 1, rank_logs[0]), start_rank(hosts, "b", 2, rank_logs[1])]
    try:
        wait_healthy(url, server, log)
        assert completions(url) == reference
        # Rank 2's host goes away (every process in its namespace killed): the engine fails, in-flight work ends with
        # an error, the server answers 503, and the surviving rank, its driver gone, leaves with one line and 0.
        for pid in subprocess.run(["ip", "netns", "pids", hosts["b"]], capture_output=True, text=True).stdout.split():
            os.kill(int(pid), 9)
        deadline = time.monotonic() + 60
        while (
            r := httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=60)
        ).status_code != 503:
            assert r.status_code == 200 and time.monotonic() < deadline, r.text
            time.sleep(0.2)
        assert r.json()["error"]["type"] == "service_unavailable_error"
        code = ranks[0].wait(timeout=60)
        if grid[0] == "--pipeline-stages":  # rank 1 was waiting for its driver's next frame
            lines = rank_logs[0].read_text(errors="replace")
            assert code == 0 and "Traceback" not in lines, lines[-3000:]
            assert lines.count("orcinus stage rank 1: lost the connection to rank 0") == 1, lines[-3000:]
        # (Under tensor parallelism rank 1 may meet its dead peer first, in an all-reduce: an error of its own.)
        # The ranks come back (as a cluster's supervisor would start them again): the server serves again.
        ranks = [start_rank(hosts, "a", 1, rank_logs[0]), start_rank(hosts, "b", 2, rank_logs[1])]
        wait_healthy(url, server, log)
        assert completions(url) == reference
    finally:
        server.terminate()
        server.wait(timeout=60)
    # The server stopped: its ranks shut down with it, cleanly.
    assert [r.wait(timeout=60) for r in ranks] == [0, 0]


DRIVER = """
import json, sys
from engine import LLM, SamplingParams
llm = LLM(model="dummy:tiny", dtype="float32", num_threads=1, pipeline_stages=2, external_stages=True)
outs = llm.generate(json.loads(sys.argv[1]), SamplingParams(max_tokens=int(sys.argv[2]), temperature=0, ignore_eos=True))
print(json.dumps([o.text for o in outs]))
"""  # and exits without llm.close(): the driver still stops its ranks at exit


def test_ranks_start_under_torchrun_and_leave_quietly_when_the_driver_is_dropped(reference, tmp_path):
    port = free_port()
    log = tmp_path / "torchrun.log"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    with open(log, "wb") as out:
        torchrun = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                "-m",
                "engine.parallel.stage",
                "--driver",
                f"127.0.0.1:{port}",
            ],
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        driver = subprocess.run(
            [sys.executable, "-c", DRIVER, json.dumps(PROMPTS), str(MAX_TOKENS)],
            cwd=REPO_ROOT,
            env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert driver.returncode == 0, driver.stderr[-3000:]
        assert json.loads(driver.stdout.splitlines()[-1]) == reference
        assert torchrun.wait(timeout=60) == 0, log.read_text(errors="replace")[-3000:]
    finally:
        torchrun.kill()
    text = log.read_text(errors="replace")
    assert "Traceback" not in text and "Connection closed" not in text, text[-3000:]
