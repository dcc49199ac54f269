"""A translated level that drafts through text (``route="text"``, transformers' UAD): greedy drafts of
its own, re-encoded by the target's tokenizer, handed up as point masses.

At a row's position the level runs its own model greedily over its whole vocabulary (the
*lookahead*: own tokens past its context, kept in its cache), and encodes the text they spell with
the target's tokenizer; every target token of it is a draft, but the last one only where it is
*settled*: the text does not end in whitespace, and followed by a word or by a newline it still
encodes to it (`last_settled`). An unsettled one (a run of spaces that the next word takes, a run
of punctuation that a newline joins) waits until more text confirms it, at the cost of a forward of
the level's model; a settled one is handed up at once, as UAD hands up all. Where the text that
follows still re-tokenizes a draft already handed up, the lookahead no longer spells the row's
sequence and the level drafts nothing more in that round.

`TextRouteRunner.logits_rows` hands the chain's drafter one draft per position as logits that are
0 at that id and -inf elsewhere: the drafter's processors keep it or rule it out (a draft ruled out
ends the proposal) and, sampling, it draws it with probability 1 and reports exactly that. So the
level's proposals are point masses, which speculative sampling accepts with the target's own
probability: exact under greedy decoding and sampling alike, whatever the drafts are. Drafts may
depend on anything decided before them (earlier rounds' lookaheads), never on what the level above
decides about them.

A lookahead stays in use while the row's sequence follows its drafts (the next round then drafts on
from it without a forward); where the sequence leaves it, the row's context is translated token by
token again (`OwnContext`) and the inner cache is cut back to what the two share. Where the context
holds the first bytes of an incomplete character the level drafts nothing there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..translation.tokens import split_complete
from .translated import TranslatedRunner

# continuations a settled last target token survives: a next word, and a newline (which joins a run of
# punctuation in Qwen's and Llama 3's pre-tokenizers). A word that goes on in the level's next own
# token is rare enough not to hold every word back for (own tokens mostly end where words do)
SETTLING_TEXTS = (" a", "\n")
# at most this many own tokens past those a position needs before the level gives up drafting there
# (own tokens that spell no complete target token: whitespace runs, bytes of a long character)
SPARE_OWN_TOKENS = 8


def last_settled(encode, text: str, ids: list[int]) -> bool:
    """Whether the last of ``ids`` (``encode(text)``, a text with no incomplete character at its end)
    stays a token of it whatever text follows, as far as whitespace at its end and `SETTLING_TEXTS`
    tell."""
    if not text or text[-1].isspace():
        return False
    return all(encode(text + more)[: len(ids)] == ids for more in SETTLING_TEXTS)


@dataclass
class Lookahead:
    """One row's greedy own tokens past its context (which ends at the target length ``base``), and the
    target ids their text encodes to (``ended``: the level ended its text with a special token, whose
    twin, if any, is the last draft)."""

    base: int
    own: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    ended: bool = False

    def agrees(self, ids: list[int]) -> bool:
        """Whether the drafts and the row's tokens past ``base`` (``ids[base:]``) agree where both are."""
        past = ids[self.base:]
        common = min(len(past), len(self.drafts))
        return past[:common] == self.drafts[:common]

    def follows(self, ids: list[int], length: int) -> bool:
        """Whether the row's sequence ``ids[:length]`` went along this lookahead's drafts."""
        return self.base <= length <= self.base + len(self.drafts) and self.agrees(ids[:length])


class TextRouteRunner(TranslatedRunner):
    """`TranslatedRunner` for a level drafting through text (see the module docs): asked one position per
    row (the chain's bottom drafter), it answers a point mass at its draft there, or -inf everywhere
    where it has none."""

    def __init__(self, inner, shared, width: int):
        super().__init__(inner, shared, width)
        self.lookaheads: list[Lookahead | None] = [None] * self.rows

    def logits_rows(self, requests: dict[int, tuple[torch.LongTensor, int]]) -> dict[int, torch.Tensor]:
        needed, growing, rows_ids = {}, [], {}
        for row, (sequence, count) in requests.items():
            if count != 1:
                raise RuntimeError(f"{self.role} drafts through text and can only draft; it was asked to verify. "
                                   "This is a bug in hf_polybasic")
            ids, length = sequence.tolist(), int(sequence.shape[0])
            rows_ids[row] = ids
            lookahead = self.lookaheads[row]
            context = self.contexts[row]
            if lookahead is None or context is None or ids[: lookahead.base] != context.target or not lookahead.follows(
                    ids, length):
                context = self.context(row, sequence, length)
                lookahead = self.lookaheads[row] = Lookahead(base=length, ended=bool(context.held))
            needed[row] = length - lookahead.base  # the draft wanted is lookahead.drafts[needed]
            self.lengths[row] = length
            if needed[row] >= len(lookahead.drafts) and not lookahead.ended:
                growing.append(row)
        limits = {row: needed[row] + 1 + SPARE_OWN_TOKENS for row in growing}
        # grown text may re-tokenize a draft handed up (a word goes on): then nothing more there
        while growing:
            self._grow(growing, requests)
            growing = [row for row in growing if needed[row] >= len(self.lookaheads[row].drafts)
                       and self.lookaheads[row].agrees(rows_ids[row])
                       and not self.lookaheads[row].ended and len(self.lookaheads[row].own) < limits[row]]
        out = {}
        for row in requests:
            lookahead = self.lookaheads[row]
            logits = torch.full((1, self.width), float("-inf"), device=self.device)
            if needed[row] < len(lookahead.drafts) and lookahead.agrees(rows_ids[row]):
                logits[0, lookahead.drafts[needed[row]]] = 0.0
            out[row] = logits
        return out

    def _grow(self, rows: list[int], requests: dict) -> None:
        """One forward of the level's own model for ``rows``: each row's next greedy own token, and its
        lookahead's drafts again."""
        asked, owns, shared = {}, {}, {}
        for row in rows:
            lookahead, context = self.lookaheads[row], self.contexts[row]
            owns[row] = context.own[: context.own_length(lookahead.base)] + lookahead.own
            shared[row] = self._shared_prefix(row, owns[row])
            asked[row] = (torch.tensor(owns[row], dtype=torch.long, device=requests[row][0].device), 1)
        self._cut_inner(shared)
        for row, own in owns.items():
            self._held[row] = own
        tokens = {row: logits.argmax(-1) for row, logits in self.inner.logits_rows(asked).items()}  # [1] each
        for row, token in zip(tokens, torch.stack(list(tokens.values())).tolist()):
            self._extend(self.lookaheads[row], int(token[0]))

    def _extend(self, lookahead: Lookahead, token: int) -> None:
        shared = self.shared
        lookahead.own.append(token)
        spelled = shared.own_bytes[token] if token < len(shared.own_bytes) else None
        if spelled is None:  # a special token (an EOS): the text ends here
            twin = shared.own_to_target[token] if token < len(shared.own_to_target) else None
            text, _ = split_complete(b"".join(shared.own_bytes[o] for o in lookahead.own[:-1]))
            lookahead.drafts = shared.encode_target(text) + ([] if twin is None else [twin])
            lookahead.ended = True
            return
        text, held = split_complete(b"".join(shared.own_bytes[o] for o in lookahead.own))
        drafts = shared.encode_target(text)
        if held or not last_settled(shared.encode_target, text, drafts):  # it waits for more text
            drafts = drafts[:-1]
        lookahead.drafts = drafts

    def rollback_rows(self, lengths: dict[int, int]) -> None:
        """Forget each row's target tokens past its length; a lookahead that starts at or before it is
        kept (the next request says whether the sequence still follows it)."""
        cut = {}
        for row, length in lengths.items():
            lookahead = self.lookaheads[row]
            if lookahead is not None and length >= lookahead.base:
                self.lengths[row] = min(self.lengths[row], length)
            else:
                self.lookaheads[row] = None
                cut[row] = length
        super().rollback_rows(cut)

    def release_rows(self, rows) -> None:
        super().release_rows(rows)
        for row in rows:
            self.lookaheads[row] = None
