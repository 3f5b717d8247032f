"""`leapdecode bench serve`: the server under load, with the `openai` client.

For each concurrency C, C client threads send the bench prompts (all categories, round
robin) as streaming completions, each waiting for its answer before sending the next,
until `requests` have been answered. Every speculation configuration runs through the same
server (the request's `speculation` field picks it), interleaved per round in ABBA order
(`round_order`), after an untimed warm-up at each concurrency; each figure is the median
over rounds. The server keeps no earlier outputs for suffix decoding
(`--suffix-max-cached-requests 0`): the rounds repeat the same prompts, and a global tree of
their greedy outputs would replay the answers (`bench repeated` measures that effect).
Reported per (configuration, C):
throughput (completion tokens per second of wall time), time to first token and
inter-token latency percentiles (p50, p90), tokens per target forward.

Configurations: `none`; fixed k for `draft` and `ngram`; a static batch-size -> k table
shaped like SGLang's defaults (bs 1 -> 4 ... bs >= 8 -> 1, bs >= 16 -> 0); `auto`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass

from tqdm import tqdm

from ..config import SpecConfig
from ..errors import LeapDecodeError
from .runner import round_order
from .servers import free_port, tail, wait_healthy

# A static batch-size -> k table after SGLang's adaptive candidates (bs 1 -> {1,3,5,7},
# bs 8 -> {0,1,3}, bs 32 -> {0,1}), as vLLM / TRT-LLM static schedules configure it.
STATIC_TABLE = {"1": 4, "2": 3, "4": 2, "8": 1, "16": 0}
PEER_CONTEXT = 4096  # every server's context (--max-model-len) where a peer runs beside ours


@dataclass
class Config:
    label: str
    speculation: dict | None  # our request's `speculation`; None: a peer's server
    url: str | None = None  # a peer's own server (None: ours)
    peer: str | None = None  # "vllm" | "llamacpp" for a peer's server


def configs(
    has_draft: bool,
    draft_ks: list[int],
    ngram_ks: list[int],
    suffix_ks=(),
    lookaheads=(),
    heads=(),
    heads_k: int = 16,
) -> list[Config]:
    """heads: the speculator kinds the server has (medusa, eagle), verified as trees of
    heads_k nodes."""
    out = [Config("none", {"method": "none"})]
    if has_draft:
        out += [
            Config(f"draft k={k}", {"method": "draft", "num_speculative_tokens": k})
            for k in draft_ks
        ]
    out += [
        Config(f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k}) for k in ngram_ks
    ]
    out += [
        Config(f"suffix k={k}", {"method": "suffix", "num_speculative_tokens": k})
        for k in suffix_ks
    ]
    for w, n, g in lookaheads:
        spec = {
            "method": "lookahead",
            "lookahead_window": w,
            "lookahead_ngram_size": n,
            "lookahead_max_candidates": g,
        }
        spec["num_speculative_tokens"] = SpecConfig(**spec).k  # the tree's size
        out.append(Config(f"lookahead W{w} N{n} G{g}", spec))
    out += [
        Config(f"{kind} k={heads_k}", {"method": kind, "num_speculative_tokens": heads_k})
        for kind in heads
    ]
    method = "draft" if has_draft else "ngram"
    out.append(
        Config(
            f"{method} static table",
            {
                "method": method,
                "num_speculative_tokens": 4,
                "num_speculative_tokens_per_batch_size": STATIC_TABLE,
            },
        )
    )
    out.append(Config("auto", {"method": "auto", "num_speculative_tokens": 4}))
    return out


def _one_request(client, model: str, row: dict, spec: dict | None) -> dict:
    t0 = time.perf_counter()
    first = None
    stamps = []
    usage = spec_stats = timings = None
    stream = client.completions.create(
        model=model,
        prompt=row["prompt"],
        max_tokens=row["max_new_tokens"],
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"speculation": spec} if spec is not None else None,
    )
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            stamps.append(now)
            if first is None:
                first = now - t0
        if getattr(chunk, "usage", None):
            usage = chunk.usage
            spec_stats = (chunk.model_extra or {}).get("speculation")
        timings = (chunk.model_extra or {}).get("timings") or timings  # llama-server's
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage else 0
    itl = (end - t0 - (first or 0)) / max(1, tokens - 1)
    return {
        "ttft": first if first is not None else end - t0,
        "itl": itl,
        "tokens": tokens,
        "seconds": end - t0,
        "spec": spec_stats,
        "timings": timings,
    }


def parallel(n_items: int, n_threads: int, fn, on_done=None) -> list:
    """fn(i) for i in range(n_items) on n_threads client threads, each taking the next item
    when its last one is done (a closed loop, as real clients behave). Returns the results in
    completion order; an exception becomes the string "error <Type>: <message>"."""
    results, lock = [], threading.Lock()
    counter = iter(range(n_items))

    def worker():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            try:
                res = fn(i)
            except Exception as e:  # noqa: BLE001 - recorded, the load goes on
                res = f"error {type(e).__name__}: {e}"
            with lock:
                results.append(res)
                if on_done is not None:
                    on_done()

    threads = [threading.Thread(target=worker) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def run_load(
    url: str,
    model: str,
    rows: list[dict],
    cfg: Config,
    concurrency: int,
    n_requests: int,
    start: int,
) -> dict:
    """One load run of a configuration; a peer's server is woken for it (vllm_serve.awake)."""
    if cfg.url is None:
        return _run_load(url, model, rows, cfg, concurrency, n_requests, start)
    from .vllm_serve import awake

    with awake(cfg.url):
        return _run_load(url, model, rows, cfg, concurrency, n_requests, start)


def _run_load(
    url: str,
    model: str,
    rows: list[dict],
    cfg: Config,
    concurrency: int,
    n_requests: int,
    start: int,
) -> dict:
    import openai

    local = threading.local()
    url = cfg.url or url
    if cfg.peer == "vllm":
        from .vllm_serve import SERVED_NAME, spec_counts

        model = SERVED_NAME
        before = spec_counts(url)  # (requests, generated tokens, accepted drafts)

    def one(i: int) -> dict:
        if not hasattr(local, "client"):
            local.client = openai.OpenAI(
                base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600
            )
        return _one_request(local.client, model, rows[(start + i) % len(rows)], cfg.speculation)

    t0 = time.perf_counter()
    out = parallel(n_requests, concurrency, one)
    results = [r for r in out if isinstance(r, dict)]
    errors = [r for r in out if isinstance(r, str)]
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    fwd = [r["spec"] for r in results if r["spec"]]
    mat = statistics.mean(s["mean_accepted_tokens"] for s in fwd) if fwd else 0.0
    if cfg.peer is not None:  # tokens per decode step, from the peer's own counters
        if cfg.peer == "vllm":
            after = spec_counts(url)
            requests, tokens_out, accepted = (a - b for a, b in zip(after, before, strict=True))
        else:  # llama.cpp: each reply's timings (tokens predicted, drafts accepted)
            ts = [r["timings"] or {} for r in results]
            requests = len(ts)
            tokens_out = sum(t.get("predicted_n", 0) for t in ts)
            accepted = sum(t.get("draft_n_accepted", 0) for t in ts)
        steps = tokens_out - requests - accepted  # each request's first token is its prefill's
        mat = (tokens_out - requests) / steps if steps > 0 else 1.0
    return {
        "throughput": tokens / wall,
        "tokens": tokens,
        "wall_s": wall,
        "errors": errors,
        "ttft": [r["ttft"] for r in results],
        "itl": [r["itl"] for r in results],
        "mean_accepted_tokens": mat,
    }


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


@contextmanager
def local_server(args, extra: tuple[str, ...] = ()):
    """`leapdecode serve` on a free local port with the bench's model options, for the length
    of the block: yields (url, pid). Its output goes to <out>/server.log (a pipe nobody reads
    would block the server), whose tail is printed when the block fails."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "leapdecode",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--speculation",
        "auto",
        "--max-num-seqs",
        str(max(args.concurrency)),
        "--max-queue",
        "1024",
        "--dtype",
        args.dtype,
        "--backend",
        args.backend,
        *extra,
    ]
    flags = ("target", "draft", "draft_dtype", "threads", "device", "max_model_len",
             "kv_cache_memory", "quantize", "draft_quantize")  # fmt: skip
    for flag in flags:
        v = getattr(args, flag, None)
        if v is not None:
            cmd += ["--" + flag.replace("_", "-"), str(v)]
    if args.threads is None:  # the clients run on this machine too: leave them a core (on
        # 2 cores the server's own default, 2 threads on an idle machine, made every
        # configuration a third slower: `none` at C=1 98 -> 149 tokens/s with 1 thread)
        from ..threads import available_cores

        cmd += ["--threads", str(max(1, available_cores() - 1))]
    for path in args.speculator or ():
        cmd += ["--speculator", path]
    if getattr(args, "compile", False):
        cmd.append("--compile")
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "server.log")
    with open(log_path, "w") as log:  # the child holds its own copy
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log_path)
        yield url, proc.pid
    except BaseException:
        print(f"server log (tail):\n{tail(log_path)}", file=sys.stderr)
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tree_rss_kb(pid: int) -> int:
    """Resident memory of a process and its descendants (the server's HTTP process and its
    engine process), in KiB (Linux /proc)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(x.split()[1]) for x in f if x.startswith("VmRSS"))
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, StopIteration):  # it exited meanwhile
            continue
    return total


def _heads(args) -> list[str]:
    """The speculator kinds to load-test: --heads, or (auto) the trees the local server loads
    (medusa, eagle; a parallel head only when named)."""
    if args.heads != "auto":
        return [h for h in args.heads.split(",") if h]
    if args.url is not None or args.backend != "native":
        return []  # the server loads heads on the native backend only
    from ..models.heads import beside, kind_of
    from ..resolve import resolve_models

    paths = args.speculator or beside(resolve_models(args.target, None)[0])
    return sorted(k for k in map(kind_of, paths) if k in ("medusa", "eagle"))


def cmd_serve_bench(args) -> int:
    import httpx

    from . import workloads

    levels = args.concurrency
    sets = workloads.load(args.prompts)
    rows = [r for group in zip(*sets.values(), strict=False) for r in group]  # round robin
    if args.max_new_tokens:
        rows = [
            {**r, "max_new_tokens": min(r["max_new_tokens"], args.max_new_tokens)} for r in rows
        ]
    if args.peer and args.max_model_len is None:
        # every engine the same context; unbounded, ours would take half the free memory for
        # its caches and vLLM its model's own context (32k for Qwen2.5: more than its cache)
        args.max_model_len = PEER_CONTEXT
    server = (
        nullcontext((args.url, None))
        if args.url
        else local_server(args, ("--suffix-max-cached-requests", "0"))
    )
    peers = ExitStack()
    with server as (url, _), peers:
        peer_cfgs = []
        if "vllm" in args.peer:
            peer_cfgs += peers.enter_context(_vllm_peer(args))
        if "llamacpp" in args.peer:
            peer_cfgs += peers.enter_context(_llamacpp_peer(args))
        info = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
        model = info["id"]
        has_draft = not args.no_draft and (args.url is not None or _local_draft(args))
        cfgs = configs(
            has_draft,
            args.draft_k,
            args.ngram_k,
            args.suffix_k,
            args.lookahead,
            _heads(args),
            args.heads_k,
        )
        if args.configs:
            keep = set(args.configs.split(",")) | {"none"}  # none: every ratio's baseline
            cfgs = [c for c in cfgs if c.label.split(" ")[0] in keep or c.label in keep]
        cfgs = cfgs[:-1] + peer_cfgs + cfgs[-1:]  # auto stays last
        # warm-up: every configuration once
        for c in cfgs:
            run_load(url, model, rows, c, 1, 1, 0)
        cells: dict[tuple[str, int], list[dict]] = {}
        meta = {
            "url": args.url or "local server",
            "model": model,
            "rounds": args.rounds,
            "levels": [],
            "requests_per_client": args.requests_per_client,
            "max_new_tokens": args.max_new_tokens,
            "prompts": len(rows),
            "dtype": args.dtype,
            "vllm_dtype": getattr(args, "vllm_dtype_used", None),
        }
        bar = tqdm(total=len(levels) * args.rounds * len(cfgs), desc="bench serve", unit="run")
        for conc in levels:
            n = max(args.requests_min, args.requests_per_client * conc)
            # untimed: the first batches of this size, ours and each peer server's
            for c in (cfgs[0], cfgs[-1], *(c for c in cfgs if c.url is not None)):
                run_load(url, model, rows, c, conc, conc, start=len(rows) // 2)
            for r in range(args.rounds):
                for c in round_order(cfgs, r):
                    bar.set_postfix_str(f"C={conc} {c.label}")
                    res = run_load(url, model, rows, c, conc, n, start=r * n)
                    cells.setdefault((c.label, conc), []).append(res)
                    bar.update()
            meta["levels"] = meta["levels"] + [conc]  # written level by level: a long run
            write(summarize(cells, cfgs, meta["levels"]), meta, args.out)  # keeps what it has
        bar.close()
    print(open(os.path.join(args.out, "results.md")).read())
    return 0


@contextmanager
def _vllm_peer(args):
    """vLLM's servers for --peer vllm: yields their Configs."""
    from ..resolve import resolve_models
    from ..threads import available_cores
    from .vllm_peer import HINT, LOGS, check_python, default_lookup, export_eagle3, find_python
    from .vllm_serve import configs as vllm_configs
    from .vllm_serve import vllm_servers

    python = find_python(args.vllm_python)
    if python is None:
        raise LeapDecodeError(f"--peer vllm: no vLLM environment found. {HINT}")
    print(f"vLLM {check_python(python)} from {python}")
    target = resolve_models(args.target, None)[0]
    # the dtype our server runs (--dtype auto: the checkpoint's own); vLLM's own "auto" would
    # load a float32 checkpoint in bfloat16 on CPU, another engine's arithmetic than ours
    from ..models.loader import load_config, resolve_dtype
    from .vllm_peer import dtype_name

    dtype = args.vllm_dtype or dtype_name(resolve_dtype(args.dtype, load_config(target)))
    want = {c.strip() for c in (args.vllm_configs or "none,ngram,eagle3,dynamic").split(",")}
    eagle3 = None
    if "eagle3" in want and "eagle" in _heads(args):
        eagle3 = export_eagle3(args.speculator, target, os.path.join(LOGS, "eagle3-head"), dtype)
    cfgs = vllm_configs(
        args.vllm_ngram_k,
        args.vllm_eagle_k,
        eagle3,
        STATIC_TABLE,
        max(args.concurrency),
        default_lookup(),
    )
    cfgs = [(label, spec) for label, spec in cfgs if label.split(" ")[1] in want]
    threads = args.threads or max(1, available_cores() - 1)  # as our server gets
    print(f"vLLM runs the target in {dtype}")
    args.vllm_dtype_used = dtype
    context = args.max_model_len or PEER_CONTEXT
    with vllm_servers(
        python, target, cfgs, dtype, max(args.concurrency), threads, context,
        os.path.join(LOGS, "serve"),
    ) as urls:  # fmt: skip
        yield [Config(label, None, urls[label], "vllm") for label, _ in cfgs]


@contextmanager
def _llamacpp_peer(args):
    """llama.cpp's servers for --peer llamacpp, one per configuration and precision, each with
    as many slots (--parallel) as the highest concurrency: yields their Configs."""
    from ..resolve import resolve_models
    from ..threads import available_cores
    from .llamacpp_peer import HINT, LOGS, Server, find_dir, gguf_for, server_args, version
    from .vllm_serve import SERVER_PIDS

    folder = find_dir(args.llamacpp)
    if folder is None:
        raise LeapDecodeError(f"--peer llamacpp: no llama.cpp build found. {HINT}")
    print(f"llama.cpp {version(folder)} from {folder}")
    target, draft = resolve_models(args.target, args.draft)
    want = {c.strip() for c in args.llamacpp_configs.split(",") if c.strip()}
    rows = []
    for p in args.llamacpp_precision:  # checked, a list (cmd_serve)
        if "none" in want:
            rows.append((f"llamacpp none {p}", "llamacpp", 0, p))
        if "draft" in want and draft is not None and not args.no_draft:
            rows += [(f"llamacpp draft k={k} {p}", "llamacpp-draft", k, p)
                     for k in args.llamacpp_draft_k]  # fmt: skip
        if "ngram" in want:
            rows += [(f"llamacpp ngram k={k} {p}", "llamacpp-ngram", k, p)
                     for k in args.llamacpp_ngram_k]  # fmt: skip
    threads = args.threads or max(1, available_cores() - 1)  # as our server gets
    context = args.max_model_len or PEER_CONTEXT
    servers = []
    try:
        for label, name, k, p in tqdm(rows, desc="starting llama-server", unit="server"):
            draft_gguf = gguf_for(draft, p, folder) if name == "llamacpp-draft" else None
            s = Server(folder, gguf_for(target, p, folder), server_args(name, k, draft_gguf),
                       threads, context, os.path.join(LOGS, "serve", label.replace(" ", "_")
                       .replace("=", "") + ".log"), parallel=max(args.concurrency))  # fmt: skip
            servers.append(s)
            SERVER_PIDS[s.url] = s.proc.pid
            s.idle()  # until its turn (vllm_serve.awake)
        yield [
            Config(label, None, s.url, "llamacpp")
            for (label, *_), s in zip(rows, servers, strict=True)
        ]
    finally:
        for s in servers:
            SERVER_PIDS.pop(s.url, None)
            s.close()


def _local_draft(args) -> bool:
    from ..resolve import resolve_models

    return resolve_models(args.target, args.draft)[1] is not None


def summarize(cells, cfgs, levels) -> list[dict]:
    out = []
    for c in cfgs:
        for conc in levels:
            runs = cells.get((c.label, conc), [])
            if not runs:
                continue
            ttft = [x for r in runs for x in r["ttft"]]
            itl = [x for r in runs for x in r["itl"]]
            out.append(
                {
                    "config": c.label,
                    "speculation": c.speculation,
                    "concurrency": conc,
                    "throughput": statistics.median(r["throughput"] for r in runs),
                    "throughput_rounds": [r["throughput"] for r in runs],
                    "ttft_p50": _pct(ttft, 0.5),
                    "ttft_p90": _pct(ttft, 0.9),
                    "itl_p50": _pct(itl, 0.5),
                    "itl_p90": _pct(itl, 0.9),
                    "mean_accepted_tokens": statistics.median(
                        r["mean_accepted_tokens"] for r in runs
                    ),
                    "errors": sum(len(r["errors"]) for r in runs),
                    "error_examples": [e for r in runs for e in r["errors"]][:3],
                }
            )
    for row in out:
        same = [r for r in out if r["concurrency"] == row["concurrency"]]
        base_label = (
            "vllm none"
            if row["config"].startswith("vllm")
            else f"llamacpp none {row['config'].rsplit(' ', 1)[-1]}"
            if row["config"].startswith("llamacpp")
            else "none"
        )
        base = next((r for r in same if r["config"] == base_label), None)
        row["vs_none"], row["vs_none_rounds"] = _paired(row, base)
        fixed = [
            r
            for r in same
            if r["config"] != "auto" and not r["config"].startswith(("vllm", "llamacpp"))
        ]
        best = max(fixed, key=lambda r: r["throughput"], default=None)
        row["best_fixed"] = best["config"] if best else None
        row["vs_best_fixed"], row["vs_best_fixed_rounds"] = _paired(row, best)
    return out


def _paired(row: dict, other: dict | None) -> tuple[float, list[float]]:
    """row / other throughput: the median of the per-round ratios. A round's configurations
    serve the same prompts minutes apart at most, so a ratio within a round is free of
    which prompts the round drew (rounds draw different ones) and of most of the machine's
    drift; a ratio of two medians is not."""
    if other is None:
        return float("nan"), []
    ratios = [
        a / b
        for a, b in zip(row["throughput_rounds"], other["throughput_rounds"], strict=False)
        if b
    ]
    return (statistics.median(ratios) if ratios else float("nan")), [round(x, 3) for x in ratios]


def write(summary: list[dict], meta: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "cells": summary}, f, indent=1)
    levels = meta["levels"]
    labels = list(dict.fromkeys(r["config"] for r in summary))
    get = {(r["config"], r["concurrency"]): r for r in summary}
    lines = [
        "# `leapdecode bench serve`",
        "",
        f"Server: {meta['model']} ({meta['url']}); greedy; streaming completions over the bench "
        f"prompt sets ({meta['prompts']} prompts, all categories round robin); "
        f"{meta['requests_per_client']} requests per client thread; configurations interleaved, "
        f"in ABBA order (each odd round reverses the one before), after an untimed warm-up "
        f"at each concurrency; median of {meta['rounds']} rounds. Each round draws its own prompts, "
        f"the same for every configuration; a ratio (x `none`, `auto` / best fixed) is the "
        f"median of the per-round ratios, which pairs configurations that served the same "
        f"prompts at nearly the same time. The server keeps no earlier "
        f"outputs for suffix decoding (the rounds repeat the prompts). Our server's dtype: "
        f"{meta.get('dtype', 'auto')}"
        + (f"; vLLM's: {meta['vllm_dtype']}." if meta.get("vllm_dtype") else "."),
        "",
        "## Throughput (completion tokens/s) and x `none` at the same concurrency",
        "",
        "| configuration | " + " | ".join(f"C={c}" for c in levels) + " |",
        "|---|" + "---|" * len(levels),
    ]
    for label in labels:
        cells = [get.get((label, c)) for c in levels]
        lines.append(
            f"| {label} | "
            + " | ".join(
                "-" if r is None else f"{r['throughput']:.0f} ({r['vs_none']:.2f}x)" for r in cells
            )
            + " |"
        )
    lines += [
        "",
        "## `auto` against the best fixed configuration at each concurrency",
        "",
        "| concurrency | best fixed | its tokens/s | auto tokens/s | auto / best fixed "
        "(rounds' range) | auto / none | auto / static table |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in levels:
        fixed = [r for r in summary if r["concurrency"] == c and r["config"] != "auto"]
        auto = get.get(("auto", c))
        if not fixed or auto is None:
            continue
        best = get[(auto["best_fixed"], c)]
        table = next((r for r in fixed if "static table" in r["config"]), None)
        spread = auto["vs_best_fixed_rounds"] or [float("nan")]
        vs_table = f"{_paired(auto, table)[0]:.2f}" if table is not None else "-"  # not run
        lines.append(
            f"| {c} | {best['config']} | {best['throughput']:.0f} | {auto['throughput']:.0f} "
            f"| {auto['vs_best_fixed']:.2f} ({min(spread):.2f}-{max(spread):.2f}) "
            f"| {auto['vs_none']:.2f} | {vs_table} |"
        )
    for prefix, who in (("vllm", "vLLM"), ("llamacpp", "llama.cpp")):
        peers = [label for label in labels if label.startswith(prefix)]
        if peers:
            lines += _peer_table(get, levels, peers, prefix, who)
    lines += [
        "",
        "## Latency (seconds): time to first token p50 / p90, inter-token p50 / p90",
        "",
        "| configuration | C | TTFT p50 | TTFT p90 | ITL p50 | ITL p90 | tokens/forward | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        lines.append(
            f"| {r['config']} | {r['concurrency']} | {r['ttft_p50']:.3f} | {r['ttft_p90']:.3f} "
            f"| {r['itl_p50'] * 1e3:.1f} ms | {r['itl_p90'] * 1e3:.1f} ms "
            f"| {r['mean_accepted_tokens']:.2f} | {r['errors']} |"
        )
    lines += ["", "![throughput](throughput.png) ![latency](latency.png)", ""]
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write("\n".join(lines))
    _plots(summary, levels, labels, out_dir)


def _peer_table(get, levels, peers, prefix, who) -> list[str]:
    """`auto` / each of a peer's configurations at each concurrency, and / its best."""
    lines = [
        "",
        f"## `auto` against {who}'s configurations",
        "",
        f"auto / {who} configuration throughput at the same concurrency: the median of "
        f"the per-round ratios (their range); the last column is {who}'s best "
        "configuration at that concurrency.",
        "",
        "| concurrency | " + " | ".join(peers) + f" | auto / {who}'s best |",
        "|---|" + "---|" * (len(peers) + 1),
    ]
    for c in levels:
        auto = get.get(("auto", c))
        theirs = [get[(p, c)] for p in peers if (p, c) in get]
        if auto is None or not theirs:
            continue
        cells = []
        for p in peers:
            r = get.get((p, c))
            ratio, rounds = _paired(auto, r)
            cells.append(
                "-"
                if r is None
                else f"{ratio:.2f} ({min(rounds or [ratio]):.2f}-{max(rounds or [ratio]):.2f})"
            )
        best = max(theirs, key=lambda r: r["throughput"])
        ratio, rounds = _paired(auto, best)
        cells.append(
            f"**{ratio:.2f}** ({best['config'].removeprefix(prefix + ' ')}; "
            f"{min(rounds or [ratio]):.2f}-{max(rounds or [ratio]):.2f})"
        )
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return lines


def _plots(summary, levels, labels, out_dir) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    get = {(r["config"], r["concurrency"]): r for r in summary}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in labels:
        xs = [c for c in levels if (label, c) in get]
        style = (
            dict(lw=2.5, color="black")
            if label == "auto"
            else dict(lw=1.2, ls="--")
            if label.startswith("vllm")
            else dict(lw=1.2, ls=":")
            if label.startswith("llamacpp")
            else dict(lw=1.2)
        )
        ax.plot(xs, [get[(label, c)]["throughput"] for c in xs], "o-", label=label, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("completion tokens / s")
    ax.set_title("Server throughput by speculation configuration")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "throughput.png"), dpi=120)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label in labels:
        xs = [c for c in levels if (label, c) in get]
        axes[0].plot(xs, [get[(label, c)]["ttft_p50"] for c in xs], "o-", label=label)
        axes[1].plot(xs, [get[(label, c)]["itl_p50"] * 1e3 for c in xs], "o-", label=label)
    for ax, title in zip(
        axes, ("time to first token p50 (s)", "inter-token latency p50 (ms)"), strict=True
    ):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "latency.png"), dpi=120)
    plt.close(fig)


def add_parser(what, model_args, prompts_dir: str) -> None:
    sv = what.add_parser("serve", help="load test of `leapdecode serve` with the openai client")
    model_args(sv)
    sv.set_defaults(draft_dtype="float32")
    sv.add_argument("--url", default=None, help="a running server (default: start one here)")
    sv.add_argument("--no-draft", action="store_true", help="skip the draft configurations")
    sv.add_argument("--prompts", default=prompts_dir)
    sv.add_argument("--concurrency", default="1,2,3,4,6,8,12,16")
    sv.add_argument("--draft-k", default="2,4")
    sv.add_argument("--ngram-k", default="4,8")
    sv.add_argument("--suffix-k", default="16")
    sv.add_argument("--lookahead", default="3x3x3", metavar="WxNxG,...")
    sv.add_argument(
        "--heads",
        default="auto",
        help="speculator kinds to test (medusa,eagle; default auto: those the "
        "local server loads; none with --url)",
    )
    sv.add_argument("--heads-k", type=int, default=12, help="tree size for medusa and eagle")
    sv.add_argument(
        "--configs", default=None, help="only these (none,draft,ngram,suffix,lookahead,auto,...)"
    )
    sv.add_argument("--rounds", type=int, default=3)
    sv.add_argument("--requests-per-client", type=int, default=4)
    sv.add_argument("--requests-min", type=int, default=8)
    sv.add_argument("--max-new-tokens", type=int, default=None, help="cap each prompt's budget")
    sv.add_argument("--out", default=os.path.join("docs", "bench", "serve"))
    sv.add_argument(
        "--peer",
        default="",
        help="also load-test peers' servers beside ours, one server per configuration: "
        "vllm (`vllm serve`), llamacpp (`llama-server`), or vllm,llamacpp",
    )
    sv.add_argument(
        "--llamacpp",
        default=None,
        metavar="DIR",
        help="llama.cpp's folder (default: $LEAPDECODE_LLAMACPP, else .llamacpp)",
    )
    sv.add_argument(
        "--llamacpp-configs",
        default="none,draft,ngram",
        help="llama-server configurations: none, draft, ngram (comma-separated)",
    )
    sv.add_argument("--llamacpp-precision", default="GGUF", help="GGUF, BF16, or GGUF,BF16")
    sv.add_argument("--llamacpp-draft-k", default="3", help="llama.cpp's --spec-draft-n-max")
    sv.add_argument("--llamacpp-ngram-k", default="64", help="its n-max for ngram-simple")
    sv.add_argument(
        "--vllm-python",
        default=None,
        metavar="PATH",
        help="the vLLM environment's interpreter (default: $LEAPDECODE_VLLM_PYTHON or .venv-vllm)",
    )
    sv.add_argument("--vllm-ngram-k", default="4,8", help="k for vLLM's ngram servers")
    sv.add_argument("--vllm-eagle-k", type=int, default=3, help="k for vLLM's eagle3 server")
    sv.add_argument(
        "--vllm-configs",
        default=None,
        help="only these vLLM servers (none, ngram, eagle3, dynamic: comma-separated; default all)",
    )
    sv.add_argument(
        "--vllm-dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="vLLM's weights and KV cache (default: the dtype our server runs, the "
        "checkpoint's own for --dtype auto; vLLM's own auto picks bfloat16 on CPU)",
    )


def cmd_soak(args) -> int:
    """500 streaming requests at concurrency 16, 10% of clients hanging up mid-stream: every
    other request must complete well-formed, no 5xx, and the server's memory must settle."""
    import random

    import httpx

    from . import workloads

    rows = [r for group in zip(*workloads.load(args.prompts).values(), strict=False) for r in group]
    args.concurrency = [args.clients]

    def rss_kb() -> int:
        return tree_rss_kb(pid)

    # exactly the share asked for hangs up, spread at random over the run
    hang_up = set(
        random.Random(0).sample(range(args.requests), round(args.disconnect_share * args.requests))
    )
    plan = [i in hang_up for i in range(args.requests)]

    def one(i: int, warm: bool = False) -> str:
        row = rows[i % len(rows)]
        body = {
            "prompt": row["prompt"],
            "max_tokens": min(args.max_new_tokens, row["max_new_tokens"]),
            "temperature": 0,
            "stream": True,
            "speculation": {"method": "auto"},
        }
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                return f"http {r.status_code}"
            lines = []
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if not warm and plan[i] and len(lines) >= 2:
                    return "disconnected"  # hang up mid-stream
            if lines and lines[-1].startswith("data: {") and '"error"' in lines[-1]:
                return f"error in stream: {lines[-1][:300]}"  # the server's 500, mid-stream
            if not lines or lines[-1] != "data: [DONE]":
                return "malformed: no [DONE]"
            last = json.loads(lines[-2][len("data: ") :])
            if last["choices"][0]["finish_reason"] not in ("stop", "length") or "usage" not in last:
                return "malformed: last chunk"
            return "ok"

    def aborted() -> int:
        """Requests the server finished as aborted (its /metrics)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(url + "/metrics", timeout=10).text
        return int(
            sum(
                s.value
                for fam in text_string_to_metric_families(text)
                for s in fam.samples
                if s.name == "leapdecode:requests_total" and s.labels.get("status") == "abort"
            )
        )

    with local_server(args) as (url, pid):
        # warm-up at full concurrency (the allocator's working set for batches of `clients`),
        # then the memory baseline
        parallel(2 * args.clients, args.clients, lambda i: one(i, warm=True))
        before, aborted_before = rss_kb(), aborted()
        bar = tqdm(total=args.requests, desc="soak", unit="req")
        t0 = time.perf_counter()
        outcomes = parallel(args.requests, args.clients, one, on_done=bar.update)
        outcomes = [o.split(":")[0] for o in outcomes]  # "error <Type>" without the message
        bar.close()
        wall = time.perf_counter() - t0
        time.sleep(2)
        health = httpx.get(url + "/health", timeout=10).json()
        after, n_aborted = rss_kb(), aborted() - aborted_before
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o] = counts.get(o, 0) + 1
    ok = counts.get("ok", 0)
    expected_ok = sum(1 for p in plan if not p)
    growth = (after - before) / before
    lines = [
        "# Soak: clients that hang up mid-stream",
        "",
        f"{args.requests} streaming requests at concurrency {args.clients}, "
        f"{sum(plan)} of them ({args.disconnect_share:.0%}) hanging up after their first "
        f"chunk; speculation auto; {wall:.0f} s. `leapdecode bench soak`.",
        "",
        "| outcome | requests |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in sorted(counts.items())]
    lines += [
        "",
        f"- completed well-formed: {ok} of the {expected_ok} that did not hang up",
        f"- the server counted {n_aborted} aborted requests (its /metrics) for the "
        f"{counts.get('disconnected', 0)} hang-ups",
        f"- server afterwards: running {health['running']}, waiting {health['waiting']}",
        f"- server RSS (after a warm-up at concurrency {args.clients}): "
        f"{before / 1024:.0f} MiB before, {after / 1024:.0f} MiB after ({growth:+.1%}; "
        f"limit +-10%)",
        "",
    ]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "soak.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    good = ok == expected_ok and not any(
        k.startswith(("http 5", "error", "malformed")) for k in counts
    )
    return 0 if good and health["running"] == 0 and abs(growth) <= 0.10 else 1


def add_soak_parser(what, model_args, prompts_dir: str) -> None:
    sk = what.add_parser("soak", help="many requests, some clients hanging up mid-stream")
    model_args(sk)
    sk.set_defaults(draft_dtype="float32")
    sk.add_argument("--prompts", default=prompts_dir)
    sk.add_argument("--requests", type=int, default=500)
    sk.add_argument("--clients", type=int, default=16)
    sk.add_argument("--disconnect-share", type=float, default=0.1)
    sk.add_argument("--max-new-tokens", type=int, default=64)
    sk.add_argument("--out", default=os.path.join("docs", "bench", "serve"))
