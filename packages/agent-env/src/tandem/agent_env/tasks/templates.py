"""Reference functions for generated tasks, each with a generator of valid inputs.

Small, self-contained, loop-bearing functions in the style of everyday utility code: each one
offers sites for several bug kinds. Inputs are small so hidden tests run in milliseconds.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Template:
    name: str
    source: str
    inputs: Callable[[random.Random], tuple]


def _ints(
    rng: random.Random, lo: int = -20, hi: int = 20, n: tuple[int, int] = (0, 8)
) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(*n))]


def _word(rng: random.Random, k: int = 6) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, k)))


def _text(rng: random.Random) -> str:
    return " ".join(_word(rng) for _ in range(rng.randint(0, 7)))


TEMPLATES: list[Template] = [
    Template(
        "clamp",
        """def clamp(value, low, high):
    \"\"\"Limit value to the closed interval [low, high].\"\"\"
    if value < low:
        return low
    if value > high:
        return high
    return value
""",
        lambda r: (r.randint(-30, 30), *sorted((r.randint(-10, 10), r.randint(-10, 10)))),
    ),
    Template(
        "running_total",
        """def running_total(values):
    \"\"\"Prefix sums: element i is the sum of values[0..i].\"\"\"
    totals = []
    acc = 0
    for v in values:
        acc += v
        totals.append(acc)
    return totals
""",
        lambda r: (_ints(r),),
    ),
    Template(
        "chunked",
        """def chunked(items, size):
    \"\"\"Split items into consecutive lists of at most size elements.\"\"\"
    out = []
    for start in range(0, len(items), size):
        out.append(items[start:start + size])
    return out
""",
        lambda r: (_ints(r, n=(0, 11)), r.randint(1, 4)),
    ),
    Template(
        "count_vowels",
        """def count_vowels(text):
    \"\"\"Number of vowels (a, e, i, o, u; any case) in text.\"\"\"
    count = 0
    for ch in text.lower():
        if ch in "aeiou":
            count += 1
    return count
""",
        lambda r: (_text(r).title() if r.random() < 0.5 else _text(r),),
    ),
    Template(
        "is_palindrome",
        """def is_palindrome(text):
    \"\"\"True if text reads the same backwards, ignoring case and non-letters.\"\"\"
    letters = [c.lower() for c in text if c.isalpha()]
    i = 0
    j = len(letters) - 1
    while i < j:
        if letters[i] != letters[j]:
            return False
        i += 1
        j -= 1
    return True
""",
        lambda r: (
            (lambda w: w + w[::-1][r.randint(0, 1) :])(_word(r, 5))
            if r.random() < 0.6
            else _word(r, 7),
        ),
    ),
    Template(
        "fizzbuzz",
        """def fizzbuzz(n):
    \"\"\"The FizzBuzz sequence from 1 to n as strings.\"\"\"
    out = []
    for i in range(1, n + 1):
        if i % 15 == 0:
            out.append("FizzBuzz")
        elif i % 3 == 0:
            out.append("Fizz")
        elif i % 5 == 0:
            out.append("Buzz")
        else:
            out.append(str(i))
    return out
""",
        lambda r: (r.randint(0, 31),),
    ),
    Template(
        "binary_search",
        """def binary_search(items, target):
    \"\"\"Index of target in the sorted list items, or -1 if absent.\"\"\"
    lo = 0
    hi = len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
""",
        lambda r: (
            lambda xs: (xs, r.choice(xs) if xs and r.random() < 0.7 else r.randint(-25, 25))
        )(sorted(set(_ints(r, n=(0, 12))))),
    ),
    Template(
        "gcd",
        """def gcd(a, b):
    \"\"\"Greatest common divisor of two non-negative integers.\"\"\"
    while b != 0:
        a, b = b, a % b
    return a
""",
        lambda r: (r.randint(0, 60), r.randint(0, 60)),
    ),
    Template(
        "merge_intervals",
        """def merge_intervals(intervals):
    \"\"\"Merge overlapping [start, end] intervals; the result is sorted.\"\"\"
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
""",
        lambda r: ([sorted((r.randint(0, 20), r.randint(0, 20))) for _ in range(r.randint(0, 6))],),
    ),
    Template(
        "rotate_left",
        """def rotate_left(items, k):
    \"\"\"Rotate items k places to the left (k may exceed the length).\"\"\"
    if not items:
        return []
    k = k % len(items)
    return items[k:] + items[:k]
""",
        lambda r: (_ints(r, n=(0, 8)), r.randint(0, 12)),
    ),
    Template(
        "median",
        """def median(values):
    \"\"\"Median of a non-empty list of numbers.\"\"\"
    ordered = sorted(values)
    n = len(ordered)
    mid = n // 2
    if n % 2 == 1:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2
""",
        lambda r: (_ints(r, n=(1, 9)),),
    ),
    Template(
        "caesar",
        """def caesar(text, shift):
    \"\"\"Shift lowercase letters by shift places, wrapping around; other characters stay.\"\"\"
    out = []
    for ch in text:
        if "a" <= ch <= "z":
            out.append(chr((ord(ch) - ord("a") + shift) % 26 + ord("a")))
        else:
            out.append(ch)
    return "".join(out)
""",
        lambda r: (_text(r), r.randint(-30, 30)),
    ),
    Template(
        "dedupe",
        """def dedupe(items):
    \"\"\"Items without repeats, keeping the first occurrence of each.\"\"\"
    seen = set()
    out = []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out
""",
        lambda r: (_ints(r, -4, 4, n=(0, 10)),),
    ),
    Template(
        "max_subarray",
        """def max_subarray(values):
    \"\"\"Largest sum of a non-empty contiguous slice of values.\"\"\"
    best = values[0]
    current = values[0]
    for v in values[1:]:
        current = max(v, current + v)
        best = max(best, current)
    return best
""",
        lambda r: (_ints(r, n=(1, 9)),),
    ),
    Template(
        "to_roman",
        """def to_roman(number):
    \"\"\"Roman numeral for 1 <= number <= 3999.\"\"\"
    table = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
             (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]
    out = []
    for value, symbol in table:
        while number >= value:
            out.append(symbol)
            number -= value
    return "".join(out)
""",
        lambda r: (r.choice([r.randint(1, 50), r.randint(1, 3999)]),),
    ),
    Template(
        "second_largest",
        """def second_largest(values):
    \"\"\"Second largest distinct value, or None if there is none.\"\"\"
    first = None
    second = None
    for v in values:
        if first is None or v > first:
            if first is not None:
                second = first
            first = v
        elif v != first and (second is None or v > second):
            second = v
    return second
""",
        lambda r: (_ints(r, -9, 9, n=(0, 8)),),
    ),
    Template(
        "word_lengths",
        """def word_lengths(text):
    \"\"\"Map each distinct word to its length, skipping words shorter than 2 letters.\"\"\"
    lengths = {}
    for word in text.split():
        if len(word) < 2:
            continue
        lengths[word] = len(word)
    return lengths
""",
        lambda r: (_text(r),),
    ),
    Template(
        "pairwise_diffs",
        """def pairwise_diffs(values):
    \"\"\"Differences between neighbours: values[i + 1] - values[i].\"\"\"
    diffs = []
    for i in range(len(values) - 1):
        diffs.append(values[i + 1] - values[i])
    return diffs
""",
        lambda r: (_ints(r, n=(0, 9)),),
    ),
    Template(
        "digit_sum",
        """def digit_sum(number, base=10):
    \"\"\"Sum of the digits of a non-negative integer written in base.\"\"\"
    total = 0
    while number > 0:
        total += number % base
        number //= base
    return total
""",
        lambda r: (r.randint(0, 100000), r.choice([2, 8, 10, 16])),
    ),
    Template(
        "interleave",
        """def interleave(first, second):
    \"\"\"Alternate elements of two lists; the rest of the longer list goes at the end.\"\"\"
    out = []
    n = min(len(first), len(second))
    for i in range(n):
        out.append(first[i])
        out.append(second[i])
    out.extend(first[n:])
    out.extend(second[n:])
    return out
""",
        lambda r: (_ints(r, n=(0, 6)), _ints(r, 30, 60, n=(0, 6))),
    ),
]

BY_NAME = {t.name: t for t in TEMPLATES}
