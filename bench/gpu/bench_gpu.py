"""The engine on a GPU, with dummy weights of named shapes (the GPU machine has no checkpoint):

(a) greedy tokens identical with CUDA graphs and eager, 32 steps of a mixed prefill/decode batch, in float32
    (in bfloat16 a GEMM at a graph's padded row count rounds differently and flips near-ties of random weights);
(b) decode step time per shape and batch size, eager vs graphs, against the memory-bandwidth floor
    (weight bytes + K/V bytes read per step, over the device copy bandwidth timed with CUDA events);
(c) output tok/s of Orcinus vs transformers `generate` (static batches) on the same weights and the
    Orca workload (input U[32,512], output U[1,128]): a first full run of each system (warm-up, reported
    apart), then --repeats warm runs, medians of those;
(d) the same workload with iteration- vs request-level scheduling at a batch cap below the request count
    (with every request admitted at once both schedulers would run the same schedule), to show the Orca effect.
Systems are interleaved across repeats and medians reported; the table comes last. The JSON at --out is
rewritten after every measured row, so a run stopped by a time limit keeps what it measured.

    python -m bench.gpu.bench_gpu --out benchmarks/results/gpu/bench_gpu.json         # on the GPU machine
    python -m bench.gpu.bench_gpu --device cpu --quick --out /tmp/bench.json   # smoke test anywhere
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import statistics
import sys
import time

import torch

from bench.common import write_report
from engine import SamplingParams
from engine.core.config import DUMMY_SHAPES, EngineConfig, ModelShape
from engine.core.engine_core import EngineCore
from engine.launch import build_engine
from engine.model.loader import load_checkpoint
from engine.runner.cuda_graphs import CudaGraphRunner
from engine.runner.decode_graphs import DecodeGraphRunner
from engine.runner.token_segments import EAGER


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_engine(shape_name: str, args, **overrides) -> EngineCore:
    config = EngineConfig(
        model=f"dummy:{shape_name}",
        device=args.device,
        max_num_seqs=max(max(args.batches), args.requests),
        max_num_batched_tokens=args.token_budget,
        kv_cache_memory=int(args.kv_gib * 2**30),
        speculative="off",  # one token per request per step, as a GPU serves by default: the steps timed are decodes
        # The CPU stand-in mirrors a GPU, whose cache holds the compute dtype (the graphs size activations by it).
        kv_cache_dtype="float32" if args.device == "cpu" else "auto",
    ).with_(**overrides)
    engine = build_engine(config, load_checkpoint(config.model))
    r = engine.runner
    if r.graphs is None and r.device.type == "cpu":
        # Off a GPU the graph runners' CPU stand-ins keep the eager/graphs comparison runnable.
        r.graphs = CudaGraphRunner(engine.model, r.kv_caches, 64, r.scratch_block, r.device, r.dtype)
        r.decode_graphs = DecodeGraphRunner(
            engine.model, r.kv_caches, r.attention, config.max_num_seqs, r.scratch_block, r.device, max_rows=64
        )
    if r.device.type == "cuda":
        assert_gpu_path(engine)
    return engine


def assert_gpu_path(engine: EngineCore) -> None:
    """Fail rather than time a fallback: each of these falls back with a warning only where it cannot build."""
    r = engine.runner
    names = {type(m).__name__ for m in engine.model.modules()}
    missing = [
        what
        for what, ok in (
            ("the CUDA attention backend", type(r.attention).__name__ == "CudaAttention"),
            ("whole-step graphs", r.decode_graphs is not None),
            ("compiled token-wise segments", r.graphs is not None and r.graphs.segments is not EAGER),
            ("the RMSNorm kernel", "CudaRMSNorm" in names),
            ("the RoPE kernel", "CudaRotary" in names),
        )
        if not ok
    ]
    if missing:
        raise RuntimeError(f"not the GPU path meant to be timed, without {', '.join(missing)}: {r.describe()}")


MODES = ("eager", "piecewise", "whole")  # no graphs; token-wise segments only; + whole-step decode graphs


def set_graphs(engine: EngineCore, mode: str, graphs: tuple) -> None:
    """graphs: the runner's (piecewise, decode) graph runners as built."""
    engine.runner.graphs = graphs[0] if mode != "eager" else None
    engine.runner.decode_graphs = graphs[1] if mode == "whole" else None


def graph_runners(engine: EngineCore) -> tuple:
    return engine.runner.graphs, engine.runner.decode_graphs


def capture_cost(engine: EngineCore) -> dict:
    g, d = graph_runners(engine)
    return {
        "piecewise_s": g.capture_seconds if g else None,
        "piecewise_mib": g.capture_bytes / 2**20 if g else None,
        "decode_s": d.capture_seconds if d else None,
        "decode_mib": d.capture_bytes / 2**20 if d else None,
        "graphs": (len(g.buckets) * (len(engine.model.layers) + 1) if g else 0) + (len(d.buckets) if d else 0),
    }


def run_to_completion(engine: EngineCore, workload, stagger: bool = False) -> tuple[list[list[int]], float]:
    """Run every (prompt, max_tokens) to the end; staggered = one arrival per iteration. Returns outputs, seconds."""
    pending = list(workload)
    reqs = []
    t = time.perf_counter()
    if not stagger:
        reqs = [
            engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)) for p, n in pending
        ]
        pending = []
    while pending or engine.has_unfinished():
        if pending:
            p, n = pending.pop(0)
            reqs.append(engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)))
        engine.step()
    elapsed = time.perf_counter() - t
    return [r.output_token_ids for r in reqs], elapsed


def workload(n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    return [
        ([rng.randrange(vocab) for _ in range(rng.randint(*input_len))], rng.randint(*output_len)) for _ in range(n)
    ]


# ---------------------------------------------------------------- (a) graphs == eager


def check_graphs_match_eager(args) -> dict:
    engine = make_engine(args.shapes[0], args, dtype=args.check_dtype)
    graphs = graph_runners(engine)
    work = workload(
        args.check_requests, tuple(args.check_input_len), (args.check_steps,) * 2, engine.shape.vocab_size, 1
    )
    outputs = {}
    for mode in MODES:
        set_graphs(engine, mode, graphs)
        outputs[mode], _ = run_to_completion(engine, work, stagger=True)
    result = {
        "shape": args.shapes[0],
        "dtype": args.check_dtype,
        "requests": len(work),
        "steps": args.check_steps,
        "capture": capture_cost(engine),
        "runner": engine.runner.describe(),
        "steps_by_path": dict(engine.runner.step_paths),
    }
    for mode in MODES[1:]:
        result[mode] = {
            "identical": sum(a == b for a, b in zip(outputs["eager"], outputs[mode])),
            "first_difference_at": [
                next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                for a, b in zip(outputs["eager"], outputs[mode])
            ],
        }
    del engine, graphs
    free_memory()
    return result


# ---------------------------------------------------------------- (b) decode step time vs floor


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s moved by a device-to-device copy (read + write), median of 10 after a warm-up.

    On a GPU each copy is timed by CUDA events around it: host timing adds the launch and the sync,
    which understates a short copy's bandwidth."""
    n = 2**30 if device.type == "cuda" else 2**25
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(11):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
    del src, dst
    free_memory()
    return 2 * n / statistics.median(times[1:])


def floor_seconds(shape: ModelShape, dtype: torch.dtype, batch: int, context: int, bandwidth: float) -> float:
    elem = torch.empty((), dtype=dtype).element_size()
    weights = shape.num_params - (0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size)
    kv = batch * context * shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim
    return (weights + kv) * elem / bandwidth


def decode_step_times(args, bandwidth: float, rows: list[dict], save) -> None:
    """Append a row per (shape, batch) to `rows`, calling save() after each."""
    for shape_name in args.shapes:
        engine = make_engine(shape_name, args)
        graphs = graph_runners(engine)
        capture = capture_cost(engine)
        print(f"(b) {shape_name}: capture {capture}", flush=True)
        for batch in args.batches:
            prompt_len = args.decode_context
            # Enough tokens that nobody finishes: timed + warm-up + those decoded while others still prefill.
            budget = engine.config.max_num_batched_tokens
            steps = args.steps * len(MODES) * args.repeats + len(MODES) + batch * prompt_len // budget + 8
            for i in range(batch):
                ids = [(7 * i + j) % engine.shape.vocab_size for j in range(prompt_len)]
                engine.add_request(ids, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
            while engine.scheduler.num_waiting or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
            ):
                engine.step()  # prefill everything first: only pure decode steps are timed
            samples = {mode: [] for mode in MODES}
            for mode in MODES:  # warm-up
                set_graphs(engine, mode, graphs)
                engine.step()
            for _ in range(args.repeats):
                for mode in MODES:  # interleaved, so drift hits all alike
                    set_graphs(engine, mode, graphs)
                    for _ in range(args.steps):
                        t = time.perf_counter()
                        engine.step()  # ends with the host read of the sampled ids: timed to completion
                        samples[mode].append(time.perf_counter() - t)
                        assert engine.last_batch_size == batch
            context = prompt_len + args.steps * args.repeats + 1
            floor = floor_seconds(engine.shape, engine.runner.dtype, batch, context, bandwidth)
            med = {m: statistics.median(v) for m, v in samples.items()}
            rows.append(
                {
                    "shape": shape_name,
                    "batch": batch,
                    "context": context,
                    "capture": capture,
                    "runner": engine.runner.describe(),
                    "eager_ms": med["eager"] * 1e3,
                    "piecewise_ms": med["piecewise"] * 1e3,
                    "graphs_ms": med["whole"] * 1e3,
                    "floor_ms": floor * 1e3,
                    "graph_speedup": med["eager"] / med["whole"],
                    "graphs_over_floor": med["whole"] / floor,
                }
            )
            save()
            print(
                f"(b) {shape_name} batch {batch}: eager {rows[-1]['eager_ms']:.2f} ms, piecewise "
                f"{rows[-1]['piecewise_ms']:.2f} ms, whole-step graphs {rows[-1]['graphs_ms']:.2f} ms, "
                f"floor {rows[-1]['floor_ms']:.2f} ms",
                flush=True,
            )
            for r in list(engine.scheduler.running):
                engine.abort_request(r.request_id)
        set_graphs(engine, "whole", graphs)
        del engine, graphs
        free_memory()


# ---------------------------------------------------------------- (c), (d) throughput


def hf_model_from(engine: EngineCore):
    """A transformers Llama with the engine's (dummy) weights, un-fused back to Hugging Face names."""
    from transformers import LlamaConfig, LlamaForCausalLM

    s = engine.shape
    config = LlamaConfig(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        rope_theta=s.rope_theta,
        rms_norm_eps=s.rms_norm_eps,
        max_position_embeddings=s.max_position,
        tie_word_embeddings=s.tie_word_embeddings,
    )
    m = engine.model
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    state = {
        "model.embed_tokens.weight": m.embed_tokens.weight,
        "model.norm.weight": m.norm.weight,
        "lm_head.weight": m.lm_head.weight,
    }
    for i, layer in enumerate(m.layers):
        p = f"model.layers.{i}."
        wq, wk, wv = layer.qkv_proj.weight.split([q, kv, kv])
        gate, up = layer.gate_up_proj.weight.chunk(2)
        state.update(
            {
                p + "input_layernorm.weight": layer.input_layernorm.weight,
                p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
                p + "self_attn.q_proj.weight": wq,
                p + "self_attn.k_proj.weight": wk,
                p + "self_attn.v_proj.weight": wv,
                p + "self_attn.o_proj.weight": layer.o_proj.weight,
                p + "mlp.gate_proj.weight": gate,
                p + "mlp.up_proj.weight": up,
                p + "mlp.down_proj.weight": layer.down_proj.weight,
            }
        )
    with torch.device(engine.runner.device):
        hf = LlamaForCausalLM(config).to(engine.runner.dtype)
    with torch.no_grad():
        hf.load_state_dict(state, strict=True)
    return hf.eval()


def run_transformers(hf, work, batch_size: int, device: torch.device) -> float:
    """Static batches in arrival order, left-padded; each batch runs until its longest request is done."""
    t = time.perf_counter()
    for i in range(0, len(work), batch_size):
        chunk = work[i : i + batch_size]
        width, new = max(len(p) for p, _ in chunk), max(n for _, n in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device=device)
        with torch.no_grad():
            out = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == width + new
    sync(device)
    return time.perf_counter() - t


def throughput(args, result: dict, save) -> None:
    """Fill `result` with (c) and (d), calling save() after every run."""
    shape_name = args.throughput_shape
    # No prefix caching: repeats re-send the same prompts, which would then cost Orcinus (not transformers) nothing.
    engines = {"orcinus": make_engine(shape_name, args, prefix_caching=False)} if "c" in args.parts else {}
    if "d" in args.parts:
        capped = {"max_num_seqs": args.capped_seqs, "prefix_caching": False}
        engines["orcinus_capped"] = make_engine(shape_name, args, **capped)
        engines["orcinus_request_level"] = make_engine(shape_name, args, scheduling="request", **capped)
    first = next(iter(engines.values()))
    work = workload(args.requests, tuple(args.input_len), tuple(args.output_len), first.shape.vocab_size, seed=0)
    out_tokens = sum(n for _, n in work)
    systems = {name: (lambda e=e: run_to_completion(e, work)[1]) for name, e in engines.items()}
    if "c" in args.parts:
        hf = hf_model_from(first)
        systems["transformers"] = lambda: run_transformers(hf, work, args.hf_batch, first.runner.device)
    result.update(
        {
            "shape": shape_name,
            "requests": len(work),
            "output_tokens": out_tokens,
            "hf_batch": args.hf_batch,
            "max_num_seqs": first.config.max_num_seqs,
            "capped_seqs": args.capped_seqs,
            "token_budget": first.config.max_num_batched_tokens,
            "warm_runs": args.repeats,
            "first_run_tok_s": {},
            "samples_tok_s": {name: [] for name in systems},
            "median_tok_s": {},
        }
    )
    # The first full run of each system is its warm-up (kernel choices, allocator growth, lazy compiles):
    # seen at 640 tok/s for transformers where its next run made 1442. Reported, never in a median.
    for name, run in systems.items():
        result["first_run_tok_s"][name] = out_tokens / run()
        save()
        print(f"(c/d) {name}: first run {result['first_run_tok_s'][name]:.0f} output tok/s", flush=True)
    samples = result["samples_tok_s"]
    for _ in range(args.repeats):
        for name, run in systems.items():  # interleaved, so drift hits all alike
            samples[name].append(out_tokens / run())
            med = result["median_tok_s"] = {n: statistics.median(v) for n, v in samples.items() if v}
            if len(med) == len(systems) and "c" in args.parts:
                result["orcinus_over_transformers"] = med["orcinus"] / med["transformers"]
            if len(med) == len(systems) and "d" in args.parts:
                result["iteration_over_request_level"] = med["orcinus_capped"] / med["orcinus_request_level"]
            save()
            print(f"(c/d) {name}: {samples[name][-1]:.0f} output tok/s", flush=True)


def device_info(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    else:
        info.update(name=platform.processor() or "cpu", threads=torch.get_num_threads())
    return info


def print_table(report: dict) -> None:
    print(f"\n== {report['device']['name']} ==")
    if a := report.get("graphs_vs_eager"):
        for mode in MODES[1:]:
            print(
                f"(a) {mode} graphs vs eager, {a['shape']} {a['dtype']}: {a[mode]['identical']}/{a['requests']} "
                f"requests token-identical over {a['steps']} steps"
            )
        print(f"(a) capture: {a['capture']}")
    if "decode_steps" in report:
        print(f"(b) copy bandwidth {report['copy_bandwidth_gb_s']:.0f} GB/s")
        print(
            f"{'shape':<14}{'batch':>6}{'eager ms':>10}{'piecew. ms':>11}{'graphs ms':>11}{'floor ms':>10}"
            f"{'speedup':>9}{'/floor':>8}"
        )
    for r in report.get("decode_steps", []):
        print(
            f"{r['shape']:<14}{r['batch']:>6}{r['eager_ms']:>10.2f}{r['piecewise_ms']:>11.2f}{r['graphs_ms']:>11.2f}"
            f"{r['floor_ms']:>10.2f}{r['graph_speedup']:>8.2f}x{r['graphs_over_floor']:>7.2f}x"
        )
    t = report.get("throughput", {})
    m = t.get("median_tok_s", {})
    if "orcinus_over_transformers" in t:
        print(
            f"(c) {t['shape']}, {t['requests']} requests, max {t['max_num_seqs']} seqs, budget {t['token_budget']}, "
            f"median of {t['warm_runs']} warm runs: orcinus {m['orcinus']:.0f} tok/s, transformers "
            f"{m['transformers']:.0f} tok/s (batch {t['hf_batch']}; "
            f"first run {t['first_run_tok_s']['transformers']:.0f}) = {t['orcinus_over_transformers']:.2f}x"
        )
    if "iteration_over_request_level" in t:
        print(
            f"(d) max {t['capped_seqs']} seqs: iteration-level {m['orcinus_capped']:.0f} vs request-level "
            f"{m['orcinus_request_level']:.0f} tok/s = {t['iteration_over_request_level']:.2f}x"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama-1b"], choices=sorted(DUMMY_SHAPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per repeat and mode")
    ap.add_argument("--decode-context", type=int, default=128, help="prompt tokens before the timed decode steps")
    ap.add_argument("--check-requests", type=int, default=12, help="(a): requests, arriving one per iteration")
    ap.add_argument("--check-steps", type=int, default=32, help="(a): greedy tokens per request")
    ap.add_argument("--check-input-len", type=int, nargs=2, default=[8, 300], help="(a): prompt tokens ~ U[lo, hi]")
    ap.add_argument("--check-dtype", default="float32", help="(a): compute dtype of the identity check")
    ap.add_argument("--throughput-shape", default="llama-1b", choices=sorted(DUMMY_SHAPES))
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, nargs=2, default=[32, 512])
    ap.add_argument("--output-len", type=int, nargs=2, default=[1, 128])
    ap.add_argument("--hf-batch", type=int, default=64, help="transformers' static batch size")
    ap.add_argument("--capped-seqs", type=int, default=64, help="(d): max_num_seqs of both schedulers")
    ap.add_argument("--token-budget", type=int, default=None, help="max_num_batched_tokens; default: the engine's")
    ap.add_argument("--kv-gib", type=float, default=8.0, help="KV cache per engine (engines are co-resident)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds of (b), and warm runs of (c)/(d) per system")
    ap.add_argument(
        "--parts", nargs="+", choices="abcd", default=list("abcd"), help="which of (a)-(d) to run, in this order"
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test of the script itself")
    ap.add_argument("--out", default="benchmarks/results/gpu/bench_gpu.json")
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.batches, args.steps, args.repeats = ["tiny"], [1, 2], 2, 1
        args.throughput_shape, args.requests, args.input_len, args.output_len = args.shapes[0], 6, [8, 24], [1, 6]
        args.hf_batch, args.token_budget, args.kv_gib, args.decode_context = 4, 64, 0.05, 16
        args.capped_seqs = 2
        args.check_requests, args.check_steps, args.check_input_len = 4, 6, [4, 40]
    device = torch.device(args.device)
    torch.manual_seed(0)

    report = {"device": device_info(device), "complete": False}

    def save() -> None:
        write_report(args.out, report)

    save()

    def part_a() -> None:
        report["graphs_vs_eager"] = check_graphs_match_eager(args)
        save()
        print(f"(a) {report['graphs_vs_eager']}", flush=True)

    def part_b() -> None:
        bandwidth = copy_bandwidth(device)
        report["copy_bandwidth_gb_s"] = bandwidth / 1e9
        report["bandwidth_timer"] = "cuda events" if device.type == "cuda" else "perf_counter"
        report["decode_steps"] = []
        decode_step_times(args, bandwidth, report["decode_steps"], save)

    def part_cd() -> None:
        report["throughput"] = {}
        throughput(args, report["throughput"], save)

    # In the order named (the most telling first); a part that fails is recorded and the next still runs.
    parts = {"a": part_a, "b": part_b, "c": part_cd, "d": part_cd}
    for run_part in dict.fromkeys(parts[p] for p in args.parts):
        try:
            run_part()
        except Exception as e:
            report.setdefault("errors", {})[run_part.__name__] = repr(e)
            save()
            print(f"{run_part.__name__} failed: {e!r}", flush=True)
            free_memory()
    report["complete"] = "errors" not in report
    save()
    print_table(report)
    print(f"wrote {args.out}")
    return 0 if report["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
