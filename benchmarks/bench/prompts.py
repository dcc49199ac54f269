"""Questions for the benchmark: Spec-Bench's question files, or a small default set shipped here.

A question has one or more user *turns*. Multi-turn questions are run as Spec-Bench runs MT-bench:
the second turn's prompt is the chat so far, i.e. the first user turn, the method's own answer to
it, then the second user turn.

Task groups are the six of the polybasic paper (Spec-Bench's six) plus code. Spec-Bench's eight
MT-bench categories (writing, roleplay, reasoning, math, coding, extraction, stem, humanities) all
map to "multi-turn conversation"; other categories map as in `CATEGORY_GROUPS`, and a category
that is not listed becomes a group of its own name.

The default set (`default_questions`, kept in the package as `hf_polybasic.cli.prompts` because
the ``plan`` command profiles on it, like `Question`) was written for this package: three short
prompts per group, original text, not taken from any data set. It is for smoke runs and the quick mode; point
``--question-file`` at Spec-Bench's ``question.jsonl`` for the real benchmark.

The held-out set (`heldout_questions`, ``--question-set heldout``) was written when the cost-aware
schedule was redesigned and never used to tune it: five code and five prose prompts, original text.
Speed claims against transformers' assisted generation are measured on it. The second held-out
set (`unseen_questions`, ``--question-set unseen``: five code, five math word problems and five
prose prompts) was written before the changes of issue 26 and never used to tune them; that issue's
claims are measured on it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from hf_polybasic.cli.prompts import Question, default_questions

TASK_GROUPS = (
    "multi-turn conversation",
    "translation",
    "summarization",
    "qa",
    "math reasoning",
    "rag",
    "code",
)

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")

CATEGORY_GROUPS = {
    **{category: "multi-turn conversation" for category in MT_BENCH_CATEGORIES},
    "mt_bench": "multi-turn conversation",
    "conversation": "multi-turn conversation",
    "translation": "translation",
    "summarization": "summarization",
    "qa": "qa",
    "math_reasoning": "math reasoning",
    "rag": "rag",
    "code": "code",
}


def group_of(category: str) -> str:
    """The task group of a Spec-Bench (or default-set) category."""
    key = category.strip().lower()
    return CATEGORY_GROUPS.get(key, key.replace("_", " "))


def normalise_group(name: str) -> str:
    """Accept "math-reasoning", "math_reasoning" or "math reasoning" for a group."""
    return name.strip().lower().replace("-", " ").replace("_", " ")


def load_question_file(path: str | Path) -> list[Question]:
    """Questions from a Spec-Bench-format JSONL file (``question_id``, ``category``, ``turns``)."""
    questions = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                turns = row["turns"]
                category = row["category"]
                question_id = row["question_id"]
            except (ValueError, KeyError) as error:
                raise ValueError(
                    f"{path}:{number}: not a Spec-Bench question line (needs question_id, category, turns): {error}"
                ) from None
            if isinstance(turns, str):
                turns = [turns]
            if not turns or not all(isinstance(turn, str) for turn in turns):
                raise ValueError(f"{path}:{number}: `turns` must be a non-empty list of strings")
            questions.append(Question(str(question_id), str(category), group_of(str(category)), tuple(turns)))
    if not questions:
        raise ValueError(f"{path} holds no questions")
    return questions


def file_digest(path: str | Path) -> str:
    """sha256 of a question file (recorded with the results)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def by_category(questions: Sequence[Question], categories: Iterable[str]) -> list[Question]:
    """The questions of ``categories`` (as the file names them), each category a group of its own: Spec-Bench
    files every MT-bench category (coding, writing, ...) under one group, where a benchmark may want code
    and prose apart."""
    wanted = [category.strip() for category in categories]
    present = {q.category for q in questions}
    unknown = [category for category in wanted if category not in present]
    if unknown:
        raise ValueError(f"no questions of category {unknown}; the file has {sorted(present)}")
    return [Question(q.question_id, q.category, q.category, q.turns) for q in questions if q.category in wanted]


def select(
    questions: Sequence[Question], groups: Iterable[str] | None = None, per_group: int | None = None, skip: int = 0
) -> list[Question]:
    """The first ``per_group`` questions of each wanted group after its first ``skip``, in file order,
    groups in `TASK_GROUPS` order (other groups after them, alphabetically)."""
    present = {q.group for q in questions}
    wanted = None
    if groups is not None:
        by_key = {normalise_group(g): g for g in present}
        unknown = [g for g in groups if normalise_group(g) not in by_key]
        if unknown:
            raise ValueError(f"no questions in group(s) {unknown}; the questions have groups {sorted(present)}")
        wanted = {by_key[normalise_group(g)] for g in groups}
    order = [g for g in TASK_GROUPS if g in present] + sorted(present - set(TASK_GROUPS))
    chosen = []
    for group in order:
        if wanted is not None and group not in wanted:
            continue
        members = [q for q in questions if q.group == group][skip:]
        chosen.extend(members if per_group is None else members[:per_group])
    return chosen


_HELDOUT_CODE = [
    "Write a Python class `LRUCache` with `get(key)` and `put(key, value)` methods backed by an "
    "`OrderedDict`, with the capacity given to the constructor.",
    "Write a function `is_valid_ipv4(address: str) -> bool` in Python that checks whether a string is a "
    "dotted-quad IPv4 address, without using the ipaddress module, and show three example calls.",
    "Convert this JavaScript function to idiomatic Python with type hints:\n\n"
    "```javascript\n"
    "function groupBy(items, keyFn) {\n"
    "  const groups = {};\n"
    "  for (const item of items) {\n"
    "    const key = keyFn(item);\n"
    "    if (!groups[key]) { groups[key] = []; }\n"
    "    groups[key].push(item);\n"
    "  }\n"
    "  return groups;\n"
    "}\n"
    "```",
    "Write a SQL query that returns, for each customer, the total amount of their orders in 2023 and the "
    "date of their latest order, from the tables customers(id, name) and orders(id, customer_id, amount, "
    "created_at). Then explain the query in two sentences.",
    "Write pytest unit tests for a function `slugify(text)` that lowercases the text, replaces runs of "
    "characters that are not letters or digits with a single hyphen, and strips hyphens from both ends.",
]

_HELDOUT_PROSE = [
    "Write a short, friendly email to a neighbour asking whether they could water your tomato plants while "
    "you are away for a week in August.",
    "What are the main differences between a virus and a bacterium? Answer in a few sentences for a "
    "secondary-school student.",
    "Describe a quiet morning at a seaside harbour in one paragraph, as the opening of a short story.",
    "Give five practical tips for someone who wants to start running regularly but finds it hard to stay "
    "motivated.",
    "Explain in simple terms how a bicycle stays upright while it is moving.",
]

# The second held-out set (`unseen_questions`, ``--question-set unseen``), written on 2026-11-24
# before the schedule, the default chain and the drafter's output layer were changed for issue 26,
# and never used to tune them (tuning used the default and the first held-out set): five prompts in
# each of three groups, original text.
_UNSEEN_CODE = [
    "Write a Python function `merge_intervals(intervals)` that takes a list of (start, end) pairs and "
    "returns the list of merged, non-overlapping intervals sorted by start. Include a docstring.",
    "Write a small command-line tool in Python with argparse that counts the lines, words and characters "
    "of the files given on the command line, like the Unix `wc` command.",
    "Here is a Python function with a bug:\n\n"
    "```python\n"
    "def average(values):\n"
    "    total = 0\n"
    "    for v in values:\n"
    "        total += v\n"
    "    return total / len(values) if values else 0\n"
    "\n"
    "def moving_average(values, window):\n"
    "    return [average(values[i:i + window]) for i in range(len(values))]\n"
    "```\n\n"
    "Explain what is wrong with `moving_average` and write a corrected version.",
    "Write a TypeScript function `debounce(fn, delayMs)` that returns a debounced version of `fn`, with "
    "correct generic types, and a short usage example.",
    "Write a Python dataclass `Money` with an amount in cents and a currency code, supporting addition of "
    "two amounts in the same currency and raising a ValueError otherwise, plus a `__str__` that prints "
    "amounts like `12.50 EUR`.",
]

_UNSEEN_MATH = [
    "A bakery sells muffins for $3 each and cookies for $1.25 each. On Saturday it sold 48 muffins and "
    "twice as many cookies. How much money did it take in from muffins and cookies? Show your work.",
    "A train leaves a station at 9:40 and travels 168 km at an average speed of 72 km/h. At what time "
    "does it arrive? Explain each step.",
    "Maria has 3 times as many stamps as Tom. If Maria gives Tom 18 stamps, they will have the same "
    "number. How many stamps did each of them have at first? Solve it step by step.",
    "A rectangular garden is 14 m long and 9 m wide. A path 1 m wide runs all the way around the outside "
    "of the garden. What is the area of the path? Show the calculation.",
    "A shop reduces the price of a jacket by 20%, and a week later reduces the new price by another 15%. "
    "The jacket now costs $61.20. What was the original price? Work it out step by step.",
]

_UNSEEN_PROSE = [
    "Write a short thank-you note to a colleague who covered your shifts while you were ill.",
    "Explain to a ten-year-old why the sky is blue, in one short paragraph.",
    "Describe the smell and sounds of a busy market on a winter evening, in four or five sentences.",
    "What are three good habits for keeping a tidy desk at work? Give a sentence of advice for each.",
    "Write a brief product description for a reusable water bottle that keeps drinks cold for a day.",
]

# The third held-out set (`fresh_questions`, ``--question-set fresh``), written on 2026-11-25 before
# any benchmark of that day's changes (the schedule's look-ahead, the chain's shape gate, static
# runners) ran, and never used to tune them: five prompts in each of three groups, original text.
_FRESH_CODE = [
    "Write a Python function `chunked(iterable, size)` that yields lists of at most `size` items from any "
    "iterable, without reading it all into memory. Add type hints and two doctest examples.",
    "Write a Python class `LRUCache` with `get(key)` and `put(key, value)` methods and a fixed capacity, "
    "evicting the least recently used entry when full. Use collections.OrderedDict.",
    "Write a SQL query that returns, for each customer, the number of orders and the total amount spent in "
    "2025, from tables `customers(id, name)` and `orders(id, customer_id, amount, created_at)`, including "
    "customers without orders.",
    "Write a Python function `parse_duration(text)` that turns strings like '1h30m', '45s' or '2h5m10s' into "
    "a number of seconds, raising ValueError on anything else.",
    "Write a bash script that finds every `.log` file older than 14 days under a directory given as its "
    "first argument, compresses it with gzip, and prints how many files it compressed.",
]

_FRESH_MATH = [
    "A cyclist rides 45 km at 18 km/h and then 30 km at 24 km/h. What is her average speed for the whole "
    "trip? Show each step.",
    "A tank holds 1200 litres. One pipe fills it in 6 hours and a drain empties it in 10 hours. If the tank "
    "starts empty with both open, how long until it is full? Explain your reasoning.",
    "The sum of three consecutive even numbers is 138. What are the numbers? Solve it step by step.",
    "A recipe for 4 people needs 350 g of flour and 3 eggs. How much flour and how many eggs are needed for "
    "10 people, if eggs are rounded up to whole eggs? Show the calculation.",
    "A phone plan costs $18 a month plus $0.05 per text message. Another costs $25 a month with unlimited "
    "texts. How many texts a month make the second plan cheaper? Work it out step by step.",
]

_FRESH_PROSE = [
    "Write a short message inviting your team to a Friday lunch to celebrate the end of a project.",
    "Explain in a few sentences why leaves change colour in autumn.",
    "Describe an old library on a rainy afternoon in one paragraph.",
    "Give four tips for writing a clear email subject line, one sentence each.",
    "Write a two-sentence summary of why regular sleep matters for memory.",
]

QUESTION_SETS = ("default", "heldout", "unseen", "fresh")


def heldout_questions() -> list[Question]:
    """The held-out set: five code and five prose prompts never used to tune the package."""
    return [Question(f"heldout-code-{i}", "code", "code", (text,)) for i, text in enumerate(_HELDOUT_CODE, 1)] + [
        Question(f"heldout-prose-{i}", "prose", "prose", (text,)) for i, text in enumerate(_HELDOUT_PROSE, 1)
    ]


def unseen_questions() -> list[Question]:
    """The second held-out set: five code, five math word problems and five prose prompts, written
    before the changes of issue 26 and never used to tune them."""
    groups = (("code", _UNSEEN_CODE), ("math reasoning", _UNSEEN_MATH), ("prose", _UNSEEN_PROSE))
    return [
        Question(f"unseen-{group.split()[0]}-{i}", group, group, (text,))
        for group, texts in groups
        for i, text in enumerate(texts, 1)
    ]


def fresh_questions() -> list[Question]:
    """The third held-out set: five code, five math word problems and five prose prompts, written
    before any benchmark of issues 29-30's changes and never used to tune them."""
    groups = (("code", _FRESH_CODE), ("math reasoning", _FRESH_MATH), ("prose", _FRESH_PROSE))
    return [
        Question(f"fresh-{group.split()[0]}-{i}", group, group, (text,))
        for group, texts in groups
        for i, text in enumerate(texts, 1)
    ]


def questions_of(name: str) -> list[Question]:
    """A shipped set by name (`QUESTION_SETS`)."""
    if name == "default":
        return default_questions()
    if name == "heldout":
        return heldout_questions()
    if name == "unseen":
        return unseen_questions()
    if name == "fresh":
        return fresh_questions()
    raise ValueError(f"unknown question set {name!r}; choose one of {QUESTION_SETS}")


def set_digest(name: str) -> str:
    """A hash of a shipped set, recorded instead of a file digest."""
    payload = [(q.question_id, q.turns) for q in questions_of(name)]
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def default_set_digest() -> str:
    """A hash of the default set, recorded instead of a file digest."""
    return set_digest("default")
