"""Measure a trained target (and draft) on the held-out files and write their model cards.

- validation loss (nats/token) and bits per byte over every held-out file, and the same
  bytes compressed file by file with xz at `-9e` (Python's `lzma`, preset 9 | EXTREME);
- draft: greedy agreement with the target (both argmaxes equal, teacher-forced) and mean
  accepted tokens per target forward at k = 4 on validation prompts;
- decode ms/token of the pair as generation runs them (target in its checkpoint dtype, draft
  in float32 with its recommended head, one thread, one token after 256 cached), timed in
  turns in one run;
- copying: a held-out function asked for again, the bench's revision prompts, looping.
"""

from __future__ import annotations

import json
import lzma
import math
import os
import statistics
import time

import torch
from tqdm import tqdm

from ..errors import LeapDecodeError
from .tokenizer import EOS
from .validation import model_manifest, validation_files, validation_prompts


def xz_bits_per_byte(files: list[tuple[str, bytes]]) -> float:
    compressed = sum(len(lzma.compress(d, preset=9 | lzma.PRESET_EXTREME)) for _, d in files)
    return 8 * compressed / sum(len(d) for _, d in files)


@torch.no_grad()
def scored_windows(models: dict, tokenizer, files, context: int):
    """Per model: total NLL (nats) and token count; plus argmax agreement between models.

    Each file is scored on its own, after <|endoftext|>, in windows of `context` tokens that
    advance by half a window; each token is scored once, with at least half a window of
    context (or all of the file before it).
    """
    keep = context // 2  # tokens of overlap carried into the next window
    eos = tokenizer.convert_tokens_to_ids(EOS)
    nll = {name: 0.0 for name in models}
    count = 0
    agree = 0
    for _, data in tqdm(files, desc="scoring validation files"):
        ids = [eos] + tokenizer.encode(data.decode("utf-8"), add_special_tokens=False)
        ids_t = torch.tensor(ids)
        scored_upto = 1  # ids[0] (eos) is never predicted
        start = 0
        while scored_upto < len(ids):
            end = min(len(ids), start + context)
            window = ids_t[start:end][None]
            first = scored_upto - start  # first position (in the window) whose label we score
            labels = ids_t[scored_upto:end]
            argmaxes = []
            for name, m in models.items():
                logits = m(input_ids=window).logits[0, first - 1 : end - start - 1].float()
                nll[name] += float(
                    torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
                )
                argmaxes.append(logits.argmax(-1))
            if len(argmaxes) == 2:
                agree += int((argmaxes[0] == argmaxes[1]).sum())
            count += len(labels)
            scored_upto = end
            start = end - keep
    return nll, count, agree


def interleaved_decode_ms(
    paths: dict[str, str],
    draft_names=frozenset(),
    context: int = 256,
    reps: int = 300,
    draft_head: int = 2048,
) -> dict[str, float]:
    """Decode step (one token after `context` cached) of several models, timed in turns so
    that they share the machine's state; median ms. Targets run in their checkpoint dtype,
    drafts (`draft_names`) in float32 with a `draft_head`-token output layer, as the bench
    runs them."""
    from ..models import load_model

    models = {}
    for name, path in paths.items():
        if name in draft_names:
            m = load_model(path, dtype="float32")
            m.restrict_head(torch.arange(min(draft_head, m.vocab_size)))
        else:
            m = load_model(path, dtype="auto")
        models[name] = m
    slot, tok = torch.tensor([0]), torch.tensor([[1]])
    for m in models.values():
        m.allocate(1, context + 8)
        m.forward(torch.randint(0, m.vocab_size, (1, context)), slot)
    times = {name: [] for name in models}
    for _ in range(reps + 20):
        for name, m in models.items():
            t0 = time.perf_counter()
            m.forward(tok, slot)
            times[name].append(time.perf_counter() - t0)
            m.truncate(slot, torch.tensor([context]))
    return {name: statistics.median(t[20:]) * 1e3 for name, t in times.items()}


def pair_decode_ms(paths: dict[str, str]) -> dict[str, float]:
    """The pair's decode steps as generation runs them (target in its checkpoint dtype,
    draft in float32 with its recommended head, one thread), in one interleaved run."""
    from ..proposers.draft_model import read_vocab_ranking

    ranking = read_vocab_ranking(paths.get("draft"))
    head = int(ranking["recommended"]) if ranking else 1 << 30
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        drafts = {"draft"} if "draft" in paths else set()
        return interleaved_decode_ms(paths, drafts, draft_head=head)
    finally:
        torch.set_num_threads(threads)


def acceptance_at_k(target: str, draft: str, prompts: list[str], k: int = 4, new: int = 128):
    from ..api import LeapDecoder

    dec = LeapDecoder.from_pretrained(target, draft=draft)
    steps = accepted = proposed = 0
    for p in tqdm(prompts, desc=f"draft k={k} on validation prompts"):
        s = dec.generate(p, method="draft", k=k, max_new_tokens=new).stats
        steps, accepted, proposed = (
            steps + s.decode_steps,
            accepted + s.accepted,
            proposed + s.proposed,
        )
    return (accepted + steps) / steps, accepted / max(1, proposed)


def evaluate_and_write_cards(args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    baseline = baseline_looping(args.baseline) if getattr(args, "baseline", None) else {}
    manifest = model_manifest(args.target)
    files = validation_files(manifest, args.data)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    paths = {"target": args.target} | ({"draft": args.draft} if args.draft else {})
    models = {
        n: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
        for n, p in paths.items()
    }
    context = models["target"].config.max_position_embeddings
    nll, count, agree = scored_windows(models, tokenizer, files, context)
    n_bytes = sum(len(d) for _, d in files)
    xz = xz_bits_per_byte(files)
    report = {
        "validation_files": len(files),
        "validation_bytes": n_bytes,
        "validation_tokens": count,
        "xz_9e_bits_per_byte": xz,
        "corpus_manifest_sha256": manifest["sha256"],
    }
    ms = pair_decode_ms(paths)
    for name in paths:
        report[name] = {
            "validation_loss_nats_per_token": nll[name] / count,
            "bits_per_byte": nll[name] / math.log(2) / n_bytes,
            "decode_ms_per_token": ms[name],
        }
        report[name]["bits_per_byte_vs_xz"] = report[name]["bits_per_byte"] / xz
    if not getattr(args, "no_copying", False):
        from ..paths import PROMPTS
        from .copying import measure

        report["target"] |= measure(args.target, files, os.path.join(PROMPTS, "revision.jsonl"))
        report["target"] |= baseline
    if args.draft:
        n_prompt, n_new = min(192, context // 2), min(128, context // 4)
        prompts = validation_prompts(tokenizer, files, args.prompts, n_prompt)
        mat, rate = acceptance_at_k(args.target, args.draft, prompts, new=n_new)
        report["draft"] |= {
            "greedy_agreement": agree / count,
            "mean_accepted_tokens_k4": mat,
            "acceptance_rate_k4": rate,
            "acceptance_prompts": len(prompts),
            "acceptance_new_tokens": n_new,
            "decode_cost_vs_target": report["draft"]["decode_ms_per_token"]
            / report["target"]["decode_ms_per_token"],
        }
    for name, path in paths.items():
        with open(os.path.join(path, "evaluation.json"), "w") as f:
            json.dump(report, f, indent=1)
        write_card(path, name, report, models[name])
    print(json.dumps(report, indent=1))
    return report


def baseline_looping(path: str) -> dict:
    """The looping share of an earlier target, from its evaluation.json or a copying report."""
    try:
        with open(path) as f:
            data = json.load(f)
        share = data.get("looping_share", data.get("target", {}).get("looping_share"))
    except (OSError, ValueError, AttributeError) as e:
        raise LeapDecodeError(f"--baseline {path}: not a readable JSON report ({e})") from None
    if share is None:
        raise LeapDecodeError(
            f"--baseline {path}: has no looping_share; pass an evaluation.json "
            "written by `leapdecode train evaluate` with the copy tests on"
        )
    return {"baseline_looping_share": float(share), "baseline": os.path.basename(path)}


def _targets(kind: str, report: dict) -> list[tuple[str, str, bool]]:
    """The embedded pair's acceptance criteria, checked against the measurements."""
    r = report[kind]
    if kind == "target":
        ratio = r["bits_per_byte_vs_xz"]
        out = [("bits per byte <= 0.70 x xz -9e (aim 0.62)", f"{ratio:.3f} x", ratio <= 0.70)]
        if "copy_score" in r:
            out += [
                (
                    "copies a held-out function asked for unchanged: >= 80% of its tokens",
                    f"{r['copy_score']:.3f}",
                    r["copy_score"] >= 0.80,
                ),
                (
                    "reproduces the revised rest exactly on >= 50% of the bench's revision prompts",
                    f"{r.get('revision_exact', float('nan')):.3f}",
                    r.get("revision_exact", 0) >= 0.5,
                ),
            ]
        if "baseline_looping_share" in r:
            base = r["baseline_looping_share"]
            out.append(
                (
                    f"loops less than the earlier target (`{r['baseline']}`: {base:.3f})",
                    f"{r['looping_share']:.3f}",
                    r["looping_share"] < base,
                )
            )
        return out
    cost = r["decode_cost_vs_target"]
    agree = r["greedy_agreement"]
    return [
        ("greedy agreement with the target >= 0.70", f"{agree:.3f}", agree >= 0.70),
        ("decode step <= 1/8 of the target's", f"{cost:.3f}", cost <= 0.125),
    ]


def _summary(path: str) -> dict:
    p = os.path.join(path, "training_summary.json")
    return json.load(open(p)) if os.path.isfile(p) else {}


def write_card(path: str, kind: str, report: dict, model) -> None:
    cfg = model.config
    s = _summary(path)
    c = s.get("config", {})
    r = report[kind]
    params = sum(p.numel() for p in model.parameters())
    hours = s.get("train_seconds", 0) / 3600
    lines = [
        "---",
        "license: apache-2.0",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [code, python, speculative-decoding, leapdecode]",
        "---",
        "",
        f"# leap-code-{kind}",
        "",
        (
            "The target code model of leapdecode: a small Llama-architecture causal LM trained "
            "from scratch on the Python standard library."
            if kind == "target"
            else "The draft model of leapdecode: a tiny Llama-architecture LM distilled from "
            "`leap-code-target` (forward KL to the target's next-token distribution, mixed with "
            "cross-entropy) for speculative decoding, on the corpus and then on the target's own "
            "generations (`leapdecode train selfgen`). Same tokenizer as the target. "
            "`draft_vocab.json` ranks the vocabulary by frequency in its training data; by "
            "default leapdecode's draft head covers the 2048 most frequent tokens only."
        ),
        "",
        "## Model",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {params:,} ({params / 1e6:.1f} M) |",
        f"| layers / hidden / heads / kv heads | {cfg.num_hidden_layers} / {cfg.hidden_size} / "
        f"{cfg.num_attention_heads} / {cfg.num_key_value_heads} |",
        f"| MLP width | {cfg.intermediate_size} |",
        f"| context | {cfg.max_position_embeddings} tokens |",
        f"| vocabulary | {cfg.vocab_size} (byte-level BPE, `<|endoftext|>` between files) |",
        f"| embeddings | {'tied' if cfg.tie_word_embeddings else 'untied'} |",
        f"| weights | {s.get('save_dtype', 'bfloat16')} safetensors |",
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        f"| corpus | `.py` files of the Python {'.'.join(map(str, __import__('sys').version_info[:2]))} "
        f"standard library; manifest sha256 `{report['corpus_manifest_sha256'][:16]}...` "
        "(`corpus_manifest.json`) |",
        f"| steps | {s.get('steps', '?')} (batch {c.get('batch', '?')} x {c.get('context', '?')} tokens, "
        f"AdamW, peak lr {c.get('lr', '?')}, cosine decay) |",
        f"| tokens seen | {s.get('tokens_seen', 0):,} |",
        f"| training time | {hours:.2f} h on 2 CPU cores "
        f"({'bf16 autocast' if c.get('bf16') else 'float32'}) |",
        f"| final training loss | {s.get('final_train_loss') or float('nan'):.3f} nats/token"
        + (" (distillation objective: KL to the target + CE share) |" if kind == "draft" else " |"),
    ]
    if kind == "draft":
        lines.append(
            f"| teacher | `{os.path.basename(str(s.get('teacher', 'leap-code-target')))}` |"
        )
    if s.get("lineage"):
        total = s.get("total_train_seconds", 0) / 3600
        lines += [
            "",
            f"Trained in stages ({total:.2f} h in all); the table above is the last:",
            "",
            "| stage | what | steps | tokens seen | context | peak lr | hours |",
            "|---|---|---|---|---|---|---|",
        ]
        for st in s["lineage"]:
            lines.append(
                f"| {st['stage']} | {st['what']} | {st['steps']} | {st['tokens_seen']:,} "
                f"| {st['context']} | {st['lr']} | {st['train_seconds'] / 3600:.2f} |"
            )
    lines += [
        "",
        "## Evaluation (held-out standard-library files)",
        "",
        f"{report['validation_files']} files, {report['validation_bytes']:,} bytes, "
        f"{report['validation_tokens']:,} tokens; each file scored on its own.",
        "",
        "| metric | value |",
        "|---|---|",
        f"| validation loss | {r['validation_loss_nats_per_token']:.3f} nats/token |",
        f"| bits per byte | {r['bits_per_byte']:.3f} |",
        f"| `xz -9e`, file by file | {report['xz_9e_bits_per_byte']:.3f} bits per byte |",
        f"| model / xz | {r['bits_per_byte_vs_xz']:.3f} |",
        f"| decode, one token after 256 (native backend, 1 thread, CPU; target in its "
        f"checkpoint dtype, draft in fp32 with its recommended head; one interleaved run) "
        f"| {r['decode_ms_per_token']:.2f} ms |",
    ]
    if "copy_score" in r:
        lines += [
            f"| copy test: share of a held-out function reproduced when asked for it unchanged "
            f"({r['copy_functions']} functions, greedy) | {r['copy_score']:.3f} |",
            f"| bench revision prompts reproduced exactly ({r.get('revision_prompts', 0)}, greedy) "
            f"| {r.get('revision_exact', float('nan')):.3f} |",
            f"| 128-token continuations in which a non-blank line repeats 3+ times "
            f"({r['looping_prompts']} validation prefixes) | {r['looping_share']:.3f} |",
        ]
    if kind == "draft":
        lines += [
            f"| greedy agreement with the target | {r['greedy_agreement']:.3f} |",
            f"| mean accepted tokens per target forward, k = 4 | {r['mean_accepted_tokens_k4']:.2f} "
            f"({r['acceptance_prompts']} validation prompts, {r['acceptance_new_tokens']} new tokens, greedy) |",
            f"| acceptance rate, k = 4 | {r['acceptance_rate_k4']:.3f} |",
            f"| decode cost / target's | {r['decode_cost_vs_target']:.3f} |",
        ]
    lines += ["", "## Project targets", "", "| target | measured | met |", "|---|---|---|"]
    for goal, value, ok in _targets(kind, report):
        lines.append(f"| {goal} | {value} | {'yes' if ok else 'no'} |")
    lines += [
        "",
        "Measured by `leapdecode train evaluate --target models/leap-code-target "
        "--draft models/leap-code-draft` (figures also in `evaluation.json`).",
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'model = AutoModelForCausalLM.from_pretrained("models/leap-code-{kind}")',
        "```",
        "",
        'or with leapdecode: `leapdecode generate --method draft "def parse(line):"`.',
        "",
    ]
    with open(os.path.join(path, "README.md"), "w") as f:
        f.write("\n".join(lines))
