"""JSON text for the tiny MiMo: records of one schema, one per line (JSON Lines), seeded.

Each record is a person-like object with the schema's six fields in order, written as
`json.dumps` writes it; the words come from a fixed list, so the model can learn the
values' shape but not guess them. A document is `RECORDS_PER_DOC` lines; documents of
the held-out seeds never occur in training.
"""

from __future__ import annotations

import json
import random

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "email": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "email", "age", "tags", "active"],
}
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "omega",
    "river",
    "stone",
    "cloud",
    "maple",
    "cedar",
    "falcon",
    "otter",
    "copper",
    "amber",
    "violet",
    "harbor",
    "meadow",
    "summit",
    "willow",
    "ember",
    "orbit",
    "pixel",
    "quartz",
    "tango",
    "velvet",
    "zephyr",
]
TAGS = ["admin", "staff", "guest", "beta", "legacy", "remote", "night", "ops", "sales", "research"]
RECORDS_PER_DOC = 8


def record(rng: random.Random) -> dict:
    first, last = rng.choice(WORDS), rng.choice(WORDS)
    return {
        "id": rng.randrange(1, 100000),
        "name": f"{first.title()} {last.title()}",
        "email": f"{first}.{last}@{rng.choice(WORDS)}.org",
        "age": rng.randrange(18, 90),
        "tags": rng.sample(TAGS, rng.randrange(0, 4)),
        "active": rng.random() < 0.5,
    }


def document(seed: int) -> bytes:
    """RECORDS_PER_DOC records, one JSON object a line."""
    rng = random.Random(seed)
    return "".join(json.dumps(record(rng)) + "\n" for _ in range(RECORDS_PER_DOC)).encode()


def corpus(first_seed: int, count: int) -> bytes:
    """`count` documents of consecutive seeds, joined by blank lines."""
    return b"\n".join(document(s) for s in range(first_seed, first_seed + count))


# Training documents use seeds below HELD_OUT_SEED; held-out prompts, seeds from it on.
HELD_OUT_SEED = 10**6
