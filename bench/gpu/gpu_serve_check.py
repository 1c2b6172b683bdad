"""The served GPU path end to end: `orcinus serve --model dummy:llama-1b` answers the OpenAI SDK (streaming
and not) and a short closed-loop `bench_serving.py`; then the grid on one GPU: 2 pipeline stages give the
tokens of one stage (both eager: a partial stage never replays graphs, and graphs' padded bf16 GEMMs round
apart), and 2 tensor-parallel ranks those of one process in float32 (their all-reduce sums in another
order, so only near-ties of random weights may differ: reported, not required).
Part of `bench/gpu/gpu_check.sh OUT --long`. The JSON is rewritten after every section, so a run cut off keeps
what it checked.

    python -m bench.gpu.gpu_serve_check --out serve.json
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from bench.common import ROOT, launch_server, stop_server, write_report

MODEL = "dummy:llama-1b"


def check_sdk(url: str) -> dict:
    """Completions through the OpenAI SDK, whole and streamed. A dummy model has no tokenizer, so the
    prompt is token ids (the API allows that) and there is no chat template to try."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    prompt = [(31 * i) % 1000 + 1 for i in range(24)]
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    streamed = [
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True)
    ]
    return {
        "completion": whole.choices[0].text,
        "streamed_equals_whole": "".join(streamed) == whole.choices[0].text,
        "stream_chunks": len(streamed),
        "completion_tokens": whole.usage.completion_tokens,
        "finish_reason": whole.choices[0].finish_reason,
    }


def check_grid(layout: dict, **config) -> dict:
    """Greedy tokens of one process vs the `layout` (pipeline_stages / tensor_parallel_size) on cuda:0."""
    from engine import LLM, SamplingParams

    prompts = [[(7 * i + j) % 1000 + 1 for j in range(20 + 13 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = []
    for grid in ({}, layout):
        with LLM(MODEL, device="cuda", kv_cache_memory=2**30, **grid, **config) as llm:
            outputs.append([c.token_ids for c in llm.generate(prompts, params)])
    return {"identical": sum(a == b for a, b in zip(*outputs)), "prompts": len(prompts), **layout, **config}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/gpu/serve.json")
    args = ap.parse_args()
    report = {"complete": False}

    def save() -> None:
        write_report(args.out, report)

    save()
    server_log = Path(args.out).with_suffix(".server.log").open("w")
    proc, url = launch_server(["--model", MODEL, "--served-model-name", MODEL, "--max-num-seqs", "64"], log=server_log)
    try:
        report["sdk"] = check_sdk(url)
        save()
        print("sdk", report["sdk"], flush=True)
        bench = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.serving.bench_serving",
                "--base-url",
                url,
                "--model",
                MODEL,
                "--num-prompts",
                "64",
                "--max-concurrency",
                "32",
                "--out",
                str(Path(args.out).with_suffix(".bench.json")),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        report["bench_serving"] = {"exit": bench.returncode, "tail": bench.stdout[-1500:] + bench.stderr[-500:]}
        save()
        print(report["bench_serving"]["tail"], flush=True)
    finally:
        report["shm_left"] = stop_server(proc)
    save()
    report["pipeline_2_stages"] = check_grid({"pipeline_stages": 2}, enforce_eager=True)
    save()
    print("pipeline", report["pipeline_2_stages"], flush=True)
    report["tensor_parallel_2"] = check_grid({"tensor_parallel_size": 2}, dtype="float32")
    print("tensor parallel", report["tensor_parallel_2"], flush=True)
    report["complete"] = True
    save()
    ok = (
        report["sdk"]["streamed_equals_whole"]
        and report["sdk"]["completion_tokens"] == 16
        and report["bench_serving"]["exit"] == 0
    )
    return 0 if ok and report["pipeline_2_stages"]["identical"] == report["pipeline_2_stages"]["prompts"] else 1


if __name__ == "__main__":
    sys.exit(main())
