"""Measuring what a chain level costs and how well it agrees with the target.

* `forward_cost`: median wall time of one forward pass that feeds ``num_tokens`` new tokens
  against a warm cache (1 token = one drafting step; k + 1 tokens = one verification of k drafts).
* `greedy_agreement`: at evenly spaced points of the target's own greedy continuation, let a
  candidate draft K tokens greedily and count how many leading ones equal the target's: the mean
  is the expected number of accepted drafts per greedy verification (0..K).

These are the T_i and acceptance numbers the theory (Lemma 3.1, Theorem 3.2) consumes; the
``python -m benchmarks levels`` command turns them into the cost/agreement table of the docs.
"""

from __future__ import annotations

import gc
import json
import platform
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_polybasic.models import nf4 as four_bit
from hf_polybasic.costs import forward_cost
from hf_polybasic.drafters import Drafter, PromptLookup
from hf_polybasic.levels import early_exit, quantized_copy, restricted_vocabulary


@torch.no_grad()
def _greedy_draft(candidate, sequence: torch.LongTensor, k: int) -> list[int]:
    if isinstance(candidate, Drafter):
        tokens, _ = candidate.propose(sequence, k)
        return tokens.tolist()
    out = candidate.generate(
        sequence, attention_mask=torch.ones_like(sequence), do_sample=False, max_new_tokens=k, min_new_tokens=k,
        eos_token_id=None, pad_token_id=0,
    )
    return out[0, sequence.shape[1] :].tolist()


@torch.no_grad()
def greedy_agreement(
    candidate, continuations: list[tuple[torch.LongTensor, torch.LongTensor]], k: int, stride: int
) -> float:
    """Mean leading matches (0..k) of the candidate's k greedy drafts with the target's continuation.

    ``continuations``: (prompt [1, L], target greedy continuation [m]) pairs; drafting starts at
    every ``stride``-th position of each continuation that leaves k tokens to compare.
    """
    matches = []
    for prompt, continuation in continuations:
        for start in range(0, continuation.shape[0] - k + 1, stride):
            sequence = torch.cat([prompt, continuation[:start].unsqueeze(0)], dim=1)
            draft = _greedy_draft(candidate, sequence, k)
            expected = continuation[start : start + k].tolist()
            count = 0
            while count < len(draft) and draft[count] == expected[count]:
                count += 1
            matches.append(count)
    return statistics.mean(matches)


@dataclass
class LevelProfile:
    """One row of the cost/agreement table; costs are relative to the target's."""

    name: str
    step_seconds: float  # one drafting step (1 token, warm cache)
    verify_seconds: float  # one verification of K drafts (K + 1 tokens, warm cache)
    relative_step_cost: float
    relative_verify_cost: float
    agreement: float  # mean accepted greedy drafts out of K

    def to_dict(self) -> dict:
        return asdict(self)


def profile_level(
    name: str,
    candidate,
    target_step_seconds: float,
    target_verify_seconds: float,
    prefix: torch.LongTensor,
    continuations,
    k: int,
    stride: int,
    repeats: int = 5,
) -> LevelProfile:
    """Costs and agreement of one candidate level (a model or a `Drafter`)."""
    if isinstance(candidate, Drafter):
        step = verify = 0.0
    else:
        step = forward_cost(candidate, prefix, 1, repeats)
        verify = forward_cost(candidate, prefix, k + 1, repeats)
    return LevelProfile(
        name=name,
        step_seconds=step,
        verify_seconds=verify,
        relative_step_cost=step / target_step_seconds,
        relative_verify_cost=verify / target_verify_seconds,
        agreement=greedy_agreement(candidate, continuations, k, stride),
    )


def markdown_table(rows: list[LevelProfile], k: int) -> str:
    """The cost/agreement table as markdown."""
    lines = [
        f"| level | step (ms) | step / target | verify {k} (ms) | verify / target | greedy agreement (of {k}) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.name} | {1000 * row.step_seconds:.1f} | {row.relative_step_cost:.2f} | "
            f"{1000 * row.verify_seconds:.1f} | {row.relative_verify_cost:.2f} | {row.agreement:.2f} |"
        )
    return "\n".join(lines)


# Short prompts of different kinds, for tables that need a few real continuations.
PROFILE_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Explain in three sentences why the sky is blue.",
    "A train travels 120 km in 1.5 hours. What is its average speed in km/h? Show the steps.",
    "Summarize: The city council met on Tuesday to discuss the new bike lanes. Residents spoke for "
    "and against the plan, citing safety and parking. The council will vote next month.",
)


def qwen_candidates(target, small, restricted: Sequence[int] = (), tokenizer=None):
    """(name, factory) for every way of building a level from the Qwen2.5-Coder pair; factories
    are called one at a time so at most one extra copy of the 1.5B is in memory. ``restricted``:
    the 0.5B in int8 and bf16 with its output layer restricted to N ids, for each N
    (`hf_polybasic.levels.restricted_vocabulary`, with ``tokenizer``'s special tokens)."""
    half = target.config.num_hidden_layers // 2
    views = [
        (f"0.5B {method}, head {size}",
         lambda method=method, size=size: restricted_vocabulary(quantized_copy(small, method), size, tokenizer=tokenizer))
        for method in ("int8-dynamic", "bf16") for size in restricted
    ]
    candidates = [
        ("1.5B bf16 copy", lambda: quantized_copy(target, "bf16")),
        ("1.5B int8-dynamic copy", lambda: quantized_copy(target, "int8-dynamic")),
        (f"1.5B early exit ({half} of {target.config.num_hidden_layers} layers)", lambda: early_exit(target, half)),
        ("0.5B fp32", lambda: small),
        ("0.5B bf16", lambda: quantized_copy(small, "bf16")),
        ("0.5B int8-dynamic", lambda: quantized_copy(small, "int8-dynamic")),
        ("PromptLookup(max_ngram=3, num_tokens=8)", lambda: PromptLookup(max_ngram=3, num_tokens=8)),
        *views,
        ("1.5B int4 copy (torch int4 kernels)", lambda: quantized_copy(target, "int4")),  # nothing to install
    ]
    if four_bit.available("nf4"):  # bitsandbytes: the quant4 extra
        candidates.append(("1.5B nf4 copy (bitsandbytes)", lambda: quantized_copy(target, "nf4")))
    return candidates


def run_levels_table(models_kind: str, k: int, new_tokens: int, stride: int, repeats: int, out,
                     only: tuple[str, ...] = (), restricted: tuple[int, ...] = ()) -> str:
    """Build the cost/agreement table for the Qwen pair (or tiny random models) and write it;
    ``only``: measure just the candidates whose name contains one of these strings; ``restricted``:
    add the drafter with its output layer restricted to each of these numbers of ids."""
    if models_kind == "qwen":
        from hf_polybasic.cli import loading

        target, tokenizer = loading.load("qwen2.5-coder-1.5b-instruct")
        small, _ = loading.load("qwen2.5-coder-0.5b-instruct")
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
            for text in PROFILE_PROMPTS
        ]
        candidates = qwen_candidates(target, small, restricted, tokenizer)
    else:
        from hf_polybasic.testing import make_target, noisy_copy, prompt

        target = make_target("llama", seed=0, layers=4)
        prompts = [prompt(8, seed=s) for s in range(len(PROFILE_PROMPTS))]
        candidates = [
            ("int8-dynamic copy", lambda: quantized_copy(target, "int8-dynamic")),
            ("early exit (2 of 4 layers)", lambda: early_exit(target, 2)),
            ("noisy copy", lambda: noisy_copy(target, 0.2, seed=1)),
            ("PromptLookup(max_ngram=3, num_tokens=8)", lambda: PromptLookup(max_ngram=3, num_tokens=8)),
        ] + [
            (f"noisy copy, head {size}", lambda size=size: restricted_vocabulary(noisy_copy(target, 0.2, seed=1), size))
            for size in restricted
        ]
    if only:
        candidates = [(name, factory) for name, factory in candidates if any(part in name for part in only)]
        if not candidates:
            raise ValueError(f"--only {list(only)} matches no candidate")
    continuations = []
    for ids in tqdm(prompts, desc="target greedy continuations"):
        greedy = target.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0,
        )
        continuations.append((ids, greedy[0, ids.shape[1] :]))
    prefix = prompts[0]
    target_step = forward_cost(target, prefix, 1, repeats)
    target_verify = forward_cost(target, prefix, k + 1, repeats)
    rows = [LevelProfile("target 1.5B fp32" if models_kind == "qwen" else "target", target_step, target_verify, 1.0, 1.0, float(k))]
    for name, factory in tqdm(candidates, desc="levels"):
        candidate = factory()
        rows.append(profile_level(name, candidate, target_step, target_verify, prefix, continuations, k, stride, repeats))
        del candidate
        gc.collect()
    table = markdown_table(rows, k)
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        record = {
            "command": " ".join(["hf-polybasic", *sys.argv[1:]]),
            "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                        "torch": torch.__version__, "python": platform.python_version()},
            "k": k, "new_tokens": new_tokens, "stride": stride, "prompts": len(prompts),
            "rows": [row.to_dict() for row in rows],
        }
        stem = f"levels_{models_kind}" + ("-" + "-".join(part.replace(" ", "_") for part in only) if only else "")
        stem += "".join(f"-head{size}" for size in restricted)
        (out / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
        (out / f"{stem}.md").write_text(table + "\n")
    return table
