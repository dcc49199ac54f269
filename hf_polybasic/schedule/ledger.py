"""The call's ledger against plain decoding, by the clock: how far one row's rounds are behind.

A schedule prices each round from cost curves and calibrated acceptance, and where its estimates are
wrong for a text (a drafter confident in prose the target writes otherwise), rounds that each looked
worth it lose, one step at a time: on the 2-core AVX2 EPYC of issue 47, the fp32 target as loaded
(T(2) = 2 T(1)), the default ran a story's opening at 0.79x - 0.89x plain `generate` in sampling, its
back-off probing again and again. A `CallLedger` keeps, for one row of a call, what its rounds took
by the clock against what plain decoding would have taken for the tokens they emitted; while the
rounds are more than `ALLOWANCE_STEPS` plain steps plus `ALLOWANCE_SHARE` of the plain time of the
tokens so far behind, the level under the target proposes nothing, and it proposes again once the
plain rounds since have earned the allowance back. So a call's loss to drafting is bounded by about
that allowance and one round's loss, whatever the estimates said; a call whose drafts are accepted
is ahead and never limited.

A plain step is what this call's rounds without proposals took in their verification (decayed: the
machine's speed now); until there is one, the parent's estimated T(1), or without a cost curve the
cheapest verification the call has seen (a verification costs at least a plain step). The call's first round is left
out: it holds the prompt's prefill in both the parent and the drafter, a cost plain decoding shares
in part and that is spent whatever follows. Lossless: it decides from past timings only whether the
next round proposes.
"""

from __future__ import annotations

from .rates import decayed

# how far behind plain decoding a row's rounds may be before its level stops proposing: this many
# plain steps, plus this share of the plain time of the tokens emitted so far
ALLOWANCE_STEPS = 2.0
ALLOWANCE_SHARE = 0.03


class CallLedger:
    """One row's rounds against plain decoding, by the clock (see the module docstring).

    Attributes:
        seconds: what the rounds after the first took (proposals and verifications).
        emitted: the tokens they emitted.
        rounds: rounds observed, the first included.
    """

    def __init__(self):
        self.seconds = 0.0
        self.emitted = 0
        self.rounds = 0
        self._plain_seconds = self._plain_rounds = 0.0  # decayed: verifications without proposals
        self._estimate: float | None = None  # the parent's estimated T(1), until plain rounds are timed
        self._cheapest: float | None = None  # the cheapest verification after the first, without an estimate

    def observe(self, drafted: int, emitted: int, seconds: float, verify_seconds: float,
                plain_estimate: float | None = None) -> None:
        """A round proposed ``drafted`` tokens and emitted ``emitted`` in ``seconds`` (proposal and
        verification), of which the verification took ``verify_seconds``; ``plain_estimate``: what
        the parent's verification of one token costs by its cost curve (None: it has none)."""
        self.rounds += 1
        self._estimate = plain_estimate
        if self.rounds == 1:  # the prompt's prefill
            return
        self._cheapest = verify_seconds if self._cheapest is None else min(self._cheapest, verify_seconds)
        if drafted == 0:
            self._plain_seconds = decayed(self._plain_seconds, verify_seconds)
            self._plain_rounds = decayed(self._plain_rounds, 1.0)
        self.seconds += seconds
        self.emitted += emitted

    def plain_step(self) -> float | None:
        """Seconds of one plain step now (None before anything priced one)."""
        if self._plain_rounds:
            return self._plain_seconds / self._plain_rounds
        return self._estimate if self._estimate is not None else self._cheapest

    def behind(self) -> float:
        """Seconds the rounds after the first took beyond plain decoding of their tokens (negative: ahead)."""
        step = self.plain_step()
        return 0.0 if step is None else self.seconds - self.emitted * step

    def allows(self) -> bool:
        """Whether the next round may propose: the rounds are within the allowance (see the module
        docstring)."""
        step = self.plain_step()
        return step is None or self.behind() <= (ALLOWANCE_STEPS + ALLOWANCE_SHARE * self.emitted) * step
