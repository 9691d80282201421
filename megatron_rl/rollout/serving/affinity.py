"""Prefix affinity: send a request to the server that last served the longest prefix of its tokens,
so its prefix cache (vLLM's automatic prefix caching) holds the shared part and only the rest is
prefilled.

    table = PrefixTable()
    k = table.lookup(prompt)                  # a server index, or None: no known prefix
    table.record(prompt + response, server)   # after the request: its tokens live in that server's cache

Who shares a prefix: the n samples of one prompt (the prompt), and the turns of one multi-turn
trajectory (turn k+1's prompt is turn k's prompt, response and the observation after it). Keys
are hashes of the token prefix at every BLOCK tokens (a chain: block b's key hashes block b-1's
key with its own tokens) plus one of the whole sequence, so a lookup finds the longest recorded
prefix that ends at a block boundary (vLLM's prefix cache reuses whole blocks only) or, for a
prompt's other samples, the whole prompt. The table keeps at most
`capacity` keys, the least recently used dropped first (a server's cache evicts too; a stale
entry only costs a prefill, never a wrong sample: placement never changes a sample, each request
carries its own seed).

Cost: O(len / BLOCK) hashes per lookup and record, O(capacity) memory; nothing grows with the
model.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

# tokens per key: vLLM's default KV-cache block size on a GPU. A server with larger blocks (a CPU
# server's default is 128; any multiple of 16) caches whole blocks of the same prefixes, so the
# server with the longest known 16-token-aligned prefix is also the one with the most cached blocks
# of it; only a match shorter than one of its blocks finds nothing cached there.
BLOCK = 16


def prefix_keys(tokens: Sequence[int]) -> list[tuple[int, bytes]]:
    """(length, key) of every BLOCK-aligned prefix of `tokens`, then of the whole sequence if it is
    not aligned; longest last. Equal prefixes give equal keys whatever follows them."""
    out, key = [], b""
    for end in range(BLOCK, len(tokens) + 1, BLOCK):
        key = _chain(key, tokens[end - BLOCK:end])
        out.append((end, key))
    if len(tokens) % BLOCK:
        out.append((len(tokens), _chain(key, tokens[len(tokens) - len(tokens) % BLOCK:], whole=True)))
    return out


def _chain(prev: bytes, block: Sequence[int], whole: bool = False) -> bytes:
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(b"w" if whole else b"b")
    h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in block))
    return h.digest()


class PrefixTable:
    """Prefix key -> the server index that last held it (LRU, at most `capacity` keys). Not locked:
    ServerPool calls it under its own lock."""

    def __init__(self, capacity: int = 1 << 16):
        self.capacity = capacity
        self._owner: OrderedDict[bytes, int] = OrderedDict()

    def lookup(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """(server index, matched tokens) of the longest recorded prefix of `tokens`, or None."""
        for length, key in reversed(prefix_keys(tokens)):
            owner = self._owner.get(key)
            if owner is not None:
                self._owner.move_to_end(key)
                return owner, length
        return None

    def record(self, tokens: Sequence[int], server: int) -> None:
        """`tokens` (a request's prompt and, once known, its response) are in `server`'s cache."""
        for _, key in prefix_keys(tokens):
            self._owner[key] = server
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, server: int) -> None:
        """Drop every key of `server` (it restarted: its cache is empty)."""
        for key in [k for k, v in self._owner.items() if v == server]:
            del self._owner[key]

    def __len__(self) -> int:
        return len(self._owner)
