"""`orcinus generate` (offline) and `orcinus serve` (the HTTP gateway)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from engine.core.config import EngineConfig, FaultPlan
from gateway.web.in_flight import DEFAULT_MAX_QUEUED_TOKENS

if TYPE_CHECKING:
    from gateway.config import GatewayConfig
    from gateway.engines.replicas import Replicas

# Flags shared by every subcommand that builds an engine; names follow EngineConfig's fields.
_ENGINE_FLAGS = {
    "model": dict(default=None, help="GGUF file, HF checkpoint dir, or dummy:NAME (default: bundled SmolLM2-135M)"),
    "device": dict(help="cuda|cpu (default: cuda when torch sees a GPU, else cpu)"),
    "dtype": dict(choices=["auto", "bfloat16", "float16", "float32"], help="activations (default: bfloat16 on a GPU, float32 on the CPU)"),
    "weights": dict(choices=["auto", "dense", "gguf"], help="gguf: multiply by the GGUF file's quantized blocks as stored, CPU only (default: gguf on the CPU where the file has them)"),
    "block_activations": dict(choices=["auto", "int16", "float32"], help="the GGUF block matmuls' inputs: int16, rounded per 32 values (AVX-512 VNNI or AVX2), or float32 exactly (default: int16 where the CPU has either)"),
    "batch_invariant": dict(action="store_true", help="a request's tokens do not depend on the rest of the batch (CPU only)"),
    "gpu_memory_utilization": dict(type=float, help="share of GPU memory for weights, KV cache and activations (default 0.9)"),
    "enforce_eager": dict(action="store_true", help="never replay CUDA graphs"),
    "cuda_graph_max_tokens": dict(type=int, help="largest token bucket of the piecewise CUDA graphs (default: the token budget)"),
    "compile": dict(choices=["auto", "on", "off"],
                    help="torch.compile the token-wise ops inside the CUDA graphs (default auto: on where graphs run)"),
    "block_size": dict(type=int, help="tokens per KV cache block"),
    "kv_cache_memory": dict(type=int, help="bytes for the KV cache (default: 512 MiB on CPU, what is free on GPU)"),
    "max_num_seqs": dict(type=int, help="most requests in one iteration"),
    "max_num_batched_tokens": dict(type=int, help="per-iteration token budget (default: 2048 on a GPU, 512 on the CPU)"),
    "max_model_len": dict(type=int, help="context window cap"),
    "scheduling": dict(choices=["iteration", "request"], help="Orca's iteration-level, or the request-level baseline"),
    "scheduling_policy": dict(choices=["fcfs", "priority", "predicted", "oracle"],
                              help="who runs first: arrival order (default), the requests' `priority` field (lower "
                                   "first), or the shortest remaining output predicted from the model's hidden state "
                                   "(oracle: `priority` carries the real length, a benchmark's ceiling)"),
    "length_predictor": dict(metavar="PATH", help="--scheduling-policy predicted: the file its length predictor starts "
                                                  "from and saves to as it learns (default: start afresh)"),
    "async_scheduling": dict(choices=["auto", "on", "off"],
                             help="schedule the next step while the device runs this one (default: on for one GPU)"),
    "kv_policy": dict(choices=["paged", "orca-reserve"], help="grow KV blocks on demand, or reserve max_tokens up front"),
    "prefix_caching": dict(action=argparse.BooleanOptionalAction,
                           help="reuse the cached K/V of prompt prefixes shared with earlier requests (default: on)"),
    "attention_backend": dict(choices=["auto", "torch", "cpu", "cuda"], help="attention backend: auto|torch|cpu|cuda"),
    "speculative": dict(choices=["auto", "off", "ngram", "suffix"],
                        help="speculative decoding: draft from prompt lookup (ngram) or suffix trees, verify in one step "
                             "(default auto: ngram on the CPU, off on a GPU)"),
    "num_speculative_tokens": dict(type=int, help="most draft tokens per request per step (default 11)"),
    "speculative_shared": dict(action=argparse.BooleanOptionalAction,
                               help="draft also from the recent outputs of requests with the same cache salt (API "
                                    "key), where a request's own context has no match (default: on)"),
    "speculative_row_cost": dict(type=float, help="one more row's cost as a share of a step's fixed cost: drafts are "
                                 "scheduled only where likely to pay for their rows (default: measured from the engine's "
                                 "own steps, starting at 0.25; 0 drafts always)"),
    "num_threads": dict(type=int, help="torch CPU threads (per stage process when pipelined)"),
    "pipeline_stages": dict(type=int, help="split the layers over N stage processes, N batches in flight"),
    "tensor_parallel_size": dict(type=int, help="split every layer over N processes (per pipeline stage)"),
    "external_stages": dict(action="store_true", help="stages are started elsewhere (MASTER_ADDR/MASTER_PORT)"),
    # Tests only, hidden from --help: failures to inject, as a FaultPlan in JSON.
    "faults": dict(type=lambda text: msgspec.json.decode(text, type=FaultPlan), help=argparse.SUPPRESS),
}


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    for name, kw in _ENGINE_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, **{"default": None, **kw})


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig fields given on the command line."""
    names = {f.name for f in fields(EngineConfig)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def cmd_export_tokenizer(args: argparse.Namespace) -> int:
    """Hugging Face tokenizer files that encode as the server does, for clients' `--tokenizer DIR`."""
    from engine.model.loader import load_checkpoint
    from engine.model.tokenizer.export import export_tokenizer

    checkpoint = load_checkpoint(args.model, weights=False)
    if checkpoint.tokenizer is None:
        sys.exit("orcinus export-tokenizer: this model has no tokenizer")
    try:
        paths = export_tokenizer(checkpoint.tokenizer, Path(args.dir), checkpoint.shape.max_position)
    except ValueError as e:
        sys.exit(f"orcinus export-tokenizer: {e}")
    print("\n".join(map(str, paths)))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.core.sampling_params import SamplingParams
    from engine.llm import LLM

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    [c] = llm.generate([prompt], params)
    print(c.text)
    return 0


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key (repeated) and --api-key-file; neither given: $ORCINUS_API_KEY, if set."""
    from gateway.web.auth import check_key, read_keys_file

    keys = list(args.api_key or [])
    for path in args.api_key_file or []:
        if not (found := read_keys_file(path)):
            raise ValueError(f"no API key in {path}")
        keys += found
    if not keys and os.environ.get("ORCINUS_API_KEY"):
        keys = [os.environ["ORCINUS_API_KEY"]]
    return tuple(dict.fromkeys(check_key(k) for k in keys))


def cmd_serve(args: argparse.Namespace) -> int:
    from engine.model.tokenizer.chat_template import load_chat_template
    from gateway.config import GatewayConfig
    from gateway.web.guards import default_allowed_hosts

    try:
        keys = api_keys(args)
        if args.chat_template is not None:
            load_chat_template(args.chat_template)  # a bad one stops the server before the engines start
    except (OSError, ValueError) as e:
        sys.exit(f"orcinus serve: {e}")
    config = GatewayConfig(
        EngineConfig(**engine_kwargs(args)), args.data_parallel_size, args.routing, keys, args.served_model_name,
        max_waiting=args.max_waiting,
        max_queued_tokens=args.max_queued_tokens,
        metrics_need_key=args.metrics_need_key, prefix_cache_scope=args.prefix_cache_scope,
        special_tokens_in_content=args.special_tokens_in_content,
        chat_template=args.chat_template,
        shutdown_timeout=args.shutdown_timeout,
        engine_unresponsive_timeout=args.engine_unresponsive_timeout,
        allowed_origins=None if args.allowed_origins is None else tuple(args.allowed_origins),
        allowed_hosts=default_allowed_hosts(args.host) if args.allowed_hosts is None else tuple(args.allowed_hosts),
        url=f"http://{'[' + args.host + ']' if ':' in args.host else args.host}:{args.port}",
    )
    try:
        replicas = launch_engines(config)
    except ValueError as e:
        sys.exit(f"orcinus serve: {e}")
    try:
        # The engines import torch and load the model while this process imports the app and reads the tokenizer
        # (~1.5 s of an ~8 s start on the 2-core machine).
        from gateway.app import build_app

        try:
            app = build_app(config, replicas)
        except ValueError as e:
            sys.exit(f"orcinus serve: {e}")
        run_server(app, host=args.host, port=args.port, shutdown_timeout=config.shutdown_timeout,
                   header_timeout=args.header_timeout, send_timeout=args.send_timeout,
                   max_connections=args.max_connections)
    finally:
        replicas.discard()  # engines the app never started (it failed first): none is left running
    return 0


def launch_engines(config: GatewayConfig) -> Replicas:
    """The config's engine replicas, their processes spawned already (the app adopts them when it starts)."""
    from gateway.config import make_replicas

    replicas = make_replicas(config)
    replicas.launch()
    return replicas


def run_server(app, *, host: str, port: int, shutdown_timeout: float, header_timeout: float = 10.0,
               send_timeout: float = 30.0, max_connections: int | None = None) -> None:
    """uvicorn on SIGTERM: stop accepting, wait up to the timeout for in-flight requests (which the app ends
    cleanly just before it), then the app's shutdown stops the engine and frees its shared memory. Connections
    are guarded against slow clients and capped (gateway/web/connections.py)."""
    import uvicorn

    from gateway.web.connections import default_max_connections, guarded_h11, raise_fd_limit

    fd_limit = raise_fd_limit()
    protocol = guarded_h11(max_connections or default_max_connections(fd_limit), header_timeout, send_timeout)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first:  # the app cannot see SIGTERM itself: uvicorn owns the signal handlers
                app.state.orcinus.begin_shutdown()

    Server(uvicorn.Config(app, host=host, port=port, log_level="info", http=protocol,
                          timeout_graceful_shutdown=shutdown_timeout)).run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="orcinus", description="Orca-style LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline from one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI API over HTTP")
    srv.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless you mean otherwise)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", action="append", default=None, metavar="KEY",
                     help="require `Authorization: Bearer KEY` on /v1 routes; repeat for several keys (visible in "
                          "`ps`: prefer $ORCINUS_API_KEY or --api-key-file)")
    srv.add_argument("--api-key-file", action="append", default=None, metavar="PATH",
                     help="API keys, one per line (# comments); with neither flag, $ORCINUS_API_KEY is the key")
    srv.add_argument("--metrics-need-key", action=argparse.BooleanOptionalAction, default=True,
                     help="with API keys, /metrics needs one too (default; --no-metrics-need-key opens it)")
    srv.add_argument("--prefix-cache-scope", choices=["key", "global"], default="key",
                     help="with API keys: each key finds only its own cached prompt prefixes and drafts only from "
                          "its own recent outputs (default), or all keys share them")
    srv.add_argument("--served-model-name", default=None, help="the model name clients send")
    srv.add_argument("--max-waiting", type=_non_negative, default=None,
                     help="sequences queued beyond the batch before new requests get 429 (default 4096)")
    srv.add_argument("--max-queued-tokens", type=_positive, default=DEFAULT_MAX_QUEUED_TOKENS,
                     help="prompt tokens of the admitted sequences before new requests get 429 (default 4M)")
    srv.add_argument("--allowed-origins", nargs="*", default=None, metavar="ORIGIN",
                     help="browser origins that may call the API, e.g. https://chat.example.com, or * for any "
                          "(default: http://localhost:* and http://127.0.0.1:*; the flag alone: none)")
    srv.add_argument("--special-tokens-in-content", choices=["allow", "escape"], default="allow",
                     help="special-token text in chat messages (e.g. <|im_start|>): allow = it becomes the special "
                          "token (default, as vLLM and llama.cpp), escape = it stays text")
    srv.add_argument("--chat-template", default=None, metavar="FILE_OR_NAME",
                     help="render chat prompts with this Jinja file, or a shipped template (chatml, gemma, llama3, "
                          "mistral-v1, mistral-v3, phi3), over the model's own (default: the model's, else the shipped "
                          "one of its architecture)")
    srv.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                     help="Host header values the server answers to (e.g. api.example.com, *.example.com; * for any); "
                          "default: bound to loopback, only localhost, 127.0.0.1 and [::1] (DNS rebinding); else any")
    srv.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                     help="a request's headers must arrive within this, or the connection is closed (default 10)")
    srv.add_argument("--send-timeout", type=float, default=30.0, metavar="SECONDS",
                     help="a client that reads nothing of a response this long is disconnected, its requests "
                          "aborted (default 30)")
    srv.add_argument("--max-connections", type=int, default=None, metavar="N",
                     help="open connections beyond this get 503 at once (default: 4096, fewer if the open-files "
                          "limit is low)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds in-flight requests may take to finish after SIGTERM")
    srv.add_argument("--engine-unresponsive-timeout", type=_positive_seconds, default=3.0, metavar="SECONDS",
                     help="an engine process that sends not even a heartbeat this long is taken out of routing until "
                          "it answers, and its requests with no token yet go to another replica (default 3)")
    srv.add_argument("--data-parallel-size", type=_positive, default=1, metavar="N",
                     help="engine replicas behind this gateway, each with its own KV cache and scheduler (and, on "
                          "GPUs, its own tensor x pipeline devices)")
    srv.add_argument("--routing", choices=["cache-aware", "least-loaded", "round-robin"], default="cache-aware",
                     help="which replica serves a request: the one holding the longest cached prefix of its prompt, "
                          "balanced against load (default), the one with the fewest tokens in flight, or in turn")
    add_engine_flags(srv)
    srv.set_defaults(func=cmd_serve)

    export = sub.add_parser("export-tokenizer", help="write the model's tokenizer as Hugging Face files into DIR")
    export.add_argument("dir")
    export.add_argument("--model", default=None, help="GGUF file or HF checkpoint dir (default: bundled SmolLM2-135M)")
    export.set_defaults(func=cmd_export_tokenizer)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
