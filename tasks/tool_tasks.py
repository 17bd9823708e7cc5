"""The task generators of the tools domain: value pools, the single-call request
generators in `SINGLES` and the two-step chains in `CHAINS`, against the schemas of
`tasks.tool_bank`.

Kept apart from `tasks.tools`, which holds the domain, its episode and its
verifier, so that the data can grow without burying the verification logic. Everything
here is deterministic given the `random.Random` it is handed.
"""

import random
import unicodedata
from collections.abc import Callable
from typing import Any, Literal

from tasks.tool_bank import CUISINES, LANGUAGES

CITIES = ("Paris", "Tokyo", "Nairobi", "Lima", "Oslo", "Toronto", "Mumbai", "Sydney", "Cairo")
CITIES += ("Berlin", "Seoul", "Madrid", "Chicago", "Lisbon", "Hanoi", "Denver")
PEOPLE = ("Ana Lima", "Ben Okafor", "Chen Wei", "Dara Singh", "Eva Novak", "Farid Haddad")
PEOPLE += ("Greta Olsen", "Hiro Tanaka", "Inés Ruiz", "Jonas Berg")
CURRENCIES = {"USD": "US dollars", "EUR": "euros", "JPY": "Japanese yen", "GBP": "British pounds"}
CURRENCIES |= {"INR": "Indian rupees", "CHF": "Swiss francs", "CAD": "Canadian dollars"}
SYMBOLS = ("AAPL", "MSFT", "NVDA", "AMZN", "GOOG", "TSLA", "SAP", "TM")
SUBJECTS = ("Quarterly report", "Lunch on Friday", "Invoice 4471", "Team offsite", "Draft review")
TITLES = ("Dentist", "Project kickoff", "Yoga class", "Call with Sam", "Budget review")
PHRASES = ("Where is the train station?", "Thank you for your help.", "The meeting is at noon.")
PHRASES += ("I would like a coffee, please.", "How much does this cost?")
PRODUCTS = ("wireless headphones", "running shoes", "standing desk", "coffee grinder")
PRODUCTS += ("hiking boots", "USB-C charger")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August")
MONTHS += ("September", "October", "November", "December")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
CODE_CHARS = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
ROOMS = ("living_room", "bedroom", "kitchen", "office")
RESTAURANT_NAMES = ("Casa Sol", "Blue Lotus", "Il Forno", "Maison Vert", "Spice Route", "Koi")
AIRLINES = ("AF", "LH", "JL", "KQ", "BA", "QF")
# (minutes, phrase) for durations a model must turn into a number.
DURATIONS = ((15, "a quarter of an hour"), (30, "half an hour"), (45, "three quarters of an hour"))
DURATIONS += ((75, "an hour and a quarter"), (90, "an hour and a half"), (120, "two hours"))

# A request generator returns (request text, expected arguments); `hard` asks for
# difficulty-2 phrasing: optional arguments and values the model must normalise.
Request = Callable[[random.Random, bool], tuple[str, dict[str, Any]]]


def _email(name: str) -> str:
    ascii_name = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode()
    return ascii_name.lower().replace(" ", ".") + "@example.com"


def date_in_words(iso: str) -> str:
    """ "2026-03-05" -> "March 5, 2026"."""
    year, month, day = (int(part) for part in iso.split("-"))
    return f"{MONTHS[month - 1]} {day}, {year}"


def _date(rng: random.Random) -> tuple[str, str]:
    """A date as (YYYY-MM-DD, "March 5, 2026")."""
    iso = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    return iso, date_in_words(iso)


def _code(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(CODE_CHARS) for _ in range(n))


def _weather(rng: random.Random, hard: bool) -> tuple[str, dict[str, Any]]:
    city, unit = rng.choice(CITIES), rng.choice(("celsius", "fahrenheit"))
    if not hard:
        if rng.random() < 0.5:
            return f"What's the weather like in {city} right now?", {"city": city}
        return f"What's the weather in {city}? Use unit {unit}.", {"city": city, "unit": unit}
    phrase = rng.choice(
        ("in °C", "in degrees Celsius") if unit == "celsius" else ("in °F", "in Fahrenheit")
    )
    request = f"Is it warm in {city} today? Give me the temperature {phrase}."
    return request, {"city": city, "unit": unit}


def _local_time(rng: random.Random, hard: bool) -> tuple[str, dict[str, Any]]:
    city = rng.choice(CITIES)
    if not hard:
        return f"What time is it in {city}?", {"city": city}
    clock = rng.choice(("12h", "24h"))
    phrase = "with am/pm" if clock == "12h" else "on a 24-hour clock"
    request = f"I'm calling someone in {city}: what's the time there, {phrase}?"
    return request, {"city": city, "format": clock}


def _convert(rng: random.Random, hard: bool) -> tuple[str, dict[str, Any]]:
    source, target = rng.sample(sorted(CURRENCIES), 2)
    if not hard:
        amount = rng.randint(5, 900)
        args = {"amount": amount, "from_currency": source, "to_currency": target}
        return f"Convert {amount} {source} to {target}.", args
    amount = rng.randint(1000, 99999) + rng.choice((0, 0.5, 0.25, 0.99))
    args = {"amount": amount, "from_currency": source, "to_currency": target}
    return f"How many {CURRENCIES[target]} do I get for {amount:,.2f} {CURRENCIES[source]}?", args


def _send_email(rng: random.Random, hard: bool) -> tuple[str, dict[str, Any]]:
    to, subject = _email(rng.choice(PEOPLE)), rng.choice(SUBJECTS)
    if not hard:
        request = f'Send an email to {to} with the subject "{subject}".'
        return request, {"to": to, "subject": subject}
    urgent = rng.random() < 0.5
    tail = "It's urgent!" if urgent else "No rush."
    request = f'Email {to} about "{subject}" (use that as the subject line). {tail}'
    return request, {"to": to, "subject": subject, "urgent": urgent}


def _event(rng: random.Random, hard: bool) -> tuple[str, dict[str, Any]]:
    title, (iso, words) = rng.choice(TITLES), _date(rng)
    if not hard:
        return f'Create a calendar event "{title}" on {iso}.', {"title": title, "date": iso}
    minutes, phrase = rng.choice(DURATIONS)
    request = f'Put "{title}" in my calendar on {words}; it takes {phrase}.'
    return request, {"title": title, "date": iso, "duration_minutes": minutes}


def _flights(rng: random.Random, hard: bool) -> tuple[str, dict[str, Any]]:
    (origin, destination), (iso, words) = rng.sample(CITIES, 2), _date(rng)
    args: dict[str, Any] = {"origin": origin, "destination": destination}
    if not hard:
        return f"Find flights from {origin} to {destination} on {iso}.", {**args, "date": iso}
    n, cabin = rng.randint(2, 4), rng.choice(("economy", "premium_economy", "business", "first"))
    request = (
        f"We are {NUMBER_WORDS[n]} people flying {cabin.replace('_', ' ')} class from {origin} "
        f"to {destination} on {words}. What flights are there?"
    )
    return request, {**args, "date": iso, "passengers": n, "cabin": cabin}


def _stock(rng: random.Random, hard: bool) -> tuple[str, dict[str, Any]]:
    symbol = rng.choice(SYMBOLS)
    if not hard:
        return f"What is the current price of {symbol} stock?", {"symbol": symbol}
    return f"how's {symbol.lower()} trading right now?", {"symbol": symbol}


def _timer(rng: random.Random, hard: bool) -> tuple[str, dict[str, Any]]:
    if not hard:
        minutes = rng.randint(1, 60)
        return f"Set a timer for {minutes} minutes.", {"minutes": minutes}
    minutes, phrase = rng.choice(DURATIONS)
    label = rng.choice(("pasta", "laundry", "tea", "oven"))
    request = f'Remind me in {phrase}: set a timer called "{label}".'
    return request, {"minutes": minutes, "label": label}


def _translate(rng: random.Random, hard: bool) -> tuple[str, dict[str, Any]]:
    text, language = rng.choice(PHRASES), rng.choice(LANGUAGES)
    if not hard:
        return f'Translate "{text}" into {language}.', {"text": text, "target_language": language}
    formal = rng.random() < 0.5
    tail = "Keep it formal." if formal else "Casual is fine."
    request = f'How do I say "{text}" in {language.capitalize()}? {tail}'
    return request, {"text": text, "target_language": language, "formal": formal}


def _thermostat(rng: random.Random, hard: bool) -> tuple[str, dict[str, Any]]:
    if not hard:
        degrees = rng.randint(16, 26)
        return f"Set the thermostat to {degrees} degrees.", {"temperature": degrees}
    room, degrees = rng.choice(ROOMS), rng.randint(16, 25) + 0.5
    request = f"Could you make the {room.replace('_', ' ')} {degrees}°C?"
    return request, {"temperature": degrees, "room": room}


def _products(rng: random.Random, hard: bool) -> tuple[str, dict[str, Any]]:
    query = rng.choice(PRODUCTS)
    if not hard:
        return f'Search the shop for "{query}".', {"query": query}
    order, phrase = rng.choice(
        (
            ("price_low", "cheapest first"),
            ("price_high", "priciest first"),
            ("rating", "best rated first"),
        )
    )
    request = f'Look for "{query}" in the shop, only things in stock, {phrase}.'
    return request, {"query": query, "in_stock_only": True, "sort": order}


def _restaurants(rng: random.Random, hard: bool) -> tuple[str, dict[str, Any]]:
    city, cuisine = rng.choice(CITIES), rng.choice(CUISINES)
    if not hard:
        return f"Find {cuisine} restaurants in {city}.", {"city": city, "cuisine": cuisine}
    request = f"Anywhere serving {cuisine.capitalize()} food in {city} that's open right now?"
    return request, {"city": city, "cuisine": cuisine, "open_now": True}


def _user(rng: random.Random, hard: bool) -> tuple[str, dict[str, Any]]:
    # Nothing to normalise in an email address: at difficulty 2 only the distractors differ.
    email = _email(rng.choice(PEOPLE))
    return f"Look up the customer account for {email}.", {"email": email}


SINGLES: dict[str, Request] = {
    "get_weather": _weather,
    "get_local_time": _local_time,
    "convert_currency": _convert,
    "send_email": _send_email,
    "create_event": _event,
    "search_flights": _flights,
    "get_stock_price": _stock,
    "set_timer": _timer,
    "translate_text": _translate,
    "set_thermostat": _thermostat,
    "search_products": _products,
    "find_restaurants": _restaurants,
    "lookup_user": _user,
}


def call(name: str, arguments: dict[str, Any], result: dict | None, note: str) -> dict[str, Any]:
    return {"name": name, "arguments": arguments, "result": result, "note": note}


def _chain_order(rng: random.Random) -> dict[str, Any]:
    name = rng.choice(PEOPLE)
    email, user_id = _email(name), f"u_{rng.randint(10000, 99999)}"
    order_id, tracking = f"ORD-{rng.randint(1000, 9999)}", "TRK" + _code(rng, 8)
    status = rng.choice(("shipped", "in transit", "out for delivery"))
    order = {"order_id": order_id, "status": status, "tracking_number": tracking}
    return {
        "request": f"My email is {email}. Where is my latest order? I need the tracking number.",
        "calls": [
            call(
                "lookup_user",
                {"email": email},
                {"user_id": user_id, "name": name},
                "Orders are looked up by user_id, so I first find the account by email.",
            ),
            call(
                "get_latest_order",
                {"user_id": user_id},
                order,
                f"lookup_user returned user_id {user_id}; now I fetch the latest order.",
            ),
        ],
        "key": tracking,
        "answer": f"Your latest order {order_id} is {status}; the tracking number is {tracking}.",
    }


def running_best(entries: list[tuple[str, float]], better: Literal["higher", "lower"]) -> str:
    """Picking the best of a list one comparison at a time, the current best restated at each
    step: a small model fails to pick the maximum of three values in one step, and then to
    copy the id that goes with it."""
    best_id, best = entries[0]
    steps = [f"Best so far: {best_id} {best}"]
    for entry_id, value in entries[1:]:
        if value > best if better == "higher" else value < best:
            best_id, best = entry_id, value
            steps.append(f"{entry_id} {value} is {better}, best {best_id} {best}")
        else:
            steps.append(f"{entry_id} {value} is not {better}, best stays {best_id} {best}")
    return "; ".join(steps) + "."


def _chain_flight(rng: random.Random) -> dict[str, Any]:
    (origin, destination), (iso, _) = rng.sample(CITIES, 2), _date(rng)
    n = rng.randint(1, 3)
    departures = sorted(rng.sample(range(6 * 60, 22 * 60, 5), 3))  # minutes after midnight
    flights = [
        {
            "flight_id": f"{rng.choice(AIRLINES)}{rng.randint(100, 9999)}",
            "departure": f"{t // 60:02d}:{t % 60:02d}",
            "price": price,
        }
        for t, price in zip(departures, rng.sample(range(150, 900), 3), strict=True)
    ]
    cheapest = min(flights, key=lambda f: f["price"])
    prices = ", ".join(f"{f['flight_id']} {f['price']}" for f in flights)
    scan = running_best([(f["flight_id"], f["price"]) for f in flights], "lower")
    code = _code(rng, 6)
    search = {"origin": origin, "destination": destination, "date": iso, "passengers": n}
    booking = {"confirmation": code, "total_price": cheapest["price"] * n}
    people = f"{n} passenger" + ("s" if n > 1 else "")
    return {
        "request": (
            f"Book the cheapest flight from {origin} to {destination} on {iso} for {people}, "
            "and tell me the confirmation code."
        ),
        "calls": [
            call(
                "search_flights",
                search,
                {"flights": flights},
                "To book the cheapest flight I first search the flights on that date.",
            ),
            call(
                "book_flight",
                {"flight_id": cheapest["flight_id"], "passengers": n},
                booking,
                f"Prices: {prices}. {scan} I book {cheapest['flight_id']}.",
            ),
        ],
        "key": code,
        "answer": f"Booked flight {cheapest['flight_id']} for {people}. Confirmation code: {code}.",
    }


def _chain_table(rng: random.Random) -> dict[str, Any]:
    city, cuisine, party = rng.choice(CITIES), rng.choice(CUISINES), rng.randint(2, 8)
    time = f"{rng.randint(18, 21)}:{rng.choice(('00', '15', '30', '45'))}"
    ratings = rng.sample((4.1, 4.3, 4.4, 4.6, 4.7, 4.9), 3)
    places = [
        {"restaurant_id": f"r_{rng.randint(1000, 9999)}", "name": name, "rating": rating}
        for name, rating in zip(rng.sample(RESTAURANT_NAMES, 3), ratings, strict=True)
    ]
    best = max(places, key=lambda p: p["rating"])
    ratings = ", ".join(f"{p['restaurant_id']} {p['rating']}" for p in places)
    scan = running_best([(p["restaurant_id"], p["rating"]) for p in places], "higher")
    reference = "BK-" + _code(rng, 6)
    table = {"restaurant_id": best["restaurant_id"], "party_size": party, "time": time}
    return {
        "request": (
            f"Reserve a table for {party} at {time} at the best-rated {cuisine} restaurant in "
            f"{city}, and tell me the booking reference."
        ),
        "calls": [
            call(
                "find_restaurants",
                {"city": city, "cuisine": cuisine},
                {"restaurants": places},
                f"I need the {cuisine} restaurants in {city} to pick the best-rated one.",
            ),
            call(
                "book_table",
                table,
                {"booking_reference": reference},
                f"Ratings: {ratings}. {scan} I book {best['restaurant_id']}.",
            ),
        ],
        "key": reference,
        "answer": f"Table for {party} at {best['name']}, {time}. Booking reference: {reference}.",
    }


def _chain_email(rng: random.Random) -> dict[str, Any]:
    name, subject = rng.choice(PEOPLE), rng.choice(SUBJECTS)
    email, message_id = _email(name), "msg_" + _code(rng, 10).lower()
    contact = {"name": name, "email": email, "phone": f"+1 555 {rng.randint(1000, 9999)}"}
    return {
        "request": f'Send {name} an email with the subject "{subject}" and tell me the message id.',
        "calls": [
            call(
                "lookup_contact",
                {"name": name},
                contact,
                f"I need {name}'s email address first, from the address book.",
            ),
            call(
                "send_email",
                {"to": email, "subject": subject},
                {"status": "sent", "message_id": message_id},
                f"The address is {email}; now I send the email.",
            ),
        ],
        "key": message_id,
        "answer": f"Sent the email to {name} ({email}). The message id is {message_id}.",
    }


CHAINS = (_chain_order, _chain_flight, _chain_table, _chain_email)
