"""Greedy output of every method against transformers' `generate` on a real checkpoint.

    python bench/lossless_real.py --target qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct --methods none,draft --prompts 6 \
        --out docs/lossless_real/qwen-1.5b-draft

The CI tests run the same check on the 135M and the 0.5B (tests/test_real_models.py); this
script is for the pairs too slow for CI. It writes OUT.json and OUT.md (one row a method:
prompts identical, ties, non-ties, tokens per target forward) and exits 1 on a non-tie.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from leapdecode import LeapDecoder
from leapdecode.bench.against_transformers import (
    MethodReport,
    Reference,
    compare,
    real_prompts,
)
from leapdecode.resolve import resolve_model

DEFAULT_K = {"draft": 4, "ngram": 8, "suffix": 16, "lookahead": None, "none": None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="folder, .gguf or catalogue name")
    p.add_argument("--draft", default=None)
    p.add_argument("--methods", default="none,ngram,suffix,lookahead")
    p.add_argument("--prompts", type=int, default=12, help="how many (a multiple of 4)")
    p.add_argument(
        "--bench-prompts",
        type=int,
        default=None,
        metavar="N",
        help="instead: the first N prompts of each bench category, chat included where the "
        "model has a template (what `bench run --per-category N` runs), whole",
    )
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", required=True, help="path prefix of the .json and .md written")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    target = resolve_model(args.target)
    draft = resolve_model(args.draft, "draft") if args.draft else None
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    if args.bench_prompts:
        prompts = bench_prompts(tok, target, args.bench_prompts)
    else:
        prompts = [tok.encode(t) for t in real_prompts(n_per_category=max(1, args.prompts // 4))]

    t0 = time.perf_counter()
    ref = Reference(target, dtype)  # transformers in the same dtype as ours
    wanted = []
    for i, ids in enumerate(prompts):
        wanted.append(ref.greedy(ids, args.max_new_tokens))
        print(f"reference {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    ref_s = time.perf_counter() - t0

    dec = LeapDecoder.from_pretrained(
        target, draft=draft, dtype=args.dtype, max_num_seqs=len(prompts), speculators=[]
    )
    rows = []
    for m in methods:
        t1 = time.perf_counter()
        outs = dec.generate_batch(prompts, method=m, k=DEFAULT_K.get(m) or 4,
                                  max_new_tokens=args.max_new_tokens)  # fmt: skip
        report = MethodReport(m, DEFAULT_K.get(m))
        report.target_forwards = sum(o.stats.target_forwards for o in outs)
        report.new_tokens = sum(len(o.token_ids) for o in outs)
        compare(ref, prompts, wanted, [o.token_ids for o in outs], report, dtype)
        row = report.as_dict() | {"seconds": round(time.perf_counter() - t1, 1)}
        rows.append(row)
        print(f"{m}: {row['identical']}/{row['prompts']} identical, {row['ties']} ties, "
              f"{row['non_ties']} non-ties", file=sys.stderr, flush=True)  # fmt: skip
    result = {
        "target": args.target,
        "draft": args.draft,
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "prompts": len(prompts),
        "reference_seconds": round(ref_s, 1),
        "torch": torch.__version__,
        "methods": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [
        f"# Greedy against transformers: {args.target}"
        + (f" with draft {args.draft}" if args.draft else ""),
        "",
        f"{len(prompts)} prompts ("
        + ("`bench run`'s own, whole" if args.bench_prompts else "bench sets, cut short")
        + f"), {args.max_new_tokens} new tokens, "
        f"{args.dtype}, transformers `generate` as the reference. Command: "
        f"`python bench/lossless_real.py {' '.join(argv or sys.argv[1:])}`",
        "",
        "| method | k | identical | ties | non-ties | tokens per target forward |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['k'] or '-'} | {r['identical']}/{r['prompts']} | {r['ties']} "
            f"| {r['non_ties']} | {r['tokens_per_target_forward']:.2f} |"
        )
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if any(r["non_ties"] for r in rows) else 0


def bench_prompts(tok, target: str, n: int) -> list[list[int]]:
    """The token ids `bench run --per-category n` decodes: each category's first n rows,
    chat's through the model's template."""
    from leapdecode.bench import workloads
    from leapdecode.chat import has_template
    from leapdecode.paths import PROMPTS

    cats = [c for c in workloads.CATEGORIES if c != "chat" or has_template(tok)]
    sets = workloads.load(PROMPTS, cats)
    workloads.chat_prompts(sets, tok, target)
    rows = [row for c in cats for row in sets[c][:n]]
    return [r["prompt"] if isinstance(r["prompt"], list) else tok.encode(r["prompt"]) for r in rows]


if __name__ == "__main__":
    sys.exit(main())
