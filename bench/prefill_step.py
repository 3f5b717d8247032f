"""Prefill: fresh prompts through the eager forward and through the compiled prompt graph
(`--compile`; models/compiled.py `fresh`), interleaved, median of --reps.

    python bench/prefill_step.py --threads 1 --reps 7

Writes docs/prefill_step.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = ((1, 200), (1, 600), (1, 1000), (2, 400), (3, 300), (8, 120))  # (prompts, tokens)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "prefill_step"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tqdm import tqdm

    from leapdecode.models import load_model
    from leapdecode.paths import TARGET_NAME, default_model

    model = load_model(default_model(TARGET_NAME), dtype="float32")
    model.allocate(8, model.max_context + 32)
    model.compile(max_rows=8)
    compiled, vocab = model.compiled, model.vocab_size
    rows = []
    for b, n in tqdm(SHAPES, desc="prefill shapes", unit="shape"):
        tokens = torch.randint(1, vocab, (b, n))
        slots, last = torch.arange(b), torch.full((b,), n - 1)

        def prefill(path, tokens=tokens, slots=slots, last=last, b=b):
            model.compiled = path
            model.truncate(slots, torch.zeros(b, dtype=torch.long))
            model.forward(tokens, slots, logits_at=last)

        times = {"eager": [], "compiled": []}
        for _ in range(2):
            prefill(None), prefill(compiled)
        for _ in range(args.reps):
            for name, path in (("eager", None), ("compiled", compiled)):
                t0 = time.perf_counter()
                prefill(path)
                times[name].append(time.perf_counter() - t0)
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rows.append({"prompts": b, "tokens": n, **{f"{k}_ms": v for k, v in ms.items()}})
    model.compiled = compiled
    write(rows, args)
    return 0


def write(rows: list[dict], args) -> None:
    with open(args.out + ".json", "w") as f:
        json.dump({"threads": args.threads, "torch": torch.__version__, "rows": rows}, f, indent=1)
    lines = [
        "# Prefill: eager and compiled",
        "",
        f"`python bench/prefill_step.py --threads {args.threads} --reps {args.reps}`: the "
        f"embedded target in float32, torch {torch.__version__}, {args.threads} thread(s); "
        f"fresh prompts (nothing cached), logits at each prompt's last token; median of "
        f"{args.reps} interleaved forwards.",
        "",
        "| prompts x tokens | eager ms | compiled ms | eager / compiled | compiled tokens/s |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        n = r["prompts"] * r["tokens"]
        lines.append(
            f"| {r['prompts']} x {r['tokens']} | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | "
            f"{r['eager_ms'] / r['compiled_ms']:.2f}x | {n / r['compiled_ms'] * 1e3:.0f} |"
        )
    lines += ["", "![prefill](prefill_step.png)", ""]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(rows))
    for i, key in enumerate(("eager", "compiled")):
        ax.bar([x + (i - 0.5) * 0.4 for x in xs], [r[f"{key}_ms"] for r in rows], 0.4, label=key)
    ax.set_xticks(list(xs), [f"{r['prompts']} x {r['tokens']}" for r in rows])
    ax.set_ylabel("ms a prefill forward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
