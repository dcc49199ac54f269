"""The paper's theory as plain functions: acceptance lengths, the time model, the insertion test.

Notation (Wang et al., ICML 2025, "Polybasic Speculative Decoding Through a Theoretical
Perspective", arXiv 2510.26527), for a chain M1 > M2 > ... > Mn (M1 the target, Mn the drafter):

* **T_i**: the cost of one forward pass of M_i (seconds, or any unit shared by all levels).
* **L_i**: the mean acceptance length of M_i's verifications, in our **tau convention** (see
  `hf_polybasic.stats`): accepted drafts **plus** the one token the verifier adds itself, so
  L_i >= 1. Only M1 .. M(n-1) verify, so there are n - 1 of them.
* **F_i**: forward passes of M_i. **N**: tokens generated.
* **beta**: forward passes of the drafter Mn per verification of M(n-1) (K for a model drafter
  that drafts K tokens one forward at a time).
* **p** (or Leviathan's **alpha**): the probability that the verifier accepts one drafted token,
  taken as the same for every position and independent of the others. Under speculative sampling
  with proposal q and target p it is alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q).
* **n** (Leviathan's **gamma**, our **K**): the number of drafted tokens, i.e. the cap on the
  accepted drafts of one verification; the acceptance length is then at most n + 1.
* **T_i(k)**: the cost of a forward of M_i that scores k new tokens, measured on the machine at
  hand (`hf_polybasic.costs`). The paper charges every forward T_i whatever k; on CPUs (and on
  GPUs at larger k) that is false, so every result below also comes with cost curves.

Against the paper's text (Section 3.2), one module per result:

* `verification`: one verification as a truncated geometric variable; Leviathan et al.'s
  two-model formulas; **Theorem 3.3** as printed (`acceptance_length_variance_as_printed`), which
  is wrong for every finite n and can be negative, next to the right variance
  (`acceptance_length_variance`, checked against simulation).
* `time_model`: **Lemma 3.1** as printed (`polybasic_time`), exact when L_i is read as N / F_i,
  which for the intermediate levels is *not* the per-verification mean that
  `LevelStats.mean_acceptance_length` reports (`TimeModelInputs`); and with cost curves
  (`polybasic_time_with_curves`: a verification of b drafts costs T_i(b + 1)).
* `insertion`: **Theorem 3.2** as printed (`insertion_test`: its two conditions are sufficient,
  not necessary, and the exact test is their sum), and with cost curves
  (`insertion_test_with_curves`), where the printed form can give the wrong answer.

Every function of the paper's forms takes numbers or numpy arrays (broadcast together) and returns a Python scalar
for scalar inputs, an array otherwise. Invalid inputs raise `ValueError` naming the argument.
"""

from .checks import ArrayLike
from .insertion import CurveInsertionVerdict, InsertionVerdict, insertion_test, insertion_test_with_curves
from .time_model import (
    CostCurveLike,
    TimeModelInputs,
    cost_curve,
    polybasic_speedup,
    polybasic_speedup_with_curves,
    polybasic_time,
    polybasic_time_per_token,
    polybasic_time_per_token_with_curves,
    polybasic_time_with_curves,
)
from .verification import (
    acceptance_length_distribution,
    acceptance_length_variance,
    acceptance_length_variance_as_printed,
    expected_acceptance_length,
    expected_tokens_per_verification,
    improvement_factor,
    optimal_draft_length,
)

__all__ = [
    "ArrayLike",
    "CostCurveLike",
    "CurveInsertionVerdict",
    "InsertionVerdict",
    "TimeModelInputs",
    "acceptance_length_distribution",
    "acceptance_length_variance",
    "acceptance_length_variance_as_printed",
    "cost_curve",
    "expected_acceptance_length",
    "expected_tokens_per_verification",
    "improvement_factor",
    "insertion_test",
    "insertion_test_with_curves",
    "optimal_draft_length",
    "polybasic_speedup",
    "polybasic_speedup_with_curves",
    "polybasic_time",
    "polybasic_time_per_token",
    "polybasic_time_per_token_with_curves",
    "polybasic_time_with_curves",
]
