"""A draft's step cost by shape, against the target's: wide and shallow, or thin and deep?

On a CPU a small model's decode step is spent on per-layer launches more than on its width
(docs/step_profile.md), so a draft of the same parameters costs less in fewer, wider layers.
This times one-row decode steps (after a 128-token context, rolled back after each) of
random-weight Llamas with the embedded models' vocabulary: the targets (v1 as committed, and
the v2 candidates of bench/gpu_train.py) and draft candidates, interleaved, median of --reps;
drafts run as the engine runs them (eager native backend, output restricted to the 2048 most
frequent tokens), the targets eager and compiled.
Each draft's cost is given over each target's, the bar being <= 1/8 (issue 35).

    python bench/draft_shapes.py [--reps 200] [--threads 1]

Writes docs/draft_shapes.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTEXT = 128
# name: (hidden, layers, heads, kv heads, intermediate)
TARGETS = {
    "v1 target 128x16": (128, 16, 2, 2, 336),
    "v2 384x12": (384, 12, 6, 2, 1024),
    "v2 512x8": (512, 8, 8, 4, 1376),
    "v2 576x7": (576, 7, 9, 3, 1536),
}
DRAFTS = {
    "1 x 512": (512, 1, 8, 4, 1376),
    "1 x 384": (384, 1, 6, 2, 1024),
    "1 x 256": (256, 1, 4, 4, 688),
    "2 x 256": (256, 2, 4, 4, 688),
    "2 x 384": (384, 2, 6, 2, 1024),
    "4 x 128": (128, 4, 2, 2, 336),
    "4 x 256": (256, 4, 4, 4, 688),
    "8 x 128": (128, 8, 2, 2, 336),
}


def build(shape, path: str) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv, inter = shape
    cfg = LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, max_position_embeddings=1024,
                      tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--draft-vocab", type=int, default=2048,
                    help="the drafts' output tokens (the engine's default; 0: all 8192)")  # fmt: skip
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "draft_shapes"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tqdm import tqdm

    from leapdecode.models import load_model

    torch.manual_seed(0)
    models, params = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in list(TARGETS.items()) + list(DRAFTS.items()):
            path = os.path.join(tmp, name.replace(" ", "_"))
            params[name] = build(shape, path)
            models[name] = load_model(path, dtype="float32")
            if name in DRAFTS and args.draft_vocab:  # as the engine runs a draft (FR-Spec)
                models[name].restrict_head(torch.arange(args.draft_vocab))
            if name in TARGETS and args.compile:
                compiled = load_model(path, dtype="float32")
                compiled.allocate(1, CONTEXT + 16)
                compiled.compile(max_rows=1)
                models[name + ", compiled"] = compiled
    slot = torch.tensor([0])
    context = torch.randint(1, 8192, (1, CONTEXT))
    for m in models.values():
        m.allocate(1, CONTEXT + 16)
        m.forward(context, slot)
    token = torch.tensor([[7]])

    def step(m) -> float:
        t0 = time.perf_counter()
        m.forward(token, slot)
        dt = time.perf_counter() - t0
        m.truncate(slot, torch.tensor([CONTEXT]))
        return dt

    times = {name: [] for name in models}
    for _ in range(10):
        for m in models.values():
            step(m)
    for _ in tqdm(range(args.reps), desc="decode steps", unit="round"):
        for name, m in models.items():
            times[name].append(step(m))
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    targets = [n for n in models if n.split(",")[0] in TARGETS]
    rows = [{"draft": d, "params": params[d], "ms": ms[d],
             **{f"over {t}": ms[d] / ms[t] for t in targets}} for d in DRAFTS]  # fmt: skip
    out = {"threads": args.threads, "reps": args.reps, "torch": torch.__version__,
           "targets": {t: {"ms": ms[t], "params": params[t.split(",")[0]]} for t in targets},
           "drafts": rows}  # fmt: skip
    with open(args.out + ".json", "w") as f:
        json.dump(out, f, indent=1)
    lines = [
        "# A draft's step cost by shape, against the target's",
        "",
        f"`python bench/draft_shapes.py --reps {args.reps} --threads {args.threads}`: one-row "
        f"decode steps after {CONTEXT} cached tokens, random weights, vocabulary 8192, float32, "
        f"torch {torch.__version__}, {args.threads} thread(s); interleaved, median of "
        f"{args.reps}. Drafts eager (as the engine runs them), their output restricted to "
        f"{args.draft_vocab or 'all'} tokens (`--draft-vocab`, the engine's default); targets "
        "eager and compiled.",
        "",
        "| target | parameters | ms a step |",
        "|---|---|---|",
    ]
    for t in targets:
        lines.append(f"| {t} | {params[t.split(',')[0]] / 1e6:.1f}M | {ms[t]:.2f} |")
    lines += ["", "| draft (layers x width) | parameters | ms a step | "
              + " | ".join(f"/ {t}" for t in targets) + " |",
              "|---|---|---|" + "---|" * len(targets)]  # fmt: skip
    for r in rows:
        ratios = " | ".join(
            f"**{r[f'over {t}']:.3f}**" if r[f"over {t}"] <= 1 / 8 else f"{r[f'over {t}']:.3f}"
            for t in targets
        )
        lines.append(f"| {r['draft']} | {r['params'] / 1e6:.1f}M | {r['ms']:.2f} | {ratios} |")
    lines += ["", "Bold: within the issue's 1/8 of the target's step.", "",
              "![draft shapes](draft_shapes.png)", ""]  # fmt: skip
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    ax.scatter([r["params"] / 1e6 for r in rows], [r["ms"] for r in rows])
    for r in rows:
        ax.annotate(r["draft"], (r["params"] / 1e6, r["ms"]), fontsize=8)
    for t in targets:
        ax.axhline(ms[t] / 8, ls=":", lw=1, color="gray")
        ax.annotate(f"1/8 of {t}", (0, ms[t] / 8), fontsize=7, color="gray")
    ax.set_xlabel("draft parameters (M)")
    ax.set_ylabel("ms a decode step")
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
