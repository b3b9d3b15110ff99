"""Chat templates render in our sandbox exactly as transformers renders them."""

import pytest

from common.model_source import bundled_templates, read_chat_template
from gateway.errors import InvalidRequest
from gateway.generate.templates import ChatTemplate

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ],
]


def special(tokenizer) -> dict:
    return {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_tokenizer_template_matches_apply_chat_template(tokenizer, messages):
    template = ChatTemplate(read_chat_template(None, tokenizer.chat_template), special(tokenizer))
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert template.render(messages) == expected


def test_bundled_chatml_renders_chatml(tokenizer):
    assert {"chatml", "llama2"} <= set(bundled_templates())
    template = ChatTemplate(read_chat_template("chatml", tokenizer.chat_template), special(tokenizer))
    text = template.render([{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_chatml_is_the_fallback_without_a_tokenizer_template():
    assert "<|im_start|>" in read_chat_template(None, None)


def test_unknown_template_option_is_refused():
    with pytest.raises(ValueError, match="not a file"):
        read_chat_template("no-such-template", None)


def test_sandbox_blocks_python_internals():
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", {})
    with pytest.raises(InvalidRequest, match="unsafe"):
        template.render([])


def test_raise_exception_becomes_a_400():
    template = ChatTemplate("{{ raise_exception('roles must alternate') }}", {})
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        template.render([{"role": "user", "content": "x"}])


def test_extra_variables_reach_the_template_but_cannot_replace_its_own():
    template = ChatTemplate("{{ messages | length }}{% if shout %}!{% endif %}{{ bos_token }}", {"bos_token": "<s>"})
    assert template.render([], variables={"shout": True}) == "0!<s>"
    for name in ("messages", "bos_token", "add_generation_prompt"):
        with pytest.raises(InvalidRequest, match=name):
            template.render([], variables={name: "x"})


# A request's own template is untrusted code: each of these ends quickly in a 400 naming it.
HOSTILE = [
    "{% include 'x' %}",
    "{% import 'x' as y %}",
    "{{ 1/0 }}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "{{ 2**100000 }}",
    "{{ 'a' * 300000000 }}",
    "{{ 'a'.ljust(10**9) }}",
    "{{ 'a' | center(10**9) }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ '%999999999d' % 1 }}",
    "{% set ns = namespace(x='a' * 1000) %}{% for i in range(100) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}",
    "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",  # output past MAX_OUTPUT_CHARS
    "{{ [range(100000) | list] * 1000 }}",  # few items, each big: printed, 600 MB
    "{% set x = [[range(100000) | list] * 10] %}{{ x * 100 }}",
]


@pytest.mark.parametrize("source", HOSTILE)
def test_a_hostile_request_template_is_a_400_naming_chat_template(source):
    template = ChatTemplate("{{ messages[0]['content'] }}", {"bos_token": "<s>"}).with_source(source)
    with pytest.raises(InvalidRequest) as refused:
        template.render([{"role": "user", "content": "Hi"}])
    assert refused.value.param == "chat_template"
    assert "took longer than" not in refused.value.message, "stopped by its own rule, not by the 2 s render deadline"


def test_a_request_template_that_loops_without_output_stops_at_its_deadline():
    import threading
    import time

    from gateway.generate.templates import Budget

    source = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    template = ChatTemplate("x", {}).with_source(source)
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match="longer than 0.5 s") as refused:
        template.render([], budget=Budget(0.5))
    assert refused.value.param == "chat_template" and time.monotonic() - started < 1.5
    budget = Budget(60)  # cancelled from another thread (its client left): it stops at once
    threading.Timer(0.2, budget.cancelled.set).start()
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match="cancelled"):
        template.render([], budget=budget)
    assert time.monotonic() - started < 1.5


def test_template_variables_may_be_named_like_render_arguments():
    """``chat_template_kwargs {"self": 1}`` collided with ``render(self, ...)``: a TypeError, a 500."""
    template = ChatTemplate("{{ messages | length }}{{ shout }}", {"bos_token": "<s>"})
    assert template.render([{"role": "user", "content": "Hi"}], variables={"self": 1, "shout": "!"}) == "1!"
    with pytest.raises(InvalidRequest) as refused:
        template.render([], variables={"messages": []})
    assert refused.value.param == "chat_template_kwargs"
