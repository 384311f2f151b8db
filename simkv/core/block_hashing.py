"""Content keys of KV blocks, derived from a trace's hash ids at any block size.

A block's key stands for its content and, through chaining, for everything before it, as
vLLM's block hash does (hash(parent hash, block tokens, extra keys such as cache_salt)).
Two kinds of key, in disjoint integer ranges:
- shared-content blocks (entirely inside the request's hashed region: its prompt's, and the
  reply's where the trace describes it): a non-negative chained hash of (parent key, the hash
  ids the block covers); the root folds in cache_salt and the trace's hash_block_tokens. Equal
  keys <=> equal content chains (up to 64-bit collisions).
- blocks holding any request-unique position: -(request index * 2**32 + block index) - 1.
  Only the same request (after a preemption) can ever look such a block up.
Python's hash of ints and tuples is not randomised, so keys are deterministic across runs.

With `lookahead` (vLLM's num_hash_lookahead_tokens, 1 under EAGLE-family speculative decoding
with prefix caching, K under multi-module MTP), a block's key also covers the tokens after it,
which the drafter's KV at the block's last positions depends on: a block is shared content only
if those tokens are too. With `reprefillable` (multi-module MTP's K - 1, vLLM's
num_reprefillable_tokens) the last tokens of what has been computed are not final yet (the
drafter may prefill them again), so the blocks holding them are not cached.
"""

from __future__ import annotations

import hashlib

from simkv.core.request import Request

_MASK63 = (1 << 63) - 1
_UNIQUE_SHIFT = 32


def content_namespace(cache_salt: str | None, lora_name: str | None) -> str | None:
    """What a request's blocks are shared within: its cache_salt and its LoRA adapter (vLLM puts
    both into the block hashes' extra keys). None for neither; the salt alone when no adapter."""
    if lora_name is None:
        return cache_salt
    return f"{cache_salt or ''}\x1flora:{lora_name}"


def salt_root(cache_salt: str | None, hash_block_tokens: int) -> int:
    """Root of a request's chain: folds in cache_salt so only equal salts share blocks."""
    salt = 0
    if cache_salt is not None:
        salt = int.from_bytes(hashlib.blake2b(cache_salt.encode(), digest_size=8).digest(), "little")
    return hash((0x5EED, salt, hash_block_tokens)) & _MASK63


def unique_block_key(request_index: int, block_index: int) -> int:
    return -((request_index << _UNIQUE_SHIFT) | block_index) - 1


class BlockHasher:
    """Computes and memoises a request's block keys at one block size."""

    weak = False

    def __init__(self, block_size: int, hash_bits: int = 63, lookahead: int = 0, reprefillable: int = 0) -> None:
        self.block_size = block_size
        self.hash_mask = (1 << hash_bits) - 1 if hash_bits < 63 else _MASK63
        self.lookahead = lookahead
        self.reprefillable = reprefillable

    def num_shared_blocks(self, request: Request) -> int:
        """Blocks lying entirely inside the request's shared (hashed) prompt region (with the
        lookahead tokens after them)."""
        return max(request.num_shared_tokens - self.lookahead, 0) // self.block_size

    def num_content_blocks(self, request: Request) -> int:
        """Blocks with shared-content keys: the prompt's shared blocks and those of the reply
        the trace describes (findable by others once the request releases them)."""
        return max(request.num_content_tokens - self.lookahead, 0) // self.block_size

    def num_cacheable_blocks(self, request: Request, num_tokens: int) -> int:
        """Full blocks among the first `num_tokens` a coordinator caches: with lookahead keys
        (EAGLE family, MTP) only those whose next tokens are known, and none holding the last
        `reprefillable` of them. (A steady decoder's request.num_tokens lags its progress; steady
        decoders run without lookahead keys, as speculative decoding has none, so the cap
        applies only with them.)"""
        if self.lookahead or self.reprefillable:  # (vLLM: the known tokens, less the reprefillable)
            num_tokens = min(num_tokens, request.num_tokens) - self.reprefillable
            num_tokens = min(num_tokens, request.num_tokens - self.lookahead)
        return max(num_tokens, 0) // self.block_size

    def num_hashed_blocks(self, request: Request, num_tokens: int) -> int:
        """Full blocks among the first `num_tokens` whose key exists (the lookahead tokens
        after them known too) and which hold none of their last `reprefillable`."""
        known = request.num_tokens
        return max(min(min(num_tokens, known) - self.reprefillable, known - self.lookahead), 0) // self.block_size

    def num_group_prompt_blocks(self, request: Request) -> int:
        """A fanned-out request's blocks keyed as its group's prompt: not one whose lookahead
        token is the member's own first output."""
        return (request.num_prompt_tokens - self.lookahead) // self.block_size

    def block_key(self, request: Request, block_index: int) -> int:
        """Key of the request's `block_index`-th block (which must be full)."""
        hashes = request.block_hashes
        if block_index < len(hashes):
            return hashes[block_index]
        self._extend(request, block_index + 1)
        return hashes[block_index]

    def _extend(self, request: Request, num_blocks: int) -> None:
        """Memoise keys up to `num_blocks`; the content keys all at once on the first call (they
        depend on the trace's ids only, and a request's blocks are asked for one by one)."""
        hashes = request.block_hashes
        bs = self.block_size
        n_content = self.num_content_blocks(request)
        i = len(hashes)
        if i < n_content:
            ids = request.shared_hash_ids
            h = request.hash_block_tokens
            parent = hashes[-1] if hashes else salt_root(request.cache_salt, h)
            mask = self.hash_mask
            stop = n_content
            if self.lookahead:  # (the token after the block: vLLM's EAGLE family; the K after it: multi-module MTP)
                more = self.lookahead - 1
                while i < stop:
                    first, last, nxt = (i * bs) // h, ((i + 1) * bs - 1) // h, (i + 1) * bs
                    after = tuple(ids[nxt // h:(nxt + more) // h + 1].tolist()) if more else int(ids[nxt // h])
                    parent = hash((parent, tuple(ids[first:last + 1].tolist()), (i * bs) % h, after, nxt % h)) & mask
                    hashes.append(parent)
                    i += 1
            elif bs <= h and h % bs == 0:
                per = h // bs
                first = i // per
                id_list = ids[first:(stop - 1) // per + 1].tolist()  # (Python ints: fast to index)
                while i < stop:
                    parent = hash((parent, id_list[i // per - first])) & mask
                    hashes.append(parent)
                    i += 1
            else:
                while i < stop:
                    first, last = (i * bs) // h, ((i + 1) * bs - 1) // h
                    parent = hash((parent, tuple(ids[first:last + 1].tolist()), (i * bs) % h)) & mask
                    hashes.append(parent)
                    i += 1
        if i < num_blocks and request.prompt_owner != request.index:  # (fan-out: the prompt is its group's)
            stop = min(num_blocks, self.num_group_prompt_blocks(request))
            top = -(request.prompt_owner << _UNIQUE_SHIFT) - 1
            hashes.extend(range(top - i, top - stop, -1))
            i = max(i, stop)
        if i < num_blocks:
            top = -(request.index << _UNIQUE_SHIFT) - 1  # unique_block_key(index, i) == top - i
            hashes.extend(range(top - i, top - num_blocks, -1))


class WeakBlockHasher(BlockHasher):
    """A deliberately weak block hash (`prefix_caching_hash_bits` < 63), to show what it costs.

    Every block, unique content included, gets a chained key of only `hash_bits` bits, so blocks
    of different content collide; the true 63-bit chain is kept beside it to detect the false hits
    that a real engine would serve silently (another request's KV for this request's tokens).
    """

    weak = True

    def __init__(self, block_size: int, hash_bits: int) -> None:
        super().__init__(block_size, 63)
        self.weak_mask = (1 << hash_bits) - 1
        self._true: dict[int, list[int]] = {}

    def num_shared_blocks(self, request: Request) -> int:
        return 1 << 62  # any block may collide with any other: all are looked up and cached

    def true_key(self, request: Request, block_index: int) -> int:
        self.block_key(request, block_index)
        return self._true[request.index][block_index]

    def forget(self, request: Request) -> None:
        self._true.pop(request.index, None)

    def fork(self, parent: Request, child: Request) -> None:
        """A forked sequence takes its parent's keys of the prompt blocks it shares: the weak
        ones come with its block_hashes, the true ones here, aligned with them."""
        self._true[child.index] = self._true.get(parent.index, [])[:len(child.block_hashes)]

    def _content(self, request: Request, i: int) -> tuple:
        bs = self.block_size
        if (i + 1) * bs <= request.num_content_tokens:
            h = request.hash_block_tokens
            first, last = (i * bs) // h, ((i + 1) * bs - 1) // h
            return tuple(request.shared_hash_ids[first:last + 1].tolist()) + ((i * bs) % h,)
        owner = request.prompt_owner if (i + 1) * bs <= request.num_prompt_tokens else request.index  # (fan-out)
        return (-1 - owner, i)

    def _extend(self, request: Request, num_blocks: int) -> None:
        weak = request.block_hashes
        true = self._true.setdefault(request.index, [])
        root = salt_root(request.cache_salt, request.hash_block_tokens)
        tp = true[-1] if true else root
        wp = weak[-1] if weak else root & self.weak_mask
        for i in range(len(weak), num_blocks):
            content = self._content(request, i)
            tp = hash((tp, content)) & _MASK63
            wp = hash((wp, content)) & self.weak_mask
            true.append(tp)
            weak.append(wp)
