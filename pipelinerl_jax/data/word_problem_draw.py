"""What every word problem is drawn from: names, items, rates and other vocabulary, and `Draw`,
the rng plus the difficulty's number ranges plus the worked solution being written (every
arithmetic step goes through `Draw.step`, which computes the value and writes one
`a op b = c` line). The kinds themselves are word_problem_kinds.py.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import NamedTuple


class _Person(NamedTuple):
    name: str
    he: str
    him: str
    his: str

    @property
    def He(self) -> str:  # noqa: N802 (the capitalised pronoun reads best in templates)
        return self.he.capitalize()

    @property
    def His(self) -> str:  # noqa: N802
        return self.his.capitalize()


_NAMES = (
    ("Tom", "m"),
    ("Maya", "f"),
    ("Liam", "m"),
    ("Sofia", "f"),
    ("Noah", "m"),
    ("Emma", "f"),
    ("Ravi", "m"),
    ("Aisha", "f"),
    ("Carlos", "m"),
    ("Mei", "f"),
    ("Omar", "m"),
    ("Hana", "f"),
    ("Ben", "m"),
    ("Lucy", "f"),
    ("Diego", "m"),
    ("Priya", "f"),
    ("Jack", "m"),
    ("Zoe", "f"),
    ("Samir", "m"),
    ("Nora", "f"),
    ("Kenji", "m"),
    ("Fatima", "f"),
    ("Leo", "m"),
    ("Grace", "f"),
    ("Mateo", "m"),
    ("Ella", "f"),
    ("Yusuf", "m"),
    ("Chloe", "f"),
    ("Ivan", "m"),
    ("Amara", "f"),
    ("Owen", "m"),
    ("Lena", "f"),
)
# Things a person collects, shares or compares (plural nouns).
_THINGS = (
    "apples",
    "marbles",
    "stickers",
    "seashells",
    "cookies",
    "baseball cards",
    "stamps",
    "toy cars",
    "crayons",
    "balloons",
    "pencils",
    "beads",
    "strawberries",
    "books",
    "coins",
    "candies",
)
# (singular, plural) goods for shopping.
_GOODS = (
    ("notebook", "notebooks"),
    ("pen", "pens"),
    ("sandwich", "sandwiches"),
    ("toy car", "toy cars"),
    ("book", "books"),
    ("ticket", "tickets"),
    ("plant", "plants"),
    ("kite", "kites"),
    ("T-shirt", "T-shirts"),
    ("mug", "mugs"),
    ("ball", "balls"),
    ("puzzle", "puzzles"),
    ("pie", "pies"),
    ("hat", "hats"),
)
# (container, containers, what it holds) for equal groups.
_CONTAINERS = (
    ("box", "boxes", "crayons"),
    ("bag", "bags", "marbles"),
    ("basket", "baskets", "apples"),
    ("shelf", "shelves", "books"),
    ("pack", "packs", "stickers"),
    ("row", "rows", "chairs"),
    ("tray", "trays", "cupcakes"),
    ("jar", "jars", "cookies"),
    ("carton", "cartons", "eggs"),
    ("vase", "vases", "flowers"),
)
_COLORS = ("red", "blue", "green", "yellow", "white", "purple")
# (subject or None for a person, subjects, verb, verb with -s, noun, money, period)
_RATES = (
    (None, None, "read", "reads", "pages", False, "day"),
    (None, None, "save", "saves", "dollars", True, "week"),
    (None, None, "earn", "earns", "dollars", True, "hour"),
    (None, None, "swim", "swims", "laps", False, "day"),
    (None, None, "walk", "walks", "blocks", False, "day"),
    ("a machine", "machines", "make", "makes", "toys", False, "hour"),
    ("a bakery", "bakeries", "bake", "bakes", "loaves of bread", False, "day"),
    ("a car", "cars", "travel", "travels", "miles", False, "hour"),
    ("a pump", "pumps", "move", "moves", "liters of water", False, "minute"),
    ("a printer", "printers", "print", "prints", "pages", False, "minute"),
)
# (denominator, words): fractions with numerator 1.
_FRACTIONS = ((2, "half"), (3, "a third"), (4, "a quarter"), (5, "a fifth"), (10, "a tenth"))
# (people, place) and what some of them do, for fractions of a group.
_CROWDS = (
    ("students", "a school"),
    ("players", "a sports club"),
    ("campers", "a summer camp"),
    ("children", "a park"),
    ("guests", "a party"),
    ("dancers", "a dance class"),
)
_ACTIVITIES = (
    "wear glasses",
    "have a pet",
    "play chess",
    "ride bikes",
    "like pizza",
    "wear red shirts",
)
_NUMERATORS = {3: (2,), 4: (3,), 5: (2, 3, 4)}  # proper fractions in lowest terms, not 1/n
_ONE_PART = {3: "One third", 4: "One quarter", 5: "One fifth"}
_PERCENTS = (5, 10, 15, 20, 25, 30, 40, 50, 60, 75)
_SIBLINGS = (("brother", "m"), ("sister", "f"), ("cousin", "m"), ("cousin", "f"))
_PARENTS = (("mother", "f"), ("father", "m"), ("aunt", "f"), ("uncle", "m"))
_TWO_LEGS = ("chickens", "ducks", "geese", "turkeys")
_FOUR_LEGS = ("cows", "goats", "sheep", "horses", "pigs")

_OPS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a // b,
}


class Draw:
    """One problem being drawn: the rng, the number ranges, and the worked solution so far.

    `step` computes one binary operation and records it as a solution line with the
    calculation "a op b = c" in place of "#": the solution is a list of checkable steps and
    the last step's value is the answer.
    """

    def __init__(self, rng: random.Random, level: int, top: int):
        self.rng, self.level, self.top = rng, level, top
        # Counts of groups, friends, hours: small even when quantities are large.
        self.small = max(3, min(top, 12 if level == 3 else 10))
        self.lines: list[str] = []
        self.value: int | None = None

    def n(self, lo: int = 2, hi: int | None = None) -> int:
        hi = self.top if hi is None else hi
        return self.rng.randint(lo, max(lo, hi))

    def k(self, lo: int = 2) -> int:
        return self.n(lo, self.small)

    def pick(self, seq):
        return seq[self.rng.randrange(len(seq))]

    def coin(self) -> bool:
        return self.rng.random() < 0.5

    def person(self, *exclude: str) -> _Person:
        while True:
            name, sex = self.pick(_NAMES)
            if name not in exclude:
                return _person(name, sex)

    def step(self, a: int, op: str, b: int, text: str) -> int:
        if op == "/" and (b == 0 or a % b):
            raise AssertionError(f"inexact division {a} / {b}")  # a generator bug
        c = _OPS[op](a, b)
        if c < 0:
            raise AssertionError(f"negative value {a} {op} {b}")  # a generator bug
        self.lines.append(text.replace("#", f"{a} {op} {b} = {c}"))
        self.value = c
        return c


def _person(name: str, sex: str) -> _Person:
    return _Person(name, *(("he", "him", "his") if sex == "m" else ("she", "her", "her")))
