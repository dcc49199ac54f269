"""Tiny random models and a tokenizer built in code (no downloads), for tests, docs and examples.

`make_chain` gives a target and noisy copies of it standing in for cheaper models of the same
family, so drafts are often, but not always, accepted. `make_target` also builds tiny hybrid and
state-space models (`HYBRID_ARCHITECTURES`: Qwen3-Next, Qwen3.5, Bamba, Jamba, LFM2, Mamba, ...),
their recurrent layers amplified so that a state left advanced changes their output. `make_tokenizer` is a character-level
tokenizer over the same tiny vocabulary, so pipelines, streamers and stop strings work.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

# Tiny hybrid models (transformers >= 5.15): each family's recurrent layers mixed with attention
# layers, smallest settings that build; ``layers`` is the depth (layer kinds alternate).
HYBRID_ARCHITECTURES = {
    # Gated DeltaNet + attention (MoE MLPs)
    "qwen3_next": lambda layers: dict(
        layer_types=["linear_attention", "full_attention"] * (layers // 2), linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, head_dim=8, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16),
    # Gated DeltaNet + attention, dense
    "qwen3_5_text": lambda layers: dict(
        layer_types=["linear_attention", "full_attention"] * (layers // 2), linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, head_dim=8),
    # Gated DeltaNet + attention, MoE (Qwen3.5 MoE)
    "qwen3_5_moe_text": lambda layers: dict(
        layer_types=["linear_attention", "full_attention"] * (layers // 2), linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, head_dim=8, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16),
    # Gated DeltaNet + attention (OLMo hybrid)
    "olmo_hybrid": lambda layers: dict(
        layer_types=["linear_attention", "full_attention"] * (layers // 2), linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8),
    # Mamba-2 + attention
    "bamba": lambda layers: dict(
        attn_layer_indices=list(range(1, layers, 2)), mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=8),
    # Mamba-2 and attention side by side in every layer
    "falcon_h1": lambda layers: dict(
        mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=8, mamba_n_groups=1, mamba_expand=2,
        mamba_chunk_size=8, head_dim=8),
    # Mamba-2 + attention + MLP-only layers
    "nemotron_h": lambda layers: dict(
        layers_block_type=(["mamba", "attention", "mamba", "mlp"] * layers)[:layers], mamba_num_heads=4,
        mamba_head_dim=16, ssm_state_size=8, n_groups=1, expand=2, chunk_size=8, head_dim=8),
    # Mamba-2 + attention (Granite 4.0-H), MoE
    "granitemoehybrid": lambda layers: dict(
        layer_types=["mamba", "attention"] * (layers // 2), mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=8, num_local_experts=4, num_experts_per_tok=2),
    # Mamba-2 layers, and a shared attention block beside Mamba-2 in every other layer (Zamba 2)
    "zamba2": lambda layers: dict(
        layers_block_type=["mamba", "hybrid"] * (layers // 2), num_key_value_heads=4, n_mamba_heads=4,
        mamba_d_state=8, mamba_ngroups=1, mamba_expand=2, chunk_size=8, attention_head_dim=8, num_mem_blocks=1),
    # Mamba (1) + attention, MoE
    "jamba": lambda layers: dict(
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4),
    # short convolutions + attention
    "lfm2": lambda layers: dict(
        layer_types=["conv", "full_attention"] * (layers // 2), conv_L_cache=3, block_ff_dim=64,
        block_auto_adjust_ff_dim=False),
    # short convolutions + attention, MoE
    "lfm2_moe": lambda layers: dict(
        layer_types=["conv", "full_attention"] * (layers // 2), num_dense_layers=1, moe_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, conv_L_cache=3),
    # Kimi Delta Attention + (multi-head latent) attention, MoE
    "kimi_linear": lambda layers: dict(
        layer_types=["linear_attention", "full_attention"] * (layers // 2), num_key_value_heads=4, linear_head_dim=8,
        linear_num_heads=4, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, kv_lora_rank=16, q_lora_rank=16,
        num_experts=4, num_experts_per_token=2, moe_intermediate_size=16),
    # pure state-space models: no attention layer at all
    "mamba": lambda layers: dict(state_size=8, expand=2, conv_kernel=4),
    "mamba2": lambda layers: dict(num_heads=4, head_dim=16, state_size=8, expand=2, n_groups=1, chunk_size=8),
    "falcon_mamba": lambda layers: dict(state_size=8, expand=2, conv_kernel=4),
}

VOCAB = 96
EOS = 2
BOS = 1
PAD = 0


@dataclass(frozen=True)
class TinyArchitecture:
    """One entry of `TINY_ARCHITECTURES`: a transformers causal LM and how to make a tiny config of it.

    Attributes:
        model_class, config_class: names in ``transformers`` (an architecture a release lacks is
            `available` False there, and tests skip it).
        attention: the attention kind it proves: "full", "sliding" (every layer windowed),
            "sliding+full" (windowed and full layers mixed), "chunked+full" (Llama 4: chunked
            attention, which transformers caches in its sliding-window layer, and NoPE full layers),
            "alibi" (a bias by key distance, no position embeddings), "learned absolute"
            (position embeddings looked up by ``position_ids``).
        moe: whether its feed-forward layers are mixtures of experts.
        tied: whether the output layer is the input embedding by default.
        fields: the llama-style common fields (see `_config`) -> this config's keyword arguments.
        weight_scale, logit_scale: what `tiny_chain` multiplies the layers' weights and the output
            layer by, so that this architecture's random outputs are peaked (the most likely token
            has ~0.2-0.6 of the mass) and not degenerate (a tied head at initialization mostly
            repeats the input token: its layers are scaled up until they dominate the residual).
    """

    model_class: str
    config_class: str
    attention: str
    fields: Callable[[dict], dict]
    moe: bool = False
    tied: bool = False
    weight_scale: float = 1.0
    logit_scale: float = 24.0

    @property
    def available(self) -> bool:
        import transformers

        return getattr(transformers, self.model_class, None) is not None and getattr(
            transformers, self.config_class, None) is not None


def _llama_like(common: dict) -> dict:
    return dict(common)


def _windowed(layer_types: Callable[[int], list[str]] | None = None, **fixed) -> Callable[[dict], dict]:
    """Fields of a model with a sliding window (``common["sliding_window"]`` tokens, far shorter than
    the outputs); ``layer_types(layers)`` gives its per-layer attention kinds, when it has them."""

    def fields(common: dict) -> dict:
        out = {**common, **fixed}
        if layer_types is not None:
            out["layer_types"] = layer_types(out["num_hidden_layers"])
        return out

    return fields


def _alternating(layers: int) -> list[str]:
    return ["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2)


def _without_window(common: dict) -> dict:
    return {key: value for key, value in common.items() if key != "sliding_window"}


def _llama4_text(common: dict) -> dict:
    # chunks of 4 tokens on the RoPE layers, NoPE full attention on the others; every layer MoE
    layers = common["num_hidden_layers"]
    return dict(
        _without_window(common), head_dim=8, intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=1,
        attention_chunk_size=common["sliding_window"] - 2, no_rope_layers=[int(i % 2 == 0) for i in range(layers)],
        interleave_moe_layer_step=1, attn_temperature_tuning=True, floor_scale=8,
    )


def _mixtral(common: dict) -> dict:
    return dict(_without_window(common), num_local_experts=4, num_experts_per_tok=2)


def _qwen_moe(common: dict) -> dict:
    return dict(
        _without_window(common), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, decoder_sparse_step=1,
    )


def _qwen3_moe(common: dict) -> dict:
    return dict(_without_window(common), head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                decoder_sparse_step=1)


def _ids(common: dict) -> dict:
    return {key: common[key] for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id",
                                         "tie_word_embeddings")}


def _bloom(common: dict) -> dict:
    return dict(_ids(common), hidden_size=common["hidden_size"], n_layer=common["num_hidden_layers"],
                n_head=common["num_attention_heads"])


def _mpt(common: dict) -> dict:
    return dict(
        _ids(common), d_model=common["hidden_size"], n_heads=common["num_attention_heads"],
        n_layers=common["num_hidden_layers"], expansion_ratio=2, max_seq_len=common["max_position_embeddings"],
        use_cache=True, attn_config={"alibi": True},
    )


def _gpt2(common: dict) -> dict:
    return dict(
        _ids(common), n_embd=common["hidden_size"], n_layer=common["num_hidden_layers"],
        n_head=common["num_attention_heads"], n_inner=common["intermediate_size"],
        n_positions=common["max_position_embeddings"],
    )


def _opt(common: dict) -> dict:
    return dict(
        _ids(common), hidden_size=common["hidden_size"], num_hidden_layers=common["num_hidden_layers"],
        ffn_dim=common["intermediate_size"], num_attention_heads=common["num_attention_heads"],
        max_position_embeddings=common["max_position_embeddings"], word_embed_proj_dim=common["hidden_size"],
    )


# Every attention kind transformers has, in tiny random models (`tiny_chain(name)`; `make_target(name)`
# and `make_chain(name)` build them with the legacy scales)
TINY_ARCHITECTURES: dict[str, TinyArchitecture] = {
    "llama": TinyArchitecture("LlamaForCausalLM", "LlamaConfig", "full", _without_window),
    "qwen2": TinyArchitecture("Qwen2ForCausalLM", "Qwen2Config", "full", _without_window),
    "mistral": TinyArchitecture("MistralForCausalLM", "MistralConfig", "sliding", _windowed()),
    "gemma2": TinyArchitecture("Gemma2ForCausalLM", "Gemma2Config", "sliding+full",
                               _windowed(_alternating, head_dim=8, query_pre_attn_scalar=8)),
    "gemma3": TinyArchitecture("Gemma3ForCausalLM", "Gemma3TextConfig", "sliding+full",
                               _windowed(_alternating, head_dim=8)),
    "cohere2": TinyArchitecture("Cohere2ForCausalLM", "Cohere2Config", "sliding+full",
                                _windowed(_alternating, logit_scale=1.0), tied=True, weight_scale=24, logit_scale=16),
    "llama4": TinyArchitecture("Llama4ForCausalLM", "Llama4TextConfig", "chunked+full", _llama4_text, moe=True),
    "mixtral": TinyArchitecture("MixtralForCausalLM", "MixtralConfig", "full", _mixtral, moe=True),
    "qwen2-moe": TinyArchitecture("Qwen2MoeForCausalLM", "Qwen2MoeConfig", "full", _qwen_moe, moe=True),
    "qwen3-moe": TinyArchitecture("Qwen3MoeForCausalLM", "Qwen3MoeConfig", "full", _qwen3_moe, moe=True, tied=True,
                                  weight_scale=32, logit_scale=16),
    "bloom": TinyArchitecture("BloomForCausalLM", "BloomConfig", "alibi", _bloom, tied=True, weight_scale=32,
                              logit_scale=16),
    "mpt": TinyArchitecture("MptForCausalLM", "MptConfig", "alibi", _mpt, tied=True, weight_scale=24, logit_scale=16),
    "gpt2": TinyArchitecture("GPT2LMHeadModel", "GPT2Config", "learned absolute", _gpt2, tied=True, weight_scale=24,
                             logit_scale=16),
    "opt": TinyArchitecture("OPTForCausalLM", "OPTConfig", "learned absolute", _opt, tied=True, weight_scale=24,
                            logit_scale=16),
}


def _config(arch: str, vocab: int = VOCAB, layers: int = 2, sliding_window: int = 6, tied: bool | None = None, **extra):
    """(model class, config) of a tiny ``arch`` (a key of `TINY_ARCHITECTURES`): hidden size 32, 4 heads
    (2 key/value heads where the architecture has them), ``layers`` layers, a window of
    ``sliding_window`` tokens where it has one; ``tied`` None is the architecture's default."""
    import transformers

    if arch in HYBRID_ARCHITECTURES:
        common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=BOS,
                      eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=bool(tied))
        common.update(extra)  # e.g. hidden_size=128 for 4-bit layers, which quantize groups of 128 features
        config = transformers.AutoConfig.for_model(arch, **{**common, **HYBRID_ARCHITECTURES[arch](layers)})
        return transformers.AutoModelForCausalLM.from_config, config
    if arch not in TINY_ARCHITECTURES:
        raise ValueError(
            f"unknown tiny architecture {arch!r}; choose one of {sorted(TINY_ARCHITECTURES)} or of "
            f"{sorted(HYBRID_ARCHITECTURES)}"
        )
    entry = TINY_ARCHITECTURES[arch]
    if not entry.available:
        raise ValueError(f"tiny architecture {arch!r} needs transformers.{entry.model_class}, which this release lacks")
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        tie_word_embeddings=entry.tied if tied is None else tied,
        sliding_window=sliding_window,
    )
    # llama-style names are mapped to the architecture's own (e.g. hidden_size=128 for 4-bit layers, which
    # quantize groups of 128 features); any other keyword is the architecture's own field, passed as is
    common.update({key: value for key, value in extra.items() if key in common})
    own = {key: value for key, value in extra.items() if key not in common}
    config_class = getattr(transformers, entry.config_class)
    return getattr(transformers, entry.model_class), config_class(**{**entry.fields(common), **own})


def make_target(
    arch: str = "llama", seed: int = 0, vocab: int = VOCAB, logit_scale: float = 4.0, weight_scale: float = 1.0, **extra
):
    """A random target whose output layer is scaled up by ``logit_scale``, so its distributions are
    peaked (``tied=True``: the output layer is the input embedding, as in Qwen2.5 and Gemma 3, and is
    scaled with it), and whose other weights (every matrix but the embeddings) are scaled by
    ``weight_scale``. ``arch``: a key of `TINY_ARCHITECTURES`."""
    cls, config = _config(arch, vocab=vocab, **extra)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        if weight_scale != 1.0:
            embeddings = model.get_input_embeddings().weight
            for parameter in model.parameters():
                if parameter.dim() >= 2 and parameter is not head and parameter is not embeddings:
                    parameter.mul_(weight_scale)
        head.mul_(logit_scale)
        if arch in HYBRID_ARCHITECTURES:
            _amplify_recurrent_layers(model)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    model.generation_config.bos_token_id = BOS
    return model


def _amplify_recurrent_layers(model, inputs: float = 3.0, outputs: float = 8.0) -> None:
    """Scale up the input and output projections of each recurrent layer: at random initialisation
    what it adds to the residual stream is too small for a stale recurrent state to change a tiny
    model's greedy output, which would leave tests of the state's rollback without power."""
    from .runners.recurrent import recurrent_layers

    kinds = {layer.module for layer in recurrent_layers(model)}
    for module in model.modules():
        if type(module).__name__ in kinds:
            for name, child in module.named_children():
                if isinstance(child, torch.nn.Linear) and name in ("in_proj", "in_proj_qkvz", "q_proj", "k_proj", "v_proj"):
                    child.weight.mul_(inputs)
                elif isinstance(child, torch.nn.Linear) and name in ("out_proj", "o_proj"):
                    child.weight.mul_(outputs)


def noisy_copy(model, noise: float, seed: int, vocab: int | None = None):
    """The same architecture with every weight multiplied by (1 + noise * N(0, 1)).

    ``vocab`` larger than the model's pads the output layer (as Qwen pads its vocabulary).
    """
    config = model.config.__class__.from_dict(model.config.to_dict())
    if vocab is not None:
        config.vocab_size = vocab
    clone = type(model)(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        source = dict(model.named_parameters())
        for name, parameter in clone.named_parameters():
            original = source[name]
            if original.shape != parameter.shape:  # padded embedding / head: copy the shared rows
                parameter.normal_(0, 0.02, generator=generator)
                parameter[: original.shape[0]] = original
                continue
            parameter.copy_(original * (1 + noise * torch.randn(original.shape, generator=generator)))
    clone.generation_config = copy.deepcopy(model.generation_config)  # its own: no shared settings
    return clone


def make_chain(arch: str = "llama", depth: int = 3, seed: int = 0, **extra):
    """[target, M2, ..., M_depth] with noise growing down the chain."""
    target = make_target(arch, seed=seed, **extra)
    noises = [0.05, 0.2, 0.4, 0.6]
    return [target] + [noisy_copy(target, noises[i], seed + 100 + i) for i in range(depth - 1)]


def tiny_chain(arch: str, depth: int = 4, seed: int = 0, noises: tuple[float, ...] = (0.02, 0.08, 0.25), **extra):
    """[target, M2, ..., M_depth] of architecture ``arch`` at its `TinyArchitecture` scales (peaked,
    non-degenerate outputs), the copies with the noise of ``noises`` (growing down the chain), so
    drafts are sometimes accepted and sometimes rejected."""
    entry = TINY_ARCHITECTURES[arch]
    target = make_target(arch, seed=seed, logit_scale=entry.logit_scale, weight_scale=entry.weight_scale, **extra)
    return [target] + [noisy_copy(target, noises[i], seed + 100 + i) for i in range(depth - 1)]


def prompt(length: int = 5, seed: int = 0, vocab: int = VOCAB) -> torch.LongTensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, length), generator=generator)


def make_tokenizer(vocab: int = VOCAB):
    """A character-level tokenizer over the tiny vocabulary: id i >= 3 is the character chr(30 + i)
    ('!' .. '}'), so any text without spaces round-trips and stop strings work."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = {"<pad>": PAD, "<s>": BOS, "</s>": EOS}
    pieces.update({chr(30 + i): i for i in range(3, vocab)})
    backend = Tokenizer(models.BPE(vocab=pieces, merges=[], unk_token="<pad>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>",
        model_input_names=["input_ids", "attention_mask"],  # no token_type_ids (transformers 4.x adds them)
    )
    tokenizer.padding_side = "left"
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tokenizer


# --- a level with another tokenizer: tokenizers trained in code, and a "translated copy" ----------
CORPUS = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
    "import json\n\n\ndef load_config(path):\n    with open(path) as handle:\n        return json.load(handle)\n",
    "for index, value in enumerate(values):\n    print(index, value * 2, sum(values) / len(values))\n",
    "The lighthouse keeper watched the storm roll in over the grey sea, and lit the lamp at dusk.",
    "Once upon a time there was a small robot who loved to read books about the ocean and the stars.",
    "Add the numbers 12, 345 and 6789: the sum is 7146. Then divide it by 3 to get 2382.",
    "Voilà: the café on the corner serves crème brûlée, naïve jokes and 日本茶 every morning.",
)
TRAINED_KINDS = ("byte-level", "metaspace")


def train_tokenizer(kind: str = "byte-level", vocab: int = 400, corpus=CORPUS):
    """A BPE tokenizer trained in code on ``corpus`` (milliseconds), as a transformers tokenizer:
    "byte-level" (GPT-2's scheme, as Qwen and SmolLM2: ``Ġ`` for a space, every byte a token; special
    tokens ``<|endoftext|>`` (BOS and pad), ``<|im_start|>``, ``<|im_end|>`` (EOS) at ids 0-2) or
    "metaspace" (SentencePiece's: ``▁`` for a space, a space put before the text, ``<0xNN>`` byte
    fallback for characters it lacks, a BOS put before every text as Llama's tokenizer does; ``<unk>``,
    ``<s>`` (BOS), ``</s>`` (EOS), ``<|im_start|>``, ``<|im_end|>`` at ids 0-4, the 256 byte tokens after
    the trained ones). ``vocab``: the trained
    tokens (byte tokens aside)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "byte-level":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        backend.train_from_iterator(corpus, trainers.BpeTrainer(
            vocab_size=vocab, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False))
        names = dict(bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>")
    elif kind == "metaspace":
        specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
        trained = Tokenizer(models.BPE(unk_token="<unk>"))
        trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        trained.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                                                show_progress=False))
        spec = json.loads(trained.to_str())["model"]
        pieces = dict(spec["vocab"])
        for byte in range(256):
            pieces.setdefault(f"<0x{byte:02X}>", len(pieces))
        merges = [tuple(merge.split(" ")) if isinstance(merge, str) else tuple(merge) for merge in spec["merges"]]
        backend = Tokenizer(models.BPE(vocab=pieces, merges=merges, unk_token="<unk>", byte_fallback=True))
        backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")])
        backend.add_special_tokens(specials)
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
        names = dict(bos_token="<s>", eos_token="</s>", pad_token="<unk>", unk_token="<unk>")
    else:
        raise ValueError(f"train_tokenizer: kind must be one of {TRAINED_KINDS}, got {kind!r}")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, model_input_names=["input_ids", "attention_mask"],
                                        **names)
    tokenizer.padding_side = "left"
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def translated_copy(target, target_tokenizer, tokenizer, noise: float = 0.0, seed: int = 0):
    """A model for ``tokenizer`` that computes what ``target`` (whose tokenizer is ``target_tokenizer``)
    computes on the same tokens: its layers are the target's (times 1 + ``noise`` N(0, 1)), and the
    embedding and output rows of each token the two tokenizers share are its twin's rows in the target
    (`hf_polybasic.translation.shared`); the other rows are random. Its drafts are then often the
    target's, as a smaller model of the same family would make them."""
    from .translation.level import shared_vocabulary

    shared = shared_vocabulary(tokenizer, target_tokenizer)
    config = target.config.__class__.from_dict(target.config.to_dict())
    config.vocab_size = len(tokenizer)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    generator = torch.Generator().manual_seed(seed)
    model = type(target)(config).eval()
    with torch.no_grad():
        source = dict(target.named_parameters())
        vocabulary = {id(target.get_input_embeddings().weight): "in", id(target.get_output_embeddings().weight): "out"}
        for name, parameter in model.named_parameters():
            original = source[name]
            if id(original) not in vocabulary:
                parameter.copy_(original * (1 + noise * torch.randn(original.shape, generator=generator)))
                continue
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * original.std())
            parameter[shared.own_ids] = original[shared.target_ids]
    model.generation_config = copy.deepcopy(target.generation_config)
    model.generation_config.bos_token_id, model.generation_config.eos_token_id, model.generation_config.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    return model


class SimulatedClock:
    """A clock that stands still except when a charged model runs a forward pass.

    Pass it to `hf_polybasic.generation.make_generate` (and to `hf_polybasic.costs.measure_curve`)
    so that every timing the chain reads is a simulated cost: schedules that react to timings then
    behave the same on every machine and every run. ``charge(model, cost)`` advances the clock by
    ``cost(tokens)`` seconds at each forward of ``model`` over ``tokens`` new tokens.
    """

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def charge(self, model, cost):
        """Charge ``cost(tokens)`` seconds per forward of ``model``, ``tokens`` being every token it
        is fed (all rows of a batch: a forward of n rows of k tokens costs what one of n k does, as
        on a machine whose forwards are bound by their arithmetic); returns the hook's handle."""

        def hook(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.advance(cost(int(ids.numel())))

        return model.register_forward_pre_hook(hook, with_kwargs=True)


@contextmanager
def simulated_machine(costs: Mapping[torch.nn.Module, Callable[[int], float]], parts=None,
                      assisted: bool = False) -> Iterator[Callable]:
    """``with simulated_machine({model: cost, ...}) as generate:`` a `custom_generate` callable that
    runs on a `SimulatedClock` charging ``cost(tokens)`` seconds per forward of each model, with cost
    curves measured on that clock and kept in memory only. Tests of the cost-aware schedule use it
    to make drafting pay (or not) whatever machine they run on; the hooks are removed on exit.
    ``parts``: the chain's classes (`hf_polybasic.decoding.build.ChainParts`), for negative controls;
    ``assisted``: the callable runs transformers' assisted loop (`hf_polybasic.assisted_generate`)."""
    from .assisted import make_assisted_generate
    from .costs import CostCurves, cost_key
    from .generation import make_generate

    clock = SimulatedClock()
    handles = [clock.charge(model, cost) for model, cost in costs.items()]
    try:
        # each model object has its own cost here, even models of one configuration
        curves = CostCurves(directory=None, key=lambda model: f"{cost_key(model)}-{id(model)}")
        make = make_assisted_generate if assisted else make_generate
        yield make(*([] if parts is None else [parts]), clock=clock, costs=curves)
    finally:
        for handle in handles:
            handle.remove()


def cheap_drafting_costs(target, assistants, target_seconds: float = 0.010, step: float = 0.02):
    """Costs under which drafting pays: the target's forward is flat at ``target_seconds``, each
    assistant costs ``step`` of the one above it per forward (model assistants only)."""
    costs, seconds = {target: (lambda tokens: target_seconds)}, target_seconds
    for model in assistants:
        if isinstance(model, torch.nn.Module):
            seconds *= step
            costs[model] = (lambda tokens, s=seconds: s)
    return costs
