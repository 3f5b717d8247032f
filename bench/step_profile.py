"""Where one decode step and one verify step of a target go, against the machine's ceiling at
these shapes.

    python bench/step_profile.py [--dtypes float32,bfloat16] [--reps 300] [--threads 1]
                                 [--no-compiled] [--out docs/step_profile]
    python bench/step_profile.py --target qwen2.5-coder-1.5b-instruct --rows 1,5,9,17 \
        --context 512 --reps 20 --threads 2 --no-compiled --llama-bench \
        --out docs/bench/real/step_profile_1.5b

On a real target (`--target`, a catalogue name or a folder) the LM head's matmul is timed
apart at each row count (its own share of the matmuls), each step's bytes of weights over
the measured bandwidth give its floor (the share of the bandwidth ceiling it reaches), and
`--llama-bench` runs llama.cpp's own llama-bench (built by bench/llamacpp_env.sh) on the same
model's GGUF files: its decode step, and its batches of 4, 8 and 16 tokens, the cost of its
verify rows.

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

CONTEXT = 128  # tokens cached before each step (--context)

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


def steps(vocab: int, rows=(1, 17)):
    """A decode step (1 row), a chain verify of each other row count, and a 17-node tree
    verify when 17 rows are asked for."""
    g = torch.Generator().manual_seed(1)
    out = {}
    for n in rows:
        name = "decode (1 row)" if n == 1 else f"chain verify ({n} rows)"
        out[name] = (torch.randint(0, vocab, (1, n), generator=g), None, None)
    if 17 in rows:
        mask, depth = tree_inputs()
        out["tree verify (17 nodes)"] = (torch.randint(0, vocab, (1, 17), generator=g), mask, depth)
    return out


def time_step(model, tokens, tree, offsets, slot) -> float:
    t0 = time.perf_counter()
    model.forward(tokens, slot, tree_mask=tree, position_offsets=offsets)
    dt = time.perf_counter() - t0
    model.truncate(slot, torch.tensor([CONTEXT]))
    return dt


def lm_head_ms(model, rows: int, reps: int) -> float:
    """The LM head's matmul alone at `rows` rows (median ms): its share of a step's matmuls."""
    from leapdecode.models.llama import _linear

    head = getattr(model, "lm_head", None)
    if head is None:
        return float("nan")
    hidden = model.config.hidden_size
    x = torch.randn(1, rows, hidden).to(head.dtype)
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        _linear(x, head, None)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1e3


def step_bytes(config, context: int, itemsize: int) -> float:
    """Bytes a step must read: every weight once (linear layers and the LM head: half the
    flops of flops_per_row without attention) and the cached keys and values."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    d = config.hidden_size // heads
    weights = flops_per_row(config, 0) / 2
    cache = config.num_hidden_layers * 2 * kv * d * context
    return (weights + cache) * itemsize


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


def bandwidth_gbs() -> dict:
    """The machine's memory bandwidth, three ways (GB/s, best of 5 each): a 256 MiB copy (read
    + write counted), a sum over 1 GiB (read), and a float32 matrix-vector product over a 1 GiB
    matrix (read: what a decode step does). A step's floor uses the best read rate."""

    def best(fn, n_bytes: float) -> float:
        fn()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return n_bytes / min(times) / 1e9

    src = torch.ones(64 * 2**20)  # 256 MiB of float32
    dst = torch.empty_like(src)
    big = torch.ones(2**28)  # 1 GiB of float32
    w, v = big.view(16384, 16384), torch.ones(16384)
    out = {
        "copy (read + write)": best(lambda: dst.copy_(src), 2 * src.numel() * 4),
        "sum (read)": best(lambda: big.sum(), big.numel() * 4),
        "matrix-vector, float32 (read)": best(lambda: torch.mv(w, v), big.numel() * 4),
    }
    out["read"] = max(out["sum (read)"], out["matrix-vector, float32 (read)"])
    return out


def engine_share(target: str, dtype: str, threads: int, tokens: int = 128) -> dict:
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
        dec.generate(prompt, method=method, k=k, max_new_tokens=16)  # warm-up
        spent[0] = 0.0
        t0 = time.perf_counter()
        r = dec.generate(prompt, method=method, k=k, max_new_tokens=tokens)
        total = time.perf_counter() - t0
        fwd = r.stats.target_forwards
        out[method] = {"total_ms_per_forward": 1e3 * total / fwd,
                       "forward_ms": 1e3 * spent[0] / fwd,
                       "engine_ms": 1e3 * (total - spent[0]) / fwd,
                       "engine_share": 1 - spent[0] / total}  # fmt: skip
    model._run = inner
    return out


def llama_bench(model: str, threads: int, context: int) -> dict:
    """llama.cpp's own llama-bench on this model's GGUF files (GGUF and BF16): its decode step
    and its batches of 4, 8 and 16 tokens after `context` cached tokens, ms each."""
    import subprocess

    from leapdecode.bench.llamacpp_peer import binary, find_dir, gguf_for, precisions

    folder = find_dir(None)
    if folder is None:
        print("llama.cpp is not built here (bash bench/llamacpp_env.sh): no llama-bench rows")
        return {}
    out = {}
    for precision in precisions(None, [model]):  # GGUF only for a catalogue model
        path = gguf_for(model, precision, folder)
        cmd = [binary(folder, "llama-bench"), "-m", path, "-t", str(threads), "-p", "4,8,16",
               "-n", "32", "-d", str(context), "-r", "3", "-o", "json"]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"llama-bench failed on {path}: {done.stderr.strip().splitlines()[-1:]}")
            continue
        tests = json.loads(done.stdout)
        ms = {}
        for t in tests:
            n = t["n_gen"] or t["n_prompt"]
            rows = 1 if t["n_gen"] else t["n_prompt"]
            ms[rows] = 1e3 * n / t["avg_ts"] / (n if t["n_gen"] else 1)
        out[precision] = {"file": path, "bytes": os.path.getsize(path), "ms": ms,
                          "command": " ".join(cmd)}  # fmt: skip
    return out


def vllm_step(target: str, python: str | None, threads: int, context: int, reps: int) -> dict:
    """vLLM's own step on this model (its CPU build, bfloat16, the offline API in its worker):
    every request's first `context` tokens cached (prefix caching on) and its tail new (a
    fresh tail each time: a prompt wholly cached is recomputed by the block). Its decode step:
    (t(1 + n tokens) - t(1 token)) / n from a 1-token tail; its batches of 4, 8 and 16 rows:
    t(a 4, 8, 16-token tail) - t(a 1-token tail) + one decode step, the cost of verify rows as
    llama-bench's -d/-p measure them. Medians of `reps` interleaved repetitions, ms."""
    from leapdecode.bench.vllm_peer import VllmPeers, find_python

    python = find_python(python)
    if python is None:
        print("vLLM is not built here (bash bench/vllm_env.sh): no vLLM rows")
        return {}
    n_new = 32
    peers = VllmPeers(python, target, [("vllm", None)], "bfloat16", context + 64, threads,
                      engine_args={"enable_prefix_caching": True}, warm_up=10)  # fmt: skip
    try:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(100, 10_000, (context,), generator=g).tolist()
        times = {"1": [], "decode": [], **{str(n): [] for n in (4, 8, 16)}}

        def fresh(n: int) -> list[int]:  # the cached prompt and n new tokens
            return ids + torch.randint(100, 10_000, (n,), generator=g).tolist()

        for _ in tqdm(range(reps), desc="vLLM: interleaved steps"):
            times["1"].append(peers.generate("vllm", fresh(1), 1)[0])
            s, tokens, *_ = peers.generate("vllm", fresh(1), 1 + n_new, ignore_eos=True)
            times["decode"].append(s)
            assert len(tokens) == 1 + n_new, len(tokens)
            for n in (4, 8, 16):
                times[str(n)].append(peers.generate("vllm", fresh(n), 1)[0])
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        decode = (med["decode"] - med["1"]) / n_new
        ms = {1: decode, **{n: med[str(n)] - med["1"] + decode for n in (4, 8, 16)}}
        return {"version": peers.version, "ms": ms, "request_1_token_ms": med["1"],
                "reps": reps}  # fmt: skip
    finally:
        peers.close(grace_s=10)


def main() -> int:
    global CONTEXT
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None,
                    help="a catalogue name or a folder (default: the embedded target)")  # fmt: skip
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rows", default="1,17", help="rows per step: 1 (decode), k + 1 (verify)")
    ap.add_argument("--context", type=int, default=CONTEXT, help="tokens cached before a step")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--engine-tokens", type=int, default=128,
                    help="tokens of the engine's generate runs (its Python's share)")  # fmt: skip
    ap.add_argument("--llama-bench", action="store_true",
                    help="also llama.cpp's llama-bench on the model's GGUF files")  # fmt: skip
    ap.add_argument("--vllm", action="store_true",
                    help="also vLLM's decode step and verify rows (bfloat16; bench/vllm_env.sh)")  # fmt: skip
    ap.add_argument("--vllm-python", default=None, help="the vLLM environment's interpreter")
    ap.add_argument("--peers-only", action="store_true",
                    help="keep our rows from OUT.json; measure the peers' (--vllm, "
                    "--llama-bench) and write OUT again")  # fmt: skip
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "step_profile"))
    ap.add_argument("--no-compiled", dest="compiled", action="store_false",
                    help="time the eager forward only")  # fmt: skip
    args = ap.parse_args()

    from leapdecode.models import load_model
    from leapdecode.models.loader import cpu_description, load_config
    from leapdecode.paths import TARGET_NAME, default_model
    from leapdecode.resolve import resolve_models

    CONTEXT = args.context
    row_counts = sorted({1, *(int(x) for x in args.rows.split(","))})
    torch.set_num_threads(args.threads)
    target = resolve_models(args.target, None)[0] if args.target else default_model(TARGET_NAME)
    config = load_config(target)
    if args.peers_only:
        try:
            with open(args.out + ".json") as f:
                result = json.load(f)
        except (OSError, ValueError) as e:
            sys.exit(f"--peers-only keeps the rows of {args.out}.json: {e}. Run without it first.")
        here = cpu_description()
        if result.get("cpu_capability", here) != here:
            sys.exit(f"{args.out}.json was measured on a CPU with {result['cpu_capability']}; "
                     f"this one has {here}: run the whole profile again (without --peers-only)")  # fmt: skip
        return peers(result, target, config, args)
    slot = torch.tensor([0])
    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, config.vocab_size, (1, CONTEXT), generator=g)
    bandwidths = bandwidth_gbs()
    bandwidth = bandwidths["read"]
    result = {"bandwidths_gbs": bandwidths, "target": args.target or TARGET_NAME,
              "cpu_capability": cpu_description(),
              "threads": args.threads, "context": CONTEXT,
              "bandwidth_gbs": bandwidth, "flops_per_row": flops_per_row(config, CONTEXT),
              "dtypes": {}}  # fmt: skip
    for dtype in args.dtypes.split(","):
        model = load_model(target, dtype=dtype)
        model.allocate(1, CONTEXT + max(row_counts) + 8)
        model.forward(context, slot)
        todo = steps(config.vocab_size, row_counts)
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
        td = getattr(torch, dtype)
        floor_ms = step_bytes(config, CONTEXT, td.itemsize) / bandwidth / 1e6
        rows = {}
        for name, (tokens, tree, offsets) in tqdm(todo.items(), desc=f"{dtype}: profiling"):
            wall = statistics.median(times[name])
            prof = profile_step(model, tokens, tree, offsets, slot, max(5, args.reps // 5), wall)
            n_rows = tokens.shape[1]
            head = lm_head_ms(model, n_rows, max(5, args.reps // 2))
            by = prof["by_kind"]
            if head == head and "matmul" in by:  # the LM head's part of the matmuls
                by["matmul (LM head)"] = min(head, by["matmul"])
                by["matmul"] -= by["matmul (LM head)"]
            rows[name] = {"ms": wall * 1e3, "rows": n_rows,
                          "gflops": flops_per_row(config, CONTEXT) * n_rows / wall / 1e9,
                          "bandwidth_share": floor_ms / (wall * 1e3),
                          "lm_head_ms": head, **prof}  # fmt: skip
            if compiled is not None:
                c = statistics.median(compiled_times[name])
                rows[name]["compiled"] = {
                    "ms": c * 1e3, "gflops": flops_per_row(config, CONTEXT) * n_rows / c / 1e9
                }  # fmt: skip
        h, inter, v = config.hidden_size, config.intermediate_size, config.vocab_size
        ceiling = {"large square 1024^3": matmul_gflops(1024, 1024, 1024, td, 10)}
        for n in row_counts:
            reps = 200 if h * inter < 2**24 else 20
            ceiling[f"{n} x {h} x {2 * inter} (gate/up)"] = matmul_gflops(n, h, 2 * inter, td, reps)
        ceiling[f"1 x {h} x {v} (LM head)"] = matmul_gflops(1, h, v, td, 20)
        decode = rows["decode (1 row)"]["ms"]
        result["dtypes"][dtype] = {"steps": rows, "matmul_gflops": ceiling,
                                   "floor_ms": floor_ms,
                                   "over_decode": {n: s["ms"] / decode for n, s in rows.items()}}  # fmt: skip
        del model, compiled  # one copy of the weights at a time: the engine loads its own
        result["dtypes"][dtype]["engine"] = engine_share(
            target, dtype, args.threads, args.engine_tokens
        )
    return peers(result, target, config, args)


def peers(result: dict, target: str, config, args) -> int:
    """The peers' own steps (--llama-bench, --vllm) added to `result`, then written. The
    bandwidth is measured again: the ceiling is the best read rate of either measurement, and
    every share (ours included) is taken against it."""
    if args.peers_only:
        again = bandwidth_gbs()
        old = result.get("bandwidths_gbs", {})
        result["bandwidths_gbs"] = {k: max(v, old.get(k, 0.0)) for k, v in again.items()}
        result["bandwidth_gbs"] = bw = result["bandwidths_gbs"]["read"]
        for dtype, d in result["dtypes"].items():
            size = getattr(torch, dtype).itemsize
            d["floor_ms"] = step_bytes(config, result["context"], size) / bw / 1e6
            for step in d["steps"].values():
                step["bandwidth_share"] = d["floor_ms"] / step["ms"]
    if args.llama_bench:
        lb = llama_bench(target, args.threads, result["context"])
        if lb:  # llama.cpp not built: an earlier profile keeps its rows
            result["llama_bench"] = lb
    if args.vllm:
        v = vllm_step(target, args.vllm_python, args.threads, result["context"], args.reps)
        if v:
            v["bytes"] = step_bytes(config, result["context"], 2)
            result["vllm"] = v
    write(result, args)
    return 0


def write(r: dict, args) -> None:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    # every command that wrote this profile (--peers-only adds to an earlier one)
    r["commands"] = r.get("commands", []) + [
        f"python bench/step_profile.py {' '.join(sys.argv[1:])}"
    ]
    with open(args.out + ".json", "w") as f:
        json.dump(r, f, indent=1)
    kinds = ["matmul", "matmul (LM head)", *(k for k, _ in KINDS if k != "matmul"),
             "other operations", "Python and dispatch (no operation)"]  # fmt: skip
    lines = [f"# One step of {r['target']}: where it goes, against the machine's ceiling",
             "", " then ".join(f"`{c}`" for c in r["commands"]) + ": "
             f"{r['context']} tokens cached, {r['threads']} thread(s) (CPU: "
             f"{r.get('cpu_capability', 'not recorded')}); median of "
             f"{args.reps} interleaved repetitions; kinds from torch.profiler's self times, "
             "scaled to the unprofiled step (the LM head's matmul timed apart); arithmetic "
             f"{r['flops_per_row'] / 1e6:.1f} MFLOP a row. Memory bandwidth: "
             + ", ".join(f"{k} {v:.1f} GB/s" for k, v in r.get("bandwidths_gbs", {}).items()
                         if k != "read")
             + f"; a step's floor is its bytes of weights and cache over the best read rate, "
             f"{r['bandwidth_gbs']:.1f} GB/s.", ""]  # fmt: skip
    for dtype, d in r["dtypes"].items():
        big = d["matmul_gflops"]["large square 1024^3"]
        lines += [f"## {dtype}", "", f"Floor of a step (bytes read / bandwidth): "
                  f"{d['floor_ms']:.1f} ms.", "",
                  "| step | ms | x decode | share of the bandwidth floor | GFLOP/s | share of "
                  "the 1024^3 matmul's | " + " | ".join(kinds) + " |",
                  "|---|---|---|---|---|---|" + "---|" * len(kinds)]  # fmt: skip
        for name, s in d["steps"].items():
            by = s["by_kind"]
            cells = [f"{by.get(k, 0.0):.1f}" for k in kinds]
            lines.append(f"| {name} | {s['ms']:.1f} | {d['over_decode'][name]:.2f} "
                         f"| {s['bandwidth_share']:.0%} | {s['gflops']:.1f} "
                         f"| {s['gflops'] / big:.1%} | " + " | ".join(cells) + " |")  # fmt: skip
        first = next(iter(d["steps"].values()))
        if "compiled" in first:
            c = {n: s["compiled"] for n, s in d["steps"].items()}
            lines += ["", "Before and after: eager against the compiled forward (`--compile`), "
                      "interleaved in the same run.", "",
                      "| step | eager ms | compiled ms | eager / compiled |",
                      "|---|---|---|---|"]  # fmt: skip
            for name, s in d["steps"].items():
                lines.append(f"| {name} | {s['ms']:.2f} | {c[name]['ms']:.2f} | "
                             f"**{s['ms'] / c[name]['ms']:.2f}x** |")  # fmt: skip
        lines += ["", "| matmul | GFLOP/s |", "|---|---|"]
        lines += [f"| {k} | {v:.1f} |" for k, v in d["matmul_gflops"].items()]
        lines += [
            "",
            f"| engine (`LeapDecoder.generate`, {args.engine_tokens} tokens) | ms a target "
            "forward | of which the forward | engine's Python | engine share |",
            "|---|---|---|---|---|",
        ]
        for m, e in d["engine"].items():
            lines.append(
                f"| {m} | {e['total_ms_per_forward']:.2f} | {e['forward_ms']:.2f} | "
                f"{e['engine_ms']:.2f} | {e['engine_share']:.0%} |"
            )
        lines.append("")
    lb = r.get("llama_bench") or {}
    if lb:
        lines += ["## llama.cpp (llama-bench) on the same model", "",
                  "Its decode step (tg) and its batches of 4, 8 and 16 tokens (pp, the cost of "
                  f"verify rows) after {r['context']} cached tokens (-d); median-free: its own "
                  "mean of 3 repetitions. Share of the bandwidth floor: the GGUF file's bytes "
                  "over the bandwidth, over the step.", "",
                  "| weights | file GB | decode ms | share of the bandwidth floor | 4 rows "
                  "(x decode) | 8 rows | 16 rows |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for p, x in lb.items():
            ms = {int(k): v for k, v in x["ms"].items()}
            floor = x["bytes"] / r["bandwidth_gbs"] / 1e6
            cells = [f"{ms[n]:.1f} ms ({ms[n] / ms[1]:.2f}x)" if n in ms else "-"
                     for n in (4, 8, 16)]  # fmt: skip
            lines.append(f"| {p} | {x['bytes'] / 1e9:.2f} | {ms[1]:.1f} | {floor / ms[1]:.0%} "
                         "| " + " | ".join(cells) + " |")  # fmt: skip
        lines.append("")
    v = r.get("vllm")
    if v:
        ms = {int(k): x for k, x in v["ms"].items()}
        floor = v["bytes"] / r["bandwidth_gbs"] / 1e6
        lines += [f"## vLLM {v['version']} (its CPU build, bfloat16) on the same model", "",
                  f"Every request's first {r['context']} tokens are cached (prefix caching) "
                  "and its tail is new. Its decode step: (a request for 33 tokens - one for 1 "
                  "token) / 32, from a 1-token tail; its batches of 4, 8 and 16 rows: a 4, 8 "
                  "or 16-token tail, minus the 1-token tail, plus one decode step. Medians of "
                  f"{v['reps']} interleaved repetitions (a 1-token request: "
                  f"{v['request_1_token_ms']:.1f} ms). Share of the bandwidth floor: the "
                  "step's bytes of weights and cache (bfloat16) over the bandwidth, over the "
                  "step.", "",
                  "| weights | GB read a step | decode ms | share of the bandwidth floor | 4 rows "
                  "(x decode) | 8 rows | 16 rows |", "|---|---|---|---|---|---|---|",
                  f"| bfloat16 | {v['bytes'] / 1e9:.2f} | {ms[1]:.1f} | {floor / ms[1]:.0%} | "
                  + " | ".join(f"{ms[n]:.1f} ms ({ms[n] / ms[1]:.2f}x)" for n in (4, 8, 16))
                  + " |", ""]  # fmt: skip
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
