"""The command line (real-model paths need downloads and are not run here)."""

from hf_polybasic.tools import cli


def test_tiny_demo_runs_and_reports_exactness(capsys):
    assert cli.main(["demo", "--tiny", "--max-new-tokens", "8", "--repeats", "1"]) == 0
    printed = capsys.readouterr().out
    assert "RANDOM models" in printed
    assert printed.count("identical to plain greedy: True") == 4


def test_models_list_names_every_model(capsys):
    assert cli.main(["models", "list", "--cache-dir", "/nonexistent-hf-polybasic-cache"]) == 0
    printed = capsys.readouterr().out
    assert "qwen2.5-coder-1.5b-instruct" in printed and "not installed" in printed


def test_levels_on_tiny_models(capsys, tmp_path):
    assert cli.main(["levels", "--models", "tiny", "--k", "3", "--new-tokens", "8", "--repeats", "1"]) == 0
    assert "| target |" in capsys.readouterr().out
