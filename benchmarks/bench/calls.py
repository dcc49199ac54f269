"""One timed call of the benchmark: a question turn encoded, one ``generate`` timed, a greedy
mismatch with plain generate told apart from a numeric near-tie."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from contextlib import nullcontext

import torch

from hf_polybasic.cli.harness import timed_call
from hf_polybasic.cli.model_sets import ModelSet
from hf_polybasic.cli.prompts import encode, messages_for

from .hf_rounds import counting_rounds
from .methods import Method
from .report import first_difference
from .settings import DECODINGS, BenchSettings


def decoding_options(settings: BenchSettings, max_new_tokens: int | None = None) -> dict:
    return {**DECODINGS[settings.decoding], "max_new_tokens": max_new_tokens or settings.max_new_tokens}


def _level_rows(stats, labels: Sequence[str] = ()) -> list[dict] | None:
    if stats is None:
        return None
    rows = []
    for index, level in enumerate(stats.levels):
        rows.append(
            {
                "name": level.name,
                "label": f"M{index + 1} {labels[index]}" if index < len(labels) else level.name,
                "role": level.role,
                "forward_passes": level.forward_passes,
                "verifications": level.verifications,
                "drafted": level.drafted,
                "accepted": level.accepted,
                "proposed": level.proposed,
                "withheld": level.withheld,
                "paused_rounds": level.paused_rounds,
                "alternative_rounds": level.alternative_rounds,
                "alternative_hits": level.alternative_hits,
                "seconds": level.seconds,
                "mean_acceptance_length": level.mean_acceptance_length,
                "acceptance_lengths": list(level.acceptance_lengths),
            }
        )
    return rows


def generate_once(
    method: Method, model_set: ModelSet, messages: list[dict], settings: BenchSettings, seed: int | None,
    max_new_tokens: int | None = None,
) -> dict:
    """One timed ``generate`` call; the measurements as a dict (no cache keys)."""
    inputs, cut = encode(model_set, messages, max_new_tokens or settings.max_new_tokens)
    options = {**model_set.generate_options, **decoding_options(settings, max_new_tokens)}
    prompt_length = inputs["input_ids"].shape[1]
    if seed is not None:
        torch.manual_seed(seed)
    with counting_rounds(model_set.target) if method.kind == "hf-assisted" else nullcontext() as hf_rounds:
        timing = timed_call(lambda: method.run(model_set.target, inputs, options), target=model_set.target)
    sequences, seconds = timing.output, timing.seconds
    if not isinstance(sequences, torch.Tensor):  # a ModelOutput
        sequences = sequences.sequences
    new = sequences[0, prompt_length:].tolist()
    stats = method.stats(model_set.target)
    levels = _level_rows(stats, method.level_labels)
    return {
        "prompt_tokens": prompt_length,
        "prompt_cut": cut,
        "new_tokens": len(new),
        "seconds": seconds,
        "tokens_per_second": len(new) / seconds if seconds > 0 else None,
        "target_forwards": timing.target_forwards,
        "output_ids": new,
        "output_text": model_set.tokenizer.decode(new, skip_special_tokens=True),
        "seed": seed,
        "rss_before_mib": timing.rss_before_mib,
        "rss_after_mib": timing.rss_after_mib,
        "rss_peak_mib": timing.rss_peak_mib,
        "levels": levels,
        "rounds": _rounds(levels, hf_rounds),
    }


def _rounds(levels: list[dict] | None, hf_rounds: dict | None) -> dict | None:
    """The target's rounds of a two-model call, ours (its level's counts) or transformers' (counted by
    `counting_rounds`): verifications, tokens drafted and accepted in all; None for other calls."""
    source = levels[0] if levels else hf_rounds
    if not source or source.get("verifications") is None:
        return None
    return {key: source[key] for key in ("verifications", "drafted", "accepted")}


def _say(message: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(message, file=sys.stderr)


NEAR_TIE_ULPS = 2
MANTISSA_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}


@torch.no_grad()
def mismatch_detail(record, plain_record, model_set: ModelSet, messages, settings: BenchSettings) -> dict | None:
    """None if the greedy output equals plain generate's; else where it first differs and the
    target's logits of the two tokens there (one full forward over the common prefix), so a bf16
    near-tie is told apart from a bug."""
    if plain_record is None:
        return None
    if first_difference(record["output_ids"], plain_record["output_ids"]) is None:
        return None
    if record["turn"] > 0 and record.get("prompt_tokens") != plain_record.get("prompt_tokens"):
        # an earlier turn already differed: the prompts differ, logits are not comparable
        return {"position": first_difference(record["output_ids"], plain_record["output_ids"])}
    inputs, _ = encode(model_set, messages, settings.max_new_tokens)
    detail = greedy_difference(model_set.target, inputs["input_ids"][0], record["output_ids"], plain_record["output_ids"])
    where = f"{record['method']} {record['question_id']} turn {record['turn'] + 1}"
    _say(f"!!! GREEDY MISMATCH: {where}: {describe_difference(detail)}")
    return detail


@torch.no_grad()
def greedy_difference(target, prompt_ids: torch.LongTensor, method_ids: list[int], plain_ids: list[int]) -> dict | None:
    """None if ``method_ids`` equals ``plain_ids`` (the new tokens after ``prompt_ids`` ``[L]``);
    else ``{"position": the first new token that differs}`` and, when both have a token there, the
    target's logits of the two tokens after the common prefix (one forward), their relative gap
    and whether it is a numeric near-tie: at most `NEAR_TIE_ULPS` units in the last place of the
    target's dtype apart, where a k-token and a 1-token forward may round either way."""
    position = first_difference(method_ids, plain_ids)
    if position is None:
        return None
    detail = {"position": position}
    if position >= min(len(method_ids), len(plain_ids)):  # one output stopped earlier
        return detail
    prefix = torch.tensor(plain_ids[:position], dtype=torch.long, device=prompt_ids.device)
    sequence = torch.cat([prompt_ids.reshape(-1), prefix]).unsqueeze(0)
    logits = target(sequence, logits_to_keep=1).logits[0, -1].float()
    method_logit, plain_logit = float(logits[method_ids[position]]), float(logits[plain_ids[position]])
    gap = abs(plain_logit - method_logit)
    bits = MANTISSA_BITS.get(target.dtype, 24)
    relative_gap = gap / max(abs(plain_logit), abs(method_logit), 1e-12)
    near_tie = relative_gap <= NEAR_TIE_ULPS * 2.0 ** (1 - bits)
    detail.update(method_logit=method_logit, plain_logit=plain_logit, relative_gap=relative_gap, near_tie=near_tie)
    return detail


def describe_difference(detail: dict) -> str:
    """One line for a `greedy_difference`."""
    if "near_tie" not in detail:
        return f"lengths differ at new token {detail['position']}"
    return (
        f"at new token {detail['position']}: logits {detail['method_logit']:.4f} (method) vs "
        f"{detail['plain_logit']:.4f} (plain), {'a numeric near-tie' if detail['near_tie'] else 'NOT a near-tie'}"
    )
