"""The command line (real-model paths need downloads and are not run here)."""

import benchmarks.cli
from hf_polybasic.cli import main as cli


def test_tiny_demo_runs_and_reports_exactness(capsys):
    assert cli.main(["demo", "--tiny", "--max-new-tokens", "8", "--repeats", "1"]) == 0
    printed = capsys.readouterr().out
    assert "RANDOM models" in printed
    assert printed.count("identical to plain greedy: True") == 4


def test_models_list_names_every_model_with_its_state(capsys, tmp_path):
    from hf_polybasic.cli.models import MODELS

    assert cli.main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in MODELS:  # one line each, and an empty cache has none of them
        (line,) = [line for line in lines if line.split()[:1] == [name]]
        assert "not installed" in line


def test_levels_on_tiny_models(capsys, tmp_path):
    assert benchmarks.cli.main(["levels", "--models", "tiny", "--k", "3", "--new-tokens", "8", "--repeats", "1"]) == 0
    assert "| target |" in capsys.readouterr().out


def test_batches_command_on_tiny_models(capsys, tmp_path):
    import json

    assert benchmarks.cli.main(["batches", "--models", "tiny", "--batch-sizes", "1,3", "--max-new-tokens", "8", "--repeats", "1",
                     "--output", str(tmp_path), "--no-progress"]) == 0
    result = json.loads((tmp_path / "batches.json").read_text())
    assert [row["batch"] for row in result["rows"]] == [1, 3]
    assert all(row["rows_identical"] == f"{row['batch']}/{row['batch']}" for row in result["rows"])  # fp32: exact
    assert result["rows"][1]["rows_per_target_forward"] > 1  # the batch shared its forwards
    assert all(row["first_call_speedup"] > 0 for row in result["rows"]) and result["question_set"] == "heldout"
    assert "| 3 |" in capsys.readouterr().out


def test_rollback_cost_on_a_tiny_hybrid(capsys, tmp_path):
    import json

    import pytest

    from hf_polybasic import compat
    if not compat.HAS_RECURRENT_CACHE_LAYERS:
        pytest.skip("transformers < 5.15: hybrid models are refused")
    assert benchmarks.cli.main(["rollback-cost", "--tiny", "--ks", "2,4", "--repeats", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "rollback_cost.json").read_text())["rows"]
    assert [(row["k"], row["kept"], row["refed_tokens"]) for row in rows] == [(2, 0, 1), (2, 1, 2), (2, 2, 0), (4, 0, 1), (4, 2, 3), (4, 4, 0)]
    assert all(row["copy_ms"] > 0 and row["verify_ms"] > 0 for row in rows)
    assert "| k | kept | T(k+1) ms |" in capsys.readouterr().out


def test_trained_head_benchmark_on_tiny_models(capsys, tmp_path):
    """``python -m benchmarks trained-head`` end to end at a tiny size: a few training steps, one prompt, 8
    tokens; every method's greedy output is plain generate's (the bench exits 1 otherwise)."""
    import json

    assert benchmarks.cli.main(["trained-head", "--models", "tiny", "--output", str(tmp_path), "--prompts", "2",
                                "--answer-tokens", "8", "--max-tokens", "2000", "--seq-len", "32", "--steps", "3",
                                "--groups", "code", "--questions-per-group", "1", "--max-new-tokens", "8",
                                "--threads", "1", "--no-progress"]) == 0
    summary = json.loads((tmp_path / "trained_head.json").read_text())
    assert summary["training"]["steps"] == 3 and summary["training"]["answered_prompts"] == 2
    assert json.loads((tmp_path / "head" / "config.json").read_text())["speculators_model_type"] == "eagle3"
    report = (tmp_path / "report.md").read_text()
    for method in ("ours-draft-auto", "ours-head", "ours-head-auto", "ours-copy-head-auto"):
        assert f"| {method} |" in report
    assert "token-for-token identical to plain generate's" in report and "| ours-head" in capsys.readouterr().out
    assert "## Draft by draft (K constant)" in report and "| ours-head | code |" in report
    # measured again without training: the same head, the training summary kept; refused where none was trained
    head = (tmp_path / "head" / "model.safetensors").read_bytes()
    assert benchmarks.cli.main(["trained-head", "--models", "tiny", "--output", str(tmp_path), "--measure-only",
                                "--steps", "5", "--groups", "code", "--questions-per-group", "1",
                                "--max-new-tokens", "8", "--threads", "1", "--no-progress"]) == 0
    assert (tmp_path / "head" / "model.safetensors").read_bytes() == head
    assert json.loads((tmp_path / "trained_head.json").read_text())["training"] == summary["training"]
    assert benchmarks.cli.main(["trained-head", "--models", "tiny", "--output", str(tmp_path / "none"),
                                "--measure-only", "--no-progress"]) == 2
    assert "no trained head" in capsys.readouterr().err


def test_trained_head_report_counts_acceptance_per_position():
    from benchmarks.trained_head import position_acceptance, seconds_per_forward

    def record(method, group, lengths, seconds=0.0, forwards=0):
        return {"method": method, "group": group,
                "levels": [{"acceptance_lengths": lengths}, {"seconds": seconds, "forward_passes": forwards}]}

    records = [record("ours-head", "code", [1, 3, 5], 0.3, 4), record("ours-head", "code", [2], 0.1, 4),
               record("ours-head", "prose", [1, 1]), record("ours-draft", "code", [5, 5], 9.0, 1),
               {"method": "plain", "group": "code", "levels": None}]
    assert position_acceptance(records, "ours-head", 4) == {"code": [0.75, 0.5, 0.25, 0.25], "prose": [0.0] * 4}
    assert seconds_per_forward(records, "ours-head") == 0.4 / 8
    assert seconds_per_forward(records, "plain") is None


def test_the_installed_command_line_says_where_the_benchmarks_run(capsys):
    assert tuple(cli.BENCHMARK_COMMANDS) == benchmarks.cli.COMMANDS  # the stubs name what the checkout has
    assert cli.main(["bench", "--quick", "--models", "tiny"]) == 2
    assert "python -m benchmarks bench" in capsys.readouterr().err
    assert cli.main(["gpu-bench", "--help"]) == 2
    assert "from a checkout of the repository" in capsys.readouterr().err


def test_the_package_never_imports_the_benchmarks():
    import re
    from pathlib import Path

    import hf_polybasic

    package = Path(hf_polybasic.__file__).parent
    importing = re.compile(r"^\s*(from|import)\s+benchmarks\b", re.MULTILINE)
    found = [str(path.relative_to(package)) for path in package.rglob("*.py") if importing.search(path.read_text())]
    assert found == []
