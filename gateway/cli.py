"""`orcinus generate` (offline) and `orcinus serve` (the HTTP gateway)."""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import os
import sys
import textwrap
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from engine.core.config import EngineConfig, FaultPlan
from engine.core.queue_policy import policy_name
from gateway.config import GatewayConfig, make_replicas

if TYPE_CHECKING:
    from gateway.engines.replicas import Replicas


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each dataclass field's attribute docstring (the string on the line after it), its whitespace collapsed."""
    [node] = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    return {
        field.target.id: " ".join(doc.value.value.split())
        for field, doc in zip(node.body, node.body[1:])
        if isinstance(field, ast.AnnAssign)
        and isinstance(field.target, ast.Name)
        and isinstance(doc, ast.Expr)
        and isinstance(doc.value, ast.Constant)
        and isinstance(doc.value.value, str)
    }


def _with_default(text: str, default) -> str:
    """Help text that states its default, when there is one to state (unset and off go without saying)."""
    if default is None or default is False or default == ():
        return text
    return f"{text} (default: {'on' if default is True else default})"


def field_help(cls: type, name: str, cli: str = "") -> str:
    """A flag's help from its config field: the docstring (as a help phrase), what only the CLI adds, the default."""
    doc = field_docs(cls)[name].removesuffix(".")
    if not doc[1:2].isupper():  # "GGUF file ..." keeps its capitals
        doc = doc[0].lower() + doc[1:]
    default = next(f.default for f in fields(cls) if f.name == name)
    return _with_default("; ".join(filter(None, [doc, cli])), default).replace("%", "%%")


# Flags shared by every subcommand that builds an engine; names follow EngineConfig's fields (`flag` where the
# flag's name says it better than the field's, `deprecated`: old spellings that still parse, with a warning).
_ENGINE_FLAGS = {
    "model": {},
    "device": {},
    "dtype": {"choices": ["auto", "bfloat16", "float16", "float32"]},
    "weights": {"choices": ["auto", "dense", "gguf"]},
    "block_activations": {"choices": ["auto", "int16", "float32"]},
    "batch_invariant": {"action": "store_true"},
    "gpu_memory_utilization": {"type": float},
    "enforce_eager": {"action": "store_true"},
    "cuda_graph_max_tokens": {"type": int},
    "compile": {"choices": ["auto", "on", "off"]},
    "block_size": {"type": int},
    "kv_cache_memory": {"type": int, "metavar": "BYTES"},
    "kv_cache_dtype": {"choices": ["auto", "float32", "bfloat16", "float16"]},
    "max_num_seqs": {"type": int},
    "max_num_batched_tokens": {"type": int},
    "max_model_len": {"type": int},
    "scheduling": {"choices": ["iteration", "request"], "flag": "scheduling_level", "deprecated": ["--scheduling"]},
    "scheduling_policy": {"type": policy_name, "metavar": "POLICY"},
    "length_predictor": {"metavar": "PATH"},
    "async_scheduling": {"choices": ["auto", "on", "off"]},
    "check_in_steps": {"type": int, "metavar": "K"},
    "kv_policy": {"choices": ["paged", "orca-reserve"]},
    "prefix_caching": {"action": argparse.BooleanOptionalAction},
    "attention_backend": {"choices": ["auto", "torch", "cpu", "cuda"]},
    "speculative": {"choices": ["auto", "off", "ngram", "suffix"]},
    "num_speculative_tokens": {"type": int},
    "speculative_shared": {"action": argparse.BooleanOptionalAction},
    "speculative_row_cost": {"type": float},
    "num_threads": {"type": int},
    "pipeline_stages": {"type": int, "metavar": "N"},
    "tensor_parallel_size": {"type": int, "metavar": "N"},
    "external_stages": {"action": "store_true"},
    "lora": {"action": "append", "metavar": "NAME=PATH"},
    "enable_lora": {"action": "store_true"},
    "max_loras": {"type": int, "metavar": "N"},
    "max_lora_rank": {"type": int, "metavar": "N"},
    # Tests only, hidden from --help: failures to inject, as a FaultPlan in JSON.
    "faults": {"type": lambda text: msgspec.json.decode(text, type=FaultPlan), "help": argparse.SUPPRESS},
}


class DeprecatedAlias(argparse.Action):
    """An old spelling of a renamed flag: it parses as the new one did, and says (on stderr) what replaced it."""

    def __init__(self, option_strings, dest, replacement: str, **kw):
        self.replacement = replacement
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"{parser.prog}: {option_string} is deprecated; use {self.replacement}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    for name, kw in _ENGINE_FLAGS.items():
        kw = dict(kw)
        flag = "--" + kw.pop("flag", name).replace("_", "-")
        deprecated = kw.pop("deprecated", [])
        kw.setdefault("help", field_help(EngineConfig, name))
        p.add_argument(flag, dest=name, **{"default": None, **kw})
        for old in deprecated:
            value = {k: v for k, v in kw.items() if k in ("choices", "type", "metavar")}
            p.add_argument(
                old, dest=name, action=DeprecatedAlias, replacement=flag, default=None, help=argparse.SUPPRESS, **value
            )


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig fields given on the command line."""
    names = {f.name for f in fields(EngineConfig)}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items() if k in names and v is not None}


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
    from gateway.web.guards import default_allowed_hosts

    try:
        keys = api_keys(args)
        if args.chat_template is not None:
            load_chat_template(args.chat_template)  # a bad one stops the server before the engines start
    except (OSError, ValueError) as e:
        sys.exit(f"orcinus serve: {e}")
    config = GatewayConfig(
        EngineConfig(**engine_kwargs(args)),
        args.data_parallel_size,
        args.routing,
        keys,
        args.served_model_name,
        max_waiting=args.max_waiting,
        max_queued_tokens=args.max_queued_tokens,
        metrics_need_key=args.metrics_need_key,
        prefix_cache_scope=args.prefix_cache_scope,
        special_tokens_in_content=args.special_tokens_in_content,
        chat_template=args.chat_template,
        shutdown_timeout=args.shutdown_timeout,
        pooling=args.pooling,
        engine_unresponsive_timeout=args.engine_unresponsive_timeout,
        allowed_origins=None if args.allowed_origins is None else tuple(args.allowed_origins),
        allowed_hosts=default_allowed_hosts(args.host) if args.allowed_hosts is None else tuple(args.allowed_hosts),
        url=f"http://{'[' + args.host + ']' if ':' in args.host else args.host}:{args.port}",
    )
    from engine.model.model_files import ModelNotFoundError, check_model
    from gateway.web.connections import bind

    try:
        check_model(config.engine.model)
        sockets = bind(args.host, args.port)
    except ModelNotFoundError as e:
        sys.exit(f"orcinus serve: {e}")
    except OSError as e:
        sys.exit(f"orcinus serve: cannot listen on {config.url}: {e.strerror or e}")
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
        run_server(
            app,
            host=args.host,
            port=args.port,
            sockets=sockets,
            shutdown_timeout=config.shutdown_timeout,
            header_timeout=args.header_timeout,
            send_timeout=args.send_timeout,
            max_connections=args.max_connections,
        )
    finally:
        replicas.discard()  # engines the app never started (it failed first): none is left running
    return 0


def launch_engines(config: GatewayConfig) -> Replicas:
    """The config's engine replicas, their processes spawned already (the app adopts them when it starts)."""

    replicas = make_replicas(config)
    replicas.launch()
    return replicas


def run_server(
    app,
    *,
    host: str,
    port: int,
    shutdown_timeout: float,
    header_timeout: float = 10.0,
    send_timeout: float = 30.0,
    max_connections: int | None = None,
    sockets: list | None = None,
) -> None:
    """uvicorn on SIGTERM: stop accepting, wait up to the timeout for in-flight requests (which the app ends
    cleanly just before it), then the app's shutdown stops the engine and frees its shared memory. Connections
    are guarded against slow clients and capped (gateway/web/connections.py). `sockets`: bound to host:port already."""
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

    server = Server(
        uvicorn.Config(
            app, host=host, port=port, log_level="info", http=protocol, timeout_graceful_shutdown=shutdown_timeout
        )
    )
    try:
        server.run(sockets)
    except KeyboardInterrupt:
        pass  # uvicorn raises the Ctrl-C it handled again once shut down: a clean stop, not a traceback (as uvicorn.run)


def _gateway_flag(p: argparse.ArgumentParser, name: str, cli: str = "", **kw) -> None:
    """A serve flag that sets GatewayConfig's field `name`: its help and default come from the field."""
    default = next(f.default for f in fields(GatewayConfig) if f.name == name)
    p.add_argument("--" + name.replace("_", "-"), default=default, help=field_help(GatewayConfig, name, cli), **kw)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orcinus", description="Orca-style LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline from one prompt")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--max-tokens", type=int, default=32, help=_with_default("most tokens to generate", 32))
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    gen.add_argument("--top-p", type=float, default=1.0, help=_with_default("nucleus sampling's probability mass", 1.0))
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (default: 0, all)")
    gen.add_argument("--seed", type=int, default=None, help="seed of the sampling draws (unset: unseeded)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI API over HTTP")
    srv.add_argument(
        "--host",
        default="127.0.0.1",
        help=_with_default("bind address (loopback unless you mean otherwise)", "127.0.0.1"),
    )
    srv.add_argument("--port", type=int, default=8000, help=_with_default("TCP port", 8000))
    srv.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on /v1 routes; repeat for several keys (visible in "
        "`ps`: prefer $ORCINUS_API_KEY or --api-key-file)",
    )
    srv.add_argument(
        "--api-key-file",
        action="append",
        default=None,
        metavar="PATH",
        help="API keys, one per line (# comments); with neither flag, $ORCINUS_API_KEY is the key",
    )
    _gateway_flag(srv, "metrics_need_key", action=argparse.BooleanOptionalAction)
    _gateway_flag(srv, "prefix_cache_scope", choices=["key", "global"])
    _gateway_flag(srv, "served_model_name")
    _gateway_flag(srv, "max_waiting", type=_non_negative, metavar="N")
    _gateway_flag(srv, "max_queued_tokens", type=_positive, metavar="N")
    _gateway_flag(srv, "allowed_origins", "the flag alone: none", nargs="*", metavar="ORIGIN")
    _gateway_flag(srv, "special_tokens_in_content", choices=["allow", "escape"])
    _gateway_flag(srv, "chat_template", metavar="FILE_OR_NAME")
    _gateway_flag(srv, "pooling", choices=["last", "mean"])
    # The server's default is not the field's: bound to loopback, it answers only loopback names.
    srv.add_argument(
        "--allowed-hosts",
        nargs="+",
        default=None,
        metavar="HOST",
        help="Host header values the server answers to (e.g. api.example.com, *.example.com; * for any); "
        "default: bound to loopback, only localhost, 127.0.0.1, [::1] and the bound address (DNS rebinding); else any",
    )
    srv.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help=_with_default("a request's headers must arrive within this, or the connection is closed", 10.0),
    )
    srv.add_argument(
        "--send-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help=_with_default(
            "a client that reads nothing of a response this long is disconnected, its requests aborted", 30.0
        ),
    )
    srv.add_argument(
        "--max-connections",
        type=int,
        default=None,
        metavar="N",
        help="open connections beyond this get 503 at once (default: 4096, fewer if the open-files limit is low)",
    )
    _gateway_flag(srv, "shutdown_timeout", type=float, metavar="SECONDS")
    _gateway_flag(srv, "engine_unresponsive_timeout", type=_positive_seconds, metavar="SECONDS")
    _gateway_flag(srv, "data_parallel_size", type=_positive, metavar="N")
    _gateway_flag(srv, "routing", choices=["cache-aware", "least-loaded", "round-robin"])
    add_engine_flags(srv)
    srv.set_defaults(func=cmd_serve)

    export = sub.add_parser("export-tokenizer", help="write the model's tokenizer as Hugging Face files into DIR")
    export.add_argument("dir", help="the directory to write into")
    export.add_argument("--model", default=None, help=field_help(EngineConfig, "model"))
    export.set_defaults(func=cmd_export_tokenizer)

    flags = sub.add_parser("flags", help="print the reference of every flag as Markdown (docs/flags.md)")
    flags.set_defaults(func=cmd_flags)
    return parser


def _invocation(action: argparse.Action) -> str:
    """How a flag is typed: each spelling with its value (choices, metavar, or the dest)."""
    if not action.option_strings:
        return action.metavar or action.dest.upper()
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    value = action.metavar or ("{" + ",".join(action.choices) + "}" if action.choices else action.dest.upper())
    value += {"*": " [...]", "+": " [...]"}.get(action.nargs, "")
    return ", ".join(f"{o} {value}" for o in action.option_strings)


REGENERATE = "python -m gateway.cli flags > docs/flags.md"


def flag_reference() -> str:
    """Every subcommand's flags as Markdown: the text of docs/flags.md, generated from the parser."""
    parser = build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {a.dest: a.help for a in commands._choices_actions}
    out = [
        "# Command-line flags",
        "",
        (
            "Generated from the parser in `gateway/cli.py`, whose help for each configuration flag is the docstring "
            "of its field in `engine/core/config.py` (`EngineConfig`) or `gateway/config.py` (`GatewayConfig`). Do "
            "not edit by hand; regenerate with:"
        ),
        "",
        "```sh",
        REGENERATE,
        "```",
        "",
        (
            "`orcinus generate` and `orcinus serve` take the same engine flags; the offline `LLM(...)` takes them as "
            "keywords named after the fields (`--max-num-seqs` is `max_num_seqs`, `--scheduling-level` is "
            "`scheduling`)."
        ),
    ]
    deprecated = []
    for name, sub in commands.choices.items():
        if name == "flags":
            continue
        out += ["", f"## `orcinus {name}`", "", helps[name][0].upper() + helps[name][1:] + ".", ""]
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, DeprecatedAlias):
                deprecated.append((name, action))
                continue
            if action.help == argparse.SUPPRESS:
                continue
            out.append(f"- `{_invocation(action)}`: {action.help.replace('%%', '%')}")
    out += ["", "## Deprecated spellings", "", "Still accepted; each use prints a line saying what replaced it.", ""]
    out += sorted({f"- `{', '.join(a.option_strings)}`: use `{a.replacement}`" for _, a in deprecated})
    return "\n".join(out) + "\n"


def cmd_flags(args: argparse.Namespace) -> int:
    print(flag_reference(), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
