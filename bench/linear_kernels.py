"""The linear layers of a real target, one kernel against another, at the row counts a step
has: 1 (decode), 5, 9, 17 (a verify of 4, 8, 16 tokens).

    python bench/linear_kernels.py [--target qwen2.5-coder-1.5b-instruct] [--rows 1,5,9,17]
                                   [--reps 30] [--threads 2] [--out docs/linear_kernels]

The shapes are the target's (read from its config.json; random weights): the fused q/k/v
projection, the attention output, the fused gate/up, the down projection and the LM head.
Kernels (where this torch has them):
  - `F.linear`, bfloat16 and float32 (float32 as the native backend runs it: [in, out], matmul);
  - oneDNN with the weight prepacked once (`torch.ops.mkldnn._reorder_linear_weight`, then
    `_linear_pointwise`), bfloat16; and the engine's own wrapper of it (`models/ops.py:
    Packed`, a call of under 4 rows run as 4) in bfloat16 and float32;
  - MKL's packed float32 GEMM (`torch.ops.mkl._mkl_reorder_linear_weight`, `_mkl_linear`);
  - weight-only int8 (`torch._weight_int8pack_mm`, a scale per output channel) and int4
    (`torch._weight_int4pack_mm_for_cpu`, groups of 128), bfloat16 activations.
For each: the median time of a call (all kernels interleaved within a repetition), the weight
bytes read over it (GB/s), its cost at each row count over one row, and whether row i of an
n-row call holds the same bits as a one-row call on that row alone (what a verify row must
compute for greedy output to match plain decoding's in every dtype). Writes OUT.md, OUT.json
and OUT.png (ms of a whole layer stack against rows).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

GROUP = 128  # int4 group size


def shapes(config: dict) -> dict[str, tuple[int, int, int]]:
    """name -> (out, in, times a step), from a Hugging Face config."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    d = config.get("head_dim") or h // heads
    n = config["num_hidden_layers"]
    return {
        "q/k/v": ((heads + 2 * kv) * d, h, n),
        "attention out": (h, heads * d, n),
        "gate/up": (2 * inter, h, n),
        "down": (h, inter, n),
        "LM head": (config["vocab_size"], h, 1),
    }


def kernels(w: torch.Tensor) -> dict:
    """name -> (fn(x) -> y, bytes of weights read, activation dtype) for one float32 weight
    [out, in]; a kernel this torch lacks is left out (with a line saying so)."""
    out_f, in_f = w.shape
    wb = w.to(torch.bfloat16)
    ks = {"F.linear bf16": (lambda x, wb=wb: F.linear(x, wb), wb.numel() * 2, torch.bfloat16)}
    wt = w.t().contiguous()  # [in, out]
    ks["matmul f32 [in, out]"] = (lambda x: torch.matmul(x, wt), w.numel() * 4, torch.float32)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(wb, 1)
        fn = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
        fn(torch.zeros(1, in_f, dtype=torch.bfloat16))
        ks["oneDNN prepacked bf16"] = (fn, wb.numel() * 2, torch.bfloat16)
    except (RuntimeError, AttributeError) as e:
        print(f"no prepacked oneDNN bf16 here: {str(e).splitlines()[0]}")
    from leapdecode.models.ops import Packed

    for hint in (16, 64):  # oneDNN's layout picked for another batch size than the engine's 4
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(wb, hint)
            fn = lambda x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")  # noqa: E731
            fn(torch.zeros(4, in_f, dtype=torch.bfloat16))
            ks[f"oneDNN prepacked bf16, layout for {hint} rows"] = (
                fn,
                wb.numel() * 2,
                torch.bfloat16,
            )
        except (RuntimeError, AttributeError):
            pass
    for dt, tag in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
        try:  # the engine's own kernel (models/ops.py): fewer than 4 rows padded to 4
            p = Packed(w.to(dt))
            p.matmul(torch.zeros(1, in_f, dtype=dt))
            ks[f"engine's Packed {tag} (oneDNN, rows padded)"] = (
                lambda x, p=p: p.matmul(x),
                w.numel() * dt.itemsize,
                dt,
            )
        except (RuntimeError, AttributeError) as e:
            print(f"no oneDNN {tag} packing here: {str(e).splitlines()[0]}")
    try:
        mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, 1)
        fn = lambda x: torch.ops.mkl._mkl_linear(x, mkl, w, None, 1)  # noqa: E731
        fn(torch.zeros(1, in_f))
        ks["MKL packed f32"] = (fn, w.numel() * 4, torch.float32)
    except (RuntimeError, AttributeError) as e:
        print(f"no packed MKL float32 here: {str(e).splitlines()[0]}")
    # int8, a scale per output channel
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127  # [out]
    w8 = (w / scale[:, None]).round().clamp(-128, 127).to(torch.int8)
    s8 = scale.to(torch.bfloat16)
    try:
        fn = lambda x: torch._weight_int8pack_mm(x, w8, s8)  # noqa: E731
        fn(torch.zeros(1, in_f, dtype=torch.bfloat16))
        ks["int8 weight-only"] = (fn, w8.numel() + s8.numel() * 2, torch.bfloat16)
    except (RuntimeError, AttributeError) as e:
        print(f"no int8 weight-only kernel here: {str(e).splitlines()[0]}")
    # int4, groups of GROUP along in, asymmetric (scale, zero) as gpt-fast does it
    if in_f % GROUP == 0:
        g = w.reshape(out_f, in_f // GROUP, GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        s4 = (hi - lo).clamp(min=1e-6) / 15  # [out, groups]
        q = ((g - lo[..., None]) / s4[..., None]).round().clamp(0, 15).to(torch.int32)
        zero = lo + 8 * s4  # gpt-fast's convention: w = (q - 8) * scale + zero
        sz = torch.stack([s4, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        try:
            p4 = torch._convert_weight_to_int4pack_for_cpu(q.reshape(out_f, in_f), 1)
            fn = lambda x: torch._weight_int4pack_mm_for_cpu(x, p4, GROUP, sz)  # noqa: E731
            fn(torch.zeros(1, in_f, dtype=torch.bfloat16))
            ks["int4 weight-only (g128)"] = (fn, out_f * in_f // 2 + sz.numel() * 2,
                                             torch.bfloat16)  # fmt: skip
        except (RuntimeError, AttributeError) as e:
            print(f"no int4 weight-only kernel here: {str(e).splitlines()[0]}")
    return ks


def same_bits(fn, x: torch.Tensor) -> bool:
    """Row i of fn(x) equals fn(x[i:i+1]) bit for bit, every i."""
    whole = fn(x)
    return all(torch.equal(whole[i : i + 1], fn(x[i : i + 1])) for i in range(x.shape[0]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct",
                    help="a catalogue name or a folder: its config.json gives the shapes")  # fmt: skip
    ap.add_argument("--rows", default="1,5,9,17")
    ap.add_argument("--shapes", default=None, help="only these shapes (comma-separated names)")
    ap.add_argument("--kernels", default=None, help="only kernels whose name holds one of these")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "linear_kernels"))
    args = ap.parse_args()

    from leapdecode.resolve import resolve_models

    torch.set_num_threads(args.threads)
    folder = resolve_models(args.target, None)[0]
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    rows = [int(r) for r in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    result = {"target": args.target, "threads": args.threads, "rows": rows, "shapes": {}}
    wanted = args.shapes.split(",") if args.shapes else None
    for name, (out_f, in_f, times) in shapes(config).items():
        if wanted and name not in wanted:
            continue
        w = torch.randn(out_f, in_f, generator=g) * in_f**-0.5
        ks = kernels(w)
        if args.kernels:
            ks = {k: v for k, v in ks.items() if any(p in k for p in args.kernels.split(","))}
        xs = {n: torch.randn(n, in_f, generator=g) for n in rows}
        ms = {k: {n: [] for n in rows} for k in ks}
        for _ in tqdm(range(args.reps), desc=f"{name} {out_f}x{in_f}"):
            for k, (fn, _, dt) in ks.items():
                for n in rows:
                    x = xs[n].to(dt)
                    t0 = time.perf_counter()
                    fn(x)
                    ms[k][n].append((time.perf_counter() - t0) * 1e3)
        entry = {"out": out_f, "in": in_f, "times_a_step": times, "kernels": {}}
        for k, (fn, nbytes, dt) in ks.items():
            med = {n: statistics.median(v[2:]) for n, v in ms[k].items()}
            entry["kernels"][k] = {
                "ms": med,
                "gbs_1_row": nbytes / med[rows[0]] / 1e6,
                "bytes": nbytes,
                "same_bits": same_bits(fn, xs[max(rows)].to(dt)),
            }
        result["shapes"][name] = entry
        del w, ks
    write(result, args)
    return 0


def write(r: dict, args) -> None:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(r, f, indent=1)
    rows = r["rows"]
    lines = [f"# The linear layers of {r['target']}, kernel by kernel", "",
             f"`python bench/linear_kernels.py {' '.join(sys.argv[1:])}`: {r['threads']} "
             f"thread(s), random weights at the target's shapes, medians of {args.reps} "
             "interleaved calls. `same bits`: row i of a "
             f"{max(rows)}-row call equals a one-row call on row i, every row.", ""]  # fmt: skip
    stack: dict[str, dict[int, float]] = {}
    for name, e in r["shapes"].items():
        lines += [f"## {name}: {e['out']} x {e['in']} ({e['times_a_step']} a step)", "",
                  "| kernel | " + " | ".join(f"{n} row{'s' * (n > 1)} ms" for n in rows)
                  + f" | GB/s at {rows[0]} | " + " | ".join(f"{n} / {rows[0]}" for n in rows[1:])
                  + " | same bits |", "|---|" + "---|" * (2 * len(rows) + 1)]  # fmt: skip
        for k, x in e["kernels"].items():
            ms = {int(n): v for n, v in x["ms"].items()}
            for n in rows:
                stack.setdefault(k, {}).setdefault(n, 0.0)
                stack[k][n] += ms[n] * e["times_a_step"]
            lines.append(f"| {k} | " + " | ".join(f"{ms[n]:.2f}" for n in rows)
                         + f" | {x['gbs_1_row']:.1f} | "
                         + " | ".join(f"{ms[n] / ms[rows[0]]:.2f}x" for n in rows[1:])
                         + f" | {'yes' if x['same_bits'] else '**no**'} |")  # fmt: skip
        lines.append("")
    lines += ["## Every linear layer of a step (the sum over layers)", "",
              "| kernel | " + " | ".join(f"{n} row{'s' * (n > 1)} ms" for n in rows) + " | "
              + " | ".join(f"{n} / {rows[0]}" for n in rows[1:]) + " |",
              "|---|" + "---|" * (2 * len(rows) - 1)]  # fmt: skip
    for k, by in stack.items():
        lines.append(f"| {k} | " + " | ".join(f"{by[n]:.1f}" for n in rows) + " | "
                     + " | ".join(f"{by[n] / by[rows[0]]:.2f}x" for n in rows[1:]) + " |")  # fmt: skip
    lines.append("")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    plot(stack, rows, args.out + ".png", r["target"])


def plot(stack: dict, rows: list[int], path: str, target: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for k, by in stack.items():
        ax.plot(rows, [by[n] for n in rows], marker="o", label=k)
    ax.set_xlabel("rows in the step (1 = decode, k + 1 = a verify of k)")
    ax.set_ylabel("ms, every linear layer of a step")
    ax.set_title(f"{target}: linear layers by kernel")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
