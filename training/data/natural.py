"""Prompts as people write them, for training: the generators phrase every task one of a few
fixed ways, and a small model trained only on those learns the phrasings, not the task.

`naturalize` rewrites a training task's prompt (the verifier reads only `task.data`, so the
reference solution still scores) and may add a system prompt. `out_of_domain` gives requests
outside the four domains a short answer saying what the tier can do, instead of noise.
The held-out evaluation keeps the generators' own prompts.
"""

import dataclasses
import random
from typing import Any

from tasks.answers import reasoning_block
from tasks.base import Style, Task
from tasks.code import DESCRIBE, OPS_BY_NAME, phrases, step_names
from tasks.terminal import LEVELS as TERMINAL_LEVELS
from training.data.natural_tools import tool_request, unseen_tools

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer concisely.",
    "You are a careful assistant that solves tasks step by step.",
    "Be brief.",
    "You are tierserve, a small assistant for arithmetic, Python, shell and tool calls.",
)
MATH = (
    "What is {e}?",
    "what's {e}",
    "How much is {e}?",
    "{e} = ?",
    "{e}",
    "{e}=?",
    "Calculate {e}",
    "calculate {e} please",
    "Can you work out {e} for me?",
    "Please compute {e}.",
    "Quick question: what does {e} equal?",
    "I need the value of {e}.",
    "Solve {e}",
    "what is {e} equal to?",
    "Hey, what's {e}?",
    "Compute {e}",
    "{e}? Just the number please.",
    "What do you get for {e}?",
)
TIMES = (" * ", " x ", " × ", " times ")
WORDS = {"+": (" plus ",), "-": (" minus ",), "*": (" times ", " multiplied by ")}
# One operation said in words, {a} and {b} the operands in order.
IN_WORDS = {
    "+": ("add {a} and {b}", "the sum of {a} and {b}", "{a} plus {b}"),
    "-": ("subtract {b} from {a}", "{a} minus {b}", "take {b} away from {a}", "{a} less {b}"),
    "*": (
        "multiply {a} by {b}",
        "the product of {a} and {b}",
        "{a} times {b}",
        "{a} multiplied by {b}",
    ),
}
# Phrases that start with a verb ("add 2 and 3") are requests; the others are asked about.
VERB_PROMPTS = ("{E}.", "Can you {e}?", "{E}, please.", "Please {e}.", "{e}")
NOUN_PROMPTS = ("What is {e}?", "what's {e}", "How much is {e}?", "{E}?")
CODE_HEADS = (
    "Write a Python function solve({p}) that returns {r}.",
    "Write a python function solve({p}) which returns {r}.",
    "I need a function solve({p}) that gives back {r}.",
    "Can you implement solve({p}) in Python? It should return {r}.",
    "python: solve({p}) should return {r}",
    "Implement solve({p}), returning {r}.",
    "Please write solve({p}) in Python so that it returns {r}.",
)
# Other ways to say a code operation ({x} its input, {k} its constant), as people put it:
# shorter, and without the generator's edge-case notes, which the reference still follows.
CODE_SAID = {
    "list_sum": ("the total of {x}", "the sum of the numbers in {x}", "{x} added up"),
    "list_len": ("how many elements {x} has", "the length of {x}", "the size of {x}"),
    "list_max": ("the biggest number in {x}", "the maximum of {x}", "the max of {x}"),
    "list_min": ("the smallest value in {x}", "the minimum of {x}", "the min of {x}"),
    "count_even": ("the number of even numbers in {x}", "how many even values {x} has"),
    "count_negative": (
        "the number of negative numbers in {x}",
        "how many values in {x} are below 0",
    ),
    "count_above": ("how many values in {x} exceed {k}", "the count of numbers in {x} above {k}"),
    "list_first": ("the first element of {x}", "the head of {x}"),
    "list_last": ("the last element of {x}", "the final item of {x}"),
    "count_distinct": ("how many different values {x} has", "the count of unique numbers in {x}"),
    "sort_up": ("{x} sorted from smallest to largest", "{x} in increasing order", "{x} sorted"),
    "sort_down": ("{x} sorted from largest to smallest", "{x} in decreasing order"),
    "list_reverse": ("{x} reversed", "{x} backwards"),
    "keep_even": ("only the even numbers of {x}", "{x} filtered to its even values"),
    "keep_odd": ("only the odd numbers of {x}", "{x} filtered to its odd values"),
    "keep_positive": ("only the positive numbers of {x}", "the numbers in {x} above zero"),
    "each_times": ("every number in {x} times {k}", "{x} with everything multiplied by {k}"),
    "each_plus": ("{x} with {k} added to every element", "every number in {x} plus {k}"),
    "each_squared": ("the squares of the numbers in {x}", "every element of {x} squared"),
    "each_abs": ("the absolute values of {x}", "{x} with every number made non-negative"),
    "dedupe": ("{x} without duplicates", "{x} with repeats removed, first occurrences kept"),
    "drop_first": ("{x} minus its first element", "everything in {x} after the first item"),
    "take_first": ("the first {k} items of {x}", "{x} cut to its first {k} elements"),
    "int_plus": ("{x} + {k}", "{k} more than {x}"),
    "int_times": ("{x} * {k}", "{x} multiplied by {k}"),
    "int_abs": ("abs({x})", "{x} without its sign"),
    "int_square": ("the square of {x}", "{x} to the power of 2"),
    "int_negate": ("minus {x}", "the negative of {x}"),
    "digit_sum": ("the sum of the digits of {x}", "{x}'s digits added up"),
    "digit_count": ("how many digits {x} has", "the number of digits in {x}"),
    "int_str": ("{x} as a string", "str({x})"),
    "binary": ("{x} in binary (absolute value, no 0b)", "the binary form of abs({x}), no prefix"),
    "str_len": ("the length of {x}", "how many characters {x} has"),
    "count_vowels": ("the number of vowels in {x}", "how many vowels {x} contains"),
    "count_upper": ("how many capital letters {x} has", "the count of uppercase characters in {x}"),
    "count_words": ("how many words {x} has", "the word count of {x}"),
    "str_reverse": ("{x} backwards", "the reverse of {x}"),
    "str_upper": ("{x} in capitals", "{x} uppercased", "{x} in all caps"),
    "str_lower": ("{x} lowercased", "{x} in small letters"),
    "no_spaces": ("{x} without spaces", "{x} with the spaces stripped out"),
    "no_vowels": ("{x} without its vowels", "{x} with every vowel deleted"),
    "swap_case": ("{x} with upper and lower case swapped", "{x} with its case inverted"),
    "reverse_words": ("{x} with its words in reverse order", "the words of {x} backwards"),
    "word_lengths": ("the length of each word in {x}", "a list of the word lengths of {x}"),
}
CODE_KINDS = ("", " {p} is {k}.", " ({p} is {k})")
CODE_TAILS = ("", "", "\n\nAnswer with the complete function in a ```python block.", " Use Python.")
# Other ways to give a terminal task ({where}: which files, said another way), by template.
TERMINAL_SAID = {
    "move_logs": (
        "shift every .log file {where} into archive/ (flat, no subfolders) and say how many moved",
        "relocate the .log files {where} to archive/ directly; print the number of files moved",
        "I want all .log files {where} in archive/ itself. Print how many you moved.",
    ),
    "count_errors": (
        "print how many lines mention ERROR in the .log files {where}",
        "what's the number of ERROR lines across the .log files {where}? print it",
        "tell me the count of lines with ERROR in them, over the .log files {where}",
    ),
    "rename_txt": (
        "give every .txt file {where} the extension .md instead, same name and folder",
        "switch the .txt files {where} over to .md (only the extension changes)",
        "all .txt files {where} need to be renamed to .md, staying in place",
    ),
    "delete_empty": (
        "get rid of every empty file {where}",
        "wipe out the files {where} that have no content",
        "erase all files of size zero {where}",
    ),
    "csv_report": (
        "put the .csv file names {where} into report.txt here: names only, sorted, one a line",
        "I need report.txt in this directory with the sorted base names of the .csv files {where}",
        "save a sorted list of the .csv files {where} (file names, no directories) to report.txt",
    ),
    "total_size": (
        "how many bytes do the files {where} add up to? print the total",
        "sum the sizes in bytes of all files {where} and print that",
        "print the combined size in bytes of the files {where}",
    ),
}
TERMINAL_TOP = {"move_logs": "logs", "count_errors": "logs", "rename_txt": "data"}
TERMINAL_TOP |= {"delete_empty": "src", "csv_report": "data", "total_size": "data"}
WHERE_SAID = {
    False: ("in {top}/", "inside {top}/", "in the {top}/ directory"),
    True: (
        "under {top}/, subfolders included",
        "in {top}/ and all its subdirectories",
        "anywhere inside {top}/, however deep",
    ),
}
TOOL_OPENERS = ("", "", "Hey, ", "Hi! ", "Can you help? ", "Quick one: ")
OUT_OF_DOMAIN = (
    "Tell me a joke.",
    "Who are you?",
    "hi",
    "Hello!",
    "Write a poem about the sea.",
    "What's the capital of France?",
    "Translate 'good morning' into German.",
    "Summarize the plot of Hamlet.",
    "What should I cook tonight?",
    "Can you recommend a good book?",
    "How are you today?",
    "Explain quantum computing in simple terms.",
    "What is the meaning of life?",
    "Write me a cover letter.",
    "thanks!",
    "Who won the world cup in 2010?",
)
CAPABILITIES = (
    "I am a small assistant for four kinds of task: integer arithmetic (e.g. What is 17 * 23?), "
    "short Python functions, shell tasks in a sandbox, and calling the tools you pass me. "
    "That request is outside them."
)


def _math(task: Task, rng: random.Random) -> str:
    """Symbols, other multiplication signs, or words: one operation in a sentence ("subtract
    19 from 100"), longer expressions with their operators spelt out ("(12 plus 8) times 3")."""
    expression, tree = task.data["expression"], task.data["tree"]
    words = rng.random() < 0.35
    if words and all(isinstance(t, int) for t in tree[1:]):
        said = rng.choice(IN_WORDS[tree[0]]).format(a=tree[1], b=tree[2])
        verb = said.split()[0] in ("add", "subtract", "multiply", "take")
        prompt = rng.choice(VERB_PROMPTS if verb else NOUN_PROMPTS)
        return prompt.format(e=said, E=said[0].upper() + said[1:])
    if words:
        for op, spelt in WORDS.items():
            expression = expression.replace(f" {op} ", rng.choice(spelt))
    elif "*" in expression and rng.random() < 0.5:
        expression = expression.replace(" * ", rng.choice(TIMES))
    return rng.choice(MATH).format(e=expression)


def _code(task: Task, rng: random.Random) -> str:
    chain = task.data["chain"]
    names, said = step_names(chain), phrases(chain)
    for i, step in enumerate(chain):  # half the steps said another way
        others = CODE_SAID.get(step["op"], ())
        if others and rng.random() < 0.5:
            op = OPS_BY_NAME[step["op"]]
            said[i] = op.render(rng.choice(others), names[i], step["k"])
    kind = DESCRIBE[OPS_BY_NAME[chain[0]["op"]].takes]
    text = rng.choice(CODE_HEADS).format(p=names[0], r=said[-1])
    text += rng.choice(CODE_KINDS).format(p=names[0], k=kind)
    if len(chain) > 1:
        lets = " ".join(f"Let {names[i + 1]} be {said[i]}." for i in range(len(chain) - 1))
        text += f" {lets}"
    if rng.random() < 0.6:
        shown = "\n".join(f"solve({a!r}) == {e!r}" for a, e in task.data["examples"])
        text += f"\n\nFor example:\n{shown}"
    return text + rng.choice(CODE_TAILS)


def _terminal(task: Task, rng: random.Random) -> str:
    """The task sentence said another way; the sandbox description and protocol around it
    are the agent harness's, not the user's, and stay."""
    nested = TERMINAL_LEVELS[task.difficulty][1]
    said = []
    for name in task.data["templates"]:
        where = rng.choice(WHERE_SAID[nested]).format(top=TERMINAL_TOP[name])
        said.append(rng.choice(TERMINAL_SAID[name]).format(where=where))
    if len(said) == 1:
        instruction = said[0]
    else:
        instruction = "Do both: " + " ".join(f"{i + 1}) {s}" for i, s in enumerate(said))
    head, rest = task.prompt.split("Task: ", 1)
    return f"{head}Task: {instruction}\n\n{rest.split(chr(10) * 2, 1)[1]}"


def _opener(prompt: str, openers: tuple[str, ...], rng: random.Random) -> str:
    """An informal opener; sometimes without the final full stop."""
    opener = rng.choice(openers)
    if opener and prompt[:1].isupper() and not prompt[1:2].isupper():
        prompt = prompt[0].lower() + prompt[1:]
    text = opener + prompt
    return text.rstrip(".") if rng.random() < 0.3 else text


def naturalize(task: Task, rng: random.Random) -> tuple[Task, str | None]:
    """The task with a reworded prompt, and a system prompt (or None)."""
    if task.domain == "math":
        prompt = _math(task, rng)
    elif task.domain == "code":
        prompt = _code(task, rng)
    elif task.domain == "tools":
        prompt = task.prompt
        if len(task.data["calls"]) == 1:
            prompt = tool_request(task, rng) if rng.random() < 0.5 else prompt
            task = unseen_tools(task, rng) if rng.random() < 0.5 else task
        prompt = _opener(prompt, TOOL_OPENERS, rng)
    else:
        prompt = _terminal(task, rng)
    system = rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.4 else None
    return dataclasses.replace(task, prompt=prompt), system


def out_of_domain(seed: int, style: Style) -> dict[str, Any]:
    """An SFT example (the shape of `training.data.streams.sft_examples`' items) of a request
    outside the domains, answered with what the tier can do."""
    rng = random.Random(f"ood:{seed}")
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.4:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    messages.append({"role": "user", "content": rng.choice(OUT_OF_DOMAIN)})
    turn = CAPABILITIES
    if style == "think":
        turn = reasoning_block("This is not arithmetic, code, a shell task or a tool call.") + turn
    example = {"messages": [*messages, {"role": "assistant", "content": CAPABILITIES}]}
    return example | {"turns": [(messages, turn)], "domain": "other", "difficulty": 1}
