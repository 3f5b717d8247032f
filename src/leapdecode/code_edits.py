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
