"""What a parallel draft (PARD) could buy on the embedded pair, predicted before training one.

A chain draft of k tokens costs k draft forwards; a parallel draft costs one forward over the
unseen tokens and k - 1 mask tokens. Everything else in the step is the same: the target's
verify forward over k + 1 tokens, the acceptance rule, the engine's bookkeeping. So, with
S(1) the engine's own chain step at k = 1 (measured: it holds every cost of drafting at all),

    chain(k) = S(1) + T(k+1) - T(2) + (k-1) F        pard(k) = S(1) + T(k+1) - T(2) + D(c+k-1) - D(c)
    tokens a step = 1 + p_1 + ... + p_k               (p_i: draft i accepted, absolute)

T(n) the target's compiled forward over n tokens, D(n) the draft's forward over n tokens,
F a chain's extra draft forward (fitted from the engine's k = 1 and 2 steps), c the tokens
the draft has not seen (the bonus token, and the last draft when all were accepted). A
parallel draft trained from the same draft does not beat the chain draft's acceptance at any
position (it sees masks where the chain sees its own guesses), so the chain's p_i give an
upper bound on what `pard` reaches with this draft; "needed" is the tokens a step at which
pard(k) ties `none`.

Measured: p_i from the engine running `draft` k=KMAX over the bench prompts; O, T, D by
interleaved microtimings (median of --reps). Writes docs/pard_predict.{md,json,png}.

    python bench/pard_predict.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KMAX = 8


def engine_figures(dec, prompts, max_new: int, method: str = "draft", tag: str = "") -> dict:
    """ms a token under `none`, acceptance by position and ms a token under `method` at k."""
    from tqdm import tqdm

    out = {}
    configs = [("none", 0)] + [(method, k) for k in (1, 2, 3, 4, KMAX)]
    for method, k in tqdm(configs, desc=f"engine runs{tag}", unit="config"):
        decode_s, tokens, steps = 0.0, 0, 0
        acc = [0] * KMAX
        for ids in prompts:
            r = dec.generate(ids, method=method, k=k, max_new_tokens=max_new, temperature=0.0)
            decode_s += r.stats.decode_s
            tokens += r.stats.new_tokens - 1  # the prefill's token is not a decode step's
            steps += r.stats.decode_steps
            for i, a in enumerate(r.stats.accepted_by_position):
                acc[i] += a
        out[f"{method}{k or ''}"] = {
            "ms_per_token": 1e3 * decode_s / tokens,
            "tokens_per_step": tokens / steps,
            "p": [a / steps for a in acc[: max(k, 1)]] if k else [],
        }
    return out


def timings(target, draft, context: int, reps: int) -> dict:
    """Median ms of the target's compiled forward over n tokens, and the draft's eager one,
    each timed right after a forward of the other model (as the engine alternates them, so
    that every call meets the caches the engine leaves it)."""
    vocab = target.vocab_size
    slot = torch.tensor([0])
    counts = {n: torch.tensor([n]) for n in range(1, KMAX + 3)}

    def call(model, n):
        model.cache.lens[:1] = context
        kw = {"counts": counts[n]} if model is target and target.packs_rows else {}
        model.forward(torch.randint(1, vocab, (1, n)), slot, **kw)

    calls = {f"T{n}": (target, draft, n) for n in range(1, KMAX + 2)}
    calls |= {f"D{n}": (draft, target, n) for n in range(1, KMAX + 3)}
    times = {k: [] for k in calls}
    for model, other, n in calls.values():
        call(other, 2), call(model, n)
    for _ in range(reps):
        for key, (model, other, n) in calls.items():
            call(other, 2)
            t0 = time.perf_counter()
            call(model, n)
            times[key].append(time.perf_counter() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def predict(eng: dict, ms: dict) -> list[dict]:
    """Predicted x none of chain and pard at k = 1..KMAX, calibrated on the engine's own
    chain step at k = 1 (it holds every cost of drafting at all: planning, the draft's
    bookkeeping, the acceptance rule on drafts), plus what k adds: the target's extra rows,
    and per extra draft token a chain forward F (fitted from the engine's k = 1 and 2 steps)
    or a pard forward's extra rows."""
    none = eng["none"]["ms_per_token"]
    p = eng[f"draft{KMAX}"]["p"]

    def step(k):
        return eng[f"draft{k}"]["ms_per_token"] * eng[f"draft{k}"]["tokens_per_step"]

    forward = step(2) - step(1) - (ms["T3"] - ms["T2"])  # a chain's extra draft forward
    rows = []
    for k in range(1, KMAX + 1):
        tokens = 1 + sum(p[:k])
        c = 2 if p[k - 1] > 0 else 1  # bonus token, + the last draft when all were accepted
        target = ms[f"T{k + 1}"] - ms["T2"]
        chain = step(1) + target + (k - 1) * forward
        pard = step(1) + target + ms[f"D{c + k - 1}"] - ms[f"D{c}"]
        rows.append({"k": k, "tokens_per_step": tokens, "chain_step_ms": chain,
                     "pard_step_ms": pard, "chain_x_none": none * tokens / chain,
                     "pard_x_none": none * tokens / pard, "chain_forward_ms": forward,
                     "pard_needed_tokens": pard / none})  # fmt: skip
    return rows


def embedded_pair(threads: int):
    """The embedded pair as `--compile` runs it, one sequence at a time, and the bench's
    completion and revision prompts."""
    from leapdecode.api import LeapDecoder
    from leapdecode.bench import workloads
    from leapdecode.paths import DRAFT_NAME, TARGET_NAME, default_model

    dec = LeapDecoder.from_pretrained(
        default_model(TARGET_NAME), draft=default_model(DRAFT_NAME), threads=threads,
        compile=True, max_num_seqs=1,
    )  # fmt: skip
    prompts = os.path.join(ROOT, "bench", "prompts")
    return dec, workloads.load(prompts, ("completion", "revision"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=10, help="per category")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "pard_predict"))
    ap.add_argument("--pard", default=os.path.join(ROOT, "models", "leap-code-draft-pard"),
                    help="a trained parallel draft to measure beside the prediction (skipped "
                    "where absent)")  # fmt: skip
    args = ap.parse_args()
    dec, sets = embedded_pair(args.threads)
    pard = None
    if os.path.isfile(os.path.join(args.pard, "config.json")):
        from leapdecode.api import LeapDecoder
        from leapdecode.paths import TARGET_NAME, default_model

        pard = LeapDecoder.from_pretrained(default_model(TARGET_NAME), draft=args.pard,
                                           threads=args.threads, compile=True, max_num_seqs=1)  # fmt: skip
    result = {"threads": args.threads, "torch": torch.__version__, "categories": {},
              "pard": os.path.relpath(args.pard, ROOT) if pard else None}  # fmt: skip
    for cat, rows in sets.items():
        prompts = [dec.encode(r["prompt"]) for r in rows[: args.prompts]]
        eng = engine_figures(dec, prompts, args.max_new_tokens)
        if pard is not None:
            measured = engine_figures(pard, prompts, args.max_new_tokens, "pard", " (pard)")
            result["categories"].setdefault(cat, {})["pard_measured"] = measured
        context = int(statistics.median(len(x) for x in prompts)) + args.max_new_tokens // 2
        dec.engine.allocate()
        ms = timings(dec.engine.target, dec.engine.draft, context, args.reps)
        dec.engine.allocate()
        result["categories"].setdefault(cat, {}).update(
            engine=eng, ms=ms, context=context, predicted=predict(eng, ms)
        )
    write(result, args)
    return 0


def _measured(pm: dict | None, k: int, best_chain: float) -> str:
    """The trained parallel draft's cell at k ("–" where not run)."""
    if not pm or f"pard{k}" not in pm:
        return "–"
    x = pm["none"]["ms_per_token"] / pm[f"pard{k}"]["ms_per_token"]
    return f"{pm[f'pard{k}']['tokens_per_step']:.2f}, {x:.2f}, {x / best_chain:.2f}"


def write(result: dict, args) -> None:
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [
        "# A parallel draft on the embedded pair: the speedup predicted before training one, "
        "and the trained one measured",
        "",
        f"`python bench/pard_predict.py --threads {args.threads}`: torch {result['torch']}, "
        f"{args.threads} thread(s), the target compiled, the draft eager (as `--compile` runs "
        f"them); {args.prompts} bench prompts a category, {args.max_new_tokens} new tokens, "
        "greedy. The model of a step is in the script's docstring; pard's acceptance is bounded "
        "by the chain draft's (same draft, masks in place of its own guesses), so its column "
        "is an upper bound.",
        "",
    ]
    for cat, c in result["categories"].items():
        eng, ms = c["engine"], c["ms"]
        p = " ".join(f"{x:.2f}" for x in eng[f"draft{KMAX}"]["p"])
        lines += [
            f"## {cat}",
            "",
            f"Measured: `none` {eng['none']['ms_per_token']:.2f} ms a token; chain step at k=1 "
            f"{c['predicted'][0]['chain_step_ms']:.2f} ms, an extra chain draft forward F "
            f"{c['predicted'][0]['chain_forward_ms']:.2f} ms; draft acceptance "
            f"by position (k={KMAX}, absolute) {p}; target forward T(n) "
            + ", ".join(f"{n}: {ms[f'T{n}']:.2f}" for n in (1, 2, 3, 5, 9))
            + " ms; draft forward D(n) "
            + ", ".join(f"{n}: {ms[f'D{n}']:.2f}" for n in (1, 2, 3, 5, 9))
            + f" ms (context {c['context']} tokens).",
            "",
            "| k | tokens a step | chain measured x none | chain predicted x none | "
            "pard predicted x none (upper bound) | pard / best chain measured | "
            "tokens a step pard needs to tie none | pard measured: tokens a step, x none, "
            "/ best chain |",
            "|---|---|---|---|---|---|---|---|",
        ]
        pm = c.get("pard_measured")
        best_chain = max(
            eng[f"draft{k}"]["tokens_per_step"] and
            eng["none"]["ms_per_token"] / eng[f"draft{k}"]["ms_per_token"]
            for k in (1, 2, 3, 4, KMAX)
        )  # fmt: skip
        for r in c["predicted"]:
            measured = eng.get(f"draft{r['k']}")
            m = f"{eng['none']['ms_per_token'] / measured['ms_per_token']:.2f}" if measured else "–"
            lines.append(
                f"| {r['k']} | {r['tokens_per_step']:.2f} | {m} | {r['chain_x_none']:.2f} | "
                f"{r['pard_x_none']:.2f} | {r['pard_x_none'] / best_chain:.2f} | "
                f"{r['pard_needed_tokens']:.2f} | {_measured(pm, r['k'], best_chain)} |"
            )
        if pm:
            p = " ".join(f"{x:.2f}" for x in pm[f"pard{KMAX}"]["p"])
            lines += ["", f"The trained parallel draft ({result['pard']}): acceptance by "
                      f"position (k={KMAX}, absolute) {p}."]  # fmt: skip
        lines.append("")
    lines += ["![predicted](pard_predict.png)", ""]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result["categories"]), figsize=(10, 4), squeeze=False)
    for ax, (cat, c) in zip(axes[0], result["categories"].items(), strict=True):
        ks = [r["k"] for r in c["predicted"]]
        ax.plot(ks, [r["chain_x_none"] for r in c["predicted"]], "o-", label="chain (predicted)")
        ax.plot(ks, [r["pard_x_none"] for r in c["predicted"]], "s-", label="pard (upper bound)")
        pm = c.get("pard_measured")
        if pm:
            got = [(k, pm["none"]["ms_per_token"] / pm[f"pard{k}"]["ms_per_token"])
                   for k in ks if f"pard{k}" in pm]  # fmt: skip
            ax.plot(*zip(*got, strict=True), "D", label="pard (trained, measured)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(cat)
        ax.set_xlabel("k")
        ax.set_ylabel("x none")
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
