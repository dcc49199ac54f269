"""The ``hf-polybasic`` command line and what its commands need, apart from the library.

One module per command: `demo` and `real_demo` (``hf-polybasic demo``), `models` (installing real
models from PyPI: ``hf-polybasic models``), `costs_table` (``hf-polybasic costs``) and `plan`
(``hf-polybasic plan``, its validation in `plan_validation` and `plan_report`); the entry point is
`main`. The library (`hf_polybasic`) never imports from here. Shared pieces, which the benchmarks
(``benchmarks/`` in a checkout of the repository, not installed) use too:

* `loading`: the one loader of the real models (`loading.load`), `pages` the memory it gives back;
* `model_sets`: the tiny and Qwen model sets and the one table of their labels;
* `prompts`: the default prompt set and how a prompt is encoded for a model set;
* `harness`: the one way a ``generate`` call is timed (wall time, forward passes, memory);
* `assisted`: transformers' own assisted generation, with the assistant's settings restored;
* `machine`: the machine and command line recorded with results.

The benchmark commands (``bench``, ``gpu-bench``, ``batches``, ``levels``, ``vocab-coverage``,
``rollback-cost``) live in ``benchmarks/``; `main` registers them when that folder can be
imported, i.e. when the package runs from a checkout.
"""
