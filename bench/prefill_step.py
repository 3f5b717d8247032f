"""Prefill: fresh prompts through the eager forward, the compiled prompt graph with SDPA's
causal attention, and the compiled prompt graph with the kernel's (`--compile`;
models/compiled.py `fresh`, attention_cpu.py `causal_attention`), interleaved, median of --reps.

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
    from leapdecode.models.compiled import CompiledForward

    sdpa = CompiledForward(model, kernel=False)  # its prompt graphs compile on first use
    paths = (("eager", None), ("sdpa", sdpa), ("compiled", compiled))
    rows = []
    for b, n in tqdm(SHAPES, desc="prefill shapes", unit="shape"):
        tokens = torch.randint(1, vocab, (b, n))
        slots, last = torch.arange(b), torch.full((b,), n - 1)

        def prefill(path, tokens=tokens, slots=slots, last=last, b=b):
            model.compiled = path
            model.truncate(slots, torch.zeros(b, dtype=torch.long))
            model.forward(tokens, slots, logits_at=last)

        times = {name: [] for name, _ in paths}
        for _ in range(2):
            for _, path in paths:
                prefill(path)
        for _ in range(args.reps):
            for name, path in paths:
                t0 = time.perf_counter()
                prefill(path)
                times[name].append(time.perf_counter() - t0)
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rows.append({"prompts": b, "tokens": n, **{f"{k}_ms": v for k, v in ms.items()}})
    model.compiled = compiled
    flops = forward_flops(model)
    for r in rows:
        r["gflop"] = r["prompts"] * flops(r["tokens"]) / 1e9
    write(rows, matmul_rates(model, args.reps), args)
    return 0


def forward_flops(model):
    """A prompt of n tokens' arithmetic: 2 flops a layer weight a token, the causal attention
    (4 x heads x head_dim flops a key, (n + 1) / 2 keys a token on average) and the LM head at
    the last token."""
    cfg = model.config
    hidden, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    h, h_kv, d = model.n_heads, model.n_kv_heads, model.head_dim
    weights = layers * (hidden * (h + 2 * h_kv) * d + h * d * hidden + 3 * hidden * inter)

    def flops(n: int) -> float:
        attention = layers * 4 * h * d * n * (n + 1) / 2
        return 2 * weights * n + attention + 2 * hidden * model.vocab_size

    return flops


def matmul_rates(model, reps: int) -> list[dict]:
    """GFLOP/s of the prompt graph's matmuls alone, at its shapes (rows x in -> out), in float32
    as the native backend lays its weights ([in, out], `torch.matmul`) and in bfloat16
    (`F.linear`, oneDNN), and of a 1024^3 product: the ceiling a prompt forward runs against."""
    import torch.nn.functional as F

    cfg = model.config
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    qkv = (model.n_heads + 2 * model.n_kv_heads) * model.head_dim
    shapes = [(m, k, n) for m in (356, 600) for k, n in
              ((hidden, qkv), (hidden, 2 * inter), (inter, hidden))]  # fmt: skip
    shapes.append((1024, 1024, 1024))
    out = []
    for m, k, n in shapes:
        x, w = torch.randn(m, k), torch.randn(n, k)
        wt = w.t().contiguous()
        xb, wb = x.bfloat16(), w.bfloat16()
        runs = {
            "float32": lambda x=x, wt=wt: torch.matmul(x, wt),
            "bfloat16": lambda xb=xb, wb=wb: F.linear(xb, wb),
        }
        times = {name: [] for name in runs}
        for _ in range(3):
            for f in runs.values():
                f()
        for _ in range(max(reps, 5) * 3):
            for name, f in runs.items():
                t0 = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t0)
        rate = {f"{name}_gflops": 2 * m * k * n / statistics.median(t) / 1e9
                for name, t in times.items()}  # fmt: skip
        out.append({"rows": m, "in": k, "out": n, **rate})
    return out


def write(rows: list[dict], rates: list[dict], args) -> None:
    with open(args.out + ".json", "w") as f:
        json.dump({"threads": args.threads, "torch": torch.__version__, "rows": rows,
                   "matmul": rates}, f, indent=1)  # fmt: skip
    lines = [
        "# Prefill: eager and compiled",
        "",
        "The compiled prompt graph's attention: SDPA's causal path (`compiled, SDPA`) or the "
        "C++ kernel's `causal_attention` (`compiled`; what `--compile` runs on CPU in float32 "
        "where the kernel builds).",
        "",
        f"`python bench/prefill_step.py --threads {args.threads} --reps {args.reps}`: the "
        f"embedded target in float32, torch {torch.__version__}, {args.threads} thread(s); "
        f"fresh prompts (nothing cached), logits at each prompt's last token; median of "
        f"{args.reps} interleaved forwards.",
        "",
        "| prompts x tokens | eager ms | compiled, SDPA ms | compiled ms | eager / compiled | "
        "SDPA / kernel | compiled tokens/s | compiled GFLOP/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n = r["prompts"] * r["tokens"]
        lines.append(
            f"| {r['prompts']} x {r['tokens']} | {r['eager_ms']:.1f} | {r['sdpa_ms']:.1f} | "
            f"{r['compiled_ms']:.1f} | {r['eager_ms'] / r['compiled_ms']:.2f}x | "
            f"{r['sdpa_ms'] / r['compiled_ms']:.2f}x | {n / r['compiled_ms'] * 1e3:.0f} | "
            f"{r['gflop'] / r['compiled_ms'] * 1e3:.1f} |"
        )
    lines += [
        "",
        "GFLOP/s: the forward's arithmetic (2 flops a layer weight a token, the causal "
        "attention, the LM head at the last token) over its time. The ceiling it runs "
        "against, the same matmuls alone (median of interleaved calls; float32 as the native "
        "backend lays its weights, `torch.matmul` with [in, out]; bfloat16 `F.linear`):",
        "",
        "| rows x in -> out | float32 GFLOP/s | bfloat16 GFLOP/s |",
        "|---|---|---|",
    ]
    for r in rates:
        lines.append(
            f"| {r['rows']} x {r['in']} -> {r['out']} | {r['float32_gflops']:.1f} | "
            f"{r['bfloat16_gflops']:.1f} |"
        )
    lines += ["", "![prefill](prefill_step.png)", ""]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(rows))
    labels = {"eager": "eager", "sdpa": "compiled, SDPA", "compiled": "compiled, kernel"}
    for i, key in enumerate(labels):
        ax.bar([x + (i - 1) * 0.27 for x in xs], [r[f"{key}_ms"] for r in rows], 0.27,
               label=labels[key])  # fmt: skip
    ax.set_xticks(list(xs), [f"{r['prompts']} x {r['tokens']}" for r in rows])
    ax.set_ylabel("ms a prefill forward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
