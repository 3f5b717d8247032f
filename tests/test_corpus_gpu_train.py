"""`leapdecode train corpus` (offline: wheels already in place) and the GPU training script's
CPU rehearsal (bench/gpu_train.py pack, then gpu_train.sh with TINY=1)."""

import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from leapdecode.cli import main
from leapdecode.paths import TARGET_NAME, default_model
from leapdecode.train import pypi_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE = "def add(a, b):\n    return a + b\n\n\nclass Box:\n    pass\n"


def _wheel(folder, name, version, licence, files):
    """A wheel as pip would have written it: METADATA and the given files."""
    path = os.path.join(folder, f"{name}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA",
                   f"Metadata-Version: 2.4\nName: {name}\nVersion: {version}\n"
                   f"License-Expression: {licence}\n")  # fmt: skip
        for rel, text in files.items():
            z.writestr(rel, text)
    return path


@pytest.fixture()
def corpus_dir(tmp_path):
    out = tmp_path / "corpus"
    arch = out / "archives"
    arch.mkdir(parents=True)
    body = "\n".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400))
    _wheel(arch, "alpha", "1.0", "MIT", {
        "alpha/__init__.py": CODE, "alpha/core.py": body, "alpha/_vendor/six.py": "x = 1\n",
        "alpha/data.bin": "not python",
        "alpha/hook.py": "# SPDX-License-Identifier: GPL-2.0-or-later\nx = 1\n",
        **{f"alpha/m{i}.py": body.replace("x", f"v{i}") for i in range(8)}})  # fmt: skip
    _wheel(arch, "beta", "2.0", "BSD-3-Clause", {"beta/same.py": CODE + "\n  \n",  # a copy
                                                 "beta/own.py": body.replace("x", "y")})  # fmt: skip
    _wheel(arch, "gamma", "0.1", "GPL-3.0-only", {"gamma/g.py": "y = 2\n"})
    _wheel(arch, "delta", "3.0", "Apache-2.0", {"delta/d.py": body.replace("x", "z") * 3,
                                               "delta/shared.py": "held = 'out'\n"})  # fmt: skip
    # a training package that bundles a held-out file: the copy is dropped from training
    _wheel(arch, "epsilon", "1.0", "MIT", {"epsilon/copy_of_delta.py": "held = 'out'\n",
                                           "epsilon/thirdparty_files/x/y.py": "z = 3\n"})  # fmt: skip
    packages = tmp_path / "packages.json"
    packages.write_text(json.dumps({"packages": [
        {"name": "alpha", "version": "1.0", "license": "MIT"},
        {"name": "beta", "version": "2.0", "license": "BSD-3-Clause"},
        {"name": "gamma", "version": "0.1", "license": "MIT"},
        {"name": "delta", "version": "3.0", "license": "Apache-2.0", "heldout": True},
        {"name": "epsilon", "version": "1.0", "license": "MIT"}]}))  # fmt: skip
    return out, packages


def test_corpus_from_wheels_dedup_licences_heldout_resume(corpus_dir):
    out, packages = corpus_dir
    args = ["train", "corpus", "--out", str(out), "--packages", str(packages), "--no-stdlib"]
    assert main(args) == 0
    m = json.load(open(out / "manifest.json"))
    by = {p["name"]: p for p in m["packages"]}
    # the vendored file and the file under its own GPL header are left out
    assert by["alpha"]["files"] == 10 and by["alpha"]["other_dropped"] == 2
    assert by["beta"]["files"] == 1 and by["beta"]["duplicates_dropped"] == 1
    assert by["gamma"]["excluded"] == "copyleft licence" and by["gamma"]["files"] == 0
    assert by["alpha"]["license_metadata"] == "MIT" and len(by["alpha"]["archive_sha256"]) == 64
    assert m["heldout_packages"] == ["delta"]
    assert by["delta"]["files"] == 2  # held-out first: its file is kept there ...
    assert by["epsilon"]["files"] == 0  # ... and the training copy dropped, as the bundled one
    assert by["epsilon"]["duplicates_dropped"] == 1 and by["epsilon"]["other_dropped"] == 1
    assert (out / "heldout" / "delta" / "delta" / "d.py").is_file()
    assert not (out / "src" / "delta").exists()
    tokens = m["tokens"]
    assert tokens["heldout"]["tokens"] > 0 and tokens["train"]["tokens"] > 0
    train = np.load(out / "tokens" / "train.npy")
    assert train.dtype == np.uint16 and len(train) == tokens["train"]["tokens"]
    # resumable: a second run redoes nothing and gives the same manifest
    (out / "src" / "alpha" / "marker").write_text("kept")
    assert main(args) == 0
    assert (out / "src" / "alpha" / "marker").is_file()
    again = json.load(open(out / "manifest.json"))
    assert again["packages"] == m["packages"]


def test_corpus_bad_inputs_are_clear(tmp_path, capsys):
    assert main(["train", "corpus", "--out", str(tmp_path / "o"), "--packages",
                 str(tmp_path / "none.json")]) != 0  # fmt: skip
    assert "not found" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"packages": [{"nom": "x"}]}')
    assert main(["train", "corpus", "--out", str(tmp_path / "o"), "--packages", str(bad)]) != 0
    assert "is not a package list" in capsys.readouterr().err


def test_copyleft_detection():
    assert pypi_corpus.is_copyleft("GPL-3.0-only")
    assert pypi_corpus.is_copyleft("MPL-2.0 AND MIT")
    assert not pypi_corpus.is_copyleft("MIT")
    assert not pypi_corpus.is_copyleft("LGPL-3.0 OR MIT")  # a permissive alternative
    assert not pypi_corpus.is_copyleft("BSD License | Apache Software License")
    assert pypi_corpus.is_copyleft("GNU General Public License v3")
    assert not pypi_corpus.is_copyleft("Simplified BSD")  # "MPL" inside a word
    assert pypi_corpus.copyleft_header(b"# SPDX-License-Identifier: GPL-2.0-or-later\n")
    assert not pypi_corpus.copyleft_header(b"# SPDX-License-Identifier: MIT\n")


def test_gpu_train_rehearsal_on_cpu(corpus_dir, tmp_path):
    """pack a corpus, then the device script at toy sizes on CPU: shards within the limits,
    loadable by transformers, with the evaluation in summary.json."""
    from transformers import AutoModelForCausalLM

    out, packages = corpus_dir
    assert main(["train", "corpus", "--out", str(out), "--packages", str(packages),
                 "--no-stdlib", "--val-percent", "50"]) == 0  # fmt: skip
    gpu = tmp_path / "gpu"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_train.py"), "pack",
                    "--corpus", str(out), "--out", str(gpu), "--chunk", "2000",
                    "--sample", "3000", "--budget-mib", "1"], check=True)  # fmt: skip
    meta = json.load(open(gpu / "meta.json"))
    assert meta["parts"] and meta["heldout"]["tokens"] > 0
    result = tmp_path / "result"
    env = {**os.environ, "TINY": "1", "OUT": str(result), "MINUTES": "0.4"}
    done = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_train.sh"), "--data",
                           str(gpu), "--work", str(tmp_path / "work")],
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    files = sorted(os.listdir(result))
    assert len(files) <= 8 and "summary.json" in files and "config.json" in files
    assert all(os.path.getsize(result / f) <= 16 * 2**20 for f in files)
    summary = json.load(open(result / "summary.json"))
    assert summary["steps"] > 0 and summary["loss"]["heldout"] > 0
    assert 0 <= summary["copy"]["copy_score"] <= 1
    assert summary["bits_per_byte"]["heldout"] > 0
    model = AutoModelForCausalLM.from_pretrained(str(result))
    assert model.config.vocab_size == summary["args"]["vocab"]
    assert os.path.isdir(default_model(TARGET_NAME))


def test_training_path_for_cuda_runs_on_cpu(tmp_path):
    """The CUDA path's pieces on CPU: fused AdamW, bf16 autocast, the token stream memory-
    mapped, the weights in shards of at most --shard-mb, loadable by transformers and by the
    native backend."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from leapdecode.models import load_model
    from leapdecode.train import corpus

    data = tmp_path / "data"
    data.mkdir()
    for name in ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "heapq.py",
                 "colorsys.py", "keyword.py", "cmd.py", "copy.py"):  # fmt: skip
        shutil.copy(os.path.join(corpus.stdlib_dir(), name), data / name)
    out = tmp_path / "model"
    tok = default_model(TARGET_NAME)  # its tokenizer
    assert main(["train", "target", "--data", str(data), "--val-percent", "30", "--tokenizer",
                 tok, "--out", str(out), "--run-dir", str(tmp_path / "run"), "--steps", "3",
                 "--eval-every", "3", "--hidden", "64", "--layers", "2", "--heads", "2",
                 "--kv-heads", "1", "--intermediate", "128", "--context", "64", "--batch", "2",
                 "--device", "cpu", "--fused-adamw", "on", "--precision", "bf16",
                 "--shard-mb", "1", "--no-copy-probe"]) == 0  # fmt: skip
    shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(shards) >= 2 and (out / "model.safetensors.index.json").is_file()
    assert all(os.path.getsize(out / f) <= 2**20 for f in shards if "00001" not in f)
    config = json.load(open(tmp_path / "run" / "train_config.json"))
    assert config["fused_adamw"] and config["bf16"] and config["device"] == "cpu"
    from leapdecode.train.data import load_or_encode

    # the training stream the run cached, read back memory-mapped (as a resumed run reads it)
    assert isinstance(load_or_encode(None, "", [], "train", str(tmp_path / "run")), np.memmap)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    native = load_model(str(out), dtype="float32")
    ids = torch.tensor([[5, 6, 7, 8]])
    native.allocate(1, 16)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits[0, -1]
    got = native.forward(ids, torch.tensor([0]))[0, -1]
    assert torch.allclose(ref, got, atol=1e-4)


def test_cuda_asked_for_without_one_is_a_clear_error(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert main(["train", "target", "--tokenizer", default_model(TARGET_NAME), "--out",
                 str(tmp_path / "m"), "--device", "cuda"]) != 0  # fmt: skip
    assert "torch sees no CUDA device" in capsys.readouterr().err
