"""A level's model on a preallocated cache: forwards of a few fixed shapes, so they can be compiled
(and on a GPU captured as CUDA graphs).

`StaticRunner` serves the same runner protocol as `hf_polybasic.runners.dynamic.CachedModel`
(`hf_polybasic.decoding.protocol.Runner`; the half they share is `hf_polybasic.runners.base.RunnerBase`):
the chain does not know which one it drives.

Layout, per row of the batch: the token at position p lives in slot p of the row's part of a
preallocated cache ``[rows, heads, capacity, head_dim]`` (`SlotCache`). A forward writes each row's
new tokens at their own positions (a per-row scatter), so rows of different lengths never need
realigning, and a query at position p attends to slots ``<= p`` of its row, through a mask built
from the write positions. Hence:

* **a rollback is free**: a row's length just gets shorter. A slot past a row's length is hidden
  from every query that can still come before it is written again (the next forward writes the
  row's tokens from its length on, before its queries attend), as in gpt-fast;
* **widths are bucketed**: a forward of k tokens per row is padded to the next of `WIDTHS`
  with trailing pad tokens (their logits dropped, their keys written past the row's length, so
  never seen); a wider one (a catch-up after a level sat out) runs as several of the widest.
  Together with the fixed capacity, a compiled forward meets a handful of shapes: one graph per
  (width, rows) that decoding uses, made the first time it comes up; only a prompt's prefill, once
  per call and of any width, runs uncompiled;
* **one cache per model and batch size**, kept between calls (`take_cache`): a compiled graph is
  tied to its cache's tensors, so a later call, whatever its prompt and budget, replays the same
  graphs as long as it fits; a call that does not fit gets a cache of the next capacity tier
  (`capacity_for`: powers of two), which then replaces the smaller one. Compiling a graph is never
  timed into the cost curves.

Which models it takes is checked, not assumed (`hf_polybasic.runners.probe.static_problem`): attention over
one cache layer kind without windows, no recurrent state, an attention implementation that takes an
explicit mask (sdpa, eager), and a probe on a few tokens (rollbacks, two rows of different lengths)
whose logits must equal full forwards'. Anything else keeps the dynamic runner, with the reason said.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Callable

import torch

from .. import compat
from ..models.fingerprint import PerModel
from .base import RunnerBase
from .fallback import compile_failure, record_failure
from ..timing import DEFAULT_CLOCK, Clock
from .transfer import upload
from ..user_warnings import warn

# Widths a forward is padded to (tokens per row); a wider one runs as several forwards of the
# widest, except a prompt's prefill, which runs uncompiled at its own width.
WIDTHS = (1, 2, 4, 8, 16, 32, 64)
# The smallest capacity of a cache; larger ones are the powers of two above it (a handful of tiers,
# so a process meets few caches, each with its own graphs).
CAPACITY_STEP = 256


def bucket(width: int, widths: tuple[int, ...] = WIDTHS) -> int:
    """The smallest of ``widths`` that holds ``width`` tokens, or ``width`` itself beyond the largest."""
    for size in widths:
        if size >= width:
            return size
    return width


def capacity_for(max_length: int, widths: tuple[int, ...] = WIDTHS) -> int:
    """Slots a row needs to decode up to ``max_length`` tokens (the last forward's padding included,
    and the one token past the budget an intermediate level's verification may score), rounded up
    to a tier: `CAPACITY_STEP` or a power of two above it."""
    needed = max_length + 1 + max(widths)
    capacity = CAPACITY_STEP
    while capacity < needed:
        capacity *= 2
    return capacity


class SlotCache(compat.CacheBase):
    """A transformers `Cache` whose layers keep ``[rows, heads, capacity, dim]`` keys and values and
    write each new token at the slot `write_slots` ``[rows, width]`` names (set before each forward);
    every forward attends over all ``capacity`` slots (the mask says which it sees)."""

    def __init__(self, num_layers: int, capacity: int, rows: int):
        self.capacity, self.rows = capacity, rows
        self.write_slots: torch.Tensor | None = None  # [rows, width] for the next forward
        self.compiled_widths: set[int] = set()  # widths a compiled forward has made a graph for, on this cache
        self.graph_runs: collections.Counter = collections.Counter()  # compiled forwards per width, on this cache
        super().__init__(layers=[SlotLayer(self, capacity) for _ in range(num_layers)])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are given with every forward; nothing reads them off this cache

    @property
    def allocated(self) -> bool:
        """Whether every layer has its tensors (a first forward allocates them)."""
        return all(layer.is_initialized for layer in self.layers)

    @property
    def is_compileable(self) -> bool:
        return True


class SlotLayer(compat.CacheLayerBase):
    """One layer of a `SlotCache` (allocated at its first update, then written in place)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: SlotCache, capacity: int):
        super().__init__()
        self.owner = weakref.proxy(owner)
        self.max_cache_len = capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        value_states = key_states if value_states is None else value_states
        rows, heads = key_states.shape[:2]
        self.keys = key_states.new_zeros(rows, heads, self.max_cache_len, key_states.shape[-1])
        self.values = value_states.new_zeros(rows, value_states.shape[1], self.max_cache_len, value_states.shape[-1])
        self.dtype, self.device = key_states.dtype, key_states.device
        if not torch.compiler.is_compiling():  # fixed addresses: CUDA graphs read and write them in place
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.values)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        slots = self.owner.write_slots  # [rows, width]
        rows, width = slots.shape
        self.keys.scatter_(2, slots.view(rows, 1, width, 1).expand_as(key_states), key_states)
        self.values.scatter_(2, slots.view(rows, 1, width, 1).expand_as(value_states), value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return 0

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        """Nothing to clear: a slot is written before any query can see it."""


def _forward(float_mask: bool, cache_name: str, layers: tuple[int, ...] | None = None) -> Callable:
    """The function a runner calls (and compiles): logits ``[rows, width, V]`` of ``model`` for
    ``input_ids`` ``[rows, width]`` at ``position_ids``, written to the cache at ``slots``; query j of
    row b attends to the slots ``<= slots[b, j]``. With ``layers`` (a draft head reads them), the
    pair (logits, the hidden states they select, concatenated ``[rows, width, F]``), out of the same
    forward (and graph). The model is an argument, not a closure: a compiled forward kept per model
    must not keep its model alive."""

    def forward(model, input_ids, position_ids, slots, cache):
        visible = visible_slots(slots, cache.capacity)
        if float_mask:  # an additive mask, for attention that adds it to the scores
            dtype = cache_dtype(model)
            visible = torch.zeros(visible.shape, dtype=dtype, device=slots.device).masked_fill(
                ~visible, torch.finfo(dtype).min)
        outputs = model(input_ids=input_ids, position_ids=position_ids, attention_mask=visible,
                        use_cache=True, output_hidden_states=layers is not None, **{cache_name: cache})
        if layers is None:
            return outputs.logits
        return outputs.logits, torch.cat([outputs.hidden_states[layer] for layer in layers], dim=-1)

    return forward


def visible_slots(slots: torch.Tensor, capacity: int) -> torch.Tensor:
    """The attention mask ``[rows, 1, width, capacity]``: the token written at slot ``slots[b, j]``
    sees the slots of its row up to its own (the causal mask, over the whole cache)."""
    return torch.arange(capacity, device=slots.device).view(1, 1, 1, -1) <= slots.unsqueeze(1).unsqueeze(-1)


def cache_dtype(model) -> torch.dtype:
    """The dtype of the model's attention scores (its first floating parameter's)."""
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


# --- compiled forwards, made once per model and reused by every call --------------------------------
# (as long as the model stays what they were made for: `hf_polybasic.models.fingerprint`)
_compiled = PerModel()
_compiled_lock = threading.Lock()


def compile_options(device: torch.device) -> dict:
    """``torch.compile``'s options for forwards on ``device``: CUDA graphs on a GPU (mode
    ``"reduce-overhead"``), inductor's default elsewhere; shapes never dynamic (one graph per width)."""
    return {"mode": "reduce-overhead" if torch.device(device).type == "cuda" else None, "dynamic": False}


# graphs a compiled forward may keep: one per width and batch size (dynamo's default allows 8 per
# function; each model's forward is a function of its own)
GRAPHS_PER_MODEL = 8 * len(WIDTHS)
# forwards of a new graph that are not timed into the cost curves, by device type: the one that
# compiles it and, on a GPU, the one that captures its CUDA graph (mode "reduce-overhead" warms up at
# the first run, records at the second); only replays price a compiled forward
GRAPH_SETUP_RUNS = {"cuda": 2}


def forward_for(model, compiled: bool, float_mask: bool, layers: tuple[int, ...] | None = None) -> Callable:
    """The model's forward for a `StaticRunner`: compiled once per (model, mask kind, hidden states
    kept) and kept while the model lives and stays what it was (a later call reuses its graphs), or
    plain."""
    forward = _forward(float_mask, compat.cache_argument(model), layers)
    if not compiled:
        return forward
    with _compiled_lock:
        kinds = _compiled.setdefault(model, dict)
        if (float_mask, layers) not in kinds:
            # a code object of its own: dynamo keeps (and counts) graphs per code object, so each
            # model's graphs neither evict nor count against another's
            forward.__code__ = forward.__code__.replace()
            kinds[float_mask, layers] = _with_graph_limit(torch.compile(forward, **compile_options(model.device)))
        return kinds[float_mask, layers]


_graphs_made = PerModel()  # model -> graphs its forwards made (since it was last changed)
_warned_graph_limit: set[str] = set()


def _may_make_graph(model, role: str) -> bool:
    """Whether ``model``'s compiled forward may make one more graph (`GRAPHS_PER_MODEL`); when it may
    not, the forward runs uncompiled, said in a warning once per model kind, never silently."""
    with _compiled_lock:
        made = _graphs_made.get(model, 0)
        if made < GRAPHS_PER_MODEL:
            _graphs_made.put(model, made + 1)
            return True
    kind = type(model).__name__
    if kind not in _warned_graph_limit:
        _warned_graph_limit.add(kind)
        warn(
            f"hf_polybasic: {role} has made {GRAPHS_PER_MODEL} compiled graphs (GRAPHS_PER_MODEL: one per width, "
            "batch size and cache tier); forwards of new shapes now run uncompiled. Calls of fewer distinct batch "
            "sizes and budgets keep every forward compiled")
    return False


def _with_graph_limit(compiled: Callable) -> Callable:
    """``compiled`` allowed `GRAPHS_PER_MODEL` graphs (dynamo's limit, set around our calls only). A frame
    past the limit raises (dynamo would run it uncompiled, saying so only in its log), so the runner
    falls back and says so (`hf_polybasic.runners.fallback`); unless the user asked dynamo to suppress
    its errors (then dynamo runs failing frames uncompiled itself)."""

    def call(*args):
        config = torch._dynamo.config
        with config.patch(recompile_limit=GRAPHS_PER_MODEL, fail_on_recompile_limit_hit=not config.suppress_errors):
            return compiled(*args)

    return call


# --- caches, kept per model and reused by later calls (a compiled graph keeps their addresses) -------
# A cache's tensors take the dtype and device of the model's keys at its first forward: one kept for a
# model is found only while the model is what it was (`hf_polybasic.models.fingerprint`).
_pool = PerModel()
_pool_lock = threading.Lock()


def take_cache(model, rows: int, capacity: int) -> SlotCache:
    """A `SlotCache` for ``rows`` rows of ``model`` with at least ``capacity`` slots each: the one a
    finished call gave back if it is large enough and the model has not changed since (its graphs
    come with it), else a new one. While a call holds it no other call can take it."""
    with _pool_lock:
        kept = _pool.get(model, {})
        free = kept.get(rows)
        if free is not None and free.capacity >= capacity:
            return kept.pop(rows)
    return SlotCache(compat.decoder_layer_count(model), capacity, rows)


def return_cache(model, cache: SlotCache) -> None:
    """Give a cache back for later calls: one kept per model and batch size, the largest (those kept
    before a change of the model are dropped)."""
    with _pool_lock:
        kept = _pool.setdefault(model, dict)
        if cache.rows not in kept or kept[cache.rows].capacity < cache.capacity:
            kept[cache.rows] = cache


class StaticRunner(RunnerBase):
    """A causal LM on a `SlotCache`, fed incrementally along the token sequences of ``rows`` rows
    (see the module docstring for the layout). Its model has no recurrent state (such models keep
    the dynamic runner), so `states` stays None.

    ``compiled``: forwards of a bucketed width run through ``torch.compile`` (one graph per bucket and
    batch size, made once per model). ``capacity``: slots per row, at least the longest sequence the
    chain will feed plus the widest bucket (`capacity_for`).

    Attributes (beside `RunnerBase`'s):
        forward_widths: the padded width of each decoding forward (its shape: one graph each when
            compiled), for the statistics; prefills are not counted.
        fallback: why compiled forwards of the model failed (in this call or an earlier one of the
            process), after which they run uncompiled (`hf_polybasic.runners.fallback`); else None.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        role: str,
        capacity: int,
        vocab_limit: int | None = None,
        clock: Clock = DEFAULT_CLOCK,
        rows: int = 1,
        compiled: bool = False,
        widths: tuple[int, ...] = WIDTHS,
    ):
        super().__init__(model, role, vocab_limit, clock, rows)
        self.capacity = capacity
        self.widths = widths
        self.cache: SlotCache | None = None  # taken at the first forward (`take_cache`), given back by `close`
        self._live = [True] * rows
        self.forward_widths: list[int] = []
        self.fallback = compile_failure(model) if compiled else None
        self.compiled = compiled and self.fallback is None
        self._float_mask = compat.attention_implementation(model) != "sdpa"
        self._make_forwards()

    def _make_forwards(self, layers: tuple[int, ...] | None = None) -> None:
        self._plain = forward_for(self.model, False, self._float_mask, layers)
        self._compiled = forward_for(self.model, True, self._float_mask, layers) if self.compiled else None

    def capture_features(self, layers: tuple[int, ...]):
        """`RunnerBase.capture_features`; the hidden states come out of the same forwards (graphs)."""
        store = super().capture_features(layers)
        self._make_forwards(store.layers)
        return store

    def batch_rows(self) -> list[int]:
        """The row at each index of the batch a forward feeds: every row (released ones feed pads)."""
        return list(range(self.rows))

    def close(self) -> None:
        """Give the cache back for later calls (the runner is not used afterwards)."""
        if self.cache is not None:
            return_cache(self.model, self.cache)
            self.cache = None

    @property
    def slots(self) -> int:
        """Slots a forward attends before its own (each row's tokens sit at their positions)."""
        return max(self.lengths)

    def _live_rows(self) -> list[int]:
        return [row for row in range(self.rows) if self._live[row]]

    def logits_rows(self, requests: dict[int, tuple[torch.LongTensor, int]]) -> dict[int, torch.Tensor]:
        """``{row: (sequence [L], num_positions)}`` -> ``{row: [num_positions, V]}``, one forward for
        every row of the batch (rows not asked feed only pads), or several of the widest width when
        a row has more new tokens than that (a catch-up: each forward's graph is one decoding uses)."""
        if self.cache is None:
            self.cache = take_cache(self.model, self.rows, self.capacity)
        fed = {}
        for row, (sequence, num_positions) in requests.items():
            self.lengths[row] = min(self.lengths[row], sequence.shape[0] - num_positions)
            fed[row] = sequence[self.lengths[row] :]
        prefill = any(self.lengths[row] == 0 for row in requests)
        self._check_ids(fed.values())
        needed, widest = max(int(tokens.shape[0]) for tokens in fed.values()), max(self.widths)
        parts = {row: [] for row in requests}  # each row's wanted logits, forward by forward
        for start in [0] if prefill else range(0, needed, widest):
            chunk = {row: tokens[start : None if prefill else start + widest] for row, tokens in fed.items()
                     if tokens.shape[0] > start}
            logits = self._forward(chunk, prefill)  # [rows, width, V]
            self._keep_features(self._hidden, {row: (row, 0, int(tokens.shape[0])) for row, tokens in chunk.items()})
            for row, tokens in chunk.items():
                count = int(tokens.shape[0])
                first = max(int(fed[row].shape[0]) - requests[row][1] - start, 0)  # first wanted position here
                if first < count:
                    # a copy, always: a CUDA graph's output is overwritten by its next replay
                    parts[row].append(logits[row, first:count, : self.vocab_limit].to(torch.float32, copy=True))
                self.lengths[row] += count
        return {row: self._to_target_vocabulary(torch.cat(parts[row])) for row in requests}

    def _forward(self, fed: dict[int, torch.LongTensor], prefill: bool) -> torch.Tensor:
        """Logits ``[rows, width, V]`` of one forward of each row's ``fed`` tokens from its length on,
        padded to a width of `WIDTHS` (a prefill: to its own)."""
        needed = max(int(tokens.shape[0]) for tokens in fed.values())
        width = bucket(needed, self.widths)
        input_ids, position_ids, slots = self._inputs(fed, width)
        return self._run(input_ids, position_ids, slots, prefill)

    def _run(self, input_ids: torch.LongTensor, position_ids: torch.LongTensor, slots: torch.LongTensor,
             prefill: bool = False) -> torch.Tensor:
        """Logits ``[rows, width, V]`` of one forward (inputs ``[rows, width]``, on the device). Compiled
        where the runner is, once the cache is allocated (a graph then only writes it), but for a
        prefill; a forward that makes a graph is not timed into the cost curves (it holds the
        compilation)."""
        width = input_ids.shape[1]
        self.cache.write_slots = slots
        compiled = self._compiled is not None and width <= max(self.widths) and self.cache.allocated and not prefill
        making_graph = compiled and width not in self.cache.compiled_widths
        if making_graph and not _may_make_graph(self.model, self.role):
            compiled = making_graph = False
        if making_graph:
            self.cache.compiled_widths.add(width)
        if compiled:
            self.cache.graph_runs[width] += 1
            try:
                with self._timed_forward(self.rows * width, self.rows,
                                         observed=self.cache.graph_runs[width] > GRAPH_SETUP_RUNS.get(self.device.type, 1)):
                    logits = self._compiled(self.model, input_ids, position_ids, slots, self.cache)
            except Exception as error:  # noqa: BLE001 - compiling, capturing or replaying failed: `_fall_back`
                logits = self._fall_back(error, input_ids, position_ids, slots)
        else:  # a compiled runner's uncompiled forwards (a prefill, a width past the graph limit) price no compiled one
            with self._timed_forward(self.rows * width, self.rows, observed=self._compiled is None):
                logits = self._plain_forward(input_ids, position_ids, slots)
        self._hidden = None
        if self.features is not None:  # [rows, width, F], a copy: a CUDA graph's output is overwritten by its next replay
            logits, self._hidden = logits[0], logits[1].clone()
        if not prefill:
            self.forward_widths.append(width)
        return logits

    def _plain_forward(self, input_ids: torch.LongTensor, position_ids: torch.LongTensor,
                       slots: torch.LongTensor) -> torch.Tensor:
        with self._attention():
            return self._plain(self.model, input_ids, position_ids, slots, self.cache)

    def _fall_back(self, error: Exception, input_ids: torch.LongTensor, position_ids: torch.LongTensor,
                   slots: torch.LongTensor) -> torch.Tensor:
        """The forward whose compiled run raised ``error``, run again uncompiled on the same cache: it
        writes the same slots, so whatever the failed run wrote is replaced before any query reads it.
        When it runs, compiling was at fault: this model's forwards run uncompiled from now on, in this
        call and every later one (`hf_polybasic.runners.fallback`, one warning); when it raises too,
        the forward itself was, and its error is the user's (with the compiled one as its context)."""
        width = input_ids.shape[1]
        with self._timed_forward(self.rows * width, self.rows, observed=False):
            logits = self._plain_forward(input_ids, position_ids, slots)
        self.fallback = record_failure(self.model, self.role, error)
        self.compiled, self._compiled = False, None
        return logits

    def forward_from(self, input_ids: torch.LongTensor, starts: torch.LongTensor) -> torch.Tensor:
        """Float32 logits ``[rows, width, V]`` (the target's width) of every row's ``input_ids``
        ``[rows, width]`` (``width`` one of `WIDTHS`) written from position ``starts[row]`` on, with
        ``starts`` ``[rows]`` on the device: positions the host does not know
        (`hf_polybasic.decoding.device_blocks`). The host's ``lengths`` stay as they were until
        `hold` says what the cache holds."""
        if self.cache is None:
            self.cache = take_cache(self.model, self.rows, self.capacity)
        positions = starts.unsqueeze(1) + torch.arange(input_ids.shape[1], device=starts.device)  # [rows, width]
        logits = self._run(input_ids, positions, positions)
        # a copy, always: a CUDA graph's output is overwritten by its next replay
        return self._to_target_vocabulary(logits[..., : self.vocab_limit].to(torch.float32, copy=True))

    def hold(self, lengths: dict[int, int]) -> None:
        """Each row's cache now holds ``lengths[row]`` tokens of its sequence (after `forward_from`)."""
        for row, length in lengths.items():
            self.lengths[row] = length

    def _inputs(self, fed: dict[int, torch.LongTensor], width: int):
        """Token ids, positions and write slots ``[rows, width]`` on the device: each asked row's new
        tokens first, then pads (rows not asked: pads only), every token at slot = its position; a
        pad's position is its row's last real one (pads past a learned position table stay in range).
        Built on the host from the lengths it knows: nothing is read back from the device, and the
        positions and slots go up without the host waiting (`hf_polybasic.runners.transfer.upload`)."""
        if max(self.lengths) + width > self.capacity:
            raise RuntimeError(
                f"{self.role}: a forward would write slot {max(self.lengths) + width - 1} of a static cache of "
                f"{self.capacity}; this is a bug in hf_polybasic (the capacity covers the budget)"
            )
        counts = [int(fed[row].shape[0]) if row in fed else 0 for row in range(self.rows)]
        slots = [[length + j for j in range(width)] for length in self.lengths]
        positions = [[length + min(j, max(count - 1, 0)) if count else max(length - 1, 0) for j in range(width)]
                     for length, count in zip(self.lengths, counts)]
        input_ids = torch.zeros(self.rows, width, dtype=torch.long, device=self.device)
        for row, tokens in fed.items():
            input_ids[row, : counts[row]] = tokens.to(self.device)
        # one upload for both, which the host does not wait for (the ids are on the device already)
        positions, slots = upload(torch.tensor([positions, slots], dtype=torch.long), self.device).unbind(0)
        return input_ids, positions, slots

    def prefill_repeated(self, prompts: dict[int, torch.LongTensor], repeats: int) -> None:
        """Cache every row's prompt but its last token (identical prompts are computed once per row
        here: the static cache has no cheap row copy, and a batch's prefill is one forward anyway)."""
        rows = sorted(prompts)
        if any(self.lengths) or len(rows) != self.rows:
            raise ValueError(f"{self.role}: prefill_repeated needs an empty runner of {len(rows)} rows")
        requests = {row: (prompts[row][:-1], 1) for row in rows if prompts[row].shape[0] > 1}
        if requests:
            self.logits_rows(requests)

    def rollback_rows(self, lengths: dict[int, int]) -> None:
        """Forget each row's tokens past its ``length``: only the length moves (see the module docstring)."""
        for row, length in lengths.items():
            self.lengths[row] = min(self.lengths[row], length)

    def release_rows(self, rows) -> None:
        """Rows that are done feed only pads from now on (the batch keeps its shape, so its graphs)."""
        for row in rows:
            self._live[row] = False

    def commit(self) -> None:
        """Nothing to do: a static cache holds no past beyond each row's length."""

    def copy_into(self, cache, row: int = 0) -> None:
        """Put the row's cached keys and values into ``cache`` (an empty `DynamicCache`, through its
        public ``update``): what a call hands back as ``past_key_values`` holds what plain `generate`'s does."""
        length = self.lengths[row]
        if length == 0 or self.cache is None or not self.cache.allocated:
            return
        for index, layer in enumerate(self.cache.layers):
            cache.update(layer.keys[row : row + 1, :, :length].clone(), layer.values[row : row + 1, :, :length].clone(),
                         index)
