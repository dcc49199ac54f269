"""A chain inside a `text-generation` pipeline, batched, compared with the plain pipeline.

Runs in a few seconds on tiny random models from `hf_polybasic.testing` (no download), so the text
is random; what matters is that every output equals the plain pipeline's. Real pretrained models
are not wired into the examples yet (a `--real` flag will come with them).

    python examples/pipeline.py
"""

from hf_polybasic.testing import make_chain, make_tokenizer
from transformers import pipeline

import hf_polybasic as hp


def main() -> None:
    target, mid, draft = make_chain("llama", depth=3)
    pipe = pipeline("text-generation", model=target, tokenizer=make_tokenizer())
    prompts = ["hello", "ab", "world!", "xyz"]
    options = dict(do_sample=False, max_new_tokens=16, return_full_text=False)

    plain = [pipe(text, **options)[0]["generated_text"] for text in prompts]

    hp.enable(target)  # now generate (and so the pipeline) accepts assistant_models=
    try:
        results = pipe(
            prompts,
            batch_size=2,  # padded on the left by the pipeline; rows are decoded one by one
            assistant_models=[mid, draft],
            polybasic_config=hp.PolybasicConfig(num_draft_tokens=4, block_threshold=8),
            **options,
        )
        stats = hp.last_stats(target)  # the last batch of two prompts
    finally:
        hp.disable(target)

    for text, result, expected in zip(prompts, results, plain):
        generated = result[0]["generated_text"]
        assert generated == expected, (text, generated, expected)
        print(f"{text!r:>10} -> {generated!r}")
    print("\nevery output equals the plain pipeline's")
    print("statistics of the last batch:")
    print(stats)


if __name__ == "__main__":
    main()
