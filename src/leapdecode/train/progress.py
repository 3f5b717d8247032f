"""`leapdecode train progress --run-dir DIR [--run-dir DIR2 ...] --out docs/training`.

Reads the runs' `log.jsonl` (a later run, trained from the earlier one's model with --init,
continues its tokens axis) and plots, against tokens seen: validation loss, the loss on the
first and on the second showing of a repeated held-out span, the copy score and the share
of revision prompts reproduced exactly (teacher-forced; see signals.py). Writes
`copy_signals.png` and `copy_signals.md` (one row per validation).
"""

from __future__ import annotations

import json
import os

from ..errors import LeapDecodeError


def read_log(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "log.jsonl")
    if not os.path.isfile(path):
        raise LeapDecodeError(f"{path!r} not found: pass the --run-dir of a training run")
    entries = {}
    for line in open(path):
        if line.strip():
            e = json.loads(line)
            entries[e["step"]] = e  # a resumed run may repeat steps: keep the latest
    return [entries[k] for k in sorted(entries)]


def read_runs(run_dirs: list[str]) -> list[dict]:
    """Validations with copy signals of the runs in order, each tagged with its run index,
    tokens_seen counted from the first run's start."""
    out, offset = [], 0
    for i, run_dir in enumerate(run_dirs):
        log = read_log(run_dir)
        out += [
            {**e, "run": i, "tokens_seen": e["tokens_seen"] + offset}
            for e in log
            if "val_loss" in e and "copy" in e
        ]
        offset += max((e["tokens_seen"] for e in log), default=0)
    return out


def write(run_dirs: list[str], out_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = read_runs(run_dirs)
    if not evals:
        raise LeapDecodeError("the run has no validation with copy signals yet")
    os.makedirs(out_dir, exist_ok=True)
    tok = [e["tokens_seen"] / 1e6 for e in evals]
    c = [e["copy"] for e in evals]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(tok, [e["val_loss"] for e in evals], label="validation loss")
    ax1.plot(tok, [x["first_showing_loss"] for x in c], label="span, first showing")
    ax1.plot(tok, [x["second_showing_loss"] for x in c], label="span, second showing")
    ax1.set_xlabel("tokens seen (M)")
    ax1.set_ylabel("nats / token")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.plot(tok, [x["copy_score"] for x in c], label="copy score (function asked for again)")
    ax2.plot(tok, [x["revision_exact"] for x in c], label="revision prompts exact")
    ax2.set_ylim(0, 1)
    ax2.set_xlabel("tokens seen (M)")
    ax2.legend()
    ax2.grid(alpha=0.3)
    for ax in (ax1, ax2):
        for e0, e1 in zip(evals, evals[1:], strict=False):
            if e1["run"] != e0["run"]:
                ax.axvline(e1["tokens_seen"] / 1e6, color="black", lw=0.8, ls="--")
            elif e1.get("context") != e0.get("context"):
                ax.axvline(e1["tokens_seen"] / 1e6, color="grey", lw=0.8, ls=":")
    fig.suptitle(
        "Target training: copying emerges (dotted: context / batch stage changes; "
        "dashed: the next run, from the last one's model)",
        fontsize=10,
    )
    fig.tight_layout()
    png = os.path.join(out_dir, "copy_signals.png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    lines = [
        "# Target training: loss and copy signals against tokens seen",
        "",
        "Teacher-forced on held-out text (`src/leapdecode/train/signals.py`). Runs, in "
        "order: "
        + ", ".join(
            f"{i} `{os.path.basename(os.path.normpath(d))}`" for i, d in enumerate(run_dirs)
        )
        + ".",
        "",
        "| run | step | tokens seen | context x batch | val loss | span 1st | span 2nd "
        "| copy score | revision exact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e, x in zip(evals, c, strict=True):
        lines.append(
            f"| {e['run']} | {e['step']} | {e['tokens_seen'] / 1e6:.2f} M | {e.get('context')} x "
            f"{e.get('batch')} | {e['val_loss']:.3f} | {x['first_showing_loss']:.2f} "
            f"| {x['second_showing_loss']:.2f} | {x['copy_score']:.3f} "
            f"| {x['revision_exact']:.2f} |"
        )
    lines += ["", "![copy signals](copy_signals.png)", ""]
    with open(os.path.join(out_dir, "copy_signals.md"), "w") as f:
        f.write("\n".join(lines))
    return png
