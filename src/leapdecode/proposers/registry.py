"""Every speculation method by name: what it is called, which proposer drafts it, what an
engine must have loaded to run it, and whether `auto` may choose it.

This module is data and checks only (no torch, no proposer imported until an engine builds
one), so the server's HTTP process and `SpecConfig` read it without loading any model.
Adding a method is a file under proposers/ (its `Proposer`) and one `register` call:

    register(Method("toy", "mypackage.toy:ToyProposer", auto=True))

The engine then builds it (`Proposer.build`), requests may ask for it by name, and, with
`auto=True`, `auto` weighs its offers (`Proposer.offer`) with the others.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from ..errors import LeapDecodeError

# A method's drafts: never a tree, a tree only with use_tree_spec, or always a tree
CHAIN, TREE_OPTION, TREE = "chain", "option", "tree"


@dataclass(frozen=True)
class Method:
    name: str
    proposer: str | type  # "module:Class" (imported when an engine builds it) or the class
    auto: bool = False  # auto may choose it (SpecConfig.auto_methods)
    auto_default: bool = False  # ... and does unless a request says otherwise
    tree: str = CHAIN  # CHAIN | TREE_OPTION | TREE: whether its drafts need tree attention
    hidden: bool = False  # drafts from the target's hidden states (the native backend's)
    missing: str = ""  # what to do when the engine has not loaded it ("": always loaded)

    def proposer_class(self) -> type:
        if not isinstance(self.proposer, str):
            return self.proposer
        module, _, name = self.proposer.partition(":")
        return getattr(importlib.import_module(module), name)


_HEAD_FIX = (
    "pass --speculator PATH to a folder `leapdecode train {0}` wrote "
    "(or put it beside the target as <target>-{0})"
)
_P = "leapdecode.proposers."
_METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add a method (or replace the one of the same name); returns it."""
    if method.name in ("auto", "") or not method.name.isidentifier():
        raise ValueError(f"a method's name must be an identifier other than auto: {method.name!r}")
    if method.tree not in (CHAIN, TREE_OPTION, TREE):
        raise ValueError(f"Method.tree is one of {CHAIN}, {TREE_OPTION}, {TREE}: {method.tree!r}")
    _METHODS[method.name] = method
    return method


def unregister(name: str) -> None:
    _METHODS.pop(name, None)


for _m in (
    Method("none", _P + "base:NoProposer"),
    Method("ngram", _P + "ngram:NgramProposer", auto=True, auto_default=True, tree=TREE_OPTION),
    Method("suffix", _P + "suffix:SuffixProposer", auto=True, auto_default=True,
           tree=TREE_OPTION),
    Method("draft", _P + "draft_model:DraftModelProposer", auto=True, auto_default=True,
           missing="method 'draft' needs a draft model: pass --draft PATH"),
    Method("pard", _P + "pard:PardProposer", auto=True,
           missing="method 'pard' needs a parallel draft: pass --pard PATH (or --draft PATH) to a "
           "draft model whose config.json names its mask token (pard_token or mask_token_id, as vLLM's "
           "parallel drafting reads it)"),
    Method("lookahead", _P + "lookahead:LookaheadProposer", tree=TREE),
    Method("medusa", _P + "medusa:MedusaProposer", auto=True, tree=TREE, hidden=True,
           missing="method 'medusa' needs Medusa heads, and none is loaded"),
    Method("eagle", _P + "eagle:EagleProposer", auto=True, tree=TREE, hidden=True,
           missing="method 'eagle' needs an EAGLE head, and none is loaded"),
    Method("peagle", _P + "peagle:PeagleProposer", auto=True, hidden=True,
           missing="method 'peagle' needs a parallel EAGLE head (P-EAGLE), and none is loaded"),
):  # fmt: skip
    register(_m)


def get(name: str) -> Method:
    return _METHODS[name]


def names() -> tuple[str, ...]:
    """Every method a request may ask for, `auto` last."""
    return (*_METHODS, "auto")


def auto_choices() -> tuple[str, ...]:
    """The methods `auto` can choose from, in the order it weighs them."""
    return tuple(m.name for m in _METHODS.values() if m.auto)


def auto_default() -> tuple[str, ...]:
    return tuple(m.name for m in _METHODS.values() if m.auto_default)


def check(spec, backend: str, loaded) -> None:
    """Refuse a request an engine cannot run: `loaded`, the methods it built (Engine.capabilities);
    `backend`, its target's backend name (tree attention and hidden states are native's)."""
    method = _METHODS.get(spec.method)  # None: auto, which weighs what is loaded
    if method is not None and method.hidden and backend != "native":  # the reason, not a hint
        raise LeapDecodeError(
            f"{method.name} needs the target's hidden states and tree attention, which the "
            f"{backend} backend lacks: use --backend native"
        )
    if method is not None and method.name not in loaded:
        heads = [m for m in loaded if _METHODS[m].hidden]
        raise LeapDecodeError(
            (method.missing or f"method {method.name!r} is not loaded in this engine")
            + (f" (only {' and '.join(heads)})" if heads and method.hidden else "")
            + (": " + _HEAD_FIX.format(method.name) if method.hidden else "")
        )
    _check_block(spec)
    always = method is not None and method.tree == TREE
    optional = spec.use_tree_spec and any(
        m.tree == TREE_OPTION and spec.may_use(m.name) for m in _METHODS.values()
    )
    if (always or optional) and backend != "native":
        raise LeapDecodeError(
            f"{spec.method} with a draft tree needs tree attention, which the {backend} "
            "backend lacks: use --backend native" + ("" if always else " or drop use_tree_spec"),
            field=None if always else "use_tree_spec",
        )


def _check_block(spec) -> None:
    """Block verification is a rule for chains (verify.py): refuse it with a method that
    always drafts trees, or with tree drafts asked for."""
    if spec.verify != "block":
        return
    trees = [m.name for m in _METHODS.values() if m.tree == TREE and spec.may_use(m.name)]
    chains = ", ".join(m.name for m in _METHODS.values() if m.tree != TREE and m.name != "none")
    if trees:
        what, fix = f"{' and '.join(trees)} draft trees", f"a chain method ({chains})"
    elif spec.use_tree_spec:
        what, fix = "use_tree_spec asks for trees", "leave use_tree_spec out"
    else:
        return
    raise LeapDecodeError(
        f"verify=block checks chains of drafts, and {what}: use verify=token or auto, or {fix}",
        field="verify",
    )
