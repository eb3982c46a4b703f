"""The correct functions that generated repositories are made of, grouped by theme.

Each entry is the function's source and a generator of random arguments; the generator picks a
theme, some of its functions, and plants a bug in one (see mutations.py). Sources are written the
way people write such helpers, so comparison, arithmetic, constant and boolean mutations are plentiful.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class FunctionSpec:
    source: str
    args: Callable[[random.Random], tuple]
    """One random argument tuple."""

    @property
    def name(self) -> str:
        return self.source.split("def ", 1)[1].split("(", 1)[0]


def ints(rng, n_min=0, n_max=8, lo=-20, hi=20):
    return [rng.randint(lo, hi) for _ in range(rng.randint(n_min, n_max))]


def word(rng, n_min=1, n_max=7, alphabet=string.ascii_lowercase):
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(n_min, n_max)))


def sentence(rng, n_max=6):
    return " ".join(word(rng) for _ in range(rng.randint(0, n_max)))


TEXT = [
    FunctionSpec('''def count_vowels(text):
    """Number of vowels (a, e, i, o, u) in text, ignoring case."""
    return sum(1 for ch in text.lower() if ch in "aeiou")
''', lambda r: (word(r, 0, 12, "aeiouxyzbcAEIOU"),)),
    FunctionSpec('''def is_palindrome(text):
    """True when text reads the same backwards, ignoring case and non-alphanumerics."""
    cleaned = [ch.lower() for ch in text if ch.isalnum()]
    return cleaned == cleaned[::-1]
''', lambda r: (r.choice([word(r, 0, 6, "abA ,"), (lambda w: w + w[::-1][r.randint(0, 1):])(word(r, 1, 4, "abc"))]),)),
    FunctionSpec('''def caesar(text, shift):
    """Shift lower-case letters by `shift` places in the alphabet; other characters are kept."""
    out = []
    for ch in text:
        if "a" <= ch <= "z":
            out.append(chr((ord(ch) - ord("a") + shift) % 26 + ord("a")))
        else:
            out.append(ch)
    return "".join(out)
''', lambda r: (word(r, 0, 8, "abxyz -!"), r.randint(-30, 30))),
    FunctionSpec('''def run_length(text):
    """Run-length encoding: "aaab" -> "a3b1"."""
    out = []
    i = 0
    while i < len(text):
        j = i
        while j < len(text) and text[j] == text[i]:
            j += 1
        out.append(f"{text[i]}{j - i}")
        i = j
    return "".join(out)
''', lambda r: (word(r, 0, 10, "aab"),)),
    FunctionSpec('''def longest_word(text):
    """The longest word of text (the first one on ties); "" for no words."""
    best = ""
    for w in text.split():
        if len(w) > len(best):
            best = w
    return best
''', lambda r: (sentence(r),)),
    FunctionSpec('''def balanced(text):
    """True when the parentheses in text are balanced."""
    depth = 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                return False
    return depth == 0
''', lambda r: (word(r, 0, 8, "(()a"),)),
    FunctionSpec('''def initials(name):
    """Upper-case initials of the words of name: "ada king lovelace" -> "AKL"."""
    return "".join(part[0].upper() for part in name.split() if len(part) > 0)
''', lambda r: (sentence(r, 4),)),
    FunctionSpec('''def count_words(text, min_length):
    """Number of words of text with at least min_length characters."""
    return len([w for w in text.split() if len(w) >= min_length])
''', lambda r: (sentence(r, 8), r.randint(1, 6))),
]

NUMBERS = [
    FunctionSpec('''def clamp(value, low, high):
    """value limited to the range [low, high]."""
    if value < low:
        return low
    if value > high:
        return high
    return value
''', lambda r: (r.randint(-10, 20), r.randint(-5, 3), r.randint(4, 12))),
    FunctionSpec('''def gcd(a, b):
    """Greatest common divisor (always >= 0)."""
    while b != 0:
        a, b = b, a % b
    return abs(a)
''', lambda r: (r.randint(-60, 60), r.randint(0, 60))),
    FunctionSpec('''def digit_sum(n):
    """Sum of the decimal digits of n (sign ignored)."""
    n = abs(n)
    total = 0
    while n > 0:
        total += n % 10
        n //= 10
    return total
''', lambda r: (r.randint(-99999, 99999),)),
    FunctionSpec('''def factorial(n):
    """n! for n >= 0."""
    result = 1
    for k in range(2, n + 1):
        result *= k
    return result
''', lambda r: (r.randint(0, 12),)),
    FunctionSpec('''def fibonacci(n):
    """The n-th Fibonacci number (fibonacci(0) == 0, fibonacci(1) == 1)."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
''', lambda r: (r.randint(0, 25),)),
    FunctionSpec('''def is_leap(year):
    """Gregorian leap year."""
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
''', lambda r: (r.choice([r.randint(1800, 2400), 100 * r.randint(16, 24), 4 * r.randint(450, 600)]),)),
    FunctionSpec('''def compound(principal, rate_percent, years):
    """Balance after `years` of yearly compounding, rounded to cents."""
    amount = principal
    for _ in range(years):
        amount += amount * rate_percent / 100
    return round(amount, 2)
''', lambda r: (r.randint(100, 5000), r.randint(1, 12), r.randint(0, 10))),
    FunctionSpec('''def collatz_steps(n):
    """Steps of the Collatz map from n (>= 1) down to 1."""
    steps = 0
    while n != 1:
        if n % 2 == 0:
            n = n // 2
        else:
            n = 3 * n + 1
        steps += 1
    return steps
''', lambda r: (r.randint(1, 60),)),
    FunctionSpec('''def is_prime(n):
    """True for prime n."""
    if n < 2:
        return False
    k = 2
    while k * k <= n:
        if n % k == 0:
            return False
        k += 1
    return True
''', lambda r: (r.randint(-3, 120),)),
]

LISTS = [
    FunctionSpec('''def running_total(values):
    """Prefix sums: [1, 2, 3] -> [1, 3, 6]."""
    total = 0
    out = []
    for v in values:
        total += v
        out.append(total)
    return out
''', lambda r: (ints(r),)),
    FunctionSpec('''def chunk(values, size):
    """values split into lists of `size` (the last may be shorter)."""
    return [values[i:i + size] for i in range(0, len(values), size)]
''', lambda r: (ints(r, 0, 9), r.randint(1, 4))),
    FunctionSpec('''def dedupe(values):
    """values without repeats, first occurrences kept in order."""
    seen = set()
    out = []
    for v in values:
        if v not in seen:
            seen.add(v)
            out.append(v)
    return out
''', lambda r: (ints(r, 0, 10, 0, 5),)),
    FunctionSpec('''def max_subarray(values):
    """Largest sum of a non-empty contiguous run of values (Kadane)."""
    best = current = values[0]
    for v in values[1:]:
        current = max(v, current + v)
        best = max(best, current)
    return best
''', lambda r: (ints(r, 1, 9),)),
    FunctionSpec('''def second_largest(values):
    """Second largest distinct value, or None when there is none."""
    distinct = sorted(set(values))
    if len(distinct) < 2:
        return None
    return distinct[-2]
''', lambda r: (ints(r, 0, 7, 0, 9),)),
    FunctionSpec('''def rotate(values, k):
    """values rotated right by k places."""
    if not values:
        return []
    k = k % len(values)
    return values[-k:] + values[:-k]
''', lambda r: (ints(r, 0, 7), r.randint(0, 9))),
    FunctionSpec('''def merge_sorted(left, right):
    """Merge two sorted lists into one sorted list."""
    i = j = 0
    out = []
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            out.append(left[i])
            i += 1
        else:
            out.append(right[j])
            j += 1
    out.extend(left[i:])
    out.extend(right[j:])
    return out
''', lambda r: (sorted(ints(r, 0, 6)), sorted(ints(r, 0, 6)))),
    FunctionSpec('''def binary_search(values, target):
    """Index of target in sorted values, or -1."""
    lo, hi = 0, len(values) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if values[mid] == target:
            return mid
        if values[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
''', lambda r: (lambda vs: (vs, r.choice(vs + [r.randint(-25, 25)]) if vs else 3))(sorted(set(ints(r, 0, 9))))),
    FunctionSpec('''def count_between(values, low, high):
    """How many values lie in the closed range [low, high]."""
    return sum(1 for v in values if low <= v <= high)
''', lambda r: (ints(r, 0, 10, -5, 15), r.randint(-5, 5), r.randint(5, 12))),
    FunctionSpec('''def median(values):
    """Median of a non-empty list."""
    ordered = sorted(values)
    n = len(ordered)
    mid = n // 2
    if n % 2 == 1:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2
''', lambda r: (ints(r, 1, 8),)),
    FunctionSpec('''def mean(values):
    """Arithmetic mean; 0.0 for an empty list."""
    if not values:
        return 0.0
    return sum(values) / len(values)
''', lambda r: (ints(r, 0, 8),)),
    FunctionSpec('''def pairs_with_sum(values, target):
    """Number of index pairs i < j with values[i] + values[j] == target."""
    count = 0
    for i in range(len(values)):
        for j in range(i + 1, len(values)):
            if values[i] + values[j] == target:
                count += 1
    return count
''', lambda r: (ints(r, 0, 8, 0, 6), r.randint(2, 8))),
]

GRADING = [
    FunctionSpec('''def letter_grade(score):
    """A for 90+, B for 80+, C for 70+, D for 60+, else F."""
    if score >= 90:
        return "A"
    if score >= 80:
        return "B"
    if score >= 70:
        return "C"
    if score >= 60:
        return "D"
    return "F"
''', lambda r: (r.choice([r.randint(0, 100), 10 * r.randint(6, 9)]),)),
    FunctionSpec('''def triangle_kind(a, b, c):
    """'invalid', 'equilateral', 'isosceles' or 'scalene'."""
    x, y, z = sorted((a, b, c))
    if x <= 0 or x + y <= z:
        return "invalid"
    if x == z:
        return "equilateral"
    if x == y or y == z:
        return "isosceles"
    return "scalene"
''', lambda r: tuple(r.choice([[r.randint(1, 6)] * 3, [r.randint(0, 7) for _ in range(3)]]))),
    FunctionSpec('''def fizzbuzz(n):
    """'FizzBuzz' for multiples of 15, 'Fizz' of 3, 'Buzz' of 5, else the number as text."""
    if n % 15 == 0:
        return "FizzBuzz"
    if n % 3 == 0:
        return "Fizz"
    if n % 5 == 0:
        return "Buzz"
    return str(n)
''', lambda r: (r.randint(1, 100),)),
    FunctionSpec('''def shipping_cost(weight_kg, express):
    """5 for up to 1 kg, plus 2 per started kg above; express doubles it."""
    cost = 5
    if weight_kg > 1:
        extra = weight_kg - 1
        cost += 2 * (int(extra) + (1 if extra % 1 > 0 else 0))
    if express:
        cost *= 2
    return cost
''', lambda r: (r.choice([r.randint(0, 8), round(r.uniform(0, 8), 1)]), r.random() < 0.5)),
    FunctionSpec('''def ticket_price(age, is_student):
    """Children under 12 pay 5, seniors from 65 pay 7, students 8, everyone else 12."""
    if age < 12:
        return 5
    if age >= 65:
        return 7
    if is_student and age < 30:
        return 8
    return 12
''', lambda r: (r.choice([r.randint(0, 90), r.choice([11, 12, 29, 30, 64, 65])]), r.random() < 0.5)),
]

THEMES: dict[str, tuple[list[FunctionSpec], tuple[str, ...]]] = {
    "text": (TEXT, ("textkit", "strutil", "wordplay", "scribe")),
    "numbers": (NUMBERS, ("numkit", "mathlib", "arith", "calcutil")),
    "lists": (LISTS, ("listkit", "seqtools", "seqkit", "arrays")),
    "grading": (GRADING, ("rules", "pricing", "policy", "grading")),
}
