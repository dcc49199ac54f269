"""The package's own tools, apart from the library: the ``hf-polybasic`` command line, the demo,
installing real models from PyPI, the Spec-Bench-style benchmark and the planner's validation.

The library (`hf_polybasic`) never imports from here. Shared pieces:

* `model_sets`: the tiny and Qwen model sets and the one table of their labels;
* `harness`: the one way a ``generate`` call is timed (wall time, forward passes, memory);
* `assisted`: transformers' own assisted generation, with the assistant's settings restored.
"""
