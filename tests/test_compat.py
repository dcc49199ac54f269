"""Each function of `hf_polybasic.compat` does what it stands for on the installed transformers.

These are the tests that fail first when a transformers release changes an internal we rely on.
"""

import inspect
import warnings

import pytest
import torch
from transformers import GenerationConfig, StaticCache
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer
from transformers.generation import logits_process as lp

from hf_polybasic import compat
from hf_polybasic.testing import make_target, prompt


def _full_logits(model, ids):
    return model(ids).logits[0]


# --- caches ---------------------------------------------------------------------------------------
def test_new_cache_has_sliding_layers_where_the_config_says_and_is_dynamic():
    model = make_target("gemma3", seed=1)
    cache = compat.new_dynamic_cache(model)
    assert compat.is_dynamic_cache(cache)
    kinds = [isinstance(layer, DynamicSlidingWindowLayer) for layer in cache.layers]
    if compat.SLIDING_LAYERS_ROLL_BACK:
        assert kinds == [layer == "sliding_attention" for layer in model.config.layer_types]
    else:  # transformers < 5.18: full layers only (sliding ones could not be rolled back)
        assert not any(kinds)
    assert compat.unrollable_layer(cache) is None


def _sliding_layer_hands_attention_only_its_window() -> bool:
    """What the layer of the installed release does: record, 4 tokens, then 1; count what it returns."""
    layer = DynamicSlidingWindowLayer(sliding_window=3)
    layer.activate_past_recording()
    states = torch.zeros(1, 1, 4, 2)
    layer.update(states, states)
    return layer.update(states[:, :, :1], states[:, :, :1])[0].shape[-2] == 3


def test_sliding_layers_roll_back_where_a_recording_layer_returns_its_window_only():
    """transformers 5.15 - 5.17: a recording sliding layer returns every recorded state (the mask
    expects the window); 5.18 returns the window. Checked on the installed release's layer."""
    if not compat.HAS_PAST_RECORDING:
        assert not compat.SLIDING_LAYERS_ROLL_BACK
        return
    assert compat.SLIDING_LAYERS_ROLL_BACK == _sliding_layer_hands_attention_only_its_window()
    known = {"5.15": False, "5.16": False, "5.17": False}.get(
        f"{compat.TRANSFORMERS_VERSION.major}.{compat.TRANSFORMERS_VERSION.minor}", True
    )
    assert compat.SLIDING_LAYERS_ROLL_BACK == known


@pytest.mark.parametrize(("arch", "window"), [("mistral", 12), ("gemma2", 10)])
def test_a_three_level_sliding_window_chain_decodes_past_its_window_exactly(arch, window):
    """Issue 31: on transformers 5.15 - 5.17 this crashed once the prompt and drafts passed the
    window ("size of tensor a (13) must match ... (12)"): the intermediate level's recording
    sliding layers handed attention more states than the mask describes."""
    import hf_polybasic as hp
    from hf_polybasic.testing import tiny_chain

    chain = tiny_chain(arch, depth=3, sliding_window=window)
    ids = prompt(7)
    reference = chain[0].generate(ids, do_sample=False, max_new_tokens=40)
    out = chain[0].generate(
        ids, do_sample=False, max_new_tokens=40, custom_generate=hp.generate, assistant_models=chain[1:],
        polybasic_config=hp.PolybasicConfig(schedule="constant", num_draft_tokens=4),
    )
    assert torch.equal(out, reference)
    for model in chain:  # the caches we build hold sliding layers only where they can roll back
        layers = compat.new_dynamic_cache(model).layers
        assert any(isinstance(layer, DynamicSlidingWindowLayer) for layer in layers) == compat.SLIDING_LAYERS_ROLL_BACK


def test_full_layers_at_sliding_attention_layers_give_the_same_logits():
    """What caches are made of before transformers 5.18: the model's masks apply the window."""
    from transformers import DynamicCache

    model = make_target("gemma3", seed=6)
    ids = prompt(14, seed=7)
    cache = DynamicCache()
    model(ids[:, :9], past_key_values=cache, use_cache=True)
    stepped = model(ids[:, 9:], past_key_values=cache, use_cache=True, position_ids=torch.arange(9, 14)[None]).logits[0]
    assert not any(isinstance(layer, DynamicSlidingWindowLayer) for layer in cache.layers)
    torch.testing.assert_close(stepped, _full_logits(model, ids)[9:], rtol=1e-4, atol=1e-4)


def test_a_passed_in_sliding_cache_is_refused_where_it_cannot_roll_back(monkeypatch):
    from transformers import DynamicCache

    model = make_target("gemma3", seed=1)
    sliding = DynamicCache(config=model.config.get_text_config(decoder=True))
    monkeypatch.setattr(compat, "SLIDING_LAYERS_ROLL_BACK", False)
    with pytest.raises(ValueError, match="past_key_values.*sliding-window layers.*install transformers >= 5.18"):
        compat.record_past_states(sliding)
    compat.record_past_states(DynamicCache())  # full layers: nothing to record
    assert compat.replaceable_empty_cache(sliding, made_by_generate=True)  # the empty one generate makes is replaced
    model(prompt(3), past_key_values=sliding, use_cache=True)
    assert not compat.replaceable_empty_cache(sliding, made_by_generate=True)  # a filled one is not (and is refused above)
    monkeypatch.setattr(compat, "SLIDING_LAYERS_ROLL_BACK", True)
    assert not compat.replaceable_empty_cache(DynamicCache(config=model.config.get_text_config(decoder=True)), True)


def test_static_caches_and_foreign_layers_are_recognised():
    model = make_target("llama", seed=1)
    assert not compat.is_dynamic_cache(StaticCache(config=model.config, max_cache_len=16))
    cache = compat.new_dynamic_cache(model)

    class RecurrentLayer:
        pass

    cache.layers.append(RecurrentLayer())
    assert compat.unrollable_layer(cache) == (len(cache.layers) - 1, "RecurrentLayer")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_removing_tokens_beyond_the_window_and_refeeding_reproduces_a_full_forward(arch):
    """Sliding window 6; 14 tokens cached, the last 9 removed (more than the window), then re-fed."""
    model = make_target(arch, seed=2)
    ids = prompt(14, seed=3)
    cache = compat.new_dynamic_cache(model)
    compat.record_past_states(cache)
    model(ids[:, :10], past_key_values=cache, use_cache=True)
    model(ids[:, 10:], past_key_values=cache, use_cache=True)
    compat.remove_last_tokens(cache, 9)
    assert cache.get_seq_length() == 5
    refed = model(ids[:, 5:], past_key_values=cache, use_cache=True, position_ids=torch.arange(5, 14)[None]).logits[0]
    torch.testing.assert_close(refed, _full_logits(model, ids)[5:], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not compat.SLIDING_LAYERS_ROLL_BACK, reason="transformers < 5.18: our caches have no sliding layers")
def test_restricting_sliding_layers_bounds_them_to_the_window_and_skips_empty_layers():
    model = make_target("gemma3", seed=4)
    window = model.config.sliding_window
    empty = compat.new_dynamic_cache(model)
    compat.record_past_states(empty)
    compat.restrict_sliding_layers(empty)  # no layer has seen a token: nothing to do, no error
    cache = compat.new_dynamic_cache(model)
    compat.record_past_states(cache)
    model(prompt(12, seed=5), past_key_values=cache, use_cache=True)
    stored = [layer.keys.shape[-2] for layer in cache.layers if isinstance(layer, DynamicSlidingWindowLayer)]
    assert max(stored) > window  # recorded past
    compat.restrict_sliding_layers(cache)
    stored = [layer.keys.shape[-2] for layer in cache.layers if isinstance(layer, DynamicSlidingWindowLayer)]
    assert max(stored) <= window
    assert cache.get_seq_length() == 12


# --- recurrent state (hybrid models) -------------------------------------------------------------------
needs_recurrent_layout = pytest.mark.skipif(
    not compat.HAS_RECURRENT_CACHE_LAYERS, reason="transformers < 5.15: hybrid models are refused"
)


def _tiny_hybrid(arch, **options):
    try:
        return make_target(arch, **options)
    except (ValueError, KeyError) as error:  # a family or layer type this release does not have
        pytest.skip(f"{arch} cannot be built on transformers {compat.TRANSFORMERS_VERSION}: {error}")


def _feed(model, cache, ids, start=0):
    kwargs = {compat.cache_argument(model): cache}
    if compat.takes_position_ids(model):
        kwargs["position_ids"] = torch.arange(start, start + ids.shape[1])[None]
    return model(input_ids=ids, use_cache=True, **kwargs).logits[0]


def test_hybrids_are_refused_by_kind_where_transformers_has_no_shared_recurrent_layout(monkeypatch):
    """Before 5.15 (checked on 4.57.6, 5.4.0 and 5.14.1) families kept their state in cache classes of
    their own, or continued it differently."""
    from hf_polybasic.runners.dynamic import CachedModel

    monkeypatch.setattr(compat, "HAS_RECURRENT_CACHE_LAYERS", False)
    target = make_target("qwen3_next", seed=1)
    with pytest.raises(ValueError, match=r"layer 0 is a Gated DeltaNet linear-attention layer \(Qwen3NextGatedDeltaNet\)"
                                         r".*older than 5.15.*need transformers >= 5.15"):
        CachedModel(target, compat.new_dynamic_cache(target), role="target")


def _forward_cache_name(model) -> str:
    """The one cache argument ``model.forward`` declares (``cache`` from transformers 5.24 on)."""
    names = [n for n in ("cache", "past_key_values", "cache_params") if n in inspect.signature(model.forward).parameters]
    assert len(names) == 1, names
    return names[0]


def test_a_model_is_given_its_cache_under_the_name_its_forward_takes_and_generate_under_any():
    """transformers 5.24 renamed ``past_key_values`` / ``cache_params`` to ``cache`` (the old names warn):
    forwards, `generate`'s model_kwargs and its output. Every name is read; the model's own is passed."""
    from transformers import DynamicCache
    from transformers.generation import GenerateDecoderOnlyOutput

    llama = make_target("llama", seed=1)
    name = compat.cache_argument(llama)
    assert name == _forward_cache_name(llama)
    assert (name == "cache") == compat.CACHE_IS_CALLED_CACHE == (compat.TRANSFORMERS_VERSION >= compat.Version("5.24"))
    cache = DynamicCache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the model's own name: no deprecation warning
        llama(prompt(3), use_cache=True, **{name: cache})
    assert cache.get_seq_length() == 3
    for key in compat.CACHE_KWARGS:
        assert compat.given_cache({key: cache, "use_cache": True}) is cache
    assert compat.given_cache({"attention_mask": None}) is None
    output = GenerateDecoderOnlyOutput(sequences=prompt(3), **{compat.OUTPUT_CACHE_FIELD: cache})
    assert output.past_key_values is cache  # the field, or from 5.24 on its alias


@needs_recurrent_layout
def test_a_hybrid_cache_has_recurrent_layers_where_the_config_says():
    model = make_target("qwen3_5_text", layers=4)
    cache = compat.new_dynamic_cache(model)
    linear = [i for i, kind in enumerate(compat.config_layer_types(model)) if kind == "linear_attention"]
    assert compat.recurrent_layer_indices(cache) == linear == [0, 2]
    assert compat.is_recurrent_cache_layer(cache.layers[0]) and not compat.is_recurrent_cache_layer(cache.layers[1])
    assert compat.tracks_length(cache) and compat.cached_tokens(cache) == 0 and not compat.holds_recurrent_state(cache)
    _feed(model, cache, prompt(5))
    assert compat.holds_recurrent_state(cache) and compat.cached_tokens(cache) == 5


@needs_recurrent_layout
def test_a_layer_without_state_is_one_a_rollback_leaves_alone():
    """Nemotron-H's MLP-only layer: a `DummyLayer` (transformers >= 5.19 or so) or an unused recurrent
    layer (5.15 - 5.18), both fine to leave alone."""
    model = make_target("nemotron_h", layers=4)  # mamba, attention, mamba, MLP only
    cache = compat.new_dynamic_cache(model)
    assert type(cache.layers[3]) in compat.ROLLBACK_LAYER_TYPES or compat.is_recurrent_cache_layer(cache.layers[3])
    from hf_polybasic.runners.recurrent import recurrent_layers

    assert [layer.index for layer in recurrent_layers(model)] == [0, 2]


@needs_recurrent_layout
def test_a_cache_of_recurrent_layers_only_cannot_count_its_tokens():
    model = make_target("mamba2")
    assert compat.cache_argument(model) == _forward_cache_name(model) and not compat.takes_position_ids(model)
    llama = make_target("llama")
    assert compat.cache_argument(llama) == _forward_cache_name(llama) and compat.takes_position_ids(llama)
    cache = compat.new_dynamic_cache(model)
    assert not compat.tracks_length(cache) and compat.cached_tokens(cache) == 0
    _feed(model, cache, prompt(4))
    with pytest.raises(ValueError, match="without attention layers and already holds a state"):
        compat.cached_tokens(cache)


@needs_recurrent_layout
@pytest.mark.parametrize("arch", ["qwen3_5_text", "falcon_h1", "lfm2"])
def test_a_state_read_and_written_back_puts_the_layer_back(arch):
    """`write_recurrent_state` of what `read_recurrent_state` gave (copied), with the attention cut by
    `remove_last_tokens`, which leaves the recurrent state alone: the next token sees what it saw."""
    model = make_target(arch, seed=2)
    ids = prompt(9, seed=4)
    cache = compat.new_dynamic_cache(model)
    compat.record_past_states(cache)
    _feed(model, cache, ids[:, :6])
    layers = [cache.layers[index] for index in compat.recurrent_layer_indices(cache)]

    def tensors():
        return [t.clone() for layer in layers for _, conv, rec in compat.read_recurrent_state(layer) for t in (conv, rec)
                if t is not None]

    kept = [[(seen, conv.clone(), None if rec is None else rec.clone()) for seen, conv, rec in
             compat.read_recurrent_state(layer)] for layer in layers]
    assert all(states[0][0] and states[0][1].shape[-1] <= layer.conv_kernel_size[0] for states, layer in zip(kept, layers))
    expected = _feed(model, cache, ids[:, 6:7], start=6)
    _feed(model, cache, ids[:, 7:9], start=7)
    advanced = tensors()
    compat.remove_last_tokens(cache, 3)
    assert all(torch.equal(a, b) for a, b in zip(advanced, tensors()))  # left alone
    assert cache.get_seq_length() == 6
    for layer, states in zip(layers, kept):
        compat.write_recurrent_state(layer, states)
    torch.testing.assert_close(_feed(model, cache, ids[:, 6:7], start=6), expected)


@needs_recurrent_layout
def test_a_state_that_saw_no_token_starts_the_layer_afresh():
    model = make_target("qwen3_5_text", seed=2)
    ids = prompt(5, seed=4)
    cache = compat.new_dynamic_cache(model)
    fresh = compat.read_recurrent_state(cache.layers[0])
    assert fresh == [(False, None, None)]
    _feed(model, cache, ids[:, :3])
    compat.write_recurrent_state(cache.layers[0], fresh)
    compat.remove_last_tokens(cache, 3)
    assert not compat.holds_recurrent_state(cache)
    torch.testing.assert_close(_feed(model, cache, ids), _feed(model, compat.new_dynamic_cache(model), ids))


@needs_recurrent_layout
def test_convolution_states_are_cut_to_the_kernel_when_handed_back():
    model = make_target("qwen3_5_text", seed=2)
    ids = prompt(12, seed=4)
    cache = compat.new_dynamic_cache(model)
    compat.record_past_states(cache)
    _feed(model, cache, ids[:, :8])
    _feed(model, cache, ids[:, 8:11], start=8)
    layer = cache.layers[0]
    width = layer.conv_kernel_size[0]
    if compat.HAS_PAST_RECORDING:
        assert layer.conv_states[0].shape[-1] > width  # recording keeps the past
    compat.stop_recording_past_states(cache)
    assert layer.conv_states[0].shape[-1] == width and not layer.record_past
    plain = compat.new_dynamic_cache(model)
    _feed(model, plain, ids[:, :11])
    torch.testing.assert_close(_feed(model, cache, ids[:, 11:], start=11), _feed(model, plain, ids[:, 11:], start=11))


@needs_recurrent_layout
@pytest.mark.parametrize("arch", ["qwen3_5_text", "nemotron_h", "kimi_linear", "lfm2", "jamba", "mamba"])
def test_which_kinds_continue_a_state_over_several_tokens(arch):
    """What `continues_state_over_several_tokens` says of the installed release: a forward of several
    tokens after a cached state gives the full forward's logits, or not (Jamba, Mamba: fails first
    when a release fixes their scan, so the one-token feeding can be dropped there)."""
    from hf_polybasic.runners.recurrent import recurrent_layers

    model = _tiny_hybrid(arch, seed=2)
    ids = prompt(16, seed=3)
    cache = compat.new_dynamic_cache(model)
    compat.record_past_states(cache)
    _feed(model, cache, ids[:, :8])
    continued = _feed(model, cache, ids[:, 8:], start=8)
    matches = torch.allclose(continued, model(input_ids=ids).logits[0, 8:], rtol=1e-4, atol=1e-4)
    assert matches == compat.continues_state_over_several_tokens(recurrent_layers(model)[0].kind.key)


# --- models ------------------------------------------------------------------------------------------
def test_logits_to_keep_and_statefulness():
    model = make_target("llama", seed=1)
    assert compat.accepts_logits_to_keep(model)
    assert not compat.is_stateful(model)

    class Recurrent(torch.nn.Module):
        _is_stateful = True

    assert compat.is_stateful(Recurrent())


def test_gguf_tensors_are_what_transformers_loads_from_the_gguf(tmp_path):
    pytest.importorskip("gguf")
    from helpers import write_tiny_gguf
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)  # a llama: its q and k weights are permuted back on the way
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    pages = []
    streamed = {}
    for name, tensor in compat.gguf_tensors(path, model, after_each=pages.append):
        assert len(pages) == len(streamed)  # the previous GGUF tensor was handed on before this one came
        streamed[name] = tensor
    whole = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    assert streamed.keys() == whole.keys() and len(pages) == len(whole)
    for name, tensor in whole.items():
        assert streamed[name].dtype == torch.float32 and torch.equal(streamed[name], tensor.float()), name


# --- generate ----------------------------------------------------------------------------------------
def test_prepared_pad_token_is_preferred_and_user_configs_are_marked():
    config = GenerationConfig(pad_token_id=3)
    assert compat.prepared_pad_token_id(config) == 3
    config._pad_token_tensor = torch.tensor(7)
    assert int(compat.prepared_pad_token_id(config)) == 7
    compat.mark_as_user_config(config)
    assert config._from_model_config is False


def test_the_generate_frame_holds_the_arguments_a_custom_generate_callable_is_not_given():
    """`streamer_of_calling_generate` and `assistant_model_of_calling_generate` read generate's own
    parameters from its frame; a callable custom_generate is given neither (assistant_model: only the
    callable's own arguments beside ``_sample``'s are passed)."""
    from transformers import GenerationMixin

    parameters = inspect.signature(GenerationMixin.generate).parameters
    assert {"streamer", "assistant_model"} <= set(parameters)
    source = inspect.getsource(GenerationMixin._extract_generation_mode_kwargs)
    assert "new_custom_keys" in source  # a callable's arguments replace the mode's (assistant_model dropped)

    def custom(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        assert "assistant_model" not in model_kwargs
        return (compat.streamer_of_calling_generate(), compat.assistant_model_of_calling_generate())

    target = make_target("llama", seed=2)
    helper = make_target("llama", seed=3)
    assert target.generate(prompt(3), custom_generate=custom, max_new_tokens=2) == (None, None)
    assert target.generate(prompt(3), custom_generate=custom, assistant_model=helper, max_new_tokens=2) == (None,
                                                                                                             helper)


def test_batched_generate_pads_a_stopped_row_only_beside_an_eos_criterion():
    from transformers import GenerationMixin
    from transformers.generation import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

    source = inspect.getsource(GenerationMixin._sample)
    assert 'has_eos_stopping_criteria = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)' in source
    assert "if has_eos_stopping_criteria:" in source
    assert compat.pads_finished_rows(StoppingCriteriaList([MaxLengthCriteria(9), EosTokenCriteria(2)]))
    assert not compat.pads_finished_rows(StoppingCriteriaList([MaxLengthCriteria(9)]))


# --- logits processors -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "processor, attribute",
    [
        (lp.MinLengthLogitsProcessor(10, eos_token_id=2), "min_length"),
        (lp.MinNewTokensLengthLogitsProcessor(5, 3, eos_token_id=2), "prompt_length_to_skip"),
        (lp.ForcedEOSTokenLogitsProcessor(20, eos_token_id=2), "max_length"),
        (lp.SuppressTokensAtBeginLogitsProcessor([4], begin_index=6), "begin_index"),
    ],
)
def test_positions_shift_on_a_copy(processor, attribute):
    before = getattr(processor, attribute)
    shifted = compat.shift_positions(processor, 4)
    assert getattr(shifted, attribute) == before - 4 and getattr(processor, attribute) == before
    assert compat.shift_positions(processor, 0) is processor


def test_a_processor_that_reads_the_prefixs_length_sees_the_removed_padding_again():
    """ForcedBOS forces where its prefix is one token long, counted in the padded batch (its only reader of
    the prefix is its length): a row of one token that lost a pad is not forced, an unpadded one is."""
    forced = lp.ForcedBOSTokenLogitsProcessor(5)
    assert lp.ForcedBOSTokenLogitsProcessor in compat.LENGTH_READING_PROCESSORS
    scores = torch.zeros(1, 8)
    one_token = torch.tensor([[6]])
    assert compat.shift_positions(forced, 0) is forced
    assert torch.isinf(forced(one_token, scores.clone())).sum() == 7  # alone, one token: forced
    padded = compat.shift_positions(forced, 1)
    assert torch.equal(padded(one_token, scores.clone()), scores)  # as plain generate sees it: 2 tokens wide
    assert torch.equal(padded(one_token, scores.clone()), forced(torch.tensor([[0, 6]]), scores.clone()))


@pytest.mark.skipif(not compat.REPETITION_PENALTY_SKIPS_ROW_PADDING, reason="this transformers has no per-row count")
def test_repetition_penaltys_skipped_prefix_is_per_row_and_shrinks_with_the_removed_padding():
    per_row = lp.RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=torch.tensor([0, 4, 7]))
    view = compat.processor_for_row(per_row, 2, torch.tensor([5, 6]))
    assert view.prompt_ignore_length == 7 and per_row.prompt_ignore_length.shape == (3,)
    assert compat.shift_positions(view, 7).prompt_ignore_length == 0
    given = lp.RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=5)
    assert compat.shift_positions(given, 3).prompt_ignore_length == 2
    assert compat.shift_positions(given, 9).prompt_ignore_length == 0  # never negative: that counts from the end
    plain = lp.RepetitionPenaltyLogitsProcessor(1.3)
    assert compat.shift_positions(plain, 3) is plain and compat.processor_for_row(plain, 1, torch.tensor([5])) is plain


def test_the_repetition_penalty_flag_matches_what_generate_builds():
    """The flag is read from the processor's constructor; `generate` passes one count per row exactly
    on the releases whose constructor takes them (checked on the source of `generate`)."""
    from transformers.generation import utils

    passes = "prompt_ignore_length=padding_lengths" in inspect.getsource(utils.GenerationMixin._get_logits_processor)
    assert compat.REPETITION_PENALTY_SKIPS_ROW_PADDING == passes


def test_processors_without_positions_are_not_copied():
    warper = lp.TemperatureLogitsWarper(0.5)
    assert compat.shift_positions(warper, 3) is warper


@pytest.mark.parametrize(
    "options",
    [
        dict(do_sample=False),
        dict(do_sample=False, repetition_penalty=1.3),
        dict(do_sample=True, temperature=0.7),
        dict(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3),
        dict(do_sample=True, top_k=0, min_p=0.1),
    ],
)
def test_planner_processors_give_generates_processed_scores(options):
    """The processors and defaults the planner rebuilds score exactly as `generate`'s own."""
    model = make_target("llama", seed=6)
    ids = prompt(6, seed=7)
    torch.manual_seed(0)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, output_scores=True,
                         output_logits=True, return_dict_in_generate=True, **options)
    processors = compat.decoding_processors(compat.resolved_decoding(model, **options))
    rebuilt = processors(ids, out.logits[0].clone())
    torch.testing.assert_close(rebuilt, out.scores[0])


def test_decoding_defaults_are_transformers_defaults():
    model = make_target("llama", seed=1)
    assert compat.resolved_decoding(model)["do_sample"] is False
    sampling = compat.resolved_decoding(model, do_sample=True, temperature=0.7)
    assert sampling["top_k"] == 50 and sampling["temperature"] == 0.7


# --- versions -----------------------------------------------------------------------------------------
def test_an_untested_release_warns_once(monkeypatch):
    from packaging.version import Version

    monkeypatch.setattr(compat, "_warned", False)
    monkeypatch.setattr(compat, "TRANSFORMERS_VERSION", Version("4.50.0"))
    assert not compat.transformers_is_tested()
    with pytest.warns(UserWarning, match="tested with transformers 4.57.0 <= v < 5.25.0; found 4.50.0"):
        compat.warn_if_untested()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.warn_if_untested()  # once only
    monkeypatch.setattr(compat, "TRANSFORMERS_VERSION", Version("5.14.1"))
    assert compat.transformers_is_tested()


def test_the_tested_range_is_the_range_pyproject_admits():
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    low, high = re.search(r'"transformers>=([0-9.]+),<([0-9.]+)"', text).groups()
    assert (compat.Version(low), compat.Version(high)) == compat.TESTED_TRANSFORMERS


def test_processor_classes_a_release_lacks_are_left_out():
    assert compat.logits_processor_classes("TopKLogitsWarper", "NoSuchWarper") == (lp.TopKLogitsWarper,)


def test_gather_slots_moves_each_rows_keys_and_values_and_select_keeps_rows():
    cache = DynamicCache()
    keys = torch.arange(2 * 1 * 4 * 2, dtype=torch.float32).reshape(2, 1, 4, 2)
    cache.update(keys, -keys, layer_idx=0)
    compat.gather_slots(cache, torch.tensor([[1, 3], [0, 2]]))
    layer = cache.layers[0]
    assert torch.equal(layer.keys[0, 0], keys[0, 0, [1, 3]]) and torch.equal(layer.keys[1, 0], keys[1, 0, [0, 2]])
    assert torch.equal(layer.values, -layer.keys) and cache.get_seq_length() == 2
    compat.select_batch_rows(cache, torch.tensor([1]))
    assert torch.equal(cache.layers[0].keys[0, 0], keys[1, 0, [0, 2]])


def test_gather_slots_refuses_layers_it_cannot_compact():
    cache = DynamicCache()
    cache.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2), layer_idx=0)
    sliding = DynamicSlidingWindowLayer(sliding_window=4)
    sliding.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    cache.layers[0] = sliding
    with pytest.raises(TypeError, match="cannot compact cache layer 0, a DynamicSlidingWindowLayer"):
        compat.gather_slots(cache, torch.tensor([[0, 1]]))
