"""OpenAI-compatible request parsing and error bodies.

Requests are parsed by hand, field by field, so that every bad input gets a 400 (404 for an
unknown model) with an OpenAI-style body naming the field:

    {"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ..config import MAX_K, parse_k_table, spec_field_names
from ..errors import LeapDecodeError
from ..proposers import registry


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status,
            message,
            param,
            code,
            kind,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_json")
    return body


def _number(body: dict, name: str, default, lo=None, hi=None, lo_open=False, integer=False):
    if name not in body or body[name] is None:
        return default
    v = body[name]
    if (
        isinstance(v, bool)
        or not isinstance(v, int | float)
        or (integer and not isinstance(v, int))
    ):
        kind = "an integer" if integer else "a number"
        raise bad(f"'{name}' must be {kind}, got {json.dumps(v)}", name, "invalid_type")
    if isinstance(v, float) and not math.isfinite(v):
        raise bad(f"'{name}' must be finite", name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise bad(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad(f"'{name}' must be <= {hi}, got {v}", name)
    return v


@dataclass
class GenerationRequest:
    prompt: str | list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stream: bool
    method: str | None  # per-request speculation override (None: the server's)
    k: int | None
    k_table: tuple | None = None  # per-request batch-size -> k table
    include_usage: bool = True
    spec_fields: dict | None = None  # other SpecConfig fields (use_tree_spec, lookahead_*, ..)
    stop_token_ids: list[int] | None = None  # besides EOS (a chat's end-of-turn tokens)

    def options(self) -> dict:
        return {
            "max_new_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop or None,
            "stop_token_ids": self.stop_token_ids,
        }


def _stops(body: dict) -> list[str]:
    """'stop': a string or a list of up to 16 non-empty ones."""
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if (
        not isinstance(stop, list)
        or not all(isinstance(s, str) and s for s in stop)
        or len(stop) > 16
    ):
        raise bad("'stop' must be a non-empty string or a list of up to 16 of them", "stop")
    return stop


def _streaming(body: dict) -> tuple[bool, dict]:
    """'stream' and 'stream_options'."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad("'stream' must be true or false", "stream", "invalid_type")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options", "invalid_type")
    return stream, opts


def _speculation(spec) -> tuple:
    """The request's 'speculation' object: (method, k, batch-size -> k table, other
    SpecConfig fields), each None where not given."""
    if spec is None:
        return None, None, None, None
    if not isinstance(spec, dict):
        raise bad(
            '\'speculation\' must be an object like {"method": "ngram", '
            '"num_speculative_tokens": 4}',
            "speculation",
            "invalid_type",
        )
    method = spec.get("method")
    if method is not None and method not in registry.names():
        raise bad(
            f"unknown speculation method {method!r}: use one of {', '.join(registry.names())}",
            "speculation.method",
        )
    k = _number(spec, "num_speculative_tokens", None, lo=0, hi=MAX_K, integer=True)
    table = spec.get("num_speculative_tokens_per_batch_size")
    if table is not None:
        try:
            table = parse_k_table(",".join(f"{b}:{t}" for b, t in dict(table).items()))
        except (LeapDecodeError, TypeError, ValueError) as e:
            raise bad(
                f"'num_speculative_tokens_per_batch_size' must map batch sizes to k: {e}",
                "speculation.num_speculative_tokens_per_batch_size",
            ) from None
    core = {"method", "num_speculative_tokens", "num_speculative_tokens_per_batch_size"}
    fields = spec_field_names() - core
    unknown = sorted(set(spec) - fields - core)
    if unknown:
        raise bad(
            f"unknown speculation field {unknown[0]!r}: use method, "
            "num_speculative_tokens, num_speculative_tokens_per_batch_size or "
            f"{', '.join(sorted(fields))}",
            f"speculation.{unknown[0]}",
        )
    extra = {name: spec[name] for name in fields if name in spec}
    return method, k, table, extra or None


def _common(body: dict, prompt) -> GenerationRequest:
    max_tokens = _number(body, "max_tokens", 16, lo=1, integer=True)
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        max_tokens = _number(body, "max_completion_tokens", 16, lo=1, integer=True)
    temperature = _number(body, "temperature", 1.0, lo=0)
    top_p = _number(body, "top_p", 1.0, lo=0, hi=1, lo_open=True)
    top_k = _number(body, "top_k", 0, lo=-1, integer=True)
    top_k = 0 if top_k == -1 else top_k  # vLLM: -1 = off
    seed = _number(body, "seed", None, integer=True)
    n = _number(body, "n", 1, lo=1, integer=True)
    if n != 1:
        raise bad("only n = 1 is supported: send several requests instead", "n", "unsupported")
    for name in ("logprobs", "top_logprobs", "echo", "suffix", "logit_bias", "tools"):
        if body.get(name):
            raise bad(f"'{name}' is not supported by this server", name, "unsupported")
    if body.get("best_of") not in (None, 1):
        raise bad("'best_of' is not supported by this server", "best_of", "unsupported")
    stop = _stops(body)
    stream, opts = _streaming(body)
    method, k, table, extra = _speculation(body.get("speculation"))
    return GenerationRequest(
        prompt,
        max_tokens,
        float(temperature),
        float(top_p),
        top_k,
        seed,
        stop,
        stream,
        method,
        k,
        table,
        include_usage=bool(opts.get("include_usage", True)),
        spec_fields=extra or None,
    )


def parse_completion(body: dict) -> GenerationRequest:
    if "prompt" not in body:
        raise bad("'prompt' is required: a string or a list of token ids", "prompt", "missing")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad(
                "'prompt' must be a string or a non-empty list of token ids (integers); "
                "batches of several prompts are not supported",
                "prompt",
                "invalid_type",
            )
    elif not isinstance(prompt, str):
        raise bad("'prompt' must be a string or a list of token ids", "prompt", "invalid_type")
    elif not prompt:
        raise bad("'prompt' is empty", "prompt")
    return _common(body, prompt)


def parse_chat(body: dict) -> tuple[list[dict], GenerationRequest]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad(
            "'messages' must be a non-empty list of {role, content} objects",
            "messages",
            "missing" if messages is None else "invalid_type",
        )
    for m in messages:
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise bad(
                "each message must be an object with string 'role' and 'content'",
                "messages",
                "invalid_type",
            )
    return messages, _common(body, "")
