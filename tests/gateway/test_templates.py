"""Chat templates render in our sandbox exactly as transformers renders them."""

import pytest

from gateway.errors import InvalidRequest
from gateway.templates import ChatTemplate, bundled_templates, read_template_source

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}],
]


def special(tokenizer) -> dict:
    return {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_tokenizer_template_matches_apply_chat_template(tokenizer, messages):
    template = ChatTemplate(read_template_source(None, tokenizer.chat_template), special(tokenizer))
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert template.render(messages) == expected


def test_bundled_chatml_renders_chatml(tokenizer):
    assert {"chatml", "llama2"} <= set(bundled_templates())
    template = ChatTemplate(read_template_source("chatml", tokenizer.chat_template), special(tokenizer))
    text = template.render([{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_chatml_is_the_fallback_without_a_tokenizer_template():
    assert "<|im_start|>" in read_template_source(None, None)


def test_unknown_template_option_is_refused():
    with pytest.raises(ValueError, match="not a file"):
        read_template_source("no-such-template", None)


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
