"""Turn ``simkv trace synth`` options into a generated Trace (kept out of the click module)."""
from __future__ import annotations

from dataclasses import dataclass

from simkv.traces.arrivals import ArrivalProcess
from simkv.traces.errors import TraceError
from simkv.traces.schema import Trace
from simkv.traces.synth import ClippedLognormal, LognormalSizes, lognormal
from simkv.traces.synth_prefix import PrefixGroups, shared_prefix
from simkv.traces.synth_sessions import SessionShape, multi_turn

KINDS = ("lognormal", "shared-prefix", "multi-turn")


@dataclass(frozen=True)
class SynthOptions:
    """Everything the ``synth`` command accepts; each kind reads the fields it needs."""

    kind: str
    n_requests: int
    seed: int
    fast: bool
    prompt: ClippedLognormal
    output: ClippedLognormal
    arrival: ArrivalProcess
    groups: int
    prefix_tokens: tuple[int, ...]
    hash_block_tokens: int | None
    assign: str
    salt_per_group: bool
    base: str
    sessions: int
    turns: int
    user_tokens: ClippedLognormal
    think_time_s: float
    max_prompt_tokens: int
    reply_hashes: bool = True


def generate(options: SynthOptions) -> Trace:
    """Dispatch on ``options.kind``."""
    sizes = LognormalSizes(options.prompt, options.output)
    if options.kind == "lognormal":
        return lognormal(options.n_requests, options.seed, sizes, options.arrival, options.fast)
    if options.kind == "shared-prefix":
        if options.base != "lognormal":
            raise TraceError(f"shared-prefix: unknown --base {options.base!r} (only 'lognormal')")
        groups = PrefixGroups(
            options.groups, options.prefix_tokens, options.hash_block_tokens, options.assign, options.salt_per_group
        )
        return shared_prefix(groups, options.n_requests, options.seed, sizes, options.arrival, options.fast)
    if options.kind == "multi-turn":
        shape = SessionShape(
            sessions=options.sessions, turns=options.turns, first_prompt=options.prompt,
            user_tokens=options.user_tokens, output=options.output, think_time_s=options.think_time_s,
            hash_block_tokens=options.hash_block_tokens or 16, max_prompt_tokens=options.max_prompt_tokens,
            reply_hashes=options.reply_hashes,
        )
        return multi_turn(shape, options.seed, options.arrival)
    raise TraceError(f"unknown generator {options.kind!r} (choose from {', '.join(KINDS)})")


def parse_int_list(text: str) -> tuple[int, ...]:
    """'1000' or '500,1000,2000' -> a tuple of ints."""
    try:
        values = tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError:
        raise TraceError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise TraceError("expected at least one integer")
    return values
