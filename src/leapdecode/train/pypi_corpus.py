"""`leapdecode train corpus`: a code corpus from pinned PyPI packages, offline after the build.

The list (corpus_packages.json: name, version, the licence read for it, held-out or not) is
downloaded with pip, one wheel a package (`pip download --no-deps --only-binary :all:`, any
platform's wheel: only its .py files are read), and laid out as

    OUT/archives/            the wheels, as pip wrote them
    OUT/src/<package>/...    training sources: each package's .py files, and the stdlib's
                             (`src/python-stdlib`); the train/validation split is by path
                             hash (corpus.py), so `--data OUT/src` works with every train command
    OUT/heldout/<package>/   the held-out packages' sources (never trained on: evaluation)
    OUT/done/<package>.json  one package's record (the build resumes after the last one)
    OUT/tokens/              {train,validation,heldout}.npy token streams, files joined by
                             <|endoftext|> (`--tokenizer`; the embedded target's by default)
    OUT/manifest.json        packages, versions, licences (ours and the wheel's metadata),
                             archive sha256, files kept and dropped, bytes and tokens by split

Files are deduplicated by content across packages (the first copy kept: the stdlib, then the
held-out packages, then the rest in list order, so no held-out file is trained on); vendored copies of other projects (`_vendor/`, `vendored/`), files over 1 MB and
files that are not UTF-8 are left out. A package whose wheel metadata names a copyleft
licence (GPL, LGPL, AGPL, MPL, EPL, EUPL, CDDL, SSPL) is dropped, whatever the list says.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from email.parser import HeaderParser

import numpy as np

from ..errors import LeapDecodeError
from . import corpus

PACKAGES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus_packages.json")
MAX_FILE_BYTES = 1_000_000  # larger .py files are generated data, not code
# folders holding other projects' copies (ray's thirdparty_files bundles psutil and more)
VENDORED = {"_vendor", "vendor", "vendored", "_vendored", "third_party", "thirdparty",
            "_thirdparty", "thirdparty_files", "extern", "_extern", "externals"}  # fmt: skip
# copyleft licences by name (words, not substrings: "Simplified BSD" holds "MPL")
COPYLEFT = re.compile(
    r"\b(A|L)?GPL|GENERAL PUBLIC LICEN[CS]E|\bMPL\b|MOZILLA PUBLIC|\bEPL\b|ECLIPSE PUBLIC|"
    r"\bEUPL\b|\bCDDL\b|\bSSPL\b|\bOSL\b|CECILL"
)
HEADER_BYTES = 2048  # a file's own licence header (SPDX) is read in its first bytes
STDLIB = "python-stdlib"
# any platform's wheel will do: only its .py files are read
PLATFORMS = [
    "any",
    "manylinux1_x86_64",
    "manylinux2010_x86_64",
    "manylinux2014_x86_64",
    *(f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35, 39)),
]


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    license: str  # the licence we read for it (SPDX where one applies)
    heldout: bool = False


def load_packages(path: str = PACKAGES) -> list[Package]:
    try:
        with open(path) as f:
            rows = json.load(f)["packages"]
        return [Package(**r) for r in rows]
    except FileNotFoundError:
        raise LeapDecodeError(f"{path!r} not found: pass --packages FILE") from None
    except (KeyError, TypeError, ValueError) as e:
        raise LeapDecodeError(
            f"{path!r} is not a package list ({e}): it needs "
            '{"packages": [{"name": ..., "version": ..., "license": ...}, ...]}'
        ) from None


def metadata_licences(z: zipfile.ZipFile) -> str:
    """The licence a wheel's METADATA states: License-Expression, else the License
    classifiers, else the License field's first line."""
    meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
    if meta is None:
        return ""
    msg = HeaderParser().parsestr(z.read(meta).decode("utf-8", "replace"))
    if msg.get("License-Expression"):
        return msg["License-Expression"].strip()
    classifiers = [
        c.split("::")[-1].strip()
        for c in msg.get_all("Classifier") or []
        if c.startswith("License ::")
    ]
    if classifiers:
        return " | ".join(classifiers)
    lines = (msg.get("License") or "").strip().splitlines()
    return lines[0][:80] if lines else ""


def is_copyleft(text: str) -> bool:
    """Whether a licence statement names only copyleft terms (an OR with a permissive licence,
    or an AND where the copyleft part is not the whole, still counts as copyleft here unless
    a permissive licence is offered as an alternative)."""
    up = text.upper()
    if not COPYLEFT.search(up):
        return False
    alternatives = [a.strip() for a in up.replace(" | ", " OR ").split(" OR ")]
    return all(COPYLEFT.search(a) for a in alternatives)


def copyleft_header(data: bytes) -> bool:
    """Whether a file declares a copyleft licence of its own (an SPDX header), as a file a
    permissive package ships under other terms may (lark's PyInstaller hook: GPL-2.0)."""
    head = data[:HEADER_BYTES].decode("utf-8", "replace")
    for line in head.splitlines():
        if "SPDX-License-Identifier:" in line:
            return is_copyleft(line.split("SPDX-License-Identifier:", 1)[1])
    return False


def download(pkg: Package, dest: str) -> str:
    """The package's wheel in dest (downloaded once, with pip); returns its path."""
    for name in sorted(os.listdir(dest)):
        parts = name.split("-")
        if name.endswith(".whl") and len(parts) > 2 and _norm(parts[0]) == _norm(pkg.name):
            if parts[1] == pkg.version:
                return os.path.join(dest, name)
    before = set(os.listdir(dest))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--ignore-requires-python", "--python-version", "3.12", "--implementation", "cp",
           "--abi", "cp312", "--abi", "abi3", "--abi", "none", "--disable-pip-version-check",
           "-q", "-d", dest]  # fmt: skip
    for p in PLATFORMS:
        cmd += ["--platform", p]
    cmd.append(f"{pkg.name}=={pkg.version}")
    done = subprocess.run(cmd, capture_output=True, text=True)
    new = sorted(set(os.listdir(dest)) - before)
    wheels = [n for n in new if n.endswith(".whl")]
    if done.returncode != 0 or not wheels:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel written"]
        raise RuntimeError(f"pip download {pkg.name}=={pkg.version}: {tail[0]}")
    return os.path.join(dest, wheels[0])


def _norm(name: str) -> str:
    """A distribution name as wheels spell it (PEP 503 / 427 normalisation)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def _keep(rel: str, data: bytes) -> bool:
    if not rel.endswith(".py") or len(data) > MAX_FILE_BYTES or not data.strip():
        return False
    if VENDORED.intersection(rel.split("/")[:-1]):
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return not copyleft_header(data)


def _content_key(data: bytes) -> str:
    """Files equal up to trailing whitespace and line endings are one file."""
    text = b"\n".join(line.rstrip() for line in data.replace(b"\r\n", b"\n").split(b"\n"))
    return hashlib.sha256(text.strip()).hexdigest()


def _write_files(files, out_dir: str, seen: set[str]) -> dict:
    """Write (relative path, bytes) pairs under out_dir, skipping what `_keep` refuses and
    content already in `seen` (updated). Returns the counts."""
    kept = dropped_dup = dropped_other = n_bytes = 0
    keys = []
    for rel, data in files:
        if not _keep(rel, data):
            dropped_other += 1
            continue
        key = _content_key(data)
        if key in seen:
            dropped_dup += 1
            continue
        seen.add(key)
        keys.append(key)
        path = os.path.join(out_dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        kept += 1
        n_bytes += len(data)
    return {
        "files": kept,
        "bytes": n_bytes,
        "duplicates_dropped": dropped_dup,
        "other_dropped": dropped_other,
        "keys": keys,
    }


def _wheel_files(z: zipfile.ZipFile):
    for info in z.infolist():
        if not info.is_dir() and info.filename.endswith(".py"):
            yield info.filename, z.read(info)


def _stdlib_files():
    root = corpus.stdlib_dir()
    for f in corpus.scan(root, (".py",), 0.0):
        with open(os.path.join(root, f.path), "rb") as fh:
            yield f.path, fh.read()


def build(
    out: str,
    packages: list[Package],
    stdlib: bool = True,
    tokenizer_path: str | None = None,
    val_percent: float = 2.0,
) -> dict:
    """Download, extract, deduplicate and tokenise (see the module notes); resumable: a
    package with a record in OUT/done is not redone. Returns the manifest."""
    from tqdm import tqdm

    for sub in ("archives", "src", "heldout", "done", "tokens"):
        os.makedirs(os.path.join(out, sub), exist_ok=True)
    names = [p.name for p in packages]
    if len(set(names)) != len(names):
        raise LeapDecodeError("the package list names a package twice: keep one version of each")
    seen: set[str] = set()
    records: dict[str, dict] = {}
    # held-out packages right after the stdlib: a file they share with a training package is
    # then dropped from training (deduplication keeps the first copy), so nothing held out is
    # trained on
    units = ([Package(STDLIB, sys.version.split()[0], "PSF-2.0")] if stdlib else []) + sorted(
        packages, key=lambda p: not p.heldout
    )
    for pkg in units:  # what earlier runs kept, in order: the deduplication resumes from it
        path = os.path.join(out, "done", pkg.name + ".json")
        if os.path.isfile(path):
            with open(path) as f:
                rec = json.load(f)
            if rec.get("version") == pkg.version:
                records[pkg.name] = rec
                seen.update(rec.get("keys", []))
    failed = []
    bar = tqdm(units, desc="corpus packages", unit="pkg")
    for pkg in bar:
        bar.set_postfix_str(pkg.name)
        if pkg.name in records:
            continue
        target = os.path.join(out, "heldout" if pkg.heldout else "src", pkg.name)
        shutil.rmtree(target, ignore_errors=True)  # a half-written earlier try
        rec = {"name": pkg.name, "version": pkg.version, "license": pkg.license,
               "heldout": pkg.heldout}  # fmt: skip
        try:
            if pkg.name == STDLIB:
                rec["license_metadata"] = "PSF-2.0"
                rec.update(_write_files(_stdlib_files(), target, seen))
            else:
                wheel = download(pkg, os.path.join(out, "archives"))
                with open(wheel, "rb") as f:
                    rec["archive"] = os.path.basename(wheel)
                    rec["archive_sha256"] = hashlib.sha256(f.read()).hexdigest()
                with zipfile.ZipFile(wheel) as z:
                    rec["license_metadata"] = metadata_licences(z)
                    if is_copyleft(rec["license_metadata"]) or is_copyleft(pkg.license):
                        rec.update(files=0, bytes=0, keys=[], excluded="copyleft licence")
                    else:
                        rec.update(_write_files(_wheel_files(z), target, seen))
        except (RuntimeError, zipfile.BadZipFile, OSError) as e:
            failed.append(f"{pkg.name}: {e}")
            tqdm.write(f"corpus: {pkg.name} failed ({e}); rerun the command to retry it")
            continue
        tmp = os.path.join(out, "done", pkg.name + ".json.tmp")
        with open(tmp, "w") as f:
            json.dump(rec, f)
        os.replace(tmp, os.path.join(out, "done", pkg.name + ".json"))
        records[pkg.name] = rec
    manifest = _manifest(out, units, records, val_percent)
    if tokenizer_path and not failed:  # streams of a partial build would go stale
        manifest["tokens"] = _tokenise(out, tokenizer_path, val_percent)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump({**manifest, "failed": failed}, f, indent=1)
    if failed:
        raise LeapDecodeError(
            f"{len(failed)} package(s) failed ({'; '.join(failed[:3])}): the rest is built "
            "and kept; rerun the same command to retry them"
        )
    return manifest


def _manifest(out: str, units, records: dict, val_percent: float) -> dict:
    rows = []
    for pkg in units:
        rec = records.get(pkg.name)
        if rec is not None:
            rows.append({k: v for k, v in rec.items() if k != "keys"})
    train_bytes = sum(r["bytes"] for r in rows if not r["heldout"])
    return {
        "packages": rows,
        "n_packages": len(rows),
        "files": sum(r["files"] for r in rows),
        "bytes": {
            "train_and_validation": train_bytes,
            "heldout": sum(r["bytes"] for r in rows if r["heldout"]),
        },
        "val_percent": val_percent,
        "heldout_packages": [r["name"] for r in rows if r["heldout"]],
    }


def _tokenise(out: str, tokenizer_path: str, val_percent: float) -> dict:
    """OUT/tokens/{train,validation,heldout}.npy with this tokenizer; returns the counts and
    bytes per token. Each split is written once (delete the file to redo it)."""
    from .data import encode_split
    from .fit import load_tokenizer

    tok = load_tokenizer(tokenizer_path)
    splits = {"train": ("src", "train"), "validation": ("src", "validation"),
              "heldout": ("heldout", None)}  # fmt: skip
    counts = {}
    for split, (folder, part) in splits.items():
        path = os.path.join(out, "tokens", split + ".npy")
        root = os.path.join(out, folder)
        try:
            files = corpus.scan(root, (".py",), val_percent)
        except LeapDecodeError:  # no files (no held-out package in a partial list)
            files = []
        files = [f for f in files if part in (None, f.split)]
        n_bytes = sum(f.bytes for f in files)
        # the stream's sources and tokenizer: a stream written from others is written again
        stamp = {
            "files": len(files),
            "bytes": n_bytes,
            "tokenizer": os.path.abspath(tokenizer_path),
        }
        stamp_path = os.path.join(out, "tokens", split + ".json")
        if os.path.isfile(stamp_path):
            with open(stamp_path) as f:
                if json.load(f) != stamp and os.path.isfile(path):
                    os.remove(path)
        if not os.path.isfile(path):
            arr = encode_split(tok, root, files, None, label=split)
            np.save(path + ".tmp.npy", arr)
            os.replace(path + ".tmp.npy", path)
            with open(stamp_path, "w") as f:
                json.dump(stamp, f)
        n = len(np.load(path, mmap_mode="r"))
        counts[split] = {"tokens": n, "bytes": n_bytes, "files": len(files),
                         "bytes_per_token": round(n_bytes / max(n, 1), 3)}  # fmt: skip
    counts["tokenizer"] = os.path.abspath(tokenizer_path)
    return counts
