"""Random JSON schemas for the structured-output property tests: nested objects, arrays with bounds, enums, numbers
and integers with ranges, required fields, additionalProperties false; strings bounded so that a small model's
outputs can finish within a few dozen tokens."""

from __future__ import annotations

import random

WORDS = ("name", "id", "city", "size", "tags", "ok", "score", "kind", "items", "meta", "color", "count")


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(("integer", "number", "boolean", "enum", "string", "const"))
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
    if kind == "number":
        low = rng.choice((-1.5, 0, 2, 10))
        return {"type": "number", "minimum": low, "maximum": low + rng.choice((1, 5.5, 100))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", 1, 2, True, None], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["fixed", 7, False])}
    return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 10)}


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of 1-3 properties; below the top, arrays and objects nest up to depth 2."""
    names = rng.sample(WORDS, rng.randint(1, 3))
    properties = {}
    for name in names:
        roll = rng.random()
        if depth < 2 and roll < 0.2:
            properties[name] = random_schema(rng, depth + 1)
        elif depth < 2 and roll < 0.4:
            low = rng.randint(0, 2)
            properties[name] = {"type": "array", "items": _leaf(rng), "minItems": low,
                                "maxItems": low + rng.randint(0, 2)}
        else:
            properties[name] = _leaf(rng)
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
