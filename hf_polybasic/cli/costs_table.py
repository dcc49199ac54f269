"""``hf-polybasic costs``: the cost curves T(k) of the real models on this machine, as a table.

One row per way the chain's models can run here (the target in float32 and bfloat16, each with and
without oneDNN-packed linear layers where this machine packs that dtype, and through the few-row view a
chain's runner takes where it pays (`hf_polybasic.models.few_rows`); the int8 copies of the
target and of the 0.5B; the 0.5B in bf16, packed where this machine packs bf16; the target's 4-bit
copies: int4 through torch's own int4 kernels, always, and nf4 where bitsandbytes, the ``quant4``
extra, is installed): the median seconds of one forward scoring k new tokens after a 64-token
context (`hf_polybasic.costs.measure_curve`, the same measurement the cost-aware schedule uses), and
T(k)/T(1), what a verification of k tokens costs in decoding steps.
Models are loaded one at a time (`hf_polybasic.cli.loading`), so the peak memory is that of the
largest.

``restricted=(N, ...)`` adds, for every 0.5B variant, the same model with its output layer restricted
to N ids (`hf_polybasic.levels.restricted_vocabulary`; a view sharing the weights). ``only`` keeps
the variants whose label contains one of its strings; ``interleaved`` builds them all at once and
times them forward by forward (each round one forward of every size for every variant in turn,
medians over rounds), so a shared machine's load hits every variant alike: the way to compare a
model with its restricted view.
"""

from __future__ import annotations

import functools
import gc
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import compat
from ..models import nf4 as four_bit
from ..models.few_rows import FewRowLinear
from ..models.modules import view_replacing
from ..costs import hardware
from ..costs import MEASURED_TOKENS, CostCurve, measure_curve
from ..costs.measure import EVERY_TOKEN
from ..timing import timed
from . import loading
from .model_sets import QWEN_DRAFT, QWEN_TARGET


def qwen_variants(restricted: Sequence[int] = ()) -> dict[str, Callable[[], torch.nn.Module]]:
    """Label -> loader of each way the real models can run on this machine (with ``restricted``,
    the 0.5B variants' restricted views too)."""

    def target(dtype, pack):
        def build():
            model, _ = loading.load(QWEN_TARGET, dtype)
            return loading.pack(model) if pack else model

        return build

    variants = {}
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        variants[f"1.5B {name}"] = target(dtype, False)
        # the view a chain's runner forwards where its probe says it pays (`hf_polybasic.models.few_rows`),
        # here whatever the probe says
        variants[f"1.5B {name} few-row products"] = lambda load=target(dtype, False): view_replacing(
            load(), torch.nn.Linear, FewRowLinear)
        if compat.onednn_supports(dtype):
            variants[f"1.5B {name} packed"] = target(dtype, True)
    variants["1.5B int8-dynamic"] = lambda: loading.load_int8(QWEN_TARGET)

    def float32_target():
        return loading.load(QWEN_TARGET, torch.float32)[0]

    variants["1.5B int4"] = _four_bit_copy_of(float32_target, "int4")  # torch's int4 kernels: nothing to install
    if four_bit.available("nf4"):  # bitsandbytes: the quant4 extra
        variants["1.5B nf4"] = _four_bit_copy_of(float32_target, "nf4")
    drafters = {
        "0.5B int8-dynamic": lambda: loading.load_int8(QWEN_DRAFT),
        "0.5B bf16": lambda: loading.load(QWEN_DRAFT, torch.bfloat16)[0],
    }
    if compat.onednn_supports(torch.bfloat16):
        drafters["0.5B bf16 packed"] = lambda: loading.pack(loading.load(QWEN_DRAFT, torch.bfloat16)[0])
    variants.update(drafters)
    variants.update(restricted_variants(drafters, restricted))
    return variants


def restricted_variants(bases: dict[str, Callable[[], torch.nn.Module]],
                        sizes: Sequence[int]) -> dict[str, Callable[[], torch.nn.Module]]:
    """``"<label>, head N"`` -> a `restricted_vocabulary` view keeping N ids, for each base and N; the
    views of one base share one loaded model (loaded on first use)."""
    from ..levels import restricted_vocabulary

    variants = {}
    for label, load in bases.items():
        shared = functools.cache(load)
        for size in sizes:
            variants[f"{label}, head {size}"] = lambda shared=shared, size=size: restricted_vocabulary(shared(), keep=size)
    return variants


def _four_bit_copy_of(load: Callable[[], torch.nn.Module], method: str) -> Callable[[], torch.nn.Module]:
    from ..levels import quantized_copy

    return lambda: quantized_copy(load(), method)


def tiny_variants(restricted: Sequence[int] = ()) -> dict[str, Callable[[], torch.nn.Module]]:
    """The same for the tiny random models (seconds; for tests and a first look)."""
    from ..levels import quantized_copy
    from ..testing import make_target

    variants = {
        "tiny fp32": lambda: make_target("qwen2"),
        "tiny bf16": lambda: make_target("qwen2").to(torch.bfloat16),
        "tiny int8-dynamic": lambda: quantized_copy(make_target("qwen2"), "int8-dynamic"),
    }
    if four_bit.available("nf4"):  # no int4: the tiny model's width, 32, takes no groups of 128 (its default)
        variants["tiny nf4"] = _four_bit_copy_of(lambda: make_target("qwen2"), "nf4")
    variants.update(restricted_variants({"tiny int8-dynamic": variants["tiny int8-dynamic"]}, restricted))
    return variants


def measure_variants(
    variants: dict[str, Callable[[], torch.nn.Module]], tokens: Sequence[int] = MEASURED_TOKENS, repeats: int = 5,
    progress: bool = True, interleaved: bool = False,
) -> dict[str, CostCurve]:
    """The cost curve of each variant, loading one model at a time (``interleaved``: all at once,
    measured round by round)."""
    if interleaved:
        return _measure_interleaved(variants, tokens, repeats, progress)
    curves = {}
    for label, build in tqdm(variants.items(), desc="cost curves", disable=not progress):
        model = build()
        curves[label] = measure_curve(model, tokens=tokens, repeats=repeats)
        del model
        gc.collect()
    return curves


@torch.no_grad()
def _measure_interleaved(variants, tokens, repeats: int, progress: bool) -> dict[str, CostCurve]:
    """Every variant built at once and timed forward by forward: each round times one forward of
    every size for every variant in turn (after two untimed rounds), so a shared machine's load
    hits all of them alike; the medians over rounds."""
    from ..runners.dynamic import CachedModel
    from ..compat import new_dynamic_cache
    from ..costs import CALIBRATION_CONTEXT, machine_description, model_description

    models = {label: build() for label, build in variants.items()}
    runners, prefixes = {}, {}
    for label, model in models.items():
        vocab = model.config.get_text_config(decoder=True).vocab_size
        prefixes[label] = (torch.arange(CALIBRATION_CONTEXT) * 7919 % max(vocab - 3, 1)) + 3  # as measure_curve's
        runners[label] = CachedModel(model, new_dynamic_cache(model), role=label)
        runners[label].logits(prefixes[label], 1)
    seconds: dict[str, dict[int, list[float]]] = {label: {k: [] for k in tokens} for label in models}
    for index in tqdm(range(repeats + 2), desc="interleaved rounds", disable=not progress):
        for k in tokens:
            for label, runner in runners.items():
                prefix = prefixes[label]
                runner.rollback_rows({0: prefix.shape[0]})
                with timed() as span:
                    runner.logits(torch.cat([prefix, prefix[-1:].repeat(k)]), k)
                if index >= 2:
                    seconds[label][k].append(span.seconds)
    return {
        label: CostCurve({k: statistics.median(times) for k, times in seconds[label].items()}, CALIBRATION_CONTEXT,
                         {"model": model_description(models[label]), "machine": machine_description(models[label])})
        for label in models
    }


def _milliseconds(seconds: float) -> str:
    return f"{1000 * seconds:.1f}" if seconds < 0.01 else f"{1000 * seconds:.0f}"


def render_table(curves: dict[str, CostCurve]) -> str:
    """Markdown: ms per forward of k tokens, then T(k)/T(1) at the largest k."""
    sizes = sorted(next(iter(curves.values())).points)
    header = "| model | " + " | ".join(f"k={k}" for k in sizes) + f" | T({sizes[-1]})/T(1) |"
    lines = [header, "|---" * (len(sizes) + 2) + "|"]
    for label, curve in curves.items():
        cells = " | ".join(_milliseconds(curve.points[k]) for k in sizes)
        lines.append(f"| {label} | {cells} | {curve.ratio(sizes[-1]):.1f} |")
    return "\n".join(lines)


def run_costs_table(models: str = "qwen", repeats: int = 5, out: str | None = None, progress: bool = True,
                    restricted: Sequence[int] = (), only: Sequence[str] = (), interleaved: bool = False,
                    every_width: bool = False) -> str:
    """Measure, render (machine line, table) and, with ``out``, write ``costs_<class>.md/.json``
    (``costs_<class>-<only>...`` when ``only`` picks variants, ``...-every-width`` with ``every_width``: k = 1 .. 17,
    `hf_polybasic.costs.measure.EVERY_TOKEN`, the widths a dynamic runner's curve is measured at)."""
    machine = hardware.describe_machine()
    variants = qwen_variants(restricted) if models == "qwen" else tiny_variants(restricted)
    if only:
        variants = {label: build for label, build in variants.items() if any(part in label for part in only)}
        if not variants:
            raise ValueError(f"--only {list(only)} matches no variant")
    tokens = EVERY_TOKEN if every_width else MEASURED_TOKENS
    curves = measure_variants(variants, tokens, repeats=repeats, progress=progress, interleaved=interleaved)
    text = (
        f"Machine: {machine['cpu']}, {machine['class']}, {machine['threads']} threads, torch {machine['torch']}; "
        f"CPU flags: {', '.join(machine['cpu_flags']) or '-'}\n"
        f"Median ms of one forward scoring k new tokens after {next(iter(curves.values())).context} cached "
        f"tokens ({repeats} {'rounds interleaved across models' if interleaved else 'interleaved rounds'} after "
        "warm-up):\n\n" + render_table(curves) + "\n"
    )
    if out is not None:
        directory = Path(out)
        directory.mkdir(parents=True, exist_ok=True)
        slug = machine["torch_cpu_capability"].lower() + ("-emulated" if "emulated" in machine["class"] else "")
        slug += "".join("-" + part.replace(" ", "_") for part in only) + "".join(f"-head{size}" for size in restricted)
        slug += "-every-width" if every_width else ""
        (directory / f"costs_{models}_{slug}.md").write_text(text)
        payload = {"machine": machine, "curves": {label: curve.to_dict() for label, curve in curves.items()}}
        (directory / f"costs_{models}_{slug}.json").write_text(json.dumps(payload, indent=1) + "\n")
    return text
