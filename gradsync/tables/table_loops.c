/* gradsync.tables._table_loops: a dynamic table's loops over ids, compiled (tens of nanoseconds an id where a
 * chain of batched tensor operations costs several times that): `mix64` and `server_of` (tables/id_hash.py), the
 * default initial rows (`HashedUniform`, tables/row_init.py), the id index's probes (`IdIndex`,
 * tables/id_index.py) and the recency log's scans (tables/recency_log.py, `_IdColumns.touch` in
 * tables/dynamic_table.py).
 *
 * Every function takes its arrays as writable or read-only buffers (numpy views of torch tensors), checks
 * their lengths against each other, and runs without the GIL.
 *
 * The id index is one array of `buckets` pairs (a power of two) of int64: (id, value), the value -1 in an empty
 * bucket (values are >= 0), so that a probe reads one cache line. An id starts at mix64(id) & (buckets - 1) and
 * probes linearly; the caller keeps the ids under half the buckets, so every probe ends at an empty bucket. A
 * removal shifts back the ids after it on their probes (Knuth's algorithm R for linear probing), so no bucket
 * is left marked deleted and a probe never walks past removed ids.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* SplitMix64's finaliser (Steele, Lea, Flood 2014): a bijection of the 64-bit patterns. */
static inline uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

typedef struct {
    int64_t id, value;  /* value -1: empty */
} Bucket;

typedef struct {
    Py_buffer view;
    Bucket *bucket;
    uint64_t mask;
} Table;

static void release(Py_buffer *views[], int count) {
    for (int i = 0; i < count; i++)
        if (views[i]->obj) PyBuffer_Release(views[i]);
}

/* A call's end: its buffers released, `result` returned (a new reference, or NULL with an error set). */
static PyObject *released(Py_buffer *views[], int count, PyObject *result) {
    release(views, count);
    return result;
}

/* Parses an index call's arguments (buckets, ids, other) by `format` and checks them: the index's buckets,
 * and ids and `other` (named `what` in the error) int64 arrays of one length. 0 with an error set and every
 * buffer released where they are not. */
static int index_call(PyObject *args, const char *format, const char *call, const char *what, Table *t,
                      Py_buffer *ids, Py_buffer *other) {
    Py_buffer *views[] = {&t->view, ids, other};
    if (!PyArg_ParseTuple(args, format, &t->view, ids, other)) return 0;
    Py_ssize_t buckets = t->view.len / (Py_ssize_t)sizeof(Bucket);
    if (t->view.len % sizeof(Bucket) || buckets == 0 || (buckets & (buckets - 1)))
        PyErr_SetString(PyExc_ValueError, "index buckets: int64 (id, value) pairs, a power of two of them");
    else if (ids->len != other->len || ids->len % 8)
        PyErr_Format(PyExc_ValueError, "%s: ids and %s must be int64 arrays of one length", call, what);
    else {
        t->bucket = t->view.buf;
        t->mask = (uint64_t)buckets - 1;
        return 1;
    }
    release(views, 3);
    return 0;
}

/* The bucket holding `id`, or -1. */
static inline int64_t bucket_of(const Table *t, int64_t id) {
    uint64_t pos = mix64((uint64_t)id) & t->mask;
    for (;;) {
        const Bucket *b = &t->bucket[pos];
        if (b->value < 0) return -1;
        if (b->id == id) return (int64_t)pos;
        pos = (pos + 1) & t->mask;
    }
}

/* find(buckets, ids, out): out[i] = the value of ids[i], -1 where absent. */
static PyObject *find(PyObject *self, PyObject *args) {
    Table t = {0};
    Py_buffer ids = {0}, out = {0};
    Py_buffer *views[] = {&t.view, &ids, &out};
    if (!index_call(args, "y*y*w*", "find", "out", &t, &ids, &out)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    const int64_t *id = ids.buf;
    int64_t *result = out.buf;
    Py_ssize_t n = ids.len / 8;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t at = bucket_of(&t, id[i]);
        result[i] = at < 0 ? -1 : t.bucket[at].value;
    }
    Py_END_ALLOW_THREADS
    return released(views, 3, Py_NewRef(Py_None));
}

/* insert(buckets, ids, values): each of the distinct absent ids, with its value, into the first empty bucket
 * along its probe; nothing where a value is negative. */
static PyObject *insert(PyObject *self, PyObject *args) {
    Table t = {0};
    Py_buffer ids = {0}, vals = {0};
    Py_buffer *views[] = {&t.view, &ids, &vals};
    Py_ssize_t bad = 0;
    if (!index_call(args, "w*y*y*", "insert", "values", &t, &ids, &vals)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    const int64_t *id = ids.buf, *value = vals.buf;
    Py_ssize_t n = ids.len / 8;
    for (Py_ssize_t i = 0; i < n && !bad; i++) bad = value[i] < 0;
    for (Py_ssize_t i = 0; i < n && !bad; i++) {
        uint64_t pos = mix64((uint64_t)id[i]) & t.mask;
        while (t.bucket[pos].value >= 0) pos = (pos + 1) & t.mask;
        t.bucket[pos].id = id[i];
        t.bucket[pos].value = value[i];
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "insert: values must be >= 0");
        return released(views, 3, NULL);
    }
    return released(views, 3, Py_NewRef(Py_None));
}

/* remove(buckets, ids, out): each present id leaves the index and its value goes to the front of out, in the
 * order of ids; returns how many were present. The ids after it on the run of full buckets move back into the
 * hole where their probe passes it. */
static PyObject *remove_ids(PyObject *self, PyObject *args) {
    Table t = {0};
    Py_buffer ids = {0}, out = {0};
    Py_buffer *views[] = {&t.view, &ids, &out};
    Py_ssize_t removed = 0;
    if (!index_call(args, "w*y*w*", "remove", "out", &t, &ids, &out)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    const int64_t *id = ids.buf;
    int64_t *result = out.buf;
    Bucket *bucket = t.bucket;
    Py_ssize_t n = ids.len / 8;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t at = bucket_of(&t, id[i]);
        if (at < 0) continue;
        result[removed++] = bucket[at].value;
        uint64_t hole = (uint64_t)at, pos = hole;
        for (;;) {
            pos = (pos + 1) & t.mask;
            if (bucket[pos].value < 0) break;
            uint64_t home = mix64((uint64_t)bucket[pos].id) & t.mask;
            if (((pos - home) & t.mask) >= ((pos - hole) & t.mask)) {  /* its probe passes the hole */
                bucket[hole] = bucket[pos];
                hole = pos;
            }
        }
        bucket[hole].value = -1;
    }
    Py_END_ALLOW_THREADS
    return released(views, 3, PyLong_FromSsize_t(removed));
}

/* mix64(src, dst): dst[i] = mix64(src[i]), int64 bit patterns. */
static PyObject *mix64_all(PyObject *self, PyObject *args) {
    Py_buffer src = {0}, dst = {0};
    Py_buffer *views[] = {&src, &dst};
    if (!PyArg_ParseTuple(args, "y*w*", &src, &dst)) goto fail;
    if (src.len != dst.len || src.len % 8) {
        PyErr_SetString(PyExc_ValueError, "mix64: src and dst must be int64 arrays of one length");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    const uint64_t *in = src.buf;
    uint64_t *result = dst.buf;
    Py_ssize_t n = src.len / 8;
    for (Py_ssize_t i = 0; i < n; i++) result[i] = mix64(in[i]);
    Py_END_ALLOW_THREADS
    return released(views, 2, Py_NewRef(Py_None));
fail:
    return released(views, 2, NULL);
}

/* The server of `id`: (mix64(mix64(id) ^ word) >> 1) % servers (`server_of` of tables/id_hash.py:
 * `keyed(id, word)`'s top 63 bits modulo the servers). */
static inline int64_t server_of_id(int64_t id, long long word, long long servers) {
    return (int64_t)((mix64(mix64((uint64_t)id) ^ (uint64_t)word) >> 1) % (uint64_t)servers);
}

/* server_of(ids, word, servers, out): out[i] = the server of ids[i] (`server_of_id`). */
static PyObject *server_of(PyObject *self, PyObject *args) {
    Py_buffer ids = {0}, out = {0};
    Py_buffer *views[] = {&ids, &out};
    long long word, servers;
    if (!PyArg_ParseTuple(args, "y*LLw*", &ids, &word, &servers, &out)) goto fail;
    if (ids.len != out.len || ids.len % 8 || servers < 1) {
        PyErr_SetString(PyExc_ValueError, "server_of: int64 ids and out of one length, servers >= 1");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    const int64_t *id = ids.buf;
    int64_t *result = out.buf;
    Py_ssize_t n = ids.len / 8;
    for (Py_ssize_t i = 0; i < n; i++) result[i] = server_of_id(id[i], word, servers);
    Py_END_ALLOW_THREADS
    return released(views, 2, Py_NewRef(Py_None));
fail:
    return released(views, 2, NULL);
}

/* placement(ids, word, servers, server): for a server's ids, (the position of the first id not above the one
 * before it, the position of the first that `server_of` with `word` places on another server), -1 where none. */
static PyObject *placement(PyObject *self, PyObject *args) {
    Py_buffer ids = {0};
    Py_buffer *views[] = {&ids};
    long long word, servers, server;
    Py_ssize_t unordered = -1, elsewhere = -1;
    if (!PyArg_ParseTuple(args, "y*LLL", &ids, &word, &servers, &server)) goto fail;
    if (ids.len % 8 || servers < 1) {
        PyErr_SetString(PyExc_ValueError, "placement: int64 ids, servers >= 1");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    const int64_t *id = ids.buf;
    Py_ssize_t n = ids.len / 8;
    for (Py_ssize_t i = 0; i < n && (unordered < 0 || elsewhere < 0); i++) {
        if (unordered < 0 && i && id[i] <= id[i - 1]) unordered = i;
        if (elsewhere < 0 && server_of_id(id[i], word, servers) != server) elsewhere = i;
    }
    Py_END_ALLOW_THREADS
    return released(views, 1, Py_BuildValue("nn", unordered, elsewhere));
fail:
    return released(views, 1, NULL);
}

/* hashed_uniform(ids, slots, seed, word, denominator, wide, out): row slots[i] of out ([rows, dim], float64
 * where `wide`, else float32: the float64 value rounded to nearest, as a cast) becomes the row of ids[i]: element
 * j is (2 u - 1) / denominator, u the top 53 bits of mix64(h ^ j) / 2^53, h = mix64(mix64(mix64(id) ^ seed) ^
 * word): `keyed(id, seed, word, j)` of tables/id_hash.py, computed as its tensor form would be. */
static PyObject *hashed_uniform(PyObject *self, PyObject *args) {
    Py_buffer ids = {0}, slots = {0}, out = {0};
    Py_buffer *views[] = {&ids, &slots, &out};
    long long seed, word;
    double denominator;
    int wide;
    Py_ssize_t dim, bad = 0;
    if (!PyArg_ParseTuple(args, "y*y*LLdpnw*", &ids, &slots, &seed, &word, &denominator, &wide, &dim, &out))
        goto fail;
    Py_ssize_t n = ids.len / 8, size = wide ? 8 : 4, rows = dim > 0 ? out.len / (size * dim) : 0;
    if (ids.len % 8 || slots.len != ids.len || dim < 1 || out.len % (size * dim)) {
        PyErr_SetString(PyExc_ValueError, "hashed_uniform: int64 ids and slots of one length; rows of dim floats");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    const uint64_t *id = ids.buf;
    const int64_t *slot = slots.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (slot[i] < 0 || slot[i] >= rows) { bad = 1; break; }
        uint64_t h = mix64(mix64(mix64(id[i]) ^ (uint64_t)seed) ^ (uint64_t)word);
        double *wide_row = (double *)out.buf + slot[i] * dim;
        float *row = (float *)out.buf + slot[i] * dim;
        for (Py_ssize_t j = 0; j < dim; j++) {
            double u = (double)(mix64(h ^ (uint64_t)j) >> 11) * 0x1p-53, value = (2 * u - 1) / denominator;
            if (wide) wide_row[j] = value;
            else row[j] = (float)value;
        }
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "hashed_uniform: a slot beyond the rows");
        goto fail;
    }
    return released(views, 3, Py_NewRef(Py_None));
fail:
    return released(views, 3, NULL);
}

/* touch(last_step, changed, lookups, slots, counts, step, out): the ids in the distinct `slots` were looked up
 * at `step` (a slot of -1: an id not admitted, skipped): each slot's `changed` flag set, its lookup count grown by
 * its count (`lookups` empty: nothing counted, and `counts` empty too), and the slots whose last step was not
 * yet `step` written to the front of out (their recency log entries) before their last step becomes `step`;
 * returns (how many were written, the counts of the skipped ids summed). */
static PyObject *touch(PyObject *self, PyObject *args) {
    Py_buffer last = {0}, changed = {0}, lookups = {0}, slots = {0}, counts = {0}, out = {0};
    Py_buffer *views[] = {&last, &changed, &lookups, &slots, &counts, &out};
    long long step, skipped = 0;
    Py_ssize_t fresh = 0, bad = 0;
    if (!PyArg_ParseTuple(args, "w*w*w*y*y*Lw*", &last, &changed, &lookups, &slots, &counts, &step, &out))
        goto fail;
    int counting = lookups.len != 0;
    if (last.len != 8 * changed.len || slots.len != out.len || slots.len % 8
            || (counting && (counts.len != slots.len || lookups.len != last.len)) || (!counting && counts.len)) {
        PyErr_SetString(PyExc_ValueError, "touch: int64 last steps and a flag per slot (and lookup counts, or none); "
                        "int64 slots, out and counts (or none) of one length");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    int64_t *last_step = last.buf, *looked = lookups.buf, *result = out.buf;
    const int64_t *slot = slots.buf, *count = counts.buf;
    uint8_t *flag = changed.buf;
    Py_ssize_t n = slots.len / 8, columns = changed.len;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = slot[i];
        if (s == -1) {
            if (counting) skipped += count[i];
            continue;
        }
        if (s < 0 || s >= columns) { bad = 1; break; }
        flag[s] = 1;
        if (counting) looked[s] += count[i];
        if (last_step[s] != step) {
            result[fresh++] = s;
            last_step[s] = step;
        }
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "touch: a slot beyond the columns");
        goto fail;
    }
    return released(views, 6, Py_BuildValue("nL", fresh, skipped));
fail:
    return released(views, 6, NULL);
}

/* claim(free, free_top, ids, id, changed, held, last_step, arrival, zeroed, out): slots for the distinct `ids`,
 * the top len(ids) of the stack of free slots `free[:free_top]` (which must hold enough) in stack order, each
 * holding its id, changed, held, its last step `arrival` and 0 in `zeroed` (an int64 column, or empty: none);
 * the slots to out; returns the new top. */
static PyObject *claim(PyObject *self, PyObject *args) {
    Py_buffer free_slots = {0}, ids = {0}, id_col = {0}, changed = {0}, held = {0}, last = {0}, zeroed = {0},
              out = {0};
    Py_buffer *views[] = {&free_slots, &ids, &id_col, &changed, &held, &last, &zeroed, &out};
    Py_ssize_t top, bad = 0;
    long long arrival;
    if (!PyArg_ParseTuple(args, "y*ny*w*w*w*w*Lw*w*", &free_slots, &top, &ids, &id_col, &changed, &held, &last,
                          &arrival, &zeroed, &out)) goto fail;
    Py_ssize_t n = ids.len / 8, columns = changed.len;
    if (ids.len % 8 || out.len != ids.len || id_col.len != 8 * columns || held.len != columns
            || last.len != 8 * columns || (zeroed.len && zeroed.len != 8 * columns) || top < n
            || 8 * top > free_slots.len) {
        PyErr_SetString(PyExc_ValueError, "claim: int64 ids and out of one length, no more than the free slots; an "
                        "int64 id, last step (and zeroed value, or none) and two flags per slot");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    const int64_t *free_slot = free_slots.buf, *id = ids.buf;
    int64_t *ids_held = id_col.buf, *last_step = last.buf, *zero = zeroed.buf, *result = out.buf;
    uint8_t *flag = changed.buf, *holds = held.buf;
    top -= n;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = free_slot[top + i];
        if (s < 0 || s >= columns) { bad = 1; break; }
        result[i] = s;
        ids_held[s] = id[i];
        flag[s] = holds[s] = 1;
        last_step[s] = arrival;
        if (zeroed.len) zero[s] = 0;
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "claim: a free slot beyond the columns");
        goto fail;
    }
    return released(views, 8, PyLong_FromSsize_t(top));
fail:
    return released(views, 8, NULL);
}

/* Whether a recency log entry (slot s, step) stands for its id: the slot holds an id whose last step is the
 * entry's, and with wanted >= 0 whose lookup count is `wanted`. */
static inline int stands_for(int32_t s, int64_t step, const uint8_t *holds, const int64_t *last_step,
                             const int64_t *count, long long wanted) {
    return holds[s] && last_step[s] == step && (wanted < 0 || count[s] == wanted);
}

/* live(log_slots, log_steps, held, last_step, lookups, wanted, out_slots, out_steps): of the recency log's
 * entries (int32 slot, int64 step), those that stand for their ids (the slot holds an id whose last step is the
 * entry's, and with wanted >= 0 whose lookup count is `wanted`: `lookups` may be empty otherwise), in order,
 * to the front of out; returns how many. */
static PyObject *live(PyObject *self, PyObject *args) {
    Py_buffer log_slots = {0}, log_steps = {0}, held = {0}, last = {0}, lookups = {0}, out_slots = {0},
              out_steps = {0};
    Py_buffer *views[] = {&log_slots, &log_steps, &held, &last, &lookups, &out_slots, &out_steps};
    long long wanted;
    Py_ssize_t kept = 0, bad = 0;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*Lw*w*", &log_slots, &log_steps, &held, &last, &lookups, &wanted,
                          &out_slots, &out_steps)) goto fail;
    Py_ssize_t n = log_steps.len / 8, columns = held.len;
    if (log_slots.len != 4 * n || last.len != 8 * columns || (wanted >= 0 && lookups.len != 8 * columns)
            || out_slots.len < 8 * n || out_steps.len < 8 * n) {
        PyErr_SetString(PyExc_ValueError, "live: int32 slots and int64 steps of the log; a flag, an int64 last step "
                        "and lookup count per slot; int64 outputs as long as the log");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    const int32_t *slot = log_slots.buf;
    const int64_t *step = log_steps.buf, *last_step = last.buf, *count = lookups.buf;
    const uint8_t *holds = held.buf;
    int64_t *kept_slot = out_slots.buf, *kept_step = out_steps.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t s = slot[i];
        if (s < 0 || s >= columns) { bad = 1; break; }
        if (stands_for(s, step[i], holds, last_step, count, wanted)) {
            kept_slot[kept] = s;
            kept_step[kept++] = step[i];
        }
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "live: a log entry beyond the columns");
        goto fail;
    }
    return released(views, 7, PyLong_FromSsize_t(kept));
fail:
    return released(views, 7, NULL);
}

/* Whether log entry (step a, slot of id ia) goes before (step b, id ib): by step, then id. */
static inline int goes_before(int64_t a, int64_t ia, int64_t b, int64_t ib) {
    return a < b || (a == b && ia < ib);
}

/* order(log_slots, log_steps, start, end, ids): the log's entries from start to end sorted by (step, id of
 * the slot) (ids by slot), stably; a merge of the runs already in order, so a step's entries appended by a
 * few lookups in id order cost a pass or two. */
static PyObject *order(PyObject *self, PyObject *args) {
    Py_buffer log_slots = {0}, log_steps = {0}, ids = {0};
    Py_buffer *views[] = {&log_slots, &log_steps, &ids};
    Py_ssize_t start, end, bad = 0;
    if (!PyArg_ParseTuple(args, "w*w*nny*", &log_slots, &log_steps, &start, &end, &ids)) goto fail;
    Py_ssize_t columns = ids.len / 8, n = end - start;
    if (log_slots.len * 2 != log_steps.len || start < 0 || start > end || 4 * end > log_slots.len || ids.len % 8) {
        PyErr_SetString(PyExc_ValueError, "order: int32 slots and int64 steps of the log, start <= end within it; "
                        "an int64 id per slot");
        goto fail;
    }
    int32_t *slot = (int32_t *)log_slots.buf + start, *spare_slot = NULL;
    int64_t *step = (int64_t *)log_steps.buf + start, *spare_step = NULL;
    const int64_t *id = ids.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (slot[i] < 0 || slot[i] >= columns) { bad = 1; break; }
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "order: a log entry beyond the columns");
        goto fail;
    }
    Py_ssize_t sorted = 1;
    while (sorted < n && !goes_before(step[sorted], id[slot[sorted]], step[sorted - 1], id[slot[sorted - 1]]))
        sorted++;
    if (sorted >= n) return released(views, 3, Py_NewRef(Py_None));
    {
        spare_slot = PyMem_RawMalloc((size_t)n * sizeof *spare_slot);
        spare_step = PyMem_RawMalloc((size_t)n * sizeof *spare_step);
        if (!spare_slot || !spare_step) {
            PyMem_RawFree(spare_slot);
            PyMem_RawFree(spare_step);
            PyErr_NoMemory();
            goto fail;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    int32_t *from_slot = slot, *to_slot = spare_slot;
    int64_t *from_step = step, *to_step = spare_step;
    for (;;) {  /* each pass merges pairs of consecutive runs in order */
        Py_ssize_t runs = 0, i = 0;
        while (i < n) {
            Py_ssize_t mid = i + 1;
            while (mid < n && !goes_before(from_step[mid], id[from_slot[mid]], from_step[mid - 1],
                                           id[from_slot[mid - 1]])) mid++;
            Py_ssize_t stop = mid + 1;
            while (stop < n && !goes_before(from_step[stop], id[from_slot[stop]], from_step[stop - 1],
                                            id[from_slot[stop - 1]])) stop++;
            if (mid >= n) stop = n;
            Py_ssize_t a = i, b = mid, k = i;
            while (a < mid && b < stop) {
                if (goes_before(from_step[b], id[from_slot[b]], from_step[a], id[from_slot[a]])) {
                    to_slot[k] = from_slot[b];
                    to_step[k++] = from_step[b++];
                } else {
                    to_slot[k] = from_slot[a];
                    to_step[k++] = from_step[a++];
                }
            }
            for (; a < mid; a++, k++) { to_slot[k] = from_slot[a]; to_step[k] = from_step[a]; }
            for (; b < stop; b++, k++) { to_slot[k] = from_slot[b]; to_step[k] = from_step[b]; }
            runs++;
            i = stop;
        }
        int32_t *swap_slot = from_slot;
        int64_t *swap_step = from_step;
        from_slot = to_slot, from_step = to_step, to_slot = swap_slot, to_step = swap_step;
        if (runs <= 1) break;
    }
    if (from_slot != slot) {
        memcpy(slot, from_slot, (size_t)n * sizeof *slot);
        memcpy(step, from_step, (size_t)n * sizeof *step);
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(spare_slot);
    PyMem_RawFree(spare_step);
    return released(views, 3, Py_NewRef(Py_None));
fail:
    return released(views, 3, NULL);
}

/* oldest(log_slots, log_steps, head, tail, held, last_step, lookups, wanted, ids, count, out_slots, out_steps,
 * out_ids): of the log's entries from head to tail, in (step, id) order (`order`), the first `count` that stand
 * for their ids (`live`'s rule), or all of them when fewer, with their slots, last steps and ids, in that order,
 * to the front of the outs (`count` long); returns (how many, the log's new head). The stale entries before the
 * last one read leave the log (its head moves forward over them). */
static PyObject *oldest(PyObject *self, PyObject *args) {
    Py_buffer log_slots = {0}, log_steps = {0}, held = {0}, last = {0}, lookups = {0}, ids = {0}, out_slots = {0},
              out_steps = {0}, out_ids = {0};
    Py_buffer *views[] = {&log_slots, &log_steps, &held, &last, &lookups, &ids, &out_slots, &out_steps, &out_ids};
    Py_ssize_t head, tail, count, bad = 0, found = 0;
    long long wanted;
    if (!PyArg_ParseTuple(args, "w*w*nny*y*y*Ly*nw*w*w*", &log_slots, &log_steps, &head, &tail, &held, &last,
                          &lookups, &wanted, &ids, &count, &out_slots, &out_steps, &out_ids)) goto fail;
    Py_ssize_t columns = held.len;
    if (log_slots.len * 2 != log_steps.len || head < 0 || head > tail || 4 * tail > log_slots.len || count < 1
            || last.len != 8 * columns || ids.len != 8 * columns || (wanted >= 0 && lookups.len != 8 * columns)
            || out_slots.len != 8 * count || out_steps.len != 8 * count || out_ids.len != 8 * count) {
        PyErr_SetString(PyExc_ValueError, "oldest: int32 slots and int64 steps of the log, head <= tail within it; a "
                        "flag, an int64 last step, id and lookup count per slot; int64 outputs of count >= 1");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    int32_t *slot = log_slots.buf;
    int64_t *step = log_steps.buf, *kept_slot = out_slots.buf, *kept_step = out_steps.buf, *kept_id = out_ids.buf;
    const int64_t *last_step = last.buf, *count_of = lookups.buf, *id = ids.buf;
    const uint8_t *holds = held.buf;
    Py_ssize_t read = head;
    for (; read < tail && found < count; read++) {
        int32_t s = slot[read];
        if (s < 0 || s >= columns) { bad = 1; break; }
        if (stands_for(s, step[read], holds, last_step, count_of, wanted)) {
            kept_slot[found] = s;
            kept_step[found] = step[read];
            kept_id[found++] = id[s];
        }
    }
    if (!bad) {  /* the live entries read stay, just before the first entry not read */
        head = read - found;
        for (Py_ssize_t i = 0; i < found; i++) {
            slot[head + i] = (int32_t)kept_slot[i];
            step[head + i] = kept_step[i];
        }
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "oldest: a log entry beyond the columns");
        goto fail;
    }
    return released(views, 9, Py_BuildValue("nn", found, head));
fail:
    return released(views, 9, NULL);
}

static PyMethodDef methods[] = {
    {"find", find, METH_VARARGS, "find(buckets, ids, out): each id's value, -1 where absent"},
    {"insert", insert, METH_VARARGS, "insert(buckets, ids, values): add distinct absent ids"},
    {"remove", remove_ids, METH_VARARGS, "remove(buckets, ids, out): drop ids; how many were present"},
    {"mix64", mix64_all, METH_VARARGS, "mix64(src, dst): SplitMix64's finaliser of each int64"},
    {"server_of", server_of, METH_VARARGS, "server_of(ids, word, servers, out): the server of each id"},
    {"placement", placement, METH_VARARGS, "placement(ids, word, servers, server): first unordered, first elsewhere"},
    {"hashed_uniform", hashed_uniform, METH_VARARGS, "hashed_uniform(ids, slots, seed, word, denominator, wide, dim, out): init rows"},
    {"touch", touch, METH_VARARGS, "touch(last_step, changed, lookups, slots, counts, step, out): looked up"},
    {"claim", claim, METH_VARARGS, "claim(free, free_top, ids, id, changed, held, last_step, arrival, zeroed, out): slots"},
    {"live", live, METH_VARARGS, "live(log slots, log steps, held, last_step, lookups, wanted, out slots, out steps)"},
    {"oldest", oldest, METH_VARARGS, "oldest(log slots, log steps, head, tail, held, last_step, lookups, wanted, "
     "ids, count, out slots, out steps, out ids): the first count by (last step, id)"},
    {"order", order, METH_VARARGS, "order(log slots, log steps, start, end, ids): sort entries by (step, id)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_table_loops", "A dynamic table's loops over ids, compiled.", -1, methods};

PyMODINIT_FUNC PyInit__table_loops(void) { return PyModule_Create(&module); }
