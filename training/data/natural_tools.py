"""Tool requests as users send them, for training: the bank's requests reworded from their
call's arguments, and tool schemas the model has never seen, built from the bank's parts.
`training.data.natural` applies them to a share of the one-call tool tasks.
"""

import copy
import dataclasses
import random
import re

from tasks.base import Task
from tasks.tools import call_note

# Other ways to ask for a one-call task, by tool: used when the call's arguments are exactly
# the template's fields ({Field} is the value capitalised).
TOOL_REQUESTS = {
    "get_weather": (
        "weather in {city}?",
        "How's the weather in {city}",
        "Is it raining in {city}?",
        "what's it like outside in {city} today",
        "Tell me the weather for {city}.",
        "{city} weather please",
        "Do I need an umbrella in {city}?",
    ),
    "get_local_time": (
        "what's the time in {city}",
        "Current time in {city}?",
        "What time is it right now in {city}?",
        "time in {city} please",
        "Do you know what time it is in {city}?",
    ),
    "convert_currency": (
        "{amount} {from_currency} in {to_currency}?",
        "How much is {amount} {from_currency} in {to_currency}?",
        "change {amount} {from_currency} into {to_currency}",
        "What's {amount} {from_currency} worth in {to_currency}?",
    ),
    "send_email": (
        'Email {to} with the subject "{subject}"',
        'Write to {to}, subject: "{subject}"',
        'Please send {to} an email titled "{subject}".',
    ),
    "create_event": (
        'Add "{title}" to my calendar on {date}.',
        'Schedule "{title}" for {date}',
        'new calendar entry "{title}", {date}',
    ),
    "search_flights": (
        "Any flights from {origin} to {destination} on {date}?",
        "I need to fly from {origin} to {destination} on {date}",
        "Show me flights {origin} to {destination}, {date}",
    ),
    "get_stock_price": (
        "{symbol} price?",
        "How much is {symbol} trading at?",
        "What's {symbol} at right now?",
        "Check the stock price of {symbol}",
        "quote for {symbol} please",
    ),
    "set_timer": (
        "timer {minutes} minutes",
        "Start a {minutes} minute timer",
        "Can you set a {minutes}-minute timer?",
        "Remind me in {minutes} minutes",
        "countdown of {minutes} minutes please",
    ),
    "translate_text": (
        'How do you say "{text}" in {Target_language}?',
        'Translate this into {target_language}: "{text}"',
        '"{text}" in {Target_language}, please',
        'Can you put "{text}" into {Target_language}?',
    ),
    "set_thermostat": (
        "Make it {temperature} degrees in here",
        "Turn the heating to {temperature} degrees",
        "thermostat to {temperature} please",
        "I want it at {temperature} degrees",
    ),
    "search_products": (
        "Do you sell {query}?",
        "Look for {query} in the shop",
        "find me {query}",
        "I'm looking for {query}",
    ),
    "find_restaurants": (
        "Where can I get {cuisine} food in {city}?",
        "Any good {cuisine} places in {city}?",
        "{Cuisine} restaurants in {city}?",
        "I'm in {city} and want {cuisine} food",
    ),
    "lookup_user": (
        "Find the account for {email}",
        "pull up the customer {email}",
        "Which customer has the email {email}?",
    ),
}
# Parts for tool schemas the model has never seen: other verbs and suffixes for a tool's
# name, other names for its parameters (the parameter descriptions keep the meaning).
TOOL_VERBS = ("get", "fetch", "lookup", "query", "check", "find", "search")
TOOL_SUFFIXES = ("", "", "_info", "_tool", "_now", "_v2", "_api")
PARAMETER_NAMES = {
    "city": ("location", "place", "city_name", "town"),
    "date": ("day", "on_date", "when"),
    "text": ("content", "input", "source_text"),
    "query": ("q", "search", "keywords", "search_term"),
    "name": ("full_name", "person", "contact_name"),
    "amount": ("value", "sum", "quantity"),
    "minutes": ("duration", "mins", "length_minutes"),
    "symbol": ("ticker", "stock", "stock_symbol"),
    "to": ("recipient", "address", "email_to"),
    "title": ("name", "summary", "event_title"),
    "temperature": ("degrees", "target_temperature", "temp"),
}


def _tool_name(name: str, taken: set[str], rng: random.Random) -> str:
    """Another name for the tool: its generic verb swapped or dropped, a suffix added."""
    while True:
        words = name.split("_")
        if words[0] in TOOL_VERBS:
            words[0] = rng.choice((*TOOL_VERBS, ""))
        new = "_".join(filter(None, words)) + rng.choice(TOOL_SUFFIXES)
        if new not in taken:
            return new


def _parameter_name(name: str, taken: set[str], rng: random.Random) -> str:
    """Another name for half of the parameters: a synonym, or the name with a suffix."""
    new = rng.choice((*PARAMETER_NAMES.get(name, ()), f"{name}_value"))
    return name if rng.random() < 0.5 or new in taken else new


def tool_request(task: Task, rng: random.Random) -> str:
    """The request reworded from its call, when a template asks for exactly its arguments."""
    [call] = task.data["calls"]
    fields = {**call["arguments"]}
    fields |= {k.capitalize(): str(v).capitalize() for k, v in call["arguments"].items()}
    templates = [
        t
        for t in TOOL_REQUESTS.get(call["name"], ())
        if {f.lower() for f in re.findall(r"{(\w+)}", t)} == set(call["arguments"])
    ]
    return rng.choice(templates).format(**fields) if templates else task.prompt


def unseen_tools(task: Task, rng: random.Random) -> Task:
    """A one-call task with tool schemas renamed: some tools and parameters get names the
    bank never uses, and the reference call and its note follow them, so the model learns to
    read names off the schema it is given rather than recall the bank's."""
    tools, renamed = copy.deepcopy(task.tools), {}
    taken = {tool["function"]["name"] for tool in tools}
    for tool in tools:
        function = tool["function"]
        if rng.random() < 0.5:
            continue
        old, function["name"] = function["name"], _tool_name(function["name"], taken, rng)
        taken.add(function["name"])
        parameters = function["parameters"]
        names = {}
        for key in parameters["properties"]:
            names[key] = _parameter_name(key, set(parameters["properties"]), rng)
        parameters["properties"] = {names[k]: v for k, v in parameters["properties"].items()}
        parameters["required"] = [names[k] for k in parameters["required"]]
        renamed[old] = (function["name"], names)
    [call] = task.data["calls"]
    if call["name"] not in renamed:
        return dataclasses.replace(task, tools=tools)
    name, names = renamed[call["name"]]
    arguments = {names[k]: v for k, v in call["arguments"].items()}
    tool = next(t for t in tools if t["function"]["name"] == name)
    note = call_note(tool, arguments, task.prompt)
    calls = [{**call, "name": name, "arguments": arguments, "note": note}]
    return dataclasses.replace(task, tools=tools, data={**task.data, "calls": calls})
