"""What a benchmark run is: its settings, the decodings it knows, where its results go."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .methods import MethodOptions
from .prompts import QUESTION_SETS

RESULTS_FILE = "results.jsonl"
RUN_FILE = "run.json"

DECODINGS: dict[str, dict[str, Any]] = {
    "greedy": {"do_sample": False},
    "sample-t1": {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0},
    "sample-t0.7-p0.9": {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 0},
}
WARMUP_TOKENS = 8


@dataclass
class BenchSettings:
    """What to run; see ``python -m benchmarks bench --help`` for each field."""

    models: str = "tiny"
    target_dtype: str = "fp32"
    pack_target: bool = False
    methods: tuple[str, ...] | None = None
    question_file: str | None = None
    question_set: str = "default"
    groups: tuple[str, ...] | None = None
    categories: tuple[str, ...] | None = None
    questions_per_group: int | None = None
    skip_questions: int = 0
    max_new_tokens: int = 256
    decoding: str = "greedy"
    repeats: int = 1
    warmup: int = 1
    seed: int = 0
    num_draft_tokens: int = 4
    block_threshold: int = 8
    lookup_tokens: int = 8
    lookup_max_ngram: int = 3
    threads: int | None = None
    output_dir: str = "bench-results"
    cache_dir: str | None = None
    progress: bool = True
    quick: bool = False
    command: str | None = None

    def __post_init__(self) -> None:
        if self.decoding not in DECODINGS:
            raise ValueError(f"decoding must be one of {list(DECODINGS)}, got {self.decoding!r}")
        for name in ("max_new_tokens", "repeats", "num_draft_tokens", "block_threshold", "lookup_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.question_set not in QUESTION_SETS:
            raise ValueError(f"question_set must be one of {QUESTION_SETS}, got {self.question_set!r}")
        for name in ("warmup", "skip_questions"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.questions_per_group is not None and self.questions_per_group < 1:
            raise ValueError(f"questions_per_group must be >= 1, got {self.questions_per_group}")

    @property
    def method_options(self) -> MethodOptions:
        return MethodOptions(self.num_draft_tokens, self.block_threshold, self.lookup_tokens, self.lookup_max_ngram)

    @property
    def greedy(self) -> bool:
        return not DECODINGS[self.decoding]["do_sample"]


@dataclass
class BenchResult:
    """What `run_benchmark` produced."""

    output_dir: Path
    summary: dict
    mismatches: list[dict]
    units_run: int
    units_cached: int
    files: list[Path] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """1 when a lossless method's greedy output differed from plain generate's, else 0."""
        return 1 if self.mismatches else 0
