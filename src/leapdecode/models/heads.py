"""Speculator heads trained on a target (Medusa, EAGLE-3, P-EAGLE): find, load, check them.

With `--method medusa|eagle|peagle` the heads come from `--speculator PATH`, or from the
folders beside the target named `<target>-medusa`, `<target>-eagle` and `<target>-peagle`,
so the embedded target needs no extra flag.
"""

from __future__ import annotations

import json
import os

from ..errors import LeapDecodeError
from .base import CausalLM
from .head_files import CONFIG

KINDS = ("medusa", "eagle", "peagle")


def beside(target: str) -> list[str]:
    """The head folders next to a target folder (`<target>-medusa`, `-eagle`, `-peagle`)."""
    base = os.path.abspath(target).rstrip(os.sep)
    return [
        p for p in (f"{base}-{k}" for k in KINDS) if os.path.isfile(os.path.join(p, "config.json"))
    ]


ARCH_KINDS = {"MedusaHeads": "medusa", "Eagle3Head": "eagle", "Eagle3Head+parallel": "peagle"}


def architecture(path: str) -> str:
    """The first `architectures` entry of the folder's config.json ("" when it has none; the
    repr of anything that is not a string), "Eagle3Head+parallel" for a P-EAGLE head.
    Raises LeapDecodeError when it cannot be read."""
    cfg = os.path.join(path, CONFIG)
    try:
        with open(cfg) as f:
            config = json.load(f)
        archs = config.get("architectures")
    except (OSError, ValueError, AttributeError) as e:
        raise LeapDecodeError(f"{cfg} could not be read as a config ({e})") from None
    arch = archs[0] if isinstance(archs, list) and archs else ""
    if arch == "Eagle3Head" and config.get("parallel_drafting"):
        return "Eagle3Head+parallel"
    return arch if isinstance(arch, str) else repr(arch)


def kind_of(path: str) -> str:
    cfg = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise LeapDecodeError(
            f"speculator path {path!r} does not exist: pass a folder written by "
            "`leapdecode train medusa`, `train eagle` or `train peagle`"
        )
    if not os.path.isfile(cfg):
        raise LeapDecodeError(
            f"speculator path {path!r} has no config.json: pass a folder written by "
            "`leapdecode train medusa`, `train eagle` or `train peagle`"
        )
    arch = architecture(path)
    kinds = ARCH_KINDS
    if arch not in kinds:
        raise LeapDecodeError(
            f"{path!r} is not a leapdecode speculator (architectures {arch!r}); a speculators "
            "(vLLM) export is for vLLM: use the folder `leapdecode train eagle` wrote"
        )
    return kinds[arch]


def load_found(paths: list[str], target: CausalLM) -> dict[str, object]:
    """Heads found beside the target: the ones that fit are loaded; one that does not (say,
    left from an earlier target) is skipped with a notice, so it never blocks other methods."""
    import logging

    out: dict[str, object] = {}
    for path in paths:
        try:
            out.update(load_heads([path], target))
        except Exception as e:  # noqa: BLE001 - whatever is wrong with it, skip it and say so
            logging.getLogger("leapdecode").warning("not loading %s: %s", path, e)
    return out


def load_heads(paths: list[str], target: CausalLM) -> dict[str, object]:
    """{"medusa": MedusaHeads, "eagle" | "peagle": Eagle3Head} from the given folders, checked against
    the target (hidden size, vocabulary, layers, positions)."""
    from .eagle import Eagle3Head
    from .medusa import MedusaHeads

    out: dict[str, object] = {}
    for path in paths:
        kind = kind_of(path)
        if kind in out:
            raise LeapDecodeError(f"two {kind} speculators given: pass one of each kind at most")
        hidden = int(target.config.hidden_size)
        if kind == "medusa":
            heads = MedusaHeads.load(path)
            if heads.hidden != hidden:
                raise LeapDecodeError(
                    f"the Medusa heads in {path!r} are for hidden size {heads.hidden}, the "
                    f"target's is {hidden}: train heads for this target"
                )
        else:
            heads = Eagle3Head.load(path)
            layers = int(target.config.num_hidden_layers)
            if (
                heads.target_hidden != hidden
                or heads.vocab_size > target.vocab_size
                or max(heads.aux_layers) >= layers
                or heads.max_positions < target.max_context + 1
            ):
                raise LeapDecodeError(
                    f"the EAGLE head in {path!r} does not fit this target (target hidden "
                    f"{heads.target_hidden} vs {hidden}, vocabulary {heads.vocab_size} vs "
                    f"{target.vocab_size}, layers {heads.aux_layers} vs {layers}, positions "
                    f"{heads.max_positions} vs {target.max_context}): train a head for this "
                    "target"
                )
        out[kind] = heads
    if out and target.name != "native":
        raise LeapDecodeError(
            f"medusa, eagle and peagle heads need the target's hidden states and tree attention, "
            f"which the {target.name} backend lacks: use --backend native"
        )
    return out
