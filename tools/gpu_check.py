"""The prepared GPU check (issue 35): one command, within 8 minutes on one GPU, that says whether the
GPU path does what its docs claim. `make gpu-check` runs it; on the device machine of a session:

    PYTHONPATH=. python tools/gpu_check.py --output "$OUT"

Steps, each printed as it ends (a step that would pass the time budget is skipped, said so):

1. the CUDA tests (`pytest -m cuda`: CUDA graphs under inductor, exactness under replay, graphs per
   call, torch's own count of host waits per round);
2. on the Llama-3.2-1B shape (random weights, built on the GPU in bf16; its 1-layer early exit drafts,
   agreeing on 0.8 of the target's greedy tokens by construction: `benchmarks.synthetic`):
   our default `assistant_models=[exit]` (compiled static runners): the first call's seconds and
   graphs, a second call's graphs (another prompt length and budget), host waits per target round
   under `torch.cuda.set_sync_debug_mode("warn")`; then, over the same prompts, tok/s of each method
   of `METHODS` and whether every output is identical to plain static `generate`'s: plain `generate`
   with a static cache (compiled by transformers), transformers' assisted decoding with the same
   drafter and a static cache (transformers >= 5.24 compiles the target's verification; the
   assistant stays eager; K = 4 drafts a round, as gpu-bench's ``hf-assisted-static``), and ours.
   Each method's first call (its compilation) is timed apart.

The time budget (``--time-budget``, 450 s: 8 minutes with the start-up) is checked before each
step: the CUDA tests get at most `TESTS_SECONDS` and leave the rest at least `CHAIN_SECONDS`, a
method's first calls are skipped (said so) when under `FIRST_CALL_RESERVE` is left, the timed
repeats stop when the next would pass the budget. Estimate for the 1B shape on an H100, from the
figures an earlier gpu-bench run printed on one (H100 80GB, 2026-11-25, kept with the project's
research notes: plain static 338 tok/s, 0.4 s a call of 128 tokens;
transformers' assisted decoding, eager, 23.6 tok/s, 5.4 s a call, its static form at most that) and,
as no compiled run was timed there, an assumed 30-60 s per inductor graph of the 1B forward (10-20 s
of its exit): building 15 s; CUDA tests <= 180 s; our first call 4-6 graphs, 100-240 s; our second
call and the waits call 10-40 s; plain static's and transformers' assisted first calls (1 and 1-2
graphs, 4 calls) 60-180 s; the timed repeats 3 x 2 x (0.4 + 0.3 + 5.4) s, about 40 s. That is
400-700 s: the budget keeps the check within 8 minutes, and slow compiling costs the last steps
(the report says which), never the limit.

Writes gpu-check.md and gpu-check.json to ``--output``. ``--device cpu --tiny`` runs the same code on
tiny models on the CPU in seconds (no CUDA tests, no sync counts: a check of the script itself).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks/ (not installed)

import hf_polybasic as hp  # noqa: E402
from benchmarks.synthetic import build_eagle3_head, build_target, model_config  # noqa: E402
from hf_polybasic.cli.assisted import assisted_generate, assistant_settings  # noqa: E402
from hf_polybasic.cli.machine import machine_info  # noqa: E402
from hf_polybasic.compat import ASSISTED_DECODING_TAKES_STATIC_CACHE  # noqa: E402
from hf_polybasic.levels import early_exit  # noqa: E402
from hf_polybasic.timing import synchronize  # noqa: E402

CUDA_TESTS = ["tests/test_gpu_path.py", "tests/test_static.py", "tests/test_devices.py", "tests/test_int4.py"]
# the compared methods, in the order they run in each repeat (`method_calls`; --methods picks some)
METHODS = ("plain-static", "hf-assisted-static", "ours-default", "ours-head")
HEAD_AGREEMENT = 0.8  # of the random EAGLE-3 head's greedy drafts with the target's (issue 42's row)
BASELINE = "plain-static"  # every output is compared with its
ASSISTED_TOKENS = 4  # K of transformers' assisted decoding: constant, as gpu-bench's hf-assisted-static
FIRST_CALL_RESERVE = 90.0  # seconds of the budget a method's first calls (its compilation) need to start
TESTS_SECONDS, CHAIN_SECONDS = 180.0, 270.0  # the CUDA tests' most, and what they leave the chain at least


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


def method_calls(target, draft, new_tokens: int, head=None) -> dict:
    """``{name: (description, call(ids, tokens))}`` of every method the check can compare (`METHODS`);
    "ours-head" only with a ``head`` level (`build_eagle3_head`'s)."""
    def plain_static(ids, tokens):
        return target.generate(ids, do_sample=False, max_new_tokens=tokens, eos_token_id=None,
                               cache_implementation="static")

    def hf_assisted_static(ids, tokens):
        return assisted_generate(target, draft, assistant_settings(ASSISTED_TOKENS), inputs=ids, do_sample=False,
                                 max_new_tokens=tokens, eos_token_id=None, cache_implementation="static")

    def ours(ids, tokens):
        return target.generate(ids, custom_generate=hp.generate, assistant_models=[draft], do_sample=False,
                               max_new_tokens=tokens, eos_token_id=None, return_dict_in_generate=True,
                               polybasic_config=hp.PolybasicConfig(compile=True)).sequences

    calls = {
        "plain-static": ("transformers generate, static cache (compiled by transformers on a GPU)", plain_static),
        "hf-assisted-static": (f"transformers assistant_model=exit, K={ASSISTED_TOKENS} constant, static cache (the "
                               "target's verification compiled on a GPU, transformers >= 5.24)", hf_assisted_static),
        "ours-default": ("hf_polybasic assistant_models=[exit], default config (compiled static runners)", ours),
    }
    if head is not None:
        def ours_head(ids, tokens):
            return target.generate(ids, custom_generate=hp.generate, assistant_models=[head], do_sample=False,
                                   max_new_tokens=tokens, eos_token_id=None, return_dict_in_generate=True,
                                   polybasic_config=hp.PolybasicConfig(compile=True)).sequences

        calls["ours-head"] = (f"hf_polybasic assistant_models=[a random-weight EAGLE-3 head of the target's shape, "
                              f"its greedy drafts the target's on {HEAD_AGREEMENT:.0%} of tokens "
                              "(benchmarks.synthetic.build_eagle3_head)], default config", ours_head)
    return calls


def _unavailable(name: str) -> str | None:
    """Why a method of `METHODS` cannot run with this transformers, or None."""
    if name == "hf-assisted-static" and not ASSISTED_DECODING_TAKES_STATIC_CACHE:
        return "transformers < 5.24 refuses a static cache in assisted decoding"
    return None


def chain_check(shape: str, device: torch.device, new_tokens: int, lengths: list[int], repeats: int,
                budget: Budget, methods: tuple[str, ...] = METHODS) -> dict:
    """The default chain's compilation and waits, then every method of ``methods`` over the same
    prompts on ``shape`` (see the module docstring)."""
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
                             "prompt_length": int(second_ids.shape[1]), "new_tokens": new_tokens // 2,
                             "runners": [level.runner for level in out.polybasic_stats.levels]}
    _say(f"gpu-check: second call (prompt {second_ids.shape[1]}, {new_tokens // 2} tokens): "
         f"{result['second_call']['graphs']} graphs")

    # host waits per target round, in a warm call
    out, syncs = _syncs(device, lambda: ours(first_ids, new_tokens))
    rounds = out.polybasic_stats.levels[0].forward_passes
    result["host_waits"] = {"syncs": syncs, "target_rounds": rounds,
                            "per_round": None if syncs is None else round(syncs / rounds, 2)}
    _say(f"gpu-check: host waits {syncs} over {rounds} target rounds")

    # each method's first calls (its compilation; transformers compiles per prompt length too), then tok/s
    # over the prompts, interleaved repeats, medians; every output compared with plain static generate's
    head_directory = tempfile.mkdtemp(prefix="gpu-check-head-") if "ours-head" in methods else None
    try:
        head = None
        if head_directory is not None:
            head, construction = build_eagle3_head(target, head_directory, HEAD_AGREEMENT)
            result["head"] = {"agreement": construction.agreement, "draft_vocab_size": construction.draft_vocab_size,
                              "layers": list(construction.layers)}
        return _compare(result, method_calls(target, draft, new_tokens, head), device, vocab, new_tokens, lengths,
                        repeats, budget, methods)
    finally:
        if head_directory is not None:
            shutil.rmtree(head_directory, ignore_errors=True)


def _compare(result: dict, calls: dict, device: torch.device, vocab: int, new_tokens: int, lengths: list[int],
             repeats: int, budget: Budget, methods: tuple[str, ...]) -> dict:
    """Each method's first calls, then tok/s over the prompts (interleaved repeats, medians), every
    output compared with `BASELINE`'s; into ``result``."""
    prompts = [_prompt(length, vocab, 10 + index, device) for index, length in enumerate(lengths)]
    result["methods"], result["skipped_methods"] = {}, {}
    for name in methods:
        why = _unavailable(name)
        if why is None and budget.left() < FIRST_CALL_RESERVE:
            why = f"{budget.left():.0f} s left of the budget for its first calls"
        if why is not None:
            result["skipped_methods"][name] = why
            _say(f"gpu-check: {name} skipped: {why}")
            continue
        first = [_timed(device, lambda ids=ids: calls[name][1](ids, new_tokens))[1] for ids in prompts]
        result["methods"][name] = {"description": calls[name][0], "first_calls_s": [round(t, 2) for t in first],
                                   "seconds": [], "identical": []}
        _say(f"gpu-check: {name}: first calls {', '.join(f'{t:.1f}' for t in first)} s")
    timed = list(result["methods"])
    if BASELINE not in timed:
        result["cut_short"] = f"{BASELINE} did not run: no output to compare with"
        return result
    for _ in range(repeats):
        for ids in prompts:
            if budget.left() < 20 * len(timed):
                result["cut_short"] = "the time budget ran out during the timed repeats"
                break
            outputs = {}
            for name in timed:
                outputs[name], seconds = _timed(device, lambda: calls[name][1](ids, new_tokens))
                result["methods"][name]["seconds"].append(seconds)
            for name in timed:
                result["methods"][name]["identical"].append(bool(torch.equal(outputs[name], outputs[BASELINE])))
    for name, row in result["methods"].items():
        row["tok_s"] = round(new_tokens / statistics.median(row["seconds"]), 1) if row["seconds"] else None
        row["identical"] = f"{sum(row['identical'])} of {len(row['identical'])}"
    base = result["methods"][BASELINE]["tok_s"]
    assisted = result["methods"].get("hf-assisted-static", {}).get("tok_s")
    for row in result["methods"].values():
        row["over_plain_static"] = round(row["tok_s"] / base, 3) if row["tok_s"] and base else None
        row["over_hf_assisted_static"] = round(row["tok_s"] / assisted, 3) if row["tok_s"] and assisted else None
    _say("gpu-check: tok/s " + ", ".join(f"{name} {row['tok_s']}" for name, row in result["methods"].items()))
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
                  f"| runners | {', '.join(chain['first_call']['runners'])} |"]
        lines += ["", f"{chain['new_tokens']} new tokens, prompts of {', '.join(map(str, chain['prompt_lengths']))} "
                  "tokens; medians over the prompts and repeats", "",
                  "| method | first calls s (compiling) | tok/s | over plain static | over transformers' assisted, "
                  "static | outputs identical to plain static |", "|---|---|---|---|---|---|"]
        for name, row in chain.get("methods", {}).items():
            lines.append(f"| {name} | {', '.join(map(str, row['first_calls_s']))} | {row.get('tok_s')} | "
                         f"{row.get('over_plain_static')} | {row.get('over_hf_assisted_static')} | "
                         f"{row.get('identical')} |")
        lines += [f"| {name} | skipped: {why} | | | | |" for name, why in chain.get("skipped_methods", {}).items()]
        if chain.get("cut_short"):
            lines.append(f"\nCut short: {chain['cut_short']}")
        lines += [""] + [f"- `{name}`: {row['description']}" for name, row in chain.get("methods", {}).items()]
        if chain.get("head"):
            head = chain["head"]
            lines.append(f"- the head: reads layers {head['layers']}, {head['draft_vocab_size']} draft ids, "
                         f"agreement {head['agreement']}")
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
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated, of {', '.join(METHODS)} (default: all; {BASELINE} always runs)")
    parser.add_argument("--output", default=os.environ.get("OUT") or "gpu-check")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU here (use --device cpu --tiny to check the script)")
    asked = {name.strip() for name in args.methods.split(",") if name.strip()}
    if asked - set(METHODS):
        parser.error(f"--methods: unknown {', '.join(sorted(asked - set(METHODS)))}; choose from {', '.join(METHODS)}")
    methods = tuple(name for name in METHODS if name in asked | {BASELINE})  # in their order
    if args.tiny:
        args.shape, args.new_tokens, args.prompt_lengths, args.repeats = "tiny", 16, "8,16", 1
        torch.set_num_threads(1)
    lengths = [int(length) for length in args.prompt_lengths.split(",")]
    budget = Budget(args.time_budget)
    report = {"command": " ".join(["python tools/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "machine": machine_info(), "torch": torch.__version__, "skipped": {}}
    if device.type == "cuda" and not args.skip_tests:
        report["cuda_tests"] = cuda_tests(timeout=min(TESTS_SECONDS, budget.left() - CHAIN_SECONDS))
        _say(f"gpu-check: CUDA tests: {report['cuda_tests']['summary']}")
    if budget.left() > 120:
        report["chain"] = chain_check(args.shape, device, args.new_tokens, lengths, args.repeats, budget, methods)
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
