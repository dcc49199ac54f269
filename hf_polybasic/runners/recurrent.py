"""Hybrid models: putting back the state of recurrent layers after a rejection.

A hybrid model interleaves attention layers with layers that fold every token into a fixed-size
state: Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5, OLMo hybrid), Mamba-2 (Bamba,
Falcon-H1, Nemotron-H, Granite 4.0-H, Zamba 2), Mamba (Jamba) and short convolutions (LFM2).
Attention keys/values are cut token by token (`hf_polybasic.runners.dynamic`); a recurrent state cannot be
cut: the tokens it has absorbed cannot be taken out again.

How it is put back (`StateHistory`): before each forward of such a model its recurrent and
convolution states are copied, with the number of tokens they hold. A rollback to L tokens restores
the latest copy taken at P <= L tokens, cuts the attention layers to P as well, and sets the
model's cached length to P; its next forward then feeds tokens P..L again as part of its input
(`hf_polybasic.runners.dynamic.CachedModel` feeds whatever its cache lacks). So every state, recurrent or
attention, is always exactly what feeding the kept tokens makes it, computed by transformers' own
layer code, and no forward pass is added: the next one is a few tokens longer. A verification
that keeps all drafts restores nothing. Copies older than the last `commit` are dropped (no
rollback reaches before it).

Why this design (measured: ``python -m benchmarks rollback-cost``, docs/howto/hybrid.md): the
alternatives replay the state update over the kept positions from inputs recorded during the
forward, or capture the state after every position inside the layer's kernel. Both need code per
layer kind that mirrors transformers' kernels (and its chunked prefill path differs from its
one-token path), and a replay is a pass of its own, which reads the recurrent layers' weights again;
re-feeding adds the kept tokens to a forward that happens anyway, which on a machine bound by
memory traffic costs little, and is exact by construction.

Not covered, and refused by name (`check_rollback_support`): layers whose state transformers keeps
outside its cache layers (RWKV, RecurrentGemma, xLSTM, MiniMax's lightning attention), unknown
recurrent layers, transformers releases before 5.15 (families kept or continued their state their own ways).
Batches of a hybrid model decode row by row (`batch_refusal_reason`): a shared forward feeds a
row's pads and holes through its recurrent state.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .. import compat
from ..models.fingerprint import PerModel

# A context of this many tokens or more before the positions whose logits are asked (a prompt) is
# fed in a forward of its own first, so that a rejected draft makes the next forward re-feed the
# tokens after the context, not the context itself. Shorter contexts (the usual re-fed tokens, at
# most a round of drafts) ride along with the drafts: a forward of their own would cost more.
CONTEXT_ALONE = 32

# Copies kept between commits: the first one (the state at the last commit) and the latest ones,
# enough for a full round of the bottom model's drafts (at most 16 single-token forwards). A rollback
# older than those restores the first and re-feeds more tokens: still exact.
MAX_SNAPSHOTS = 18


@dataclass(frozen=True)
class LayerKind:
    """A kind of recurrent layer: a short key, its name in messages, the module classes that
    implement it, and whether `StateHistory` rolls it back (else ``cause`` says why not)."""

    key: str
    name: str
    classes: tuple[str, ...]
    covered: bool
    cause: str = ""

    @property
    def steps_one_token(self) -> bool:
        """Whether this release's layer code must be fed one token at a time once it holds a state
        (`hf_polybasic.compat.continues_state_over_several_tokens`)."""
        return self.covered and not compat.continues_state_over_several_tokens(self.key)


GATED_DELTANET = LayerKind(
    "gated_deltanet", "a Gated DeltaNet linear-attention layer",
    ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "OlmoHybridGatedDeltaNet"),
    covered=True,
)
MAMBA2 = LayerKind(
    "mamba2", "a Mamba-2 state-space layer",
    ("BambaMixer", "FalconH1Mixer", "NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer", "Zamba2MambaMixer",
     "Mamba2Mixer"),
    covered=True,
)
MAMBA = LayerKind(
    "mamba", "a Mamba state-space layer", ("JambaMambaMixer", "MambaMixer", "FalconMambaMixer"), covered=True,
)
SHORT_CONVOLUTION = LayerKind(
    "short_convolution", "a short-convolution layer", ("Lfm2ShortConv", "Lfm2MoeShortConv"), covered=True,
)
RWKV = LayerKind(
    "rwkv", "an RWKV time-mix recurrent layer", ("RwkvSelfAttention",), covered=False,
    cause="transformers passes its state between forwards outside any cache (`state`), as a whole",
)
RG_LRU = LayerKind(
    "rg_lru", "an RG-LRU (Griffin) recurrent layer", ("RecurrentGemmaRecurrentBlock",), covered=False,
    cause="transformers keeps its state inside the model's modules, not in a cache",
)
MLSTM = LayerKind(
    "mlstm", "an mLSTM recurrent layer", ("xLSTMLayer", "xLSTMBlock"), covered=False,
    cause="transformers keeps its state in an xLSTMCache, which has no per-layer state hf_polybasic can put back",
)
LIGHTNING = LayerKind(
    "lightning", "a lightning (linear) attention layer", ("MiniMaxLightningAttention",), covered=False,
    cause="transformers keeps its state in a MiniMaxCache outside the shared recurrent cache layers",
)
ZAMBA_MAMBA = LayerKind(
    "zamba_mamba", "a Zamba Mamba state-space layer", ("ZambaMambaMixer",), covered=False,
    cause="hf_polybasic's tests do not check it (a tiny Zamba does not build on transformers 5.23)",
)
KIMI_DELTA = LayerKind(
    "kimi_delta", "a Kimi Delta Attention linear-attention layer", ("KimiDeltaAttention", "KimiLinearDeltaAttention"),
    covered=True,
)
KINDS: tuple[LayerKind, ...] = (GATED_DELTANET, KIMI_DELTA, MAMBA2, MAMBA, SHORT_CONVOLUTION, RWKV, RG_LRU, MLSTM,
                                LIGHTNING, ZAMBA_MAMBA)
UNKNOWN = LayerKind(
    "unknown", "a recurrent layer", (), covered=False,
    cause="it is not a kind hf_polybasic knows how to roll back",
)
STATEFUL = LayerKind(
    "stateful", "a stateful model", (), covered=False,
    cause="transformers marks it as carrying recurrent state, and none of its layers is a kind hf_polybasic knows how "
    "to roll back",
)
_BY_CLASS = {name: kind for kind in KINDS for name in kind.classes}

# config ``layer_types`` entries of layers with recurrent or convolution state
RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba", "recurrent"})


@dataclass(frozen=True)
class RecurrentLayer:
    """Layer ``index`` of a model is a recurrent layer of ``kind``, implemented by ``module`` (a class name)."""

    index: int
    kind: LayerKind
    module: str

    def describe(self) -> str:
        if self.kind is STATEFUL:
            return f"{self.module} is stateful (recurrent state)"
        return f"layer {self.index} is {self.kind.name} ({self.module})"


_LAYER_NUMBER = re.compile(r"(?:^|\.)(?:layers|blocks|h)\.(\d+)(?:\.|$)")


_found = PerModel()  # model -> its recurrent layers (found again when its modules change)


def recurrent_layers(model: torch.nn.Module) -> list[RecurrentLayer]:
    """The model's layers that carry recurrent or convolution state, by layer index: the modules of
    a known kind, then any other layer its config marks as recurrent (``layer_types``), then, for a
    model transformers marks stateful with none of these, the model itself (as layer 0). Found once
    per model (a chain asks at every call)."""
    found = _found.setdefault(model, lambda: _recurrent_layers(model))
    if not found and compat.is_stateful(model):
        return [RecurrentLayer(0, STATEFUL, type(model).__name__)]
    return list(found)


def _recurrent_layers(model: torch.nn.Module) -> list[RecurrentLayer]:
    found: dict[int, RecurrentLayer] = {}
    decoder_layers: dict[int, str] = {}
    for name, module in model.named_modules():
        number = _LAYER_NUMBER.search(name)
        if number is None:
            continue
        index = int(number.group(1))
        decoder_layers.setdefault(index, type(module).__name__)  # the shallowest module of that layer
        kind = _BY_CLASS.get(type(module).__name__)
        if kind is not None and index not in found:
            found[index] = RecurrentLayer(index, kind, type(module).__name__)
    for index, layer_type in enumerate(compat.config_layer_types(model) or ()):
        if layer_type in RECURRENT_LAYER_TYPES and index not in found:
            found[index] = RecurrentLayer(index, UNKNOWN, decoder_layers.get(index, type(model).__name__))
    return [found[index] for index in sorted(found)]


def covered_kinds() -> str:
    """The kinds `StateHistory` rolls back, for messages: "Gated DeltaNet linear-attention, ..."."""
    return ", ".join(kind.name.split(" ", 1)[1].removesuffix(" layer") for kind in KINDS if kind.covered)


def check_rollback_support(model: torch.nn.Module, cache, role: str, layers: list[RecurrentLayer]) -> None:
    """Raise a clear error, naming the layer and its kind, unless every recurrent layer of ``model``
    (``layers``, from `recurrent_layers`) can be rolled back with ``cache``, and every other layer
    of ``cache`` is one `hf_polybasic.runners.dynamic` cuts."""
    for layer in layers:
        if not layer.kind.covered:
            raise ValueError(
                f"{role}: {layer.describe()}, whose state cannot be rolled back after a rejected draft: "
                f"{layer.kind.cause}. hf_polybasic rolls back these kinds: {covered_kinds()}"
            )
    first = layers[0]
    if not compat.HAS_RECURRENT_CACHE_LAYERS:
        raise ValueError(
            f"{role}: {first.describe()}, and transformers {compat.TRANSFORMERS_VERSION} is older than 5.15: before "
            "it, model families kept such state in cache classes of their own (4.57 - 5.4) or continued it in ways "
            "of their own (5.14), which hf_polybasic does not roll back. Hybrid and state-space models need "
            "transformers >= 5.15"
        )
    if not compat.is_dynamic_cache(cache):
        raise ValueError(
            f"{role} uses a {type(cache).__name__}, which cannot be rolled back token by token; use the default "
            "DynamicCache (do not set cache_implementation / pass another cache type)"
        )
    for layer in layers:
        held = cache.layers[layer.index] if layer.index < len(cache.layers) else None
        if not compat.is_recurrent_cache_layer(held):
            what = "no layer" if held is None else f"a {type(held).__name__}"
            raise ValueError(
                f"{role}: {layer.describe()}, but the cache holds {what} there; pass a cache laid out by the model's "
                "config (DynamicCache(config=model.config)), or none"
            )
    for index, held in enumerate(cache.layers):
        if not compat.is_recurrent_cache_layer(held) and type(held) not in compat.ROLLBACK_LAYER_TYPES:
            raise ValueError(
                f"{role}: cache layer {index} is a {type(held).__name__}, which cannot be rolled back after a "
                "rejected draft"
            )


def batch_refusal_reason(model: torch.nn.Module) -> str | None:
    """Why the rows of a batch cannot share forwards of ``model`` (None: they can, as far as its
    recurrent layers go): a shared forward feeds each row's pads and holes through a recurrent
    state, which no attention mask hides."""
    layers = recurrent_layers(model) if isinstance(model, torch.nn.Module) else []
    if not layers:
        return None
    return (
        f"{type(model).__name__} has recurrent layers ({layers[0].describe()}), whose state a forward shared by "
        "rows would advance over the other rows' padding"
    )


class StateHistory:
    """Copies of a one-row cache's recurrent and convolution states, each with the number of tokens
    it holds, taken before each forward and restored by a rollback (see the module's docstring).

    Attributes:
        restored_tokens: tokens dropped by restores beyond those the rollbacks asked for (what the
            next forwards re-feed), for the record.
    """

    def __init__(self, cache, indices: list[int], steps_one_token: bool = False):
        self.cache = cache
        self.indices = indices
        self.steps_one_token = steps_one_token
        self._snapshots: list[tuple[int, list]] = []  # (tokens held, [(layer index, states)]), by tokens
        self._feeding_context = False
        self.restored_tokens = 0

    @classmethod
    def of(cls, model: torch.nn.Module, cache, rows: int, role: str) -> StateHistory | None:
        """The history for ``model``'s ``cache``, or None when it holds no recurrent state."""
        indices = compat.recurrent_layer_indices(cache) if cache is not None else []
        if not indices:
            return None
        if rows != 1:
            raise ValueError(f"{role} has recurrent layers: a batch of it is decoded row by row (one row per cache)")
        return cls(cache, indices, any(layer.kind.steps_one_token for layer in recurrent_layers(model)))

    def forward(self, model: torch.nn.Module):
        """How to run a forward of ``model`` over its cache, called as ``forward(input_ids=,
        position_ids=, <cache>=, **kwargs)`` with the cache under the name the model takes
        (`compat.cache_argument`): the model itself, or a function that drops positions a model
        without attention does not take, and, for a kind whose transformers code cannot continue a
        state over several tokens (`LayerKind.steps_one_token`), feeds them one at a time once the
        cache holds a state."""
        positions = compat.takes_position_ids(model)
        if not (self.steps_one_token or not positions):
            return model

        def call(input_ids, position_ids, **kwargs):
            if positions:
                kwargs["position_ids"] = position_ids
            return model(input_ids=input_ids, **kwargs)

        def forward(input_ids, position_ids, **kwargs):
            if not self.steps_one_token or input_ids.shape[1] == 1 or not compat.holds_recurrent_state(self.cache):
                return call(input_ids, position_ids, **kwargs)
            kwargs.pop("logits_to_keep", None)
            logits = [
                call(input_ids[:, i : i + 1], position_ids[:, i : i + 1], **kwargs).logits
                for i in range(input_ids.shape[1])
            ]
            return SteppedOutput(torch.cat(logits, dim=1))

        return forward

    def before_forward(self, runner, context: torch.LongTensor) -> None:
        """Called by ``runner`` (a one-row `CachedModel`) before a forward whose logits start after
        ``context`` ``[C]``: feed a long context in a forward of its own, then copy the states."""
        if not self._feeding_context and context.shape[0] - runner.lengths[0] >= CONTEXT_ALONE:
            self._feeding_context = True
            try:
                runner.logits_rows({0: (context, 1)})
            finally:
                self._feeding_context = False
        self.snapshot(runner.lengths[0])

    def snapshot(self, length: int) -> None:
        """Copy the states, which hold ``length`` tokens."""
        while self._snapshots and self._snapshots[-1][0] >= length:
            self._snapshots.pop()
        copies = []
        for index in self.indices:
            layer = self.cache.layers[index]
            states = compat.read_recurrent_state(layer)
            compat.write_recurrent_state(layer, states)  # convolution states recorded past the kernel: cut
            copies.append((index, [
                (seen, _copy(conv) if seen else None, _copy(recurrent) if seen else None)
                for seen, conv, recurrent in states
            ]))
        self._snapshots.append((length, copies))
        if len(self._snapshots) > MAX_SNAPSHOTS:
            del self._snapshots[1]

    def restore(self, length: int) -> int:
        """Put back the latest copy holding at most ``length`` tokens; how many tokens it holds (the
        caller cuts its attention layers and its length to that)."""
        while self._snapshots and self._snapshots[-1][0] > length:
            self._snapshots.pop()
        if not self._snapshots:
            raise RuntimeError(
                f"no copy of the recurrent state holds {length} tokens or fewer; this is a bug in hf_polybasic "
                "(a rollback reached before the last commit)"
            )
        held, copies = self._snapshots.pop()  # its tensors become the layers' own: a later forward copies anew
        for index, states in copies:
            compat.write_recurrent_state(self.cache.layers[index], states)
        self.restored_tokens += length - held
        return held

    def commit(self) -> None:
        """No rollback reaches before the tokens cached now: drop every copy."""
        self._snapshots.clear()


def settle(runner, sequence: torch.LongTensor) -> None:
    """Make a one-row runner's cache hold ``sequence`` ``[L]`` but its last token, transformers'
    convention for a cache handed back to the caller: a hybrid model's cache may hold fewer tokens
    after a rejection (its next forward would re-feed them), so they are fed now. A cache continued
    by plain `generate` then gets one new token per forward, as after plain `generate` (transformers
    cannot continue some recurrent kinds over several tokens: `LayerKind.steps_one_token`)."""
    if runner.states is None or runner.lengths[0] >= sequence.shape[0] - 1:
        return
    runner.logits_rows({0: (sequence[:-1], 1)})
    runner.commit()


@dataclass
class SteppedOutput:
    """The logits of a forward fed one token at a time, ``[1, tokens, V]``."""

    logits: torch.Tensor


def _copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.clone()
