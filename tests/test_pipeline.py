"""Pipeline-parallel stages over torch.distributed (gloo on CPU): same tokens for 1, 2 and 3 stages,
batches in flight, stages on separate "hosts" via env rendezvous, and a dead stage failing fast."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import PROMPTS as ALL_PROMPTS
from conftest import free_port
from conftest import run_staggered as run_arrivals

from engine import LLM, SamplingParams
from engine.core.config import EngineConfig
from engine.parallel.pipeline import StageFailedError
from engine.parallel.stage import stage_span
from engine.runner.local_executor import build_model

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ALL_PROMPTS[:11]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "num_layers, num_stages, spans",
    [
        (30, 1, [(0, 30)]),
        (30, 2, [(0, 15), (15, 30)]),
        (30, 4, [(0, 8), (8, 16), (16, 23), (23, 30)]),
        (3, 3, [(0, 1), (1, 2), (2, 3)]),
    ],
)
def test_layers_split_evenly_with_extras_on_the_first_stages(num_layers, num_stages, spans):
    got = [stage_span(num_layers, s, num_stages) for s in range(num_stages)]
    assert [(r.start, r.stop) for r in got] == spans


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="cannot split 3 layers over 4 pipeline stages"):
        stage_span(3, 0, 4)


def test_stage_spans_chained_give_the_whole_models_logits(checkpoint, tokenizer):
    """No processes: the three spans of a split model, run one after the other, equal the whole model."""
    from engine.attention.torch_backend import TorchAttention
    from engine.core.batch import Batch, ScheduledRequest
    from engine.runner.model_runner import ModelRunner

    config = EngineConfig(device="cpu", dtype="float32", kv_cache_memory=8 * 737_280, max_num_batched_tokens=256)
    ids = tokenizer.encode(PROMPTS[2])
    batch = Batch([ScheduledRequest("r", ids, 0, list(range(-(-len(ids) // 16))), True)])
    whole = ModelRunner(config, build_model(checkpoint, 512, config), 8, 512)
    expected = whole.run(batch)
    hidden = None
    for stage in range(3):
        span = stage_span(checkpoint.shape.num_layers, stage, 3)
        runner = ModelRunner(config, build_model(checkpoint, 512, config, span), 8, 512)
        assert len(runner.kv_caches) == len(span) and isinstance(runner.attention, TorchAttention)
        hidden = runner.run(batch, hidden)
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)


def run_staggered(llm: LLM, tokenizer, check_in_flight: bool = False) -> list[list[int]]:
    """One request arrives per iteration; optionally assert no request is in two in-flight batches."""
    engine = llm.engine
    executor = engine.executor
    submit = executor.submit

    def checked_submit(batch, sampling):
        in_flight = {rid for _, b, _ in executor.in_flight for rid in b.request_ids}
        assert not in_flight & set(batch.request_ids)
        submit(batch, sampling)

    if check_in_flight:
        executor.submit = checked_submit
    requests = run_arrivals(engine, [tokenizer.encode(p) for p in PROMPTS], GREEDY)
    assert not engine.scheduler.in_flight
    return [r.output_token_ids for r in requests]


@pytest.fixture(scope="module")
def reference(checkpoint, tokenizer):
    return run_staggered(LLM(checkpoint=checkpoint, dtype="float32"), tokenizer)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_stages_give_the_same_tokens(num_stages, reference, tokenizer):
    with LLM(pipeline_stages=num_stages, dtype="float32") as llm:
        assert llm.engine.executor.max_in_flight == num_stages
        assert run_staggered(llm, tokenizer, check_in_flight=True) == reference
        # Orca: with N stages the scheduler keeps N batches in flight, each request in one of them at most.
        assert llm.engine.max_batches_in_flight == num_stages
        assert not llm.engine.executor.known  # the last stage's sampler was told to release every finished request


def test_stages_started_as_separate_hosts_rendezvous_through_the_environment(reference, tokenizer, monkeypatch):
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "3"}
    stages = [
        subprocess.Popen([sys.executable, "-m", "engine.parallel.stage"], env={**env, "RANK": str(rank)}, cwd=REPO_ROOT)
        for rank in (1, 2)
    ]
    try:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        with LLM(pipeline_stages=2, external_stages=True, num_threads=1, dtype="float32") as llm:
            assert run_staggered(llm, tokenizer) == reference
        assert [p.wait(timeout=30) for p in stages] == [0, 0]  # shut down cleanly by the driver
    finally:
        for p in stages:
            p.kill()


def test_a_dead_stage_fails_the_engine_instead_of_hanging(tokenizer):
    llm = LLM(pipeline_stages=2)
    try:
        engine = llm.engine
        engine.add_request(tokenizer.encode(PROMPTS[0]), SamplingParams(max_tokens=200, ignore_eos=True))
        engine.step()
        os.kill(engine.executor.procs[1].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(StageFailedError, match="pipeline stage 1 .* exited with code -9"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - start < 30  # a liveness bound, not a speed claim: it must not hang
    finally:
        llm.close()


def test_a_request_whose_sampling_raises_on_the_last_stage_fails_alone(checkpoint, tokenizer):
    """A grammar in error (the offline API compiles it on the last stage) and an injected sampling fault fail only
    their requests: the other gets the single process's tokens, every block comes back, the stages go on."""
    from engine.core.config import FaultPlan

    mark = 4321  # in no prompt below
    prompts = [tokenizer.encode(p) for p in PROMPTS[:2]]
    assert not any(mark in p for p in prompts)
    broken = SamplingParams(max_tokens=12, temperature=0.0, grammar="this is not a grammar")
    [reference] = [o.token_ids for o in LLM(checkpoint=checkpoint, dtype="float32").generate(prompts[1:], GREEDY)]
    with LLM(pipeline_stages=2, dtype="float32", faults=FaultPlan(sampler_token=mark)) as llm:
        outs = llm.generate([prompts[0], [mark] + prompts[0], prompts[1]], [broken, GREEDY, GREEDY])
        assert [(o.finish_reason, o.token_ids) for o in outs] == [("error", []), ("error", []), ("length", reference)]
        s = llm.engine.scheduler
        assert s.kv.num_free_blocks == s.kv.num_blocks and not llm.engine.executor.known
        assert [o.token_ids for o in llm.generate(prompts[1:], GREEDY)] == [reference]


def test_a_stage_that_exits_before_it_joins_fails_the_start_instead_of_hanging(monkeypatch):
    """A rank launched here that dies before the rendezvous (killed, or broken at import) never comes: the driver must
    not wait out the world's year-long timeout, and the rank that came is stopped with it."""
    import threading

    from engine.parallel import pipeline

    launched = []

    def launch(self, rank, world, port):
        # Rank 1 stands for a stage that joined and waits; rank 2 for one that died on its way.
        code = "import time; time.sleep(300)" if rank == 1 else "raise SystemExit(3)"
        launched.append(subprocess.Popen([sys.executable, "-c", code]))
        return launched[-1]

    monkeypatch.setattr(pipeline.PipelineExecutor, "_launch", launch)
    raised = []

    def start() -> None:
        try:
            pipeline.PipelineExecutor(EngineConfig(pipeline_stages=2, device="cpu"), 64, None)
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(timeout=60)  # a liveness bound, not a speed claim: without it a regression hangs the suite
    try:
        assert not thread.is_alive(), "the driver still waits for a stage that exited"
        [error] = raised
        assert isinstance(error, StageFailedError)
        assert re.fullmatch(r"pipeline stage 1 \(pid \d+\) exited with code 3 before it joined", str(error)), error
        assert [p.wait(timeout=10) for p in launched] == [-signal.SIGKILL, 3]
    finally:
        for p in launched:
            p.kill()


def test_a_stage_whose_next_stage_is_gone_waits_for_the_driver_instead_of_dying(monkeypatch, capsys):
    """A batch can reach a stage after its next stage's host went away, before the driver has seen it: the send fails,
    and the stage goes back to its driver (which ends the job) instead of exiting with a traceback of its own."""
    from types import SimpleNamespace

    from engine.parallel import stage as stage_module
    from engine.parallel.frames import PendingSends

    def isend(*args, **kwargs):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.231.0.3]:48326.\nmore")

    monkeypatch.setattr(stage_module.dist, "isend", isend)
    stage = object.__new__(stage_module.Stage)
    stage.samples, stage.via_host, stage.rank, stage.next_rank, stage.tensors = False, False, 1, 2, None
    stage.model = SimpleNamespace(is_first=True, is_last=False)
    stage.runner = SimpleNamespace(run=lambda batch, hidden: torch.zeros(3, 8))
    stage.pending = PendingSends()
    stage.step(SimpleNamespace(batch=SimpleNamespace(num_tokens=3)))
    err = capsys.readouterr().err
    assert err.startswith("orcinus stage rank 1: lost the connection to rank 2: ") and err.count("\n") == 1
    assert "Connection closed by peer" in err and err.endswith("; waiting for the driver\n")
    assert stage.pending.items == []


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def test_killing_a_stage_under_the_server_gives_errors_then_503_then_recovers(server_factory):
    with server_factory("--pipeline-stages", "2") as url:
        kill_a_rank_mid_stream_then_recover(url, num_ranks=2)


def kill_a_rank_mid_stream_then_recover(url: str, num_ranks: int) -> None:
    """Kill the server's last stage process while a stream runs: the stream ends with an error event and [DONE],
    the server answers 503 while the engine restarts, then 200 from new stage processes."""
    import httpx

    def rank_pids() -> list[int]:
        return [
            p
            for gateway_child in _children(_server_pid(url))
            for p in _children(gateway_child)
            if "engine.parallel.stage" in _cmdline(p)
        ]

    ranks = rank_pids()
    assert len(ranks) == num_ranks
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))  # tokens are flowing
            os.kill(ranks[-1], signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]  # must end, not hang (30 s read timeout)
        assert rest[-1] == "data: [DONE]"
        assert any('"error"' in line for line in rest[-3:]), rest[-3:]
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "service_unavailable_error"
        deadline = time.monotonic() + 120  # the engine and every rank are started again
        while (r := client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})).status_code == 503:
            assert time.monotonic() < deadline, "the engine did not come back"
            time.sleep(0.5)
        assert r.status_code == 200
        assert len(rank_pids()) == num_ranks and not set(rank_pids()) & set(ranks)


def _server_pid(url: str) -> int:
    port = int(url.rsplit(":", 1)[1])
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            if f"--port {port}" in _cmdline(pid) and "gateway.cli serve" in _cmdline(pid):
                return pid
        except OSError:
            continue
    raise AssertionError(f"no server process listening on port {port}")
