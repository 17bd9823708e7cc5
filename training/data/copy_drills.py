"""Copy drills: the last turn of a tool chain, cut to the context it copies from.

A small model copies a chain's code one character token at a time and fails at the merged
pieces (`pf`, `PZ`, `XR`): teacher-forced on its misses, the single characters are near
certain and the merged pieces near impossible, whatever the length of the context before
them. So a drill is that cut context (the request, the last call and its result: a fraction
of a chain's turns) with a code built largely from merged pieces
(`training.data.code_pieces`), trained on the turn that copies it twice, into the reasoning
and into the answer: many copies for the tokens a whole chain costs.
"""

import dataclasses
from typing import Any

from tasks import get_domain
from tasks.base import Style
from training.data.code_pieces import CodePieces
from training.data.streams import sft_examples


def copy_drill(seed: int, style: Style, codes: CodePieces, natural: float) -> dict[str, Any]:
    """An SFT example (the shape of `training.data.streams.sft_examples`' items) whose one turn is
    the final answer of the difficulty-3 tool chain of `seed`, its code redrawn."""
    every = dataclasses.replace(codes, share=1.0)
    example = next(sft_examples(get_domain("tools"), [seed], [3], style, natural, every))
    context, turn = example["turns"][-1]
    call, result = context[-2:]
    asked = [m for m in context if m["role"] in ("system", "user")]  # system prompt, request
    name = call["tool_calls"][0]["function"]["name"]
    tools = [tool for tool in example["tools"] if tool["function"]["name"] == name]
    messages = [*asked, call, result]
    return {
        "messages": [*messages, example["messages"][-1]],
        "turns": [(messages, turn)],
        "tools": tools,
        "domain": "copy",
        "difficulty": 3,
    }
