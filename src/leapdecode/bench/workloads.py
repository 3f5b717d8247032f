"""The benchmark's prompt sets, built from the embedded models' held-out Python files.

Source: the files of the `validation` split in `<target>/corpus_manifest.json` (the
standard library of the interpreter the models were trained with). Each file's sha256 is
checked against the manifest, so a prompt set is reproducible or the build says why not.

Categories (Spec-Bench style, for code):
- completion: a file's text cut at a line boundary inside a function or class body;
- revision:   a snippet, an instruction comment (rename an identifier), and the start of
              the revised snippet; the expected rest of the revision sets max_new_tokens;
- grounded:   a long module excerpt, then the start of its test file that uses its names;
- free:       a signature and docstring only, little to copy;
- chat:       a user's request to an instruct model, the chat template applied when the run
              loads it: "write a function that ...", "fix this bug", "add type hints to this"
              (the code: revision snippets and small functions written here).

Regenerate: `leapdecode bench prompts` (writes bench/prompts/<category>.jsonl).
"""

from __future__ import annotations

import ast
import json
import os
import random
import textwrap

from .. import code_edits
from ..errors import LeapDecodeError

CATEGORIES = ("completion", "revision", "grounded", "free", "chat")
TEXT = CATEGORIES[:4]  # prompts as text; chat's are messages until chat_prompts applies a template
MAX_NEW_TOKENS = {"completion": 128, "revision": 192, "grounded": 128, "free": 128, "chat": 256}
PROMPT_CHARS = {"completion": 2000, "grounded": 2600}


def validation_files(manifest_path: str) -> list[tuple[str, str]]:
    """(relative path, text) of every validation file of 200 bytes or more, checked by
    sha256 against the manifest (train/evaluate.py reads them the same way)."""
    from ..train.validation import validation_files as checked_files

    if not os.path.isfile(manifest_path):
        raise LeapDecodeError(
            f"{manifest_path!r} not found: pass --target with a model that has a corpus manifest"
        )
    with open(manifest_path) as f:
        manifest = json.load(f)
    try:
        files = checked_files(manifest)
    except LeapDecodeError as e:
        raise LeapDecodeError(
            f"{e}; the prompts need the corpus the models were trained on "
            "(keep the committed bench/prompts files instead of regenerating them)"
        ) from None
    return [(path, data.decode("utf-8")) for path, data in files if len(data) >= 200]


def _tail(text: str, chars: int) -> str:
    """The last `chars` characters of text, starting at a line boundary."""
    if len(text) <= chars:
        return text
    cut = text.index("\n", len(text) - chars) + 1
    return text[cut:]


def completion(files, rng: random.Random, n: int, used: set | None = None) -> list[dict]:
    cands = []
    for path, text in files:
        lines = text.splitlines(keepends=True)
        for fn in code_edits.functions(ast.parse(text)):
            body = fn.end_lineno - fn.lineno
            if body >= 8:
                # Cut a third of the way into the body, at the end of a line.
                cut = fn.lineno + max(1, body // 3)
                cands.append((path, fn.name, "".join(lines[:cut])))
    return [
        {
            "id": f"completion-{i}",
            "source": f"{p}:{name}",
            "prompt": _tail(pre, PROMPT_CHARS["completion"]),
        }
        for i, (p, name, pre) in enumerate(_pick(cands, rng, n, used))
    ]


def revision(files, rng: random.Random, n: int, tokenizer, used: set | None = None) -> list[dict]:
    cands = [(path, *c) for path, text in files for c in code_edits.candidates(text)]
    out = []
    for i, (path, name, code, names) in enumerate(_pick(cands, rng, n, used)):
        prompt, rest, _ = code_edits.revision(code, names, rng)
        budget = min(
            MAX_NEW_TOKENS["revision"], len(tokenizer.encode(rest, add_special_tokens=False))
        )
        out.append(
            {
                "id": f"revision-{i}",
                "source": f"{path}:{name}",
                "prompt": prompt,
                "expected": rest,
                "max_new_tokens": budget,
            }
        )
    return out


def grounded(files, rng: random.Random, n: int, used: set | None = None) -> list[dict]:
    cands = []
    for path, text in files:
        tree = ast.parse(text)
        module = os.path.splitext(os.path.basename(path))[0]
        lines = text.splitlines(keepends=True)
        for node in tree.body:
            if not isinstance(node, ast.ClassDef | ast.FunctionDef) or node.end_lineno is None:
                continue
            code = "".join(lines[node.lineno - 1 - len(node.decorator_list) : node.end_lineno])
            if len(code) < 600:
                continue
            code = code[: PROMPT_CHARS["grounded"]]
            code = code[: code.rindex("\n") + 1]
            cands.append((path, module, node, code))
    out = []
    picked = _pick(cands, rng, n, used, key=lambda c: (c[0], c[2].name))
    for i, (path, module, node, code) in enumerate(picked):
        if isinstance(node, ast.ClassDef):
            methods = [m.name for m in node.body if isinstance(m, ast.FunctionDef)]
            target = next(
                (m for m in methods if not m.startswith("__")), methods[0] if methods else "init"
            )
            test = (
                f"class Test{node.name}(unittest.TestCase):\n\n"
                f"    def test_{target.strip('_')}(self):\n"
                f"        obj = {node.name}("
            )
        else:
            test = (
                f"class Test{node.name.title().replace('_', '')}(unittest.TestCase):\n\n"
                f"    def test_{node.name.strip('_')}(self):\n"
                f"        result = {node.name}("
            )
        prompt = (
            f"# {module}.py\n{code}\n\n# test_{module}.py\nimport unittest\n"
            f"from {module} import {node.name}\n\n\n{test}"
        )
        out.append({"id": f"grounded-{i}", "source": f"{path}:{node.name}", "prompt": prompt})
    return out


def free(files, rng: random.Random, n: int, used: set | None = None) -> list[dict]:
    cands = []
    for path, text in files:
        lines = text.splitlines(keepends=True)
        for fn in code_edits.functions(ast.parse(text)):
            doc = ast.get_docstring(fn, clean=False)
            if not doc or not fn.body or fn.body[0].end_lineno is None:
                continue
            start = fn.lineno - 1 - len(fn.decorator_list)
            head = textwrap.dedent("".join(lines[start : fn.body[0].end_lineno]))
            if len(head) < 2000:
                cands.append((path, fn.name, head))
    return [
        {"id": f"free-{i}", "source": f"{p}:{name}", "prompt": head}
        for i, (p, name, head) in enumerate(_pick(cands, rng, n, used))
    ]


def _pick(
    cands: list, rng: random.Random, n: int, used: set | None = None, key=lambda c: (c[0], c[1])
) -> list:
    """n candidates at random, each from a (file, function) no prompt has used yet: the same
    code in two prompts would let a method that remembers earlier outputs (suffix) copy."""
    used = set() if used is None else used
    fresh, seen = [], set()
    for c in cands:
        if key(c) not in used and key(c) not in seen:
            seen.add(key(c))
            fresh.append(c)
    if len(fresh) < n:
        raise LeapDecodeError(f"only {len(fresh)} candidates for {n} prompts: lower --per-category")
    picked = rng.sample(fresh, n)
    used.update(key(c) for c in picked)
    return picked


def build(
    manifest_path: str, tokenizer, per_category: int = 20, seed: int = 0
) -> dict[str, list[dict]]:
    files = validation_files(manifest_path)
    used: set = set()  # (file, function) already in a prompt: each source serves once
    sets = {
        "completion": completion(files, random.Random(seed), per_category, used),
        "revision": revision(files, random.Random(seed + 1), per_category, tokenizer, used),
        "grounded": grounded(files, random.Random(seed + 2), per_category, used),
        "free": free(files, random.Random(seed + 3), per_category, used),
    }
    sets["chat"] = chat(sets["revision"])
    for cat, rows in sets.items():
        for row in rows:
            if cat == "chat":
                continue
            row.setdefault("max_new_tokens", MAX_NEW_TOKENS[cat])
            _end_inside_line(row, tokenizer)
    return sets


WRITE = (
    "Write a Python function `merge_intervals(intervals)` that merges overlapping closed "
    "intervals given as (start, end) tuples and returns them sorted. Include a docstring.",
    "Write a Python function that reads a CSV file and returns a dict mapping each value of "
    "the `category` column to the sum of the `amount` column for that category.",
    "Write a Python class `LRUCache` with `get(key)` and `put(key, value)` methods and a fixed "
    "capacity, evicting the least recently used entry.",
)
BUGGY = (
    (
        "This function should return the n-th Fibonacci number (fib(0) == 0, fib(1) == 1), "
        "but fib(5) returns 8. Fix this bug and show the corrected function.",
        "def fib(n):\n    a, b = 1, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
        "    return a\n",
    ),
    (
        "This function should return the words that appear in both lists, in the order of the "
        "first list and without duplicates, but it sometimes returns duplicates. Fix this bug.",
        "def common_words(first, second):\n    result = []\n    seen = set(second)\n"
        "    for word in first:\n        if word in seen:\n            result.append(word)\n"
        "    return result\n",
    ),
)


def chat(revision_rows: list[dict], n_hints: int = 3) -> list[dict]:
    """Chat requests (see the module's docstring): "write", "fix" and "hints" kinds."""
    fix = [f"{why}\n\n```python\n{code}```" for why, code in BUGGY]
    hints = []
    for row in revision_rows[:n_hints]:
        code = row["prompt"].split("# Task")[0].removeprefix("# Original:\n").strip()
        hints.append(
            f"Add type hints to this function; change nothing else.\n\n```python\n{code}\n```"
        )
    kinds = [list(WRITE), fix, hints]
    asks = [k[i] for i in range(max(map(len, kinds))) for k in kinds if i < len(k)]  # interleaved
    return [
        {
            "id": f"chat-{i}",
            "messages": [{"role": "user", "content": text}],
            "max_new_tokens": MAX_NEW_TOKENS["chat"],
        }
        for i, text in enumerate(asks)
    ]


def chat_prompts(sets: dict[str, list[dict]], tokenizer, name: str) -> None:
    """Each chat row's prompt: its messages through the tokenizer's chat template, as token
    ids (a model without a template is a clear error naming the category)."""
    from ..chat import chat_ids

    for row in sets.get("chat", []):
        row["prompt"] = chat_ids(
            tokenizer, row["messages"], name, hint="leave `chat` out of --categories"
        )


def _end_inside_line(row: dict, tokenizer) -> None:
    """A prompt cut after a newline ends on a bare "\n" token, which byte-level BPE rarely
    produces in the middle of code: a newline merges with the next line's indentation
    ("\n    "). The model then starts a new top-level statement instead of continuing. So
    cut before the newline; the expected text (revision) starts with it."""
    if row["prompt"].endswith("\n"):
        row["prompt"] = row["prompt"][:-1]
        if "expected" in row:
            row["expected"] = "\n" + row["expected"]
            n = len(tokenizer.encode(row["expected"], add_special_tokens=False))
            row["max_new_tokens"] = min(MAX_NEW_TOKENS["revision"], n)


def save(sets: dict[str, list[dict]], out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for cat, rows in sets.items():
        path = os.path.join(out_dir, f"{cat}.jsonl")
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        paths.append(path)
    return paths


def load(prompt_dir: str, categories=TEXT) -> dict[str, list[dict]]:
    sets = {}
    for cat in categories:
        path = os.path.join(prompt_dir, f"{cat}.jsonl")
        if not os.path.isfile(path):
            raise LeapDecodeError(
                f"{path!r} not found: run `leapdecode bench prompts --out {prompt_dir}`"
            )
        with open(path) as f:
            sets[cat] = [json.loads(line) for line in f if line.strip()]
    return sets
