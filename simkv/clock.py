"""The replay clock: time is an integer count of ticks of 2**-40 s (about 0.91 ps).

Integer durations add up exactly in any order, so a run of decode steps whose durations are
affine in their step index (see `StepBackend.decode_step_line`) has a closed-form end time:
jumping over the run gives the very times that stepping through it would, bit for bit, and the
cost of a run no longer grows with its length. Times are reported in float seconds
(`ticks / TICKS_PER_SECOND`, exact below 2**53 ticks, about 2.3 hours of simulated time, and
rounded to the nearest double beyond).

Times and durations in seconds become ticks by rounding up (`to_ticks`; the scaling by a power
of two is exact): a request joins the first step that starts at or after its arrival tick, and
a step lasts at least its duration (at most one tick more), so a request arriving exactly at the
end of a step, in decimal seconds, still joins the next step.
Per-token coefficients of the decode lines are rounded to the nearest tick (`per_token_ticks`).
"""

from __future__ import annotations

import math

TICKS_PER_SECOND = 1 << 40
#: The step table keeps ticks in int64: simulated time must stay below 2**62 ticks (48.5 days).
MAX_TICKS = 1 << 62


def to_ticks(seconds: float) -> int:
    """A time or duration in seconds, rounded up to a whole tick."""
    return math.ceil(seconds * TICKS_PER_SECOND)


def per_token_ticks(seconds: float) -> int:
    """A per-token coefficient in seconds, rounded to the nearest tick."""
    return round(seconds * TICKS_PER_SECOND)


def line_ticks(line: tuple[int, int, int, int], context_tokens: int) -> int:
    """A pure-decode step's ticks from its backend's decode line (a0, a1, b0, b1)."""
    a0, a1, b0, b1 = line
    return max(a0 + a1 * context_tokens, b0 + b1 * context_tokens)


# A decode run's step j lasts max(a0 + a1 * j, b0 + b1 * j) ticks, integers >= 0 (the roofline's
# compute and memory time; other models give one line twice). `run_shape` puts it in the form
# the two functions below take: (c0, c1, cross, d0, d1), meaning c0 + c1 * j for j < cross and
# d0 + d1 * j from then on.
NEVER = 1 << 62


def run_shape(a0: int, a1: int, b0: int, b1: int) -> tuple[int, int, int, int, int]:
    if b0 > a0 or (b0 == a0 and b1 > a1):
        a0, a1, b0, b1 = b0, b1, a0, a1  # the a line is the max at step 0
    if b1 <= a1:
        return a0, a1, NEVER, a0, a1  # and stays the max
    return a0, a1, -(-(a0 - b0) // (b1 - a1)), b0, b1


def run_ticks(shape: tuple[int, int, int, int, int], num_steps: int) -> int:
    """Total ticks of the first `num_steps` steps of a run."""
    c0, c1, cross, d0, d1 = shape
    if num_steps <= cross:
        return num_steps * c0 + c1 * (num_steps * (num_steps - 1) // 2)
    m = num_steps - cross
    return (cross * c0 + c1 * (cross * (cross - 1) // 2)
            + m * (d0 + d1 * cross) + d1 * (m * (m - 1) // 2))


def steps_to_reach(shape: tuple[int, int, int, int, int], ticks: int, limit: int) -> int:
    """The fewest steps (at most `limit`) whose total reaches `ticks` (> 0); `limit` if even
    `limit` steps fall short."""
    if run_ticks(shape, limit) < ticks:
        return limit
    c0, c1, cross, d0, d1 = shape
    if cross >= limit:
        return _fewest(c0, c1, ticks)
    head = cross * c0 + c1 * (cross * (cross - 1) // 2)
    if head >= ticks:
        return _fewest(c0, c1, ticks)
    return cross + _fewest(d0 + d1 * cross, d1, ticks - head)


def _fewest(first: int, slope: int, rest: int) -> int:
    """The smallest m >= 1 with m * first + slope * m * (m - 1) / 2 >= rest (the quadratic's
    root in floats, then corrected in integers)."""
    if slope == 0:
        return max(1, -(-rest // first))
    half = first - slope / 2
    m = int((-half + math.sqrt(half * half + 2.0 * slope * rest)) / slope) + 1  # the root, rounded up
    while m > 1 and (m - 1) * first + slope * ((m - 1) * (m - 2) // 2) >= rest:
        m -= 1
    while m * first + slope * (m * (m - 1) // 2) < rest:
        m += 1
    return m
