"""``python -m benchmarks gpu-bench``: the engine on a GPU, against plain ``generate`` and transformers'
assisted generation, on models built in code (no network, no downloads, no tokenizer).

The models (`benchmarks.synthetic`): a random target of a real shape (default Llama-3-8B,
bf16), structured so that its early exits agree with its greedy tokens on a set fraction of
tokens; its ``draft_layers``-layer exit (the drafter, agreeing on ``draft_agreement``) and its
half-depth exit (the middle level) share its weights; its int4 copy (`hf_polybasic.models.int4`: weights
of its own, groups of 128, torch's int4 kernels; the paper's middle level) is made from it where
the device's kernel takes the shape; a `ReferenceDrafter` has a set acceptance rate and a set
cost. Prompts are token ids of varied lengths; every method decodes the same
prompts, greedy, with EOS off (every call generates the whole budget).

The phases, each timed and reported:

1. **build** the target on the device, in its dtype (no float32 copy), and its int4 copy.
2. **costs**: T(k) of each model level (`hf_polybasic.costs.measure_curve`: warm-up, then
   interleaved rounds, medians; CUDA-synchronized) and each one's prefill of every prompt length.
3. **references**: plain greedy ``generate`` of every prompt and batch, untimed: the outputs every
   method must reproduce, and what the synthetic drafter reads.
4. **agreement**: each level's greedy agreement with the references (one forward per prompt).
5. **warm-up**: one untimed call of every method on every batch size, of the whole budget
   (kernels, allocator, every compiled width, the cost-aware schedule's first measurement); on a
   GPU, one profiled call of every batch-1 method (host time against GPU busy time).
6. **timed**: repeats of every (method, prompt or batch), interleaved, the methods' order rotated
   each repeat; each call timed with the GPU's queue drained before and after
   (`hf_polybasic.cli.harness.timed_call`), its peak GPU memory recorded. Repeats stop early
   when the next would end past the time budget (the report says so).

Read against the theory: for each batch-1 call, the time its forwards alone would take by the
measured cost curves (Lemma 3.1 with curves on the call's own forward counts and block sizes, each
level's first forward charged as a prefill, plus the seconds the synthetic drafter took); the ratio
to the measured time is the engine's efficiency (1 = no overhead beyond the forwards). For the
synthetic 2-level chain, Leviathan et al.'s expected tokens per verification and the speedup they
predict from the set acceptance and cost, against what was measured.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from hf_polybasic.compat import ASSISTED_DECODING_TAKES_STATIC_CACHE, accepts_logits_to_keep
from hf_polybasic.config import PolybasicConfig
from hf_polybasic.costs import forward_cost, measure_curve
from hf_polybasic.models.int4 import DEFAULT_GROUP_SIZE as INT4_GROUP_SIZE
from hf_polybasic.levels import early_exit, quantized_copy
from hf_polybasic.planning import theory
from hf_polybasic.timing import synchronize
from hf_polybasic.cli.harness import ForwardCounter, process_peak_rss_mib, timed_call
from hf_polybasic.cli.machine import command_line, machine_info

from .bench.calls import _level_rows, describe_difference, greedy_difference
from .bench.methods import Method, hf_assisted, plain, polybasic
from .bench.report import speedup
from .synthetic import PAD, SHAPES, ReferenceDrafter, build_target, model_config, parameter_count, random_prompts

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KEY_TOKENS = 8  # the synthetic drafter tells prompts apart by their first tokens
BATCHED_METHODS = ("plain", "plain-static", "ours-2", "ours-2-eager", "ours-3", "ours-2-synthetic")
BASELINES = ("plain", "plain-static")  # speedups are reported over each


class GpuBenchError(RuntimeError):
    """A setting the machine cannot run (no CUDA device, too little memory): said, not a traceback."""


@dataclass(frozen=True)
class GpuBenchSettings:
    """What ``python -m benchmarks gpu-bench`` runs (see `TINY` for ``--tiny``)."""

    device: str = "cuda"
    shape: str = "llama3-8b"
    dtype: str = "bf16"
    max_new_tokens: int = 96
    prompt_lengths: tuple[int, ...] = (32, 128, 512)
    batch_sizes: tuple[int, ...] = (1, 4, 8)
    repeats: int = 3
    num_draft_tokens: int = 4  # K: our drafters', transformers' num_assistant_tokens, the synthetic drafter's
    draft_agreement: float = 0.8  # of the drafter exit with the target, by construction
    acceptance: float = 0.8  # the synthetic drafter's
    drafter_cost: float = 0.05  # the synthetic drafter's seconds per token, in target T(1)s
    cost_tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    time_budget_s: float = 480.0  # 8 minutes: one command on a lent GPU (10 at most), compilation included
    seed: int = 0
    output_dir: str | None = None
    progress: bool = True


TINY = dict(shape="tiny", max_new_tokens=16, prompt_lengths=(8, 16, 32), repeats=2, cost_tokens=(1, 2, 4, 8),
            time_budget_s=120.0)


@dataclass
class Unit:
    """One input every method decodes: a prompt (batch 1) or a left-padded batch of prompts."""

    name: str
    prompts: list[list[int]]
    inputs: dict
    references: list[list[int]] = field(default_factory=list)  # plain generate's new tokens, per row

    @property
    def batch(self) -> int:
        return len(self.prompts)


@dataclass
class BenchMethod:
    """A `Method` with what the time model needs: its levels' names (model levels are keys of the
    cost curves), its synthetic drafter, and transformers' assistant (whose forwards are counted)."""

    method: Method
    levels: tuple[str, ...]
    drafter: ReferenceDrafter | None = None
    assistant: torch.nn.Module | None = None


class Budget:
    """The run's time budget, from its start."""

    def __init__(self, seconds: float):
        self.seconds, self.started = seconds, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def allows(self, more_seconds: float) -> bool:
        return self.elapsed() + more_seconds <= self.seconds


def check_settings(settings: GpuBenchSettings) -> None:
    """A `GpuBenchError` for a setting that would fail later, before any model is built."""
    problems = []
    if settings.shape not in SHAPES:
        problems.append(f"--shape must be one of {sorted(SHAPES)}")
    if settings.dtype not in DTYPES:
        problems.append(f"--dtype must be one of {sorted(DTYPES)}")
    if not 0.0 <= settings.acceptance <= 1.0:
        problems.append("--acceptance must be in [0, 1]")
    if not 0.0 < settings.draft_agreement <= 1.0:
        problems.append("--draft-agreement must be in (0, 1]")
    if settings.drafter_cost < 0:
        problems.append("--drafter-cost must be >= 0")
    if min(settings.prompt_lengths, default=0) < KEY_TOKENS:
        problems.append(f"--prompt-lengths must each be at least {KEY_TOKENS} tokens")
    if not settings.batch_sizes or min(settings.batch_sizes) < 1:
        problems.append("--batch-sizes must be one or more sizes >= 1")
    if min(settings.repeats, settings.max_new_tokens, settings.num_draft_tokens) < 1:
        problems.append("--repeats, --max-new-tokens and --draft-tokens must be >= 1")
    if problems:
        raise GpuBenchError("; ".join(problems))


def check_device(settings: GpuBenchSettings) -> torch.device:
    """The device, or a `GpuBenchError` saying why it cannot run the settings."""
    check_settings(settings)
    try:
        device = torch.device(settings.device)
    except RuntimeError as error:
        raise GpuBenchError(f"--device must be cuda, cuda:N or cpu, got {settings.device!r}") from error
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise GpuBenchError(
                f"--device {settings.device}: torch sees no CUDA device (torch {torch.__version__}, built for CUDA "
                f"{torch.version.cuda or 'none'}). Without a GPU, run the smoke test: "
                "python -m benchmarks gpu-bench --device cpu --tiny"
            )
        index = device.index if device.index is not None else torch.cuda.current_device()
        device = torch.device("cuda", index)
        free, total = torch.cuda.mem_get_info(device)
        needed = parameter_count(settings.shape) * DTYPES[settings.dtype].itemsize * 1.3 + int4_bytes(settings.shape)
        if needed > free:
            raise GpuBenchError(
                f"--shape {settings.shape} in {settings.dtype} needs about {needed / 2**30:.1f} GiB of GPU memory "
                f"(weights, 30% for caches, and the int4 copy); {device} has {free / 2**30:.1f} of "
                f"{total / 2**30:.1f} GiB free. Try --shape llama3.2-1b"
            )
    elif device.type != "cpu":
        raise GpuBenchError(f"--device must be cuda, cuda:N or cpu, got {settings.device!r}")
    elif settings.shape != "tiny":
        _say(f"gpu-bench: a {settings.shape} target on the CPU is very slow; --tiny is the CPU smoke test", settings)
    return device


def int4_bytes(shape: str) -> int:
    """About the bytes of ``shape``'s int4 copy: half a byte per weight of its decoder layers plus a
    bf16 scale and zero per group of 128, and its embedding and output layer in bf16."""
    config = model_config(shape)[1]
    table = config.vocab_size * config.hidden_size  # the embedding; the output layer is as large (untied)
    return int((parameter_count(shape) - 2 * table) * (0.5 + 4 / INT4_GROUP_SIZE) + 2 * table * 2)


def _say(message: str, settings: GpuBenchSettings) -> None:
    if settings.progress:
        print(message, file=sys.stderr, flush=True)


def _batch_inputs(prompts: list[list[int]], device: torch.device) -> dict:
    """Left-padded ``input_ids`` and ``attention_mask`` ``[B, width]`` on ``device``."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def _units(settings: GpuBenchSettings, vocab: int, device: torch.device) -> list[Unit]:
    """A unit per prompt (batch 1), then one per larger batch size (its first B batch prompts, of
    cycled lengths: rows of a batch are left-padded to the longest)."""
    units = []
    if 1 in settings.batch_sizes:
        for index, prompt in enumerate(random_prompts(settings.prompt_lengths, vocab, settings.seed, KEY_TOKENS)):
            units.append(Unit(f"prompt {index + 1} ({len(prompt)} tokens)", [prompt], _batch_inputs([prompt], device)))
    larger = [b for b in settings.batch_sizes if b > 1]
    if larger:
        lengths = [settings.prompt_lengths[i % len(settings.prompt_lengths)] for i in range(max(larger))]
        rows = random_prompts(lengths, vocab, settings.seed + 1, KEY_TOKENS)
        for size in larger:
            units.append(Unit(f"batch {size}", rows[:size], _batch_inputs(rows[:size], device)))
    return units


def _options(max_new_tokens: int) -> dict:
    return dict(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=PAD)


def _methods(bench: Bench, settings: GpuBenchSettings, drafter_seconds: float, vocab: int) -> list[BenchMethod]:
    """The compared methods (K = ``num_draft_tokens`` for every drafter): plain generate, eager and
    with a static cache (which transformers compiles on a GPU: a GPU user's real baseline),
    transformers' assisted generation with the drafter exit (and, where the release takes one, with
    a static cache), ours with the default configuration over the exits (2 and 3 levels; compiled
    on a GPU), ours uncompiled (the dynamic runner), ours with a constant K, the paper's shape with
    the default configuration (the int4 copy over the drafter exit, and the int4 copy alone, where
    it was built), and ours over the synthetic drafter with the constant schedule (2 and 3 levels),
    whose fixed K the theory assumes. On the CPU, ours compiled explicitly too (the CPU proxy of
    the GPU path)."""
    draft, half, labels = bench.models["draft"], bench.models["half"], bench.labels
    k = settings.num_draft_tokens
    default = PolybasicConfig(num_draft_tokens=k)
    constant = PolybasicConfig(num_draft_tokens=k, schedule="constant")

    def synthetic(seed: int) -> ReferenceDrafter:
        return ReferenceDrafter(settings.acceptance, k, drafter_seconds, vocab, seed=seed, key_tokens=KEY_TOKENS)

    two, three = synthetic(settings.seed + 2), synthetic(settings.seed + 3)
    methods = [
        BenchMethod(plain(), ("target",)),
        BenchMethod(plain("plain-static", static=True), ("target",)),
        BenchMethod(hf_assisted(draft, labels["draft"], k), ("target", "draft"), assistant=draft),
    ]
    if ASSISTED_DECODING_TAKES_STATIC_CACHE:
        methods.append(BenchMethod(hf_assisted(draft, labels["draft"], k, "hf-assisted-static", static=True),
                                   ("target", "draft"), assistant=draft))
    methods += [
        BenchMethod(polybasic([draft], [labels["draft"]], default, "ours-2"), ("target", "draft")),
        BenchMethod(polybasic([draft], [labels["draft"]], replace(default, compile=False), "ours-2-eager"),
                    ("target", "draft")),
        BenchMethod(polybasic([draft], [labels["draft"]], constant, f"ours-2-k{k}"), ("target", "draft")),
        BenchMethod(polybasic([half, draft], [labels["half"], labels["draft"]], default, "ours-3"),
                    ("target", "half", "draft")),
    ]
    if "int4" in bench.models:  # the paper's shape: target <- int4 copy <- drafter, and the copy alone
        quantized = bench.models["int4"]
        methods += [
            BenchMethod(polybasic([quantized, draft], [labels["int4"], labels["draft"]], default, "ours-3-int4"),
                        ("target", "int4", "draft")),
            BenchMethod(polybasic([quantized], [labels["int4"]], default, "ours-2-int4"), ("target", "int4")),
        ]
    # --- where a trained-head row plugs in (issue 42: a random EAGLE-3 head of the target's shape, built by
    # benchmarks.synthetic): BenchMethod(polybasic([head], [label], default, "ours-2-head"), ("target", "head")),
    # with the head in bench.models and its label in bench.labels; add its name to BATCHED_METHODS for batches ---
    methods += [
        BenchMethod(polybasic([two], [repr(two)], constant, "ours-2-synthetic"), ("target", "synthetic"), two),
        BenchMethod(polybasic([half, three], [labels["half"], repr(three)], constant, "ours-3-synthetic"),
                    ("target", "half", "synthetic"), three),
    ]
    if not bench.cuda:  # ours-2 is compiled by default on a GPU only: the CPU proxy of that path
        methods.insert(methods.index(next(m for m in methods if m.method.name == "ours-2-eager")),
                       BenchMethod(polybasic([draft], [labels["draft"]], replace(default, compile=True),
                                             "ours-2-compiled"), ("target", "draft")))
    return methods


def _call(target, bm: BenchMethod, unit: Unit, max_new_tokens: int, cuda: bool) -> dict:
    """One timed ``generate`` of ``unit`` by ``bm``: seconds, memory, forwards, outputs, statistics."""
    if bm.drafter is not None:
        bm.drafter.load(prompt + reference for prompt, reference in zip(unit.prompts, unit.references))
        bm.drafter.reset()
    counter = ForwardCounter(bm.assistant) if bm.assistant is not None else None
    before = torch.cuda.memory_allocated(target.device) / 2**20 if cuda else None
    with counter or contextlib.nullcontext():
        timing = timed_call(lambda: bm.method.run(target, unit.inputs, _options(max_new_tokens)), target=target,
                            sample_rss=not cuda, count_forwards=not bm.method.polybasic)
    width = unit.inputs["input_ids"].shape[1]
    sequences = timing.output if isinstance(timing.output, torch.Tensor) else timing.output.sequences
    outputs = sequences[:, width:].tolist()
    stats = bm.method.stats(target)
    record = {
        "seconds": timing.seconds,
        "new_tokens": sum(len(row) for row in outputs),
        "target_forwards": timing.target_forwards if stats is None else stats.levels[0].forward_passes,
        "assistant_forwards": None if counter is None else counter.count,
        "cuda_before_mib": before,
        "cuda_peak_mib": timing.cuda_peak_mib,
        "rss_peak_mib": timing.rss_peak_mib,
        "outputs": outputs,
        "levels": _level_rows(stats, bm.method.level_labels),
        "stats_new_tokens": None if stats is None else stats.new_tokens,
    }
    if bm.drafter is not None:
        d = bm.drafter
        record["drafter"] = {"calls": d.calls, "proposed": d.proposed, "off_reference": d.off_reference,
                             "charged_seconds": d.charged_seconds, "spent_seconds": d.spent_seconds}
    return record


@torch.no_grad()
def _agreement(model, target_units: list[Unit]) -> float:
    """The fraction of reference tokens (plain greedy generate's) that ``model`` predicts greedily
    from the reference prefix before each (one forward per prompt)."""
    hits = total = 0
    for unit in target_units:
        prompt, reference = unit.prompts[0], unit.references[0]
        sequence = torch.tensor([prompt + reference[:-1]], device=unit.inputs["input_ids"].device)
        kwargs = {"logits_to_keep": len(reference)} if accepts_logits_to_keep(model) else {}
        logits = model(sequence, **kwargs).logits[0, -len(reference) :]
        predicted = logits.argmax(-1).tolist()
        hits += sum(p == r for p, r in zip(predicted, reference))
        total += len(reference)
    return hits / max(total, 1)


# --------------------------------------------------------------------------------- time model
def _forwards_seconds(curve, prefill: float, forwards: int, tokens: float) -> float:
    """``forwards`` forwards of a model, the first a prefill, the others scoring ``tokens`` each."""
    return prefill + max(forwards - 1, 0) * curve.seconds(tokens) if forwards else 0.0


def predicted_seconds(bm: BenchMethod, record: dict, curves: dict, prefills: dict, prompt_length: int,
                      stats=None, num_draft_tokens: int = 4) -> float | None:
    """Seconds the call's forwards alone take by the measured cost curves (batch 1): plain, N target
    forwards; transformers' assisted, its counted target (K + 1 tokens) and assistant (1 token)
    forwards; ours, Lemma 3.1 with curves (`theory.polybasic_time_with_curves`) on the call's own
    forward counts and block sizes, with each model's first forward charged as its prefill instead,
    plus the seconds the synthetic drafter took (its set cost, unless the host was slower)."""
    curve, prefill = curves["target"], prefills["target"][prompt_length]
    kind = bm.method.kind
    if kind == "plain":
        return _forwards_seconds(curve, prefill, record["target_forwards"], 1)
    if kind == "hf-assisted":
        assistant = bm.levels[1]
        return (_forwards_seconds(curve, prefill, record["target_forwards"], num_draft_tokens + 1)
                + _forwards_seconds(curves[assistant], prefills[assistant][prompt_length], record["assistant_forwards"], 1))
    if stats is None or stats.new_tokens == 0:
        return None
    try:
        inputs = theory.TimeModelInputs.from_stats(stats)
    except ValueError:  # a verifying level ran no forward (the schedule sat it out): no time model
        return None
    level_curves = [curves[name].seconds if name in curves else (lambda k: 0.0) for name in bm.levels]
    seconds = theory.polybasic_time_with_curves(stats.new_tokens, level_curves, inputs.acceptance_lengths,
                                                inputs.blocks, inputs.beta)
    for index, name in enumerate(bm.levels):
        if name in curves and stats.levels[index].forward_passes:
            scored = inputs.blocks[index] + 1 if index < len(inputs.blocks) else 1
            seconds += prefills[name][prompt_length] - curves[name].seconds(scored)
    if bm.drafter is not None:
        seconds += record["drafter"]["spent_seconds"]  # its set cost, or more if reading the sequence took longer
    return seconds


def acceptance_estimate(acceptance_lengths: list[int], num_draft_tokens: int) -> float | None:
    """The per-token acceptance rate from one level's verifications of K-token drafts (maximum
    likelihood for independent tokens: accepted / (accepted + verifications that rejected one))."""
    accepted = sum(length - 1 for length in acceptance_lengths)
    rejections = sum(1 for length in acceptance_lengths if length - 1 < num_draft_tokens)
    return accepted / (accepted + rejections) if accepted + rejections else None


# --------------------------------------------------------------------------------------- run
def run_gpu_bench(settings: GpuBenchSettings) -> dict:
    """Run the benchmark (see the module docstring); the result as plain data, also written to
    ``settings.output_dir`` (gpu_bench.json, gpu_bench.md) when given."""
    from hf_polybasic.cli.models import offline

    with offline():
        return _run(settings)


@dataclass
class Bench:
    """What the phases share: the settings, the device, the models and the clock."""

    settings: GpuBenchSettings
    device: torch.device
    budget: Budget
    models: dict = field(default_factory=dict)  # "target", "int4" (where built), "half", "draft"
    labels: dict = field(default_factory=dict)
    layers: dict = field(default_factory=dict)
    phases: dict = field(default_factory=dict)
    int4: dict = field(default_factory=dict)  # the int4 copy: group size, its own GPU memory, or why not built

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def target(self) -> torch.nn.Module:
        return self.models["target"]

    def phase_done(self, name: str, started: float) -> None:
        self.phases[name] = round(time.perf_counter() - started, 2)
        _say(f"gpu-bench: {name} done in {self.phases[name]:.1f} s ({self.budget.elapsed():.0f} s so far)",
             self.settings)


def _run(settings: GpuBenchSettings) -> dict:
    bench = Bench(settings, check_device(settings), Budget(settings.time_budget_s))
    if not bench.cuda and settings.shape == "tiny":
        # tiny models gain nothing from intra-op threads, and on a small shared CPU their spin-waits
        # make every forward many times slower
        torch.set_num_threads(1)

    started = time.perf_counter()
    construction = _build(bench)
    weights_mib = bench.int4.pop("target_mib")
    bench.phase_done("build", started)

    started = time.perf_counter()
    units = _units(settings, construction.vocab_size, bench.device)
    curves, prefills = _costs(bench, sorted({len(u.prompts[0]) for u in units if u.batch == 1}))
    drafter_seconds = settings.drafter_cost * curves["target"].seconds(1)
    methods = _methods(bench, settings, drafter_seconds, construction.vocab_size)
    bench.phase_done("costs", started)

    started = time.perf_counter()
    reference_seconds = _references(bench, units)
    bench.phase_done("references", started)
    per_repeat = sum(reference_seconds[unit.name] * len(_for_batch(methods, unit.batch)) for unit in units)
    _say(f"gpu-bench: a timed repeat should take about {per_repeat:.0f} s if every method took what plain generate "
         f"did; {settings.repeats} asked, {max(settings.time_budget_s - bench.budget.elapsed(), 0):.0f} s of budget left",
         settings)

    started = time.perf_counter()
    single = [unit for unit in units if unit.batch == 1]
    agreement = {name: _agreement(model, single) for name, model in bench.models.items()} if single else {}
    bench.phase_done("agreement", started)

    started = time.perf_counter()
    _warm_up(bench, methods, units)
    bench.phase_done("warm-up", started)

    started = time.perf_counter()
    profiled = _profile(bench, _for_batch(methods, 1), single[0]) if single else {}
    bench.phase_done("profile", started)

    started = time.perf_counter()
    runs, repeats_run, cut = _timed(bench, methods, units, curves, prefills)
    bench.phase_done("timed", started)

    started = time.perf_counter()
    mismatches = _mismatches(bench, runs, units)
    bench.phase_done("mismatch check", started)

    device = bench.device
    result = {
        "command": command_line(),
        "settings": asdict(settings),
        "machine": {**machine_info(), "device": str(device),
                    "gpu": torch.cuda.get_device_name(device) if bench.cuda else None,
                    "gpu_memory_gib": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
                    if bench.cuda else None,
                    "cuda": torch.version.cuda},
        "model": {"shape": settings.shape, "dtype": settings.dtype,
                  "parameters": sum(p.numel() for p in bench.target.parameters()),
                  "weights_mib": weights_mib, "construction": construction.to_dict(),
                  "draft_layers": bench.layers["draft"], "half_layers": bench.layers["half"], "int4": bench.int4},
        "levels": _levels_summary(bench, curves, prefills, agreement, construction),
        "synthetic_drafter": {"acceptance": settings.acceptance, "num_tokens": settings.num_draft_tokens,
                              "seconds_per_token": drafter_seconds, "cost_in_target_steps": settings.drafter_cost},
        "methods": [{"name": bm.method.name, "kind": bm.method.kind, "description": bm.method.description,
                     "levels": list(bm.levels)} for bm in methods],
        "units": [{"name": u.name, "prompt_tokens": [len(p) for p in u.prompts]} for u in units],
        "reference_seconds": reference_seconds,
        "cost_runner": cost_runner(bench),
        "profile": profiled,
        "repeats_run": repeats_run,
        "cut": cut,
        "runs": runs,
        "mismatches": mismatches,
        "phases_s": bench.phases,
        "process_peak_rss_mib": process_peak_rss_mib(),
    }
    result["summary"] = summarise(result, methods, settings)
    result["total_s"] = round(bench.budget.elapsed(), 1)
    if settings.output_dir:
        out = Path(settings.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_bench.json").write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
        (out / "gpu_bench.md").write_text(markdown(result) + "\n", encoding="utf-8")
    return result


def _build(bench: Bench):
    """The structured target on the device, its int4 copy (weights of its own) where the device's
    int4 kernel takes the shape, and its two early exits (sharing its weights): the drafter (1/16 of
    its layers, at least one) and the middle level (half of them)."""
    settings = bench.settings
    layers = model_config(settings.shape)[1].num_hidden_layers
    bench.layers = {"target": layers, "int4": layers, "half": layers // 2, "draft": max(1, layers // 16)}
    target, construction = build_target(settings.shape, bench.device, DTYPES[settings.dtype], bench.layers["draft"],
                                        settings.draft_agreement, settings.seed)
    synchronize((bench.device,) if bench.cuda else ())
    allocated = (lambda: torch.cuda.memory_allocated(bench.device) / 2**20) if bench.cuda else (lambda: None)
    bench.int4 = {"target_mib": allocated(), "group_size": INT4_GROUP_SIZE}
    bench.models = {"target": target}
    bench.labels = {"target": f"{settings.shape} target", "int4": f"int4 copy (groups of {INT4_GROUP_SIZE})",
                    "half": f"exit-{bench.layers['half']}", "draft": f"exit-{bench.layers['draft']}"}
    quantized, why_not = _int4_copy(target)
    if quantized is None:
        bench.int4["not_built"] = why_not
        _say(f"gpu-bench: no int4 level: {why_not}", settings)
    else:
        bench.models["int4"] = quantized
        synchronize((bench.device,) if bench.cuda else ())
        bench.int4["mib"] = None if not bench.cuda else allocated() - bench.int4["target_mib"]
    bench.models.update(half=early_exit(target, bench.layers["half"]), draft=early_exit(target, bench.layers["draft"]))
    return construction


def _int4_copy(target: torch.nn.Module) -> tuple[torch.nn.Module | None, str | None]:
    """(the target's int4 copy, None), or (None, why not): a shape or device the int4 kernels
    cannot take. On the CPU the copy's warning that its kernels are slow over many tokens is left
    out (the report measures it)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"quantized_copy\(method='int4'\) on the CPU")
            return quantized_copy(target, "int4"), None
    except ValueError as error:
        return None, str(error)


def _costs(bench: Bench, prompt_lengths: list[int]) -> tuple[dict, dict]:
    """T(k) of every model level, through the runner ours' default uses on this device (compiled on a
    GPU: `cost_runner`), and its prefill of every prompt length (seconds)."""
    curves = {name: measure_curve(model, tokens=bench.settings.cost_tokens, repeats=3, runner=cost_runner(bench))
              for name, model in bench.models.items()}
    first = torch.tensor([3], device=bench.device)
    prefills = {name: {n: forward_cost(model, first, n - 1, repeats=2) for n in prompt_lengths}
                for name, model in bench.models.items()}
    return curves, prefills


def cost_runner(bench: Bench) -> str:
    """The runner ours' default configuration decodes with here (`PolybasicConfig.compiles`)."""
    return "compiled" if PolybasicConfig().compiles(bench.device) else "dynamic"


def _profile(bench: Bench, methods: list[BenchMethod], unit: Unit) -> dict:
    """One call of every method on ``unit`` under ``torch.profiler`` (GPU only): the call's host time
    (wall), the GPU's busy time (its kernels' own time), kernel and graph launches, and the host's
    waits for the GPU (synchronizations). A call costs the larger of host and GPU time only when the
    host never waits; their sum when it waits at every forward."""
    if not bench.cuda:
        return {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    found = {}
    for bm in methods:
        try:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
                started = time.perf_counter()
                _call(bench.target, bm, unit, bench.settings.max_new_tokens, bench.cuda)
                host = time.perf_counter() - started
            events = profiler.key_averages()
            gpu = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e6
            launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                  "cudaLaunchKernelExC", "cudaGraphLaunch"))
            waits = sum(e.count for e in events if e.key in ("cudaDeviceSynchronize", "cudaStreamSynchronize",
                                                              "cudaEventSynchronize"))
            found[bm.method.name] = {"host_s": host, "gpu_s": gpu, "launches": launches, "synchronizations": waits}
        except Exception as error:  # noqa: BLE001 - a profiler problem is reported, not fatal
            found[bm.method.name] = {"error": f"{type(error).__name__}: {error}"}
    return found


def _references(bench: Bench, units: list[Unit]) -> dict:
    """Plain greedy generate of every unit (untimed for the comparison): each unit's references."""
    seconds = {}
    for unit in units:
        timing = timed_call(lambda: bench.target.generate(**unit.inputs, **_options(bench.settings.max_new_tokens)),
                            target=bench.target, sample_rss=False)
        unit.references = timing.output[:, unit.inputs["input_ids"].shape[1] :].tolist()
        seconds[unit.name] = timing.seconds
    return seconds


def _warm_up(bench: Bench, methods: list[BenchMethod], units: list[Unit]) -> None:
    """One call of every method on the first unit of every batch size, of the whole budget: a
    compiled method meets the widths its timed calls will (each compiled once, here), and the
    cost-aware schedule its first measurements."""
    sizes = set()
    for unit in units:
        if unit.batch not in sizes:
            sizes.add(unit.batch)
            for bm in _for_batch(methods, unit.batch):
                _call(bench.target, bm, unit, bench.settings.max_new_tokens, bench.cuda)


def _timed(bench: Bench, methods: list[BenchMethod], units: list[Unit], curves: dict, prefills: dict):
    """The timed calls: (records, repeats started, why the run was cut short or None)."""
    from tqdm.auto import tqdm

    settings, budget = bench.settings, bench.budget
    runs: list[dict] = []
    repeat_seconds, repeats_run, cut = 0.0, 0, None
    total = settings.repeats * sum(len(_for_batch(methods, unit.batch)) for unit in units)
    bar = tqdm(total=total, desc="gpu-bench", unit="call", file=sys.stderr, disable=not settings.progress)
    for repeat in range(settings.repeats):
        if repeat > 0 and not budget.allows(repeat_seconds):
            cut = (f"stopped after {repeat} of {settings.repeats} repeats: another would end past the "
                   f"{settings.time_budget_s:.0f} s budget ({budget.elapsed():.0f} s elapsed, a repeat took "
                   f"{repeat_seconds:.0f} s)")
            break
        began, repeats_run = time.perf_counter(), repeat + 1
        for unit in units:
            chosen = _for_batch(methods, unit.batch)
            shift = repeat % len(chosen)
            for bm in chosen[shift:] + chosen[:shift]:  # rotated: no method always runs first
                if not budget.allows(0.0):
                    cut = (f"stopped during repeat {repeat + 1} of {settings.repeats}: the "
                           f"{settings.time_budget_s:.0f} s budget ran out (the inputs it did not reach have one "
                           "repeat fewer)")
                    break
                record = _call(bench.target, bm, unit, settings.max_new_tokens, bench.cuda)
                record.update(method=bm.method.name, unit=unit.name, batch=unit.batch, repeat=repeat,
                              prompt_tokens=[len(p) for p in unit.prompts])
                record["identical_rows"] = sum(a == b for a, b in zip(record["outputs"], unit.references))
                if unit.batch == 1:
                    record["predicted_seconds"] = predicted_seconds(
                        bm, record, curves, prefills, len(unit.prompts[0]), bm.method.stats(bench.target),
                        settings.num_draft_tokens)
                runs.append(record)
                bar.update(1)
            if cut:
                break
        if cut:
            break
        repeat_seconds = time.perf_counter() - began
    bar.close()
    if cut:
        _say(f"gpu-bench: {cut}", settings)
    return runs, repeats_run, cut


def _mismatches(bench: Bench, runs: list[dict], units: list[Unit]) -> list[dict]:
    """Where each method's output first left plain generate's, per input (its first differing row):
    the target's logits of both tokens there, a near-tie or not (`greedy_difference`)."""
    by_name = {unit.name: unit for unit in units}
    found, seen = [], set()
    for record in runs:
        if record["identical_rows"] == record["batch"] or (record["method"], record["unit"]) in seen:
            continue
        seen.add((record["method"], record["unit"]))
        unit = by_name[record["unit"]]
        for row, (output, reference) in enumerate(zip(record["outputs"], unit.references)):
            if output != reference:
                prompt = torch.tensor(unit.prompts[row], device=bench.device)
                detail = greedy_difference(bench.target, prompt, output, reference)
                found.append({"method": record["method"], "unit": record["unit"], "row": row, **detail})
                _say(f"gpu-bench: GREEDY MISMATCH {record['method']} {record['unit']} row {row}: "
                     f"{describe_difference(detail)}", bench.settings)
                break
    return found


def _for_batch(methods: list[BenchMethod], batch: int) -> list[BenchMethod]:
    """The methods that run on a batch of ``batch`` rows (transformers' assisted generation takes one)."""
    return methods if batch == 1 else [bm for bm in methods if bm.method.name in BATCHED_METHODS]


def _levels_summary(bench: Bench, curves: dict, prefills: dict, agreement: dict, construction) -> list[dict]:
    target_step, layers, labels = curves["target"].seconds(1), bench.layers, bench.labels
    rows = []
    for name in bench.models:
        curve = curves[name]
        rows.append({
            "level": name, "label": labels[name], "layers": layers[name],
            "set_agreement": 1.0 if name == "target" else None if name == "int4"  # set by construction: exits only
            else construction.exit_agreement(layers[name]),
            "measured_agreement": agreement.get(name),
            "t1_ms": curve.seconds(1) * 1e3,
            "cost_vs_target": curve.seconds(1) / target_step,
            "points_ms": {k: v * 1e3 for k, v in curve.points.items()},
            "ratios": {k: curve.ratio(k) for k in curve.points},
            "prefill_ms": {n: v * 1e3 for n, v in prefills[name].items()},
        })
    return rows


# ------------------------------------------------------------------------------------ summary
def summarise(result: dict, methods: list[BenchMethod], settings: GpuBenchSettings) -> dict:
    """Per batch size and method: tokens/s (mean over the batch-1 prompts of each one's median),
    speedup over plain generate, identical rows, mean acceptance length of the target, the time
    model's efficiency, peak GPU memory; and the synthetic chains read against the theory."""
    runs = result["runs"]
    sizes = sorted({r["batch"] for r in runs})
    table = {}
    for size in sizes:
        rows = {}
        for bm in _for_batch(methods, size):
            mine = [r for r in runs if r["batch"] == size and r["method"] == bm.method.name]
            if not mine:
                continue
            units = sorted({r["unit"] for r in mine})
            speeds = [statistics.median(r["new_tokens"] / r["seconds"] for r in mine if r["unit"] == u) for u in units]
            efficiencies = [r["predicted_seconds"] / r["seconds"] for r in mine if r.get("predicted_seconds")]
            lengths = [length for r in mine if r["levels"] for length in r["levels"][0]["acceptance_lengths"]]
            peaks = [r["cuda_peak_mib"] for r in mine if r["cuda_peak_mib"] is not None]
            over = [r["cuda_peak_mib"] - r["cuda_before_mib"] for r in mine if r["cuda_peak_mib"] is not None]
            rss = [r["rss_peak_mib"] for r in mine if r["rss_peak_mib"] is not None]
            rows[bm.method.name] = {
                "tokens_per_second": statistics.fmean(speeds),
                "per_unit_tokens_per_second": dict(zip(units, speeds)),
                "identical_rows": sum(r["identical_rows"] for r in mine),
                "rows": sum(r["batch"] for r in mine),
                "target_acceptance_length": statistics.fmean(lengths) if lengths else None,
                "efficiency": statistics.median(efficiencies) if efficiencies else None,
                "cuda_peak_mib": max(peaks) if peaks else None,
                "cuda_over_weights_mib": max(over) if over else None,
                "rss_peak_mib": max(rss) if rss else None,
            }
        for baseline in BASELINES:
            base = rows.get(baseline, {}).get("per_unit_tokens_per_second")
            for name, row in rows.items():
                mine = row["per_unit_tokens_per_second"]
                key = "speedup" if baseline == "plain" else f"speedup_over_{baseline.replace('-', '_')}"
                row[key] = speedup([mine[u] for u in sorted(mine)], [base[u] for u in sorted(mine)]) \
                    if base and set(mine) <= set(base) else None
        table[size] = rows
    return {"by_batch": table, "theory": _theory(result, methods, settings, table.get(1, {}))}


def _theory(result: dict, methods: list[BenchMethod], settings: GpuBenchSettings, batch_one: dict) -> list[dict]:
    """The synthetic chains: the set acceptance and cost against what was measured, and for the
    2-level one Leviathan et al.'s expected tokens per verification and the speedup it implies
    with the measured T(k) of the target (`theory.polybasic_speedup_with_curves`)."""
    k, a = settings.num_draft_tokens, settings.acceptance
    target_points = {int(p): v / 1e3 for p, v in result["levels"][0]["points_ms"].items()}
    drafter_seconds = result["synthetic_drafter"]["seconds_per_token"]
    rows = []
    for bm in methods:
        if bm.drafter is None:
            continue
        mine = [r for r in result["runs"] if r["method"] == bm.method.name and r["batch"] == 1]
        if not mine:
            continue
        verifier = len(bm.levels) - 2  # the level that verifies the drafter
        lengths = [length for r in mine for length in r["levels"][verifier]["acceptance_lengths"]]
        target_lengths = [length for r in mine for length in r["levels"][0]["acceptance_lengths"]]
        charged = sum(r["drafter"]["charged_seconds"] for r in mine)
        spent = sum(r["drafter"]["spent_seconds"] for r in mine)
        row = {
            "method": bm.method.name,
            "set_acceptance": a,
            "measured_acceptance": acceptance_estimate(lengths, k),
            "verifier": bm.levels[verifier],
            "off_reference_calls": sum(r["drafter"]["off_reference"] for r in mine),
            "drafter_spent_over_charged": spent / charged if charged else None,
            "measured_target_acceptance_length": statistics.fmean(target_lengths) if target_lengths else None,
            "measured_speedup": batch_one.get(bm.method.name, {}).get("speedup"),
            "efficiency": batch_one.get(bm.method.name, {}).get("efficiency"),
        }
        if len(bm.levels) == 2:
            expected = float(theory.expected_tokens_per_verification(a, k))
            row["expected_target_acceptance_length"] = expected
            call = max(k * drafter_seconds, 1e-12)  # one propose call: K tokens at the set cost
            row["predicted_speedup"] = float(theory.polybasic_speedup_with_curves(
                [target_points, call], [expected], [k], 1.0))
            row["leviathan_speedup"] = float(theory.improvement_factor(a, k, call / k / target_points[1]))
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------- markdown
def _f(value, spec: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _count(parameters: int) -> str:
    return f"{parameters / 1e9:.2f}B" if parameters >= 1e9 else f"{parameters / 1e6:.1f}M"


def markdown(result: dict) -> str:
    """The report as markdown: setup, levels and their T(k), batch 1, batches, theory, notes."""
    s, m, model = result["settings"], result["machine"], result["model"]
    device = f"{m['gpu']} ({m['gpu_memory_gib']} GiB), CUDA {m['cuda']}" if m.get("gpu") else f"CPU: {m.get('cpu')}"
    lines = [
        f"# python -m benchmarks gpu-bench: {model['shape']} ({_count(model['parameters'])} parameters, {model['dtype']}, "
        "random weights, structured)",
        "",
        f"Device: {device}; torch {m.get('torch')}, transformers {m.get('transformers')}, hf_polybasic "
        f"{m.get('hf_polybasic')} ({str(m.get('git_commit', ''))[:10]}{', dirty' if m.get('git_dirty') else ''})",
        f"Command: `{result['command']}`",
        f"Greedy, {s['max_new_tokens']} new tokens per row (EOS off), prompts of {', '.join(map(str, s['prompt_lengths']))} "
        f"random tokens; medians of {result['repeats_run']} interleaved repeats (of {s['repeats']} asked); K = "
        f"{s['num_draft_tokens']}. Total {result['total_s']:.0f} s: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in result["phases_s"].items()),
    ]
    if result["cut"]:
        lines.append(f"**Cut short**: {result['cut']}.")
    if model["weights_mib"] is not None:
        lines.append(f"GPU memory of the weights: {model['weights_mib'] / 1024:.1f} GiB (the exits share them)"
                     + (f"; the int4 copy's own: {model['int4']['mib'] / 1024:.1f} GiB." if model["int4"].get("mib")
                        is not None else "."))
    if model["int4"].get("not_built"):
        lines.append(f"No int4 level: {model['int4']['not_built']}")
    lines += ["", f"## Levels: agreement with the target and T(k) (measured through the {result.get('cost_runner', 'dynamic')} "
              "runner)", ""]
    points = list(result["levels"][0]["ratios"])
    lines.append("| level | layers | greedy agreement: set / measured | T(1) ms | cost / target's | "
                 + " | ".join(f"T({k})/T(1)" for k in points) + " |")
    lines.append("|---|---|---|---|---|" + "---|" * len(points))
    for row in result["levels"]:
        lines.append(
            f"| {row['label']} | {row['layers']} | {_f(row['set_agreement'])} / {_f(row['measured_agreement'])} | "
            f"{row['t1_ms']:.2f} | {row['cost_vs_target']:.3f} | "
            + " | ".join(f"{row['ratios'][k]:.2f}" for k in points) + " |"
        )
    d = result["synthetic_drafter"]
    lines.append(f"| synthetic drafter | - | acceptance {d['acceptance']} (set) | {d['seconds_per_token'] * 1e3:.3f} per "
                 f"token (set) | {d['cost_in_target_steps']} | - " + "| - " * (len(points) - 1) + "|")
    descriptions = {entry["name"]: entry["description"] for entry in result["methods"]}
    for size, rows in result["summary"]["by_batch"].items():
        lines += ["", f"## Batch {size}" + (" (one prompt at a time; speedup: mean tokens/s over the prompts)" if int(size) == 1
                                           else " (transformers' assisted generation takes one row: ours against plain "
                                                "batched generate)"), ""]
        lines.append("| method | tokens/s | speedup over plain | over plain static | rows identical to plain | "
                     "target L (tau) | efficiency (forwards-only time / measured) | peak GPU memory GiB (over the "
                     "weights) |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for name, row in rows.items():
            memory = "-" if row["cuda_peak_mib"] is None else \
                f"{row['cuda_peak_mib'] / 1024:.2f} (+{row['cuda_over_weights_mib'] / 1024:.2f})"
            lines.append(
                f"| {name} | {row['tokens_per_second']:.1f} | **{_f(row['speedup'])}x** | "
                f"{_f(row.get('speedup_over_plain_static'))}x | "
                f"{row['identical_rows']}/{row['rows']} | {_f(row['target_acceptance_length'])} | "
                f"{_f(row['efficiency'])} | {memory} |"
            )
    if result.get("profile"):
        lines += ["", "## Host and GPU time of one call (batch 1, first prompt, under torch.profiler)", "",
                  "| method | host s | GPU busy s | host / GPU | kernel and graph launches | host waits for the GPU |",
                  "|---|---|---|---|---|---|"]
        for name, row in result["profile"].items():
            if "error" in row:
                lines.append(f"| {name} | {row['error']} | | | | |")
                continue
            ratio = row["host_s"] / row["gpu_s"] if row["gpu_s"] else None
            lines.append(f"| {name} | {row['host_s']:.3f} | {row['gpu_s']:.3f} | {_f(ratio)} | {row['launches']} | "
                         f"{row['synchronizations']} |")
    theory_rows = result["summary"]["theory"]
    if theory_rows:
        lines += ["", "## The synthetic drafter against the theory (batch 1)", "",
                  "| method | acceptance set / measured (at its verifier) | target L: expected / measured | "
                  "speedup: predicted (Lemma 3.1, measured T(k)) / Leviathan (T(k) = T(1)) / measured | efficiency | "
                  "off-reference calls |",
                  "|---|---|---|---|---|---|"]
        for row in theory_rows:
            lines.append(
                f"| {row['method']} | {row['set_acceptance']} / {_f(row['measured_acceptance'], '.3f')} ({row['verifier']}) | "
                f"{_f(row.get('expected_target_acceptance_length'))} / {_f(row['measured_target_acceptance_length'])} | "
                f"{_f(row.get('predicted_speedup'))} / {_f(row.get('leviathan_speedup'))} / {_f(row['measured_speedup'])} | "
                f"{_f(row['efficiency'])} | {row['off_reference_calls']} |"
            )
    lines += ["", "Methods:"] + [f"- `{name}`: {text}" for name, text in descriptions.items()]
    if not result["runs"]:
        lines += ["", "No timed call ran within the time budget: nothing was compared."]
    elif result["mismatches"]:
        lines += ["", "Greedy outputs that differ from plain generate's (first differing row per method and input):"]
        lines += [f"- {x['method']}, {x['unit']}, row {x['row']}: {describe_difference(x)}" for x in result["mismatches"]]
    else:
        lines += ["", "Every output is identical to plain generate's."]
    return "\n".join(lines)


def settings_from_args(args) -> GpuBenchSettings:
    """`GpuBenchSettings` from the command line: ``--tiny`` first, then every option given."""
    base = GpuBenchSettings(**TINY) if args.tiny else GpuBenchSettings()
    given = {
        "device": args.device, "shape": args.shape, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats, "num_draft_tokens": args.draft_tokens, "draft_agreement": args.draft_agreement,
        "acceptance": args.acceptance, "drafter_cost": args.drafter_cost, "time_budget_s": args.time_budget,
        "seed": args.seed, "output_dir": args.output,
    }
    if args.prompt_lengths:
        given["prompt_lengths"] = tuple(int(x) for x in args.prompt_lengths.split(","))
    if args.batch_sizes:
        given["batch_sizes"] = tuple(int(x) for x in args.batch_sizes.split(","))
    settings = replace(base, **{k: v for k, v in given.items() if v is not None}, progress=not args.no_progress)
    if args.dtype is None and settings.device == "cpu" and settings.shape == "tiny":
        settings = replace(settings, dtype="fp32")  # tiny on the CPU: bit-for-bit comparable outputs
    return settings


def add_gpu_bench_parser(commands) -> None:
    parser = commands.add_parser(
        "gpu-bench", help="the engine on a GPU against plain generate and transformers' assisted generation, on "
        "models built in code (no network): T(k), batch 1/4/8, memory, the theory")
    parser.add_argument("--device", default=None, help="cuda (default), cuda:N or cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny models, short runs: a smoke test (seconds on a CPU)")
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES), help="the target's shape (default llama3-8b)")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default bf16 (fp32 with --tiny on cpu)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="per row (default 96; --tiny 16)")
    parser.add_argument("--prompt-lengths", default=None, help="comma-separated (default 32,128,512)")
    parser.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,4,8)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats, medians reported (default 3)")
    parser.add_argument("--draft-tokens", type=int, default=None, help="K (default 4)")
    parser.add_argument("--draft-agreement", type=float, default=None,
                        help="the drafter exit's greedy agreement with the target, by construction (default 0.8)")
    parser.add_argument("--acceptance", type=float, default=None, help="the synthetic drafter's (default 0.8)")
    parser.add_argument("--drafter-cost", type=float, default=None,
                        help="the synthetic drafter's seconds per token, in target forwards T(1) (default 0.05)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds from the start; repeats stop when the next would end later (default 480)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--output", default=None, help="directory for gpu_bench.json and gpu_bench.md")
    parser.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    parser.set_defaults(handler=_handle)


def _handle(args) -> int:
    try:
        result = run_gpu_bench(settings_from_args(args))
    except GpuBenchError as error:
        print(f"python -m benchmarks gpu-bench: {error}", file=sys.stderr)
        return 2
    print(markdown(result))
    return 0
