"""`leapdecode train medusa`: Medusa-1 heads on a frozen target, by self-distillation.

Head i learns, from the target's normed last hidden state at token t, the target's own
next-token distribution at t + i (soft labels: the target's probabilities given the true
prefix, Medusa-2's self-distillation), weighted 0.8^(i-1) as in Medusa. The heads are then
measured on held-out windows: how often head i's rank-r token is the target's greedy
token there. Those accuracies choose the static tree (models/medusa.py) and go in the
model card.
"""

from __future__ import annotations

import numpy as np
import torch

from ..models.medusa import MedusaHeads, build_tree
from .data import batch_at
from .teacher import Teacher, soft_ce

RANKS = 10  # ranks measured per head


def medusa_loss(heads: MedusaHeads, teacher: Teacher):
    def step(b: torch.Tensor):
        tokens = b[:, :-1]  # [B, T]
        _, final, logits = teacher.run(tokens)
        p = torch.softmax(logits, dim=-1)  # [B, T, V]
        z = heads(final)  # [B, T, K, H]
        total, metrics = 0.0, {}
        for i in range(1, heads.num_heads + 1):
            head_logits = teacher.head(z[:, :-i, i - 1])  # [B, T-i, V] guesses token t+1+i
            target = p[:, i:]  # the target's distribution for that token
            total = total + 0.8 ** (i - 1) * soft_ce(
                head_logits.flatten(0, 1), target.flatten(0, 1)
            )
            hit = head_logits.argmax(-1) == target.argmax(-1)
            metrics[f"acc{i}"] = float(hit.float().mean())
        return total, metrics

    return step


@torch.no_grad()
def measure(
    heads: MedusaHeads, teacher: Teacher, tokens: np.ndarray, windows: int = 16, context: int = 256
) -> list[list[float]]:
    """accuracy[i][r]: share of held-out positions where head i+1's rank-r token is the
    target's greedy token."""
    context = min(context, len(tokens) - 2)
    hits = torch.zeros(heads.num_heads, RANKS)
    total = torch.zeros(heads.num_heads)
    for w in range(0, windows, 4):
        b = torch.from_numpy(batch_at(tokens, w, 4, context, seed=777))[:, :-1]
        _, final, logits = teacher.run(b)
        greedy = logits.argmax(-1)  # [B, T]
        z = heads(final)
        for i in range(1, heads.num_heads + 1):
            top = teacher.head(z[:, :-i, i - 1]).topk(RANKS, dim=-1).indices  # [B, T-i, R]
            hits[i - 1] += (top == greedy[:, i:, None]).flatten(0, 1).float().sum(0)
            total[i - 1] += top.shape[0] * top.shape[1]
    return (hits / total[:, None]).tolist()


def train_medusa(
    teacher: Teacher,
    train_tokens,
    val_tokens,
    *,
    num_heads: int,
    steps: int,
    batch: int,
    context: int,
    lr: float,
    run_dir: str,
    seed: int = 0,
    stamp: dict | None = None,
):
    """Returns (trained heads with accuracies and tree, training summary)."""
    from .teacher import fit

    torch.manual_seed(seed)
    heads = MedusaHeads(num_heads, teacher.hidden)
    stamp = {**(stamp or {}), "kind": "medusa", "heads": num_heads}
    summary = fit(
        heads,
        medusa_loss(heads, teacher),
        train_tokens,
        steps=steps,
        batch=batch,
        context=context,
        lr=lr,
        run_dir=run_dir,
        desc="medusa",
        seed=seed,
        stamp=stamp,
    )
    heads.accuracy = measure(heads, teacher, val_tokens)
    heads.tree = build_tree(heads.accuracy)
    return heads, summary
