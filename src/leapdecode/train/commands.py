"""`leapdecode train tokenizer | target | draft | selfgen | medusa | eagle | evaluate | ...`."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import numpy as np
import torch

from ..errors import LeapDecodeError
from ..models.loader import cpu_has_fast_bf16
from . import corpus
from .data import load_or_encode
from .loop import TrainConfig, train

DRAFT_VOCAB = 2048  # tokens a draft proposes by default (the most frequent in its data)
RUNS = os.path.join(os.path.expanduser("~"), ".cache", "leapdecode", "runs")


def add_parsers(sub) -> None:
    p = sub.add_parser("train", help="train a tokenizer, a target LM or a distilled draft")
    what = p.add_subparsers(dest="what", required=True, parser_class=type(p))

    tok = what.add_parser("tokenizer", help="byte-level BPE on the training split")
    _data_args(tok)
    tok.add_argument("--vocab-size", type=int, default=8192)
    tok.add_argument("--out", required=True)

    tgt = what.add_parser("target", help="a Llama-architecture LM, cross-entropy")
    _data_args(tgt)
    tgt.add_argument("--tokenizer", required=True, help="folder from `train tokenizer`")
    _model_args(tgt, hidden=512, layers=6, heads=8, kv_heads=4, intermediate=1376)
    _loop_args(tgt, steps=520, batch=8, lr=1.5e-3)
    tgt.add_argument("--init", default=None, help="start from this model folder (fine-tune)")
    tgt.add_argument("--tokens", default=None, help="train on this token stream (.npy)")
    tgt.add_argument(
        "--repeat-share",
        type=float,
        default=0.0,
        help="share of rows showing a corpus span twice (teaches copying)",
    )
    tgt.add_argument(
        "--edit-share",
        type=float,
        default=0.0,
        help="share of rows from revision documents (function, then revised)",
    )
    tgt.add_argument(
        "--no-copy-probe",
        action="store_true",
        help="skip the copy signals measured with each validation",
    )

    ed = what.add_parser("edits", help="revision documents + plain files, for a target fine-tune")
    _data_args(ed)
    ed.add_argument("--tokenizer", required=True, help="tokenizer (or model) folder")
    ed.add_argument("--out", required=True, help="output .npy token stream")
    ed.add_argument("--docs", type=int, default=3000, help="revision documents")
    ed.add_argument("--plain-share", type=float, default=0.5, help="share of plain-file tokens")
    ed.add_argument("--seed", type=int, default=0)

    dr = what.add_parser("draft", help="a small LM distilled from the target (forward KL)")
    _data_args(dr)
    dr.add_argument("--target", required=True, help="trained target folder (teacher)")
    _model_args(dr, hidden=256, layers=2, heads=4, kv_heads=4, intermediate=688)
    _loop_args(dr, steps=300, batch=8, lr=3e-3)
    dr.add_argument("--ce-weight", type=float, default=0.1, help="share of plain cross-entropy")
    dr.add_argument("--init", default=None, help="start from this draft folder (fine-tune)")
    dr.add_argument(
        "--tokens", default=None, help="train on this token stream (.npy from `train selfgen`)"
    )

    sg = what.add_parser("selfgen", help="the target's own greedy continuations, for a draft")
    _data_args(sg)
    sg.add_argument("--target", required=True)
    sg.add_argument("--out", required=True, help="output .npy token stream")
    sg.add_argument("--samples", type=int, default=2048)
    sg.add_argument("--prefix-tokens", type=int, default=256)
    sg.add_argument("--new-tokens", type=int, default=256)
    sg.add_argument("--batch", type=int, default=16)
    sg.add_argument("--seed", type=int, default=0)

    pg = what.add_parser("progress", help="plot a run's loss and copy signals so far")
    pg.add_argument("--run-dir", required=True, action="append",
                    help="a run's folder; repeat it for a run continued by another (--init): "
                    "later runs continue the tokens axis")  # fmt: skip
    pg.add_argument("--out", default=os.path.join("docs", "training"))

    from .heads_command import add_parsers as add_heads

    add_heads(what, _data_args)

    from .sizing import add_parser as add_sizing

    add_sizing(what, _data_args, _loop_args)

    ev = what.add_parser("evaluate", help="measure a trained pair and write the model cards")
    _data_args(ev)
    ev.add_argument("--target", required=True)
    ev.add_argument("--draft", default=None)
    ev.add_argument("--prompts", type=int, default=12, help="validation prompts for acceptance")
    ev.add_argument(
        "--baseline",
        default=None,
        metavar="JSON",
        help="an earlier target's evaluation.json (or docs/training/v0_copying.json): "
        "the card checks that the looping share is lower than its",
    )
    ev.add_argument("--no-copying", action="store_true",
                    help="skip the copy, revision and looping tests (greedy generation)")  # fmt: skip


def _data_args(p) -> None:
    p.add_argument("--data", default=None, help="folder of training files (default: Python stdlib)")
    p.add_argument("--ext", default=".py", help="file extensions to use, comma-separated")
    p.add_argument("--val-percent", type=float, default=2.0)


def _model_args(p, hidden, layers, heads, kv_heads, intermediate) -> None:
    p.add_argument("--out", required=True, help="output folder (Hugging Face format)")
    p.add_argument("--run-dir", default=None, help=f"checkpoints and caches (default {RUNS}/NAME)")
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--heads", type=int, default=heads)
    p.add_argument("--kv-heads", type=int, default=kv_heads)
    p.add_argument("--intermediate", type=int, default=intermediate)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--save-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])


def _loop_args(p, steps, batch, lr) -> None:
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup", type=int, default=None, help="default: 6%% of the steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--checkpoint-every", type=int, default=25)
    p.add_argument(
        "--precision", default="auto", choices=["auto", "bf16", "fp32"],
        help="bf16 autocast or float32; auto: bf16 only where the CPU has native bf16",
    )  # fmt: skip
    p.add_argument(
        "--compile", action="store_true",
        help="torch.compile the training step (about 1.3x faster on CPU; needs a C++ compiler)",
    )  # fmt: skip
    p.add_argument("--max-minutes", type=float, default=0.0,
                   help="stop after this much training time (resumable); 0 = no limit")  # fmt: skip
    p.add_argument(
        "--schedule", default=None,
        help="stages CONTEXTxBATCH:STEPS,... (e.g. 256x8:6000,1024x4:2000); overrides "
        "--steps, --batch and --context for the batches (the model's context stays --context)",
    )  # fmt: skip


def _extensions(args) -> tuple[str, ...]:
    return tuple(e if e.startswith(".") else "." + e for e in args.ext.split(",") if e)


def _train_config(args) -> TrainConfig:
    for name in ("steps", "batch", "context"):
        if getattr(args, name) < 1:
            raise LeapDecodeError(f"--{name} must be >= 1")
    if args.lr <= 0:
        raise LeapDecodeError("--lr must be > 0")
    stages = parse_schedule(args.schedule, args.context) if args.schedule else ()
    steps = sum(s for _, _, s in stages) if stages else args.steps
    warmup = args.warmup if args.warmup is not None else max(1, steps * 6 // 100)
    bf16 = {"auto": cpu_has_fast_bf16(), "bf16": True, "fp32": False}[args.precision]
    return TrainConfig(
        steps=steps, batch=args.batch, context=args.context, lr=args.lr, warmup=warmup,
        seed=args.seed, eval_every=args.eval_every, checkpoint_every=args.checkpoint_every,
        bf16=bf16, threads=args.threads, ce_weight=getattr(args, "ce_weight", 0.0),
        stages=stages, compile=args.compile, max_seconds=60 * args.max_minutes,
    )  # fmt: skip


def parse_schedule(text: str, max_context: int) -> tuple:
    """'256x8:6000,1024x4:2000' -> ((256, 8, 6000), (1024, 4, 2000))."""
    stages = []
    for part in text.split(","):
        try:
            shape, steps = part.split(":")
            context, batch = shape.lower().split("x")
            stage = (int(context), int(batch), int(steps))
        except ValueError:
            raise LeapDecodeError(
                f"--schedule stage {part!r} is not CONTEXTxBATCH:STEPS (e.g. 256x8:6000)"
            ) from None
        if min(stage) < 1 or stage[0] > max_context:
            raise LeapDecodeError(
                f"--schedule stage {part!r}: values must be >= 1 and the context <= --context"
            )
        stages.append(stage)
    return tuple(stages)


def _llama_config(args, tokenizer):
    from transformers import LlamaConfig

    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise LeapDecodeError("--hidden must divide by --heads, and --heads by --kv-heads")
    eos = tokenizer.eos_token_id
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=args.context,
        tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
        rms_norm_eps=1e-5, initializer_range=0.02,
    )  # fmt: skip


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    if not os.path.exists(path):
        raise LeapDecodeError(
            f"{path!r} does not exist: pass a folder with tokenizer.json (a model folder, or "
            "one written by `leapdecode train tokenizer`)"
        )
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise LeapDecodeError(
            f"{path!r} has no tokenizer.json: run `leapdecode train tokenizer` first"
        )
    return AutoTokenizer.from_pretrained(path)


def _corpus(args):
    root = args.data or corpus.stdlib_dir()
    return root, corpus.scan(root, _extensions(args), args.val_percent)


def _save(model, tokenizer, args, root, files, summary: dict, kind: str) -> None:
    from transformers import GenerationConfig

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    os.makedirs(args.out, exist_ok=True)
    model.to(dtype[args.save_dtype]).save_pretrained(args.out, safe_serialization=True)
    model.float()
    tokenizer.save_pretrained(args.out)
    eos = tokenizer.eos_token_id
    GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos).save_pretrained(args.out)
    m = corpus.save_manifest(root, files, args.out)
    summary = {**summary, "kind": kind, "parameters": sum(p.numel() for p in model.parameters()),
               "corpus_manifest_sha256": m["sha256"], "save_dtype": args.save_dtype}  # fmt: skip
    summary = with_lineage(summary)
    with open(os.path.join(args.out, "training_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


def stage_of(summary: dict) -> dict:
    """One training stage as the model card's lineage table shows it."""
    c = summary.get("config", {})
    stages = c.get("stages") or [[c.get("context"), c.get("batch"), summary.get("steps")]]
    what = []
    if summary.get("kind") == "draft":
        what.append(f"distilled from `{os.path.basename(str(summary.get('teacher', '?')))}`")
    what.append(
        f"on `{os.path.basename(summary['tokens'])}` (the target's own continuations)"
        if summary.get("tokens")
        else "on the training split"
    )
    mix = summary.get("mix") or {}
    if mix.get("repeat_share") or mix.get("edit_share"):
        what.append(f"with {mix.get('repeat_share', 0):.0%} repeated spans and "
                    f"{mix.get('edit_share', 0):.0%} revision documents")  # fmt: skip
    if len(stages) > 1:
        what.append("windows " + " -> ".join(f"{b} x {ctx}" for ctx, b, _ in stages))
    return {"what": ", ".join(what), "steps": summary.get("steps", 0),
            "tokens_seen": summary.get("tokens_seen", 0),
            "train_seconds": summary.get("train_seconds", 0.0),
            "context": stages[-1][0], "lr": c.get("lr")}  # fmt: skip


def with_lineage(summary: dict) -> dict:
    """A model trained from --init carries the stages behind its starting point, so its card
    tells the whole training, not only the last stage."""
    init = summary.get("init")
    path = os.path.join(init, "training_summary.json") if init else ""
    if not os.path.isfile(path):
        return summary
    with open(path) as f:
        before = json.load(f)
    stages = before.get("lineage") or [stage_of(before)]
    stages = [*stages, stage_of(summary)]
    for i, st in enumerate(stages):
        st["stage"] = i
    total = sum(st["train_seconds"] for st in stages)
    return {**summary, "lineage": stages, "total_train_seconds": total}


def cmd_tokenizer(args) -> int:
    from .tokenizer import train_tokenizer

    if not 256 < args.vocab_size <= 65_536:
        raise LeapDecodeError("--vocab-size must be in 257..65536")
    tok = train_tokenizer(args.data, args.out, args.vocab_size, _extensions(args), args.val_percent)
    print(f"tokenizer with {len(tok)} tokens saved to {args.out}")
    return 0


def _fit(args, tokenizer, kind: str, teacher=None, save_partial: bool = False) -> int:
    """Build a fresh Llama from the flags (or --init), train it resumably, save it to --out."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    cfg = _train_config(args)
    root, files = _corpus(args)
    run_dir = args.run_dir or os.path.join(RUNS, os.path.basename(os.path.abspath(args.out)))
    train_tokens = load_or_encode(tokenizer, root, files, "train", run_dir)
    val_tokens = load_or_encode(tokenizer, root, files, "validation", run_dir)
    if getattr(args, "tokens", None):
        if not os.path.isfile(args.tokens):
            raise LeapDecodeError(
                f"{args.tokens!r} not found: make it with `leapdecode train selfgen`"
            )
        train_tokens = np.load(args.tokens)
    if len(train_tokens) < args.context + 2:
        raise LeapDecodeError(
            f"{len(train_tokens)} training tokens cannot fill one window of --context "
            f"{args.context}: lower --context or give more data"
        )
    torch.manual_seed(cfg.seed)
    if getattr(args, "init", None):
        model = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32)
    else:
        model = LlamaForCausalLM(_llama_config(args, tokenizer))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{kind}: {n_params / 1e6:.2f}M parameters, {len(train_tokens) / 1e6:.2f}M training "
          f"tokens, run folder {run_dir}")  # fmt: skip
    batches, probe = _mixture(args, tokenizer, root, files, train_tokens, val_tokens, run_dir)
    summary = train(model, train_tokens, val_tokens, cfg, run_dir, kind, teacher=teacher,
                    batches=batches, probe=probe)  # fmt: skip
    summary["config"] = asdict(cfg)
    if batches is not None:
        summary["mix"] = asdict(batches.mix)
    if summary["stopped_early"] and not save_partial:
        print(f"{kind}: stopped at step {summary['steps']} (--max-minutes); rerun the same "
              "command to continue")  # fmt: skip
        return 0
    if teacher is not None:
        summary["teacher"] = args.target
    for name in ("init", "tokens"):
        if getattr(args, name, None):
            summary[name] = getattr(args, name)
    _save(model, tokenizer, args, root, files, summary, kind)
    if kind == "draft":
        from ..proposers.draft_model import write_vocab_ranking

        source = args.tokens or "the training split"
        write_vocab_ranking(args.out, train_tokens, len(tokenizer), DRAFT_VOCAB, source)
    print(f"{kind} saved to {args.out}; measure it with `leapdecode train evaluate`")
    return 0


def _mixture(args, tokenizer, root, files, train_tokens, val_tokens, run_dir):
    """The copy-teaching batch mixture and the copy probe (target training only)."""
    from .mix import Batches, Mix, load_or_build_revisions
    from .signals import CopyProbe

    repeat, edit = getattr(args, "repeat_share", 0.0), getattr(args, "edit_share", 0.0)
    try:
        mix = Mix(repeat, edit)
    except ValueError as e:
        raise LeapDecodeError(f"--repeat-share / --edit-share: {e}") from None
    batches = None
    if repeat or edit:
        revisions = None
        if edit:
            revisions = load_or_build_revisions(tokenizer, root, files, args.seed, run_dir)
            if len(revisions[1]) == 0:
                raise LeapDecodeError(
                    "--edit-share needs functions of 6-30 lines in the training files"
                )
        batches = Batches(train_tokens, mix, args.seed, revisions)
    probe = None
    if hasattr(args, "no_copy_probe") and not args.no_copy_probe and len(val_tokens) > 256:
        probe = CopyProbe(tokenizer, root, files, val_tokens)
    return batches, probe


def cmd_target(args) -> int:
    return _fit(args, _load_tokenizer(args.tokenizer), "target")


def cmd_draft(args) -> int:
    from transformers import AutoModelForCausalLM

    tokenizer = _load_tokenizer(args.target)
    teacher = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return _fit(args, tokenizer, "draft", teacher=teacher)


def cmd_selfgen(args) -> int:
    from .selfgen import generate_stream

    tokenizer = _load_tokenizer(args.target)
    root, files = _corpus(args)
    run_dir = os.path.join(RUNS, os.path.basename(os.path.abspath(args.target)))
    corpus_tokens = load_or_encode(tokenizer, root, files, "train", run_dir)
    stream = generate_stream(
        args.target, corpus_tokens, args.out, args.samples, args.prefix_tokens,
        args.new_tokens, args.batch, args.seed, tokenizer.eos_token_id,
    )  # fmt: skip
    print(f"{len(stream)} tokens saved to {args.out}")
    return 0


def cmd_edits(args) -> int:
    from .edits import build_stream

    if args.docs < 1 or not 0 <= args.plain_share < 1:
        raise LeapDecodeError("--docs must be >= 1 and --plain-share in [0, 1)")
    root, files = _corpus(args)
    stream = build_stream(_load_tokenizer(args.tokenizer), root, files, args.docs,
                          args.plain_share, args.seed)  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    np.save(args.out, stream)
    print(f"{len(stream)} tokens saved to {args.out}")
    return 0


def cmd_evaluate(args) -> int:
    from .evaluate import evaluate_and_write_cards

    evaluate_and_write_cards(args)
    return 0


def cmd_sizing(args) -> int:
    from .sizing import run

    return run(args)


def cmd_progress(args) -> int:
    from .progress import write

    print(write(args.run_dir, args.out))
    return 0


def cmd_heads(args) -> int:
    from .heads_command import cmd_heads as run

    return run(args)


def cmd_train(args) -> int:
    return {"tokenizer": cmd_tokenizer, "target": cmd_target, "draft": cmd_draft,
            "sizing": cmd_sizing, "progress": cmd_progress,
            "evaluate": cmd_evaluate, "selfgen": cmd_selfgen,
            "edits": cmd_edits, "medusa": cmd_heads, "eagle": cmd_heads}[args.what](args)  # fmt: skip
