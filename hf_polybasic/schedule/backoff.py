"""Back-off: when proposing does not pay, a level proposes nothing for a stretch of rounds.

The level above then decodes exactly as plain decoding does. After the stretch the level probes
(`PROBE_ROUNDS` rounds with proposals, whatever the estimates say, so that they learn from fresh
evidence); a pause that follows a probe is twice as long as the one before (up to
`MAX_BACKOFF_ROUNDS`), and a probe after which proposing pays again resets the stretch to
`FIRST_BACKOFF_ROUNDS`.
"""

from __future__ import annotations

# rounds without proposals before the first probe, the most ever, and the probe's length
# (8 and 1, not 4 and 2: on a 64-token answer where no draft pays, bf16 target on emulated AVX2,
# 4 and 2 measured 0.90x plain generate, 8 and 1 0.99x; docs/benchmarks.md)
FIRST_BACKOFF_ROUNDS = 8
MAX_BACKOFF_ROUNDS = 64
PROBE_ROUNDS = 1


class BackOff:
    """The pause / probe state of one level.

    Attributes:
        paused_for: rounds still to sit out (0: proposing).
        stretch: the length of the next pause.
        probing: rounds of the current probe still to go (proposals are made whatever the estimates).
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

    def pause(self, rounds: int | None = None) -> None:
        """Sit out ``rounds`` (default: the current stretch, which then doubles)."""
        if rounds is None:
            rounds = self.stretch
            self.stretch = min(2 * self.stretch, MAX_BACKOFF_ROUNDS)
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

    def probed(self) -> None:
        """A round of the probe is done."""
        self.probing = max(self.probing - 1, 0)

    def reset(self) -> None:
        """Proposing pays again: the next pause is the first one."""
        self.stretch = FIRST_BACKOFF_ROUNDS
