"""Back-off: when proposing does not pay, a level proposes nothing for a stretch of rounds.

The level above then decodes exactly as plain decoding does. After the stretch the level probes
(`PROBE_ROUNDS` rounds with proposals, judged on their own); a probe that fails doubles the next
stretch (up to `MAX_BACKOFF_ROUNDS`), one that pays clearly (`RESET_MARGIN` over plain decoding)
resets it to `FIRST_BACKOFF_ROUNDS`.
"""

from __future__ import annotations

# rounds without proposals before the first probe, the most ever, and the probe's length
# (8 and 1, not 4 and 2: on a 64-token answer where no draft pays, bf16 target on emulated AVX2,
# 4 and 2 measured 0.90x plain generate, 8 and 1 0.99x; docs/benchmarks.md)
FIRST_BACKOFF_ROUNDS = 8
MAX_BACKOFF_ROUNDS = 64
PROBE_ROUNDS = 1
# a probe that pays this much better than plain decoding resets the back-off stretch (a probe that
# merely ties does not: one round is noisy, and a lucky one would undo the doubling)
RESET_MARGIN = 1.1
# rounds must yield this much less than plain decoding before the level backs off: a machine whose
# speed swings by tens of percent between prompts must not make a tie look like a loss
BACKOFF_MARGIN = 0.95


class BackOff:
    """The pause / probe state of one level.

    Attributes:
        paused_for: rounds still to sit out (0: proposing).
        stretch: the length of the next pause.
        probing: rounds of the current probe still to go.
        paused_rounds: rounds sat out in all (reported in the statistics).
    """

    def __init__(self):
        self.paused_for = 0
        self.stretch = FIRST_BACKOFF_ROUNDS
        self.probing = 0
        self.paused_rounds = 0

    @property
    def paused(self) -> bool:
        return self.paused_for > 0

    def pause(self, rounds: int) -> None:
        self.paused_for = rounds
        self.probing = 0

    def sit_out(self) -> bool:
        """Count one round sat out; True when the pause is over and a probe starts."""
        self.paused_for -= 1
        self.paused_rounds += 1
        if self.paused_for == 0:
            self.probing = PROBE_ROUNDS
            return True
        return False

    def judge(self, rate: float, plain_rate: float) -> bool:
        """After a round with proposals: back off (True) if ``rate`` falls short of plain decoding,
        doubling the next stretch; reset the stretch if it pays clearly. Mid-probe: wait."""
        if self.probing:
            self.probing -= 1
            if self.probing:
                return False
        if rate < BACKOFF_MARGIN * plain_rate:
            self.pause(self.stretch)
            self.stretch = min(2 * self.stretch, MAX_BACKOFF_ROUNDS)
            return True
        if rate >= RESET_MARGIN * plain_rate:
            self.stretch = FIRST_BACKOFF_ROUNDS
        return False
