"""How fast an autoscaler may scale (`--scale-up-policy`, `--scale-down-policy`): HPA's
`behavior.scaleUp` / `behavior.scaleDown` policies.

A rule is a list of policies and how to pick among them: `pods=4/15` lets the fleet grow (or
shrink) by 4 replicas within any 15 s, `percent=100/15` by 100 % of what it had 15 s before;
`select=max` (HPA's default) takes the policy that allows the largest change, `select=min` the
smallest, and `disabled` forbids scaling that way at all. As HPA computes it, each policy
starts from the replicas the fleet had a period ago (those it has, less the ones it added
within the period, plus the ones it removed) and proposes that plus `pods`, or times (1 +
percent/100) rounded up, for a scale-up; less `pods`, or times (1 - percent/100) rounded down,
for a scale-down. HPA's defaults: up `pods=4/15,percent=100/15` (select max), down
`percent=100/15` (anything at once: only the stabilisation window holds a scale-down back).
Several policies are separated by ',' or ';' (';' inside a P/D pool's settings or a sweep key).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_UP = "pods=4/15;percent=100/15"
DEFAULT_DOWN = "percent=100/15"
MAX_PERIOD_S = 1800.0  # (HPA's limit on periodSeconds)


class PolicyError(ValueError):
    """A bad --scale-up-policy / --scale-down-policy."""


@dataclass(frozen=True)
class ScalingRules:
    """One direction's policies: (kind, value, period in seconds) each, and the select."""

    policies: tuple[tuple[str, float, float], ...]
    select: str = "max"  # max, min or disabled

    @classmethod
    def parse(cls, text: str, flag: str) -> "ScalingRules":
        items = [item.strip() for item in str(text).replace(";", ",").split(",") if item.strip()]
        if [item.lower() for item in items] == ["disabled"]:
            return cls((), "disabled")
        policies, select = [], "max"
        for item in items:
            key, eq, value = item.partition("=")
            key = key.strip().lower()
            if key == "select" and value.strip().lower() in ("max", "min"):
                select = value.strip().lower()
                continue
            amount, slash, period = value.partition("/")
            try:
                amount_f, period_f = float(amount), float(period) if slash else math.nan
            except ValueError:
                amount_f = period_f = math.nan
            if key not in ("pods", "percent") or not eq or not (amount_f > 0 and 0 < period_f <= MAX_PERIOD_S) or (
                    key == "pods" and not amount_f.is_integer()):
                raise PolicyError(f"{flag} {text!r}: expected policies as pods=N/SECONDS or percent=P/SECONDS "
                                  f"(N a whole number > 0, SECONDS in (0, {MAX_PERIOD_S:g}]), e.g. pods=1/60, "
                                  f"with select=max|min, or 'disabled'; got {item!r}")
            policies.append((key, amount_f, period_f))
        if not policies:
            raise PolicyError(f"{flag} {text!r}: give at least one policy, e.g. pods=1/60, or 'disabled'")
        return cls(tuple(policies), select)

    def __str__(self) -> str:
        if self.select == "disabled":
            return "disabled"
        parts = [f"{kind}={_number(value)}/{_number(period)}" for kind, value, period in self.policies]
        return ";".join(parts + (["select=min"] if self.select == "min" else []))

    @property
    def longest_period_s(self) -> float:
        return max((period for _, _, period in self.policies), default=0.0)

    def limit(self, have: int, changes_within, up: bool) -> int:
        """The most replicas (`up`) or the fewest a fleet of `have` may go to now;
        `changes_within(period_s)`: (added, removed) within the last period_s seconds."""
        if self.select == "disabled":
            return have
        proposals = []
        for kind, value, period in self.policies:
            added, removed = changes_within(period)
            start = have - added + removed  # (what it had a period ago)
            if up:
                proposals.append(start + int(value) if kind == "pods" else math.ceil(start * (1 + value / 100) - 1e-9))
            else:
                proposals.append(start - int(value) if kind == "pods" else math.floor(start * (1 - value / 100) + 1e-9))
        # (select max, the largest change: for a scale-up the most replicas, for a scale-down the fewest)
        return (max if up == (self.select == "max") else min)(proposals)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)
