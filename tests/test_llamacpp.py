"""llama.cpp as a bench peer (bench/llamacpp_peer.py): its configurations' flags, the request
and the reply's counters, the run's labels, references and report rows; and, where llama.cpp
is built here (`bash bench/llamacpp_env.sh`), a real llama-server on the pulled SmolLM2."""

from __future__ import annotations

import os

import pytest

from leapdecode.bench import llamacpp_peer as lp
from leapdecode.bench.lossless import check
from leapdecode.bench.report import aggregate, llamacpp_rows, markdown
from leapdecode.bench.runner import Record, llamacpp_method_list
from leapdecode.cli import main
from leapdecode.errors import LeapDecodeError


def test_each_configuration_has_the_flags_its_documentation_gives():
    assert lp.server_args("llamacpp", 0, None) == []
    assert lp.server_args("llamacpp-draft", 7, "d.gguf") == [
        "-md", "d.gguf", "--spec-type", "draft-simple", "--spec-draft-n-max", "7"]  # fmt: skip
    assert lp.server_args("llamacpp-ngram", 64, None) == [
        "--spec-type", "ngram-simple", "--spec-draft-n-max", "64"]  # fmt: skip
    assert lp.server_args("llamacpp-ngram-mod", 64, None) == ["--spec-default"]
    with pytest.raises(LeapDecodeError, match="needs a draft"):
        lp.server_args("llamacpp-draft", 3, None)
    with pytest.raises(LeapDecodeError, match="unknown llama.cpp configuration"):
        lp.server_args("llamacpp-tree", 3, None)


def test_the_request_sends_token_ids_without_prompt_cache_and_counts_come_from_timings():
    body = lp.request_body([1, 2, 3], 16)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 16
    assert body["cache_prompt"] is False and body["return_tokens"] is True
    assert body["temperature"] == 0.0
    sampled = lp.request_body([1], 4, temperature=0.7, seed=5)
    assert (sampled["temperature"], sampled["seed"], sampled["top_k"], sampled["min_p"]) == (
        0.7, 5, 0, 0.0)  # fmt: skip
    # 10 tokens, 6 of 9 drafted accepted: the prefill, then 4 forwards of 1 + accepted tokens
    reply = {"tokens": list(range(10)), "timings": {"draft_n": 9, "draft_n_accepted": 6}}
    assert lp.result(reply) == (list(range(10)), 4, 9, 6)
    assert lp.result({"tokens": [7, 8], "timings": {}}) == ([7, 8], 2, 0, 0)


def test_labels_carry_the_precision_and_speculative_rows_check_against_their_plain_run():
    methods = llamacpp_method_list(
        {"llamacpp-draft": [3], "llamacpp-ngram": [64]}, ["GGUF", "BF16"], with_draft=True
    )
    labels = [m.label for m in methods]
    assert labels == ["llamacpp GGUF", "llamacpp-draft k=3 GGUF", "llamacpp-ngram k=64 GGUF",
                      "llamacpp-ngram-mod k=64 GGUF", "llamacpp BF16", "llamacpp-draft k=3 BF16",
                      "llamacpp-ngram k=64 BF16", "llamacpp-ngram-mod k=64 BF16"]  # fmt: skip
    assert all(m.llamacpp and not m.ours and not m.vllm for m in methods)
    draftless = llamacpp_method_list({"llamacpp-draft": [3], "llamacpp-ngram": [8]}, ["BF16"],
                                     with_draft=False)  # fmt: skip
    assert [m.name for m in draftless] == ["llamacpp", "llamacpp-ngram", "llamacpp-ngram-mod"]

    def rec(label, name, k, tokens, secs=1.0, forwards=None):
        n = len(tokens)
        return Record("completion", "p0", label, name, k, seconds=[secs], tokens=tokens,
                      target_forwards=forwards or n, decode_steps=(forwards or n) - 1,
                      accepted=n - (forwards or n))  # fmt: skip

    records = [
        rec("none", "none", 0, [1, 2, 3, 4], secs=2.0),
        rec("llamacpp BF16", "llamacpp", 0, [1, 2, 9, 9]),  # differs from ours at position 2
        rec("llamacpp-ngram k=64 BF16", "llamacpp-ngram", 64, [1, 2, 9, 9], 0.5, forwards=2),
        rec("llamacpp-draft k=3 BF16", "llamacpp-draft", 3, [1, 2, 9, 8], 0.8, forwards=2),
    ]
    seen = []

    def logits_fn(ours, ids):
        import torch

        seen.append((ours, list(ids)))
        out = torch.zeros(16)
        out[3], out[9] = 5.0, 1.0  # ours' token 3 wins by far: not a tie
        return out

    mism = check(records, logits_fn, __import__("torch").float32, {"p0": [0]})
    assert mism[("completion", "llamacpp BF16")]["non_tie"] == 1  # against ours: reported
    assert ("completion", "llamacpp-ngram k=64 BF16") not in mism  # equal to its plain run
    assert mism[("completion", "llamacpp-draft k=3 BF16")]["details"][0]["reference"] == (
        "llamacpp BF16")  # fmt: skip

    cells = aggregate(records, {"c": None}, mism)
    names = {c["method"]: c["name"] for c in cells}
    assert names["llamacpp-ngram k=64 BF16"] == "llamacpp-ngram BF16"
    rows = llamacpp_rows(cells)
    plain = next(r for r in rows if r["ours"]["name"] == "none" and r["llamacpp"]["name"] ==
                 "llamacpp BF16")  # fmt: skip
    assert plain["ratio"] == pytest.approx((4 / 2.0) / (4 / 1.0))
    text = markdown(cells, {"title": "t", "setup": "s"})
    assert "## Against llama.cpp" in text and "llamacpp-ngram k=64 BF16" in text


def test_precisions_follow_where_the_models_came_from(tmp_path, capsys):
    """GGUF rows run a catalogue model's own file: by default left out, with a line, for a
    folder not pulled from the catalogue; asked for there, one clear error before loading."""
    pulled, plain = tmp_path / "pulled", tmp_path / "plain"
    pulled.mkdir(), plain.mkdir()
    (pulled / "leapdecode-pull.json").write_text('{"name": "smollm2-135m-instruct"}')
    assert lp.precisions(None, [str(pulled)]) == ["GGUF", "BF16"]
    assert lp.precisions(None, [str(pulled), str(plain)]) == ["BF16"]
    assert "BF16 only" in capsys.readouterr().out
    assert lp.precisions("bf16,BF16", [str(plain)]) == ["BF16"]
    with pytest.raises(LeapDecodeError, match="pass --llamacpp-precision BF16"):
        lp.precisions("GGUF", [str(plain)])
    with pytest.raises(LeapDecodeError, match="takes GGUF, BF16"):
        lp.precisions("Q8", [str(pulled)])


def test_a_llamacpp_folder_without_its_server_is_one_clear_line(capsys, tmp_path):
    code = main(["bench", "run", "--no-vllm", "--no-peers", "--out", str(tmp_path),
                 "--llamacpp", str(tmp_path), "--methods", "none,llamacpp"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "has no bin/llama-server" in err and "llamacpp_env.sh" in err
    assert "Traceback" not in err
    code = main(["bench", "run", "--no-vllm", "--out", str(tmp_path), "--llamacpp-precision",
                 "Q8", "--llamacpp", str(tmp_path)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "--llamacpp-precision takes GGUF, BF16" in err


BUILT = lp.find_dir(None)


@pytest.mark.skipif(
    BUILT is None, reason="llama.cpp is not built here (bash bench/llamacpp_env.sh)"
)
def test_a_real_llama_server_answers_token_ids_and_counts_its_drafts(monkeypatch):
    """SmolLM2's own Q4_1 file on llama-server: plain and n-gram speculation (its own
    lossless claim, on the demo's revision, whose answer copies the prompt), each reply's
    counters consistent; ngram-mod keeps nothing from one request to the next (its table
    outlives a request: the bench starts its server anew for each)."""
    from helpers import pulled

    folder = pulled("smollm2-135m-instruct")
    with monkeypatch.context() as m:  # the GGUF is kept beside the test's pulled folder
        m.setenv("LEAPDECODE_CACHE", os.path.dirname(os.path.dirname(folder)))
        configs = [("llamacpp GGUF", "llamacpp", 0, "GGUF"),
                   ("llamacpp-ngram k=16 GGUF", "llamacpp-ngram", 16, "GGUF"),
                   ("llamacpp-ngram-mod k=64 GGUF", "llamacpp-ngram-mod", 64, "GGUF")]  # fmt: skip
        peers = lp.LlamaCppPeers(BUILT, folder, None, configs, threads=2, context=1024, warm_up=1)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder)
        from leapdecode.demo import DEMO_PROMPT  # a revision: the answer copies the prompt

        ids = tok.encode(DEMO_PROMPT)
        got = {}
        for label, *_ in configs:
            secs, tokens, forwards, drafted, accepted = peers.generate(label, ids, 48)
            assert secs > 0 and 1 <= len(tokens) <= 48 and forwards == len(tokens) - accepted
            got[label] = (tokens, forwards)
        assert got["llamacpp-ngram k=16 GGUF"][0] == got["llamacpp GGUF"][0]
        assert got["llamacpp-ngram k=16 GGUF"][1] < got["llamacpp GGUF"][1], got  # drafts accepted
        again = peers.generate("llamacpp-ngram-mod k=64 GGUF", ids, 48)
        assert (again[1], again[2]) == got["llamacpp-ngram-mod k=64 GGUF"], (again, got)
    finally:
        peers.close()
