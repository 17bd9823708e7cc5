"""Property test (hypothesis) of the chat template: for any conversation (any text,
reasoning, tool calls, system prompts), our rendering is transformers' `apply_chat_template`
of the same template, character for character.
"""

import functools
from pathlib import Path

import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.model.tokenizer import Tokenizer

MESSAGE_TEXT = st.text(st.characters(exclude_categories=("Cs", "Cc")), max_size=30)
TOOL_CALL = st.fixed_dictionaries(
    {"name": st.sampled_from(["get_weather", "add"]), "arguments": st.dictionaries(
        st.sampled_from(["city", "a", "b"]), st.one_of(st.integers(), MESSAGE_TEXT), max_size=2)}
)  # fmt: skip


@st.composite
def conversations(draw: st.DrawFn) -> list[dict]:
    chat: list[dict] = []
    if draw(st.booleans()):
        chat.append({"role": "system", "content": draw(MESSAGE_TEXT)})
    for _ in range(draw(st.integers(1, 3))):
        chat.append({"role": "user", "content": draw(MESSAGE_TEXT)})
        reply: dict = {"role": "assistant", "content": draw(MESSAGE_TEXT)}
        if draw(st.booleans()):
            reply["reasoning_content"] = draw(MESSAGE_TEXT)
        calls = draw(st.lists(TOOL_CALL, max_size=2))
        if calls:
            reply["tool_calls"] = [{"type": "function", "function": c} for c in calls]
            chat.append(reply)
            chat.append({"role": "tool", "content": draw(MESSAGE_TEXT)})
        else:
            chat.append(reply)
    if draw(st.booleans()):
        chat.pop()  # end on the user's (or a tool's) turn
    return chat


@functools.cache
def tokenizers(path: Path) -> tuple[Tokenizer, object]:
    """Ours and transformers' tokenizer of one checkpoint, loaded once."""
    return Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)


@given(chat=conversations(), add_generation_prompt=st.booleans())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_chat_template_renders_as_transformers(
    random_checkpoint: Path, chat: list[dict], add_generation_prompt: bool
):
    ours, theirs = tokenizers(random_checkpoint)
    kwargs = {"add_generation_prompt": add_generation_prompt}
    expected = theirs.apply_chat_template(chat, tokenize=False, **kwargs)  # type: ignore[attr-defined]
    assert ours.apply_chat_template(chat, **kwargs) == expected
