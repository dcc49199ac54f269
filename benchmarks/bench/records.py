"""The results cache: one JSON line per finished unit, keyed by everything that changes what it measures."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from . import prompts as prompt_sets
from .methods import Method
from .settings import DECODINGS, BenchSettings


def question_seed(base_seed: int, question_id: str, turn: int) -> int:
    """The fixed sampling seed of one question turn: the same for every method and repeat."""
    digest = hashlib.sha256(f"{base_seed}:{question_id}:{turn}".encode()).hexdigest()
    return int(digest[:8], 16)


def fingerprint(settings: BenchSettings, model_info: dict) -> str:
    """What a cached result must share with this run to be reused (besides question and method)."""
    keyed = {
        # the pool depends on the selected methods; each method's spec names the models it uses
        "models": {key: value for key, value in model_info.items() if key != "pool"},
        "target_dtype": settings.target_dtype,
        "decoding": DECODINGS[settings.decoding],
        "max_new_tokens": settings.max_new_tokens,
        "seed": settings.seed if not settings.greedy else None,
        "threads": settings.threads or torch.get_num_threads(),
    }
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]


def unit_key(fp: str, method: Method, question: prompt_sets.Question, turn: int, repeat: int) -> tuple:
    return (fp, method.name, method.spec_digest, question.question_id, question.digest, turn, repeat)


def record_key(record: dict) -> tuple:
    return (
        record["fingerprint"],
        record["method"],
        record["method_spec"],
        record["question_id"],
        record["question_digest"],
        record["turn"],
        record["repeat"],
    )


def read_records(path: Path) -> list[dict]:
    """The JSON lines of a results file; a torn last line (an interrupted write) is ignored."""
    if not path.exists():
        return []
    records = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records
