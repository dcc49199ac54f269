"""Theorem 3.2: does inserting a middle model pay? As printed, and with cost curves T(k)."""

from __future__ import annotations

from dataclasses import dataclass

from .checks import nonnegative, positive, scalar
from .time_model import CostCurveLike, cost_curve


@dataclass(frozen=True)
class InsertionVerdict:
    """Theorem 3.2 for inserting M_new between M_i and M_{i+1}, with the numbers behind it.

    All ``*_per_token`` values are time per generated token (the unit of the costs), from Lemma 3.1.

    Attributes:
        helps: the exact answer under Lemma 3.1: ``time_saved_per_token > 0``.
        condition_1: the paper's first condition, T_new / T_i < L_new (1 / L_i - 1 / L_{i-new});
            equivalent to ``new_cost_per_token < upper_saving_per_token``.
        condition_1_lhs, condition_1_rhs: its two sides.
        condition_2: the paper's second condition, T_new / T_{i+1} < beta (L_new / L_i - 1);
            equivalent to ``new_cost_per_token < beta T_{i+1} (1 / L_i - 1 / L_new)``.
        condition_2_lhs, condition_2_rhs: its two sides.
        new_cost_per_token: T_new / L_new, what running M_new costs.
        upper_saving_per_token: T_i (1 / L_i - 1 / L_{i-new}), saved at M_i because it now
            verifies M_new (longer acceptances) instead of M_{i+1}.
        lower_saving_per_token: beta T_{i+1} (1 / L_i - 1 / L_new) when M_{i+1} is the drafter
            (it now drafts for M_new), else 0: a model that still verifies the same level below
            costs the same.
        time_saved_per_token: upper + lower saving - new cost; > 0 means the insertion pays.
    """

    helps: bool
    condition_1: bool
    condition_1_lhs: float
    condition_1_rhs: float
    condition_2: bool
    condition_2_lhs: float
    condition_2_rhs: float
    new_cost_per_token: float
    upper_saving_per_token: float
    lower_saving_per_token: float
    time_saved_per_token: float

    @property
    def paper_says_helps(self) -> bool:
        """The theorem as printed: condition 1 or condition 2."""
        return self.condition_1 or self.condition_2


def insertion_test(
    *,
    t_i: float,
    t_new: float,
    t_next: float,
    l_i: float,
    l_i_new: float,
    l_new: float,
    beta: float,
    next_is_drafter: bool = True,
) -> InsertionVerdict:
    """Theorem 3.2: does inserting M_new between M_i and M_{i+1} shorten generation?

    How the subscripts are read (the paper's statement and proof, Section 3.2):

    | argument  | paper       | meaning                                                      |
    |-----------|-------------|--------------------------------------------------------------|
    | `t_i`     | T_i         | cost of one forward of M_i, the model above the insertion    |
    | `t_new`   | T_new       | cost of one forward of M_new                                  |
    | `t_next`  | T_{i+1}     | cost of one forward of M_{i+1}, the model below              |
    | `l_i`     | L_i         | acceptance length of M_i verifying M_{i+1}, before insertion |
    | `l_i_new` | L_{i-new}   | acceptance length of M_i verifying M_new, after insertion    |
    | `l_new`   | L_new = L_{new-(i+1)} | acceptance length of M_new verifying M_{i+1}       |
    | `beta`    | beta        | drafter forwards per verification of the model above it      |

    Acceptance lengths are in the tau convention; any positive value is accepted, since the N / F
    reading below falls under 1 for a middle level that runs more forwards than tokens reach the
    output (its per-verification mean is still >= 1). Measured values should be read as in
    `TimeModelInputs` (N / F).

    What holds exactly (subtracting Lemma 3.1 before and after; only M_i's term, the new term and,
    if M_{i+1} is the drafter, the drafter's term change):

        insertion helps  <=>  T_new / L_new  <  T_i (1/L_i - 1/L_{i-new}) + [beta T_{i+1} (1/L_i - 1/L_new)]

    The paper's condition 1 asks the first saving alone to cover T_new / L_new, condition 2 the
    second alone. So "condition 1 or condition 2" is sufficient when both savings are >= 0, but it
    is not necessary (both can fail while their sum pays), and when one saving is negative (e.g.
    M_new accepts fewer of the drafter's tokens than M_i did) one condition can hold while the
    insertion costs time. ``helps`` is the exact answer; both printed conditions are reported too.
    Condition 2 is only meaningful when M_{i+1} is the drafter; it is computed as printed either way.

    Args:
        t_i: T_i, forward cost of M_i, > 0.
        t_new: T_new, forward cost of M_new, > 0.
        t_next: T_{i+1}, forward cost of M_{i+1}, > 0.
        l_i: L_i, > 0.
        l_i_new: L_{i-new}, > 0.
        l_new: L_new, > 0.
        beta: drafter forwards per verification of the model above it, >= 0.
        next_is_drafter: whether M_{i+1} is the bottom model Mn (the case of a three-model chain
            built from a two-model one).
    """
    t_i, t_new = scalar("t_i", t_i, positive), scalar("t_new", t_new, positive)
    t_next = scalar("t_next", t_next, positive)
    l_i, l_i_new = scalar("l_i", l_i, positive), scalar("l_i_new", l_i_new, positive)
    l_new, beta = scalar("l_new", l_new, positive), scalar("beta", beta, nonnegative)

    condition_1_lhs, condition_1_rhs = t_new / t_i, l_new * (1 / l_i - 1 / l_i_new)
    condition_2_lhs, condition_2_rhs = t_new / t_next, beta * (l_new / l_i - 1)
    new_cost = t_new / l_new
    upper_saving = t_i * (1 / l_i - 1 / l_i_new)
    lower_saving = beta * t_next * (1 / l_i - 1 / l_new) if next_is_drafter else 0.0
    saved = upper_saving + lower_saving - new_cost
    return InsertionVerdict(
        helps=bool(saved > 0),
        condition_1=bool(condition_1_lhs < condition_1_rhs),
        condition_1_lhs=condition_1_lhs,
        condition_1_rhs=condition_1_rhs,
        condition_2=bool(condition_2_lhs < condition_2_rhs),
        condition_2_lhs=condition_2_lhs,
        condition_2_rhs=condition_2_rhs,
        new_cost_per_token=new_cost,
        upper_saving_per_token=upper_saving,
        lower_saving_per_token=lower_saving,
        time_saved_per_token=saved,
    )


# --- Theorem 3.2 with cost curves -------------------------------------------------------------------
@dataclass(frozen=True)
class CurveInsertionVerdict:
    """Inserting M_new between M_i and M_{i+1} when forwards cost T(k) for k tokens scored.

    All ``*_per_token`` values are seconds per generated token, from
    `polybasic_time_per_token_with_curves` before and after the insertion.

    Attributes:
        helps: the exact answer under the time model with curves: ``time_saved_per_token > 0``.
        new_cost_per_token: T_new(b_new + 1) / L_new, what running M_new costs.
        upper_saving_per_token: T_i(b_i + 1) / L_i - T_i(b_i_new + 1) / L_{i-new}: M_i verifies
            fewer times, but each verification now scores M_new's longer blocks.
        lower_saving_per_token: beta T_{i+1}(1) (1 / L_i - 1 / L_new) when M_{i+1} is the drafter.
        time_saved_per_token: upper + lower saving - new cost.
        constant_cost: the paper's form (`insertion_test`) with each model's one-token cost T(1).
    """

    helps: bool
    new_cost_per_token: float
    upper_saving_per_token: float
    lower_saving_per_token: float
    time_saved_per_token: float
    constant_cost: InsertionVerdict

    @property
    def constant_cost_misleads(self) -> bool:
        """Whether charging every forward T(1), as the paper does, gives the other answer."""
        return self.constant_cost.helps != self.helps


def insertion_test_with_curves(
    *,
    t_i: CostCurveLike,
    t_new: CostCurveLike,
    t_next: CostCurveLike,
    l_i: float,
    l_i_new: float,
    l_new: float,
    beta: float,
    block_i: float,
    block_i_new: float,
    block_new: float,
    next_is_drafter: bool = True,
) -> CurveInsertionVerdict:
    """Theorem 3.2 when a forward's cost depends on the tokens it scores.

    Lemma 3.1 with curves before and after the insertion: before, M_i verifies blocks of
    ``block_i`` drafts from M_{i+1}, N / L_i times; after, it verifies blocks of ``block_i_new``
    from M_new, N / L_{i-new} times, and M_new verifies blocks of ``block_new`` from M_{i+1},
    N / L_new times; if M_{i+1} is the drafter its beta forwards per verification now follow M_new.

        helps  <=>  T_new(b_new + 1) / L_new  <  T_i(b_i + 1) / L_i - T_i(b_i_new + 1) / L_{i-new}
                                                  [+ beta T_{i+1}(1) (1 / L_i - 1 / L_new)]

    With constant curves this is `insertion_test`'s exact answer. Where T_i grows with k (fp32 or
    emulated bf16 on a CPU), the paper's form overstates the saving at M_i: the middle model makes
    M_i's blocks longer, and a longer verification costs more (`CurveInsertionVerdict.constant_cost`
    shows its verdict next to this one).

    Args:
        t_i: cost curve of M_i: a callable k -> seconds, ``{k: seconds}``, or a number (constant).
        t_new: cost curve of M_new, likewise.
        t_next: cost curve of M_{i+1}, likewise.
        l_i: L_i, M_i's acceptance length verifying M_{i+1}, before (as in `insertion_test`).
        l_i_new: L_{i-new}, M_i's acceptance length verifying M_new, after.
        l_new: L_new, M_new's acceptance length verifying M_{i+1}.
        beta: drafter forwards per verification of the model above it.
        block_i: mean drafts per verification of M_i before the insertion.
        block_i_new: mean drafts per verification of M_i after it (M_new's blocks).
        block_new: mean drafts per verification of M_new.
        next_is_drafter: whether M_{i+1} is the bottom model.
    """
    curve_i, curve_new, curve_next = (cost_curve(n, c) for n, c in (("t_i", t_i), ("t_new", t_new), ("t_next", t_next)))
    l_i, l_i_new, l_new = (scalar(n, v, positive) for n, v in (("l_i", l_i), ("l_i_new", l_i_new), ("l_new", l_new)))
    beta = scalar("beta", beta, nonnegative)
    b_i, b_i_new, b_new = (
        scalar(n, v, nonnegative) for n, v in (("block_i", block_i), ("block_i_new", block_i_new), ("block_new", block_new))
    )
    new_cost = curve_new(b_new + 1) / l_new
    upper = curve_i(b_i + 1) / l_i - curve_i(b_i_new + 1) / l_i_new
    lower = beta * curve_next(1) * (1 / l_i - 1 / l_new) if next_is_drafter else 0.0
    saved = upper + lower - new_cost
    constant = insertion_test(
        t_i=curve_i(1), t_new=curve_new(1), t_next=curve_next(1), l_i=l_i, l_i_new=l_i_new, l_new=l_new, beta=beta,
        next_is_drafter=next_is_drafter,
    )
    return CurveInsertionVerdict(bool(saved > 0), new_cost, upper, lower, saved, constant)
