"""One row's text in a translated level's own tokens, following the chain's sequence token by token.

The chain's sequences are target ids; a translated level runs on its own. `OwnContext` keeps, for
one row, the level's own tokens for the target's sequence so far:

* **the prompt** (the row's sequence before the first position the level is asked about) is encoded
  once, as text, by the level's own tokenizer with its own special tokens (its BOS, if it adds one);
  the target's special tokens in it become their twins (`hf_polybasic.translation.shared`) or are left
  out;
* **each later target token** becomes its twin where it has one, else its bytes are re-encoded as text
  by the level's tokenizer (bytes of an incomplete UTF-8 character are held until the character is
  complete, and anything held is re-encoded with the next token);
* **a table** from the target's length to the level's (and what was held there), so a rollback of
  the target's sequence cuts the level's to the matching length.

Every own token of a position depends only on the target's tokens before it (each token is
translated on top of the ones before): what the level scores at a position is a function of the
sequence up to there, as the chain's losslessness argument needs of every level.
"""

from __future__ import annotations

from .shared import SharedVocabulary
from .tokens import split_complete


def encode_prompt(shared: SharedVocabulary, prompt: list[int]) -> tuple[list[int], bytes]:
    """The level's own ids for the target's ``prompt`` ids, and the bytes of an incomplete character at
    its end: its text (special tokens with a twin as their content, the others left out) encoded
    once by the level's tokenizer, with its special tokens."""
    own_tokenizer, target_tokenizer = shared.own_tokenizer, shared.target_tokenizer
    pieces: list[bytes] = []
    for token in prompt:
        spelled = shared.target_bytes[token] if token < len(shared.target_bytes) else b""
        if spelled is None:
            twin = shared.target_to_own[token]
            spelled = b"" if twin is None else own_tokenizer.convert_ids_to_tokens(twin).encode()
        pieces.append(spelled)
    data = b"".join(pieces)
    if shared.target_prepends_space and data.startswith(b" ") and prompt and shared.target_bytes[prompt[0]]:
        data = data[1:]  # the space the target's tokenizer put before the text is not part of it
    text, held = split_complete(data)
    ids = list(own_tokenizer(text, add_special_tokens=True)["input_ids"]) if text else []
    bos = getattr(own_tokenizer, "bos_token_id", None)
    if bos is not None and ids[:2] == [bos, bos]:  # the target's BOS as well as the level's own
        ids = ids[1:]
    if not ids:  # an empty text: the level still needs a position to score from
        start = bos if bos is not None else getattr(own_tokenizer, "eos_token_id", None)
        if start is None:
            raise ValueError("a translated level got a prompt with no text, and its tokenizer has no BOS or EOS "
                             "token to start from; give a prompt with some text")
        ids = [start]
    return ids, held


class OwnContext:
    """One row's own tokens for the target's sequence (see the module docs).

    Attributes:
        target: the target's ids translated so far.
        own: the level's ids for them.
        start: the prompt's length; the sequence is never cut before it (a row whose sequence changes
            before it starts again: `follow` says so).
    """

    def __init__(self, shared: SharedVocabulary, prompt: list[int]):
        self.shared = shared
        self.target = list(prompt)
        self.start = len(prompt)
        self.own, held = encode_prompt(shared, self.target)
        self._marks: list[tuple[int, bytes]] = [(len(self.own), held)]  # per target length from start

    def own_length(self, length: int) -> int:
        """The level's length for the target's first ``length`` tokens (``start <= length <= len(target)``)."""
        if length < self.start:
            raise IndexError(f"target length {length} is inside the prompt this row's translation started from "
                             f"({self.start})")
        return self._marks[length - self.start][0]

    @property
    def held(self) -> bytes:
        """The bytes of an incomplete character at the end of the text, not yet in `own`."""
        return self._marks[-1][1]

    def follow(self, sequence: list[int]) -> bool:
        """Translate ``sequence`` (the target's ids): keep what it shares with the tokens translated so
        far, cut the rest, translate what is new. False (nothing changed) where it differs before
        `start`: the row must start again from a new prompt."""
        if sequence[: self.start] != self.target[: self.start] or len(sequence) < self.start:
            return False
        same = self.start
        limit = min(len(sequence), len(self.target))
        if sequence[:limit] != self.target[:limit]:
            while sequence[same] == self.target[same]:
                same += 1
        else:
            same = limit
        self.truncate(same)
        for token in sequence[same:]:
            self._push(token)
        return True

    def truncate(self, length: int) -> None:
        """Forget the target's tokens past ``length`` (at least `start`) and their own tokens."""
        if length >= len(self.target):
            return
        own_length = self.own_length(length)
        del self.target[length:], self.own[own_length:], self._marks[length - self.start + 1 :]

    def _push(self, token: int) -> None:
        shared, (_, held) = self.shared, self._marks[-1]
        spelled = shared.target_bytes[token] if token < len(shared.target_bytes) else b""
        twin = shared.target_to_own[token] if token < len(shared.target_to_own) else None
        if spelled is None:  # a special token: its twin, after whatever was held (which can no longer complete)
            if held:
                self.own.extend(shared.encode_own(held.decode(errors="replace")))
                held = b""
            if twin is not None:
                self.own.append(twin)
        elif twin is not None and not held:
            self.own.append(twin)
        else:
            text, held = split_complete(held + spelled)
            self.own.extend(shared.encode_own(text))
        self.target.append(token)
        self._marks.append((len(self.own), held))
