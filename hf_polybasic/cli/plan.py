"""``hf-polybasic plan``: profile a pool, plan a chain, and with ``--validate`` check the plan by measuring.

The pool (`hf_polybasic.cli.model_sets.build_pool`): ``qwen`` is the Qwen2.5-Coder 1.5B target,
an int8 copy of it, the 0.5B in int8, an early exit of the target and
``PromptLookup(max_ngram=3, num_tokens=8)``; ``tiny`` is the same shape built from random models
(mechanics only: their forwards cost so little that per-call overheads dominate). The validation
is `hf_polybasic.cli.plan_validation`, its report `hf_polybasic.cli.plan_report`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..planning import plan, profile
from .machine import machine_info
from .model_sets import DEFAULT_DTYPE, Pool, build_pool
from .plan_report import plot_predicted_vs_measured, validation_markdown
from .plan_validation import GRIDS, grid_chains, validate, validation_grid
from .prompts import default_questions, encode, messages_for

# one question per group in this order, then the second of each, ...: copy-heavy tasks come first
PROMPT_GROUPS = ("code", "summarization", "qa", "math reasoning", "rag", "translation", "multi-turn conversation")


def pool_prompts(pool: Pool, count: int, max_new_tokens: int) -> list[torch.LongTensor]:
    """``count`` default benchmark prompts ([1, L] ids, chat-templated, cut to the context)."""
    if count < 1:
        raise ValueError(f"--prompts must be >= 1, got {count}")
    questions = default_questions()
    by_group = {group: [q for q in questions if q.group == group] for group in PROMPT_GROUPS}
    chosen = []
    for index in range(max(len(v) for v in by_group.values())):
        chosen += [members[index] for members in by_group.values() if index < len(members)]
    chosen = chosen[:count]
    return [encode(pool.model_set, messages_for(q, 0, []), max_new_tokens)[0]["input_ids"] for q in chosen]


def add_plan_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "plan", help="profile a pool of models, predict every chain and pick the fastest (--validate: measure it)"
    )
    parser.add_argument("--models", choices=list(DEFAULT_DTYPE), default="qwen",
                        help="qwen: Qwen2.5-Coder 1.5B target, its int8 copy, 0.5B int8, an early exit, PromptLookup; "
                        "tiny: the same shape from random models (seconds; mechanics only)")
    parser.add_argument("--target-dtype", choices=["bf16", "fp32"], default=None,
                        help="default: bf16 (qwen), fp32 (tiny)")
    parser.add_argument("--max-new-tokens", type=int, default=48,
                        help="reference text (and validation budget) per prompt")
    parser.add_argument("--prompts", type=int, default=4, help="default benchmark prompts to use (one per task group)")
    parser.add_argument("--cost-repeats", type=int, default=3, help="timed forwards per cost (median)")
    parser.add_argument("--max-levels", type=int, default=None, help="most models per chain, the target included")
    parser.add_argument("--plan-tokens", type=int, default=None,
                        help="plan for calls making this many tokens, prefills included (default: --max-new-tokens, "
                        "the validation budget; 0: per token of long generations)")
    parser.add_argument("--early-exit-layers", type=int, default=None,
                        help="layers of the target's early-exit candidate (default 14 qwen, 1 tiny; 0: none)")
    parser.add_argument("--four-bit", action="append", default=[], choices=["nf4", "int4"],
                        help="add a 4-bit copy of the target to the pool (repeatable; nf4 needs hf_polybasic[quant4], "
                        "int4 only torch)")
    parser.add_argument("--out", default=None, help="output directory (default: plan-results/<models>)")
    parser.add_argument("--validate", action="store_true", help="also time a grid of configurations and plain generate")
    parser.add_argument("--grid", choices=list(GRIDS), default="small",
                        help="validation grid: small = 2-model K in {3,5,8}, 3-model (K,mu) in {(3,6),(4,10)}; "
                        "tiny = K 4, (4,8)")
    parser.add_argument("--repeats", type=int, default=3, help="--validate: timed runs per configuration (median)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--cache-dir", default=None, help="model cache for --models qwen (see `hf-polybasic models`)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(handler=run_from_args)
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    for name in ("max_new_tokens", "prompts", "cost_repeats", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    progress = not args.no_progress
    out = Path(args.out or f"plan-results/{args.models}")
    out.mkdir(parents=True, exist_ok=True)
    pool = build_pool(args.models, args.target_dtype, args.early_exit_layers, args.cache_dir, tuple(args.four_bit))
    prompts = pool_prompts(pool, args.prompts, args.max_new_tokens)
    the_profile = profile(
        pool.target, pool.candidates, pool.tokenizer, prompts, do_sample=False, max_new_tokens=args.max_new_tokens,
        repeats=args.cost_repeats, progress=progress, generate_kwargs=pool.generate_options,
    )
    the_profile.info["command"] = " ".join(["hf-polybasic", *sys.argv[1:]])
    the_profile.info["models"] = pool.model_set.info
    plan_tokens = args.max_new_tokens if args.plan_tokens is None else (args.plan_tokens or None)
    the_plan = plan(the_profile, max_levels=args.max_levels, new_tokens=plan_tokens)
    report = f"# Plan ({args.models})\n\n## Profile\n\n{the_profile.markdown()}\n\n## Plan\n\n{the_plan.markdown()}\n"
    print(report)
    the_profile.save(out / "profile.json")
    (out / "plan.json").write_text(json.dumps(the_plan.to_dict(), indent=1) + "\n")
    (out / "plan.md").write_text(report)
    if args.validate:
        grid = validation_grid(the_profile, the_plan.best, args.grid)
        count = len(grid) + 1 + len(grid_chains(grid))  # plain, static, one cost-aware per chain
        print(
            f"validation: {count} configurations (plain and cost-aware included) x {args.repeats} repeat(s) x {len(prompts)} "
            f"prompt(s) of {args.max_new_tokens} tokens = {count * args.repeats * len(prompts)} timed generate calls"
        )
        record = validate(pool, the_profile, the_plan, prompts, args.max_new_tokens, args.repeats, args.grid, progress)
        record["command"] = the_profile.info["command"]
        record["machine"] = machine_info()
        header = f"{args.models}, target {args.target_dtype or DEFAULT_DTYPE[args.models]}"
        (out / "validation.json").write_text(json.dumps(record, indent=1) + "\n")
        (out / "validation.md").write_text(validation_markdown(record, header))
        plot_predicted_vs_measured(record, out / "predicted_vs_measured.png")
        planner = record["planner"]
        print(
            f"validation: plan {planner['choice']} measured {planner['measured_speedup']:.2f}x, best measured "
            f"{planner['best_measured']} {planner['best_measured_speedup']:.2f}x (ratio {planner['ratio']:.3f})"
        )
    print(f"wrote {out}/")
    return 0
