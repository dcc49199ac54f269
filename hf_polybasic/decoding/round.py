"""One round of the whole chain, top to bottom: the levels that propose and verify.

A chain M1 > M2 > ... > Mn (assembled by `hf_polybasic.decoding.build`) is a stack of levels; the
decode loop (`hf_polybasic.decoding.loop`) asks the target for one round at a time, for every live
row at once (``{row: (sequence, budget)}``). A round, as this file runs it:

1. **Propose** (`Verifier.verify` asks its ``child``). The level below returns each row's proposal:
   tokens and the distribution each was drawn from (`Proposal`).
   a. An `IntermediateLevel` verifies rounds of the level below it (this same recursion, one level
      down) until each row's block holds mu tokens, an EOS or the budget, and hands the block up.
      Where reads wait for the device (a GPU) its rounds are decided there, a batch of them per read
      (`hf_polybasic.decoding.device_blocks`), and added to the blocks as this loop adds them.
      When its shape gate says so it sits the round out: the drafter proposes straight up under the
      schedules the gate's shape prices (``propose(requests, schedules=...)``, *bypassed*), or the
      middle model drafts alone (*dropped*).
   b. A `ModelDrafter` drafts up to K tokens per row, one forward per step for the rows still
      drafting; its schedule sets K and may stop a row by confidence.
   c. A `DrafterLevel` asks a model-free `Drafter` (prompt lookup, your own), row by row.
2. **Score**: one forward of the verifier's runner scores every row's proposal plus one position
   (`Runner.logits_rows`), and the row's logits processors give the processed scores. Greedy, one
   row, a model drafter right below: where the target's measured costs say the wider forward pays,
   the same forward also scores the drafter's next-best tokens beside each draft, one-token branches
   (`hf_polybasic.decoding.alternatives`).
3. **Decide**: `hf_polybasic.decoding.acceptance` decides each row's ``[accepted, next token]`` on the
   device (greedy match, or speculative sampling against the reported distributions).
4. **Read**: one read from the device for all rows (accepted counts, next tokens, confidences).
   Where a read waits for the device (a GPU) a model drafter reads nothing itself: it hands up
   every token it drafted with a `Deferred`, the verifier verifies them all and reads them back
   with its decision, and the drafter then settles where its proposal ends (an invalid draw, an EOS,
   its schedule's stop). The round keeps min(accepted, settled) drafts and the token emitted at
   that position: the next draft when the verifier accepted past the cut (the acceptance test there
   emitted it as a sample of the verifier's distribution). Exact because the cut is a stopping time:
   where it falls depends only on the drafts before it, never on the verification.
5. **Roll back**: the verifier's cache forgets the rejected drafts (`Runner.rollback_rows`); the level
   below is told what was kept (``child.verified(kept, seconds)``): it rolls back too and its schedules
   learn. Rollbacks only go down; proposals only go up.
6. **Hand up** each row's `Round`: the accepted drafts, then the verifier's own token (and where that
   token was one of the branches scored beside the draft it rejected, the verifier's token after it).

Why the chain is lossless: by `hf_polybasic.decoding.acceptance`, the tokens a verifier emits are an
autoregressive sample of its own processed distribution p_i (greedy: its argmax continuation),
whatever the level below proposed. So the block M_i hands up really is drawn from the q = p_i it
reports, which is exactly what the level above needs for its own verification to be exact. By
induction up the chain, the target emits a sample of its processed distribution (greedy: its own
greedy output), for any number of levels, any K and any mu. A drafter must therefore report the
*processed* distribution each token was drawn from (raw logits would make the chain lossy under
top-k, top-p or temperature), or nothing for point masses (greedy drafts, n-gram lookups).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ..drafters import Drafter
from ..models.vocab_head import NOTHING_TO_SAMPLE
from ..processing import DecodingRules, process_positions
from ..runners.transfer import reads_wait, upload
from ..schedule import Schedule, ShapeGate
from ..schedule.calibration import BIN_EDGES
from ..schedule.shape_gate import BYPASSED, DROPPED
from ..stats import LevelStats
from ..timing import DEFAULT_CLOCK, Clock, DeviceSpan, timed
from .acceptance import emitted_tokens, greedy_decision, speculative_decision
from .alternatives import AlternativesPolicy, hit, next_best, per_token, tokens_per_round
from .device_blocks import DeviceBlocks
from .protocol import Block, Deferred, Level, Proposal, Runner
from .reads import HostRead


@dataclass
class Round:
    """One verification: the tokens emitted and the verifier's rows for them.

    tokens: [m] emitted ids (accepted drafts, then the verifier's own token), on the device; ids:
    the same as host ints; scores: [m, V] processed scores they were chosen from; logits: [m, V]
    raw logits; confidences: the verifier's processed probability of each token, when its level
    asked for them (`Verifier.confidences`).
    """

    tokens: torch.LongTensor
    scores: torch.Tensor
    logits: torch.Tensor
    ids: list[int] = field(default_factory=list)
    confidences: list[float] | None = None


@dataclass
class Read:
    """A verifier's decision for one row, read back: it keeps the first ``kept`` drafts of the
    row's (settled) proposal and then emits ``token`` (``on_device``: the same, ``[1]``); with
    confidences, its processed probability of each of those ``kept + 1`` tokens."""

    kept: int
    token: int
    on_device: torch.LongTensor
    confidences: list[float] | None


class Proposer:
    """What every level below the target shares, per row: where its last proposal started and how long
    it was; what the proposal cost and what the level above kept go to the schedules it was made under
    (the level's own ``schedules``, or those the level above passed for the round), and the level rolls
    back to what was kept. A subclass sets ``schedules`` (``{row: Schedule}`` or None) and ``stats``
    and implements ``propose`` and ``rollback_rows``."""

    schedules: dict[int, Schedule] | None
    stats: LevelStats

    def __init__(self):
        self._starts: dict[int, int] = {}
        self._proposed: dict[int, int] = {}
        self._active: dict[int, Schedule] | None = None  # the schedules of the last proposal

    def _begin(self, requests: dict[int, tuple[torch.LongTensor, int]],
               schedules: dict[int, Schedule] | None) -> dict[int, Schedule] | None:
        """Start a proposal under ``schedules`` (None: the level's own); returns them."""
        self._active = self.schedules if schedules is None else schedules
        for row, (sequence, _) in requests.items():
            self._starts[row] = sequence.shape[0]
        return self._active

    def proposed(self, row: int) -> int:
        """How many tokens the last proposal held for ``row``."""
        return self._proposed[row]

    def _observe(self, blocks: dict[int, Block], seconds: float) -> None:
        """Each row's proposal is recorded and its schedule learns what it cost: the rows' shared
        ``seconds`` split by tokens."""
        self._record({row: block.size for row, block in blocks.items()}, seconds)

    def _record(self, sizes: dict[int, int], seconds: float) -> None:
        total = sum(sizes.values())
        for row, size in sizes.items():
            self._proposed[row] = size
            self.stats.proposed += size
            if self._active is not None:
                self._active[row].observe_proposal(size, seconds * size / total if total else 0.0)

    def _learn(self, kept: dict[int, int], seconds: float) -> None:
        if self._active is not None:
            for row, count in kept.items():
                self._active[row].observe_verification(self._proposed[row], count, seconds)

    def verified(self, kept: dict[int, int], seconds: float, more: int = 0) -> None:
        """The level above kept the first ``kept[row]`` tokens of each row's last proposal (its share of
        the verification took ``seconds``; ``more``: the tokens it emitted beyond them and its own token
        per row, alternatives that hit): the schedules it was made under learn, and the level rolls
        back to them."""
        self._learn(kept, seconds)
        self.rollback_rows({row: self._starts[row] + count for row, count in kept.items()})

    def observe_round(self, proposed: dict[int, int], seconds: float, kept: dict[int, int],
                      verify_seconds: float) -> None:
        """A round proposed ``proposed[row]`` tokens (in ``seconds``) and the level above kept
        ``kept[row]`` (its share took ``verify_seconds``), made without `propose` and `verified` (an
        intermediate level's rounds decided on the device, `hf_polybasic.decoding.device_blocks`):
        recorded and learned as they would have been, under the level's own schedules; nothing rolls
        back (the runners hold what the device decided)."""
        self._active = self.schedules
        self._record(proposed, seconds)
        self._learn(kept, verify_seconds)

    def propose(self, requests: dict[int, tuple[torch.LongTensor, int]],
                schedules: dict[int, Schedule] | None = None) -> dict[int, Proposal]:
        raise NotImplementedError

    def rollback_rows(self, lengths: dict[int, int]) -> None:
        raise NotImplementedError


class Verifier:
    """A model that verifies the proposals of the level below it, for every row asked, in one forward.

    ``samples=False`` verifies by argmax even when the target samples (an intermediate level with
    ``verification="greedy"``). ``rules`` are per row. ``confidences``: each round also reports the
    verifier's probability of every token it emits (an intermediate level whose schedule stops
    blocks by confidence sets it).

    A round reads back from the device once for all its rows (every row's number of accepted drafts,
    next token and, with ``confidences``, the probabilities): never per token or per row, and it
    uploads nothing (the next token stays on the device).
    """

    def __init__(
        self,
        runner: Runner,
        child: Level,
        rules: dict[int, DecodingRules],
        stats: LevelStats,
        samples: bool,
        clock: Clock = DEFAULT_CLOCK,
    ):
        self.runner, self.child, self.rules, self.stats = runner, child, rules, stats
        self.samples = samples
        self.clock = clock
        self.confidences = False
        self.alternatives: AlternativesPolicy | None = None  # set where it scores a drafter's alternatives

    def verify(self, requests: dict[int, tuple[torch.LongTensor, int]]) -> dict[int, Round]:
        """``{row: (sequence, budget)}``: ask the child for each row's proposal, score them all in one
        forward pass, keep what is accepted. Emits between 1 and ``budget`` tokens per row (the child
        proposes at most one fewer)."""
        # 1. propose: the level below, for every row at once (recursively, down to the drafter)
        proposals = self.child.propose({row: (sequence, budget - 1) for row, (sequence, budget) in requests.items()})
        with self.stats.timed(self.clock) as span:
            # 2. score: one forward over every row's proposal and one position more
            candidates = {row: torch.cat([requests[row][0], proposals[row].tokens]) for row in requests}
            logits, branches = self._score(requests, proposals, candidates)
            scores = {
                row: process_positions(self.rules[row].processors, candidates[row], sequence.shape[0],
                                       logits[row].to(sequence.device))  # [k + 1, V]
                for row, (sequence, _) in requests.items()
            }
            # 3. decide, on the device: [accepted, next token] per row
            try:
                decided = {row: self.decide(proposals[row], scores[row]) for row in requests}  # [2] each
            except RuntimeError as error:  # vocab_head: a restricted level may be left nothing to sample from
                if self.samples and not all(bool(torch.isfinite(s).any(-1).all()) for s in scores.values()):
                    raise ValueError(NOTHING_TO_SAMPLE.format(level=self.runner.role)) from error
                raise
            # 4. read: the round's one read from the device, every row at once (with the drafts the
            #    level below left there, `Deferred`: it settles where each row's proposal ends)
            deferred = next((p.deferred for p in proposals.values() if p.deferred is not None), None)
            settled, values = self._read(proposals, decided, scores, deferred)
            rounds, kept = {}, {}
            for row in requests:
                rounds[row] = self._round(settled[row], values[row], scores[row], logits[row])
                if row in branches:  # one more token where the target's own was an alternative it scored
                    rounds[row] = self._past_alternative(row, requests[row][0], settled[row], rounds[row],
                                                         values[row], *branches[row])
                kept[row] = values[row].kept
            # 5. roll back: this level forgets the rejected drafts, then the level below does (`verified`)
            self.runner.rollback_rows({row: requests[row][0].shape[0] + count for row, count in kept.items()})
        # the drafting the read waited for was the level below's work, not this level's
        seconds = span.seconds - (0.0 if deferred is None else deferred.late_seconds())
        self.stats.seconds -= span.seconds - seconds
        # each row's share of the forward the rows shared, split evenly as `BatchShare` prices it (the
        # whole forward's seconds would make every row's overhead look like the other rows' work)
        more = sum(len(rounds[row].ids) - kept[row] - 1 for row in kept)  # alternatives that hit
        self.child.verified(kept, seconds / len(kept), more)
        return rounds  # 6. hand up: each row's accepted drafts, then this level's own token

    def _score(self, requests: dict[int, tuple[torch.LongTensor, int]], proposals: dict[int, Proposal],
               candidates: dict[int, torch.LongTensor]) -> tuple[dict[int, torch.Tensor], dict[int, tuple]]:
        """The round's one forward: each row's logits ``[k + 1, V]`` at its drafts and one position more;
        where the round offers the drafter's alternatives (`_per_draft`), their logits too, ``{row:
        (m, [k, m, V])}``."""
        per_draft = self._per_draft(requests, proposals)
        if not per_draft:
            return self.runner.logits_rows({row: (candidates[row], len(proposals[row]) + 1) for row in requests}), {}
        ((row, proposal),) = proposals.items()
        offered = torch.tensor([ids[:per_draft] for ids in proposal.alternatives])  # [k, m]
        logits, branches = self.runner.logits_with_alternatives(candidates[row], len(proposal), offered)
        return {row: logits}, {row: (per_draft, branches)}

    def _per_draft(self, requests: dict[int, tuple[torch.LongTensor, int]], proposals: dict[int, Proposal]) -> int:
        """How many alternatives per draft this round scores (`AlternativesPolicy`): a one-row round whose
        drafter offered them, where its policy says so."""
        if self.alternatives is None:
            return 0
        ((row, proposal),) = proposals.items()  # one row (`hf_polybasic.decoding.build.alternatives_problem`)
        if proposal.alternatives is None:
            return 0
        width = requests[row][0].shape[0] + len(proposal) - self.runner.lengths[row]
        stats = self.stats
        emitted = stats.accepted + stats.verifications + stats.alternative_hits
        return self.alternatives.per_draft(len(proposal), width, tokens_per_round(emitted, stats.verifications))

    def _past_alternative(self, row: int, sequence: torch.LongTensor, proposal: Proposal, round_: Round, read: Read,
                          per_draft: int, branches: torch.Tensor) -> Round:
        """The row's round, and where the target's own token is one of the alternatives scored beside the
        draft it rejected (not an EOS), the target's argmax after it too: its logits ``branches`` ``[k, m,
        V]`` came from the same forward (`hf_polybasic.decoding.alternatives`)."""
        index = hit(read.kept, read.token, [offered[:per_draft] for offered in proposal.alternatives])
        if read.token in self.rules[row].eos_token_ids:
            index = None
        self.alternatives.observe(index is not None)
        self.stats.alternative_rounds += 1
        if index is None:
            return round_
        self.stats.alternative_hits += 1
        self.stats.acceptance_lengths[-1] += 1  # the round emitted one token more
        text = torch.cat([sequence, round_.tokens])
        logits = branches[read.kept, index : index + 1].to(text.device)  # [1, V]
        scores = process_positions(self.rules[row].processors, text, text.shape[0], logits)
        after = scores.argmax(-1)  # [1]
        return Round(tokens=torch.cat([round_.tokens, after]), scores=torch.cat([round_.scores, scores]),
                     logits=torch.cat([round_.logits, logits]), ids=round_.ids + [int(after)])

    def decide(self, proposal: Proposal, scores: torch.Tensor) -> torch.Tensor:
        """The one place a row's drafts are accepted (`hf_polybasic.decoding.acceptance`): ``[accepted, next token]``
        on the device."""
        if self.samples:
            return speculative_decision(proposal.tokens, proposal.probs, scores.softmax(-1))
        return greedy_decision(proposal.tokens, scores)

    def _read(self, proposals: dict[int, Proposal], decided: dict[int, torch.Tensor], scores: dict[int, torch.Tensor],
              deferred: Deferred | None) -> tuple[dict[int, Proposal], dict[int, Read]]:
        """Every row's decision in one read from the device (`HostRead`): the settled proposals
        (``proposals`` themselves unless the level below ``deferred`` its read: its pieces join this
        read) and each row's `Read`. Where the emitted tokens or their confidences are needed, they
        are computed for all k + 1 positions before the read: position j emits the j-th draft while
        j < accepted, then the verifier's own token."""
        read, emitted = HostRead(), {}
        for row, decision in decided.items():
            read.add((row, "decision"), decision)  # [accepted, next token]
            if deferred is not None or self.confidences:
                drafts = proposals[row].tokens.to(decision.device)  # [k]
                emitted[row] = emitted_tokens(drafts, decision[0], decision[1:])  # [k + 1]
            if deferred is not None:
                read.add((row, "emitted"), emitted[row])
            if self.confidences:
                probs = scores[row].softmax(-1).gather(1, emitted[row].to(scores[row].device).unsqueeze(1)).squeeze(1)
                read.add((row, "confidences"), probs)  # [k + 1]
        if deferred is not None:
            read.extend(deferred.pieces)
        host = read.read()
        settled = proposals if deferred is None else deferred.settle(host)
        reads = {}
        for row in decided:
            accepted, next_token = (int(value) for value in host[row, "decision"])
            kept = min(accepted, len(settled[row]))
            # past the settled proposal the verifier emits the draft it accepted there (`Deferred`)
            token = next_token if kept == accepted else int(host[row, "emitted"][kept])
            on_device = emitted[row][kept : kept + 1] if row in emitted else decided[row][1:]
            confidences = host.get((row, "confidences"))
            reads[row] = Read(kept, token, on_device, None if confidences is None else confidences[: kept + 1])
        return settled, reads

    def _round(self, proposal: Proposal, read: Read, scores, logits) -> Round:
        """The row's round: its first ``read.kept`` drafts, then the token emitted after them, on the
        device (taken from the decision, not uploaded again) and as host ints."""
        kept = read.kept
        self.stats.record_verification(len(proposal), kept)
        tokens = torch.cat([proposal.tokens[:kept], read.on_device.to(proposal.tokens.device)])
        ids = (proposal.tokens[:kept].tolist() if proposal.ids is None else proposal.ids[:kept]) + [read.token]
        return Round(tokens=tokens, scores=scores[: kept + 1], logits=logits[: kept + 1], ids=ids,
                     confidences=read.confidences)

    def rollback_rows(self, lengths: dict[int, int]) -> None:
        """Forget everything about each row's tokens past its length, here and in every level below."""
        self.runner.rollback_rows(lengths)
        self.child.rollback_rows(lengths)

    def commit(self) -> None:
        """Everything so far is final (the target has verified it), here and below."""
        self.runner.commit()
        self.child.commit()

    def release_rows(self, rows) -> None:
        """These rows are done: they leave every forward, here and below."""
        self.runner.release_rows(rows)
        self.child.release_rows(rows)


class IntermediateLevel(Proposer):
    """A `Verifier` that the level above uses as its proposer: for each row it verifies rounds of the
    level below until the row's block holds at least mu tokens (its schedule's length), an EOS or the
    budget, or its schedule ends it after a token; rows still building share each round's forward.

    Each round asks its verifier for one token more than the block has room for, so the level below
    drafts up to the budget (in a chain of n models every level drafts as soon as 2 tokens remain);
    `Block.extend` cuts the surplus, which can only be the verifier's own token (the cut block is
    still an autoregressive sample of this level's distribution, and its cache never held that token).

    With a ``shape_gate`` (`hf_polybasic.schedule.ShapeGate`: the level right above a model drafter,
    under the cost-aware schedule) the level is *bypassed* in the rounds the gate says: the drafter
    proposes straight to the level above, under its ``bypass_schedules`` (priced by that level's
    costs), and this level's model neither verifies nor runs (its cache catches up when it is back).
    With a ``drop_drafter`` too (a `ModelDrafter` over this level's own runner, under schedules priced
    by the level above's costs) the gate may *drop* the drafter instead: this level's model drafts its
    block token by token, reporting the distribution each token was drawn from as any model drafter
    does, and the drafter neither drafts nor runs (its cache catches up when it is back).
    """

    def __init__(self, verifier: Verifier, schedules: dict[int, Schedule], clock: Clock = DEFAULT_CLOCK,
                 shape_gate: ShapeGate | None = None, bypass_schedules: dict[int, Schedule] | None = None,
                 drop_drafter: ModelDrafter | None = None):
        super().__init__()
        self.verifier, self.schedules, self.clock = verifier, schedules, clock
        self.stats = verifier.stats
        verifier.confidences = any(schedule.stops_per_token for schedule in schedules.values())
        self.shape_gate, self.bypass_schedules, self.drop_drafter = shape_gate, bypass_schedules, drop_drafter
        # over a model drafter, where reads wait for the device: many rounds a read (`DeviceBlocks`)
        self.device_blocks = DeviceBlocks(verifier, verifier.child) if isinstance(verifier.child, ModelDrafter) else None
        self._bypassing = self._dropping = False
        self._before: tuple[int, ...] | None = None

    def _counts(self) -> tuple[int, ...]:
        """(this level's verifications, drafted, accepted, the drafter's forwards, this level's
        forwards, answers of its schedules and the drafter's, in any shape, given on an uncalibrated
        confidence calibration) so far."""
        child = self.verifier.child
        lent = [self.schedules, child.schedules, self.bypass_schedules,
                None if self.drop_drafter is None else self.drop_drafter.schedules]
        distinct = {id(schedules): schedules for schedules in lent if schedules is not None}.values()
        stops = sum(getattr(schedule, "uncalibrated_answers", 0)
                    for schedules in distinct for schedule in schedules.values())
        return (self.stats.verifications, self.stats.drafted, self.stats.accepted, child.forward_passes,
                self.verifier.runner.forward_passes, stops)

    def _bypass(self, requests: dict[int, tuple[torch.LongTensor, int]]) -> dict[int, Proposal]:
        """The drafter proposes straight to the level above, under the schedules priced for that."""
        self._bypassing = True
        return self.verifier.child.propose(requests, schedules=self.bypass_schedules)

    def _drop(self, requests: dict[int, tuple[torch.LongTensor, int]]) -> dict[int, Proposal]:
        self._dropping = True
        return self.drop_drafter.propose(requests)

    def verified(self, kept: dict[int, int], seconds: float, more: int = 0) -> None:
        """The level above kept ``kept`` of this round's proposal (and emitted ``more`` tokens beyond
        them and its own, alternatives that hit): whoever proposed learns and rolls back (the drafter
        under the lent schedules when bypassed, this level's model as a drafter when the drafter was
        dropped, else this level), and the shape gate is told what the round took."""
        if self._bypassing:
            proposer, shape = self.verifier.child, BYPASSED
            proposer.verified(kept, seconds)
        elif self._dropping:
            proposer, shape = self.drop_drafter, DROPPED
            proposer.verified(kept, seconds)
        else:
            proposer, shape = self, None
            super().verified(kept, seconds)
        self._bypassing = self._dropping = False
        if self.shape_gate is None:
            return
        verifications, drafted, accepted, drafter_forwards, own_forwards, stops = (
            now - then for now, then in zip(self._counts(), self._before))
        # the forwards of the model that drafted, and (in) what the middle level's own rounds did
        forwards, middle = {BYPASSED: (drafter_forwards, (0, 0, 0)), DROPPED: (own_forwards, (0, 0, 0))}.get(
            shape, (drafter_forwards, (verifications, accepted + verifications, drafted)))
        # an alternative that hit counts as one more draft accepted (Theorem 3.2's rounds accept what they drafted at most)
        self.shape_gate.observe(len(kept), sum(kept.values()) + len(kept) + more,
                                sum(proposer.proposed(row) for row in kept) + more,
                                forwards, middle, stops > 0)

    def propose(self, requests: dict[int, tuple[torch.LongTensor, int]],
                schedules: dict[int, Schedule] | None = None) -> dict[int, Proposal]:
        """Each row's block of at least mu tokens (its schedule's length), built from rounds of the
        level below; or, in the rounds the shape gate says, the drafter's or this model's drafts."""
        if self.shape_gate is not None:
            self._before = self._counts()
            if self.shape_gate.bypassed:
                return self._bypass(requests)
            if self.shape_gate.dropped:
                return self._drop(requests)
        schedules = self._begin(requests, schedules)
        blocks, thresholds, building = {}, {}, []
        for row, (sequence, budget) in requests.items():
            thresholds[row] = schedules[row].length()
            blocks[row] = Block(self.verifier.rules[row].eos_token_ids, budget, sequence.device)
            if not blocks[row].closed and thresholds[row] > 0:
                building.append(row)
        with timed(self.clock) as span:  # this level and everything below: what the blocks cost
            while building:
                if (self.device_blocks is not None and reads_wait(self.verifier.runner.device)
                        and self.device_blocks.serves(self.verifier.rules)):
                    building = self._device_rounds(requests, blocks, thresholds, building)
                    continue
                rounds = self.verifier.verify({
                    row: (torch.cat([requests[row][0], blocks[row].tokens]), requests[row][1] - blocks[row].size + 1)
                    for row in building
                })
                building = [row for row in building if self._extend(row, blocks[row], rounds[row], thresholds[row])]
        self._observe(blocks, span.seconds)
        return {row: block.proposal() for row, block in blocks.items()}

    def _device_rounds(self, requests: dict[int, tuple[torch.LongTensor, int]], blocks: dict[int, Block],
                       thresholds: dict[int, int], building: list[int]) -> list[int]:
        """A batch of rounds decided on the device, read once (`DeviceBlocks`), added to the blocks
        round by round as the loop above adds them; the rows still building."""
        asked = {row: (torch.cat([requests[row][0], blocks[row].tokens]), blocks[row].budget - blocks[row].size,
                       thresholds[row] - blocks[row].size) for row in building}
        ran = False
        for rounds in self.device_blocks.run(asked):
            ran = ran or any(row in rounds for row in building)
            building = [row for row in building if row not in rounds or self._extend(
                row, blocks[row], Round(*rounds[row][:2], logits=rounds[row][1], ids=rounds[row][2],
                                        confidences=rounds[row][3]), thresholds[row])]
        if not ran:
            raise RuntimeError(f"{self.verifier.runner.role}: a batch of device rounds ran for none of rows {building}; "
                               "this is a bug in hf_polybasic")
        return building

    def _extend(self, row: int, block: Block, round_: Round, threshold: int) -> bool:
        """Add a round's tokens to the row's block; whether the row goes on building."""
        schedule = self._active[row]
        probs = round_.scores.softmax(-1) if self.verifier.samples else None
        before = block.size
        kept = block.extend(round_.tokens, probs, ids=round_.ids)
        if schedule.stops_per_token and self._stop_within(schedule, block, before, round_.confidences[:kept]):
            return False
        return not block.closed and block.size < threshold

    @staticmethod
    def _stop_within(schedule, block: Block, before: int, confidences: list[float]) -> bool:
        """Ask the schedule, token by token, whether to go on after each new token (its confidence:
        this level's probability of it); on the first no, end the block right after that token. The
        token that closes the block (its budget, an EOS) is not asked about, only told (`closed_at`): the
        block ends there anyway."""
        for index, confidence in enumerate(confidences):
            if block.closed and before + index + 1 == block.size:
                schedule.closed_at(confidence)
                break
            if not schedule.keep_drafting(confidence):
                block.truncate(before + index + 1)
                return True
        return False

    def rollback_rows(self, lengths: dict[int, int]) -> None:
        self.verifier.rollback_rows(lengths)

    def commit(self) -> None:
        self.verifier.commit()

    def release_rows(self, rows) -> None:
        self.verifier.release_rows(rows)


@dataclass
class Draw:
    """One token a model drafted for a row, still on the device: the token ``[1]``, the distribution
    reported for it (``[1, V]`` when sampling, else None), its probability when asked, and whether
    the processed scores it came from had any finite value; where a gate prices the position (a round's
    first, and sampling on the host every later one), what it prices (``top``, `draw_spread`)."""

    token: torch.LongTensor
    probs: torch.Tensor | None
    confidence: torch.Tensor | None
    valid: torch.Tensor
    top: torch.Tensor | None = None  # [1] greedy, [bins] sampling; at gated positions only
    alternatives: torch.LongTensor | None = None  # [m] the next-best tokens, where the level offers them


@functools.cache
def _bin_edges(device: torch.device) -> torch.Tensor:
    """`calibration.BIN_EDGES` on ``device``, uploaded once."""
    return upload(torch.tensor(BIN_EDGES, dtype=torch.float64), device)


def draw_spread(probs: torch.Tensor, sampled: bool) -> torch.Tensor:
    """What a round's first-draft gate prices (`CostAwareSchedule.first_draft_pays`), from the
    distribution ``probs`` ``[V]`` the draft comes from: greedy, its largest probability ``[1]`` (the
    draft's confidence); sampling, its mass in each confidence bin ``[bins]`` (the chance that the
    drawn token's confidence falls there, `calibration.BIN_EDGES`)."""
    if not sampled:
        return probs.max().reshape(1)
    # past the first edge only the largest 1 / edge probabilities can lie (a distribution sums to 1):
    # bin those as the host bins a confidence read back (in double), the rest is the first bin's mass
    top = probs.topk(min(int(1 / BIN_EDGES[0]), probs.shape[0])).values.double()
    top = torch.where(top >= BIN_EDGES[0], top, 0.0)
    bins = torch.bucketize(top, _bin_edges(probs.device), right=True)  # the bin `calibration` puts it in
    spread = torch.zeros(len(BIN_EDGES) + 1, dtype=top.dtype, device=probs.device).scatter_add_(0, bins, top)
    spread[0] = probs.sum().double() - top.sum()
    return spread


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


class ModelDrafter(Proposer):
    """Drafts up to K tokens with a model, sampling from (or taking the argmax of) its processed
    distribution; each row's schedule sets its K and may stop its draft early, by its confidence in
    each token. Rows still drafting share one forward per step. On the CPU the drafts are read back
    after every step and stop there; where a read waits for the device (a GPU) the drafter drafts a
    width and reads nothing: the level above reads the drafts with its decision (`Deferred`), and
    the block is cut where the schedule would have stopped after that read (the tokens past the cut
    cost a drafter step each, not a wait for the device's whole queue).

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
        # next-best tokens offered beside each greedy draft (`hf_polybasic.decoding.alternatives`); set
        # where the target scores them
        self.alternatives = 0

    @property
    def forward_passes(self) -> int:
        return self.runner.forward_passes

    def propose(self, requests: dict[int, tuple[torch.LongTensor, int]],
                schedules: dict[int, Schedule] | None = None) -> dict[int, Proposal]:
        """Each row's draft of up to K tokens (its schedule's length, at most its budget)."""
        schedules = self._begin(requests, schedules)
        blocks, drafting, widths = {}, [], {}
        by_confidence = [row for row in requests if schedules[row].stops_per_token]
        # where a schedule stops by confidence: on the CPU, read every step and stop there; where a
        # read waits for the device (`reads_wait`), draft a width and cut the block after one read
        stepwise = bool(by_confidence) and not reads_wait(self.runner.device)
        for row, (sequence, budget) in requests.items():
            blocks[row] = Block(self.rules[row].eos_token_ids, min(schedules[row].length(), budget), sequence.device)
            widths[row] = blocks[row].budget
            if row in by_confidence and not stepwise:
                widths[row] = min(widths[row], self._widths.get(row, FIRST_WIDTH))
            if not blocks[row].closed:
                drafting.append(row)
        drawn: dict[int, list[Draw]] = {row: [] for row in drafting}
        catch_up = 0.0  # seconds spent feeding tokens decided while this level sat out or was rolled back
        device = DeviceSpan(self.runner.device, self.clock)
        with self.stats.timed(self.clock) as span:
            device.start()
            while drafting:
                grown = {row: torch.cat([requests[row][0], blocks[row].tokens, *(d.token for d in drawn[row])])
                         for row in drafting}
                behind = max(grown[row].shape[0] - self.runner.lengths[row] for row in drafting)
                with timed(self.clock) as forward:
                    logits = self.runner.logits_rows({row: (grown[row], 1) for row in drafting})
                if behind > 1:
                    catch_up += forward.seconds * (behind - 1) / behind
                for row in drafting:
                    # a gate prices a round's first position, and, sampling on the host, every later one
                    gated = blocks[row].size + len(drawn[row]) == 0 or (stepwise and self.samples)
                    drawn[row].append(self.draw(row, grown[row], logits[row], row in by_confidence, gated))
                if stepwise:
                    drafting = self._keep_step(blocks, drawn, drafting)
                else:
                    drafting = [row for row in drafting if blocks[row].size + len(drawn[row]) < widths[row]]
            device.stop()
        seconds = span.seconds - catch_up
        if stepwise:
            for row in by_confidence:
                self._withhold(row, blocks[row])
            self._observe(blocks, seconds)
            return {row: block.proposal() for row, block in blocks.items()}
        pieces = [piece for row in requests for piece in self._pieces(row, drawn.get(row, []))]
        if reads_wait(self.runner.device):  # the level above reads them with its decision
            return self._deferred(blocks, drawn, widths, pieces, span.seconds, device, catch_up)
        return self._settle(blocks, drawn, widths, HostRead(pieces).read(), seconds)

    def _deferred(self, blocks: dict[int, Block], drawn: dict[int, list[Draw]], widths: dict[int, int],
                  pieces: list, host_seconds: float, device: DeviceSpan, catch_up: float) -> dict[int, Proposal]:
        """Every row's drafted tokens, unread, for the level above to verify and to read back with its
        decision (`Deferred`); its read settles the blocks (`_settle`), when the drafting has run on
        the device: its seconds there (``device``, beyond the host's ``host_seconds`` of launching
        it) are this level's, though the level above waited for them."""
        late = []

        def settle(host: dict) -> dict[int, Proposal]:
            late.append(device.seconds(host_seconds) - host_seconds)
            self.stats.seconds += late[0]
            return self._settle(blocks, drawn, widths, host, host_seconds + late[0] - catch_up)

        deferred = Deferred(pieces, settle, lambda: late[0] if late else 0.0)
        proposals = {}
        for row in blocks:
            draws = drawn.get(row, [])
            if not draws:
                proposals[row] = Proposal(blocks[row].tokens, None, [], deferred)
                continue
            probs = torch.cat([d.probs for d in draws]) if self.samples else None
            proposals[row] = Proposal(torch.cat([d.token for d in draws]), probs, None, deferred)
        return proposals

    def draw(self, row: int, grown: torch.LongTensor, logits: torch.Tensor, confidence: bool,
             gated: bool = False) -> Draw:
        """The row's next token, drawn on the device: its processed distribution's argmax, or a sample
        of it; with ``confidence``, its probability, and where a gate prices the position (``gated``)
        what it prices (`draw_spread`). A position where the processors leave no finite
        score (a constraint outside what this model proposes) draws nothing valid."""
        logits = logits.to(grown.device)  # [1, V]
        scores = process_positions(self.rules[row].processors, grown, grown.shape[0], logits)
        valid = torch.isfinite(scores).any()
        probs = None
        if self.samples or confidence:
            probs = scores.softmax(-1)
            probs = torch.where(valid, probs, torch.ones_like(probs) / probs.shape[-1])  # never NaN to draw from
        token = torch.multinomial(probs, 1)[0] if self.samples else scores.argmax(-1)  # [1]
        reported = self.proposal_probs(probs, logits) if self.samples else None
        others = next_best(scores, token, self.alternatives) if self.alternatives else None  # greedy only (build)
        if not confidence:
            return Draw(token, reported, None, valid, alternatives=others)
        return Draw(token, reported, probs[0, token], valid, draw_spread(probs[0], self.samples) if gated else None,
                    others)

    def _keep_step(self, blocks: dict[int, Block], drawn: dict[int, list[Draw]], rows: list[int]) -> list[int]:
        """Read the latest draw of every row back (one read for all: token, validity, confidence, and
        what a gate prices: at a round's first position, and sampling at every later one), add it to the
        row's block unless its gate declines it (counted as withheld after the first); the rows that
        draft another."""
        latest = [drawn[row].pop() for row in rows]
        read = HostRead()
        for row, draw in zip(rows, latest):
            values = [draw.token[0], draw.valid, draw.confidence.reshape(())]
            read.add((row, "draw"), torch.stack([value.double() for value in values]))
            if draw.top is not None:
                read.add((row, "top"), draw.top)
            if draw.alternatives is not None:
                read.add((row, "alternatives"), draw.alternatives)
        host = read.read()
        going = []
        for row, draw in zip(rows, latest):
            token, valid, confidence = host[row, "draw"]
            if not valid:
                continue
            block, schedule = blocks[row], self._active[row]
            # whether the round proposes this draft at all: from its distribution, never the draw
            if block.size == 0 and not schedule.first_draft_pays(self._gate_input(host[row, "top"])):
                continue
            if block.size and self.samples and not schedule.next_draft_pays(host[row, "top"]):
                self.stats.withheld += 1
                continue
            others = host.get((row, "alternatives"))
            block.extend(draw.token, draw.probs, ids=[int(token)], alternatives=others and per_token(others, 1))
            # the token just drawn is kept whatever it is; only whether to draw another depends on it
            if block.closed:
                schedule.closed_at(confidence)
            elif schedule.keep_drafting(confidence):
                going.append(row)
        return going

    def _gate_input(self, values: list[float]) -> float | list[float]:
        """What `first_draft_pays` takes, from a `draw_spread` read back: greedy, the top probability;
        sampling, the mass per confidence bin."""
        return values if self.samples else values[0]

    @staticmethod
    def _pieces(row: int, draws: list[Draw]) -> list[tuple[tuple, torch.Tensor]]:
        """What a read carries of a row's draws (`HostRead` pieces, named ``("drafts", row, ...)``): its
        drafted tokens, their validity and, where its schedule stops by confidence, their
        probabilities (what `_settle` reads)."""
        if not draws:
            return []
        pieces = [(("drafts", row, "tokens"), torch.cat([d.token for d in draws])),
                  (("drafts", row, "valid"), torch.stack([d.valid for d in draws]))]
        if draws[0].alternatives is not None:
            pieces.append((("drafts", row, "alternatives"), torch.stack([d.alternatives for d in draws])))
        if draws[0].confidence is not None:
            pieces.append((("drafts", row, "confidences"), torch.stack([d.confidence.reshape(()) for d in draws])))
            pieces.append((("drafts", row, "tops"), draws[0].top))
        return pieces

    def _settle(self, blocks: dict[int, Block], drawn: dict[int, list[Draw]], widths: dict[int, int],
                host: dict[int, list[float]], seconds: float) -> dict[int, Proposal]:
        """Add every row's draws to its block from their values read back (`_pieces`), each up to its
        first invalid draw (`Block.extend` cuts after an EOS); a schedule that stops by confidence then
        cuts the block after the first token it would not have drafted past, as if it had been asked
        token by token, and the row's next width follows where it cut (`next_width`). The proposal
        and what it cost are recorded; returns the proposals."""
        for row, block in blocks.items():
            draws = drawn.get(row, [])
            if not draws:
                continue
            tokens = [int(token) for token in host["drafts", row, "tokens"]]
            valid = host["drafts", row, "valid"]
            usable = valid.index(0) if 0 in valid else len(draws)
            if not usable:
                continue
            others = host.get(("drafts", row, "alternatives"))
            others = None if others is None else per_token(others, len(draws))[:usable]
            block.extend(torch.cat([d.token for d in draws[:usable]]),
                         torch.cat([d.probs for d in draws[:usable]]) if self.samples else None, ids=tokens[:usable],
                         alternatives=others)
            if draws[0].confidence is not None:
                self._cut_by_confidence(row, block, host["drafts", row, "confidences"],
                                        self._gate_input(host["drafts", row, "tops"]), widths[row])
        self._observe(blocks, seconds)
        return {row: block.proposal() for row, block in blocks.items()}

    def _cut_by_confidence(self, row: int, block: Block, confidences: list[float], top: float | list[float],
                           width: int) -> None:
        """Ask the row's schedule whether to propose at all (from the first position's `draw_spread`) and
        about each kept token in turn, as `_keep_step` would have after drafting it; end the block
        after the first it would not have drafted past."""
        schedule = self._active[row]
        if block.size and not schedule.first_draft_pays(top):
            block.truncate(0)
            self._widths[row] = next_width(width, 1)
            return
        for index in range(block.size):
            if block.closed and index == block.size - 1:
                schedule.closed_at(confidences[index])  # drafting would have ended here anyway: told, not asked
                break
            if not schedule.keep_drafting(confidences[index]):
                block.truncate(index + 1)
                self._widths[row] = next_width(width, index + 1)
                return
        self._widths[row] = next_width(width, None)

    def _withhold(self, row: int, block: Block) -> None:
        """Once the row's drafting has stopped, propose only as many of its drafts as its schedule says
        pay (`CostAwareSchedule.proposal_size`): argmax drafts only, which are a function of the text
        so far, so withholding them keeps verification exact; a sampled draft is proposed whatever it is
        (its round stops before a draft only by that position's distribution, `_keep_step`).
        Drafts read with the verifier's decision (`_cut_by_confidence`) are verified whole before the
        read: withholding them there would save nothing."""
        if self.samples or not block.size:
            return
        size = self._active[row].proposal_size(block.size)
        self.stats.withheld += block.size - size
        block.truncate(size)

    def proposal_probs(self, probs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """What is reported upward for a sampled token: the processed distribution it was drawn from."""
        return probs

    def rollback_rows(self, lengths: dict[int, int]) -> None:
        self.runner.rollback_rows(lengths)

    def commit(self) -> None:
        self.runner.commit()

    def release_rows(self, rows) -> None:
        self.runner.release_rows(rows)


class DrafterLevel(Proposer):
    """Adapts a `Drafter` (the public, model-free interface) to the level protocol, checking what it
    returns; it is asked for each row in turn. A row's ``schedule`` (cost-aware) caps how many tokens
    it may propose, or sits it out (0: the level above decodes alone) when its drafts do not pay;
    without one, the drafter's own length holds."""

    def __init__(self, drafter: Drafter, rules: dict[int, DecodingRules], stats: LevelStats,
                 clock: Clock = DEFAULT_CLOCK, schedules: dict[int, Schedule] | None = None):
        super().__init__()
        self.drafter, self.rules, self.stats, self.clock = drafter, rules, stats, clock
        self.schedules = schedules

    def propose(self, requests: dict[int, tuple[torch.LongTensor, int]],
                schedules: dict[int, Schedule] | None = None) -> dict[int, Proposal]:
        schedules = self._begin(requests, schedules)
        proposals = {}
        for row, (sequence, budget) in requests.items():
            schedule = None if schedules is None else schedules[row]
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

    def rollback_rows(self, lengths: dict[int, int]) -> None:
        for length in lengths.values():  # a batchable Drafter keeps no state; one of one row does
            self.drafter.rollback_to(length)

    def commit(self) -> None:
        self.drafter.commit()

    def release_rows(self, rows) -> None:
        """A `Drafter` serving several rows keeps no state: nothing to release."""


# how far from 1 a Drafter's reported probabilities may sum (float rounding)
PROBABILITY_SUM_TOLERANCE = 1e-3


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
