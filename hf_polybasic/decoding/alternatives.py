"""Alternatives: the drafter's next-best tokens, scored by the target beside the drafts (greedy).

At each drafted position the drafter's argmax is the draft; its next ``m`` tokens by processed score
are that position's *alternatives*. The target scores them in the same forward as the drafts, each
as a one-token branch: at the position of draft j, attending to the text and drafts ``0..j-1`` only
(`hf_polybasic.runners.branches.branch_mask`). Where the target rejects draft j its own token there
is its argmax t; if t is one of draft j's alternatives, the target has already scored the text
followed by t, so the round emits one token more: the target's argmax after t (`hit`).

Why it stays exact: every token emitted is still the target's argmax given the text before it; the
alternatives only decide which of those argmaxes the forward happens to have computed. Which
tokens are offered as alternatives never changes what is emitted. Greedy only: a sampled round would
need a rejection rule over several candidates per position.

Whether a round offers them is a cost question (`alternatives_pay`): m more tokens per draft widen
the target's forward, which is nearly free where its cost is flat in the width (bf16 products on
AMX: T(16) is 1.06 T(1)) and dear where it is not (fp32 on AVX2: T(8) is 5.6 T(1)).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# alternatives per drafted position under ``draft_alternatives="auto"``: where the target's token was
# not the drafter's argmax it was its 2nd choice 50, 3rd 15, 4th 8 times in 100 (stopping-replay's
# miss ranks, the committed Qwen2.5 streams), so three catch about three misses in four
DEFAULT_ALTERNATIVES = 3

# before any round has offered alternatives, a hit is expected this often per round
PRIOR_HITS, PRIOR_ROUNDS = 1.0, 3.0
# before any round was verified, a round is expected to emit this many tokens
PRIOR_TOKENS_PER_ROUND = 2.0


def next_best(scores: torch.Tensor, token: torch.LongTensor, count: int) -> torch.LongTensor:
    """The ``count`` best tokens of ``scores`` ``[1, V]`` other than the drawn ``token`` ``[1]``: ``[count]``
    (ties as ``topk`` orders them; a token the processors forbid may appear where fewer are allowed,
    which costs a branch and changes nothing emitted)."""
    others = scores.scatter(-1, token.view(1, 1), -float("inf"))
    return others.topk(min(count, scores.shape[-1] - 1), dim=-1).indices[0]


def per_token(values: list[float], tokens: int) -> list[list[int]]:
    """The alternatives of ``tokens`` drafts as one read returned them (``[tokens, m]`` flattened): per draft, ids."""
    width = len(values) // tokens
    return [[int(value) for value in values[i * width : (i + 1) * width]] for i in range(tokens)]


def hit(kept: int, token: int, alternatives: list[list[int]]) -> int | None:
    """Where the verifier kept ``kept`` drafts and then emitted ``token``: the index of ``token`` among the
    alternatives of the draft it rejected (``alternatives[kept]``), or None (every draft was kept, or
    the token was not offered)."""
    if kept >= len(alternatives):
        return None
    offered = alternatives[kept]
    return offered.index(token) if token in offered else None


def tokens_per_round(emitted: int, rounds: int) -> float:
    """The tokens a verifier's rounds emitted on average, `PRIOR_TOKENS_PER_ROUND` before its first."""
    return emitted / rounds if rounds else PRIOR_TOKENS_PER_ROUND


def alternatives_pay(seconds: Callable[[float], float], width: int, branches: int, tokens_per_round: float,
                     hit_rate: float) -> bool:
    """Whether scoring ``branches`` alternatives beside a forward of ``width`` tokens pays: its cost grows
    by ``seconds(width + branches) / seconds(width)``, its yield by one token in ``hit_rate`` of the
    rounds over the ``tokens_per_round`` it emits already."""
    return seconds(width + branches) * tokens_per_round < seconds(width) * (tokens_per_round + hit_rate)


class AlternativesPolicy:
    """How many alternatives per draft the target scores in a round: ``count`` always (a count the user
    set), or under ``auto`` ``count`` where `alternatives_pay` by the target's measured forward costs
    (``seconds``: k tokens -> seconds, None: unpriced, then none), the tokens its rounds emit and how
    often offered alternatives have hit so far."""

    def __init__(self, count: int, auto: bool, seconds: Callable[[float], float] | None):
        self.count, self.auto, self.seconds = count, auto, seconds
        self.rounds = 0  # rounds that offered alternatives
        self.hits = 0

    def per_draft(self, drafts: int, width: int, tokens_per_round: float) -> int:
        """Alternatives per draft for a round of ``drafts`` drafts fed in a forward of ``width`` tokens."""
        if not drafts:
            return 0
        if not self.auto:
            return self.count
        if self.seconds is None:
            return 0
        rate = (self.hits + PRIOR_HITS) / (self.rounds + PRIOR_ROUNDS)
        return self.count if alternatives_pay(self.seconds, width, drafts * self.count, tokens_per_round, rate) else 0

    def observe(self, hit_: bool) -> None:
        """A round that offered alternatives hit (emitted one token more) or not."""
        self.rounds += 1
        self.hits += int(hit_)
