"""``python -m benchmarks bench``: the Spec-Bench-style benchmark from the command line.

`add_bench_parser` registers the subcommand on the package's command line; ``python -m
benchmarks.bench`` (from the repository root) runs it on its own.
"""

from __future__ import annotations

import argparse
import sys

from .methods import DEFAULT_METHODS, RECIPES
from .prompts import QUESTION_SETS
from .settings import DECODINGS

QUICK = {"questions_per_group": 1, "max_new_tokens": 24, "repeats": 1, "warmup": 1}
FULL = {"questions_per_group": None, "max_new_tokens": 256, "repeats": 1, "warmup": 1}


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="small run: 1 question per group, 24 new tokens, 1 repeat (explicit flags still win)")
    parser.add_argument("--models", choices=["tiny", "qwen"], default="tiny",
                        help="tiny: random models from hf_polybasic.testing (seconds); qwen: Qwen2.5-Coder 1.5B "
                        "target with 0.5B and int8 copies (installed by `hf-polybasic models install`)")
    parser.add_argument("--target-dtype", choices=["fp32", "bf16"], default="fp32",
                        help="dtype of the target (fp32 keeps greedy equality checks meaningful)")
    parser.add_argument("--pack-target", action="store_true",
                        help="oneDNN-packed linear layers in the target for every method, plain included "
                        "(hf_polybasic.models.packed; on CPUs where small batches are slow in MKL)")
    parser.add_argument("--methods", type=_names, default=None,
                        help=f"comma-separated method names (default: {','.join(DEFAULT_METHODS)}); plain is "
                        "always run, as the baseline; see --list-methods")
    parser.add_argument("--list-methods", action="store_true", help="print the method names and exit")
    parser.add_argument("--question-file", default=None,
                        help="Spec-Bench-format JSONL (question_id, category, turns); default: a shipped set")
    parser.add_argument("--question-set", choices=list(QUESTION_SETS), default="default",
                        help="the shipped set to run without --question-file: 'default' (3 per group, 7 groups), "
                        "'heldout' (5 code and 5 prose prompts never used for tuning), 'unseen' (5 code, 5 math "
                        "word problems, 5 prose, written before issue 26's changes and used only to measure them) "
                        "or 'fresh' (the same groups, written before issues 29-30's changes were measured)")
    parser.add_argument("--groups", type=_names, default=None,
                        help="comma-separated task groups to run, e.g. qa,math-reasoning,code (default: all)")
    parser.add_argument("--categories", type=_names, default=None,
                        help="comma-separated categories of the question file to run, each reported as a group of its "
                        "own (e.g. Spec-Bench's coding,math_reasoning,writing), instead of --groups")
    parser.add_argument("--questions-per-group", type=int, default=None,
                        help="first N questions of each group (default: all; --quick: 1)")
    parser.add_argument("--skip-questions", type=int, default=0,
                        help="leave out the first N questions of each group (prompts earlier runs did not use)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="budget per turn (default 256; --quick: 24)")
    parser.add_argument("--decoding", choices=list(DECODINGS), default="greedy",
                        help="greedy, sample-t1 (temperature 1) or sample-t0.7-p0.9; top_k is off when sampling")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs of everything; medians are reported")
    parser.add_argument("--warmup", type=int, default=None, help="untimed short calls per method before timing")
    parser.add_argument("--seed", type=int, default=0, help="base of the per-question sampling seeds")
    parser.add_argument("--num-draft-tokens", type=int, default=4,
                        help="K of our model drafters and transformers' num_assistant_tokens")
    parser.add_argument("--block-threshold", type=int, default=8, help="mu of our 3-model chains")
    parser.add_argument("--lookup-tokens", type=int, default=8, help="tokens per prompt-lookup draft (ours and HF's)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--output", default=None,
                        help="output directory, also the resume cache (default: bench-results/<models>-<decoding>"
                        "[-quick])")
    parser.add_argument("--cache-dir", default=None, help="model cache for --models qwen (see `hf-polybasic models`)")
    parser.add_argument("--report-only", action="store_true",
                        help="rebuild the tables and plots of --output from its cached results; run nothing")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def settings_from_args(args: argparse.Namespace, command: str | None = None):
    from .settings import BenchSettings

    sizes = dict(QUICK if args.quick else FULL)
    for name in sizes:
        value = getattr(args, name)
        if value is not None:
            sizes[name] = value
    output = args.output or f"bench-results/{args.models}-{args.decoding}{'-quick' if args.quick else ''}"
    return BenchSettings(
        models=args.models,
        target_dtype=args.target_dtype,
        pack_target=args.pack_target,
        methods=args.methods,
        question_file=args.question_file,
        question_set=args.question_set,
        groups=args.groups,
        categories=args.categories,
        skip_questions=args.skip_questions,
        decoding=args.decoding,
        seed=args.seed,
        num_draft_tokens=args.num_draft_tokens,
        block_threshold=args.block_threshold,
        lookup_tokens=args.lookup_tokens,
        threads=args.threads,
        output_dir=output,
        cache_dir=args.cache_dir,
        progress=not args.no_progress,
        quick=args.quick,
        command=command,
        **sizes,
    )


def run_from_args(args: argparse.Namespace) -> int:
    """The subcommand's handler: run (or resume) the benchmark, print the table, return the exit
    status (1 if a lossless method's greedy output differed from plain generate's)."""
    if args.list_methods:
        for name, recipe in RECIPES.items():
            default = "default" if name in DEFAULT_METHODS else "       "
            print(f"{name:<27} {default}  needs: {', '.join(recipe.needs) or '-'}")
        return 0
    from hf_polybasic.cli.machine import command_line

    command = getattr(args, "command_line", None) or command_line()
    try:
        settings = settings_from_args(args, command)
        if args.report_only:
            from .runner import rebuild_report

            result = rebuild_report(settings.output_dir, settings)
        else:
            from .runner import run_benchmark

            result = run_benchmark(settings)
    except (ValueError, FileNotFoundError) as error:
        print(f"python -m benchmarks bench: error: {error}", file=sys.stderr)
        return 2
    print((result.output_dir / "results.md").read_text(encoding="utf-8"))
    print(f"[bench] {result.units_run} calls run, {result.units_cached} taken from the cache; "
          f"files: {', '.join(str(p) for p in result.files)}", file=sys.stderr)
    if result.mismatches:
        print(f"[bench] !!! {len(result.mismatches)} greedy output(s) differ from plain generate: see the "
              f"'Greedy equality' section of {result.output_dir / 'results.md'}", file=sys.stderr)
    return result.exit_code


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``bench`` on an ``add_subparsers()`` object; its handler is ``args.handler``."""
    parser = subparsers.add_parser(
        "bench",
        help="Spec-Bench-style benchmark: plain generate, transformers' assisted modes and polybasic chains",
        description="Run every method on the same prompts with the same budget; write results.jsonl (the resume "
        "cache), summary.json, results.md and PNG plots to the output directory.",
    )
    add_arguments(parser)
    parser.set_defaults(handler=run_from_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-polybasic")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
