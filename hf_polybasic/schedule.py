"""How many tokens a level proposes per round: K for the bottom drafter, mu for an intermediate.

A `ProposalSchedule` belongs to a proposing level (the child); the child reports what its proposal
cost (`observe_proposal`) and, through `Level.verified`, what the level above (the parent) made of
it (`observe_verification`). Three kinds:

* ``"constant"``: always the configured length (the paper's static K and mu).
* ``"heuristic"``: transformers' assisted-generation rule: +2 after a round whose proposal was
  accepted whole, -1 (down to 1) otherwise.
* ``"cost_aware"`` (the default): lengths from measured costs. The parent's verification of k
  tokens costs T_v(k) (its cost curve, `hf_polybasic.costs`, at today's level) plus a per-round
  overhead o; this level's proposals cost s per token; the parent accepts each proposed token
  with probability alpha (a running, decayed estimate). Then

  - an intermediate level proposes the mu in 1..maximum that maximises expected tokens per second,
    E(l) / (l s + T_v(l + 1) + o) with E(l) = 1 + alpha + ... + alpha^l (`best_length`);
  - a model drafter drafts up to ``maximum`` tokens and stops as soon as one more token is not
    expected to pay its marginal cost, s plus T_v(j + 2) - T_v(j + 1) (`keep_drafting`), using its
    own probabilities of the tokens drafted so far, calibrated against past acceptances;
  - **back-off**: when rounds with proposals yield fewer tokens per second than the parent decoding
    alone (one token per T_v(1) + o), or when the costs say that not even perfect acceptance could
    pay, the level proposes nothing for a stretch of rounds: the parent then decodes exactly as
    plain decoding does. It probes again after the stretch, which doubles (up to
    `MAX_BACKOFF_ROUNDS`) while probes keep failing.

Why every schedule is lossless: the length is chosen from the past only (acceptance counts,
timings, and the tokens already drafted, which are all kept), never by dropping a drawn token, and
verification of each proposed token is exact whatever the length (a length of 0 is plain
decoding). With ``"cost_aware"`` the length depends on timings, so a sampled output is exactly
distributed but not bit-reproducible from a seed across runs; ``"constant"`` and ``"heuristic"``
are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

SCHEDULES = ("constant", "heuristic", "cost_aware")

# per-round decay of the running sums: an observation's weight halves after ~7 later rounds, so
# the estimates follow the text (code copied from the prompt vs. free prose) within one call
DECAY = 0.9
# verifications before "cost_aware" trusts its estimates (until then: the configured length, capped
# at what pays at `PRIOR_ACCEPTANCE`)
WARMUP_ROUNDS = 2
# back-off: rounds without proposals before the first probe, the most ever, and the probe's length
# (8 and 1, not 4 and 2: on a 64-token answer where no draft pays, bf16 target on emulated AVX2,
# 4 and 2 measured 0.90x plain generate, 8 and 1 0.99x; docs/benchmarks.md)
FIRST_BACKOFF_ROUNDS = 8
MAX_BACKOFF_ROUNDS = 64
PROBE_ROUNDS = 1
# before any evidence, "cost_aware" caps the warm-up proposals at the length that would pay best if
# this share of tokens were accepted (optimistic: on a flat cost curve it leaves K as configured;
# where verifying k tokens costs about k steps it drafts one token, not K)
PRIOR_ACCEPTANCE = 0.8
# a probe that pays this much better than plain decoding resets the back-off stretch (a probe that
# merely ties does not: two rounds are noisy, and a lucky one would undo the doubling)
RESET_MARGIN = 1.1


def expected_tokens(acceptance_rate: float, length: int) -> float:
    """Tokens one verification of ``length`` proposed tokens emits on average when each is accepted
    with probability ``acceptance_rate`` until the first rejection: 1 + alpha + ... + alpha^length."""
    total, power = 1.0, 1.0
    for _ in range(length):
        power *= acceptance_rate
        total += power
    return total


def best_length(
    acceptance_rate: float,
    seconds_per_token: float,
    verification_seconds: Callable[[int], float],
    maximum: int,
    minimum: int = 1,
) -> int:
    """The proposal length l in minimum..maximum that maximises expected tokens per second,
    E(l) / (l * seconds_per_token + verification_seconds(l + 1)); ties go to the shorter one.

    With a constant verification cost this is Leviathan et al.'s optimal draft length; with a
    cost curve T_v(k) it is the same question asked of the machine at hand.
    """
    best, best_rate = minimum, -1.0
    for length in range(minimum, maximum + 1):
        cost = length * seconds_per_token + verification_seconds(length + 1)
        rate = expected_tokens(acceptance_rate, length) / max(cost, 1e-12)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = length, rate
    return best


def acceptance_rate_estimate(accepted: float, rejections: float) -> float:
    """Per-token acceptance rate alpha from (decayed) counts, with one pseudo-observation each way.

    Each verification accepts a leading run and ends in at most one rejection, so the geometric
    maximum-likelihood estimate is accepted / (accepted + rejections); the pseudo-counts keep it
    inside (0, 1) before either has been seen.
    """
    if accepted < 0 or rejections < 0:
        raise ValueError(f"counts must be >= 0, got accepted={accepted}, rejections={rejections}")
    return (accepted + 1.0) / (accepted + rejections + 2.0)


def _decayed(total: float, value: float) -> float:
    return DECAY * total + value


@dataclass
class ProposalSchedule:
    """Chooses the proposal length of one level, within ``0 .. maximum`` (0: back off).

    Attributes:
        kind: one of `SCHEDULES`.
        initial: the configured length (K or mu); the length of the first rounds.
        maximum: the largest length any schedule proposes.
        stops_early: the level can stop after any token it drafts (a model drafter); a
            cost-aware schedule then lets it draft up to ``maximum`` and leaves the stop to
            `keep_drafting`.
        verifier_costs: the parent's forward cost, ``seconds(k)`` for k tokens scored, and the
            seconds of its latest forward, ``last_seconds`` (`hf_polybasic.costs.CostEstimate`);
            None: a constant, the mean verification seen.
        step_seconds: what one proposed token costs this level, if known in advance (a model
            drafter's T(1)); used to back off at once when not even perfect acceptance could pay.
    """

    kind: str
    initial: int
    maximum: int
    stops_early: bool = False
    verifier_costs: object | None = None
    step_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.kind!r}")
        self.maximum = max(self.maximum, self.initial)
        self.current = self.initial
        self.rounds = 0
        # decayed sums over rounds with proposals: acceptance, this level's cost, realized yield
        self.accepted = self.rejections = 0.0
        self.proposing_seconds = self.proposed_tokens = 0.0
        self.yield_tokens = self.yield_seconds = 0.0
        # decayed sums over every verification: its seconds, and seconds beyond the forward itself
        self.verify_seconds = self.verifications = 0.0
        self.overhead_seconds = self.overhead_rounds = 0.0
        # rounds in which the parent decoded alone (nothing proposed): what plain decoding costs here
        self.plain_seconds = self.plain_rounds = 0.0
        # calibration of the drafter's own probabilities against acceptances
        self.observed_accepted = self.observed_probability = self.observed_tokens = 0.0
        self._round_probabilities: list[float] = []
        self._last_proposal_seconds = 0.0
        # back-off: rounds still to sit out, the next stretch, probe rounds left, rounds sat out in all
        self.paused_for = 0
        self.stretch = FIRST_BACKOFF_ROUNDS
        self.probing = 0
        self.paused_rounds = 0
        self._checked_costs = False

    # --- what the level asks ------------------------------------------------------------------
    @property
    def stops_per_token(self) -> bool:
        """Whether the level should consult `keep_drafting` after each token it drafts."""
        return self.stops_early and self.kind == "cost_aware"

    def length(self) -> int:
        """Tokens to propose in the next round (0: let the parent decode alone)."""
        if self.kind == "cost_aware" and not self._checked_costs:
            self._checked_costs = True
            if self._drafting_cannot_pay():
                self._back_off(MAX_BACKOFF_ROUNDS // 2)
        if self.paused_for > 0:
            return 0
        if self.kind == "cost_aware" and self.rounds < WARMUP_ROUNDS:
            return min(self.current, self._warmup_length())
        return self.current

    def _warmup_length(self) -> int:
        """The length that pays best at `PRIOR_ACCEPTANCE`, from the costs known before any round
        (the configured length where they are not known)."""
        if self.verifier_costs is None or self.step_seconds is None:
            return self.current
        return best_length(PRIOR_ACCEPTANCE, self.step_seconds, self.verification_seconds, self.maximum)

    def keep_drafting(self, token_probability: float) -> bool:
        """Whether a model drafter should draft one more token this round, given its own
        probability of the token it just drafted (which is kept either way). Always True unless
        cost-aware.

        Stop when the next token is not expected to pay: with S_j the draft's survival probability
        so far (its tokens' probabilities, calibrated against past acceptances), E_j = 1 + S_1 + ...
        + S_j the tokens expected if drafting stops now and C_j its round's cost, one more token adds
        about S_j alpha tokens for s + T_v(j + 2) - T_v(j + 1) seconds; go on while
        S_j alpha C_j > E_j (s + T_v(j + 2) - T_v(j + 1)).
        """
        self._round_probabilities.append(token_probability)
        if self.kind != "cost_aware" or self.rounds < WARMUP_ROUNDS or self.proposed_tokens <= 0:
            return True
        survival, expected = 1.0, 1.0
        calibration = self.calibration()
        for probability in self._round_probabilities:
            survival *= min(1.0, calibration * probability)
            expected += survival
        drafted = len(self._round_probabilities)
        step = self.seconds_per_token()
        cost = drafted * step + self.verification_seconds(drafted + 1)
        marginal = step + self.verification_seconds(drafted + 2) - self.verification_seconds(drafted + 1)
        return survival * self.acceptance_rate() * cost > expected * marginal

    # --- estimates ----------------------------------------------------------------------------
    def calibration(self) -> float:
        """How much more (or less) often than its own probability says a drafted token is accepted:
        accepted drafts / the drafter's probabilities of them, over the tokens whose fate a
        verification revealed, with half a pseudo-acceptance of a token of average probability (so
        a drafter whose probabilities are all small but right is believed, not capped)."""
        if self.observed_tokens <= 0:
            return 1.0
        mean_probability = self.observed_probability / self.observed_tokens
        return (self.observed_accepted + 0.5) / (self.observed_probability + mean_probability)

    def acceptance_rate(self) -> float:
        return acceptance_rate_estimate(self.accepted, self.rejections)

    def seconds_per_token(self) -> float:
        """What one proposed token costs this level (and everything below it)."""
        if self.proposed_tokens > 0:
            return self.proposing_seconds / self.proposed_tokens
        return self.step_seconds or 0.0

    def overhead(self) -> float:
        """Seconds of a verification beyond the parent's forward (processing, acceptance, Python)."""
        return self.overhead_seconds / self.overhead_rounds if self.overhead_rounds else 0.0

    def verification_seconds(self, tokens: int) -> float:
        """What the parent's verification of ``tokens`` tokens (proposal + 1) costs."""
        if self.verifier_costs is not None:
            return self.verifier_costs.seconds(tokens) + self.overhead()
        return self.verify_seconds / self.verifications if self.verifications else 0.0

    def plain_rate(self) -> float:
        """Tokens per second of the parent decoding alone."""
        if self.plain_rounds >= 1:
            seconds = self.plain_seconds / self.plain_rounds
        else:
            seconds = self.verification_seconds(1)
        return 1.0 / seconds if seconds > 0 else float("inf")

    def _drafting_cannot_pay(self) -> bool:
        """Whether the costs alone rule drafting out: even if every proposed token were accepted, every
        length would emit tokens more slowly than the parent decoding alone (a tie is left to the
        rounds to settle)."""
        if self.verifier_costs is None or self.step_seconds is None:
            return False
        plain = 1.0 / max(self.verification_seconds(1), 1e-12)
        return all(
            (length + 1) / (length * self.step_seconds + self.verification_seconds(length + 1)) < plain * (1 - 1e-6)
            for length in range(1, self.maximum + 1)
        )

    # --- what the level and its parent report -----------------------------------------------------
    def observe_proposal(self, num_tokens: int, seconds: float) -> None:
        """The level proposed ``num_tokens`` tokens in ``seconds`` (its own and its children's work)."""
        self._last_proposal_seconds = seconds
        if num_tokens > 0:
            self.proposing_seconds = _decayed(self.proposing_seconds, seconds)
            self.proposed_tokens = _decayed(self.proposed_tokens, num_tokens)

    def observe_verification(self, num_drafted: int, num_accepted: int, seconds: float) -> None:
        """The parent accepted ``num_accepted`` of ``num_drafted`` proposed tokens in one verification
        of ``seconds``; updates the estimates and the length of the next round."""
        self.rounds += 1
        self.verify_seconds = _decayed(self.verify_seconds, seconds)
        self.verifications = _decayed(self.verifications, 1.0)
        if self.verifier_costs is not None:
            forward = getattr(self.verifier_costs, "last_seconds", None)
            if forward is None:
                forward = self.verifier_costs.seconds(num_drafted + 1)
            self.overhead_seconds = _decayed(self.overhead_seconds, max(seconds - forward, 0.0))
            self.overhead_rounds = _decayed(self.overhead_rounds, 1.0)
        if num_drafted == 0:
            self.plain_seconds = _decayed(self.plain_seconds, seconds + self._last_proposal_seconds)
            self.plain_rounds = _decayed(self.plain_rounds, 1.0)
        else:
            self._learn_from(num_drafted, num_accepted, seconds)
        self._round_probabilities = []
        if self.kind == "heuristic" and num_drafted:
            rejected = num_accepted < num_drafted
            self.current = min(self.maximum, self.current + 2) if not rejected else max(1, self.current - 1)
        elif self.kind == "cost_aware":
            self._choose_next(num_drafted)

    def _learn_from(self, num_drafted: int, num_accepted: int, seconds: float) -> None:
        self.accepted = _decayed(self.accepted, num_accepted)
        self.rejections = _decayed(self.rejections, float(num_accepted < num_drafted))
        revealed = self._round_probabilities[: num_accepted + 1]
        self.observed_accepted = _decayed(self.observed_accepted, min(num_accepted, len(revealed)))
        self.observed_probability = _decayed(self.observed_probability, sum(revealed))
        self.observed_tokens = _decayed(self.observed_tokens, len(revealed))
        self.yield_tokens = _decayed(self.yield_tokens, num_accepted + 1)
        self.yield_seconds = _decayed(self.yield_seconds, seconds + self._last_proposal_seconds)

    def _choose_next(self, num_drafted: int) -> None:
        if self.paused_for > 0:
            self.paused_for -= 1
            self.paused_rounds += 1
            if self.paused_for == 0:  # probe: fresh evidence decides, the old rounds do not
                self.probing = PROBE_ROUNDS
                self.yield_tokens = self.yield_seconds = 0.0
            return
        if self.rounds < WARMUP_ROUNDS or num_drafted == 0:
            return
        if self.probing:
            self.probing -= 1
            if self.probing:
                return
        if self.yield_seconds > 0 and self.yield_tokens / self.yield_seconds < self.plain_rate():
            self._back_off(self.stretch)
            self.stretch = min(2 * self.stretch, MAX_BACKOFF_ROUNDS)
            return
        if self.yield_tokens / max(self.yield_seconds, 1e-12) >= RESET_MARGIN * self.plain_rate():
            self.stretch = FIRST_BACKOFF_ROUNDS
        if self.stops_early:
            self.current = self.maximum  # the per-token rule decides where a draft ends
        else:
            self.current = best_length(
                min(self.acceptance_rate(), 0.999), self.seconds_per_token(), self.verification_seconds, self.maximum
            )

    def _back_off(self, rounds: int) -> None:
        self.paused_for = rounds
        self.probing = 0
