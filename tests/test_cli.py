"""The CLI's JSON contract, and one clear error line (never a traceback) for bad input."""

import json
import os
import subprocess
import sys

import pytest

import helpers
from leapdecode.cli import main

STATS_KEYS = {
    "target_forwards": int, "draft_forwards": int, "proposed": int, "accepted": int,
    "acceptance_rate": float, "mean_accepted_tokens": float, "prefill_s": float,
    "decode_s": float, "wall_s": float, "tokens_per_s": float,
}  # fmt: skip


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def check_contract(obj):
    assert isinstance(obj["text"], str)
    assert isinstance(obj["token_ids"], list) and all(isinstance(t, int) for t in obj["token_ids"])
    assert obj["finish_reason"] in ("length", "stop")
    for key, typ in STATS_KEYS.items():
        assert isinstance(obj["stats"][key], typ), key


@pytest.mark.parametrize("method", ["none", "draft", "ngram", "auto"])
def test_json_one_object_per_prompt(capsys, tmp_path, target_dir, draft_dir, method, monkeypatch):
    # a cache of its own: no step-cost profile saved by an earlier test of this pair
    monkeypatch.setenv("LEAPDECODE_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "import os\n", "x = 1"])
    )
    code, out, err = run_cli(
        capsys, "generate", "--target", target_dir, "--draft", draft_dir, "--method", method,
        "--k", "3", "--max-new-tokens", "12", "--json", "--prompts-file", str(prompts),
    )  # fmt: skip
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 3
    for line in lines:
        obj = json.loads(line)
        check_contract(obj)
        assert len(obj["token_ids"]) == 12 or obj["finish_reason"] == "stop"
        assert obj["stats"]["draft_forwards"] > 0 if method == "draft" else True
    # auto's one-off profiling is announced on stderr (stdout stays one JSON object a line)
    assert ("profiling the step costs" in err) == (method == "auto")


def test_plain_output_prints_prompt_and_completion(capsys, target_dir):
    code, out, err = run_cli(
        capsys, "generate", "--target", target_dir, "--max-new-tokens", "5", "def f(x):"
    )
    assert code == 0
    assert out.startswith("def f(x):")
    assert "tokens/forward" in err


def test_stdin_prompt(capsys, monkeypatch, target_dir):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("import sys\n"))
    code, out, _ = run_cli(
        capsys, "generate", "--target", target_dir, "--json", "--max-new-tokens", "3", "-"
    )
    assert code == 0
    check_contract(json.loads(out))


@pytest.fixture(scope="module")
def other_tokenizer_draft(tmp_path_factory):
    tok = str(tmp_path_factory.mktemp("tok2"))
    helpers.make_tokenizer(tok, vocab=300)
    path = str(tmp_path_factory.mktemp("draft2"))
    helpers.make_llama(path, seed=9, tokenizer_dir=tok, vocab_size=300)
    return path


def bad_cases(tmp_path, target_dir, draft_dir, other_draft):
    not_model = tmp_path / "empty"
    not_model.mkdir()
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "ok"}\n{not json\n')
    no_key = tmp_path / "nokey.jsonl"
    no_key.write_text('{"text": "x"}\n')
    empty_file = tmp_path / "empty.jsonl"
    empty_file.write_text("\n")
    t = ["generate", "--target", target_dir]
    return {
        "missing target": (["generate", "--target", str(tmp_path / "nope"), "x"], "does not exist"),
        "not a model folder": (["generate", "--target", str(not_model), "x"], "no config.json"),
        "vocabulary mismatch": (
            t + ["--method", "draft", "--draft", other_draft, "x"],
            "tokenizer",
        ),
        "draft method without draft": (t + ["--method", "draft", "x"], "needs a draft"),
        "empty prompt": (t + [""], "empty"),
        "prompt too long": (t + ["x " * 400], "context"),
        "negative k": (t + ["--method", "ngram", "--k", "-1", "x"], "k must be"),
        "absurd k": (t + ["--method", "ngram", "--k", "100000", "x"], "k must be"),
        "negative temperature": (t + ["--temperature", "-0.5", "x"], "temperature"),
        "top-p zero": (t + ["--top-p", "0", "x"], "top-p"),
        "top-p above one": (t + ["--top-p", "1.5", "x"], "top-p"),
        "malformed prompts file": (t + ["--prompts-file", str(bad_json)], "bad.jsonl:2"),
        "prompts file without prompt key": (t + ["--prompts-file", str(no_key)], "nokey.jsonl:1"),
        "empty prompts file": (t + ["--prompts-file", str(empty_file)], "no prompts"),
        "missing prompts file": (
            t + ["--prompts-file", str(tmp_path / "none.jsonl")],
            "cannot read",
        ),
        "no prompt": (t, "no prompt"),
        "zero max tokens": (t + ["--max-new-tokens", "0", "x"], "--max-new-tokens"),
        "non-integer k": (t + ["--k", "two", "x"], "invalid int"),
        "unknown method": (t + ["--method", "magic", "x"], "invalid choice"),
        "cuda on a CPU machine": (t + ["--device", "cuda", "x"], "CUDA"),
        "draft confidence of one": (t + ["--draft-min-prob", "1", "x"], "--draft-min-prob"),
        "unknown draft dtype": (t + ["--draft-dtype", "int3", "x"], "invalid choice"),
        "unknown auto method": (
            t + ["--method", "auto", "--auto-methods", "magic", "x"],
            "--auto-methods must be a list of ngram, suffix, draft, pard, medusa, eagle, peagle, got magic",
        ),  # fmt: skip
        "infinite temperature": (t + ["--temperature", "inf", "x"], "finite number"),
        "negative draft vocabulary": (
            t + ["--method", "draft", "--draft", draft_dir, "--draft-vocab", "-3", "x"],
            "--draft-vocab",
        ),  # fmt: skip
        "missing speculator": (
            t + ["--method", "eagle", "--speculator", str(tmp_path / "nope"), "x"],
            "speculator path",
        ),  # fmt: skip
        "train with a missing target": (
            ["train", "draft", "--target", str(tmp_path / "nope"), "--out", str(tmp_path / "o")],
            "does not exist",
        ),  # fmt: skip
        "demo with an empty prompt": (["demo", "--prompt", " "], "--prompt is empty"),
        "bench with an unknown method": (
            ["bench", "run", "--methods", "magic", "--no-peers"],
            "unknown method 'magic'",
        ),  # fmt: skip
        "serve with no slots": (
            ["serve", "--target", target_dir, "--max-num-seqs", "0"],
            "--max-num-seqs must be >= 1",
        ),  # fmt: skip
    }


def test_auto_without_draft_in_its_methods_never_loads_the_draft(
    capsys, target_dir, other_tokenizer_draft
):
    """--auto-methods without draft: the draft is neither loaded nor profiled (a draft of
    another vocabulary, an error to load, passes unnoticed)."""
    code, out, err = run_cli(capsys, "generate", "--target", target_dir, "--draft",
                             other_tokenizer_draft, "--method", "auto", "--auto-methods",
                             "ngram,suffix", "--json", "--max-new-tokens", "4", "x")  # fmt: skip
    assert code == 0, err
    check_contract(json.loads(out))


def test_bad_input_gives_one_clear_line(
    capsys, tmp_path, target_dir, draft_dir, other_tokenizer_draft
):
    cases = bad_cases(tmp_path, target_dir, draft_dir, other_tokenizer_draft)
    for name, (argv, needle) in cases.items():
        if name == "cuda on a CPU machine" and __import__("torch").cuda.is_available():
            continue
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own checks exit through SystemExit
            code = e.code
        out, err = capsys.readouterr()
        assert code not in (0, None), name
        lines = err.strip().splitlines()
        assert len(lines) == 1, f"{name}: {err!r}"
        assert lines[0].startswith("leapdecode: error:"), f"{name}: {err!r}"
        assert needle in lines[0], f"{name}: {lines[0]!r}"
        assert "Traceback" not in err and out == ""


def _run(args, **kw):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "leapdecode.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300, **kw)  # fmt: skip


def test_subprocess_json_and_error(target_dir, draft_dir, tmp_path):
    ok = _run(["generate", "--target", target_dir, "--draft", draft_dir, "--method", "draft",
               "--max-new-tokens", "8", "--json", "def g():"])  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    check_contract(json.loads(ok.stdout))
    bad = _run(["generate", "--target", str(tmp_path / "missing"), "x"])
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr
    assert bad.stderr.strip().startswith("leapdecode: error:")


def test_errors_name_the_flags_the_user_typed(capsys, target_dir):
    for argv, flag in ((["--method", "suffix", "--suffix-min-token-prob", "2"],
                        "--suffix-min-token-prob must be"),
                       (["--draft-min-prob", "5"], "--draft-min-prob must be"),
                       (["--method", "lookahead", "--lookahead-ngram-size", "2"],
                        "(--lookahead-ngram-size)"),
                       (["--max-new-tokens", "100000"], "lower --max-new-tokens")):  # fmt: skip
        code, _, err = run_cli(capsys, "generate", "--target", target_dir, *argv, "x")
        assert code == 2 and flag in err, err
        assert not any(
            name in err for name in ("suffix_decoding", "draft_min_prob", "max_new_tokens")
        )  # no API field names


def test_auto_checks_every_option_before_profiling(capsys, target_dir):
    code, _, err = run_cli(capsys, "generate", "--target", target_dir, "--method", "auto",
                           "--max-new-tokens", "0", "x")  # fmt: skip
    assert code == 2 and "--max-new-tokens" in err
    assert "profiling" not in err  # refused before the cost model's profile


def test_an_errors_field_is_named_as_its_flag_and_paths_are_left_alone():
    """The CLI names the field an error carries as its flag (a table, not the text's words):
    in place, or after the message; a path or a longer name holding it stays as it is."""
    from leapdecode import LeapDecodeError
    from leapdecode.cli import _flagged

    assert _flagged(LeapDecodeError("draft_min_prob must be", field="draft_min_prob")) == (
        "--draft-min-prob must be"
    )
    assert _flagged(LeapDecodeError("lookahead needs W 1..32", field="lookahead_window")) == (
        "lookahead needs W 1..32 (--lookahead-window)"
    )
    msg = "cannot read prompts file '/tmp/max_new_tokens.jsonl' (run draft_min_prob-run)"
    assert _flagged(LeapDecodeError(msg)) == msg
    assert _flagged(LeapDecodeError(msg, field="max_new_tokens")) == msg + " (--max-new-tokens)"


def test_demo_on_the_embedded_models_gives_the_same_output_for_every_method(capsys):
    """The README's main command (on the embedded pair here; a user's pulls a real model):
    every method's row, each with the plain decoding's output, for both tasks."""
    from leapdecode.paths import DRAFT_NAME, TARGET_NAME, default_model

    code, out, err = run_cli(capsys, "demo", "--target", default_model(TARGET_NAME), "--draft",
                             default_model(DRAFT_NAME), "--max-new-tokens", "24", "--repeats",
                             "1", "--no-vllm")  # fmt: skip
    assert code == 0, err
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") == 8}
    assert set(rows) == {"none", "draft", "ngram", "suffix", "eagle"}  # eagle: head beside target
    assert all(line.split("│")[7].strip() == "yes" for line in rows.values()), out
    assert [rows[m].split("│")[2].strip() for m in ("draft", "ngram", "eagle")] == ["4", "8", "6"]
    assert "code edit" in out and "completion" in out


def test_demo_prompt_is_a_revision_the_embedded_target_gets_right():
    """The demo's default prompt asks for an argument rename; the target's greedy output
    begins with the correct edit, as code_edits.rename makes it from the original."""
    import re

    from leapdecode import LeapDecoder, code_edits
    from leapdecode.demo import DEMO_PROMPT
    from leapdecode.paths import TARGET_NAME, default_model

    original = DEMO_PROMPT.split("# Original:\n", 1)[1].split("\n# Task: ", 1)[0]
    old, new = re.search(r"rename the argument `(\w+)` to `(\w+)`", DEMO_PROMPT).groups()
    head, rest = code_edits.rename(original, old, new).split("\n", 1)
    assert old != new and new in rest  # a body that uses the argument: something to edit
    assert DEMO_PROMPT.endswith("# Revised:\n" + head)  # ends inside the revised signature
    dec = LeapDecoder.from_pretrained(default_model(TARGET_NAME))
    out = dec.generate(DEMO_PROMPT, method="none", max_new_tokens=128)
    assert out.text.startswith("\n" + rest), out.text


def test_demo_methods_and_k_are_checked(capsys, target_dir, draft_dir):
    # a short prompt: the test models hold 256 tokens, and their tokenizer splits the demo's
    models = ("--target", target_dir, "--draft", draft_dir, "--max-new-tokens", "4",
              "--repeats", "1", "--prompt", "def f(x):\n    return x", "--no-vllm")  # fmt: skip
    code, out, err = run_cli(capsys, "demo", *models, "--methods", "ngram", "--k", "3")
    assert code == 0, err
    rows = [line.split("│")[1:3] for line in out.splitlines() if line.count("│") == 8]
    assert [(m.strip(), k.strip()) for m, k in rows] == [("none", "0"), ("ngram", "3")]
    for bad, says in ((["--methods", "ngram,bogus"], "unknown bogus"),
                      (["--methods", "auto"], "auto needs a load"),
                      (["--k", "0"], "--k must be in 1..64"), (["--k", "-3"], "--k must be")):  # fmt: skip
        code, out, err = run_cli(capsys, "demo", *models, *bad)
        assert code == 2 and says in err and "Traceback" not in err


def test_a_kill_unwinds_bench_and_demo_so_their_vllm_engines_are_shut_down(monkeypatch):
    """SIGTERM to `leapdecode bench|demo` runs their clean-up (the `finally` that closes the
    vLLM engines, each stopped between its turns) and exits 143."""
    import signal
    import time

    from leapdecode import cli

    cleaned = []

    def command(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this returns
        finally:
            cleaned.append(args.command)
        return 0

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setitem(cli.COMMANDS, "bench", command)
    try:
        assert cli.main(["bench", "run", "--quick"]) == 143
    finally:
        signal.signal(signal.SIGTERM, before)
    assert cleaned == ["bench"]


def test_the_parser_and_help_import_no_torch():
    """`leapdecode --help` and `generate --help` stay quick: the parser is built without
    torch, numpy or transformers (bench's and train's flags are added when they run)."""
    code = (
        "import sys\n"
        "from leapdecode.cli import build_parser\n"
        "p = build_parser()\n"
        "p.format_help()\n"
        "p.parse_args(['generate', '--method', 'ngram', '--chat', 'x'])\n"
        "print([m for m in ('torch', 'numpy', 'transformers') if m in sys.modules])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_bench_and_train_keep_every_flag_when_filled(capsys):
    from leapdecode.cli import build_parser

    args = build_parser().parse_args(["bench", "run", "--quick", "--vllm-leap-k", "3"])
    assert args.quick and args.vllm_leap_k == "3"
    args = build_parser().parse_args(["train", "pard", "--draft", "d", "--out", "o", "--k", "4"])
    assert (args.what, args.k) == ("pard", 4)
    for argv, flag in ((["bench", "serve", "--help"], "--concurrency"),
                       (["train", "target", "--help"], "--run-dir")):  # fmt: skip
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        assert flag in capsys.readouterr().out


def test_demo_and_generate_refuse_a_bad_flag_before_any_model_loads(capsys, monkeypatch):
    from leapdecode import demo
    from leapdecode.api import LeapDecoder

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(LeapDecoder, "from_pretrained", no_load)
    monkeypatch.setattr(demo, "run_demo", no_load)  # (which pulls and loads its models)
    monkeypatch.setattr("leapdecode.frontend.load_tokenizer", no_load)
    for argv, says in (
        (["demo", "--max-new-tokens", "-1"], "--max-new-tokens must be >= 1, got -1"),
        (["demo", "--repeats", "0"], "--repeats must be >= 1"),
        (["demo", "--k", "0"], "--k must be in 1..64"),
        (["demo", "--methods", "magic"], "--methods: unknown magic"),
        (["demo", "--prompt", ""], "--prompt is empty"),
        (["demo", "--threads", "0"], "--threads must be >= 1"),
        (["generate", "--max-new-tokens", "0", "x"], "--max-new-tokens must be >= 1"),
        (["generate", "--method", "ngram", "--k", "99", "x"], "k must be an integer in 0..64"),
        (["generate", "--temperature", "-1", "x"], "temperature"),
        (["generate", "--stop", "", "x"], "--stop must be a non-empty string"),
        (["generate", "--chat", "--max-new-tokens", "0", "x"], "--max-new-tokens"),
    ):
        code = main(argv)
        out, err = capsys.readouterr()
        assert code == 2, f"{argv}: {err}"
        assert says in err and err.count("\n") == 1 and out == "", f"{argv}: {err}"


def test_the_suite_keeps_out_of_the_users_cache():
    """conftest.py points $LEAPDECODE_CACHE (and the compiled graphs and kernel) away from the
    user's ~/.cache/leapdecode."""
    from leapdecode.cache import cache_root
    from leapdecode.models import attention_cpu, compiled

    home = os.path.realpath(os.path.join(os.path.expanduser("~"), ".cache", "leapdecode"))
    paths = (cache_root(), attention_cpu.BUILD_DIR, compiled.CACHE_DIR,
             os.environ["TORCHINDUCTOR_CACHE_DIR"])  # fmt: skip
    for path in paths:
        assert not os.path.realpath(path).startswith(home), path
