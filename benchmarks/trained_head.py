"""``python -m benchmarks trained-head``: train an EAGLE-3 head for the demo's target on this machine
(`hf_polybasic.training.train_head`), then measure it on held-out prompts with the Spec-Bench-style
benchmark (`benchmarks.bench`), beside the 0.5B int8 drafter and in the paper's shape.

1. **Data** (offline, `benchmarks.head_data`): ``--prompts`` templated prompts (code, math, prose) that the
   target answers (self-distillation), then the sources of standard-library modules, up to
   ``--max-tokens`` tokens in all.
2. **Training**: ``train_head`` with the options below; the head goes to ``OUTPUT/head`` (its
   ``training/`` folder makes a rerun of the same command resume instead of starting over, and train
   on for another ``--max-minutes`` where the run was stopped by them), what it did to
   ``OUTPUT/training.json``. ``--measure-only`` skips this step and measures the head already there.
3. **Measurement**: ``benchmarks.bench`` on ``--question-set`` (default ``unseen``: code, math word
   problems, prose, none of it trained on): plain ``generate``; ours with the 0.5B int8 drafter
   (``ours-draft``, ``ours-draft-auto``); ours with the head alone (``ours-head``: K constant,
   ``ours-head-auto``: cost-aware); and the paper's shape, target <- a quantized copy of it (``--copy``) <- the
   head (``ours-copy-head-auto``). Results in ``OUTPUT/bench`` (results.md: tok/s and speedup against plain
   generate, new tokens per target forward, each level's acceptance), a summary in ``OUTPUT/report.md``
   and ``OUTPUT/trained_head.json``.

``--models tiny`` runs all of it on random tiny models in seconds (the mechanics; the numbers mean
nothing). ``--models qwen`` is the real run: Qwen2.5-Coder-1.5B-Instruct (``hf-polybasic models install``).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import sys
from pathlib import Path

TINY_AUX_LAYERS = (0, 1)  # the tiny set's target has 2 layers: EAGLE-3's default three need 7


def add_trained_head_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser("trained-head", help="train a head for the demo's target (train-head), then time it "
                                 "against the 0.5B int8 drafter and under a quantized copy of the target")
    parser.add_argument("--models", choices=["tiny", "qwen"], default="tiny",
                        help="tiny: random models (seconds; mechanics only); qwen: Qwen2.5-Coder-1.5B-Instruct")
    parser.add_argument("--output", default=None, help="default: bench-results/trained-head-<models>")
    group = parser.add_argument_group("training (hf-polybasic train-head's options of the same names)")
    group.add_argument("--prompts", type=int, default=192, help="templated prompts the target answers")
    group.add_argument("--answer-tokens", type=int, default=128)
    group.add_argument("--answer-batch-size", type=int, default=16)
    group.add_argument("--max-tokens", type=int, default=48_000, help="tokens in all, answers first, then sources")
    group.add_argument("--seq-len", type=int, default=512)
    group.add_argument("--batch-size", type=int, default=2)
    group.add_argument("--epochs", type=int, default=1)
    group.add_argument("--steps", type=int, default=None, help="default: --epochs over the windows")
    group.add_argument("--lr", type=float, default=1e-3)
    group.add_argument("--draft-vocab-size", type=int, default=None,
                       help="default: 32000, or the whole vocabulary where smaller")
    group.add_argument("--intermediate-size", type=int, default=None, help="the head's MLP width (default: the "
                       "target's, as speculators builds it)")
    group.add_argument("--train-dtype", choices=["bf16", "fp32"], default="bf16",
                       help="the target's dtype while it answers and computes the features")
    group.add_argument("--max-minutes", type=float, default=25.0,
                       help="stop the optimisation after this long (checkpointed: the same command goes on)")
    group.add_argument("--seed", type=int, default=0)
    group = parser.add_argument_group("measurement (python -m benchmarks bench's options of the same names)")
    group.add_argument("--question-set", default="unseen", help="held-out prompts: unseen, heldout or fresh")
    group.add_argument("--groups", default=None, help="comma-separated task groups, e.g. code (default: all)")
    group.add_argument("--questions-per-group", type=int, default=None, help="default: all")
    group.add_argument("--max-new-tokens", type=int, default=64)
    group.add_argument("--repeats", type=int, default=1)
    group.add_argument("--warmup", type=int, default=1)
    group.add_argument("--num-draft-tokens", type=int, default=4, help="K of the drafter and of the head")
    group.add_argument("--block-threshold", type=int, default=8, help="mu of the copy in the paper's shape")
    group.add_argument("--target-dtype", choices=["bf16", "fp32"], default="bf16")
    group.add_argument("--pack-target", action="store_true", help="oneDNN-packed linear layers in the target")
    group.add_argument("--copy", choices=["int4", "int8"], default="int4",
                       help="the quantized copy of the target in the paper's shape (qwen; tiny: its noisy copy)")
    parser.add_argument("--measure-only", action="store_true",
                        help="measure the head a run already trained in --output (no training, not even a resumed one)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--cache-dir", default=None, help="model cache (see `hf-polybasic models`)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(handler=run_from_args)
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    try:
        report = run_trained_head(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"python -m benchmarks trained-head: error: {error}", file=sys.stderr)
        return 2
    print(report.read_text())
    print(f"[trained-head] head: {report.parent / 'head'}; benchmark: {report.parent / 'bench'}; report: {report}",
          file=sys.stderr)
    return 0


def run_trained_head(args: argparse.Namespace) -> Path:
    """Train, measure, report (see the module docstring); returns the report's path."""
    import torch

    from hf_polybasic.cli.machine import command_line, machine_info

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    out = Path(args.output or f"bench-results/trained-head-{args.models}")
    command = command_line()
    if args.measure_only:
        if not (out / "training.json").is_file():
            raise FileNotFoundError(f"--measure-only: no trained head in {out} (no training.json); train one first "
                                    "with the same command without --measure-only")
        trained = json.loads((out / "training.json").read_text())
    else:
        trained = train(args, out)
    bench = measure(args, out, command)
    summary = {"command": command, "machine": machine_info(), "training": trained,
               "num_draft_tokens": args.num_draft_tokens,
               "bench": {"output": str(out / "bench"), "summary": bench.summary}}
    (out / "trained_head.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    report = out / "report.md"
    report.write_text(_report(summary, out))
    return report


def train(args: argparse.Namespace, out: Path) -> dict:
    """Train the head into ``out/head`` (resuming a run of the same settings); what it did, as JSON."""
    import torch

    from hf_polybasic.training import train_head

    from .head_data import source_paths, write_prompts

    prompts = write_prompts(out / "data" / "prompts.jsonl", args.prompts, seed=args.seed)
    if args.models == "tiny":
        from hf_polybasic.testing import make_chain, make_tokenizer

        model, tokenizer = make_chain("qwen2", depth=3, seed=0)[0], make_tokenizer()  # the tiny bench set's target
        extra = dict(aux_layers=TINY_AUX_LAYERS)
    else:
        from hf_polybasic.cli.loading import load
        from hf_polybasic.cli.model_sets import QWEN_TARGET

        dtype = torch.bfloat16 if args.train_dtype == "bf16" else torch.float32
        model, tokenizer = load(QWEN_TARGET, dtype, cache_dir=args.cache_dir)
        extra = {}
    result = train_head(model, tokenizer, out / "head", texts=source_paths(), prompts=[prompts],
                        answer_tokens=args.answer_tokens, answer_batch_size=args.answer_batch_size,
                        max_tokens=args.max_tokens, seq_len=args.seq_len, batch_size=args.batch_size,
                        epochs=args.epochs, steps=args.steps, lr=args.lr, draft_vocab_size=args.draft_vocab_size,
                        intermediate_size=args.intermediate_size, seed=args.seed, max_minutes=args.max_minutes,
                        progress=not args.no_progress, **extra)
    del model
    gc.collect()
    last = result.losses[-20:]
    trained = {"head": str(result.directory), "steps": result.steps, "total_steps": result.total_steps,
            "windows": result.windows, "seq_len": args.seq_len, "answered_prompts": result.answers,
            "draft_vocab_size": result.draft_vocab_size, "feature_layers": list(result.feature_layers),
            "first_loss": round(result.losses[0], 4) if result.losses else None,
            "last_loss": round(sum(last) / len(last), 4) if last else None, "stopped_early": result.stopped_early,
            "resumed_from": result.resumed_from, "seconds": round(result.seconds, 1),
            "phases_seconds": {key: round(value, 1) for key, value in result.timings.items()},
            "train_dtype": args.train_dtype}
    (out / "training.json").write_text(json.dumps(trained, indent=2) + "\n")
    return trained


def measure(args: argparse.Namespace, out: Path, command: str):
    """The benchmark of the trained head (see the module docstring); its `BenchResult`."""
    from hf_polybasic.cli.model_sets import LABELS, build_model_set
    from hf_polybasic.config import PolybasicConfig
    from hf_polybasic.levels import draft_head

    from .bench.methods import needed_pool, polybasic
    from .bench.runner import run_benchmark
    from .bench.settings import BenchSettings

    names = ("plain", "ours-draft", "ours-draft-auto")
    copy_key = "mid" if args.models == "tiny" or args.copy == "int8" else "mid-int4"
    settings = BenchSettings(models=args.models, target_dtype=args.target_dtype if args.models == "qwen" else "fp32",
                             pack_target=args.pack_target, methods=names, question_set=args.question_set,
                             groups=tuple(g.strip() for g in args.groups.split(",")) if args.groups else None,
                             questions_per_group=args.questions_per_group, max_new_tokens=args.max_new_tokens,
                             repeats=args.repeats, warmup=args.warmup, num_draft_tokens=args.num_draft_tokens,
                             block_threshold=args.block_threshold, output_dir=str(out / "bench"),
                             cache_dir=args.cache_dir, progress=not args.no_progress, command=command)
    model_set = build_model_set(args.models, needed_pool(names) | {copy_key}, settings.target_dtype,
                                args.cache_dir, pack_target=args.pack_target)
    head = draft_head(str(out / "head"), verifier=model_set.target)
    digest = hashlib.sha256((out / "head" / "model.safetensors").read_bytes()).hexdigest()[:12]
    label, copy_label = f"trained EAGLE-3 head {digest}", LABELS[args.models][copy_key]
    constant = PolybasicConfig(num_draft_tokens=args.num_draft_tokens, schedule="constant")
    aware = PolybasicConfig(num_draft_tokens=args.num_draft_tokens, block_threshold=args.block_threshold,
                            schedule="cost_aware")
    methods = [polybasic([head], [label], constant, "ours-head"),
               polybasic([head], [label], aware, "ours-head-auto"),
               polybasic([model_set.pool[copy_key], head], [copy_label, label], aware, "ours-copy-head-auto")]
    return run_benchmark(settings, extra_methods=methods, model_set=model_set)


def _report(summary: dict, out: Path) -> str:
    training, machine = summary["training"], summary["machine"]
    phases = ", ".join(f"{phase} {seconds} s" for phase, seconds in training["phases_seconds"].items())
    lines = [
        "# A trained head on this machine (python -m benchmarks trained-head)", "",
        f"- command: `{summary['command']}`",
        f"- machine: {machine.get('cpu')}, {machine.get('logical_cores')} logical cores, flags "
        f"{', '.join(machine.get('cpu_flags') or [])}; torch {machine.get('torch')}, transformers "
        f"{machine.get('transformers')}",
        f"- head: `{training['head']}` (speculators eagle3, draft vocabulary {training['draft_vocab_size']}, reads the "
        f"inputs of layers {training['feature_layers']})",
        f"- training: {training['steps']} of {training['total_steps']} steps on {training['windows']} windows of "
        f"{training['seq_len']} tokens ({training['answered_prompts']} answered prompts, then library sources); loss "
        f"{training['first_loss']} at the first step, {training['last_loss']} over the last 20"
        f"{' (stopped by --max-minutes)' if training['stopped_early'] else ''}",
        f"- time: {training['seconds']} s ({phases})", "",
        *_drafting_lines(out / "bench" / "results.jsonl", summary["num_draft_tokens"]),
        (out / "bench" / "results.md").read_text(),
    ]
    return "\n".join(lines) + "\n"


def position_acceptance(records: list[dict], method: str, positions: int) -> dict[str, list[float]]:
    """Per group, for j = 1 .. ``positions``: the share of the target's verifications of ``method`` in
    which at least j drafts were accepted (the j-th draft of a round, and every one before it)."""
    lengths: dict[str, list[int]] = {}
    for record in records:
        if record["method"] == method and record.get("levels"):
            lengths.setdefault(record["group"], []).extend(record["levels"][0]["acceptance_lengths"])
    return {group: [sum(length > j for length in values) / len(values) for j in range(1, positions + 1)]
            for group, values in lengths.items() if values}


def seconds_per_forward(records: list[dict], method: str) -> float | None:
    """The drafting level's (the bottom one's) own seconds per forward pass, pooled over ``method``'s calls."""
    levels = [record["levels"][-1] for record in records if record["method"] == method and record.get("levels")]
    forwards = sum(level["forward_passes"] for level in levels)
    return sum(level["seconds"] for level in levels) / forwards if forwards else None


def _drafting_lines(results: Path, positions: int) -> list[str]:
    """The head against the drafter, draft by draft (the constant-K methods, ``positions`` = K): acceptance
    per position and what one forward of the drafting level costs."""
    from .bench.records import read_records

    records = read_records(results)
    methods = [m for m in ("ours-draft", "ours-head") if any(r["method"] == m for r in records)]
    if not methods:
        return []
    lines = ["## Draft by draft (K constant)", "",
             "Share of the target's verifications in which at least j drafts were accepted, per group; and the "
             "drafting level's own seconds per forward pass (its forwards, processing and draws).", "",
             "| method | group | " + " | ".join(f"j={j}" for j in range(1, positions + 1)) + " | s per forward |",
             "|---|---|" + "---|" * (positions + 1)]
    for method in methods:
        cost = seconds_per_forward(records, method)
        for group, shares in position_acceptance(records, method, positions).items():
            lines.append(f"| {method} | {group} | " + " | ".join(f"{share:.2f}" for share in shares)
                         + f" | {'–' if cost is None else f'{cost * 1000:.1f} ms'} |")
    return [*lines, ""]
