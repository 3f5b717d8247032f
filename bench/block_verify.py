"""Block verification against the token-level rule, on the embedded pair under sampling.

The draft model's chains (`--method draft`) on the bench's completion and revision prompts,
sampled at each temperature with the same seeds under `verify=token` and `verify=block`
(interleaved, the order alternating request by request). Two comparisons:

- paired, step by step: at every verify step, whichever rule drives the run, both rules are
  evaluated on the same target and draft distributions, the same drafts and the same
  uniforms; the drafts each keeps are counted (this is "on the same seeds" with the noise
  of diverging outputs taken out). Mean kept a step per rule, and block - token with a 95%
  bootstrap interval over requests (steps within a request are not independent);
- end to end: tokens a step and tokens/s of each rule's own runs (outputs diverge after the
  first sampled difference, so these carry the trajectories' noise).

Writes docs/block_verify.{md,json,png}.

    python bench/block_verify.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RULES = ("token", "block")


def interval(diffs: list[tuple[int, int]], reps: int = 2000, seed: int = 0):
    """95% bootstrap interval of sum(diff) / sum(steps), resampling requests."""
    rng = random.Random(seed)
    means = []
    for _ in range(reps):
        pick = rng.choices(diffs, k=len(diffs))
        means.append(sum(d for d, _ in pick) / max(1, sum(n for _, n in pick)))
    means.sort()
    return means[int(0.025 * reps)], means[int(0.975 * reps) - 1]


class Paired:
    """Wraps verify's two chain rules so that each call evaluates both on the same inputs:
    the driving rule's result is returned, both rules' kept drafts are recorded."""

    def __init__(self) -> None:
        from leapdecode import verify

        self.rule, self.kept = "token", {r: 0 for r in RULES}
        rules = {"token": verify.rejection_accept, "block": verify.block_accept}
        assert all(f.__module__ == "leapdecode.verify" for f in rules.values()), "wrapped twice"

        def both(p, q, drafts, counts, uniforms):
            out = {r: f(p, q, drafts, counts, uniforms) for r, f in rules.items()}
            for r in RULES:
                self.kept[r] += int(out[r][0].sum())
            return out[self.rule]

        verify.rejection_accept = verify.block_accept = both

    def take(self) -> dict:
        kept, self.kept = self.kept, {r: 0 for r in RULES}
        return kept


def run_pairs(dec, paired, prompts, temperature, k: int, seeds: int, max_new: int) -> dict:
    """Each prompt x seed under both rules: per driving rule, per-request figures."""
    from tqdm import tqdm

    out = {r: [] for r in RULES}
    jobs = [(i, s) for s in range(seeds) for i in range(len(prompts))]
    for n, (i, seed) in enumerate(tqdm(jobs, desc=f"T={temperature} k={k}", unit="pair")):
        for rule in RULES if n % 2 == 0 else RULES[::-1]:
            paired.rule = rule
            r = dec.generate(prompts[i], method="draft", k=k, max_new_tokens=max_new,
                             temperature=temperature, seed=1000 + seed, verify=rule)  # fmt: skip
            out[rule].append({"steps": r.stats.decode_steps, "tokens": r.stats.new_tokens - 1,
                              "decode_s": r.stats.decode_s, "kept": paired.take()})  # fmt: skip
    return out


def summarise(runs: dict) -> dict:
    rows = {}
    for rule, reqs in runs.items():
        steps = sum(q["steps"] for q in reqs)
        rows[rule] = {
            "tokens_per_step": sum(q["tokens"] for q in reqs) / steps,
            "tokens_per_s": sum(q["tokens"] for q in reqs) / sum(q["decode_s"] for q in reqs),
        }
    reqs = runs["token"] + runs["block"]  # every verify step, both rules evaluated on it
    steps = sum(q["steps"] for q in reqs)
    for rule in RULES:
        rows[rule]["paired_kept_per_step"] = sum(q["kept"][rule] for q in reqs) / steps
    diffs = [(q["kept"]["block"] - q["kept"]["token"], q["steps"]) for q in reqs]
    lo, hi = interval(diffs)
    mean = sum(d for d, _ in diffs) / steps
    rows["diff"] = {"mean": mean, "lo": lo, "hi": hi, "requests": len(reqs), "steps": steps}
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=10, help="per category")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--ks", default="2,4")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "block_verify"))
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from pard_predict import embedded_pair

    dec, sets = embedded_pair(args.threads)
    prompts = [dec.encode(r["prompt"]) for rows in sets.values() for r in rows[: args.prompts]]
    dec.generate(prompts[0], method="draft", k=2, max_new_tokens=8, temperature=1.0, seed=0)
    paired = Paired()
    result = {"threads": args.threads, "torch": torch.__version__, "args": vars(args),
              "cells": []}  # fmt: skip
    for t in (float(x) for x in args.temperatures.split(",")):
        for k in (int(x) for x in args.ks.split(",")):
            runs = run_pairs(dec, paired, prompts, t, k, args.seeds, args.max_new_tokens)
            result["cells"].append({"temperature": t, "k": k, **summarise(runs)})
    write(result, args)
    return 0


def write(result: dict, args) -> None:
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    a = result["args"]
    lines = [
        "# Block verification against the token-level rule (draft model, sampled)",
        "",
        f"`python bench/block_verify.py --threads {args.threads}`: the embedded pair, the "
        f"target compiled, torch {result['torch']}, {args.threads} thread(s); {a['prompts']} "
        f"completion and {a['prompts']} revision prompts x {a['seeds']} seeds, "
        f"{a['max_new_tokens']} new tokens; each prompt and seed under both rules, "
        "interleaved. Kept = draft tokens accepted a verify step (the bonus token not "
        "counted), both rules evaluated on every step of both rules' runs (same drafts, same "
        "uniforms); the interval is a 95% bootstrap over requests. End to end: each rule's "
        "own runs.",
        "",
        "| temperature | k | steps | kept a step, token | kept a step, block | block - token "
        "(95% interval) | end to end: tokens a step, token / block | tokens/s, token / block |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in result["cells"]:
        t, b, d = c["token"], c["block"], c["diff"]
        lines.append(
            f"| {c['temperature']} | {c['k']} | {d['steps']} | {t['paired_kept_per_step']:.3f} | "
            f"{b['paired_kept_per_step']:.3f} | {d['mean']:+.3f} ({d['lo']:+.3f} .. "
            f"{d['hi']:+.3f}) | {t['tokens_per_step']:.2f} / {b['tokens_per_step']:.2f} | "
            f"{t['tokens_per_s']:.0f} / {b['tokens_per_s']:.0f} |"
        )
    lines += ["", "![kept drafts](block_verify.png)", ""]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    cells = result["cells"]
    xs = range(len(cells))
    for i, rule in enumerate(RULES):
        ax.bar([x + (i - 0.5) * 0.38 for x in xs], [c[rule]["paired_kept_per_step"] for c in cells],
               0.38, label=rule)  # fmt: skip
    ax.set_xticks(list(xs), [f"T={c['temperature']} k={c['k']}" for c in cells])
    ax.set_ylabel("drafts kept a verify step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
