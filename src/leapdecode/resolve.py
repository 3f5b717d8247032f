"""The one model resolver: what --target, --draft, --speculator, --pard, the API and the server
accept, turned into a Hugging Face model folder (one that holds config.json).

A spec is, in this order:
- an existing folder, used as it is;
- a GGUF file (by its first bytes, whatever its name), dequantized once to bfloat16 into the
  cache (`gguf-models/<first 16 hex digits of its sha256>`);
- a catalogue name (`leapdecode pull --list`), pulled beforehand with `leapdecode pull NAME`;
- a Hugging Face Hub id (`owner/name`), downloaded with huggingface_hub.

Whatever is made here appears at once: it is written into FOLDER.partial, renamed, and a marker
(leapdecode-pull.json) is written last. A folder without the marker is not complete.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import sys
from datetime import datetime, timezone
from importlib import resources

from .cache import cache_dir, cache_root
from .errors import LeapDecodeError

MARKER = "leapdecode-pull.json"
GGUF_MAGIC = b"GGUF"
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
HUB_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "*.safetensors",
    "*.safetensors.index.json",
]
GGUF_GROWTH = 4  # a bfloat16 folder is at most about 4x its quantized GGUF file
CHUNK = 1 << 22


def catalogue() -> dict[str, dict]:
    """The catalogue's entries by name (parsed from the shipped catalogue.json)."""
    text = resources.files(__package__).joinpath("catalogue.json").read_text(encoding="utf-8")
    return json.loads(text)["models"]


def is_complete(folder: str) -> bool:
    """Was this folder finished (its marker written last)?"""
    return os.path.isfile(os.path.join(folder, MARKER)) and os.path.isfile(
        os.path.join(folder, "config.json")
    )


def pulled_path(name: str) -> str | None:
    """The folder of a pulled catalogue model, or None when it is not pulled (or not complete)."""
    folder = cache_dir("models", name)
    return folder if is_complete(folder) else None


def resolve_model(spec: str, what: str = "target", *, progress: bool = True) -> str:
    """A Hugging Face model folder for a folder, a GGUF file, a catalogue name or a Hub id."""
    spec = os.fspath(spec)
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        from .models.loader import check_model_dir

        return check_model_dir(path, what)
    if os.path.isfile(path):
        if is_gguf(path):
            return gguf_model(path, progress=progress)
        raise LeapDecodeError(
            f"{what} path {spec!r} is a file, neither a model folder nor a GGUF file: pass the "
            "folder that holds config.json, a .gguf file or a catalogue name "
            "(leapdecode pull --list)"
        )
    models = catalogue()
    if spec in models:
        folder = pulled_path(spec)
        if folder is None:
            raise LeapDecodeError(f"{what} {spec!r} is not pulled yet: run: leapdecode pull {spec}")
        return folder
    if _looks_like_path(spec):
        from .models.loader import check_model_dir

        return check_model_dir(path, what)  # says it does not exist
    if HUB_ID.fullmatch(spec):
        return hub_model(spec, what)
    raise LeapDecodeError(
        f"unknown {what} {spec!r}: not a folder, a .gguf file, a Hub id (owner/name) or a "
        f"catalogue name ({', '.join(models)}): pass one of those (leapdecode pull --list)"
    )


def _looks_like_path(spec: str) -> bool:
    return (
        spec.startswith((".", "/", "~"))
        or spec.count("/") > 1
        or "\\" in spec
        or spec.lower().endswith(".gguf")
    )


# --- Hub ---------------------------------------------------------------------------------------


def hub_model(repo_id: str, what: str = "target") -> str:
    """A Hub repository's config, tokenizer and safetensors files, through huggingface_hub."""
    alternatives = (
        "pass a local model folder, a .gguf file, or a catalogue model "
        "(leapdecode pull --list, then leapdecode pull NAME)"
    )
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(repo_id, allow_patterns=HUB_FILES)
    except Exception as e:  # noqa: BLE001 - offline, no network, not found, gated: one answer
        reason = _first_line(e)
        if _hub_offline():
            reason = "HF_HUB_OFFLINE is set and it is not in the local Hub cache"
        raise LeapDecodeError(
            f"cannot get {what} {repo_id!r} from the Hugging Face Hub ({reason}), and it is "
            f"not a local folder: {alternatives}"
        ) from None
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise LeapDecodeError(
            f"the Hub repository {repo_id!r} has no config.json (it may hold only GGUF files): "
            f"download a .gguf file from it and pass that file, or {alternatives}"
        )
    return folder


def _hub_offline() -> bool:
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else ""
    line = line if len(line) <= 160 else line[:157] + "..."
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


# --- GGUF files --------------------------------------------------------------------------------


def is_gguf(path: str) -> bool:
    """Does the file start with the GGUF magic?"""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def gguf_model(path: str, progress: bool = True) -> str:
    """The bfloat16 folder of a GGUF file, made once and found again by the file's sha256."""
    digest = cached_sha256(path, progress=progress)
    folder = cache_dir("gguf-models", digest[:16])
    if is_complete(folder):
        return folder
    with locked("gguf-" + digest[:16]):
        if is_complete(folder):  # made meanwhile by another process
            return folder
        size = os.path.getsize(path)
        check_space(f"the GGUF file {path!r}", {"bfloat16 model": GGUF_GROWTH * size})
        entry = next(
            (e for e in catalogue().values() if e["gguf"]["sha256"] == digest), None
        )  # a catalogue model's GGUF: its end-of-turn ids
        record = {"source": os.path.abspath(path), "sha256": digest}
        eos = entry["eos_token_ids"] if entry else None
        convert_gguf(path, folder, eos_token_ids=eos, record=record, progress=progress)
    return folder


def convert_gguf(
    gguf_path: str,
    folder: str,
    eos_token_ids: list[int] | None = None,
    record: dict | None = None,
    progress: bool = True,
) -> str:
    """Dequantize a GGUF file to a bfloat16 Hugging Face folder, complete at once."""
    partial = folder + ".partial"
    remove(partial)
    say(f"dequantizing {os.path.basename(gguf_path)} to bfloat16 ...", progress)
    try:
        _dequantize(gguf_path, partial, eos_token_ids, progress)
    except BaseException:
        remove(partial)
        raise
    remove(folder)  # an incomplete folder left by an interrupted run
    os.replace(partial, folder)
    write_marker(folder, record or {})
    return folder


def _dequantize(gguf_path: str, out: str, eos_token_ids, progress: bool) -> None:
    try:
        import gguf  # noqa: F401 - transformers needs it to read GGUF files
    except ImportError:
        raise LeapDecodeError(
            "reading GGUF files needs the gguf package: pip install gguf"
        ) from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = os.path.split(os.path.abspath(gguf_path))
    options = {}
    try:  # transformers 5 keeps GGUF weights packed unless asked to dequantize them
        from transformers import GgufConfig

        options["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    with _progress_bars(progress), _faster_gguf():
        try:
            model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, dtype=torch.bfloat16, **options
            )
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds
            raise LeapDecodeError(
                f"cannot convert the GGUF file {gguf_path!r} ({_first_line(e)}): transformers "
                "reads GGUF files of the architectures it supports; pass a Hugging Face model "
                "folder instead"
            ) from None
        model.save_pretrained(out)
        del model
        tokenizer.save_pretrained(out)  # keeps the chat template
    if eos_token_ids:
        generation = GenerationConfig.from_pretrained(out)
        generation.eos_token_id = list(eos_token_ids)
        generation.save_pretrained(out)


@contextlib.contextmanager
def _progress_bars(on: bool):
    """transformers' own progress bars as they are, or hidden (some are plain tqdm bars on
    sys.stderr: those are silenced by pointing sys.stderr elsewhere meanwhile)."""
    if on:
        yield
        return
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
            yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _faster_gguf():
    """transformers reads a GGUF file's metadata three times (config, weights, tokenizer: a
    slow parse of the vocabulary each time) and builds gguf's tensor-name map once per module
    of the model. Each gives the same answer every time, so for the duration each is made once."""
    import gguf

    names = [n for n in ("GGUFReader", "get_tensor_name_map") if hasattr(gguf, n)]
    saved = {n: getattr(gguf, n) for n in names}
    for n in names:
        setattr(gguf, n, functools.lru_cache(maxsize=None)(saved[n]))
    try:
        yield
    finally:
        for n in names:
            setattr(gguf, n, saved[n])


# --- files, hashes, markers, disk space ----------------------------------------------------------


def file_sha256(path: str, progress: bool = False, label: str = "checking") -> str:
    """The sha256 of a file, read in chunks (a progress bar over bytes when asked)."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    size = os.path.getsize(path)
    with (
        open(path, "rb") as f,
        tqdm(
            total=size,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"{label} {os.path.basename(path)}",
            file=sys.stderr,
            disable=not progress or size < (64 << 20),
            leave=False,
        ) as bar,
    ):
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def cached_sha256(path: str, progress: bool = False) -> str:
    """A file's sha256, remembered by (path, size, mtime) so that a big file is read once."""
    path = os.path.realpath(path)
    stat = os.stat(path)
    key = [stat.st_size, stat.st_mtime_ns]
    memo_path = cache_dir("gguf-models", "sha256.json")
    memo = _read_json(memo_path)
    known = memo.get(path)
    if isinstance(known, dict) and known.get("key") == key:
        return known["sha256"]
    digest = file_sha256(path, progress=progress, label="hashing")
    memo = _read_json(memo_path)  # another process may have added to it meanwhile
    memo[path] = {"key": key, "sha256": digest}
    write_json(memo_path, memo)
    return digest


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(path: str, data: dict) -> None:
    """Write a json file whole (a temporary file renamed over it)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def write_marker(folder: str, record: dict) -> None:
    """Mark a folder complete: the last file written into it."""
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    write_json(os.path.join(folder, MARKER), {**record, "time": stamp})


def remove(path: str) -> None:
    """Remove a file or a folder if it is there."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


@contextlib.contextmanager
def locked(key: str):
    """Hold the cache's lock named `key` (another process making the same thing waits)."""
    path = cache_dir("locks", key + ".lock")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def free_bytes(path: str) -> int:
    """Free bytes on the disk that holds path (or its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.0f} MB"


def check_space(what: str, needs: dict[str, int]) -> None:
    """Refuse, with the numbers, when the cache's disk has less room than the parts need."""
    root = cache_root()
    need, free = sum(needs.values()), free_bytes(root)
    if need <= free:
        return
    parts = ", ".join(f"{k} {gb(v)}" for k, v in needs.items() if v)
    raise LeapDecodeError(
        f"not enough disk space for {what}: it needs about {gb(need)} ({parts}) and the cache "
        f"{root} has {gb(free)} free: free some space, or set LEAPDECODE_CACHE to a folder on "
        "a disk with room"
    )


def say(message: str, progress: bool = True) -> None:
    """A progress line on stderr."""
    if progress:
        print(f"leapdecode: {message}", file=sys.stderr, flush=True)


def resolve_models(target: str | None, draft: str | None) -> tuple[str, str | None]:
    """The commands' (target, draft) as folders: the embedded pair when no target is given
    (paths.resolve_models' rule), each else resolved as `resolve_model` does."""
    from .paths import resolve_models as defaults

    target, draft = defaults(target, draft)
    return resolve_model(target, "target"), None if draft is None else resolve_model(draft, "draft")
