"""A windowed draft (the draft-context option, proposers/draft_model.py): where more tokens
are unseen than the window, a catch-up feeds the draft model the sequence's first SINK tokens
and its latest ones only, so a long prompt's draft prefill stays short; the draft then
proposes exactly what the draft model says after that text, and the output stays the
target's."""

from __future__ import annotations

import os
import sysconfig

import pytest
import torch

from leapdecode import LeapDecoder
from leapdecode.config import SamplingParams
from leapdecode.errors import LeapDecodeError
from leapdecode.models import load_model
from leapdecode.proposers.draft_model import SINK, DraftModelProposer
from leapdecode.sequence import Sequence
from test_embedded_models import DRAFT, TARGET  # the committed toy pair

WINDOW = 64


def _long_prompt(dec: LeapDecoder) -> list[int]:
    path = os.path.join(sysconfig.get_paths()["stdlib"], "textwrap.py")
    with open(path) as f:
        text = f.read()[:3000]
    ids = dec.tokenizer.encode(text)
    assert len(ids) > 4 * WINDOW
    return ids


def _greedy(model, tokens: list[int], n: int) -> list[int]:
    """The draft model's own greedy continuation of `tokens`, fed from an empty cache."""
    model.allocate(1, len(tokens) + n + 8)
    slot, out = torch.tensor([0]), []
    logits = model.forward(torch.tensor([tokens]), slot)[0, -1]  # [V]
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = model.forward(torch.tensor([[out[-1]]]), slot)[0, -1]
    return out


def test_a_windowed_draft_proposes_what_the_draft_says_after_the_window():
    dec = LeapDecoder.from_pretrained(TARGET, draft=DRAFT)
    ids = _long_prompt(dec)
    draft = load_model(DRAFT)
    draft.allocate(1, len(ids) + 400)
    proposer = DraftModelProposer(draft, draft.vocab_size, context=WINDOW)
    seq = Sequence(0, list(ids), len(ids), SamplingParams(), 64, 4096, frozenset(), slot=0)
    proposer.add([seq])
    assert proposer.unseen(seq) == WINDOW  # what auto prices a catch-up at
    got = proposer.propose([seq], [4]).tokens[0].tolist()
    window = ids[:SINK] + ids[len(ids) - (WINDOW - SINK) :]
    assert got == _greedy(load_model(DRAFT), window, 4)
    assert int(draft.lengths(torch.tensor([0]))[0]) == WINDOW + 3  # the window, 3 drafts fed
    # the target accepts 2 drafts and adds its own token
    proposer.accepted([seq], [2])
    seq.tokens += got[:2] + [7]
    got = proposer.propose([seq], [4]).tokens[0].tolist()
    assert got == _greedy(load_model(DRAFT), window + seq.tokens[len(ids) :], 4)
    # another method's long accepted run: the draft is fed a new window after the sinks
    proposer.accepted([seq], [0])
    seq.tokens += ids[100:300]
    got = proposer.propose([seq], [4]).tokens[0].tolist()
    window = ids[:SINK] + seq.tokens[len(seq.tokens) - (WINDOW - SINK) :]
    assert got == _greedy(load_model(DRAFT), window, 4)


def test_a_windowed_draft_keeps_the_target_output():
    dec = LeapDecoder.from_pretrained(TARGET, draft=DRAFT, draft_context=WINDOW)
    ids = _long_prompt(dec)
    fed = []
    forward = dec.draft.forward

    def recording(tokens, *args, **kwargs):
        fed.append(tokens.shape[1])
        return forward(tokens, *args, **kwargs)

    dec.draft.forward = recording
    plain = dec.generate(ids, method="none", max_new_tokens=40).token_ids
    dec.generate(ids[:10], method="auto", max_new_tokens=2)  # auto's step profile, measured once
    for method in ("draft", "auto"):
        fed.clear()
        assert dec.generate(ids, method=method, k=4, max_new_tokens=40).token_ids == plain
        assert max(fed) <= WINDOW, method  # a catch-up: at most the window
    assert fed and max(fed) == WINDOW  # auto drafted with it too, from the window


def test_draft_context_bad_input_is_a_clear_error():
    for bad in (3, -1, 1.5, True):
        with pytest.raises(LeapDecodeError, match="draft_context must be") as e:
            LeapDecoder.from_pretrained(TARGET, draft=DRAFT, draft_context=bad)
        assert e.value.field == "draft_context"


def test_the_flag_is_checked_in_one_line(capsys):
    from leapdecode.cli import main

    code = main(["generate", "--method", "draft", "--draft-context", "3", "def f(x):"])
    err = capsys.readouterr().err
    assert code == 2 and "--draft-context" in err and "Traceback" not in err
    assert main(["generate", "--method", "draft", "--draft-context", "0", "--max-new-tokens", "4",
                 "def f(x):"]) == 0  # fmt: skip
