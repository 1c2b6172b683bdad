"""lm-evaluation-harness against `orcinus serve` (issue 29): a loglikelihood task and a generate_until task with five
stop strings, through lm-eval's `local-completions` model with the tokenizer `orcinus export-tokenizer` writes; every
loglikelihood lm-eval logs must equal the engine's own prompt logprobs (offline `LLM`, the same defaults) within 1e-4.

lm-eval is installed from PyPI into its own venv, as a user would (`--venv`, created if missing):

    python -m bench.clients.check_lm_eval --out benchmarks/results/clients/lm_eval.json
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, served, write_report

MODEL = "SmolLM2-135M-Instruct"
STOPS = ["\n\n", "Question:", "</s>", "<|im_end|>", "###"]
MC = [
    {"question": "The capital of France is", "choices": [" Paris", " Berlin", " Madrid", " Rome"], "answer": 0},
    {
        "question": "Water freezes at a temperature of",
        "choices": [" 0 degrees Celsius", " 50 degrees Celsius", " 100 degrees Celsius"],
        "answer": 0,
    },
    {"question": "The largest planet in the solar system is", "choices": [" Jupiter", " Mars", " Venus"], "answer": 0},
    {"question": "A week has", "choices": [" seven days", " ten days", " three days"], "answer": 0},
    {
        "question": "Question: What color is the sky on a clear day?\nAnswer:",
        "choices": [" blue", " green", " red"],
        "answer": 0,
    },
    {"question": "2 + 2 =", "choices": [" 4", " 5", " 22"], "answer": 0},
]
GEN = [
    {"question": "What is the capital of Italy?", "answer": "Rome"},
    {"question": "Name a primary color.", "answer": "Red"},
    {"question": "How many legs does a spider have?", "answer": "8"},
    {"question": "What is 3 times 3?", "answer": "9"},
]


def write_tasks(root: Path) -> Path:
    tasks = root / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    for name, rows in (("mc", MC), ("gen", GEN)):
        (tasks / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "orcinus_mc.yaml").write_text(f"""task: orcinus_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tasks / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
""")
    (tasks / "orcinus_gen.yaml").write_text(f"""task: orcinus_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tasks / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: answer
generation_kwargs:
  until: {json.dumps(STOPS)}
  max_gen_toks: 24
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return tasks


def ensure_venv(venv: Path) -> Path:
    lm_eval = venv / "bin" / "lm_eval"
    if not lm_eval.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "lm-eval[api]", "transformers"], check=True)
    return lm_eval


def samples(out: Path, task: str) -> list[dict]:
    [path] = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reference_logliks(tokenizer_dir: Path, pairs: list[tuple[str, str]]) -> list[float]:
    """The engine's own prompt logprobs for lm-eval's token split of each (context, continuation)."""
    from transformers import AutoTokenizer

    from engine import LLM, SamplingParams

    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    llm = LLM()
    out = []
    for context, continuation in pairs:
        # lm-eval's _encode_pair: trailing spaces of the context move to the continuation; both from one encoding
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = hf.encode(context + continuation, add_special_tokens=False)
        num_context = len(hf.encode(context, add_special_tokens=False))
        [req] = llm.generate([whole], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
        out.append(sum(t.logprob for t in req.prompt_logprobs[num_context:]))
    llm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", default="/tmp/lmeval", help="lm-eval's own venv (created with pip if missing)")
    ap.add_argument("--out", default="benchmarks/results/clients/lm_eval.json")
    args = ap.parse_args()
    lm_eval = ensure_venv(Path(args.venv))
    work = Path(tempfile.mkdtemp(prefix="orcinus-lm-eval-"))
    tokenizer_dir = work / "tokenizer"
    subprocess.run([str(ROOT / ".venv" / "bin" / "orcinus"), "export-tokenizer", str(tokenizer_dir)], check=True)
    tasks = write_tasks(work)
    with served([]) as base:
        cmd = [
            str(lm_eval),
            "run",
            "--model",
            "local-completions",
            "--model_args",
            (
                f"model={MODEL},base_url={base}/v1/completions,tokenizer={tokenizer_dir},"
                f"tokenizer_backend=huggingface,num_concurrent=4,max_retries=1,tokenized_requests=True"
            ),
            "--tasks",
            "orcinus_mc,orcinus_gen",
            "--include_path",
            str(tasks),
            "--log_samples",
            "--output_path",
            str(work / "results"),
        ]
        t = time.time()
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        seconds = time.time() - t
    if run.returncode != 0:
        sys.exit(f"lm_eval failed ({run.returncode}):\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}")
    mc = samples(work / "results", "orcinus_mc")
    gen = samples(work / "results", "orcinus_gen")
    # lm-eval 0.4.x logs each request's arguments as {"gen_args_i": {"arg_0": context, "arg_1": continuation}}
    # and each response as [[loglikelihood, is_greedy]], as strings
    pairs = [(a["arg_0"], a["arg_1"]) for s in mc for a in s["arguments"].values()]
    logged = [float(resp[0][0]) for s in mc for resp in s["resps"]]
    reference = reference_logliks(tokenizer_dir, pairs)
    worst = max(abs(a - b) for a, b in zip(logged, reference))
    outputs = [s["resps"][0][0] for s in gen]
    stops_sent = [s["arguments"]["gen_args_0"]["arg_1"]["until"] for s in gen]
    result = {
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "lm_eval_command": " ".join(shlex.quote(c) for c in cmd),
        "lm_eval_seconds": round(seconds, 1),
        "loglikelihood": {
            "requests": len(logged),
            "max_abs_diff_vs_engine": worst,
            "within_1e-4": worst <= 1e-4,
            "pairs": [
                {"context": c, "continuation": x, "lm_eval": a, "engine": b}
                for (c, x), a, b in zip(pairs, logged, reference)
            ],
        },
        "generate_until": {"requests": len(gen), "stop_strings_sent": stops_sent[0], "outputs": outputs},
        "lm_eval_stdout_tail": run.stdout[-3000:],
    }
    write_report(args.out, result)
    print(
        json.dumps(
            {k: result[k] for k in ("lm_eval_seconds",)}
            | {
                "loglikelihood": {k: v for k, v in result["loglikelihood"].items() if k != "pairs"},
                "generate_until": result["generate_until"],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
