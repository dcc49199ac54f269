"""Questions for the benchmark: Spec-Bench's question files, or a small default set shipped here.

A question has one or more user *turns*. Multi-turn questions are run as Spec-Bench runs MT-bench:
the second turn's prompt is the chat so far, i.e. the first user turn, the method's own answer to
it, then the second user turn.

Task groups are the six of the polybasic paper (Spec-Bench's six) plus code. Spec-Bench's eight
MT-bench categories (writing, roleplay, reasoning, math, coding, extraction, stem, humanities) all
map to "multi-turn conversation"; other categories map as in `CATEGORY_GROUPS`, and a category
that is not listed becomes a group of its own name.

The default set (`default_questions`) was written for this package: three short prompts per
group, original text, not taken from any data set. It is for smoke runs and the quick mode; point
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
from dataclasses import dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class Question:
    """One benchmark question.

    Attributes:
        question_id: the id from the file (kept as a string).
        category: the file's category ("writing", "translation", ...).
        group: the task group it is reported under (see `TASK_GROUPS`).
        turns: the user turns, in order.
    """

    question_id: str
    category: str
    group: str
    turns: tuple[str, ...]

    @property
    def digest(self) -> str:
        """A short hash of the turns: cached results are only reused for the same text."""
        return hashlib.sha256(json.dumps(list(self.turns)).encode()).hexdigest()[:16]


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


def select(
    questions: Sequence[Question], groups: Iterable[str] | None = None, per_group: int | None = None
) -> list[Question]:
    """The first ``per_group`` questions of each wanted group, in file order, groups in
    `TASK_GROUPS` order (other groups after them, alphabetically)."""
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
        members = [q for q in questions if q.group == group]
        chosen.extend(members if per_group is None else members[:per_group])
    return chosen


# --------------------------------------------------------------------------------- default set
_CONVERSATION = [
    (
        "Plan a relaxed three-day visit to a mid-sized European city for someone who loves museums, long walks "
        "and trying local bakeries. Give one short paragraph per day.",
        "Now shorten the whole plan to exactly five bullet points and add a rough budget for each day.",
    ),
    (
        "I keep forgetting to water my houseplants. Suggest a simple weekly routine that would help, in under "
        "120 words.",
        "Turn that routine into a short rhyming poem that a child could remember.",
    ),
    (
        "Explain to a new team member what a code review is for, and how to give feedback that is kind but "
        "still useful.",
        "Write three example review comments in that style: one about naming, one about a missing test and one "
        "about performance.",
    ),
]

_TRANSLATION = [
    "Translate German to English: Der kleine Bahnhof am Rande des Dorfes wurde nach zwanzig Jahren wieder "
    "eröffnet, und am ersten Morgen warteten mehr Menschen auf dem Bahnsteig, als der Zug Sitzplätze hatte.",
    "Translate German to English: Die Forscherinnen beobachteten, dass Bienen in den Stadtgärten früher im Jahr "
    "aktiv werden als auf dem Land, vermutlich wegen der höheren Temperaturen zwischen den Gebäuden.",
    "Translate German to English: Wegen des starken Regens wurde das Konzert im Park kurzfristig in die Turnhalle "
    "der Schule verlegt, wo der Klang überraschend gut war.",
]

_SUMMARIZATION = [
    "Summarize: The town council of Elmsford voted on Tuesday to turn the disused freight yard beside the river "
    "into a public park. The site, which has been fenced off for almost fifteen years, covers about six hectares "
    "and still holds the foundations of two warehouses. Under the plan, the foundations will be kept as raised "
    "terraces, a cycle path will link the park to the old town, and a small pier will be rebuilt for rowing "
    "clubs. Work is expected to start next spring and to last two years. Some residents welcomed the decision, "
    "saying the neighbourhood has no green space larger than a playground. Others questioned the cost, which the "
    "council puts at 4.2 million, and asked whether part of the land should instead be used for housing. The "
    "mayor said that a regional grant will cover half of the budget and that a survey of residents had shown "
    "strong support for the park.",
    "Summarize: A long-running study of night-time light in coastal towns has found that switching street lamps "
    "to warmer, dimmer settings after midnight reduced the number of insects drawn to the lamps by about a third. "
    "The researchers compared twelve towns over four summers, changing the lamps in half of them and leaving the "
    "others as they were. Residents in the test towns reported no change in how safe they felt, and the towns "
    "saved roughly a fifth of their lighting electricity. The team cautions that insect numbers also depend on "
    "the weather and on nearby farmland, so the effect may differ elsewhere. They now plan to repeat the work "
    "inland, where moths make up a larger share of the insects around lamps.",
    "Summarize: After three years of repairs, the public library on Harbour Street reopened its doors this "
    "weekend. The building had been closed when water damage was found in its roof beams. Besides the new roof, "
    "the library now has a reading room for teenagers, a workshop with two 3D printers and sewing machines, and "
    "longer opening hours on weekdays. Its collection of local maps and photographs, which had been stored in "
    "another city during the work, has returned and is being scanned so that it can be searched online. The head "
    "librarian said that more than two thousand people visited on the first day, many of them children who had "
    "never seen the building open.",
]

_QA = [
    "Why does ice float on liquid water?",
    "What is the difference between weather and climate?",
    "How does a refrigerator keep its inside cold?",
]

_MATH = [
    "A bakery sells muffins for $3 each and cookies for $1.50 each. On Saturday it sold 48 muffins and twice as "
    "many cookies as muffins. How much money did it take in from muffins and cookies that day?",
    "A train leaves at 9:40 and travels 210 km at an average speed of 84 km per hour. At what time does it "
    "arrive?",
    "Mia has 5 more marbles than Leo. Together they have 37 marbles. Then Leo gives Mia 4 of his marbles. How "
    "many marbles does Mia have now?",
]

_RAG = [
    "Answer the question using the passages below.\n\n"
    "Passage 1: The Varden Bridge crosses the Ossel river at the town of Lamport. It was opened in 1911 and is "
    "built from local grey limestone. Its central arch spans 38 metres.\n"
    "Passage 2: Lamport is a market town of about 9,000 people. Its weekly market has been held on Thursdays "
    "since the town received its charter.\n"
    "Passage 3: A footbridge was added beside the Varden Bridge in 1978 after the road was widened, so that "
    "pedestrians no longer had to share the old deck with traffic.\n\n"
    "Question: What is the Varden Bridge made of, and when was it opened?",
    "Answer the question using the passages below.\n\n"
    "Passage 1: The Kestrel-3 weather balloon was launched from a school playing field on 4 May. It carried a "
    "camera, a thermometer and a small radio transmitter built by the students.\n"
    "Passage 2: The balloon reached a height of 31 kilometres before it burst. Its payload came down by "
    "parachute 64 kilometres east of the launch site.\n"
    "Passage 3: The lowest temperature the thermometer recorded was minus 52 degrees Celsius, about 11 "
    "kilometres up.\n\n"
    "Question: How high did the Kestrel-3 balloon go, and where did its payload land?",
    "Answer the question using the passages below.\n\n"
    "Passage 1: The Brightwater orchard grows eleven varieties of apple. The oldest trees were planted in 1932.\n"
    "Passage 2: Each autumn the orchard opens for picking on the last two weekends of September. Visitors pay by "
    "weight at the gate.\n"
    "Passage 3: Apples that are not sold fresh are pressed into juice on site; the press can handle about two "
    "tonnes a day.\n\n"
    "Question: When can visitors pick apples at Brightwater, and what happens to the apples that are not sold?",
]

_CODE = [
    "Write a Python function `merge_intervals(intervals)` that merges overlapping closed intervals given as a "
    "list of (start, end) tuples and returns the merged intervals sorted by start. Include a short docstring.",
    "Add type hints and a docstring to this Python function, and make it return an empty dict for an empty "
    "list. Show the complete function.\n\n"
    "```python\n"
    "def count_words(lines):\n"
    "    counts = {}\n"
    "    for line in lines:\n"
    "        for word in line.lower().split():\n"
    "            word = word.strip('.,;:!?')\n"
    "            if word:\n"
    "                counts[word] = counts.get(word, 0) + 1\n"
    "    return counts\n"
    "```",
    "Explain briefly what this function does, then rewrite it to be easier to read.\n\n"
    "```python\n"
    "def f(xs, n):\n"
    "    r = []\n"
    "    for i in range(0, len(xs), n):\n"
    "        r.append(xs[i:i + n])\n"
    "    return [c for c in r if len(c) == n] + ([r[-1]] if r and len(r[-1]) != n else [])\n"
    "```",
]


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


def default_questions() -> list[Question]:
    """The shipped prompt set: three questions in each of the seven task groups."""
    questions = []
    for i, turns in enumerate(_CONVERSATION, 1):
        questions.append(Question(f"conversation-{i}", "conversation", "multi-turn conversation", tuple(turns)))
    for category, group, texts in (
        ("translation", "translation", _TRANSLATION),
        ("summarization", "summarization", _SUMMARIZATION),
        ("qa", "qa", _QA),
        ("math_reasoning", "math reasoning", _MATH),
        ("rag", "rag", _RAG),
        ("code", "code", _CODE),
    ):
        for i, text in enumerate(texts, 1):
            questions.append(Question(f"{category}-{i}", category, group, (text,)))
    return questions


def default_set_digest() -> str:
    """A hash of the default set, recorded instead of a file digest."""
    return set_digest("default")
