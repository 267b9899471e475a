"""The `generated` source: a small deterministic text generator for fast, offline tests.

Short stories and worked arithmetic from fixed templates, driven by `random.Random(seed)`, so a
seed always yields the same documents. Far too predictable to show the study's length effect;
the demo uses `installed-docs` instead.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

NAMES = ("Ada", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Kemal", "Lina")
PLACES = ("the harbour", "a quiet library", "the old mill", "the market", "a windy hill", "the station")
THINGS = ("a brass key", "a red kite", "a map", "a lantern", "a small boat", "a notebook", "a violin")
FEELINGS = ("curious", "tired", "delighted", "worried", "brave", "patient")
EVENTS = (
    "{a} found {t} near {p}.",
    "{a} asked {b} to help carry {t} to {p}.",
    "At {p}, {a} felt {f} and sat down for a while.",
    "{b} laughed when {a} dropped {t}.",
    "It started to rain over {p}, so {a} and {b} waited inside.",
    "{a} wrote a letter to {b} about {t}.",
)


def _story(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    lines = [f"Once upon a time, {a} lived near {rng.choice(PLACES)}."]
    for _ in range(rng.randint(2, 9)):
        lines.append(rng.choice(EVENTS).format(a=a, b=b, t=rng.choice(THINGS), p=rng.choice(PLACES),
                                               f=rng.choice(FEELINGS)))
    lines.append(f"In the end, {a} was {rng.choice(FEELINGS)}.")
    return " ".join(lines)


def _arithmetic(rng: random.Random) -> str:
    x, y, z = rng.randint(2, 999), rng.randint(2, 999), rng.randint(2, 99)
    name = rng.choice(NAMES)
    return (f"Problem: {name} has {x} marbles and buys {y} more, then shares them among {z} friends. "
            f"How many does each friend get, and how many are left?\n\n"
            f"Solution: {x} + {y} = {x + y}. {x + y} divided by {z} is {(x + y) // z} "
            f"with remainder {(x + y) % z}. Each friend gets {(x + y) // z}; {(x + y) % z} are left.")


def documents(seed: int, count: int) -> Iterator[str]:
    rng = random.Random(seed)
    for _ in range(count):
        yield _story(rng) if rng.random() < 0.6 else _arithmetic(rng)
