"""`leapdecode train sizing`: pick the target's shape by measurement, not by habit.

Each candidate shape trains for the same wall time on the same batches; its validation loss
is fitted against training time (L = a + b * t^-c, least squares over the later half of the
run) and extrapolated to the main run's budget. Beside it, the decode step of each trained
candidate and of 1-layer drafts is measured in one interleaved run, since on a small CPU a
decode step costs per layer more than per parameter: a candidate qualifies only if a 1-layer
draft costs at most 1/8 of it. Writes `sizing.md`, `sizing.json` and `sizing.png`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import numpy as np

from ..errors import LeapDecodeError

DRAFT_WIDTHS = (128, 192, 256)
MAX_COST = 1 / 8


def parse_candidates(text: str) -> list[dict]:
    """'192x12,256x8' -> shapes with head_dim 64 (32 where 64 does not divide) and MLP 8/3 d."""
    out = []
    for part in text.split(","):
        try:
            hidden, layers = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise LeapDecodeError(f"--candidates entry {part!r} is not HIDDENxLAYERS") from None
        if hidden < 32 or layers < 1 or hidden % 32:
            raise LeapDecodeError(f"--candidates entry {part!r}: hidden must be a multiple of 32")
        heads = hidden // 64 if hidden % 64 == 0 else hidden // 32
        inter = int(round(hidden * 8 / 3 / 16)) * 16
        out.append(
            {
                "name": f"{hidden}x{layers}",
                "hidden": hidden,
                "layers": layers,
                "heads": heads,
                "kv_heads": heads,
                "intermediate": inter,
            }
        )
    return out


MIN_LOSS = 1.0  # nats/token: no small model gets below this on code; keeps fits physical
EXPONENTS = np.linspace(0.2, 1.2, 51)


def _fit_ab(t: np.ndarray, loss: np.ndarray, c: float) -> tuple[float, float, float]:
    """a, b of L = a + b t^-c by least squares (a >= MIN_LOSS), and the squared error."""
    x = np.stack([np.ones_like(t), t**-c], 1)
    coef, *_ = np.linalg.lstsq(x, loss, rcond=None)
    if coef[0] < MIN_LOSS:  # refit b with a pinned at the floor
        coef = np.array([MIN_LOSS, float(((loss - MIN_LOSS) @ t**-c) / (t**-c @ t**-c))])
    return float(coef[0]), float(coef[1]), float(((x @ coef - loss) ** 2).sum())


def fit_curves(
    curves: list[tuple[np.ndarray, np.ndarray]],
) -> tuple[float, list[tuple[float, float]]]:
    """L_i = a_i + b_i t^-c with one exponent c shared by every candidate.

    A short run cannot tell a floor from a slope on its own (a free exponent per curve
    extrapolates some to impossible losses); learning curves of one model family on one
    data stream share their shape, so the exponent is fitted jointly and each candidate
    keeps its own offset and scale."""
    best = None
    for c in EXPONENTS:
        fits = [_fit_ab(t, y, c) for t, y in curves]
        err = sum(f[2] for f in fits)
        if best is None or err < best[0]:
            best = (err, float(c), [(a, b) for a, b, _ in fits])
    return best[1], best[2]


def _draft_models(run_dir: str, vocab: int) -> dict[str, str]:
    """Random 1-layer drafts of a few widths (cost only depends on the shape)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    paths = {}
    for d in DRAFT_WIDTHS:
        path = os.path.join(run_dir, f"draft1x{d}")
        if not os.path.isfile(os.path.join(path, "config.json")):
            heads = d // 64
            cfg = LlamaConfig(
                vocab_size=vocab,
                hidden_size=d,
                num_hidden_layers=1,
                num_attention_heads=heads,
                num_key_value_heads=heads,
                intermediate_size=int(round(d * 8 / 3 / 16)) * 16,
                max_position_embeddings=1024,
                tie_word_embeddings=True,
            )
            LlamaForCausalLM(cfg).save_pretrained(path)
        paths[f"draft 1x{d}"] = path
    return paths


def run(args) -> int:
    from .evaluate import interleaved_decode_ms
    from .fit import fit, load_tokenizer

    cands = parse_candidates(args.candidates)
    if args.minutes <= 0 or args.budget_hours <= 0:
        raise LeapDecodeError("--minutes and --budget-hours must be > 0")
    tokenizer = load_tokenizer(args.tokenizer)
    results = []
    for c in cands:
        sub = copy.copy(args)
        for key in ("hidden", "layers", "heads", "kv_heads", "intermediate"):
            setattr(sub, key, c[key])
        sub.run_dir = os.path.join(args.run_dir, c["name"])
        sub.out = os.path.join(sub.run_dir, "model")
        sub.max_minutes = args.minutes
        sub.init = sub.tokens = None
        if not os.path.isfile(os.path.join(sub.out, "config.json")):
            fit(sub, tokenizer, "target", save_partial=True)
        log = [json.loads(x) for x in open(os.path.join(sub.run_dir, "log.jsonl"))]
        results.append({**c, "log": [e for e in log if "val_loss" in e]})
    models = {r["name"]: os.path.join(args.run_dir, r["name"], "model") for r in results}
    drafts = _draft_models(args.run_dir, len(tokenizer))
    ms = interleaved_decode_ms({**models, **drafts}, draft_names=set(drafts))
    budget_s = args.budget_hours * 3600
    cheapest_draft = min(ms[n] for n in drafts)
    curves = []
    for r in results:
        t = np.array([e["train_s"] for e in r["log"]])
        y = np.array([e["val_loss"] for e in r["log"]])
        late = t >= t[-1] * 0.3
        curves.append((t[late], y[late]))
    c, ab = fit_curves(curves)
    for r, (a, b) in zip(results, ab, strict=True):
        t = np.array([e["train_s"] for e in r["log"]])
        y = np.array([e["val_loss"] for e in r["log"]])
        r["fit"] = {"a": a, "b": b, "c": c}
        r["final_val_loss"] = float(y[-1])
        r["tokens_seen"] = r["log"][-1]["tokens_seen"]
        r["tokens_per_s"] = r["tokens_seen"] / max(1e-9, t[-1])
        r["extrapolated_loss"] = a + b * budget_s**-c
        r["decode_ms"] = ms[r["name"]]
        r["draft_cost"] = cheapest_draft / ms[r["name"]]
        r["qualifies"] = r["draft_cost"] <= MAX_COST
        r["copy"] = r["log"][-1].get("copy", {})
        summary = json.load(open(os.path.join(models[r["name"]], "training_summary.json")))
        r["params"] = summary["parameters"]
    eligible = [r for r in results if r["qualifies"]] or results
    pick = min(eligible, key=lambda r: r["extrapolated_loss"])
    os.makedirs(args.report, exist_ok=True)
    report = {
        "minutes_each": args.minutes,
        "budget_hours": args.budget_hours,
        "decode_ms": ms,
        "pick": pick["name"],
        "candidates": results,
        "schedule": args.schedule,
        "repeat_share": args.repeat_share,
        "edit_share": args.edit_share,
        "lr": args.lr,
    }
    with open(os.path.join(args.report, "sizing.json"), "w") as f:
        json.dump(report, f, indent=1)
    _write_table(report, drafts, os.path.join(args.report, "sizing.md"))
    _plot(report, os.path.join(args.report, "sizing.png"))
    print(open(os.path.join(args.report, "sizing.md")).read())
    return 0


def _write_table(report: dict, drafts: dict, path: str) -> None:
    lines = [
        "# Target sizing",
        "",
        f"Each candidate trained for {report['minutes_each']:g} minutes of training time on the "
        f"same batches (schedule `{report['schedule']}`, repeat share {report['repeat_share']}, "
        f"revision share {report['edit_share']}, peak lr {report['lr']}), float32 on the "
        "2-core CPU. Validation loss is fitted as L = a + b t^-c (one exponent c for all "
        "candidates, a >= 1) over the later 70% of each run and extrapolated to the main "
        f"budget of {report['budget_hours']:g} h. Decode: "
        "native backend, bf16 weights for the targets and float32 for the 1-layer drafts "
        "(2048-token head), one token after 256 cached, median of one interleaved run.",
        "",
        "| candidate | params | tokens/s (train) | tokens seen | val loss | fit a, b, c "
        f"| extrapolated at {report['budget_hours']:g} h | decode ms | cheapest 1-layer draft / "
        "target | qualifies (<= 1/8) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["candidates"]:
        f = r["fit"]
        pick = " **(pick)**" if r["name"] == report["pick"] else ""
        lines.append(
            f"| {r['name']}{pick} | {r.get('params', 0) / 1e6:.2f} M | {r['tokens_per_s']:.0f} "
            f"| {r['tokens_seen'] / 1e6:.2f} M | {r['final_val_loss']:.3f} "
            f"| {f['a']:.2f}, {f['b']:.2f}, {f['c']:.2f} | {r['extrapolated_loss']:.3f} "
            f"| {r['decode_ms']:.2f} | {r['draft_cost']:.3f} | {'yes' if r['qualifies'] else 'no'} |"
        )
    lines += [
        "",
        "Drafts: " + ", ".join(f"{n} {report['decode_ms'][n]:.2f} ms" for n in drafts),
        "",
        "![loss against training time](sizing.png)",
        "",
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    budget = report["budget_hours"] * 3600
    for r in report["candidates"]:
        t = np.array([e["train_s"] for e in r["log"]])
        y = np.array([e["val_loss"] for e in r["log"]])
        (line,) = ax.plot(t / 60, y, "o-", ms=3, label=f"{r['name']} ({r['decode_ms']:.1f} ms)")
        tt = np.geomspace(max(t[0], 1), budget, 60)
        f = r["fit"]
        ax.plot(tt / 60, f["a"] + f["b"] * tt ** -f["c"], "--", color=line.get_color(), lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("training time (minutes, log scale); dashed: fit, extrapolated to the budget")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("Target candidates: validation loss against wall time")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_parser(what, data_args, loop_args) -> None:
    sz = what.add_parser("sizing", help="train candidate target shapes briefly and pick one")
    data_args(sz)
    sz.add_argument("--tokenizer", required=True)
    sz.add_argument(
        "--candidates",
        default="192x12,256x12,160x16,256x8",
        help="HIDDENxLAYERS,... (head dim 64, MLP 8/3 x hidden)",
    )
    sz.add_argument("--minutes", type=float, default=8.0, help="training time per candidate")
    sz.add_argument(
        "--budget-hours",
        type=float,
        default=4.0,
        help="main run's training time, for the extrapolation",
    )
    sz.add_argument("--run-dir", required=True, help="one checkpoint folder per candidate here")
    sz.add_argument("--report", default="docs/sizing", help="where the table and plot go")
    sz.add_argument("--context", type=int, default=1024)
    sz.add_argument("--save-dtype", default="bfloat16")
    sz.add_argument("--repeat-share", type=float, default=0.0)
    sz.add_argument("--edit-share", type=float, default=0.0)
    sz.add_argument("--no-copy-probe", action="store_true")
    loop_args(sz, steps=100000, batch=8, lr=2e-3)
    sz.set_defaults(_namespace=argparse.Namespace)
