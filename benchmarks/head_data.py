"""Training data for the ``trained-head`` benchmark, all available offline: prompts written from templates
here (code tasks, arithmetic word problems, short prose requests: the groups the held-out question sets
measure, none of their text), which the target answers (self-distillation), and the Python sources of
standard-library modules installed with the interpreter.

The templates are original; numbers and choices are drawn from a seeded generator, so a seed gives the
same prompts everywhere. `training_prompts` refuses to return a prompt that is one of the benchmark's
question sets' (`benchmarks.bench.prompts.QUESTION_SETS`).
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

# standard-library modules whose sources are the benchmark's texts (pure Python in CPython 3.10-3.13)
SOURCE_MODULES = ("json", "argparse", "dataclasses", "pathlib", "functools", "textwrap", "csv", "enum",
                  "statistics", "fractions", "logging", "email", "http", "collections", "string", "shlex",
                  "configparser", "difflib", "heapq", "bisect", "calendar", "gettext", "html", "urllib")

_CODE_TASKS = [
    ("flatten", "flattens a nested list of any depth into a flat list"),
    ("word_counts", "returns a dictionary mapping each word of a text to how often it occurs, ignoring case"),
    ("is_palindrome", "checks whether a string reads the same backwards, ignoring spaces and punctuation"),
    ("rotate_matrix", "rotates a square matrix, given as a list of lists, by 90 degrees clockwise"),
    ("binary_search", "finds the index of a value in a sorted list, or returns -1"),
    ("merge_sorted", "merges two sorted lists into one sorted list without calling sort"),
    ("roman_to_int", "converts a Roman numeral such as 'MCMXCIV' to an integer"),
    ("group_anagrams", "groups a list of words into lists of anagrams"),
    ("running_mean", "yields the running mean of a stream of numbers"),
    ("parse_csv_line", "splits one CSV line into fields, honouring double-quoted fields with commas"),
    ("transpose", "transposes a list of equally long rows"),
    ("top_k", "returns the k largest items of a list using heapq"),
    ("dedupe", "removes duplicates from a list while keeping the first occurrence of each item in order"),
    ("chunk_text", "splits a text into pieces of at most n characters without breaking words"),
    ("validate_email", "checks with a regular expression whether a string looks like an email address"),
    ("fibonacci", "returns the n-th Fibonacci number iteratively"),
    ("prime_sieve", "returns all primes below n with the sieve of Eratosthenes"),
    ("camel_to_snake", "converts a camelCase identifier to snake_case"),
    ("histogram", "prints a text histogram of a list of integers with one row of stars per value"),
    ("retry", "is a decorator that retries a function up to n times when it raises an exception"),
    ("read_config", "reads a JSON configuration file and fills in defaults for missing keys"),
    ("matrix_multiply", "multiplies two matrices given as lists of lists"),
    ("balanced_brackets", "checks whether the brackets (), [] and {} in a string are balanced"),
    ("count_vowels", "counts the vowels in a string"),
    ("unique_paths", "counts the paths from the top-left to the bottom-right corner of an m by n grid"),
    ("caesar_cipher", "shifts every letter of a text by k places in the alphabet"),
    ("file_sizes", "walks a directory tree and returns the total size of the files under it"),
    ("timer", "is a context manager that prints how long its block took"),
    ("lcs_length", "returns the length of the longest common subsequence of two strings"),
    ("bank_account", "is a class with deposit, withdraw and balance methods that refuses overdrafts"),
]
_CODE_FORMS = [
    "Write a Python function `{name}` that {task}.",
    "Write a Python function `{name}` that {task}. Add type hints and a docstring.",
    "Implement `{name}` in Python: it {task}. Then show two example calls.",
    "Write a Python function `{name}` that {task}, and pytest tests for it.",
]
_MATH_FORMS = [
    "A farmer has {a} apple trees, and each tree gives {b} kg of apples. He sells the apples for ${c} per kg. "
    "How much does he earn? Explain your steps.",
    "A car uses {b} litres of fuel per 100 km. How much fuel does it need for a trip of {a0} km? Solve step by step.",
    "Tom reads {b} pages a day. His book has {a0} pages. After {c} days, how many pages are left? Show your work.",
    "A box holds {b} pencils. A school orders {a} boxes and gives each of its {c} classes the same number of "
    "pencils. How many pencils does each class get, and how many are left over? Explain.",
    "The price of a lamp is ${a0}. It is discounted by {p}%. What is the new price? Work it out step by step.",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter? Show the calculation.",
    "Anna saves ${b} every week. How many weeks does she need to save ${a0}? Explain your reasoning.",
    "A train travels {a0} km in {c} hours. What is its average speed, and how far does it go in {b} hours at that "
    "speed? Solve it step by step.",
]
_PROSE_FORMS = [
    "Write a short email to {who} about {topic}.",
    "Explain {topic} in a few sentences for {who}.",
    "Give three tips about {topic}, one sentence each.",
    "Write one paragraph describing {topic}.",
    "Summarize in two sentences why {topic} matters to {who}.",
]
_PROSE_TOPICS = ["planting a vegetable garden", "learning a new language", "saving energy at home", "a visit to a "
                 "museum", "preparing for a job interview", "how rain forms", "taking care of a dog", "cooking rice",
                 "the history of bicycles", "keeping a journal", "recycling paper", "a walk in the mountains",
                 "choosing a good book", "how a library works", "the phases of the moon", "a birthday party",
                 "starting to play the guitar", "drinking enough water", "a train journey", "organising a bookshelf"]
_PROSE_READERS = ["a friend", "a colleague", "a child", "a neighbour", "a new student", "your manager"]


def training_prompts(count: int, seed: int = 0) -> list[str]:
    """``count`` prompts, code, math and prose in turn (see the module docstring)."""
    from .bench.prompts import QUESTION_SETS, questions_of

    rng = random.Random(seed)
    groups = [_code_prompts(rng), _math_prompts(rng), _prose_prompts(rng)]
    prompts, seen = [], set()
    held_out = {turn for name in QUESTION_SETS for question in questions_of(name) for turn in question.turns}
    while len(prompts) < count:
        for group in groups:
            text = next(group)
            if text not in seen and len(prompts) < count:
                if text in held_out:
                    raise AssertionError(f"a training prompt is a benchmark question: {text!r}")
                seen.add(text)
                prompts.append(text)
    return prompts


def _code_prompts(rng: random.Random):
    while True:
        name, task = rng.choice(_CODE_TASKS)
        yield rng.choice(_CODE_FORMS).format(name=name, task=task)


def _math_prompts(rng: random.Random):
    while True:
        numbers = dict(a=rng.randint(3, 40), b=rng.randint(2, 12), c=rng.randint(2, 9), a0=rng.randint(6, 90) * 10,
                       p=rng.choice([5, 10, 15, 20, 25, 30, 40]))
        yield rng.choice(_MATH_FORMS).format(**numbers)


def _prose_prompts(rng: random.Random):
    while True:
        yield rng.choice(_PROSE_FORMS).format(topic=rng.choice(_PROSE_TOPICS), who=rng.choice(_PROSE_READERS))


def write_prompts(path: Path, count: int, seed: int = 0) -> Path:
    """`training_prompts` as a JSONL file of ``{"prompt": ...}`` lines (what ``train-head --prompts`` reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in training_prompts(count, seed)))
    return path


def source_paths(modules=SOURCE_MODULES) -> list[str]:
    """The source file (module) or folder (package) of each standard-library module in ``modules``."""
    paths = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            raise ValueError(f"the standard-library module {name!r} has no Python source here")
        origin = Path(spec.origin)
        paths.append(str(origin.parent if origin.name == "__init__.py" else origin))
    return paths
