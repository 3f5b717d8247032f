"""The training loop shared by the target (cross-entropy) and the draft (distillation).

Resumable: a checkpoint (model, optimizer, step) is written atomically every
`checkpoint_every` steps; batches are a pure function of (seed, step), so a killed run
restarted with the same command continues exactly where it stopped.

A run may go through stages of (context, batch) (`TrainConfig.stages`): copying emerges
sooner with small batches of short windows, and long context is learnt after it
(Aoyama et al. 2025, arXiv 2511.16893). Every entry of the log also goes to
`log.jsonl` in the run folder, for plots while the run goes on.
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
    stages: tuple = ()  # ((context, batch, steps), ...); empty: one stage of the fields above
    eval_context: int = 0  # validation window; 0 = the longest context trained on
    compile: bool = False  # torch.compile the training step (needs a C++ compiler)
    device: str = "cpu"  # where the model trains: cpu | cuda (cuda:N)
    fused_adamw: bool = False  # the optimizer's fused kernel (one launch for every parameter)
    max_seconds: float = 0.0  # stop (checkpointed) after this much training time; 0 = no limit

    def plan(self) -> list[tuple[int, int, int]]:
        """[(context, batch, steps)] of every stage; their steps add up to `steps`."""
        return [tuple(st) for st in self.stages] or [(self.context, self.batch, self.steps)]

    def stage_at(self, step: int) -> tuple[int, int]:
        """(context, batch) of the stage that holds `step`."""
        for context, batch, steps in self.plan():
            if step < steps:
                return context, batch
            step -= steps
        return self.plan()[-1][:2]


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def _autocast(cfg: TrainConfig):
    return torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16, enabled=cfg.bf16)


def _to_device(batch: np.ndarray, cfg: TrainConfig) -> torch.Tensor:
    """A numpy batch on the training device (pinned and copied asynchronously to a GPU)."""
    t = torch.from_numpy(batch)
    if torch.device(cfg.device).type == "cuda":
        return t.pin_memory().to(cfg.device, non_blocking=True)
    return t


def loss_fn(model, batch: torch.Tensor, cfg: TrainConfig, teacher=None) -> torch.Tensor:
    """Cross-entropy, or forward KL to the teacher's next-token distribution (+ CE share)."""
    inputs, labels = batch[:, :-1], batch[:, 1:]
    with _autocast(cfg):
        logits = model(input_ids=inputs, use_cache=False).logits
    logits = logits.float().flatten(0, 1)  # [B*T, V]
    ce = F.cross_entropy(logits, labels.flatten())
    if teacher is None:
        return ce
    with torch.no_grad(), _autocast(cfg):
        t_logits = teacher(input_ids=inputs, use_cache=False).logits
    t_logp = F.log_softmax(t_logits.float().flatten(0, 1), dim=-1)
    s_logp = F.log_softmax(logits, dim=-1)
    kl = F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean")  # KL(teacher || student)
    return (1 - cfg.ce_weight) * kl + cfg.ce_weight * ce


@torch.no_grad()
def eval_loss(model, tokens: np.ndarray, cfg: TrainConfig) -> float:
    """Mean cross-entropy (nats/token) on fixed validation windows."""
    model.eval()
    total = 0.0
    context = cfg.eval_context or max(c for c, _, _ in cfg.plan())
    context = min(context, len(tokens) - 2)
    for i in range(cfg.eval_batches):
        b = _to_device(batch_at(tokens, i, 4, context, seed=12345), cfg)
        with _autocast(cfg):
            logits = model(input_ids=b[:, :-1], use_cache=False).logits
        total += float(F.cross_entropy(logits.float().flatten(0, 1), b[:, 1:].flatten()))
    model.train()
    return total / cfg.eval_batches


def _save_checkpoint(path: str, model, opt, step: int, log: list) -> None:
    tmp = path + ".tmp"
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "log": log}, tmp
    )
    os.replace(tmp, path)


def train(
    model,
    train_tokens: np.ndarray,
    val_tokens: np.ndarray,
    cfg: TrainConfig,
    run_dir: str,
    desc: str,
    teacher=None,
    batches=None,
    probe=None,
) -> dict:
    """Train `model` in place; returns a summary (steps, tokens, seconds, losses).

    `batches` (mix.Batches) draws the rows (default: plain windows of `train_tokens`);
    `probe` (signals.CopyProbe) is measured with every validation."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    os.makedirs(run_dir, exist_ok=True)
    model.to(cfg.device)
    if teacher is not None:
        teacher.to(cfg.device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=cfg.fused_adamw or None,
    )
    ckpt_path = os.path.join(run_dir, "checkpoint.pt")
    start, log = 0, []
    if os.path.isfile(ckpt_path):
        state = torch.load(ckpt_path, weights_only=False, map_location=cfg.device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start, log = state["step"], state["log"]
        tqdm.write(f"resuming {desc} from step {start} ({ckpt_path})")
    with open(os.path.join(run_dir, "train_config.json"), "w") as f:
        json.dump(asdict(cfg), f, indent=1)

    model.train()
    step_loss = lambda b: loss_fn(model, b, cfg, teacher)  # noqa: E731
    if cfg.compile:
        step_loss = torch.compile(step_loss, dynamic=False)
    elapsed = sum(e.get("step_s", 0.0) for e in log)
    seen = sum(e.get("tokens", 0) for e in log)
    log_file = open(os.path.join(run_dir, "log.jsonl"), "a")
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc=desc, unit="step")
    stopped_early = False
    for step in bar:
        if cfg.max_seconds and elapsed >= cfg.max_seconds:
            stopped_early = True
            _save_checkpoint(ckpt_path, model, opt, step, log)
            tqdm.write(f"{desc}: stopped after {elapsed:.0f} s of training (max_seconds)")
            break
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        context, rows = cfg.stage_at(step)
        if batches is None:
            batch = batch_at(train_tokens, step, rows, context, cfg.seed)
        else:
            batch = batches.batch_at(step, rows, context)
        loss = step_loss(_to_device(batch, cfg))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.item()  # waits for the step's kernels (a GPU's work is queued): dt is real
        dt = time.perf_counter() - t0
        elapsed += dt
        seen += rows * context
        entry = {
            "step": step + 1,
            "loss": loss,
            "lr": lr_at(cfg, step),
            "step_s": dt,
            "tokens": rows * context,
            "context": context,
            "batch": rows,
            "tokens_seen": seen,
            "train_s": elapsed,
        }
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            entry["val_loss"] = eval_loss(model, val_tokens, cfg)
            msg = f"{desc} step {step + 1}: train {loss:.3f}  val {entry['val_loss']:.3f}"
            if probe is not None:
                entry["copy"] = probe.measure(model)
                c = entry["copy"]
                msg += (
                    f"  2nd showing {c['second_showing_loss']:.2f} (1st "
                    f"{c['first_showing_loss']:.2f})  copy {c['copy_score']:.2f}  "
                    f"revision exact {c['revision_exact']:.2f}"
                )
            tqdm.write(msg)
        log.append(entry)
        log_file.write(json.dumps(entry) + "\n")
        log_file.flush()
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rows * context / dt:.0f}", ctx=context)
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            _save_checkpoint(ckpt_path, model, opt, step + 1, log)
    log_file.close()
    val = [e["val_loss"] for e in log if "val_loss" in e]
    return {
        "steps": log[-1]["step"] if log else 0,
        "tokens_seen": sum(e.get("tokens", cfg.batch * cfg.context) for e in log),
        "train_seconds": elapsed,
        "final_train_loss": log[-1]["loss"] if log else None,
        "final_val_loss": val[-1] if val else None,
        "stopped_early": stopped_early,
    }
