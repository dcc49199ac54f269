"""``python -m benchmarks gpu-bench``: its smoke test on the CPU (the same code path as on a GPU, tiny
models), its instruments (the structured target, the synthetic drafter) and its arithmetic."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hf_polybasic import compat
from hf_polybasic.levels import early_exit
from benchmarks import gpu_bench
import benchmarks.cli as cli
from hf_polybasic.cli.harness import timed_call
from benchmarks.synthetic import FIRST_TOKEN, ReferenceDrafter, build_target, random_prompts

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_tiny_cpu_run_reports_every_method_and_writes_json(tmp_path, capsys):
    assert cli.main(["gpu-bench", "--device", "cpu", "--tiny", "--output", str(tmp_path), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    for heading in ("## Levels: agreement with the target and T(k) (measured through the dynamic runner)", "## Batch 1",
                    "## Batch 4", "## Batch 8",
                    "## The synthetic drafter against the theory"):
        assert heading in printed
    assert (tmp_path / "gpu_bench.md").read_text().strip() == printed.strip()
    result = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert result["settings"]["shape"] == "tiny" and result["settings"]["dtype"] == "fp32"
    assert result["repeats_run"] >= 1 and result["machine"]["gpu"] is None

    by_batch = result["summary"]["by_batch"]
    assert set(by_batch) == {"1", "4", "8"}
    expected = {"plain", "plain-static", "hf-assisted", "ours-2", "ours-2-compiled", "ours-2-eager", "ours-2-k4", "ours-3",
                "ours-3-int4", "ours-2-int4", "ours-2-synthetic", "ours-3-synthetic"}
    if compat.ASSISTED_DECODING_TAKES_STATIC_CACHE:
        expected.add("hf-assisted-static")  # transformers >= 5.24
    assert set(by_batch["1"]) == expected
    assert set(by_batch["8"]) == set(gpu_bench.BATCHED_METHODS)  # transformers' assisted generation takes one row
    # an fp32 target on the CPU: every method reproduces plain generate exactly
    assert result["mismatches"] == []
    for rows in by_batch.values():
        for row in rows.values():
            assert row["identical_rows"] == row["rows"] > 0 and row["tokens_per_second"] > 0 and row["speedup"] > 0
    assert by_batch["1"]["plain"]["speedup"] == pytest.approx(1.0)
    assert by_batch["1"]["plain-static"]["speedup_over_plain_static"] == pytest.approx(1.0)
    assert by_batch["1"]["ours-2-compiled"]["speedup_over_plain_static"] > 0
    for name in ("plain", "hf-assisted", "ours-2", "ours-2-synthetic", "ours-2-int4"):
        assert by_batch["1"][name]["efficiency"] > 0
    # every row generated the whole budget
    assert all(r["new_tokens"] == r["batch"] * result["settings"]["max_new_tokens"] for r in result["runs"])

    levels = {row["level"]: row for row in result["levels"]}
    assert levels["target"]["measured_agreement"] == 1.0
    assert levels["draft"]["set_agreement"] == pytest.approx(0.8, abs=0.01)
    assert set(levels["target"]["ratios"]) == {"1", "2", "4", "8"}
    # the int4 copy of the tiny target (every layer takes groups of 128): a level of its own, measured
    assert list(levels) == ["target", "int4", "half", "draft"]
    assert levels["int4"]["set_agreement"] is None and levels["int4"]["measured_agreement"] > 0.9
    assert levels["int4"]["layers"] == levels["target"]["layers"] and levels["int4"]["t1_ms"] > 0
    assert set(levels["int4"]["ratios"]) == {"1", "2", "4", "8"}
    assert result["model"]["int4"] == {"group_size": 128, "mib": None}  # GPU memory only on a GPU
    methods = {entry["name"]: entry for entry in result["methods"]}
    assert methods["ours-3-int4"]["levels"] == ["target", "int4", "draft"]
    assert methods["ours-2-int4"]["levels"] == ["target", "int4"]
    assert f"| int4 copy (groups of 128) | 4 | - / {levels['int4']['measured_agreement']:.2f} |" in printed

    (two, three) = result["summary"]["theory"]
    assert two["method"] == "ours-2-synthetic" and two["verifier"] == "target" and two["off_reference_calls"] == 0
    assert two["expected_target_acceptance_length"] == pytest.approx((1 - 0.8**5) / 0.2)
    # (the predicted speedup rests on T(k) measured on a shared CPU: it may be below 1 for tiny models)
    assert 0.6 < two["measured_acceptance"] <= 1.0 and two["predicted_speedup"] > 0
    assert three["verifier"] == "half"


def test_a_target_the_int4_kernels_cannot_take_gets_no_int4_level_and_a_note():
    from hf_polybasic.testing import make_target

    copy, why = gpu_bench._int4_copy(make_target("llama", seed=0))  # width 32: no group of 128
    assert copy is None and "cannot be cut in groups of 128" in why
    copy, why = gpu_bench._int4_copy(build_target("tiny", "cpu", torch.float32, 1, 0.8, 0)[0])
    assert why is None and copy is not None


def test_the_memory_check_counts_the_int4_copy():
    # Llama-3-8B: its decoder layers at half a byte a weight, embedding and output layer in bf16
    params = gpu_bench.parameter_count("llama3-8b")
    assert 0.33 < gpu_bench.int4_bytes("llama3-8b") / (2 * params) < 0.38


def test_cuda_asked_without_a_gpu_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["gpu-bench", "--tiny", "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert "torch sees no CUDA device" in error and "python -m benchmarks gpu-bench --device cpu --tiny" in error


@pytest.mark.cuda
@needs_cuda
def test_tiny_cuda_run(tmp_path):
    settings = gpu_bench.GpuBenchSettings(**{**gpu_bench.TINY, "device": "cuda", "output_dir": str(tmp_path),
                                             "progress": False})
    result = gpu_bench.run_gpu_bench(settings)
    rows = result["summary"]["by_batch"][1]
    assert rows["plain"]["cuda_peak_mib"] > 0 and rows["ours-2"]["cuda_over_weights_mib"] >= 0
    assert all(mismatch.get("near_tie", False) for mismatch in result["mismatches"]), result["mismatches"]


# ------------------------------------------------------------------------------------- instruments
def test_structured_target_exits_agree_as_set_with_wide_margins():
    target, construction = build_target("tiny", "cpu", torch.float32, draft_layers=1, draft_agreement=0.8, seed=0)
    assert construction.exit_agreement(1) == pytest.approx(0.8, abs=0.01)
    assert construction.exit_agreement(3) > construction.exit_agreement(2) > construction.exit_agreement(1)
    prompts = random_prompts([16, 24, 32], construction.vocab_size, seed=5, key_tokens=8)
    hits, total, gaps = {1: 0, 2: 0}, 0, []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = target.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0)
            logits = target(out).logits[0, len(prompt) - 1 : -1]
            top = logits.topk(2, -1).values
            gaps += ((top[:, 0] - top[:, 1]) / top[:, 0].abs()).tolist()
            chosen = logits.argmax(-1)
            assert torch.equal(chosen, out[0, len(prompt) :])
            for layers in hits:
                hits[layers] += int((early_exit(target, layers)(out).logits[0, len(prompt) - 1 : -1].argmax(-1) == chosen).sum())
            total += chosen.numel()
    for layers, count in hits.items():
        assert count / total == pytest.approx(construction.exit_agreement(layers), abs=0.1)
    # the target's greedy choices are never near-ties: far from what half-precision kernels can flip
    assert min(gaps) > 0.05


def test_reference_drafter_has_the_set_acceptance_and_cost():
    reference = list(range(FIRST_TOKEN, FIRST_TOKEN + 400))
    drafter = ReferenceDrafter(acceptance=0.6, num_tokens=4, seconds_per_token=2e-4, vocab_size=1000, seed=1)
    drafter.load([reference])
    right = drawn = 0
    for start in range(8, 396, 4):
        tokens, log_probs = drafter.propose(torch.tensor([reference[:start]]), 10)
        assert log_probs is None and tokens.dtype == torch.long and tokens.shape == (4,)
        truth = reference[start : start + 4]
        right += sum(int(t) == r for t, r in zip(tokens, truth))
        assert all(FIRST_TOKEN <= int(t) < 1000 for t in tokens)
        drawn += 4
    rate = right / drawn
    assert abs(rate - 0.6) < 3 * math.sqrt(0.6 * 0.4 / drawn)
    assert drafter.proposed == drawn and drafter.charged_seconds == pytest.approx(drawn * 2e-4)
    assert drafter.spent_seconds >= drafter.charged_seconds

    # the budget caps the proposal; no budget, no proposal and no cost
    assert drafter.propose(torch.tensor([reference[:10]]), 2)[0].shape == (2,)
    assert drafter.propose(torch.tensor([reference[:10]]), 0)[0].shape == (0,)

    # acceptance 1 proposes the reference; 0 never does
    exact = ReferenceDrafter(1.0, 3, 0.0, 1000)
    exact.load([reference])
    assert exact.propose(torch.tensor([reference[:20]]), 5)[0].tolist() == reference[20:23]
    never = ReferenceDrafter(0.0, 3, 0.0, 1000)
    never.load([reference])
    assert all(a != b for a, b in zip(never.propose(torch.tensor([reference[:20]]), 5)[0].tolist(), reference[20:23]))

    # off the reference (or an unknown prompt): nothing proposed, counted
    off = reference[:20] + [999]
    assert exact.propose(torch.tensor([off]), 5)[0].numel() == 0
    assert exact.propose(torch.tensor([list(range(500, 530))]), 5)[0].numel() == 0
    assert exact.off_reference == 2


def test_acceptance_estimate_counts_rejecting_verifications():
    # accepted + 1 per verification, K = 4: 4 + 4 + 0 + 2 accepted, two verifications rejected a draft
    assert gpu_bench.acceptance_estimate([5, 5, 1, 3], 4) == pytest.approx(10 / 12)
    assert gpu_bench.acceptance_estimate([], 4) is None


def test_timed_call_records_no_gpu_memory_on_the_cpu():
    timing = timed_call(lambda: 1, target=torch.nn.Linear(2, 2), sample_rss=False)
    assert timing.output == 1 and timing.cuda_peak_mib is None and timing.target_forwards == 0


def test_greedy_difference_tells_a_real_difference_from_a_near_tie():
    from benchmarks.bench.calls import greedy_difference

    target, construction = build_target("tiny", "cpu", torch.float32, draft_layers=1, draft_agreement=0.8, seed=0)
    prompt = torch.tensor(random_prompts([12], construction.vocab_size, seed=2, key_tokens=8)[0])
    plain = target.generate(prompt.unsqueeze(0), max_new_tokens=6, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, 12:].tolist()
    assert greedy_difference(target, prompt, plain, plain) is None
    wrong = plain[:3] + [FIRST_TOKEN + (plain[3] - FIRST_TOKEN + 1) % (construction.vocab_size - FIRST_TOKEN)] + plain[4:]
    detail = greedy_difference(target, prompt, wrong, plain)
    assert detail["position"] == 3 and detail["near_tie"] is False and detail["plain_logit"] > detail["method_logit"]
    assert greedy_difference(target, prompt, plain[:4], plain) == {"position": 4}  # stopped earlier


def test_settings_that_would_fail_later_are_refused_before_building(capsys):
    assert cli.main(["gpu-bench", "--device", "cpu", "--tiny", "--acceptance", "1.5", "--prompt-lengths", "4"]) == 2
    error = capsys.readouterr().err
    assert "--acceptance must be in [0, 1]" in error and "--prompt-lengths must each be at least 8 tokens" in error


def _gpu_check():
    """tools/gpu_check.py (a script, not a package module), imported by path."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_check_compares_every_method_on_the_cpu(tmp_path, capsys):
    """`make gpu-check`'s script on tiny CPU models (issue 45): plain static generate, transformers'
    assisted decoding on a static cache (>= 5.24) and ours over the same prompts, every output
    identical to plain static generate's, each method's first calls timed apart; the report says each."""
    gpu_check = _gpu_check()
    assert gpu_check.main(["--device", "cpu", "--tiny", "--output", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    chain = report["chain"]
    expected = set(gpu_check.METHODS) - ({"hf-assisted-static"} if not compat.ASSISTED_DECODING_TAKES_STATIC_CACHE else set())
    assert set(chain["methods"]) == expected and "cut_short" not in chain
    for name, row in chain["methods"].items():
        assert row["identical"] == "2 of 2" and row["tok_s"] > 0 and len(row["first_calls_s"]) == 2, name
        assert row["over_plain_static"] > 0
    assert chain["first_call"]["runners"] == ["static, compiled"] * 2
    printed = capsys.readouterr().out
    assert "| ours-default |" in printed and "over transformers' assisted, static" in printed
    assert (tmp_path / "gpu-check.md").read_text().strip() in printed


def test_the_gpu_check_refuses_a_method_it_does_not_know(capsys):
    """Before anything runs (a GPU's minutes are not spent on a typo)."""
    gpu_check = _gpu_check()
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cpu", "--tiny", "--methods", "ours-default,ours-defualt"])
    assert ("--methods: unknown ours-defualt; choose from plain-static, hf-assisted-static, ours-default, "
            "ours-head") in capsys.readouterr().err
