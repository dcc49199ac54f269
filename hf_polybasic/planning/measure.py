"""Measuring a pool for the planner: costs and agreements along the target's own greedy text.

`profile` generates the target's greedy continuation of each prompt (the reference text), runs
every candidate over it teacher-forced (one forward each), records where each pair of levels
agrees, and times forwards of 1..16 tokens against a warm cache (`hf_polybasic.costs.forward_cost`).
"""

from __future__ import annotations

import inspect
import platform
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from ..compat import decoding_processors, resolved_decoding
from ..costs import SLOWED, forward_cost
from ..drafters import Drafter
from ..translation.level import Translated
from ..processing import process_positions
from ..timing import timed
from ..user_warnings import warn
from .acceptance import is_int
from .profile_data import DRAFTER, MODEL, TARGET, Profile, cost_order


def encode_prompt(tokenizer, prompt) -> torch.LongTensor:
    """[1, L] ids: a string (chat-templated when the tokenizer has a template), chat messages, or ids."""
    if isinstance(prompt, torch.Tensor):
        ids = prompt.reshape(1, -1) if prompt.dim() == 1 else prompt
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise ValueError(f"a prompt of token ids must have shape [L] or [1, L], got {tuple(prompt.shape)}")
        return ids.long().cpu()
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
        return torch.tensor([list(prompt)], dtype=torch.long)
    if tokenizer is None:
        raise ValueError("text or chat prompts need a tokenizer; pass tokenizer= or give token ids")
    if isinstance(prompt, str):
        if getattr(tokenizer, "chat_template", None):
            prompt = [{"role": "user", "content": prompt}]
        else:
            return tokenizer(prompt, return_tensors="pt")["input_ids"].long()
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, Mapping) for m in prompt):
        encoded = tokenizer.apply_chat_template(
            list(prompt), add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        return encoded["input_ids"].long()
    raise ValueError(f"a prompt must be a string, chat messages or token ids, got {type(prompt).__name__}")


def _checked_candidates(candidates) -> dict[str, Any]:
    if not isinstance(candidates, Mapping) or not candidates:
        raise ValueError("candidates must be a non-empty dict label -> model or Drafter")
    for label, candidate in candidates.items():
        if not isinstance(label, str) or not label or label == TARGET:
            raise ValueError(f"candidate labels must be non-empty strings other than {TARGET!r}, got {label!r}")
        is_model = isinstance(candidate, torch.nn.Module) and hasattr(candidate, "config")
        if isinstance(candidate, Translated):
            raise TypeError(
                f"candidates[{label!r}] is a translated level (another tokenizer): the planner does not measure those "
                "yet; put it in assistant_models directly")
        if not isinstance(candidate, Drafter) and not is_model:
            raise TypeError(
                f"candidates[{label!r}] must be a transformers model or a hf_polybasic.drafters.Drafter, "
                f"got {type(candidate).__name__}"
            )
    return dict(candidates)


def _vocab_size(model) -> int:
    return model.config.get_text_config(decoder=True).vocab_size


@torch.no_grad()
def _teacher_forced_logits(model, sequence: torch.LongTensor, count: int, vocab: int) -> torch.Tensor:
    """[count, vocab] float32 raw logits predicting the last ``count`` tokens of ``sequence`` ([1, L]),
    from one forward pass (a draft head's: `HeadModel.teacher_forced`); columns cut or padded (-inf) to
    the target's vocabulary."""
    inputs = sequence[:, :-1].to(model.device)
    if hasattr(model, "teacher_forced"):  # a draft head: fed its verifier's features over the same text
        logits = model.teacher_forced(inputs)[0, -count:].float().cpu()
    else:
        kwargs = {"logits_to_keep": count} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        logits = model(input_ids=inputs, use_cache=False, **kwargs).logits[0, -count:].float().cpu()
    if logits.shape[1] < vocab:
        logits = torch.nn.functional.pad(logits, (0, vocab - logits.shape[1]), value=float("-inf"))
    return logits[:, :vocab]


@dataclass
class _LevelReading:
    """What one level did along one prompt's reference text (M positions)."""

    tokens: torch.LongTensor  # [M] its token at each position; -1 = no proposal (Drafter)
    probs: torch.Tensor | None = None  # [M, V] processed distribution (sampling, models)
    lengths: list[int] | None = None  # Drafter: tokens proposed at each position
    seconds_per_token: float | None = None  # models: the teacher-forced forward's seconds per token fed


def _read_drafter(drafter: Drafter, sequence: torch.LongTensor, start: int, budget: int, timings: list):
    """Propose at every position of the reference (its first token and length), timing each call."""
    tokens, lengths = [], []
    for t in range(sequence.shape[1] - start):
        with timed() as span:
            proposal, _ = drafter.propose(sequence[:, : start + t], budget)
        timings.append(span.seconds)
        lengths.append(int(proposal.shape[0]))
        tokens.append(int(proposal[0]) if proposal.shape[0] else -1)
    return _LevelReading(tokens=torch.tensor(tokens, dtype=torch.long), lengths=lengths)


def _read_model(model, sequence, start, processors, sampling: bool, vocab: int) -> _LevelReading:
    """Argmax (and, sampling, the processed distribution) at every position, from one forward."""
    count = sequence.shape[1] - start
    with timed() as span:
        logits = _teacher_forced_logits(model, sequence, count, vocab)  # [M, V]
    per_token = span.seconds / (sequence.shape[1] - 1)
    scores = process_positions(processors, sequence[0], start, logits)
    probs = scores.softmax(-1) if sampling else None
    return _LevelReading(tokens=scores.argmax(-1), probs=probs, seconds_per_token=per_token)


def _pair_readings(upper: _LevelReading, lower: _LevelReading, sampling: bool) -> tuple[list[int], list[float] | None]:
    agreement = (upper.tokens == lower.tokens).int().tolist()
    if not sampling:
        return agreement, None
    if lower.probs is not None:
        overlap = torch.minimum(upper.probs, lower.probs).sum(-1)
    else:  # a Drafter's point mass: p_upper of its token, 0 where it proposed nothing
        proposed = lower.tokens.clamp(min=0)
        overlap = upper.probs.gather(1, proposed.unsqueeze(1)).squeeze(1) * (lower.tokens >= 0)
    return agreement, overlap.tolist()


@torch.no_grad()
def profile(
    target,
    candidates: Mapping[str, Any],
    tokenizer,
    prompts: Sequence[Any],
    *,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    max_new_tokens: int = 48,
    block_sizes: Sequence[int] = (1, 2, 4, 8, 16),
    repeats: int = 3,
    progress: bool = True,
    generate_kwargs: Mapping[str, Any] | None = None,
) -> Profile:
    """Measure the costs and agreements of a pool along the target's own greedy text.

    Args:
        target: the model whose output must not change.
        candidates: label -> a cheaper model or a `Drafter` (e.g. ``PromptLookup``).
        tokenizer: encodes text / chat prompts (chat template when it has one); None for id prompts.
        prompts: strings, chat message lists, or token ids ([L] / [1, L]).
        do_sample, temperature, top_p, top_k, min_p, repetition_penalty: the decoding the plan is
            for, resolved as `generate` resolves them (`hf_polybasic.compat.resolved_decoding`).
        max_new_tokens: length of the reference text per prompt (the target's greedy continuation).
        block_sizes: tokens fed per timed forward; costs in between are interpolated.
        repeats: timed forwards per (model, block size); the median is kept.
        progress: show progress bars.
        generate_kwargs: extra options for the reference ``target.generate`` (e.g. ``eos_token_id``).
    """
    pool = _checked_candidates(candidates)
    prompts = list(prompts) if prompts is not None else []
    if not prompts:
        raise ValueError("prompts must not be empty: give a few prompts like the ones the plan is for")
    if not is_int(max_new_tokens, 2):
        raise ValueError(f"max_new_tokens must be an int >= 2, got {max_new_tokens!r}")
    sizes = sorted({1, *(int(k) for k in block_sizes)})
    if sizes[0] < 1:
        raise ValueError(f"block_sizes must be ints >= 1, got {list(block_sizes)}")
    if not is_int(repeats, 1):
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    decoding = resolved_decoding(
        target, do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty,
    )
    sequences = _reference_texts(target, tokenizer, prompts, max_new_tokens, decoding, generate_kwargs, progress)
    models = {TARGET: target, **pool}
    kinds = {label: DRAFTER if isinstance(m, Drafter) else MODEL for label, m in models.items()}
    readings, propose_seconds = _read_levels(models, sequences, decoding, max_new_tokens, progress)
    costs = _measure_costs(models, sequences[0][0], sizes, repeats, propose_seconds, progress)
    _warn_slowed_timings(costs, repeats)
    agreement, overlaps = _pair_tables(cost_order(kinds, costs), kinds, readings, decoding["do_sample"])
    drafters = [label for label, kind in kinds.items() if kind == DRAFTER]
    proposal_lengths = {label: [r[label].lengths for r in readings] for label in drafters}
    draft_lengths = {
        label: int(getattr(models[label], "num_tokens", 0) or max(max(p, default=0) for p in proposal_lengths[label]))
        for label in drafters
    }
    info = {
        "prompts": len(sequences),
        "prompt_tokens": [start for _, start in sequences],
        "reference_tokens": [s.shape[1] - start for s, start in sequences],
        "max_new_tokens": max_new_tokens,
        "block_sizes": sizes,
        "repeats": repeats,
        "cost_context_tokens": int(sequences[0][0].shape[1]),
        "labels": {label: _describe(m) for label, m in models.items()},
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads(), "torch": torch.__version__},
    }
    return Profile(
        kinds=kinds, costs=costs, agreement=agreement, overlaps=overlaps, proposal_lengths=proposal_lengths,
        draft_lengths=draft_lengths, prefill=_prefill_seconds(readings, sequences), decoding=decoding, info=info,
        models=models,
    )


def _reference_texts(target, tokenizer, prompts, max_new_tokens, decoding, generate_kwargs, progress):
    """(prompt + the target's greedy continuation [1, L + m] on CPU, L) per prompt that got m >= 1."""
    sequences = []
    for prompt in tqdm(prompts, desc="reference (target greedy)", disable=not progress):
        ids = encode_prompt(tokenizer, prompt).to(target.device)
        out = target.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
            repetition_penalty=decoding["repetition_penalty"], **dict(generate_kwargs or {}),
        )
        if out.shape[1] > ids.shape[1]:  # else EOS at once: no positions to profile
            sequences.append((out.cpu(), ids.shape[1]))
    if not sequences:
        raise ValueError("the target generated no token for any prompt; profile other prompts")
    return sequences


def _read_levels(models, sequences, decoding, max_new_tokens, progress):
    """Per prompt, label -> `_LevelReading`; and per Drafter the seconds of each propose call."""
    processors = decoding_processors(decoding)
    vocab = _vocab_size(models[TARGET])
    propose_seconds = {label: [] for label, m in models.items() if isinstance(m, Drafter)}
    bar = tqdm(total=len(sequences) * len(models), desc="teacher forcing", disable=not progress)
    readings = []
    for sequence, start in sequences:
        here = {}
        for label, model in models.items():
            if isinstance(model, Drafter):
                here[label] = _read_drafter(model, sequence, start, max_new_tokens, propose_seconds[label])
            else:  # the target's forward too: it times its prefill (and gives p_target when sampling)
                here[label] = _read_model(model, sequence, start, processors, decoding["do_sample"], vocab)
            bar.update()
        here[TARGET].tokens = sequence[0, start:]  # its argmax is the text (one long forward may round a tie)
        readings.append(here)
    bar.close()
    return readings, propose_seconds


def _measure_costs(models, prefix, sizes, repeats, propose_seconds, progress) -> dict[str, dict[int, float]]:
    """label -> {k: seconds}: `profiling.forward_cost` after ``prefix``; a Drafter: median propose."""
    costs = {}
    total = sum(1 if isinstance(m, Drafter) else len(sizes) for m in models.values())
    bar = tqdm(total=total, desc="forward costs", disable=not progress)
    for label, model in models.items():
        if isinstance(model, Drafter):
            costs[label] = {1: max(statistics.median(propose_seconds[label]), 1e-9)}
            bar.update()
            continue
        costs[label] = {}
        for k in sizes:
            costs[label][k] = forward_cost(model, prefix.to(model.device), k, repeats)
            bar.update()
    bar.close()
    return costs


def slowed_timings(costs: Mapping[str, Mapping[int, float]]) -> list[tuple[str, int, int, float]]:
    """``(label, k, longer, ratio)`` for every measured T(k) over SLOWED times a longer forward's
    T(longer) of the same model (the longer forward with the least time)."""
    found = []
    for label, points in costs.items():
        ks = sorted(points)
        for i, k in enumerate(ks[:-1]):
            longer = min(ks[i + 1 :], key=points.get)
            if points[k] > SLOWED * points[longer]:
                found.append((label, k, longer, points[k] / points[longer]))
    return found


def _warn_slowed_timings(costs, repeats: int) -> None:
    """Say where a timing was slowed: the plan prices that forward at the longer one's cost
    (`hf_polybasic.costs.unslowed`), but the machine was busy while profiling."""
    slowed = slowed_timings(costs)
    if slowed:
        listed = "; ".join(f"{label}: T({k}) {ratio:.1f}x T({longer})" for label, k, longer, ratio in slowed)
        warn(f"hp.profile: some forwards measured over twice as slow as a longer forward of the same model ({listed}), "
             f"so something else ran on this machine while it profiled (repeats={repeats}, the median kept). The "
             "plan prices each at the longer forward's cost; for steadier costs profile again on an idle "
             "machine, with repeats=5 or more", UserWarning)


def _pair_tables(order, kinds, readings, sampling: bool):
    """(agreement, overlaps) for every (upper, lower) with upper above lower in ``order``."""
    agreement, overlaps = {}, {}
    for i, upper in enumerate(order):
        if kinds[upper] == DRAFTER:
            continue
        for lower in order[i + 1 :]:
            pairs = [_pair_readings(here[upper], here[lower], sampling) for here in readings]
            agreement[(upper, lower)] = [indicators for indicators, _ in pairs]
            if sampling:
                overlaps[(upper, lower)] = [overlap for _, overlap in pairs]
    return agreement, overlaps


def _prefill_seconds(readings, sequences) -> dict[str, float]:
    """Prefill of the mean prompt per model: the median per-token rate of its teacher-forced
    forwards (robust to a first, cold call) times the mean prompt length."""
    mean_prompt = statistics.mean(start for _, start in sequences)
    labels = [label for label, reading in readings[0].items() if reading.seconds_per_token is not None]
    return {
        label: statistics.median(here[label].seconds_per_token for here in readings) * mean_prompt for label in labels
    }


def _describe(model) -> str:
    if isinstance(model, Drafter):
        return repr(model)
    dtype = next((p.dtype for p in model.parameters()), None)
    name = str(getattr(model.config, "name_or_path", "") or "").rstrip("/").split("/")[-1]
    layers = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", "?")
    return f"{type(model).__name__}({name or '-'}, {layers} layers, {str(dtype).replace('torch.', '')})"
