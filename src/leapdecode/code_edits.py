"""Code revisions built from real source: rename an argument, in one fixed prompt format.

Shared by the benchmark's `revision` prompts (held-out files) and the target's revision
training documents (training files), so both use exactly the same format:

    # Original:
    <snippet>
    # Task: rename the argument `old` to `new`; change nothing else.
    # Revised:
    <snippet with old renamed>
"""

from __future__ import annotations

import ast
import io
import keyword
import random
import textwrap
import tokenize


def functions(tree: ast.AST) -> list[ast.FunctionDef]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno
    ]


def snippet(lines: list[str], node: ast.AST) -> str:
    """The source of a def (decorators included), dedented to column 0."""
    start = node.lineno - 1 - len(getattr(node, "decorator_list", []))
    return textwrap.dedent("".join(lines[start : node.end_lineno]))


def name_uses(code: str, name: str):
    for t in tokenize.generate_tokens(io.StringIO(code).readline):
        if t.type == tokenize.NAME and t.string == name:
            yield t


def rename(code: str, old: str, new: str) -> str:
    """Rename identifier `old` to `new` (NAME tokens only, not strings or comments)."""
    lines = code.splitlines(keepends=True)
    # Replace from the right of each line so earlier columns stay valid.
    for t in sorted(name_uses(code, old), key=lambda t: t.start, reverse=True):
        row, col = t.start[0] - 1, t.start[1]
        lines[row] = lines[row][:col] + new + lines[row][t.end[1] :]
    return "".join(lines)


def new_name(old: str, code: str) -> str:
    for cand in (f"new_{old}", f"{old}_value", f"the_{old}", f"{old}_2"):
        if cand not in code and not keyword.iskeyword(cand):
            return cand
    return f"{old}_{len(code)}"


def renamable_args(fn: ast.FunctionDef, code: str) -> list[str]:
    """Arguments (not self/cls, longer than one letter) used at least twice in the snippet."""
    names = sorted(
        {a.arg for a in fn.args.args + fn.args.kwonlyargs if a.arg not in ("self", "cls")}
    )
    return [x for x in names if len(x) > 1 and sum(1 for _ in name_uses(code, x)) >= 2]


def candidates(
    text: str, min_lines: int = 6, max_lines: int = 30
) -> list[tuple[str, str, list[str]]]:
    """(function name, snippet, renamable arguments) for each suitable def in a file."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for fn in functions(tree):
        code = snippet(lines, fn)
        if not min_lines <= code.count("\n") <= max_lines:
            continue
        try:
            names = renamable_args(fn, code)
        except (tokenize.TokenError, IndentationError, SyntaxError):
            continue
        if names:
            out.append((fn.name, code, names))
    return out


def revision(code: str, names: list[str], rng: random.Random) -> tuple[str, str, str]:
    """(prompt ending with the revised signature line, the expected rest, the instruction)."""
    old = rng.choice(names)
    new = new_name(old, code)
    revised = rename(code, old, new)
    head = revised.splitlines(keepends=True)[0]
    task = f"rename the argument `{old}` to `{new}`; change nothing else."
    prompt = f"# Original:\n{code}\n# Task: {task}\n# Revised:\n{head}"
    return prompt, revised[len(head) :], task


# ---- more kinds of revision, for training documents that teach copying ------------------
#
# Each takes a dedented snippet holding one def and returns (task, revised) or None when the
# snippet does not lend itself to that edit. The revised code differs from the original in a
# few places only: the rest must be carried over token for token, which is what a target
# has to learn before prompt lookup pays on revision.

SAME_AGAIN = "the same function again, unchanged"


def _def_node(code: str) -> ast.FunctionDef | None:
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return None
    fn = tree.body[0] if tree.body else None
    return fn if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) else None


def _body_lines(code: str, fn: ast.FunctionDef) -> tuple[list[str], int]:
    """The snippet's lines and the index of the first body line (after the signature)."""
    return code.splitlines(keepends=True), fn.body[0].lineno - 1


def _indent_of(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def edit_unchanged(code: str, fn, rng: random.Random):
    return SAME_AGAIN, code


def _rename_one(code: str, names: list[str], rng: random.Random, task: str):
    """Rename one of `names` (chosen at random); task is formatted with old and new."""
    if not names:
        return None
    old = rng.choice(names)
    new = new_name(old, code)
    return task.format(old=old, new=new), rename(code, old, new)


def edit_rename_arg(code: str, fn, rng: random.Random):
    task = "rename the argument `{old}` to `{new}`; change nothing else"
    return _rename_one(code, renamable_args(fn, code), rng, task)


def edit_rename_local(code: str, fn, rng: random.Random):
    args = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    stored = sorted(
        {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        - args
    )
    stored = [n for n in stored if len(n) > 1 and sum(1 for _ in name_uses(code, n)) >= 2]
    return _rename_one(code, stored, rng, "rename the variable `{old}` to `{new}`")


def edit_rename_function(code: str, fn, rng: random.Random):
    new = new_name(fn.name, code)
    return f"rename the function to `{new}`", rename(code, fn.name, new)


def edit_add_docstring(code: str, fn, rng: random.Random):
    if ast.get_docstring(fn) is not None:
        return None
    lines, first = _body_lines(code, fn)
    if first >= len(lines) or first < 1:
        return None
    words = fn.name.strip("_").replace("_", " ") or "helper"
    doc = f'{_indent_of(lines[first])}"""{words[0].upper() + words[1:]}."""\n'
    return "add a docstring", "".join(lines[:first] + [doc] + lines[first:])


def edit_add_comment(code: str, fn, rng: random.Random):
    lines, first = _body_lines(code, fn)
    body = [i for i in range(first, len(lines)) if lines[i].strip()]
    if not body:
        return None
    i = rng.choice(body)
    note = rng.choice(["check this", "keep in sync with the caller", "fast path", "see above"])
    comment = f"{_indent_of(lines[i])}# {note}\n"
    return f"add the comment `# {note}`", "".join(lines[:i] + [comment] + lines[i:])


def edit_remove_line(code: str, fn, rng: random.Random):
    """Drop one comment line or one blank line inside the body."""
    lines, first = _body_lines(code, fn)
    cands = [i for i in range(first, len(lines)) if lines[i].lstrip().startswith("#")]
    if not cands:
        return None
    i = rng.choice(cands)
    return "remove the comment `" + lines[i].strip() + "`", "".join(lines[:i] + lines[i + 1 :])


def edit_swap_args(code: str, fn, rng: random.Random):
    """Swap two adjacent positional parameters in the signature (the body is unchanged)."""
    args = [a.arg for a in fn.args.args if a.arg not in ("self", "cls")]
    if len(args) < 2 or fn.args.defaults or fn.lineno != 1:
        return None
    i = rng.randrange(len(args) - 1)
    a, b = args[i], args[i + 1]
    lines = code.splitlines(keepends=True)
    head = lines[0]
    pair = f"{a}, {b}"
    if head.count(pair) != 1:
        return None
    lines[0] = head.replace(pair, f"{b}, {a}")
    return f"swap the parameters `{a}` and `{b}`", "".join(lines)


EDITS = (
    edit_unchanged,
    edit_rename_arg,
    edit_rename_local,
    edit_rename_function,
    edit_add_docstring,
    edit_add_comment,
    edit_remove_line,
    edit_swap_args,
)


def revision_document(code: str, rng: random.Random) -> str | None:
    """A training document: a function, an instruction, then the function revised.

    Two layouts, chosen at random: the benchmark's `# Original: / # Task: / # Revised:`
    format, and a compact one (`# <task>:` between the two versions), as a file with a
    near-duplicate function would show it.
    """
    fn = _def_node(code)
    if fn is None:
        return None
    for edit in rng.sample(EDITS, len(EDITS)):
        try:
            got = edit(code, fn, rng)
        except (tokenize.TokenError, IndentationError, SyntaxError):
            got = None
        if got is not None:
            break
    else:
        return None
    task, revised = got
    if rng.random() < 0.5:
        return f"# Original:\n{code}\n# Task: {task}.\n# Revised:\n{revised}"
    return f"{code}\n# {task[0].upper() + task[1:]}:\n{revised}"


def copy_prompt(code: str) -> tuple[str, str]:
    """(prompt, expected rest) for the copy test: a function, a line asking for the same
    function again unchanged, and its first line; the rest is the function's other lines."""
    head, rest = code.split("\n", 1) if "\n" in code else (code, "")
    return f"{code}\n# {SAME_AGAIN[0].upper() + SAME_AGAIN[1:]}:\n{head}", "\n" + rest


def all_functions(text: str, min_lines: int = 6, max_lines: int = 30) -> list[tuple[str, str]]:
    """(name, dedented snippet) for every def of min_lines..max_lines lines in a file."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for fn in functions(tree):
        code = snippet(lines, fn)
        if min_lines <= code.count("\n") <= max_lines and _def_node(code) is not None:
            out.append((fn.name, code))
    return out
