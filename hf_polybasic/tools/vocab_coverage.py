"""``hf-polybasic vocab-coverage``: how much of real text a restricted drafter vocabulary covers.

`hf_polybasic.levels.restricted_vocabulary` keeps the first N token ids (BPE merge order, which
follows frequency), the special tokens, and every token the drafter has been fed. This measures, on
the benchmark's prompts and on the target's own greedy continuations of them, the share of tokens
that such an S holds:

* *prompt, id < N*: prompt tokens among the first N ids;
* *output, id < N*: generated tokens among the first N ids (a static S);
* *output, in S*: generated tokens in the S the drafter has when it drafts them: id < N, a special
  token, or a token of the prompt or of the text before it (what `restricted_vocabulary` keeps).

A generated token outside S is one the drafter can never propose: the share of tokens in S bounds
the acceptance a restricted drafter can keep.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import cpu, hardware
from .bench.prompts import questions_of
from .model_sets import QWEN_TARGET

DEFAULT_SIZES = (8192, 16384, 32768, 49152, 65536)


def coverage(prompts: Sequence[list[int]], outputs: Sequence[list[int]], sizes: Sequence[int], special: set[int]) -> dict:
    """{N: {"prompt": share, "output": share, "output_in_s": share}} over the given token lists."""
    result = {}
    for n in sizes:
        prompt_in = sum(token < n for ids in prompts for token in ids)
        output_in = sum(token < n for ids in outputs for token in ids)
        in_s = 0
        for prompt_ids, output_ids in zip(prompts, outputs):
            seen = set(prompt_ids) | special
            for token in output_ids:
                in_s += token < n or token in seen
                seen.add(token)
        prompt_total = max(sum(map(len, prompts)), 1)
        output_total = max(sum(map(len, outputs)), 1)
        result[n] = {"prompt": prompt_in / prompt_total, "output": output_in / output_total,
                     "output_in_s": in_s / output_total}
    return result


def markdown(groups: dict[str, dict], sizes: Sequence[int]) -> str:
    lines = ["| text | tokens | " + " | ".join(f"N={n}" for n in sizes) + " |",
             "|---|---:|" + "---:|" * len(sizes)]
    for group, entry in groups.items():
        for key, label in (("prompt", "prompt, id < N"), ("output", "output, id < N"), ("output_in_s", "output, in S")):
            count = entry["prompt_tokens"] if key == "prompt" else entry["output_tokens"]
            cells = " | ".join(f"{100 * entry['coverage'][n][key]:.1f}%" for n in sizes)
            lines.append(f"| {group}: {label} | {count} | {cells} |")
    return "\n".join(lines)


@torch.no_grad()
def run_vocab_coverage(question_sets: Sequence[str] = ("default", "heldout"), sizes: Sequence[int] = DEFAULT_SIZES,
                       new_tokens: int = 96, out: str | None = None) -> str:
    """Generate the target's greedy continuation of every question's first turn (bf16), measure the
    coverage per question group and overall (the target packed where
    this machine packs bf16), print and (with ``out``) write vocab_coverage.md/.json."""
    from . import loading

    target, tokenizer = loading.load(QWEN_TARGET, torch.bfloat16)
    if torch.bfloat16 in cpu.supported_dtypes():
        target = loading.pack(target)  # the same greedy text, sooner
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    per_group: dict[str, tuple[list, list]] = {}
    questions = [question for name in question_sets for question in questions_of(name)]
    for question in tqdm(questions, desc="target greedy continuations"):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question.turns[0]}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        output = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens)
        prompts, outputs = per_group.setdefault(question.group, ([], []))
        prompts.append(ids[0].tolist())
        outputs.append(output[0, ids.shape[1]:].tolist())
    groups = {"all": ([p for ps, _ in per_group.values() for p in ps], [o for _, os in per_group.values() for o in os])}
    groups.update(per_group)
    result = {
        group: {"coverage": coverage(prompts, outputs, sizes, special), "prompt_tokens": sum(map(len, prompts)),
                "output_tokens": sum(map(len, outputs))}
        for group, (prompts, outputs) in groups.items()
    }
    machine = hardware.describe_machine()
    text = (f"Token coverage of a restricted drafter vocabulary (Qwen2.5 tokenizer, {len(tokenizer)} ids); "
            f"{len(questions)} questions ({', '.join(question_sets)}), target {QWEN_TARGET} bf16 greedy, "
            f"{new_tokens} new tokens:\n\n" + markdown(result, sizes) + "\n")
    if out is not None:
        directory = Path(out)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "vocab_coverage.md").write_text(text)
        record = {"command": " ".join(["hf-polybasic", *sys.argv[1:]]), "machine": machine, "sizes": list(sizes),
                  "question_sets": list(question_sets), "new_tokens": new_tokens, "groups": result}
        (directory / "vocab_coverage.json").write_text(json.dumps(record, indent=1) + "\n")
    return text
