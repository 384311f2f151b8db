"""KV offloading's CPU tier under vLLM's "arc" eviction policy (`--kv-offloading-policy arc`,
vLLM's kv_connector_extra_config `eviction_policy`): its CPUOffloadingManager with the
ARCCachePolicy, the same interface as core/kv_offload.py's CPUOffloadManager.

Adaptive replacement: T1 holds chunks stored and not yet reused, T2 chunks a request reused
(loaded, or offered again while resident); B1 and B2 remember the keys last evicted from each
(at most the tier's size). A store of a key remembered in B1 grows T1's target, one in B2
shrinks it (once per request and key). Evictions take T1's least recent chunks while T1 holds
at least its target, T2's otherwise (then T1's if T2 has none idle). A request's accesses take
effect when it finishes, tail first: chunks it reused move to T2's most recent end, chunks it
only stored to their own list's.
"""

from __future__ import annotations

from collections import OrderedDict

_PENDING = -1  # a chunk's reference count while its store is in flight (vLLM's not-ready)


class ARCOffloadManager:
    def __init__(self, num_chunks: int, admission=None) -> None:
        self.num_chunks = num_chunks
        self.admission = admission  # (core/kv_offload.py's StoreAdmission: vLLM's store_threshold)
        self.t1: OrderedDict[int, list[int]] = OrderedDict()  # key -> [ref_cnt]
        self.t2: OrderedDict[int, list[int]] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()
        self.target_t1 = 0.0
        self._num_evictable = 0
        self.num_evictions = 0

    def _get(self, key: int) -> list[int] | None:
        return self.t1.get(key) or self.t2.get(key)

    @property
    def chunks(self) -> dict:
        return {**self.t1, **self.t2}

    @property
    def num_used(self) -> int:
        return len(self.t1) + len(self.t2)

    def lookup(self, key: int) -> int:
        """0: miss, 1: readable, 2: its store is in flight."""
        chunk = self._get(key)
        if chunk is None:
            return 0
        return 2 if chunk[0] == _PENDING else 1

    def held_run(self, keys) -> tuple[int, bool]:
        """How many of `keys`, in order, the tier holds before the first it lacks, and whether
        one of those is still being stored."""
        count, pending = 0, False
        for key in keys:
            found = self.lookup(key)
            if not found:
                break
            count += 1
            pending |= found == 2
        return count, pending

    # ---- loads --------------------------------------------------------------------------------
    def prepare_load(self, keys: list[tuple[int, int]], access) -> None:
        for _, key in keys:
            chunk = self._get(key)
            if chunk[0] == 0:
                self._num_evictable -= 1
            chunk[0] += 1
        self._record(keys, access, reused=[k for _, k in keys])

    def complete_load(self, keys: list[int]) -> None:
        for key in keys:
            chunk = self._get(key)
            chunk[0] -= 1
            if chunk[0] == 0:
                self._num_evictable += 1

    # ---- stores -------------------------------------------------------------------------------
    def prepare_store(self, keys: list[tuple[int, int]], access) -> list[int] | None:
        """The keys a store job writes (those the tier lacks, and its admission takes); None if
        the tier cannot make room."""
        to_store, ready = [], []
        for p, k in keys:
            chunk = self._get(k)
            if chunk is None:
                to_store.append((p, k))
            elif chunk[0] != _PENDING:
                ready.append((p, k))
        if self.admission is not None:
            to_store = self.admission.offer(keys, to_store)
        misses = [k for _, k in to_store if k not in access.store_misses]
        for key in reversed(misses):  # (the ghost lists teach the target, once per request and key)
            self._adapt(key)
        access.store_misses.update(misses)
        recorded = {k for _, k in to_store} | {k for _, k in ready}
        self._record([(p, k) for p, k in keys if k in recorded], access, reused=[k for _, k in ready])
        if not to_store:
            return []
        need = len(to_store) - (self.num_chunks - self.num_used)
        if need > 0:
            if need > self._num_evictable or not self._evict(need, {k for _, k in keys}):
                return None
        for _, key in to_store:
            self.t1[key] = [_PENDING]
            self.b1.pop(key, None)
            self.b2.pop(key, None)
        access.inserted.update(k for _, k in to_store)
        return [k for _, k in to_store]

    def complete_store(self, keys: list[int]) -> None:
        for key in keys:
            chunk = self._get(key)
            if chunk is not None and chunk[0] == _PENDING:
                chunk[0] = 0
                self._num_evictable += 1

    def _adapt(self, key: int) -> None:
        if key in self.b1:
            self.target_t1 = min(self.target_t1 + max(1, len(self.b2) / len(self.b1)), self.num_chunks)
            self.b1.move_to_end(key)
        elif key in self.b2:
            self.target_t1 = max(self.target_t1 - max(1, len(self.b1) / len(self.b2)), 0)
            self.b2.move_to_end(key)

    def _evict(self, n: int, protected: set[int]) -> bool:
        """Evict exactly n idle chunks not in `protected`, or none (False)."""
        def idle(entries):
            for key, chunk in entries:
                if chunk[0] == 0 and key not in protected:
                    return key
            return None

        picked: list[tuple[int, bool]] = []  # (key, from T1)
        t1_size = len(self.t1)
        t1_iter, t2_iter = iter(self.t1.items()), iter(self.t2.items())
        for _ in range(n):
            key = None
            if t1_size >= int(self.target_t1):
                key = idle(t1_iter)
                if key is not None:
                    picked.append((key, True))
                    t1_size -= 1
                    continue
            key = idle(t2_iter)
            if key is not None:
                picked.append((key, False))
                continue
            key = idle(t1_iter)
            if key is None:
                return False
            picked.append((key, True))
            t1_size -= 1
        for key, from_t1 in picked:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        for ghost in (self.b1, self.b2):
            for _ in range(len(ghost) - self.num_chunks):
                ghost.popitem(last=False)
        self._num_evictable -= n
        self.num_evictions += n
        return True

    # ---- a request's accesses -----------------------------------------------------------------
    def _record(self, keys: list[tuple[int, int]], access, reused: list[int]) -> None:
        for p, k in keys:
            if k not in access.seen:
                access.seen.add(k)
                access.keys.append((p, k))
        access.reused.update(k for k in reused if k not in access.inserted)

    def request_finished(self, access) -> None:
        """Its accesses take effect, tail first (vLLM's on_request_finished)."""
        if access.finished:
            return
        access.finished = True
        only_inserted = access.inserted - access.reused
        for _, key in sorted(access.keys, reverse=True):
            if key in only_inserted:
                if key in self.t1:
                    self.t1.move_to_end(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)
            elif key in access.reused:
                if key in self.t1:
                    self.t2[key] = self.t1.pop(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)
