"""``hf-polybasic plan --validate``: measure a grid of configurations and compare with the plan.

`validate` times a small grid of configurations (`validation_grid`) with ``target.generate``
against plain ``generate`` on the same prompts (greedy, same budget, median of the repeats, the
repeats outermost so that drift of a shared machine hits every configuration alike), and returns
predicted vs measured speedups, the planner's choice vs the best measured configuration, the
cost-aware schedule against the best static setting of each chain, and the paper's Table 1 for
every insertion of a middle model (`insertion_rows`), with measured acceptance lengths read as in
`hf_polybasic.theory.TimeModelInputs` (N / F_i).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from ..config import PolybasicConfig
from ..generation import generate as polybasic_generate
from ..generation import last_stats
from ..planning import TARGET, ChainPrediction, Plan, Profile, predict, theory
from .harness import timed_call
from .model_sets import Pool

GRIDS = {
    # K of 2-model chains; (K, mu) of 3-model chains
    "small": {"two": (3, 5, 8), "three": ((3, 6), (4, 10))},
    "tiny": {"two": (4,), "three": ((4, 8),)},
}
WARMUP_TOKENS = 4
TARGET_RATIO = 0.9


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


# --- Table 1 (paper) --------------------------------------------------------------------------
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


# --- validation -------------------------------------------------------------------------------
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
