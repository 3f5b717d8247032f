"""Where the embedded models are, and the one rule for default models.

Without `--target`, every command (generate, demo, bench, serve) uses the embedded pair in
`models/` (or `$LEAPDECODE_MODELS`). The embedded draft comes with it only when the target
is the embedded one too: a user's own target never gets a draft of another family.
"""

from __future__ import annotations

import os

from .errors import LeapDecodeError

# the source checkout (src/leapdecode/ -> ..); the embedded models and bench files live there
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MODELS = os.path.join(REPO, "models")
PROMPTS = os.path.join(REPO, "bench", "prompts")  # the bench prompt sets (a repo checkout)
TARGET_NAME, DRAFT_NAME = "leap-code-target", "leap-code-draft"
PARD_NAME = "leap-code-draft-pard"  # the embedded parallel draft (PARD)


def models_root() -> str:
    return os.environ.get("LEAPDECODE_MODELS", DEFAULT_MODELS)


def default_model(name: str) -> str | None:
    path = os.path.join(models_root(), name)
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def resolve_models(target: str | None, draft: str | None) -> tuple[str, str | None]:
    """(target, draft) from the user's flags: the embedded pair when no target is given."""
    if target is None:
        target = default_model(TARGET_NAME)
        if target is None:
            raise LeapDecodeError(
                f"no --target given and no embedded model in {models_root()}: pass --target PATH"
            )
        if draft is None:
            draft = default_model(DRAFT_NAME)
    return target, draft


def resolve_pard(target: str | None, pard: str | None) -> str | None:
    """--pard, or the embedded parallel draft when the target is the embedded one."""
    if pard is None and target is None:
        return default_model(PARD_NAME)
    return pard
