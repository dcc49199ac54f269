"""A drafter whose output layer scores only a subset S of the vocabulary: `restricted_vocabulary`.

A small drafter spends a large share of each step in its output layer (Qwen2.5-Coder-0.5B: 896 x
151,936 weights, 27 % of what a forward reads). Its drafts only need to be *likely* tokens; the
level above decides every token. `restricted_vocabulary(model, keep)` returns a view of ``model``
(every weight shared, nothing of the original changed) whose output layer computes the logits of
the token ids in S only and writes -inf for every other id, so the output keeps the full width V
and every logits processor sees the vocabulary it expects. S is

* the ``keep`` first ids of a ranking: by default the ids themselves (BPE tokenizers such as
  Qwen's, GPT-2's and Llama 3's number tokens in merge order, which follows frequency), or a
  ranking you give (most frequent first, e.g. counted on your own traffic);
* every EOS/BOS/PAD id of the model's configs and, given the tokenizer, every special and added
  token;
* every token the model has been fed since its cache was last empty (the prompt and the text so
  far: code copies rare identifiers from its prompt). A forward pre-hook reads ``input_ids`` and
  adds the missing rows (only those are gathered); a forward on an empty cache starts S afresh.

Why the chain stays lossless: greedy, the verifier's argmax decides every token, so a proposal only
changes how many are accepted. Sampling, the drafter samples from its restricted *processed*
distribution (softmax over S after the processors) and reports exactly that as q, so speculative
sampling is exact (`hf_polybasic.decoding.acceptance`); ids outside S have q = 0 and are only ever emitted by the
level above. A position where the processors leave no id of S finite (a forced token, a prefix
constraint or bad words outside S) has no distribution to draw from: the drafter ends its proposal
there and the level above decodes that token itself (`hf_polybasic.decoding.round.ModelDrafter`).

As an intermediate level the view stays exact: what it emits is an exact sample of its own
restricted distribution, which is what it reports upward as q, and the target decides. But a
verifier must emit a token at every position, so with sampling a position where the processors
leave no id of S would stop the call; with such processors (``prefix_allowed_tokens_fn``,
``bad_words_ids``) keep the restricted model at the bottom of the chain.

The restricted layer keeps the original's kind: a float ``nn.Linear`` multiplies a view of its
weight (no copy when S's ranked part is a prefix of the ids), a dynamic int8 layer multiplies an
int8 sub-matrix with the same per-row scales, a oneDNN-packed layer (`hf_polybasic.models.packed`) a packed
sub-matrix; on S its logits are the original's (up to the order of summation). Rows added later
come from the weight itself (float), else from the tied input embedding when it reproduces the
layer exactly (checked once), else from one unpacked copy of the layer's weight kept for them
(untied int8 or packed layers). Apply the transform last, on the model's final device: packing or
quantizing a view changes the modules it shares with the original.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .. import compat
from .fingerprint import PerModel
from .packed import PackedLinear
from .modules import view_replacing
from ..vocabulary import as_id_list

__all__ = ["RestrictedLinear", "drafting_view", "restricted_vocabulary"]

# raised where a verifying level samples and its processors left it no token (a restricted level)
NOTHING_TO_SAMPLE = (
    "{level} has no token left to sample from at a position: its logits processors excluded every token "
    "its output layer scores (a restricted_vocabulary model with bad_words_ids or a similar constraint). "
    "Put the restricted model at the bottom of the chain, where such positions are left to the level above"
)


def dynamic_int8_type() -> type:
    """PyTorch's dynamically quantized int8 ``Linear`` class (imported without its deprecation warning)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    return DynamicLinear


# --- where a restricted block gets its rows, per kind of output layer --------------------------------
class _FloatRows:
    """Rows of a float ``nn.Linear`` (any dtype, any device): views of its weight where possible."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias

    def take(self, ids: torch.LongTensor, prefix: bool = False) -> tuple:
        if prefix:  # ids are 0 .. n-1: a view, nothing copied
            n = ids.shape[0]
            return self.weight[:n], None if self.bias is None else self.bias[:n]
        return self.weight.index_select(0, ids), None if self.bias is None else self.bias.index_select(0, ids)

    @staticmethod
    def build(rows: tuple):
        weight, bias = rows
        return lambda hidden: torch.nn.functional.linear(hidden, weight, bias)


class _Int8Rows:
    """Rows of a dynamic int8 layer (``torch.ao`` ``quantize_dynamic``): int8 values with their
    per-row scales, run by the same fbgemm kernel as the original. Rows come from the tied input
    embedding, re-quantized row by row (per-channel quantization treats rows independently, so they
    come out identical: checked once here), else from one unpacked copy of the int8 weight."""

    def __init__(self, head, embedding: torch.Tensor | None):
        from torch.ao.quantization import per_channel_dynamic_qconfig

        weight, bias = head._packed_params._weight_bias()
        self.bias, self.version = bias, head.version
        self.in_features = head.in_features
        self._observer = per_channel_dynamic_qconfig.weight
        rows = weight.shape[0]
        if weight.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
            scales, zeros = weight.q_per_channel_scales(), weight.q_per_channel_zero_points()
        else:  # per-tensor: the same scale for every row
            scales = torch.full((rows,), weight.q_scale(), dtype=torch.float64)
            zeros = torch.full((rows,), weight.q_zero_point(), dtype=torch.long)
        self._stored = (weight.int_repr(), scales, zeros)
        if embedding is not None and embedding.shape == weight.shape and self._requantize(embedding, None) is not None:
            self._stored = None  # the embedding reproduces every row: keep no copy
            self._embedding = embedding

    def _requantize(self, embedding: torch.Tensor, ids: torch.LongTensor | None):
        """The int8 rows of ``embedding`` (all, or ``ids``), quantized as ``quantize_dynamic`` does;
        with ``ids=None``, None unless they equal the stored rows exactly."""
        source = (embedding if ids is None else embedding.index_select(0, ids)).detach().float()
        observer = self._observer()
        observer(source)
        scales, zeros = observer.calculate_qparams()
        quantized = torch.quantize_per_channel(source, scales.double(), zeros.long(), 0, torch.qint8)
        rows = (quantized.int_repr(), scales.double(), zeros.long())
        if ids is None:
            same = all(torch.equal(a, b) for a, b in zip(rows, self._stored))
            return rows if same else None
        return rows

    def take(self, ids: torch.LongTensor, prefix: bool = False) -> tuple:
        ids = ids.to(torch.long)
        if self._stored is None:
            values, scales, zeros = self._requantize(self._embedding, ids)
        else:
            values, scales, zeros = (part.index_select(0, ids) for part in self._stored)
        return values, scales, zeros, None if self.bias is None else self.bias.index_select(0, ids)

    def build(self, rows: tuple):
        values, scales, zeros, bias = rows
        layer = dynamic_int8_type()(self.in_features, values.shape[0], bias_=bias is not None)
        layer.version = self.version  # the same kernel flags (reduce_range) as the original
        layer.set_weight_bias(torch._make_per_channel_quantized_tensor(values, scales, zeros, 0), bias)
        return layer.forward


class _PackedRows:
    """Rows of a oneDNN-packed layer (`hf_polybasic.models.packed.PackedLinear`), packed again for the block.
    Rows come from the tied input embedding when it holds the same weights, else from one dense copy."""

    def __init__(self, head: PackedLinear, embedding: torch.Tensor | None):
        self.bias, self.dtype = head.bias, head.dtype
        dense = head.packed.to_dense()
        tied = embedding is not None and embedding.shape == dense.shape and torch.equal(embedding.to(self.dtype), dense)
        self._source = embedding if tied else dense

    def take(self, ids: torch.LongTensor, prefix: bool = False) -> tuple:
        weight = self._source.index_select(0, ids).to(self.dtype)
        return weight, None if self.bias is None else self.bias.index_select(0, ids)

    @staticmethod
    def build(rows: tuple):
        weight, bias = rows
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias, requires_grad=False)
        return PackedLinear(linear).forward


def _join(first: tuple, second: tuple) -> tuple:
    """Two blocks' rows (tuples of per-row tensors, or None) as one."""
    return tuple(None if a is None else torch.cat([a, b]) for a, b in zip(first, second))


def _row_source(head: torch.nn.Module, embedding: torch.Tensor | None):
    if type(head) is torch.nn.Linear:
        return _FloatRows(head.weight.detach(), None if head.bias is None else head.bias.detach())
    if isinstance(head, PackedLinear):
        return _PackedRows(head, embedding)
    if isinstance(head, dynamic_int8_type()) and head._packed_params.dtype == torch.qint8:
        return _Int8Rows(head, embedding)
    raise TypeError(
        f"restricted_vocabulary: the output layer is a {type(head).__name__}; supported are float nn.Linear, "
        "dynamic int8 (hf_polybasic.levels.quantized_copy(model, 'int8-dynamic')) and oneDNN-packed "
        "(hf_polybasic.models.packed.pack_linear_layers) layers"
    )


# --- the layer --------------------------------------------------------------------------------------
class RestrictedLinear(torch.nn.Module):
    """An output layer that scores the token ids of S only, -inf for the rest (full width).

    S = ``ranked`` (computed as one block, a weight view when it is 0 .. n-1) plus ``always`` and
    whatever `add` brings in since the last `reset` (one small block, gathered row by row as ids
    arrive). Attributes: ``width`` (V, the original's output features), ``token_ids`` (S, sorted).
    """

    def __init__(self, head: torch.nn.Module, ranked: torch.LongTensor, always: torch.LongTensor,
                 width: int, embedding: torch.Tensor | None = None):
        super().__init__()
        self.width = width
        self._rows = _row_source(head, embedding)
        device = ranked.device
        self._ranked = ranked
        self._prefix = bool(torch.equal(ranked, torch.arange(ranked.shape[0], device=device)))
        self._ranked_block = self._rows.build(self._rows.take(ranked, prefix=self._prefix))
        self._in_ranked = torch.zeros(width, dtype=torch.bool, device=device)
        self._in_ranked[ranked] = True
        self._always = always[~self._in_ranked[always]].unique()
        self.reset()

    @property
    def token_ids(self) -> torch.LongTensor:
        """S, sorted."""
        return torch.cat([self._ranked, self._added]).sort().values

    def __len__(self) -> int:
        return int(self._ranked.shape[0] + self._added.shape[0])

    def reset(self) -> None:
        """S back to the ranked ids and the ones always kept."""
        self._member = self._in_ranked.clone()
        self._member[self._always] = True
        self._added = self._always
        self._added_rows = self._rows.take(self._always) if self._always.numel() else None
        self._added_block = None if self._added_rows is None else self._rows.build(self._added_rows)

    def add(self, ids: torch.Tensor) -> int:
        """Put ``ids`` into S; only rows not there yet are gathered. Returns how many were new."""
        ids = ids.reshape(-1).to(self._member.device)
        ids = ids[(ids >= 0) & (ids < self.width)]
        new = ids[~self._member[ids]].unique()
        if new.numel() == 0:
            return 0
        self._member[new] = True
        rows = self._rows.take(new)
        self._added_rows = rows if self._added_rows is None else _join(self._added_rows, rows)
        self._added = torch.cat([self._added, new])
        self._added_block = self._rows.build(self._added_rows)
        return int(new.numel())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        ranked = self._ranked_block(hidden)  # [..., n]
        out = ranked.new_full((*hidden.shape[:-1], self.width), float("-inf"))
        if self._prefix:
            out[..., : ranked.shape[-1]] = ranked
        else:
            out.index_copy_(-1, self._ranked, ranked)
        if self._added_block is not None:
            out.index_copy_(-1, self._added, self._added_block(hidden).to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return f"width={self.width}, kept={len(self)} (ranked {self._ranked.shape[0]}, added {self._added.shape[0]})"


# --- the transform ---------------------------------------------------------------------------------
def restricted_vocabulary(
    model: torch.nn.Module,
    keep: int = 65536,
    ranking: Sequence[int] | torch.Tensor | None = None,
    tokenizer: Any = None,
    always: Iterable[int] = (),
    grow: bool = True,
) -> torch.nn.Module:
    """A view of ``model`` whose output layer scores only a subset S of the token ids (module docs).

    Args:
        model: a causal LM (used as a drafter; see the module docs for intermediate levels).
        keep: how many ids of ``ranking`` S starts with.
        ranking: token ids, most useful first; default the ids in order (BPE merge order).
        tokenizer: when given, its special and added tokens are always in S.
        always: more ids always in S (EOS, BOS and PAD ids of the model's configs always are).
        grow: add every token the model is fed (prompt and text so far) to S, afresh for each
            sequence started on an empty cache.

    Returns a model sharing every weight with ``model`` (which is not changed), with its own
    module tables (hooks on ``model`` do not fire for it); its output layer is a `RestrictedLinear`.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise TypeError(f"restricted_vocabulary: {type(model).__name__} has no output layer (get_output_embeddings)")
    width = _out_features(head)
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"restricted_vocabulary: keep must be an int >= 1, got {keep!r}")
    device = next(model.parameters()).device
    if ranking is None:
        ranked = torch.arange(min(keep, width), device=device)
    else:
        order = list(dict.fromkeys(as_id_list(ranking)))  # first occurrence of each id, in order
        if any(not 0 <= i < width for i in order):
            raise ValueError(f"restricted_vocabulary: ranking holds ids outside 0 .. {width - 1}")
        ranked = torch.tensor(order[:keep], dtype=torch.long, device=device)
    kept = torch.tensor(sorted(_always_kept(model, tokenizer, always, width)), dtype=torch.long, device=device)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    embedding = getattr(embeddings, "weight", None) if isinstance(embeddings, torch.nn.Embedding) else None
    restricted = RestrictedLinear(head, ranked, kept, width, embedding)

    # the output layer's place in a view of the model, the modules on the way to it viewed too
    view = view_replacing(model, type(head), lambda _: restricted, chosen=lambda module: module is head)
    if view is model:
        raise TypeError("restricted_vocabulary: the output layer is not a submodule of the model")
    if grow:
        view.register_forward_pre_hook(_grow_hook(restricted), with_kwargs=True)
    return view


def _out_features(head: torch.nn.Module) -> int:
    width = getattr(head, "out_features", None)
    if width is None:
        raise TypeError(f"restricted_vocabulary: cannot tell the width of a {type(head).__name__} output layer")
    return int(width)


def _always_kept(model, tokenizer, extra: Iterable[int], width: int) -> set[int]:
    ids = set(as_id_list(list(extra)))
    for config in (model.config, getattr(model, "generation_config", None)):
        for name in ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id"):
            ids.update(as_id_list(getattr(config, name, None)))
    if tokenizer is not None:
        ids.update(tokenizer.all_special_ids)
        ids.update(getattr(tokenizer, "added_tokens_decoder", {}).keys())
    return {i for i in ids if 0 <= i < width}


def _grow_hook(restricted: RestrictedLinear):
    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        cache = compat.given_cache(kwargs)  # under the name the model takes (`compat.cache_argument`)
        if cache is not None and cache.get_seq_length() == 0:
            restricted.reset()  # a new sequence: S starts again from the ranked and always-kept ids
        restricted.add(ids)

    return hook


# --- the view a chain drafts through by default (PolybasicConfig.drafter_vocabulary) ------------------
_views = threading.local()  # per thread: S is the state of one decoding at a time


def drafting_view(model: torch.nn.Module, keep: int) -> torch.nn.Module | None:
    """``restricted_vocabulary(model, keep)`` for a chain's bottom model, made once per model, ``keep``
    and thread, and again once the model has changed (`hf_polybasic.models.fingerprint`: a view holds
    the rows of the output layer it was made from, so a cast, a move or an in-place quantization of the
    model makes a new one); None where it would not pay or would change how the model runs: an output
    layer narrower than ``2 * keep`` or of a kind `restricted_vocabulary` does not handle, or forward
    hooks on the model itself (accelerate's device hooks live there; a view does not run them)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    width = getattr(head, "out_features", None)
    if head is None or width is None or width < 2 * keep or model._forward_hooks or model._forward_pre_hooks:
        return None
    if not (type(head) is torch.nn.Linear or isinstance(head, (PackedLinear, dynamic_int8_type()))):
        return None
    views = getattr(_views, "by_model", None)
    if views is None:
        views = _views.by_model = PerModel()
    made = views.setdefault(model, dict)
    if keep not in made:
        made[keep] = restricted_vocabulary(model, keep)
    return made[keep]
