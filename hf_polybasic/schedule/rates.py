"""Pure math of proposal lengths: expected tokens of a verification, the best length, acceptance.

A verification of l proposed tokens, each accepted with probability alpha until the first
rejection, emits E(l) = 1 + alpha + ... + alpha^l tokens (the accepted ones and the verifier's own).
If proposing costs s seconds per token and the verification of l + 1 tokens costs T_v(l + 1), the
round yields E(l) / (l s + T_v(l + 1)) tokens per second; `best_length` maximises it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate
from operator import mul

# per-round decay of running sums: an observation's weight halves after ~7 later rounds, so the
# estimates follow the text (code copied from the prompt vs. free prose) within one call
DECAY = 0.9


def decayed(total: float, value: float) -> float:
    """A running sum with `DECAY`: the older part weighs a little less each round."""
    return DECAY * total + value


def expected_tokens(acceptance_rate: float, length: int) -> float:
    """Tokens one verification of ``length`` proposed tokens emits on average when each is accepted
    with probability ``acceptance_rate`` until the first rejection: 1 + alpha + ... + alpha^length."""
    total, power = 1.0, 1.0
    for _ in range(length):
        power *= acceptance_rate
        total += power
    return total


def best_length(
    acceptance_rate: float,
    seconds_per_token: float,
    verification_seconds: Callable[[int], float],
    maximum: int,
    minimum: int = 1,
) -> int:
    """The proposal length l in minimum..maximum that maximises expected tokens per second,
    E(l) / (l * seconds_per_token + verification_seconds(l + 1)); ties go to the shorter one.

    With a constant verification cost this is Leviathan et al.'s optimal draft length; with a
    cost curve T_v(k) it is the same question asked of the machine at hand.
    """
    best, best_rate = minimum, -1.0
    for length in range(minimum, maximum + 1):
        cost = length * seconds_per_token + verification_seconds(length + 1)
        rate = expected_tokens(acceptance_rate, length) / max(cost, 1e-12)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = length, rate
    return best


def best_round_rate(first_acceptance: float, acceptance_rate: float, seconds_per_token: float,
                    verification_seconds: Callable[[int], float], maximum: int) -> float:
    """The most expected tokens per second a round can yield over proposal lengths 1 .. ``maximum``:
    a round of l proposed tokens emits 1 + a_1 (1 + alpha + ... + alpha^(l - 1)) tokens on average
    (the first accepted with probability ``first_acceptance`` a_1, each later one, after an accepted
    one, with ``acceptance_rate`` alpha) for l s + T_v(l + 1) seconds.

    Looking at every length, not at the first token alone, is what a step-shaped cost curve needs: where
    T_v(2) - T_v(1) is a whole step (unpacked fp32 on many CPUs: T_v(2) = 2 T_v(1), then flat to 8
    tokens), a one-token round never beats decoding alone, and a long one does.
    """
    best, tail, power = 0.0, 0.0, 1.0
    for length in range(1, maximum + 1):
        tail += power  # 1 + alpha + ... + alpha^(length - 1)
        power *= acceptance_rate
        cost = length * seconds_per_token + verification_seconds(length + 1)
        best = max(best, (1.0 + first_acceptance * tail) / max(cost, 1e-12))
    return best


def acceptance_rate_estimate(accepted: float, rejections: float) -> float:
    """Per-token acceptance rate alpha from (decayed) counts, with one pseudo-observation each way.

    Each verification accepts a leading run and ends in at most one rejection, so the geometric
    maximum-likelihood estimate is accepted / (accepted + rejections); the pseudo-counts keep it
    inside (0, 1) before either has been seen.
    """
    if accepted < 0 or rejections < 0:
        raise ValueError(f"counts must be >= 0, got accepted={accepted}, rejections={rejections}")
    return (accepted + 1.0) / (accepted + rejections + 2.0)


def worth_one_more(survival: float, next_acceptance: float, expected: float, round_seconds: float,
                   marginal_seconds: float) -> bool:
    """Whether drafting one more token raises the round's expected tokens per second.

    The round so far: ``expected`` tokens for ``round_seconds``; the next token adds
    ``survival * next_acceptance`` expected tokens (every draft so far accepted, then this one) for
    ``marginal_seconds`` (a drafting step plus what it adds to the verification, s + T_v(j + 2) -
    T_v(j + 1)). It pays iff the marginal rate beats the round's: g / m > E / C.
    """
    return survival * next_acceptance * round_seconds > expected * marginal_seconds


def worth_more(survival: float, next_acceptance: float, expected: float, round_seconds: float,
               extra_seconds: list[float]) -> bool:
    """Whether drafting some more tokens raises the round's expected tokens per second, looking
    further than the next one.

    Extending the round by m tokens (m = 1 .. len(``extra_seconds``)) adds ``survival`` (a + a^2 +
    ... + a^m) expected tokens, a = ``next_acceptance`` (drafts run in streaks: a confident run
    goes on as it went), for ``extra_seconds[m - 1]`` seconds (m drafting steps plus what they add
    to the verification, which a step-shaped cost curve, a static runner's padded widths, makes 0
    within a width). It pays iff some m raises the rate: g_m / x_m > E / C. With m = 1 alone this
    is `worth_one_more`; looking further drafts across a costly step to the flat stretch beyond it.
    """
    gain, power = 0.0, 1.0
    for extra in extra_seconds:
        power *= next_acceptance
        gain += survival * power
        if gain * round_seconds > expected * extra:
            return True
    return False


def more_drafts_pay(acceptances: Sequence[float], first: float, later: float, step: float,
                    verification_seconds: Callable[[int], float], room: int, spent: int = 0) -> bool:
    """Whether more drafts raise the expected tokens per second of a round whose kept drafts are
    accepted with probabilities ``acceptances`` (each given every draft before it was): the next one
    accepted with probability ``first`` given every kept one was, each after it with ``later``; m = 1 ..
    ``room`` more cost m drafting steps of ``step`` seconds (``spent`` of them run already: paid either
    way, so not counted) plus what they add to the verification (`worth_more`)."""
    survivals = list(accumulate(acceptances, mul))  # P(the first i kept drafts are all accepted)
    drafted = len(survivals)
    verified = verification_seconds(drafted + 1)
    extras = [(m - spent) * step + verification_seconds(drafted + 1 + m) - verified for m in range(1, room + 1)]
    survival = survivals[-1] if survivals else 1.0
    return worth_more(survival * first / later, later, 1.0 + sum(survivals), drafted * step + verified, extras)


def best_proposal(acceptances: list[float], verification_seconds: Callable[[int], float]) -> int:
    """Of a round's drafts, accepted with probabilities ``acceptances`` (each given every draft
    before it was), how many to propose once drafting has stopped (its cost is spent whatever is
    proposed): the j in 0 .. len(acceptances) whose verification saves the most against the parent
    decoding alone, E_j T_v(1) - T_v(j + 1) with E_j = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_j; of equals,
    the longest."""
    plain = verification_seconds(1)
    gains, expected, survival = [0.0], 1.0, 1.0
    for index, acceptance in enumerate(acceptances):
        survival *= acceptance
        expected += survival
        gains.append(expected * plain - verification_seconds(index + 2))
    return max(range(len(acceptances), -1, -1), key=gains.__getitem__)


def never_pays(step_seconds: float, verification_seconds: Callable[[int], float], maximum: int) -> bool:
    """Whether even perfect acceptance could not pay: every proposal length 1 .. ``maximum`` emits
    tokens more slowly, (l + 1) / (l s + T_v(l + 1)), than the parent decoding alone, 1 / T_v(1) (a
    tie is left to the rounds to settle)."""
    plain = 1.0 / max(verification_seconds(1), 1e-12)
    return all((length + 1) / (length * step_seconds + verification_seconds(length + 1)) < plain * (1 - 1e-6)
               for length in range(1, maximum + 1))
