"""Where one decode step and one verify step of the embedded target go, against the machine's
ceiling at these shapes.

    python bench/step_profile.py [--dtypes float32,bfloat16] [--reps 300] [--threads 1]
                                 [--no-compiled] [--out docs/step_profile]

Steps, each after a 128-token cached context and rolled back after (every repetition sees the
same state): a decode step (1 row), a chain verify (17 rows: k = 16 plus the root) and a
16-node tree verify (a root, then 4 children each with 3 more: 1 + 4 + 12 nodes, the tree
mask). For each: the median wall time (unprofiled), then `torch.profiler` over the same step
with each operation's self time put in one kind (matmuls; attention; norms, RoPE and other
elementwise work; cache reads/writes and indexing), and the rest of the wall time, which no
operation holds, as Python and dispatch. The engine's own Python (planning, proposing,
acceptance, bookkeeping) is measured in `LeapDecoder.generate` (`none` and `ngram k=16`): the
share of the call outside the target's forwards.

With the compiled forward (models/compiled.py; `--compile`), the same steps are timed again,
interleaved with the eager ones: before (eager) and after (compiled), each step's time and
share of the ceiling, and 17 verify rows over one decode row. (The profiler's kinds are for
the eager path: compiled, the elementwise work is fused into the graph's own kernels.)

The ceiling: a matmul microbenchmark (GFLOP/s) at a large square shape and at the step's own
shapes, and the memory bandwidth (a large copy, GB/s); a step's arithmetic (2 flops a
weight a row, plus attention) over its time is the share of the ceiling it reaches.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

CONTEXT = 128

# an operation's name -> kind (first pattern that the lower-case name holds)
KINDS = [  # attention first: "scaled_dot_product_attention" holds "dot" too
    ("attention", ("attention", "sdpa", "softmax", "flash")),
    ("matmul", ("mm", "matmul", "linear", "addmm", "bmm", "dot")),
    ("cache / indexing", ("index", "copy_", "gather", "scatter", "select", "slice", "narrow",
                          "embedding", "cat", "stack", "masked", "where", "arange", "clamp")),
    ("norm / RoPE / elementwise", ("norm", "rsqrt", "pow", "mean", "mul", "add", "sub", "neg",
                                   "silu", "sigmoid", "div", "to", "cos", "sin", "chunk",
                                   "split", "view", "transpose", "reshape", "unsqueeze",
                                   "expand", "contiguous", "empty", "zeros", "ones", "fill",
                                   "copy", "clone", "eq", "le", "lt", "ge", "gt", "and",
                                   "any", "all", "item", "equal", "max", "min", "sum")),
]  # fmt: skip


def kind_of(name: str) -> str:
    low = name.lower().removeprefix("aten::")
    for kind, pats in KINDS:
        if any(p in low for p in pats):
            return kind
    return "other operations"


def tree_inputs(batch: int = 1):
    """A 16-node tree: root -> 4 children -> 3 grandchildren each (parents as tree.py)."""
    from leapdecode.tree import ancestor_mask, depths

    parents = [0, 0, 0, 0] + [1 + c for c in range(4) for _ in range(3)]  # [16] draft nodes
    p = torch.tensor([parents] * batch)
    counts = torch.full((batch,), len(parents))
    mask = ancestor_mask(p, counts)  # [B, 17, 17]
    return mask, depths(mask)


def steps(vocab: int):
    g = torch.Generator().manual_seed(1)
    mask, depth = tree_inputs()
    return {
        "decode (1 row)": (torch.randint(0, vocab, (1, 1), generator=g), None, None),
        "chain verify (17 rows)": (torch.randint(0, vocab, (1, 17), generator=g), None, None),
        "tree verify (17 nodes)": (torch.randint(0, vocab, (1, 17), generator=g), mask, depth),
    }


def time_step(model, tokens, tree, offsets, slot) -> float:
    t0 = time.perf_counter()
    model.forward(tokens, slot, tree_mask=tree, position_offsets=offsets)
    dt = time.perf_counter() - t0
    model.truncate(slot, torch.tensor([CONTEXT]))
    return dt


def profile_step(model, tokens, tree, offsets, slot, reps: int, wall_s: float) -> dict:
    """ms a step by kind: each operation's self time, scaled so that the profiled step's wall
    time equals the unprofiled one (the profiler's own overhead taken out pro rata)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(reps):
            time_step(model, tokens, tree, offsets, slot)
        prof_wall = (time.perf_counter() - t0) / reps
    by_kind: dict[str, float] = {}
    n_ops = 0
    for e in prof.key_averages():
        kind = kind_of(e.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + e.self_cpu_time_total / 1e3 / reps  # ms
        n_ops += e.count
    ops_ms = sum(by_kind.values())
    scale = wall_s / prof_wall
    out = {k: v * scale for k, v in by_kind.items()}
    out["Python and dispatch (no operation)"] = max(0.0, wall_s * 1e3 - ops_ms * scale)
    return {"by_kind": out, "ops_per_step": n_ops / reps, "profiled_ms": prof_wall * 1e3}


def flops_per_row(config, context: int) -> float:
    """2 flops a weight (every linear layer and the LM head) plus attention over the context."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    d = h // heads
    per_layer = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * inter
    attention = 4 * context * heads * d  # q.k and p.v
    return 2 * (layers * per_layer + h * config.vocab_size) + layers * attention


def matmul_gflops(m: int, k: int, n: int, dtype, reps: int) -> float:
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * m * k * n / statistics.median(times) / 1e9


def bandwidth_gbs() -> float:
    src = torch.ones(64 * 2**20)  # 256 MiB of float32
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / min(times) / 1e9  # read + write


def engine_share(target: str, dtype: str, threads: int) -> dict:
    """Share of LeapDecoder.generate outside the target's forwards, none and ngram k=16."""
    from leapdecode.api import LeapDecoder

    dec = LeapDecoder.from_pretrained(target, dtype=dtype, threads=threads)
    model = dec.target
    inner = model._run
    spent = [0.0]

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            spent[0] += time.perf_counter() - t0

    model._run = timed
    prompt = "def count_words(text):\n    counts = {}\n    for word in text.split():\n"
    out = {}
    for method, k in (("none", 1), ("ngram", 16)):
        dec.generate(prompt, method=method, k=k, max_new_tokens=128)  # warm-up
        spent[0] = 0.0
        t0 = time.perf_counter()
        r = dec.generate(prompt, method=method, k=k, max_new_tokens=128)
        total = time.perf_counter() - t0
        fwd = r.stats.target_forwards
        out[method] = {"total_ms_per_forward": 1e3 * total / fwd,
                       "forward_ms": 1e3 * spent[0] / fwd,
                       "engine_ms": 1e3 * (total - spent[0]) / fwd,
                       "engine_share": 1 - spent[0] / total}  # fmt: skip
    model._run = inner
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "step_profile"))
    ap.add_argument("--no-compiled", dest="compiled", action="store_false",
                    help="time the eager forward only")  # fmt: skip
    args = ap.parse_args()

    from leapdecode.models import load_model
    from leapdecode.models.loader import load_config
    from leapdecode.paths import TARGET_NAME, default_model

    torch.set_num_threads(args.threads)
    target = default_model(TARGET_NAME)
    config = load_config(target)
    slot = torch.tensor([0])
    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, config.vocab_size, (1, CONTEXT), generator=g)
    result = {"threads": args.threads, "context": CONTEXT, "dtypes": {}}
    for dtype in args.dtypes.split(","):
        model = load_model(target, dtype=dtype)
        model.allocate(1, CONTEXT + 32)
        model.forward(context, slot)
        todo = steps(config.vocab_size)
        times = {name: [] for name in todo}
        compiled_times = {name: [] for name in todo}
        compiled = None
        if args.compiled:
            model.compile(max_rows=1)
            compiled, model.compiled = model.compiled, None
        for _ in tqdm(range(args.reps), desc=f"{dtype}: interleaved steps"):
            for name, (tokens, tree, offsets) in todo.items():
                times[name].append(time_step(model, tokens, tree, offsets, slot))
                if compiled is not None:
                    model.compiled = compiled
                    compiled_times[name].append(time_step(model, tokens, tree, offsets, slot))
                    model.compiled = None
        rows = {}
        for name, (tokens, tree, offsets) in todo.items():
            wall = statistics.median(times[name])
            prof = profile_step(model, tokens, tree, offsets, slot, max(20, args.reps // 5), wall)
            n_rows = tokens.shape[1]
            rows[name] = {"ms": wall * 1e3, "rows": n_rows,
                          "gflops": flops_per_row(config, CONTEXT) * n_rows / wall / 1e9,
                          **prof}  # fmt: skip
            if compiled is not None:
                c = statistics.median(compiled_times[name])
                rows[name]["compiled"] = {
                    "ms": c * 1e3, "gflops": flops_per_row(config, CONTEXT) * n_rows / c / 1e9
                }  # fmt: skip
        td = getattr(torch, dtype)
        h, inter, v = config.hidden_size, config.intermediate_size, config.vocab_size
        ceiling = {
            "large square 1024^3": matmul_gflops(1024, 1024, 1024, td, 10),
            f"1 x {h} x {3 * h} (qkv, decode)": matmul_gflops(1, h, 3 * h, td, 2000),
            f"1 x {h} x {2 * inter} (gate/up, decode)": matmul_gflops(1, h, 2 * inter, td, 2000),
            f"1 x {h} x {v} (LM head, decode)": matmul_gflops(1, h, v, td, 500),
            f"17 x {h} x {2 * inter} (gate/up, verify)": matmul_gflops(17, h, 2 * inter, td, 2000),
        }
        result["dtypes"][dtype] = {"steps": rows, "matmul_gflops": ceiling,
                                   "verify17_over_decode": rows["chain verify (17 rows)"]["ms"]
                                   / rows["decode (1 row)"]["ms"],
                                   "engine": engine_share(target, dtype, args.threads)}  # fmt: skip
    result["bandwidth_gbs"] = bandwidth_gbs()
    result["flops_per_row"] = flops_per_row(config, CONTEXT)
    write(result, args)
    return 0


def write(r: dict, args) -> None:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(r, f, indent=1)
    lines = ["# One step of the embedded target: where it goes, against the machine's ceiling",
             "", f"`python bench/step_profile.py --threads {args.threads}`: the embedded target "
             f"(leap-code-target), {CONTEXT} tokens cached, {args.threads} thread(s); median of "
             f"{args.reps} interleaved repetitions; kinds from torch.profiler's self times, "
             "scaled to the unprofiled step; arithmetic "
             f"{r['flops_per_row'] / 1e6:.1f} MFLOP a row. Memory bandwidth (a 256 MiB copy): "
             f"{r['bandwidth_gbs']:.1f} GB/s.", ""]  # fmt: skip
    for dtype, d in r["dtypes"].items():
        big = d["matmul_gflops"]["large square 1024^3"]
        lines += [f"## {dtype}", "", f"17 verify rows / 1 decode row: "
                  f"**{d['verify17_over_decode']:.2f}x**.", "",
                  "| step | ms | GFLOP/s | share of the 1024^3 matmul's | profiler events | "
                  + " | ".join(k for k, _ in KINDS) + " | other operations | Python and dispatch |",
                  "|---|---|---|---|---|" + "---|" * (len(KINDS) + 2)]  # fmt: skip
        for name, s in d["steps"].items():
            by = s["by_kind"]
            cells = [f"{by.get(k, 0.0):.2f}" for k, _ in KINDS]
            cells += [f"{by.get('other operations', 0.0):.2f}",
                      f"{by.get('Python and dispatch (no operation)', 0.0):.2f}"]  # fmt: skip
            lines.append(f"| {name} | {s['ms']:.2f} | {s['gflops']:.2f} | {s['gflops'] / big:.1%} "
                         f"| {s['ops_per_step']:.0f} | " + " | ".join(cells) + " |")  # fmt: skip
        first = next(iter(d["steps"].values()))
        if "compiled" in first:
            c = {n: s["compiled"] for n, s in d["steps"].items()}
            lines += ["", "Before and after: eager against the compiled forward (`--compile`), "
                      "interleaved in the same run.", "",
                      "| step | eager ms | compiled ms | eager / compiled | share of the 1024^3 "
                      "matmul's, eager | compiled |", "|---|---|---|---|---|---|"]  # fmt: skip
            for name, s in d["steps"].items():
                lines.append(f"| {name} | {s['ms']:.2f} | {c[name]['ms']:.2f} | "
                             f"**{s['ms'] / c[name]['ms']:.2f}x** | {s['gflops'] / big:.1%} | "
                             f"{c[name]['gflops'] / big:.1%} |")  # fmt: skip
            dec, ver = "decode (1 row)", "chain verify (17 rows)"
            lines += ["", f"17 verify rows / 1 decode row: eager **{d['verify17_over_decode']:.2f}x**"
                      f", compiled **{c[ver]['ms'] / c[dec]['ms']:.2f}x**."]  # fmt: skip
        lines += ["", "| matmul | GFLOP/s |", "|---|---|"]
        lines += [f"| {k} | {v:.1f} |" for k, v in d["matmul_gflops"].items()]
        lines += [
            "",
            "| engine (`LeapDecoder.generate`, 128 tokens) | ms a target forward | "
            "of which the forward | engine's Python | engine share |",
            "|---|---|---|---|---|",
        ]
        for m, e in d["engine"].items():
            lines.append(
                f"| {m} | {e['total_ms_per_forward']:.2f} | {e['forward_ms']:.2f} | "
                f"{e['engine_ms']:.2f} | {e['engine_share']:.0%} |"
            )
        lines.append("")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
