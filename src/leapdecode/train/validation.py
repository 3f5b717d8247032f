"""The held-out split a model was trained without: its corpus manifest, the validation
files (checked against the manifest's hashes) and prompts cut from them. Used by `train
evaluate`, the heads' training, the copying measure and the bench's workloads."""

from __future__ import annotations

import json
import os

from ..errors import LeapDecodeError


def model_manifest(model_dir: str) -> dict:
    path = os.path.join(model_dir, "corpus_manifest.json")
    if not os.path.isfile(path):
        raise LeapDecodeError(f"{model_dir!r} has no corpus_manifest.json: was it trained here?")
    with open(path) as f:
        return json.load(f)


def validation_files(manifest: dict, root: str | None = None) -> list[tuple[str, bytes]]:
    """The held-out files, checked against the manifest's sha256 (the corpus must not drift)."""
    import hashlib

    root = root or manifest["root"]
    out = []
    for f in manifest["files"]:
        if f["split"] != "validation":
            continue
        path = os.path.join(root, f["path"])
        try:
            data = open(path, "rb").read()
        except OSError as e:
            raise LeapDecodeError(f"validation file {path!r} is missing: pass --data DIR") from e
        if hashlib.sha256(data).hexdigest() != f["sha256"]:
            raise LeapDecodeError(f"validation file {path!r} differs from the manifest")
        out.append((f["path"], data))
    return out


def validation_prompts(tokenizer, files, n: int, prompt_tokens: int = 192) -> list[str]:
    """Prefixes of held-out files, cut at a line boundary."""
    prompts = []
    for _, data in files:
        text = data.decode("utf-8")
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < prompt_tokens + 128:
            continue
        prefix = tokenizer.decode(ids[:prompt_tokens])
        cut = prefix.rfind("\n")
        prompts.append(prefix[: cut + 1] if cut > 0 else prefix)
        if len(prompts) == n:
            break
    return prompts
