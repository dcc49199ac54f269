"""Training an EAGLE-3 draft head for any causal LM: `train_head`, and ``hf-polybasic train-head``.

A run reads texts and prompts (`corpus`), has the model answer the prompts (`answers`: self-distillation),
lays everything into windows of tokens, picks the head's draft vocabulary from their token counts
(`vocabulary`), computes the model's hidden states over every window once into shards on disk
(`features`), and trains the head on them (`loop`), the model's own distributions as the teacher
(`hf_polybasic.heads.training`). The head is saved as vllm-project/speculators saves an EAGLE-3 head
(`speculators`), so `hf_polybasic.levels.draft_head`, speculators and vLLM load it.

Everything a run needs to resume lies in its work folder (``<output>/training`` by default): the settings
(``run.json``), the answers, the windows, the feature shards and the last checkpoint. Run the same call
again and it goes on where it stopped; with other settings it refuses.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .corpus import read_prompts, read_texts, token_windows
from .settings import HeadTraining

__all__ = ["HeadTraining", "TrainedHead", "train_head"]


@dataclass
class TrainedHead:
    """What `train_head` did. ``directory``: the head (load it with ``draft_head(directory, verifier=model)``
    or `level`); ``steps`` of ``total_steps`` done, their ``losses``; ``windows`` of ``seq_len`` tokens
    trained on, the model's answers to ``answers`` prompts among them; ``resumed_from``: the step a
    checkpoint held (None: a fresh run); ``stopped_early``: stopped by ``max_minutes``; ``seconds`` this call
    took, ``timings`` its phases' (reading and answering, features, training)."""

    directory: Path
    work_dir: Path
    steps: int
    total_steps: int
    losses: list[float] = field(repr=False)
    windows: int
    answers: int
    draft_vocab_size: int
    feature_layers: tuple[int, ...]
    resumed_from: int | None
    stopped_early: bool
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)

    def level(self, verifier):
        """The trained head as a level of a chain for ``verifier`` (`hf_polybasic.levels.draft_head`)."""
        from ..heads import draft_head

        return draft_head(str(self.directory), verifier=verifier)


def train_head(model, tokenizer, output_dir, texts=(), prompts=(), *, work_dir=None, max_minutes: float | None = None,
               progress: bool = True, **settings) -> TrainedHead:
    """Distil an EAGLE-3 head for ``model`` (a transformers causal LM) and save it to ``output_dir`` in
    speculators' format. The head trains where the model is (CPU or GPU), in float32; ``model`` is read,
    never changed.

    ``texts``: files or folders of text (see `hf_polybasic.training.corpus`); ``prompts``: JSONL (or
    ``.txt``) files of prompts, which the model answers first, its answers then trained on
    (self-distillation; EAGLE's recommendation); at least one of the two. ``tokenizer``: the model's.
    ``settings``: the fields of `HeadTraining` (``steps``, ``seed``, ``draft_vocab_size``, ...).
    ``work_dir``: where the run keeps what it needs to resume (default ``<output_dir>/training``).
    ``max_minutes``: stop (with a checkpoint) once this much time has passed in training."""
    from . import answers as answering
    from .features import FeatureShards, TeacherLogits, check_output_layer
    from .loop import HeadTrainer
    from .speculators import (build_head, default_aux_layers, eagle3_config, exported_weights, initial_weights,
                              layer_config, write_checkpoint)
    from .vocabulary import draft_ids, draft_vocabulary_size, token_counts

    started = time.monotonic()
    unknown = sorted(set(settings) - set(HeadTraining.__dataclass_fields__))
    if unknown:
        raise TypeError(f"train_head() got unexpected keyword arguments {unknown}; its settings are the fields of "
                        f"HeadTraining: {', '.join(HeadTraining.__dataclass_fields__)}")
    settings = HeadTraining(**settings)
    texts, prompts = _paths(texts, "texts"), _paths(prompts, "prompts")
    if not texts and not prompts:
        raise ValueError("train_head: no texts and no prompts; pass texts=[files or folders of text] and/or "
                         "prompts=[JSONL files of prompts the model answers]")
    text_config = model.config.get_text_config(decoder=True)
    vocab, depth = int(text_config.vocab_size), int(text_config.num_hidden_layers)
    size = draft_vocabulary_size(settings.draft_vocab_size, vocab)
    aux = list(settings.aux_layers) if settings.aux_layers is not None else default_aux_layers(depth)
    if max(aux) >= depth:
        raise ValueError(f"train_head: aux_layers {aux} name layers the model does not have (it has {depth}: 0 .. "
                         f"{depth - 1})")
    device = model.get_input_embeddings().weight.device
    TeacherLogits.rows_of(model)  # refuses a packed or quantized output layer before any work
    check_output_layer(model, torch.arange(min(4, vocab), device=device)[None])

    output_dir = Path(output_dir).expanduser()
    work = Path(work_dir).expanduser() if work_dir is not None else output_dir / "training"
    _claim(work, _fingerprint(model, texts, prompts, settings))
    timings = {}
    windows, answer_count = _windows(model, tokenizer, texts, prompts, work, settings, progress, answering)
    timings["data"] = time.monotonic() - started

    ids = draft_ids(token_counts(windows, vocab), size)
    teacher = TeacherLogits(model, ids, device)
    config = eagle3_config(model, layer_config(model, settings.num_layers, settings.intermediate_size),
                           draft_vocab_size=size, aux_layers=aux, speculative_tokens=settings.speculative_tokens,
                           save_dtype=settings.save_dtype)
    head = build_head(config, initial_weights(config, model, ids, settings.seed), model, device)
    shards = FeatureShards(work / "features", windows, settings.shard_size)
    mark = time.monotonic()
    shards.write_missing(model, head.feature_layers, settings.batch_size, progress)
    timings["features"] = time.monotonic() - mark

    def export():
        write_checkpoint(output_dir, config, exported_weights(head, model, config, settings.save_embeddings))

    trainer = HeadTrainer(head, teacher, shards, settings, work / "checkpoint.pt", export, device)
    mark = time.monotonic()
    state = trainer.run(max_minutes=max_minutes, progress=progress)
    timings["training"] = time.monotonic() - mark
    return TrainedHead(output_dir, work, state.step, state.total, state.losses, windows.shape[0], answer_count,
                       size, head.feature_layers, state.resumed_from, state.stopped_early,
                       time.monotonic() - started, timings)


def _paths(paths, what: str) -> list[str]:
    if isinstance(paths, (str, Path)):
        paths = [paths]
    try:
        return [str(Path(path).expanduser()) for path in paths]
    except TypeError:
        raise ValueError(f"train_head: {what} must be a path or a list of paths, got {paths!r}") from None


def _fingerprint(model, texts: list[str], prompts: list[str], settings: HeadTraining) -> dict:
    config = model.config.get_text_config(decoder=True)
    return {"model": {"name_or_path": getattr(model.config, "name_or_path", "") or type(model).__name__,
                      "model_type": getattr(config, "model_type", None), "hidden_size": config.hidden_size,
                      "num_hidden_layers": config.num_hidden_layers, "vocab_size": config.vocab_size,
                      "dtype": str(model.get_input_embeddings().weight.dtype)},
            "texts": [str(Path(path).resolve()) for path in texts],
            "prompts": [str(Path(path).resolve()) for path in prompts],
            "settings": settings.fingerprint()}


def _claim(work: Path, fingerprint: dict) -> None:
    """Record the run in ``work`` (``run.json``), or refuse where it holds a run with other settings."""
    path = work / "run.json"
    if path.exists():
        differ = _differences(json.loads(path.read_text()), fingerprint)
        if differ:
            raise ValueError(f"train_head: {work} holds a run with other settings ({', '.join(differ)} differ); "
                             "rerun with the same ones to resume it, or give another output_dir (or work_dir), or "
                             "delete that folder")
        return
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fingerprint, indent=2) + "\n")


def _differences(earlier: dict, now: dict, prefix: str = "") -> list[str]:
    found = []
    for key in sorted(set(earlier) | set(now)):
        before, after = earlier.get(key), now.get(key)
        if isinstance(before, dict) and isinstance(after, dict):
            found += _differences(before, after, f"{prefix}{key}.")
        elif before != after:
            found.append(prefix + key)
    return found


def _windows(model, tokenizer, texts, prompts, work: Path, settings: HeadTraining, progress: bool, answering):
    """``(windows [N, seq_len], how many answers)``: read from the work folder, or made (and kept there)."""
    from safetensors.torch import load_file, save_file

    path = work / "windows.safetensors"
    if path.exists():
        saved = load_file(str(path))
        return saved["input_ids"], int(saved["answers"])
    chats = read_prompts(prompts) if prompts else []
    if prompts and not chats:
        raise ValueError(f"train_head: the prompts files {prompts} hold no prompt")
    answers = answering.answered(model, tokenizer, chats, work / "answers.jsonl", settings.answer_tokens,
                                 settings.answer_batch_size, settings.answer_temperature, settings.seed,
                                 progress) if chats else []
    documents = itertools.chain(answers, (list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
                                          for text in read_texts(texts)))  # windows cut them: no length warning
    separator = tokenizer.eos_token_id
    windows = token_windows(documents, settings.seq_len, separator, settings.max_tokens)
    if not windows.shape[0]:
        raise ValueError(f"train_head: the texts and answers hold fewer than seq_len={settings.seq_len} tokens; pass "
                         "more text or a smaller seq_len")
    partial = path.with_suffix(".partial")
    save_file({"input_ids": windows, "answers": torch.tensor(len(answers))}, str(partial))
    os.replace(partial, path)  # whole or not at all: an interrupted run makes them again
    return windows, len(answers)
