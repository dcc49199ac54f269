"""What a head-training run is: every setting that changes the head it trains (`HeadTraining`), checked
when made. A run's work folder records them; a resumed run must have the same."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .speculators import SAVE_DTYPES


@dataclass(frozen=True)
class HeadTraining:
    """Settings of `hf_polybasic.training.train_head` (each one a keyword of it).

    The head: ``draft_vocab_size`` (ids its output layer scores; None: speculators' 32,000, or the whole
    vocabulary where smaller), ``aux_layers`` (the verifier layers whose inputs it reads; None: EAGLE-3's
    2, L//2, L-3), ``num_layers`` (decoder layers), ``intermediate_size`` (None: the verifier's),
    ``speculative_tokens`` (the proposal length its config.json advertises to vLLM), ``save_embeddings``
    (also write the verifier's embeddings into the checkpoint) and ``save_dtype``.

    The data: ``seq_len`` (tokens per training window), ``max_tokens`` (at most this many tokens, the
    model's answers first; None: all), ``answer_tokens``/``answer_batch_size``/``answer_temperature``
    (how prompts are answered: 0 is greedy).

    The optimisation: ``batch_size`` windows per step, ``epochs`` over the windows (or ``steps``, which
    wins), AdamW at ``lr`` (linear warm-up over a ``warmup`` fraction of the steps, then cosine decay to
    a tenth), ``weight_decay``, gradients clipped to ``max_grad_norm``, ``passes`` training-time-test
    passes per step (speculators' ``ttt_steps``), ``train_lm_head`` (else the output layer keeps the
    verifier's rows, as speculators keeps it), ``seed`` (the head's initial weights, the order of
    windows, sampled answers).

    The machinery: ``shard_size`` windows per feature shard on disk, a checkpoint every
    ``checkpoint_every`` steps (neither changes the trained head).
    """

    draft_vocab_size: int | None = None
    aux_layers: tuple[int, ...] | None = None
    num_layers: int = 1
    intermediate_size: int | None = None
    speculative_tokens: int = 3
    save_embeddings: bool = False
    save_dtype: str = "bfloat16"
    seq_len: int = 256
    max_tokens: int | None = None
    answer_tokens: int = 256
    answer_batch_size: int = 8
    answer_temperature: float = 0.0
    batch_size: int = 4
    epochs: int = 1
    steps: int | None = None
    lr: float = 3e-4
    warmup: float = 0.05
    weight_decay: float = 0.0
    max_grad_norm: float = 0.5
    passes: int = 3
    train_lm_head: bool = False
    seed: int = 0
    shard_size: int = 64
    checkpoint_every: int = 50

    def __post_init__(self):
        positive = ["num_layers", "speculative_tokens", "answer_tokens", "answer_batch_size", "batch_size", "epochs",
                    "passes", "shard_size", "checkpoint_every"]
        optional = ["draft_vocab_size", "intermediate_size", "max_tokens", "steps"]
        for name in positive + optional:
            value = getattr(self, name)
            if not (value is None and name in optional) and (not isinstance(value, int) or value < 1):
                raise ValueError(f"train_head: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.seq_len, int) or self.seq_len < 3:
            raise ValueError(f"train_head: seq_len must be an integer >= 3 (a head position reads a token and "
                             f"predicts the one after the next), got {self.seq_len!r}")
        if self.save_dtype not in SAVE_DTYPES:
            raise ValueError(f"train_head: save_dtype must be one of {list(SAVE_DTYPES)}, got {self.save_dtype!r}")
        for name, low, high in (("lr", 0.0, None), ("warmup", -1e-12, 1.0), ("weight_decay", -1e-12, None),
                                ("max_grad_norm", 0.0, None), ("answer_temperature", -1e-12, None)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= low or (high is not None and value > high):
                raise ValueError(f"train_head: {name} must be a number "
                                 f"{'in [0, 1]' if high else '> 0' if low == 0 else '>= 0'}, got {value!r}")
        if self.aux_layers is not None:
            layers = tuple(self.aux_layers)
            if not layers or not all(isinstance(layer, int) and layer >= 0 for layer in layers) or \
                    len(set(layers)) != len(layers):
                raise ValueError(f"train_head: aux_layers must be distinct layer ids >= 0, got {self.aux_layers!r}")
            object.__setattr__(self, "aux_layers", layers)

    def fingerprint(self) -> dict:
        """The settings that decide the trained head (what a resumed run must share)."""
        settings = dataclasses.asdict(self)
        settings.pop("checkpoint_every")
        settings["aux_layers"] = None if self.aux_layers is None else list(self.aux_layers)
        return settings
