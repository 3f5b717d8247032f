"""The embedded target v2's training run, prepared for one GPU machine (issue 35).

Two steps, one on each machine:

    python bench/gpu_train.py pack --corpus DIR          # here: DIR from `leapdecode train corpus`
    bash bench/gpu_train.sh                              # there (device run, carry .gpu)

`pack` takes the corpus's token streams (DIR/tokens/{train,validation,heldout}.npy) and writes
`.gpu/` (git-ignored, carried to the device): the training stream as xz parts of 1M-token
chunks drawn at random over the whole stream (so a budget-limited share still covers every
package), until the compressed parts reach the budget; a held-out and a validation sample; and
meta.json (tokens, bytes a token, the corpus manifest's packages). The budget is what the
device leaves of its 64 MiB once the repository's tracked files are counted (--budget-mib).

`run` (what gpu_train.sh starts) decompresses the parts on every core into a memory-mapped
token file, sizes the model by a short measured sweep (each candidate's tokens/s for a few
seconds, then the largest whose tokens over the remaining time reach --tokens-per-param),
trains it with bf16 autocast, fused AdamW, torch.compile and large batches until --minutes
is spent, evaluates (held-out and validation loss, bits per byte, and copy signals: the loss
of a held-out span shown a second time and the share of it greedy decoding copies), and
writes into --out at most 8 files of at most 16 MiB: the weights as sharded safetensors
(bfloat16), their index, config.json, log.jsonl and summary.json. `--tiny` runs the same
path at toy sizes (CPU, seconds), as the tests do.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import lzma
import math
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

TREE_LIMIT_MIB = 64  # what one device call may carry, the repository's tracked files included
OUT_FILES, OUT_FILE_MIB = 8, 16  # what comes back
CHUNK = 1_000_000  # tokens a compressed part of the training stream holds
SAMPLE = 1_000_000  # tokens of the validation and held-out samples
# (hidden, layers, heads, kv heads, intermediate): candidates under the output limit (4 shards
# of 16 MiB in bfloat16 with a 10% margin for the shards' packing: about 30M parameters with an
# 8192-token vocabulary; 22M, 27M and 30M here), few layers each: the target decodes on CPUs,
# where a step's cost follows its layers more than its width
CANDIDATES = [(384, 12, 6, 2, 1024), (512, 8, 8, 4, 1376), (576, 7, 9, 3, 1536)]
TINY = [(32, 1, 2, 1, 64), (48, 2, 2, 1, 96)]


def _v1_config() -> dict:
    path = os.path.join(ROOT, "models", "leap-code-target", "config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------ pack
def tree_mib() -> float:
    """MiB of the repository's tracked files (they travel with every device call)."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    names = [n for n in out.stdout.decode().split("\0") if n]
    return sum(os.path.getsize(os.path.join(ROOT, n)) for n in names if os.path.isfile(
        os.path.join(ROOT, n))) / 2**20  # fmt: skip


def spread(stream: np.ndarray, n: int, pieces: int) -> np.ndarray:
    """n tokens of `stream` in `pieces` evenly spaced slices (the streams run package by
    package: a prefix would sample the first few alone)."""
    if len(stream) <= n:
        return np.asarray(stream)
    size = n // pieces
    starts = np.linspace(0, len(stream) - size, pieces).astype(np.int64)
    return np.concatenate([np.asarray(stream[s : s + size]) for s in starts])


def _compress(arr: np.ndarray) -> bytes:
    return lzma.compress(np.ascontiguousarray(arr, dtype=np.uint16).tobytes(), preset=9)


def cmd_pack(args) -> int:
    from tqdm import tqdm

    tokens = os.path.join(args.corpus, "tokens")
    streams = {}
    for split in ("train", "validation", "heldout"):
        path = os.path.join(tokens, split + ".npy")
        if not os.path.isfile(path):
            raise SystemExit(f"{path} not found: build the corpus with `leapdecode train corpus`")
        streams[split] = np.load(path, mmap_mode="r")
    if streams["train"].dtype != np.uint16:
        raise SystemExit("the token streams must be uint16 (a vocabulary under 65,536)")
    budget = args.budget_mib or TREE_LIMIT_MIB - tree_mib() - 2.0  # 2 MiB of slack
    if budget <= 0.1:
        raise SystemExit(f"no room to carry tokens: the repository's tracked files take "
                         f"{tree_mib():.1f} of the device's {TREE_LIMIT_MIB} MiB")  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    for name in os.listdir(args.out):  # an earlier pack's files (only those)
        if name.endswith(".xz") or name == "meta.json":
            os.remove(os.path.join(args.out, name))
    used, meta = 0, {"parts": [], "budget_mib": round(budget, 2)}
    manifest = {}
    path = os.path.join(args.corpus, "manifest.json")
    if os.path.isfile(path):
        with open(path) as f:
            manifest = json.load(f)
    tokenizer = (manifest.get("tokens") or {}).get("tokenizer")
    tok = None
    if tokenizer and os.path.isdir(tokenizer):  # the model's vocabulary and end-of-text id
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
        meta.update(vocab_size=len(tok), eos_token_id=tok.eos_token_id, tokenizer=tokenizer)
    for split in ("validation", "heldout"):  # the samples first: they must fit
        arr = spread(streams[split], args.sample, 16)
        if len(arr) == 0:
            raise SystemExit(f"the corpus has no {split} tokens: its evaluation needs some")
        if tok is not None:  # the sample's own bytes a token (bits per byte divide by it)
            meta.setdefault("sample_bytes_per_token", {})[split] = round(
                len(tok.decode(arr.tolist()).encode("utf-8")) / len(arr), 4
            )
        blob = _compress(arr)
        with open(os.path.join(args.out, split + ".xz"), "wb") as f:
            f.write(blob)
        used += len(blob)
        meta[split] = {"tokens": len(arr)}
    n_chunks = len(streams["train"]) // args.chunk
    order = np.random.default_rng(0).permutation(n_chunks)
    workers = max(1, os.cpu_count() or 1)
    bar = tqdm(total=int(budget * 2**20), unit="B", unit_scale=True, desc="packing tokens")
    bar.update(used)
    with cf.ProcessPoolExecutor(workers) as ex:
        for start in range(0, n_chunks, workers):
            idx = order[start : start + workers]
            chunks = [streams["train"][i * args.chunk : (i + 1) * args.chunk] for i in idx]
            blobs = list(ex.map(_compress, chunks))
            full = False
            for i, blob in zip(idx, blobs, strict=True):
                if used + len(blob) > budget * 2**20:
                    full = True
                    break
                name = f"train-{len(meta['parts']):04d}.xz"
                with open(os.path.join(args.out, name), "wb") as f:
                    f.write(blob)
                used += len(blob)
                bar.update(len(blob))
                meta["parts"].append({"file": name, "chunk": int(i), "tokens": args.chunk})
            if full:
                break
    bar.close()
    manifest = {}
    path = os.path.join(args.corpus, "manifest.json")
    if os.path.isfile(path):
        with open(path) as f:
            manifest = json.load(f)
    bpt = manifest.get("tokens") or {}
    tokenizer = (manifest.get("tokens") or {}).get("tokenizer")
    if tokenizer and os.path.isdir(tokenizer):  # the model's vocabulary and end-of-text id
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
        meta.update(vocab_size=len(tok), eos_token_id=tok.eos_token_id, tokenizer=tokenizer)
    meta.update(
        train_tokens=sum(p["tokens"] for p in meta["parts"]),
        corpus_train_tokens=len(streams["train"]),
        compressed_mib=round(used / 2**20, 2),
        bytes_per_token={
            s: (bpt.get(s) or {}).get("bytes_per_token") for s in ("train", "validation", "heldout")
        },  # fmt: skip
        packages=[f"{p['name']}=={p['version']}" for p in manifest.get("packages", [])],
        heldout_packages=manifest.get("heldout_packages", []),
    )
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"{args.out}: {meta['train_tokens'] / 1e6:.1f}M of {len(streams['train']) / 1e6:.1f}M "
          f"training tokens, {used / 2**20:.1f} MiB (budget {budget:.1f})")  # fmt: skip
    return 0


# ------------------------------------------------------------------------------------- run
def _decompress(path: str) -> np.ndarray:
    with open(path, "rb") as f:
        return np.frombuffer(lzma.decompress(f.read()), dtype=np.uint16)


def load_stream(data: str, work: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """The training tokens as a memory-mapped file (decompressed on every core), and the
    validation and held-out samples."""
    with open(os.path.join(data, "meta.json")) as f:
        meta = json.load(f)
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, "train.bin")
    total = sum(p["tokens"] for p in meta["parts"])
    out = np.memmap(path, dtype=np.uint16, mode="w+", shape=(total,))
    with cf.ProcessPoolExecutor(max(1, os.cpu_count() or 1)) as ex:
        at = 0
        files = [os.path.join(data, p["file"]) for p in meta["parts"]]
        for arr in ex.map(_decompress, files):
            out[at : at + len(arr)] = arr
            at += len(arr)
    out.flush()
    train = np.memmap(path, dtype=np.uint16, mode="r", shape=(at,))
    val = _decompress(os.path.join(data, "validation.xz"))
    held = _decompress(os.path.join(data, "heldout.xz"))
    return train, val, held, meta


def llama(shape, vocab: int, context: int, eos: int = 0):
    from transformers import LlamaForCausalLM

    from leapdecode.train.fit import llama_config

    return LlamaForCausalLM(llama_config(shape, vocab, eos, context))


def train_for(shape, args, train, val, seconds: float, steps: int, run_dir: str, compile_: bool):
    """Train a fresh model of `shape` for at most `seconds` (the schedule planned for `steps`);
    returns (model, summary, tokens a second)."""
    import shutil

    import torch

    from leapdecode.train.loop import TrainConfig
    from leapdecode.train.loop import train as run_loop

    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: never resume an earlier one
    torch.manual_seed(0)
    model = llama(shape, args.vocab, args.context, args.eos)
    cuda = args.device.startswith("cuda")
    cfg = TrainConfig(steps=steps, batch=args.batch, context=args.context, lr=args.lr,
                      warmup=max(1, steps * 6 // 100), eval_every=max(1, steps // 4),
                      eval_batches=4, checkpoint_every=10**9, bf16=cuda or args.bf16,
                      compile=compile_, device=args.device, fused_adamw=cuda,
                      max_seconds=seconds, threads=0 if cuda else 2)  # fmt: skip
    t0 = time.perf_counter()
    summary = run_loop(model, train, val, cfg, run_dir, f"{shape}")
    tokens = summary["tokens_seen"]
    return model, summary, tokens / max(summary["train_seconds"], 1e-9), time.perf_counter() - t0


def n_params(shape, vocab: int) -> int:
    hidden, layers, heads, kv, inter = shape
    d = hidden // heads
    per = hidden * (heads + 2 * kv) * d + heads * d * hidden + 3 * hidden * inter + 2 * hidden
    return layers * per + vocab * hidden + hidden


def copy_signals(model, held: np.ndarray, device: str, span: int, n: int) -> dict:
    """A held-out span shown twice: the loss on each showing, and the share of the second
    that greedy decoding reproduces before its first miss (the copy score)."""
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(1)
    first = second = 0.0
    copied = []
    model.eval()
    with torch.no_grad():
        for _ in range(n):
            s = int(rng.integers(0, len(held) - span))
            ids = torch.from_numpy(held[s : s + span].astype(np.int64))
            x = torch.cat([ids, ids])[None].to(device)
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16,
                                enabled=device.startswith("cuda")):  # fmt: skip
                logits = model(input_ids=x).logits[0].float()
            nll = F.cross_entropy(logits[:-1], x[0, 1:], reduction="none")
            first += float(nll[: span - 1].mean())
            second += float(nll[span:].mean())
            pred = logits[span - 1 : 2 * span - 1].argmax(-1)
            miss = (pred != x[0, span:]).nonzero()
            copied.append((len(ids) if len(miss) == 0 else int(miss[0])) / len(ids))
    model.train()
    return {"first_showing_loss": first / n, "second_showing_loss": second / n,
            "copy_score": float(np.mean(copied))}  # fmt: skip


def cmd_run(args) -> int:
    import torch

    from leapdecode.train.loop import TrainConfig, eval_loss

    t_start = time.perf_counter()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    budget = args.minutes * 60
    os.makedirs(args.out, exist_ok=True)
    work = args.work
    train, val, held, meta = load_stream(args.data, work)
    # the tokenizer's vocabulary and end-of-text id, as pack recorded them (else v1's)
    args.vocab = args.vocab or meta.get("vocab_size") or _v1_config().get("vocab_size", 8192)
    args.eos = meta.get("eos_token_id", _v1_config().get("eos_token_id", 0))
    print(f"{len(train) / 1e6:.1f}M training tokens on {args.device} "
          f"({time.perf_counter() - t_start:.1f} s to unpack)", flush=True)  # fmt: skip
    limit = 0.9 * (OUT_FILES - 4) * OUT_FILE_MIB * 2**20 / 2  # parameters in 4 bfloat16 shards
    candidates = TINY if args.tiny else CANDIDATES
    candidates = [c for c in candidates if n_params(c, args.vocab) <= limit]
    sweep = []
    for shape in candidates:  # the sweep: each candidate's tokens/s, eager, a few seconds
        _, summary, tok_s, wall = train_for(shape, args, train, val, args.sweep_seconds,
                                            10**6, os.path.join(work, f"sweep-{shape[0]}-{shape[1]}"),
                                            False)  # fmt: skip
        sweep.append({"shape": shape, "params": n_params(shape, args.vocab), "tokens_s": tok_s,
                      "loss": summary["final_train_loss"], "wall_s": wall})  # fmt: skip
        print(f"sweep {shape}: {sweep[-1]['params'] / 1e6:.1f}M parameters, {tok_s:,.0f} tokens/s, "
              f"loss {summary['final_train_loss']:.3f}", flush=True)  # fmt: skip
    left = budget - (time.perf_counter() - t_start) - args.eval_seconds
    if left <= 0:
        raise SystemExit(f"--minutes {args.minutes} leaves no time to train after the sweep")
    compiling = 60.0 if args.compile else 0.0  # the first steps' compile, inside the time left
    # the largest candidate that sees --tokens-per-param tokens a parameter in the time left
    fits = [s for s in sweep if s["tokens_s"] * left >= args.tokens_per_param * s["params"]]
    pick = max(fits, key=lambda s: s["params"]) if fits else max(sweep, key=lambda s: s["tokens_s"])
    steps = max(
        1, int(pick["tokens_s"] * max(left - compiling, left / 2) / (args.batch * args.context))
    )
    print(f"training {pick['shape']} ({pick['params'] / 1e6:.1f}M) for {left:.0f} s, "
          f"about {steps} steps", flush=True)  # fmt: skip
    t_final = time.perf_counter()
    try:
        model, summary, tok_s, _ = train_for(pick["shape"], args, train, val, left, steps,
                                             os.path.join(work, "final"), args.compile)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a compiler missing there must not cost the run
        if not args.compile:
            raise
        left -= time.perf_counter() - t_final
        print(f"compiled training failed ({type(e).__name__}: {e}); eager for the {left:.0f} s "
              "left", flush=True)  # fmt: skip
        model, summary, tok_s, _ = train_for(pick["shape"], args, train, val, left,
                                             int(pick["tokens_s"] * left / (args.batch * args.context)) or 1,
                                             os.path.join(work, "final"), False)  # fmt: skip
    cfg = TrainConfig(context=args.context, eval_batches=16, bf16=args.device.startswith("cuda"),
                      device=args.device)  # fmt: skip
    losses = {s: eval_loss(model, a, cfg) if len(a) > 2 * args.context else None
              for s, a in (("validation", val), ("heldout", held))}  # fmt: skip
    bpt = meta.get("sample_bytes_per_token") or meta.get("bytes_per_token") or {}
    bpb = {s: losses[s] / math.log(2) / bpt[s] if losses[s] and bpt.get(s) else None
           for s in losses}  # fmt: skip
    span = min(128, args.context // 2)
    copy = copy_signals(model, held, args.device, span, args.copy_spans) if len(held) > span else {}
    # the output: shards, index, config, log and summary (at most 8 files of 16 MiB)
    for name in os.listdir(args.out):
        if name.endswith((".safetensors", ".json", ".jsonl")):
            os.remove(os.path.join(args.out, name))
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True,
                                             max_shard_size=OUT_FILE_MIB * 2**20)  # fmt: skip
    gen = os.path.join(args.out, "generation_config.json")
    if os.path.isfile(gen):
        os.remove(gen)  # rebuilt here from config.json: one file fewer to bring back
    log = os.path.join(work, "final", "log.jsonl")
    if os.path.isfile(log):
        with open(log) as src, open(os.path.join(args.out, "log.jsonl"), "w") as dst:
            dst.write(src.read())
    out = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "shape": dict(
            zip(
                ("hidden", "layers", "heads", "kv_heads", "intermediate"),
                pick["shape"],
                strict=True,
            )
        ),  # fmt: skip
        "parameters": pick["params"],
        "sweep": sweep,
        "steps": summary["steps"],
        "tokens_seen": summary["tokens_seen"],
        "train_seconds": summary["train_seconds"],
        "tokens_s": tok_s,
        "epochs": summary["tokens_seen"] / max(len(train), 1),
        "loss": losses,
        "bits_per_byte": bpb,
        "copy": copy,
        "wall_s": time.perf_counter() - t_start,
        "data": {
            k: meta.get(k)
            for k in ("train_tokens", "corpus_train_tokens", "compressed_mib", "heldout_packages")
        },  # fmt: skip
        "args": vars(args),
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(out, f, indent=1)
    files = sorted(os.listdir(args.out))
    big = [n for n in files if os.path.getsize(os.path.join(args.out, n)) > OUT_FILE_MIB * 2**20]
    print(json.dumps({k: out[k] for k in ("shape", "parameters", "steps", "tokens_seen", "loss",
                                           "bits_per_byte", "copy", "wall_s")}, indent=1))  # fmt: skip
    if len(files) > OUT_FILES or big:
        print(f"WARNING: {len(files)} files, over {OUT_FILE_MIB} MiB: {big}: not all come back")
        return 1
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="(here) the corpus's tokens into .gpu/ for the device")
    p.add_argument("--corpus", required=True, help="a folder from `leapdecode train corpus`")
    p.add_argument("--out", default=os.path.join(ROOT, ".gpu"))
    p.add_argument("--budget-mib", type=float, default=0.0,
                   help="compressed MiB at most (default: 64 less the tracked files, less 2)")  # fmt: skip
    p.add_argument("--chunk", type=int, default=CHUNK)
    p.add_argument("--sample", type=int, default=SAMPLE)
    r = sub.add_parser("run", help="(on the GPU) sweep, train, evaluate, write the shards")
    r.add_argument("--data", default=os.path.join(ROOT, ".gpu"))
    r.add_argument("--out", required=True)
    r.add_argument("--work", default="/tmp/leapdecode-gpu-train")
    r.add_argument("--minutes", type=float, default=8.0, help="the whole run, sweep included")
    r.add_argument("--device", default="auto")
    r.add_argument("--context", type=int, default=1024)
    r.add_argument("--batch", type=int, default=64)
    r.add_argument("--lr", type=float, default=2e-3)
    r.add_argument("--vocab", type=int, default=0,
                   help="the tokenizer's size (default: what pack recorded)")  # fmt: skip
    r.add_argument("--sweep-seconds", type=float, default=15.0)
    r.add_argument("--tokens-per-param", type=float, default=10.0)
    r.add_argument("--eval-seconds", type=float, default=30.0)
    r.add_argument("--copy-spans", type=int, default=32)
    r.add_argument("--bf16", action="store_true", help="bf16 autocast on CPU too")
    r.add_argument("--no-compile", dest="compile", action="store_false")
    r.add_argument("--tiny", action="store_true", help="toy sizes (the CPU rehearsal)")
    args = ap.parse_args()
    return cmd_pack(args) if args.cmd == "pack" else cmd_run(args)


if __name__ == "__main__":
    raise SystemExit(main())
