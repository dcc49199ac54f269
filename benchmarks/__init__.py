"""The benchmarks of hf_polybasic: tooling that measures the package, kept in the repository and
out of the installed package (``pyproject.toml`` installs only ``hf_polybasic*``).

Run them from the repository root: ``python -m benchmarks <command> [options]``. The commands are in `benchmarks.cli`; ``python -m benchmarks.bench``
runs the Spec-Bench-style benchmark on its own.

They reach the package only through absolute imports (``from hf_polybasic... import``): its public
API, and the pieces the command line shares with them (`hf_polybasic.cli.model_sets`, `harness`,
`machine`, `assisted`, `loading`, `models`, `prompts`). The package never imports from here.

* `bench`: the Spec-Bench-style benchmark (``bench``);
* `gpu_bench`: the engine on a GPU against plain and assisted generate (``gpu-bench``), on models
  built in code by `synthetic`;
* `batch_bench` (``batches``), `levels_table` (``levels``), `vocab_coverage` (``vocab-coverage``),
  `rollback_cost` (``rollback-cost``).
"""
