"""How vLLM 0.33's PCPManager splits a step over prefill-context-parallel ranks (its V2 model
runner, latent attention): `split_step` gives each rank's share, which the roofline prices
(`RooflineCostModel.pcp_rank_works`).

- A prefill chunk of n tokens is cut into 2 x PCP pieces of ceil(n / (2 x PCP)) tokens, and
  rank r takes pieces r and 2 x PCP - 1 - r (DualChunkSwap: an early piece and a late one, so
  that the ranks' causal attention balances). A piece attends the chunk's context and the
  chunk's tokens before it, which every rank holds (each writes every token's K/V), and runs
  down the prefill path however short it is (vLLM does not treat short PCP pieces as decodes).
- Decode rows are dealt whole, round robin: first the verifications of speculative decoding
  (the last sampled token and K drafts: a decode row of 1 + K tokens), in the step's order,
  then the single-token decodes, which the scheduler sums (each rank takes its count's share
  of their context).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from simkv.core.outputs import SchedulerOutput


@dataclass(frozen=True, slots=True)
class Piece:
    """A row of a rank's batch, with the fields of a ScheduledChunk the roofline reads."""

    num_computed_tokens: int  # the context before the row (the chunk's cached tokens and its earlier pieces)
    num_new_tokens: int
    prefill: bool  # a prefill piece (down the prefill path); else a verification (a decode row)


@dataclass(slots=True)
class RankStep:
    """A rank's share of a step, with the fields of a SchedulerOutput the roofline reads."""

    chunks: list[Piece] = field(default_factory=list)
    num_decode_reqs: int = 0
    decode_context_tokens: float = 0.0
    decode_capped_context_tokens: float = 0.0


def split_step(output: SchedulerOutput, pcp: int) -> list[RankStep]:
    """Each of the `pcp` ranks' share of `output`."""
    ranks = [RankStep() for _ in range(pcp)]
    ordinal = 0  # (decode rows dealt so far)
    for chunk in output.chunks:
        n, c = chunk.num_new_tokens, chunk.num_computed_tokens
        if chunk.num_spec_tokens or chunk.spec_placeholder:  # a verification: one decode row, whole
            ranks[ordinal % pcp].chunks.append(Piece(c, n, False))
            ordinal += 1
            continue
        size = -(-n // (2 * pcp))
        for rank, step in enumerate(ranks):
            for piece in (rank, 2 * pcp - 1 - rank):
                start, end = piece * size, min((piece + 1) * size, n)
                if end > start:
                    step.chunks.append(Piece(c + start, end - start, True))
    n = output.num_decode_reqs
    for rank, step in enumerate(ranks):
        d = max(0, n - (rank - ordinal) % pcp + pcp - 1) // pcp  # (decode rows ordinal, ordinal + 1, ... dealt on)
        if d:
            step.num_decode_reqs = d
            step.decode_context_tokens = output.decode_context_tokens * d / n
            step.decode_capped_context_tokens = output.decode_capped_context_tokens * d / n
    return ranks
