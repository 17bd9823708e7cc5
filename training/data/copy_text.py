"""Copy-dense pretraining text: documents where most tokens can only be predicted by looking
back at an earlier one (a repeated span, the value stored under a key, a list echoed back).

A model pretrained only on task documents learns formats, not where to look: its loss at
positions that copy a value from the prompt stays near ln(number of choices). These
documents reward the attention heads that find and copy a source token, which every domain
needs (operands, names, arguments).
"""

import random
import string

from tasks.tool_tasks import CITIES, PEOPLE, PRODUCTS, SUBJECTS, SYMBOLS, TITLES

WORDS = (*CITIES, *PEOPLE, *PRODUCTS, *SUBJECTS, *SYMBOLS, *TITLES)


def _value(rng: random.Random) -> str:
    """A number of 1-7 digits, a word or name from the task banks, or a random code."""
    kind = rng.random()
    if kind < 0.4:
        return str(rng.randint(0, 10 ** rng.randint(1, 7) - 1))
    if kind < 0.8:
        return rng.choice(WORDS)
    return "".join(rng.choices(string.ascii_uppercase + string.digits, k=rng.randint(3, 8)))


def _repeat(rng: random.Random) -> str:
    span = " ".join(_value(rng) for _ in range(rng.randint(3, 12)))
    return f"Text: {span}\nRepeat it: {span}"


def _recall(rng: random.Random) -> str:
    keys = rng.sample(range(100, 1000), rng.randint(3, 10))
    table = {f"k{key}": _value(rng) for key in keys}
    lines = [f"{key} = {value}" for key, value in table.items()]
    asked = rng.sample(list(table), rng.randint(1, len(table)))
    lines += [f"What is {key}? {table[key]}" for key in asked]
    return "\n".join(lines)


def _echo(rng: random.Random) -> str:
    items = [_value(rng) for _ in range(rng.randint(2, 9))]
    listed = ", ".join(items)
    if rng.random() < 0.5:
        return f"List: {listed}\nEcho: {listed}"
    arguments = {f"arg{i}": item for i, item in enumerate(items)}
    call = ", ".join(f'"{key}": "{value}"' for key, value in arguments.items())
    return f"Values: {listed}\nAs JSON: {{{call}}}"


def copy_document(seed: int) -> str:
    """One document of a few copy exercises."""
    rng = random.Random(f"copy:{seed}")
    kinds = (_repeat, _recall, _echo)
    return "\n\n".join(rng.choice(kinds)(rng) for _ in range(rng.randint(2, 5)))
