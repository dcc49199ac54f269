"""``acceptance-features``: whether signals the drafter has at a draft, beyond its own confidence, foretell
the target's acceptance, on the streams of ``stopping-replay`` reports (`benchmarks.stopping_replay`).

The default schedule prices a draft by one signal, the drafter's confidence in it (`ConfidenceCalibration`).
Every rule that stops drafting by that signal stays near the best fixed threshold in hindsight (the replay's
table), far below the hindsight oracle; this asks whether another signal known when the draft is made would
close some of that gap. Each revealed draft of a stream (position p, draft j after j accepted ones: accepted iff
``matches[p] > j``) gets the signals

* ``confidence``: the drafter's probability of the draft (what the schedule reads);
* ``previous``: its confidence in the draft before it in the round (1 at a round's first);
* ``depth``: j, how far into the round it is;
* ``recent``: the share of the `RECENT` positions before p at which the drafter's first draft was the target's
  token (known at p: those tokens are decoded),

and a logistic regression on the logits of the probabilities (and log(1 + j)) is fitted to each set of
signals, scored by its log-loss per draft on turns it was not fitted to (leave one turn out). A signal that
lowers the loss little adds little to what the confidence already tells.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from .stopping_replay import Stream, load_streams

# positions before a draft's whose first-draft agreement ``recent`` averages
RECENT = 12
SIGNALS = ("confidence", "previous", "depth", "recent")
# the sets of signals compared: none (the overall rate), the schedule's own, each other one beside it, all
MODELS = ((), ("confidence",), ("confidence", "previous"), ("confidence", "depth"), ("confidence", "recent"),
          SIGNALS)
# probabilities are kept this far off 0 and 1 before their logits are taken
BOUND = 1e-3


def revealed_drafts(stream: Stream) -> tuple[list[dict[str, float]], list[bool]]:
    """Every draft of ``stream`` whose fate is known (the accepted ones at each position and the first
    rejected one), its signals (see the module docstring) and whether it was accepted."""
    rows, accepted = [], []
    for position, (matches, confidences) in enumerate(zip(stream.matches, stream.confidences)):
        window = stream.matches[max(0, position - RECENT):position]
        recent = sum(match > 0 for match in window) / len(window) if window else 0.5
        for depth in range(min(matches + 1, len(confidences))):
            rows.append({"confidence": confidences[depth], "previous": confidences[depth - 1] if depth else 1.0,
                         "depth": float(depth), "recent": recent})
            accepted.append(matches > depth)
    return rows, accepted


def _design(rows: Sequence[dict[str, float]], signals: Sequence[str]) -> torch.Tensor:
    """``[len(rows), 1 + len(signals)]``: an intercept, then each signal's logit (depth: log(1 + j))."""
    columns = [torch.ones(len(rows), dtype=torch.float64)]
    for name in signals:
        values = torch.tensor([row[name] for row in rows], dtype=torch.float64)
        if name == "depth":
            columns.append(torch.log1p(values))
        else:
            values = values.clamp(BOUND, 1 - BOUND)
            columns.append(torch.log(values / (1 - values)))
    return torch.stack(columns, dim=1)


def fit_logistic(design: torch.Tensor, labels: torch.Tensor, iterations: int = 50) -> torch.Tensor:
    """Weights ``[columns]`` of a logistic regression of ``labels`` ``[rows]`` (0 or 1) on ``design``
    ``[rows, columns]`` (Newton's method, a ridge of 1e-3 keeping it defined on separable data)."""
    weights = torch.zeros(design.shape[1], dtype=torch.float64)
    ridge = 1e-3 * torch.eye(design.shape[1], dtype=torch.float64)
    for _ in range(iterations):
        p = torch.sigmoid(design @ weights)
        hessian = design.T @ (design * (p * (1 - p))[:, None]) + ridge
        step = torch.linalg.solve(hessian, design.T @ (labels - p) - ridge @ weights)
        weights = weights + step
        if step.abs().max() < 1e-10:
            break
    return weights


def held_out_loss(turns: Sequence[tuple[list[dict[str, float]], list[bool]]], signals: Sequence[str]) -> float:
    """Log-loss per revealed draft of a logistic regression on ``signals``, each turn scored by a fit to the
    others (leave one turn out); ``turns``: each turn's `revealed_drafts`."""
    design = _design([row for rows, _ in turns for row in rows], signals)
    labels = torch.tensor([label for _, accepted in turns for label in accepted], dtype=torch.float64)
    turn_of = torch.tensor([index for index, (_, accepted) in enumerate(turns) for _ in accepted])
    total = 0.0
    for held in range(len(turns)):
        test = turn_of == held
        if not test.any():
            continue
        weights = fit_logistic(design[~test], labels[~test])
        p = torch.sigmoid(design[test] @ weights).clamp(1e-6, 1 - 1e-6)
        truth = labels[test]
        total += float(-(truth * p.log() + (1 - truth) * (1 - p).log()).sum())
    return total / len(labels)


def compare_signals(turns: Sequence[tuple[list[dict[str, float]], list[bool]]]) -> dict[str, float]:
    """`held_out_loss` of every set of `MODELS`, by name ("none" for the overall rate alone), over the turns'
    `revealed_drafts`."""
    return {" + ".join(signals) or "none": held_out_loss(turns, signals) for signals in MODELS}


def run_acceptance_features(replays: Sequence[str], out: str | None = None) -> str:
    """`compare_signals` over the streams of the ``stopping-replay`` report directories in ``replays``, all
    turns together; the table as markdown, and with ``out`` ``summary.json`` and ``results.md`` there."""
    streams = [stream for directory in replays
               for stream in load_streams(Path(directory) / "streams.jsonl").values()]
    turns = [revealed_drafts(stream) for stream in streams]
    drafts = sum(len(accepted) for _, accepted in turns)
    losses = compare_signals(turns)
    base = losses["confidence"]
    lines = [f"{len(streams)} turns, {drafts} revealed drafts; log-loss per draft on held-out turns (leave one turn "
             "out), and its change against the confidence alone.", "",
             "| signals | log-loss per draft | against the confidence alone |", "|---|---|---|"]
    lines += [f"| {name} | {loss:.4f} | {(loss - base) / base:+.1%} |" for name, loss in losses.items()]
    text = "\n".join(lines) + "\n"
    if out is not None:
        directory = Path(out)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "summary.json").write_text(json.dumps(
            {"replays": list(replays), "turns": len(streams), "revealed_drafts": drafts, "recent": RECENT,
             "log_loss": losses}, indent=1) + "\n")
        (directory / "results.md").write_text(text)
    return text

