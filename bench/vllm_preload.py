"""A/B: vLLM's CPU engines with and without the libraries its CPU guide preloads (tcmalloc and
Intel OpenMP, bench/vllm_peer.py: preload), plain decoding and suffix k=16.

    python bench/vllm_preload.py [--per-category 3] [--rounds 3] [--out docs/bench/vllm-preload]

Four engines loaded side by side (each stopped between its turns, as in `bench run`), 30
warm-up requests each; then, per round, every bench prompt (the first N of each category) on
every engine, the order reversed every other round. Tokens/s from request in to last token
out; the table gives each engine's median and the with / without ratio of the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "bench", "vllm-preload"))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from leapdecode.bench import workloads
    from leapdecode.bench.vllm_peer import (
        BENCH_WARM_UP,
        HINT,
        VllmPeers,
        find_python,
        preload,
        spec_config,
    )
    from leapdecode.paths import TARGET_NAME, default_model

    python = find_python(None)
    if python is None:
        sys.exit(f"no vLLM environment: {HINT}")
    target = default_model(TARGET_NAME)
    libs = preload(python)
    print("preloaded:", libs or "nothing found", flush=True)
    tok = AutoTokenizer.from_pretrained(target)
    sets = workloads.load(os.path.join(ROOT, "bench", "prompts"))
    rows = [r for c in sets.values() for r in c[: args.per_category]]
    off = {"_env": {"LD_PRELOAD": ""}}  # an empty LD_PRELOAD: nothing preloaded
    suffix = spec_config("vllm-suffix", 16)
    configs = [("none, preloaded", None), ("none, not preloaded", dict(off)),
               ("suffix k=16, preloaded", suffix), ("suffix k=16, not preloaded", suffix | off)]  # fmt: skip
    peers = VllmPeers(python, target, configs, "float32", 1024, 1,
                      os.path.join(args.out, "logs"), warm_up=BENCH_WARM_UP, vocab_size=8192)  # fmt: skip
    speeds: dict[str, list[float]] = {label: [] for label, _ in configs}
    try:
        for rnd in range(args.rounds):
            order = [label for label, _ in configs]
            for r in rows:
                ids = tok.encode(r["prompt"])
                for label in order if rnd % 2 == 0 else order[::-1]:
                    seconds, tokens, *_ = peers.generate(label, ids, r.get("max_new_tokens", 128))
                    speeds[label].append(len(tokens) / seconds)
            print(f"round {rnd + 1}/{args.rounds}:",
                  {k: round(statistics.median(v), 1) for k, v in speeds.items()}, flush=True)  # fmt: skip
    finally:
        peers.close()
    med = {k: statistics.median(v) for k, v in speeds.items()}
    lines = ["# vLLM CPU with and without its guide's LD_PRELOAD", "",
             f"`python bench/vllm_preload.py --per-category {args.per_category} --rounds "
             f"{args.rounds}`: {len(rows)} bench prompts x {args.rounds} rounds, 1 thread, the "
             f"embedded target in float32; preloaded: {', '.join(libs) or 'nothing'}.", "",
             "| engine | tokens/s (median) |", "|---|---|"]  # fmt: skip
    lines += [f"| {k} | {v:.1f} |" for k, v in med.items()]
    lines += ["", "| method | preloaded / not |", "|---|---|",
              f"| none | {med['none, preloaded'] / med['none, not preloaded']:.3f} |",
              f"| suffix k=16 | {med['suffix k=16, preloaded'] / med['suffix k=16, not preloaded']:.3f} |",
              ""]  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
