"""The kinds of word problem (`KINDS`): each a function of a `Draw` (word_problem_draw.py:
the rng, the difficulty's number ranges and the worked solution being written) that returns
the question text, taking every arithmetic step through `Draw.step`. The task itself (splits,
problem i, the CLI) is word_problems.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from pipelinerl_jax.data.word_problem_draw import (
    _ACTIVITIES,
    _COLORS,
    _CONTAINERS,
    _CROWDS,
    _FOUR_LEGS,
    _FRACTIONS,
    _GOODS,
    _NUMERATORS,
    _ONE_PART,
    _PARENTS,
    _PERCENTS,
    _RATES,
    _SIBLINGS,
    _THINGS,
    _TWO_LEGS,
    Draw,
)


def _inventory(d: Draw) -> str:
    p, items = d.person(), d.pick(_THINGS)
    if d.level == 1:
        if d.coin():
            a, b = d.n(), d.n()
            d.step(a, "+", b, f"{p.name} has # {items} now.")
            verb = d.pick(("buys", "finds", "gets", "wins", "collects"))
            return d.pick(
                (
                    f"{p.name} has {a} {items} and {verb} {b} more. "
                    f"How many {items} does {p.name} have now?",
                    f"{p.name} had {a} {items}. {p.His} friend gave {p.him} {b} more. "
                    f"How many {items} does {p.name} have now?",
                )
            )
        a = d.n(3)
        b = d.n(1, a - 1)
        d.step(a, "-", b, f"{p.name} has # {items} left.")
        return d.pick(
            (
                f"{p.name} has {a} {items} and gives {b} of them to {p.his} friend. "
                f"How many {items} does {p.name} have left?",
                f"{p.name} had {a} {items}. {p.He} lost {b} of them. "
                f"How many {items} does {p.he} have left?",
            )
        )
    if d.level == 2:
        a = d.n()
        if d.coin():
            b = d.n()
            c = d.n(1, a + b - 1)
            s = d.step(a, "+", b, f"After buying more, {p.name} has # {items}.")
            d.step(s, "-", c, f"After giving some away, {p.he} has # {items} left.")
            return (
                f"{p.name} has {a} {items}. {p.He} buys {b} more and then gives {c} to "
                f"{p.his} sister. How many {items} does {p.name} have now?"
            )
        bags, per = d.k(), d.n()
        got = d.step(bags, "*", per, f"The bags hold # {items}.")
        d.step(a, "+", got, f"{p.name} has # {items} in all.")
        return (
            f"{p.name} has {a} {items}. {p.He} buys {bags} bags with {per} {items} in "
            f"each bag. How many {items} does {p.name} have now?"
        )
    a, bags, per = d.n(), d.k(), d.n()
    if d.coin():
        each, friends = d.n(1, 5), d.n(2, 5)
        a = max(a, each * friends + 1)  # keep some for himself: the answer stays positive
        got = d.step(bags, "*", per, f"The bags hold # {items}.")
        have = d.step(a, "+", got, f"{p.name} then has # {items}.")
        gave = d.step(each, "*", friends, f"{p.He} gives away # {items}.")
        d.step(have, "-", gave, f"{p.He} has # {items} left.")
        return (
            f"{p.name} has {a} {items}. {p.He} buys {bags} bags with {per} {items} in each "
            f"bag, and then gives {each} {items} to each of {p.his} {friends} friends. "
            f"How many {items} does {p.name} have left?"
        )
    a += (a + bags * per) % 2  # an even total halves exactly
    got = d.step(bags, "*", per, f"The packs hold # {items}.")
    have = d.step(a, "+", got, f"{p.name} then has # {items}.")
    d.step(have, "/", 2, f"{p.He} gives away half and keeps # {items}.")
    return (
        f"{p.name} has {a} {items}. {p.He} buys {bags} packs of {per} {items}, then gives "
        f"half of all {p.his} {items} to {p.his} brother. "
        f"How many {items} does {p.name} have left?"
    )


def _bill(cost: int) -> int:
    """The note a buyer pays with: the smallest common one above the cost."""
    for note in (5, 10, 20, 50, 100):
        if note > cost:
            return note
    return (cost // 100 + 1) * 100


def _shopping(d: Draw) -> str:
    p = d.person()
    (one, many), (one2, many2) = d.rng.sample(_GOODS, 2)
    if d.level == 1:
        form = d.rng.randrange(3)
        if form == 0:
            k, price = d.k(), d.n()
            d.step(k, "*", price, f"{p.name} spends # dollars.")
            return (
                f"{p.name} buys {k} {many} that cost ${price} each. "
                f"How much money does {p.he} spend?"
            )
        if form == 1:
            a, b = d.n(), d.n()
            d.step(a, "+", b, "Together they cost # dollars.")
            return (
                f"A {one} costs ${a} and a {one2} costs ${b}. "
                f"How much do the {one} and the {one2} cost together?"
            )
        price = d.n()
        money = d.n(price + 1, max(2 * d.top, price + 1))
        d.step(money, "-", price, f"{p.name} has # dollars left.")
        return (
            f"{p.name} has ${money} and buys a {one} for ${price}. "
            f"How much money does {p.he} have left?"
        )
    if d.level == 2:
        k, price = d.k(), d.n()
        if d.coin():
            cost = k * price
            note = _bill(cost)
            d.step(k, "*", price, f"The {many} cost # dollars.")
            d.step(note, "-", cost, f"{p.name} gets # dollars in change.")
            return (
                f"{p.name} buys {k} {many} for ${price} each and pays with ${note}. "
                f"How much change does {p.he} get?"
            )
        extra = d.n()
        cost = d.step(k, "*", price, f"The {many} cost # dollars.")
        d.step(cost, "+", extra, f"{p.name} spends # dollars in total.")
        return (
            f"{p.name} buys {k} {many} at ${price} each and a {one2} for ${extra}. "
            f"How much does {p.he} spend in total?"
        )
    if d.coin():
        k1, p1, k2, p2 = d.k(), d.n(), d.k(), d.n()
        c1 = d.step(k1, "*", p1, f"The {many} cost # dollars.")
        c2 = d.step(k2, "*", p2, f"The {many2} cost # dollars.")
        cost = d.step(c1, "+", c2, f"{p.name} spends # dollars.")
        note = _bill(cost)
        d.step(note, "-", cost, f"{p.He} gets # dollars in change.")
        return (
            f"At the market, {p.name} buys {k1} {many} for ${p1} each and {k2} {many2} "
            f"for ${p2} each. {p.He} pays with ${note}. How much change does {p.he} get?"
        )
    friends, k, price = d.n(2, 6), d.k(), d.n()
    people = d.step(1, "+", friends, "There are # people.")
    bought = d.step(people, "*", k, f"They buy # {many}.")
    d.step(bought, "*", price, "They spend # dollars.")
    return (
        f"{p.name} and {friends} friends each buy {k} {many} that cost ${price} each. "
        f"How much money do they spend in total?"
    )


def _sharing(d: Draw) -> str:
    p, items = d.person(), d.pick(_THINGS)
    if d.level == 1:
        q, k = d.n(), d.k()
        total = q * k
        form = d.rng.randrange(3)
        if form == 0:
            d.step(total, "/", k, f"Each friend gets # {items}.")
            return (
                f"{p.name} has {total} {items} and shares them equally among {k} friends. "
                f"How many {items} does each friend get?"
            )
        if form == 1:
            people, place = d.pick(_CROWDS)
            d.step(total, "/", k, "There are # groups.")
            return (
                f"There are {total} {people} at {place}. They split into groups of {k}. "
                f"How many groups are there?"
            )
        one, many, what = d.pick(_CONTAINERS)
        d.step(total, "/", k, f"Each {one} gets # {what}.")
        return (
            f"{p.name} puts {total} {what} equally into {k} {many}. "
            f"How many {what} go in each {one}?"
        )
    if d.level == 2:
        if d.coin():
            one, many, what = d.pick(_CONTAINERS)
            a, b = d.k(), d.n()
            divisors = [k for k in range(2, 13) if (a * b) % k == 0]
            k = d.pick(divisors)
            total = d.step(a, "*", b, f"{p.name} has # {what}.")
            d.step(total, "/", k, f"Each friend gets # {what}.")
            return (
                f"{p.name} has {a} {many} with {b} {what} in each {one}. {p.He} shares all "
                f"the {what} equally among {k} friends. How many {what} does each friend get?"
            )
        q, k, keep = d.n(), d.k(), d.n(1)
        total = q * k + keep
        rest = d.step(total, "-", keep, f"{p.name} shares # {items}.")
        d.step(rest, "/", k, f"Each friend gets # {items}.")
        return (
            f"{p.name} has {total} {items}. {p.He} keeps {keep} for {p.him}self and shares "
            f"the rest equally among {k} friends. How many {items} does each friend get?"
        )
    trays, per, k = d.k(), d.n(), d.n(2, 6)
    total = trays * per
    keep = total % k or k  # leaves a multiple of k to share (and a non-zero number to keep)
    if total - keep < 2 * k:  # too few to give each friend two
        per += 2 * k
        total = trays * per
        keep = total % k or k
    made = d.step(trays, "*", per, f"{p.name} bakes # cookies.")
    rest = d.step(made, "-", keep, f"{p.He} shares # cookies.")
    each = d.step(rest, "/", k, "Each friend gets # cookies.")
    if d.coin():
        return (
            f"{p.name} bakes {trays} trays of {per} cookies. {p.He} keeps {keep} cookies and "
            f"shares the rest equally among {k} friends. How many cookies does each friend "
            f"get?"
        )
    eaten = d.n(1, each - 1)
    d.step(each, "-", eaten, "Each friend has # cookies left.")
    return (
        f"{p.name} bakes {trays} trays of {per} cookies. {p.He} keeps {keep} cookies and "
        f"shares the rest equally among {k} friends. Each friend eats {eaten} of "
        f"their cookies. How many cookies does each friend have left?"
    )


def _rates(d: Draw) -> str:
    subject, subjects, verb, verbs, noun, money, period = d.pick(_RATES)
    if subject is None:
        p = d.person()
        who, mid, the, it = p.name, p.name, p.name, p.he
    else:  # "A bakery bakes ...", "For the first 3 days, a bakery ...", "The bakery bakes ..."
        p, who, mid, it = None, subject.capitalize(), subject, "it"
        the = "The " + subject.split(" ", 1)[1]

    def amount(x: int) -> str:
        return f"${x}" if money else f"{x} {noun}"

    how = "How much money" if money else f"How many {noun}"
    if d.level == 1:
        r, t = d.n(), d.k()
        d.step(r, "*", t, f"In {t} {period}s, that is # {noun}.")
        return f"{who} {verbs} {amount(r)} every {period}. {how} does {it} {verb} in {t} {period}s?"
    if d.level == 2:
        r = d.n()
        if d.coin():
            t1, t2 = d.k(), d.k()
            got = r * t1
            rate = d.step(got, "/", t1, f"{the} {verbs} # {noun} every {period}.")
            d.step(rate, "*", t2, f"In {t2} {period}s, that is # {noun}.")
            return (
                f"{who} {verbs} {amount(got)} in {t1} {period}s, the same amount every "
                f"{period}. {how} does {it} {verb} in {t2} {period}s?"
            )
        r2, t = d.n(), d.k()
        if p is None:
            pair, they = (
                f"One {subject[2:]} {verbs} {amount(r)} and another {verbs} "
                f"{amount(r2)} every {period}.",
                f"the two {subjects}",
            )
        else:
            q = d.person(p.name)
            pair, they = (
                (f"{p.name} {verbs} {amount(r)} and {q.name} {verbs} {amount(r2)} every {period}."),
                "they",
            )
        both = d.step(r, "+", r2, f"Together they {verb} # {noun} every {period}.")
        d.step(both, "*", t, f"In {t} {period}s, that is # {noun}.")
        return f"{pair} {how} do {they} {verb} together in {t} {period}s?"
    r1, t1, r2, t2 = d.n(), d.k(), d.n(), d.k()
    a = d.step(r1, "*", t1, f"In the first {t1} {period}s, {it} {verbs} # {noun}.")
    b = d.step(r2, "*", t2, f"In the next {t2} {period}s, {it} {verbs} # {noun}.")
    goal_first = d.coin()  # after the goal sentence, the subject is a pronoun
    story = (
        f"For the first {t1} {period}s, {it if goal_first else mid} {verbs} {amount(r1)} "
        f"every {period}. For the next {t2} {period}s, {it} {verbs} {amount(r2)} every "
        f"{period}."
    )
    if not goal_first:
        d.step(a, "+", b, f"In all, {it} {verbs} # {noun}.")
        return f"{story} {how} does {it} {verb} in all?"
    goal = a + b + d.n(1)
    done = d.step(a, "+", b, f"So far, {it} {verbs} # {noun}.")
    d.step(goal, "-", done, f"{it.capitalize()} still needs to {verb} # {noun}.")
    wants = "wants" if p is not None else "needs"
    return (
        f"{who} {wants} to {verb} {amount(goal)} in all. {story} "
        f"{how} does {it} still need to {verb} to reach {p.his if p else 'its'} goal?"
    )


def _groups(d: Draw) -> str:
    p = d.person()
    one, many, what = d.pick(_CONTAINERS)
    if d.level == 1:
        g, k = d.k(), d.n()
        d.step(g, "*", k, f"There are # {what}.")
        return d.pick(
            (
                f"There are {g} {many} with {k} {what} in each {one}. "
                f"How many {what} are there in total?",
                f"{p.name} has {g} {many}. Each {one} holds {k} {what}. "
                f"How many {what} does {p.he} have?",
            )
        )
    if d.level == 2:
        g = d.k()
        if d.coin():
            c1, c2 = d.rng.sample(_COLORS, 2)
            a, b = d.n(1), d.n(1)
            per = d.step(a, "+", b, f"Each {one} has # {what}.")
            d.step(g, "*", per, f"There are # {what} in all.")
            return (
                f"{p.name} has {g} {many}. Each {one} has {a} {c1} {what} and {b} {c2} "
                f"{what}. How many {what} does {p.name} have in all?"
            )
        k = d.n()
        total = d.step(g, "*", k, f"There are # {what}.")
        used = d.n(1, total - 1)
        d.step(total, "-", used, f"# {what} are left.")
        return (
            f"There are {g} {many} with {k} {what} in each {one}. {p.name} takes {used} "
            f"{what}. How many {what} are left?"
        )
    if d.coin():
        two, four = d.pick(_TWO_LEGS), d.pick(_FOUR_LEGS)
        a, b = d.n(), d.n()
        x = d.step(a, "*", 2, f"The {two} have # legs.")
        y = d.step(b, "*", 4, f"The {four} have # legs.")
        d.step(x, "+", y, "All the animals have # legs.")
        return (
            f"A farm has {a} {two} and {b} {four}. Each of the {two} has 2 legs and each "
            f"of the {four} has 4 legs. How many legs do the animals have in all?"
        )
    shelves, per_shelf, k = d.k(), d.k(), d.n()
    boxes = d.step(shelves, "*", per_shelf, f"There are # {many}.")
    total = d.step(boxes, "*", k, f"The {many} hold # {what}.")
    sold = d.n(1, total - 1)
    story = (
        f"A store has {shelves} shelves. Each shelf has {per_shelf} {many}, and each "
        f"{one} holds {k} {what}. The store sells {sold} {what}."
    )
    left = d.step(total, "-", sold, f"# {what} are left.")
    if d.coin():
        return f"{story} How many {what} are left?"
    new = d.n()
    d.step(left, "+", new, f"After the delivery there are # {what}.")
    return (
        f"{story} Then a delivery brings {new} more {what}. "
        f"How many {what} does the store have now?"
    )


def _comparison(d: Draw) -> str:
    a_p = d.person()
    b_p = d.person(a_p.name)
    items, A, B = d.pick(_THINGS), a_p.name, b_p.name
    if d.level == 1:
        form = d.rng.randrange(4)
        a = d.n(3)
        if form == 0:
            b = d.n(1)
            d.step(a, "+", b, f"{B} has # {items}.")
            return (
                f"{A} has {a} {items}. {B} has {b} more {items} than {A}. "
                f"How many {items} does {B} have?"
            )
        b = d.n(1, a - 1)
        if form == 1:
            d.step(a, "-", b, f"{B} has # {items}.")
            return (
                f"{A} has {a} {items}. {B} has {b} fewer {items} than {A}. "
                f"How many {items} does {B} have?"
            )
        if form == 2:
            d.step(a, "-", b, f"{A} has # more {items}.")
            return (
                f"{A} has {a} {items} and {B} has {b} {items}. "
                f"How many more {items} does {A} have than {B}?"
            )
        k = d.n(2, 5)
        d.step(a, "*", k, f"{B} has # {items}.")
        return (
            f"{A} has {a} {items}. {B} has {k} times as many {items} as {A}. "
            f"How many {items} does {B} have?"
        )
    if d.level == 2:
        a = d.n(3)
        form = d.rng.randrange(3)
        if form == 0:
            b = d.n(1)
            other = d.step(a, "+", b, f"{B} has # {items}.")
            rel = f"{b} more {items} than {A}"
        elif form == 1:
            b = d.n(1, a - 1)
            other = d.step(a, "-", b, f"{B} has # {items}.")
            rel = f"{b} fewer {items} than {A}"
        else:
            k = d.n(2, 5)
            other = d.step(a, "*", k, f"{B} has # {items}.")
            rel = f"{k} times as many {items} as {A}"
        d.step(a, "+", other, f"Together they have # {items}.")
        return f"{A} has {a} {items}. {B} has {rel}. How many {items} do {A} and {B} have together?"
    C = d.person(A, B).name
    a, k = d.n(3), d.n(2, 5)
    other = d.step(a, "*", k, f"{B} has # {items}.")
    if d.coin():
        c = d.n(1, other - 1)
        third = d.step(other, "-", c, f"{C} has # {items}.")
        two = d.step(a, "+", other, f"{A} and {B} have # {items}.")
        d.step(two, "+", third, f"All three have # {items}.")
        return (
            f"{A} has {a} {items}. {B} has {k} times as many {items} as {A}, and {C} has "
            f"{c} fewer {items} than {B}. How many {items} do the three of them have "
            f"together?"
        )
    c = d.n(1)
    third = d.step(other, "+", c, f"{C} has # {items}.")
    d.step(third, "-", a, f"{C} has # more {items} than {A}.")
    return (
        f"{A} has {a} {items}. {B} has {k} times as many {items} as {A}, and {C} has "
        f"{c} more {items} than {B}. How many more {items} does {C} have than {A}?"
    )


def _fractions(d: Draw) -> str:
    p = d.person()
    den, words = d.pick(_FRACTIONS)
    if d.level == 1:
        q = d.n(1)
        total = den * q
        if d.coin():
            items = d.pick(_THINGS)
            d.step(total, "/", den, f"{p.name} gives away # {items}.")
            return (
                f"{p.name} has {total} {items}. {p.He} gives {words} of them to "
                f"{p.his} friend. How many {items} does {p.he} give away?"
            )
        (people, place), doing = d.pick(_CROWDS), d.pick(_ACTIVITIES)
        d.step(total, "/", den, f"# {people} {doing}.")
        return (
            f"There are {total} {people} at {place}. {words.capitalize()} of them "
            f"{doing}. How many {people} {doing}?"
        )
    pcts = [x for x in _PERCENTS if 100 // math.gcd(x, 100) <= d.top]
    pct = d.pick(pcts)
    unit = 100 // math.gcd(pct, 100)  # the smallest price whose pct% is a whole number
    price = unit * d.n(1, d.top // unit)
    one = d.pick(_GOODS)[0]
    if d.level == 2:
        form = d.rng.randrange(3)
        if form == 0:
            q = d.n(1)
            total = den * q
            (people, place), doing = d.pick(_CROWDS), d.pick(_ACTIVITIES)
            some = d.step(total, "/", den, f"# {people} {doing}.")
            d.step(total, "-", some, f"# {people} do not.")
            return (
                f"There are {total} {people} at {place}. {words.capitalize()} of them "
                f"{doing}. How many of the {people} do not {doing}?"
            )
        if form == 1:
            x = d.step(price, "*", pct, f"{price} times {pct} is #.")
            d.step(x, "/", 100, f"{p.name} saves # dollars.")
            return (
                f"A {one} costs ${price}. It is on sale for {pct}% off. "
                f"How much money does {p.name} save by buying it on sale?"
            )
        den = d.pick((3, 4, 5))
        num = d.pick(_NUMERATORS[den])
        items, q = d.pick(_THINGS), d.n(1)
        total = den * q
        # Food is eaten, anything else is given away.
        eats = items in ("cookies", "candies", "strawberries", "apples")
        verb, ask = ("eats", "eat") if eats else ("gives away", "give away")
        part = d.step(total, "/", den, f"{_ONE_PART[den]} of the {items} is # {items}.")
        d.step(part, "*", num, f"{p.name} {verb} # {items}.")
        return (
            f"{p.name} has {total} {items}. {p.He} {verb} {num}/{den} of them. "
            f"How many {items} does {p.he} {ask}?"
        )
    if d.coin():
        k = d.k()
        x = d.step(price, "*", pct, f"{price} times {pct} is #.")
        off = d.step(x, "/", 100, "The discount is # dollars.")
        sale = d.step(price, "-", off, f"Each {one} costs # dollars on sale.")
        d.step(sale, "*", k, f"{p.name} pays # dollars.")
        return (
            f"A {one} costs ${price}. This week it is on sale for {pct}% off. {p.name} buys "
            f"{k} of them on sale. How much does {p.he} pay?"
        )
    den = d.pick((3, 4, 5))
    num = d.pick(_NUMERATORS[den])
    u = 2 * d.n(1, max(1, d.top // 2))  # even, so half of the girls is whole
    total = den * u
    part = d.step(total, "/", den, f"{_ONE_PART[den]} of the students is # students.")
    girls = d.step(part, "*", num, "# students are girls.")
    play = d.step(girls, "/", 2, "# girls play soccer.")
    d.step(girls, "-", play, "# girls do not play soccer.")
    return (
        f"A school has {total} students, and {num}/{den} of them are girls. Half of the "
        f"girls play soccer. How many girls do not play soccer?"
    )


def _ages(d: Draw) -> str:
    p = d.person()
    sib, _ = d.pick(_SIBLINGS)
    par, _ = d.pick(_PARENTS)
    if d.level == 1:
        form = d.rng.randrange(4)
        a = d.n(4, 15)
        if form == 0:
            b = d.n(1, 9)
            d.step(a, "+", b, f"{p.His} {sib} is # years old.")
            return (
                f"{p.name} is {a} years old. {p.His} {sib} is {b} years older. "
                f"How old is {p.his} {sib}?"
            )
        if form == 1:
            b = d.n(1, a - 1)
            d.step(a, "-", b, f"{p.His} {sib} is # years old.")
            return (
                f"{p.name} is {a} years old. {p.His} {sib} is {b} years younger. "
                f"How old is {p.his} {sib}?"
            )
        if form == 2:
            t = d.n(1, 10)
            d.step(a, "+", t, f"{p.name} will be # years old.")
            return f"{p.name} is {a} years old. How old will {p.he} be in {t} years?"
        k = d.n(3, 5)
        a = d.n(max(4, -(-22 // k)), 60 // k)  # a parent between 22 and 60
        d.step(a, "*", k, f"{p.His} {par} is # years old.")
        return (
            f"{p.name} is {a} years old. {p.His} {par} is {k} times as old as {p.him}. "
            f"How old is {p.his} {par}?"
        )
    if d.level == 2:
        if d.coin():
            k = d.n(3, 5)
            a = d.n(max(4, -(-22 // k)), 60 // k)
            t = d.n(2, 10)
            now = d.step(a, "*", k, f"{p.His} {par} is # years old.")
            d.step(now, "+", t, f"In {t} years, {p.his} {par} will be # years old.")
            return (
                f"{p.name} is {a} years old. {p.His} {par} is {k} times as old as "
                f"{p.him}. How old will {p.his} {par} be in {t} years?"
            )
        a, b = d.n(4, 15), d.n(1, 9)
        s = d.step(a, "+", b, f"{p.His} {sib} is # years old.")
        d.step(a, "+", s, "Together they are # years old.")
        return (
            f"{p.name} is {a} years old. {p.His} {sib} is {b} years older than {p.him}. "
            f"What is the sum of their ages?"
        )
    a, b = d.n(4, 12), d.n(1, 8)
    if d.coin():
        k = d.n(3, 4)
        s = d.step(a, "+", b, f"{p.His} {sib} is # years old.")
        f = d.step(a, "*", k, f"{p.His} {par} is # years old.")
        two = d.step(a, "+", s, f"{p.name} and {p.his} {sib} are # years old together.")
        d.step(two, "+", f, "All three together are # years old.")
        return (
            f"{p.name} is {a} years old. {p.His} {sib} is {b} years older than {p.him}, "
            f"and {p.his} {par} is {k} times as old as {p.name}. What is the sum of the "
            f"ages of all three?"
        )
    k = 4 if a + b <= 23 else 3  # a grandparent of at most 92
    t = d.n(2, 10)
    s = d.step(a, "+", b, f"{p.His} {sib} is # years old.")
    g = d.step(s, "*", k, "Their grandmother is # years old.")
    d.step(g, "+", t, f"In {t} years, she will be # years old.")
    return (
        f"{p.name} is {a} years old. {p.His} {sib} is {b} years older than {p.him}. Their "
        f"grandmother is {k} times as old as {p.his} {sib}. How old will their "
        f"grandmother be in {t} years?"
    )


KINDS: dict[str, Callable[[Draw], str]] = {
    "inventory": _inventory,
    "shopping": _shopping,
    "sharing": _sharing,
    "rates": _rates,
    "groups": _groups,
    "comparison": _comparison,
    "fractions": _fractions,
    "ages": _ages,
}
