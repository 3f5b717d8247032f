"""The training loop shared by the target (cross-entropy) and the draft (distillation).

Resumable: a checkpoint (model, optimizer, step) is written atomically every
`checkpoint_every` steps; batches are a pure function of (seed, step), so a killed run
restarted with the same command continues exactly where it stopped.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from .data import batch_at


@dataclass
class TrainConfig:
    steps: int = 520
    batch: int = 8
    context: int = 1024
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 25
    bf16: bool = True
    threads: int = 0  # 0 = torch's default
    ce_weight: float = 0.0  # distillation only: share of plain cross-entropy in the loss


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def _autocast(cfg: TrainConfig):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16)


def loss_fn(model, batch: torch.Tensor, cfg: TrainConfig, teacher=None) -> torch.Tensor:
    """Cross-entropy, or forward KL to the teacher's next-token distribution (+ CE share)."""
    inputs, labels = batch[:, :-1], batch[:, 1:]
    with _autocast(cfg):
        logits = model(input_ids=inputs).logits
    logits = logits.float().flatten(0, 1)  # [B*T, V]
    ce = F.cross_entropy(logits, labels.flatten())
    if teacher is None:
        return ce
    with torch.no_grad(), _autocast(cfg):
        t_logits = teacher(input_ids=inputs).logits
    t_logp = F.log_softmax(t_logits.float().flatten(0, 1), dim=-1)
    s_logp = F.log_softmax(logits, dim=-1)
    kl = F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean")  # KL(teacher || student)
    return (1 - cfg.ce_weight) * kl + cfg.ce_weight * ce


@torch.no_grad()
def eval_loss(model, tokens: np.ndarray, cfg: TrainConfig) -> float:
    """Mean cross-entropy (nats/token) on fixed validation windows."""
    model.eval()
    total = 0.0
    for i in range(cfg.eval_batches):
        b = torch.from_numpy(batch_at(tokens, i, max(1, cfg.batch // 2), cfg.context, seed=12345))
        with _autocast(cfg):
            logits = model(input_ids=b[:, :-1]).logits
        total += float(F.cross_entropy(logits.float().flatten(0, 1), b[:, 1:].flatten()))
    model.train()
    return total / cfg.eval_batches


def _save_checkpoint(path: str, model, opt, step: int, log: list) -> None:
    tmp = path + ".tmp"
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "log": log}, tmp
    )
    os.replace(tmp, path)


def train(model, train_tokens: np.ndarray, val_tokens: np.ndarray, cfg: TrainConfig, run_dir: str,
          desc: str, teacher=None) -> dict:  # fmt: skip
    """Train `model` in place; returns a summary (steps, tokens, seconds, losses)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    os.makedirs(run_dir, exist_ok=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
    )  # fmt: skip
    ckpt_path = os.path.join(run_dir, "checkpoint.pt")
    start, log = 0, []
    if os.path.isfile(ckpt_path):
        state = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start, log = state["step"], state["log"]
        tqdm.write(f"resuming {desc} from step {start} ({ckpt_path})")
    with open(os.path.join(run_dir, "train_config.json"), "w") as f:
        json.dump(asdict(cfg), f, indent=1)

    model.train()
    tokens_per_step = cfg.batch * cfg.context
    elapsed = sum(e.get("step_s", 0.0) for e in log)
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc=desc, unit="step")
    for step in bar:
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        batch = torch.from_numpy(batch_at(train_tokens, step, cfg.batch, cfg.context, cfg.seed))
        loss = loss_fn(model, batch, cfg, teacher)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        elapsed += dt
        loss = loss.item()
        entry = {"step": step + 1, "loss": loss, "lr": lr_at(cfg, step), "step_s": dt}
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            entry["val_loss"] = eval_loss(model, val_tokens, cfg)
            tqdm.write(f"{desc} step {step + 1}: train {loss:.3f}  val {entry['val_loss']:.3f}")
        log.append(entry)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / dt:.0f}")
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            _save_checkpoint(ckpt_path, model, opt, step + 1, log)
    val = [e["val_loss"] for e in log if "val_loss" in e]
    return {
        "steps": cfg.steps,
        "tokens_seen": cfg.steps * tokens_per_step,
        "train_seconds": elapsed,
        "final_train_loss": log[-1]["loss"] if log else None,
        "final_val_loss": val[-1] if val else None,
    }
