"""Many calls, interrupted calls and concurrent calls leave nothing behind.

`test_many_mixed_calls_*` runs 200 calls in CI; ``pytest -m slow`` runs the long variant (2000).
"""

import threading

import psutil
import pytest
import torch
from hf_polybasic.testing import make_chain, make_tokenizer, prompt
from transformers.cache_utils import DynamicSlidingWindowLayer

import hf_polybasic as hp
from helpers import assert_target_could_sample
from hf_polybasic.drafters import PromptLookup

CONFIG = hp.PolybasicConfig(num_draft_tokens=3, block_threshold=4, schedule="constant")  # drafts every round


class InterruptAfter:
    """A streamer that raises KeyboardInterrupt at its `count`-th put (the prompt is the first)."""

    def __init__(self, count: int):
        self.count = count

    def put(self, value):
        self.count -= 1
        if self.count <= 0:
            raise KeyboardInterrupt

    def end(self):
        pass


def _mixed_calls(calls: int, rss_growth_mib: float) -> None:
    target, mid, draft = make_chain("gemma3", 3, seed=31)  # sliding-window layers, window 6
    tokenizer = make_tokenizer()
    chains = [[mid, draft], [draft], [mid, PromptLookup(max_ngram=2, num_tokens=4)]]
    prompts = [prompt(5 + i % 4, seed=i) for i in range(6)]
    plain = {}

    def reference(index):
        if index not in plain:
            plain[index] = target.generate(prompts[index], do_sample=False, max_new_tokens=12, eos_token_id=None)
        return plain[index]

    hp.enable(target)
    process = psutil.Process()
    try:
        for call in range(calls):
            ids = prompts[call % len(prompts)]
            chain = chains[call % len(chains)]
            kind = call % 5
            if kind == 0:  # sampled
                out = target.generate(ids, assistant_models=chain, polybasic_config=CONFIG, do_sample=True,
                                      temperature=0.8, top_k=20, max_new_tokens=12, eos_token_id=None)
                assert out.shape == (1, ids.shape[1] + 12)
                assert_target_could_sample(target, out, ids.shape[1], top_k=20)
            elif kind == 1:  # a stop string, with the cache returned
                stop = tokenizer.decode([int(reference(call % len(prompts))[0, ids.shape[1] + 4])])
                out = target.generate(ids, assistant_models=chain, polybasic_config=CONFIG, do_sample=False,
                                      max_new_tokens=12, eos_token_id=None, stop_strings=[stop],
                                      tokenizer=tokenizer, return_dict_in_generate=True)
                sequences = out.sequences
                assert torch.equal(sequences, reference(call % len(prompts))[:, : sequences.shape[1]])
                cache = out.past_key_values
                assert cache.get_seq_length() == sequences.shape[1] - 1
                window = target.config.sliding_window
                for layer in cache.layers:
                    if isinstance(layer, DynamicSlidingWindowLayer) and layer.is_initialized:
                        assert layer.keys.shape[-2] <= window  # rolled back and committed: bounded
            elif kind == 2:  # interrupted mid-call from the streamer, then an exact call
                with pytest.raises(KeyboardInterrupt):
                    target.generate(ids, assistant_models=chain, polybasic_config=CONFIG, do_sample=False,
                                    max_new_tokens=12, eos_token_id=None, streamer=InterruptAfter(3))
                out = target.generate(ids, assistant_models=chain, polybasic_config=CONFIG, do_sample=False,
                                      max_new_tokens=12, eos_token_id=None)
                assert torch.equal(out, reference(call % len(prompts)))
            else:  # greedy, exact
                out = target.generate(ids, assistant_models=chain, polybasic_config=CONFIG, do_sample=False,
                                      max_new_tokens=12, eos_token_id=None)
                assert torch.equal(out, reference(call % len(prompts)))
            if call == 20:
                settled = process.memory_info().rss / 2**20
        assert process.memory_info().rss / 2**20 - settled < rss_growth_mib
    finally:
        hp.disable(target)


def test_many_mixed_calls_on_one_enabled_model_stay_exact_and_bounded():
    _mixed_calls(200, rss_growth_mib=40)


@pytest.mark.slow
def test_many_mixed_calls_long_variant():
    _mixed_calls(2000, rss_growth_mib=40)


def _run_in_threads(jobs):
    """Run each zero-argument job in its own thread; re-raise the first failure."""
    errors = []

    def guarded(job):
        try:
            job()
        except BaseException as error:  # noqa: BLE001 - handed to the main thread
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _exact_calls(target, chain, prompts, expected, repeats=8):
    def job():
        for _ in range(repeats):
            for ids, want in zip(prompts, expected):
                out = target.generate(ids, assistant_models=chain, polybasic_config=CONFIG, do_sample=False,
                                      max_new_tokens=10, eos_token_id=None)
                assert torch.equal(out, want)

    return job


def test_two_threads_on_two_enabled_models_give_exact_results():
    models = [make_chain("llama", 3, seed=41), make_chain("qwen2", 3, seed=42)]
    prompts = [prompt(5, seed=s) for s in range(3)]
    expected = [[m[0].generate(p, do_sample=False, max_new_tokens=10, eos_token_id=None) for p in prompts] for m in models]
    for target, *_ in models:
        hp.enable(target)
    try:
        _run_in_threads([_exact_calls(m[0], m[1:], prompts, e) for m, e in zip(models, expected)])
    finally:
        for target, *_ in models:
            hp.disable(target)


def test_two_threads_on_the_same_model_give_exact_results():
    """Every call keeps its state (caches, statistics) to itself, so the same model (and the same
    assistants) can serve two threads at once."""
    target, mid, draft = make_chain("llama", 3, seed=43)
    prompts = [prompt(5, seed=s) for s in range(3)]
    expected = [target.generate(p, do_sample=False, max_new_tokens=10, eos_token_id=None) for p in prompts]
    hp.enable(target)
    try:
        _run_in_threads([_exact_calls(target, [mid, draft], prompts, expected),
                         _exact_calls(target, [draft], prompts, expected)])
    finally:
        hp.disable(target)
