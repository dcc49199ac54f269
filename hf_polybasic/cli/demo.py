"""A self-contained demonstration on small *random* models (no downloads).

It builds a random 16-layer target and two early-exit views of it (its first 8 layers as the
middle model M2, its first layer as the drafter M3), then runs plain greedy `generate`, two-model
chains and the three-model chain on the same prompt, checks
that all outputs are identical and prints the per-level statistics and the measured speed ratio.
Random models make random text and say nothing about speed on real models; they show the
mechanics. (The benchmark on real pretrained models lives in its own command.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ..config import PolybasicConfig
from ..generation import generate, last_stats
from ..levels import early_exit
from .assisted import assisted_generate, assistant_settings
from .harness import median_of


@dataclass
class DemoModels:
    target: torch.nn.Module
    half_depth: torch.nn.Module
    one_layer: torch.nn.Module


def build_demo_models(hidden_size: int = 512, layers: int = 16, vocab: int = 2048, seed: int = 0) -> DemoModels:
    """A random target whose deeper layers change the residual stream a little (as in trained
    models, where early exits often agree with the full model), plus two early-exit copies of it:
    half of its layers (the chain's middle model) and one layer (the drafter)."""
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # peaked distributions, like a trained model's
        for depth, layer in enumerate(target.model.layers):
            damping = 1.0 if depth == 0 else 0.1 / depth
            layer.self_attn.o_proj.weight.mul_(damping)
            layer.mlp.down_proj.weight.mul_(damping)
    target.generation_config.pad_token_id = 0
    return DemoModels(target, early_exit(target, layers // 2), early_exit(target, 1))


def run_demo(max_new_tokens: int = 64, repeats: int = 3, seed: int = 0) -> int:
    """Print the comparison; return 0 if every method reproduced plain greedy generate exactly."""
    models = build_demo_models(seed=seed)
    prompt = torch.randint(3, models.target.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(seed))
    options = dict(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None)
    print("hf_polybasic demo on small RANDOM models (no real weights): it shows the mechanics and")
    print("checks exactness; its speed numbers say nothing about real models.\n")

    plain, plain_time = _timed(lambda: models.target.generate(prompt, **options), repeats)
    print(f"plain greedy generate: {max_new_tokens / plain_time:.1f} tokens/s (median of {repeats})\n")

    def report(title: str, out: torch.Tensor, seconds: float) -> bool:
        equal = torch.equal(out, plain)
        print(title)
        print(f"  identical to plain greedy: {equal}")
        print(f"  {max_new_tokens / seconds:.1f} tokens/s, {plain_time / seconds:.2f}x plain (median of {repeats})")
        return equal

    all_equal = report(
        "HF assisted generation: target <- 1-layer early exit (assistant_model=, K=4 constant)",
        *_timed(
            lambda: assisted_generate(models.target, models.one_layer, assistant_settings(4), inputs=prompt, **options),
            repeats,
        ),
    )
    print()
    chains = {
        "2 models: target <- 1-layer early exit": ([models.one_layer], PolybasicConfig(num_draft_tokens=4)),
        "2 models: target <- half-depth early exit": ([models.half_depth], PolybasicConfig(num_draft_tokens=6)),
        "3 models: target <- half-depth <- 1-layer": (
            [models.half_depth, models.one_layer],
            PolybasicConfig(num_draft_tokens=4, block_threshold=12),
        ),
    }
    for title, (assistants, config) in chains.items():
        out, seconds = _timed(
            lambda: models.target.generate(
                prompt, custom_generate=generate, assistant_models=assistants, polybasic_config=config, **options
            ),
            repeats,
        )
        all_equal &= report(f"{title}  ({config})", out, seconds)
        print("  " + str(last_stats(models.target)).replace("\n", "\n  ") + "\n")
    return 0 if all_equal else 1


def _timed(fn, repeats: int) -> tuple[torch.Tensor, float]:
    """Output and median wall time of ``repeats`` runs after one untimed warm-up run."""
    timing = median_of(fn, repeats, warmup=1)
    return timing.output, timing.seconds


