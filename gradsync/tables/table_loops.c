/* gradsync.tables._table_loops: a dynamic table's loops over ids, compiled (tens of nanoseconds an id where a
 * chain of batched tensor operations costs several times that): `mix64` and `server_of` (tables/id_hash.py), the
 * default initial rows (`HashedUniform`, tables/row_init.py), the id index's probes (`IdIndex`,
 * tables/id_index.py) and the recency log's scans (tables/recency_log.py, `_IdColumns.touch` in
 * tables/dynamic_table.py).
 *
 * Every function takes its arrays as writable or read-only buffers (numpy views of torch tensors), checks
 * their lengths against each other, and runs without the GIL.
 *
 * The id index is three arrays of `buckets` entries (a power of two): keys (int64), values (int64) and state
 * (uint8: 0 empty, 1 full). An id starts at mix64(id) & (buckets - 1) and probes linearly; the caller keeps the
 * ids under half the buckets, so every probe ends at an empty bucket. A removal shifts back the ids after it on
 * their probes (Knuth's algorithm R for linear probing), so no bucket is left marked deleted and a probe never
 * walks past removed ids.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

enum { EMPTY = 0, FULL = 1 };

/* SplitMix64's finaliser (Steele, Lea, Flood 2014): a bijection of the 64-bit patterns. */
static inline uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

typedef struct {
    Py_buffer keys, values, state;
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

/* Parses an index call's arguments (keys, values, state, ids, other) by `format` and checks them: the index's
 * arrays, and ids and `other` (named `what` in the error) int64 arrays of one length. 0 with an error set and
 * every buffer released where they are not. */
static int index_call(PyObject *args, const char *format, const char *call, const char *what, Table *t,
                      Py_buffer *ids, Py_buffer *other) {
    Py_buffer *views[] = {&t->keys, &t->values, &t->state, ids, other};
    if (!PyArg_ParseTuple(args, format, &t->keys, &t->values, &t->state, ids, other)) return 0;
    Py_ssize_t buckets = t->state.len;
    if (t->keys.len != 8 * buckets || t->values.len != 8 * buckets || buckets == 0 || (buckets & (buckets - 1)))
        PyErr_SetString(PyExc_ValueError, "index arrays: keys and values int64, state uint8, a power of two each");
    else if (ids->len != other->len || ids->len % 8)
        PyErr_Format(PyExc_ValueError, "%s: ids and %s must be int64 arrays of one length", call, what);
    else {
        t->mask = (uint64_t)buckets - 1;
        return 1;
    }
    release(views, 5);
    return 0;
}

/* The bucket holding `id`, or -1. */
static inline int64_t bucket_of(const Table *t, int64_t id) {
    const int64_t *keys = t->keys.buf;
    const uint8_t *state = t->state.buf;
    uint64_t pos = mix64((uint64_t)id) & t->mask;
    for (;;) {
        uint8_t s = state[pos];
        if (s == EMPTY) return -1;
        if (keys[pos] == id) return (int64_t)pos;
        pos = (pos + 1) & t->mask;
    }
}

/* find(keys, values, state, ids, out): out[i] = the value of ids[i], -1 where absent. */
static PyObject *find(PyObject *self, PyObject *args) {
    Table t = {0};
    Py_buffer ids = {0}, out = {0};
    Py_buffer *views[] = {&t.keys, &t.values, &t.state, &ids, &out};
    if (!index_call(args, "y*y*y*y*w*", "find", "out", &t, &ids, &out)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    const int64_t *id = ids.buf, *values = t.values.buf;
    int64_t *result = out.buf;
    Py_ssize_t n = ids.len / 8;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t at = bucket_of(&t, id[i]);
        result[i] = at < 0 ? -1 : values[at];
    }
    Py_END_ALLOW_THREADS
    return released(views, 5, Py_NewRef(Py_None));
}

/* insert(keys, values, state, ids, new_values): each of the distinct absent ids into the first empty bucket along
 * its probe. */
static PyObject *insert(PyObject *self, PyObject *args) {
    Table t = {0};
    Py_buffer ids = {0}, vals = {0};
    Py_buffer *views[] = {&t.keys, &t.values, &t.state, &ids, &vals};
    if (!index_call(args, "w*w*w*y*y*", "insert", "values", &t, &ids, &vals)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    int64_t *keys = t.keys.buf, *values = t.values.buf;
    uint8_t *state = t.state.buf;
    const int64_t *id = ids.buf, *value = vals.buf;
    Py_ssize_t n = ids.len / 8;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t pos = mix64((uint64_t)id[i]) & t.mask;
        while (state[pos] == FULL) pos = (pos + 1) & t.mask;
        keys[pos] = id[i];
        values[pos] = value[i];
        state[pos] = FULL;
    }
    Py_END_ALLOW_THREADS
    return released(views, 5, Py_NewRef(Py_None));
}

/* remove(keys, values, state, ids, out): each present id leaves the index and its value goes to the front of
 * out, in the order of ids; returns how many were present. The ids after it on the run of full buckets move
 * back into the hole where their probe passes it. */
static PyObject *remove_ids(PyObject *self, PyObject *args) {
    Table t = {0};
    Py_buffer ids = {0}, out = {0};
    Py_buffer *views[] = {&t.keys, &t.values, &t.state, &ids, &out};
    Py_ssize_t removed = 0;
    if (!index_call(args, "w*w*w*y*w*", "remove", "out", &t, &ids, &out)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    const int64_t *id = ids.buf;
    int64_t *keys = t.keys.buf, *values = t.values.buf, *result = out.buf;
    uint8_t *state = t.state.buf;
    Py_ssize_t n = ids.len / 8;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t at = bucket_of(&t, id[i]);
        if (at < 0) continue;
        result[removed++] = values[at];
        uint64_t hole = (uint64_t)at, pos = hole;
        for (;;) {
            pos = (pos + 1) & t.mask;
            if (state[pos] == EMPTY) break;
            uint64_t home = mix64((uint64_t)keys[pos]) & t.mask;
            if (((pos - home) & t.mask) >= ((pos - hole) & t.mask)) {  /* its probe passes the hole */
                keys[hole] = keys[pos];
                values[hole] = values[pos];
                hole = pos;
            }
        }
        state[hole] = EMPTY;
    }
    Py_END_ALLOW_THREADS
    return released(views, 5, PyLong_FromSsize_t(removed));
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

/* server_of(ids, word, servers, out): out[i] = (mix64(mix64(ids[i]) ^ word) >> 1) % servers, the server of each id
 * (`server_of` of tables/id_hash.py: `keyed(id, word)`'s top 63 bits modulo the servers). */
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
    const uint64_t *id = ids.buf;
    int64_t *result = out.buf;
    Py_ssize_t n = ids.len / 8;
    for (Py_ssize_t i = 0; i < n; i++)
        result[i] = (int64_t)((mix64(mix64(id[i]) ^ (uint64_t)word) >> 1) % (uint64_t)servers);
    Py_END_ALLOW_THREADS
    return released(views, 2, Py_NewRef(Py_None));
fail:
    return released(views, 2, NULL);
}

/* hashed_uniform(ids, seed, word, denominator, out): row i of out ([len(ids), dim] float64) is
 * (2 u - 1) / denominator, u the top 53 bits of mix64(h ^ j) / 2^53, h = mix64(mix64(mix64(id) ^ seed) ^ word):
 * `keyed(id, seed, word, j)` of tables/id_hash.py, computed as its tensor form would be. */
static PyObject *hashed_uniform(PyObject *self, PyObject *args) {
    Py_buffer ids = {0}, out = {0};
    Py_buffer *views[] = {&ids, &out};
    long long seed, word;
    double denominator;
    if (!PyArg_ParseTuple(args, "y*LLdw*", &ids, &seed, &word, &denominator, &out)) goto fail;
    Py_ssize_t n = ids.len / 8;
    if (ids.len % 8 || (n && (out.len % (8 * n) || out.len == 0))) {
        PyErr_SetString(PyExc_ValueError, "hashed_uniform: int64 ids and a float64 row of dim per id");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    const uint64_t *id = ids.buf;
    double *row = out.buf;
    Py_ssize_t dim = n ? out.len / (8 * n) : 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h = mix64(mix64(mix64(id[i]) ^ (uint64_t)seed) ^ (uint64_t)word);
        for (Py_ssize_t j = 0; j < dim; j++) {
            double u = (double)(mix64(h ^ (uint64_t)j) >> 11) * 0x1p-53;
            row[i * dim + j] = (2 * u - 1) / denominator;
        }
    }
    Py_END_ALLOW_THREADS
    return released(views, 2, Py_NewRef(Py_None));
fail:
    return released(views, 2, NULL);
}

/* touch(last_step, changed, slots, step, out): the ids in the distinct `slots` were looked up at `step`: each
 * slot's `changed` flag set, and the slots whose last step was not yet `step` written to the front of out (their
 * recency log entries) before their last step becomes `step`; returns how many. */
static PyObject *touch(PyObject *self, PyObject *args) {
    Py_buffer last = {0}, changed = {0}, slots = {0}, out = {0};
    Py_buffer *views[] = {&last, &changed, &slots, &out};
    long long step;
    Py_ssize_t fresh = 0, bad = 0;
    if (!PyArg_ParseTuple(args, "w*w*y*Lw*", &last, &changed, &slots, &step, &out)) goto fail;
    if (last.len != 8 * changed.len || slots.len != out.len || slots.len % 8) {
        PyErr_SetString(PyExc_ValueError, "touch: int64 last steps and a flag per slot; int64 slots and out");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    int64_t *last_step = last.buf, *result = out.buf;
    uint8_t *flag = changed.buf;
    const int64_t *slot = slots.buf;
    Py_ssize_t n = slots.len / 8, columns = changed.len;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = slot[i];
        if (s < 0 || s >= columns) { bad = 1; break; }
        flag[s] = 1;
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
    return released(views, 4, PyLong_FromSsize_t(fresh));
fail:
    return released(views, 4, NULL);
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
        if (holds[s] && last_step[s] == step[i] && (wanted < 0 || count[s] == wanted)) {
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

static PyMethodDef methods[] = {
    {"find", find, METH_VARARGS, "find(keys, values, state, ids, out): each id's value, -1 where absent"},
    {"insert", insert, METH_VARARGS, "insert(keys, values, state, ids, values): add distinct absent ids"},
    {"remove", remove_ids, METH_VARARGS, "remove(keys, values, state, ids, out): drop ids; how many were present"},
    {"mix64", mix64_all, METH_VARARGS, "mix64(src, dst): SplitMix64's finaliser of each int64"},
    {"server_of", server_of, METH_VARARGS, "server_of(ids, word, servers, out): the server of each id"},
    {"hashed_uniform", hashed_uniform, METH_VARARGS, "hashed_uniform(ids, seed, word, denominator, out): init rows"},
    {"touch", touch, METH_VARARGS, "touch(last_step, changed, slots, step, out): looked up; the log's new slots"},
    {"live", live, METH_VARARGS, "live(log slots, log steps, held, last_step, lookups, wanted, out slots, out steps)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_table_loops", "A dynamic table's loops over ids, compiled.", -1, methods};

PyMODINIT_FUNC PyInit__table_loops(void) { return PyModule_Create(&module); }
