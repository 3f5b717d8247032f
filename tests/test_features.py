"""A head trained from its target's features kept on disk (train/features.py, `train eagle
--features`): the kept features are the target's own (transformers' hidden states and greedy
tokens), a killed extraction continues where it stopped, and a head's loss from them is the
loss it gets with the teacher running every batch."""

import json
import os

import numpy as np
import pytest
import torch

import helpers
from leapdecode.cli import main
from leapdecode.errors import LeapDecodeError
from leapdecode.models.eagle import Eagle3Head
from leapdecode.models.loader import load_model
from leapdecode.train.eagle import _unroll, eagle_loss, new_head, unroll_features
from leapdecode.train.features import (
    FeatureShards,
    Labeller,
    extract,
    shard_path,
    window_features,
    window_slots,
)
from leapdecode.train.teacher import TargetTables, Teacher

LAYERS = (0, 1)  # the toy target has 2 layers (transformers: 2 = after the final norm)


def _stream(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, helpers.VOCAB, n).astype(np.int32)


def test_kept_features_are_the_targets_own(target_dir, hf_target, tmp_path):
    model = load_model(target_dir, dtype="float32")
    folder = str(tmp_path / "features")
    stream = _stream(5 * 33 + 7)  # five windows of 33 tokens, and a rest no window takes
    kw = dict(layers=LAYERS, context=32, windows=9, stamp={"target": "toy"}, shard_windows=2)
    extract(model, stream, folder, **{**kw, "windows": 3})  # its last shard holds 1 window
    assert extract(model, stream, folder, **kw)["windows"] == 5  # that shard is made whole
    shards = FeatureShards(folder)
    assert shards.windows == 5 and all(os.path.isfile(shard_path(folder, i)) for i in range(3))
    for w in range(5):
        f = shards.window(w)
        at = int(window_slots(len(stream), 33)[w]) * 33
        window = torch.from_numpy(stream[at : at + 33].astype(np.int64))
        assert torch.equal(f.tokens[0], window)
        with torch.no_grad():
            ref = hf_target(window[None], output_hidden_states=True)
        for j, i in enumerate(LAYERS):
            torch.testing.assert_close(f.aux[:, :, j], ref.hidden_states[i])
        torch.testing.assert_close(f.final, ref.hidden_states[-1])
        assert torch.equal(f.greedy, ref.logits.argmax(-1))
    # a killed extraction (a shard missing) is refused until it is run again, which writes
    # only what is missing
    first = open(shard_path(folder, 0), "rb").read()
    os.remove(shard_path(folder, 1))
    with pytest.raises(LeapDecodeError, match="run the extraction again"):
        FeatureShards(folder)
    extract(model, stream, folder, **kw)
    again = FeatureShards(folder)
    assert torch.equal(again.window(3).aux, shards.window(3).aux)
    assert open(shard_path(folder, 0), "rb").read() == first
    b = again.batch(7, 3, seed=1)  # a batch is a pure function of (seed, step)
    assert b.aux.shape == (3, 33, len(LAYERS), model.config.hidden_size)
    assert torch.equal(b.tokens, again.batch(7, 3, seed=1).tokens)
    with pytest.raises(LeapDecodeError, match="another target or other settings"):
        extract(model, stream, folder, **{**kw, "stamp": {"target": "other"}})


def test_a_head_learns_the_same_from_kept_features(target_dir, tmp_path):
    """The same windows, the same head: its loss and accuracies from the kept features
    (labels through the LM head rows of its draft vocabulary) are those it gets with the
    teacher running the batch (labels from the full logits)."""
    teacher, tables = Teacher(target_dir), TargetTables(target_dir)
    torch.manual_seed(0)
    head = new_head(tables, torch.arange(0, helpers.VOCAB, 3))
    assert torch.equal(head.lm_head.weight, teacher.output_weight[head.draft_ids])
    model = load_model(target_dir, dtype="float32")
    model.allocate(1, 33)
    stream = torch.from_numpy(_stream(66, seed=3).astype(np.int64))
    b = stream.view(2, 33)  # [B, T+1]
    parts = [window_features(model, row, head.aux_layers) for row in b]
    kept = type(parts[0]).cat(parts)
    labeller = Labeller(tables.output_weight, head.draft_ids)
    live, live_m = eagle_loss(lambda x: _unroll(head, teacher, x, 3))(b)
    disk, disk_m = eagle_loss(lambda f: unroll_features(head, f, tables.embed, labeller, 3))(kept)
    torch.testing.assert_close(disk, live, atol=1e-4, rtol=1e-4)
    assert disk_m == live_m


def test_train_eagle_from_features(target_dir, tmp_path):
    root = str(tmp_path)
    corpus = os.path.join(root, "corpus")
    os.makedirs(corpus)
    for i, text in enumerate(helpers.stdlib_text()):
        with open(os.path.join(corpus, f"f{i}.py"), "w", encoding="utf-8") as f:
            f.write(text)
    out, feats = os.path.join(root, "eagle"), os.path.join(root, "features")
    argv = ["train", "eagle", "--target", target_dir, "--out", out, "--run-dir", out + "-run",
            "--data", corpus, "--val-percent", "20", "--steps", "6", "--batch", "4",
            "--context", "64", "--eval-prompts", "0", "--threads", "1", "--ttt-steps", "2",
            "--draft-vocab", "256", "--features", feats, "--feature-windows", "8"]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        assert main(argv) == 0
        manifest = json.load(open(os.path.join(feats, "train", "manifest.json")))
        assert manifest["windows"] == 8 and manifest["dtype"] == "bfloat16"
        assert FeatureShards(os.path.join(feats, "validation")).windows >= 1
        head = Eagle3Head.load(out)
        report = json.load(open(os.path.join(out, "evaluation.json")))
        assert len(report["accuracy"]["top1_by_depth"]) == 2
        assert len(open(out + "-run/log.jsonl").read().splitlines()) == 6
        # run again: the features are kept, the run is finished
        shard = shard_path(os.path.join(feats, "train"), 0)
        stamp = os.path.getmtime(shard)
        assert main(argv) == 0
        assert os.path.getmtime(shard) == stamp
        assert torch.equal(Eagle3Head.load(out).draft_ids, head.draft_ids)
    finally:
        torch.set_num_threads(threads)


def test_a_time_budget_sets_the_steps(tmp_path):
    """`fit(budget_s=...)` (`train eagle --hours`): the steps become those that fit the budget
    at the measured pace, the run ends with a checkpoint there, and a resumed run with the
    budget spent runs no more."""
    import time

    from leapdecode.train.teacher import fit

    module = torch.nn.Linear(4, 1)

    def loss_step(b):
        time.sleep(0.05)
        return module(b.float()[:, :4]).pow(2).mean(), {}

    run = str(tmp_path / "run")
    kw = dict(steps=10_000, batch=2, context=8, lr=1e-3, run_dir=run, desc="t", budget_s=0.5)
    summary = fit(module, loss_step, np.arange(100), **kw)
    assert 3 <= summary["steps"] <= 12
    assert len(open(os.path.join(run, "log.jsonl")).read().splitlines()) == summary["steps"]
    assert (
        torch.load(os.path.join(run, "checkpoint.pt"), weights_only=False)["step"]
        == (summary["steps"])
    )
    assert fit(module, loss_step, np.arange(100), **kw)["steps"] == summary["steps"]
