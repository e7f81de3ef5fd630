"""Chat templates come with a model, so they are untrusted code: they render in Jinja's immutable sandbox, and a
template that reaches for Python internals or mutates its inputs gets a 400, never the host."""

from __future__ import annotations

import pytest

from services.api.errors import ApiError
from services.api.templating import PromptBuilder
from shared.config import DEFAULT_MODEL_DIR

HOSTILE = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('echo pwned').read() }}",
    "{{ raise_exception.__globals__['__builtins__']['open']('/etc/passwd').read() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{% set _ = messages.append({'role': 'system', 'content': 'injected'}) %}{{ messages | length }}",
    "{% set _ = messages[0].update({'content': 'rewritten'}) %}{{ messages[0].content }}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
]


@pytest.fixture(scope="module")
def builder() -> PromptBuilder:
    builder = PromptBuilder(DEFAULT_MODEL_DIR, threads=1)
    yield builder
    builder.close()


@pytest.mark.parametrize("template", HOSTILE)
def test_a_hostile_template_is_refused(builder: PromptBuilder, template: str) -> None:
    builder.tokenizer.chat_template = template
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ApiError) as refused:
        builder._chat(messages, True, False, {}, None)
    assert refused.value.status == 400 and "unsafe" in refused.value.message
    assert messages == [{"role": "user", "content": "hi"}]


def test_an_ordinary_template_still_renders(builder: PromptBuilder) -> None:
    builder.tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content | upper }}{% endfor %}"
    assert builder._chat([{"role": "user", "content": "hi"}], True, False, {}, None).text == "<user>HI"
