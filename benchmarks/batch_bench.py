"""``python -m benchmarks batches``: batched decoding, ours against plain batched ``generate``, per batch size.

transformers refuses assisted generation for more than one row, so the user's alternative for a
batch is plain batched ``generate``. For each batch size B, the first B prompts of the shipped code
prompts (held-out set first, then the default set's) are left-padded into one batch and decoded by
plain ``generate`` and by ours (``assistant_models=[draft]``, the default config), interleaved
within each repeat; medians over repeats. The first call of each method in the process (kernels
built, cost curves read or measured) is timed on its own and reported as the first call's speedup. Reported per B: total new tokens per second of each,
the speedup, how many rows are identical to plain ``generate``'s (with a bf16 target, k-token and
1-token forwards round differently, so near-ties may flip), the target's forwards per round of
ours, and the process's peak memory while each ran.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_polybasic.config import PolybasicConfig
from hf_polybasic.generation import generate as polybasic_generate
from hf_polybasic.generation import last_stats
from hf_polybasic.cli.harness import process_peak_rss_mib, timed_call
from hf_polybasic.cli.machine import command_line, machine_info
from hf_polybasic.cli.model_sets import build_model_set

from .bench.prompts import questions_of


def code_prompts(count: int, question_set: str = "heldout") -> list[str]:
    """The first ``count`` code prompts of a shipped set (``heldout``: the held-out set's, then the
    default set's; ``unseen``: the second held-out set's, then the first's)."""
    sets = {"heldout": ("heldout", "default"), "unseen": ("unseen", "heldout")}[question_set]
    texts = [q.turns[0] for name in sets for q in questions_of(name) if q.group == "code"]
    if count > len(texts):
        raise ValueError(f"at most {len(texts)} rows: there are {len(texts)} code prompts")
    return texts[:count]


def encode_batch(tokenizer, texts: list[str]) -> dict:
    """The chat-templated prompts, left-padded into one batch."""
    tokenizer.padding_side = "left"
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
             for t in texts]
    return dict(tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False))


def run_batches(models: str, target_dtype: str, pack_target: bool, batch_sizes: list[int], max_new_tokens: int,
                repeats: int, output: str | None, progress: bool = True, question_set: str = "heldout") -> dict:
    model_set = build_model_set(models, {"draft"}, target_dtype, pack_target=pack_target)
    target, tokenizer, draft = model_set.target, model_set.tokenizer, model_set.pool["draft"]
    options = dict(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                   **model_set.generate_options)
    config = PolybasicConfig()

    def plain(batch):
        return target.generate(**batch, **options)

    def ours(batch):
        return target.generate(**batch, custom_generate=polybasic_generate, assistant_models=[draft],
                               polybasic_config=config, **options)

    batches = {size: encode_batch(tokenizer, code_prompts(size, question_set)) for size in batch_sizes}
    firsts = {}
    for size, batch in batches.items():  # the first call of each (kernels, cost curves), timed on its own
        firsts[size] = {name: timed_call(lambda call=call: call(batch), target=target).seconds
                        for name, call in (("plain", plain), ("ours", ours))}
    runs = {size: {"plain": [], "ours": []} for size in batch_sizes}
    steps = tqdm(total=repeats * len(batch_sizes) * 2, desc="batches", disable=not progress)
    for _ in range(repeats):
        for size, batch in batches.items():
            for name, call in (("plain", plain), ("ours", ours)):
                timing = timed_call(lambda: call(batch), target=target)
                width = batch["input_ids"].shape[1]
                new = timing.output[:, width:]
                tokens = int((new != tokenizer.pad_token_id).sum())
                record = {"seconds": timing.seconds, "new_tokens": tokens, "tokens_per_second": tokens / timing.seconds,
                          "target_forwards": timing.target_forwards, "rss_peak_mib": timing.rss_peak_mib,
                          "sequences": timing.output.tolist()}
                if name == "ours":
                    stats = last_stats(target)
                    record["verifications"] = stats.levels[0].verifications
                runs[size][name].append(record)
                steps.update()
    steps.close()
    rows = []
    for size in batch_sizes:
        plain_rate = statistics.median(r["tokens_per_second"] for r in runs[size]["plain"])
        ours_rate = statistics.median(r["tokens_per_second"] for r in runs[size]["ours"])
        reference = runs[size]["plain"][0]["sequences"]
        identical = sum(a == b for a, b in zip(runs[size]["ours"][0]["sequences"], reference))
        last = runs[size]["ours"][-1]
        rows.append({
            "batch": size, "plain_tok_s": plain_rate, "ours_tok_s": ours_rate, "speedup": ours_rate / plain_rate,
            "first_call_speedup": firsts[size]["plain"] / firsts[size]["ours"],  # same tokens: a ratio of times
            "rows_identical": f"{identical}/{size}",
            "rows_per_target_forward": last["verifications"] / max(last["target_forwards"] - 0, 1),
            "plain_peak_rss_mib": max(r["rss_peak_mib"] or 0 for r in runs[size]["plain"]),
            "ours_peak_rss_mib": max(r["rss_peak_mib"] or 0 for r in runs[size]["ours"]),
        })
    result = {"command": command_line(), "machine": machine_info(), "models": model_set.info,
              "max_new_tokens": max_new_tokens, "repeats": repeats, "question_set": question_set, "rows": rows,
              "runs": runs, "first_calls": firsts,
              "process_peak_rss_mib": process_peak_rss_mib()}
    table = markdown(result)
    if output:
        out = Path(output)
        out.mkdir(parents=True, exist_ok=True)
        (out / "batches.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "batches.md").write_text(table + "\n")
    return result


def markdown(result: dict) -> str:
    machine = result["machine"]
    lines = [
        f"Machine: {machine.get('cpu')}, {machine.get('class')}, {machine.get('torch_threads')} threads; "
        f"flags {', '.join(machine.get('cpu_flags', []))}",
        f"Models: {result['models'].get('target')} <- {result['models'].get('pool', {}).get('draft')}; greedy, "
        f"{result['max_new_tokens']} new tokens per row, medians of {result['repeats']} interleaved repeats "
        f"(first call: the first call of each method in the process, timed alone); code prompts of the "
        f"{result.get('question_set', 'heldout')} set",
        f"Command: `{result['command']}`",
        "",
        "| batch | plain generate (tok/s) | ours (tok/s) | speedup | first call | rows identical | "
        "rows per target forward | peak RSS plain / ours (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        first = row.get("first_call_speedup")
        lines.append(
            f"| {row['batch']} | {row['plain_tok_s']:.2f} | {row['ours_tok_s']:.2f} | **{row['speedup']:.2f}x** | "
            f"{'-' if first is None else f'{first:.2f}x'} | "
            f"{row['rows_identical']} | {row['rows_per_target_forward']:.2f} | "
            f"{row['plain_peak_rss_mib']:.0f} / {row['ours_peak_rss_mib']:.0f} |"
        )
    return "\n".join(lines)
