# The types of the compiled module table_loops.c (for mypy; the C function table's docstrings say the same).
# Every array is a C-contiguous numpy array, a tensor's .numpy(); outputs are written in place.
import numpy

_Array = numpy.ndarray

def find(buckets: _Array, ids: _Array, out: _Array, /) -> None: ...
def insert(buckets: _Array, ids: _Array, values: _Array, /) -> None: ...
def remove(buckets: _Array, ids: _Array, out: _Array, /) -> int: ...
def mix64(src: _Array, dst: _Array, /) -> None: ...
def server_of(ids: _Array, word: int, servers: int, out: _Array, /) -> None: ...
def placement(ids: _Array, word: int, servers: int, server: int, /) -> tuple[int, int]: ...
def hashed_uniform(
    ids: _Array, slots: _Array, seed: int, word: int, denominator: float, wide: bool, dim: int, out: _Array, /
) -> None: ...
def touch(
    last_step: _Array, changed: _Array, lookups: _Array, slots: _Array, counts: _Array, step: int, out: _Array, /
) -> tuple[int, int]: ...
def claim(
    free: _Array,
    free_top: int,
    ids: _Array,
    id: _Array,
    changed: _Array,
    held: _Array,
    last_step: _Array,
    arrival: int,
    zeroed: _Array,
    out: _Array,
    /,
) -> int: ...
def live(
    log_slots: _Array,
    log_steps: _Array,
    held: _Array,
    last_step: _Array,
    lookups: _Array,
    wanted: int,
    out_slots: _Array,
    out_steps: _Array,
    /,
) -> int: ...
def oldest(
    log_slots: _Array,
    log_steps: _Array,
    head: int,
    tail: int,
    held: _Array,
    last_step: _Array,
    lookups: _Array,
    wanted: int,
    ids: _Array,
    count: int,
    out_slots: _Array,
    out_steps: _Array,
    out_ids: _Array,
    /,
) -> tuple[int, int]: ...
def order(log_slots: _Array, log_steps: _Array, start: int, end: int, ids: _Array, /) -> None: ...
