"""Distilling a draft head on its verifier's own states: the loss, one step, a short loop.

The verifier is the teacher: for each text, one forward gives its hidden states (the head's real
features) and its next-token distributions. The head is trained as it drafts: a first pass reads the
real features (head position ``j``: the token at ``j + 1`` and the feature of ``j``, predicting the
token at ``j + 2``), and each further pass reads the head's own outputs of the pass before in place of
the features past the first position (what it reads while drafting several tokens; EAGLE-3's
"training-time test"). The loss is the KL divergence from the verifier's distribution to the head's,
averaged over passes; over the verifier's whole vocabulary, or over the head's draft vocabulary
(`head_loss` with ``draft=True``: both distributions renormalised over the ids the head can propose, as
speculators trains EAGLE-3, with no vocabulary-wide tensor). Nothing of the verifier is trained (it
runs under ``no_grad``, and parameters a head shares with it are left out) and no module's train/eval
mode is touched.
"""

from __future__ import annotations

import torch


def teacher(verifier, input_ids: torch.LongTensor, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The verifier's real features ``[B, L, F]`` (its hidden states ``layers`` selects, concatenated)
    and its next-token log-probabilities ``[B, L, V]`` over ``input_ids`` ``[B, L]``."""
    with torch.no_grad():
        outputs = verifier(input_ids=input_ids, output_hidden_states=True)
        features = torch.cat([outputs.hidden_states[layer] for layer in layers], dim=-1)
        return features, outputs.logits.float().log_softmax(-1)


def head_loss(head, input_ids: torch.LongTensor, features: torch.Tensor, teacher_log_probs: torch.Tensor,
              passes: int = 2, draft: bool = False) -> torch.Tensor:
    """The distillation loss of ``head`` on ``input_ids`` ``[B, L]`` (L >= 3) given the verifier's real
    ``features`` ``[B, L, F]`` and ``teacher_log_probs`` ``[B, L, V]``: the mean KL(verifier || head) of
    the token after each head position, over ``passes`` passes (see the module docstring). ``draft``:
    ``teacher_log_probs`` are over the head's draft vocabulary ``[B, L, draft_vocab]`` (an EAGLE-3 head's
    ``draft_ids``, renormalised there), and so are the head's."""
    tokens = input_ids[:, 1:]  # [B, L - 1]: head position j reads the token at j + 1
    n = tokens.shape[1] - 1  # positions whose next token (at j + 2) is in the text
    dtype = next(p.dtype for p in head.parameters() if p.is_floating_point())
    real = head.project(features[:, :n].to(dtype))  # [B, n, hidden]
    positions = torch.arange(n, device=input_ids.device).expand(tokens.shape[0], n) + head.position_offset
    target = teacher_log_probs[:, 1 : n + 1]  # [B, n, V]: the verifier's distribution of the token at j + 2
    forward = head.draft_forward if draft else head
    fed, total = real, 0.0
    for _ in range(passes):
        logits, hidden = forward(tokens[:, :n], fed, position_ids=positions, attention_mask=None, cache=None,
                                 use_cache=False)
        log_q = logits[..., : target.shape[-1]].float().log_softmax(-1)
        log_q = torch.where(torch.isfinite(log_q), log_q, torch.full_like(log_q, -1e4))  # ids the head cannot propose
        total = total + torch.nn.functional.kl_div(log_q, target, log_target=True, reduction="batchmean") / n
        # the next pass reads its own output at j - 1 as the feature of j (the first position keeps its real one)
        fed = torch.cat([real[:, :1], hidden[:, :-1]], dim=1)
    return total / passes


def distill(head, verifier, texts: torch.LongTensor, steps: int = 200, lr: float = 3e-3, passes: int = 2,
            batch_size: int = 8, seed: int = 0) -> list[float]:
    """Train ``head`` (in place) for ``steps`` Adam steps on ``texts`` ``[N, L]`` (token ids the verifier
    reads, e.g. its own samples), batches of ``batch_size`` drawn with ``seed``; returns the losses.
    The verifier's states are computed once per text."""
    generator = torch.Generator().manual_seed(seed)
    features, log_probs = teacher(verifier, texts, head.feature_layers)
    shared = {id(p) for p in verifier.parameters()}  # the verifier's own (MTP layers hold its embeddings): never trained
    trainable = [p for p in head.parameters() if p.requires_grad and id(p) not in shared]
    optimizer = torch.optim.Adam(trainable, lr=lr)
    losses = []
    for _ in range(steps):
        batch = torch.randint(0, texts.shape[0], (min(batch_size, texts.shape[0]),), generator=generator)
        loss = head_loss(head, texts[batch], features[batch], log_probs[batch], passes)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
