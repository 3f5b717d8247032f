"""Aggregate the records per (category, method): JSON, a markdown table and PNG plots.

A cell's tokens/s is its prompts' tokens over the sum of their median times (as Spec-Bench
reports throughput), so long prompts weigh more than short ones; speedups are ratios of
those totals, measured in the same run."""

from __future__ import annotations

import json
import os
from collections import defaultdict

from ..metrics import mean_accepted_tokens
from .runner import BASELINES, COUNTERPART, Record
from .vllm_peer import COUNTERPART as VLLM_COUNTERPART


def predicted_speedup(alpha: float, k: int, c: float) -> float:
    """Leviathan et al. 2023, Thm 3.8: expected walltime improvement with acceptance rate
    alpha, k drafts a step and draft/target cost ratio c."""
    if k == 0:
        return 1.0
    tokens = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + 1)


def aggregate(records: list[Record], costs: dict, mismatches: dict) -> list[dict]:
    groups: dict[tuple[str, str], list[Record]] = defaultdict(list)
    for r in records:
        groups[(r.category, r.method)].append(r)
    cells = []
    for (cat, label), rs in groups.items():
        tokens = sum(len(r.tokens) for r in rs)
        secs = sum(r.median_s for r in rs)
        steps = sum(r.decode_steps for r in rs)
        proposed, accepted = sum(r.proposed for r in rs), sum(r.accepted for r in rs)
        width = max((len(r.proposed_by_position) for r in rs), default=0)
        by_pos = []
        for i in range(width):
            p = sum(r.proposed_by_position[i] for r in rs if i < len(r.proposed_by_position))
            a = sum(r.accepted_by_position[i] for r in rs if i < len(r.accepted_by_position))
            by_pos.append(a / p if p else None)
        r0 = rs[0]
        ours = not r0.name.startswith(("hf-", "vllm", "llamacpp"))
        # llama.cpp's methods are told apart by precision too: "llamacpp-draft BF16"
        name = (
            f"{r0.name} {label.rsplit(' ', 1)[-1]}" if r0.name.startswith("llamacpp") else r0.name
        )
        alpha = accepted / proposed if proposed else None  # vLLM counts its drafts too
        c = costs.get("c") if r0.name == "draft" else 0.0
        decode = sum(r.propose_s + r.verify_s + r.accept_s for r in rs)
        cells.append(
            {
                "category": cat,
                "method": label,
                "name": name,
                "k": r0.k,
                "ours": ours,
                "prompts": len(rs),
                "new_tokens": tokens,
                "seconds": secs,
                "tokens_per_s": tokens / secs if secs else 0.0,
                "target_forwards": sum(r.target_forwards for r in rs),
                "target_forwards_per_token": sum(r.target_forwards for r in rs) / tokens
                if tokens
                else None,
                # tokens per target decode forward, the target's own token included
                "mean_accepted_tokens": (
                    mean_accepted_tokens(sum(r.accepted for r in rs), steps) if steps else None
                ),
                "acceptance_rate": alpha,
                "acceptance_by_position": by_pos if ours else None,
                "mean_proposed_per_step": proposed / steps if ours and steps else None,
                "draft_forwards": sum(r.draft_forwards for r in rs),
                "c": c if ours else None,
                "predicted_speedup": (  # Leviathan's formula holds for fixed-k chains only
                    predicted_speedup(alpha, r0.k, c)
                    if r0.name in ("draft", "ngram") and alpha is not None and c is not None
                    else (1.0 if r0.name == "none" else None)
                ),
                "ms_per_step": {
                    "proposer": 1e3 * sum(r.propose_s for r in rs) / steps,
                    "verify_forward": 1e3 * sum(r.verify_s for r in rs) / steps,
                    "accept": 1e3 * sum(r.accept_s for r in rs) / steps,
                }
                if ours and steps
                else None,
                "time_split": {
                    "proposer": sum(r.propose_s for r in rs) / decode,
                    "verify_forward": sum(r.verify_s for r in rs) / decode,
                    "accept": sum(r.accept_s for r in rs) / decode,
                    "other_s": secs - decode,  # prefill, tokenization, set-up (median run)
                }
                if ours and decode > 0
                else None,
                "mismatches": mismatches.get((cat, label), {"non_tie": 0, "tie": 0, "details": []}),
            }
        )
    by_key = {(c["category"], c["method"]): c for c in cells}
    for cell in cells:
        base = by_key.get((cell["category"], "none"))
        hf = by_key.get((cell["category"], "hf-generate"))
        vllm = by_key.get((cell["category"], "vllm"))
        cell["speedup_vs_vllm"] = cell["tokens_per_s"] / vllm["tokens_per_s"] if vllm else None
        cell["speedup_vs_none"] = cell["tokens_per_s"] / base["tokens_per_s"] if base else None
        cell["speedup_vs_hf_generate"] = cell["tokens_per_s"] / hf["tokens_per_s"] if hf else None
        pred = cell["predicted_speedup"]
        cell["efficiency"] = (
            cell["speedup_vs_none"] / pred
            if cell["ours"] and pred and cell["speedup_vs_none"]
            else None
        )
        if cell["ours"]:
            peer_label = None
            if cell["name"] in COUNTERPART:
                peer_label = COUNTERPART[cell["name"]] + (
                    "" if cell["name"] == "none" else f" k={cell['k']}"
                )
            peer = by_key.get((cell["category"], peer_label)) if peer_label else None
            cell["counterpart"] = peer_label if peer else None
            cell["speedup_vs_counterpart"] = (
                cell["tokens_per_s"] / peer["tokens_per_s"] if peer else None
            )
    return cells


def is_baseline(name: str) -> bool:
    """Plain decoding (no k): ours, transformers', vLLM's, llama.cpp's at a precision."""
    return name in BASELINES or name.split(" ")[0] == "llamacpp"


def llamacpp_rows(cells: list[dict]) -> list[dict]:
    """Per category, precision and method of ours with a llama.cpp counterpart (none, draft,
    ngram), and ours at its fastest overall: each side at its best k, ours / theirs."""
    from .llamacpp_peer import COUNTERPART as LLAMACPP_COUNTERPART

    out = []
    cats = list(dict.fromkeys(c["category"] for c in cells))
    precisions = sorted({c["name"].split(" ")[1] for c in cells if c["name"].startswith("llama")})
    for cat in cats:
        fastest = max((c for c in cells if c["category"] == cat and c["ours"]),
                      key=lambda c: c["tokens_per_s"], default=None)  # fmt: skip
        for p in precisions:
            theirs_best = max((c for c in cells if c["category"] == cat
                               and c["name"].endswith(" " + p)),
                              key=lambda c: c["tokens_per_s"], default=None)  # fmt: skip
            pairs = [(best(cells, cat, ours), best(cells, cat, f"{theirs} {p}"), False)
                     for ours, theirs in LLAMACPP_COUNTERPART.items()]  # fmt: skip
            pairs.append((fastest, theirs_best, True))
            for a, b, fastest_pair in pairs:
                if a and b:
                    out.append({"category": cat, "precision": p, "ours": a, "llamacpp": b,
                                "fastest": fastest_pair,
                                "ratio": a["tokens_per_s"] / b["tokens_per_s"]})  # fmt: skip
    return out


def llamacpp_markdown(cells: list[dict]) -> list[str]:
    rows = llamacpp_rows(cells)
    if not rows:
        return []
    lines = [
        "",
        "## Against llama.cpp (its counterpart of each method, best k each; last row of a "
        "precision: each side's fastest)",
        "",
        "tokens/s, request in to last token out, prefill included. BF16: a GGUF of the weights "
        "we run; GGUF: the catalogue's own quantized file (other weights, what llama.cpp users "
        "run).",
        "",
        "| category | precision | ours | tok/s | tok/fwd | llama.cpp | tok/s | tok/fwd "
        "| ours / llama.cpp |",
        "|---" * 9 + "|",
    ]
    for r in rows:
        a, b = r["ours"], r["llamacpp"]
        mark = "fastest: " if r["fastest"] else ""
        lines.append(
            f"| {r['category']} | {r['precision']} | {mark}{a['name']}{_setting(a)} "
            f"| {a['tokens_per_s']:.1f} | {_f(a['mean_accepted_tokens'])} | {b['method']} "
            f"| {b['tokens_per_s']:.1f} | {_f(b['mean_accepted_tokens'])} | "
            + (f"**{_f(r['ratio'])}** |" if r["fastest"] else f"{_f(r['ratio'])} |")
        )
    return lines


def vllm_rows(cells: list[dict]) -> list[dict]:
    """Per category and method of ours with a vLLM counterpart: each side at its best k,
    and ours / theirs (tokens/s)."""
    rows = []
    cats = list(dict.fromkeys(c["category"] for c in cells))
    for cat in cats:
        for ours, theirs in VLLM_COUNTERPART.items():
            a, b = best(cells, cat, ours), best(cells, cat, theirs)
            if a is None or b is None:
                continue
            rows.append(
                {
                    "category": cat,
                    "ours": a,
                    "vllm": b,
                    "ratio": a["tokens_per_s"] / b["tokens_per_s"] if b["tokens_per_s"] else None,
                }
            )
        for name in ("vllm-leap-suffix", "vllm-leap-ngram"):  # ours inside vLLM, beside vLLM's own
            a = best(cells, cat, name)
            b = best(cells, cat, "vllm-" + name.removeprefix("vllm-leap-"))
            if a is not None and b is not None:
                rows.append(
                    {
                        "category": cat,
                        "ours": a,
                        "vllm": b,
                        "ratio": a["tokens_per_s"] / b["tokens_per_s"]
                        if b["tokens_per_s"]
                        else None,
                    }
                )
    return rows


def _setting(c: dict) -> str:
    """A cell's setting: its label less the method's name (k=16, W3 N4 G3, ...)."""
    if is_baseline(c["name"]):
        return ""
    if c["name"].startswith("llamacpp"):  # "llamacpp-draft k=3 BF16" -> "k=3"
        return f" (k={c['k']})"
    return f" ({c['method'].removeprefix(c['name'] + ' ')})"


def vllm_markdown(cells: list[dict]) -> list[str]:
    rows = vllm_rows(cells)
    if not rows:
        return []
    lines = [
        "",
        "## Compared with vLLM (each at its best k)",
        "",
        "tokens/s, request in to last token out, prefill included; `vllm-leap-*` are "
        "leapdecode's proposers running inside vLLM (`leapdecode.integrations.vllm`), "
        "beside vLLM's own; tok/fwd = tokens per target decode forward.",
        "",
        "| category | ours | tok/s | tok/fwd | vLLM | tok/s | tok/fwd | ours / vLLM |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, b = r["ours"], r["vllm"]
        lines.append(
            f"| {r['category']} | {a['name']}{_setting(a)} | {a['tokens_per_s']:.0f} "
            f"| {_f(a['mean_accepted_tokens'])} | {b['name']}{_setting(b)} "
            f"| {b['tokens_per_s']:.0f} | {_f(b['mean_accepted_tokens'])} "
            f"| **{_f(r['ratio'])}** |"
        )
    return lines


def best(cells: list[dict], category: str, name: str) -> dict | None:
    """The fastest k of a method in a category."""
    cands = [c for c in cells if c["category"] == category and c["name"] == name]
    return max(cands, key=lambda c: c["tokens_per_s"], default=None)


def _f(x, spec=".2f") -> str:
    return "–" if x is None else format(x, spec)


def markdown(cells: list[dict], meta: dict) -> str:
    cats = list(dict.fromkeys(c["category"] for c in cells))
    names = list(dict.fromkeys(c["name"] for c in cells))
    lines = [f"# leapdecode bench: {meta['title']}", "", meta["setup"], ""]
    lines += [
        "## Best k per method (tokens/s, and speedup over leapdecode `none`)",
        "",
        "The best setting is picked on the same runs it is reported from: a method tried "
        "at more settings gains a little from the noise. Every setting's own figures are "
        "in the tables below.",
        "",
    ]
    lines += ["| method | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for name in names:
        row = []
        for cat in cats:
            b = best(cells, cat, name)
            row.append(
                "–"
                if b is None
                else f"{b['tokens_per_s']:.0f} tok/s, {_f(b['speedup_vs_none'])}x" + _setting(b)
            )
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    lines += vllm_markdown(cells)
    lines += llamacpp_markdown(cells)
    looks = list(dict.fromkeys(c["method"] for c in cells if c["name"] == "lookahead"))
    if looks:
        lines += [
            "",
            "## Lookahead by window W, n-gram size N, candidates G",
            "",
            "speedup over `none` (tokens per target forward); nodes = the tree's size, "
            "(W-1) + (N-2) W + G (N-1).",
            "",
            "| setting | nodes | " + " | ".join(cats) + " |",
            "|---" * (len(cats) + 2) + "|",
        ]
        by = {(c["category"], c["method"]): c for c in cells}
        for label in looks:
            row = []
            for cat in cats:
                c = by.get((cat, label))
                row.append(
                    "–"
                    if c is None
                    else f"{_f(c['speedup_vs_none'])}x ({_f(c['mean_accepted_tokens'])})"
                )
            k = next(c["k"] for c in cells if c["method"] == label)
            lines.append(f"| {label.removeprefix('lookahead ')} | {k} | " + " | ".join(row) + " |")
    lines += [
        "",
        "## Every cell",
        "",
        "tok/fwd = tokens per target decode forward (its own token included); alpha = accepted / "
        "proposed draft tokens; by position = acceptance of draft 1, 2, 3, 4; pred = "
        "(1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)); eff = measured / pred; split = share of "
        "decode time in proposer / verify forward / accept; ms/step = the same in milliseconds per "
        "decode step; mism = mismatching prompts vs the reference (non-tie + tie).",
        "",
        "| category | method | tok/s | x none | x HF generate | x vLLM | x HF counterpart | tok/fwd "
        "| fwd/token | alpha | by position | pred | eff | split | ms/step | mism |",
        "|---" * 16 + "|",
    ]
    for cat in cats:
        for c in [c for c in cells if c["category"] == cat]:
            pos = c["acceptance_by_position"]
            pos_s = "–" if not pos else " ".join(_f(p) for p in pos[:4])
            split = c["time_split"]
            split_s = (
                "–"
                if not split
                else (
                    f"{split['proposer']:.0%} / {split['verify_forward']:.0%} / {split['accept']:.0%}"
                )
            )
            ms = c["ms_per_step"]
            ms_s = (
                "–"
                if not ms
                else (f"{ms['proposer']:.2f} / {ms['verify_forward']:.2f} / {ms['accept']:.2f}")
            )
            m = c["mismatches"]
            lines.append(
                f"| {cat} | {c['method']} | {c['tokens_per_s']:.1f} | {_f(c['speedup_vs_none'])} "
                f"| {_f(c['speedup_vs_hf_generate'])} | {_f(c['speedup_vs_vllm'])} "
                f"| {_f(c.get('speedup_vs_counterpart'))} "
                f"| {_f(c['mean_accepted_tokens'])} | {_f(c['target_forwards_per_token'], '.3f')} "
                f"| {_f(c['acceptance_rate'])} | {pos_s} | {_f(c['predicted_speedup'])} "
                f"| {_f(c['efficiency'])} | {split_s} | {ms_s} | {m['non_tie']} + {m['tie']} |"
            )
    lines += ["", meta.get("costs_line", ""), ""]
    return "\n".join(lines)


def plots(cells: list[dict], out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = list(dict.fromkeys(c["category"] for c in cells))
    names = list(dict.fromkeys(c["name"] for c in cells))
    paths = []

    fig, ax = plt.subplots(figsize=(9, 4.5))
    _grouped_bars(
        ax,
        cats,
        {
            name: [(best(cells, cat, name) or {}).get("speedup_vs_none") or 0.0 for cat in cats]
            for name in names
        },
    )
    ax.set_ylabel("speedup over leapdecode none (best k)")
    ax.set_title("Speedup by category and method (greedy)")
    ax.legend(fontsize=8, ncol=2)
    paths.append(_save(fig, out_dir, "speedup_by_category.png"))

    rows = vllm_rows(cells)
    if rows:  # ours / vLLM's counterpart, each at its best k
        fig, ax = plt.subplots(figsize=(9, 4.5))
        series = {}
        for r in rows:
            series.setdefault(r["ours"]["name"], dict.fromkeys(cats, 0.0))[r["category"]] = (
                r["ratio"] or 0.0
            )
        _grouped_bars(ax, cats, {name: list(got.values()) for name, got in series.items()})
        ax.set_ylabel("tokens/s: ours / vLLM's counterpart (best k each)")
        ax.set_title("leapdecode against vLLM CPU, method by method (greedy)")
        ax.legend(fontsize=8, ncol=2)
        paths.append(_save(fig, out_dir, "vs_vllm.png"))

    rows = llamacpp_rows(cells)
    if rows:  # ours / llama.cpp's counterpart at each precision, best k each
        fig, ax = plt.subplots(figsize=(9, 4.5))
        series = {}
        for r in rows:
            if r["fastest"]:
                continue
            key = f"{r['ours']['name']} / {r['llamacpp']['name']}"
            series.setdefault(key, dict.fromkeys(cats, 0.0))[r["category"]] = r["ratio"]
        _grouped_bars(ax, cats, {name: list(got.values()) for name, got in series.items()})
        ax.set_ylabel("tokens/s: ours / llama.cpp's (best k each)")
        ax.set_title("leapdecode against llama.cpp, method by method (greedy)")
        ax.legend(fontsize=7, ncol=2)
        paths.append(_save(fig, out_dir, "vs_llamacpp.png"))

    for key, ylabel, fname in (
        ("mean_accepted_tokens", "tokens per target forward", "accepted_vs_k.png"),
        ("tokens_per_s", "tokens/s", "tokens_per_s_vs_k.png"),
    ):
        fig, axes = plt.subplots(1, len(cats), figsize=(3.2 * len(cats), 3.6), sharey=True)
        axes = axes if len(cats) > 1 else [axes]
        for ax, cat in zip(axes, cats, strict=True):
            for name in names:
                pts = sorted(
                    (c["k"], c[key])
                    for c in cells
                    if c["category"] == cat and c["name"] == name and c[key] is not None
                )
                if is_baseline(name):
                    if pts and key == "tokens_per_s":
                        color = {"none": "black", "vllm": "tab:red"}.get(name, "grey")
                        ax.axhline(pts[0][1], ls="--", lw=1, label=name, color=color)
                    continue
                if pts:
                    ls = {"hf": ":", "vl": "-.", "ll": "--"}.get(name[:2], "-")
                    ax.plot(*zip(*pts, strict=True), marker="o", label=name, ls=ls)
            ax.set_title(cat)
            ax.set_xlabel("k")
        axes[0].set_ylabel(ylabel)
        axes[-1].legend(fontsize=7)
        paths.append(_save(fig, out_dir, fname))
    return paths


def _grouped_bars(ax, cats: list[str], series: dict[str, list[float]]) -> None:
    """One bar per series in each category's group (peers hatched), a line at 1.0."""
    width = 0.8 / max(1, len(series))
    for j, (name, ys) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(cats))]
        hatch = {"hf": "//", "vl": "..", "ll": "xx"}.get(name[:2])
        ax.bar(xs, ys, width, label=name, hatch=hatch)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(cats)), cats)


def _save(fig, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write(cells: list[dict], meta: dict, out_dir: str) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = {
        "json": os.path.join(out_dir, "results.json"),
        "markdown": os.path.join(out_dir, "results.md"),
    }
    with open(paths["json"], "w") as f:
        json.dump({"meta": meta, "cells": cells}, f, indent=1)
    pngs = plots(cells, out_dir)
    md = markdown(cells, meta)
    md += "\n" + "\n".join(f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in pngs) + "\n"
    with open(paths["markdown"], "w") as f:
        f.write(md)
    paths["plots"] = ", ".join(pngs)
    return paths
