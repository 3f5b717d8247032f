"""A real target's step under each layout of its linear layers, in one process, interleaved:
a decode step (1 row) and verify steps of 4, 7, 8 and 16 tokens (5, 8, 9, 17 rows) after a cached
context, and the prefill of that context.

    python bench/layout_steps.py [--target qwen2.5-coder-1.5b-instruct] [--dtype bfloat16]
                                 [--context 512] [--reps 15] [--threads 2]
                                 [--out docs/bench/real/layout_steps]

Layouts, bfloat16: `F.linear` with one masked attention call a step (the engine before
packing), packed for oneDNN with exact rows (the engine's default: every row computes the
bits of a one-row step, models/exact_attention.py) and without (what exact rows cost), and
`--quantize int8` / `int4` (all five loaded: about 14 GB for the 1.5B). float32: `[in, out]`
matmuls (the engine before packing float32) and packed for oneDNN (about 14 GB for the 1.5B).
Writes OUT.md, OUT.json and OUT.png (ms against rows).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

LAYOUTS = {  # dtype -> {name: quantize}; a name with "before": plain weights, one attention call
    "bfloat16": {
        "bfloat16, F.linear, one attention call (before)": None,
        "bfloat16, oneDNN-packed, exact rows (default)": None,
        "bfloat16, oneDNN-packed, rows not exact": None,
        "int8 weight-only": "int8",
        "int4 weight-only": "int4",
    },
    "float32": {
        "float32, [in, out] matmuls (before)": None,
        "float32, oneDNN-packed (default)": None,
    },
}
ROWS = (1, 5, 8, 9, 17)  # 8: the bar (a verify of 8 rows); 5, 9, 17: k = 4, 8, 16
PREFILL_REPS = 3  # the context's prefill, timed in the first rounds only (seconds each)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(LAYOUTS))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "bench", "real", "layout_steps"))
    args = ap.parse_args()

    from leapdecode.models import load_model
    from leapdecode.models.loader import cpu_description
    from leapdecode.resolve import resolve_models

    torch.set_num_threads(args.threads)
    folder = resolve_models(args.target, None)[0]
    models = {}
    for name, scheme in tqdm(LAYOUTS[args.dtype].items(), desc="loading"):
        m = load_model(folder, dtype=args.dtype, quantize=scheme)
        if "before" in name:
            m._unpack()  # plain weights: F.linear
            m.exact_rows = False  # one masked attention call a step
        if "not exact" in name:  # what exact rows cost: the same call, no padding
            m.exact_rows = False
        m.allocate(1, args.context + max(ROWS) + 8)
        models[name] = m
    g = torch.Generator().manual_seed(0)
    vocab = next(iter(models.values())).vocab_size
    context = torch.randint(0, vocab, (1, args.context), generator=g)
    slot, keep = torch.tensor([0]), torch.tensor([args.context])
    for m in models.values():
        m.forward(context, slot)
    tokens = {r: torch.randint(0, vocab, (1, r), generator=g) for r in ROWS}
    times = {(n, r): [] for n in models for r in ROWS}
    prefill = {n: [] for n in models}
    for rep in tqdm(range(args.reps + 2), desc="interleaved steps"):
        for name, m in models.items():
            if 1 <= rep <= PREFILL_REPS:  # the context again from nothing (its last row's logits)
                m.truncate(slot, torch.tensor([0]))
                t0 = time.perf_counter()
                m.forward(context, slot, logits_at=torch.tensor([args.context - 1]))
                prefill[name].append(time.perf_counter() - t0)
            for r in ROWS:
                t0 = time.perf_counter()
                m.forward(tokens[r], slot)
                dt = time.perf_counter() - t0
                m.truncate(slot, keep)
                if rep >= 2:  # two warm-up rounds
                    times[(name, r)].append(dt)
    ms = {n: {r: statistics.median(times[(n, r)]) * 1e3 for r in ROWS} for n in models}
    prefill_tps = {n: args.context / statistics.median(v) for n, v in prefill.items()}

    head = (
        f"`python bench/layout_steps.py --target {args.target} --dtype {args.dtype} --context "
        f"{args.context} --reps {args.reps} --threads {args.threads}`: {cpu_description()}, "
        f"medians of {args.reps} interleaved rounds (the prefill of the {args.context}-token "
        f"context: of {PREFILL_REPS}), torch {torch.__version__}."
    )
    lines = [f"# {args.target}: a step by layout of the linear layers", "", head, "",
             "| layout | decode ms | " + " | ".join(f"{r} rows" for r in ROWS[1:])
             + " | prefill tokens/s |", "|---|---|" + "---|" * len(ROWS)]  # fmt: skip
    for name, row in ms.items():
        d = row[1]
        cells = [f"{row[r]:.0f} ({row[r] / d:.2f}x)" for r in ROWS[1:]]
        lines.append(f"| {name} | {d:.0f} | " + " | ".join(cells) + f" | {prefill_tps[name]:.0f} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(args.out + ".json", "w") as f:
        json.dump({"command": head, "ms": ms, "prefill_tokens_per_s": prefill_tps}, f, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, row in ms.items():
        ax.plot(ROWS, [row[r] for r in ROWS], marker="o", label=name)
    ax.set_xlabel("rows in the step (1 = decode, k + 1 = a verify of k tokens)")
    ax.set_ylabel("ms a step")
    ax.set_title(f"{args.target}, {args.dtype}, {args.threads} threads")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=120)
    print("\n".join(lines))
    print(f"wrote {args.out}.md, .json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
