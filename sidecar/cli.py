"""The `pagedserve` command line: serve, generate, chat, stats, health."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

# Not .settings here (it loads the engine's config, numpy and more): `pagedserve health`, run by every probe,
# imports what one health check needs and no more.
from .client_requests import DEFAULT_SOCKET


def _cmd_serve(args: argparse.Namespace) -> int:
    from .settings import load_settings

    settings = load_settings(args)
    if settings.tensor_parallel_size == 1:
        # The CPU kernels' compiles (seconds with an empty cache, both cores) begin now, beside the server's
        # imports and socket, instead of when the engine asks for its backend ~0.6 s later.
        from pagedserve.cupy_kernels.backend import start_warm_up

        start_warm_up(settings.device, settings.cpu_kernels)
    from .logging_setup import configure_logging
    from .server import run_server

    configure_logging(level=settings.log_level)
    return run_server(settings)


def _sampling(args: argparse.Namespace) -> dict:
    return {"temperature": args.temperature, "max_tokens": args.max_tokens, "seed": args.sample_seed}


def _constraint(args: argparse.Namespace) -> dict:
    """--json-schema FILE | --regex RE | --choice a,b,c | --grammar FILE as the client's keyword (empty: none)."""
    def read(path: str, flag: str) -> str:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"{flag}: cannot read {path!r}: {e.strerror}") from None

    if args.json_schema is not None:
        return {"json_schema": read(args.json_schema, "--json-schema")}
    if args.grammar is not None:
        return {"grammar": read(args.grammar, "--grammar")}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice is not None:
        return {"choice": [c for c in args.choice.split(",")]}
    return {}


def _local(args: argparse.Namespace, messages: list[dict] | None) -> int:
    from pagedserve.runtime import LLM, SamplingParams

    from pagedserve.runtime import StructuredOutputsParams

    constraint = {("json" if k == "json_schema" else k): v for k, v in _constraint(args).items()}
    structured = StructuredOutputsParams(**constraint) if constraint else None  # bad ones fail before loading
    llm = LLM(args.model, device=args.device, max_model_len=args.max_model_len, seed=0)
    params = SamplingParams(**_sampling(args), structured_outputs=structured)
    if messages is not None:
        out = llm.chat(messages, params, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def _remote(args: argparse.Namespace, messages: list[dict] | None) -> int | None:
    """Stream from a running server; None when no server answers (the caller then runs locally)."""
    import grpc

    from .client import PagedServeClient, PagedServeError

    with PagedServeClient(args.socket) as client:
        try:
            if client.health() != "SERVING":
                return None
        except PagedServeError as e:
            if e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return None
            raise
        kwargs = {k: v for k, v in _sampling(args).items() if v is not None}
        kwargs.update(_constraint(args))
        stream = client.chat(messages, **kwargs) if messages is not None else client.generate(args.prompt, **kwargs)
        for chunk in stream:
            print(chunk.text, end="", flush=True)
        print()
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    messages = [{"role": "user", "content": args.prompt}] if args.chat else None
    return _cmd_text(args, messages)


def _cmd_chat(args: argparse.Namespace) -> int:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.prompt})
    return _cmd_text(args, messages)


def _cmd_text(args: argparse.Namespace, messages: list[dict] | None) -> int:
    if not args.local and args.model is None:
        result = _remote(args, messages)
        if result is not None:
            return result
    return _local(args, messages)


def _cmd_stats(args: argparse.Namespace) -> int:
    from .client import PagedServeClient

    with PagedServeClient(args.socket) as client:
        info, stats = client.model_info(), client.server_stats()
    print(json.dumps({"model": dataclasses.asdict(info), "stats": dataclasses.asdict(stats)}, indent=2))
    return 0


# `pagedserve health` exit codes, for exec probes (Kubernetes, Docker HEALTHCHECK, scripts).
HEALTH_SERVING, HEALTH_NOT_SERVING, HEALTH_UNREACHABLE = 0, 1, 2


def _cmd_health(args: argparse.Namespace) -> int:
    """Ask the gRPC health service once: 0 when SERVING (with --live: whenever the server answers), 1 when it
    answers anything else (loading, draining, failed), 2 when nothing answers within --timeout."""
    import grpc

    from .client import PagedServeClient, PagedServeError, resolve_target

    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout:g}")
    target = resolve_target(args.socket)
    try:
        with PagedServeClient(target, timeout=args.timeout) as client:
            status = client.health(args.service)
    except PagedServeError as e:
        if e.code != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND is an answer: no such service
            print(f"pagedserve health: {target} did not answer (timeout {args.timeout:g} s): "
                  f"{e.code.name}: {e.message}", file=sys.stderr)
            return HEALTH_UNREACHABLE
        status = "SERVICE_UNKNOWN"
    print(status)
    return HEALTH_SERVING if status == "SERVING" or args.live else HEALTH_NOT_SERVING


def _add_text_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--sample-seed", type=int, default=None)
    p.add_argument("--local", action="store_true", help="run the model in this process even if a server is up")
    p.add_argument("--socket", default=None, help=f"server socket (default $PAGEDSERVE_SOCKET or {DEFAULT_SOCKET})")
    p.add_argument("--model", default=None, help="a .gguf file or HF directory: implies --local")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-model-len", type=int, default=None)
    guided = p.add_mutually_exclusive_group()
    guided.add_argument("--json-schema", metavar="FILE", default=None, help="the output follows this JSON Schema")
    guided.add_argument("--regex", metavar="RE", default=None, help="the output matches this regular expression")
    guided.add_argument("--choice", metavar="A,B,C", default=None, help="the output is one of these strings")
    guided.add_argument("--grammar", metavar="FILE", default=None,
                        help="the output follows this Lark (or GBNF) grammar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from .settings import add_settings_arguments

    s = sub.add_parser("serve", help="run the gRPC sidecar (unix socket by default; --http-port adds the OpenAI API)")
    add_settings_arguments(s)
    s.set_defaults(func=_cmd_serve)
    g = sub.add_parser("generate", help="generate a continuation (through a running server, else locally)")
    _add_text_args(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.set_defaults(func=_cmd_generate)
    c = sub.add_parser("chat", help="one chat turn (through a running server, else locally)")
    _add_text_args(c)
    c.add_argument("--system", default=None, help="an optional system message")
    c.set_defaults(func=_cmd_chat)
    st = sub.add_parser("stats", help="model info and live stats of a running server")
    st.add_argument("--socket", default=None)
    st.set_defaults(func=_cmd_stats)
    _add_health_parser(sub)
    from .bench_cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def _add_health_parser(sub) -> None:
    h = sub.add_parser("health", help="exit 0 if a running server is SERVING (for exec probes), else 1 or 2",
                       description=_cmd_health.__doc__)
    h.add_argument("--socket", default=None,
                   help=f"server socket path or host:port (default $PAGEDSERVE_SOCKET or {DEFAULT_SOCKET})")
    h.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer (default 5)")
    h.add_argument("--service", default="", help="a service name (default '': the whole server)")
    h.add_argument("--live", action="store_true",
                   help="liveness: exit 0 on any answer, NOT_SERVING (loading, draining) included")
    h.set_defaults(func=_cmd_health)


def main(argv: list[str] | None = None) -> int:
    from .client import PagedServeError
    from .logging_setup import configure_logging

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["health"]:  # a probe: only the parser it needs (the full one imports the engine's config)
        parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
        _add_health_parser(parser.add_subparsers(dest="command", required=True))
    else:
        parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "serve":
        configure_logging(level="warning", stream=sys.stderr)
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows up here, not in the interpreter's exit
        return code
    except (ValueError, PagedServeError) as e:  # bad input or a server error: one clear line, no traceback
        print(f"pagedserve: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `pagedserve stats | head`: the reader left; stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141


if __name__ == "__main__":
    sys.exit(main())
