"""Page bookkeeping for the paged latent cache: allocator, prefix cache and host offload.

Pure Python over page numbers; the device arrays live in the engine (glm5_jax.model.paged_decode).

- Allocator: a page is free (no content worth keeping), in use (ref count > 0), or cached (ref 0
  but holding a full page of tokens known by its hash). `allocate` takes a free page first, else
  evicts the least recently released cached page.
- Prefix cache: a full page is keyed by a hash chain, hash(parent hash, the page's tokens), so a
  key names the page's tokens AND everything before them (what its latents depend on). `match`
  walks a prompt's chain and takes a reference on every page found, stopping at the first miss.
- Host offload (host_pages > 0): an evicted cached page is first copied to host memory with the
  `offload(page) -> data` callback (LRU, at most host_pages entries); a later `match` that finds
  a key only on the host allocates a device page and copies the data back with `reload(page,
  data)`.
- State snapshots (hybrid models, `StateSnapshots`): the KDA layers' state after a cached page's
  last token, in one of a fixed number of snapshot slots on the device, keyed by the page's hash.
  A prefix hit of a hybrid model ends at a page with a snapshot. A snapshot lives while its key
  is cached (on the device or the host): the allocator forgets it with the page; when every slot
  is taken the least recently used snapshot gives its slot up (its page stays cached, no longer
  an end of a hit).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable, Sequence

import numpy as np


def page_hashes(tokens: Sequence[int], page_size: int, count: int | None = None,
                parent: bytes = b"") -> list[bytes]:
    """Hash chain of the first `count` full pages of `tokens` (all full pages when None)."""
    full = len(tokens) // page_size
    count = full if count is None else min(count, full)
    hashes = []
    for index in range(count):
        page = np.asarray(tokens[index * page_size:(index + 1) * page_size], np.int64)
        parent = hashlib.blake2b(parent + page.tobytes(), digest_size=16).digest()
        hashes.append(parent)
    return hashes


class StateSnapshots:
    """Which page keys have a KDA state snapshot, in which of `capacity` snapshot slots (LRU)."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 snapshot, got {capacity}")
        self.capacity = capacity
        self._slot_of: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # oldest first
        self._free = collections.deque(range(capacity))
        self.saves = 0
        self.restores = 0
        self.evictions = 0

    @property
    def used(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot_of

    def take(self, key: bytes) -> int:
        """A snapshot slot for `key` (which has none yet): a free one, else the least recently used."""
        if self._free:
            slot = self._free.popleft()
        else:
            _, slot = self._slot_of.popitem(last=False)
            self.evictions += 1
        self._slot_of[key] = slot
        self.saves += 1
        return slot

    def use(self, key: bytes) -> int:
        """The snapshot slot of `key` (a hit restores from it; now the most recently used)."""
        self._slot_of.move_to_end(key)
        self.restores += 1
        return self._slot_of[key]

    def forget(self, key: bytes) -> None:
        """`key` left the prefix cache: its snapshot slot is free again."""
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._free.append(slot)


class PageAllocator:
    """Ref-counted pages with an LRU prefix cache and optional host offload (see module docs)."""

    def __init__(self, num_pages: int, *, host_pages: int = 0,
                 offload: Callable[[int], object] | None = None,
                 reload: Callable[[int, object], None] | None = None,
                 snapshots: StateSnapshots | None = None):
        if num_pages < 1 or host_pages < 0:
            raise ValueError(f"num_pages ({num_pages}) must be >= 1 and host_pages ({host_pages}) >= 0")
        if host_pages and (offload is None or reload is None):
            raise ValueError("host_pages > 0 needs the offload and reload callbacks")
        self.num_pages = num_pages
        self.host_pages = host_pages
        self._offload, self._reload = offload, reload
        self.snapshots = snapshots  # hybrid models: the KDA state snapshots of cached pages
        self.refs = np.zeros(num_pages, np.int64)
        self._free = collections.deque(range(num_pages))
        self._cached: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # oldest first
        self._page_of: dict[bytes, int] = {}  # every device page holding a hashed full page
        self._hash_of: dict[int, bytes] = {}
        self._host: collections.OrderedDict[bytes, object] = collections.OrderedDict()
        self.evictions = 0
        self.reloads = 0

    # ------------------------------------------------------------------ state
    @property
    def available(self) -> int:
        """Pages `allocate` can hand out now (free plus evictable cached)."""
        return len(self._free) + len(self._cached)

    @property
    def used(self) -> int:
        """Pages referenced by at least one sequence."""
        return self.num_pages - self.available

    @property
    def cached(self) -> int:
        """Unreferenced pages kept on the device for prefix hits."""
        return len(self._cached)

    @property
    def host_used(self) -> int:
        return len(self._host)

    def cached_hashes(self) -> list[bytes]:
        """Evictable cached pages' keys, least recently released first."""
        return list(self._cached)

    def on_host(self, key: bytes) -> bool:
        return key in self._host

    def knows(self, key: bytes) -> bool:
        """A device page or the host cache holds `key`."""
        return key in self._page_of or key in self._host

    # ------------------------------------------------------------------ operations
    def allocate(self) -> int | None:
        """A page with ref count 1, or None when every page is in use."""
        if self._free:
            page = self._free.popleft()
        elif self._cached:
            key, page = self._cached.popitem(last=False)
            self._evict(key, page)
        else:
            return None
        self.refs[page] = 1
        return page

    def _evict(self, key: bytes, page: int) -> None:
        del self._page_of[key], self._hash_of[page]
        self.evictions += 1
        if self.host_pages:
            self._host[key] = self._offload(page)
            self._host.move_to_end(key)
            while len(self._host) > self.host_pages:
                self._forget(self._host.popitem(last=False)[0])
        else:
            self._forget(key)

    def _forget(self, key: bytes) -> None:
        """`key` is cached nowhere any more."""
        if self.snapshots is not None:
            self.snapshots.forget(key)

    def release(self, page: int) -> None:
        """Drops one reference; an unreferenced hashed page stays cached (most recent last)."""
        if self.refs[page] <= 0:
            raise ValueError(f"page {page} released more often than it was taken")
        self.refs[page] -= 1
        if self.refs[page] == 0:
            key = self._hash_of.get(page)
            if key is None:
                self._free.append(page)
            else:
                self._cached[key] = page

    def register(self, page: int, key: bytes) -> None:
        """Marks an in-use page as holding the full page `key` (a no-op if another page already does)."""
        if key in self._page_of or page in self._hash_of:
            return
        self._page_of[key] = page
        self._hash_of[page] = key
        self._host.pop(key, None)  # the device copy is the one to keep now

    def match(self, keys: Sequence[bytes]) -> tuple[list[int], int]:
        """Takes a reference on the pages of the longest cached prefix of `keys` (device or host).

        Returns (pages, host_hits): pages[i] holds keys[i]; host_hits of them were copied back from
        host memory. Stops at the first key found nowhere, or when no page is left for a reload.
        """
        pages, host_hits = [], 0
        for key in keys:
            page = self._page_of.get(key)
            if page is not None:
                if self.refs[page] == 0:
                    del self._cached[key]
                self.refs[page] += 1
            elif key in self._host:
                page = self.allocate()
                if page is None:
                    break
                data = self._host.pop(key)
                self._reload(page, data)
                self._page_of[key], self._hash_of[page] = page, key
                host_hits += 1
                self.reloads += 1
            else:
                break
            pages.append(page)
        return pages, host_hits
