"""``hf-polybasic plan``: profile a pool, plan a chain, and with ``--validate`` check the plan by measuring.

The pool (`build_pool`): the tools' model sets (`hf_polybasic.tools.model_sets`):
``qwen`` is the Qwen2.5-Coder 1.5B target, an int8 copy of it, the 0.5B in int8, an early exit of
the target and ``PromptLookup(max_ngram=3, num_tokens=8)``; ``tiny`` is the same shape built from
random models (mechanics only: their forwards cost so little that per-call overheads dominate).

``--validate`` times a small grid of configurations (`validation_grid`) with ``target.generate``
against plain ``generate`` on the same prompts (greedy, same budget, median of ``--repeats``, the
repeats outermost so that drift of a shared machine hits every configuration alike), and
writes predicted vs measured speedups, the planner's choice vs the best measured configuration, and
the paper's Table 1 for every insertion of a middle model (`insertion_rows`), with measured
acceptance lengths read as in `hf_polybasic.theory.TimeModelInputs` (N / F_i).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..config import PolybasicConfig
from ..drafters import PromptLookup
from ..integration import generate as polybasic_generate
from ..integration import last_stats
from ..levels import early_exit
from ..planning import TARGET, ChainPrediction, Plan, Profile, plan, predict, profile, theory
from .bench.prompts import default_questions
from .bench.runner import encode, messages_for
from .harness import timed_call
from .model_sets import LABELS, build_model_set
DEFAULT_EARLY_EXIT = {"qwen": 14, "tiny": 1}
DEFAULT_DTYPE = {"qwen": "bf16", "tiny": "fp32"}
# one question per group in this order, then the second of each, ...: copy-heavy tasks come first
PROMPT_GROUPS = ("code", "summarization", "qa", "math reasoning", "rag", "translation", "multi-turn conversation")
GRIDS = {
    # K of 2-model chains; (K, mu) of 3-model chains
    "small": {"two": (3, 5, 8), "three": ((3, 6), (4, 10))},
    "tiny": {"two": (4,), "three": ((4, 8),)},
}
WARMUP_TOKENS = 4
TARGET_RATIO = 0.9


# ===================================================================================== the pool
@dataclass
class Pool:
    """The target, its tokenizer, the candidates (label -> model or Drafter) and generate options."""

    name: str
    target: torch.nn.Module
    tokenizer: Any
    candidates: dict[str, Any]
    model_set: Any
    generate_options: dict = field(default_factory=dict)


def build_pool(
    models: str, target_dtype: str | None = None, early_exit_layers: int | None = None, cache_dir=None
) -> Pool:
    """The benchmark's model set for ``models`` ("qwen" or "tiny") plus an early exit and PromptLookup.

    ``early_exit_layers``: layers of the target's early-exit view (default 14 for qwen, 1 for tiny;
    0 leaves it out).
    """
    if models not in DEFAULT_DTYPE:
        raise ValueError(f"--models must be one of {list(DEFAULT_DTYPE)}, got {models!r}")
    model_set = build_model_set(models, {"mid", "draft"}, target_dtype or DEFAULT_DTYPE[models], cache_dir=cache_dir)
    labels = LABELS[models]
    candidates: dict[str, Any] = {labels[key]: model_set.pool[key] for key in ("mid", "draft")}
    layers = DEFAULT_EARLY_EXIT[models] if early_exit_layers is None else early_exit_layers
    if layers:
        candidates[f"exit{layers}"] = early_exit(model_set.target, layers)
    candidates[labels["lookup"]] = PromptLookup(max_ngram=3, num_tokens=8)
    return Pool(models, model_set.target, model_set.tokenizer, candidates, model_set, dict(model_set.generate_options))


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


# =============================================================================== measuring
@dataclass
class Measurement:
    """One configuration, timed on every prompt.

    Attributes:
        name: the configuration.
        seconds: per repeat, generation time summed over the prompts.
        new_tokens: tokens generated over the prompts.
        forward_passes: per level (target first) summed over the prompts; None for plain.
        verifications, accepted: per verifying level, summed over the prompts; None for plain.
        identical: whether the outputs equal plain generate's (None for plain itself).
    """

    name: str
    seconds: list[float]
    new_tokens: int
    forward_passes: list[int] | None = None
    verifications: list[int] | None = None
    accepted: list[int] | None = None
    identical: bool | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / statistics.median(self.seconds)

    def time_model_inputs(self, drafter_bottom: bool) -> theory.TimeModelInputs | None:
        """Measured L_i = N / F_i and beta (F_n / F_{n-1}; 1 for a Drafter, which counts no forwards)."""
        if self.forward_passes is None:
            return None
        inputs = theory.TimeModelInputs.from_counts(self.new_tokens, self.forward_passes)
        if drafter_bottom:
            inputs = theory.TimeModelInputs(inputs.acceptance_lengths, 1.0)
        return inputs

    @property
    def per_verification_lengths(self) -> list[float] | None:
        """Mean tokens emitted per verification (accepted + 1) of each verifying level."""
        if self.verifications is None:
            return None
        return [(a + v) / v if v else None for a, v in zip(self.accepted, self.verifications)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "seconds": self.seconds,
            "new_tokens": self.new_tokens,
            "tokens_per_second": self.tokens_per_second,
            "forward_passes": self.forward_passes,
            "verifications": self.verifications,
            "accepted": self.accepted,
            "per_verification_lengths": self.per_verification_lengths,
            "identical_to_plain": self.identical,
        }


class Runner:
    """Runs one configuration (plain when its chain is the target alone) on the validation prompts,
    accumulating its `Measurement` over repeats."""

    def __init__(
        self,
        pool: Pool,
        setting: ChainPrediction,
        models: dict[str, Any],
        max_new_tokens: int,
        schedule: str = "constant",
    ):
        self.pool, self.setting, self.max_new_tokens = pool, setting, max_new_tokens
        self.schedule = schedule
        self.options = {"do_sample": False, **pool.generate_options}
        self.chain_kwargs = {}
        if not setting.is_plain:
            self.chain_kwargs = {
                "custom_generate": polybasic_generate,
                "assistant_models": [models[label] for label in setting.chain[1:]],
                "polybasic_config": dataclasses.replace(setting.config(), schedule=schedule),
            }
        name = setting_name(setting) if schedule == "constant" else f"{setting.name} (schedule={schedule})"
        self.measurement = Measurement(name, [], 0)
        self.outputs: list[list[int]] = []

    def _generate(self, ids: torch.LongTensor, tokens: int) -> torch.LongTensor:
        return self.pool.target.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, **self.options, **self.chain_kwargs
        )

    def warm_up(self, prompts: Sequence[torch.LongTensor]) -> None:
        self._generate(prompts[0], WARMUP_TOKENS)

    def run_once(self, prompts: Sequence[torch.LongTensor]) -> None:
        """One timed pass over every prompt; the first pass also records outputs and statistics."""
        first = not self.measurement.seconds
        total, counts = 0.0, {}
        for ids in prompts:
            timing = timed_call(lambda: self._generate(ids, self.max_new_tokens), sample_rss=False)
            out = timing.output
            total += timing.seconds
            if first:
                self.outputs.append(out[0, ids.shape[1] :].tolist())
                self.measurement.new_tokens += len(self.outputs[-1])
                stats = last_stats(self.pool.target) if self.chain_kwargs else None
                for key in ("forward_passes", "verifications", "accepted") if stats is not None else ():
                    values = [getattr(level, key) for level in stats.levels]
                    counts[key] = [a + b for a, b in zip(counts.get(key, [0] * len(values)), values)]
        self.measurement.seconds.append(total)
        if counts:
            self.measurement.forward_passes = counts["forward_passes"]
            self.measurement.verifications = counts["verifications"][:-1]  # the bottom never verifies
            self.measurement.accepted = counts["accepted"][:-1]


def setting_name(setting: ChainPrediction) -> str:
    """e.g. 'target <- 0.5B-int8 (K=4)'."""
    return setting.name + (f" ({setting.settings})" if setting.settings != "-" else "")


def validation_grid(profile: Profile, chosen: ChainPrediction | None, grid: str = "small") -> list[ChainPrediction]:
    """The configurations ``--validate`` times: every 2-model chain at each K of the grid, every
    3-model chain at each (K, mu), and the planner's choice; each with its prediction."""
    if grid not in GRIDS:
        raise ValueError(f"--grid must be one of {list(GRIDS)}, got {grid!r}")
    spec, candidates = GRIDS[grid], profile.candidates
    settings = []
    for lower in candidates:
        for K in [None] if profile.is_drafter(lower) else spec["two"]:
            settings.append(predict((TARGET, lower), K, None, profile))
    for index, middle in enumerate(candidates):
        if profile.is_drafter(middle):
            continue
        for lower in candidates[index + 1 :]:
            for K, mu in spec["three"]:
                settings.append(predict((TARGET, middle, lower), None if profile.is_drafter(lower) else K, mu, profile))
    if chosen is not None and not chosen.is_plain:
        settings.append(chosen)
    unique = {}
    for setting in settings:
        unique.setdefault((setting.chain, setting.num_draft_tokens, setting.block_thresholds), setting)
    return list(unique.values())


# ============================================================================ Table 1 (paper)
def _best_measured(rows: list[dict], chain: tuple[str, ...]) -> dict | None:
    matching = [row for row in rows if tuple(row["chain"]) == chain]
    return max(matching, key=lambda row: row["measured_speedup"], default=None)


def insertion_rows(profile: Profile, rows: list[dict]) -> list[dict]:
    """Paper's Table 1: for each measured target <- X and each model Y between them, the
    Theorem 3.2 quantities from the profile's 1-token costs and the *measured* L's (N / F_i) of the
    best measured configuration of each chain, the verdicts, and the measured speedups."""
    table = []
    candidates = profile.candidates
    for index, middle in enumerate(candidates):
        if profile.is_drafter(middle):
            continue
        for lower in candidates[index + 1 :]:
            before = _best_measured(rows, (TARGET, lower))
            after = _best_measured(rows, (TARGET, middle, lower))
            if before is None or after is None:
                continue
            drafter = profile.is_drafter(lower)
            measured = {
                "L_i": before["measured_lengths"][0],
                "L_i-new": after["measured_lengths"][0],
                "L_new": after["measured_lengths"][1],
            }
            # N / F_i of a middle level is < 1 when it runs more forwards than tokens reach the output
            beta = after["measured_beta"]
            verdict = theory.insertion_test(
                t_i=profile.cost(TARGET, 1), t_new=profile.cost(middle, 1), t_next=profile.cost(lower, 1),
                l_i=measured["L_i"], l_i_new=measured["L_i-new"], l_new=measured["L_new"], beta=beta, next_is_drafter=True,
            )
            table.append(
                {
                    "before": before["name"],
                    "inserted": middle,
                    "after": after["name"],
                    "T_new/T_i": verdict.condition_1_lhs,
                    "L_new(1/L_i - 1/L_i-new)": verdict.condition_1_rhs,
                    "T_new/T_i+1": verdict.condition_2_lhs,
                    "beta(L_new/L_i - 1)": verdict.condition_2_rhs,
                    **measured, "beta": beta, "drafter_bottom": drafter,
                    "below_1": sorted(key for key, value in measured.items() if value < 1.0),
                    "lemma_verdict": verdict.helps,
                    "paper_verdict": verdict.paper_says_helps,
                    "measured_before": before["measured_speedup"],
                    "measured_after": after["measured_speedup"],
                    "measured_helped": after["measured_speedup"] > before["measured_speedup"],
                    "predicted_before": before["predicted_speedup"],
                    "predicted_after": after["predicted_speedup"],
                }
            )
    return table


# ================================================================================ validation
def validate(
    pool: Pool,
    the_profile: Profile,
    the_plan: Plan,
    prompts: Sequence[torch.LongTensor],
    max_new_tokens: int,
    repeats: int,
    grid: str = "small",
    progress: bool = True,
) -> dict[str, Any]:
    """Measure plain generate and every configuration of `validation_grid`; the validation record."""
    settings = validation_grid(the_profile, the_plan.best, grid)
    plain_setting = predict((TARGET,), None, None, the_profile)
    runners = [Runner(pool, setting, the_profile.models, max_new_tokens) for setting in [plain_setting, *settings]]
    # the cost-aware schedule on every chain of the grid, from the untuned defaults K = 4, mu = 8
    dynamic = [
        Runner(pool, default_setting(chain, the_profile), the_profile.models, max_new_tokens, "cost_aware")
        for chain in grid_chains(settings)
    ]
    static_count = len(runners)
    runners += dynamic
    for runner in tqdm(runners, desc="validation warm-up", disable=not progress):
        runner.warm_up(prompts)
    # repeats outermost, so that slow drift of a shared machine hits every configuration alike
    bar = tqdm(total=len(runners) * repeats, desc="validation (timed generate)", disable=not progress)
    for _ in range(repeats):
        for runner in runners:
            runner.run_once(prompts)
            bar.update()
    bar.close()
    plain, reference = runners[0].measurement, runners[0].outputs
    rows = [_row(runner, the_profile, the_plan, reference, plain, max_new_tokens) for runner in runners[1:static_count]]
    dynamic_rows = [_row(runner, the_profile, the_plan, reference, plain, max_new_tokens) for runner in dynamic]
    best = max(rows, key=lambda row: row["measured_speedup"], default=None)
    chosen = next((row for row in rows if row["is_plan"]), None)
    chosen_speedup = 1.0 if chosen is None else chosen["measured_speedup"]
    best_speedup = max(1.0, best["measured_speedup"] if best else 1.0)
    return {
        "plain": plain.to_dict(),
        "configurations": rows,
        "planner": {
            "choice": setting_name(the_plan.best),
            "predicted_speedup": the_plan.best.speedup_for(max_new_tokens),
            "measured_speedup": chosen_speedup,
            "best_measured": best["name"] if best and best["measured_speedup"] > 1.0 else "plain generate",
            "best_measured_speedup": best_speedup,
            "ratio": chosen_speedup / best_speedup,
            "within_10_percent": chosen_speedup / best_speedup >= TARGET_RATIO,
        },
        "dynamic": [
            {
                "chain": row["chain"],
                "name": row["name"],
                "measured_speedup": row["measured_speedup"],
                "identical_to_plain": row["identical_to_plain"],
                "best_static": (static := _best_measured(rows, tuple(row["chain"])))["name"],
                "best_static_speedup": static["measured_speedup"],
                "ratio": row["measured_speedup"] / static["measured_speedup"],
            }
            for row in dynamic_rows
        ],
        "table_1": insertion_rows(the_profile, rows),
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "prompts": len(prompts),
        "grid": grid,
    }


def grid_chains(settings: Sequence[ChainPrediction]) -> list[tuple[str, ...]]:
    """The distinct chains of a validation grid, in grid order: each gets one cost-aware run."""
    return list(dict.fromkeys(setting.chain for setting in settings))


def default_setting(chain: tuple[str, ...], the_profile: Profile) -> ChainPrediction:
    """``chain`` with `PolybasicConfig`'s defaults (K = 4, mu = 8): what a user gets untuned."""
    defaults = PolybasicConfig()
    k = None if the_profile.is_drafter(chain[-1]) else defaults.num_draft_tokens
    mu = defaults.block_threshold if len(chain) > 2 else None
    return predict(chain, k, mu, the_profile)


def _row(runner, the_profile, the_plan, reference, plain, max_new_tokens) -> dict:
    """One measured configuration against plain generate, with its prediction."""
    setting, measured = runner.setting, runner.measurement
    measured.identical = runner.outputs == reference
    inputs = measured.time_model_inputs(the_profile.is_drafter(setting.chain[-1]))
    return {
        "name": measured.name,
        "schedule": runner.schedule,
        "chain": list(setting.chain),
        "num_draft_tokens": setting.num_draft_tokens,
        "block_thresholds": list(setting.block_thresholds),
        "predicted_speedup": setting.speedup_for(max_new_tokens),
        "predicted_speedup_long": setting.speedup,
        "lemma_speedup": setting.lemma_speedup,
        "measured_speedup": measured.tokens_per_second / plain.tokens_per_second,
        "predicted_lengths": [lv.acceptance_length for lv in setting.levels[:-1]],
        "measured_lengths": list(inputs.acceptance_lengths),
        "measured_per_verification_lengths": measured.per_verification_lengths,
        "measured_beta": inputs.beta,
        "is_plan": runner.schedule == "constant"
        and (setting.chain, setting.num_draft_tokens, setting.block_thresholds)
        == (the_plan.best.chain, the_plan.best.num_draft_tokens, the_plan.best.block_thresholds),
        **{key: value for key, value in measured.to_dict().items() if key != "name"},
    }


def _verdict(helps: bool) -> str:
    return "helps" if helps else "hurts"


def _numbers(values) -> str:
    return ", ".join("-" if x is None else f"{x:.2f}" for x in values or [])


def validation_markdown(record: dict[str, Any], header: str) -> str:
    planner = record["planner"]
    lines = [
        f"# Planner validation: {header}",
        "",
        f"{record['prompts']} prompts, greedy, max_new_tokens={record['max_new_tokens']}, median of "
        f"{record['repeats']} timed run(s) after a warm-up; plain generate: "
        f"{record['plain']['tokens_per_second']:.2f} tokens/s.",
        "",
        "## The planner's choice vs the best measured configuration",
        "",
        "| | configuration | predicted speedup | measured speedup |",
        "|---|---|---:|---:|",
        f"| planner | {planner['choice']} | {planner['predicted_speedup']:.2f}x | {planner['measured_speedup']:.2f}x |",
        f"| best measured | {planner['best_measured']} | - | {planner['best_measured_speedup']:.2f}x |",
        "",
        f"Ratio (planner / best measured): **{planner['ratio']:.3f}** (target >= {TARGET_RATIO}: "
        f"{'met' if planner['within_10_percent'] else 'NOT met'}).",
        "",
        "## Every configuration",
        "",
        f"Predicted: for calls of {record['max_new_tokens']} new tokens, every model's prefill included (what is "
        "measured); long: per token of long generations; Lemma 3.1: with the predicted L_i, T_i = 1-token costs, "
        "long generations. L per verifying level, target first: predicted and measured tokens per verification "
        "(accepted + 1), and measured N / F_i (the reading that makes Lemma 3.1 exact).",
        "",
        "| configuration | predicted | long | Lemma 3.1 | measured | measured / predicted | tokens/s | L predicted | "
        "L measured | N / F_i | identical to plain |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---|---|",
    ]
    for row in sorted(record["configurations"], key=lambda r: -r["measured_speedup"]):
        mark = " **(plan)**" if row["is_plan"] else ""
        lemma = "-" if row["lemma_speedup"] is None else f"{row['lemma_speedup']:.2f}x"
        lines.append(
            f"| {row['name']}{mark} | {row['predicted_speedup']:.2f}x | {row['predicted_speedup_long']:.2f}x | "
            f"{lemma} | "
            f"{row['measured_speedup']:.2f}x | "
            f"{row['measured_speedup'] / row['predicted_speedup']:.2f} | {row['tokens_per_second']:.2f} | "
            f"{_numbers(row['predicted_lengths'])} | {_numbers(row['measured_per_verification_lengths'])} | "
            f"{_numbers(row['measured_lengths'])} | {row['identical_to_plain']} |"
        )
    lines += [
        "",
        "## Dynamic policy: cost-aware schedule vs the best static configuration",
        "",
        "Each chain run with `PolybasicConfig(schedule=\"cost_aware\")` from the untuned defaults (K = 4, mu = 8), "
        "against the best of that chain's static grid configurations (measured on the same prompts).",
        "",
        "| chain | cost-aware speedup | best static | its speedup | cost-aware / best static | identical to plain |",
        "|---|---:|---|---:|---:|---|",
    ]
    for row in record.get("dynamic", []):
        lines.append(
            f"| {' <- '.join(row['chain'])} | {row['measured_speedup']:.2f}x | {row['best_static']} | "
            f"{row['best_static_speedup']:.2f}x | {row['ratio']:.2f} | {row['identical_to_plain']} |"
        )
    lines += [
        "",
        "## Table 1: inserting a middle model (Theorem 3.2, measured L's)",
        "",
        "T from the profile (1-token forwards; a Drafter: one propose call), L_i = N / F_i of the best measured "
        "configuration of each chain, beta = drafter forwards per verification above it (1 for a Drafter). "
        "Condition 1: T_new/T_i < L_new(1/L_i - 1/L_i-new); condition 2: T_new/T_i+1 < beta(L_new/L_i - 1); "
        "the paper's verdict is 1 or 2; the Lemma 3.1 verdict is the exact sign of the saving. An N / F_i below 1 "
        "(marked *) is a middle level running more forwards than tokens reach the output.",
        "",
        "| before | inserted | L_i, L_i-new, L_new, beta | T_new/T_i | L_new(1/L_i - 1/L_i-new) | T_new/T_i+1 | "
        "beta(L_new/L_i - 1) | Lemma 3.1 verdict | paper's verdict | measured before | measured after | "
        "measured: helped |",
        "|---|---|---|---:|---:|---:|---:|---|---|---:|---:|---|",
    ]
    for row in record["table_1"]:
        lengths = ", ".join(
            f"{row[key]:.2f}" + ("*" if key in row["below_1"] else "") for key in ("L_i", "L_i-new", "L_new")
        )
        lines.append(
            f"| {row['before']} | {row['inserted']} | {lengths}, {row['beta']:.2f} | {row['T_new/T_i']:.3f} | "
            f"{row['L_new(1/L_i - 1/L_i-new)']:.3f} | "
            f"{row['T_new/T_i+1']:.3g} | {row['beta(L_new/L_i - 1)']:.3f} | {_verdict(row['lemma_verdict'])} | "
            f"{_verdict(row['paper_verdict'])} | {row['measured_before']:.2f}x | {row['measured_after']:.2f}x | "
            f"{row['measured_helped']} |"
        )
    lines += ["", "![predicted vs measured speedup](predicted_vs_measured.png)", ""]
    return "\n".join(lines)


def plot_predicted_vs_measured(record: dict[str, Any], path: Path) -> Path:
    """Scatter of predicted vs measured speedup with the diagonal; the plan is marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 6), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    rows = record["configurations"]
    predicted = [row["predicted_speedup"] for row in rows]
    measured = [row["measured_speedup"] for row in rows]
    axes.scatter(predicted, measured, s=18, label="configurations")
    for row in rows:
        label = row["name"].replace("target <- ", "")
        axes.annotate(label, (row["predicted_speedup"], row["measured_speedup"]), fontsize=5)
    chosen = [row for row in rows if row["is_plan"]]
    if chosen:
        point = ([chosen[0]["predicted_speedup"]], [chosen[0]["measured_speedup"]])
        axes.scatter(*point, s=80, marker="*", color="red", label="plan")
    top = max([1.0, *predicted, *measured]) * 1.1
    axes.plot([0, top], [0, top], color="grey", linewidth=0.8, label="measured = predicted")
    axes.axhline(1.0, color="black", linewidth=0.5)
    axes.set_xlim(0, top)
    axes.set_ylim(0, top)
    axes.set_xlabel("predicted speedup over plain generate (x)")
    axes.set_ylabel("measured speedup over plain generate (x)")
    axes.set_title("Planner: predicted vs measured speedup")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)
    return path


# ======================================================================================= CLI
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
    pool = build_pool(args.models, args.target_dtype, args.early_exit_layers, args.cache_dir)
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
        record["machine"] = {
            "platform": platform.platform(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(),
        }
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
