"""The bottom of a chain: a model that drafts token by token, or a `Drafter` behind an adapter.

Both implement `hf_polybasic.decoding.protocol.Level`. What they report with each token is the distribution
it was drawn from (the *processed* one: reporting raw logits would make the chain lossy under
top-k/top-p/temperature) or nothing for point masses (greedy drafts, n-gram lookups).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..drafters import Drafter
from .processing import DecodingRules, process_positions
from .protocol import Block, Proposal, Runner
from ..schedule import Schedule
from ..stats import LevelStats
from ..timing import DEFAULT_CLOCK, Clock, timed
from ..runners.transfer import reads_wait

PROBABILITY_SUM_TOLERANCE = 1e-3
# Where reads wait for the device, a schedule that stops by confidence drafts this many tokens in
# its first round before its one read, then `next_width`: as many as it last kept, doubled when it
# kept them all (up to its length), halved at most per round.
FIRST_WIDTH = 4


def next_width(width: int, cut: int | None) -> int:
    """How far to draft next round after drafting ``width`` tokens and cutting after ``cut`` of them
    (None: the schedule kept all ``width``): twice as far when nothing was cut, else the power of two
    above the cut, never below half of ``width``."""
    if cut is None:
        return 2 * width
    return max(1 << cut.bit_length(), width // 2, 1)


@dataclass
class Draw:
    """One token a model drafted for a row, still on the device: the token ``[1]``, the distribution
    reported for it (``[1, V]`` when sampling, else None), its probability when asked, and whether
    the processed scores it came from had any finite value."""

    token: torch.LongTensor
    probs: torch.Tensor | None
    confidence: torch.Tensor | None
    valid: torch.Tensor


class ScheduledRows:
    """The bookkeeping every level below the target shares, per row: where its last proposal started
    and how long it was; what the proposal cost and what the level above kept go to the row's
    schedule (when the level has schedules), and the level rolls back to what was kept. A subclass
    sets ``schedules`` (``{row: Schedule}`` or None) and ``stats`` and implements ``rollback_to``."""

    schedules: dict[int, Schedule] | None
    stats: LevelStats

    def __init__(self):
        self._starts: dict[int, int] = {}
        self._proposed: dict[int, int] = {}

    def _observe(self, blocks: dict[int, Block], seconds: float) -> None:
        """Each row's proposal is recorded and its schedule learns what it cost: the rows' shared
        ``seconds`` split by tokens."""
        total = sum(block.size for block in blocks.values())
        for row, block in blocks.items():
            self._proposed[row] = block.size
            self.stats.proposed += block.size
            if self.schedules is not None:
                self.schedules[row].observe_proposal(block.size, seconds * block.size / total if total else 0.0)

    def verified(self, kept: dict[int, int], seconds: float) -> None:
        if self.schedules is not None:
            for row, count in kept.items():
                self.schedules[row].observe_verification(self._proposed[row], count, seconds)
        self.rollback_to({row: self._starts[row] + count for row, count in kept.items()})

    def rollback_to(self, lengths: dict[int, int]) -> None:
        raise NotImplementedError


class ModelDrafter(ScheduledRows):
    """Drafts up to K tokens with a model, sampling from (or taking the argmax of) its processed
    distribution; each row's schedule sets its K and may stop its draft early, by its confidence in
    each token. Rows still drafting share one forward per step. On the CPU the drafts are read back
    after every step and stop there; where a read waits for the device (a GPU) they are read once per
    proposal, and a block cut by confidence is cut after that read (the tokens past the cut cost a
    drafter step each, not a wait for the device's whole queue).

    ``samples=False`` drafts by argmax even when the target samples (below a level that verifies
    greedily); the proposal is then a point mass. ``rules`` and ``schedules`` are per row.
    """

    def __init__(
        self,
        runner: Runner,
        rules: dict[int, DecodingRules],
        stats: LevelStats,
        schedules: dict[int, Schedule],
        samples: bool,
        clock: Clock = DEFAULT_CLOCK,
    ):
        super().__init__()
        self.runner, self.rules, self.stats, self.schedules = runner, rules, stats, schedules
        self.samples = samples
        self.clock = clock
        self._widths: dict[int, int] = {}  # per row, how far to draft before the one read (`next_width`)

    def propose(self, requests: dict[int, tuple[torch.LongTensor, int]]) -> dict[int, Proposal]:
        blocks, drafting, widths = {}, [], {}
        by_confidence = [row for row in requests if self.schedules[row].stops_per_token]
        # where a schedule stops by confidence: on the CPU, read every step and stop there; where a
        # read waits for the device (`reads_wait`), draft a width and cut the block after one read
        stepwise = bool(by_confidence) and not reads_wait(self.runner.device)
        for row, (sequence, budget) in requests.items():
            blocks[row] = Block(self.rules[row].eos_token_ids, min(self.schedules[row].length(), budget), sequence.device)
            self._starts[row] = sequence.shape[0]
            widths[row] = blocks[row].budget
            if row in by_confidence and not stepwise:
                widths[row] = min(widths[row], self._widths.get(row, FIRST_WIDTH))
            if not blocks[row].closed:
                drafting.append(row)
        drawn: dict[int, list[Draw]] = {row: [] for row in drafting}
        catch_up = 0.0  # seconds spent feeding tokens decided while this level sat out or was rolled back
        with self.stats.timed(self.clock) as span:
            while drafting:
                grown = {row: torch.cat([requests[row][0], blocks[row].tokens, *(d.token for d in drawn[row])])
                         for row in drafting}
                behind = max(grown[row].shape[0] - self.runner.lengths[row] for row in drafting)
                with timed(self.clock) as forward:
                    logits = self.runner.logits_rows({row: (grown[row], 1) for row in drafting})
                if behind > 1:
                    catch_up += forward.seconds * (behind - 1) / behind
                for row in drafting:
                    drawn[row].append(self._draw(row, grown[row], logits[row], row in by_confidence))
                if stepwise:
                    drafting = self._keep_step(blocks, drawn, drafting)
                else:
                    drafting = [row for row in drafting if blocks[row].size + len(drawn[row]) < widths[row]]
            if not stepwise:
                self._keep_all(blocks, drawn, widths)
        self._observe(blocks, span.seconds - catch_up)
        return {row: block.proposal() for row, block in blocks.items()}

    def _draw(self, row: int, grown: torch.LongTensor, logits: torch.Tensor, confidence: bool) -> Draw:
        """The row's next token, drawn on the device: its processed distribution's argmax, or a sample
        of it; with ``confidence``, its probability. A position where the processors leave no
        finite score (a constraint outside what this model proposes) draws nothing valid."""
        logits = logits.to(grown.device)  # [1, V]
        scores = process_positions(self.rules[row].processors, grown, grown.shape[0], logits)
        valid = torch.isfinite(scores).any()
        probs = None
        if self.samples or confidence:
            probs = scores.softmax(-1)
            probs = torch.where(valid, probs, torch.ones_like(probs) / probs.shape[-1])  # never NaN to draw from
        token = torch.multinomial(probs, 1)[0] if self.samples else scores.argmax(-1)  # [1]
        reported = self.proposal_probs(probs, logits) if self.samples else None
        return Draw(token, reported, probs[0, token] if confidence else None, valid)

    def _keep_step(self, blocks: dict[int, Block], drawn: dict[int, list[Draw]], rows: list[int]) -> list[int]:
        """Read the latest draw of every row back (one read for all: token, validity, confidence), add
        it to the row's block; the rows that draft another."""
        latest = [drawn[row].pop() for row in rows]
        values = torch.stack([torch.stack([d.token[0].double(), d.valid.double(), d.confidence.reshape(()).double()])
                              for d in latest]).tolist()
        going = []
        for row, draw, (token, valid, confidence) in zip(rows, latest, values):
            if not valid:
                continue
            block = blocks[row]
            block.extend(draw.token, draw.probs, ids=[int(token)])
            # the token just drawn is kept whatever it is; only whether to draw another depends on it
            if not block.closed and self.schedules[row].keep_drafting(confidence):
                going.append(row)
        return going

    def _keep_all(self, blocks: dict[int, Block], drawn: dict[int, list[Draw]], widths: dict[int, int]) -> None:
        """Read every row's draws back at once (token, validity and, where its schedule stops by
        confidence, the token's probability) and add them to the blocks, each up to its first invalid
        draw (`Block.extend` cuts after an EOS); a schedule that stops by confidence then cuts the block
        after the first token it would not have drafted past, as if it had been asked token by token,
        and the row's next width follows where it cut (`next_width`)."""
        rows = [row for row in drawn if drawn[row]]
        if not rows:
            return
        packed = []
        for row in rows:
            packed += [torch.cat([d.token for d in drawn[row]]).double(), torch.stack([d.valid for d in drawn[row]]).double()]
            if drawn[row][0].confidence is not None:
                packed.append(torch.stack([d.confidence.reshape(()) for d in drawn[row]]).double())
        values = torch.cat(packed).tolist()
        start = 0
        for row in rows:
            count = len(drawn[row])
            tokens = [int(token) for token in values[start : start + count]]
            valid = values[start + count : start + 2 * count]
            start += 2 * count
            confidences = None
            if drawn[row][0].confidence is not None:
                confidences = values[start : start + count]
                start += count
            usable = valid.index(0) if 0 in valid else count
            if not usable:
                continue
            block = blocks[row]
            block.extend(torch.cat([d.token for d in drawn[row][:usable]]),
                         torch.cat([d.probs for d in drawn[row][:usable]]) if self.samples else None, ids=tokens[:usable])
            if confidences is not None:
                self._cut_by_confidence(row, block, confidences, widths[row])

    def _cut_by_confidence(self, row: int, block: Block, confidences: list[float], width: int) -> None:
        """Ask the row's schedule about each kept token in turn, as `_keep_step` would have after
        drafting it; end the block after the first it would not have drafted past."""
        schedule = self.schedules[row]
        for index in range(block.size):
            if block.closed and index == block.size - 1:
                break  # drafting would have ended here anyway: the schedule is not asked
            if not schedule.keep_drafting(confidences[index]):
                block.truncate(index + 1)
                self._widths[row] = next_width(width, index + 1)
                return
        self._widths[row] = next_width(width, None)

    def proposal_probs(self, probs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """What is reported upward for a sampled token: the processed distribution it was drawn from."""
        return probs

    def rollback_to(self, lengths: dict[int, int]) -> None:
        self.runner.rollback_rows(lengths)

    def commit(self) -> None:
        self.runner.commit()

    def release_rows(self, rows) -> None:
        self.runner.release_rows(rows)


class DrafterLevel(ScheduledRows):
    """Adapts a `Drafter` (the public, model-free interface) to the level protocol, checking what it
    returns; it is asked for each row in turn. A row's ``schedule`` (cost-aware) caps how many tokens
    it may propose, or sits it out (0: the level above decodes alone) when its drafts do not pay;
    without one, the drafter's own length holds."""

    def __init__(self, drafter: Drafter, rules: dict[int, DecodingRules], stats: LevelStats,
                 clock: Clock = DEFAULT_CLOCK, schedules: dict[int, Schedule] | None = None):
        super().__init__()
        self.drafter, self.rules, self.stats, self.clock = drafter, rules, stats, clock
        self.schedules = schedules

    def propose(self, requests: dict[int, tuple[torch.LongTensor, int]]) -> dict[int, Proposal]:
        proposals = {}
        for row, (sequence, budget) in requests.items():
            self._starts[row] = sequence.shape[0]
            schedule = None if self.schedules is None else self.schedules[row]
            if schedule is not None:
                budget = min(budget, schedule.length())
            with self.stats.timed(self.clock) as span:
                tokens, log_probs = self.drafter.propose(sequence.unsqueeze(0), budget)
                check_drafter_output(type(self.drafter).__name__, tokens, log_probs, budget)
                block = Block(self.rules[row].eos_token_ids, budget, sequence.device)
                block.extend(tokens.to(sequence.device), None if log_probs is None else log_probs.exp())
            self._observe({row: block}, span.seconds)  # timed alone: the row's own seconds
            proposals[row] = block.proposal()
        return proposals

    def rollback_to(self, lengths: dict[int, int]) -> None:
        for length in lengths.values():  # a batchable Drafter keeps no state; one of one row does
            self.drafter.rollback_to(length)

    def commit(self) -> None:
        self.drafter.commit()

    def release_rows(self, rows) -> None:
        """A `Drafter` serving several rows keeps no state: nothing to release."""


def check_drafter_output(name: str, tokens, log_probs, limit: int) -> None:
    """Raise unless ``Drafter.propose`` returned at most ``limit`` token ids ``[k]`` and either None
    or log-probabilities ``[k, V]`` that can be the distributions the tokens were drawn from:
    finite or -inf, each row summing to 1, and every proposed token with probability > 0 (a token
    reported with probability 0 cannot have been drawn, and losslessness rests on that)."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype != torch.long:
        raise TypeError(f"{name}.propose must return a 1-D LongTensor of token ids, got {tokens!r}")
    if tokens.shape[0] > limit:
        raise ValueError(f"{name}.propose returned {tokens.shape[0]} tokens but max_new_tokens was {limit}")
    if log_probs is None:
        return
    if log_probs.dim() != 2 or log_probs.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"{name}.propose must return log_probs of shape [k, V] for k = {tokens.shape[0]} tokens "
            f"(or None for deterministic drafts), got shape {tuple(log_probs.shape)}"
        )
    if tokens.numel() == 0:
        return
    values = log_probs.detach().double()
    if bool(torch.isnan(values).any()) or bool((values == float("inf")).any()):
        raise ValueError(f"{name}.propose returned log_probs with NaN or +inf; they must be log-probabilities")
    sums = values.exp().sum(-1)
    off = (sums - 1).abs() > PROBABILITY_SUM_TOLERANCE
    if bool(off.any()):
        row = int(off.nonzero()[0])
        raise ValueError(
            f"{name}.propose returned log_probs whose probabilities do not sum to 1 (row {row} sums to "
            f"{float(sums[row]):.4g}); return the log-probabilities of the distribution each token was drawn from"
        )
    width = values.shape[1]
    ids = tokens.to(values.device)
    picked = values.gather(1, ids.clamp(max=width - 1).unsqueeze(1)).squeeze(1)
    impossible = (ids >= width) | (picked == float("-inf"))
    if bool(impossible.any()):
        position = int(impossible.nonzero()[0])
        raise ValueError(
            f"{name}.propose reported probability 0 for the token it proposed at position {position} "
            f"(id {int(tokens[position])}); a proposal must be the distribution the token was drawn from"
        )
