"""`leapdecode bench repeated`: one kind of revision over many files, served one after
another by one engine, as a server sees a stream of similar requests.

Suffix decoding's global tree keeps earlier requests' outputs, so its acceptance should
rise as the stream goes on; the same method without the global tree, and chain prompt
lookup, are the controls. Writes results.json, results.md and acceptance.png.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time

import torch
from tqdm import tqdm

from ..errors import LeapDecodeError

CONFIGS = (  # (label, method, global tree)
    ("suffix (global tree)", "suffix", True),
    ("suffix (this request only)", "suffix", False),
    ("ngram", "ngram", True),
)


def add_parser(what, model_args) -> None:
    p = what.add_parser(
        "repeated",
        help="similar requests one after another: suffix's global "
        "tree filling up (acceptance by request, plot)",
    )
    model_args(p)
    p.add_argument("--requests", type=int, default=60, help="revision requests (default 60)")
    p.add_argument("--k", type=int, default=16, help="draft tokens per step (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap per request")
    p.add_argument("--seed", type=int, default=7, help="which files and names (default 7)")
    p.add_argument("--out", default=os.path.join("bench", "results", "repeated"))


def _prompts(target: str, n: int, seed: int) -> list[dict]:
    from transformers import AutoTokenizer

    from . import workloads

    tok = AutoTokenizer.from_pretrained(target)
    files = workloads.validation_files(os.path.join(target, "corpus_manifest.json"))
    rows = workloads.revision(files, random.Random(seed), n, tok)
    for row in rows:
        workloads._end_inside_line(row, tok)
    return rows


def cmd_repeated(args) -> int:
    from ..api import LeapDecoder
    from ..resolve import resolve_models

    if args.requests < 2 or not 1 <= args.k <= 64:
        raise LeapDecodeError("--requests must be >= 2 and --k in 1..64")
    target, _ = resolve_models(args.target, None)
    rows = _prompts(target, args.requests, args.seed)
    results = {}
    bar = tqdm(total=len(rows) * len(CONFIGS), desc="repeated", unit="req")
    for label, method, keep in CONFIGS:
        dec = LeapDecoder.from_pretrained(
            target,
            device=args.device,
            dtype=args.dtype,
            threads=args.threads,
            suffix_decoding_max_cached_requests=10_000 if keep else 0,
        )
        dec.generate(rows[0]["prompt"], method="none", max_new_tokens=8)  # warm-up
        per = []
        for row in rows:
            bar.set_postfix_str(label)
            max_new = row["max_new_tokens"]
            if args.max_new_tokens:
                max_new = min(max_new, args.max_new_tokens)
            t0 = time.perf_counter()
            out = dec.generate(row["prompt"], method=method, k=args.k, max_new_tokens=max_new)
            secs = time.perf_counter() - t0
            s = out.stats
            per.append(
                {
                    "id": row["id"],
                    "tokens": len(out.token_ids),
                    "seconds": secs,
                    "mean_accepted_tokens": (s.accepted + s.decode_steps) / max(1, s.decode_steps),
                    "acceptance_rate": s.accepted / s.proposed if s.proposed else 0.0,
                }
            )
            bar.update()
        results[label] = per
    bar.close()
    meta = {
        "target": target,
        "requests": len(rows),
        "k": args.k,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    paths = write(results, meta, args.out)
    print(f"wrote {paths['markdown']}, {paths['json']} and {paths['plot']}")
    return 0


def _mean(xs) -> float:
    return statistics.fmean(xs) if xs else 0.0


def write(results: dict, meta: dict, out_dir: str) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = {
        "json": os.path.join(out_dir, "results.json"),
        "markdown": os.path.join(out_dir, "results.md"),
        "plot": os.path.join(out_dir, "acceptance.png"),
    }
    with open(paths["json"], "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    n = meta["requests"]
    quarter = max(1, n // 4)
    lines = [
        "# Repeated similar requests: suffix decoding's global tree",
        "",
        f"{n} revision requests (rename an identifier, each on another validation file), "
        f"served one after another by one engine; greedy, k = {meta['k']}; "
        f"{meta['threads']} threads, torch {meta['torch']}. Target `{meta['target']}`.",
        "",
        "tok/fwd = tokens per target decode forward (its own token included), the mean over "
        "requests; tok/s = total tokens / total seconds.",
        "",
        f"| method | tok/fwd, first {quarter} | tok/fwd, last {quarter} | tok/fwd, all | tok/s |",
        "|---|---|---|---|---|",
    ]
    for label, per in results.items():
        acc = [r["mean_accepted_tokens"] for r in per]
        tps = sum(r["tokens"] for r in per) / max(1e-9, sum(r["seconds"] for r in per))
        lines.append(
            f"| {label} | {_mean(acc[:quarter]):.2f} | {_mean(acc[-quarter:]):.2f} "
            f"| {_mean(acc):.2f} | {tps:.1f} |"
        )
    lines += ["", "![acceptance.png](acceptance.png)", ""]
    with open(paths["markdown"], "w") as f:
        f.write("\n".join(lines))
    fig, ax = plt.subplots(figsize=(8, 4))
    window = max(1, n // 10)
    for label, per in results.items():
        acc = [r["mean_accepted_tokens"] for r in per]
        rolling = [_mean(acc[max(0, i - window + 1) : i + 1]) for i in range(len(acc))]
        ax.plot(range(1, len(acc) + 1), rolling, label=label)
    ax.set_xlabel("request number (served one after another)")
    ax.set_ylabel(f"tokens per target forward (mean of last {window})")
    ax.set_title("Acceptance as the global tree fills")
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths["plot"], dpi=110)
    plt.close(fig)
    return paths
