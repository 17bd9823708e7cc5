"""How an answer is read, defined once: the verifiers, the router's cascade and the API server
all take reasoning, tool calls, programs, commands and final numbers out of a reply here, so a
reply that passes its task's verifier never fails the cascade for a different reading of it.

The markup is the model family's chat format: `<think>…</think>` reasoning before the answer,
`<tool_call>…</tool_call>` blocks around each call's JSON. Reasoning opens either in the output
(`<think>` as its first non-blank text) or already in the prompt, in which case the output only
closes it with `</think>` (vLLM's Qwen3 and DeepSeek-R1 parsers make the same call). Newlines
between the tags and the text are formatting, not content: the chat template writes them back
when it renders the turn again. The streaming readers live with the API server
(`serving/model/chat_format.py`, `serving/model/tool_calls.py`) and reach the same results.
"""

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

THINK_START = "<think>"
THINK_END = "</think>"
CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
MARKUP = (THINK_START, THINK_END, CALL_START, CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END)

# A program: a fenced block tagged python, python3 or py, or untagged.
PYTHON_BLOCK = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL)
# A shell command: a fenced block tagged bash or sh. An untagged block is not a command: the
# terminal tasks ask for ```bash, and a bare block may as well be the output the model expects.
COMMAND_BLOCK = re.compile(r"```(?:bash|sh)[ \t]*\n(.*?)```", re.DOTALL)
DONE_LINE = re.compile(r"^\s*DONE\s*$", re.MULTILINE)
# An integer, with thousands separators (commas or spaces) and a leading minus allowed.
INTEGER = re.compile(r"(?<!\d)-?\d{1,3}(?:[, ]\d{3})+(?!\d)|(?<!\d)-?\d+")
_CALL_BLOCK = re.compile(rf"\s*{CALL_START}(.*?)(?:{CALL_END}\s*|\Z)", re.DOTALL)


def reasoning_block(reasoning: str) -> str:
    """Reasoning as the template writes it before the answer."""
    return f"{THINK_START}\n{reasoning}\n{THINK_END}\n\n"


def tool_call_block(body: str) -> str:
    """One call's JSON (`{"name": ..., "arguments": {...}}`) as a tool-call block."""
    return f"{CALL_START}\n{body}\n{CALL_END}"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """Return (reasoning, content); reasoning is None when the text has none.

    Output cut off inside reasoning (an opening tag, no closing one) is all reasoning.
    """
    stripped = text.lstrip()
    opened = stripped.startswith(THINK_START)
    body = stripped[len(THINK_START) :] if opened else text
    if THINK_END in body:
        reasoning, _, content = body.partition(THINK_END)
        return reasoning.strip("\n") or None, content.lstrip("\n")
    if opened:
        return body.strip("\n") or None, ""
    return None, text


def _new_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass
class ToolCall:
    """One function call; `arguments` is a JSON string, as the OpenAI API carries it."""

    name: str
    arguments: str
    id: str = field(default_factory=_new_id)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The OpenAI `tool_calls` entry; with `index`, the streaming delta form."""
        function = {"name": self.name, "arguments": self.arguments}
        call = {"id": self.id, "type": "function", "function": function}
        return call if index is None else {"index": index, **call}


def parse_call(body: str) -> ToolCall | None:
    """The call in one block's text, or None if it is not `{"name": str, "arguments": ...}`."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    if isinstance(args, dict):
        args = json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], args) if isinstance(args, str) else None


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Return (content outside the blocks, calls). If any block is malformed, the whole text
    is content and there are no calls: a half-understood call must not be executed.

    Whitespace between the calls and the surrounding text is the template's formatting, so it
    is dropped. A final block that was never closed (generation stopped after the JSON) still
    counts if its JSON is complete."""
    parsed = [parse_call(m.group(1)) for m in _CALL_BLOCK.finditer(text)]
    calls = [call for call in parsed if call is not None]
    if not parsed or len(calls) < len(parsed):
        return text, []
    return _CALL_BLOCK.sub("", text), calls


def extract_program(completion: str) -> str:
    """The last Python block of the answer (reasoning dropped), else the whole answer: a reply
    that is nothing but code is a program too."""
    _, content = split_reasoning(completion)
    blocks = PYTHON_BLOCK.findall(content)
    return blocks[-1] if blocks else content


def parse_command_turn(completion: str) -> tuple[str | None, bool, str | None]:
    """(command, done, why the turn is invalid) for one terminal turn: exactly one command
    block, or a line DONE and no block."""
    _, content = split_reasoning(completion)
    blocks = COMMAND_BLOCK.findall(content)
    outside = COMMAND_BLOCK.sub("", content)
    done = DONE_LINE.search(outside) is not None
    if len(blocks) > 1:
        return None, False, f"{len(blocks)} command blocks"
    if blocks and done:
        return None, False, "both a command and DONE"
    if blocks and not blocks[0].strip():
        return None, False, "an empty command"
    if blocks:
        return blocks[0], False, None
    if done:
        return None, True, None
    return None, False, "no ```bash block and no DONE"


def final_integer(content: str) -> int | None:
    """The last integer of an answer's content: a final answer may follow working ("... so
    3 * 4 = 12. The answer is 12.") and be followed by words."""
    found = INTEGER.findall(content.replace("\u2212", "-"))
    return int(re.sub(r"[, ]", "", found[-1])) if found else None
