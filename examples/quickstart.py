"""A first polybasic `generate` call: a target and two assistants, checked against plain `generate`.

Runs in a few seconds on tiny random models from `hf_polybasic.testing` (no download), so the text
is random; what the example shows is that the chain reproduces the target exactly and how few
target forward passes it needs. Real pretrained models are not wired into the examples yet (a
`--real` flag will come with them).

    python examples/quickstart.py
"""

import torch
from hf_polybasic.testing import make_chain, make_tokenizer

import hf_polybasic as hp


def main() -> None:
    target, mid, draft = make_chain("llama", depth=3)  # M1 > M2 > M3, noisier down the chain
    tokenizer = make_tokenizer()
    inputs = tokenizer("hello!world", return_tensors="pt")
    prompt_length = inputs.input_ids.shape[1]
    options = dict(do_sample=False, max_new_tokens=40)

    plain = target.generate(**inputs, **options)
    print("plain greedy generate:   ", repr(tokenizer.decode(plain[0, prompt_length:])))

    # Two models (dualistic), then three (polybasic); K = 4 drafted tokens, mu = 8 verified tokens
    config = hp.PolybasicConfig(num_draft_tokens=4, block_threshold=8)
    for assistants in ([draft], [mid, draft]):
        out = target.generate(
            **inputs,
            custom_generate=hp.generate,
            assistant_models=assistants,
            polybasic_config=config,
            return_dict_in_generate=True,
            **options,
        )
        assert torch.equal(out.sequences, plain), "the chain must reproduce plain greedy generate"
        stats = out.polybasic_stats
        print(f"\n{len(assistants) + 1} models: identical to plain greedy generate")
        print(stats)
        target_level = stats.levels[0]
        print(
            f"target forward passes: {target_level.forward_passes} for {stats.new_tokens} tokens "
            f"(L_1 = {target_level.mean_acceptance_length:.2f} tokens per target forward pass)"
        )

    # Sampling: the output follows the target's distribution (not the same draw as plain generate)
    torch.manual_seed(0)
    sampled = target.generate(
        **inputs,
        custom_generate=hp.generate,
        assistant_models=[mid, draft],
        do_sample=True,
        temperature=0.8,
        max_new_tokens=20,
    )
    print("\nsampled:", repr(tokenizer.decode(sampled[0, prompt_length:], skip_special_tokens=True)))
    print(hp.last_stats(target))


if __name__ == "__main__":
    main()
