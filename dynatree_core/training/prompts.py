"""Prompt set for on-policy draft-training data, written for this project.

Prompts are built from topics x templates so the set is large and diverse without being a
dataset download: chat instructions (the embedded target is an instruct model) and plain-text
openings (encyclopedic, narrative, code, lists). `sample_prompts` is deterministic per seed.
"""

from __future__ import annotations

import random

TOPICS = [
    "photosynthesis",
    "the French Revolution",
    "black holes",
    "the water cycle",
    "volcanoes",
    "the Roman Empire",
    "machine learning",
    "climate change",
    "the human heart",
    "honey bees",
    "the printing press",
    "electric cars",
    "the Moon landing",
    "coral reefs",
    "vaccines",
    "the stock market",
    "quantum computers",
    "the Great Wall of China",
    "rainforests",
    "the Internet",
    "dinosaurs",
    "the Olympic Games",
    "chess",
    "coffee",
    "bread baking",
    "the solar system",
    "earthquakes",
    "jazz music",
    "the immune system",
    "recycling",
    "renewable energy",
    "ancient Egypt",
    "the theory of evolution",
    "gravity",
    "tea",
    "the Renaissance",
    "antibiotics",
    "social media",
    "sleep",
    "the ocean tides",
    "bicycles",
    "democracy",
    "the periodic table",
    "smartphones",
    "the Amazon river",
    "migration of birds",
    "glaciers",
    "the Silk Road",
    "robots",
    "public libraries",
    "volunteering",
    "time management",
    "learning a new language",
    "healthy eating",
    "running a marathon",
    "gardening",
    "saving money",
    "writing a resume",
    "job interviews",
    "friendship",
    "city parks",
    "trains",
    "the history of mathematics",
    "prime numbers",
    "sorting algorithms",
    "databases",
    "Python programming",
    "the Linux operating system",
    "encryption",
    "weather",
    "mountains",
    "deserts",
    "penguins",
    "elephants",
    "the color of the sky",
    "rainbows",
    "music theory",
    "painting",
    "photography",
    "movies",
    "board games",
    "space exploration",
]

CHAT_TEMPLATES = [
    "Explain {t} to a ten-year-old.",
    "Write a short paragraph about {t}.",
    "What are three interesting facts about {t}?",
    "Give me a brief history of {t}.",
    "Why is {t} important?",
    "Write a short poem about {t}.",
    "List five key points about {t}.",
    "Summarize what you know about {t} in a few sentences.",
    "What are the pros and cons of {t}?",
    "Write a short story that involves {t}.",
    "How would you teach a class about {t}?",
    "Describe {t} in simple terms.",
    "What questions do people often ask about {t}? Answer two of them.",
    "Write a friendly email to a colleague about {t}.",
    "Compare {t} and {u}.",
]

CODE_CHAT = [
    "Write a Python function that reverses a string.",
    "Write a Python function to check whether a number is prime.",
    "Explain what a for loop does in Python, with an example.",
    "Write a Python function that returns the factorial of n.",
    "How do I read a text file line by line in Python?",
    "Write a function that computes the Fibonacci numbers up to n.",
    "What is the difference between a list and a tuple in Python?",
    "Write a SQL query that counts the rows of a table named users.",
    "Write a Python class representing a bank account with deposit and withdraw methods.",
    "Explain recursion with a short code example.",
    "Write a bash command that counts the lines in all .txt files in a folder.",
    "Write a Python function that sorts a list of dictionaries by a key.",
]

PLAIN_OPENINGS = [
    "{T} is",
    "The history of {t} begins",
    "In this article, we discuss {t}.",
    "Once upon a time, in a small village, a child became fascinated by {t}.",
    "Here are some facts about {t}:\n1.",
    "Chapter 1\n\nThe morning I first learned about {t},",
    "Q: What is {t}?\nA:",
    "# Notes on {t}\n\n",
    "Many people do not know that {t}",
]

PLAIN_CODE = [
    "def fibonacci(n):\n",
    "import numpy as np\n\n\ndef normalize(x):\n",
    'class Stack:\n    """A simple stack."""\n\n    def __init__(self):\n',
    "# Utility functions for working with files\nimport os\n\n",
    "def binary_search(items, target):\n",
    "SELECT name, COUNT(*)\nFROM",
]


def sample_prompts(n: int, seed: int) -> list[tuple[str, bool]]:
    """Return n (text, is_chat) prompts; about 60% chat, 10% code chat, 30% plain text."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        t, u = rng.sample(TOPICS, 2)
        r = rng.random()
        if r < 0.6:
            out.append((rng.choice(CHAT_TEMPLATES).format(t=t, u=u), True))
        elif r < 0.7:
            out.append((rng.choice(CODE_CHAT), True))
        elif r < 0.93:
            text = rng.choice(PLAIN_OPENINGS).format(t=t, T=t[0].upper() + t[1:])
            out.append((text, False))
        else:
            out.append((rng.choice(PLAIN_CODE), False))
    return out
