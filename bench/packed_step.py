"""A chain verify step of rows with drafts of different lengths: padded to the longest row,
or packed (each row's own tokens only; `CausalLM.packs_rows`, the compiled forward's kernel).

Each row's cached context is a bench prompt's length plus 32 (the categories in turn); the
rows' token counts are mixes a busy server meets (a few rows with a long n-gram draft, the
rest with one token or a short draft). The uniform step of as many rows with the same total
of tokens spread evenly is the cost model's estimate of a packed step (verify_s(B, R)).
Interleaved, median of --reps; writes docs/packed_step.{md,json,png}.

    python bench/packed_step.py --threads 1 --reps 15
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIXES = {  # rows' new tokens (1 + drafts)
    "16 rows: 4 x 9, 12 x 1": [9] * 4 + [1] * 12,
    "16 rows: 2 x 9, 4 x 3, 10 x 1": [9] * 2 + [3] * 4 + [1] * 10,
    "16 rows: 2 x 17, 4 x 5, 10 x 1": [17] * 2 + [5] * 4 + [1] * 10,
    "4 rows: 9, 1, 1, 1": [9, 1, 1, 1],
    "4 rows: 9, 5, 3, 1": [9, 5, 3, 1],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "packed_step"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from batched_step import prompt_lengths
    from leapdecode.models import load_model
    from leapdecode.paths import TARGET_NAME, default_model

    target = default_model(TARGET_NAME)
    lengths = prompt_lengths(AutoTokenizer.from_pretrained(target))
    model = load_model(target, dtype="float32")
    model.allocate(16, model.max_context + 32)
    model.compile(max_rows=16)
    if not model.packs_rows:
        print("the cached-attention kernel is not built here: nothing to compare")
        return 1
    vocab = model.vocab_size
    rows = []
    for name, counts in tqdm(MIXES.items(), desc="packed steps", unit="mix"):
        counts = torch.tensor(counts)
        b, t, n = len(counts), int(counts.max()), int(counts.sum())
        ctx = torch.tensor([min(lengths[i % len(lengths)] + 32, model.max_context - 2 - t)
                            for i in range(b)])  # fmt: skip
        slots = torch.arange(b)
        even = max(1, round(n / b))

        def step(width, c=None, b=b, slots=slots, ctx=ctx):
            model.cache.lens[:b] = ctx
            model.forward(torch.randint(1, vocab, (b, width)), slots, counts=c)

        paths = {"padded": lambda t=t: step(t), "packed": lambda t=t, c=counts: step(t, c),
                 "uniform": lambda e=even: step(e)}  # fmt: skip
        times = {k: [] for k in paths}
        for fn in paths.values():
            fn(), fn()
        for _ in range(args.reps):
            for k, fn in paths.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rows.append({"mix": name, "rows": b, "tokens": n, "padded_tokens": b * t,
                     "even": even, **{f"{k}_ms": v for k, v in ms.items()}})  # fmt: skip
    write(rows, args)
    return 0


def write(rows: list[dict], args) -> None:
    with open(args.out + ".json", "w") as f:
        json.dump({"threads": args.threads, "torch": torch.__version__, "rows": rows}, f, indent=1)
    lines = [
        "# A chain verify step of rows with different draft lengths: padded or packed",
        "",
        f"`python bench/packed_step.py --threads {args.threads} --reps {args.reps}`: the "
        f"embedded target in float32, compiled (--compile), torch {torch.__version__}, "
        f"{args.threads} thread(s); median of {args.reps} interleaved steps. Padded: every row "
        "runs the longest row's count (the step before `packs_rows`); packed: each row its "
        "own; uniform: as many rows with the same total spread evenly (what the cost model "
        "prices a packed step at).",
        "",
        "| rows' tokens | tokens (padded) | padded ms | packed ms | packed / padded | "
        "uniform ms (tokens a row) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mix']} | {r['tokens']} ({r['padded_tokens']}) | {r['padded_ms']:.2f} | "
            f"{r['packed_ms']:.2f} | {r['packed_ms'] / r['padded_ms']:.2f} | "
            f"{r['uniform_ms']:.2f} ({r['even']}) |"
        )
    lines += ["", "![packed step](packed_step.png)", ""]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(rows))
    for i, (key, label) in enumerate((("padded_ms", "padded"), ("packed_ms", "packed"),
                                      ("uniform_ms", "uniform, same tokens"))):  # fmt: skip
        ax.bar([x + (i - 1) * 0.27 for x in xs], [r[key] for r in rows], 0.27, label=label)
    ax.set_xticks(list(xs), [r["mix"] for r in rows], rotation=20, ha="right", fontsize=7)
    ax.set_ylabel("ms a step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
