"""`leapdecode train eagle`: an EAGLE-3-style head on a frozen target, by self-distillation.

Each batch runs the target once over [B, T+1] tokens for its aux hidden states (the layers
the head reads) and its next-token distributions. The head then unrolls `ttt_steps` steps
of the training-time test (models/eagle.py `ttt_forward`): step 0 drafts from the
target's real features, step j from the head's own output of step j-1, the way it drafts
at depth j+1. Every step learns the target's distribution over the draft vocabulary
(soft labels, renormalised over the draft's tokens), weighted 0.8^j. Accuracy by depth is
measured on held-out windows the same way (greedy: the head's top token equals the target's
greedy token, on the chain of its own features).

With `parallel=k` (`leapdecode train peagle`) the head learns P-EAGLE's parallel drafting
instead: one forward per window lays out the real pairs and k - 1 mask slots after every
anchor (models/eagle.py `parallel_forward`); block j learns the target's distribution j
tokens further on, weighted 0.8^j, and accuracy is measured by block the same way.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import LeapDecodeError
from ..models.eagle import Eagle3Head, default_aux_layers
from .data import batch_at
from .features import Labeller
from .teacher import TargetTables, Teacher, fit, soft_ce


def draft_vocabulary(tokens: np.ndarray, vocab: int, size: int) -> torch.Tensor:
    """The `size` most frequent token ids of the training stream, sorted (the draft vocab)."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab)[:vocab]
    ranked = np.argsort(-counts, kind="stable")[: min(size, vocab)]
    return torch.from_numpy(np.sort(ranked)).long()


def new_head(teacher: Teacher | TargetTables, draft_ids: torch.Tensor) -> Eagle3Head:
    cfg = teacher.config
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or teacher.hidden // heads)
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    head = Eagle3Head(
        teacher.hidden,
        teacher.hidden,
        heads,
        int(getattr(cfg, "num_key_value_heads", heads)),
        head_dim,
        int(cfg.intermediate_size),
        teacher.vocab,
        draft_ids,
        default_aux_layers(teacher.layers),
        theta,
        int(cfg.max_position_embeddings) + 2,
        float(cfg.rms_norm_eps),
    )
    with torch.no_grad():  # start from the target's own output rows for the draft tokens
        head.lm_head.weight.copy_(teacher.output_weight[draft_ids])
    return head


def _labels(head: Eagle3Head, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distribution renormalised over the draft vocabulary [.., Vd], and its
    greedy token as a draft id (-1 where it is outside the draft vocabulary)."""
    q = torch.softmax(logits[..., head.draft_ids], dim=-1)  # [B, T, Vd]: p renormalised
    to_draft = torch.full((logits.shape[-1],), -1, dtype=torch.long)
    to_draft[head.draft_ids] = torch.arange(head.draft_vocab_size)
    return q, to_draft[logits.argmax(-1)]


def _unroll(head: Eagle3Head, teacher: Teacher, b: torch.Tensor, steps: int):
    """b [B, T+1] -> (per-step draft logits [B, T, Vd], labels q [B, T, Vd], greedy [B, T]),
    aligned: step j's logits at [:, t] are scored by the labels at [:, t] (ttt steps: the
    first j indices have no chain; parallel blocks: the last j have no label). The teacher
    runs the batch here; `unroll_features` is the same from features kept on disk."""
    aux, _, logits = teacher.run(b, head.aux_layers)  # aux [B, T+1, n, H]
    q, greedy = _labels(head, logits[:, 1:])  # the target's guess for the token after that
    return _unroll_from(head, aux, teacher.embed, b, q, greedy, steps)


def unroll_features(head: Eagle3Head, f, embed, labeller, steps: int):
    """`_unroll` from a batch of features.Features: labels from the kept final hidden states
    through the target's LM head rows of the draft vocabulary (`labeller`)."""
    q, greedy = labeller(f.final[:, 1:], f.greedy[:, 1:])
    return _unroll_from(head, f.aux.float(), embed, f.tokens, q, greedy, steps)


def _unroll_from(head: Eagle3Head, aux, embed, b, q, greedy, steps: int):
    """aux [B, T+1, n, H] of the window b [B, T+1]; q, greedy: labels at indices 1..T."""
    emb = embed(b[:, 1:])  # [B, T, H] the token after each feature
    if head.parallel:  # block j at anchor t guesses what the labels hold at t + j
        mask_emb = embed(torch.tensor([[head.pard_token]]))[0, 0]  # [H]
        outs = head.parallel_forward(aux[:, :-1], emb, steps, mask_emb)
        t = emb.shape[1]
        return [(o[:, : t - j], q[:, j:], greedy[:, j:]) for j, o in enumerate(outs)]
    outs = head.ttt_forward(aux[:, :-1], emb, steps)
    return [(o[:, j:], q[:, j:], greedy[:, j:]) for j, o in enumerate(outs)]


def eagle_loss(unroll):
    """The training step of a head: unroll(batch) -> its steps (see `_unroll`)."""

    def step(b):
        total, metrics = 0.0, {}
        for j, (logits, q, greedy) in enumerate(unroll(b)):
            total = total + 0.8**j * soft_ce(logits.flatten(0, 1), q.flatten(0, 1))
            metrics[f"acc{j + 1}"] = float((logits.argmax(-1) == greedy).float().mean())
        return total, metrics

    return step


def make_parallel(head: Eagle3Head, k: int, tokens: np.ndarray) -> Eagle3Head:
    """The head with P-EAGLE's mask slots, trained for k: where it has none, `mask_hidden`
    starts at zero and the mask token is the training stream's least frequent one."""
    if not head.parallel:
        n = len(head.aux_layers) * head.target_hidden
        head.mask_hidden = torch.nn.Parameter(torch.zeros(n))
        counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=head.vocab_size)
        head.pard_token = int(np.argmin(counts[: head.vocab_size]))
    head.parallel = k
    return head


@torch.no_grad()
def measure(unrolled, steps: int) -> dict:
    """Held-out accuracy by draft depth (top-1 and top-4), and the share of target greedy
    tokens the draft vocabulary covers, over held-out batches (`_unroll`'s results, made as
    this iterates)."""
    top1, top4, covered, n, k = np.zeros(steps), np.zeros(steps), 0, 0, 0
    for batch in unrolled:
        k += 1
        for j, (logits, _, greedy) in enumerate(batch):
            if j == 0:
                covered += int((greedy >= 0).sum())
                n += greedy.numel()
            top = logits.topk(4, dim=-1).indices
            g = greedy[..., None]
            top1[j] += float((top[..., :1] == g).float().mean())
            top4[j] += float((top == g).any(-1).float().mean())
    return {
        "top1_by_depth": (top1 / k).round(4).tolist(),
        "top4_by_depth": (top4 / k).round(4).tolist(),
        "draft_vocab_coverage": round(covered / n, 4),
    }


def held_out(tokens: np.ndarray, windows: int = 16, context: int = 256):
    """The held-out batches `measure` scores: 4 windows at a time, a fixed draw."""
    context = min(context, len(tokens) - 2)
    for w in range(0, windows, 4):
        yield torch.from_numpy(batch_at(tokens, w, 4, context, seed=777))


def init_head(teacher: Teacher, path: str) -> Eagle3Head:
    """A trained head to continue from (`--init`): it must read this target's layers."""
    head = Eagle3Head.load(path)
    if (head.target_hidden, head.vocab_size) != (teacher.hidden, teacher.vocab) or max(
        head.aux_layers
    ) >= teacher.layers:
        raise LeapDecodeError(
            f"--init {path!r} is a head for another target (hidden {head.target_hidden}, "
            f"vocabulary {head.vocab_size}, layers {list(head.aux_layers)}; this target: "
            f"hidden {teacher.hidden}, vocabulary {teacher.vocab}, {teacher.layers} layers): "
            "pass a head trained for this target, or leave --init out to start afresh"
        )
    head.info = {}
    return head.train()


def train_eagle(
    teacher: Teacher,
    train_tokens,
    val_tokens,
    *,
    draft_vocab: int,
    ttt_steps: int,
    steps: int,
    batch: int,
    context: int,
    lr: float,
    run_dir: str,
    seed: int = 0,
    stamp: dict | None = None,
    init: str | None = None,
    parallel: int = 0,
    features=None,
    val_features=None,
    budget_s: float | None = None,
    bf16: bool = False,
):
    """Returns (trained head with its held-out accuracy, training summary). init: a head
    folder to continue from (its weights and draft vocabulary) instead of a new head;
    parallel: train P-EAGLE's parallel drafting of that many drafts (ttt_steps is then it);
    features, val_features: train and measure from features kept on disk
    (features.FeatureShards of the token streams' windows; the teacher is then a
    teacher.TargetTables); budget_s: at most this many seconds of training; bf16: its forward
    under bfloat16 autocast (teacher.fit)."""
    import hashlib

    torch.manual_seed(seed)
    if init:
        head = init_head(teacher, init)
    else:
        head = new_head(teacher, draft_vocabulary(train_tokens, teacher.vocab, draft_vocab))
    if parallel:
        head = make_parallel(head, parallel, train_tokens)
        ttt_steps = parallel
    elif head.parallel:  # --init a parallel head: continue its EAGLE layer as a chain head
        head.parallel = 0
        del head.mask_hidden
    vocab_digest = hashlib.sha256(head.draft_ids.numpy().tobytes()).hexdigest()[:16]
    kind = "peagle" if parallel else "eagle"
    stamp = {**(stamp or {}), "kind": kind, "ttt_steps": ttt_steps, "draft_vocab": vocab_digest}
    if init:  # a run folder continues only the run it began with these weights
        weights = hashlib.sha256()
        for v in head.state_dict().values():
            weights.update(v.detach().numpy().tobytes())
        stamp["init"] = weights.hexdigest()[:16]
    if features is None:  # the teacher runs every batch

        def unroll(b):
            return _unroll(head, teacher, b, ttt_steps)

        batches, val = None, held_out(val_tokens)
    else:  # features kept on disk (train/features.py); the teacher is its TargetTables
        labeller = Labeller(teacher.output_weight, head.draft_ids)

        def unroll(f):
            return unroll_features(head, f, teacher.embed, labeller, ttt_steps)

        def batches(step):
            return features.batch(step, batch, seed)

        val = (val_features.batch(w, 4, seed=777) for w in range(0, 16, 4))
        context = int(features.manifest["context"])
        stamp["features"] = features.manifest["stamp"]
    summary = fit(
        head,
        eagle_loss(unroll),
        train_tokens,
        steps=steps,
        batch=batch,
        context=context,
        lr=lr,
        run_dir=run_dir,
        desc=kind,
        seed=seed,
        stamp=stamp,
        batches=batches,
        budget_s=budget_s,
        bf16=bf16,
    )
    if init:
        summary["init"] = init
    head.info["accuracy"] = measure((unroll(b) for b in val), ttt_steps)
    return head, summary
