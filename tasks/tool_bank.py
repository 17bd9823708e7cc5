"""The tool schemas of the tools domain, in the OpenAI `tools` format.

Pure data: `tasks.tool_tasks` draws requests against them and
`tasks.tools` checks calls against them.
"""

from typing import Any

LANGUAGES = ("spanish", "french", "german", "japanese", "portuguese", "italian")
CUISINES = ("italian", "japanese", "mexican", "indian", "thai", "french")


def _tool(name: str, description: str, params: dict[str, dict], required: list[str]) -> dict:
    """An OpenAI `tools` entry; optional parameters carry their `default`."""
    schema = {"type": "object", "properties": params, "required": required}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": schema},
    }


def _p(kind: str, description: str, **extra: Any) -> dict:
    return {"type": kind, "description": description, **extra}


BANK = {
    t["function"]["name"]: t
    for t in (
        _tool(
            "get_weather",
            "Current weather for a city.",
            {
                "city": _p("string", "City name, e.g. Paris"),
                "unit": _p(
                    "string", "Temperature unit", enum=["celsius", "fahrenheit"], default="celsius"
                ),
            },
            ["city"],
        ),
        _tool(
            "get_local_time",
            "Current local time in a city.",
            {
                "city": _p("string", "City name"),
                "format": _p("string", "Clock format", enum=["24h", "12h"], default="24h"),
            },
            ["city"],
        ),
        _tool(
            "convert_currency",
            "Convert an amount of money between currencies at today's rate.",
            {
                "amount": _p("number", "Amount to convert"),
                "from_currency": _p("string", "ISO 4217 code of the source currency, e.g. USD"),
                "to_currency": _p("string", "ISO 4217 code of the target currency"),
            },
            ["amount", "from_currency", "to_currency"],
        ),
        _tool(
            "send_email",
            "Send an email.",
            {
                "to": _p("string", "Recipient email address"),
                "subject": _p("string", "Subject line"),
                "urgent": _p("boolean", "Mark as urgent", default=False),
            },
            ["to", "subject"],
        ),
        _tool(
            "create_event",
            "Add an event to the user's calendar.",
            {
                "title": _p("string", "Event title"),
                "date": _p("string", "Date as YYYY-MM-DD"),
                "duration_minutes": _p("integer", "Length in minutes", default=60),
            },
            ["title", "date"],
        ),
        _tool(
            "search_flights",
            "Search flights between two cities on a date.",
            {
                "origin": _p("string", "Departure city"),
                "destination": _p("string", "Arrival city"),
                "date": _p("string", "Date as YYYY-MM-DD"),
                "passengers": _p("integer", "Number of passengers", default=1),
                "cabin": _p(
                    "string",
                    "Cabin class",
                    default="economy",
                    enum=["economy", "premium_economy", "business", "first"],
                ),
            },
            ["origin", "destination", "date"],
        ),
        _tool(
            "book_flight",
            "Book a flight found by search_flights.",
            {
                "flight_id": _p("string", "The flight_id from search_flights"),
                "passengers": _p("integer", "Number of passengers", default=1),
            },
            ["flight_id"],
        ),
        _tool(
            "get_stock_price",
            "Latest trading price of a stock.",
            {"symbol": _p("string", "Ticker symbol in upper case, e.g. AAPL")},
            ["symbol"],
        ),
        _tool(
            "set_timer",
            "Start a countdown timer.",
            {
                "minutes": _p("integer", "Duration in whole minutes"),
                "label": _p("string", "Name shown when it rings", default=""),
            },
            ["minutes"],
        ),
        _tool(
            "translate_text",
            "Translate text into another language.",
            {
                "text": _p("string", "Text to translate"),
                "target_language": _p("string", "Language to translate into", enum=list(LANGUAGES)),
                "formal": _p("boolean", "Use the formal register", default=False),
            },
            ["text", "target_language"],
        ),
        _tool(
            "set_thermostat",
            "Set the target temperature of a room, in degrees Celsius.",
            {
                "temperature": _p("number", "Target temperature in °C"),
                "room": _p(
                    "string",
                    "Room",
                    default="living_room",
                    enum=["living_room", "bedroom", "kitchen", "office"],
                ),
            },
            ["temperature"],
        ),
        _tool(
            "search_products",
            "Search the online shop.",
            {
                "query": _p("string", "What to look for"),
                "in_stock_only": _p("boolean", "Only items in stock", default=False),
                "sort": _p(
                    "string",
                    "Result order",
                    default="relevance",
                    enum=["relevance", "price_low", "price_high", "rating"],
                ),
            },
            ["query"],
        ),
        _tool(
            "find_restaurants",
            "Find restaurants in a city by cuisine.",
            {
                "city": _p("string", "City name"),
                "cuisine": _p("string", "Cuisine", enum=list(CUISINES)),
                "open_now": _p("boolean", "Only places open now", default=False),
            },
            ["city", "cuisine"],
        ),
        _tool(
            "book_table",
            "Reserve a table at a restaurant found by find_restaurants.",
            {
                "restaurant_id": _p("string", "The restaurant_id from find_restaurants"),
                "party_size": _p("integer", "Number of guests"),
                "time": _p("string", "Time as HH:MM, 24-hour clock"),
            },
            ["restaurant_id", "party_size", "time"],
        ),
        _tool(
            "lookup_user",
            "Find a customer account by email address.",
            {"email": _p("string", "The customer's email address")},
            ["email"],
        ),
        _tool(
            "get_latest_order",
            "The most recent order of a customer.",
            {"user_id": _p("string", "The user_id from lookup_user")},
            ["user_id"],
        ),
        _tool(
            "lookup_contact",
            "Find a contact in the address book by name.",
            {"name": _p("string", "Full name")},
            ["name"],
        ),
    )
}
