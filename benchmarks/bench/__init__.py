"""A Spec-Bench-style benchmark: plain `generate`, transformers' assisted modes and polybasic chains
on the same prompts with the same budget.

* `prompts`: the questions (a Spec-Bench JSONL file, or the shipped default set) and task groups;
* `methods`: the compared methods, as small named factories (the model sets are `hf_polybasic.cli.model_sets`);
* `settings`: what a run is; `calls`: one timed call; `records`: the results cache;
* `runner`: the timed, cached, resumable run;
* `report`: aggregation (Spec-Bench's speedup formula), the markdown table and the plots;
* `cli`: ``python -m benchmarks bench`` (`add_bench_parser`).

From Python::

    from benchmarks.bench import BenchSettings, run_benchmark
    result = run_benchmark(BenchSettings(models="tiny", questions_per_group=1, max_new_tokens=16,
                                         output_dir="/tmp/bench"))
    print(result.summary["table"]["overall"]["ours-draft"]["speedup"])
"""

from hf_polybasic.cli.model_sets import ModelSet

from .methods import DEFAULT_METHODS, RECIPES, Method, MethodOptions
from .methods import hf_assisted, hf_prompt_lookup, plain, polybasic
from .report import speedup
from .runner import rebuild_report, run_benchmark
from .settings import BenchResult, BenchSettings

__all__ = [
    "DEFAULT_METHODS",
    "RECIPES",
    "BenchResult",
    "BenchSettings",
    "Method",
    "MethodOptions",
    "ModelSet",
    "hf_assisted",
    "hf_prompt_lookup",
    "plain",
    "polybasic",
    "rebuild_report",
    "run_benchmark",
    "speedup",
]
