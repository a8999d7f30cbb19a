"""Chat templates render exactly as transformers' `apply_chat_template` does, text and token ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers

from engine.errors import TokenizerError
from engine.loading.chat_template import FALLBACK_TEMPLATE, render_chat
from engine.loading.tokenizer import Tokenizer
from tests.helpers.tiny import make_tiny_model

# Real-world template styles, as published in their models' tokenizer_config.json.
CHATML_QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
ZEPHYR = """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\n'  + message['content'] + eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
# Features newer templates lean on: tojson (no HTML escaping), namespace, loop controls, {% generation %}, tools=None.
FEATURES = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{% generation %}{{ m | tojson }}{% endgeneration %}\n{% if ns.n > 2 %}{% break %}{% endif %}"
    "{% endfor %}{{ 'tools:' ~ (tools is none) }}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

TEMPLATES = {
    "chatml": CHATML_QWEN2,
    "llama3": LLAMA3,
    "mistral": MISTRAL,
    "zephyr": ZEPHYR,
    "llama2": LLAMA2,
    "features": FEATURES,
}

WITH_SYSTEM = [
    {"role": "system", "content": "You are terse. <b>&'</b>"},
    {"role": "user", "content": "Hello 🙂, how are you? 日本語"},
    {"role": "assistant", "content": "  Fine, thanks!  "},
    {"role": "user", "content": "def main():\n    return 42"},
]
ALTERNATING = WITH_SYSTEM[1:]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _with_template(base: Path, out: Path, template: str | None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "config.json", "generation_config.json"):
        shutil.copy(base / name, out / name)
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    if template is not None:
        cfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_matches_transformers(base_dir: Path, tmp_path: Path, name: str, gen_prompt: bool) -> None:
    folder = _with_template(base_dir, tmp_path / name, TEMPLATES[name])
    ours = Tokenizer.from_dir(folder)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    messages = ALTERNATING if name == "mistral" else WITH_SYSTEM
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=gen_prompt) == expected
    expected_ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=gen_prompt)
    assert ours.encode_chat(messages, add_generation_prompt=gen_prompt) == list(expected_ids)


@pytest.mark.parametrize("name", ["mistral", "llama2"])
def test_role_alternation_error_is_a_tokenizer_error(base_dir: Path, tmp_path: Path, name: str) -> None:
    folder = _with_template(base_dir, tmp_path / name, TEMPLATES[name])
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    with pytest.raises(Exception, match="must alternate"):
        hf.apply_chat_template(bad, tokenize=False)
    with pytest.raises(TokenizerError, match="must alternate") as err:
        Tokenizer.from_dir(folder).encode_chat(bad)
    assert "\n" not in str(err.value)


def test_continue_final_message_matches_transformers(base_dir: Path, tmp_path: Path) -> None:
    folder = _with_template(base_dir, tmp_path / "chatml", CHATML_QWEN2)
    messages = [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One, two,"}]
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    expected = hf.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    got = Tokenizer.from_dir(folder).apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert got == expected
    assert got.endswith("One, two,")


def test_none_valued_keys_are_dropped_like_transformers(base_dir: Path, tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m['role'] }}={{ m.get('name', 'anon') }};{% endfor %}"
    folder = _with_template(base_dir, tmp_path / "names", template)
    messages = [{"role": "user", "content": "x", "name": None}]
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert Tokenizer.from_dir(folder).apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False)


def test_fallback_without_template(base_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_with_template(base_dir, tmp_path / "none", None))
    assert tok.chat_template is None
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages)
    assert text == "<|bos|>System: Be kind.\n\nUser: Hi\n\nAssistant:"
    assert tok.encode_chat(messages)[:2] == [tok.bos_id, tok.encode("System", add_bos=False)[0]]
    assert render_chat(None, messages, add_generation_prompt=False) == "System: Be kind.\n\nUser: Hi\n\n"
    assert render_chat(FALLBACK_TEMPLATE, messages, add_generation_prompt=False) == "System: Be kind.\n\nUser: Hi\n\n"


def test_strftime_now_and_extra_variables() -> None:
    text = render_chat("{{ strftime_now('%Y') }}|{{ custom }}", [], add_generation_prompt=False, custom="x")
    year, custom = text.split("|")
    assert year.isdigit() and len(year) == 4 and custom == "x"


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}{{ m['content'] }",  # syntax error
        "{{ messages[0].__class__.__mro__ }}",  # sandbox refusal
        "{% set ns = namespace(_x=1) %}",  # underscore namespace attribute
        "{{ 1 / 0 }}",  # runtime error inside the template
    ],
)
def test_broken_or_unsafe_templates_raise_tokenizer_error(template: str) -> None:
    with pytest.raises(TokenizerError) as err:
        render_chat(template, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert "\n" not in str(err.value) and str(err.value).endswith(".")


# -- hostile templates: bounded in time and size, one sentence ---------------------------------------------------

HOSTILE_TEMPLATES = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "doubling namespace": "{% set ns = namespace(x='ab') %}{% for i in range(40) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}{{ ns.x }}",
    "doubling macro": "{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% else %}{{ s }}{% endif %}{% endmacro %}{{ f('ab', 40) }}",
    "lipsum": "{{ lipsum(n=200000) }}",
    "repeat": "{{ 'x' * 1000000000 }}",
    "filter width": "{{ 'x'|center(1000000000) }}",
    "method width": "{{ 'x'.ljust(1000000000) }}",
    "format width": "{{ '%*d' % (1000000000, 1) }}",
    "power": "{{ 7 ** 100000 }}",
    "huge output": "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_hostile_templates_are_stopped_with_one_sentence(name: str) -> None:
    from engine.loading.template_limits import RenderLimits

    with pytest.raises(TokenizerError, match="was stopped because") as info:
        render_chat(
            HOSTILE_TEMPLATES[name],
            [{"role": "user", "content": "hi"}],
            add_generation_prompt=True,
            limits=RenderLimits(max_chars=1_000_000, max_seconds=1.0),
        )
    assert "\n" not in str(info.value) and str(info.value).endswith(".")


def test_limits_leave_real_templates_alone() -> None:
    from tests.helpers.tiny import CHAT_TEMPLATE

    messages = [{"role": "user", "content": "x" * 500_000}, {"role": "assistant", "content": "y"}]
    assert len(render_chat(CHAT_TEMPLATE, messages, add_generation_prompt=True, bos_token="<s>")) > 500_000
