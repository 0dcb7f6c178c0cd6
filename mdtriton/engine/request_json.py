"""The JSON texts a request carries (its `cache` and `loras` inputs), read within bounds: their size, their nesting
and their integers' digits are checked before or while Python's json reads them, so that a hostile text is refused
with one line saying what to send, in a millisecond, never answered "maximum recursion depth exceeded" or Python's
integer-digit limit."""

from __future__ import annotations

import json
from typing import Any

# Far more than the objects these inputs hold (a method and a few numbers; an adapter name and scale per adapter).
MAX_JSON_BYTES = 8192
MAX_JSON_DEPTH = 4
MAX_INTEGER_DIGITS = 20


def nesting_depth(text: str) -> int:
    """How deep the arrays and objects of a JSON text nest (brackets inside strings do not count); stops counting
    past MAX_JSON_DEPTH."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                break
        elif char in "]}":
            depth -= 1
    return deepest


def bounded_integer(digits: str) -> int:
    """A JSON integer's value (json.loads's parse_int); ValueError past MAX_INTEGER_DIGITS digits."""
    if len(digits.lstrip("-")) > MAX_INTEGER_DIGITS:
        raise ValueError(f"an integer of {len(digits.lstrip('-'))} digits")
    return int(digits)


def read_json(text: str, name: str, example: str) -> Any:
    """The value of the JSON text of input `name`; ValueError, naming the input and what to send (example), if it is
    longer than MAX_JSON_BYTES, nests deeper than MAX_JSON_DEPTH, holds an integer of more than MAX_INTEGER_DIGITS
    digits, or is not JSON."""
    size = len(text.encode())
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{name} is {size} bytes of JSON, over the {MAX_JSON_BYTES} taken; {example}")
    if nesting_depth(text) > MAX_JSON_DEPTH:
        raise ValueError(f"{name} nests arrays or objects deeper than {MAX_JSON_DEPTH} levels; {example}")
    try:
        return json.loads(text, parse_int=bounded_integer)
    except json.JSONDecodeError as error:
        raise ValueError(f"{name} is not JSON ({error.msg} at character {error.pos}); {example}") from None
    except ValueError as error:  # bounded_integer's
        raise ValueError(f"{name} holds {error}, over the {MAX_INTEGER_DIGITS} taken; {example}") from None
