"""Engine-level load without HTTP: C closed-loop clients step the engine directly.

Each client submits its next request (the bench prompts, all categories round robin, at
most 64 new tokens) as soon as its last one finishes, as `leapdecode bench serve`'s clients
do, but through `Engine.add_request` / `step` in one process, so the server's threads and
the clients' CPU are out of the picture. Configurations are interleaved ABBA; per run it
prints throughput, decode steps, time in planning and in prefill, and the methods the plan
chose (with k > 0), then the median throughput per configuration.

    python bench/closed_loop.py --concurrency 4 --requests 16 --rounds 3 \\
        --configs suffix16,ngram8,auto,auto-no-draft

A configuration named NAME-padded runs NAME with every chain verify step padded to its
longest row, as before the target packed rows (`CausalLM.packs_rows`).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

from leapdecode import LeapDecoder
from leapdecode.bench import workloads
from leapdecode.bench.command import PROMPTS
from leapdecode.config import SpecConfig
from leapdecode.paths import resolve_models

CONFIGS = {
    "none": dict(method="none", num_speculative_tokens=0),
    "ngram4": dict(method="ngram", num_speculative_tokens=4),
    "ngram8": dict(method="ngram", num_speculative_tokens=8),
    "suffix16": dict(method="suffix", num_speculative_tokens=16),
    "auto": dict(method="auto", num_speculative_tokens=4),
    "auto-no-draft": dict(
        method="auto", num_speculative_tokens=4, auto_methods=("ngram", "suffix")
    ),
    "auto-ngram": dict(method="auto", num_speculative_tokens=4, auto_methods=("ngram",)),
    # the static batch-size -> k table of `leapdecode bench serve` (bench/serve.py STATIC_TABLE)
    "draft-table": dict(
        method="draft",
        num_speculative_tokens=4,
        num_speculative_tokens_per_batch_size=((1, 4), (2, 3), (4, 2), (8, 1), (16, 0)),
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16, help="requests per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="suffix16,ngram8,auto",
                    help=",".join(CONFIGS) + " (each also as NAME-padded)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", action="store_true", help="the compiled forward (--compile)")
    ap.add_argument("--dtype", default="auto", help="the target's dtype (auto: the checkpoint's)")
    ap.add_argument("--prefill", action="store_true",
                    help="also time each round's prompts alone (one token each), as "
                         "bench/vllm_closed_loop.py --prefill does for vLLM")  # fmt: skip
    args = ap.parse_args()
    labels = args.configs.split(",")
    target, draft = resolve_models(None, None)
    dec = LeapDecoder.from_pretrained(target, draft=draft, threads=args.threads,
                                      suffix_decoding_max_cached_requests=0,
                                      compile=args.compile, dtype=args.dtype)  # fmt: skip
    eng = dec.engine
    sets = workloads.load(PROMPTS)
    rows = [r for group in zip(*sets.values(), strict=False) for r in group]
    steps: list[dict] = []
    packs_rows = type(eng.target).packs_rows
    plan, decode, prefill = eng.planner.plan, eng._decode, eng._prefill

    def timed_plan(seqs):
        t = time.perf_counter()
        out = plan(seqs)
        steps[-1].update(plan_s=time.perf_counter() - t, plan=out)
        return out

    def timed_decode(seqs):
        steps.append({})
        before = [len(s.tokens) for s in seqs]
        t = time.perf_counter()
        out = decode(seqs)
        steps[-1].update(
            step_s=time.perf_counter() - t,
            emitted=[len(s.tokens) - n for s, n in zip(seqs, before, strict=True)],
        )
        return out

    def timed_prefill(seqs):
        t = time.perf_counter()
        out = prefill(seqs)
        steps.append({"prefill_s": time.perf_counter() - t})
        return out

    eng.planner.plan, eng._decode, eng._prefill = timed_plan, timed_decode, timed_prefill

    def run(label: str, start: int, one_token: bool = False) -> dict:
        # NAME-padded: NAME with every chain step padded to its longest row (packs_rows off)
        padded = label.endswith("-padded")
        type(eng.target).packs_rows = property(lambda m: 0) if padded else packs_rows
        spec = SpecConfig(**CONFIGS[label.removesuffix("-padded")])
        todo, active = iter(range(args.requests)), []

        def submit():
            i = next(todo, None)
            if i is not None:
                r = rows[(start + i) % len(rows)]
                n = 1 if one_token else min(64, r["max_new_tokens"])
                s = dec.request(r["prompt"], spec=spec, max_new_tokens=n)
                eng.add_request(s)
                active.append(s)

        steps.clear()
        for _ in range(args.concurrency):
            submit()
        t0, tokens = time.perf_counter(), 0
        while active:
            eng.step()
            for s in [s for s in active if s.finished]:
                active.remove(s)
                tokens += len(s.output)
                submit()
        wall = time.perf_counter() - t0
        chosen = collections.Counter(m for s in steps for m, k in s.get("plan", []) if k)
        # tokens a row emitted on the steps its plan chose each method (k = 0: "none")
        by = collections.defaultdict(list)
        for s in steps:
            for (m, k), n in zip(s.get("plan", []), s.get("emitted", []), strict=False):
                by[m if k else "none"].append(n)
        name = label + (" prefill" if one_token else "")
        return {"config": name, "tok_s": round(tokens / wall, 1), "wall_s": round(wall, 2),
                "decode_steps": sum(1 for s in steps if "plan" in s),
                "plan_s": round(sum(s.get("plan_s", 0) for s in steps), 3),
                "prefill_s": round(sum(s.get("prefill_s", 0) for s in steps), 2),
                "chosen": dict(chosen),
                "tok_per_row_step": {m: round(statistics.mean(v), 2) for m, v in by.items()}}  # fmt: skip

    for label in labels:  # warm-up
        run(label, len(rows) // 2)
    results = collections.defaultdict(list)
    alone: list[float] = []  # the prompts alone, a round each (--prefill)
    for r in range(args.rounds):
        for label in labels if r % 2 == 0 else labels[::-1]:
            out = run(label, r * args.requests)
            results[label].append(out["tok_s"])
            print(json.dumps(out), flush=True)
        if args.prefill:
            out = run(labels[0], r * args.requests, one_token=True)
            alone.append(out["wall_s"])
            print(json.dumps(out), flush=True)
    for label in labels:
        print(f"{label}: median {statistics.median(results[label]):.1f} tokens/s")
    if alone:
        print(f"prefill alone: median {statistics.median(alone):.2f} s")


if __name__ == "__main__":
    main()
