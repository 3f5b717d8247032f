"""The training corpus: source files under a folder, split train/validation by path hash.

Default: the `.py` files of the running interpreter's standard library (site-packages
excluded). The split is deterministic (sha256 of the relative path), and a manifest
(file list, sha256, byte counts) is saved with every model so a run can be reproduced.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass

from ..errors import LeapDecodeError

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the corpus root
    sha256: str
    bytes: int
    split: str  # "train" | "validation"


def is_validation(rel_path: str, percent: float) -> bool:
    h = int(hashlib.sha256(rel_path.encode("utf-8")).hexdigest()[:8], 16)
    return (h % 10_000) < percent * 100


def scan(
    root: str | None = None, extensions=(".py",), val_percent: float = 2.0
) -> list[SourceFile]:
    root = root or stdlib_dir()
    if not os.path.isdir(root):
        raise LeapDecodeError(f"corpus folder {root!r} does not exist: pass --data DIR")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(tuple(extensions)):
                continue
            full = os.path.join(dirpath, name)
            try:
                data = open(full, "rb").read()
                data.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue  # unreadable or not UTF-8 text: not part of the corpus
            rel = os.path.relpath(full, root)
            split = "validation" if is_validation(rel, val_percent) else "train"
            files.append(SourceFile(rel, hashlib.sha256(data).hexdigest(), len(data), split))
    if not files:
        raise LeapDecodeError(f"no {'/'.join(extensions)} files under {root!r}")
    return files


def read(root: str, f: SourceFile) -> str:
    with open(os.path.join(root, f.path), encoding="utf-8") as fh:
        return fh.read()


def manifest(root: str, files: list[SourceFile]) -> dict:
    entries = [f.__dict__ for f in files]
    body = json.dumps(entries, sort_keys=True).encode()
    return {
        "root": root,
        "files": entries,
        "n_train": sum(f.split == "train" for f in files),
        "n_validation": sum(f.split == "validation" for f in files),
        "train_bytes": sum(f.bytes for f in files if f.split == "train"),
        "validation_bytes": sum(f.bytes for f in files if f.split == "validation"),
        "sha256": hashlib.sha256(body).hexdigest(),
    }


def save_manifest(root: str, files: list[SourceFile], out_dir: str) -> dict:
    m = manifest(root, files)
    with open(os.path.join(out_dir, "corpus_manifest.json"), "w") as f:
        json.dump(m, f, indent=1)
    return m
