"""hf_polybasic: polybasic (multi-model) speculative decoding inside Hugging Face `model.generate`.

Importing this package patches nothing. Use either transformers' own extension point::

    out = target.generate(**inputs, custom_generate=hp.generate, assistant_models=[mid, draft])

or opt in once per model with `enable`::

    hp.enable(target)
    out = target.generate(**inputs, assistant_models=[mid, draft], polybasic_config=hp.PolybasicConfig())

To choose the chain, K and mu from measurements, profile a pool and plan::

    plan = hp.plan(hp.profile(target, {"mid": mid, "draft": draft}, tokenizer, prompts))
    out = target.generate(**inputs, custom_generate=hp.generate, assistant_models=plan.assistant_models,
                          polybasic_config=plan.config)
"""

from . import drafters, levels
from .assisted import assisted_generate
from .candidates import PolybasicCandidateGenerator
from .config import PolybasicConfig
from .generation import PolybasicGenerateOutput, disable, enable, generate, last_stats
from .levels import restricted_vocabulary
from .planning import Plan, Profile, plan, profile
from .stats import LevelStats, PolybasicStats

__all__ = [
    "assisted_generate",
    "drafters",
    "levels",
    "LevelStats",
    "Plan",
    "PolybasicCandidateGenerator",
    "PolybasicConfig",
    "PolybasicGenerateOutput",
    "PolybasicStats",
    "Profile",
    "disable",
    "enable",
    "generate",
    "last_stats",
    "plan",
    "profile",
    "restricted_vocabulary",
]
__version__ = "0.1.0"
