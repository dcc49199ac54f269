"""`PolybasicConfig`: what the user sets, validated on construction.

Mapping to the paper (Wang et al., ICML 2025, Algorithm 1), for a chain M1 > M2 > ... > Mn
(M1 = the target, ``assistant_models = [M2, ..., Mn]``):

* ``num_draft_tokens`` is the paper's **K**: how many tokens the bottom model Mn drafts per round.
* ``block_threshold`` is the paper's **mu**, one value per *intermediate* level M2 .. M(n-1):
  such a level keeps verifying drafts from the level below until it holds at least mu verified
  tokens (or hits EOS or the length budget), then hands the whole block up. A single int applies
  to every intermediate level. With two models (target + one assistant) there is no intermediate
  level and mu is unused.
* **L_i** (mean acceptance length) and **F_i** (forward passes) are not settings but measurements:
  see `hf_polybasic.stats.LevelStats`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .compat import mark_as_user_config

VERIFICATION_RULES = ("auto", "greedy")
# the largest K / mu a varying schedule may reach (or the configured value, if larger)
MAX_DRAFT_TOKENS = 16
MAX_BLOCK_THRESHOLD = 32

GENERATION_CONFIG_KEY = "polybasic_config"

# the per-level schedules (`hf_polybasic.schedule`): how many tokens a level proposes per round
SCHEDULES = ("constant", "heuristic", "cost_aware")


@dataclass(frozen=True)
class PolybasicConfig:
    """Settings of a polybasic chain. Every combination that validates is lossless.

    Attributes:
        num_draft_tokens: K, tokens the bottom model drafts per round (>= 1).
        block_threshold: mu, verified tokens an intermediate level accumulates before the level
            above verifies them; an int for every intermediate level, or a sequence with one value
            per intermediate level, strongest first (>= 1 each).
        verification: how *intermediate* levels verify the stream below them. ``"auto"`` follows
            the target: greedy match under ``do_sample=False``, speculative sampling otherwise.
            ``"greedy"`` makes intermediate levels always pass up their argmax tokens; under
            sampling they then hand up a point-mass proposal, which the level above verifies with
            the point-mass rule, so the output distribution is still exactly the target's.
            The target itself always follows ``do_sample``.
        schedule: how K and mu move during generation (`hf_polybasic.schedule`): ``"constant"``
            keeps them as set; ``"heuristic"`` is transformers' assisted-generation rule (+2 after
            a fully accepted proposal, -1 otherwise); ``"cost_aware"`` picks, after every
            verification, the length that maximises expected tokens per second from the running
            acceptance rate and the measured costs. K and mu are then the starting values; they
            move within 1 .. max(16, K) and 1 .. max(32, mu). ``"cost_aware"`` is the default
            because it was the fastest on every chain of the benchmark (docs: Benchmarks). Every
            schedule is lossless; ``"cost_aware"`` depends on timings, so sampled outputs are not
            bit-reproducible from a seed with it: use ``"constant"`` or ``"heuristic"`` for that.
        prompt_lookup: True puts a `hf_polybasic.drafters.PromptLookup` below the *model* at the bottom
            of the chain: a free level that drafts by copying what followed the last three tokens
            earlier in the prompt or the text so far (after shorter matches it copies wrongly too
            often). The chain's last model then verifies those copies in one forward instead of
            drafting token by token; under the constant and heuristic schedules the lookup drafts K
            tokens per round and that model, now an intermediate level, hands up blocks of the
            config's last mu; the cost-aware schedule sizes both itself and sits the lookup out
            where its copies are not accepted. It pays where outputs copy their input
            (code edits, summaries, retrieval); off by default because elsewhere the extra level costs
            more than it saves (docs: Benchmarks). A chain whose bottom already is a `Drafter` is
            left alone.
        drafter_vocabulary: the bottom *model* of the chain drafts through
            `hf_polybasic.levels.restricted_vocabulary` with this many ids (the first ones, plus
            special ids and every token of the text) when its output layer has at least twice as
            many: its steps skip most of its largest matrix (Qwen2.5's 151,936 ids: a 0.5B int8
            step 44 -> 37 ms) while it keeps 99 % of its agreement with the target. Lossless (the
            level above decides every token; docs: Build the levels); greedy, also above a
            `Drafter` (a `PromptLookup`), whose copies it verifies by its restricted argmax, which
            the level above decides in turn. Left as given: a model above a `Drafter` when sampling
            (a level that verifies by sampling must keep every token the processors allow), one with
            forward hooks of its own (accelerate's offloading), one whose output layer is of another
            kind. None: always the model as given.
        few_row_products: True: on the CPU, each model of the chain runs its forwards through a view
            of it (`hf_polybasic.models.few_rows.few_row_view`; the same weights, nothing copied, the
            model unchanged) whose linear layers compute 2 to 64 rows as ``(W @ x.T).T`` where a probe
            on this machine measures that faster than ``nn.Linear``. Exact products summed in another
            order, as a k-token forward's already are. Off by default: on a real AVX2 CPU it made a
            verification of 1 to 4 drafts cost 1.1 - 1.5 steps instead of 2 - 3 (fp32 as loaded), but
            the default chain through it was not faster on held-out prompts (docs: Speed on your machine).
        compile: run every model of the chain that can (`hf_polybasic.runners.probe.static_problem`) on a static
            cache with its forwards compiled by ``torch.compile`` (on a GPU as CUDA graphs, mode
            ``"reduce-overhead"``): one graph per padded width (`hf_polybasic.runners.static.WIDTHS`), made once
            per model and reused by later calls. ``"auto"`` (default): for models on a CUDA device;
            True: everywhere (on the CPU too, without graphs); False: never. A model that cannot keeps
            the dynamic cache, with a warning naming why. Exact either way (docs: Speed on a GPU).
        measure_costs: under ``"cost_aware"``, measure a model's forward costs on this machine the
            first time it is used (~25 forwards, kept on disk: `hf_polybasic.costs`). False: use
            stored curves only (``hf-polybasic costs`` measures ahead), else the call's own timings;
            so does ``HF_POLYBASIC_MEASURE_COSTS=0``.
        draft_alternatives: greedy, in the rounds a model drafter proposes to the target (a chain of
            two models; the bypassed and dropped rounds of a gated chain of three): at each drafted
            position the target also scores this many of the drafter's next-best tokens, in the same
            forward, each as a one-token branch; where it rejects a draft for one of them the round
            emits one token more (`hf_polybasic.decoding.alternatives`). Exact: every token is still
            the target's argmax. ``"auto"`` (default): 3, in the rounds where the target's measured
            cost curve says the wider forward pays (flat costs: bf16 on AVX-512 with AMX), under the
            cost-aware schedule; else none. An int: that many in every round (0: never); a chain that
            cannot (sampling, an ungated intermediate level, a batch, a GPU, a static cache, attention
            that takes no 4-D mask, windowed layers, a draft head) is refused with the reason.
    """

    num_draft_tokens: int = 4
    block_threshold: int | tuple[int, ...] = 8
    verification: Literal["auto", "greedy"] = "auto"
    schedule: Literal["constant", "heuristic", "cost_aware"] = "cost_aware"
    prompt_lookup: bool = False
    drafter_vocabulary: int | None = 65536
    few_row_products: bool = False
    compile: bool | Literal["auto"] = "auto"
    measure_costs: bool = True
    draft_alternatives: int | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        k = self.num_draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"PolybasicConfig.num_draft_tokens (K) must be an int >= 1, got {k!r}")
        mu = self.block_threshold
        if isinstance(mu, (list, tuple)):
            mu = tuple(mu)
            object.__setattr__(self, "block_threshold", mu)
            values = mu
            if not values:
                raise ValueError("PolybasicConfig.block_threshold (mu) must not be an empty sequence")
        else:
            values = (mu,)
        for value in values:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"PolybasicConfig.block_threshold (mu) must be an int >= 1 or a sequence of them, got {mu!r}"
                )
        if self.verification not in VERIFICATION_RULES:
            raise ValueError(
                f"PolybasicConfig.verification must be one of {VERIFICATION_RULES}, got {self.verification!r}"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(f"PolybasicConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not isinstance(self.prompt_lookup, bool):
            raise ValueError(f"PolybasicConfig.prompt_lookup must be True or False, got {self.prompt_lookup!r}")
        size = self.drafter_vocabulary
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(
                f"PolybasicConfig.drafter_vocabulary must be None or an int >= 1 (ids the bottom model drafts from), "
                f"got {size!r}"
            )
        if not isinstance(self.few_row_products, bool):
            raise ValueError(f"PolybasicConfig.few_row_products must be True or False, got {self.few_row_products!r}")
        if self.compile != "auto" and not isinstance(self.compile, bool):
            raise ValueError(f"PolybasicConfig.compile must be 'auto', True or False, got {self.compile!r}")
        if not isinstance(self.measure_costs, bool):
            raise ValueError(f"PolybasicConfig.measure_costs must be True or False, got {self.measure_costs!r}")
        count = self.draft_alternatives
        if count != "auto" and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
            raise ValueError(
                f"PolybasicConfig.draft_alternatives must be 'auto' or an int >= 0 (next-best tokens per draft), "
                f"got {count!r}"
            )

    def compiles(self, device: torch.device | str) -> bool:
        """Whether a model on ``device`` runs compiled (``compile``; ``"auto"``: on CUDA devices)."""
        if self.compile == "auto":
            return torch.device(device).type == "cuda"
        return bool(self.compile)

    @property
    def last_threshold(self) -> int:
        """The mu of the weakest intermediate level (an int's value, else the sequence's last)."""
        mu = self.block_threshold
        return mu if isinstance(mu, int) else mu[-1]

    def thresholds_for(self, num_intermediate_levels: int) -> tuple[int, ...]:
        """mu for each intermediate level, strongest first; errors if a sequence has the wrong length."""
        mu = self.block_threshold
        if isinstance(mu, int):
            return (mu,) * num_intermediate_levels
        if len(mu) != num_intermediate_levels:
            raise ValueError(
                f"PolybasicConfig.block_threshold has {len(mu)} values but the chain has "
                f"{num_intermediate_levels} intermediate level(s) (assistant_models minus the bottom drafter); "
                "give one mu per intermediate level or a single int"
            )
        return mu

    # --- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (lists for sequences)."""
        out = dataclasses.asdict(self)
        if isinstance(out["block_threshold"], tuple):
            out["block_threshold"] = list(out["block_threshold"])
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PolybasicConfig:
        """Inverse of `to_dict`; unknown keys are an error, not silently dropped."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"PolybasicConfig has no field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**data)

    def to_json(self) -> str:
        """`to_dict` as a JSON string (sorted keys)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PolybasicConfig:
        """Inverse of `to_json`."""
        return cls.from_dict(json.loads(text))

    def save_to(self, generation_config) -> None:
        """Store this config as the default in a `GenerationConfig` (saved with `save_pretrained`).

        The generation config stops counting as derived from the model config: transformers drops
        custom entries when it reloads a config marked ``_from_model_config``.
        """
        setattr(generation_config, GENERATION_CONFIG_KEY, self.to_dict())
        mark_as_user_config(generation_config)

    @classmethod
    def from_generation_config(cls, generation_config) -> PolybasicConfig | None:
        """The config stored by `save_to`, or None if the generation config holds none."""
        stored = getattr(generation_config, GENERATION_CONFIG_KEY, None)
        if stored is None:
            return None
        if isinstance(stored, PolybasicConfig):
            return stored
        if isinstance(stored, dict):
            return cls.from_dict(stored)
        raise TypeError(
            f"generation_config.{GENERATION_CONFIG_KEY} must be a dict written by PolybasicConfig.save_to, "
            f"got {type(stored).__name__}"
        )
