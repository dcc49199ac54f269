"""Tiny random models and a tokenizer built in code (no downloads), for tests, docs and examples.

`make_chain` gives a target and noisy copies of it standing in for cheaper models of the same
family, so drafts are often, but not always, accepted. `make_target` also builds tiny hybrid and
state-space models (`HYBRID_ARCHITECTURES`: Qwen3-Next, Qwen3.5, Bamba, Jamba, LFM2, Mamba, ...),
their recurrent layers amplified so that a state left advanced changes their output. `make_tokenizer` is a character-level
tokenizer over the same tiny vocabulary, so pipelines, streamers and stop strings work.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

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


def _config(arch: str, vocab: int = VOCAB, layers: int = 2, sliding_window: int = 6, tied: bool = False, **extra):
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
        tie_word_embeddings=tied,
    )
    common.update(extra)  # e.g. hidden_size=128 for 4-bit layers, which quantize groups of 128 features
    if arch == "llama":
        return LlamaForCausalLM, LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2ForCausalLM, Qwen2Config(**common)
    if arch == "gemma3":
        # every other layer is sliding-window with a window far shorter than the generations
        return Gemma3ForCausalLM, Gemma3TextConfig(
            **common, head_dim=8, sliding_window=sliding_window, layer_types=["sliding_attention", "full_attention"] * (layers // 2)
        )
    if arch in HYBRID_ARCHITECTURES:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model(arch, **{**common, **HYBRID_ARCHITECTURES[arch](layers)})
        return AutoModelForCausalLM.from_config, config
    raise ValueError(
        f"unknown tiny architecture {arch!r}; choose 'llama', 'qwen2', 'gemma3' or one of {sorted(HYBRID_ARCHITECTURES)}"
    )


def make_target(arch: str = "llama", seed: int = 0, vocab: int = VOCAB, logit_scale: float = 4.0, **extra):
    """A random target whose output layer is scaled up, so its distributions are peaked
    (``tied=True``: the output layer is the input embedding, as in Qwen2.5 and Gemma 3)."""
    cls, config = _config(arch, vocab=vocab, **extra)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
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
    from .recurrent import recurrent_layers

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


class SimulatedClock:
    """A clock that stands still except when a charged model runs a forward pass.

    Pass it to `hf_polybasic.integration.make_generate` (and to `hf_polybasic.costs.measure_curve`)
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
def simulated_machine(costs: Mapping[torch.nn.Module, Callable[[int], float]]) -> Iterator[Callable]:
    """``with simulated_machine({model: cost, ...}) as generate:`` a `custom_generate` callable that
    runs on a `SimulatedClock` charging ``cost(tokens)`` seconds per forward of each model, with cost
    curves measured on that clock and kept in memory only. Tests of the cost-aware schedule use it
    to make drafting pay (or not) whatever machine they run on; the hooks are removed on exit."""
    from .costs import CostCurves, cost_key
    from .integration import make_generate

    clock = SimulatedClock()
    handles = [clock.charge(model, cost) for model, cost in costs.items()]
    try:
        # each model object has its own cost here, even models of one configuration
        curves = CostCurves(directory=None, key=lambda model: f"{cost_key(model)}-{id(model)}")
        yield make_generate(clock=clock, costs=curves)
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
