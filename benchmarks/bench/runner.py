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

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from hf_polybasic.cli.harness import process_peak_rss_mib
from hf_polybasic.cli.machine import command_line, machine_info
from hf_polybasic.cli.model_sets import ModelSet, build_model_set

from . import prompts as prompt_sets
from .calls import generate_once, messages_for, mismatch_detail
from .methods import Method, build_methods, needed_pool, resolve_names
from .records import fingerprint, question_seed, read_records, record_key, unit_key
from .report import write_report
from .settings import DECODINGS, RESULTS_FILE, RUN_FILE, WARMUP_TOKENS, BenchResult, BenchSettings


def load_questions(settings: BenchSettings) -> tuple[list[prompt_sets.Question], dict]:
    """The selected questions and a description of where they came from."""
    if settings.question_file:
        questions = prompt_sets.load_question_file(settings.question_file)
        source = {
            "file": str(Path(settings.question_file).resolve()),
            "sha256": prompt_sets.file_digest(settings.question_file),
        }
    elif settings.question_set == "default":  # recorded as before, so earlier results stay valid
        questions = prompt_sets.default_questions()
        source = {"file": None, "default_set_sha256": prompt_sets.default_set_digest()}
    else:
        questions = prompt_sets.questions_of(settings.question_set)
        source = {"file": None, "set": settings.question_set, "sha256": prompt_sets.set_digest(settings.question_set)}
    if settings.categories is not None:
        questions = prompt_sets.by_category(questions, settings.categories)
    chosen = prompt_sets.select(questions, settings.groups, settings.questions_per_group, settings.skip_questions)
    if not chosen:
        raise ValueError("no questions selected")
    return chosen, source


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
            settings.models, needed_pool(names), settings.target_dtype, settings.cache_dir, load=load,
            pack_target=settings.pack_target,
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
