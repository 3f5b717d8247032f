"""Where a decode step's time goes, in vLLM CPU and in leapdecode, on the embedded target.

    python bench/vllm_profile.py [--method none|ngram|suffix|draft|eagle] [--k K] [--requests 12]
    python bench/vllm_profile.py --concurrency 16 --max-new-tokens 64     (the two servers)

Runs the same greedy requests (bench prompts, 128 new tokens) through one vLLM engine (the
offline LLM API in its worker, `bench/vllm_peer`) and through leapdecode, sampling each with
py-spy (`pip install py-spy`): every vLLM process (the frontend, the engine core, the model
worker) and ours. Self time is grouped by where it is spent (the model's matmuls and
attention, the rest of the forward, sampling / acceptance, the proposer, scheduling and
bookkeeping, inter-process waits) and reported per decode step, with tokens/s. Writes
docs/vllm_profile/<method>.md (and .json); --concurrency C: `leapdecode serve` and vLLM's API
server under C streaming clients instead, docs/vllm_profile/serve-c<C>.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

# (group, substrings of a frame "function (file:line) source line") in order: a sample goes to
# the first group that its leaf frame matches, else to the first frame up the stack that does.
# Our own frames carry their source line (py-spy names the function; the line says which
# operation it runs); vLLM's model runs as one inductor-compiled graph (CompiledFxGraph) plus
# its custom operations (attention, the paged cache) called as torch ops (OpOverload).
GROUPS = [
    ("waiting / IPC (spins, polls, queues)",
     ("poll (", "select (", "sched_yield", "recv", "wait (", "acquire_read", "get_metadata",
      "memory_fence", "notify (", "send (", "_recv", "epoll", "get (queue", "sleep")),
    ("model: inductor-compiled graph (vLLM)", ("compiledfxgraph", "runner.call")),
    ("model: attention / custom ops", ("scaled_dot_product_attention", "attention", "sdpa",
                                       "paged", "flash", "opoverload")),
    ("model: matmul (linear)", ("_linear", "linear", "addmm", "matmul", "gemm", "lm_head")),
    ("model: norm / RoPE / elementwise", ("rms_norm", "rotary", "rope", "silu", "act_and_mul",
                                          "embedding", "transpose", "reshape", "chunk")),
    ("model: KV cache / indexing", ("kvcache", "cache.write", "cache.read", "index_copy")),
    ("sampling / acceptance", ("sample", "rejection", "verify", "argmax", "logits", "accept")),
    ("proposer", ("propose", "ngram", "suffix", "lookup", "speculate", "drafter", "char_")),
    ("scheduling / bookkeeping", ("schedule", "step", "update", "prepare", "output", "process",
                                  "batch", "append", "detokeniz", "commit", "_decode")),
]  # fmt: skip
_SOURCE: dict[str, list[str]] = {}


def with_source(frame: str) -> str:
    """'f (leapdecode/x.py:12)' -> the frame and its source line (our own files only)."""
    inner = frame.rpartition(" (")[2].rstrip(")")
    path, _, line = inner.rpartition(":")
    if not path.startswith("leapdecode/") or not line.isdigit():
        return frame
    if path not in _SOURCE:
        try:
            with open(os.path.join(ROOT, "src", path)) as f:
                _SOURCE[path] = f.read().splitlines()
        except OSError:
            _SOURCE[path] = []
    lines = _SOURCE[path]
    return frame + " " + (lines[int(line) - 1].strip() if int(line) <= len(lines) else "")


def group_of(stack: list[str]) -> str:
    for frame in reversed(stack):  # leaf first
        low = with_source(frame).lower()
        for name, pats in GROUPS:
            if any(p in low for p in pats):
                return name
    return "other Python"


def read_raw(path: str) -> Counter:
    """py-spy's raw (collapsed) output: 'frame;frame;... count' lines -> samples per group."""
    out: Counter = Counter()
    if not os.path.isfile(path):
        return out
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            if stack and n.isdigit():
                out[group_of(stack.split(";"))] += int(n)
    return out


RATE = 200  # py-spy samples a second (each active sample: 5 ms of one thread's time)


def py_spy() -> str:
    """py-spy beside this interpreter (a venv's bin), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    found = here if os.access(here, os.X_OK) else shutil.which("py-spy")
    if found is None:
        sys.exit("py-spy is not installed: pip install py-spy (into this environment)")
    return found


def spy(pids: dict[str, int], seconds: float, tmp: str) -> list[tuple[str, subprocess.Popen, str]]:
    procs = []
    for name, pid in pids.items():
        path = os.path.join(tmp, f"{name}.txt")
        p = subprocess.Popen([py_spy(), "record", "--pid", str(pid), "--duration", str(int(seconds)),
                              "--rate", str(RATE), "--format", "raw", "--nonblocking",
                              "--output", path], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)  # fmt: skip
        procs.append((name, p, path))
    return procs


def children(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(c) for c in f.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def name_of(pid: int, side: str = "vllm") -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        return "?"
    if side == "leapdecode":  # `leapdecode serve` and its engine process (server/worker.py)
        return "HTTP server" if " serve " in cmd else "engine process"
    if "api_server" in cmd:
        return "HTTP server (API server)"
    if "Worker" in comm or "Worker" in cmd:
        return "vllm worker (model)"
    if "EngineCore" in comm or "EngineCore" in cmd:
        return "vllm engine core (scheduler)"
    return f"vllm other {pid}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--method", default="none", choices=["none", "ngram", "suffix", "draft", "eagle"]
    )
    ap.add_argument(
        "--k",
        type=int,
        default=None,
        help="ours and vLLM's k (default: 16 for ngram / suffix, 2 for draft)",
    )
    ap.add_argument(
        "--vllm-k",
        type=int,
        default=None,
        help="vLLM's k when it differs from ours (default --k; 3 for eagle3)",
    )
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--out", default=None, help="default: docs/vllm_profile/<method>")
    ap.add_argument("--concurrency", type=int, default=None,
                    help="profile the servers instead (ours: `leapdecode serve`, vLLM's API "
                         "server) under C concurrent streaming clients (none only)")  # fmt: skip
    ap.add_argument("--regroup", metavar="DIR", default=None,
                    help="only re-group a finished run's py-spy samples (DIR: the raw files it "
                         "printed) into --out's tables")  # fmt: skip
    args = ap.parse_args()
    args.out = args.out or os.path.join(ROOT, "docs", "vllm_profile", args.method)

    import torch
    from transformers import AutoTokenizer

    from leapdecode.api import LeapDecoder
    from leapdecode.bench import workloads
    from leapdecode.bench.vllm_peer import (
        COUNTERPART,
        VllmPeers,
        export_eagle3,
        find_python,
        spec_config,
    )
    from leapdecode.paths import DRAFT_NAME, TARGET_NAME, default_model

    target, draft = default_model(TARGET_NAME), default_model(DRAFT_NAME)
    args.k = args.k or {"none": 0, "draft": 2, "eagle": 6}.get(args.method, 16)
    args.vllm_k = args.vllm_k or (3 if args.method == "eagle" else args.k)
    if args.regroup:
        with open(args.out + ".json") as f:
            results = json.load(f)
        for r in results.values():
            r["samples"] = {n: dict(read_raw(os.path.join(args.regroup, n + ".txt")))
                            for n in r["samples"]}  # fmt: skip
        write(results, args)
        return 0
    python = find_python(args.vllm_python)
    py_spy()  # before a minute of loading
    if python is None:
        sys.exit("no vLLM environment: bash bench/vllm_env.sh")
    if args.concurrency:
        if args.method != "none":
            sys.exit("--concurrency profiles plain decoding only (--method none)")
        return serve_profile(python, target, args)
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(target)
    sets = workloads.load(os.path.join(ROOT, "bench", "prompts"))
    rows = [r for group in zip(*sets.values(), strict=False) for r in group][: args.requests]
    prompts = [tok.encode(r["prompt"]) for r in rows]
    name = COUNTERPART[args.method]
    label = name if args.method == "none" else f"{name} k={args.vllm_k}"
    tmp = tempfile.mkdtemp()
    eagle3 = export_eagle3(None, target, os.path.join(tmp, "eagle3"), "float32") if (
        args.method == "eagle") else None  # fmt: skip
    spec = spec_config(name, args.vllm_k, draft=draft, eagle3=eagle3)
    peers = VllmPeers(python, target, [(label, spec)], "float32", 1024, 1, tmp)
    dec = LeapDecoder.from_pretrained(target, draft=draft if args.method == "draft" else None,
                                      threads=1)  # fmt: skip
    k = args.k
    results = {}
    try:
        for side in ("vllm", "leapdecode"):

            def run_all(side=side):
                toks, secs, steps = 0, 0.0, 0
                for ids in prompts:
                    if side == "vllm":
                        s, t, fwd, _, _ = peers.generate(label, ids, args.max_new_tokens)
                    else:
                        t0 = time.perf_counter()
                        out = dec.generate(ids, method=args.method, k=max(k, 1),
                                           max_new_tokens=args.max_new_tokens)  # fmt: skip
                        s, t, fwd = (
                            time.perf_counter() - t0,
                            out.token_ids,
                            out.stats.target_forwards,
                        )
                    toks, secs, steps = toks + len(t), secs + s, steps + fwd - 1
                return toks, secs, steps

            run_all()  # warm-up
            toks, secs, steps = run_all()  # timed, unprofiled
            if side == "vllm":
                root = peers.workers[label].proc.pid
                pids = {name_of(p): p for p in children(root)}
                pids["vllm frontend (LLM.generate)"] = root
            else:
                pids = {"leapdecode (one process)": os.getpid()}
            spies = spy(pids, 2 * secs + 10, tmp)  # py-spy in child processes, sampling these
            time.sleep(1.0)
            run_all()
            for _, p, _ in spies:  # stopped as the pass ends (py-spy saves on SIGINT)
                p.send_signal(signal.SIGINT)
            for _, p, _ in spies:
                p.wait()
            groups = {n: read_raw(path) for n, p, path in spies}
            results[side] = {"tokens": toks, "seconds": secs, "steps": steps,
                             "tokens_per_s": toks / secs, "ms_per_step": 1e3 * secs / max(1, steps),
                             "samples": {n: dict(g) for n, g in groups.items()}}  # fmt: skip
    finally:
        peers.close()
    print(f"py-spy's raw samples: {tmp} (--regroup {tmp} re-groups them)")
    write(results, args)
    return 0


def serve_profile(python: str, target: str, args) -> int:
    """Both servers under C concurrent streaming clients (bench serve's load generator), every
    process of each sampled with py-spy during one timed load; 'steps' are the engine's
    batched decode steps, estimated as completion tokens / C."""
    import httpx

    from leapdecode.bench import workloads
    from leapdecode.bench.serve import Config, run_load
    from leapdecode.bench.servers import free_port, wait_healthy
    from leapdecode.bench.vllm_serve import SERVER_PIDS, awake, vllm_server

    c = args.concurrency
    n = max(8, 4 * c)
    sets = workloads.load(os.path.join(ROOT, "bench", "prompts"))
    rows = [{**r, "max_new_tokens": min(r["max_new_tokens"], args.max_new_tokens)}
            for group in zip(*sets.values(), strict=False) for r in group]  # fmt: skip
    tmp = tempfile.mkdtemp()
    results = {}
    port = free_port()
    ours = subprocess.Popen([sys.executable, "-m", "leapdecode", "serve", "--target", target,
                             "--host", "127.0.0.1", "--port", str(port), "--threads", "1",
                             "--max-num-seqs", str(c), "--suffix-max-cached-requests", "0"],
                            stdout=open(os.path.join(tmp, "ours.log"), "w"),
                            stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, ours, os.path.join(tmp, "ours.log"))
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        with vllm_server(python, target, None, "float32", c, 1,
                         os.path.join(tmp, "vllm-serve.log")) as vurl:  # fmt: skip
            sides = {"vllm": Config("vllm none", None, vurl),
                     "leapdecode": Config("none", {"method": "none"})}  # fmt: skip
            for side, cfg in sides.items():
                root = SERVER_PIDS[vurl] if side == "vllm" else ours.pid
                with awake(vurl) if side == "vllm" else contextlib.nullcontext():
                    run_load(url, model, rows, cfg, c, n, 0)  # warm-up
                    res = run_load(url, model, rows, cfg, c, n, n)  # timed, unprofiled
                    pids = {f"{side} {name_of(p, side)}": p for p in [root, *children(root)]}
                    spies = spy(pids, 120, tmp)
                    time.sleep(1.0)
                    run_load(url, model, rows, cfg, c, n, n)
                    for _, p, _ in spies:
                        p.send_signal(signal.SIGINT)
                    for _, p, _ in spies:
                        p.wait()
                results[side] = {"tokens_per_s": res["throughput"], "tokens": res["tokens"],
                                 "steps": max(1, round(res["tokens"] / c)),
                                 "ms_per_step": 1e3 * c / res["throughput"],
                                 "samples": {nm: dict(read_raw(path)) for nm, _, path in spies}}  # fmt: skip
    finally:
        ours.terminate()
        ours.wait()
    print(f"py-spy's raw samples: {tmp}")
    args.out = os.path.join(ROOT, "docs", "vllm_profile", f"serve-c{c}")
    write(results, args)
    return 0


def write(results: dict, args) -> None:
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    note = ("py-spy keeps a thread's sample only when it is running (not blocked in the kernel): "
            "'ms per step' is a process's running time in that group per decode step (5 ms a "
            "sample, summed over its threads), 'waiting' is time spent spinning (polls, "
            "sched_yield), and a process's total against the step's wall time shows how much "
            "of the step it holds a core.")  # fmt: skip
    if getattr(args, "concurrency", None):
        c = args.concurrency
        lines = [f"# Where a batched decode step goes under load: vLLM's server and ours (C={c})",
                 "", f"`python bench/vllm_profile.py --concurrency {c}`: `leapdecode serve` and "
                 f"vLLM's API server, plain decoding, 1 thread each, the embedded target in "
                 f"float32; {c} concurrent streaming clients (bench serve's load generator, "
                 f"{max(8, 4 * c)} requests of at most {args.max_new_tokens} tokens); py-spy at "
                 f"200 Hz over a second, profiled load (tokens/s from the load before it, "
                 f"unprofiled); a step is estimated as C tokens. " + note, ""]  # fmt: skip
    else:
        lines = [f"# Where a decode step goes: vLLM CPU and leapdecode (`{args.method}`"
                 + (f", k={args.k}" if args.method != "none" else "") + ")", "",
                 f"`python bench/vllm_profile.py --method {args.method} --k {args.k}` (vLLM at "
                 f"k={args.vllm_k}): {args.requests} bench prompts, {args.max_new_tokens} greedy "
                 "tokens, 1 thread each, the embedded target in float32; py-spy at 200 Hz over "
                 "a third, profiled pass (the tokens/s come from the pass before it, "
                 "unprofiled). " + note, ""]  # fmt: skip
    for side, r in results.items():
        lines += [f"## {side}: {r['tokens_per_s']:.0f} tokens/s, {r['ms_per_step']:.2f} ms per "
                  f"decode step ({r['steps']} steps)", "",
                  "| process | group | share of its samples | ms per step |", "|---|---|---|---|"]  # fmt: skip
        for proc, groups in r["samples"].items():
            total = sum(groups.values()) or 1
            lines.append(
                f"| {proc} | **all (running)** | 100% | {1e3 * total / RATE / max(1, r['steps']):.2f} |"
            )
            for g, n in sorted(groups.items(), key=lambda x: -x[1]):
                ms = 1e3 * n / RATE / max(1, r["steps"])
                lines.append(f"| {proc} | {g} | {n / total:.0%} | {ms:.2f} |")
        lines.append("")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
