"""A compiled forward step for the native backend, measured against the eager one before it is
built into the engine (issue: an engine step ahead of vLLM's).

    python bench/compiled_step.py [--modes default,cpp] [--reps 200] [--threads 1]
                                  [--out docs/compiled_step]

The candidate: the whole forward of the embedded target as one function for torch.compile
(inductor's C++ backend), the KV cache an input it only reads. Attention runs in two parts,
the cached prefix and the step's own new tokens, joined in one softmax, so the graph never
copies or writes the cache; it returns the new keys and values, which the caller writes with
one slice assignment a layer. Each step shape (rows x tokens) is a graph of its own here.

For every shape, after a 128-token cached context in each row: the eager step
(`NativeLlama.forward`, rolled back after) and the compiled one, interleaved, median of
`--reps`; the largest logit difference between them; the first call's time (the compile).
Modes: `default` (inductor), `cpp` (inductor's C++ wrapper: no Python between kernels),
`max-autotune` (with freezing: inductor may pick its own C++ matmul kernels).
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

CONTEXT = 128
SHAPES = [(1, 1), (1, 5), (1, 17), (4, 1), (16, 1), (16, 5)]  # (rows, tokens a row)


def make_step(model):
    """The forward as one function: (tokens [B, T], first slot, cached length) -> logits
    [B, T, V], new keys and values [L, B, H_kv, T, D]. Full attention, consecutive slots, every
    row at the same length (what the candidate is measured on)."""
    h, h_kv, d = model.n_heads, model.n_kv_heads, model.head_dim
    hidden, eps, scale = model.embed.shape[1], model.eps, model.head_dim**-0.5
    layers, cache = model.layers, model.cache

    def step(tokens, slot: int, start: int):
        b, t = tokens.shape
        positions = start + torch.arange(t)  # [T]
        cos = model.cos[positions][None, :, None]  # [1, T, 1, D]
        sin = model.sin[positions][None, :, None]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        new_bias = torch.zeros(t, t).masked_fill(~causal, float("-inf"))  # [T, T]
        x = F.embedding(tokens, model.embed)  # [B, T, hidden]
        keys, values = [], []
        for i, layer in enumerate(layers):
            a = F.rms_norm(x, (hidden,), layer.attn_norm, eps)
            qkv = a @ layer.wqkv  # [B, T, (H + 2 H_kv) D]
            qk = qkv[..., : (h + h_kv) * d].view(b, t, h + h_kv, d)
            v = qkv[..., (h + h_kv) * d :].view(b, t, h_kv, d).transpose(1, 2)  # [B, H_kv, T, D]
            qk = qk * cos + torch.roll(qk, d // 2, dims=-1) * sin
            q = qk[:, :, :h].transpose(1, 2)  # [B, H, T, D]
            k = qk[:, :, h:].transpose(1, 2)  # [B, H_kv, T, D]
            keys.append(k)
            values.append(v)
            k_past = cache.k[i][slot : slot + b, :, :start]  # [B, H_kv, S, D]
            v_past = cache.v[i][slot : slot + b, :, :start]
            s_past = (q @ k_past.transpose(-1, -2)) * scale  # [B, H, T, S]
            s_new = (q @ k.transpose(-1, -2)) * scale + new_bias  # [B, H, T, T]
            p = torch.cat([s_past, s_new], -1).softmax(-1)
            o = p[..., :start] @ v_past + p[..., start:] @ v  # [B, H, T, D]
            x = x + o.transpose(1, 2).reshape(b, t, h * d) @ layer.wo
            m = F.rms_norm(x, (hidden,), layer.mlp_norm, eps)
            gate, up = (m @ layer.w_gate_up).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ layer.w_down
        x = F.rms_norm(x, (hidden,), model.norm, eps)
        return x @ model.lm_head, torch.stack(keys), torch.stack(values)

    return step


def compiled(step, mode: str):
    import torch._inductor.config as inductor

    inductor.cpp_wrapper = mode == "cpp"
    inductor.freezing = mode == "max-autotune"
    torch._dynamo.reset()
    kw = {"mode": "max-autotune-no-cudagraphs"} if mode == "max-autotune" else {}
    return torch.compile(step, **kw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="default,cpp")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "compiled_step"))
    args = ap.parse_args()

    from leapdecode.models import load_model
    from leapdecode.paths import TARGET_NAME, default_model

    torch.set_num_threads(args.threads)
    model = load_model(default_model(TARGET_NAME), dtype="float32")
    model._unpack()  # plain [in, out] tensors for the `@` below (float32 loads packed for oneDNN)
    if not hasattr(model, "layers") or any(layer.window for layer in model.layers):
        sys.exit("the candidate covers the native backend's full-attention models")
    rows_max = max(b for b, _ in SHAPES)
    model.allocate(rows_max, CONTEXT + 32)
    g = torch.Generator().manual_seed(0)
    slots = torch.arange(rows_max)
    model.forward(torch.randint(0, model.vocab_size, (rows_max, CONTEXT), generator=g), slots)
    result = {"threads": args.threads, "context": CONTEXT, "modes": {}}
    for mode in args.modes.split(","):
        fn = compiled(make_step(model), mode)
        rows = {}
        for b, t in tqdm(SHAPES, desc=f"{mode}: shapes"):
            tokens = torch.randint(0, model.vocab_size, (b, t), generator=g)
            sl = slots[:b]
            with torch.inference_mode():
                t0 = time.perf_counter()
                logits, _, _ = fn(tokens, 0, CONTEXT)
                compile_s = time.perf_counter() - t0
                ref = model.forward(tokens, sl)
                model.truncate(sl, torch.full((b,), CONTEXT))
                diff = float((logits - ref).abs().max())
                eager, comp = [], []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    model.forward(tokens, sl)
                    eager.append(time.perf_counter() - t0)
                    model.truncate(sl, torch.full((b,), CONTEXT))
                    t0 = time.perf_counter()
                    fn(tokens, 0, CONTEXT)
                    comp.append(time.perf_counter() - t0)
            e, c = statistics.median(eager) * 1e3, statistics.median(comp) * 1e3
            rows[f"{b}x{t}"] = {"rows": b, "tokens": t, "eager_ms": e, "compiled_ms": c,
                                "speedup": e / c, "compile_s": compile_s,
                                "max_logit_diff": diff}  # fmt: skip
        result["modes"][mode] = rows
    write(result, args)
    return 0


def write(r: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(r, f, indent=1)
    lines = ["# A compiled step against the eager one (native backend, embedded target)", "",
             f"`python bench/compiled_step.py --modes {args.modes} --reps {args.reps} --threads "
             f"{args.threads}`: float32, {CONTEXT} tokens cached in every row, median of "
             f"{args.reps} interleaved calls; first call = the compile (or a cache hit).", "",
             "| mode | rows x tokens | eager ms | compiled ms | eager / compiled | first call s "
             "| max logit diff |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for mode, rows in r["modes"].items():
        for shape, s in rows.items():
            lines.append(f"| {mode} | {shape} | {s['eager_ms']:.2f} | {s['compiled_ms']:.2f} | "
                         f"**{s['speedup']:.2f}x** | {s['compile_s']:.1f} | "
                         f"{s['max_logit_diff']:.1e} |")  # fmt: skip
    lines.append("")
    lines.append(f"![step times]({os.path.basename(args.out)}.png)")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(9, 4))
    modes = list(r["modes"])
    shapes = list(next(iter(r["modes"].values())))
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):  # each mode against the eager calls interleaved with it
        ax.bar([i + j * width for i in range(len(shapes))],
               [r["modes"][mode][s]["speedup"] for s in shapes], width, label=mode)  # fmt: skip
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(shapes))], shapes)
    ax.set_xlabel("rows x tokens a row")
    ax.set_ylabel("eager ms / compiled ms (median)")
    ax.set_title("native step: torch.compile (inductor, CPU) against eager")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=100)
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
