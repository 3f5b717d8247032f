"""`leapdecode train tokenizer | target | draft | draft-vocab | selfgen | medusa | eagle | peagle |
evaluate | ...`."""

from __future__ import annotations

import os

from ..cache import cache_dir
from ..errors import LeapDecodeError

# The parsers are built without torch, numpy or transformers (`leapdecode --help` stays
# quick): each command imports what it runs.


HELP = "train a tokenizer, a target LM or a distilled draft"


def add_parsers(sub) -> None:
    """`train` and its subcommands on `sub` (the CLI's subparsers)."""
    fill_parser(sub.add_parser("train", help=HELP))


def fill_parser(p) -> None:
    """`train`'s subcommands and their flags on its parser `p` (the CLI fills it only when
    `train` is the command: the subcommands' modules import numpy and torch)."""
    what = p.add_subparsers(dest="what", required=True, parser_class=type(p))

    co = what.add_parser(
        "corpus", help="a code corpus from pinned PyPI packages (pip), with the stdlib"
    )
    co.add_argument("--out", required=True, help="output folder (resumable: rerun to continue)")
    co.add_argument(
        "--packages",
        default=None,
        help="package list (JSON; default: the one shipped, train/corpus_packages.json)",
    )
    co.add_argument("--no-stdlib", action="store_true", help="leave the Python stdlib out")
    co.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer (or model) folder for the token streams (default: the embedded target's)",
    )
    co.add_argument("--no-tokens", action="store_true", help="sources only, no token streams")
    co.add_argument("--only", type=int, default=0, help="the first N packages of the list only")
    co.add_argument("--val-percent", type=float, default=2.0)

    tok = what.add_parser("tokenizer", help="byte-level BPE on the training split")
    _data_args(tok)
    tok.add_argument("--vocab-size", type=int, default=8192)
    tok.add_argument(
        "--sample-percent",
        type=float,
        default=100.0,
        help="learn on this share of the training files (by path hash)",
    )
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

    dv = what.add_parser(
        "draft-vocab",
        help="rank a draft's vocabulary by frequency (FR-Spec: its LM head cut to the top N)",
    )
    _data_args(dv)
    dv.add_argument("--draft", required=True, help="the draft: a folder or a catalogue name")
    dv.add_argument(
        "--coverage",
        type=float,
        default=0.999,
        help="the recommended N covers this share of the counted tokens (default 0.999)",
    )
    dv.add_argument(
        "--recommended", type=int, default=0, help="recommend this N instead (0: by --coverage)"
    )

    pg = what.add_parser("progress", help="plot a run's loss and copy signals so far")
    pg.add_argument(
        "--run-dir",
        required=True,
        action="append",
        help="a run's folder; repeat it for a run continued by another (--init): "
        "later runs continue the tokens axis",
    )
    pg.add_argument("--out", default=os.path.join("docs", "training"))

    from .heads_command import add_parsers as add_heads

    add_heads(what, _data_args)

    from .pard import add_parser as add_pard

    add_pard(what, _data_args)

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
    ev.add_argument(
        "--no-copying",
        action="store_true",
        help="skip the copy, revision and looping tests (greedy generation)",
    )


def _data_args(p) -> None:
    p.add_argument("--data", default=None, help="folder of training files (default: Python stdlib)")
    p.add_argument("--ext", default=".py", help="file extensions to use, comma-separated")
    p.add_argument("--val-percent", type=float, default=2.0)


def _model_args(p, hidden, layers, heads, kv_heads, intermediate) -> None:
    p.add_argument("--out", required=True, help="output folder (Hugging Face format)")
    p.add_argument(
        "--run-dir",
        default=None,
        help="checkpoints and caches (default ~/.cache/leapdecode/runs/NAME, or under "
        "$LEAPDECODE_CACHE)",
    )
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--heads", type=int, default=heads)
    p.add_argument("--kv-heads", type=int, default=kv_heads)
    p.add_argument("--intermediate", type=int, default=intermediate)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--save-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--shard-mb", type=int, default=16, help="weights in safetensors files of at most this MiB"
    )


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
        "--precision",
        default="auto",
        choices=["auto", "bf16", "fp32"],
        help="bf16 autocast or float32; auto: bf16 only where the CPU has native bf16",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the training step (about 1.3x faster on CPU; needs a C++ compiler)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="auto (cuda when a GPU is visible), cpu, cuda or cuda:N",
    )
    p.add_argument(
        "--fused-adamw",
        default="auto",
        choices=["auto", "on", "off"],
        help="AdamW's fused kernel; auto: on for CUDA",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=0.0,
        help="stop after this much training time (resumable); 0 = no limit",
    )
    p.add_argument(
        "--schedule",
        default=None,
        help="stages CONTEXTxBATCH:STEPS,... (e.g. 256x8:6000,1024x4:2000); overrides "
        "--steps, --batch and --context for the batches (the model's context stays --context)",
    )


def cmd_corpus(args) -> int:
    from ..paths import TARGET_NAME, default_model
    from .pypi_corpus import PACKAGES, build, load_packages

    packages = load_packages(args.packages or PACKAGES)
    if args.only < 0:
        raise LeapDecodeError("--only must be >= 0")
    if args.only:
        packages = packages[: args.only]
    tokenizer = None if args.no_tokens else (args.tokenizer or default_model(TARGET_NAME))
    m = build(args.out, packages, not args.no_stdlib, tokenizer, args.val_percent)
    print(f"corpus in {args.out}: {m['n_packages']} packages, {m['files']} files, "
          f"{m['bytes']['train_and_validation'] / 1e6:.1f} MB to train on, "
          f"{m['bytes']['heldout'] / 1e6:.1f} MB held out")  # fmt: skip
    for split, c in (m.get("tokens") or {}).items():
        if isinstance(c, dict):
            print(
                f"  {split}: {c['tokens'] / 1e6:.1f}M tokens ({c['bytes_per_token']} bytes a token)"
            )
    return 0


def cmd_tokenizer(args) -> int:
    from .fit import extensions
    from .tokenizer import train_tokenizer

    if not 256 < args.vocab_size <= 65_536:
        raise LeapDecodeError("--vocab-size must be in 257..65536")
    if not 0 < args.sample_percent <= 100:
        raise LeapDecodeError("--sample-percent must be in (0, 100]")
    tok = train_tokenizer(
        args.data,
        args.out,
        args.vocab_size,
        extensions(args),
        args.val_percent,
        args.sample_percent,
    )
    print(f"tokenizer with {len(tok)} tokens saved to {args.out}")
    return 0


def cmd_target(args) -> int:
    from .fit import fit, load_tokenizer

    return fit(args, load_tokenizer(args.tokenizer), "target")


def cmd_draft(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from .fit import fit, load_tokenizer

    tokenizer = load_tokenizer(args.target)
    teacher = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return fit(args, tokenizer, "draft", teacher=teacher)


def cmd_selfgen(args) -> int:
    from .data import load_or_encode
    from .fit import corpus_files, load_tokenizer
    from .selfgen import generate_stream

    tokenizer = load_tokenizer(args.target)
    root, files = corpus_files(args)
    run_dir = cache_dir("runs", os.path.basename(os.path.abspath(args.target)))
    corpus_tokens = load_or_encode(tokenizer, root, files, "train", run_dir)
    stream = generate_stream(
        args.target,
        corpus_tokens,
        args.out,
        args.samples,
        args.prefix_tokens,
        args.new_tokens,
        args.batch,
        args.seed,
        tokenizer.eos_token_id,
    )
    print(f"{len(stream)} tokens saved to {args.out}")
    return 0


def cmd_edits(args) -> int:
    import numpy as np

    from .edits import build_stream
    from .fit import corpus_files, load_tokenizer

    if args.docs < 1 or not 0 <= args.plain_share < 1:
        raise LeapDecodeError("--docs must be >= 1 and --plain-share in [0, 1)")
    root, files = corpus_files(args)
    stream = build_stream(
        load_tokenizer(args.tokenizer), root, files, args.docs, args.plain_share, args.seed
    )
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


def cmd_pard(args) -> int:
    from .pard import cmd_pard as run

    return run(args)


def cmd_draft_vocab(args) -> int:
    from .draft_vocab import cmd_draft_vocab as run

    return run(args)


def cmd_train(args) -> int:
    return {
        "draft-vocab": cmd_draft_vocab,
        "corpus": cmd_corpus,
        "tokenizer": cmd_tokenizer,
        "target": cmd_target,
        "draft": cmd_draft,
        "sizing": cmd_sizing,
        "progress": cmd_progress,
        "evaluate": cmd_evaluate,
        "selfgen": cmd_selfgen,
        "edits": cmd_edits,
        "medusa": cmd_heads,
        "eagle": cmd_heads,
        "peagle": cmd_heads,
        "pard": cmd_pard,
    }[args.what](args)
