"""The mixed workload of issue 31: chat prompts whose natural answers run from one word to a story, EOS-terminated.

Each prompt asks for a kind of answer (a word, a sentence, a list of n items, a paragraph, a story) about random
subjects, so neither its length in tokens nor its max_tokens (drawn apart from the kind, as clients set it) says how
long the answer will be; what it asks for does.
"""

from __future__ import annotations

import random

ANIMALS = ["fox", "owl", "whale", "tortoise", "cat", "dragon", "robot", "penguin", "wolf", "bee", "horse", "crow"]
TOPICS = [
    "photosynthesis",
    "gravity",
    "the water cycle",
    "compound interest",
    "volcanoes",
    "the internet",
    "vaccines",
    "electricity",
    "tides",
    "rainbows",
    "black holes",
    "recycling",
    "earthquakes",
    "magnets",
]
THINGS = [
    "fruits",
    "vegetables",
    "colors",
    "countries",
    "musical instruments",
    "sports",
    "tools",
    "flowers",
    "animals that live in the sea",
    "board games",
    "kitchen utensils",
    "rivers",
]
WORD_QUESTIONS = [
    "What is the opposite of hot?",
    "What color is a ripe banana?",
    "What is the capital of France?",
    "Which animal says moo?",
    "What is frozen water called?",
    "What is the largest planet?",
    "What do bees make?",
    "Which season comes after winter?",
    "What gas do plants breathe in?",
    "What is two plus two, as a word?",
    "What do you call a baby dog?",
    "Which star is closest to us?",
]
PLACES = ["a lighthouse", "a desert town", "a floating market", "an old library", "a mountain village", "the moon"]
MAX_TOKENS = [256, 384, 512]  # what clients ask for, whatever the prompt: it bounds, it does not predict

KINDS = ("word", "sentence", "list", "paragraph", "story")


def prompt(rng: random.Random, kind: str) -> str:
    if kind == "word":
        return f"Answer with a single word and nothing else. {rng.choice(WORD_QUESTIONS)}"
    if kind == "sentence":
        return f"In one short sentence, what is {rng.choice(TOPICS)}?"
    if kind == "list":
        return f"List {rng.randint(3, 9)} {rng.choice(THINGS)}, one per line, with no other text."
    if kind == "paragraph":
        return f"Explain {rng.choice(TOPICS)} to a child in one paragraph."
    return f"Write a long, detailed story about a {rng.choice(ANIMALS)} who lives in {rng.choice(PLACES)}."


def request(rng: random.Random) -> tuple[str, str, int]:
    """One (kind, prompt, max_tokens), of a kind drawn at random."""
    kind = rng.choice(KINDS)
    return kind, prompt(rng, kind), rng.choice(MAX_TOKENS)


def requests(rng: random.Random, n: int) -> list[tuple[str, str, int]]:
    """n (kind, prompt, max_tokens), the kinds in equal shares, shuffled."""
    out = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        out.append((kind, prompt(rng, kind), rng.choice(MAX_TOKENS)))
    rng.shuffle(out)
    return out


def kendall_tau(x: list[float], y: list[float]) -> float:
    """Kendall's tau-b (ties in either list counted as neither concordant nor discordant)."""
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            dx, dy = x[i] - x[j], y[i] - y[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    n = concordant + discordant
    denominator = ((n + ties_x) * (n + ties_y)) ** 0.5
    return (concordant - discordant) / denominator if denominator else 0.0
