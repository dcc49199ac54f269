"""The default schedule: proposal lengths from confidences, acceptance and the machine's costs.

A `CostAwareSchedule` belongs to a proposing level (the child). The parent's verification of k
tokens costs T_v(k) (its cost curve, `hf_polybasic.costs`, at today's level) plus a per-round
overhead o; this level's proposals cost s per token (measured).

* **A model level** (the bottom drafter, or an intermediate level: ``per_token``) proposes token by
  token and, after each, asks `keep_drafting` with its confidence in the token (its probability of
  it; the token is kept either way). It goes on while drafting further raises the round's expected
  tokens per second: with S the probability that every token so far is accepted and a the
  predicted acceptance of the next one (both from the level's confidences,
  `ConfidenceCalibration`), m more tokens add S (a + ... + a^m) tokens for
  m s + T_v(j + 1 + m) - T_v(j + 1) seconds, against the round's E tokens for C seconds so far, for
  any m up to `LOOKAHEAD` (`rates.worth_more`): a step in T_v (a static runner's padded widths, a
  CPU kernel's row blocks) is crossed when the flat stretch beyond it pays for it. Confident streaks
  (code, copied text) run long, up to ``maximum``; unsure tokens end the proposal; where a
  verification of k tokens costs about k steps the marginal cost is a whole step and proposals stay
  short. Before a round's first token counts, the bottom drafter asks `first_draft_pays` with its
  distribution there (not the drawn token: greedy, its largest probability; sampling, its mass in
  each confidence bin, since a flat distribution draws an unsure token as often as its mass says):
  once the calibration is the pair's own, the round proposes only where some proposal, its first
  token priced by the calibrated acceptance of that draw, beats the parent decoding the position alone
  (where T_v(2) = 2 T_v(1), an unsure first draft costs a whole step; `DECLINED_ROUNDS` declines in
  a row back the level off, since each cost a drafter forward). A declined round reveals nothing, so
  a sampled call's `shift` (its text agreeing less than the pair's record) only moves back by drafting:
  the probe after a back-off is priced by the bins without it (issue 47, AVX2: after two rejected
  rounds at a code turn's start it drafted nothing for 33 rounds, 11 declined by the gate and 22 in
  back-offs whose probes it declined too, and the rounds that followed accepted 23 drafts of 23).
  A level the gate decides is not also paused by the average test below (`gates_rounds`): after a
  turn's unsure opening that test sat out stretches the drafter went on to match.
  Once a greedy round's drafting has stopped, it proposes only the drafts that pay
  (`proposal_size`): the gate priced the first draft as if the streak went on, and where the cost
  curve steps, a round that stopped at an unsure second or third draft pays more proposing fewer,
  or none (the drafting is spent either way). Rounds that drafted and proposed nothing count as
  declined ones towards the back-off. A sampled draft cannot be withheld for its value; instead each
  later position of a sampled round is priced, as the first is, from its distribution before its
  draw counts (`next_draft_pays`), and the round stops before a draft that does not pay.
* **A `Drafter`** (no confidences: n-gram lookups) proposes the length in 1 .. ``maximum`` that
  maximises expected tokens per second from its running acceptance (`rates.best_length`).
* **Back-off** (`BackOff`): for a level its first-draft gate does not decide, rounds go on while
  some proposal length is expected to beat the parent decoding alone:
  (1 + a_1 (1 + alpha + ... + alpha^(l-1))) / (l s + T_v(l + 1)) > 1 / (T_v(1) + o) for some l,
  with a_1 the running acceptance of first tokens and alpha the running acceptance per token
  (`rates.best_round_rate`). Not the first token alone: where a verification of 2 tokens costs two
  steps and one of 8 hardly more (unpacked fp32 on many CPUs), a one-token round never pays and a
  long one does, and `keep_drafting` drafts across that step.
  When no length pays, or when the costs say that not even perfect acceptance could pay, the level
  proposes nothing for a stretch of rounds, then probes. Every
  quantity is a ratio of costs measured on the same curves, or a count of acceptances, so a machine
  that slows down or speeds up mid-call moves both sides alike. As a safety net against wrong
  costs, `SAFETY_ROUNDS` rounds that yield, by the clock, less than `SAFETY_MARGIN` of plain
  decoding also make it back off.

Lossless: lengths come from the past and from tokens already proposed (kept whatever they are),
and whether a round proposes a draft at all from the drafter's distribution before its draw counts; no
sampled token is ever dropped because of its value (argmax drafts, a function of the text so far, may
be withheld), and verification is exact whatever the length (0 is plain decoding). Lengths depend on
timings, so sampled outputs are exactly distributed but not bit-reproducible from a seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .backoff import MAX_BACKOFF_ROUNDS, BackOff
from .batch_gate import BatchGate
from .calibration import ConfidenceCalibration
from .rates import (acceptance_rate_estimate, best_length, best_proposal, best_round_rate, decayed, more_drafts_pay,
                    never_pays)

# verifications before the back-off judges the rounds and a Drafter's length moves (the first one,
# which includes the prompt's prefill, never counts towards a yield or the overhead)
WARMUP_ROUNDS = 3
# what a per-token schedule drafts without stopping token by token before it has measured anything
FIRST_FIXED_LENGTH = 4
# acceptance of a round's first token before any evidence, as (accepted, rejected) pseudo-counts
FIRST_TOKEN_PRIOR = (1.5, 0.5)
# the clock's safety net: rounds with proposals in the window, and the share of plain decoding's
# rate they must at least yield (wide: a shared machine's speed swings by tens of percent)
SAFETY_ROUNDS = 8
SAFETY_MARGIN = 0.8
# a probe after which proposing pays by this margin resets the back-off stretch
RESET_MARGIN = 1.1
# rounds in a row whose first draft did not pay (`first_draft_pays`) before the level backs off
DECLINED_ROUNDS = 4
# how many more tokens `keep_drafting` looks ahead (1: the next one only)
LOOKAHEAD = 16


class VerifierCosts(Protocol):
    """The parent's forward cost as a schedule sees it (`hf_polybasic.costs.CostEstimate`, or a
    row's share of one, `hf_polybasic.decoding.round.BatchShare`)."""

    last_seconds: float | None

    def seconds(self, tokens: float) -> float: ...


class CostAwareSchedule:
    """Proposal lengths of one level from confidences and costs (see the module docstring).

    Args:
        initial: the configured length (K or mu, or a Drafter's own); a Drafter's first rounds use it.
        maximum: the longest proposal.
        per_token: the level proposes token by token with confidences (a model level:
            `keep_drafting` decides where a proposal ends) rather than in one piece (a `Drafter`).
        verifier_costs: the parent's forward cost, ``seconds(k)`` for k tokens scored, and the
            seconds of its latest forward, ``last_seconds`` (`hf_polybasic.costs.CostEstimate`);
            None: the mean verification this call has seen.
        step_seconds: what one proposed token costs this level, if known in advance (a model's
            T(1)); used until its own proposals have been timed, and, with ``static_check``, to back
            off at once when not even perfect acceptance could pay (an intermediate level, which
            may emit several tokens per forward, only knows its cost per token from its rounds).
        gate: the batch's `BatchGate` (rows of a batch, level under the target): while it is
            paused the level proposes nothing, whatever its own estimates say.
        calibration: where the level's acceptance-by-confidence starts (what an earlier call of the
            same two models learned, `calibration.remembered`); None: the prior.
    """

    def __init__(self, initial: int, maximum: int, per_token: bool = False, verifier_costs: VerifierCosts | None = None,
                 step_seconds: float | None = None, static_check: bool = True, gate: BatchGate | None = None,
                 calibration: ConfidenceCalibration | None = None):
        self.initial, self.maximum = initial, max(maximum, initial)
        self.per_token = per_token
        self.verifier_costs, self.step_seconds = verifier_costs, step_seconds
        self.static_check = static_check
        self.gate = gate
        self._gated_rounds = 0  # rounds the batch's gate sat this row out
        self.current = self.maximum if per_token else initial
        self.rounds = 0
        self.calibration = calibration or ConfidenceCalibration()
        self.backoff = BackOff()
        # decayed sums: acceptance, first-token acceptance, this level's cost per proposed token,
        # realized yield of rounds with proposals; every verification's seconds and its overhead
        self.accepted = self.rejections = 0.0
        self.first_accepted, self.first_rejected = FIRST_TOKEN_PRIOR
        self.proposing_seconds = self.proposed_tokens = 0.0
        self.yield_tokens = self.yield_seconds = self.yield_rounds = 0.0
        self.verify_seconds = self.verifications = 0.0
        self.overhead_seconds = self.overhead_rounds = 0.0
        self._confidences: list[float] = []
        # `keep_drafting` answers given before the calibration was the pair's own (`calibrated`): the
        # lengths of those proposals (cut short or drafted on) are the prior's, so the shape gate takes
        # no verdict from their rounds
        self.uncalibrated_answers = 0
        self._last_proposal_seconds, self._checked_costs = 0.0, False
        self._declined = 0  # rounds in a row that drafted and proposed nothing (`first_draft_pays`, `proposal_size`)
        # whether `first_draft_pays` decides this level's rounds (asked with a calibration of the pair's own)
        self.gates_rounds = False

    # --- what the level asks ---------------------------------------------------------------------
    @property
    def stops_per_token(self) -> bool:
        return self.per_token

    @property
    def paused_rounds(self) -> int:
        return self.backoff.paused_rounds + self._gated_rounds

    def length(self) -> int:
        """Tokens to propose in the next round (0: let the parent decode alone)."""
        if not self._checked_costs:
            self._checked_costs = True
            if self._proposing_cannot_pay():
                self.backoff.pause(MAX_BACKOFF_ROUNDS // 2)
        if self.backoff.paused:
            return 0
        if self.gate is not None and self.gate.paused:
            self._gated_rounds += 1
            return 0
        # the average test (`round_pays`) pauses a level that cannot tell its rounds apart; a level whose
        # first-draft gate decides each round from its confidence there is not also paused by it
        if (not self.backoff.probing and self.rounds >= WARMUP_ROUNDS and not self.gates_rounds
                and not self.round_pays()):
            self.backoff.pause()
            return 0
        if self.gate is not None and self.gate.cap is not None:  # a batch not yet seen to pay: short proposals
            return min(self.current, self.gate.cap)
        return self.current

    def fixed_length(self) -> int:
        """Tokens to propose in the next round where the level cannot stop token by token (a drafter
        whose rounds are decided on the device, `hf_polybasic.decoding.device_blocks`): `length`, at
        most the best fixed length for the measured acceptance and costs (`best_length`) once warmed
        up, and at most `FIRST_FIXED_LENGTH` before."""
        length = self.length()
        if not self.per_token or length == 0:
            return length
        if self.rounds < WARMUP_ROUNDS:
            return min(length, FIRST_FIXED_LENGTH)
        return min(length, best_length(min(self.acceptance_rate(), 0.999), self.seconds_per_token(),
                                       self.verification_seconds, self.maximum))

    def keep_drafting(self, confidence: float) -> bool:
        """Whether a model level should propose one more token this round, given its confidence in
        the token it just proposed (which is kept either way)."""
        self._confidences.append(confidence)
        if not self.calibration.calibrated:
            self.uncalibrated_answers += 1
        later = self.calibration.next_acceptance(confidence)
        return self._more_pays(later, later, spent=0)

    def closed_at(self, confidence: float) -> None:
        """The round's last draft filled its block: its confidence is kept as `keep_drafting`'s are."""
        self._confidences.append(confidence)

    def first_draft_pays(self, top: float | Sequence[float]) -> bool:
        """Whether a model level's round should propose at all, given its distribution at the round's
        first position (known before the drawn token is kept, so the answer is exact to act on when
        sampling): greedy, its largest probability ``top`` (the draft's own confidence); sampling, its
        mass in each calibration bin (`ConfidenceCalibration.drawn_acceptance`). Yes where some proposal
        from there beats the parent decoding that position alone (`more_drafts_pay` from a round of
        nothing). Before the calibration is the pair's own, yes."""
        calibration = self.calibration
        if not calibration.calibrated:
            return True
        self.gates_rounds = True
        if self.backoff.probing:  # declined rounds reveal nothing: a probe is priced without this call's shift
            calibration = calibration.unshifted()
        if isinstance(top, float):
            first, later = calibration.acceptance(top), calibration.next_acceptance(top)
        else:
            first, later = calibration.drawn_acceptance(top)
        pays = self._more_pays(first, later, spent=1)  # the first token is drawn already
        if not pays:  # a drafter forward for nothing
            self._proposed_nothing()
        return pays

    def next_draft_pays(self, spread: Sequence[float]) -> bool:
        """Whether a sampled round proposes the draft at its next position, from that position's mass in each
        calibration bin (`ConfidenceCalibration.drawn_acceptance`; known before the drawn token counts, so
        exact to act on): yes where it, and maybe more, beat stopping at the drafts kept so far. Before the
        calibration is the pair's own, yes."""
        if not self.calibration.calibrated:
            return True
        return self._more_pays(*self.calibration.drawn_acceptance(spread), spent=1)

    def _more_pays(self, first: float, later: float, spent: int) -> bool:
        """`rates.more_drafts_pay` for a round of the drafts kept so far (`_confidences`), `LOOKAHEAD` ahead."""
        acceptances = [self.calibration.acceptance(value) for value in self._confidences]
        return more_drafts_pay(acceptances, first, later, self.seconds_per_token(), self.verification_seconds,
                               min(LOOKAHEAD, self.maximum - len(acceptances)), spent)

    def _proposed_nothing(self) -> None:
        """A round drafted and proposed nothing (`first_draft_pays`, `proposal_size`): `DECLINED_ROUNDS` in
        a row back the level off; a round that proposes restarts the count (`observe_verification`)."""
        self._declined += 1
        if self._declined >= DECLINED_ROUNDS:
            self._declined = 0
            self.backoff.pause()

    def proposal_size(self, drafted: int) -> int:
        """How many of a round's ``drafted`` argmax drafts to propose once drafting has stopped
        (`rates.best_proposal`, priced by the calibration; see the module docstring). Before the
        calibration is the pair's own, or with a draft no confidence was asked of, all of them."""
        confidences = self._confidences[:drafted]
        if not self.calibration.calibrated or len(confidences) < drafted:
            return drafted
        size = best_proposal([self.calibration.acceptance(value) for value in confidences], self.verification_seconds)
        if size == 0:
            self._proposed_nothing()
        return size

    # --- estimates ---------------------------------------------------------------------------------
    def acceptance_rate(self) -> float:
        return acceptance_rate_estimate(self.accepted, self.rejections)

    def first_token_acceptance(self) -> float:
        return self.first_accepted / (self.first_accepted + self.first_rejected)

    def seconds_per_token(self) -> float:
        """What one proposed token costs this level (and everything below it)."""
        if self.proposed_tokens > 0:
            return self.proposing_seconds / self.proposed_tokens
        return self.step_seconds or 0.0

    def overhead(self) -> float:
        """Seconds of a verification beyond the parent's forward (processing, acceptance, Python)."""
        return self.overhead_seconds / self.overhead_rounds if self.overhead_rounds else 0.0

    def verification_seconds(self, tokens: int) -> float:
        """What the parent's verification of ``tokens`` tokens (proposal + 1) costs now."""
        if self.verifier_costs is not None:
            return self.verifier_costs.seconds(tokens) + self.overhead()
        return self.verify_seconds / self.verifications if self.verifications else 0.0

    def plain_rate(self) -> float:
        """Tokens per second of the parent decoding alone, priced at the parent's current speed."""
        seconds = self.verification_seconds(1)
        return 1.0 / seconds if seconds > 0 else float("inf")

    def round_pays(self, margin: float = 1.0) -> bool:
        """Whether a round with some proposal length is expected to beat the parent decoding alone by
        ``margin`` (`rates.best_round_rate` against ``1 / (T_v(1) + o)``)."""
        best = best_round_rate(self.first_token_acceptance(), self.acceptance_rate(), self.seconds_per_token(),
                               self.verification_seconds, self.maximum)
        return best > margin * self.plain_rate()

    def _proposing_cannot_pay(self) -> bool:
        """Whether the costs alone rule proposing out (`rates.never_pays`)."""
        if self.verifier_costs is None or self.step_seconds is None or not self.static_check:
            return False
        return never_pays(self.step_seconds, self.verification_seconds, self.maximum)

    # --- what the level and its parent report --------------------------------------------------------
    def observe_proposal(self, num_tokens: int, seconds: float) -> None:
        """The level proposed ``num_tokens`` tokens in ``seconds`` (its own and its children's work)."""
        self._last_proposal_seconds = seconds
        if num_tokens > 0 and self.rounds > 0:  # the first proposal holds the level's prefill
            self.proposing_seconds = decayed(self.proposing_seconds, seconds)
            self.proposed_tokens = decayed(self.proposed_tokens, num_tokens)

    def observe_verification(self, num_drafted: int, num_accepted: int, seconds: float) -> None:
        """The parent accepted ``num_accepted`` of ``num_drafted`` proposed tokens in one verification
        of ``seconds``; updates the estimates and the length of the next round."""
        self.rounds += 1
        first_round = self.rounds == 1  # its forwards include the prompt's (prefill)
        self.verify_seconds = decayed(self.verify_seconds, seconds)
        self.verifications = decayed(self.verifications, 1.0)
        if self.verifier_costs is not None and not first_round:
            forward = getattr(self.verifier_costs, "last_seconds", None)
            forward = self.verifier_costs.seconds(num_drafted + 1) if forward is None else forward
            self.overhead_seconds = decayed(self.overhead_seconds, max(seconds - forward, 0.0))
            self.overhead_rounds = decayed(self.overhead_rounds, 1.0)
        if num_drafted:
            self._declined = 0
            self.accepted = decayed(self.accepted, num_accepted)
            self.rejections = decayed(self.rejections, float(num_accepted < num_drafted))
            self.first_accepted = decayed(self.first_accepted, float(num_accepted > 0))
            self.first_rejected = decayed(self.first_rejected, float(num_accepted == 0))
            self.calibration.observe(self._confidences[:num_drafted], num_accepted)
            if not first_round:
                self.yield_tokens = decayed(self.yield_tokens, num_accepted + 1)
                self.yield_seconds = decayed(self.yield_seconds, seconds + self._last_proposal_seconds)
                self.yield_rounds += 1
        self._confidences = []
        self._after_round(num_drafted)

    def _after_round(self, num_drafted: int) -> None:
        if self.backoff.paused:
            if self.backoff.sit_out():  # a probe follows: fresh evidence decides, the old rounds do not
                self.yield_tokens = self.yield_seconds = self.yield_rounds = 0.0
                self.first_accepted, self.first_rejected = FIRST_TOKEN_PRIOR
            return
        if num_drafted == 0:
            return
        if self.backoff.probing:
            self.backoff.probed()
            if not self.backoff.probing and self.round_pays(RESET_MARGIN):
                self.backoff.reset()
        rate = self.yield_tokens / max(self.yield_seconds, 1e-12)
        if self.yield_rounds >= SAFETY_ROUNDS and rate < SAFETY_MARGIN * self.plain_rate():
            self.backoff.pause()
            return
        if not self.per_token and self.rounds >= WARMUP_ROUNDS:
            self.current = best_length(
                min(self.acceptance_rate(), 0.999), self.seconds_per_token(), self.verification_seconds, self.maximum
            )
