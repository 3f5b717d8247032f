"""`leapdecode bench`: prompt sets reproducible, report arithmetic, a quick end-to-end run."""

import json
import os

import pytest

from leapdecode.bench import lossless, report, workloads
from leapdecode.cli import DEFAULT_MODELS, main

TARGET = os.path.join(DEFAULT_MODELS, "leap-code-target")
DRAFT = os.path.join(DEFAULT_MODELS, "leap-code-draft")
PROMPTS = os.path.join(os.path.dirname(DEFAULT_MODELS), "bench", "prompts")


def test_predicted_speedup_matches_the_paper_formula():
    # Leviathan et al. 2023, Thm 3.8: (1 - a^(k+1)) / ((1 - a)(k c + 1))
    assert report.predicted_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8**5) / (0.2 * 1.4))
    assert report.predicted_speedup(1.0, 4, 0.0) == 5.0
    assert report.predicted_speedup(0.0, 4, 0.0) == 1.0
    assert report.predicted_speedup(0.5, 0, 0.3) == 1.0


def test_first_difference_and_tie_tolerance():
    import torch

    assert lossless.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert lossless.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert lossless.first_difference([1, 2], [1, 2, 3]) == 2
    assert lossless.tie_tolerance(10.0, torch.float32) == 1e-4
    assert lossless.tie_tolerance(16.0, torch.bfloat16) == pytest.approx(0.25)


def test_committed_prompt_sets_regenerate_identically(tmp_path):
    manifest = os.path.join(TARGET, "corpus_manifest.json")
    try:
        workloads.validation_files(manifest)
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"the corpus behind the prompts is not on this machine: {e}")
    assert main(["bench", "prompts", "--out", str(tmp_path)]) == 0
    for cat in workloads.CATEGORIES:
        fresh = (tmp_path / f"{cat}.jsonl").read_text()
        committed = open(os.path.join(PROMPTS, f"{cat}.jsonl")).read()
        assert fresh == committed, cat
        rows = [json.loads(line) for line in committed.splitlines()]
        assert len(rows) >= (20 if cat in workloads.TEXT else 8)
        key = "prompt" if cat in workloads.TEXT else "messages"
        assert all(r[key] and r["max_new_tokens"] >= 1 for r in rows)


def test_revision_prompts_hold_the_source_and_the_renamed_signature():
    for row in workloads.load(PROMPTS, ["revision"])["revision"]:
        original = row["prompt"].split("# Original:\n", 1)[1].split("\n# Task:", 1)[0]
        old, new = (
            row["prompt"].split("rename the argument `", 1)[1].split("`; change")[0].split("` to `")
        )
        signature = row["prompt"].rsplit("# Revised:\n", 1)[1]
        revised = signature + row["expected"]
        assert old in original and new not in original
        assert revised.count(new) >= 2  # every use is renamed; an argument is used twice
        assert revised.replace(new, old) == original


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, target_dir, draft_dir):
    """The tiny test pair with Medusa, EAGLE and parallel EAGLE heads beside the target, a
    parallel draft (the draft with a mask token), and the committed prompts cut to their last
    160 characters (two a category): the end-to-end runs below exercise every method and peer
    in seconds instead of minutes on the embedded pair."""
    import shutil

    import helpers

    root = tmp_path_factory.mktemp("bench-pair")
    target = str(root / "target")
    shutil.copytree(target_dir, target)
    heads = helpers.train_heads(target, str(root / "heads"), steps=10)
    heads += (helpers.train_peagle(target, heads[1], steps=10, k=4),)
    for path in heads:
        shutil.copytree(path, f"{target}-{os.path.basename(path)}")
    pard = root / "pard"
    shutil.copytree(draft_dir, pard)
    config = json.loads((pard / "config.json").read_text())
    (pard / "config.json").write_text(json.dumps({**config, "pard_token": 1, "pard_max_k": 4}))
    prompts = root / "prompts"
    prompts.mkdir()
    for cat, rows in workloads.load(PROMPTS).items():
        cut = [{**r, "prompt": r["prompt"][-160:]} for r in rows[:2]]
        (prompts / f"{cat}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in cut))
    return ["--target", target, "--draft", draft_dir, "--pard", str(pard), "--prompts",
            str(prompts), "--no-vllm", "--no-llamacpp"]  # fmt: skip


def test_quick_bench_writes_table_json_and_plots(tmp_path, tiny):
    out = tmp_path / "results"
    assert main(["bench", "run", "--quick", *tiny, "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    cells = data["cells"]
    names = {c["name"] for c in cells}
    assert names == {"none", "draft", "ngram", "ngram-tree", "suffix", "suffix-tree", "lookahead",
                     "hf-generate", "hf-assisted", "hf-lookup", "medusa", "eagle", "pard",
                     "peagle"}  # fmt: skip
    assert {c["category"] for c in cells} == set(workloads.TEXT)  # no chat template: no chat
    for c in cells:
        assert c["tokens_per_s"] > 0
        assert c["mismatches"]["non_tie"] == 0, (c["category"], c["method"], c["mismatches"])
        if c["name"] == "none" or (c["name"] in ("draft", "ngram") and c["acceptance_rate"]):
            assert c["efficiency"] is not None and c["predicted_speedup"] > 0
            assert c["speedup_vs_counterpart"] is not None
        if c["ours"]:
            assert (
                abs(sum(c["time_split"][k] for k in ("proposer", "verify_forward", "accept")) - 1)
                < 1e-6
            )
    md = (out / "results.md").read_text()
    assert "| completion | none |" in md and "![speedup_by_category.png]" in md
    assert "## Lookahead by window W, n-gram size N, candidates G" in md
    for png in ("speedup_by_category.png", "accepted_vs_k.png", "tokens_per_s_vs_k.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_sampled_bench_run_seeds_every_method_and_verifies_chains_as_blocks(tmp_path, tiny):
    """--temperature samples every method (each request seeded), --verify reaches our chains
    (tree settings keep the token rule); outputs are checked against their own repeats."""
    out = tmp_path / "sampled"
    argv = ["bench", "run", *tiny, "--out", str(out), "--temperature", "0.8", "--verify",
            "block", "--per-category", "1", "--repeats", "2", "--draft-k", "2", "--ngram-k", "4",
            "--tree-k", "8", "--eagle-k", "6", "--categories", "completion,revision",
            "--methods", "none,draft,ngram-tree,eagle,hf-generate,hf-assisted"]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    assert {c["name"] for c in data["cells"]} == {"none", "draft", "ngram-tree", "eagle",
                                                  "hf-generate", "hf-assisted"}  # fmt: skip
    for c in data["cells"]:
        assert c["mismatches"]["non_tie"] == 0, (c["method"], c["mismatches"])  # seeded repeats
    assert "sampled at temperature 0.8" in (out / "results.md").read_text()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--draft-k", "2,x"], "comma-separated integers"),
        (["--ngram-k", "0"], "every k must be in 1..64"),
        (["--categories", "poetry"], "unknown category"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--lookahead", "3x3"], "WxNxG triples"),
        (["--lookahead", "3x2x3"], "n-gram size 3..16"),
        (["--prompts", "/nonexistent"], "leapdecode bench prompts"),
        (["--suffix-spec-factor", "1,x"], "comma-separated numbers"),
        (["--suffix-spec-factor", "-1"], "suffix_decoding_max_spec_factor must be in"),
        (["--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--draft-min-prob", "1.5"], "--draft-min-prob must be in [0, 1)"),
    ],
)
def test_bench_bad_input_is_one_line(capsys, tmp_path, argv, needle):
    code = main(["bench", "run", "--out", str(tmp_path), "--no-vllm", *argv])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err


def test_suffix_draft_caps_are_settings_of_their_own():
    """--suffix-spec-factor 1,4: each suffix k at each cap; the default cap keeps the plain
    label, and a cap reaches the engine as suffix_decoding_max_spec_factor."""
    from leapdecode.bench.runner import method_list

    methods = method_list([], [16], {"draft": [], "ngram": []}, False, False, tree_ks=[16],
                          suffix_ks=[16], suffix_factors=(1.0, 4.0))  # fmt: skip
    labels = [m.label for m in methods]
    assert labels == ["none", "ngram k=16", "ngram-tree k=16", "suffix k=16", "suffix k=16 f4",
                      "suffix-tree k=16", "suffix-tree k=16 f4"]  # fmt: skip
    capped = methods[4]
    assert capped.method == "suffix"
    assert capped.options == {"suffix_decoding_max_spec_factor": 4.0}
    assert methods[6].options == {"suffix_decoding_max_spec_factor": 4.0, "use_tree_spec": True}


def test_suffix_tokens_only_is_a_setting_beside_each_suffix_chain():
    """--suffix-tokens-only: each suffix chain setting again without matching characters."""
    from leapdecode.bench.runner import method_list

    methods = method_list([], [], {"draft": [], "ngram": []}, False, False, suffix_ks=[16],
                          suffix_factors=(1.0, 4.0), suffix_tokens_only=True)  # fmt: skip
    assert [m.label for m in methods] == [
        "none", "suffix k=16", "suffix k=16 f4", "suffix k=16 tokens-only",
        "suffix k=16 f4 tokens-only"]  # fmt: skip
    assert methods[4].options == {"suffix_decoding_max_spec_factor": 4.0,
                                  "suffix_decoding_char_match": False}  # fmt: skip


def test_assisted_generation_peer_uses_our_k(target_dir, draft_dir, hf_target):
    """transformers takes the draft length from the assistant's generation config; the peer
    must set it, or every "hf-assisted k=..." row would run transformers' default k."""
    import torch

    from leapdecode.bench.peers import HFPeers

    peers = HFPeers(target_dir, draft_dir, "float32", "float32")
    ids = [5, 17, 42, 7, 99, 3]
    with torch.no_grad():
        want = hf_target.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                  attention_mask=torch.ones(1, 6, dtype=torch.long))  # fmt: skip
    forwards = {}
    for k in (1, 6):
        tokens, forwards[k] = peers.generate(ids, "hf-assisted", k, 24)
        assert tokens == want[0, 6:].tolist()
    assert forwards[1] >= 13  # at most 2 tokens per target forward with one draft token
    assert forwards[6] < forwards[1]


def test_interrupted_bench_run_resumes_after_its_last_finished_prompt(
    tmp_path, capsys, monkeypatch, tiny
):
    from leapdecode.bench import report

    out = tmp_path / "results"
    argv = ["bench", "run", "--quick", *tiny, "--no-peers", "--methods", "none,ngram,suffix",
            "--categories", "completion,revision", "--out", str(out),
            "--threads", "1"]  # pinned: a default from the machine's load could differ per call  # fmt: skip

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:  # killed after measuring, before the report
        m.setattr(report, "aggregate", interrupted)
        assert main(argv) == 130
    partial = out / "partial.jsonl"
    lines = partial.read_text().splitlines()
    assert len(lines) == 1 + 4  # the signature, then one line per finished prompt
    # as if killed while writing the third prompt's line: half a line at the end
    partial.write_text("\n".join(lines[:3]) + "\n" + lines[3][: len(lines[3]) // 2])
    capsys.readouterr()

    assert main(argv) == 0
    assert "2 prompts already measured" in capsys.readouterr().out
    assert not partial.exists()  # a finished run leaves no partial file behind
    cells = json.loads((out / "results.json").read_text())["cells"]
    assert {(c["category"], c["name"]) for c in cells} == {
        (cat, n) for cat in ("completion", "revision") for n in ("none", "ngram", "suffix")
    }
    assert all(c["mismatches"]["non_tie"] == 0 and c["tokens_per_s"] > 0 for c in cells)

    with monkeypatch.context() as m:  # other settings never reuse the records...
        m.setattr(report, "aggregate", interrupted)
        assert main(argv) == 130
    kept = partial.read_text()
    capsys.readouterr()
    assert main([*argv, "--ngram-k", "5"]) != 0  # ...nor overwrite them: an error says why
    err = capsys.readouterr().err
    assert "other settings (differing: methods)" in err and "--fresh" in err, err
    assert partial.read_text() == kept
    # fewer methods, nothing else changed: their records are reused, the full file kept
    narrow = [a if a != "none,ngram,suffix" else "none,suffix" for a in argv]
    assert main(narrow) == 0
    printed = capsys.readouterr().out
    assert "resuming with 2 of the 3 methods" in printed and "4 prompts already measured" in printed
    cells = json.loads((out / "results.json").read_text())["cells"]
    assert {c["name"] for c in cells} == {"none", "suffix"}
    assert (out / "partial.jsonl.all-methods").read_text() == kept
    with monkeypatch.context() as m:  # narrowed again: the first full file stays
        m.setattr(report, "aggregate", interrupted)
        assert main(argv) == 130
    assert main(narrow) == 0
    assert (out / "partial.jsonl.all-methods").read_text() == kept
    assert (out / "partial.jsonl.all-methods.1").exists()
    capsys.readouterr()
    assert main([*argv, "--ngram-k", "5", "--fresh"]) == 0
    assert "already measured" not in capsys.readouterr().out


def test_bench_run_measures_auto_beside_the_fixed_methods(tmp_path, tiny):
    """`auto` is a row of bench run when asked for by name (never by default: it profiles the
    step costs first), its output plain decoding's."""
    out = tmp_path / "auto"
    argv = ["bench", "run", *tiny, "--no-peers", "--per-category", "1", "--repeats", "1",
            "--categories", "completion,revision", "--methods", "none,draft,suffix,auto",
            "--draft-k", "3", "--suffix-k", "16", "--max-new-tokens", "24", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    cells = json.loads((out / "results.json").read_text())["cells"]
    auto = [c for c in cells if c["name"] == "auto"]
    assert [c["method"] for c in auto] == ["auto", "auto"]
    assert all(c["mismatches"]["non_tie"] == 0 and c["tokens_per_s"] > 0 for c in auto)
    assert "| completion | auto |" in (out / "results.md").read_text()


def test_a_pulled_model_is_named_by_its_wheels_not_its_file_times(tmp_path):
    """A bench run resumes across a re-pull: a pulled folder's stamp is its name, its wheels'
    sha256 and its files' sizes; another folder's includes the files' times."""
    from leapdecode.bench.command import model_stamp
    from leapdecode.resolve import MARKER

    def folder(name: str, sha: str):
        d = tmp_path / name / "m"
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x" * 10)
        (d / "config.json").write_text("{}")
        (d / MARKER).write_text(json.dumps({"sources": [{"sha256": sha}]}))
        return d

    a, b = folder("a", "aa"), folder("b", "aa")
    os.utime(b / "model.safetensors", (1, 1))  # pulled again: other file times
    assert model_stamp(str(a)) == model_stamp(str(b)) == ["m", ["aa"], [("config.json", 2),
                                                                  ("model.safetensors", 10)]]  # fmt: skip
    assert model_stamp(str(folder("c", "bb"))) != model_stamp(str(a))  # other wheels
    (a / MARKER).unlink()  # not pulled: the times count
    plain = model_stamp(str(a))
    os.utime(a / "model.safetensors", (1, 1))
    assert model_stamp(str(a)) != plain
    assert model_stamp(None) is None


def test_every_bench_prompt_comes_from_its_own_source():
    """No two prompts share a (file, function): suffix's global tree holds earlier prompts'
    outputs, and the same code twice would let it copy an answer."""
    from leapdecode.bench import workloads

    sets = workloads.load(workloads_dir())
    sources = [r["source"] for rows in sets.values() for r in rows]
    assert len(sources) == 80 and len(set(sources)) == len(sources)


def workloads_dir():
    from leapdecode.bench.command import PROMPTS

    return PROMPTS
