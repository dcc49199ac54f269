"""Streaming with a chain: print text as it comes, iterate over it from another thread, see the bursts.

Runs in a few seconds on tiny random models from `hf_polybasic.testing` (no download). With a
chain, tokens arrive in bursts: all tokens of one target verification at once. Real pretrained
models are not wired into the examples yet (a `--real` flag will come with them).

    python examples/streaming.py
"""

from threading import Thread

import torch
from hf_polybasic.testing import make_chain, make_tokenizer
from transformers import TextIteratorStreamer, TextStreamer
from transformers.generation.streamers import BaseStreamer

import hf_polybasic as hp


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


def main() -> None:
    target, mid, draft = make_chain("llama", depth=3)
    tokenizer = make_tokenizer()
    inputs = tokenizer("hello", return_tensors="pt")
    prompt_length = inputs.input_ids.shape[1]
    options = dict(custom_generate=hp.generate, assistant_models=[mid, draft], do_sample=False, max_new_tokens=30)

    # 1. Print to stdout while generating
    print("TextStreamer:          ", end="", flush=True)
    out = target.generate(**inputs, streamer=TextStreamer(tokenizer, skip_prompt=True), **options)
    expected = tokenizer.decode(out[0, prompt_length:])
    assert torch.equal(out, target.generate(**inputs, do_sample=False, max_new_tokens=30))

    # 2. Iterate over the text in this thread while generate runs in another one
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    thread = Thread(target=target.generate, kwargs=dict(**inputs, streamer=streamer, **options))
    thread.start()
    text = "".join(streamer)  # the loop ends because generate calls streamer.end()
    thread.join()
    assert text.strip() == expected.strip()
    print(f"TextIteratorStreamer:   {text}")

    # 3. The bursts: one per target forward pass, accepted tokens + the target's own token
    print("bursts:                 ", end="")
    bursts = BurstPrinter(tokenizer)
    target.generate(**inputs, streamer=bursts, **options)
    stats = hp.last_stats(target)
    assert bursts.lengths == stats.levels[0].acceptance_lengths
    print(f"{stats.new_tokens} tokens in {len(bursts.lengths)} bursts of {bursts.lengths} tokens")


if __name__ == "__main__":
    main()
