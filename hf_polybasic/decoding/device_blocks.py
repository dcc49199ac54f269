"""An intermediate level's blocks where a read waits for the device: many of its rounds, one read.

`hf_polybasic.decoding.round.IntermediateLevel` builds each row's block from rounds of the level
below: the drafter drafts, the level verifies, and the host reads the decision before the next round
(it needs the accepted count to know what to feed next). On a GPU every such read waits for the
device's whole queue. Here the rounds' positions live on the device instead: the host queues a batch
of R rounds for every row of the batch at once, in fixed shapes, and reads once after them. A round:

1. **catch up and draft**: the drafter feeds what its cache lacks of the row's sequence (its last
   token, or its last two where the level accepted every draft: one forward of width 2), then drafts
   ``w`` tokens, one forward each (`ModelDrafter.draw`: the argmax or a sample of its processed
   distribution, which it reports);
2. **score and decide**: the level scores ``[the sequence's last token, w drafts]`` in one forward and
   decides ``[accepted, next token]`` per row (`Verifier.decide`);
3. **append**: the emitted tokens (the accepted drafts, then its own) are written after the row's
   sequence in a device buffer, and the sequence's length and both caches' lengths move on, on the
   device, unless the row's block is done (its tokens reached mu, its budget, or an EOS).

After R rounds, one read: every round's decisions and emitted tokens (and, for a schedule that stops
blocks by confidence, their probabilities) and both caches' lengths. The level then replays the rounds
through the host loop's own block logic (`IntermediateLevel._extend`: cuts, stops, the threshold), and
rows still building run another batch. R is what the level's mean acceptance length says the blocks
need, one more (`rounds_needed`).

Exact: every round is a round of the host loop (drafts drawn from the drafter's processed distribution,
verified against the level's); rounds past a row's end (run because the shapes are fixed, or past a
stop the host finds after the read) are discarded, and where a block ends depends only on its own
tokens (a stopping time, as for `hf_polybasic.decoding.protocol.Deferred`).

Used where reads wait for the device and it applies (`DeviceBlocks.serves`): the level and its drafter both
run on static caches (`hf_polybasic.runners.static.StaticRunner.forward_from`) that keep no features for a
draft head (their positions would live on the device only), every processor of every
row is prefix-free (no row's sequence is needed on the host) and no ids need a check on the host. The
drafter's schedule sets its width but is not asked token by token; it learns from every round.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from ..processing import PREFIX_FREE_PROCESSORS, process_positions
from ..runners.static import StaticRunner, bucket
from ..runners.transfer import upload
from ..timing import timed
from .acceptance import emitted_tokens
from .protocol import Proposal
from .reads import HostRead

# rounds of one batch at most, and the widest draft (a verification of w + 1 positions fits the widest width)
MAX_ROUNDS = 16
MAX_WIDTH = 63


def rounds_needed(remaining: int, mean_length: float | None, budget: int) -> int:
    """Rounds a batch runs for blocks with ``remaining`` tokens still to go, where a round emits
    ``mean_length`` tokens on average (None: not measured, taken as 1): one more than that says,
    never more than ``budget`` (each round emits a token at least) or `MAX_ROUNDS`."""
    length = 1.0 if mean_length is None else max(mean_length, 1.0)
    return max(1, min(MAX_ROUNDS, budget, math.ceil(remaining / length) + 1))


class DeviceBlocks:
    """Rounds of an intermediate level (``verifier``, over the model drafter ``drafter``), a batch of
    them per read (see the module docstring)."""

    def __init__(self, verifier, drafter):
        self.verifier, self.drafter = verifier, drafter

    def serves(self, rows) -> bool:
        """Whether the rounds of ``rows`` can be decided on the device (see the module docstring; the
        caller knows whether reads wait for it)."""
        runners = (self.verifier.runner, self.drafter.runner)
        return (all(isinstance(runner, StaticRunner) and runner.features is None for runner in runners)
                and not any(runner.checks_ids for runner in runners)
                and all(isinstance(processor, PREFIX_FREE_PROCESSORS)
                        for row in rows for rules in (self.verifier.rules[row], self.drafter.rules[row])
                        for processor in rules.processors))

    def width(self, rows) -> int:
        """The drafter's width for a batch: the longest its rows' schedules draft where they cannot
        stop token by token (`Schedule.fixed_length`)."""
        return min(MAX_WIDTH, max(self.drafter.schedules[row].fixed_length() for row in rows))

    def run(self, requests: dict[int, tuple[torch.LongTensor, int, int]]) -> Iterator[dict[int, tuple]]:
        """``{row: (sequence [P], budget, needed)}``: each row's sequence so far, the tokens its block may
        still take and those it still needs. Runs a batch of rounds and reads once; yields, round by
        round, ``{row: (tokens [m] on the device, processed scores [m, V], ids, confidences)}`` for the
        rows that round ran for (m: the accepted drafts and the level's own token)."""
        verifier, drafter = self.verifier, self.drafter
        above, below = verifier.runner, drafter.runner
        rows, device = above.rows, above.device
        lengths = {row: sequence.shape[0] for row, (sequence, _, _) in requests.items()}
        for runner in (above, below):  # both caches hold every row's sequence but its last token
            runner.rollback_rows({row: length - 1 for row, length in lengths.items()})
            behind = {row: (requests[row][0][:-1], 1) for row in requests if runner.lengths[row] < lengths[row] - 1}
            if behind:
                runner.logits_rows(behind)
        w = self.width(requests)
        mean = (verifier.stats.accepted / verifier.stats.verifications + 1) if verifier.stats.verifications else None
        batch = rounds_needed(max(needed for _, _, needed in requests.values()), mean,
                              max(budget for _, budget, _ in requests.values()))
        first = next(iter(requests))
        rules = {row: verifier.rules.get(row, verifier.rules[first]) for row in range(rows)}
        state = _State.start(requests, rows, device, above.lengths, below.lengths, batch * (w + 1) + w + 2,
                             [rules[row].eos_token_ids for row in range(rows)])
        # what each row's processors are given as its prefix (prefix-free: they only look at its shape)
        sequences = {row: requests[row if row in requests else first][0] for row in range(rows)}
        ran = []
        for _ in range(batch):
            with drafter.stats.timed(drafter.clock) as drafting:
                drafts, probs = self._draft(state, w, sequences)
            with verifier.stats.timed(verifier.clock) as verifying:
                ran.append(self._verify(state, drafts, probs, sequences, rules) + (drafting.seconds, verifying.seconds))
        with verifier.stats.timed(verifier.clock):
            host = self._read(state, ran)
        above.hold({row: int(host["above"][row]) for row in requests})
        if w:
            below.hold({row: int(host["below"][row]) for row in requests})
        for index, (active, accepted, emitted, scores, _, drafting, verifying) in enumerate(ran):
            live = [row for row in requests if host["active"][index][row]]
            kept = {row: int(host["accepted"][index][row]) for row in live}
            for row in live:
                verifier.stats.record_verification(w, kept[row])
                verifier.stats.device_rounds += 1
            if live:
                drafter.observe_round(dict.fromkeys(live, w), drafting / len(live), kept, verifying / len(live))
            yield {row: (emitted[row, : kept[row] + 1], scores[row, : kept[row] + 1],
                         [int(t) for t in host["emitted"][index][row][: kept[row] + 1]],
                         None if host["confidences"][index] is None else
                         host["confidences"][index][row][: kept[row] + 1]) for row in live}

    def _draft(self, state: _State, w: int, sequences) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Step 1: every row's ``w`` drafts ``[rows, w]`` and the distributions reported for them
        ``[rows, w, V]`` (None: point masses)."""
        drafter, below = self.drafter, self.drafter.runner
        if not w:
            return state.sequence.new_zeros(state.rows, 0), None
        offsets = torch.arange(2, device=state.device)
        feed = state.sequence.gather(1, state.below.unsqueeze(1) + offsets)  # [rows, 2]
        logits = below.forward_from(feed, state.below)  # [rows, 2, V]
        last = (state.length - 1 - state.below).clamp(0, 1)  # where the sequence's last token is in the feed
        step = logits.gather(1, last.view(-1, 1, 1).expand(-1, 1, logits.shape[-1])).squeeze(1)  # [rows, V]
        tokens, reported = [], []
        for j in range(w):
            if j:
                step = below.forward_from(tokens[-1].unsqueeze(1), state.length + j - 1)[:, 0]
            draws = [drafter.draw(row, sequences[row], step[row : row + 1], False) for row in range(state.rows)]
            tokens.append(torch.cat([draw.token for draw in draws]))  # [rows]
            if drafter.samples:
                reported.append(torch.cat([draw.probs for draw in draws]))  # [rows, V]
        return torch.stack(tokens, 1), torch.stack(reported, 1) if reported else None

    def _verify(self, state: _State, drafts: torch.Tensor, probs: torch.Tensor | None, sequences, rules) -> tuple:
        """Steps 2 and 3: score and decide every row's drafts, append what it emits, move the lengths
        of the rows still building; returns the round's (active [rows], accepted [rows], emitted
        [rows, w + 1], processed scores [rows, w + 1, V], confidences [rows, w + 1] or None)."""
        verifier, above = self.verifier, self.verifier.runner
        w = drafts.shape[1]
        last = state.sequence.gather(1, (state.length - 1).unsqueeze(1))  # [rows, 1]
        feed = torch.cat([last, drafts], 1)  # [rows, w + 1]
        padded = torch.nn.functional.pad(feed, (0, bucket(w + 1, above.widths) - (w + 1)))
        logits = above.forward_from(padded, state.length - 1)[:, : w + 1]  # [rows, w + 1, V]
        scores = torch.stack([process_positions(rules[row].processors, sequences[row],
                                                sequences[row].shape[0], logits[row])
                              for row in range(state.rows)])
        decided = torch.stack([verifier.decide(Proposal(drafts[row], None if probs is None else probs[row]), scores[row])
                               for row in range(state.rows)])  # [rows, 2]
        accepted = decided[:, 0]
        emitted = emitted_tokens(drafts, accepted, decided[:, 1:])  # [rows, w + 1]
        confidences = None
        if verifier.confidences:
            confidences = scores.softmax(-1).gather(2, emitted.unsqueeze(2)).squeeze(2)  # [rows, w + 1]
        active = state.append(emitted, accepted, w)
        return active, accepted, emitted, scores, confidences

    def _read(self, state: _State, ran: list[tuple]) -> dict:
        """The batch's one read (`HostRead`): per round, which rows it ran for, their accepted counts,
        emitted tokens and confidences; both caches' lengths."""
        read = HostRead([("above", state.above), ("below", state.below)])
        for index, (active, accepted, emitted, _, confidences, _, _) in enumerate(ran):
            read.extend([((index, "active"), active), ((index, "accepted"), accepted), ((index, "emitted"), emitted)])
            if confidences is not None:
                read.add((index, "confidences"), confidences)  # [rows, w + 1]
        values = read.read()

        def per_row(flat: list[float], width: int) -> list[list[float]]:
            return [flat[row * width : (row + 1) * width] for row in range(state.rows)]

        host = {"above": values["above"], "below": values["below"], "active": [], "accepted": [], "emitted": [],
                "confidences": []}
        for index, (_, _, emitted, _, confidences, _, _) in enumerate(ran):
            width = emitted.shape[1]
            host["active"].append([bool(v) for v in values[index, "active"]])
            host["accepted"].append(values[index, "accepted"])
            host["emitted"].append(per_row(values[index, "emitted"], width))
            host["confidences"].append(None if confidences is None else per_row(values[index, "confidences"], width))
        return host


class _State:
    """A batch's rows on the device, every row of the runners' batch (rows not asked are done from
    the start, so the shapes stay fixed): ``sequence`` ``[rows, L]`` the tokens so far (the row's
    sequence, then its block), ``length`` ``[rows]`` how many, ``above``/``below`` ``[rows]`` the tokens
    each cache holds, ``size`` the block's tokens this batch added, ``budget``/``needed`` the tokens the
    block may still take / still needs, ``done``, ``eos`` ``[rows, E]`` each row's EOS ids (-1 pads)."""

    def __init__(self, **tensors):
        for name, value in tensors.items():
            setattr(self, name, value)
        self.rows, self.device = self.length.shape[0], self.length.device

    @classmethod
    def start(cls, requests, rows: int, device, above: list[int], below: list[int], room: int,
              eos: list[frozenset[int]]) -> _State:
        asked = [row in requests for row in range(rows)]
        # a row not asked is done from the start; its forwards write past what its caches hold
        length = [requests[row][0].shape[0] if asked[row] else max(above[row], below[row]) + 1 for row in range(rows)]
        sequence = torch.zeros(rows, max(length) + room, dtype=torch.long, device=device)
        for row, (tokens, _, _) in requests.items():
            sequence[row, : tokens.shape[0]] = tokens
        budget = [requests[row][1] if asked[row] else 0 for row in range(rows)]
        needed = [requests[row][2] if asked[row] else 0 for row in range(rows)]
        widest = max(1, max(len(ids) for ids in eos))
        eos_ids = [sorted(ids) + [-1] * (widest - len(ids)) for ids in eos]
        host = torch.tensor([length, above, below, budget, needed, [int(not a) for a in asked]], dtype=torch.long)
        length_, above_, below_, budget_, needed_, done = upload(host, device).unbind(0)
        return cls(sequence=sequence, length=length_, above=above_, below=below_, size=torch.zeros_like(length_),
                   budget=budget_, needed=needed_, done=done.bool(),
                   eos=upload(torch.tensor(eos_ids, dtype=torch.long), device))

    def append(self, emitted: torch.Tensor, accepted: torch.Tensor, w: int) -> torch.Tensor:
        """Step 3 for ``emitted`` ``[rows, w + 1]`` (``accepted`` ``[rows]`` of them drafts): the rows
        still building take their tokens (cut after an EOS and at the budget) and move their lengths
        on; returns which rows the round ran for ``[rows]``."""
        active = ~self.done
        positions = torch.arange(w + 1, device=self.device)
        count = accepted + 1
        is_eos = (emitted.unsqueeze(2) == self.eos.unsqueeze(1)).any(2) & (positions < count.unsqueeze(1))
        ends = is_eos.any(1)
        first_eos = torch.where(ends, is_eos.long().argmax(1) + 1, count)
        count = torch.minimum(torch.minimum(count, first_eos), self.budget - self.size)
        ended = ends & (first_eos <= count)
        count = torch.where(active, count, 0)
        index = self.length.unsqueeze(1) + positions  # [rows, w + 1]; a done row's writes fall past its tokens
        self.sequence.scatter_(1, index, emitted)
        self.size = self.size + count
        finished = active & (ended | (self.size >= self.budget) | (self.size >= self.needed))
        new_length = self.length + count
        # the caches as the host loop leaves them (the level's: the accepted drafts; the drafter's: the
        # drafts it fed that were accepted); a row that ended holds no more than its tokens
        above = torch.where(active, self.length + accepted, self.above)
        below = torch.where(active, self.length + torch.clamp(accepted, max=max(w - 1, 0)), self.below) if w else self.below
        self.above = torch.where(finished, torch.minimum(above, new_length - 1), above)
        self.below = torch.where(finished, torch.minimum(below, new_length - 1), below)
        self.length = new_length
        self.done = self.done | finished
        return active
