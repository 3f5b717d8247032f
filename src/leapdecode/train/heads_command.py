"""`leapdecode train medusa | eagle | peagle`: speculator heads for a trained target, with a
model card.

    leapdecode train medusa --target models/leap-code-target --out models/leap-code-target-medusa
    leapdecode train eagle  --target models/leap-code-target --out models/leap-code-target-eagle
    leapdecode train peagle --target models/leap-code-target --out models/leap-code-target-peagle \
        --init models/leap-code-target-eagle

Both train against the target's own outputs on the training split of the corpus (or on
`--tokens F.npy`, e.g. the target's own continuations from `train selfgen`), resumably
(rerun the same command after an interruption), then measure the heads on held-out files
and through the engine (mean accepted tokens per target forward on validation prompts),
and write `README.md` (the model card) beside the weights.
"""

from __future__ import annotations

import json
import os

import numpy as np

from ..cache import cache_dir
from ..errors import LeapDecodeError

EVAL_KS = {"medusa": (4, 8, 16), "eagle": (4, 8, 16), "peagle": (2, 4, 8)}
TITLES = {"medusa": "Medusa-1 heads", "eagle": "EAGLE-3-style draft head",
          "peagle": "Parallel EAGLE draft head (P-EAGLE)"}  # fmt: skip


def add_parsers(what, data_args) -> None:
    for kind, helptext in (
        ("medusa", "Medusa-1 heads on the target's last hidden state"),
        ("eagle", "an EAGLE-3-style draft head on the target's features"),
        ("peagle", "a parallel EAGLE head (P-EAGLE: k drafts in one forward)"),
    ):
        p = what.add_parser(kind, help=helptext + " (self-distillation)")
        data_args(p)
        p.add_argument("--target", required=True, help="trained target folder (frozen teacher)")
        p.add_argument("--out", required=True, help=f"output folder (e.g. <target>-{kind})")
        p.add_argument(
            "--run-dir",
            default=None,
            help="checkpoints (default ~/.cache/leapdecode/runs/NAME, or under $LEAPDECODE_CACHE)",
        )
        p.add_argument("--tokens", default=None, help="train on this token stream (.npy)")
        p.add_argument("--steps", type=int, default=1500)
        p.add_argument("--batch", type=int, default=8)
        p.add_argument("--context", type=int, default=256, help="window length in tokens")
        p.add_argument("--lr", type=float, default=3e-3 if kind == "medusa" else 2e-3)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--threads", type=int, default=0)
        p.add_argument(
            "--eval-prompts",
            type=int,
            default=8,
            help="validation prompts for the measured acceptance (0: skip)",
        )
        if kind == "medusa":
            p.add_argument("--heads", type=int, default=4, help="Medusa heads (tokens ahead)")
            continue
        p.add_argument(
            "--draft-vocab",
            type=int,
            default=2048,
            help="the head drafts only the N most frequent tokens",
        )
        p.add_argument(
            "--features",
            default=None,
            metavar="DIR",
            help="compute the target's features once (native backend, --feature-dtype) into "
            "DIR, resumably, and train from them: for a real target on a CPU",
        )
        p.add_argument(
            "--precision",
            default="auto",
            choices=["auto", "bf16", "fp32"],
            help="the head's forward under bf16 autocast or in float32; auto: bf16 where the "
            "CPU has native bf16 (about 1.9x faster for the 1.5B's head here)",
        )
        p.add_argument(
            "--hours",
            type=float,
            default=None,
            help="train for at most this long (resumed runs' time included): --steps then "
            "become those that fit, at the pace measured",
        )
        p.add_argument(
            "--feature-windows",
            type=int,
            default=256,
            help="training windows of --context tokens kept in --features (default 256)",
        )
        p.add_argument(
            "--feature-dtype",
            default="bfloat16",
            choices=["bfloat16", "float32"],
            help="the target's dtype for --features (default bfloat16)",
        )
        p.add_argument(
            "--init",
            default=None,
            metavar="PATH",
            help="continue from this trained head (its weights and draft vocabulary; "
            "--draft-vocab is then ignored); for peagle, an eagle head is a good start",
        )
        if kind == "peagle":
            p.add_argument(
                "--k", type=int, default=8, help="drafts a forward it learns (default 8)"
            )
        else:
            p.add_argument(
                "--ttt-steps",
                type=int,
                default=4,
                help="training-time test: draft steps unrolled per position",
            )


def _check(args) -> None:
    if args.steps < 1 or args.batch < 1 or args.context < 8 or args.lr <= 0:
        raise LeapDecodeError("--steps and --batch must be >= 1, --context >= 8, --lr > 0")
    if not 1 <= getattr(args, "heads", 1) <= 16:
        raise LeapDecodeError("--heads must be in 1..16")
    if not 1 <= getattr(args, "ttt_steps", 1) <= 16:
        raise LeapDecodeError("--ttt-steps must be in 1..16")
    if not 2 <= getattr(args, "k", 2) <= 16:
        raise LeapDecodeError("--k must be in 2..16")
    if getattr(args, "draft_vocab", 16) < 16:
        raise LeapDecodeError("--draft-vocab must be >= 16")
    if not os.path.exists(args.target):
        raise LeapDecodeError(f"--target {args.target!r} does not exist: pass the target's folder")
    if not os.path.isfile(os.path.join(args.target, "config.json")):
        raise LeapDecodeError(f"--target {args.target!r} is not a model folder (no config.json)")


def token_streams(args, teacher_path: str, run_dir: str):
    """(train, validation) token streams: --tokens (its last 5% held out: the data the
    heads will see), or the corpus splits encoded with the target's tokenizer, cached in
    the run folder (so a cache never outlives the tokenizer it was made with)."""
    from .data import load_or_encode
    from .fit import corpus_files, load_tokenizer

    if args.tokens:
        if not os.path.isfile(args.tokens):
            raise LeapDecodeError(f"--tokens {args.tokens!r} not found")
        stream = np.load(args.tokens)
        cut = len(stream) - max(len(stream) // 20, args.context + 2)
        if cut < args.context + 2:
            raise LeapDecodeError(
                f"--tokens {args.tokens!r} is too short for --context {args.context}"
            )
        return stream[:cut], stream[cut:]
    tokenizer = load_tokenizer(teacher_path)
    root, files = corpus_files(args)
    cache = os.path.join(run_dir, "tokens")
    train = load_or_encode(tokenizer, root, files, "train", cache)
    val = load_or_encode(tokenizer, root, files, "validation", cache)
    for name, split in (("training", train), ("validation", val)):
        if len(split) < args.context + 2:
            raise LeapDecodeError(
                f"the corpus' {name} split has {len(split)} tokens, too few for --context "
                f"{args.context}: add files (--data), raise --val-percent or lower --context"
            )
    return train, val


def measured_acceptance(target: str, out: str, kind: str, n_prompts: int) -> dict:
    """Mean accepted tokens per target forward (greedy) on validation prompts, by k."""
    from ..api import LeapDecoder
    from .validation import model_manifest, validation_files, validation_prompts

    if n_prompts <= 0:
        return {}
    try:
        files = validation_files(model_manifest(target))
    except LeapDecodeError as e:
        print(f"(no acceptance measured: {e})")
        return {}
    dec = LeapDecoder.from_pretrained(target, speculators=[out], dtype="float32")
    prompts = validation_prompts(dec.tokenizer, files, n_prompts)
    result = {}
    for k in EVAL_KS[kind]:
        res = dec.generate_batch(prompts, method=kind, k=k, max_new_tokens=96)
        steps = sum(r.stats.decode_steps for r in res)
        emitted = sum(r.stats.accepted for r in res) + steps
        result[f"k{k}"] = round(emitted / max(1, steps), 3)
    return {"mean_accepted_tokens": result, "prompts": len(prompts), "max_new_tokens": 96}


def cmd_heads(args) -> int:
    import torch

    from .teacher import TargetTables, Teacher

    _check(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    kind = args.what
    run_dir = args.run_dir or cache_dir("runs", os.path.basename(os.path.abspath(args.out)))
    from .teacher import fingerprint

    features = getattr(args, "features", None)  # eagle and peagle only
    if features and args.feature_windows < 1:
        raise LeapDecodeError("--feature-windows must be >= 1")
    if getattr(args, "hours", None) is not None and args.hours <= 0:
        raise LeapDecodeError("--hours must be > 0")
    teacher = TargetTables(args.target) if features else Teacher(args.target)
    longest = int(teacher.config.max_position_embeddings)
    if args.context + 1 > longest:
        raise LeapDecodeError(
            f"--context {args.context} needs windows of {args.context + 1} tokens; the "
            f"target's context is {longest}: lower --context"
        )
    train, val = token_streams(args, args.target, run_dir)
    stamp = fingerprint(args.target, tokens=args.tokens, tokens_len=len(train))
    common = dict(
        steps=args.steps,
        batch=args.batch,
        context=args.context,
        lr=args.lr,
        run_dir=run_dir,
        seed=args.seed,
        stamp=stamp,
    )
    if kind == "medusa":
        from .medusa import train_medusa

        heads, summary = train_medusa(teacher, train, val, num_heads=args.heads, **common)
        accuracy = {
            "top1_by_head": [round(a[0], 4) for a in heads.accuracy],
            "top5_by_head": [round(sum(a[:5]), 4) for a in heads.accuracy],
        }
    else:
        from .eagle import train_eagle

        if args.init and not os.path.isfile(os.path.join(args.init, "config.json")):
            raise LeapDecodeError(f"--init {args.init!r} is not a head folder (no config.json)")
        from ..models.loader import cpu_has_fast_bf16

        kept = {"bf16": {"auto": cpu_has_fast_bf16(), "bf16": True, "fp32": False}[args.precision]}
        if args.hours is not None:
            kept["budget_s"] = args.hours * 3600
        if features:
            kept["features"], kept["val_features"] = extract_features(args, train, val)
        heads, summary = train_eagle(
            teacher,
            train,
            val,
            **kept,
            draft_vocab=args.draft_vocab,
            ttt_steps=getattr(args, "ttt_steps", 0),
            init=args.init,
            parallel=getattr(args, "k", 0) if kind == "peagle" else 0,
            **common,
        )
        accuracy = heads.info.pop("accuracy")
    summary["data"] = args.tokens or "the corpus training split"
    heads.info.update(
        {"target": os.path.basename(os.path.abspath(args.target)), "training": summary}
    )
    heads.save(args.out, extra={"accuracy": accuracy})
    acceptance = measured_acceptance(args.target, args.out, kind, args.eval_prompts)
    report = {"kind": kind, "accuracy": accuracy, "acceptance": acceptance, "training": summary}
    with open(os.path.join(args.out, "evaluation.json"), "w") as f:
        json.dump(report, f, indent=1)
    write_card(args.out, report)
    print(f"{kind} saved to {args.out}: accuracy {accuracy}; acceptance {acceptance}")
    return 0


def extract_features(args, train, val):
    """The target's features of the training windows and 16 held-out ones, computed once with
    the native backend (train/features.py) under args.features; returns their FeatureShards.
    A folder is kept for the same target, layers, dtype and token stream (its digest)."""
    import hashlib

    import torch

    from ..models.eagle import Eagle3Head, default_aux_layers
    from ..models.loader import load_model
    from .features import FeatureShards, extract
    from .teacher import fingerprint

    if args.init:
        layers = Eagle3Head.load(args.init).aux_layers
    else:
        with open(os.path.join(args.target, "config.json")) as f:
            layers = default_aux_layers(int(json.load(f)["num_hidden_layers"]))
    model = None
    shards = []
    for split, tokens, windows in (("train", train, args.feature_windows), ("validation", val, 16)):
        folder = os.path.join(args.features, split)
        stream = hashlib.sha256(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())
        stamp = fingerprint(args.target, layers=list(layers), dtype=args.feature_dtype,
                            stream=stream.hexdigest()[:16])  # fmt: skip
        want = min(windows, len(tokens) // (args.context + 1))
        try:
            have = FeatureShards(folder)
            if have.manifest["stamp"] == stamp and have.windows == want:
                shards.append(have)
                continue
        except LeapDecodeError:
            pass
        if model is None:
            print(f"computing the target's features ({args.feature_dtype}) into {args.features}")
            model = load_model(args.target, dtype=args.feature_dtype)
        with torch.inference_mode():
            extract(model, tokens, folder, layers=tuple(layers), context=args.context,
                    windows=windows, stamp=stamp)  # fmt: skip
        shards.append(FeatureShards(folder))
    return shards


def write_card(out: str, report: dict) -> None:
    kind, acc, t = report["kind"], report["accuracy"], report["training"]
    title = TITLES[kind]
    lines = [
        f"# {title} for `{os.path.basename(out).rsplit('-', 1)[0]}`",
        "",
        "Trained by `leapdecode train " + kind + "` against the frozen target's own "
        "outputs (self-distillation: its hidden states and next-token distributions).",
        "",
        "| | |",
        "|---|---|",
        f"| data | {t['data']} |",
        *([f"| continued from | {t['init']} (steps below: this run's) |"] if t.get("init") else []),
        f"| steps x batch x context | {t['steps']} x {t['batch']} x {t['context']} "
        f"({t['tokens_seen'] / 1e6:.2f} M tokens) |",
        f"| training time | {t['train_seconds'] / 60:.1f} min on this machine's CPU |",
        f"| final training loss | {t['final_loss']:.3f} |",
        "",
    ]
    if kind == "medusa":
        lines += [
            "Held-out accuracy (teacher-forced: the head's token equals the target's "
            "greedy token there):",
            "",
            "| head (tokens ahead) | top-1 | top-5 |",
            "|---|---|---|",
        ]
        for i, (a1, a5) in enumerate(zip(acc["top1_by_head"], acc["top5_by_head"], strict=True)):
            lines.append(f"| {i + 1} (t+{i + 2}) | {a1:.3f} | {a5:.3f} |")
    else:
        how = (
            "draft position (one forward: position 1 from the last real pair, position "
            "j + 1 from mask slot j, as at inference"
            if kind == "peagle"
            else "draft depth (each depth drafts from the head's own features of the depth "
            "before, as at inference"
        )
        lines += [
            f"Held-out accuracy by {how}; the head's token equals the target's greedy token):",
            "",
            ("| position" if kind == "peagle" else "| depth") + " | top-1 | top-4 |",
            "|---|---|---|",
        ]
        for j, (a1, a4) in enumerate(zip(acc["top1_by_depth"], acc["top4_by_depth"], strict=True)):
            lines.append(f"| {j + 1} | {a1:.3f} | {a4:.3f} |")
        lines += [
            "",
            f"Draft vocabulary covers {acc['draft_vocab_coverage']:.1%} of the "
            "target's greedy tokens on held-out text.",
        ]
    a = report.get("acceptance") or {}
    if a:
        lines += [
            "",
            f"Measured through the engine (greedy, {a['prompts']} validation "
            f"prompts, {a['max_new_tokens']} new tokens): mean accepted tokens per "
            "target forward, bonus token included:",
            "",
            ("| k | " if kind == "peagle" else "| tree size k | ")
            + " | ".join(k[1:] for k in a["mean_accepted_tokens"])
            + " |",
            "|---" * (1 + len(a["mean_accepted_tokens"])) + "|",
            "| accepted / forward | "
            + " | ".join(f"{v:.2f}" for v in a["mean_accepted_tokens"].values())
            + " |",
        ]
    lines += [
        "",
        "Use: `leapdecode generate --method " + kind + ' --k 16 "def parse(line):"` '
        "(found beside the target; or `--speculator PATH`).",
        "",
    ]
    if kind == "peagle":
        lines[-2] = lines[-2].replace("--k 16", "--k 4")
    if kind in ("eagle", "peagle"):
        lines += [
            "Export for vLLM: `leapdecode export --format speculators --speculator "
            f"{out} --out DIR`.",
            "",
        ]
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("\n".join(lines))
