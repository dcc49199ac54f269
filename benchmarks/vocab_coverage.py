"""``python -m benchmarks vocab-coverage``: how much of real text a restricted drafter vocabulary covers.

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
the acceptance a restricted drafter can keep. With ``drafters``, it also measures that acceptance:
the greedy agreement of each drafter with the recorded outputs, restricted to S for each N and
unrestricted. While a greedy draft matches the target it was fed exactly the target's text, so one
teacher-forced forward over prompt and output gives the drafter's logits at every position, and
its restricted draft there is the argmax over S (the first N ids, the special tokens and the tokens
before it, as `restricted_vocabulary` keeps them): the agreement at a position is how many of the
next K recorded tokens it drafts before the first miss, averaged over every position that leaves K.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from hf_polybasic.cli.model_sets import QWEN_DRAFT, QWEN_TARGET

from .bench.prompts import questions_of

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


@torch.no_grad()
def drafter_agreement(model, prompts: Sequence[list[int]], outputs: Sequence[list[int]], sizes: Sequence[int],
                      special: set[int], k: int = 8) -> dict:
    """{N or "all": mean leading matches (0..k)} of ``model``'s greedy drafts of k tokens from every
    position of each output, restricted to S for each N (see the module docs) and unrestricted."""
    matches: dict = {key: [] for key in ("all", *sizes)}
    for prompt, output in zip(prompts, outputs):
        if not output:
            continue
        ids = torch.tensor([prompt + output])
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(output) - 1].float()  # row j predicts output[j]
        target = torch.tensor(output)
        hits = {"all": logits.argmax(-1) == target}
        seen = set(prompt) | special
        extras = []  # per position: ids >= 0 kept besides the first N (special and fed so far)
        for token in output:
            extras.append(sorted(seen))
            seen.add(token)
        for n in sizes:
            best, index = logits[:, :n].max(-1)
            for j, kept in enumerate(extras):
                outside = [i for i in kept if i >= n]
                if outside:
                    values = logits[j, outside]
                    if float(values.max()) > float(best[j]):
                        index[j] = outside[int(values.argmax())]
            hits[n] = index == target
        for key, hit in hits.items():
            run = hit.tolist()
            for start in range(len(run) - k + 1):  # every position that leaves k tokens to compare
                count = 0
                while count < k and run[start + count]:
                    count += 1
                matches[key].append(count)
    return {key: sum(values) / max(len(values), 1) for key, values in matches.items()}


def markdown(groups: dict[str, dict], sizes: Sequence[int]) -> str:
    lines = ["| text | tokens | " + " | ".join(f"N={n}" for n in sizes) + " |",
             "|---|---:|" + "---:|" * len(sizes)]
    for group, entry in groups.items():
        for key, label in (("prompt", "prompt, id < N"), ("output", "output, id < N"), ("output_in_s", "output, in S")):
            count = entry["prompt_tokens"] if key == "prompt" else entry["output_tokens"]
            cells = " | ".join(f"{100 * entry['coverage'][n][key]:.1f}%" for n in sizes)
            lines.append(f"| {group}: {label} | {count} | {cells} |")
    return "\n".join(lines)


def agreement_markdown(agreement: dict[str, dict], sizes: Sequence[int]) -> str:
    lines = ["| drafter | unrestricted | " + " | ".join(f"N={n}" for n in sizes) + " |",
             "|---|---:|" + "---:|" * len(sizes)]
    for name, values in agreement.items():
        cells = " | ".join(f"{values[n]:.2f} ({values[n] / values['all']:.0%})" for n in sizes)
        lines.append(f"| {name} | {values['all']:.2f} | {cells} |")
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
                       out: str | None = None, drafters: Sequence[str] = (), k: int = 8) -> str:
    """Coverage per decoding mode and question group, and over all; with ``drafters`` ("int8",
    "bf16": the 0.5B so loaded) their greedy agreement with the greedy outputs, K = ``k``, per N;
    printed and (with ``out``) written as vocab_coverage.md/.json."""
    from hf_polybasic.cli import loading

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
    agreement = {}
    if drafters and "greedy: all" in groups:
        prompts, outputs = groups["greedy: all"]
        for kind in drafters:
            model = (loading.load_int8(QWEN_DRAFT) if kind == "int8" else
                     loading.load(QWEN_DRAFT, {"bf16": torch.bfloat16, "fp32": torch.float32}[kind])[0])
            agreement[f"0.5B {kind}"] = drafter_agreement(model, prompts, outputs, sizes, special, k)
            del model
    text = (f"Share of tokens a restricted drafter vocabulary holds (Qwen2.5 tokenizer, {len(tokenizer)} ids): the first "
            f"N ids, the {len(special)} special tokens and every token fed before; prompts and plain generate's "
            f"outputs (first turns) from {', '.join(results)}:\n\n" + markdown(measured, sizes) + "\n")
    if agreement:
        text += (f"\nGreedy agreement of the drafter with those greedy outputs: mean leading matches of K = {k} drafts "
                 f"from every position (teacher-forced), unrestricted and restricted to S:\n\n"
                 + agreement_markdown(agreement, sizes) + "\n")
    if out is not None:
        directory = Path(out)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "vocab_coverage.md").write_text(text)
        record = {"command": " ".join(["hf-polybasic", *sys.argv[1:]]), "sizes": list(sizes),
                  "results": list(results), "groups": measured, "k": k, "agreement": agreement}
        (directory / "vocab_coverage.json").write_text(json.dumps(record, indent=1) + "\n")
    return text
