"""Chat templates: SmolLM2's rendering equals transformers'; the sandbox holds."""

from __future__ import annotations

from typing import Any

import pytest

from furnace_trio.loading.tokenizer import Tokenizer
from furnace_trio.text.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    compile_chat_template,
    render_chat_template,
)

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? Answer in 日本語 😀"},
    ],
    [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "second\n\nwith blank lines"},
        {"role": "user", "content": "  padded  "},
    ],
]


@pytest.mark.model
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_smollm2_rendering_matches_transformers(
    tokenizer: Tokenizer,
    hf_reference: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
) -> None:
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    # The prompt ids the server uses equal transformers' tokenized rendering too.
    assert (
        tokenizer.render_and_encode_chat(messages, add_generation_prompt=add_generation_prompt)
        == hf_reference(theirs, add_special_tokens=False).input_ids
    )


@pytest.mark.model
def test_smollm2_adds_its_default_system_message(tokenizer: Tokenizer) -> None:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(tokenizer.token_to_id("<|im_start|>")) == 3


def test_hf_environment_features() -> None:
    source = (
        "{% for m in messages %}"
        "{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{{ m | tojson }}|{{ m | tojson(indent=2, sort_keys=True) }}\n"
        "{% endfor %}"
        "{{ bos_token }}{{ eos_token }}{{ strftime_now('%Y') | length }}"
        "{% generation %}gen{% endgeneration %}"
        "{% if tools %}{{ tools[0].name }}{% endif %}{{ extra }}"
    )
    messages = [{"role": "skip"}, {"role": "user", "content": "é<>&"}]
    text = render_chat_template(
        source, messages, bos_token="<s>", eos_token="</s>", tools=[{"name": "f"}], extra="!"
    )
    assert text == (
        '{"role": "user", "content": "é<>&"}|{\n  "content": "é<>&",\n  "role": "user"\n}\n'
        "<s></s>4genf!"
    )


def test_trim_and_lstrip_blocks() -> None:
    source = "{% for m in messages %}\n    {% if true %}\n{{ m }}\n    {% endif %}\n{% endfor %}"
    assert render_chat_template(source, ["a", "b"]) == "a\nb\n"


def test_compiled_template_is_cached() -> None:
    source = "{{ messages | length }}"
    assert compile_chat_template(source) is compile_chat_template(source)
    assert compile_chat_template(source).render([1, 2]) == "2"


def test_raise_exception_becomes_value_error() -> None:
    source = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with user') }}{% endif %}ok"
    assert render_chat_template(source, [{"role": "user"}]) == "ok"
    with pytest.raises(ChatTemplateError, match=r"^Conversations must start with user$"):
        render_chat_template(source, [{"role": "assistant"}])
    assert issubclass(ChatTemplateError, ValueError)


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{{ raise_exception.__globals__ }}",
        "{% set _ = messages.append('x') %}{{ messages }}",
        "{{ messages[0].update({'role': 'x'}) }}",
        "{{ 'a' * 100000000 }}",
        "{{ 2 ** 100000000 }}",
        "{{ range(10 ** 9) | list | length }}",
        "{{ 1 / 0 }}",
        "{{ undefined_function() }}",
        "{% for %}",
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    ],
)
def test_hostile_or_broken_templates_fail_cleanly(source: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError):
        render_chat_template(source, messages)
    assert messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "source",
    [
        "{{ 'a'.center(67108864) | length }}",
        "{{ 'a' | center(67108864) }}",
        "{{ 'a'.ljust(100000000) | length }}",
        # A string doubled in a loop (2**27 characters unbounded), with ~ and with +.
        "{% set ns = namespace(s='ab') %}{% for i in range(26) %}"
        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
        "{% set ns = namespace(s='ab') %}{% for i in range(26) %}"
        "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}",
        "{{ '%0100000000d' | format(1) | length }}",
        "{{ ('%.100000000f' % 1.0) | length }}",
        "{{ '{:>{w}}'.format(1, w=100000000) | length }}",
        "{{ ('a' * 1000000).replace('', 'bb' * 20) | length }}",
        "{{ ('a\n' * 500000) | indent(100) | length }}",
        "{{ [1] | batch(20000000, 0) | list | length }}",
        "{% set s = 'x' * 1000000 %}{% for i in range(100) %}{{ s }}{% endfor %}",
        # Buffers filled in a loop, joined only at their end: a block set and a macro.
        "{% set s = 'x' * 1000000 %}{% set b %}{% for i in range(100) %}{{ s }}"
        "{% endfor %}{% endset %}{{ b | length }}",
        "{% set s = 'x' * 1000000 %}{% macro m() %}{% for i in range(100) %}{{ s }}"
        "{% endfor %}{% endmacro %}{{ m() | length }}",
        "{{ ('a'.encode() * 100000000) | length }}",
        "{{ '{:>{w}}'.format_map({'w': 100000000}) | length }}",
        "{{ {'a': [1, [2]]} | tojson(indent=100000000) | length }}",
        "{{ lipsum(n=1000000) | length }}",
        "{{ ('a ' * 500000) | wordwrap(1, wrapstring='x' * 100) | length }}",
    ],
)
def test_templates_cannot_build_huge_strings(source: str) -> None:
    with pytest.raises(ChatTemplateError, match="exceeded a limit"):
        render_chat_template(source, [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "source",
    [
        "{% for a in range(100000) %}{% for b in range(3000) %}{% endfor %}{% endfor %}",
        "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
        "{{ f(28) }}",
    ],
)
def test_template_loops_have_a_cpu_budget(source: str) -> None:
    template = ChatTemplate(source, cpu_s=0.2)
    with pytest.raises(ChatTemplateError, match=r"more than 0\.2 s of CPU time"):
        template.render([])


def test_ordinary_formatting_and_loops_still_work() -> None:
    source = (
        "{% for m in messages %}{{ m.role }}:{{ m.content | trim }}"
        "{% if not loop.last %}|{% endif %}{% endfor %}"
        "{{ '%5d' | format(3) }}{{ 'x'.center(5) }}{{ '{:>4}'.format(1) }}"
        "{{ [1, 2] + [3] }}{{ ', '.join(['a', 'b']) }}{{ 'ab' * 2 }}"
    )
    messages = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo"}]
    assert render_chat_template(source, messages) == (
        "user:hi|assistant:yo    3  x     1[1, 2, 3]a, babab"
    )


def test_template_must_be_text() -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate("")
    with pytest.raises(ChatTemplateError):
        compile_chat_template("{{ x }}").render("not a list")  # type: ignore[arg-type]


@pytest.mark.model
def test_broken_model_template_fails_at_render_not_at_load(tokenizer: Tokenizer) -> None:
    broken = Tokenizer(
        tokenizer.hf_tokenizer,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=2,
        add_bos_token=False,
        chat_template="{% if %}",
    )
    with pytest.raises(ValueError, match="does not compile"):
        broken.apply_chat_template([{"role": "user", "content": "x"}])
