"""Models built in code whose levels agree with the target by construction, and a drafter with a set
acceptance rate and a set cost: the instruments of ``python -m benchmarks gpu-bench``.

Random weights at a real size cost what a real model of that shape costs (a forward's time does
not depend on the values), but a random model's levels agree with it by accident, and its greedy
choices are near-ties between many tokens (the top logit of a random vector is barely above the
next), which half-precision kernels flip at random. `build_target` therefore gives the random
model a structure:

* **a confident bigram skeleton.** The embedding dominates the residual stream and the output
  layer is a shuffled copy of it, so the target's next token is a fixed function of the last one,
  chosen by a wide margin (its logit about three times the largest of the other, random, ones).
  The attention and MLP weights stay random, scaled down so that together they move the residual
  stream by about `NOISE` of its norm at any width, so every forward costs what it would.
* **override tables in the deeper layers.** Layer l (1 .. L-1) holds, in its first MLP rows, a
  lookup table of ``m`` tokens (disjoint sets): after such a token, the layer writes the
  direction of another token into the residual stream, and the target predicts that one instead,
  again by a wide margin. An early exit of n layers (`hf_polybasic.levels.early_exit`) lacks the
  tables of layers n .. L-1, so it agrees with the target's greedy token exactly when the last
  token is in none of them: on a fraction ``1 - (L - n) m / V`` of the tokens, set by ``m``
  (`TargetConstruction.exit_agreement`).

`build_eagle3_head` gives such a target a random-weight EAGLE-3 head of the real head's shape (one
decoder layer over ``2 * hidden``, an ``fc`` over three layers' states, a reduced draft vocabulary), whose
greedy draft is the target's greedy token after a set fraction of the tokens (its *agreement*), written as
a speculators checkpoint and loaded through `hf_polybasic.levels.draft_head`, as a user loads one.

`ReferenceDrafter` is a bottom level whose acceptance rate and cost are set, not measured: it
proposes the target's own greedy continuation (looked up in a reference computed beforehand by
plain ``generate``, i.e. it cheats, as a benchmark instrument may), each token right with
probability ``acceptance`` independently, and costs exactly ``seconds_per_token`` per proposed
token. With it, a run can be read against the theory (Leviathan et al.'s expected tokens per
verification, Lemma 3.1).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hf_polybasic.drafters import Drafter
from hf_polybasic.levels import draft_head, early_exit

PAD, BOS, EOS = 0, 1, 2
FIRST_TOKEN = 3  # ids below are special: never in a prompt, never predicted by the skeleton

# Real shapes (from the models' published configs), plus a tiny one for CPU smoke tests. The output
# layer is always untied: it is built from the embedding, not shared with it.
SHAPES = {
    "llama3-8b": (LlamaForCausalLM, LlamaConfig, dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5)),
    "qwen2-7b": (Qwen2ForCausalLM, Qwen2Config, dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "llama3.2-1b": (LlamaForCausalLM, LlamaConfig, dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5)),
    "tiny": (LlamaForCausalLM, LlamaConfig, dict(
        vocab_size=2048, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2)),
}

INIT_STD = 0.02  # every random matrix, as transformers initialises Llama and Qwen2
NOISE = 0.3  # how far all random layers together move the residual stream, in embedding norms: they cost, barely move it
MARGIN = 3.0  # the skeleton's logit over the typical largest random logit
OVERRIDE_STRENGTH = 3.0  # an override writes this many embedding norms of the new token's direction
GATE = 8.0  # a table row's pre-activation for its own token (about GATE / sqrt(hidden) for others)


@dataclass(frozen=True)
class TargetConstruction:
    """How `build_target` structured the random target (recorded with the results).

    Attributes:
        shape: a key of `SHAPES`.
        layers: L, decoder layers.
        vocab_size: V.
        tokens_per_layer: m, tokens in each override table (layers 1 .. L-1).
        seed: of every random draw.
    """

    shape: str
    layers: int
    vocab_size: int
    tokens_per_layer: int
    seed: int

    def exit_agreement(self, num_layers: int) -> float:
        """The fraction of tokens after which an early exit of ``num_layers`` layers predicts the
        target's greedy token: those in no override table of the layers it lacks."""
        return 1.0 - (self.layers - num_layers) * self.tokens_per_layer / (self.vocab_size - FIRST_TOKEN)

    def to_dict(self) -> dict:
        return asdict(self)


def tokens_per_layer(layers: int, vocab_size: int, draft_layers: int, draft_agreement: float) -> int:
    """m such that an early exit of ``draft_layers`` layers agrees on ``draft_agreement`` of the tokens."""
    if not 0.0 < draft_agreement <= 1.0:
        raise ValueError(f"the drafter exit's agreement must be in (0, 1], got {draft_agreement}")
    if not 1 <= draft_layers < layers:
        raise ValueError(f"the drafter exit needs 1 .. {layers - 1} layers, got {draft_layers}")
    return round((1.0 - draft_agreement) * (vocab_size - FIRST_TOKEN) / (layers - draft_layers))


def model_config(shape: str, max_positions: int = 4096):
    """The transformers config of ``shape`` (built in code: nothing is downloaded)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {sorted(SHAPES)}")
    cls, config_cls, fields = SHAPES[shape]
    config = config_cls(**fields, max_position_embeddings=max_positions, tie_word_embeddings=False,
                        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    return cls, config


def parameter_count(shape: str) -> int:
    """Parameters of ``shape`` (on the meta device: nothing is allocated)."""
    cls, config = model_config(shape)
    with torch.device("meta"):
        return sum(p.numel() for p in cls(config).parameters())


@torch.no_grad()
def build_target(shape: str, device: torch.device | str, dtype: torch.dtype, draft_layers: int,
                 draft_agreement: float, seed: int = 0) -> tuple[torch.nn.Module, TargetConstruction]:
    """A random target of ``shape``, made in ``dtype`` directly on ``device`` (no float32 copy first),
    structured so that an early exit of ``draft_layers`` layers agrees with its greedy tokens on
    ``draft_agreement`` of them, and deeper exits on more (see the module docstring)."""
    cls, config = model_config(shape)
    device = torch.device(device)
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)  # as transformers does to build a model in a dtype
        cast = False
    except TypeError:  # a torch that takes only float32/float64 here: build in float32, then cast
        cast = True
    try:
        with torch.device(device):
            model = cls(config).eval()
    finally:
        torch.set_default_dtype(previous)
    if cast:
        model.to(dtype)  # (this also casts float32 buffers such as the rotary frequencies)
    layers, vocab, hidden = config.num_hidden_layers, config.vocab_size, config.hidden_size
    m = tokens_per_layer(layers, vocab, draft_layers, draft_agreement)
    if m > config.intermediate_size or m * (layers - 1) > (vocab - FIRST_TOKEN) // 2:
        raise ValueError(
            f"an exit of {draft_layers} of {layers} layers agreeing on {draft_agreement} of the tokens needs override "
            f"tables of {m} tokens per layer: more than the MLP's {config.intermediate_size} rows or half the "
            "vocabulary in all; ask for a higher agreement"
        )
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, parameter in model.named_parameters():  # every value drawn here: nothing left to chance
        if parameter.dim() >= 2:
            parameter.normal_(0.0, INIT_STD, generator=generator)
        else:
            parameter.fill_(0.0 if name.endswith("bias") else 1.0)

    # the skeleton: embedding rows of norm ~ sqrt(hidden) (rms 1); the output row of token t points
    # along the embedding of its predecessor perm[t], so the successor of x is inverse[x]
    unit = model.model.embed_tokens.weight.clone()  # [V, hidden], rms INIT_STD
    model.model.embed_tokens.weight.copy_(unit / INIT_STD)
    cpu = torch.Generator().manual_seed(seed + 1)
    perm = torch.arange(vocab)
    perm[FIRST_TOKEN:] = FIRST_TOKEN + torch.randperm(vocab - FIRST_TOKEN, generator=cpu)
    inverse = torch.argsort(perm)
    beta = MARGIN * math.sqrt(2 * math.log(vocab)) / math.sqrt(hidden)
    head = model.get_output_embeddings().weight
    head.add_(beta * unit[perm.to(device)])

    # the override tables: disjoint token sets, each mapped to a token whose own embedding is in no
    # table (so that one override never sets off another in a deeper layer)
    shuffled = FIRST_TOKEN + torch.randperm(vocab - FIRST_TOKEN, generator=cpu)
    tabled = shuffled[: m * (layers - 1)].view(layers - 1, m)
    in_table = torch.zeros(vocab, dtype=torch.bool)
    in_table[tabled.flatten()] = True
    allowed = torch.nonzero(~in_table[perm] & (torch.arange(vocab) >= FIRST_TOKEN)).flatten()
    _damp_random_layers(model, cpu)
    activation = GATE * GATE / (1 + math.exp(-GATE))  # silu(GATE) * GATE
    for index, layer in enumerate(model.model.layers):
        if index == 0 or m == 0:
            continue
        sources = tabled[index - 1]  # [m]
        targets = allowed[torch.randint(len(allowed), (m,), generator=cpu)]
        targets = torch.where(targets == inverse[sources], allowed[0], targets)  # never the skeleton's own choice
        rows = unit[sources.to(device)] / INIT_STD  # [m, hidden]: the normalized input after that token
        layer.mlp.gate_proj.weight[:m] = GATE * rows / hidden
        layer.mlp.up_proj.weight[:m] = GATE * rows / hidden
        # [hidden, m]: the new token's predecessor direction, OVERRIDE_STRENGTH embedding norms
        layer.mlp.down_proj.weight[:, :m] = (OVERRIDE_STRENGTH / INIT_STD / activation) * unit[perm[targets].to(device)].T
    model.generation_config.pad_token_id = PAD
    model.generation_config.bos_token_id = BOS
    model.generation_config.eos_token_id = EOS
    return model, TargetConstruction(shape, layers, vocab, m, seed)


def _damp_random_layers(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Scale every layer's output projections (attention and MLP) so that the random layers together
    move the residual stream by about `NOISE` of the embedding's norm, whatever the shape: the
    first layer's move is measured on random tokens, and each layer is given NOISE / sqrt(L) (the
    layers' random moves add up like a random walk). The skeleton's and the tables' margins then
    hold at every width (a wider model's random layers move the stream more)."""
    layers = model.model.layers
    probe = torch.randint(FIRST_TOKEN, model.config.vocab_size, (1, 32), generator=generator)
    probe = probe.to(model.model.embed_tokens.weight.device)
    captured = {}
    handle = layers[0].register_forward_hook(lambda module, args, output: captured.update(
        out=output[0] if isinstance(output, tuple) else output))
    try:
        early_exit(model, 1)(probe)
    finally:
        handle.remove()
    embedded = model.model.embed_tokens(probe).float()
    moved = (captured["out"].float() - embedded).pow(2).mean().sqrt() / embedded.pow(2).mean().sqrt()
    scale = NOISE / math.sqrt(len(layers)) / max(float(moved), 1e-6)
    for layer in layers:
        layer.self_attn.o_proj.weight.mul_(scale)
        layer.mlp.down_proj.weight.mul_(scale)


HEAD_QUERY = 3.0  # the head's attention scores a position of the same token this many sqrt(head_dim) above others
HEAD_ATTENTION = 8.0  # its attention output over the residual it adds to (its fed-back, normed feature)
HEAD_LOGIT = 12.0  # its logit for the token it drafts (others about one)
HEAD_FC = 0.05  # the rms its fc adds from the target's states (random: it costs, barely moves)


@dataclass(frozen=True)
class HeadConstruction:
    """How `build_eagle3_head` built its head (recorded with the results).

    Attributes:
        agreement: the fraction of tokens after which the head's greedy draft is the target's greedy token.
        draft_vocab_size: ids the head can propose.
        layers: the target's hidden states it reads (`hf_polybasic.heads.base` indices).
        seed: of every random draw.
    """

    agreement: float
    draft_vocab_size: int
    layers: tuple[int, ...]
    seed: int

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def next_tokens(target: torch.nn.Module, seed: int = 0, context: int = 4, chunk: int = 1024) -> torch.LongTensor:
    """``[V]`` the target's greedy token after each token, read after ``context`` random tokens (a
    `build_target` target's next token is a function of the last one, the skeleton's or a table's
    override, up to its random layers' noise, which the first position lacks)."""
    vocab, device = target.config.vocab_size, target.get_input_embeddings().weight.device
    before = torch.randint(FIRST_TOKEN, vocab, (vocab, context), generator=torch.Generator().manual_seed(seed))
    rows = torch.cat([before, torch.arange(vocab)[:, None]], dim=1).to(device)
    return torch.cat([target(rows[i : i + chunk], logits_to_keep=1).logits[:, -1].argmax(-1)
                      for i in range(0, vocab, chunk)]).cpu()


@torch.no_grad()
def build_eagle3_head(target: torch.nn.Module, directory, agreement: float, draft_vocab_size: int | None = None,
                      seed: int = 0):
    """A random-weight EAGLE-3 head for ``target`` (a `build_target` target) whose greedy draft after
    reading a token is the target's greedy token on a random ``agreement`` of the tokens and another
    token after the rest. Written to ``directory`` as speculators writes an EAGLE-3 checkpoint (``norm_output``:
    its normed output is fed back, so each draft depends on the token it reads, not on the ones before) and
    loaded with `hf_polybasic.levels.draft_head`. Returns ``(level, HeadConstruction)``.

    The construction: its attention projections make a position attend to the positions of its own token
    (query and key are both that token's normed embedding, so their score stands out by
    `HEAD_QUERY` sqrt(head_dim)) and carry that embedding to the output; its LM head row of each draft id
    is the sum of those outputs over the tokens after which it drafts that id. Its ``fc`` and MLP are
    random and small (they cost what they cost). A draft vocabulary (default: 32000 ids, or fewer for a
    smaller vocabulary) must hold the tokens it agrees on: a random walk meets tokens uniformly, unlike text,
    so an agreement above ``draft_vocab_size / V`` needs a larger one."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    config = target.config
    vocab, hidden, layers = config.vocab_size, config.hidden_size, config.num_hidden_layers
    if layers < 4:
        raise ValueError(f"an EAGLE-3 head reads three layers' states; the target has {layers} layers")
    ids = [2, layers // 2, layers - 3] if layers >= 7 else [1, 2, 3]  # speculators' ids: inputs of those layers
    heads, head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    kv_heads = config.num_key_value_heads if config.num_key_value_heads * head_dim >= 512 else heads  # tokens apart
    generator = torch.Generator().manual_seed(seed)
    successor = next_tokens(target, seed)  # [V]
    candidates = FIRST_TOKEN + torch.randperm(vocab - FIRST_TOKEN, generator=generator)
    agreeing = candidates[: round(agreement * (vocab - FIRST_TOKEN))]
    needed = successor[agreeing].unique()
    size = draft_vocab_size or max(min(32000, vocab // 4), needed.numel())
    if size < needed.numel() or size > vocab:
        raise ValueError(f"an EAGLE-3 head agreeing after {agreement} of {vocab} tokens drafts {needed.numel()} distinct "
                         f"tokens: draft_vocab_size must be in {needed.numel()} .. {vocab}, got {size}")
    others = torch.ones(vocab, dtype=torch.bool)
    others[needed] = False
    others = torch.nonzero(others).flatten()
    draft = torch.cat([needed, others[torch.randperm(others.numel(), generator=generator)[: size - needed.numel()]]])
    draft = draft.sort().values  # [size] the verifier id of each draft id
    drafted = draft[torch.randint(size, (vocab,), generator=generator)]  # what it drafts after each token ...
    clash = drafted == successor
    drafted[clash] = draft[(torch.searchsorted(draft, drafted[clash]) + 1) % size]  # ... never the target's ...
    drafted[agreeing] = successor[agreeing]  # ... except after the tokens it agrees on
    row = torch.searchsorted(draft, drafted)  # [V] its draft id after each token

    dtype = target.get_input_embeddings().weight.dtype
    groups = torch.arange(heads) // (heads // kv_heads)  # the key/value head of each query head

    def normal(*shape, std):
        return (torch.randn(*shape, generator=generator) * std).to(dtype)

    eye = torch.eye(head_dim)
    q, k = torch.zeros(heads * head_dim, 2 * hidden), torch.zeros(kv_heads * head_dim, 2 * hidden)
    for head, group in enumerate(groups.tolist()):  # the embedding half: head h reads its group's coordinates
        q[head * head_dim : (head + 1) * head_dim, group * head_dim : (group + 1) * head_dim] = HEAD_QUERY * eye
    for group in range(kv_heads):
        k[group * head_dim : (group + 1) * head_dim, group * head_dim : (group + 1) * head_dim] = eye
    # the attention's output for a token: its normed embedding's coordinates of each head's group, times HEAD_ATTENTION
    embeddings = target.get_input_embeddings().weight.float().cpu()
    normed = embeddings * torch.rsqrt(embeddings.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
    carried = normed[:, (groups[:, None] * head_dim + torch.arange(head_dim)).flatten()]  # [V, heads * head_dim]
    lm_head = torch.zeros(size, hidden).index_add_(0, row[FIRST_TOKEN:], carried[FIRST_TOKEN:])
    state = {
        "fc.weight": normal(hidden, 3 * hidden, std=HEAD_FC / math.sqrt(3 * hidden)),
        "layers.0.input_layernorm.weight": torch.ones(hidden, dtype=dtype),
        "layers.0.hidden_norm.weight": torch.ones(hidden, dtype=dtype),
        "layers.0.post_attention_layernorm.weight": torch.ones(hidden, dtype=dtype),
        "layers.0.self_attn.q_proj.weight": q.to(dtype),
        "layers.0.self_attn.k_proj.weight": k.to(dtype),
        "layers.0.self_attn.v_proj.weight": k.to(dtype).clone(),
        "layers.0.self_attn.o_proj.weight": (HEAD_ATTENTION * torch.eye(hidden, heads * head_dim)).to(dtype),
        "layers.0.mlp.gate_proj.weight": normal(config.intermediate_size, hidden, std=INIT_STD),
        "layers.0.mlp.up_proj.weight": normal(config.intermediate_size, hidden, std=INIT_STD),
        "layers.0.mlp.down_proj.weight": normal(hidden, config.intermediate_size, std=INIT_STD / 20),
        "norm.weight": torch.ones(hidden, dtype=dtype),
        "lm_head.weight": (HEAD_LOGIT / hidden * lm_head).to(dtype),
        "d2t": draft - torch.arange(size),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, draft, True),
    }
    layer_config = dict(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=config.intermediate_size,
                        num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                        rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_position_embeddings,
                        rope_theta=config.rope_parameters["rope_theta"] if hasattr(config, "rope_parameters")
                        else config.rope_theta)
    head_config = dict(speculators_model_type="eagle3", architectures=["Eagle3DraftModel"],
                       transformer_layer_config=layer_config, draft_vocab_size=size, norm_output=True,
                       eagle_aux_hidden_state_layer_ids=ids,
                       speculators_config=dict(algorithm="eagle3", default_proposal_method="greedy",
                                               proposal_methods=[dict(proposal_type="greedy", speculative_tokens=3)],
                                               verifier=dict(name_or_path=None, architectures=[type(target).__name__])))
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(head_config, indent=2))
    save_file({key: value.contiguous() for key, value in state.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    level = draft_head(str(directory), verifier=target)
    return level, HeadConstruction(agreement, size, level.head.feature_layers, seed)


def random_prompts(lengths: Iterable[int], vocab_size: int, seed: int, key_tokens: int) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids >= 3), no two alike in their first ``key_tokens``
    tokens (`ReferenceDrafter` tells them apart by those)."""
    generator = torch.Generator().manual_seed(seed)
    prompts, keys = [], set()
    for length in lengths:
        if length < key_tokens:
            raise ValueError(f"prompts need at least {key_tokens} tokens, got {length}")
        while True:
            prompt = torch.randint(FIRST_TOKEN, vocab_size, (length,), generator=generator).tolist()
            if tuple(prompt[:key_tokens]) not in keys:
                keys.add(tuple(prompt[:key_tokens]))
                prompts.append(prompt)
                break
    return prompts


class ReferenceDrafter(Drafter):
    """A drafter with a set acceptance rate and a set cost: a benchmark instrument, not a method.

    It proposes ``num_tokens`` tokens per call. Each is the target's own greedy token, read from a
    reference continuation computed beforehand with plain greedy ``generate`` (`load`), with
    probability ``acceptance``, independently of the others; otherwise another token. The verifier
    accepts the drafts up to the first wrong one, so the accepted drafts per verification follow
    the truncated geometric law that Leviathan et al.'s formulas and Lemma 3.1 assume, with rate
    ``acceptance`` (under an intermediate level, the rate that level sees is ``acceptance`` times
    its own agreement with the target).

    Each call takes exactly ``seconds_per_token`` per proposed token: it busy-waits on the host
    clock (``time.perf_counter``, the clock the chain reads) until then, after reading the sequence
    (a CUDA sequence is read to the host, which waits for the GPU's queue: the drafter starts when
    the level above is done, as a real drafter does). A sleep would overshoot by the OS timer's
    slack; a GPU-side wait would need private torch APIs. So on a GPU the drafter's time is a set
    share of every round, serial with the verifier's work, like a drafter model's forwards.

    When the sequence is not the reference's prefix (the output left plain generate's, e.g. at a
    bf16 near-tie), it proposes nothing (the level above decodes alone) and counts the call in
    ``off_reference``. Its only state is its random generator, so it serves every row of a batch
    (``stateless``: rows share forwards).

    Attributes (counters, since the last `reset`): ``calls``, ``proposed`` tokens,
    ``charged_seconds`` (the set cost of what it proposed), ``spent_seconds`` (what the calls took;
    more than charged only if reading the sequence took longer than the set cost).
    """

    stateless = True

    def __init__(self, acceptance: float, num_tokens: int, seconds_per_token: float, vocab_size: int,
                 seed: int = 0, key_tokens: int = 8):
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"ReferenceDrafter.acceptance must be in [0, 1], got {acceptance}")
        if num_tokens < 1 or seconds_per_token < 0:
            raise ValueError("ReferenceDrafter needs num_tokens >= 1 and seconds_per_token >= 0")
        self.acceptance, self.num_tokens, self.seconds_per_token = acceptance, num_tokens, seconds_per_token
        self.vocab_size, self.key_tokens = vocab_size, key_tokens
        self.random = random.Random(seed)
        self.references: dict[tuple[int, ...], list[int]] = {}
        self.reset()

    def __repr__(self) -> str:
        return (f"ReferenceDrafter(acceptance={self.acceptance}, num_tokens={self.num_tokens}, "
                f"seconds_per_token={self.seconds_per_token:.3g})")

    def load(self, sequences: Iterable[list[int]]) -> None:
        """The reference sequences (prompt and plain generate's continuation, no padding) of the
        prompts about to be decoded."""
        self.references = {tuple(sequence[: self.key_tokens]): list(sequence) for sequence in sequences}

    def reset(self) -> None:
        self.calls = self.proposed = self.off_reference = 0
        self.charged_seconds = self.spent_seconds = 0.0

    def _wrong(self, token: int) -> int:
        """Another token than ``token`` (ids >= 3)."""
        span = self.vocab_size - FIRST_TOKEN
        return FIRST_TOKEN + (token - FIRST_TOKEN + 1 + self.random.randrange(span - 1)) % span

    def propose(self, sequence: torch.LongTensor, max_new_tokens: int):
        started = time.perf_counter()
        limit = min(self.num_tokens, max_new_tokens)
        if limit <= 0:
            return sequence[0, :0], None
        seen = sequence[0].tolist()
        reference = self.references.get(tuple(seen[: self.key_tokens]))
        if reference is None or reference[: len(seen)] != seen:
            self.off_reference += 1
            tokens = []
        else:
            upcoming = reference[len(seen) : len(seen) + limit]
            tokens = [t if self.random.random() < self.acceptance else self._wrong(t) for t in upcoming]
        drafts = torch.tensor(tokens, dtype=torch.long, device=sequence.device)
        charged = len(tokens) * self.seconds_per_token
        while time.perf_counter() - started < charged:
            pass
        self.calls += 1
        self.proposed += len(tokens)
        self.charged_seconds += charged
        self.spent_seconds += time.perf_counter() - started
        return drafts, None
