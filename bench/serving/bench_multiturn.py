"""Multi-turn chat with and without automatic prefix caching: TTFT per turn and output throughput.

N concurrent conversations (distinct seeded system prompts) of T turns each; every turn resends the
whole history through the OpenAI SDK (streamed chat completions, temperature 0) and appends the reply,
as a chat UI does. Orcinus runs on loopback in alternation, caching on (default flags) then off
(`--no-prefix-caching`), --repeats rounds, a fresh server per run so every run starts with a cold cache;
we report medians over the repeats. Goal: TTFT p50 of turns 2+ >= 3x lower with caching, throughput not lower.

    python -m bench.serving.bench_multiturn --out benchmarks/results/serving/multiturn.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from bench.common import parse_metrics, serve_flags, served, write_report

MODES = {"on": [], "off": ["--no-prefix-caching"]}  # caching is on by default
# Common English words, each one token (with its leading space) for SmolLM2: word counts ~ token counts.
WORDS = [
    "time",
    "year",
    "people",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "state",
    "family",
    "student",
    "group",
    "country",
    "problem",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "work",
    "government",
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
    "father",
    "power",
    "hour",
    "game",
    "line",
    "end",
    "member",
    "law",
    "car",
    "city",
    "community",
    "name",
    "team",
    "minute",
    "idea",
    "body",
    "information",
    "back",
    "parent",
    "face",
    "level",
    "office",
    "door",
    "health",
    "person",
    "art",
    "war",
    "history",
    "party",
    "result",
    "change",
    "morning",
    "reason",
    "research",
    "girl",
    "moment",
    "air",
    "teacher",
    "force",
    "education",
    "river",
    "garden",
    "window",
    "market",
    "bridge",
    "coffee",
    "music",
    "letter",
    "island",
    "forest",
    "engine",
    "signal",
    "paper",
    "winter",
    "summer",
    "ocean",
    "mountain",
    "village",
    "cloud",
    "train",
    "station",
    "green",
    "blue",
    "small",
    "large",
    "quick",
    "quiet",
    "bright",
    "early",
    "late",
    "simple",
    "careful",
    "happy",
    "strong",
    "warm",
    "cold",
    "open",
    "new",
    "old",
    "good",
]


@dataclass(frozen=True)
class Conversation:
    system: str
    users: tuple[str, ...]


def text(rng: random.Random, lo: int, hi: int) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    return " ".join(words).capitalize() + "."


def conversations(
    n: int, turns: int, system_tokens: tuple[int, int], user_words: tuple[int, int], seed: int = 0
) -> list[Conversation]:
    """Seeded per conversation, so both modes (and every repeat) send the same users' messages."""
    out = []
    for i in range(n):
        rng = random.Random(f"{seed}-{i}")
        out.append(Conversation(text(rng, *system_tokens), tuple(text(rng, *user_words) for _ in range(turns))))
    return out


def pct(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile; None for no values."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    f = int(k)
    return v[f] + (v[min(f + 1, len(v) - 1)] - v[f]) * (k - f)


def mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


async def converse(
    client: openai.AsyncOpenAI, model: str, conv: Conversation, max_tokens: int, think_s: float = 0.0
) -> list[dict]:
    """The conversation's turns one after another; stops at the first failed turn. With `think_s`, the user first
    arrives within U[0, think_s] and reads and types for Exp(mean think_s) seconds before each later turn (seeded)."""
    messages = [{"role": "system", "content": conv.system}]
    turns = []
    rng = random.Random(conv.system)
    if think_s:
        await asyncio.sleep(rng.uniform(0, think_s))
    for t, user in enumerate(conv.users):
        if think_s and t:
            await asyncio.sleep(rng.expovariate(1 / think_s))
        messages.append({"role": "user", "content": user})
        t0 = time.perf_counter()
        ttft, reply, usage = None, [], None
        try:
            stream = await client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    if choice.delta.content:  # not the role-only opening delta
                        ttft = ttft or time.perf_counter() - t0
                        reply.append(choice.delta.content)
        except (openai.OpenAIError, httpx.HTTPError) as e:
            turns.append({"ok": False, "error": f"{type(e).__name__}: {e}"[:300]})
            return turns
        e2e = time.perf_counter() - t0
        # A reply that is EOS at once has no content chunk; its first token still took the whole request.
        turns.append(
            {
                "ok": True,
                "ttft": ttft or e2e,
                "e2e": e2e,
                "prompt_tokens": usage and usage.prompt_tokens,
                "output_tokens": usage.completion_tokens if usage else len(reply),
            }
        )
        messages.append({"role": "assistant", "content": "".join(reply)})
    return turns


async def prefix_metrics(url: str) -> dict[str, float]:
    """The prefix-cache totals from /metrics once the engine is idle (its stats frame trails the last token)."""
    names = (
        "orcinus_prefix_cache_queried_tokens",
        "orcinus_prefix_cache_hit_tokens",
        "orcinus_requests_running",
        "orcinus_requests_waiting",
    )
    async with httpx.AsyncClient(timeout=10) as http:
        for _ in range(100):
            m = parse_metrics((await http.get(url + "/metrics")).text)
            if not m.get("orcinus_requests_running") and not m.get("orcinus_requests_waiting"):
                break
            await asyncio.sleep(0.05)
    return {k.removeprefix("orcinus_"): m.get(k, 0.0) for k in names[:2]}


async def run_mode(url: str, convs: list[Conversation], max_tokens: int, think_s: float = 0.0) -> dict:
    """All conversations at once against the server at `url`; per-turn TTFTs, throughput, prefix-cache hits."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
        model = (await client.models.list()).data[0].id
        # Warm-up (the first iterations of a fresh engine are slow); its prompt shares no block with ours.
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi."}], max_tokens=2)
        before = await prefix_metrics(url)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(converse(client, model, c, max_tokens, think_s) for c in convs))
        duration = time.perf_counter() - t0
        after = await prefix_metrics(url)
    n_turns = len(convs[0].users)
    ok = [[r for r in conv if r["ok"]] for conv in results]
    ttft = [[conv[t]["ttft"] for conv in ok if len(conv) > t] for t in range(n_turns)]
    later = [x for t in ttft[1:] for x in t]
    out_tokens = sum(r["output_tokens"] for conv in ok for r in conv)
    queried, hits = (after[k] - before[k] for k in ("prefix_cache_queried_tokens", "prefix_cache_hit_tokens"))
    return {
        "ttft_s": ttft,
        "ttft_p50_s": [pct(t, 0.5) for t in ttft],
        "ttft_p90_s": [pct(t, 0.9) for t in ttft],
        "ttft_p50_later_turns_s": pct(later, 0.5),
        "ttft_p90_later_turns_s": pct(later, 0.9),
        "prompt_tokens_mean": [mean([c[t]["prompt_tokens"] for c in ok if len(c) > t]) for t in range(n_turns)],
        "output_tokens": out_tokens,
        "duration_s": duration,
        "output_tok_s": out_tokens / duration,
        "prefix_cache_queried_tokens": queried,
        "prefix_cache_hit_tokens": hits,
        "hit_rate": hits / queried if queried else 0.0,
        # Turns that failed, plus those a failure left unsent.
        "failed": sum(not r["ok"] for conv in results for r in conv) + sum(n_turns - len(c) for c in results),
        "errors": sorted({r["error"] for conv in results for r in conv if not r["ok"]})[:5],
    }


def median_of(runs: list[dict], key: str):
    """Median over the repeats of a number, or element-wise of a per-turn list (Nones skipped)."""

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    if isinstance(runs[0][key], list):
        return [med([r[key][t] for r in runs]) for t in range(len(runs[0][key]))]
    return med([r[key] for r in runs])


def launched(args):
    """Default server factory: `orcinus serve` with the shared flags plus the mode's, logged beside --out."""

    def serve(mode_flags: list[str], name: str):
        flags = [*mode_flags, *serve_flags(args, "max_num_seqs", "kv_cache_memory", "max_num_batched_tokens", "model")]
        return served(flags, Path(args.out).with_suffix(f".{name}.server.log"), stop_timeout=30, timeout=180)

    return serve


def main(argv: list[str] | None = None, serve=None) -> int:
    """`serve(mode_flags, name)` is a context manager yielding a fresh server's URL (tests pass their own)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="as `orcinus serve --model` (default: the bundled model)")
    ap.add_argument("--conversations", type=int, default=16, help="concurrent conversations")
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation")
    ap.add_argument("--max-tokens", type=int, default=32, help="reply length cap per turn")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of (on, off), each run on a fresh server")
    ap.add_argument(
        "--system-tokens",
        type=int,
        nargs=2,
        default=[150, 300],
        metavar=("LO", "HI"),
        help="system prompt length per conversation, ~U[LO, HI] (one token a word)",
    )
    ap.add_argument(
        "--user-words",
        type=int,
        nargs=2,
        default=[30, 80],
        metavar=("LO", "HI"),
        help="user message length per turn, ~U[LO, HI]",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=16, help="max batch size, both modes")
    ap.add_argument(
        "--kv-cache-memory", type=int, default=None, help="KV cache bytes, both modes (default: the server's)"
    )
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="per-iteration token budget, both modes (default: the server's)",
    )
    ap.add_argument("--out", default="benchmarks/results/serving/multiturn.json")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    serve = serve or launched(args)

    t_start = time.perf_counter()
    convs = conversations(args.conversations, args.turns, tuple(args.system_tokens), tuple(args.user_words), args.seed)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for r in range(args.repeats):
        for mode, flags in MODES.items():  # alternate on/off so drift on a shared machine hits both alike
            with serve(flags, f"{mode}-{r}") as url:
                res = asyncio.run(run_mode(url, convs, args.max_tokens))
            runs[mode].append(res)
            print(
                f"repeat {r} caching {mode:>3}: TTFT p50 by turn "
                + " ".join(f"{x * 1000:.0f}" if x is not None else "-" for x in res["ttft_p50_s"])
                + f" ms, {res['output_tok_s']:.1f} tok/s, hit rate {res['hit_rate']:.2f}, failed {res['failed']}",
                flush=True,
            )

    keys = (
        "ttft_p50_s",
        "ttft_p90_s",
        "ttft_p50_later_turns_s",
        "ttft_p90_later_turns_s",
        "prompt_tokens_mean",
        "output_tok_s",
        "prefix_cache_queried_tokens",
        "prefix_cache_hit_tokens",
        "hit_rate",
    )
    modes = {
        mode: {k: median_of(rs, k) for k in keys} | {"failed": sum(x["failed"] for x in rs)}
        for mode, rs in runs.items()
    }
    on, off = modes["on"], modes["off"]
    ttft_ratio = (
        off["ttft_p50_later_turns_s"] / on["ttft_p50_later_turns_s"]
        if on["ttft_p50_later_turns_s"] and off["ttft_p50_later_turns_s"]
        else None
    )
    tput_ratio = on["output_tok_s"] / off["output_tok_s"] if off["output_tok_s"] else None
    summary = {
        "ttft_p50_later_turns_ratio_off_on": ttft_ratio,
        "throughput_ratio_on_off": tput_ratio,
        "goal_met": bool(ttft_ratio and tput_ratio and ttft_ratio >= 3 and tput_ratio >= 1),
    }
    fmt = lambda x, spec: "-" if x is None else format(x, spec)
    line = (
        f"TTFT p50 turns 2-{args.turns}: {fmt(ttft_ratio, '.2f')}x lower with prefix caching (goal >= 3x); "
        f"throughput on/off {fmt(tput_ratio, '.2f')}x (goal >= 1)"
    )
    result = {
        "command": "python -m bench.serving.bench_multiturn " + shlex.join(argv),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "model": args.model or "SmolLM2-135M-Instruct (bundled GGUF, the server's CPU defaults)",
        "config": {k: v for k, v in vars(args).items() if k != "out"} | {"mode_flags": MODES},
        "modes": modes,
        "runs": runs,
        "summary": summary,
        "summary_line": line,
        "elapsed_s": time.perf_counter() - t_start,
    }
    write_report(args.out, result)

    print(f"\n{'caching':<8}{'TTFT p50 by turn (ms)':<28}{'p50 t2+':>9}{'p90 t2+':>9}{'tok/s':>8}{'hit rate':>10}")
    ms = lambda x: fmt(x and x * 1000, ".0f")
    for mode, m in modes.items():
        print(
            f"{mode:<8}{' / '.join(ms(x) for x in m['ttft_p50_s']):<28}{ms(m['ttft_p50_later_turns_s']):>9}"
            f"{ms(m['ttft_p90_later_turns_s']):>9}{m['output_tok_s']:>8.1f}{m['hit_rate']:>10.2f}"
        )
    print(line)
    print(f"wrote {args.out} in {result['elapsed_s']:.0f} s")
    return 0 if all(m["failed"] == 0 for m in modes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
