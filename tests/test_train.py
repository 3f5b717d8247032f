"""Tiny end-to-end training (tokenizer -> target -> draft -> load -> generate), and resume."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from leapdecode.cli import main
from leapdecode.train import corpus, loop

FILES = ["textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "heapq.py",
         "colorsys.py", "keyword.py", "cmd.py", "copy.py"]  # fmt: skip
TINY = ["--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
        "--intermediate", "64", "--context", "64", "--batch", "2", "--threads", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    for name in FILES:
        shutil.copy(os.path.join(corpus.stdlib_dir(), name), d / name)
    files = corpus.scan(str(d), val_percent=30)
    assert {f.split for f in files} == {"train", "validation"}
    return str(d)


def test_tokenizer_target_draft_end_to_end(tmp_path, data_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from leapdecode import LeapDecoder

    tok, tgt, dr = (str(tmp_path / n) for n in ("tok", "target", "draft"))
    common = ["--data", data_dir, "--val-percent", "30"]
    assert main(["train", "tokenizer", *common, "--vocab-size", "300", "--out", tok]) == 0
    assert main(["train", "target", *common, "--tokenizer", tok, "--out", tgt,
                 "--run-dir", str(tmp_path / "run_t"), "--steps", "8", "--eval-every", "4", *TINY]) == 0  # fmt: skip
    assert main(["train", "draft", *common, "--target", tgt, "--out", dr,
                 "--run-dir", str(tmp_path / "run_d"), "--steps", "4", "--eval-every", "2", *TINY]) == 0  # fmt: skip

    for path in (tgt, dr):
        for name in ("config.json", "model.safetensors", "generation_config.json",
                     "tokenizer.json", "corpus_manifest.json", "training_summary.json"):  # fmt: skip
            assert os.path.isfile(os.path.join(path, name)), name
    manifest = json.load(open(os.path.join(tgt, "corpus_manifest.json")))
    assert manifest["n_validation"] >= 1 and len(manifest["sha256"]) == 64

    hf = AutoModelForCausalLM.from_pretrained(tgt, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(tgt)
    assert AutoModelForCausalLM.from_pretrained(dr).config.vocab_size == hf.config.vocab_size
    dec = LeapDecoder.from_pretrained(tgt, draft=dr)
    ids = hf_tok.encode("def wrap(text):")
    out = dec.generate(ids, method="draft", k=3, max_new_tokens=12)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))  # fmt: skip
    assert out.token_ids == ref[0, len(ids) :].tolist()

    assert (
        main(["train", "evaluate", "--target", tgt, "--baseline", str(tmp_path / "none.json")]) == 2
    )
    baseline = tmp_path / "v0.json"
    baseline.write_text(json.dumps({"target": {"looping_share": 1.5}}))  # any share is lower
    assert main(["train", "evaluate", "--data", data_dir, "--target", tgt, "--draft", dr,
                 "--prompts", "1", "--baseline", str(baseline)]) == 0  # fmt: skip
    report = json.load(open(os.path.join(dr, "evaluation.json")))
    assert report["target"]["baseline_looping_share"] == 1.5
    assert (
        "| loops less than the earlier target (`v0.json`: 1.500) |"
        in open(os.path.join(tgt, "README.md")).read()
    )
    assert 0 <= report["draft"]["greedy_agreement"] <= 1
    assert report["target"]["bits_per_byte"] > 0 and report["xz_9e_bits_per_byte"] > 0
    card = open(os.path.join(tgt, "README.md")).read()
    assert "bits per byte" in card and manifest["sha256"][:16] in card


def test_killed_run_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens = torch.randint(0, 50, (5000,), generator=torch.Generator().manual_seed(0)).numpy()
    cfg = loop.TrainConfig(steps=6, batch=2, context=16, lr=1e-2, warmup=1, eval_every=3,
                           eval_batches=1, checkpoint_every=2, bf16=False)  # fmt: skip

    def model():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                                            num_hidden_layers=1, num_attention_heads=2))  # fmt: skip

    straight = model()
    loop.train(straight, tokens, tokens, cfg, str(tmp_path / "straight"), "straight")

    real_batch_at = loop.batch_at

    def dies_at_step_5(toks, step, *a, **kw):
        if step == 5:
            raise KeyboardInterrupt  # the run is killed during step 5
        return real_batch_at(toks, step, *a, **kw)

    monkeypatch.setattr(loop, "batch_at", dies_at_step_5)
    killed = model()
    with pytest.raises(KeyboardInterrupt):
        loop.train(killed, tokens, tokens, cfg, str(tmp_path / "killed"), "killed")
    state = torch.load(tmp_path / "killed" / "checkpoint.pt", weights_only=False)
    assert state["step"] == 4  # the last checkpoint before the kill

    monkeypatch.setattr(loop, "batch_at", real_batch_at)
    resumed = model()  # a fresh process: new weights, then the checkpoint is loaded
    summary = loop.train(resumed, tokens, tokens, cfg, str(tmp_path / "killed"), "resumed")
    assert summary["steps"] == 6
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_selfgen_then_draft_fine_tune_on_the_targets_own_text(tmp_path, data_dir):
    """`train selfgen` writes prefix + the target's greedy continuation; `train draft --init
    --tokens` fine-tunes an existing draft on that stream."""
    import numpy as np
    from transformers import AutoTokenizer

    from leapdecode import LeapDecoder

    tok, tgt, dr, dr2 = (str(tmp_path / n) for n in ("tok", "target", "draft", "draft2"))
    common = ["--data", data_dir, "--val-percent", "30"]
    assert main(["train", "tokenizer", *common, "--vocab-size", "300", "--out", tok]) == 0
    assert main(["train", "target", *common, "--tokenizer", tok, "--out", tgt,
                 "--run-dir", str(tmp_path / "run_t"), "--steps", "4", *TINY]) == 0  # fmt: skip
    assert main(["train", "draft", *common, "--target", tgt, "--out", dr,
                 "--run-dir", str(tmp_path / "run_d"), "--steps", "2", *TINY]) == 0  # fmt: skip
    stream = str(tmp_path / "self.npy")
    assert main(["train", "selfgen", *common, "--target", tgt, "--out", stream, "--samples", "4",
                 "--batch", "2", "--prefix-tokens", "16", "--new-tokens", "24"]) == 0  # fmt: skip
    data = np.load(stream)
    eos = AutoTokenizer.from_pretrained(tgt).eos_token_id
    docs = np.split(data, np.flatnonzero(data == eos))[1:]
    assert len(docs) >= 4  # 2 batches of 2 (a continuation may itself end with eos)
    first = [int(t) for t in docs[0][1:]]
    dec = LeapDecoder.from_pretrained(tgt)
    want = dec.generate(first[:16], max_new_tokens=24).token_ids
    assert first[16:] == want[: len(first) - 16]  # the target's own greedy continuation

    assert main(["train", "draft", *common, "--target", tgt, "--init", dr, "--tokens", stream,
                 "--out", dr2, "--run-dir", str(tmp_path / "run_d2"), "--steps", "2",
                 *TINY]) == 0  # fmt: skip
    summary = json.load(open(os.path.join(dr2, "training_summary.json")))
    assert summary["init"] == dr and summary["tokens"] == stream
    # the card's lineage: the stage behind --init, then this one
    first, second = summary["lineage"]
    assert (first["stage"], first["what"]) == (
        0,
        f"distilled from `{os.path.basename(tgt)}`, on the training split",
    )
    assert second["stage"] == 1 and "`self.npy` (the target's own continuations)" in second["what"]
    assert summary["total_train_seconds"] == first["train_seconds"] + second["train_seconds"]


def test_revision_documents_stream(data_dir):
    from transformers import AutoTokenizer

    from leapdecode.cli import DEFAULT_MODELS
    from leapdecode.train.edits import build_stream

    tok = AutoTokenizer.from_pretrained(os.path.join(DEFAULT_MODELS, "leap-code-target"))
    files = corpus.scan(data_dir, val_percent=30)
    stream = build_stream(tok, data_dir, files, docs=5, plain_share=0.5, seed=0)
    docs = [tok.decode(d) for d in np.split(stream, np.flatnonzero(stream == tok.eos_token_id))[1:]]
    revisions = [d for d in docs if d.startswith("<|endoftext|># Original:")]
    assert len(revisions) >= 5 and len(docs) > len(revisions)  # plain files mixed in
    body = revisions[0].split("# Original:\n", 1)[1]
    original, rest = body.split("\n# Task: rename the argument `", 1)
    old, new = rest.split("`; change nothing else.")[0].split("` to `")
    revised = rest.split("# Revised:\n", 1)[1]
    assert revised.replace(new, old) == original
    train_names = {f.path for f in files if f.split == "train"}
    assert train_names  # documents come from training files only (see edits.py)


def test_progress_continues_a_fine_tune_on_the_tokens_axis(tmp_path):
    from leapdecode.train.progress import read_runs, write

    copy = {"first_showing_loss": 3.0, "second_showing_loss": 1.0, "copy_score": 0.5,
            "revision_exact": 0.0}  # fmt: skip
    for name, steps in (("main", (100, 200)), ("ft", (50, 100))):
        (tmp_path / name).mkdir()
        rows = [{"step": s, "tokens_seen": s * 1000, "context": 256, "batch": 8,
                 "val_loss": 2.0, "copy": copy} for s in steps]  # fmt: skip
        rows.append({"step": steps[-1] + 1, "tokens_seen": (steps[-1] + 1) * 1000})  # no eval
        (tmp_path / name / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = [str(tmp_path / "main"), str(tmp_path / "ft")]
    evals = read_runs(runs)
    # the fine-tune starts where the main run's log ends (201,000 tokens)
    assert [(e["run"], e["tokens_seen"]) for e in evals] == [
        (0, 100_000), (0, 200_000), (1, 251_000), (1, 301_000)
    ]  # fmt: skip
    png = write(runs, str(tmp_path / "out"))
    assert open(png, "rb").read(4) == b"\x89PNG"
    md = (tmp_path / "out" / "copy_signals.md").read_text()
    assert "0 `main`, 1 `ft`" in md and "| 1 | 100 | 0.30 M |" in md
