"""`leapdecode train draft-vocab` (train/draft_vocab.py): a draft's vocabulary ranked by frequency
in a corpus, its head cut to the recommended N, the output still the target's."""

from __future__ import annotations

import json
import os
import shutil
import sysconfig

import numpy as np

from leapdecode import LeapDecoder
from leapdecode.cli import main
from leapdecode.train.draft_vocab import rank, recommend
from test_embedded_models import DRAFT, TARGET  # the committed toy pair


def test_ranking_puts_the_kept_ids_first_and_recommends_by_coverage():
    counts = np.array([5, 0, 90, 3, 2])
    ranked = rank(counts, [1])
    assert ranked.tolist() == [1, 2, 0, 3, 4]
    assert recommend(counts, ranked, 0.9) == 5  # a multiple of 1,024 or the whole vocabulary


def test_a_draft_ranked_on_a_corpus_drafts_from_its_top_tokens(tmp_path, capsys):
    draft = tmp_path / "draft"
    shutil.copytree(DRAFT, draft)
    (draft / "draft_vocab.json").unlink()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    src = os.path.join(sysconfig.get_paths()["stdlib"], "json")
    for name in sorted(os.listdir(src)):
        if name.endswith(".py"):
            shutil.copy(os.path.join(src, name), corpus / name)
    argv = ["train", "draft-vocab", "--draft", str(draft), "--data", str(corpus),
            "--val-percent", "30", "--coverage", "0.99"]  # fmt: skip
    assert main(argv) == 0
    assert "the draft's head keeps" in capsys.readouterr().out
    got = json.loads((draft / "draft_vocab.json").read_text())
    vocab = json.loads((draft / "config.json").read_text())["vocab_size"]
    ranked = got["ranked_token_ids"]
    assert sorted(ranked) == list(range(vocab))  # every token, once
    assert got["recommended"] % 1024 == 0 or got["recommended"] == vocab
    assert got["coverage_of_recommended"] >= 0.99
    assert got["held_out_coverage_of_recommended"] is not None
    prompt = "import json\n\n\ndef load(path):\n"
    dec = LeapDecoder.from_pretrained(TARGET, draft=str(draft))  # the recommended head
    assert dec.draft.head_ids is not None and len(dec.draft.head_ids) == got["recommended"]
    plain = dec.generate(prompt, method="none", max_new_tokens=40).token_ids
    assert dec.generate(prompt, method="draft", k=4, max_new_tokens=40).token_ids == plain


def test_draft_vocab_bad_input_is_one_line(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    code = main(["train", "draft-vocab", "--draft", DRAFT, "--data", str(empty)])
    err = capsys.readouterr().err
    assert code == 2 and "no .py files" in err and "Traceback" not in err
    code = main(["train", "draft-vocab", "--draft", DRAFT, "--coverage", "2"])
    assert code == 2 and "--coverage must be in (0, 1]" in capsys.readouterr().err
    code = main(["train", "draft-vocab", "--draft", DRAFT, "--recommended", "-1"])
    assert code == 2 and "--recommended must be >= 0" in capsys.readouterr().err
