"""A checkpoint's tokenizer and chat template, without transformers at run time.

Chats must render byte for byte as transformers' `apply_chat_template` renders them (the
model was trained on that text, and a vLLM tier renders with it), so the Jinja environment,
the variables and the input clean-up below mirror `transformers.utils.chat_template_utils`.
"""

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from tokenizers import Tokenizer as RawTokenizer

# The named special tokens transformers passes to every chat template.
NAMED_SPECIAL_TOKENS = tuple(
    f"{n}_token" for n in ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
)
# Names a message's reasoning may come under; templates read `reasoning_content`.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TokenizerError(ValueError):
    """The checkpoint's tokenizer files are missing or malformed."""


class ChatTemplateError(TokenizerError):
    """The chat could not be rendered: a client error (bad messages or tools)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Unlike Jinja's own filter: no HTML escaping, non-ASCII kept.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _check_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"Chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}"
        )


class _Namespace(Namespace):
    """`namespace()` that refuses underscore names, which could reach interpreter internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        super().__setitem__(name, value)


class _Dict:
    """`dict` for templates: builds dicts without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant text for training masks; serving
    only needs it to parse and render its body."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


def _plain(value: Any) -> Any:
    """Rebuild `value` from JSON types only: arbitrary objects' methods must not reach the
    sandbox. Anything else becomes an inert "<TypeName>" string, as in transformers."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base, convert in ((str, str.__str__), (int, int.__int__), (float, float.__float__)):
        if isinstance(value, base):  # enums and other subclasses lose their extra methods
            return convert(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: Sequence[Any]) -> list[dict]:
    """Plain dicts without None values (templates render "None" or crash on them), with
    reasoning copied under both `reasoning_content` and `thinking`."""
    if not messages:
        raise ChatTemplateError("Cannot apply chat template to an empty conversation.")
    prepared = []
    for message in messages:
        message = _plain(message)
        if not isinstance(message, dict):
            raise ChatTemplateError(f"Chat messages must be objects, got {message!r}.")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise TokenizerError(f"{path} is missing") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_templates(directory: Path, config: dict) -> dict[str, str]:
    """Template files win over tokenizer_config.json's `chat_template`, as in transformers."""
    templates = {}
    if (directory / "chat_template.jinja").is_file():
        templates["default"] = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    for path in sorted((directory / "additional_chat_templates").glob("*.jinja")):
        templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates
    entry = config.get("chat_template")
    if entry is None or isinstance(entry, str):
        return {} if entry is None else {"default": entry}
    try:
        return {item["name"]: item["template"] for item in entry}
    except (TypeError, KeyError) as e:
        raise TokenizerError("tokenizer_config.json: malformed chat_template list") from e


@dataclasses.dataclass
class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens and chat templates of a checkpoint."""

    raw: RawTokenizer = dataclasses.field(repr=False)
    special_tokens: dict[str, str]
    eos_token_ids: list[int]
    templates: dict[str, jinja2.Template] = dataclasses.field(repr=False)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        directory = Path(path)
        if not directory.is_dir():
            raise TokenizerError(f"{directory} is not a checkpoint directory")
        if not (directory / "tokenizer.json").is_file():
            raise TokenizerError(f"{directory / 'tokenizer.json'} is missing")
        try:
            raw = RawTokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception for bad files
            raise TokenizerError(f"{directory / 'tokenizer.json'} is malformed: {e}") from e
        config = _read_json(directory / "tokenizer_config.json")
        special = {k: t for k in NAMED_SPECIAL_TOKENS if (t := _token_text(config.get(k)))}
        eos_ids = []
        if "eos_token" in special:
            eos_id = raw.token_to_id(special["eos_token"])
            if eos_id is None:
                raise TokenizerError(f"eos_token {special['eos_token']!r} is not in the vocabulary")
            eos_ids.append(eos_id)
        if (directory / "generation_config.json").is_file():
            extra = _read_json(directory / "generation_config.json").get("eos_token_id")
            extra = [] if extra is None else extra if isinstance(extra, list) else [extra]
            if not all(isinstance(i, int) for i in extra):
                raise TokenizerError(
                    "generation_config.json: eos_token_id must be int or list[int]"
                )
            eos_ids += [i for i in extra if i not in eos_ids]
        env = _environment()
        templates = {}
        for name, source in _read_templates(directory, config).items():
            try:
                templates[name] = env.from_string(source)
            except jinja2.TemplateSyntaxError as e:
                raise TokenizerError(f"chat template {name!r} does not parse: {e}") from e
        return cls(raw, special, eos_ids, templates)

    @property
    def vocab_size(self) -> int:
        return self.raw.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens.get("pad_token")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.raw.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.raw.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _template(self, with_tools: bool) -> jinja2.Template:
        if with_tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        if not self.templates:
            raise ChatTemplateError("This model has no chat template; use the completions API.")
        raise ChatTemplateError(f"No default chat template among {sorted(self.templates)}.")

    def apply_chat_template(
        self,
        messages: Sequence[Any],
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render a chat to the prompt text; unknown kwargs (e.g. `enable_thinking`) reach the
        template as variables. Raises ChatTemplateError for anything the template rejects."""
        template = self._template(tools is not None)
        chat = _prepare_messages(messages)
        tool_schemas = None if tools is None else _plain(list(tools))
        if tool_schemas is not None and not all(isinstance(t, dict) for t in tool_schemas):
            raise ChatTemplateError("Tools must be JSON schema objects.")
        variables = _plain({"documents": None, **self.special_tokens, **template_kwargs})
        try:
            return template.render(
                messages=chat,
                tools=tool_schemas,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(e.message or type(e).__name__) from e
        except (TypeError, ValueError, LookupError, AttributeError) as e:
            raise ChatTemplateError(f"Chat template failed on this input: {e}") from e
