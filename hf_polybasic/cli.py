"""Command line: ``hf-polybasic <command>``. Each command lives in its own module."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(max_new_tokens=args.max_new_tokens, repeats=args.repeats, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-polybasic", description="Polybasic speculative decoding for transformers")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="compare plain generate with 2- and 3-model chains on small random models")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--repeats", type=int, default=3, help="timed runs per method; the median is reported")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
