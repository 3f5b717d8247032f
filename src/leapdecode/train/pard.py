"""`leapdecode train pard`: a parallel draft (PARD) fine-tuned from a draft model.

Each training window [x_0 .. x_T] becomes the input [x_0 .. x_{T-k}, m, .., m] (k - 1 copies
of the mask token m at the end): the prediction after x_{T-k} is scored against x_{T-k+1}
(draft 1) and after the j-th mask against x_{T-k+1+j} (draft j + 1), as the proposer
(proposers/pard.py) reads it; the real positions keep their plain next-token loss, so the
draft stays a draft. Trained with k masks, it drafts any k' <= k the same way (attention is
causal: fewer masks change nothing before them).

The mask token is a token the draft never proposes: the least frequent one of its
`draft_vocab.json` ranking (no new embedding row, so the vocabulary stays the target's, as
vLLM's draft_model wants), written to config.json as `pard_token` with `pard_max_k`.
Resumable (train/teacher.py's `fit`), with a progress bar; the card gives the validation
accuracy of every draft position.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch
import torch.nn.functional as F

from ..cache import cache_dir
from ..errors import LeapDecodeError
from ..proposers.draft_model import VOCAB_FILE, read_vocab_ranking

COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", VOCAB_FILE,
          "corpus_manifest.json")  # fmt: skip


def add_parser(what, data_args) -> None:
    p = what.add_parser("pard", help="a parallel draft (PARD) fine-tuned from a draft model")
    data_args(p)
    p.add_argument("--draft", required=True, help="the draft model folder to start from")
    p.add_argument("--out", required=True, help="output folder (Hugging Face format)")
    p.add_argument(
        "--run-dir",
        default=None,
        help="checkpoints (default ~/.cache/leapdecode/runs/NAME, or under $LEAPDECODE_CACHE)",
    )
    p.add_argument("--tokens", default=None, help="train on this token stream (.npy)")
    p.add_argument("--k", type=int, default=8, help="draft tokens a forward it learns (default 8)")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=128, help="window length in tokens")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--mask-token", type=int, default=None,
                   help="the mask token id (default: the draft's least frequent token)")  # fmt: skip


def pard_inputs(batch: torch.Tensor, k: int, mask: int) -> tuple[torch.Tensor, int]:
    """batch [B, T+1] windows -> (inputs [B, T] with the last k - 1 replaced by the mask, the
    number of real inputs T - k + 1)."""
    t = batch.shape[1] - 1
    real = t - k + 1
    inputs = batch[:, :t].clone()
    inputs[:, real:] = mask
    return inputs, real


def pard_loss(model, batch: torch.Tensor, k: int, mask: int) -> tuple[torch.Tensor, dict]:
    """Next-token loss on the real positions plus the k drafts' loss; accuracy by draft."""
    inputs, real = pard_inputs(batch, k, mask)
    logits = model(input_ids=inputs).logits.float()  # [B, T, V]
    plain = F.cross_entropy(logits[:, : real - 1].flatten(0, 1), batch[:, 1:real].flatten())
    block = logits[:, real - 1 :]  # [B, k, V]: draft 1 .. k
    labels = batch[:, real:]  # [B, k]
    drafts = F.cross_entropy(block.flatten(0, 1), labels.flatten())
    hit = (block.argmax(-1) == labels).float().mean(0)  # [k]
    return plain + drafts, {f"acc{j + 1}": float(hit[j]) for j in range(min(k, 4))}


@torch.no_grad()
def accuracy_by_position(model, tokens: np.ndarray, k: int, mask: int, context: int) -> list:
    """Validation: how often each draft position's argmax is the next text token."""
    from .data import batch_at

    model.eval()
    hits = torch.zeros(k)
    n = 0
    for i in range(16):
        b = torch.from_numpy(batch_at(tokens, i, 16, context, seed=4321))
        inputs, real = pard_inputs(b, k, mask)
        block = model(input_ids=inputs).logits[:, real - 1 :]
        hits += (block.argmax(-1) == b[:, real:]).float().sum(0)
        n += b.shape[0]
    return [round(float(h) / n, 4) for h in hits]


def pick_mask(draft: str, vocab_size: int, given: int | None) -> int:
    if given is not None:
        if not 0 <= given < vocab_size:
            raise LeapDecodeError(f"--mask-token must be in 0..{vocab_size - 1}, got {given}")
        return given
    ranking = read_vocab_ranking(draft)
    return int(ranking["ranked_token_ids"][-1]) if ranking else vocab_size - 1


def cmd_pard(args) -> int:
    from transformers import AutoModelForCausalLM

    from .heads_command import token_streams
    from .teacher import fingerprint, fit

    if not os.path.isfile(os.path.join(args.draft, "config.json")):
        raise LeapDecodeError(f"--draft {args.draft!r} is not a model folder (no config.json)")
    if not 2 <= args.k <= 32 or args.context < args.k + 8 or args.steps < 1 or args.batch < 1:
        raise LeapDecodeError(
            "--k must be in 2..32, --context at least k + 8, --steps and --batch >= 1"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    name = os.path.basename(os.path.abspath(args.out))
    run_dir = args.run_dir or cache_dir("runs", name)
    model = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32)
    mask = pick_mask(args.draft, model.config.vocab_size, args.mask_token)
    train, val = token_streams(args, args.draft, run_dir)
    stamp = fingerprint(args.draft, tokens=args.tokens, tokens_len=len(train), k=args.k, mask=mask)
    summary = fit(model, lambda b: pard_loss(model, b, args.k, mask), train, steps=args.steps,
                  batch=args.batch, context=args.context, lr=args.lr, run_dir=run_dir,
                  desc="pard", seed=args.seed, stamp=stamp)  # fmt: skip
    accuracy = accuracy_by_position(model, val, args.k, mask, args.context)
    model.config.pard_token = mask
    model.config.pard_max_k = args.k
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out)
    for f in COPIED:
        if os.path.isfile(os.path.join(args.draft, f)):
            shutil.copy(os.path.join(args.draft, f), os.path.join(args.out, f))
    report = {"from": os.path.basename(os.path.abspath(args.draft)), "mask_token": mask,
              "k": args.k, "accuracy_by_position": accuracy, "training": summary,
              "data": args.tokens or "the corpus training split"}  # fmt: skip
    with open(os.path.join(args.out, "evaluation.json"), "w") as f:
        json.dump(report, f, indent=1)
    write_card(args.out, report)
    print(f"parallel draft saved to {args.out}: validation accuracy by position {accuracy}")
    return 0


def write_card(out: str, r: dict) -> None:
    t = r["training"]
    acc = r["accuracy_by_position"]
    lines = [
        "---",
        "license: apache-2.0",
        "library_name: transformers",
        "tags: [code, python, speculative-decoding, leapdecode, pard]",
        "---",
        "",
        f"# {os.path.basename(os.path.abspath(out))}",
        "",
        f"A parallel draft (PARD) fine-tuned from `{r['from']}` by `leapdecode train pard`: one "
        f"forward over the context and up to {r['k'] - 1} copies of the mask token "
        f"{r['mask_token']} (`pard_token` in config.json) proposes up to {r['k']} tokens "
        "(`leapdecode generate --method pard --draft THIS`; vLLM: `draft_model` with "
        "`parallel_drafting`).",
        "",
        "| | |",
        "|---|---|",
        f"| data | {r['data']} |",
        f"| steps | {t['steps']} (batch {t['batch']} x {t['context']} tokens, lr {t['lr']}) |",
        f"| training time | {t['train_seconds'] / 3600:.2f} h on CPU |",
        f"| final training loss | {t['final_loss']:.3f} |",
        "",
        "Validation accuracy of each draft position (its argmax is the next text token):",
        "",
        "| " + " | ".join(f"draft {j + 1}" for j in range(len(acc))) + " |",
        "|" + "---|" * len(acc),
        "| " + " | ".join(f"{a:.3f}" for a in acc) + " |",
        "",
    ]
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("\n".join(lines))
