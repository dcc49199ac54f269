"""Trained draft heads (EAGLE-1/2/3, native MTP layers): the modules and the formats they are published in.
How a head runs as a level of a chain: `hf_polybasic.runners.head`; the public entry: `hf_polybasic.levels.draft_head`."""

from __future__ import annotations


def draft_head(source, *, verifier):
    """A trained draft head as a level of a chain, for ``assistant_models=[...]``.

    ``source``: a local directory or a Hub id of a head checkpoint (EAGLE-1/2 and EAGLE-3 as SafeAILab
    and SpecForge publish them, and the speculators format: `hf_polybasic.heads.formats`), or ``"mtp"``
    for ``verifier``'s own multi-token-prediction layers (transformers' `MtpModel`). ``verifier``: the
    model the head was trained for (its embeddings and, where the format says so, its LM head are
    shared, never copied; nothing of it changes). The head drafts from the hidden states of whichever
    model sits right above it in the chain: the target, or a middle level such as
    ``quantized_copy(verifier, ...)`` (the paper's system: target, its 4-bit copy, a head)."""
    from ..runners.head import HeadModel

    if isinstance(source, str) and source == "mtp":
        from .mtp import mtp_head

        name = getattr(verifier.config, "name_or_path", "") or type(verifier).__name__
        return HeadModel(mtp_head(verifier), name=f"mtp of {name}", verifier=verifier)
    from .formats import load_head

    return HeadModel(load_head(source, verifier), name=str(source), verifier=verifier)
