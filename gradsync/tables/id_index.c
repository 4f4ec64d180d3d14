/* gradsync.tables._id_index: the loops of `IdIndex` (tables/id_index.py) and `mix64` (tables/id_hash.py),
 * compiled: an id costs a few nanoseconds here against tens in batched tensor operations.
 *
 * The index is three arrays of `buckets` entries (a power of two): keys (int64), values (int64) and state
 * (uint8: 0 empty, 1 full, 2 a tombstone left by a removal). An id starts at mix64(id) & (buckets - 1) and
 * probes linearly; the caller keeps ids and tombstones under half the buckets, so every probe ends at an empty
 * bucket. Every function takes its arrays as writable or read-only buffers (numpy views of torch tensors),
 * checks their lengths against each other, and runs without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

enum { EMPTY = 0, FULL = 1, TOMBSTONE = 2 };

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

static int table_ok(Table *t) {
    Py_ssize_t buckets = t->state.len;
    if (t->keys.len != 8 * buckets || t->values.len != 8 * buckets || buckets == 0 || (buckets & (buckets - 1))) {
        PyErr_SetString(PyExc_ValueError, "index arrays: keys and values int64, state uint8, a power of two each");
        return 0;
    }
    t->mask = (uint64_t)buckets - 1;
    return 1;
}

/* The bucket holding `id`, or -1. */
static inline int64_t bucket_of(const Table *t, int64_t id) {
    const int64_t *keys = t->keys.buf;
    const uint8_t *state = t->state.buf;
    uint64_t pos = mix64((uint64_t)id) & t->mask;
    for (;;) {
        uint8_t s = state[pos];
        if (s == EMPTY) return -1;
        if (s == FULL && keys[pos] == id) return (int64_t)pos;
        pos = (pos + 1) & t->mask;
    }
}

/* find(keys, values, state, ids, out): out[i] = the value of ids[i], -1 where absent. */
static PyObject *find(PyObject *self, PyObject *args) {
    Table t = {0};
    Py_buffer ids = {0}, out = {0};
    Py_buffer *views[] = {&t.keys, &t.values, &t.state, &ids, &out};
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*", &t.keys, &t.values, &t.state, &ids, &out)) goto fail;
    if (!table_ok(&t)) goto fail;
    if (ids.len != out.len || ids.len % 8) {
        PyErr_SetString(PyExc_ValueError, "find: ids and out must be int64 arrays of one length");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    const int64_t *id = ids.buf, *values = t.values.buf;
    int64_t *result = out.buf;
    Py_ssize_t n = ids.len / 8;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t at = bucket_of(&t, id[i]);
        result[i] = at < 0 ? -1 : values[at];
    }
    Py_END_ALLOW_THREADS
    release(views, 5);
    Py_RETURN_NONE;
fail:
    release(views, 5);
    return NULL;
}

/* insert(keys, values, state, ids, new_values): each of the distinct absent ids into the first bucket along its
 * probe that is not full; returns how many of those were tombstones. */
static PyObject *insert(PyObject *self, PyObject *args) {
    Table t = {0};
    Py_buffer ids = {0}, vals = {0};
    Py_buffer *views[] = {&t.keys, &t.values, &t.state, &ids, &vals};
    Py_ssize_t reused = 0;
    if (!PyArg_ParseTuple(args, "w*w*w*y*y*", &t.keys, &t.values, &t.state, &ids, &vals)) goto fail;
    if (!table_ok(&t)) goto fail;
    if (ids.len != vals.len || ids.len % 8) {
        PyErr_SetString(PyExc_ValueError, "insert: ids and values must be int64 arrays of one length");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    int64_t *keys = t.keys.buf, *values = t.values.buf;
    uint8_t *state = t.state.buf;
    const int64_t *id = ids.buf, *value = vals.buf;
    Py_ssize_t n = ids.len / 8;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t pos = mix64((uint64_t)id[i]) & t.mask;
        while (state[pos] == FULL) pos = (pos + 1) & t.mask;
        reused += state[pos] == TOMBSTONE;
        keys[pos] = id[i];
        values[pos] = value[i];
        state[pos] = FULL;
    }
    Py_END_ALLOW_THREADS
    release(views, 5);
    return PyLong_FromSsize_t(reused);
fail:
    release(views, 5);
    return NULL;
}

/* remove(keys, values, state, ids, out): each present id's bucket becomes a tombstone and its value goes to the
 * front of out, in the order of ids; returns how many were present. */
static PyObject *remove_ids(PyObject *self, PyObject *args) {
    Table t = {0};
    Py_buffer ids = {0}, out = {0};
    Py_buffer *views[] = {&t.keys, &t.values, &t.state, &ids, &out};
    Py_ssize_t removed = 0;
    if (!PyArg_ParseTuple(args, "y*y*w*y*w*", &t.keys, &t.values, &t.state, &ids, &out)) goto fail;
    if (!table_ok(&t)) goto fail;
    if (ids.len != out.len || ids.len % 8) {
        PyErr_SetString(PyExc_ValueError, "remove: ids and out must be int64 arrays of one length");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    const int64_t *id = ids.buf, *values = t.values.buf;
    uint8_t *state = t.state.buf;
    int64_t *result = out.buf;
    Py_ssize_t n = ids.len / 8;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t at = bucket_of(&t, id[i]);
        if (at >= 0) {
            state[at] = TOMBSTONE;
            result[removed++] = values[at];
        }
    }
    Py_END_ALLOW_THREADS
    release(views, 5);
    return PyLong_FromSsize_t(removed);
fail:
    release(views, 5);
    return NULL;
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
    release(views, 2);
    Py_RETURN_NONE;
fail:
    release(views, 2);
    return NULL;
}

static PyMethodDef methods[] = {
    {"find", find, METH_VARARGS, "find(keys, values, state, ids, out): each id's value, -1 where absent"},
    {"insert", insert, METH_VARARGS, "insert(keys, values, state, ids, values): add absent ids; tombstones reused"},
    {"remove", remove_ids, METH_VARARGS, "remove(keys, values, state, ids, out): drop ids; how many were present"},
    {"mix64", mix64_all, METH_VARARGS, "mix64(src, dst): SplitMix64's finaliser of each int64"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_id_index", "IdIndex's loops, compiled.", -1, methods};

PyMODINIT_FUNC PyInit__id_index(void) { return PyModule_Create(&module); }
