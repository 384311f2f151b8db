"""Block pool: owns every KV block, the free queue and the prefix-cache hash map.

Invariants (checked by `BlockPool.check_invariants` in tests):
- block 0 is the null block; it is never in the free queue and never handed out.
- a block with ref_cnt > 0 is never in the free queue; a block with ref_cnt == 0 always is.
  Exception: blocks inside a `BlockChunk` of the free queue (a released request's private
  blocks, see below) are free while their ref_cnt still reads 1: the chunk, not the block,
  says they are free, so that handing them out and taking them back touches no block.
- a block's `block_hash` is set only while the block holds a full, cached block of content;
  it is dropped lazily, when the block is popped from the free queue for reuse (eviction).
- used + free == usable (num_gpu_blocks - 1) at all times.
"""

from __future__ import annotations

from typing import Iterable

#: Hash of a cached block whose content no request can ever look up again (a finished
#: request's unique tokens). It orders the free queue like any hash but is in no map.
UNFINDABLE_HASH = -(1 << 63) - 1


class KVCacheBlock:
    """One physical KV block. Carries its own free-queue links so removal is O(1)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block", "content_id")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.content_id = 0  # true content key, kept only under a weak block hash
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockChunk:
    """Free blocks that nobody can look up, released together, as ONE node of the free queue.

    A finished request's private blocks (its unique content; no other sequence holds them)
    keep their order in the queue but are linked, handed out and counted as a list slice
    instead of one by one. Inside the chunk every block has ref_cnt 1 and no hash, exactly
    what it must have when handed out. `hashed`: the blocks count as cached content (vLLM
    hashed them; handing one out is an eviction), else as never-cached blocks.
    """

    __slots__ = ("blocks", "pos", "last", "hashed", "prev_free_block", "next_free_block")

    def __init__(self, blocks: list[KVCacheBlock], hashed: bool) -> None:
        self.blocks = blocks
        self.pos = 0  # blocks[:pos] have been handed out
        self.last = len(blocks) - 1  # the index of the last block (the list never changes)
        self.hashed = hashed
        self.prev_free_block = None
        self.next_free_block = None

    def __len__(self) -> int:
        return len(self.blocks) - self.pos


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with fake head and tail nodes (part of BlockPool).

    Allocation pops from the head; `remove` takes a block out of the middle in O(1); released
    blocks arrive as linked chains at the front (reused first) or the back. A node is a block
    or a `BlockChunk` of blocks. BlockPool's hot loops (`get_new_blocks`, `free_blocks`) walk
    and link the nodes directly.
    """

    def __init__(self, blocks: list[KVCacheBlock], as_chunk: bool = False) -> None:
        """`as_chunk`: the blocks (never used, so nobody can look them up) form one BlockChunk
        node, in order; else one node each."""
        self.num_free_blocks = len(blocks)
        self.fake_head = KVCacheBlock(-1)
        self.fake_tail = KVCacheBlock(-1)
        prev = self.fake_head
        if as_chunk and blocks:
            for block in blocks:
                block.ref_cnt = 1  # a chunk's blocks carry the state they are handed out in
            blocks = [BlockChunk(blocks, hashed=False)]
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = prev

    def expand_chunks(self) -> None:
        """Relink every chunk's remaining blocks as single nodes, in place, in the state a one
        by one release leaves them in (tests compare the two representations)."""
        node = self.fake_head.next_free_block
        while node is not self.fake_tail:
            nxt = node.next_free_block
            if type(node) is BlockChunk:
                prev = node.prev_free_block
                for block in node.blocks[node.pos:]:
                    block.ref_cnt = 0
                    block.block_hash = UNFINDABLE_HASH if node.hashed else None
                    prev.next_free_block = block
                    block.prev_free_block = prev
                    prev = block
                prev.next_free_block = nxt
                nxt.prev_free_block = prev
            node = nxt

    def remove(self, block: KVCacheBlock) -> None:
        """Take a free block out of the queue (a prefix hit; never a chunk's block)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def prepend_chain(self, head: KVCacheBlock, tail: KVCacheBlock, count: int) -> None:
        """Put a linked chain head..tail of `count` blocks at the front (head becomes first)."""
        first = self.fake_head.next_free_block
        self.fake_head.next_free_block = head
        head.prev_free_block = self.fake_head
        tail.next_free_block = first
        first.prev_free_block = tail
        self.num_free_blocks += count

    def append_chain(self, head: KVCacheBlock, tail: KVCacheBlock, count: int) -> None:
        """Put a linked chain head..tail of `count` blocks at the back (tail becomes last)."""
        last = self.fake_tail.prev_free_block
        last.next_free_block = head
        head.prev_free_block = last
        tail.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = tail
        self.num_free_blocks += count

    def nodes(self) -> list:
        """The queue's nodes (blocks and chunks) from head to tail (tests, debugging; O(n))."""
        out = []
        node = self.fake_head.next_free_block
        while node is not self.fake_tail:
            out.append(node)
            node = node.next_free_block
        return out

    def blocks(self) -> list[KVCacheBlock]:
        """Free blocks from head to tail, chunks expanded (tests, debugging; O(n))."""
        out = []
        for node in self.nodes():
            if type(node) is BlockChunk:
                out.extend(node.blocks[node.pos:])
            else:
                out.append(node)
        return out

    def block_ids(self) -> list[int]:
        """Free block ids from head to tail (tests, debugging; O(n))."""
        return [block.block_id for block in self.blocks()]


class BlockHashToBlockMap:
    """Prefix cache: block hash -> one block, or {block_id: block} when duplicates exist.

    Identical content computed by two requests at once yields two blocks with one hash;
    both stay cached (block tables are append-only), and a lookup returns the first.
    """

    def __init__(self) -> None:
        self._cache: dict[int, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def __len__(self) -> int:
        return len(self._cache)

    def get_one_block(self, key: int) -> KVCacheBlock | None:
        blocks = self._cache.get(key)
        if blocks is None or type(blocks) is KVCacheBlock:
            return blocks
        return next(iter(blocks.values()))

    def insert(self, key: int, block: KVCacheBlock) -> None:
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif type(blocks) is KVCacheBlock:
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}
        else:
            blocks[block.block_id] = block

    def pop(self, key: int, block_id: int) -> None:
        blocks = self._cache.get(key)
        if blocks is None:
            return
        if type(blocks) is KVCacheBlock:
            if blocks.block_id == block_id:
                del self._cache[key]
            return
        blocks.pop(block_id, None)
        if not blocks:
            del self._cache[key]
        elif len(blocks) == 1:
            self._cache[key] = next(iter(blocks.values()))


def _chain_append(head, tail, node):
    """Link `node` after `tail` of a chain being built; returns the chain's (head, tail)."""
    if tail is None:
        return node, node
    tail.next_free_block = node
    node.prev_free_block = tail
    return head, node


class BlockPool:
    """All KV blocks of one pool: allocation, release, prefix-cache insertion and lookup."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, reserve_null_block: bool = True) -> None:
        first = 1 if reserve_null_block else 0
        if num_gpu_blocks < first + 1:
            raise ValueError(f"num_gpu_blocks must be at least {first + 1}, got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        # the never-used blocks start as one chunk: the first pass over the pool slices it
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[first:], as_chunk=True)
        self.null_block = self.blocks[0] if reserve_null_block else None
        if self.null_block is not None:
            self.null_block.ref_cnt = 1  # never freed, never handed out
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.num_usable_blocks = num_gpu_blocks - first
        # Counters the replay reports.
        self.num_evictions = 0

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, as a new engine's pool has none (vLLM's name); only with
        no block in use. False, with nothing changed, if some block is."""
        if self.get_num_used_blocks():
            return False
        for block in self.blocks:
            block.block_hash = None
            block.content_id = 0
        self.cached_block_hash_to_block._cache.clear()
        node = self.free_block_queue.fake_head.next_free_block
        while node is not self.free_block_queue.fake_tail:
            if type(node) is BlockChunk:
                node.hashed = False  # (handing its blocks out evicts nothing now)
            node = node.next_free_block
        return True

    def get_num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.free_block_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the head of the free queue, evicting any cached content."""
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        node = queue.fake_head.next_free_block
        if type(node) is BlockChunk and (pos := node.pos) + num_blocks <= node.last:
            # the commonest case: a slice of the chunk at the head, which stays there
            node.pos = pos + num_blocks
            queue.num_free_blocks -= num_blocks
            if node.hashed:
                self.num_evictions += num_blocks
            return node.blocks[pos:pos + num_blocks]
        out: list[KVCacheBlock] = []
        append = out.append
        cache = self.cached_block_hash_to_block
        cached = cache._cache
        need = num_blocks
        while need:
            if type(node) is BlockChunk:
                pos, chunk_blocks = node.pos, node.blocks
                left = len(chunk_blocks) - pos
                take = need if need < left else left
                out += chunk_blocks[pos:pos + take] if pos or take < left else chunk_blocks
                if node.hashed:
                    self.num_evictions += take
                need -= take
                if take < left:
                    node.pos = pos + take
                    break  # the chunk stays at the head
                nxt = node.next_free_block
                node.next_free_block = None  # a used-up chunk links to nothing: freed without the GC
                node = nxt
                continue
            block_hash = node.block_hash
            if block_hash is not None:
                if block_hash != UNFINDABLE_HASH:
                    if cached.get(block_hash) is node:  # (the common case: the one block of its hash)
                        del cached[block_hash]
                    else:
                        cache.pop(block_hash, node.block_id)
                node.block_hash = None
                self.num_evictions += 1
            node.ref_cnt = 1  # its stale free-queue links are never read while referenced
            append(node)
            need -= 1
            node = node.next_free_block
        queue.fake_head.next_free_block = node
        node.prev_free_block = queue.fake_head
        queue.num_free_blocks -= num_blocks
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash != UNFINDABLE_HASH:
            self.cached_block_hash_to_block.pop(block.block_hash, block.block_id)
        block.block_hash = None
        self.num_evictions += 1

    def get_new_block(self) -> KVCacheBlock:
        """Pop one block from the head of the free queue (the hot path of decode)."""
        queue = self.free_block_queue
        head = queue.fake_head
        node = head.next_free_block
        if node is queue.fake_tail:
            raise ValueError("No free blocks available")
        queue.num_free_blocks -= 1
        if type(node) is BlockChunk:
            pos = node.pos
            block = node.blocks[pos]
            pos += 1
            if pos == len(node.blocks):
                nxt = node.next_free_block
                head.next_free_block = nxt
                nxt.prev_free_block = head
                node.next_free_block = None  # see get_new_blocks
            else:
                node.pos = pos
            if node.hashed:
                self.num_evictions += 1
            return block
        nxt = node.next_free_block
        head.next_free_block = nxt
        nxt.prev_free_block = head
        if node.block_hash is not None:
            self._evict(node)
        node.ref_cnt = 1
        return node

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get_one_block(block_hash)

    def cache_blocks(self, blocks: list[KVCacheBlock], keys: list[int], start: int, end: int) -> None:
        """`cache_block(blocks[i], keys[i])` for the blocks of [start, end) not cached yet (a
        request's caching loop, with the map's common case inline)."""
        cached = self.cached_block_hash_to_block._cache
        insert = self.cached_block_hash_to_block.insert
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is None:
                key = keys[i]
                block.block_hash = key
                if key in cached:
                    insert(key, block)  # (another block holds this content already)
                else:
                    cached[key] = block

    def cache_block(self, block: KVCacheBlock, block_hash: int, insert: bool = True) -> None:
        """Mark a full block as cached. `insert=False` records the hash without making the
        block findable: used for content no request can ever look up again."""
        block.block_hash = block_hash
        if insert:
            self.cached_block_hash_to_block.insert(block_hash, block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the free queue."""
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: list[KVCacheBlock], unfindable: tuple[int, int] = (0, 0),
                    private: tuple[int, int, bool] | None = None) -> None:
        """Drop one reference from each block, first block = first to be evicted.

        Blocks reaching ref_cnt 0 without a hash (or with caching off) go to the FRONT of
        the free queue; hashed blocks go to the BACK, in LRU order. Blocks at positions
        [unfindable[0], unfindable[1]) get UNFINDABLE_HASH on the way (full blocks of a
        finished request whose content nobody can look up).

        `private` = (lo, hi, hashed): the blocks at [lo, hi) are held by this request alone
        and have no findable content; they go into the queue as one BlockChunk, at the back
        if `hashed` (they count as cached, unfindable content) else at the front. Same queue
        order as one by one, without touching them. The chunk takes `ordered_blocks` itself
        (cut to [lo, hi)): the caller gives the list up.
        """
        queue = self.free_block_queue
        caching = self.enable_caching
        lo, hi = unfindable
        # Build the two chains in place: front chain (to prepend) and back chain (to append).
        front_head = front_tail = back_head = back_tail = None
        num_front = num_back = 0
        if private is not None and private[1] > private[0]:
            plo, phi, hashed = private
            # the chunk keeps the list itself, cut down to [plo, phi) in place: no block is touched
            head, tail = ordered_blocks[:plo], ordered_blocks[phi:]
            del ordered_blocks[phi:], ordered_blocks[:plo]
            segments = ((head, 0, False), (ordered_blocks, plo, True), (tail, phi, False))
        else:
            segments = ((ordered_blocks, 0, False),)
        for seg_blocks, offset, is_chunk in segments:
            if is_chunk:
                node = BlockChunk(seg_blocks, hashed)
                if hashed and caching:
                    back_head, back_tail = _chain_append(back_head, back_tail, node)
                    num_back += phi - plo
                else:
                    front_head, front_tail = _chain_append(front_head, front_tail, node)
                    num_front += phi - plo
                continue
            for i, block in enumerate(seg_blocks, offset):
                block.ref_cnt -= 1
                if lo <= i < hi and block.block_hash is None:
                    block.block_hash = UNFINDABLE_HASH
                if block.ref_cnt:
                    continue
                if block.block_hash is None or not caching:
                    if front_tail is None:
                        front_head = block
                    else:
                        front_tail.next_free_block = block
                        block.prev_free_block = front_tail
                    front_tail = block
                    num_front += 1
                else:
                    if back_tail is None:
                        back_head = block
                    else:
                        back_tail.next_free_block = block
                        block.prev_free_block = back_tail
                    back_tail = block
                    num_back += 1
        if num_front:
            queue.prepend_chain(front_head, front_tail, num_front)
        if num_back:
            queue.append_chain(back_head, back_tail, num_back)

    def check_invariants(self) -> None:
        """Assert the pool invariants (O(num blocks); tests only)."""
        queue = self.free_block_queue
        prev, node = queue.fake_head, queue.fake_head.next_free_block
        while node is not None:
            assert node.prev_free_block is prev, f"broken back link at {node}"
            assert type(node) is not BlockChunk or len(node) > 0, "empty chunk in free queue"
            prev, node = node, node.next_free_block
        assert prev is queue.fake_tail, "free queue does not end at its tail"
        free_ids = queue.block_ids()
        assert len(free_ids) == self.free_block_queue.num_free_blocks, "free count drifted"
        assert len(set(free_ids)) == len(free_ids), "block twice in free queue"
        free_set = set(free_ids)
        in_chunk = set()
        for node in queue.nodes():
            if type(node) is BlockChunk:
                for block in node.blocks[node.pos:]:
                    assert block.ref_cnt == 1 and block.block_hash is None, f"chunk block in a wrong state: {block}"
                    in_chunk.add(block.block_id)
        first = 0 if self.null_block is None else 1
        assert first == 0 or 0 not in free_set, "null block in free queue"
        for block in self.blocks[first:]:
            assert block.ref_cnt >= 0, f"negative ref count on {block}"
            if block.block_id in in_chunk:
                continue
            if block.ref_cnt > 0:
                assert block.block_id not in free_set, f"referenced block in free queue: {block}"
            else:
                assert block.block_id in free_set, f"unreferenced block not free: {block}"
        assert self.get_num_used_blocks() + self.get_num_free_blocks() == self.num_usable_blocks
