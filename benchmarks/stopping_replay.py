"""``stopping-replay``: how far a rule that stops drafting by the drafter's confidence can go on given
prompts, with the costs measured on this machine: transformers' rule (draft while the last token's
confidence is at least 0.4, up to 20), ours (the default `CostAwareSchedule`, its calibration carried
from prompt to prompt as in decoding), the best fixed threshold and cap in hindsight, and the hindsight
oracle (each round drafts exactly the tokens the target will accept).

For each prompt the target decodes greedily (plain ``generate``); at every position of its output the
drafter drafts ``depth`` tokens greedily from the target's own prefix, recording its confidence in each
(its largest probability) and how many match the target's continuation (``matches``): a `Stream`.
Along that path a rule is replayed without running the models again (`replay`): a round at position p
that drafts k tokens accepts min(m_p, k), emits those and the target's next token, and costs k drafting
steps plus one verification of k + 1 tokens (`Costs`: the target's measured T(k + 1), the drafter's
measured T(1) a step). Greedy only: along the target's path a draft's fate is known without the target.
What it leaves out: per-round overheads (the same for every rule) and the drafter's catch-up forwards.

What drafting more than one continuation would add (`Siblings`): at each position the stream also keeps the
rank of the target's token among the drafter's choices from the target's prefix (``ranks``). A round whose
drafts carry the drafter's next choices as leaves (a tree the target verifies in the same forward, each leaf
seeing the drafts before it) emits one token more where its first rejected draft's position holds the
target's token among those leaves: the leaf, then the target's token after it. Such a round verifies the
leaves too, and the leaf is fed again next round; the drafter's steps do not change (its choices come
from the forwards that drew the drafts).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy
import torch

from hf_polybasic.compat import cache_argument, new_dynamic_cache, remove_last_tokens
from hf_polybasic.config import MAX_DRAFT_TOKENS
from hf_polybasic.costs import CostCurve, CostEstimate, measure_curve
from hf_polybasic.schedule.factory import RowSchedules

# transformers' defaults for an assistant model: up to 20 tokens, stop after a token below 0.4
TRANSFORMERS_RULE = (0.4, 20)
THRESHOLDS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
CAPS = (4, 8, 12, 16, 20, 24)
RANKS_KEPT = 4  # a stream's ranks tell the drafter's first four choices apart; lower ranks read 0


@dataclass
class Stream:
    """The drafter's view of one greedy continuation of the target: at position p, ``matches[p]``
    (how many of its ``depth`` greedy drafts from the target's prefix equal the target's next tokens)
    and ``confidences[p]`` (its largest probability at each of those drafts)."""

    matches: list[int]
    confidences: list[list[float]]
    ranks: list[int] | None = None  # [p]: the target's token p among the drafter's choices from its prefix (1: first)

    @property
    def tokens(self) -> int:
        return len(self.matches)


@dataclass
class Costs:
    """T(k) of the target (``verify``) and one drafting step (``step``), in seconds."""

    verify: CostCurve
    step: float

    def round_seconds(self, drafted: int, forwards: int, leaves: int = 0) -> float:
        """A round of ``forwards`` drafting steps whose ``drafted`` tokens (and ``leaves`` more) the target verifies."""
        return forwards * self.step + self.verify.seconds(drafted + leaves + 1)


@dataclass(frozen=True)
class Siblings:
    """A round's drafts verified with the drafter's next ``per_draft`` choices at each draft as leaves (only
    at its last draft: ``last_only``): `leaves` the target verifies beside the drafts, and whether the round
    emits a token more (`hits`)."""

    per_draft: int
    last_only: bool = False

    def leaves(self, drafted: int) -> int:
        return min(drafted, 1) * self.per_draft if self.last_only else drafted * self.per_draft

    def hits(self, rank: int, accepted: int, drafted: int) -> bool:
        """Whether the target's token where the round's first rejected draft stood (the ``rank``th of the
        drafter's choices there) is among the leaves at that draft."""
        if accepted >= drafted or (self.last_only and accepted != drafted - 1):
            return False
        return 2 <= rank <= 1 + self.per_draft


def rank_of(logits: torch.Tensor, token: int) -> int:
    """Where ``token`` stands among the choices of ``logits`` ``[V]`` (1: the largest; ties rank alike), or 0
    past `RANKS_KEPT`."""
    rank = 1 + int((logits > logits[token]).sum())
    return rank if rank <= RANKS_KEPT else 0


@torch.no_grad()
def drafter_stream(target, drafter, input_ids: torch.LongTensor, new_tokens: int, depth: int,
                   **generate_options) -> tuple[Stream, torch.LongTensor]:
    """`Stream` of ``drafter`` along ``target``'s greedy continuation of ``input_ids`` (``[1, L]``, plain
    ``generate`` with ``generate_options``), and that continuation ``[n]``."""
    prompt = input_ids.shape[1]
    output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                             **{**generate_options, "do_sample": False})[0, prompt:]
    cache = new_dynamic_cache(drafter)
    feed = {cache_argument(drafter): cache, "use_cache": True}
    logits = drafter(input_ids, **feed).logits[0, -1]
    matches, confidences, ranks = [], [], []
    for position in range(output.shape[0]):
        ranks.append(rank_of(logits, int(output[position])))
        drafted, sure = [], []
        next_logits = logits
        for index in range(depth):
            confidence, token = next_logits.float().softmax(-1).max(-1)
            drafted.append(int(token))
            sure.append(round(float(confidence), 4))
            if index + 1 < depth:
                next_logits = drafter(token.view(1, 1), **feed).logits[0, -1]
        # forget the drafts: the cache holds the prompt and the output so far
        remove_last_tokens(cache, depth - 1)
        ahead = output[position : position + depth].tolist()
        matched = 0
        while matched < len(ahead) and drafted[matched] == ahead[matched]:
            matched += 1
        matches.append(matched)
        confidences.append(sure)
        logits = drafter(output[position].view(1, 1), **feed).logits[0, -1]
    return Stream(matches, confidences, ranks), output


class Rule:
    """Where a round's drafts stop: ``rule(stream, position, budget)`` is the number of tokens to draft;
    ``extra_forwards``: drafting steps its last round ran beyond those (a round that ran the drafter and
    then drafted nothing); `observe`, `start` and `finish` let a rule learn, as a schedule does."""

    extra_forwards = 0

    def __call__(self, stream: Stream, position: int, budget: int) -> int:
        raise NotImplementedError

    def observe(self, drafted: int, accepted: int, costs: Costs) -> None:
        pass

    def start(self) -> None:
        pass

    def finish(self) -> None:
        pass


class Threshold(Rule):
    """Draft while the last drafted token's confidence is at least ``threshold``, at most ``cap``
    tokens (the token below the threshold is kept: transformers' ``assistant_confidence_threshold``)."""

    def __init__(self, threshold: float, cap: int):
        self.threshold, self.cap = threshold, cap

    def __call__(self, stream: Stream, position: int, budget: int) -> int:
        confidences = stream.confidences[position]
        limit = min(self.cap, budget, len(confidences))
        for index, confidence in enumerate(confidences[:limit]):
            if confidence < self.threshold:
                return index + 1
        return limit


class Schedule(Rule):
    """The package's default schedule of a model drafter right under the target, priced by ``costs``
    (or seeing ``seen``, another estimate of the target's costs, while its rounds are priced by ``costs``);
    its calibration carries from one prompt to the next (`start`, `finish`) as between calls."""

    def __init__(self, costs: Costs, initial: int = 4, maximum: int = MAX_DRAFT_TOKENS,
                 seen: CostEstimate | None = None):
        self.costs, self.initial, self.maximum, self.seen = costs, initial, maximum, seen
        self._pair = (_Key(), _Key())  # this replay's own calibration memory
        self.schedule = self._made = None

    def start(self) -> None:
        self._made = RowSchedules("cost_aware", [0])
        seen = self.seen if self.seen is not None else CostEstimate(self.costs.verify)
        self.schedule = self._made.for_level(self.initial, self.maximum, seen, True,
                                             step_seconds=self.costs.step, pair=self._pair)[0]

    def finish(self) -> None:
        self._made.keep_learned()

    def __call__(self, stream: Stream, position: int, budget: int) -> int:
        schedule, confidences = self.schedule, stream.confidences[position]
        limit = min(schedule.length(), budget, len(confidences))
        if limit == 0:
            return 0
        if not schedule.first_draft_pays(confidences[0]):
            self.extra_forwards = 1  # the drafter ran to see its first distribution, then drafted nothing
            return 0
        drafted = 0
        for confidence in confidences[:limit]:
            drafted += 1
            if not schedule.keep_drafting(confidence):
                break
        return drafted

    def observe(self, drafted: int, accepted: int, costs: Costs) -> None:
        if drafted:
            self.schedule.observe_proposal(drafted, drafted * costs.step)
        self.schedule.observe_verification(drafted, accepted, costs.verify.seconds(drafted + 1))


class Oracle(Rule):
    """Draft exactly the tokens the target will accept (hindsight)."""

    def __call__(self, stream: Stream, position: int, budget: int) -> int:
        return min(stream.matches[position], budget)


# the leaves replayed beside the default schedule's drafts, where the streams carry ranks
SIBLING_SHAPES = {
    "the drafter's second choice at its last draft": Siblings(1, last_only=True),
    "its second choice at every draft": Siblings(1),
    "its second and third choices at every draft": Siblings(2),
}


class _Key:
    """A weakly referable stand-in for a model in the calibration memory."""


@dataclass
class Replayed:
    """What a rule did along some streams: tokens emitted, seconds, target forwards and drafted tokens."""

    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    drafted: int = 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def replay(streams: Iterable[Stream], rule: Rule, costs: Costs, siblings: Siblings | None = None) -> Replayed:
    """Replay ``rule`` along each stream in turn (`Stream`, `Costs`): a round at position p drafts
    ``rule(stream, p, budget)`` tokens, accepts min(matches[p], drafted) and emits one more;
    ``budget`` keeps the round within the stream. A round costs a drafting step per drafted token, and
    one more where the rule ran the drafter and then drafted nothing (`Rule.extra_forwards`). With
    ``siblings`` (streams with ranks) the target verifies their leaves too, and a round they hit emits one
    more token and verifies one more (the leaf, fed again)."""
    result = Replayed()
    for stream in streams:
        if siblings is not None and stream.ranks is None:
            raise ValueError("replaying siblings needs streams with ranks (made by this version of stopping-replay)")
        rule.start()
        position, seconds = 0, 0.0
        while position < stream.tokens:
            drafted = rule(stream, position, stream.tokens - position - 1)
            accepted = min(stream.matches[position], drafted)
            leaves, emitted = 0, accepted + 1
            if siblings is not None:
                leaves = siblings.leaves(drafted)
                # a rejected draft leaves the budget a token past it: the leaf's next token is in the stream
                if siblings.hits(stream.ranks[position + accepted], accepted, drafted):
                    leaves, emitted = leaves + 1, emitted + 1
            seconds += costs.round_seconds(drafted, drafted + rule.extra_forwards, leaves)
            rule.extra_forwards = 0
            rule.observe(drafted, accepted, costs)
            position += emitted
            result.rounds += 1
            result.drafted += drafted
        rule.finish()
        result.tokens += stream.tokens
        result.seconds += seconds
    return result


def ranked(streams: Iterable[Stream]) -> bool:
    """Whether every stream keeps its ranks (made since they are kept), so that leaves can be replayed."""
    return all(stream.ranks is not None for stream in streams)


def miss_ranks(streams: Iterable[Stream]) -> dict[int, int]:
    """How often, where the target's token was not the drafter's first choice, it was its 2nd, 3rd, ... choice
    (``0``: below the `RANKS_KEPT` kept), by rank. (A token tied with the first choice ranks 1 and is left out.)"""
    counted = {rank: 0 for rank in (*range(2, RANKS_KEPT + 1), 0)}
    for stream in streams:
        for rank in stream.ranks or ():
            if rank != 1:
                counted[rank] += 1
    return counted


def second_pass(streams: Sequence[Stream], rule: Rule, costs: Costs, siblings: Siblings | None = None) -> Replayed:
    """`replay` of ``rule`` counted on its second pass along ``streams``: the first is the warm-up, leaving
    what a bench's earlier calls leave (the default schedule's calibration)."""
    replay(streams, rule, costs, siblings)
    return replay(streams, rule, costs, siblings)


def compare(streams: Sequence[Stream], costs: Costs) -> dict:
    """Every rule along ``streams``: speed over plain decoding (1 / T(1)) and over transformers' rule.
    Ours runs the streams twice and counts the second pass (its calibration carried, as after warm-up)."""
    plain = 1.0 / costs.verify.seconds(1)
    rows = {
        "transformers (0.4, up to 20)": replay(streams, Threshold(*TRANSFORMERS_RULE), costs),
        "ours (CostAwareSchedule)": second_pass(streams, Schedule(costs), costs),
        "oracle (hindsight)": replay(streams, Oracle(), costs),
    }
    best = max(((replay(streams, Threshold(t, c), costs), t, c) for t in THRESHOLDS for c in CAPS),
               key=lambda item: item[0].rate)
    rows[f"best threshold in hindsight ({best[1]}, up to {best[2]})"] = best[0]
    if ranked(streams):
        rows.update({f"ours, {name}": second_pass(streams, Schedule(costs), costs, siblings)
                     for name, siblings in SIBLING_SHAPES.items()})
    reference = rows["transformers (0.4, up to 20)"].rate
    return {name: {"x_plain": row.rate / plain, "x_transformers": row.rate / reference,
                   "tokens_per_round": row.tokens / row.rounds, "drafted_per_round": row.drafted / row.rounds}
            for name, row in rows.items()}


def line_through(points: dict[int, float]) -> dict[int, float]:
    """The least-squares line through measured ``{tokens: seconds}`` at the same widths: a replay priced by it
    is not decided by one width's noisy timing (differences of a few percent between rules can be)."""
    widths = sorted(points)
    if len(widths) < 2:
        return dict(points)
    slope, intercept = numpy.polyfit(widths, [points[k] for k in widths], 1)
    return {k: float(intercept + slope * k) for k in widths}


def depth_of(named: dict[str, Stream]) -> int:
    """How many tokens the drafter drafted at each position of these streams."""
    return len(next(iter(named.values())).confidences[0])


def save_streams(path: Path, named: dict[str, Stream]) -> None:
    path.write_text("".join(json.dumps({"name": name, "matches": s.matches, "confidences": s.confidences,
                                        **({"ranks": s.ranks} if s.ranks is not None else {})}) + "\n"
                            for name, s in named.items()))


def load_streams(path: Path) -> dict[str, Stream]:
    """The streams ``save_streams`` wrote (those of reports before ranks were kept have none)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["name"]: Stream(row["matches"], row["confidences"], row.get("ranks")) for row in rows}


def run_stopping_replay(models: str, target_dtype: str, question_file: str | None, categories: Sequence[str] | None,
                        questions_per_group: int | None, max_new_tokens: int, depth: int, out: str | None,
                        pack_target: bool = False, streams: str | None = None, skip_questions: int = 0,
                        fit_line: bool = False) -> str:
    """Streams of the model set's drafter along its target's greedy answers to the chosen questions (every
    turn, each after the target's own earlier answers, as the benchmark's chats; ``skip_questions``: the
    first N of each category left out; or those turns of the ``streams`` file of an earlier run), the target's cost curve
    (with ``fit_line``: the least-squares line through it, `line_through`)
    and the drafter's step measured here, and every rule compared (`compare`); the table as markdown, and
    with ``out``: ``streams.jsonl``, ``summary.json`` and ``results.md`` there."""
    from hf_polybasic.cli.model_sets import build_model_set
    from hf_polybasic.cli.prompts import encode, messages_for
    from hf_polybasic.costs import machine_description

    from .bench.runner import load_questions
    from .bench.settings import BenchSettings

    model_set = build_model_set(models, {"draft"}, target_dtype, pack_target=pack_target)
    target, drafter = model_set.target, model_set.pool["draft"]
    questions = load_questions(BenchSettings(
        models=models, target_dtype=target_dtype, question_file=question_file,
        categories=tuple(categories) if categories else None, questions_per_group=questions_per_group,
        skip_questions=skip_questions, max_new_tokens=max_new_tokens))[0]
    named = {}
    if streams is not None:  # the question options choose which of its turns are replayed
        chosen = {question.question_id for question in questions}
        named = {name: stream for name, stream in load_streams(Path(streams)).items() if name.split("/")[0] in chosen}
        if not named:
            raise ValueError(f"no turn of {streams} belongs to the selected questions ({sorted(chosen)}); select the "
                             "question file and categories its streams were made from")
    else:
        for question in questions:
            answers: list[str] = []
            for turn in range(len(question.turns)):
                inputs, _ = encode(model_set, messages_for(question, turn, answers), max_new_tokens)
                stream, output = drafter_stream(target, drafter, inputs["input_ids"], max_new_tokens, depth,
                                                **model_set.generate_options)
                named[f"{question.question_id}/{turn}"] = stream
                answers.append(model_set.tokenizer.decode(output, skip_special_tokens=True))
    depth = depth_of(named)  # a streams file's own
    widths = set(range(1, depth + 2))
    if ranked(named.values()):  # the widest round with leaves, every 4th
        widest = max(s.leaves(MAX_DRAFT_TOKENS) for s in SIBLING_SHAPES.values()) + MAX_DRAFT_TOKENS + 2
        widths |= {*range(depth + 2, widest, 4), widest}
    measured = measure_curve(target, tokens=sorted(widths))
    verify = CostCurve(line_through(measured.points)) if fit_line else measured
    costs = Costs(verify, measure_curve(drafter, tokens=(1,)).seconds(1))
    table = compare(list(named.values()), costs)
    machine = machine_description(target)
    lines = [f"Drafter `{model_set.labels['draft']}`, target `{model_set.labels['target']}`, "
             f"{len(named)} turns ({', '.join(named)}), "
             f"{max_new_tokens} new tokens, drafts {depth} deep; T(1) {costs.verify.seconds(1):.3f} s, "
             f"T(17) {costs.verify.seconds(17):.3f} s{' (the line through the measured T(k))' if fit_line else ''}, "
             f"a drafting step {costs.step:.3f} s; "
             f"CPU {machine.get('cpu')} ({machine.get('class')}), flags {', '.join(machine.get('cpu_flags', []))}.",
             "", "| rule | x plain | x transformers' | tokens per target forward | drafted per round |",
             "|---|---|---|---|---|"]
    lines += [f"| {name} | {row['x_plain']:.2f}x | {row['x_transformers']:.3f}x | {row['tokens_per_round']:.2f} | "
              f"{row['drafted_per_round']:.2f} |" for name, row in table.items()]
    missed = miss_ranks(named.values()) if ranked(named.values()) else None
    if missed is not None:
        lines += ["", f"Where the drafter's first choice missed ({sum(missed.values())} positions), the target's token "
                  f"was its choice " + ", ".join(f"{rank} at {count}" for rank, count in missed.items() if rank)
                  + f", below {RANKS_KEPT} at {missed[0]}."]
    text = "\n".join(lines) + "\n"
    if out is not None:
        directory = Path(out)
        directory.mkdir(parents=True, exist_ok=True)
        save_streams(directory / "streams.jsonl", named)
        (directory / "summary.json").write_text(json.dumps(
            {"table": table, "costs": {"verify": costs.verify.points, "step": costs.step, "measured": measured.points},
             "machine": machine, **({"miss_ranks": missed} if missed is not None else {}),
             "turns": list(named)}, indent=1, default=str) + "\n")
        (directory / "results.md").write_text(text)
    return text
