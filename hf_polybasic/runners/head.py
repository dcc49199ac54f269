"""A trained draft head run as a level: fed its verifier's features, cached and rolled back like a model.

A head (`hf_polybasic.heads.base.DraftHead`) reads, at head position ``p``, the token at sequence position
``p + 1`` and the *feature* of position ``p``. `HeadRunner` serves the runner protocol
(`hf_polybasic.decoding.protocol.Runner`) over the sequence itself, so a `ModelDrafter` drafts with a
head as with any model, and a `Verifier` could score with one:

1. **Features** of a position are, in this order of preference: *real*, the hidden states the level
   above computed there (its runner keeps them from the forwards it runs anyway,
   `hf_polybasic.runners.features`), projected by the head; zeros for positions that were cached before
   any feature was kept (a filled cache handed in); *predicted*, the head's own output at the
   position before (the tokens it drafted, and the level above's own tokens it never fed). A position
   with none of these waits for the forward that predicts it: positions are fed in passes, each as
   far as features are known.
2. **The head's cache** is an ordinary runner (`CachedModel` or `StaticRunner`) over `HeadModel`, the
   head dressed as a causal LM over the sequence shifted by one. Where the level above has since
   computed real features for positions the head built on predicted ones (the drafts it accepted),
   the head's cache is rolled back to them and they are fed again (EAGLE's ``stable_kv``).
3. **Catching up**: at the first round the level above has fed nothing yet; the head asks it to
   feed the row's sequence but its last token (tokens it would feed in its next forward anyway).

Exact whatever the features are: the head's drafts are sampled from the logits it reports, and a
feature only ever depends on the row's tokens so far and on what came before.
"""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from .base import to_target_vocabulary


class HeadModel(torch.nn.Module):
    """A `DraftHead` as the runners drive a causal LM: ``input_ids`` are the tokens at head positions,
    the features come from ``feed`` (``position_ids [B, n] -> [B, n, hidden]``, set around each
    forward by `HeadRunner`; zeros without one: what cost measuring and probes see), and the
    logits it returns carry the head's ``hidden`` behind the vocabulary: ``[B, n, V + hidden]``."""

    def __init__(self, head, name: str = "", verifier=None):
        super().__init__()
        self.head = head
        # the model the head was trained for (what `teacher_forced` reads features from): not a submodule,
        # so nothing done to the head (`.to`, `.half`) reaches the user's model
        self._verifier = (verifier,)
        self.config = copy.copy(head.decoder_config)
        self.config.vocab_size = head.vocab_size
        self.config.name_or_path = name
        for special in ("bos_token_id", "eos_token_id", "pad_token_id"):  # a head has no tokenizer of its own
            setattr(self.config, special, None)
        self.generation_config = GenerationConfig()
        self.feed = None

    @property
    def device(self) -> torch.device:
        return next(self.head.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(p.dtype for p in self.head.parameters() if p.is_floating_point())

    def forward(self, input_ids: torch.LongTensor, position_ids: torch.LongTensor | None = None,
                attention_mask: torch.Tensor | None = None, use_cache: bool = True, logits_to_keep: int = 0,
                **kwargs) -> CausalLMOutputWithPast:
        cache = kwargs.pop("cache", kwargs.pop("past_key_values", None))  # the release's name for it
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        features = None if self.feed is None else _fed(self.feed, position_ids)
        if features is None:
            features = torch.zeros(*input_ids.shape, self.head.hidden_size, dtype=self.dtype, device=input_ids.device)
        logits, hidden = self.head(input_ids, features, position_ids=position_ids + self.head.position_offset,
                                   attention_mask=attention_mask, cache=cache, use_cache=use_cache)
        return CausalLMOutputWithPast(logits=torch.cat([logits, hidden.to(logits.dtype)], dim=-1))


    @torch.no_grad()
    def teacher_forced(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """Logits ``[B, L, V]`` of the token after each of ``input_ids`` ``[B, L]``, every feature real: the
        hidden states of the model the head was trained for over the same text (what the planner reads
        of a head). The first position's has nothing to draft from: uniform (zeros)."""
        (verifier,) = self._verifier
        if verifier is None:
            raise ValueError("this head was made without its verifier; make it with draft_head(..., verifier=model)")
        outputs = verifier(input_ids=input_ids.to(verifier.device), output_hidden_states=True)
        real = torch.cat([outputs.hidden_states[layer] for layer in self.head.feature_layers], dim=-1)
        count = input_ids.shape[1] - 1
        first = torch.zeros(input_ids.shape[0], 1, self.head.vocab_size, device=self.device)
        if not count:
            return first
        positions = torch.arange(count, device=self.device).expand(input_ids.shape[0], count)
        features = self.head.project(real[:, :count].to(device=self.device, dtype=self.dtype))
        logits, _ = self.head(input_ids[:, 1:].to(self.device), features, attention_mask=None, cache=None,
                              position_ids=positions + self.head.position_offset, use_cache=False)
        return torch.cat([first, logits.float()], dim=1)


@torch.compiler.disable
def _fed(feed, position_ids: torch.LongTensor) -> torch.Tensor:
    """``feed(position_ids)``, never traced: a compiled forward of the head would guard on what this
    round's feed holds (each row's first position, its table's length) and make a graph per round,
    until dynamo's recompile limit stopped compiling it (`hf_polybasic.runners.fallback`)."""
    return feed(position_ids)


def head_source(runner, role: str):
    """The runner of the level above a head, which keeps the features the head reads: a model's.
    Raises a clear error where the level above is no model (a `Drafter`) or a head itself."""
    if runner is None or isinstance(runner, HeadRunner) or not hasattr(runner, "capture_features"):
        raise ValueError(f"{role} is a draft head: it drafts from the hidden states of the model right above it in "
                         "assistant_models (or the target); put it right below a model, not below a Drafter or "
                         "another head")
    return runner


class HeadRunner:
    """The runner protocol for a head (see the module docstring) over ``inner``, a runner of its
    `HeadModel` (made with no vocabulary limit: the hidden rides behind the logits), reading the
    features that ``source`` (the runner of the level above) keeps. Lengths are the sequence's: a
    head holding positions ``0 .. h - 1`` holds ``h + 1`` tokens of it."""

    states = None

    def __init__(self, inner, source, vocab_limit: int | None = None):
        self.inner, self.source, self.vocab_limit = inner, source, vocab_limit
        self.model, self.role, self.device, self.rows = inner.model, inner.role, inner.device, inner.rows
        self.head = inner.model.head
        self.features = source.capture_features(self.head.feature_layers)
        self._predicted: list[dict[int, torch.Tensor]] = [{} for _ in range(self.rows)]  # position -> [hidden]
        self._real = [0] * self.rows  # head positions 0 .. real - 1 were built on real (or zero) features

    # --- what the chain reads of a runner -----------------------------------------------------------
    @property
    def lengths(self) -> list[int]:
        """Per row, tokens of its sequence the head holds as it will stand at the next forward (the
        positions built on predicted features that now have real ones are fed again)."""
        return [self._held(row) + 1 if self._held(row) else 0 for row in range(self.rows)]

    @property
    def forward_passes(self) -> int:
        return self.inner.forward_passes

    @property
    def live_rows(self) -> int:
        return self.inner.live_rows

    @property
    def checks_ids(self) -> bool:
        return self.inner.checks_ids

    @property
    def cost_observer(self):
        return self.inner.cost_observer

    @cost_observer.setter
    def cost_observer(self, observer) -> None:
        self.inner.cost_observer = observer

    # --- features -------------------------------------------------------------------------------------
    def _held(self, row: int) -> int:
        """Head positions the inner cache holds that stay valid: up to the first built on a predicted
        feature where a real one is now known."""
        held = self.inner.lengths[row]
        if held > self._real[row] and self.features.length(row) > self._real[row]:
            return self._real[row]
        return held

    def _kind(self, row: int, position: int) -> str | None:
        """Where the feature of ``position`` comes from: "real", "zero", "predicted", or None (not known yet)."""
        store = self.features
        if store.known_from(row) <= position < store.length(row):
            return "real"
        if position < store.known_from(row) or (position >= store.length(row) and position < self.source.lengths[row]
                                                  and store.length(row) == 0):
            return "zero"  # cached before features were kept
        if position in self._predicted[row]:
            return "predicted"
        return None

    def _features(self, row: int, start: int, end: int) -> torch.Tensor:
        """``[end - start, hidden]`` the features of head positions ``start .. end - 1`` (all known)."""
        head, pieces, position = self.head, [], start
        dtype, device = self.model.dtype, self.model.device
        while position < end:
            kind = self._kind(row, position)
            stop = position + 1
            while stop < end and self._kind(row, stop) == kind and kind != "predicted":
                stop += 1
            if kind == "real":
                pieces.append(head.project(self.features.read(row, position, stop).to(device=device, dtype=dtype)))
            elif kind == "zero":
                pieces.append(torch.zeros(stop - position, head.hidden_size, dtype=dtype, device=device))
            else:
                pieces.append(self._predicted[row][position].to(dtype).unsqueeze(0))
            position = stop
        return torch.cat(pieces)

    def _catch_up_source(self, requests: dict[int, tuple[torch.LongTensor, int]]) -> None:
        """Where a row's first position to feed has no feature and none can be predicted (nothing
        before it is held: the first round), the level above feeds the row's sequence but its last
        token, which its next forward would feed anyway."""
        behind = {}
        for row, (sequence, _) in requests.items():
            first = self._held(row)
            if first < sequence.shape[0] - 1 and self._kind(row, first) is None \
                    and self.source.lengths[row] < sequence.shape[0] - 1:
                behind[row] = (sequence[:-1], 1)
        if behind:
            self.source.logits_rows(behind)

    # --- the runner protocol --------------------------------------------------------------------------
    def logits_rows(self, requests: dict[int, tuple[torch.LongTensor, int]]) -> dict[int, torch.Tensor]:
        """``{row: (sequence [L], num_positions)}`` -> ``{row: [num_positions, V]}``, in as few forwards
        of the head as its features allow (one, unless it scores a block past its known features:
        then one per position, each predicting the next position's feature)."""
        self._catch_up_source(requests)
        for row in requests:  # positions built on predicted features that now have real ones are fed again
            if self._held(row) < self.inner.lengths[row]:
                self.rollback_rows({row: self._held(row) + 1})
        wanted = {row: [] for row in requests}  # each row's logits, pass by pass
        targets = {row: (sequence[1:], sequence.shape[0] - 1 - n) for row, (sequence, n) in requests.items()}
        for row, (shifted, first) in targets.items():
            if first < 0:  # a position before the first token: nothing to draft from (uniform)
                wanted[row].append(torch.zeros(-first, self.head.vocab_size, device=self.device))
            if self.inner.lengths[row] > max(first, 0):
                self.rollback_rows({row: max(first, 0) + 1})
        pending = {row for row, (shifted, _) in targets.items() if self.inner.lengths[row] < shifted.shape[0]}
        while pending:
            span = {}
            for row in pending:
                shifted, first = targets[row]
                start = self.inner.lengths[row]
                stop = start + 1
                while stop < shifted.shape[0] and self._kind(row, stop) in ("real", "zero"):
                    stop += 1
                span[row] = (start, stop)
            out = self._pass({row: (targets[row][0][:stop], start, stop) for row, (start, stop) in span.items()})
            for row, (start, stop) in span.items():
                first = max(targets[row][1], 0)
                if stop > first:
                    wanted[row].append(out[row][max(first - start, 0):, : self.head.vocab_size])
            pending = {row for row in pending if self.inner.lengths[row] < targets[row][0].shape[0]}
        return {row: to_target_vocabulary(torch.cat(pieces), self.vocab_limit) for row, pieces in wanted.items()}

    def _pass(self, spans: dict[int, tuple[torch.LongTensor, int, int]]) -> dict[int, torch.Tensor]:
        """One forward of the head: each row's shifted sequence up to ``stop``, head positions ``start ..
        stop - 1`` fed (every feature known); returns each row's ``[stop - start, V + hidden]`` and keeps
        each position's hidden as the next position's predicted feature."""
        tables = {row: (start, self._features(row, start, stop)) for row, (_, start, stop) in spans.items()}
        order = self.inner.batch_rows()

        def feed(position_ids: torch.LongTensor) -> torch.Tensor:  # [B, n] -> [B, n, hidden]
            out = torch.zeros(*position_ids.shape, self.head.hidden_size, dtype=self.model.dtype,
                              device=position_ids.device)
            for index, row in enumerate(order):
                if row in tables:
                    start, table = tables[row]
                    out[index] = table[(position_ids[index] - start).clamp(0, table.shape[0] - 1)]
            return out

        self.model.feed = feed
        try:
            out = self.inner.logits_rows({row: (shifted, stop - start) for row, (shifted, start, stop) in spans.items()})
        finally:
            self.model.feed = None
        vocab = self.head.vocab_size
        for row, (_, start, stop) in spans.items():
            real = all(self._kind(row, position) in ("real", "zero") for position in range(start, stop))
            if self._real[row] >= start and real:
                self._real[row] = stop
            for offset, position in enumerate(range(start + 1, stop + 1)):
                self._predicted[row][position] = out[row][offset, vocab:]
        return out

    def rollback_rows(self, lengths: dict[int, int]) -> None:
        """Forget each row's tokens past its length: head positions from ``length - 1`` on."""
        held = {row: max(length - 1, 0) for row, length in lengths.items()}
        self.inner.rollback_rows(held)
        for row, length in held.items():
            self._real[row] = min(self._real[row], self.inner.lengths[row])
            predicted = self._predicted[row]
            for position in [p for p in predicted if p > self.inner.lengths[row]]:
                del predicted[position]

    def release_rows(self, rows) -> None:
        self.inner.release_rows(rows)
        for row in rows:
            self._predicted[row] = {}

    def commit(self) -> None:
        """Everything held is final; predicted features below what the head holds are not read again."""
        self.inner.commit()
        for row in range(self.rows):
            predicted, held = self._predicted[row], self.inner.lengths[row]
            for position in [p for p in predicted if p < held]:
                del predicted[position]

    def prefill_repeated(self, prompts: dict[int, torch.LongTensor], repeats: int) -> None:
        """Nothing ahead of time: the head reads the level above's features of the prompts at its first draft."""

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()
