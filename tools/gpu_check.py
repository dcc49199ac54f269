"""The prepared GPU check (issue 35): one command, within 8 minutes on one GPU, that says whether the
GPU path does what its docs claim. `make gpu-check` runs it; on the device machine of a session:

    PYTHONPATH=. python tools/gpu_check.py --output "$OUT"

Steps, each printed as it ends (a step that would pass the time budget is skipped, said so):

1. the CUDA tests (`pytest -m cuda`: CUDA graphs under inductor, exactness under replay, graphs per
   call, torch's own count of host waits per round);
2. on the Llama-3.2-1B shape (random weights, built on the GPU in bf16; its 1-layer early exit drafts,
   agreeing on 0.8 of the target's greedy tokens by construction: `benchmarks.synthetic`):
   plain `generate` with a static cache (compiled by transformers) against our default
   `assistant_models=[exit]` (compiled static runners): the first call's seconds and graphs, a second
   call's graphs (another prompt length and budget), host waits per target round under
   `torch.cuda.set_sync_debug_mode("warn")`, tok/s of each over the same prompts, and whether every
   output is identical.

Writes gpu-check.md and gpu-check.json to ``--output``. ``--device cpu --tiny`` runs the same code on
tiny models on the CPU in seconds (no CUDA tests, no sync counts: a check of the script itself).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks/ (not installed)

import hf_polybasic as hp  # noqa: E402
from benchmarks.synthetic import build_target, model_config  # noqa: E402
from hf_polybasic.cli.machine import machine_info  # noqa: E402
from hf_polybasic.levels import early_exit  # noqa: E402
from hf_polybasic.timing import synchronize  # noqa: E402

CUDA_TESTS = ["tests/test_gpu_path.py", "tests/test_static.py", "tests/test_devices.py", "tests/test_int4.py"]


def _say(text: str) -> None:
    print(text, flush=True)


class Budget:
    """Seconds left of the check's time budget."""

    def __init__(self, seconds: float):
        self.started, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.started)


def cuda_tests(timeout: float) -> dict:
    """`pytest -m cuda` on the files that hold CUDA tests: its closing line and exit code."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", *CUDA_TESTS]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        lines = (done.stdout + done.stderr).strip().splitlines()
        result = {"exit_code": done.returncode, "summary": lines[-1] if lines else "",
                  "failures": [line for line in lines if line.startswith(("FAILED", "ERROR"))][:20]}
    except subprocess.TimeoutExpired:
        result = {"exit_code": None, "summary": f"timed out after {timeout:.0f} s", "failures": []}
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _prompt(length: int, vocab: int, seed: int, device) -> torch.LongTensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, length), generator=generator).to(device)


def _timed(device, call):
    synchronize([device] if device.type == "cuda" else [])
    started = time.perf_counter()
    out = call()
    synchronize([device] if device.type == "cuda" else [])
    return out, time.perf_counter() - started


def _syncs(device, call) -> tuple[object, int]:
    """``call()`` and how many synchronizing CUDA calls torch saw in it."""
    if device.type != "cuda":
        return call(), None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = call()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return out, sum("synchroniz" in str(w.message) for w in caught)


def chain_check(shape: str, device: torch.device, new_tokens: int, lengths: list[int], repeats: int,
                budget: Budget) -> dict:
    """The default chain against plain static `generate` on ``shape`` (see the module docstring)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layers = model_config(shape)[1].num_hidden_layers
    target, construction = build_target(shape, device, dtype, max(1, layers // 16), 0.8, seed=0)
    draft = early_exit(target, max(1, layers // 16))
    vocab = construction.vocab_size
    result = {"shape": shape, "dtype": str(dtype), "new_tokens": new_tokens, "prompt_lengths": lengths}

    def ours(ids, tokens, **extra):
        return target.generate(ids, custom_generate=hp.generate, assistant_models=[draft], do_sample=False,
                               max_new_tokens=tokens, eos_token_id=None, return_dict_in_generate=True,
                               polybasic_config=hp.PolybasicConfig(compile=True), **extra)

    def plain_static(ids, tokens):
        return target.generate(ids, do_sample=False, max_new_tokens=tokens, eos_token_id=None,
                               cache_implementation="static")

    # first and second call of ours: seconds and graphs
    first_ids, second_ids = _prompt(lengths[0], vocab, 1, device), _prompt(lengths[-1] + 7, vocab, 2, device)
    before = _graphs()
    out, seconds = _timed(device, lambda: ours(first_ids, new_tokens))
    result["first_call"] = {"seconds": round(seconds, 2), "graphs": _graphs() - before,
                            "widths": [level.forward_widths for level in out.polybasic_stats.levels],
                            "runners": [level.runner for level in out.polybasic_stats.levels]}
    _say(f"gpu-check: first call of the default {seconds:.1f} s, {result['first_call']['graphs']} graphs")
    before = _graphs()
    out, seconds = _timed(device, lambda: ours(second_ids, new_tokens // 2))
    result["second_call"] = {"seconds": round(seconds, 2), "graphs": _graphs() - before,
                             "prompt_length": int(second_ids.shape[1]), "new_tokens": new_tokens // 2}
    _say(f"gpu-check: second call (prompt {second_ids.shape[1]}, {new_tokens // 2} tokens): "
         f"{result['second_call']['graphs']} graphs")

    # host waits per target round, in a warm call
    out, syncs = _syncs(device, lambda: ours(first_ids, new_tokens))
    rounds = out.polybasic_stats.levels[0].forward_passes
    result["host_waits"] = {"syncs": syncs, "target_rounds": rounds,
                            "per_round": None if syncs is None else round(syncs / rounds, 2)}
    _say(f"gpu-check: host waits {syncs} over {rounds} target rounds")

    # tok/s over the prompts, interleaved repeats, medians; outputs compared
    prompts = [_prompt(length, vocab, 10 + index, device) for index, length in enumerate(lengths)]
    for ids in prompts:  # warm-up: transformers compiles its static generate per prompt length too
        if budget.left() < 60:
            break
        plain_static(ids, new_tokens)
        ours(ids, new_tokens)
    times = {"plain-static": [], "ours-default": []}
    identical = []
    for _ in range(repeats):
        for ids in prompts:
            if budget.left() < 20:
                result["cut_short"] = "the time budget ran out during the timed repeats"
                break
            reference, seconds = _timed(device, lambda: plain_static(ids, new_tokens))
            times["plain-static"].append(seconds)
            mine, seconds = _timed(device, lambda: ours(ids, new_tokens))
            times["ours-default"].append(seconds)
            identical.append(bool(torch.equal(mine.sequences, reference)))
    result["tok_s"] = {name: round(new_tokens / statistics.median(values), 1) if values else None
                       for name, values in times.items()}
    if all(result["tok_s"].values()):
        result["speedup"] = round(result["tok_s"]["ours-default"] / result["tok_s"]["plain-static"], 3)
    result["identical"] = f"{sum(identical)} of {len(identical)}"
    _say(f"gpu-check: tok/s {result['tok_s']}, identical {result['identical']}")
    return result


def markdown(report: dict) -> str:
    lines = ["# gpu-check", "", f"Command: `{report['command']}`", f"Device: {report['device']}", ""]
    tests = report.get("cuda_tests")
    if tests:
        lines += [f"CUDA tests: {tests['summary']} (exit {tests['exit_code']}, {tests['seconds']} s)", ""]
        lines += [f"- {failure}" for failure in tests["failures"]]
    chain = report.get("chain")
    if chain:
        lines += ["", f"## {chain['shape']} ({chain['dtype']}), default `assistant_models=[exit]`, compiled", "",
                  "| figure | value |", "|---|---|",
                  f"| first call | {chain['first_call']['seconds']} s, {chain['first_call']['graphs']} graphs |",
                  f"| second call (other prompt and budget) | {chain['second_call']['graphs']} graphs |",
                  f"| host waits per target round | {chain['host_waits']['per_round']} "
                  f"({chain['host_waits']['syncs']} over {chain['host_waits']['target_rounds']} rounds) |",
                  f"| tok/s plain static (compiled by transformers) | {chain['tok_s']['plain-static']} |",
                  f"| tok/s ours, default | {chain['tok_s']['ours-default']} |",
                  f"| speedup | {chain.get('speedup')} |", f"| outputs identical | {chain['identical']} |"]
    for step, why in report.get("skipped", {}).items():
        lines.append(f"\nSkipped {step}: {why}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="llama3.2-1b")
    parser.add_argument("--tiny", action="store_true", help="tiny models (the script's own check, on the CPU)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-lengths", default="128,512")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--time-budget", type=float, default=450.0, help="seconds for everything")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--output", default=os.environ.get("OUT") or "gpu-check")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU here (use --device cpu --tiny to check the script)")
    if args.tiny:
        args.shape, args.new_tokens, args.prompt_lengths, args.repeats = "tiny", 16, "8,16", 1
        torch.set_num_threads(1)
    budget = Budget(args.time_budget)
    report = {"command": " ".join(["python tools/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "machine": machine_info(), "torch": torch.__version__, "skipped": {}}
    if device.type == "cuda" and not args.skip_tests:
        report["cuda_tests"] = cuda_tests(timeout=min(240.0, budget.left() - 180))
        _say(f"gpu-check: CUDA tests: {report['cuda_tests']['summary']}")
    lengths = [int(length) for length in args.prompt_lengths.split(",")]
    if budget.left() > 120:
        report["chain"] = chain_check(args.shape, device, args.new_tokens, lengths, args.repeats, budget)
    else:
        report["skipped"]["chain"] = f"{budget.left():.0f} s left of the budget"
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
    (out / "gpu-check.md").write_text(markdown(report), encoding="utf-8")
    _say(markdown(report))
    tests_ok = report.get("cuda_tests", {}).get("exit_code", 0) == 0
    return 0 if tests_ok and "chain" in report else 1


if __name__ == "__main__":
    sys.exit(main())
