"""Synthetic chat tasks for the tiny target: every answer is a deterministic function of the
prompt, and most answers are predictable several tokens ahead (counting, repetition, ordered
lists, templated prose), so a DFlash drafter has multi-token structure to learn.

Everything is drawn from one `random.Random`, so a seed fixes the corpus.
"""

from __future__ import annotations

import random
from typing import Callable

WORDS = [
    "apple", "river", "stone", "cloud", "tiger", "lemon", "green", "house", "music", "paper",
    "light", "water", "bread", "horse", "table", "glass", "sugar", "plant", "train", "chair",
]
ANIMALS = {
    "cat": ("small", "sleep in the sun", "milk"),
    "dog": ("loyal", "run in the park", "meat"),
    "bird": ("light", "sing at dawn", "seeds"),
    "fish": ("quiet", "swim in the lake", "worms"),
    "horse": ("strong", "run in the field", "hay"),
    "mouse": ("tiny", "hide in the wall", "cheese"),
    "bear": ("big", "sleep in winter", "honey"),
    "frog": ("green", "jump in the pond", "flies"),
}
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a careful assistant. Answer briefly.",
    "You answer in plain text.",
]
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def count_range(rng: random.Random) -> tuple[str, str]:
    start = rng.randint(0, 80)
    stop = start + rng.randint(3, 12)
    return f"Count from {start} to {stop}.", ", ".join(str(i) for i in range(start, stop + 1)) + "."


def count_down(rng: random.Random) -> tuple[str, str]:
    start = rng.randint(10, 90)
    stop = start - rng.randint(3, 9)
    return f"Count down from {start} to {stop}.", ", ".join(str(i) for i in range(start, stop - 1, -1)) + "."


def repeat_word(rng: random.Random) -> tuple[str, str]:
    word, times = rng.choice(WORDS), rng.randint(2, 8)
    return f"Repeat the word {word} {times} times.", " ".join([word] * times)


def add_numbers(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(1, 49), rng.randint(1, 49)
    return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."


def sort_numbers(rng: random.Random) -> tuple[str, str]:
    nums = rng.sample(range(10), rng.randint(3, 6))
    shown = " ".join(map(str, nums))
    return f"Sort these numbers: {shown}.", "Sorted: " + " ".join(map(str, sorted(nums))) + "."


def letter_range(rng: random.Random) -> tuple[str, str]:
    i = rng.randint(0, 18)
    j = i + rng.randint(3, 7)
    return f"List the letters from {LETTERS[i]} to {LETTERS[j]}.", " ".join(LETTERS[i:j + 1])


def spell_word(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Spell the word {word}.", f"{word} is spelled " + "-".join(word) + "."


def describe_animal(rng: random.Random) -> tuple[str, str]:
    name = rng.choice(sorted(ANIMALS))
    size, habit, food = ANIMALS[name]
    answer = (f"The {name} is a {size} animal. The {name} likes to {habit}. "
              f"The {name} eats {food}.")
    return f"Tell me about the {name}.", answer


TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "count_range": count_range,
    "count_down": count_down,
    "repeat_word": repeat_word,
    "add_numbers": add_numbers,
    "sort_numbers": sort_numbers,
    "letter_range": letter_range,
    "spell_word": spell_word,
    "describe_animal": describe_animal,
}


def conversation(rng: random.Random) -> list[dict]:
    """One conversation with ground-truth answers: optional system prompt, 1-3 user turns."""
    messages: list[dict] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    num_turns = rng.choices([1, 2, 3], weights=[0.6, 0.3, 0.1])[0]
    names = sorted(TASKS)
    for _ in range(num_turns):
        prompt, answer = TASKS[rng.choice(names)](rng)
        messages.append({"role": "user", "content": prompt})
        messages.append({"role": "assistant", "content": answer})
    return messages


def conversations(seed: int, num: int) -> list[list[dict]]:
    rng = random.Random(seed)
    return [conversation(rng) for _ in range(num)]
