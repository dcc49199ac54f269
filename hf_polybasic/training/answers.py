"""Self-distillation data: the model's own answers to prompts (what EAGLE recommends training a head on:
the head learns to draft what its verifier writes, not what a data set's authors wrote).

Each prompt goes through the tokenizer's chat template (with the generation prompt) where it has one,
else its messages' contents are joined; prompts are answered in left-padded batches by plain
``model.generate`` (greedy, or sampled at ``temperature`` with a seed per batch, drawn without touching
the caller's random state). A document is the prompt's ids and the answer's, up to and including its
first end-of-text id. Answers are appended to a JSONL file as each batch finishes, so an interrupted run
answers only the prompts it had not.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The ids a chat model reads before answering ``messages``."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = "\n".join(str(message["content"]) for message in messages)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def end_ids(model, tokenizer) -> set[int]:
    """The ids that end an answer: the model's generation config's EOS, else the tokenizer's."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return set() if eos is None else set(eos if isinstance(eos, (list, tuple)) else [eos])


def answered(model, tokenizer, prompts: Sequence[list[dict]], path: Path, new_tokens: int, batch_size: int,
             temperature: float, seed: int, progress: bool = True) -> list[list[int]]:
    """Each prompt's ids followed by the model's answer (see the module docstring), read from ``path``
    where an earlier run wrote them and generated (and appended there) for the others."""
    from tqdm.auto import tqdm

    done: dict[int, list[int]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
                done[int(row["index"])] = list(row["ids"])
            except (ValueError, KeyError, TypeError):  # a line cut by an interruption: answered again
                continue
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("train_head: the tokenizer has neither a pad nor an EOS token, so prompts cannot be answered "
                         "in batches; set tokenizer.pad_token_id")
    stops = end_ids(model, tokenizer)
    device = model.get_input_embeddings().weight.device
    batches = [list(range(start, min(start + batch_size, len(prompts))))
               for start in range(0, len(prompts), batch_size)]
    todo = [batch for batch in batches if any(index not in done for index in batch)]
    bar = tqdm(total=len(batches), initial=len(batches) - len(todo), desc="answers", unit="batch", disable=not progress)
    with path.open("a") as sink:
        for batch in todo:
            rows = [prompt_ids(tokenizer, prompts[index]) for index in batch]
            width = max(map(len, rows))
            ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows], device=device)
            mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], device=device)
            sampling = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) if temperature > 0 else \
                dict(do_sample=False)
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
                torch.manual_seed(seed * 1_000_003 + batch[0])
                out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, pad_token_id=pad,
                                     **sampling)
            for index, row, generated in zip(batch, rows, out[:, width:].tolist()):
                answer = []
                for token in generated:
                    answer.append(token)
                    if token in stops:
                        break
                done[index] = row + answer
                sink.write(json.dumps({"index": index, "ids": done[index]}) + "\n")
            sink.flush()
            bar.update(1)
    bar.close()
    return [done[index] for index in range(len(prompts))]
