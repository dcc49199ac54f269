"""Aggregating the per-call records into tables and plots.

Formulas (the same as Spec-Bench's ``evaluation/speed.py`` for one run):

* per question q (all of its turns together), for method m and repeat r:
  ``tps(m, q, r) = sum of new tokens over the turns / sum of wall seconds over the turns``;
* for a set of questions Q (a task group, or all of them for "overall") and repeat r:
  ``speedup_r(m) = mean_{q in Q} tps(m, q, r) / mean_{q in Q} tps(plain, q, r)``,
  over the questions that both m and plain finished in repeat r;
* reported: ``speedup(m) = median_r speedup_r(m)`` (= the Spec-Bench number when there is one
  repeat), and likewise tokens/s = ``median_r mean_q tps(m, q, r)``.

Acceptance length (tau, the Spec-Bench/EAGLE convention, as in `hf_polybasic.stats`): per
verification, accepted draft tokens + 1. ``L_i`` of a level is pooled over all its verifications in
the group: ``sum(accepted + 1) / verifications``. "Tokens per target forward" is
``sum(new tokens) / sum(target forward calls)`` for every method (1.00 for plain ``generate``; the
prefill counts as a forward), so transformers' assisted modes get a comparable number too.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from .prompts import Question

SUMMARY_FILE = "summary.json"
TABLE_FILE = "results.md"
SPEEDUP_PLOT = "speedup.png"
OVERALL = "overall"


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where two token lists differ (a length difference counts at the
    shorter one's end); None if they are equal."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def speedup(method_tps: Sequence[float], baseline_tps: Sequence[float]) -> float:
    """Spec-Bench's speedup: mean per-question tokens/s of the method over the baseline's."""
    if not method_tps or not baseline_tps:
        raise ValueError("speedup needs at least one question for the method and for the baseline")
    return statistics.fmean(method_tps) / statistics.fmean(baseline_tps)


def question_speeds(records: Sequence[dict], turns: dict[str, int]) -> dict[tuple[str, int, str], float]:
    """``{(method, repeat, question_id): tokens/s}`` over all turns of each finished question
    (questions missing a turn are left out)."""
    tokens: dict[tuple, int] = defaultdict(int)
    seconds: dict[tuple, float] = defaultdict(float)
    seen: dict[tuple, int] = defaultdict(int)
    for record in records:
        key = (record["method"], record["repeat"], record["question_id"])
        tokens[key] += record["new_tokens"]
        seconds[key] += record["seconds"]
        seen[key] += 1
    return {
        key: tokens[key] / seconds[key]
        for key in tokens
        if seen[key] == turns.get(key[2], 0) and seconds[key] > 0
    }


def _cell(
    speeds: dict, method: str, baseline: str, question_ids: Sequence[str], repeats: Sequence[int]
) -> dict | None:
    per_repeat, tps_repeat, counted = [], [], set()
    for repeat in repeats:
        both = [q for q in question_ids if (method, repeat, q) in speeds and (baseline, repeat, q) in speeds]
        if not both:
            continue
        mine = [speeds[(method, repeat, q)] for q in both]
        base = [speeds[(baseline, repeat, q)] for q in both]
        per_repeat.append(speedup(mine, base))
        tps_repeat.append(statistics.fmean(mine))
        counted.update(both)
    if not per_repeat:
        return None
    return {
        "speedup": statistics.median(per_repeat),
        "speedup_per_repeat": per_repeat,
        "tokens_per_second": statistics.median(tps_repeat),
        "n_questions": len(counted),
        "n_repeats": len(per_repeat),
    }


def _levels(records: Sequence[dict]) -> list[dict] | None:
    rows = [r["levels"] for r in records if r.get("levels")]
    if not rows:
        return None
    new_tokens = sum(r["new_tokens"] for r in records if r.get("levels"))
    out = []
    for index, first in enumerate(rows[0]):
        same = [row[index] for row in rows if len(row) > index]
        verifications = sum(level["verifications"] for level in same)
        accepted = sum(level["accepted"] + level.get("alternative_hits", 0) for level in same)  # emitted beyond 1
        forwards = sum(level["forward_passes"] for level in same)
        out.append(
            {
                "name": first.get("label", first["name"]),
                "role": first["role"],
                "verifications": verifications,
                "mean_acceptance_length": (accepted + verifications) / verifications if verifications else None,
                "forward_passes": forwards,
                "forward_passes_per_call": forwards / len(same),
                "forward_passes_per_token": forwards / new_tokens if new_tokens else None,
                "withheld": sum(level.get("withheld", 0) for level in same),
                "paused_rounds": sum(level.get("paused_rounds", 0) for level in same),
                "alternative_rounds": sum(level.get("alternative_rounds", 0) for level in same),
                "alternative_hits": sum(level.get("alternative_hits", 0) for level in same),
                "seconds": sum(level["seconds"] for level in same),
            }
        )
    return out


def _rounds(records: Sequence[dict]) -> dict | None:
    """The target's rounds pooled over two-model calls (`calls._rounds`): per verification, tokens
    drafted and accepted; rounds with nothing drafted (a paused level) count as verifications too."""
    rows = [r["rounds"] for r in records if r.get("rounds")]
    verifications = sum(row["verifications"] for row in rows)
    if not verifications:
        return None
    drafted, accepted = sum(row["drafted"] for row in rows), sum(row["accepted"] for row in rows)
    return {"verifications": verifications, "drafted_per_round": drafted / verifications,
            "accepted_per_round": accepted / verifications, "accepted_share": accepted / drafted if drafted else None}


def mismatches_of(records: Sequence[dict], methods, baseline: str) -> list[dict]:
    """Greedy outputs of lossless methods that differ from plain generate's (same question, turn and
    repeat), with the first differing new-token position."""
    lossless = {m.name for m in methods if m.lossless and m.name != baseline}
    plain = {(r["question_id"], r["turn"], r["repeat"]): r for r in records if r["method"] == baseline}
    found = []
    for record in records:
        if record["method"] not in lossless:
            continue
        reference = plain.get((record["question_id"], record["turn"], record["repeat"]))
        if reference is None:
            continue
        position = first_difference(record["output_ids"], reference["output_ids"])
        if position is None:
            continue
        earlier = [
            m
            for m in found
            if m["method"] == record["method"]
            and m["question_id"] == record["question_id"]
            and m["repeat"] == record["repeat"]
            and m["turn"] < record["turn"]
        ]

        def token(ids, i):
            return ids[i] if i < len(ids) else None

        found.append(
            {
                "method": record["method"],
                "question_id": record["question_id"],
                "group": record["group"],
                "turn": record["turn"],
                "repeat": record["repeat"],
                "position": position,
                "method_token": token(record["output_ids"], position),
                "plain_token": token(reference["output_ids"], position),
                "method_new_tokens": record["new_tokens"],
                "plain_new_tokens": reference["new_tokens"],
                "note": "an earlier turn already differed, so the prompts differ" if earlier else "",
                # logits are only comparable when both runs had the same prompt
                **{
                    key: value
                    for key, value in (record.get("mismatch") or {}).items()
                    if key in ("method_logit", "plain_logit", "relative_gap", "near_tie") and not earlier
                },
            }
        )
    return found


def turn_speeds(records: Sequence[dict]) -> dict[tuple[str, int], dict[str, float]]:
    """Per (question, turn), each method's median tokens/s over its repeats."""
    speeds: dict[tuple[str, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for record in records:
        speeds[(record["question_id"], record["turn"])][record["method"]].append(record["new_tokens"] / record["seconds"])
    return {turn: {method: statistics.median(values) for method, values in by_method.items()}
            for turn, by_method in speeds.items()}


def lowest_turns(turns: dict[tuple[str, int], dict[str, float]], methods) -> list[dict]:
    """For each method against the baseline (the first) and each method of ours against each other
    one, the turn where its median tokens/s is the lowest share of the other's."""
    names = [method.name for method in methods]
    ours = [method.name for method in methods if method.polybasic]
    pairs = [(name, names[0]) for name in names[1:]] + [(a, b) for a in ours for b in names[1:] if b != a]
    found = []
    for method, against in pairs:
        ratios = [(speeds[method] / speeds[against], turn) for turn, speeds in turns.items()
                  if method in speeds and speeds.get(against)]
        if ratios:
            ratio, (question, turn) = min(ratios)
            found.append({"method": method, "against": against, "ratio": ratio, "question": question, "turn": turn})
    return found


def summarise(records: Sequence[dict], methods, questions: Sequence[Question]) -> dict:
    """Per group and overall, per method: speedup, tokens/s, tokens per target forward, per-level
    L_i and forward passes, memory; plus the greedy mismatches."""
    baseline = methods[0].name
    turns = {q.question_id: len(q.turns) for q in questions}
    speeds = question_speeds(records, turns)
    repeats = sorted({r["repeat"] for r in records})
    groups = list(dict.fromkeys(q.group for q in questions))
    members = {g: [q.question_id for q in questions if q.group == g] for g in groups}
    members[OVERALL] = [q.question_id for q in questions]
    by = defaultdict(list)
    for record in records:
        by[(record["method"], record["group"])].append(record)
        by[(record["method"], OVERALL)].append(record)
    table: dict = {}
    for group in [*groups, OVERALL]:
        table[group] = {}
        for method in methods:
            cell = _cell(speeds, method.name, baseline, members[group], repeats)
            rows = by[(method.name, group)]
            if cell is None or not rows:
                continue
            forwards = sum(r["target_forwards"] for r in rows)
            peaks = [r["rss_peak_mib"] for r in rows if r.get("rss_peak_mib") is not None]
            cell.update(
                {
                    "n_calls": len(rows),
                    "new_tokens_mean": statistics.fmean(r["new_tokens"] for r in rows),
                    "tokens_per_target_forward": sum(r["new_tokens"] for r in rows) / forwards if forwards else None,
                    "levels": _levels(rows),
                    "rounds": _rounds(rows),
                    "rss_peak_mib_max": max(peaks) if peaks else None,
                }
            )
            table[group][method.name] = cell
    turns = turn_speeds(records)
    return {"baseline": baseline, "groups": groups, "table": table, "lowest_turns": lowest_turns(turns, methods),
            "turns": [{"question": question, "turn": turn, "tokens_per_second": speeds}
                      for (question, turn), speeds in sorted(turns.items())]}


# ------------------------------------------------------------------------------------- markdown
def _fmt(value, spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def markdown(summary: dict, run_info: dict, mismatches: Sequence[dict], methods) -> str:
    table, groups = summary["table"], summary["groups"]
    columns = [*groups, OVERALL]
    settings = run_info["settings"]
    machine = run_info["machine"]
    repeats = settings["repeats"]
    lines = [
        "# Benchmark results",
        "",
        f"- models: {run_info['models'].get('target')}; pool: {run_info['models'].get('pool')}",
        f"- decoding: {settings['decoding']} {run_info['decoding']}, max_new_tokens={settings['max_new_tokens']}, "
        f"batch 1, repeats={repeats} (numbers are medians over repeats), warm-up calls per method={settings['warmup']}",
        f"- machine: {machine.get('cpu')}, {machine.get('logical_cores')} logical cores, torch threads "
        f"{machine.get('torch_threads')}, torch {machine.get('torch')}, transformers {machine.get('transformers')}",
        f"- command: `{run_info['command']}`",
        "- n = questions counted in the cell (each question: all of its turns); "
        "multi-turn questions have 2 turns",
        "",
    ]

    def block(title: str, note: str, value) -> None:
        lines.extend([f"## {title}", "", note, "", "| method | " + " | ".join(columns) + " |",
                      "|---|" + "---|" * len(columns)])
        for method in methods:
            cells = []
            for group in columns:
                cell = table.get(group, {}).get(method.name)
                cells.append("–" if cell is None else f"{value(cell)} (n={cell['n_questions']})")
            lines.append(f"| {method.name} | " + " | ".join(cells) + " |")
        lines.append("")

    block(
        "Speedup over plain generate",
        "mean over questions of the method's tokens/s divided by the mean over the same questions of plain "
        "generate's tokens/s (Spec-Bench's formula).",
        lambda c: _fmt(c["speedup"], ".2f", "×"),
    )
    block("Tokens per second", "mean over questions of per-question tokens/s.",
          lambda c: _fmt(c["tokens_per_second"], ".2f"))
    block(
        "Tokens per target forward",
        "new tokens / forward calls of the target (1.00 for plain generate; for two-model methods this is "
        "the mean acceptance length τ).",
        lambda c: _fmt(c["tokens_per_target_forward"], ".2f"),
    )

    counted = [m for m in methods if any(table.get(g, {}).get(m.name, {}).get("rounds") for g in columns)]
    if counted:
        lines.extend(["## Drafts per target round", "",
                      "Per verification of the target, pooled over the group: tokens drafted, tokens accepted (and "
                      "their share of the drafted ones); ours from the target level's statistics, transformers' "
                      "counted on its candidate generator (`benchmarks/bench/hf_rounds.py`). v = verifications.", "",
                      "| method | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)])
        for method in counted:
            cells = []
            for group in columns:
                rounds = (table.get(group, {}).get(method.name) or {}).get("rounds")
                cells.append("–" if rounds is None else
                             f"{rounds['drafted_per_round']:.2f} drafted, {rounds['accepted_per_round']:.2f} accepted "
                             f"({_fmt(rounds['accepted_share'], '.2f')}) (v={rounds['verifications']})")
            lines.append(f"| {method.name} | " + " | ".join(cells) + " |")
        lines.append("")

    ours = [m for m in methods if m.polybasic]
    if ours:
        lines.extend(["## Acceptance length per level (ours)", "",
                      "L_i = mean over the level's verifications of (accepted draft tokens + 1), pooled over the "
                      "group; F/token = that level's forward passes per generated token. v = verifications; alternatives "
                      "h/r: of r rounds that scored the drafter's next-best tokens, h emitted one token more.", "",
                      "| method | level | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)])
        for method in ours:
            reference = next(
                (table[g][method.name]["levels"] for g in columns if method.name in table.get(g, {})), None
            )
            for index, level in enumerate(reference or []):
                cells = []
                for group in columns:
                    cell = table.get(group, {}).get(method.name)
                    row = cell["levels"][index] if cell and cell.get("levels") else None
                    if row is None:
                        cells.append("–")
                    elif row["verifications"]:
                        cells.append(
                            f"L={row['mean_acceptance_length']:.2f}, "
                            f"F/token={row['forward_passes_per_token']:.2f} (v={row['verifications']}"
                            + (f", alternatives {row['alternative_hits']}/{row['alternative_rounds']}"
                               if row.get("alternative_rounds") else "") + ")"
                        )
                    else:
                        cells.append(f"F/token={_fmt(row['forward_passes_per_token'], '.2f')}")
                label = level["name"] if level["role"] in level["name"] else f"{level['name']} ({level['role']})"
                lines.append(f"| {method.name} | {label} | " + " | ".join(cells) + " |")
        lines.append("")

    if summary.get("turns"):
        names = [method.name for method in methods]
        lines.extend(["## Per turn", "", f"Each turn's median tokens/s over the repeats: {names[0]}'s, and each "
                      "other method's as a multiple of it.", "",
                      "| question | turn | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)])
        for row in summary["turns"]:
            speeds, base = row["tokens_per_second"], row["tokens_per_second"].get(names[0])
            cells = [_fmt(base, ".2f")] + [
                "–" if name not in speeds or not base else f"{speeds[name] / base:.2f}x" for name in names[1:]]
            lines.append(f"| {row['question']} | {row['turn'] + 1} | " + " | ".join(cells) + " |")
        lines.append("")
        for low in summary["lowest_turns"]:
            lines.append(f"- lowest turn, {low['method']} against {low['against']}: {low['ratio']:.2f}x "
                         f"(question {low['question']}, turn {low['turn'] + 1})")
        lines.append("")

    lines.extend(["## Memory", "",
                  "Peak resident memory (RSS) of the whole benchmark process during the method's calls, sampled "
                  "every 50 ms: it includes every model loaded for the run, not only the method's own. Process "
                  f"peak over the run (getrusage): {_fmt(run_info.get('process_max_rss_mib'), '.0f')} MiB.", "",
                  "| method | peak RSS during its calls (MiB) |", "|---|---|"])
    for method in methods:
        cell = table.get(OVERALL, {}).get(method.name)
        lines.append(f"| {method.name} | {_fmt(cell and cell['rss_peak_mib_max'], '.0f')} |")
    lines.append("")

    lines.extend(["## Greedy equality with plain generate", ""])
    if settings["decoding"] != "greedy":
        lines.append("Not checked: sampled outputs are not expected to be equal.")
    elif not mismatches:
        lines.append("Every output of every lossless method was token-for-token identical to plain generate's.")
    else:
        ties = sum(1 for m in mismatches if m.get("near_tie"))
        lines.append(f"**MISMATCH: {len(mismatches)} output(s) differ from plain generate's**, {ties} of them at a "
                     "numeric near-tie: the target's two logits there differ by at most 2 units in the last place "
                     "of its dtype (a k-token forward and a 1-token forward round differently in bf16).")
        lines.extend(["", "| method | question | turn | repeat | first differing new token | method / plain token "
                      "| their logits (method / plain) | near-tie | note |",
                      "|---|---|---|---|---|---|---|---|---|"])
        for m in mismatches:
            logits = (f"{m['method_logit']:.3f} / {m['plain_logit']:.3f}" if "plain_logit" in m else "-")
            tie = {True: "yes", False: "**no**"}.get(m.get("near_tie"), "-")
            lines.append(f"| {m['method']} | {m['question_id']} | {m['turn'] + 1} | {m['repeat']} | {m['position']} | "
                         f"{m['method_token']} / {m['plain_token']} | {logits} | {tie} | {m['note']} |")
    lines.append("")

    lines.extend(["## Methods", "", "| method | what |", "|---|---|"])
    for method in methods:
        lines.append(f"| {method.name} | {method.description} |")
    lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- plots
def _figure(width: float, height: float):
    """A matplotlib figure on the Agg canvas, without pyplot (no global backend state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(figure)
    return figure


def plot_speedups(summary: dict, methods, path: Path) -> Path:
    """Grouped bars: speedup per task group (and overall) per method, a line at 1×."""
    table, columns = summary["table"], [*summary["groups"], OVERALL]
    shown = [m for m in methods if m.name != summary["baseline"]]
    figure = _figure(max(7.0, 1.3 * len(columns) + 2), 4.5)
    axes = figure.add_subplot()
    width = 0.8 / max(1, len(shown))
    for index, method in enumerate(shown):
        values = [table.get(g, {}).get(method.name, {}).get("speedup", float("nan")) for g in columns]
        positions = [c + (index - (len(shown) - 1) / 2) * width for c in range(len(columns))]
        axes.bar(positions, values, width, label=method.name)
    axes.axhline(1.0, color="black", linewidth=0.8)
    labels = []
    for group in columns:
        n = table.get(group, {}).get(summary["baseline"], {}).get("n_questions", 0)
        labels.append(f"{group}\n(n={n})")
    axes.set_xticks(range(len(columns)), labels, fontsize=7)
    axes.set_ylabel("speedup over plain generate (×)")
    axes.set_title("Speedup per task group (mean tokens/s ratio)")
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path)
    return path


def plot_acceptance(records: Sequence[dict], method, path: Path) -> Path | None:
    """Histogram of acceptance lengths per verifying level of one of our chains, all groups pooled."""
    rows = [r["levels"] for r in records if r["method"] == method.name and r.get("levels")]
    if not rows:
        return None
    levels = [(i, level) for i, level in enumerate(rows[0]) if any(row[i]["verifications"] for row in rows)]
    if not levels:
        return None
    from matplotlib.ticker import MaxNLocator

    figure = _figure(4.2 * len(levels), 3.6)
    for column, (index, level) in enumerate(levels, 1):
        lengths = [x for row in rows for x in row[index]["acceptance_lengths"]]
        axes = figure.add_subplot(1, len(levels), column)
        top = max(lengths)
        axes.hist(lengths, bins=[b - 0.5 for b in range(1, top + 2)], color=f"C{column - 1}", edgecolor="white")
        mean = sum(lengths) / len(lengths)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        title = f"{level.get('label', level['name'])} ({level['role']})"
        axes.set_title(f"{title}\nL={mean:.2f}, {len(lengths)} verifications", fontsize=8)
        axes.set_xlabel("acceptance length (accepted + 1)")
        axes.set_ylabel("verifications")
    figure.suptitle(f"{method.name}: acceptance lengths per level", fontsize=9)
    figure.tight_layout()
    figure.savefig(path)
    return path


def write_report(out: Path, run_info: dict, records: Sequence[dict], methods, questions: Sequence[Question]):
    """summary.json, results.md and the PNG plots in ``out``; returns (summary, mismatches, files)."""
    summary = summarise(records, methods, questions)
    greedy = run_info["settings"]["decoding"] == "greedy"
    mismatches = mismatches_of(records, methods, summary["baseline"]) if greedy else []
    summary["mismatches"] = mismatches
    files = []
    payload = {"run": run_info, **summary}
    (out / SUMMARY_FILE).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    files.append(out / SUMMARY_FILE)
    (out / TABLE_FILE).write_text(markdown(summary, run_info, mismatches, methods), encoding="utf-8")
    files.append(out / TABLE_FILE)
    if records:
        files.append(plot_speedups(summary, methods, out / SPEEDUP_PLOT))
        for method in methods:
            if method.polybasic:
                path = plot_acceptance(records, method, out / f"acceptance_{method.name}.png")
                if path is not None:
                    files.append(path)
    return summary, mismatches, files
