"""Chat (leapdecode/chat.py): the tokenizer's chat template applied by `generate --chat` and by
the server's /v1/chat/completions, and generation ending with the assistant's turn.

The mechanics run on a copy of the embedded target given a small template. One test runs a
real instruct model (Qwen2.5, SmolLM2) through the server against `transformers`' own
`generate`, when LEAPDECODE_TEST_REAL_MODEL names its folder (its generation_config.json
listing the end-of-turn ids, as `leapdecode pull` writes it)."""

import json
import os
import shutil

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from leapdecode import LeapDecoder
from leapdecode.chat import chat_ids, chat_text, conversation, end_of_turn_ids
from leapdecode.cli import main
from leapdecode.errors import LeapDecodeError
from leapdecode.paths import DEFAULT_MODELS
from test_server import Server

EMBEDDED = os.path.join(DEFAULT_MODELS, "leap-code-target")
# each turn opened by the BOS (<|endoftext|>, the toy tokenizer's one special token)
TEMPLATE = (
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}"
)
USER = "write a function that returns the sum of a list"
SYSTEM = "you write Python"


def _model_copy(dst, template: str | None = TEMPLATE, eos=None) -> str:
    """The embedded target in `dst` (its weights linked), with a chat template and an EOS list."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(EMBEDDED):
        if name == "model.safetensors":
            os.symlink(os.path.join(EMBEDDED, name), os.path.join(dst, name))
        elif name.endswith(".json"):
            shutil.copy(os.path.join(EMBEDDED, name), dst)
    if template is not None:
        with open(os.path.join(dst, "chat_template.jinja"), "w") as f:
            f.write(template)
    if eos is not None:
        with open(os.path.join(dst, "generation_config.json")) as f:
            gen = json.load(f)
        with open(os.path.join(dst, "generation_config.json"), "w") as f:
            json.dump(gen | {"eos_token_id": eos}, f)
    return str(dst)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return _model_copy(tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture(scope="module")
def reply(chat_model):
    """The templated prompt's ids and the greedy reply without any end-of-turn stop."""
    tok = AutoTokenizer.from_pretrained(chat_model)
    ids = chat_ids(tok, conversation(USER, SYSTEM), "chat")
    dec = LeapDecoder.from_pretrained(chat_model, max_num_seqs=2)
    out = dec.generate(ids, max_new_tokens=16)
    assert out.finish_reason == "length"  # the toy model writes on: a stop below is the list's
    return ids, out.token_ids


@pytest.fixture(scope="module")
def stop_model(tmp_path_factory, reply):
    """The copy whose generation_config.json lists a second EOS: a token the reply writes
    (its first time) a few tokens in. Returns (folder, index of that token in the reply)."""
    out = reply[1]
    i = next(i for i in range(3, len(out)) if out[i] not in out[:i] and out[i] != 0)
    return _model_copy(tmp_path_factory.mktemp("chat-stop") / "model", eos=[0, out[i]]), i


def test_the_template_is_applied_without_a_second_bos(chat_model):
    from tokenizers.processors import TemplateProcessing

    tok = AutoTokenizer.from_pretrained(chat_model)
    bos = tok.bos_token_id
    # a tokenizer that adds a BOS of its own on encode, as Llama's do
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, bos)]
    )
    assert tok.encode("x")[0] == bos  # (the setup holds)
    messages = conversation(USER, SYSTEM)
    text = chat_text(tok, messages, "chat")
    assert text.startswith(f"{tok.bos_token}system\n{SYSTEM}\n{tok.bos_token}user\n{USER}\n")
    assert text.endswith(f"{tok.bos_token}assistant\n")  # the generation prompt
    ids = chat_ids(tok, messages, "chat")
    assert ids[0] == bos and ids[1] != bos
    assert ids.count(bos) == 3  # one a turn, none added by the tokenizer
    want = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert ids == (want if isinstance(want, list) else want["input_ids"])  # as transformers


def test_end_of_turn_ids_are_the_eos_and_the_token_closing_a_turn(chat_model):
    tok = AutoTokenizer.from_pretrained(chat_model)
    assert end_of_turn_ids(tok) == [tok.eos_token_id]  # this template closes a turn with "\n"
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_ids(tok) == sorted({tok.eos_token_id, end})


def test_no_template_or_a_refused_conversation_is_a_clear_error(capsys, chat_model):
    with pytest.raises(LeapDecodeError, match="'base' has no tokenizer files"):
        chat_ids(None, conversation("hi"), "base")
    tok = AutoTokenizer.from_pretrained(chat_model)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(LeapDecodeError, match="rejected the messages: roles must alternate"):
        chat_ids(tok, conversation("hi"), "strict")
    for argv, says in (
        (["--chat", "--target", EMBEDDED, "hi"],
         "'leap-code-target' has no chat template: drop --chat"),
        (["--system", "be brief", "--target", chat_model, "hi"], "add --chat"),
    ):  # fmt: skip
        code = main(["generate", *argv])
        out, err = capsys.readouterr()
        assert code == 2 and out == ""
        assert err.count("\n") == 1 and says in err, err


def test_generate_chat_stops_at_the_eos_list_and_prints_the_reply(
    capsys, tmp_path, stop_model, reply
):
    folder, i = stop_model
    ids, out = reply
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": USER}) + "\n" + json.dumps({"prompt": USER}) + "\n")
    code = main(["generate", "--chat", "--system", SYSTEM, "--target", folder, "--json",
                 "--method", "ngram", "--k", "3", "--max-new-tokens", "16",
                 "--prompts-file", str(prompts)])  # fmt: skip
    lines, err = capsys.readouterr()
    assert code == 0, err
    tok = AutoTokenizer.from_pretrained(folder)
    for line in lines.splitlines():  # the JSON contract, the reply cut at the listed EOS
        obj = json.loads(line)
        assert set(obj) == {"text", "token_ids", "finish_reason", "stats"}
        assert obj["token_ids"] == out[: i + 1] and obj["finish_reason"] == "stop"
        assert obj["text"] == tok.decode(out[: i + 1], skip_special_tokens=True)
    code = main(["generate", "--chat", "--system", SYSTEM, "--target", folder,
                 "--max-new-tokens", "16", USER])  # fmt: skip
    text, err = capsys.readouterr()
    assert code == 0, err
    assert text == tok.decode(out[: i + 1], skip_special_tokens=True) + "\n"  # the reply alone
    assert "finish=stop" in err


def test_server_chat_applies_the_template_and_stops_at_the_eos_list(stop_model, reply):
    folder, i = stop_model
    ids, out = reply
    tok = AutoTokenizer.from_pretrained(folder)
    s = Server("--target", folder, "--speculation", "ngram", "--max-num-seqs", "2")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        messages = conversation(USER, SYSTEM)
        got = client.chat.completions.create(
            model="model", messages=messages, max_tokens=16, temperature=0
        )
        assert got.choices[0].message.role == "assistant"
        assert got.choices[0].message.content == tok.decode(out[: i + 1], skip_special_tokens=True)
        assert got.choices[0].finish_reason == "stop"
        assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == i + 1
        streamed = client.chat.completions.create(
            model="model", messages=messages, max_tokens=16, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == (
            got.choices[0].message.content
        )
        bad = httpx.post(s.url + "/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": 5}]})  # fmt: skip
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    finally:
        s.stop()


def test_real_instruct_model_chat_matches_transformers_and_stops_at_im_end():
    """On SmolLM2-135M-Instruct as pulled (or $LEAPDECODE_TEST_REAL_MODEL, e.g. a Qwen2.5
    folder)."""
    import torch
    from transformers import AutoModelForCausalLM

    from helpers import pulled

    folder = os.environ.get("LEAPDECODE_TEST_REAL_MODEL") or pulled("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(folder)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "user", "content": "What is 2 + 2? Answer with the number only."}]
    ids = chat_ids(tok, messages, "real")
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids) :]
    want = want.tolist()
    del hf
    assert want[-1] == end and len(want) < 24  # transformers stops at <|im_end|> too
    s = Server("--target", folder, "--dtype", "float32", "--speculation", "ngram",
               "--max-num-seqs", "1", "--served-model-name", "real")  # fmt: skip
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        got = client.chat.completions.create(
            model="real", messages=messages, max_tokens=24, temperature=0
        )
    finally:
        s.stop()
    assert got.choices[0].finish_reason == "stop"
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(want)
    assert got.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
