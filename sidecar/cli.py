"""The `pagedserve` command line."""

from __future__ import annotations

import argparse
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a .gguf file or Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)


def _cmd_generate(args: argparse.Namespace) -> int:
    from pagedserve.runtime import LLM, SamplingParams

    llm = LLM(args.model, device=args.device, max_model_len=args.max_model_len, seed=args.seed)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sample_seed)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a continuation in this process and print it")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    g.add_argument("--sample-seed", type=int, default=None)
    _add_engine_args(g)
    g.set_defaults(func=_cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .logging_setup import configure_logging

    args = build_parser().parse_args(argv)
    configure_logging(level="warning", stream=sys.stderr)
    try:
        return args.func(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"pagedserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
