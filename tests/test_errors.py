"""Bad input gets a clear error naming the argument; nothing is silently ignored."""

import pytest
import torch
from hf_polybasic.testing import make_chain, make_target, noisy_copy, prompt
from transformers import DynamicCache, StaticCache

import hf_polybasic as hp
from hf_polybasic.runners.dynamic import CachedModel


@pytest.fixture
def chain(shared_models):
    return shared_models.chain("llama", 3, seed=21)


@pytest.fixture
def own_chain():
    """A chain of this test's own, for tests that change the models (enable, config flags)."""
    return make_chain("llama", 3, seed=21)


def run(target, assistants, **kwargs):
    kwargs.setdefault("max_new_tokens", 4)
    return target.generate(prompt(4), custom_generate=hp.generate, assistant_models=assistants, **kwargs)


@pytest.mark.parametrize(
    "assistants, error, message",
    [
        (None, ValueError, "needs `assistant_models"),
        ([], ValueError, "is empty"),
        ("model", TypeError, "must be a list"),
        ([object()], TypeError, r"assistant_models\[0\]"),
    ],
)
def test_bad_assistant_models(assistants, error, message, chain):
    target = chain[0]
    with pytest.raises(error, match=message):
        target.generate(prompt(4), custom_generate=hp.generate, assistant_models=assistants, max_new_tokens=3)


def test_a_single_model_instead_of_a_list_is_a_type_error(chain):
    target, m2, _ = chain
    with pytest.raises(TypeError, match="assistant_models=\\[model\\]"):
        target.generate(prompt(4), custom_generate=hp.generate, assistant_models=m2, max_new_tokens=3)


def test_incompatible_vocabulary_names_both_models(chain):
    target = chain[0]
    other = make_target("qwen2", seed=1, vocab=1000)
    with pytest.raises(ValueError, match=r"assistant_models\[0\] Qwen2ForCausalLM.*LlamaForCausalLM.*1000 vs 96"):
        run(target, [other])


def test_padded_vocabulary_of_the_same_tokenizer_is_accepted():
    """An assistant whose output layer is padded (97 vs 96 ids) still gives the target's greedy output."""
    target = make_target("llama", seed=4, vocab=96)
    padded = noisy_copy(target, 0.05, seed=5, vocab=97)
    ids = prompt(4, seed=1)
    reference = target.generate(ids, do_sample=False, max_new_tokens=15, eos_token_id=None)
    out = target.generate(
        ids, do_sample=False, max_new_tokens=15, eos_token_id=None, custom_generate=hp.generate, assistant_models=[padded]
    )
    assert torch.equal(out, reference)
    # the padded row gets most of the assistant's probability mass, so without cutting the
    # assistant's output to the target's vocabulary it would draft id 96, which the target's
    # repetition penalty cannot even index
    with torch.no_grad():
        padded.lm_head.weight[96] = padded.lm_head.weight[:96].mean(0) * 50
    torch.manual_seed(0)
    sampled = target.generate(
        ids,
        do_sample=True,
        repetition_penalty=1.3,
        max_new_tokens=15,
        eos_token_id=None,
        custom_generate=hp.generate,
        assistant_models=[padded],
    )
    assert int(sampled.max()) < 96


def test_disagreeing_eos_is_an_incompatible_tokenizer(chain):
    target = chain[0]
    other = noisy_copy(target, 0.1, seed=3)
    other.config.eos_token_id = 7
    with pytest.raises(ValueError, match="disagree on eos_token_id"):
        run(target, [other])


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(num_beams=2), "beam search"),
        (dict(guidance_scale=1.5), "guidance_scale"),
        (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
        (dict(return_dict_in_generate=True, output_attentions=True), "output_attentions"),
        (dict(return_dict_in_generate=True, output_hidden_states=True), "output_hidden_states"),
        (dict(output_hidden_states=True), "output_hidden_states"),
        (dict(penalty_alpha=0.6, top_k=4), "penalty_alpha"),
        (dict(dola_layers="high"), "dola_layers"),
        (dict(num_beams=4, num_beam_groups=2, diversity_penalty=0.5), "num_beam_groups"),
    ],
)
def test_unsupported_generation_options(options, message, chain):
    target = chain[0]
    error = NotImplementedError if message.startswith("output_") else ValueError
    with pytest.raises(error, match=message):
        run(target, chain[1:], **options)


def test_a_stateful_watermark_is_refused(chain):
    from transformers import SynthIDTextWatermarkingConfig

    target = chain[0]
    watermark = SynthIDTextWatermarkingConfig(ngram_len=2, keys=[11, 12, 13, 14])
    with pytest.raises(ValueError, match="SynthIDTextWatermarkLogitsProcessor.*keeps state"):
        run(target, chain[1:], do_sample=True, watermarking_config=watermark)


def test_custom_position_ids_are_refused_and_generates_own_are_accepted(chain):
    target = chain[0]
    ids = prompt(4)
    with pytest.raises(ValueError, match=r"custom `position_ids` are not supported.*\[5, 6, 7, 8\]"):
        run(target, chain[1:], position_ids=torch.arange(5, 9)[None])
    out = run(target, chain[1:], position_ids=torch.arange(4)[None])  # what generate would derive anyway
    assert torch.equal(out, target.generate(ids, max_new_tokens=4))


def test_unknown_model_inputs_are_named(chain):
    target = chain[0]
    with pytest.raises(ValueError, match="token_type_ids"):
        run(target, chain[1:], token_type_ids=torch.zeros(1, 4, dtype=torch.long))


def test_a_prefilled_static_cache_cannot_be_continued(chain):
    target = chain[0]
    cache = StaticCache(config=target.config, max_cache_len=32)
    target(torch.tensor([[5, 6, 7]]), past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match=r"^a pre-filled StaticCache \(past_key_values\) cannot be continued"):
        run(target, chain[1:], past_key_values=cache)


def test_quantized_style_cache_layers_are_refused(chain):
    target = chain[0]
    cache = DynamicCache(config=target.config)

    class OddLayer(type(cache.layers[0])):
        pass

    cache.layers[0] = OddLayer()
    with pytest.raises(ValueError, match="cache layer 0 is a OddLayer"):
        CachedModel(target, cache, role="target")


def test_stateful_models_are_refused(own_chain):
    target = own_chain[0]
    target._is_stateful = True
    try:
        with pytest.raises(ValueError, match="stateful"):
            run(target, own_chain[1:])
    finally:
        del target._is_stateful


def test_encoder_decoder_target_is_refused(own_chain):
    target, m2, _ = own_chain
    target.config.is_encoder_decoder = True
    try:
        with pytest.raises(NotImplementedError, match="encoder-decoder"):
            hp.generate(target, prompt(3), None, None, target.generation_config, assistant_models=[m2])
    finally:
        target.config.is_encoder_decoder = False


def test_wrong_number_of_block_thresholds(chain):
    target = chain[0]
    with pytest.raises(ValueError, match="block_threshold has 2 values but the chain has 1 intermediate"):
        run(target, chain[1:], polybasic_config=hp.PolybasicConfig(block_threshold=(4, 4)))


def test_polybasic_config_of_the_wrong_type(chain):
    target = chain[0]
    with pytest.raises(TypeError, match="polybasic_config"):
        run(target, chain[1:], polybasic_config=5)


def test_enabled_model_rejects_mixing_with_hf_assistant_model(own_chain):
    target, m2, m3 = own_chain
    hp.enable(target)
    try:
        with pytest.raises(ValueError, match="assistant_model="):
            target.generate(prompt(4), assistant_models=[m2, m3], assistant_model=m3, max_new_tokens=3)
        with pytest.raises(ValueError, match="without `assistant_models`"):
            target.generate(prompt(4), polybasic_config=hp.PolybasicConfig(), max_new_tokens=3)
    finally:
        hp.disable(target)


def test_hf_assistant_model_beside_custom_generate_is_refused_as_the_enabled_route_refuses_it(own_chain):
    """transformers drops ``assistant_model=`` before a callable custom_generate sees it: the chain ran
    without that model, silently. It is refused with the enabled route's message."""
    target, m2, m3 = own_chain
    with pytest.raises(ValueError) as plain_route:
        run(target, [m2], assistant_model=m3)
    hp.enable(target)
    try:
        with pytest.raises(ValueError) as enabled_route:
            target.generate(prompt(4), assistant_models=[m2], assistant_model=m3, max_new_tokens=4)
    finally:
        hp.disable(target)
    assert str(plain_route.value) == str(enabled_route.value)
    assert "`assistant_model=` (transformers' two-model assisted generation) cannot be combined" in str(plain_route.value)


def test_a_paged_cache_is_refused_naming_what_to_use(own_chain):
    """``cache_implementation="paged"`` switches transformers to continuous batching, where the chain never
    runs (another output shape, said only in transformers' log). Refused where the call reaches us: the
    enabled route (before transformers switches) and the callable (a generation config asking for it)."""
    from transformers import GenerationConfig

    target, *chain = own_chain
    try:
        paged = GenerationConfig(cache_implementation="paged", max_new_tokens=4, eos_token_id=2, pad_token_id=0)
    except ValueError:  # transformers 4.57 refuses the value itself
        paged = None
    if paged is not None:
        with pytest.raises(ValueError, match="continuous batching .* cache_implementation='static'"):
            target.generate(prompt(4), custom_generate=hp.generate, assistant_models=chain, generation_config=paged)
    hp.enable(target)
    try:
        with pytest.raises(ValueError, match="cache_implementation='paged' runs transformers' continuous batching"):
            target.generate(prompt(4), assistant_models=chain, cache_implementation="paged", max_new_tokens=4)
        assert target.generate(prompt(4), cache_implementation="static", max_new_tokens=4).shape == (1, 8)
    finally:
        hp.disable(target)


def test_a_row_without_any_token_gets_its_own_message(chain):
    """A row whose attention mask is all zeros has nothing to generate from; it was called right padding."""
    ids = torch.tensor([[5, 6, 7], [0, 0, 0], [0, 8, 9]])
    mask = torch.tensor([[1, 1, 1], [0, 0, 0], [0, 1, 1]])
    with pytest.raises(ValueError, match="row 1 of attention_mask is all zeros") as refused:
        chain[0].generate(ids, attention_mask=mask, custom_generate=hp.generate, assistant_models=list(chain[1:]),
                          max_new_tokens=4, pad_token_id=0)
    assert "padding" not in str(refused.value)


def test_enabled_model_with_an_explicitly_empty_chain_is_an_error(own_chain):
    target = own_chain[0]
    hp.enable(target, assistant_models=list(own_chain[1:]))
    try:
        with pytest.raises(ValueError, match="is empty"):
            target.generate(prompt(4), assistant_models=[], max_new_tokens=3)
    finally:
        hp.disable(target)


def test_enable_rejects_non_generation_models():
    with pytest.raises(TypeError, match="generation model"):
        hp.enable(torch.nn.Linear(2, 2))


def test_streamer_with_a_batch_is_refused(chain):
    from hf_polybasic.testing import make_tokenizer
    from transformers import TextStreamer

    target = chain[0]
    ids = torch.randint(3, 90, (2, 4))
    with pytest.raises(ValueError, match="batch size 1"):
        target.generate(
            ids,
            custom_generate=hp.generate,
            assistant_models=list(chain[1:]),
            max_new_tokens=3,
            streamer=TextStreamer(make_tokenizer()),
        )
