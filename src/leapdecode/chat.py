"""Chat: a conversation becomes the prompt an instruct model was trained on, through its
tokenizer's chat template (`leapdecode generate --chat` and the server's
/v1/chat/completions both build theirs here).

The template's text is tokenized without the tokenizer's own special tokens: a template
writes the BOS itself where its model wants one, and `encode` would add a second (as
`transformers`' own `apply_chat_template(tokenize=True)` does). Generation stops at the
model's EOS ids (generation_config.json's list) and, for a chat, also at the tokenizer's EOS
and at the special token the template closes a turn with (`<|im_end|>`, `<|eot_id|>`, ...),
as vLLM does with the tokenizer's EOS.
"""

from __future__ import annotations

from .errors import LeapDecodeError

_MARK = "LeapdecodeReplyMark"  # a reply no template rewrites, to find what follows a turn


class NoChatTemplate(LeapDecodeError):
    """The tokenizer has no chat template (a base or code-completion model), or the model
    folder has no tokenizer at all."""

    def __init__(self, name: str, hint: str, tokenizer=True) -> None:
        what = "no chat template" if tokenizer else "no tokenizer files, so no chat template"
        super().__init__(f"the model {name!r} has {what}: {hint}", field="messages")


def has_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def conversation(user: str, system: str | None = None) -> list[dict]:
    """One user message, after a system message when one is given."""
    head = [] if system is None else [{"role": "system", "content": system}]
    return [*head, {"role": "user", "content": user}]


def chat_text(
    tokenizer,
    messages: list[dict],
    name: str,
    hint: str = "drop --chat / use /v1/completions with a plain prompt",
) -> str:
    """The template's text for `messages`, ending with the assistant's turn opened
    (add_generation_prompt). NoChatTemplate without a template; LeapDecodeError (field
    "messages") when the template refuses the messages (a role it does not know, say)."""
    if not has_template(tokenizer):
        raise NoChatTemplate(name, hint, tokenizer is not None)
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - a template's own check (raise_exception) or error
        raise LeapDecodeError(
            f"the chat template of {name!r} rejected the messages: {e}", field="messages"
        ) from None


def chat_ids(tokenizer, messages: list[dict], name: str, **hint) -> list[int]:
    """The prompt's token ids for `messages` (see chat_text), without a second BOS."""
    text = chat_text(tokenizer, messages, name, **hint)
    return tokenizer.encode(text, add_special_tokens=False)


def _special(tokenizer, token_id: int) -> bool:
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    if token_id in added:
        return bool(getattr(added[token_id], "special", False))
    return token_id in (getattr(tokenizer, "all_special_ids", None) or ())


def end_of_turn_ids(tokenizer) -> list[int]:
    """Token ids that end the assistant's turn: the tokenizer's EOS, and the special token the
    template writes right after an assistant's message (none found: the EOS only)."""
    ids = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    if has_template(tokenizer):
        turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}]
        try:
            text = tokenizer.apply_chat_template(turns, tokenize=False)
        except Exception:  # noqa: BLE001 - a template that wants other turns: EOS only
            text = ""
        if _MARK in text:
            after = tokenizer.encode(text.split(_MARK, 1)[1], add_special_tokens=False)
            if after and _special(tokenizer, after[0]):
                ids.add(after[0])
    return sorted(ids)
