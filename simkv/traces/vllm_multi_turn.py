"""The conversations of vLLM's multi-turn benchmark (`benchmarks/multi_turn/
benchmark_serving_multi_turn.py`), from its generator's JSON file (`generate_multi_turn.json`,
``"filetype": "generate_conversations"``), as a trace of paced sessions.

The generator draws, from numpy's global random state seeded with the benchmark's ``--seed``
(default 0), in this order: every conversation's message count (``prompt_input.num_turns``;
at least 2, rounded up to even: a user message and its answer per turn), every conversation's
own prefix (``prefix_num_tokens``), one common prefix for all (``common_prefix_num_tokens``,
optional), then per conversation one count per message for user messages (``num_tokens``) and
one for answers (``prompt_output.num_tokens``; at least 1), of which the user turns read the
even places and the answers the odd ones. Distributions: constant, uniform (whole numbers:
``randint(min, max + 1)``), zipf and poisson (capped at ``max``), lognormal (``mean`` and
``sigma``, or an ``average`` with a ``median_ratio``, 0.85 by default: the draws scaled so
that their mean is the average, capped at ``max``, rounded). `draw_conversations` makes the
same draws, in the same order, as the generator's source reads (vLLM's bench_dataset.py of
2026; the benchmark is not part of the vllm package, so no run of it was recorded, but the turn
counts and answer lengths of vLLM's README example agree with a replay of its command:
docs/traces.md).

Token counts come from the model's tokenizer, which simkv does not run; these are Llama 3's,
counted on the generator's fixed texts: a user message is the conversation's tag ("<id> is a
nice number... ", ``INTRO_TOKENS``), the first one also the common prefix before it and the
conversation's prefix after it ("<id>, " and the prefix text: ``PREFIX_LEAD_TOKENS`` more),
the instruction ("Please rewrite the following text and add more content: ",
``INSTRUCTION_TOKENS``), and text up to the drawn count (the instruction and the tag, common
prefix included, count in it; a count they already pass adds no text). An answer has its drawn
count: the client asks for exactly that many tokens. The server's chat template (Llama 3's) puts
a BOS token first, a header (``HEADER_TOKENS``: start, role, end, blank line) before each
message and an end-of-turn token after it, and ends the prompt with the assistant's header.
Turn k's prompt is the whole conversation so far: every earlier message, the answers as they
were generated, and the new user message; it repeats the previous prompt and its answer token
for token. Lengths are therefore within a few tokens of the real ones; the draws themselves
are vLLM's.

Every conversation is ready at time 0 and sent turn after turn with no pause (the benchmark's
``--request-rate`` 0): replay it with `--client-max-concurrency N --client-max-active-sessions
M` for its ``--num-clients N --max-active-conversations M`` (M defaults to N there).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from simkv.traces.build import build_trace, consecutive_ids
from simkv.traces.errors import TraceError
from simkv.traces.schema import Trace

INTRO_TOKENS = 7  # "<id> is a nice number... "
PREFIX_LEAD_TOKENS = 2  # "<id>, " before a conversation's own prefix
INSTRUCTION_TOKENS = 11  # "Please rewrite the following text and add more content: "
BOS_TOKENS = 1  # <|begin_of_text|>
HEADER_TOKENS = 4  # <|start_header_id|>role<|end_header_id|>\n\n
EOT_TOKENS = 1  # <|eot_id|>
DEFAULT_MEDIAN_RATIO = 0.85


@dataclass(frozen=True)
class Distribution:
    """One of the generator's distributions (``kind``: constant, uniform, zipf, poisson,
    lognormal) with its parameters."""

    kind: str
    value: float = 0
    low: float = 0
    high: float = 0
    alpha: float = 0
    mu: float = 0
    sigma: float = 0
    average: float | None = None
    cap: int | None = None

    def sample(self, rng: np.random.RandomState, size: int) -> np.ndarray:
        if self.kind == "constant":
            return np.full(size, self.value)
        if self.kind == "uniform":
            return rng.randint(int(self.low), int(self.high) + 1, size=size)
        if self.kind in ("zipf", "poisson"):
            draws = rng.zipf(self.alpha, size=size) if self.kind == "zipf" else rng.poisson(self.alpha, size=size)
            return np.minimum(draws, self.cap) if self.cap else draws
        draws = rng.lognormal(mean=self.mu, sigma=self.sigma, size=size)
        if self.average is not None:
            draws *= self.average / draws.mean()
        if self.cap:
            draws = np.minimum(draws, self.cap)
        return np.round(draws).astype(int)


@dataclass(frozen=True)
class MultiTurnConfig:
    """The generator's JSON file, read."""

    num_conversations: int
    num_turns: Distribution
    common_prefix_tokens: Distribution
    prefix_tokens: Distribution
    input_tokens: Distribution
    output_tokens: Distribution


def _distribution(conf: dict, where: str, optional: bool = False) -> Distribution:
    section, _, name = where.partition(".")
    part = conf.get(section)
    if not isinstance(part, dict):
        raise TraceError(f"field '{section}' must be an object")
    if name not in part:
        if optional:
            return Distribution("constant", value=0)
        raise TraceError(f"missing field '{where}'")
    spec = part[name]
    if not isinstance(spec, dict) or "distribution" not in spec:
        raise TraceError(f"'{where}' needs a 'distribution'")
    kind = spec["distribution"]

    def need(key: str) -> float:
        if key not in spec:
            raise TraceError(f"'{where}' ({kind}) needs '{key}'")
        value = spec[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TraceError(f"'{where}.{key}' must be a number, got {value!r}")
        return value

    cap = spec.get("max")
    if kind == "constant":
        return Distribution(kind, value=need("value"))
    if kind == "uniform":
        low, high = need("min"), need("max")
        if not (isinstance(low, int) and isinstance(high, int)) or not 0 < low <= high:
            raise TraceError(f"'{where}' (uniform): min and max must be whole numbers, 0 < min <= max; got {low}, {high}")
        return Distribution(kind, low=low, high=high)
    if kind in ("zipf", "poisson"):
        return Distribution(kind, alpha=need("alpha"), cap=cap)
    if kind == "lognormal":
        if "average" in spec:
            average = need("average")
            ratio = spec.get("median_ratio") or DEFAULT_MEDIAN_RATIO
            if average < 1 or not 0 < ratio < 1:
                raise TraceError(f"'{where}' (lognormal): average must be >= 1 and median_ratio in (0, 1)")
            median = average * ratio
            return Distribution(kind, mu=float(np.log(median)), sigma=float(np.sqrt(2 * np.log(average / median))),
                                average=average, cap=cap)
        mu, sigma = need("mean"), need("sigma")
        if mu <= 0 or sigma < 0:
            raise TraceError(f"'{where}' (lognormal): mean must be > 0 and sigma >= 0")
        return Distribution(kind, mu=mu, sigma=sigma, cap=cap)
    raise TraceError(f"'{where}': unknown distribution {kind!r} (constant, uniform, zipf, poisson, lognormal)")


def read_config(path: str | os.PathLike) -> MultiTurnConfig:
    """The generator's JSON file; TraceError naming the file and the field otherwise."""
    try:
        with open(path) as f:
            conf = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise TraceError(f"{path}: {exc}") from None
    try:
        if not isinstance(conf, dict) or conf.get("filetype") != "generate_conversations":
            raise TraceError("not a conversation generator's file (\"filetype\": \"generate_conversations\")")
        n = conf.get("num_conversations")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise TraceError(f"'num_conversations' must be a whole number >= 1, got {n!r}")
        return MultiTurnConfig(n, _distribution(conf, "prompt_input.num_turns"),
                               _distribution(conf, "prompt_input.common_prefix_num_tokens", optional=True),
                               _distribution(conf, "prompt_input.prefix_num_tokens"),
                               _distribution(conf, "prompt_input.num_tokens"),
                               _distribution(conf, "prompt_output.num_tokens"))
    except TraceError as exc:
        raise TraceError(f"{path}: {exc}") from None


@dataclass(frozen=True)
class Conversations:
    """The generator's draws: per conversation its message count, its own prefix and its
    per-message counts (user counts at even places, answers at odd ones); one common prefix."""

    num_messages: np.ndarray
    prefix_tokens: np.ndarray
    common_prefix_tokens: int
    input_tokens: list[np.ndarray]
    output_tokens: list[np.ndarray]


def draw_conversations(config: MultiTurnConfig, seed: int = 0) -> Conversations:
    """The draws the benchmark's generator makes with numpy's global state seeded `seed`, in its
    order."""
    rng = np.random.RandomState(seed)
    n = config.num_conversations
    messages = np.maximum(config.num_turns.sample(rng, n), 2)
    messages = messages + messages % 2
    prefix = config.prefix_tokens.sample(rng, n)
    common = int(config.common_prefix_tokens.sample(rng, 1)[0])
    inputs, outputs = [], []
    for count in messages.tolist():
        inputs.append(np.maximum(config.input_tokens.sample(rng, count), INSTRUCTION_TOKENS))
        outputs.append(np.maximum(config.output_tokens.sample(rng, count), 1))
    return Conversations(messages.astype(np.int64), prefix.astype(np.int64), common, inputs, outputs)


def user_message_tokens(drawn: int, turn: int, common: int, prefix: int) -> int:
    """A user message's tokens: its fixed texts and the text that takes it to the drawn count
    (the first turn: the common prefix before its tag, its own prefix after; see the module)."""
    fixed = INTRO_TOKENS + INSTRUCTION_TOKENS + (max(common - 1, 0) if turn == 0 else 0)
    own = PREFIX_LEAD_TOKENS + prefix if turn == 0 and prefix > 0 else 0
    return max(drawn, fixed) + own


def chat_template_tokens(num_messages) -> int:
    """The tokens Llama 3's chat template adds to a prompt of `num_messages` messages (a BOS, a
    header and an end-of-turn token per message, the assistant's header last): what a prompt
    has beyond its messages' text, which is all the benchmark counts as its input_num_tokens."""
    return BOS_TOKENS + num_messages * (HEADER_TOKENS + EOT_TOKENS) + HEADER_TOKENS


def multi_turn_trace(config: MultiTurnConfig, seed: int = 0, max_turns: int | None = None,
                     hash_block_tokens: int = 16, source: str = "vllm-multi-turn") -> Trace:
    """The conversations as a trace: one row per user turn, every row at time 0 and its session
    paced on its replies; each prompt's hash list goes on over its reply (the next turn repeats
    it), and the common prefix's whole blocks are shared by every conversation. `max_turns`: the
    benchmark's --max-turns (messages, user and answer, per conversation)."""
    drawn = draw_conversations(config, seed)
    rows: list[tuple[int, int, int, int]] = []  # (conversation, turn, prompt, output)
    for c in range(config.num_conversations):
        count = int(drawn.num_messages[c]) if max_turns is None else min(int(drawn.num_messages[c]), max_turns)
        history = BOS_TOKENS
        for turn, m in enumerate(range(0, count - 1, 2)):
            user = user_message_tokens(int(drawn.input_tokens[c][m]), turn, drawn.common_prefix_tokens,
                                       int(drawn.prefix_tokens[c]))
            answer = int(drawn.output_tokens[c][m + 1])
            prompt = history + HEADER_TOKENS + user + EOT_TOKENS + HEADER_TOKENS  # (ends with the assistant's header)
            rows.append((c, turn, prompt, answer))
            history = prompt + answer + EOT_TOKENS
    if not rows:
        raise TraceError(f"{source}: no user turn (--max-turns below 2?)")
    conv, turn, prompt, output = (np.array(column, dtype=np.int64) for column in zip(*rows))
    block = hash_block_tokens
    blocks = -(-(prompt + output) // block)
    stride = int(blocks.max()) + 1
    hash_ids, offsets = consecutive_ids((conv + 1) * stride, blocks)
    # BOS, the first user header and the common prefix: the same tokens in every conversation
    shared = (BOS_TOKENS + HEADER_TOKENS + max(drawn.common_prefix_tokens - 1, 0)) // block
    position = hash_ids - np.repeat((conv + 1) * stride, blocks)
    hash_ids = np.where(position < shared, position, hash_ids)
    return build_trace(source, arrival_time_s=np.zeros(len(rows)), prompt_tokens=prompt, output_tokens=output,
                       request_id=[f"CONV_ID_{c}/turn{t}" for c, t in zip(conv.tolist(), turn.tolist())],
                       hash_ids=hash_ids, hash_offsets=offsets, hash_block_tokens=block,
                       session_id=[f"CONV_ID_{c}" for c in conv.tolist()], think_time_s=np.zeros(len(rows)))
