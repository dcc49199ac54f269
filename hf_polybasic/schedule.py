"""How many tokens a level proposes per round: K for the bottom drafter, mu for an intermediate.

A `ProposalSchedule` belongs to a proposing level (the child); the level above it (the parent)
reports every verification outcome to it, and the child reports how long it took to produce its
proposal. Three kinds:

* ``"constant"``: always the configured length (the paper's static K and mu).
* ``"heuristic"``: transformers' assisted-generation schedule: +2 after a round whose proposal was
  accepted whole, -1 (down to 1) otherwise.
* ``"cost_aware"``: the length that maximises the parent's expected emitted tokens per second,
  from a running (exponentially decayed) estimate of the per-token acceptance rate alpha and the
  measured cost ratio c = (seconds per proposed token, this level and everything below) /
  (seconds of one parent verification): Leviathan et al.'s optimal draft length
  (`optimal_length`), recomputed after every verification. A model
  drafter also stops early, token by token (`keep_drafting`): the next draft token is worth its
  cost c only if the draft so far is likely to survive, so drafting goes on while the estimated
  survival probability of the whole draft (the drafter's probabilities of its tokens, calibrated
  against past acceptances) is at least c times the round's current yield. This plays the role
  of transformers' confidence threshold, with the threshold derived from measured costs.

Why every schedule is lossless: the length is chosen from the past only (acceptance counts,
timings, and the tokens already drafted, which are all kept): never by dropping a drawn token. Verification of each drafted token is exact whatever the
length, so the output is still the target's greedy output / an exact sample of its distribution.
With ``"cost_aware"`` the length depends on wall-clock timings, so a sampled output is exactly
distributed but not bit-reproducible from a seed across runs; ``"constant"`` and ``"heuristic"``
are.
"""

from __future__ import annotations

from dataclasses import dataclass


SCHEDULES = ("constant", "heuristic", "cost_aware")

# per-round decay of the running sums: an observation's weight halves after ~7 later rounds, so
# the estimates follow the text (code copied from the prompt vs. free prose) within one call
DECAY = 0.9
# verifications before "cost_aware" trusts its estimates (the configured length is used until then)
WARMUP_ROUNDS = 2


@dataclass
class ProposalSchedule:
    """Chooses the proposal length of one level, within ``1 .. maximum``.

    Attributes:
        kind: one of `SCHEDULES`.
        initial: the configured length (K or mu); the length of the first rounds.
        maximum: the largest length any schedule proposes.
        stops_early: the level can stop after any token it drafts (a model drafter); a
            cost-aware schedule then lets it draft up to ``maximum`` and leaves the stop to that
            per-token rule instead of the alpha-based length.
    """

    kind: str
    initial: int
    maximum: int
    stops_early: bool = False

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.kind!r}")
        self.maximum = max(self.maximum, self.initial)
        self.current = self.initial
        self.rounds = 0
        # decayed sums: accepted tokens, rejections, proposing seconds, proposed tokens, verify seconds
        self.accepted = self.rejections = 0.0
        self.proposing_seconds = self.proposed_tokens = 0.0
        self.verify_seconds = self.verifications = 0.0
        # calibration of the drafter's own probabilities: accepted drafts and their probabilities,
        # over the tokens whose fate a verification revealed (accepted ones and the first rejected)
        self.observed_accepted = self.observed_probability = 0.0
        self._round_probabilities: list[float] = []

    @property
    def stops_per_token(self) -> bool:
        """Whether the level should consult `keep_drafting` after each token it drafts."""
        return self.stops_early and self.kind == "cost_aware"

    def length(self) -> int:
        """Tokens to propose in the next round."""
        return self.current

    def observe_proposal(self, num_tokens: int, seconds: float) -> None:
        """The child produced ``num_tokens`` tokens in ``seconds`` (its own and its children's work)."""
        self.proposing_seconds = DECAY * self.proposing_seconds + seconds
        self.proposed_tokens = DECAY * self.proposed_tokens + num_tokens

    def keep_drafting(self, token_probability: float) -> bool:
        """Whether a model drafter should draft one more token this round, given its own
        probability of the token it just drafted (which is kept either way). Always True unless
        cost-aware.

        Rule: each drafted token survives verification with probability about
        ``min(1, calibration * its probability)``, the calibration being the running ratio of
        accepted drafts to the drafter's probabilities of them; drafting continues while the whole
        draft's survival probability is at least c times the round's yield (tokens emitted per
        unit of verification time), i.e. while one more token is expected to pay for its cost.
        """
        self._round_probabilities.append(token_probability)
        if self.kind != "cost_aware" or self.rounds < WARMUP_ROUNDS or self.verifications <= 0:
            return True
        calibration = (self.observed_accepted + 1.0) / (self.observed_probability + 1.0)
        survival = 1.0
        for probability in self._round_probabilities:
            survival *= min(1.0, calibration * probability)
        cost_ratio = (self.proposing_seconds / max(self.proposed_tokens, 1e-9)) / max(
            self.verify_seconds / self.verifications, 1e-9
        )
        tokens_per_round = (self.accepted + self.verifications) / self.verifications
        proposed_per_round = self.proposed_tokens / self.verifications
        yield_per_round = tokens_per_round / (1.0 + proposed_per_round * cost_ratio)
        return survival >= cost_ratio * yield_per_round

    def observe_verification(self, num_drafted: int, num_accepted: int, seconds: float) -> None:
        """The parent accepted ``num_accepted`` of ``num_drafted`` proposed tokens in one forward of
        ``seconds``; updates the length of the next round."""
        self.rounds += 1
        rejected = num_accepted < num_drafted
        self.accepted = DECAY * self.accepted + num_accepted
        self.rejections = DECAY * self.rejections + rejected
        self.verify_seconds = DECAY * self.verify_seconds + seconds
        self.verifications = DECAY * self.verifications + 1
        revealed = self._round_probabilities[: num_accepted + 1]
        self.observed_accepted = DECAY * self.observed_accepted + min(num_accepted, len(revealed))
        self.observed_probability = DECAY * self.observed_probability + sum(revealed)
        self._round_probabilities = []
        if self.kind == "heuristic" and num_drafted:
            self.current = min(self.maximum, self.current + 2) if not rejected else max(1, self.current - 1)
        elif self.kind == "cost_aware" and self.rounds >= WARMUP_ROUNDS and self.stops_early:
            self.current = self.maximum
        elif self.kind == "cost_aware" and self.rounds >= WARMUP_ROUNDS and self.proposed_tokens > 0:
            self.current = cost_aware_length(
                acceptance_rate=acceptance_rate_estimate(self.accepted, self.rejections),
                seconds_per_proposed_token=self.proposing_seconds / self.proposed_tokens,
                seconds_per_verification=self.verify_seconds / self.verifications,
                maximum=self.maximum,
            )


def acceptance_rate_estimate(accepted: float, rejections: float) -> float:
    """Per-token acceptance rate alpha from (decayed) counts, with one pseudo-observation each way.

    Each verification accepts a leading run and ends in at most one rejection, so the geometric
    maximum-likelihood estimate is accepted / (accepted + rejections); the pseudo-counts keep it
    inside (0, 1) before either has been seen.
    """
    if accepted < 0 or rejections < 0:
        raise ValueError(f"counts must be >= 0, got accepted={accepted}, rejections={rejections}")
    return (accepted + 1.0) / (accepted + rejections + 2.0)


def optimal_length(acceptance_rate: float, cost_ratio: float, maximum: int) -> int:
    """Leviathan et al.'s optimal draft length in 0..maximum: the gamma that maximises
    (1 - alpha^(gamma+1)) / ((1 - alpha) (gamma c + 1)); ties go to the shorter draft.
    (`hf_polybasic.planning.theory.optimal_draft_length` is the same, for arrays.)"""
    best, best_value, tokens, power = 0, 1.0, 1.0, 1.0
    for gamma in range(1, maximum + 1):
        power *= acceptance_rate
        tokens += power
        value = tokens / (gamma * cost_ratio + 1)
        if value > best_value:
            best, best_value = gamma, value
    return best


def cost_aware_length(
    acceptance_rate: float, seconds_per_proposed_token: float, seconds_per_verification: float, maximum: int
) -> int:
    """The proposal length in 1..maximum that maximises expected emitted tokens per second.

    Expected tokens per verification of a length-g proposal at per-token acceptance alpha are
    (1 - alpha^(g+1)) / (1 - alpha); the round costs g * seconds_per_proposed_token +
    seconds_per_verification.
    """
    if seconds_per_verification <= 0:
        return maximum
    ratio = max(seconds_per_proposed_token / seconds_per_verification, 1e-9)
    return max(1, optimal_length(min(acceptance_rate, 0.999), ratio, maximum))
