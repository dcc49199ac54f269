"""Why each candidate is in or out of a plan (Theorem 3.2), and the plan as markdown.

`plan_markdown` (the plan, the ranking, the explanations) lives here, not in the dataclasses; a
profile's own tables are `hf_polybasic.planning.profile_data.profile_markdown`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .. import theory
from .predict import ChainPrediction, predict
from .profile_data import TARGET, Profile, pair_key


@dataclass(frozen=True)
class Insertion:
    """Theorem 3.2 for inserting a candidate between ``upper`` and ``lower`` of the best chain
    without it, with the planner's predicted numbers (T = 1-token costs, L per verification).

    ``before`` is that chain at the K of ``after`` (the best setting of the chain with it), so that
    beta is the same on both sides.
    """

    upper: str
    new: str
    lower: str
    t_i: float
    t_new: float
    t_next: float
    l_i: float
    l_i_new: float
    l_new: float
    beta: float
    verdict: theory.InsertionVerdict
    before: ChainPrediction
    after: ChainPrediction

    def to_dict(self) -> dict[str, Any]:
        names = ("upper", "new", "lower", "t_i", "t_new", "t_next", "l_i", "l_i_new", "l_new", "beta")
        numbers = {name: getattr(self, name) for name in names}
        verdict = dict(self.verdict.__dict__, paper_says_helps=self.verdict.paper_says_helps)
        return {**numbers, "verdict": verdict, "before": self.before.to_dict(), "after": self.after.to_dict()}


@dataclass(frozen=True)
class Explanation:
    """Why a candidate is in or out of the plan.

    Attributes:
        label: the candidate.
        included: whether the chosen chain uses it.
        best_with: the best chain that uses it.
        best_without: the best chain (or plain decoding) that does not.
        insertion: Theorem 3.2 for inserting it into ``best_without``; None when it would not be a
            middle level there (it would be the new bottom, or ``best_without`` is plain).
        text: one readable paragraph.
    """

    label: str
    included: bool
    best_with: ChainPrediction
    best_without: ChainPrediction
    insertion: Insertion | None
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "included": self.included,
            "best_with": self.best_with.to_dict(),
            "best_without": self.best_without.to_dict(),
            "insertion": None if self.insertion is None else self.insertion.to_dict(),
            "text": self.text,
        }


def grown_chain(profile: Profile, chain: tuple[str, ...], label: str) -> tuple[str, ...] | None:
    """``chain`` with ``label`` added at its place in the cost order; None when that is no chain
    (``chain`` is plain decoding, or both would hold a Drafter)."""
    if len(chain) == 1 or (profile.is_drafter(label) and profile.is_drafter(chain[-1])):
        return None
    return tuple(sorted((*chain, label), key=profile.order.index))


def _insertion(profile: Profile, label: str, base: ChainPrediction, best_of_chain: Callable) -> Insertion | None:
    """Theorem 3.2 for adding ``label`` to ``base``; None unless it lands between two levels."""
    chain = grown_chain(profile, base.chain, label)
    if chain is None or chain.index(label) == len(chain) - 1:
        return None
    position = chain.index(label)
    after = best_of_chain(chain)
    thresholds = tuple(mu for level, mu in zip(chain[1:-1], after.block_thresholds) if level != label)
    before = predict(base.chain, after.num_draft_tokens, thresholds, profile)
    upper, lower = chain[position - 1], chain[position + 1]
    numbers = dict(
        t_i=profile.cost(upper, 1),
        t_new=profile.cost(label, 1),
        t_next=profile.cost(lower, 1),
        l_i=before.level(upper).acceptance_length,
        l_i_new=after.level(upper).acceptance_length,
        l_new=after.level(label).acceptance_length,
        beta=float(after.num_draft_tokens or 1),
    )
    verdict = theory.insertion_test(**numbers, next_is_drafter=lower == chain[-1])
    return Insertion(upper, label, lower, **numbers, verdict=verdict, before=before, after=after)


def explain_candidate(
    profile: Profile,
    label: str,
    ranking: Sequence[ChainPrediction],
    chosen: tuple[str, ...],
    best_of_chain: Callable[[tuple[str, ...]], ChainPrediction],
    new_tokens: int | None,
) -> Explanation | None:
    """Why ``label`` is in or out: the best chain with it, the best without it (``ranking`` is
    fastest first), and Theorem 3.2 for inserting it; None when no ranked chain uses it."""
    with_it = next((row for row in ranking if label in row.chain), None)
    if with_it is None:  # max_levels excluded every chain with it
        return None
    without = next(row for row in ranking if label not in row.chain)
    insertion = _insertion(profile, label, without, best_of_chain)
    included = label in chosen
    text = _explanation_text(label, included, with_it, without, insertion, profile, new_tokens)
    return Explanation(label, included, with_it, without, insertion, text)


def _explanation_text(label: str, included: bool, best_with, best_without, insertion, profile, new_tokens) -> str:
    verb = "in" if included else "out"
    text = (
        f"{label}: {verb}. Best chain with it: {best_with.name} ({best_with.settings}), predicted "
        f"{best_with.speedup_for(new_tokens):.2f}x; best without it: {best_without.name}"
        + ("" if best_without.is_plain else f" ({best_without.settings})")
        + f", {best_without.speedup_for(new_tokens):.2f}x."
    )
    if insertion is None:
        if best_without.is_plain:
            return text + " Nothing without it beats plain decoding, so Theorem 3.2 (a middle level) does not apply."
        if profile.is_drafter(label) and profile.is_drafter(best_without.chain[-1]):
            return text + f" A chain holds one Drafter (at the bottom): it competes with {best_without.chain[-1]}."
        where = "Drafter" if profile.is_drafter(label) else "cheapest model"
        return text + (
            f" As the {where} it would be the new bottom of {best_without.name}, not a middle level, so Theorem 3.2 "
            "does not apply."
        )
    v = insertion.verdict
    exact = "accepts" if v.helps else "rejects"
    paper = "accept" if v.paper_says_helps else "reject"
    return text + (
        f" Theorem 3.2, inserting it between {insertion.upper} and {insertion.lower} of {best_without.name} "
        f"(beta={insertion.beta:g}): the exact Lemma-3.1 test {exact} it "
        f"(saves {v.time_saved_per_token * 1000:+.3f} ms/token: "
        f"{v.upper_saving_per_token * 1000:.3f} at {insertion.upper} + {v.lower_saving_per_token * 1000:.3f} at "
        f"{insertion.lower} - {v.new_cost_per_token * 1000:.3f} running it); the paper's conditions {paper} it "
        f"(1: T_new/T_i = {v.condition_1_lhs:.3f} < L_new(1/L_i - 1/L_i-new) = {v.condition_1_rhs:.3f} "
        f"is {v.condition_1}; "
        f"2: T_new/T_i+1 = {v.condition_2_lhs:.3f} < beta(L_new/L_i - 1) = {v.condition_2_rhs:.3f} is {v.condition_2}; "
        f"T_i={insertion.t_i * 1000:.2f} ms, T_new={insertion.t_new * 1000:.2f} ms, "
        f"T_i+1={insertion.t_next * 1000:.3f} ms, "
        f"L_i={insertion.l_i:.2f}, L_i-new={insertion.l_i_new:.2f}, L_new={insertion.l_new:.2f})."
    )


# ----------------------------------------------------------------------------------- renderers
def plan_markdown(plan) -> str:
    """The plan, every chain ranked, and why each candidate is in or out."""
    best, n = plan.best, plan.new_tokens
    horizon = "per token of long generations" if n is None else f"for calls of {n} new tokens, prefills included"
    if plan.is_plain:
        runner_up = next((row for row in plan.ranking if not row.is_plain), None)
        closest = "" if runner_up is None else f" (closest: {runner_up.name}, {runner_up.speedup_for(n):.2f}x)"
        lines = [
            f"**No chain is predicted to beat plain decoding**{closest}. Use plain `target.generate` "
            "(`plan.assistant_models` is empty; `plan.generate_kwargs()` is {}).",
        ]
    else:
        lines = [
            f"**Plan: {best.name}** (`{plan.config!r}`): predicted {plan.predicted_speedup:.2f}x plain decoding "
            f"{horizon} ({best.time_per_token * 1000:.2f} vs {best.plain_time_per_token * 1000:.2f} ms/token; "
            f"{best.speedup:.2f}x for long generations).",
            "",
            "    out = target.generate(**inputs, custom_generate=hp.generate,",
            "                          assistant_models=plan.assistant_models, polybasic_config=plan.config)",
        ]
    lines += [
        "",
        f"Chains ranked {horizon}; each at its best setting on the grids.",
        "",
        "| rank | chain | setting | ms/token | prefill ms | predicted speedup (long) | "
        + ("" if n is None else f"predicted speedup ({n} tokens) | ")
        + "Lemma 3.1 speedup | L per level, target first |",
        "|---:|---|---|---:|---:|---:|" + ("" if n is None else "---:|") + "---:|---|",
    ]
    for rank, row in enumerate(plan.ranking, 1):
        lemma = "-" if row.lemma_speedup is None else f"{row.lemma_speedup:.2f}x"
        lengths = [f"{level.acceptance_length:.2f}" for level in row.levels if level.acceptance_length is not None]
        horizon_cell = "" if n is None else f"{row.speedup_for(n):.2f}x | "
        lines.append(
            f"| {rank} | {row.name} | {row.settings} | {row.time_per_token * 1000:.2f} | "
            f"{row.prefill_seconds * 1000:.1f} | {row.speedup:.2f}x | {horizon_cell}"
            f"{lemma} | {', '.join(lengths) or '-'} |"
        )
    lines += ["", "Why each candidate is in or out:", ""]
    lines += [f"- {e.text}" for e in plan.explanations]
    return "\n".join(lines)
