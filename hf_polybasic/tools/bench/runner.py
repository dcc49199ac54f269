"""Running the benchmark: every method on every question, timed, cached, resumable.

One *unit* of work is one ``generate`` call: (question, turn, method, repeat). Each finished unit
is appended at once as one JSON line to ``results.jsonl`` in the output directory; a rerun with the
same settings skips every unit already there. Settings that change what a unit measures (models,
target dtype, decoding, budget, seed, threads, the question's text, the method's own settings) are
part of its cache key, so changed settings never reuse stale results; adding repeats, questions or
methods only runs what is new.

Order: for each repeat, for each question, each method in turn (plain first) runs all turns of the
question, so slow drift of a shared machine hits every method alike. Each method gets ``warmup``
untimed short calls before its first timed call in a process.

Measured per unit: new tokens, wall time (``time.perf_counter`` around the ``generate`` call
only: tokenizing and decoding are outside), tokens/s, the target's forward calls (a forward
pre-hook on the target; plain generate makes one per token), ours' per-level statistics from
`hf_polybasic.last_stats`, and the process's resident memory (RSS) before, after and at its
sampled peak during the call.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from . import prompts as prompt_sets
from ..harness import process_peak_rss_mib, timed_call
from ..model_sets import ModelSet, build_model_set
from .methods import Method, MethodOptions, build_methods, needed_pool, resolve_names
from .report import first_difference, write_report

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
    """What to run; see ``hf-polybasic bench --help`` for each field."""

    models: str = "tiny"
    target_dtype: str = "fp32"
    methods: tuple[str, ...] | None = None
    question_file: str | None = None
    groups: tuple[str, ...] | None = None
    questions_per_group: int | None = None
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
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
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


# ------------------------------------------------------------------------------ measurement
def command_line() -> str:
    """This process's command line, as typed (``python -m hf_polybasic.tools.bench`` for the module)."""
    program = sys.argv[0] if sys.argv else "python"
    if program.endswith("__main__.py"):
        head = ["python", "-m", "hf_polybasic.tools.bench"]
    else:
        head = [Path(program).name]
    return shlex.join(head + sys.argv[1:])


def question_seed(base_seed: int, question_id: str, turn: int) -> int:
    """The fixed sampling seed of one question turn: the same for every method and repeat."""
    digest = hashlib.sha256(f"{base_seed}:{question_id}:{turn}".encode()).hexdigest()
    return int(digest[:8], 16)


# -------------------------------------------------------------------------------- environment
def machine_info() -> dict:
    """CPU model, cores, memory, library versions, git commit and load at the start of the run."""
    import transformers

    from ... import __version__

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_polybasic": __version__,
    }
    try:
        import psutil

        info["physical_cores"] = psutil.cpu_count(logical=False)
        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
        info["psutil"] = psutil.__version__
    except ImportError:  # pragma: no cover
        pass
    if hasattr(os, "getloadavg"):
        info["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
    info.update(_git_state())
    return info


def _git_state() -> dict:
    root = Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"git_commit": commit, "git_dirty": bool(dirty)}


# ------------------------------------------------------------------------------------ the run
def load_questions(settings: BenchSettings) -> tuple[list[prompt_sets.Question], dict]:
    """The selected questions and a description of where they came from."""
    if settings.question_file:
        questions = prompt_sets.load_question_file(settings.question_file)
        source = {
            "file": str(Path(settings.question_file).resolve()),
            "sha256": prompt_sets.file_digest(settings.question_file),
        }
    else:
        questions = prompt_sets.default_questions()
        source = {"file": None, "default_set_sha256": prompt_sets.default_set_digest()}
    chosen = prompt_sets.select(questions, settings.groups, settings.questions_per_group)
    if not chosen:
        raise ValueError("no questions selected")
    return chosen, source


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


def encode(model_set: ModelSet, messages: list[dict], max_new_tokens: int) -> tuple[dict, int]:
    """Chat-templated inputs (``add_generation_prompt=True``), cut to the model's context if needed;
    also returns how many prompt tokens were cut."""
    encoded = model_set.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    input_ids = encoded["input_ids"]
    attention_mask = encoded.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    cut = 0
    if model_set.context_length is not None:
        room = model_set.context_length - max_new_tokens
        if room < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in this model's context")
        cut = max(0, input_ids.shape[1] - room)
        input_ids, attention_mask = input_ids[:, cut:], attention_mask[:, cut:]
    device = next(model_set.target.parameters()).device
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}, cut


def messages_for(question: prompt_sets.Question, turn: int, answers: list[str]) -> list[dict]:
    """The chat for ``turn``: earlier user turns each followed by this method's own answer."""
    messages = []
    for index in range(turn):
        messages.append({"role": "user", "content": question.turns[index]})
        messages.append({"role": "assistant", "content": answers[index]})
    messages.append({"role": "user", "content": question.turns[turn]})
    return messages


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
    timing = timed_call(lambda: method.run(model_set.target, inputs, options), target=model_set.target)
    sequences, seconds = timing.output, timing.seconds
    if not isinstance(sequences, torch.Tensor):  # a ModelOutput
        sequences = sequences.sequences
    new = sequences[0, prompt_length:].tolist()
    stats = method.stats(model_set.target)
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
        "levels": _level_rows(stats, method.level_labels),
    }


def _say(message: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(message, file=sys.stderr)


def describe_run(
    settings: BenchSettings, extra_methods: Sequence[Method] = (), model_set: ModelSet | None = None, load: bool = True
) -> tuple[ModelSet, list[Method], list[prompt_sets.Question], dict]:
    """The model set, the methods, the questions and the run description (run.json) of ``settings``.

    With ``load=False`` no model is loaded: enough to describe the run and find its cached results.
    """
    questions, source = load_questions(settings)
    names = resolve_names(settings.methods)
    if model_set is None:
        model_set = build_model_set(
            settings.models, needed_pool(names), settings.target_dtype, settings.cache_dir, load=load
        )
    methods = build_methods(model_set, names, settings.method_options) + list(extra_methods)
    taken = [m.name for m in methods]
    if len(set(taken)) != len(taken):
        raise ValueError(f"method names must be unique, got {taken}")
    run_info = {
        "settings": asdict(settings),
        "fingerprint": fingerprint(settings, model_set.info),
        "command": settings.command or command_line(),
        "machine": machine_info(),
        "models": model_set.info,
        "methods": [
            {
                "name": m.name,
                "kind": m.kind,
                "description": m.description,
                "spec": m.spec,
                "spec_digest": m.spec_digest,
                "lossless": m.lossless,
                "polybasic": m.polybasic,
            }
            for m in methods
        ],
        "questions": {"source": source, "ids": [q.question_id for q in questions]},
        "decoding": DECODINGS[settings.decoding],
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "finished": None,
    }
    return model_set, methods, questions, run_info


def run_benchmark(
    settings: BenchSettings,
    extra_methods: Sequence[Method] = (),
    model_set: ModelSet | None = None,
) -> BenchResult:
    """Run (or resume) the benchmark described by ``settings`` and write its report.

    ``extra_methods`` are run after the named ones (custom comparisons, tests); ``model_set`` may
    be given to reuse loaded models.
    """
    from tqdm.auto import tqdm

    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    out = Path(settings.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_set, methods, questions, run_info = describe_run(settings, extra_methods, model_set, load=True)
    fp = run_info["fingerprint"]
    # written now, so that a run stopped half-way can still be reported (--report-only)
    (out / RUN_FILE).write_text(json.dumps(run_info, indent=2) + "\n", encoding="utf-8")

    results_path = out / RESULTS_FILE
    done = {record_key(r): r for r in read_records(results_path)}

    units = [
        (repeat, question, method, turn)
        for repeat in range(settings.repeats)
        for question in questions
        for method in methods
        for turn in range(len(question.turns))
    ]
    pending = [u for u in units if unit_key(fp, u[2], u[1], u[3], u[0]) not in done]
    units_cached = len(units) - len(pending)
    bar = tqdm(total=len(pending), desc="bench", unit="gen", file=sys.stderr, disable=not settings.progress)
    warmed: set[str] = set()
    greedy = settings.greedy
    plain_name = methods[0].name
    with open(results_path, "a", encoding="utf-8") as sink:
        for repeat in range(settings.repeats):
            for question in questions:
                for method in methods:
                    answers: list[str] = []
                    for turn in range(len(question.turns)):
                        key = unit_key(fp, method, question, turn, repeat)
                        if key in done:
                            answers.append(done[key]["output_text"])
                            continue
                        if method.name not in warmed:
                            bar.set_postfix_str(f"{method.name} warm-up")
                            _warm_up(method, model_set, questions[0], settings)
                            warmed.add(method.name)
                        bar.set_postfix_str(f"{method.name} {question.question_id} turn {turn + 1}")
                        seed = None if greedy else question_seed(settings.seed, question.question_id, turn)
                        measured = generate_once(
                            method, model_set, messages_for(question, turn, answers), settings, seed
                        )
                        record = {
                            "fingerprint": fp,
                            "method": method.name,
                            "method_spec": method.spec_digest,
                            "question_id": question.question_id,
                            "question_digest": question.digest,
                            "turn": turn,
                            "repeat": repeat,
                            "group": question.group,
                            "category": question.category,
                            **measured,
                            "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        }
                        if greedy and method.lossless and method.name != plain_name:
                            plain_record = done.get(unit_key(fp, methods[0], question, turn, repeat))
                            record["mismatch"] = mismatch_detail(
                                record, plain_record, model_set, messages_for(question, turn, answers), settings
                            )
                        sink.write(json.dumps(record) + "\n")
                        sink.flush()
                        done[key] = record
                        answers.append(record["output_text"])
                        bar.update(1)
    bar.close()
    run_info["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    run_info["process_max_rss_mib"] = process_peak_rss_mib()
    run_info["units"] = {"total": len(units), "run": len(pending), "cached": units_cached}
    (out / RUN_FILE).write_text(json.dumps(run_info, indent=2) + "\n", encoding="utf-8")

    wanted = {unit_key(fp, m, q, t, r) for (r, q, m, t) in units}
    records = [done[k] for k in done if k in wanted]
    summary, mismatches, files = write_report(out, run_info, records, methods, questions)
    return BenchResult(out, summary, mismatches, len(pending), units_cached, files)


def _warm_up(method: Method, model_set: ModelSet, question: prompt_sets.Question, settings: BenchSettings) -> None:
    """Untimed short calls, so one-off costs (allocations, lazy init) are not timed."""
    messages = messages_for(question, 0, [])
    for _ in range(settings.warmup):
        seed = None if settings.greedy else question_seed(settings.seed, "warm-up", 0)
        budget = min(WARMUP_TOKENS, settings.max_new_tokens)
        generate_once(method, model_set, messages, settings, seed, max_new_tokens=budget)


# relative logit gap below which a greedy mismatch counts as a numeric near-tie: two units in the
# last place of the target's dtype (bf16 keeps 8 significant bits, fp16 11, fp32 24)
NEAR_TIE_ULPS = 2
MANTISSA_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}


@torch.no_grad()
def mismatch_detail(record, plain_record, model_set: ModelSet, messages, settings: BenchSettings) -> dict | None:
    """None if the greedy output equals plain generate's; else where it first differs and the
    target's logits of the two tokens there (one full forward over the common prefix), so a bf16
    near-tie is told apart from a bug."""
    if plain_record is None:
        return None
    position = first_difference(record["output_ids"], plain_record["output_ids"])
    if position is None:
        return None
    detail = {"position": position}
    if record["turn"] > 0 and record.get("prompt_tokens") != plain_record.get("prompt_tokens"):
        return detail  # an earlier turn already differed: the prompts differ, logits are not comparable
    ids = record["output_ids"], plain_record["output_ids"]
    if position >= min(len(ids[0]), len(ids[1])):  # one output stopped earlier
        _say(f"!!! GREEDY MISMATCH: {record['method']} {record['question_id']}: lengths differ at token {position}")
        return detail
    inputs, _ = encode(model_set, messages, settings.max_new_tokens)
    prefix = torch.tensor([plain_record["output_ids"][:position]], dtype=torch.long, device=inputs["input_ids"].device)
    sequence = torch.cat([inputs["input_ids"], prefix], dim=1)
    logits = model_set.target(sequence, logits_to_keep=1).logits[0, -1].float()
    method_logit, plain_logit = float(logits[ids[0][position]]), float(logits[ids[1][position]])
    gap = abs(plain_logit - method_logit)
    bits = MANTISSA_BITS.get(model_set.target.dtype, 24)
    relative_gap = gap / max(abs(plain_logit), abs(method_logit), 1e-12)
    near_tie = relative_gap <= NEAR_TIE_ULPS * 2.0 ** (1 - bits)
    detail.update(method_logit=method_logit, plain_logit=plain_logit, relative_gap=relative_gap, near_tie=near_tie)
    _say(
        f"!!! GREEDY MISMATCH: {record['method']} {record['question_id']} turn {record['turn'] + 1} at new token "
        f"{position}: logits {method_logit:.4f} (method) vs {plain_logit:.4f} (plain), "
        f"{'a numeric near-tie' if near_tie else 'NOT a near-tie'}"
    )
    return detail


@dataclass(frozen=True)
class MethodInfo:
    """What the report needs of a method, read back from run.json (for `rebuild_report`)."""

    name: str
    kind: str
    description: str
    spec_digest: str
    lossless: bool = True
    polybasic: bool = False


def rebuild_report(output_dir: str | Path, settings: BenchSettings | None = None) -> BenchResult:
    """Rewrite the tables and plots of ``output_dir`` from its cached results, running nothing.

    The run is the one described by the directory's run.json (its fingerprint, methods and
    questions); without a run.json, ``settings`` describe it (no model is loaded).
    """
    out = Path(output_dir)
    run_file = out / RUN_FILE
    if run_file.exists():
        run_info = json.loads(run_file.read_text(encoding="utf-8"))
        settings = BenchSettings(**{**run_info["settings"], "methods": None, "groups": None})
        all_questions, _ = load_questions(BenchSettings(**{**asdict(settings), "questions_per_group": None}))
        by_id = {q.question_id: q for q in all_questions}
        questions = [by_id[i] for i in run_info["questions"]["ids"] if i in by_id]
        methods = [
            MethodInfo(m["name"], m["kind"], m["description"], m["spec_digest"], m["lossless"], m["polybasic"])
            for m in run_info["methods"]
        ]
    elif settings is not None:
        _, methods, questions, run_info = describe_run(settings, load=False)
        run_info["started"] = None
        run_info["note"] = "run.json was missing: described from the report command's settings"
        run_file.write_text(json.dumps(run_info, indent=2) + "\n", encoding="utf-8")
    else:
        raise FileNotFoundError(f"{run_file} not found: run the benchmark into {out} first")
    wanted = {(m.name, m.spec_digest) for m in methods}
    digests = {q.question_id: q.digest for q in questions}
    records = [
        r
        for r in read_records(out / RESULTS_FILE)
        if r["fingerprint"] == run_info["fingerprint"]
        and (r["method"], r["method_spec"]) in wanted
        and digests.get(r["question_id"]) == r["question_digest"]
        and r["repeat"] < settings.repeats
    ]
    summary, mismatches, files = write_report(out, run_info, records, methods, questions)
    return BenchResult(out, summary, mismatches, 0, len(records), files)
