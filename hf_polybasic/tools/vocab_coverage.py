"""``hf-polybasic vocab-coverage``: how much of real text a restricted drafter vocabulary covers.

`hf_polybasic.levels.restricted_vocabulary` keeps the first N token ids (BPE merge order, which
follows frequency), the special tokens, and every token the drafter has been fed. This measures,
on the target's own outputs recorded by the benchmark (plain ``generate``'s ``output_ids`` in a
``results.jsonl``, first turns of the shipped question sets) and on their prompts (chat-templated
again with the Qwen tokenizer; no model runs), the share of tokens such an S holds:

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

from .bench.prompts import questions_of
from .model_sets import QWEN_TARGET

DEFAULT_SIZES = (8192, 16384, 32768, 49152, 65536)
# the benchmark's committed runs: greedy on both shipped sets, and sampled (T 0.7, top-p 0.9)
DEFAULT_RESULTS = ("docs/results/heldout-avx512/results.jsonl", "docs/results/bench/results.jsonl",
                   "docs/results/bench-sample/results.jsonl")


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


def _recorded_texts(path: Path, tokenizer) -> dict[str, tuple[list, list]]:
    """"<greedy|sampled> <group>" -> (prompts, outputs): plain generate's first turns in ``path``."""
    questions = {q.question_id: q for name in ("default", "heldout") for q in questions_of(name)}
    run = json.loads((path.parent / "run.json").read_text())
    mode = "sampled" if run.get("decoding", {}).get("do_sample") else "greedy"
    texts: dict[str, tuple[list, list]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["method"] != "plain" or record["repeat"] != 0 or record["turn"] != 0:
            continue
        question = questions.get(record["question_id"])
        if question is None:  # a question of another file: its text is not known here
            continue
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question.turns[0]}],
                                            add_generation_prompt=True, return_dict=True)["input_ids"]
        prompts, outputs = texts.setdefault(f"{mode} {record['group']}", ([], []))
        prompts.append(list(ids))
        outputs.append(list(record["output_ids"]))
    return texts


def run_vocab_coverage(results: Sequence[str] = DEFAULT_RESULTS, sizes: Sequence[int] = DEFAULT_SIZES,
                       out: str | None = None) -> str:
    """Coverage per decoding mode and question group, and over all; printed and (with ``out``)
    written as vocab_coverage.md/.json."""
    from . import loading

    tokenizer = loading.load_tokenizer(QWEN_TARGET)
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    groups: dict[str, tuple[list, list]] = {}
    for path in results:
        for key, (prompts, outputs) in _recorded_texts(Path(path), tokenizer).items():
            groups.setdefault(key, ([], []))[0].extend(prompts)
            groups[key][1].extend(outputs)
    for mode in ("greedy", "sampled"):
        parts = [value for key, value in groups.items() if key.startswith(mode)]
        if parts:
            groups[f"{mode}: all"] = ([p for ps, _ in parts for p in ps], [o for _, os in parts for o in os])
    ordered = dict(sorted(groups.items(), key=lambda item: (item[0].split()[0], ": all" not in item[0], item[0])))
    measured = {
        key: {"coverage": coverage(prompts, outputs, sizes, special), "prompt_tokens": sum(map(len, prompts)),
              "output_tokens": sum(map(len, outputs)), "questions": len(prompts)}
        for key, (prompts, outputs) in ordered.items()
    }
    text = (f"Share of tokens a restricted drafter vocabulary holds (Qwen2.5 tokenizer, {len(tokenizer)} ids): the first "
            f"N ids, the {len(special)} special tokens and every token fed before; prompts and plain generate's "
            f"outputs (first turns) from {', '.join(results)}:\n\n" + markdown(measured, sizes) + "\n")
    if out is not None:
        directory = Path(out)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "vocab_coverage.md").write_text(text)
        record = {"command": " ".join(["hf-polybasic", *sys.argv[1:]]), "sizes": list(sizes),
                  "results": list(results), "groups": measured}
        (directory / "vocab_coverage.json").write_text(json.dumps(record, indent=1) + "\n")
    return text
