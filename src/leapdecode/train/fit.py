"""Training a model from the command's flags: the tokenizer and corpus they name, a fresh
Llama (or --init) trained resumably and saved with its card's lineage. Shared by the train
commands (commands.py), the heads' training (heads_command.py) and model sizing (sizing.py)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import numpy as np
import torch

from ..cache import cache_dir
from ..errors import LeapDecodeError
from ..models.loader import cpu_has_fast_bf16
from . import corpus
from .data import load_or_encode
from .loop import TrainConfig, train

DRAFT_VOCAB = 2048  # tokens a draft proposes by default (the most frequent in its data)


def extensions(args) -> tuple[str, ...]:
    return tuple(e if e.startswith(".") else "." + e for e in args.ext.split(",") if e)


def _train_config(args) -> TrainConfig:
    for name in ("steps", "batch", "context", "shard_mb"):
        if getattr(args, name, 1) < 1:
            raise LeapDecodeError(f"--{name.replace('_', '-')} must be >= 1")
    if args.lr <= 0:
        raise LeapDecodeError("--lr must be > 0")
    stages = parse_schedule(args.schedule, args.context) if args.schedule else ()
    steps = sum(s for _, _, s in stages) if stages else args.steps
    warmup = args.warmup if args.warmup is not None else max(1, steps * 6 // 100)
    device = resolve_device(getattr(args, "device", "cpu"))
    cuda = device.startswith("cuda")
    auto_bf16 = torch.cuda.is_bf16_supported() if cuda else cpu_has_fast_bf16()
    bf16 = {"auto": auto_bf16, "bf16": True, "fp32": False}[args.precision]
    fused = getattr(args, "fused_adamw", "auto")
    return TrainConfig(
        steps=steps,
        batch=args.batch,
        context=args.context,
        lr=args.lr,
        warmup=warmup,
        seed=args.seed,
        eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every,
        bf16=bf16,
        threads=args.threads,
        ce_weight=getattr(args, "ce_weight", 0.0),
        stages=stages,
        compile=args.compile,
        max_seconds=60 * args.max_minutes,
        device=device,
        fused_adamw=cuda if fused == "auto" else fused == "on",
    )


def resolve_device(name: str) -> str:
    """--device: auto (cuda when a GPU is visible), cpu, cuda or cuda:N; a clear error when
    CUDA is asked for and not there."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise LeapDecodeError(
            f"--device {name}: torch sees no CUDA device here (torch {torch.__version__}); "
            "use --device cpu, or install a CUDA build of torch"
        )
    if name != "cpu" and not name.startswith("cuda"):
        raise LeapDecodeError(f"--device {name!r}: use auto, cpu, cuda or cuda:N")
    return name


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
    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise LeapDecodeError("--hidden must divide by --heads, and --heads by --kv-heads")
    shape = (args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate)
    return llama_config(shape, len(tokenizer), tokenizer.eos_token_id, args.context)


def llama_config(shape, vocab: int, eos: int, context: int):
    """The Llama this project trains: shape (hidden, layers, heads, kv heads, intermediate),
    tied embeddings, the end-of-text id as bos, eos and pad."""
    from transformers import LlamaConfig

    hidden, layers, heads, kv_heads, intermediate = shape
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
    )


def load_tokenizer(path: str):
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


def corpus_files(args):
    root = args.data or corpus.stdlib_dir()
    return root, corpus.scan(root, extensions(args), args.val_percent)


def _save(model, tokenizer, args, root, files, summary: dict, kind: str) -> None:
    from transformers import GenerationConfig

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    os.makedirs(args.out, exist_ok=True)
    shard = getattr(args, "shard_mb", 16) * 2**20  # bytes a file at most (one larger tensor aside)
    model.to(dtype[args.save_dtype]).save_pretrained(
        args.out, safe_serialization=True, max_shard_size=shard
    )
    model.float()
    tokenizer.save_pretrained(args.out)
    eos = tokenizer.eos_token_id
    GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos).save_pretrained(args.out)
    m = corpus.save_manifest(root, files, args.out)
    summary = {
        **summary,
        "kind": kind,
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus_manifest_sha256": m["sha256"],
        "save_dtype": args.save_dtype,
    }
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
        what.append(
            f"with {mix.get('repeat_share', 0):.0%} repeated spans and "
            f"{mix.get('edit_share', 0):.0%} revision documents"
        )
    if len(stages) > 1:
        what.append("windows " + " -> ".join(f"{b} x {ctx}" for ctx, b, _ in stages))
    return {
        "what": ", ".join(what),
        "steps": summary.get("steps", 0),
        "tokens_seen": summary.get("tokens_seen", 0),
        "train_seconds": summary.get("train_seconds", 0.0),
        "context": stages[-1][0],
        "lr": c.get("lr"),
    }


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


def fit(args, tokenizer, kind: str, teacher=None, save_partial: bool = False) -> int:
    """Build a fresh Llama from the flags (or --init), train it resumably, save it to --out."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    cfg = _train_config(args)
    root, files = corpus_files(args)
    run_dir = args.run_dir or cache_dir("runs", os.path.basename(os.path.abspath(args.out)))
    train_tokens = load_or_encode(tokenizer, root, files, "train", run_dir)
    val_tokens = load_or_encode(tokenizer, root, files, "validation", run_dir)
    if getattr(args, "tokens", None):
        if not os.path.isfile(args.tokens):
            raise LeapDecodeError(
                f"{args.tokens!r} not found: make it with `leapdecode train selfgen`"
            )
        train_tokens = np.load(args.tokens, mmap_mode="r")  # read where batches fall
    if len(val_tokens) < 3:
        raise LeapDecodeError(
            f"the validation split of {root!r} is empty ({len(files)} files, "
            f"--val-percent {args.val_percent}): raise --val-percent or give more files"
        )
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
    print(
        f"{kind}: {n_params / 1e6:.2f}M parameters, {len(train_tokens) / 1e6:.2f}M training "
        f"tokens, run folder {run_dir}"
    )
    batches, probe = _mixture(args, tokenizer, root, files, train_tokens, val_tokens, run_dir)
    summary = train(
        model,
        train_tokens,
        val_tokens,
        cfg,
        run_dir,
        kind,
        teacher=teacher,
        batches=batches,
        probe=probe,
    )
    summary["config"] = asdict(cfg)
    if batches is not None:
        summary["mix"] = asdict(batches.mix)
    if summary["stopped_early"] and not save_partial:
        print(
            f"{kind}: stopped at step {summary['steps']} (--max-minutes); rerun the same "
            "command to continue"
        )
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
