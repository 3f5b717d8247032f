"""The EAGLE head's drafting layer, eager against torch.compile: does compiling it pay?

    python bench/eagle_head_step.py [--prompts 3] [--reps 7] [--threads 1]

Generates `--prompts` completion prompts (64 tokens each, `eagle` k=3, the compiled target)
while recording every call of the head's two halves (`Eagle3Runner.qkv` and `.finish`: the
catch-up and one call per tree depth), then replays those calls eager and compiled
(torch.compile, dynamic shapes, the C++ wrapper on CPU), interleaved, median of --reps
replays. Writes docs/eagle_head_step.{md,json,png}.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "eagle_head_step"))
    args = ap.parse_args()
    from leapdecode import LeapDecoder
    from leapdecode.bench import workloads
    from leapdecode.bench.command import PROMPTS
    from leapdecode.paths import resolve_models

    target, draft = resolve_models(None, None)
    dec = LeapDecoder.from_pretrained(target, draft=draft, threads=args.threads, compile=True)
    proposer = dec.engine.proposers.get("eagle")
    if proposer is None:
        raise SystemExit("no EAGLE head beside the target: train one (`leapdecode train eagle`)")
    calls: list[tuple[str, list]] = []
    for name in ("qkv", "finish"):
        f = getattr(proposer.run, name)

        def record(*a, _f=f, _name=name):
            calls.append((_name, [x.clone() if torch.is_tensor(x) else x for x in a]))
            return _f(*a)

        setattr(proposer.run, name, record)
    for r in workloads.load(PROMPTS)["completion"][: args.prompts]:
        dec.generate(r["prompt"], max_new_tokens=64, method="eagle", k=3)
    shapes = collections.Counter((n, tuple(a[0].shape)) for n, a in calls)
    eager = proposer.head.runner()
    options = {"cpp_wrapper": proposer.target.device.type == "cpu"}
    compiled = {
        n: torch.compile(getattr(eager, n), dynamic=True, options=options)
        for n in ("qkv", "finish")
    }

    def replay(fns) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            for n, a in calls:
                fns[n](*a)
        return time.perf_counter() - t0

    plain = {"qkv": eager.qkv, "finish": eager.finish}
    t0 = time.perf_counter()
    replay(compiled)  # compiles
    compile_s = time.perf_counter() - t0
    replay(compiled)
    times = {"eager": [], "compiled": []}
    for _ in range(args.reps):
        times["eager"].append(replay(plain))
        times["compiled"].append(replay(compiled))
    with torch.inference_mode():
        n, a = next(c for c in calls if c[0] == "finish")
        diff = float((compiled[n](*a)[1] - plain[n](*a)[1]).abs().max())
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "calls": len(calls),
        "shapes": {f"{n} {list(s)}": c for (n, s), c in shapes.most_common()},
        "eager_s": med["eager"],
        "compiled_s": med["compiled"],
        "compile_s": compile_s,
        "max_abs_diff": diff,
        "torch": torch.__version__,
        "threads": args.threads,
    }
    with open(args.out + ".json", "w") as f:
        json.dump(out, f, indent=1)
    lines = [
        "# The EAGLE head's drafting layer: eager against compiled",
        "",
        f"`python bench/eagle_head_step.py --prompts {args.prompts} --reps {args.reps} "
        f"--threads {args.threads}`: the {len(calls)} calls of `Eagle3Runner.qkv` and `.finish` "
        f"in {args.prompts} generations of 64 tokens (`eagle` k=3, the compiled target), "
        f"replayed eager and compiled (torch.compile, dynamic shapes, C++ wrapper), "
        f"interleaved, median of {args.reps}; torch {torch.__version__}.",
        "",
        "| replay | seconds | a call, ms |",
        "|---|---|---|",
    ]
    for k in ("eager", "compiled"):
        lines.append(f"| {k} | {med[k]:.4f} | {med[k] / len(calls) * 1e3:.3f} |")
    lines += [
        "",
        f"Eager / compiled: **{med['eager'] / med['compiled']:.2f}x**. Compiling took "
        f"{compile_s:.1f} s; the largest logit difference {diff:.1e}.",
        "",
        "Calls by shape (first argument): "
        + ", ".join(f"{n} {list(s)} x {c}" for (n, s), c in shapes.most_common(6)),
        "",
        "![eagle head](eagle_head_step.png)",
        "",
    ]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 3))
    ax.bar(["eager", "compiled"], [med["eager"] / len(calls) * 1e3,
                                   med["compiled"] / len(calls) * 1e3])  # fmt: skip
    ax.set_ylabel("ms a head call")
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
