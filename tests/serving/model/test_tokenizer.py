"""Our tokenizer against transformers: same chat text, same ids, same decoding."""

import json
import random
import shutil
from pathlib import Path

import pytest
from pydantic import BaseModel

from serving.model.tokenizer import ChatTemplateError, Tokenizer
from tasks.answers import parse_tool_calls, split_reasoning
from training.data.tokenizer import CHAT_TEMPLATE, MARKUP_TOKENS, save_tokenizer, train_tokenizer

transformers = pytest.importorskip("transformers")

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "what",
    "is",
    "weather",
    "in",
    "Paris",
    "Rome",
    "city",
    "calculate",
    "12",
    "+",
    "345",
    "=",
    "357",
    "héllo",
    "wörld",
    "日本語",
    "café",
    "naïve",
    "😀",
    "def",
    "return",
    "print(x)",
]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city <b>é</b>",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def _call(name: str, arguments: str | dict, call_id: str = "call_1") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
    [{"role": "developer", "content": "Dev rules."}, {"role": "user", "content": "ok"}],
    [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "\nadd them\n"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "easy"},
    ],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "answer"}]},
        {"role": "system", "content": "a late system message"},
        {"role": "user", "content": "日本語 😀 ünïcödé"},
    ],
    [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                _call("get_weather", '{"city": "Paris"}'),
                _call("get_weather", {"city": "Rome", "unit": "C"}, "call_2"),
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "assistant", "content": "Paris is sunny; Rome has rain.", "reasoning": "combine"},
    ],
    [
        {"role": "user", "content": "Add 2 and 3."},
        {
            "role": "assistant",
            "content": "Let me compute.",
            "reasoning_content": "use the tool",
            "tool_calls": [_call("add", {"a": 2, "b": 3})],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "5"}]},
    ],
    [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>\nraw reasoning\n</think>\n\nraw answer"},
        {"role": "user", "content": "<tool_response>\nnot a query\n</tool_response>"},
        {"role": "assistant", "content": "final", "thinking": "via the thinking key"},
    ],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! <|im_end|>"}],
]


def _random_conversations(n: int) -> list[list[dict]]:
    rng = random.Random(1)
    chats = []
    for _ in range(n):
        chat = [{"role": "system", "content": " ".join(rng.choices(WORDS, k=5))}][
            : rng.randint(0, 1)
        ]
        for _ in range(rng.randint(1, 4)):
            chat.append(
                {"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 9)))}
            )
            reply = {
                "role": "assistant",
                "content": " ".join(rng.choices(WORDS, k=rng.randint(0, 9))),
            }
            if rng.random() < 0.5:
                reply["reasoning_content"] = " ".join(rng.choices(WORDS, k=4))
            chat.append(reply)
        chats.append(chat[: len(chat) - rng.randint(0, 1)])
    return chats


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(0)
    lines = [" ".join(rng.choices(WORDS, k=rng.randint(3, 15))) for _ in range(400)]
    path = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(train_tokenizer(lines, vocab_size=600), path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return path


@pytest.fixture(scope="module")
def ours(checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_dir(checkpoint)


@pytest.fixture(scope="module")
def hf(checkpoint: Path):
    return transformers.AutoTokenizer.from_pretrained(checkpoint)


def _hf_render(hf, chat, **kwargs) -> str:
    return hf.apply_chat_template(chat, tokenize=False, **kwargs)


@pytest.mark.parametrize("tools", [None, [WEATHER, ADD]])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, hf, tools, add_generation_prompt) -> None:
    for chat in CONVERSATIONS + _random_conversations(40):
        kwargs = {"tools": tools, "add_generation_prompt": add_generation_prompt}
        expected = _hf_render(hf, chat, **kwargs)
        assert ours.apply_chat_template(chat, **kwargs) == expected
        ids = hf.apply_chat_template(chat, tokenize=True, return_dict=False, **kwargs)
        assert ours.encode(expected) == ids


def test_template_kwargs_reach_the_template(ours, hf) -> None:
    chat = [{"role": "user", "content": "Hi"}]
    rendered = ours.apply_chat_template(chat, enable_thinking=False)
    assert rendered == _hf_render(hf, chat, add_generation_prompt=True, enable_thinking=False)
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_rendered_format(ours) -> None:
    rendered = ours.apply_chat_template(CONVERSATIONS[6], tools=[ADD], add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n# Tools\n")
    assert '\n{"type": "function", "function": {"name": "add"' in rendered
    assert (
        "<|im_start|>assistant\n<think>\nuse the tool\n</think>\n\nLet me compute.\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in rendered
    assert rendered.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_parsed_output_renders_back_verbatim(ours) -> None:
    """Parsing a completion and sending it back as the next turn's history reproduces the
    text the model generated, so the next prompt extends the last one (prefix caching)."""
    chat = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = ours.apply_chat_template(chat, tools=[WEATHER])
    output = (
        "<think>\nI should look it up.\n</think>\n\nLet me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
    )
    reasoning, content = split_reasoning(output)
    content, calls = parse_tool_calls(content)
    turn = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    turn["tool_calls"] = [call.to_openai() for call in calls]
    history = ours.apply_chat_template([*chat, turn], tools=[WEATHER], add_generation_prompt=False)
    assert history == prompt + output + "<|im_end|>\n"


def test_pydantic_messages_and_none_fields(ours) -> None:
    class Message(BaseModel):
        role: str
        content: str | None = None
        reasoning_content: str | None = None

    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    models = [Message(role="user", content="Hi"), Message(role="assistant", content="Yo")]
    assert ours.apply_chat_template(models) == ours.apply_chat_template(plain)


def test_encode_decode_match_transformers(ours, hf) -> None:
    texts = [
        "Hello world",
        "  leading and trailing  ",
        "numbers 1234567 and 3.14159",
        "日本語 café 😀 naïve\n\ttabs\r\n",
        "<|im_start|>user\nhi<|im_end|>\n<think>\nhmm\n</think>\n\n<tool_call>{}</tool_call>",
        "",
    ]
    for text in texts:
        ids = hf.encode(text, add_special_tokens=False)
        assert ours.encode(text) == ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )


def test_special_tokens_and_markup(ours, hf) -> None:
    assert ours.vocab_size == len(hf)
    assert ours.eos_token == "<|im_end|>" and ours.pad_token == "<|endoftext|>"
    assert ours.bos_token is None
    assert ours.eos_token_ids == [2, 0]  # tokenizer_config's first, then generation_config's
    text = "<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>"
    ids = ours.encode(text)
    for token in ["<|im_start|>", "<|im_end|>", *MARKUP_TOKENS[:4]]:
        assert ours.raw.token_to_id(token) in ids
    assert ours.decode(ids) == "assistant\n<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call>"


def test_train_tokenizer_is_deterministic_and_sized() -> None:
    lines = [f"line {i} of {' '.join(WORDS[i % 9 :])}" for i in range(300)]
    a, b = train_tokenizer(lines, 350), train_tokenizer(lines, 350)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == 350
    assert [a.id_to_token(i) for i in range(3)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(lines, 100)


def _copy(checkpoint: Path, tmp_path: Path, skip: str = "") -> Path:
    for path in checkpoint.iterdir():
        if path.name != skip:
            shutil.copy(path, tmp_path / path.name)
    return tmp_path


def _set_config(path: Path, **changes) -> None:
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, **changes}))


def test_template_from_tokenizer_config(checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(checkpoint, tmp_path, skip="chat_template.jinja")
    template = CHAT_TEMPLATE.read_text()
    _set_config(path, chat_template=template)
    ours, hf = Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)
    for chat in CONVERSATIONS:
        expected = _hf_render(hf, chat, tools=[WEATHER], add_generation_prompt=True)
        assert ours.apply_chat_template(chat, tools=[WEATHER]) == expected


def test_named_templates_pick_tool_use(checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(checkpoint, tmp_path, skip="chat_template.jinja")
    templates = [
        {"name": "default", "template": "plain:{{ messages[0].content }}"},
        {"name": "tool_use", "template": "tools:{{ tools | length }}"},
    ]
    _set_config(path, chat_template=templates)
    ours, hf = Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)
    chat = [{"role": "user", "content": "x"}]
    for tools in (None, [WEATHER]):
        expected = _hf_render(hf, chat, tools=tools, add_generation_prompt=True)
        assert ours.apply_chat_template(chat, tools=tools) == expected
    assert ours.apply_chat_template(chat) == "plain:x"
    assert ours.apply_chat_template(chat, tools=[WEATHER]) == "tools:1"


def test_render_errors_are_clean(ours) -> None:
    with pytest.raises(ChatTemplateError, match=r"^Unexpected message role: robot$"):
        ours.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        ours.apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="must be objects"):
        ours.apply_chat_template(["just a string"])
    with pytest.raises(ChatTemplateError, match="JSON schema objects"):
        ours.apply_chat_template([{"role": "user", "content": "x"}], tools=["not a schema"])
    assert issubclass(ChatTemplateError, ValueError)


FOREIGN_TEMPLATE = """{% for m in messages %}
    {% if m.content is defined %}
    [{{ m.role }}] {{ m.content }}
    {% endif %}
    {% if m.thinking is defined %}
    thinking={{ m.thinking }} reasoning_content={{ m.reasoning_content }}
    {% endif %}
{% endfor %}
documents={{ documents is none }} bos={{ bos_token is defined }} pad={{ pad_token }} {{ x }}
{% if add_generation_prompt %}GO{% endif %}
"""


def test_foreign_template_matches_transformers(checkpoint: Path, tmp_path: Path) -> None:
    """Whitespace control, None-dropping, reasoning aliases and variables, as transformers."""
    path = _copy(checkpoint, tmp_path)
    (path / "chat_template.jinja").write_text(FOREIGN_TEMPLATE)
    ours, hf = Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)
    chat = [
        {"role": "user", "content": None},
        {"role": "assistant", "content": "a", "reasoning": "r"},
        {"role": "assistant", "content": "b", "thinking": "t", "reasoning_content": None},
    ]
    for add_generation_prompt in (True, False):
        expected = _hf_render(hf, chat, add_generation_prompt=add_generation_prompt, x=[1, "y"])
        rendered = ours.apply_chat_template(
            chat, add_generation_prompt=add_generation_prompt, x=[1, "y"]
        )
        assert rendered == expected
    assert "thinking=t reasoning_content=t" in rendered and "[user]" not in rendered


def test_sandbox_and_transformers_extensions(checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(checkpoint, tmp_path)
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% generation %}{{ m.content | tojson }}{% endgeneration %}{% endfor %}"
        "{{ ns.n }}{{ dict(a=1) | tojson }}{{ eos_token }}{{ strftime_now('%Y') | length }}"
    )
    (path / "chat_template.jinja").write_text(template)
    chat = [{"role": "user", "content": "é<b>"}, {"role": "assistant", "content": "x"}]
    ours = Tokenizer.from_dir(path)
    assert ours.apply_chat_template(chat) == '"é<b>""x"2{"a": 1}<|im_end|>4'
    hf = transformers.AutoTokenizer.from_pretrained(path)
    assert ours.apply_chat_template(chat) == _hf_render(hf, chat, add_generation_prompt=True)
    (path / "chat_template.jinja").write_text("{% set ns = namespace(_x=1) %}")
    with pytest.raises(ChatTemplateError, match="underscore"):
        Tokenizer.from_dir(path).apply_chat_template(chat)
    (path / "chat_template.jinja").write_text("{{ messages.__class__ }}{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError):
        Tokenizer.from_dir(path).apply_chat_template(chat)
