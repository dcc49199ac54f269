"""The prompts the ``plan`` command profiles on, and how a prompt is encoded for a model set.

`default_questions` is the package's own small prompt set: three short prompts in each of seven
task groups (the polybasic paper's six, Spec-Bench's, plus code), original text written for this
package, not taken from any data set. The benchmark (``benchmarks/bench`` in a checkout of the
repository) runs it as its ``default`` set, beside its held-out sets and Spec-Bench's files.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from .model_sets import ModelSet


@dataclass(frozen=True)
class Question:
    """One benchmark question.

    Attributes:
        question_id: the id from the file (kept as a string).
        category: the file's category ("writing", "translation", ...).
        group: the task group it is reported under.
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


def messages_for(question: Question, turn: int, answers: list[str]) -> list[dict]:
    """The chat for ``turn``: earlier user turns each followed by this method's own answer."""
    messages = []
    for index in range(turn):
        messages.append({"role": "user", "content": question.turns[index]})
        messages.append({"role": "assistant", "content": answers[index]})
    messages.append({"role": "user", "content": question.turns[turn]})
    return messages


def encode(model_set: ModelSet, messages: list[dict], max_new_tokens: int) -> tuple[dict, int]:
    """Chat-templated inputs (``add_generation_prompt=True``), cut to the model's context if needed;
    also returns how many prompt tokens were cut."""
    encoded = model_set.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    input_ids = encoded["input_ids"]
    attention_mask = encoded.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    cut = 0
    if model_set.context_length is not None:
        room = model_set.context_length - max_new_tokens
        if room < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in this model's context")
        cut = max(0, input_ids.shape[1] - room)
        input_ids, attention_mask = input_ids[:, cut:], attention_mask[:, cut:]
    device = next(model_set.target.parameters()).device
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}, cut
