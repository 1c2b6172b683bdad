"""Shared fixtures: the default model loaded once, the transformers reference loaded once, live gateway servers."""

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.common import parse_metrics  # noqa: F401 - the tests' too: one reading of /metrics
from engine.core.request import Request, SampledTokens
from engine.core.sampling_params import SamplingParams
from engine.model.loader import load_checkpoint
from engine.model.model_files import GGUFReader, default_model_path

# Reference and engine share the 2 cores; fewer threads than cores avoids oversubscription stalls.
torch.set_num_threads(2)


def pytest_addoption(parser):
    parser.addoption("--gpu", action="store_true", help="run the GPU tests (marked `gpu`) on the GPU, and only them")
    parser.addoption("--screenshots", default=None, help="also save the browser tests' screenshots in this folder")
    parser.addoption(
        "--require-browser",
        action="store_true",
        help="fail, rather than skip, the browser tests where Chromium or its driver is missing (CI)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; runs only with --gpu")
    if not config.getoption("--gpu"):
        # The other tests compare float32 CPU results with references: engines (and the servers they
        # start) must not pick a GPU in bfloat16 just because one is there. Set before CUDA initialises.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_modifyitems(config, items):
    gpu = config.getoption("--gpu")
    for item in items:
        is_gpu_test = item.get_closest_marker("gpu") is not None
        if is_gpu_test and not gpu:
            item.add_marker(pytest.mark.skip(reason="GPU test: run `pytest --gpu` on a machine with a GPU"))
        elif gpu and not is_gpu_test:
            item.add_marker(pytest.mark.skip(reason="CPU test: run without --gpu"))
        elif gpu and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="--gpu given, but torch sees no CUDA GPU here"))


# Prompts shared by the engine tests: prose, code, numbers, a chat turn.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "List three colors:",
    "1, 2, 3, 4, 5,",
    "Translate to French: good morning",
    "Q: What is 12 * 12?\nA:",
    "The quick brown fox",
    "In machine learning, a transformer is",
    "import numpy as np\nx = np.",
    "My favourite food is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]


def run_staggered(engine, prompt_ids: list[list[int]], params) -> list:
    """One request arrives per iteration, joining those already running; returns the finished Requests.
    Afterwards every KV block must be free again."""
    pending, requests = list(prompt_ids), []
    while pending or engine.has_unfinished():
        if pending:
            requests.append(engine.add_request(pending.pop(0), params))
        engine.step()
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks
    return requests


class ByHidden:
    """A length predictor that reads the remaining length off the probe's first value (the test writes it there)."""

    def predict(self, hidden, num_output_tokens):
        return hidden[0] - num_output_tokens

    def observe(self, probes, num_output_tokens):
        pass

    def save(self):
        pass


def decode_ready(s, lengths: dict[str, int]) -> None:
    """Admit and prefill one request per entry on Scheduler `s`, each probed (ByHidden) at its length."""
    for rid, n in lengths.items():
        s.add(Request(rid, [1, 2, len(rid), n], SamplingParams(max_tokens=n, ignore_eos=True), arrival_time=0.0))
    while s.waiting:
        batch = s.schedule()
        s.update(
            batch,
            {
                r.request_id: SampledTokens([7], hidden=[float(lengths[r.request_id])] if r.probe else None)
                for r in batch.requests
            },
        )


def wait_for_metrics(fetch, pred, timeout: float, what: str) -> dict[str, float]:
    """Poll `fetch()` (parsed /metrics) until `pred` holds; fail with `what` and the orcinus series otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        m = fetch()
        if pred(m):
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout}s: { {k: v for k, v in m.items() if k.startswith('orcinus_')} }")
        time.sleep(0.1)


@pytest.fixture(scope="session")
def checkpoint():
    return load_checkpoint(None)


@pytest.fixture(scope="session")
def tokenizer(checkpoint):
    return checkpoint.tokenizer


@contextlib.contextmanager
def fast_gguf_reader():
    """transformers' GGUF model load, 33 -> 7 s here: it opens the file with gguf's reader, which parses the
    tokenizer's ~100k strings one by one (~5 s a time, three times a load; ours reads the same fields, test_model
    checks it), and builds gguf's tensor-name map, a pure function of the architecture, once per module (~10 s)."""
    import gguf

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", GGUFReader)
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="session")
def hf_tokenizer():
    """transformers' tokenizer from the default GGUF, converted once. Deep-copy it to change it."""
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    with fast_gguf_reader():
        return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def hf_model():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    with fast_gguf_reader():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()


# ---------------------------------------------------------------- the HTTP gateway (tests/test_gateway*.py)

SHM_DIR = Path("/dev/shm")
REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shm_segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob("orcinus_*")}


def unlinked_rings(pid: int) -> set[str]:
    """The orcinus rings process `pid` maps whose names are gone from /dev/shm (the kernel says "(deleted)")."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return set()
    return {
        line.split("/dev/shm/")[1].split()[0]
        for line in maps
        if "/dev/shm/orcinus_" in line and line.endswith("(deleted)")
    }


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    """Running, and not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def start_server(log_dir: Path, *args: str, startup_timeout: float = 120.0) -> tuple[subprocess.Popen, str, Path]:
    """`orcinus serve *args` on a free loopback port, its output in a log under `log_dir`: returns the process, its
    base URL and the log once /health is 200 (the test fails with the log's tail, the server killed, if it is not)."""
    import httpx

    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), *args],
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with code {proc.returncode} while starting:\n{_tail(log_path)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url, log_path
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.fail(f"the server was not healthy within {startup_timeout:.0f}s:\n{_tail(log_path)}")
        time.sleep(0.1)


def _tail(log_path: Path) -> str:
    return log_path.read_text(errors="replace")[-4000:]


@contextlib.contextmanager
def run_server(log_dir: Path, *args: str, startup_timeout: float = 120.0):
    """`orcinus serve` on a free loopback port: yields its base URL once /health is 200; on exit
    SIGTERMs it and checks that none of the shared-memory segments it created remain."""
    before = _shm_segments()
    # The served defaults (float32 on the GGUF's own blocks, on the CPU): what a user runs.
    proc, url, log_path = start_server(log_dir, "--max-num-seqs", "64", *args, startup_timeout=startup_timeout)
    try:
        # The gateway (this pid) creates the rings, named orcinus_<its pid>_<random>, and unlinks their names once
        # the engine has attached: the engine maps them still, and a kill -9 of either process leaves nothing.
        named = {n for n in _shm_segments() - before if n.startswith(f"orcinus_{proc.pid}_")}
        assert not named, f"the rings of a ready server still have names: {sorted(named)}"
        children = _children(proc.pid)  # the engine process (and multiprocessing's resource tracker)
        assert children, "the server has no engine process"
        assert any(unlinked_rings(c) for c in children), f"no engine of the server maps an orcinus_{proc.pid}_* ring"
        assert f"  chat page       {url}/" in log_path.read_text(errors="replace"), "no startup block:\n" + _tail(
            log_path
        )
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                pytest.fail(f"the server did not exit within 60s of SIGTERM:\n{_tail(log_path)}")
    leaked = {n for n in _shm_segments() - before if n.startswith(f"orcinus_{proc.pid}_")}
    assert not leaked, f"shared-memory segments left behind by the server: {sorted(leaked)}"
    # uvicorn re-raises the SIGTERM it handled once shutdown is done, so -SIGTERM is a clean exit too.
    assert proc.returncode in (0, -signal.SIGTERM), f"the server exited with code {proc.returncode}:\n{_tail(log_path)}"
    assert "Application shutdown complete" in log_path.read_text(errors="replace"), _tail(log_path)
    deadline = time.monotonic() + 10
    while (alive := [c for c in children if _alive(c)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"the server's child processes {alive} outlived it"


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory):
    """`with server_factory("--api-key", "k") as url:` starts an extra server for a module's tests."""
    log_dir = tmp_path_factory.mktemp("servers")
    return lambda *args: run_server(log_dir, *args)


@pytest.fixture(scope="session")
def server(server_factory):
    """One gateway (default model, `--max-num-seqs 64`) shared by every gateway test; yields its base URL."""
    with server_factory() as url:
        yield url


@pytest.fixture(scope="session")
def client(server):
    """The OpenAI SDK on the shared server."""
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="session")
def model(client):
    """The model name the shared server serves."""
    return client.models.list().data[0].id
