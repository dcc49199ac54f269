"""The benchmark commands: ``python -m benchmarks <command>`` from the repository root (the installed
``hf-polybasic`` names them and says where they run, `hf_polybasic.cli.main.BENCHMARK_COMMANDS`).

``bench`` (`benchmarks.bench`), ``gpu-bench`` (`benchmarks.gpu_bench`), ``batches``
(`benchmarks.batch_bench`), ``levels`` (`benchmarks.levels_table`), ``vocab-coverage``
(`benchmarks.vocab_coverage`), ``rollback-cost`` (`benchmarks.rollback_cost`), ``stopping-replay``
(`benchmarks.stopping_replay`), ``curve-noise`` (`benchmarks.curve_noise`), ``acceptance-features``
(`benchmarks.acceptance_features`) and ``trained-head``
(`benchmarks.trained_head`). Each command's module is
imported only when it runs.
"""

from __future__ import annotations

import argparse
import sys

from .bench.cli import add_bench_parser
from .gpu_bench import add_gpu_bench_parser
from .trained_head import add_trained_head_parser

# the order in which they are registered; hf_polybasic.cli.main.BENCHMARK_COMMANDS names the same
COMMANDS = ("levels", "vocab-coverage", "batches", "rollback-cost", "stopping-replay", "curve-noise",
            "acceptance-features", "bench", "gpu-bench", "trained-head")


def _levels(args: argparse.Namespace) -> int:
    from .levels_table import run_levels_table

    print(run_levels_table(args.models, args.k, args.new_tokens, args.stride, args.repeats, args.out, tuple(args.only),
                           tuple(args.restricted_head)))
    return 0


def _vocab_coverage(args: argparse.Namespace) -> int:
    from .vocab_coverage import DEFAULT_RESULTS, run_vocab_coverage

    sizes = [int(size) for size in args.sizes.split(",")]
    print(run_vocab_coverage(tuple(args.results or DEFAULT_RESULTS), sizes, args.out, tuple(args.drafter), args.k))
    return 0


def _batches(args: argparse.Namespace) -> int:
    from .batch_bench import markdown, run_batches

    sizes = [int(size) for size in args.batch_sizes.split(",")]
    result = run_batches(args.models, args.target_dtype, args.pack_target, sizes, args.max_new_tokens, args.repeats,
                         args.output, progress=not args.no_progress, question_set=args.question_set)
    print(markdown(result))
    return 0


def _rollback_cost(args: argparse.Namespace) -> int:
    from .rollback_cost import run_rollback_cost

    ks = [int(k) for k in args.ks.split(",")]
    print(run_rollback_cost(args.tiny, args.layers, ks, args.repeats, args.out, args.threads))
    return 0


def _curve_noise(args: argparse.Namespace) -> int:
    from .curve_noise import run_curve_noise

    sigmas = [float(sigma) for sigma in args.sigmas.split(",")]
    print(run_curve_noise(args.replays, sigmas, args.calls, args.seeds, args.out))
    return 0


def _acceptance_features(args: argparse.Namespace) -> int:
    from .acceptance_features import run_acceptance_features

    print(run_acceptance_features(args.replays, args.out))
    return 0


def _stopping_replay(args: argparse.Namespace) -> int:
    from .stopping_replay import run_stopping_replay

    categories = args.categories.split(",") if args.categories else None
    print(run_stopping_replay(args.models, args.target_dtype, args.question_file, categories, args.questions_per_group,
                              args.max_new_tokens, args.depth, args.out, args.pack_target, args.streams,
                              args.skip_questions, args.fit_line), end="")
    return 0


def add_benchmark_parsers(commands) -> None:
    """Register every benchmark command on an ``add_subparsers()`` object; handlers are ``args.handler``."""
    levels = commands.add_parser("levels", help="cost and greedy agreement of each way to build a chain level")
    levels.add_argument("--models", choices=["qwen", "tiny"], default="qwen")
    levels.add_argument("--k", type=int, default=8, help="draft length K for the verify cost and the agreement")
    levels.add_argument("--new-tokens", type=int, default=48, help="greedy continuation length per prompt")
    levels.add_argument("--stride", type=int, default=8, help="draft every STRIDE positions of a continuation")
    levels.add_argument("--repeats", type=int, default=5, help="timed forward passes per cost (median)")
    levels.add_argument("--out", default=None, help="directory for levels_<models>.json and .md")
    levels.add_argument("--only", action="append", default=[],
                        help="measure only the candidates whose name contains this (repeatable), e.g. --only int4")
    levels.add_argument("--restricted-head", type=int, action="append", default=[], metavar="N",
                        help="also the drafter (0.5B int8 and bf16) with its output layer restricted to N ids "
                        "(hf_polybasic.levels.restricted_vocabulary; repeatable)")
    levels.set_defaults(handler=_levels)

    coverage = commands.add_parser("vocab-coverage", help="share of prompt and generated tokens a restricted drafter "
                                   "vocabulary (restricted_vocabulary: first N ids + fed tokens) holds, on the target's "
                                   "outputs the benchmark recorded")
    coverage.add_argument("--sizes", default="8192,16384,32768,49152,65536", help="comma-separated N (ids kept)")
    coverage.add_argument("--results", action="append", default=None, metavar="RESULTS_JSONL",
                          help="a benchmark results.jsonl (repeatable; default: the committed greedy and sampled runs)")
    coverage.add_argument("--drafter", action="append", choices=["int8", "bf16", "fp32"], default=[],
                          help="also the greedy agreement of the 0.5B (int8 as in the benchmark, bf16, fp32) with the "
                          "recorded greedy outputs, unrestricted and restricted to each N (repeatable)")
    coverage.add_argument("--k", type=int, default=8, help="draft length for --drafter's agreement")
    coverage.add_argument("--out", default=None, help="directory for vocab_coverage.md and .json")
    coverage.set_defaults(handler=_vocab_coverage)

    batches = commands.add_parser("batches", help="batched decoding, ours against plain batched generate, per batch size")
    batches.add_argument("--models", choices=["qwen", "tiny"], default="qwen")
    batches.add_argument("--target-dtype", choices=["fp32", "bf16"], default="bf16")
    batches.add_argument("--pack-target", action="store_true", help="oneDNN-packed linear layers for the target")
    batches.add_argument("--batch-sizes", default="1,2,4,8", help="comma-separated batch sizes (at most 8)")
    batches.add_argument("--max-new-tokens", type=int, default=64)
    batches.add_argument("--repeats", type=int, default=3, help="interleaved repeats; medians are reported")
    batches.add_argument("--output", default=None, help="directory for batches.json and batches.md")
    batches.add_argument("--question-set", choices=["heldout", "unseen"], default="heldout",
                         help="whose code prompts make the rows (unseen: the second held-out set's first)")
    batches.add_argument("--no-progress", action="store_true", help="no progress bar")
    batches.set_defaults(handler=_batches)

    rollback = commands.add_parser(
        "rollback-cost", help="what rolling back a hybrid model's recurrent state costs per round (Qwen3-Next layer "
        "shapes, random weights), against its verification forward"
    )
    rollback.add_argument("--tiny", action="store_true", help="a tiny random model instead (seconds; a smoke test)")
    rollback.add_argument("--layers", type=int, default=4, help="depth (every 4th layer attention, as in Qwen3-Next)")
    rollback.add_argument("--ks", default="2,4,8,16", help="comma-separated draft counts k")
    rollback.add_argument("--repeats", type=int, default=5, help="interleaved repeats; medians are reported")
    rollback.add_argument("--out", default=None, help="directory for rollback_cost.json and rollback_cost.md")
    rollback.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    rollback.set_defaults(handler=_rollback_cost)

    replay = commands.add_parser(
        "stopping-replay", help="rules that stop drafting by confidence (transformers', ours, every threshold, the "
        "hindsight oracle) replayed along the target's greedy answers with this machine's measured costs")
    replay.add_argument("--models", choices=["qwen", "tiny"], default="qwen")
    replay.add_argument("--target-dtype", choices=["fp32", "bf16"], default="fp32")
    replay.add_argument("--pack-target", action="store_true", help="the target's linear layers packed (its costs)")
    replay.add_argument("--question-file", default=None, help="a Spec-Bench question.jsonl (default: the shipped set)")
    replay.add_argument("--categories", default=None, help="comma-separated categories of the question file")
    replay.add_argument("--questions-per-group", type=int, default=3)
    replay.add_argument("--skip-questions", type=int, default=0,
                        help="leave out the first N questions of each category (prompts earlier runs did not use)")
    replay.add_argument("--max-new-tokens", type=int, default=64)
    replay.add_argument("--depth", type=int, default=24, help="tokens the drafter drafts at every position")
    replay.add_argument("--out", default=None, help="directory for streams.jsonl, summary.json and results.md")
    replay.add_argument("--streams", default=None, help="the streams.jsonl of an earlier run: its turns of the "
                        "selected questions replayed again with costs measured now, the models not run on them")
    replay.add_argument("--fit-line", action="store_true", help="price the rounds by the least-squares line "
                        "through the measured T(k), so that one width's noisy timing does not decide small differences")
    replay.set_defaults(handler=_stopping_replay)

    noise = commands.add_parser(
        "curve-noise", help="what noisy forward timings cost the default schedule: stopping-replay reports replayed "
        "after many calls' refreshes of their cost curve (no models run)")
    noise.add_argument("replays", nargs="+", help="stopping-replay report directories (streams.jsonl, summary.json)")
    noise.add_argument("--sigmas", default="0.1,0.2", help="comma-separated spreads of log(timed / true) per forward")
    noise.add_argument("--calls", type=int, default=150, help="calls whose forwards refresh the stored curve")
    noise.add_argument("--seeds", type=int, default=6, help="seeded runs per spread and rule")
    noise.add_argument("--out", default=None, help="directory for summary.json and results.md")
    noise.set_defaults(handler=_curve_noise)

    features = commands.add_parser(
        "acceptance-features", help="whether signals beyond a draft's confidence (the one before it, its depth, the "
        "recent agreement) foretell its acceptance: stopping-replay streams, held-out log-loss (no models run)")
    features.add_argument("replays", nargs="+", help="stopping-replay report directories (streams.jsonl)")
    features.add_argument("--out", default=None, help="directory for summary.json and results.md")
    features.set_defaults(handler=_acceptance_features)

    add_bench_parser(commands)
    add_gpu_bench_parser(commands)
    add_trained_head_parser(commands)


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks <command> [options]``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description="The benchmarks of hf_polybasic")
    add_benchmark_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.handler(args)
