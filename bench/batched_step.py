"""Where a busy server's time goes: prompt prefill and the batched decode step, against the
machine's ceilings (issue: an engine step ahead of vLLM's).

    python bench/batched_step.py [--rows 1,4,16] [--tokens 1,5,17] [--prompt 600] [--reps 15]
                                 [--threads 1] [--out docs/batched_step]

`bench serve` at 16 clients spends its engine's time in two places: prefilling the prompts
that arrive (one forward each, eager) and decoding every running row at once. This measures
both on the embedded target (float32):

- prefill: one prompt of `--prompt` tokens, its wall time, tokens/s and the arithmetic rate
  it reaches against a matmul microbenchmark at its own shape (the machine's ceiling there);
- the batched decode and verify steps: `rows` rows of `tokens` new tokens each (1: decode;
  k + 1: verifying a chain of k drafts), each row after a cached context of the length of a
  bench prompt (the four categories' prompts in turn, as the serve bench draws them), eager,
  compiled with the graph's own attention and compiled with the cached-attention kernel,
  interleaved, median of `--reps`. A decode step streams every row's
  cached keys and values: the bytes it must read (each row's own length) and the bytes it
  does read (every row padded to the longest, as one attention call does), each over the
  step's time, against the machine's streaming bandwidth (a large sum, GB/s).
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
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def stream_gbs() -> float:
    """Read bandwidth of one thread: a sum over 256 MiB of float32 (best of five)."""
    x = torch.ones(64 * 2**20)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / min(times) / 1e9


def median_ms(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def prompt_lengths(tokenizer) -> list[int]:
    """The bench prompts' token counts, the categories interleaved (as bench serve draws)."""
    from leapdecode.bench import workloads
    from leapdecode.bench.command import PROMPTS

    sets = workloads.load(PROMPTS)
    rows = [r for group in zip(*sets.values(), strict=False) for r in group]
    return [len(tokenizer.encode(r["prompt"])) for r in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--tokens", default="1,5,17", help="new tokens a row (1: a decode step)")
    ap.add_argument("--prompt", type=int, default=600, help="prefill length (tokens)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "batched_step"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from tqdm import tqdm
    from transformers import AutoTokenizer

    from leapdecode.models import load_model
    from leapdecode.models.loader import load_config
    from leapdecode.paths import TARGET_NAME, default_model
    from step_profile import flops_per_row, matmul_gflops

    target = default_model(TARGET_NAME)
    config = load_config(target)
    rows = [int(r) for r in args.rows.split(",")]
    lengths = prompt_lengths(AutoTokenizer.from_pretrained(target))
    model = load_model(target, dtype="float32")
    max_rows = max(rows)
    model.allocate(max_rows, model.max_context + 32)
    print(f"compiling the forward for up to {max_rows} rows...", flush=True)
    from leapdecode.models.compiled import CompiledForward

    model.compile(max_rows=max_rows)
    compiled = model.compiled
    graph_only = CompiledForward(model, (), kernel=False)  # the graph's own attention
    graph_only.warm_up(max_rows)
    paths = (("eager", None), ("graph attention", graph_only), ("compiled", compiled))
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_bytes_token = 2 * layers * kv_heads * head_dim * 4  # keys and values, every layer
    r: dict = {"threads": args.threads, "stream_gbs": stream_gbs(),
               "torch": torch.__version__, "kernel": compiled.kernel}  # fmt: skip

    # prefill: one prompt, eager (a prompt is longer than the compiled steps)
    n = min(args.prompt, model.max_context - 1)
    tokens = torch.randint(1, config.vocab_size, (1, n))
    slot = torch.tensor([0])

    def prefill():
        model.truncate(slot, torch.zeros(1, dtype=torch.long))
        model.forward(tokens, slot, logits_at=torch.tensor([n - 1]))

    model.compiled = None  # eager, as the table says (bench/prefill_step.py: both paths)
    ms = median_ms(prefill, max(3, args.reps // 3))
    model.compiled = compiled
    flops = sum(flops_per_row(config, c) - 2 * config.hidden_size * config.vocab_size
                for c in range(n)) + 2 * config.hidden_size * config.vocab_size  # fmt: skip
    r["prefill"] = {"tokens": n, "ms": ms, "tokens_per_s": n / ms * 1e3,
                    "gflops": flops / ms / 1e6,
                    "matmul_ceiling_gflops": matmul_gflops(n, config.hidden_size,
                                                           config.intermediate_size * 2,
                                                           torch.float32, 20)}  # fmt: skip

    # the batched decode and verify steps, the three paths interleaved
    r["decode"] = []
    shapes = [(b, t) for b in rows for t in (int(x) for x in args.tokens.split(","))]
    for b, t in tqdm(shapes, desc="batched steps", unit="shape"):
        ctx = torch.tensor([min(lengths[i % len(lengths)] + 32, model.max_context - 2 - t)
                            for i in range(b)])  # fmt: skip
        slots = torch.arange(b)
        model.allocate(max_rows, model.max_context + 32)
        model.cache.lens[:b] = ctx

        def step(b=b, t=t, slots=slots, ctx=ctx):
            model.forward(torch.randint(1, config.vocab_size, (b, t)), slots)
            model.cache.lens[:b] = ctx

        times = {name: [] for name, _ in paths}
        for _ in range(2):
            for _, path in paths:
                model.compiled = path
                step()
        for _ in range(args.reps):
            for name, path in paths:
                model.compiled = path
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
        model.compiled = compiled
        must = int(ctx.sum()) * kv_bytes_token
        padded = b * int(ctx.max()) * kv_bytes_token
        entry = {"rows": b, "tokens": t, "context_mean": float(ctx.float().mean()),
                 "context_max": int(ctx.max()), "kv_mb_needed": must / 1e6,
                 "kv_mb_read": padded / 1e6}  # fmt: skip
        for name, ts in times.items():
            s = statistics.median(ts)
            entry[name] = {"ms": s * 1e3, "tokens_per_s": b / s,
                           "needed_gbs": must / s / 1e9, "read_gbs": padded / s / 1e9}  # fmt: skip
        r["decode"].append(entry)
    write(r, args)
    return 0


def write(r: dict, args) -> None:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(r, f, indent=1)
    p = r["prefill"]
    lines = [
        "# Where a busy server's time goes: prefill and the batched decode and verify steps",
        "",
        f"`python bench/batched_step.py --rows {args.rows} --tokens {args.tokens} --prompt "
        f"{args.prompt} --reps "
        f"{args.reps} --threads {args.threads}`: the embedded target in float32, torch "
        f"{r['torch']}, {r['threads']} thread(s). Streaming read bandwidth of one thread (a sum "
        f"over 256 MiB): **{r['stream_gbs']:.1f} GB/s**.",
        "",
        "## Prefill (one prompt, eager)",
        "",
        "| tokens | ms | tokens/s | GFLOP/s reached | matmul ceiling at this shape |",
        "|---|---|---|---|---|",
        f"| {p['tokens']} | {p['ms']:.1f} | {p['tokens_per_s']:.0f} | {p['gflops']:.1f} | "
        f"{p['matmul_ceiling_gflops']:.1f} GFLOP/s |",
        "",
        "## The batched decode and verify steps: eager, compiled with the graph's own "
        "attention, compiled with the cached-attention kernel",
        "",
        "Each row's cached context is a bench prompt's length plus 32 (the categories in turn); "
        "tokens: new tokens a row (1: a decode step, k + 1: the verify step of a k-token chain). "
        "KV needed: the keys and values of each row's own context, every layer; padded: every "
        "row padded to the longest, what one attention call over the batch streams (the eager "
        "step and the graph's own attention). The kernel (`models/attention_cpu.py`"
        + (
            ""
            if r["kernel"]
            else "; not built on this machine, so 'compiled' is the graph's attention here"
        )
        + ") reads each row's own: a decode step streams it once, a verify "
        "step's queries share one matrix product per key/value head. GB/s: the needed bytes "
        "over the kernel step's time, against the streaming bandwidth above; x 1 token: the "
        "step against the one-token step of as many rows on the same path.",
        "",
        "| rows | tokens | context mean / max | KV needed / padded MB | eager ms | compiled, "
        "graph attention ms | compiled, kernel ms | eager / kernel | graph / kernel | "
        "graph x 1 token | kernel x 1 token | kernel GB/s (share of bandwidth) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    one = {e["rows"]: e for e in r["decode"] if e.get("tokens", 1) == 1}
    for e in r["decode"]:
        eg, gr, cp = e["eager"], e["graph attention"], e["compiled"]
        base = one.get(e["rows"])

        def rel(name, e=e, base=base):
            return f"{e[name]['ms'] / base[name]['ms']:.2f}x" if base else "-"

        lines.append(
            f"| {e['rows']} | {e.get('tokens', 1)} | {e['context_mean']:.0f} / "
            f"{e['context_max']} | {e['kv_mb_needed']:.1f} / {e['kv_mb_read']:.1f} | "
            f"{eg['ms']:.2f} | {gr['ms']:.2f} | {cp['ms']:.2f} | {eg['ms'] / cp['ms']:.2f}x | "
            f"{gr['ms'] / cp['ms']:.2f}x | {rel('graph attention')} | {rel('compiled')} | "
            f"{cp['needed_gbs']:.1f} ({cp['needed_gbs'] / r['stream_gbs']:.0%}) |"
        )
    lines += ["", "![batched step](batched_step.png)", ""]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for t in sorted({e.get("tokens", 1) for e in r["decode"]}):
        es = [e for e in r["decode"] if e.get("tokens", 1) == t]
        xs = [e["rows"] for e in es]
        for name, style in (("graph attention", "--"), ("compiled", "-")):
            label = "kernel" if name == "compiled" else name
            ax.plot(xs, [e[name]["ms"] for e in es], style, marker="o",
                    label=f"{label}, {t} token(s) a row")  # fmt: skip
    ax.set_xlabel("rows (bench prompt contexts)")
    ax.set_ylabel("step, ms (compiled)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
