"""Planning a chain from measurements: which models to stack, with which K and mu.

One module per concept, data flowing one way:

* `theory`: the paper's formulas as pure functions (Lemma 3.1, Theorems 3.2 and 3.3);
* `acceptance`: how a verifier accepts the stream below, from agreement data (pure numpy);
* `profile_data`: `Profile`, the measured costs and agreements of a pool (JSON);
* `measure`: `profile`, which measures a pool on real prompts;
* `predict`: `predict`, the time model of one chain with one K and mu;
* `search`: `plan` and `Plan`, every chain at its best setting, fastest first;
* `explain`: why each candidate is in or out (Theorem 3.2), and the markdown reports.

Typical use::

    plan = hp.plan(hp.profile(target, {"mid": mid, "draft": draft}, tokenizer, prompts))
    out = target.generate(**inputs, **plan.generate_kwargs())
"""

from .. import theory
from .acceptance import (
    Acceptance,
    BlockAcceptance,
    expected_run_length,
    expected_verifications,
    geometric_pmf,
    run_lengths,
    verification_walk,
    walk_acceptance_length,
)
from .explain import Explanation, Insertion, plan_markdown
from .measure import encode_prompt, profile
from .predict import ChainPrediction, LevelPrediction, predict, predict_time_per_token
from .profile_data import DRAFTER, MODEL, TARGET, Profile, cost_order, profile_markdown
from .search import DEFAULT_K_GRID, DEFAULT_MU_GRID, Plan, best_setting, candidate_chains, plan

__all__ = [
    "Acceptance",
    "BlockAcceptance",
    "ChainPrediction",
    "DEFAULT_K_GRID",
    "DEFAULT_MU_GRID",
    "DRAFTER",
    "Explanation",
    "Insertion",
    "LevelPrediction",
    "MODEL",
    "Plan",
    "Profile",
    "TARGET",
    "best_setting",
    "candidate_chains",
    "cost_order",
    "encode_prompt",
    "expected_run_length",
    "expected_verifications",
    "geometric_pmf",
    "plan",
    "plan_markdown",
    "predict",
    "predict_time_per_token",
    "profile",
    "profile_markdown",
    "run_lengths",
    "theory",
    "verification_walk",
    "walk_acceptance_length",
]
