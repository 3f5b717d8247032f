"""Training speculator heads against the target itself (self-distillation), resumably.

`Teacher` runs the frozen target (transformers, float32) on a batch of windows and returns
what a head learns from: its hidden states and its next-token distributions, computed on
the fly (nothing cached to disk; on this CPU the teacher's forward is cheap next to the
heads' backward). `fit` is the loop both head kinds share: AdamW with warmup and cosine
decay, a checkpoint (heads, optimizer, step) written atomically every `checkpoint_every`
steps, batches a pure function of (seed, step) so a killed run continues where it stopped,
a progress bar, and `log.jsonl` in the run folder.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable

import numpy as np
import torch
from tqdm import tqdm

from ..errors import LeapDecodeError
from .data import batch_at


class Teacher:
    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        cfg = self.model.config
        self.config = cfg
        self.hidden = int(cfg.hidden_size)
        self.layers = int(cfg.num_hidden_layers)
        self.vocab = int(self.model.get_output_embeddings().weight.shape[0])

    @torch.no_grad()
    def run(self, tokens: torch.Tensor, layers: tuple[int, ...] = ()):
        """tokens [B, T] -> (aux [B, T, len(layers), H] residual stream entering each layer,
        final [B, T, H] after the final norm, logits [B, T, V])."""
        if any(not 0 <= i < self.layers for i in layers):
            raise LeapDecodeError(f"aux layers must be inputs of layers 0..{self.layers - 1}")
        out = self.model(input_ids=tokens, output_hidden_states=True)
        hs = out.hidden_states  # embeddings, then each layer's output (the last one normed)
        aux = torch.stack([hs[i] for i in layers], dim=2) if layers else None
        return aux, hs[-1], out.logits.float()

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(tokens)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The target's LM head (frozen; gradients flow to x)."""
        return self.model.get_output_embeddings()(x)

    @property
    def output_weight(self) -> torch.Tensor:
        """The LM head's weight [V, H]."""
        return self.model.get_output_embeddings().weight


class TargetTables:
    """What a head trained from kept features needs of its target besides them: its config,
    its input embeddings and its LM head's weight, read from the folder's safetensors in their
    own dtype (the 1.5B's tied table is 0.47 GB in bfloat16), not the whole model."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open
        from transformers import AutoConfig

        self.config = cfg = AutoConfig.from_pretrained(path)
        self.hidden = int(cfg.hidden_size)
        self.layers = int(cfg.num_hidden_layers)
        tables = {}
        for name in sorted(os.listdir(path)):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(path, name), framework="pt") as f:
                    for key in ("model.embed_tokens.weight", "lm_head.weight"):
                        if key in f.keys():
                            tables[key] = f.get_tensor(key)
        if "model.embed_tokens.weight" not in tables:
            raise LeapDecodeError(
                f"{path} has no model.embed_tokens.weight in its safetensors: pass a Llama/Qwen "
                "model folder (leapdecode pull writes one)"
            )
        self.embeddings = tables["model.embed_tokens.weight"]  # [V, H]
        self.output_weight = tables.get("lm_head.weight", self.embeddings)  # tied: the same
        self.vocab = int(self.output_weight.shape[0])

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embeddings[tokens].float()


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def fingerprint(target: str, **settings) -> dict:
    """What a run's checkpoint must agree with to be resumed: the target (its config and a
    digest of its weight files' size and ends) and the head's settings."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(os.listdir(target)):
        if name == "config.json" or name.endswith(".safetensors"):
            path = os.path.join(target, name)
            size = os.path.getsize(path)
            digest.update(f"{name}:{size}".encode())
            with open(path, "rb") as f:
                digest.update(f.read(1 << 20))
                f.seek(max(0, size - (1 << 20)))
                digest.update(f.read())
    return {"target": digest.hexdigest()[:16], **settings}


def fit(
    module: torch.nn.Module,
    loss_step: Callable,
    tokens: np.ndarray,
    *,
    steps: int,
    batch: int,
    context: int,
    lr: float,
    run_dir: str,
    desc: str,
    seed: int = 0,
    checkpoint_every: int = 25,
    log_every: int = 25,
    stamp: dict | None = None,
    batches: Callable | None = None,
    budget_s: float | None = None,
    bf16: bool = False,
) -> dict:
    """Train `module` in place: loss_step(batch [B, context + 1] long) -> (loss, {metric}).
    `stamp` (see `fingerprint`) is kept in the checkpoint; a run folder whose checkpoint
    has another stamp is refused rather than resumed. `batches(step)`: batch number `step`
    another way than windows of `tokens` (features kept on disk; a pure function of step).
    `budget_s`: train for at most this many seconds in all (resumed runs' included): the
    steps become those that fit, at the pace measured, and the schedule follows them.
    `bf16`: the forward under bfloat16 autocast (the weights and the optimizer stay float32)."""
    if batches is None and len(tokens) < context + 2:
        raise LeapDecodeError(
            f"{len(tokens)} training tokens cannot fill one window of {context}: lower --context"
        )
    os.makedirs(run_dir, exist_ok=True)
    params = [p for p in module.parameters() if p.requires_grad]
    device = params[0].device
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    ckpt = os.path.join(run_dir, "checkpoint.pt")
    start, log = 0, []
    stamp = {**(stamp or {}), "batch": batch, "context": context, "seed": seed}
    if os.path.isfile(ckpt):
        state = torch.load(ckpt, weights_only=False)
        if state.get("stamp") != stamp:
            raise LeapDecodeError(
                f"{run_dir} holds a {desc} run for another target or other settings "
                f"({state.get('stamp')} vs {stamp}): delete it or pass another --run-dir"
            )
        module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start, log = state["step"], state["log"]
        tqdm.write(f"resuming {desc} from step {start} ({ckpt})")
    torch.manual_seed(seed + start)
    with open(os.path.join(run_dir, "log.jsonl"), "w") as f:  # the checkpoint's log, then on
        f.writelines(json.dumps(e) + "\n" for e in log)
    log_file = open(os.path.join(run_dir, "log.jsonl"), "a")
    elapsed = sum(e.get("step_s", 0.0) for e in log)
    if budget_s is not None and start > 0:  # what is left of the budget, at the logged pace
        steps = min(steps, start + int(max(0.0, budget_s - elapsed) / (elapsed / start)))
    bar = tqdm(initial=start, total=steps, desc=desc, unit="step")
    module.train()
    step, ran = start, 0.0
    while step < steps:
        t0 = time.perf_counter()
        for g in opt.param_groups:  # warmup 5% of the steps (a budget's, once it is measured)
            g["lr"] = lr_at(step, steps, lr, max(1, steps // 20))
        if batches is not None:
            b = batches(step)
        else:
            b = torch.from_numpy(batch_at(tokens, step, batch, context, seed))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, metrics = loss_step(b)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        elapsed, ran, step = elapsed + dt, ran + dt, step + 1
        loss = float(loss.detach())
        entry = {"step": step, "loss": loss, "step_s": dt, **metrics}
        log.append(entry)
        log_file.write(json.dumps(entry) + "\n")
        log_file.flush()
        if budget_s is not None:  # the steps that fit what is left, at this run's pace
            steps = min(steps, step + int(max(0.0, budget_s - elapsed) / (ran / (step - start))))
            bar.total = steps
        bar.update(1)
        shown = {k: f"{v:.2f}" for k, v in list(metrics.items())[:3]}
        bar.set_postfix(loss=f"{loss:.3f}", **shown)
        if step % log_every == 0:
            tqdm.write(
                f"{desc} step {step}: loss {loss:.3f} "
                + " ".join(f"{k} {v:.3f}" for k, v in metrics.items())
            )
        if step % checkpoint_every == 0 or step == steps:
            tmp = ckpt + ".tmp"
            torch.save(
                {
                    "model": module.state_dict(),
                    "opt": opt.state_dict(),
                    "step": step,
                    "log": log,
                    "stamp": stamp,
                },
                tmp,
            )
            os.replace(tmp, ckpt)
    bar.close()
    log_file.close()
    module.eval()
    return {
        "steps": step,
        "batch": batch,
        "context": context,
        "lr": lr,
        "tokens_seen": step * batch * context,
        "train_seconds": round(elapsed, 1),
        "final_loss": log[-1]["loss"] if log else None,
    }


def soft_ce(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits [N, V] against a distribution probs [N, V], mean over N."""
    return -(probs * torch.log_softmax(logits.float(), dim=-1)).sum(-1).mean()
