"""The validation record as markdown and as a predicted-vs-measured plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .plan_validation import TARGET_RATIO


def _verdict(helps: bool) -> str:
    return "helps" if helps else "hurts"


def _numbers(values) -> str:
    return ", ".join("-" if x is None else f"{x:.2f}" for x in values or [])


def validation_markdown(record: dict[str, Any], header: str) -> str:
    planner = record["planner"]
    lines = [
        f"# Planner validation: {header}",
        "",
        f"{record['prompts']} prompts, greedy, max_new_tokens={record['max_new_tokens']}, median of "
        f"{record['repeats']} timed run(s) after a warm-up; plain generate: "
        f"{record['plain']['tokens_per_second']:.2f} tokens/s.",
        "",
        "## The planner's choice vs the best measured configuration",
        "",
        "| | configuration | predicted speedup | measured speedup |",
        "|---|---|---:|---:|",
        f"| planner | {planner['choice']} | {planner['predicted_speedup']:.2f}x | {planner['measured_speedup']:.2f}x |",
        f"| best measured | {planner['best_measured']} | - | {planner['best_measured_speedup']:.2f}x |",
        "",
        f"Ratio (planner / best measured): **{planner['ratio']:.3f}** (target >= {TARGET_RATIO}: "
        f"{'met' if planner['within_10_percent'] else 'NOT met'}).",
        "",
        "## Every configuration",
        "",
        f"Predicted: for calls of {record['max_new_tokens']} new tokens, every model's prefill included (what is "
        "measured); long: per token of long generations; Lemma 3.1: with the predicted L_i, T_i = 1-token costs, "
        "long generations. L per verifying level, target first: predicted and measured tokens per verification "
        "(accepted + 1), and measured N / F_i (the reading that makes Lemma 3.1 exact).",
        "",
        "| configuration | predicted | long | Lemma 3.1 | measured | measured / predicted | tokens/s | L predicted | "
        "L measured | N / F_i | identical to plain |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---|---|",
    ]
    for row in sorted(record["configurations"], key=lambda r: -r["measured_speedup"]):
        mark = " **(plan)**" if row["is_plan"] else ""
        lemma = "-" if row["lemma_speedup"] is None else f"{row['lemma_speedup']:.2f}x"
        lines.append(
            f"| {row['name']}{mark} | {row['predicted_speedup']:.2f}x | {row['predicted_speedup_long']:.2f}x | "
            f"{lemma} | "
            f"{row['measured_speedup']:.2f}x | "
            f"{row['measured_speedup'] / row['predicted_speedup']:.2f} | {row['tokens_per_second']:.2f} | "
            f"{_numbers(row['predicted_lengths'])} | {_numbers(row['measured_per_verification_lengths'])} | "
            f"{_numbers(row['measured_lengths'])} | {row['identical_to_plain']} |"
        )
    lines += [
        "",
        "## Dynamic policy: cost-aware schedule vs the best static configuration",
        "",
        "Each chain run with `PolybasicConfig(schedule=\"cost_aware\")` from the untuned defaults (K = 4, mu = 8), "
        "against the best of that chain's static grid configurations (measured on the same prompts).",
        "",
        "| chain | cost-aware speedup | best static | its speedup | cost-aware / best static | identical to plain |",
        "|---|---:|---|---:|---:|---|",
    ]
    for row in record.get("dynamic", []):
        lines.append(
            f"| {' <- '.join(row['chain'])} | {row['measured_speedup']:.2f}x | {row['best_static']} | "
            f"{row['best_static_speedup']:.2f}x | {row['ratio']:.2f} | {row['identical_to_plain']} |"
        )
    lines += [
        "",
        "## Table 1: inserting a middle model (Theorem 3.2, measured L's)",
        "",
        "T from the profile (1-token forwards; a Drafter: one propose call), L_i = N / F_i of the best measured "
        "configuration of each chain, beta = drafter forwards per verification above it (1 for a Drafter). "
        "Condition 1: T_new/T_i < L_new(1/L_i - 1/L_i-new); condition 2: T_new/T_i+1 < beta(L_new/L_i - 1); "
        "the paper's verdict is 1 or 2; the Lemma 3.1 verdict is the exact sign of the saving. An N / F_i below 1 "
        "(marked *) is a middle level running more forwards than tokens reach the output.",
        "",
        "| before | inserted | L_i, L_i-new, L_new, beta | T_new/T_i | L_new(1/L_i - 1/L_i-new) | T_new/T_i+1 | "
        "beta(L_new/L_i - 1) | Lemma 3.1 verdict | paper's verdict | measured before | measured after | "
        "measured: helped |",
        "|---|---|---|---:|---:|---:|---:|---|---|---:|---:|---|",
    ]
    for row in record["table_1"]:
        lengths = ", ".join(
            f"{row[key]:.2f}" + ("*" if key in row["below_1"] else "") for key in ("L_i", "L_i-new", "L_new")
        )
        lines.append(
            f"| {row['before']} | {row['inserted']} | {lengths}, {row['beta']:.2f} | {row['T_new/T_i']:.3f} | "
            f"{row['L_new(1/L_i - 1/L_i-new)']:.3f} | "
            f"{row['T_new/T_i+1']:.3g} | {row['beta(L_new/L_i - 1)']:.3f} | {_verdict(row['lemma_verdict'])} | "
            f"{_verdict(row['paper_verdict'])} | {row['measured_before']:.2f}x | {row['measured_after']:.2f}x | "
            f"{row['measured_helped']} |"
        )
    lines += ["", "![predicted vs measured speedup](predicted_vs_measured.png)", ""]
    return "\n".join(lines)


def plot_predicted_vs_measured(record: dict[str, Any], path: Path) -> Path:
    """Scatter of predicted vs measured speedup with the diagonal; the plan is marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 6), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    rows = record["configurations"]
    predicted = [row["predicted_speedup"] for row in rows]
    measured = [row["measured_speedup"] for row in rows]
    axes.scatter(predicted, measured, s=18, label="configurations")
    for row in rows:
        label = row["name"].replace("target <- ", "")
        axes.annotate(label, (row["predicted_speedup"], row["measured_speedup"]), fontsize=5)
    chosen = [row for row in rows if row["is_plan"]]
    if chosen:
        point = ([chosen[0]["predicted_speedup"]], [chosen[0]["measured_speedup"]])
        axes.scatter(*point, s=80, marker="*", color="red", label="plan")
    top = max([1.0, *predicted, *measured]) * 1.1
    axes.plot([0, top], [0, top], color="grey", linewidth=0.8, label="measured = predicted")
    axes.axhline(1.0, color="black", linewidth=0.5)
    axes.set_xlim(0, top)
    axes.set_ylim(0, top)
    axes.set_xlabel("predicted speedup over plain generate (x)")
    axes.set_ylabel("measured speedup over plain generate (x)")
    axes.set_title("Planner: predicted vs measured speedup")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)
    return path
