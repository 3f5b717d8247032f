"""Time one decode step and one k-token verify step, native vs transformers backend.

Both backends load the same checkpoint (a 4-layer, 256-wide Llama, random weights, vocabulary
8192 like the embedded models). Each step runs after a 128-token cached context and is
rolled back afterwards, so every repetition sees the same state. The backends are
interleaved within each repetition; the figures are medians, and the ratio is
native / transformers from the same run.

    python bench/backend_step.py [--reps 1000] [--out docs/backend_step.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from leapdecode.models import load_model

CONFIG = dict(
    vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
)  # fmt: skip
CONTEXT = 128
STEPS = {"decode (1 token)": 1, "verify k=1": 2, "verify k=4": 5, "verify k=8": 9}


def time_step(model, tokens: torch.Tensor, slot: torch.Tensor) -> float:
    start = time.perf_counter()
    model.forward(tokens, slot)
    elapsed = time.perf_counter() - start
    model.truncate(slot, torch.tensor([CONTEXT]))
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=1000)
    ap.add_argument("--out", default="docs/backend_step.md")
    args = ap.parse_args()

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as path:
        LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(path)
        models = {name: load_model(path, backend=name) for name in ("native", "transformers")}
    slot = torch.tensor([0])
    context = torch.randint(0, CONFIG["vocab_size"], (1, CONTEXT))
    for m in models.values():
        m.allocate(1, CONTEXT + 16)
        m.forward(context, slot)

    times = {(step, name): [] for step in STEPS for name in models}
    gen = torch.Generator().manual_seed(1)
    for _ in tqdm(range(args.reps), desc="interleaved repetitions"):
        for step, width in STEPS.items():
            tokens = torch.randint(0, CONFIG["vocab_size"], (1, width), generator=gen)
            for name, m in models.items():
                times[(step, name)].append(time_step(m, tokens, slot))

    rows = []
    for step in STEPS:
        nat = statistics.median(times[(step, "native")]) * 1e3
        hf = statistics.median(times[(step, "transformers")]) * 1e3
        rows.append({"step": step, "native_ms": nat, "transformers_ms": hf, "ratio": nat / hf})

    lines = [
        "# Backend step time: native vs transformers",
        "",
        f"Model: Llama, {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, "
        f"intermediate {CONFIG['intermediate_size']}, vocabulary {CONFIG['vocab_size']}, float32, "
        f"CPU ({torch.get_num_threads()} threads), {CONTEXT} tokens already cached. "
        f"Median of {args.reps} interleaved repetitions; ratio = native / transformers.",
        "",
        "| step | native (ms) | transformers (ms) | ratio |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {r['step']} | {r['native_ms']:.3f} | {r['transformers_ms']:.3f} | {r['ratio']:.2f} |"
        for r in rows
    ]
    png = os.path.splitext(os.path.basename(args.out))[0] + ".png"
    lines += ["", f"![step times]({png})", "", "Produced by `python bench/backend_step.py`."]
    table = "\n".join(lines)
    print(table)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write(table + "\n")
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(
            {"config": CONFIG, "context": CONTEXT, "reps": args.reps, "rows": rows}, f, indent=1
        )
    plot(rows, os.path.splitext(args.out)[0] + ".png")


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["native_ms"] for r in rows], 0.4, label="native")
    ax.bar([i + 0.2 for i in x], [r["transformers_ms"] for r in rows], 0.4, label="transformers")
    ax.set_xticks(list(x), [r["step"] for r in rows])
    ax.set_ylabel("ms per step (median)")
    ax.set_title("One target forward, 4-layer 256-wide Llama, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
