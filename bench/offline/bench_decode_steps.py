"""Median time of a pure decode step at each batch size, for one engine config, in this checkout or another.

`--tree DIR` imports the engine from another checkout (an older commit, for a before/after), so both run the same
measurement: requests of ~10-token prompts (or `--context N` tokens) decode together, a few warm-up steps, then
the median of N timed steps.
Run the two trees alternately and compare medians; on a shared machine use one thread (two threads wait on each
other whenever another process holds a core).

    .venv/bin/python -m bench.offline.bench_decode_steps --threads 1 --batches 1 8 32 --out /tmp/after.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[2]), help="checkout to import from")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=15, help="timed steps per batch size")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=0, help="prompt tokens per request (0: ~10, a short sentence)")
    ap.add_argument(
        "--model", default=None, help="a .gguf, Hugging Face directory or dummy:NAME (default: the bundled)"
    )
    ap.add_argument("--config", default="{}", help='EngineConfig fields as JSON, e.g. \'{"dtype": "bfloat16"}\'')
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    tree = Path(args.tree).resolve()
    spec = importlib.util.find_spec("engine")
    if not args.child and (spec is None or Path(spec.origin).resolve().parents[1] != tree):
        # Another checkout's engine: this script again, in a process that imports from that tree first (a tree
        # from before the script existed still compares).
        env = {**os.environ, "PYTHONPATH": str(tree)}
        rc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--child"], env=env
        ).returncode
        if rc == 0 and args.out:  # the child wrote its measurements: the report's provenance is this process's
            from bench.common import write_report

            write_report(args.out, json.loads(Path(args.out).read_text()))
        return rc
    import torch

    from engine import LLM, SamplingParams
    from engine.model.loader import load_checkpoint

    torch.set_num_threads(args.threads)
    llm = LLM(
        checkpoint=load_checkpoint(args.model),
        num_threads=args.threads,
        max_num_seqs=max(args.batches),
        **json.loads(args.config),
    )
    engine = llm.engine
    result = {}
    for batch in args.batches:
        params = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)  # aborted once timed
        requests = []
        for i in range(batch):
            if args.context:  # distinct ids, so no request's prefix is cached from another's (nor a tokenizer needed)
                prompt = [
                    1000 + (i * 7919 + j * 31) % min(40000, llm.engine.shape.vocab_size - 1000)
                    for j in range(args.context)
                ]
            else:
                prompt = llm.tokenizer.encode(f"The history of the printing press begins {i}")
            requests.append(engine.add_request(prompt, params))
        while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in requests):  # the prefill, maybe in chunks
            engine.step()
        for _ in range(2):  # warm decode steps
            engine.step()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        for r in requests:
            engine.abort_request(r.request_id)
        while engine.has_unfinished():
            engine.step()
        result[batch] = statistics.median(times) * 1e3
        print(f"batch {batch:>3}: {result[batch]:.2f} ms a step", flush=True)
    if args.out:
        report = {"tree": args.tree, "model": args.model, "dtype": engine.config.dtype, "median_step_ms": result}
        if args.child:  # another tree's process, which may lack bench.common: the parent adds the provenance
            Path(args.out).write_text(json.dumps(report))
        else:
            from bench.common import write_report

            write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
