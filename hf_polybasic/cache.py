"""One model with its own `DynamicCache`: feed tokens, read logits, roll back, commit.

Invariant of `CachedModel`: its cache holds the keys/values of ``sequence[:length]`` for whatever
sequence the chain passes next; callers keep it true by calling `rollback_to` whenever they discard
tokens. Rollbacks only go down the chain (a verifier rolls back the level below it) and never
re-prefill from scratch: they cut the tail of the cache.

Rollback across several verification rounds: an intermediate level's block is verified by the
level above only after several of its own rounds, so its cache must be able to drop tokens older
than its last round. Sliding-window layers therefore keep their past states until `commit` (called
once the target has verified a block, when no rollback can reach before it) restricts them to the
window; how that is done for each transformers release lives in `hf_polybasic.compat`.
"""

from __future__ import annotations

import torch

from . import compat
from .timing import DEFAULT_CLOCK, Clock, cuda_devices, synchronize, timed


def model_label(model: torch.nn.Module) -> str:
    """A short name for error messages and statistics, e.g. 'Qwen2ForCausalLM(qwen2.5-coder-0.5b)'
    (the last part of ``config.name_or_path``, when there is one)."""
    name = str(getattr(getattr(model, "config", None), "name_or_path", "") or "").rstrip("/").split("/")[-1]
    return f"{type(model).__name__}({name})" if name else type(model).__name__


def input_vocabulary_size(model: torch.nn.Module) -> int:
    """How many token ids ``model`` can embed."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(embeddings, torch.nn.Embedding):
        return int(embeddings.num_embeddings)
    return int(model.config.get_text_config(decoder=True).vocab_size)


def check_rollback_support(model: torch.nn.Module, cache, role: str) -> None:
    """Raise a clear error if ``cache`` cannot be rolled back token by token.

    ``role`` names the model in messages, e.g. "target M1 LlamaForCausalLM".
    """
    if compat.is_stateful(model):
        raise ValueError(
            f"{role} is stateful (recurrent/SSM state); its state cannot be rolled back after a rejected draft, "
            "so it cannot be part of a speculative chain"
        )
    if not compat.is_dynamic_cache(cache):
        raise ValueError(
            f"{role} uses a {type(cache).__name__}, which cannot be rolled back token by token "
            "(static and quantized caches have no exact crop); use the default DynamicCache "
            "(do not set cache_implementation / pass another cache type)"
        )
    unsupported = compat.unrollable_layer(cache)
    if unsupported is not None:
        index, name = unsupported
        raise ValueError(
            f"{role}: cache layer {index} is a {name} (recurrent or linear-attention state), "
            "which cannot be rolled back after a rejected draft; such models cannot be part of a speculative chain"
        )


class CachedModel:
    """A causal LM plus its own cache, fed incrementally along one token sequence.

    ``vocab_limit`` is the target's output width: an assistant's logits are cut to it (an assistant
    whose output layer is padded beyond the target's must never propose an id the target does not
    have) or padded to it with -inf, so every level's processors see the target's vocabulary.

    Attributes:
        length: tokens of the current sequence whose keys/values are cached.
        forward_passes: forward calls made (F_i in the paper).
        cost_observer: told ``observe(tokens fed, seconds)`` after every forward, when set (a
            `hf_polybasic.costs.CostEstimate` following what forwards cost on this machine now).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cache,
        role: str,
        vocab_limit: int | None = None,
        clock: Clock = DEFAULT_CLOCK,
    ):
        self.model = model
        self.vocab_limit = vocab_limit
        self.cache = cache
        self.role = role
        self.clock = clock
        self.device = model.device
        self.cuda_devices = cuda_devices(model)  # synchronized at the end of each timed forward
        if cache is not None:
            check_rollback_support(model, cache, role)
            compat.record_past_states(cache)
        self.length = cache.get_seq_length() if cache is not None else 0
        self.forward_passes = 0
        self.cost_observer = None
        self.input_vocabulary = input_vocabulary_size(model)
        self._accepts_logits_to_keep = compat.accepts_logits_to_keep(model)

    def logits(self, sequence: torch.LongTensor, num_positions: int) -> torch.Tensor:
        """Float32 logits ``[num_positions, V]`` for the last positions of ``sequence`` ``[L]``.

        Row j predicts the token after ``sequence[:L - num_positions + 1 + j]``. Only tokens not
        yet cached are fed; afterwards all L tokens are cached.
        """
        total = sequence.shape[0]
        first_needed = total - num_positions
        if self.length > first_needed:
            self.rollback_to(first_needed)
        fed = sequence[0 if self.cache is None else self.length :]
        self._check_ids(fed)
        kwargs = {"logits_to_keep": num_positions} if self._accepts_logits_to_keep else {}
        inputs = fed.unsqueeze(0).to(self.device)
        with timed(self.clock) as span:
            if self.cache is None:
                outputs = self.model(input_ids=inputs, use_cache=False, **kwargs)
            else:
                positions = torch.arange(self.length, total, device=self.device).unsqueeze(0)
                outputs = self.model(
                    input_ids=inputs, position_ids=positions, past_key_values=self.cache, use_cache=True, **kwargs
                )
            logits = outputs.logits[0, -num_positions:, : self.vocab_limit].float()
            synchronize(self.cuda_devices)  # on a GPU, time the work, not its launch
        if self.cost_observer is not None:
            self.cost_observer.observe(int(fed.shape[0]), span.seconds)
        self.forward_passes += 1
        self.length = total
        if self.vocab_limit is not None and logits.shape[-1] < self.vocab_limit:
            # ids this model lacks (padding rows of the target's output layer) are never proposed
            logits = torch.nn.functional.pad(logits, (0, self.vocab_limit - logits.shape[-1]), value=-float("inf"))
        return logits

    def _check_ids(self, new_ids: torch.LongTensor) -> None:
        """A clear error, not an IndexError in the embedding, for an id this model cannot embed (an
        assistant whose vocabulary lacks a few of the target's padding rows, see `hf_polybasic.vocabulary`)."""
        if new_ids.numel() and int(new_ids.max()) >= self.input_vocabulary:
            raise ValueError(
                f"token id {int(new_ids.max())} was generated but {self.role} has only {self.input_vocabulary} token "
                "ids; every model of a chain must use the target's tokenizer (its vocabulary must cover every id "
                "the target emits)"
            )

    def rollback_to(self, length: int) -> None:
        """Forget cached tokens past ``length`` (no-op if fewer are cached)."""
        if length >= self.length:
            return
        if self.cache is not None:
            compat.remove_last_tokens(self.cache, self.length - length)
        self.length = length

    def commit(self) -> None:
        """Everything cached is final: let sliding layers drop states outside their window."""
        if self.cache is not None:
            compat.restrict_sliding_layers(self.cache)
