"""``multi-turn``: chat sessions whose every turn re-sends the whole conversation so far.

Turn k's prompt = turn k-1's prompt + turn k-1's output + new user tokens (turn 1: the first
user message, system prompt included). A session is one stream of content: its b-th block of
``hash_block_tokens`` tokens has one id, so turn k's hash list is the session's first
ceil(prompt_k / H) ids and every turn's prompt extends the previous one (the prefix rule makes
the shared part exact, partial last block included). With ``reply_hashes`` (the default) a
turn's list goes on over its reply, ceil((prompt_k + output_k) / H) ids, so the engine keys the
reply's KV blocks as the next turn's prompt has them (a real engine caches the reply's blocks
and the next turn hits them). Sessions start at times drawn from the
arrival process; turn k arrives an exponential think time (mean ``think_time_s``) after turn
k-1's arrival. The rows carry ``session_id`` and that think time (``think_time_s``), so a
replay sends turn k no earlier than turn k-1's finish + its think time (simkv/replay/sessions.py:
a user answers a reply they have read); the arrival times are the open-loop schedule, which
``--no-session-pacing`` replays as it is. A session ends early when the next prompt would exceed
``max_prompt_tokens``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simkv.traces.arrivals import ArrivalProcess, arrival_rng
from simkv.traces.build import build_trace, consecutive_ids
from simkv.traces.errors import TraceError
from simkv.traces.schema import Trace
from simkv.traces.synth import ClippedLognormal


@dataclass(frozen=True)
class SessionShape:
    """Lengths and timing of the chat sessions."""

    sessions: int = 100
    turns: int = 4
    first_prompt: ClippedLognormal = ClippedLognormal(6.0, 0.7, 8, 1800)
    user_tokens: ClippedLognormal = ClippedLognormal(4.0, 0.8, 4, 1024)
    output: ClippedLognormal = ClippedLognormal(4.8, 0.9, 8, 900)
    think_time_s: float = 10.0
    hash_block_tokens: int = 16
    max_prompt_tokens: int = 32768
    reply_hashes: bool = True

    def check(self) -> None:
        if self.sessions < 1 or self.turns < 1:
            raise TraceError("multi-turn: --sessions and --turns must be >= 1")
        if self.hash_block_tokens < 1 or self.think_time_s < 0 or self.max_prompt_tokens < 1:
            raise TraceError("multi-turn: need --hash-block-tokens >= 1, --think-time >= 0, --max-prompt-tokens >= 1")
        for name, dist in (("first prompt", self.first_prompt), ("user tokens", self.user_tokens), ("output", self.output)):
            dist.check(f"multi-turn {name}")


def multi_turn(shape: SessionShape = SessionShape(), seed: int = 0, arrival: ArrivalProcess = ArrivalProcess()) -> Trace:
    """Rows ordered session by session, turn by turn (the reader sorts them by arrival)."""
    shape.check()
    rng = np.random.default_rng([seed, 3])
    count = (shape.sessions, shape.turns)
    new_tokens = shape.user_tokens.draw_numpy(rng, shape.sessions * shape.turns).reshape(count)
    new_tokens[:, 0] = shape.first_prompt.draw_numpy(rng, shape.sessions)
    outputs = shape.output.draw_numpy(rng, shape.sessions * shape.turns).reshape(count)
    think = rng.exponential(shape.think_time_s, count) if shape.think_time_s > 0 else np.zeros(count)
    gaps = think.copy()
    gaps[:, 0] = 0.0
    think[:, 0] = arrival.times(shape.sessions, arrival_rng(seed))
    prompts = np.cumsum(new_tokens, axis=1) + np.cumsum(outputs, axis=1) - outputs
    keep = prompts <= shape.max_prompt_tokens
    keep = np.cumprod(keep, axis=1).astype(bool)
    keep[:, 0] = True
    return _session_trace(shape, seed, prompts, outputs, np.cumsum(think, axis=1), gaps, keep)


def _session_trace(
    shape: SessionShape, seed: int, prompts: np.ndarray, outputs: np.ndarray, times: np.ndarray, gaps: np.ndarray,
    keep: np.ndarray
) -> Trace:
    block = shape.hash_block_tokens
    session, turn = np.nonzero(keep)
    prompt = prompts[session, turn]
    output = outputs[session, turn]
    blocks = -(-(prompt + output if shape.reply_hashes else prompt) // block)
    stride = int(-(-(prompts + outputs).max() // block))
    hash_ids, offsets = consecutive_ids(session * stride, blocks)
    ids = [f"s{s}-t{t}" for s, t in zip(session.tolist(), turn.tolist())]
    return build_trace(
        f"synth:multi-turn(seed={seed})",
        arrival_time_s=times[session, turn],
        prompt_tokens=prompt,
        output_tokens=output,
        request_id=ids,
        hash_ids=hash_ids,
        hash_offsets=offsets,
        hash_block_tokens=block,
        session_id=[f"s{s}" for s in session.tolist()],
        think_time_s=gaps[session, turn],
    )
