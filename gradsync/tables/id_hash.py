"""A fixed 64-bit hash of int64 ids, over tensors: where an id sits in an `IdIndex`, whether a sighting
admits it, and the default initial row of a dynamic table all derive from it.

`mix64` is SplitMix64's finaliser (Steele, Lea, Flood 2014) on the id's two's-complement bits (compiled, beside
the id index's loops); `keyed(ids, *words)` folds further words in, one `mix64` each.
Being a fixed function of the id (no per-process salt), it gives the same answer in every process, under every
strategy and arrival order.
"""

from __future__ import annotations

import torch

from gradsync.tables import _table_loops

_MASK = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    value &= _MASK
    return value - (1 << 64) if value >> 63 else value


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's `>>` on int64 keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 of each int64 value (any shape): a bijection of the 64-bit patterns that scatters neighbouring
    ids. Compiled with the id index (`tables/table_loops.c`), which places ids by the same function."""
    src = x.to("cpu", torch.int64).contiguous()
    out = torch.empty_like(src)
    _table_loops.mix64(src.numpy(), out.numpy())
    return out.to(x.device)


def keyed(ids: torch.Tensor, *words: int | torch.Tensor) -> torch.Tensor:
    """mix64 of the ids, then each word xor-ed in and mixed again: `mix64(...mix64(mix64(ids) ^ w1)... ^ wn)`.
    A word is a Python int (taken as its low 64 bits) or an int64 tensor that broadcasts against the ids."""
    h = mix64(ids.long())
    for word in words:
        h = mix64(h ^ (_signed(word) if isinstance(word, int) else word))
    return h


def unit_interval(h: torch.Tensor) -> torch.Tensor:
    """The top 53 bits of each hash as a float64 in [0, 1): exact, the same on every machine."""
    return _shr(h, 11).double() * 2.0**-53


_SERVER_WORD = 0x736572766572  # b"server": keeps placement apart from the index's buckets and the other streams


def server_of(ids: torch.Tensor, num_servers: int) -> torch.Tensor:
    """The server (0 .. num_servers - 1) that holds each id of a dynamic table: `keyed(id, b"server")`'s top 63
    bits modulo the servers, so that strided or adversarial ids spread, and the ids a server holds fill its
    `IdIndex` buckets evenly (those start at `mix64(id)`, a different stream). Compiled, as `mix64`."""
    src = ids.to("cpu", torch.int64).contiguous()
    out = torch.empty_like(src)
    _table_loops.server_of(src.numpy(), _SERVER_WORD, num_servers, out.numpy())
    return out.to(ids.device)


def misplaced(ids: torch.Tensor, num_servers: int, server: int) -> tuple[int, int]:
    """For the ids sent to `server` (1-D int64): the position of the first that is not above the one before it,
    and of the first that `server_of` places on another server; -1 where none. One compiled pass."""
    return _table_loops.placement(ids.contiguous().numpy(), _SERVER_WORD, num_servers, server)
