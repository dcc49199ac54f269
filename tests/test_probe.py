"""Models whose forward does not do what a chain relies on are found before decoding: refused when
they cannot decode on their own cache, decoded row by row (with the reason) when the rows of a
batch would see each other's cache layout. Each case failed before the probes: silently different
tokens, or a crash inside the model."""

import warnings

import pytest
import torch
import transformers as tf
from helpers import left_padded

import hf_polybasic as hp
from hf_polybasic import compat
from hf_polybasic.decoding import loop as engine
from hf_polybasic.labels import model_label
from hf_polybasic.runners import probe
from hf_polybasic.testing import EOS, PAD, make_chain, noisy_copy, prompt
from hf_polybasic.levels import quantized_copy

CONFIG = hp.PolybasicConfig(num_draft_tokens=3, block_threshold=4, schedule="constant")
VOCAB = 96


def _scaled(model):
    """Peaked distributions, as `hf_polybasic.testing.make_target` makes them."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD, EOS
    return model.eval()


def openai_gpt():
    """Keeps no cache: it silently swallows ``past_key_values``."""
    torch.manual_seed(0)
    return _scaled(tf.OpenAIGPTLMHeadModel(tf.OpenAIGPTConfig(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2,
                                                              n_head=4)))


def trocr():
    """Takes positions from the cache's physical length; ``position_ids`` are ignored."""
    torch.manual_seed(0)
    config = tf.TrOCRConfig(vocab_size=VOCAB, d_model=32, decoder_layers=2, decoder_attention_heads=4,
                            decoder_ffn_dim=64, max_position_embeddings=128, pad_token_id=PAD, bos_token_id=1,
                            eos_token_id=EOS)
    return _scaled(tf.TrOCRForCausalLM(config))


def cpm_ant():
    """Needs its whole input at every step."""
    torch.manual_seed(0)
    config = tf.CpmAntConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, dim_head=8, dim_ff=64,
                             num_hidden_layers=2, prompt_length=4, segment_types=4, prompt_types=4)
    return tf.CpmAntForCausalLM(config).eval()


def mpt():
    """ALiBi biases by physical key slots (it takes no position_ids): holes shift a row's biases."""
    torch.manual_seed(0)
    return _scaled(tf.MptForCausalLM(tf.MptConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4,
                                                  max_seq_len=128, pad_token_id=PAD, eos_token_id=EOS,
                                                  use_cache=True)))  # MPT's config turns its cache off by default


def llama4(chunk: int = 4):
    """Chunked attention, backed by transformers' sliding-window cache layer."""
    torch.manual_seed(0)
    config = tf.Llama4TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 attention_chunk_size=chunk, num_local_experts=2, num_experts_per_tok=1,
                                 max_position_embeddings=256, pad_token_id=PAD, bos_token_id=1, eos_token_id=EOS)
    return _scaled(tf.Llama4ForCausalLM(config))


OPTIONS = dict(do_sample=False, max_new_tokens=16, eos_token_id=None, pad_token_id=PAD)


def _chain_call(target, assistants, ids, mask=None):
    return target.generate(ids, attention_mask=mask, custom_generate=hp.generate, assistant_models=assistants,
                           polybasic_config=CONFIG, **OPTIONS)


@pytest.mark.parametrize("build, cause", [(openai_gpt, "past_key_values stays empty"),
                                          (cpm_ant, "past_key_values stays empty")])
def test_a_model_that_does_not_decode_on_its_cache_is_refused_clearly(build, cause):
    model = build()
    assert cause in probe.cache_problem(model)
    draft = noisy_copy(model, 0.1, seed=1)
    with pytest.raises(ValueError, match=rf"target M1 {type(model).__name__} cannot be part of a speculative chain: .*{cause}"):
        _chain_call(model, [draft], prompt(6, seed=3))
    llama, llama_draft = make_chain("llama", 2, seed=4)
    with pytest.raises(ValueError, match=rf"assistant_models\[0\] \(M2 {type(model).__name__}\) cannot be part"):
        _chain_call(llama, [model], prompt(6, seed=3))


def test_a_forward_that_fails_on_a_filled_cache_is_a_refusal_not_a_crash():
    class NoSecondForward(torch.nn.Module):  # BLT cannot score several tokens on a filled cache
        def __init__(self, model):
            super().__init__()
            self.inner, self.config = model, model.config

        @property
        def device(self):
            return self.inner.device

        def get_input_embeddings(self):
            return self.inner.get_input_embeddings()

        def forward(self, input_ids, past_key_values=None, **kwargs):
            if past_key_values is not None and past_key_values.get_seq_length() > 0 and input_ids.shape[1] > 1:
                raise RuntimeError("cannot score several tokens on a filled cache")
            return self.inner(input_ids=input_ids, past_key_values=past_key_values, **kwargs)

    problem = probe.cache_problem(NoSecondForward(make_chain("llama", 1, seed=5)[0]))
    assert problem.startswith("a forward on its own filled cache fails (RuntimeError: cannot score several tokens")


def test_models_that_decode_on_their_cache_pass_the_probe(shared_models):
    for arch in ("llama", "qwen2", "gemma3"):
        assert probe.cache_problem(shared_models.chain(arch, 2, seed=7)[0]) is None
        half = make_chain(arch, 1, seed=7)[0].to(torch.bfloat16)
        assert probe.cache_problem(half) is None and (arch == "gemma3" or probe.rows_problem(half) is None)
    assert probe.cache_problem(trocr()) is None and probe.cache_problem(llama4()) is None


@pytest.mark.parametrize("build", [trocr, mpt], ids=["TrOCR", "MPT"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_that_reads_positions_off_its_cache_decodes_a_batch_row_by_row_with_the_reason(build, dtype):
    """TrOCR takes positions from the cache's length, MPT's ALiBi biases keys by their slots (found by
    the oracle test: rows differed from plain generate once a round rejected drafts)."""
    target = build().to(dtype)
    name = type(target).__name__
    assert f"{name} gives a row of a batch other logits" in probe.rows_problem(target)
    if dtype == torch.bfloat16:
        return
    target = build()
    draft = noisy_copy(target, 0.1, seed=2)
    prompts = [prompt(n, seed=n)[0] for n in (3, 7, 5)]
    ids, mask = left_padded(prompts)
    with pytest.warns(UserWarning, match=f"row by row .*{name} gives a row of a batch other logits"):
        out = _chain_call(target, [draft], ids, mask)
    for row, p in enumerate(prompts):
        alone = target.generate(p[None], **OPTIONS)[0, p.shape[0] :]
        assert torch.equal(out[row, ids.shape[1] :], alone)


def test_chunked_attention_is_windowed_by_its_cache_layer_class_and_batched_row_by_row():
    """Llama 4's chunked layers are transformers' sliding-window layers: holes would narrow the
    chunk (every row of a 4-row batch differed from plain batched generate, without a warning)."""
    target = llama4()
    kinds = compat.windowed_layers(target)
    assert kinds and all("DynamicSlidingWindowLayer (chunked_attention)" == kind for _, kind in kinds)
    draft = noisy_copy(target, 0.1, seed=3)
    prompts = [prompt(n, seed=10 + n)[0] for n in (3, 9, 5, 6)]
    ids, mask = left_padded(prompts)
    with pytest.warns(UserWarning, match=r"row by row .*windowed attention \(layer 0: DynamicSlidingWindowLayer"):
        out = _chain_call(target, [draft], ids, mask)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, **OPTIONS))


def test_windowed_layers_come_from_the_cache_layer_classes(shared_models):
    gemma, llama = shared_models.chain("gemma3", 1, seed=7)[0], shared_models.chain("llama", 1, seed=7)[0]
    assert [index for index, _ in compat.windowed_layers(gemma)] == [0]
    assert compat.windowed_layers(llama) == []
    assert probe.rows_problem(llama) is None


def test_the_row_by_row_warning_says_why_each_time_the_reason_changes(shared_models, monkeypatch):
    monkeypatch.setattr(engine, "_last_row_by_row_reason", None)
    sliding = shared_models.chain("gemma3", 2, seed=7)
    full = shared_models.chain("llama", 2, seed=7)
    ids, mask = left_padded([prompt(4, seed=1)[0], prompt(6, seed=2)[0]])

    def reasons(target, draft, **options):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            target.generate(ids, attention_mask=mask, custom_generate=hp.generate, assistant_models=[draft],
                            polybasic_config=CONFIG, **{**OPTIONS, **options})
        return [str(w.message) for w in caught if "row by row" in str(w.message)]

    assert any("windowed attention" in m for m in reasons(*sliding))
    assert reasons(*sliding) == []  # the same reason again: said once
    assert any("use_cache=False" in m for m in reasons(*full, use_cache=False))
    assert any("windowed attention" in m for m in reasons(*sliding))


def test_only_the_targets_batched_logits_must_equal_the_rows_alone():
    """A level below the target stays exact whatever logits it computes in a batch (the target
    decides), so only a structural problem decodes its batch row by row."""
    model = trocr()
    assert probe.rows_problem(model) is not None
    assert probe.rows_problem(model, compare_logits=False) is None
    llama = make_chain("llama", 1, seed=9)[0]
    target = noisy_copy(model, 0.0, seed=1)  # an exact copy: a TrOCR drafter under a TrOCR target is refused by it
    assert engine.row_by_row_reason(llama, [model]) is None
    assert "TrOCRForCausalLM gives a row" in engine.row_by_row_reason(target, [llama])


def _with_sink(model: torch.nn.Module, token: int, value: float = 300.0) -> torch.nn.Module:
    """``model`` where ``token`` at a forward's first position puts a massive activation into one
    channel of every MLP's down_proj input, as the first token of real Qwen and Llama models does."""
    state = {}

    def top(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        state["sink"] = ids is not None and int(ids[0, 0]) == token

    def down(module, args):
        if state.get("sink"):
            x = args[0].clone()
            x[:, 0, 0] = value
            return (x,)
        return None

    model.register_forward_pre_hook(top, with_kwargs=True)
    for layer in model.model.layers:
        layer.mlp.down_proj.register_forward_pre_hook(down)
    return model


def test_a_dynamic_int8_drafter_with_a_massive_activation_passes_the_cache_probe(monkeypatch):
    """Dynamic int8 scales a forward's activations by its largest: a full forward that holds the
    sink token quantizes every other token coarser than a forward on the cache, which does not
    (the real int8 Qwen2.5-Coder-0.5B was refused: 7.6 off where a lost context is 13.8 off)."""
    with torch.no_grad():  # as cache_problem runs it
        model = make_chain("llama", 1, seed=5)[0]
        sink = int(probe._probe_ids(model, 9, seed=1)[0])  # the cache probe's first token
        quantized = _with_sink(quantized_copy(model), sink)
        assert probe._null_share(quantized) == probe.DYNAMIC_NULL_SHARE
        assert probe._check_cache(quantized) is None
        assert probe._null_share(_with_sink(model, sink)) == probe.NULL_SHARE
        assert probe._check_cache(model) is None  # the float model is consistent with itself
        monkeypatch.setattr(probe, "DYNAMIC_NULL_SHARE", probe.NULL_SHARE)  # the share that refused it
        assert "differ from a full forward's" in probe._check_cache(quantized)


def _padded_logits(model, real: torch.LongTensor, pads: torch.LongTensor) -> torch.Tensor:
    """The real tokens' logits from one forward over them and trailing ``pads`` (a causal mask: the
    pads never reach the real tokens through attention), positioned as the static runner places them."""
    ids = torch.cat([real, pads])[None]
    positions = torch.cat([torch.arange(real.shape[0]), torch.full(pads.shape, real.shape[0] - 1)])[None]
    return model(input_ids=ids, position_ids=positions, use_cache=False).logits[0, : real.shape[0]]


def _without_own_mask(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` dropping a 4-D attention mask (the static runner's), so it builds its own causal mask
    over the cache, as a model that builds its mask or position bias from a 2-D mask does."""

    def drop(module, args, kwargs):
        if kwargs.get("attention_mask") is not None and kwargs["attention_mask"].dim() == 4:
            kwargs["attention_mask"] = None
        return args, kwargs

    model.register_forward_pre_hook(drop, with_kwargs=True)
    return model


def test_a_dynamic_int8_model_keeps_the_dynamic_runner_for_its_activation_scale_not_its_masks():
    """torch.ao's quantize_dynamic quantizes each forward's activations with one scale over all of
    its tokens: the static runner's pads change the real tokens' logits (2% of the largest here,
    where the probe allows 0.1%), which the probe must not blame on masks. With its weights
    dequantized the same model passes, so the warning names the quantization."""
    target = make_chain("llama", 1, seed=5)[0]
    quantized = quantized_copy(target, "int8-dynamic")
    real, pads = probe._probe_ids(target, 5, seed=2), torch.full((3,), 57)
    with torch.no_grad():
        for model, changed in ((target, False), (quantized, True)):
            alone = model(input_ids=real[None], use_cache=False).logits[0]
            off = float((_padded_logits(model, real, pads) - alone).abs().max()) / float(alone.abs().max())
            assert (off > probe.TOLERANCE[torch.float32]) is changed, off
    assert probe.static_problem(target) is None
    layers = probe._dynamic_int8_layers(quantized)
    problem = probe.static_problem(quantized)
    assert problem == probe.DYNAMIC_QUANTIZATION_REASON and "mask or position bias" not in problem
    assert layers and probe._dynamic_int8_layers(quantized) == layers  # the twin left the model as it was
    twin = probe._dequantized_twin(quantized)
    assert not probe._dynamic_int8_layers(twin)
    assert {p.data_ptr() for p in twin.parameters()} <= {p.data_ptr() for p in quantized.parameters()}
    seen = []
    handle = layers[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].shape))
    with torch.no_grad():
        twin(input_ids=real[None])  # a hook on a quantized layer runs in the twin as well
    handle.remove()
    assert seen

    from hf_polybasic.decoding import build as chain
    chain._warned_runners.discard((model_label(quantized), problem))
    ids = prompt(6, seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = target.generate(ids, custom_generate=hp.generate, assistant_models=[quantized], do_sample=False,
                              max_new_tokens=8, cache_implementation="static")
    said = [str(w.message) for w in caught if "on a dynamic cache" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("hf_polybasic runs assistant_models[0] (M2 LlamaForCausalLM) on a "
                                                 "dynamic cache: its dynamically quantized linear layers")
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=8))  # exact either way


def test_a_model_that_builds_its_own_mask_keeps_the_mask_reason_quantized_or_not():
    model = _without_own_mask(make_chain("llama", 1, seed=5)[0])
    assert probe.static_problem(model) == probe.STATIC_LOGITS_REASON
    quantized = _without_own_mask(quantized_copy(make_chain("llama", 1, seed=5)[0], "int8-dynamic"))
    assert probe.static_problem(quantized) == probe.STATIC_LOGITS_REASON  # its dequantized twin fails too


def test_the_errors_page_quotes_the_static_runner_reasons():
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "reference" / "errors.md").read_text()
    assert probe.STATIC_LOGITS_REASON in page and probe.DYNAMIC_QUANTIZATION_REASON in page



def test_a_value_kept_per_model_is_found_only_for_the_model_as_it_was():
    """`PerModel` (what verdicts, views, pooled caches and compiled forwards are kept in): a value is found
    again while the model is left as it was or its weights are loaded in place, and no longer once it is
    cast (also on the meta device, where no storage tells), given new storage of the same dtype, changed
    in its modules (even one without parameters) or its attention implementation."""
    from hf_polybasic.models.fingerprint import PerModel

    kept = PerModel()
    model = make_chain("llama", 1, seed=7)[0]
    model.model.register_module("unused", None)  # a child left None is skipped

    def found(value) -> bool:
        kept.put(model, value)
        return kept.get(model) == value and model in kept and kept[model] == value

    assert found("as built") and kept.setdefault(model, lambda: "made again") == "as built"
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)  # values loaded in place: the same tensors
    assert kept.get(model) == "as built"
    changes = [
        lambda: model.to(torch.float64),
        lambda: setattr(model.lm_head.weight, "data", model.lm_head.weight.data.clone()),  # new storage, same dtype
        lambda: setattr(model.model.layers[0].mlp, "act_fn", torch.nn.GELU()),  # a module without parameters
        lambda: model.set_attn_implementation("eager"),
    ]
    for change in changes:
        assert found("before")
        change()
        assert kept.get(model, "gone") == "gone" and model not in kept
        with pytest.raises(KeyError):
            kept[model]
        assert kept.setdefault(model, lambda: "made again") == "made again" and kept[model] == "made again"
    meta = torch.nn.Linear(3, 3, device="meta")
    kept.put(meta, "on meta")
    assert kept.get(meta) == "on meta"
    meta.to(torch.float64)
    assert kept.get(meta) is None
    # a value another thread kept while this one made its own wins
    assert kept.setdefault(meta, lambda: kept.put(meta, "theirs") or "mine") == "theirs"


def _static_call(target, draft, ids, exact: bool = True) -> list[str]:
    """A greedy static call (equal to plain generate unless not ``exact``); the runner of each level."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="hf_polybasic runs .* on a dynamic cache")
        out = target.generate(ids, custom_generate=hp.generate, assistant_models=[draft], polybasic_config=CONFIG,
                              cache_implementation="static", return_dict_in_generate=True, **OPTIONS)
    if exact:
        assert torch.equal(out.sequences, target.generate(ids, **OPTIONS))
    return [level.runner for level in out.polybasic_stats.levels]


def test_a_verdict_is_probed_again_once_its_model_changed():
    """A verdict holds for the model as it was probed (`hf_polybasic.models.fingerprint`). After a static call
    the sdpa verdict was kept through ``set_attn_implementation("flex_attention")``, so the next static call fed
    flex attention the static runner's mask (the process died: "double free or corruption", the slow test
    below); a target quantized in place by ``quantize_dynamic`` after a probe ran on the static runner, which
    refuses it fresh. Each change gets a new verdict."""
    target, draft = make_chain("llama", 2, seed=6)
    ids = prompt(6, seed=2)
    assert _static_call(target, draft, ids) == ["static", "static"]
    target.set_attn_implementation("flex_attention")
    assert "'flex_attention' takes no explicit attention mask" in probe.static_problem(target)
    target.set_attn_implementation("sdpa")
    assert probe.static_problem(target) is None
    torch.ao.quantization.quantize_dynamic(target, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    assert probe.static_problem(target) == probe.DYNAMIC_QUANTIZATION_REASON
    # (an int8 target's logits depend on how many tokens a forward holds: no longer plain generate's exactly)
    assert _static_call(target, draft, ids, exact=False) == ["dynamic", "static"]


@pytest.mark.slow
def test_a_static_call_after_switching_to_flex_attention_keeps_the_dynamic_runner_and_is_exact():
    """The crash itself (flex attention compiles its kernels on the CPU: half a minute)."""
    target, draft = make_chain("llama", 2, seed=6)
    ids = prompt(6, seed=2)
    assert _static_call(target, draft, ids) == ["static", "static"]
    for model in (target, draft):
        model.set_attn_implementation("flex_attention")
    assert _static_call(target, draft, ids) == ["dynamic", "dynamic"]
