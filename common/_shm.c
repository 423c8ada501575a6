/*
 * tensorbroker.common._shm: every load, store and fence on memory that the broker and its
 * clients share, in one place (Note [directory and lease slots] in common/directory.py).
 *
 * Python cannot order memory accesses: all synchronisation through shared memory is here,
 * with the __atomic builtins. Addresses are plain ints (the mappings are made here too, so
 * that the directory can be mapped read-only).
 *
 * Directory entry (ENTRY bytes, 8-aligned), written only by the broker under its seqlock:
 *
 *     0  seq      u64   odd while the broker writes the entry
 *     8  state    u32   0 empty (ends a probe), 1 live, 2 deleted (a probe goes on)
 *    12  keylen   u32
 *    16  oid      u64   the object's id (never reused)
 *    24  version  u64
 *    32  hash     u64   key_hash(key)
 *    40  desclen  u32
 *    48  key[keylen] desc[desclen]
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define HEAD 48
#define MAX_SPINS 100000

typedef struct {
    uint64_t seq;
    uint32_t state;
    uint32_t keylen;
    uint64_t oid;
    uint64_t version;
    uint64_t hash;
    uint32_t desclen;
    uint32_t pad;
} Entry;

static uint64_t fnv1a(const char *s, Py_ssize_t n) {
    uint64_t h = UINT64_C(1469598103934665603);
    for (Py_ssize_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= UINT64_C(1099511628211);
    }
    return h ? h : 1;
}

static int get_addr(PyObject *obj, uintptr_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    if (v == 0 || v % 8) {
        PyErr_SetString(PyExc_ValueError, "address must be a non-zero multiple of 8");
        return -1;
    }
    *out = (uintptr_t)v;
    return 0;
}

static PyObject *key_hash(PyObject *self, PyObject *arg) {
    (void)self;
    char *s;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(arg, &s, &n) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(fnv1a(s, n));
}

/* ---- mappings ------------------------------------------------------------------------ */

static PyObject *map_fd(PyObject *self, PyObject *args) {
    (void)self;
    int fd, writable;
    Py_ssize_t size, offset = 0;
    if (!PyArg_ParseTuple(args, "inp|n:map_fd", &fd, &size, &writable, &offset))
        return NULL;
    void *p;
    Py_BEGIN_ALLOW_THREADS
    p = mmap(NULL, (size_t)size, writable ? PROT_READ | PROT_WRITE : PROT_READ,
             MAP_SHARED | MAP_POPULATE, fd, (off_t)offset);
    Py_END_ALLOW_THREADS
    if (p == MAP_FAILED)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromUnsignedLongLong((uintptr_t)p);
}

static PyObject *unmap(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long addr;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "Kn:unmap", &addr, &size))
        return NULL;
    if (munmap((void *)(uintptr_t)addr, (size_t)size) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/* ---- plain words ----------------------------------------------------------------------- */

static PyObject *load(PyObject *self, PyObject *arg) {
    (void)self;
    uintptr_t a;
    if (get_addr(arg, &a) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_load_n((uint64_t *)a, __ATOMIC_ACQUIRE));
}

static PyObject *store(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *addr;
    unsigned long long v;
    uintptr_t a;
    if (!PyArg_ParseTuple(args, "OK:store", &addr, &v) || get_addr(addr, &a) < 0)
        return NULL;
    __atomic_store_n((uint64_t *)a, (uint64_t)v, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* ---- the directory ------------------------------------------------------------------- */

/* Broker: write one entry under its seqlock. */
static PyObject *entry_write(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *addr;
    unsigned int state;
    unsigned long long oid, version, size;
    const char *key, *desc;
    Py_ssize_t keylen, desclen;
    uintptr_t a;
    if (!PyArg_ParseTuple(args, "OKIKKy#y#:entry_write", &addr, &size, &state, &oid, &version,
                          &key, &keylen, &desc, &desclen) ||
        get_addr(addr, &a) < 0)
        return NULL;
    if ((unsigned long long)(HEAD + keylen + desclen) > size) {
        PyErr_Format(PyExc_ValueError, "key and descriptor (%zd bytes) do not fit an entry",
                     keylen + desclen);
        return NULL;
    }
    Entry *e = (Entry *)a;
    uint64_t seq = __atomic_load_n(&e->seq, __ATOMIC_RELAXED);
    __atomic_store_n(&e->seq, seq + 1, __ATOMIC_RELAXED); /* odd: readers retry */
    __atomic_thread_fence(__ATOMIC_RELEASE);            /* the odd seq before the data */
    e->state = state;
    e->keylen = (uint32_t)keylen;
    e->oid = oid;
    e->version = version;
    e->hash = fnv1a(key, keylen);
    e->desclen = (uint32_t)desclen;
    memcpy((char *)e + HEAD, key, (size_t)keylen);
    memcpy((char *)e + HEAD + keylen, desc, (size_t)desclen);
    __atomic_store_n(&e->seq, seq + 2, __ATOMIC_RELEASE); /* the data before the even seq */
    Py_RETURN_NONE;
}

/* One consistent copy of an entry's head (and, if `buf`, its key and descriptor). Returns 0,
 * or -1 if it stayed torn for MAX_SPINS tries. */
static int read_entry(Entry *e, Entry *head, char *buf, size_t bufsize) {
    for (int i = 0; i < MAX_SPINS; i++) {
        uint64_t s1 = __atomic_load_n(&e->seq, __ATOMIC_ACQUIRE);
        if (s1 & 1)
            continue;
        memcpy(head, e, sizeof(Entry));
        size_t n = (size_t)head->keylen + head->desclen;
        if (buf != NULL && n <= bufsize)
            memcpy(buf, (char *)e + HEAD, n);
        __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the copies before the second seq load */
        if (__atomic_load_n(&e->seq, __ATOMIC_RELAXED) == s1)
            return 0;
    }
    return -1;
}

/* Client: find `key`. (index, oid, version, desc) if live, None if absent (an empty entry
 * ends the probe, or every entry was probed), or False if an entry stayed torn. */
static PyObject *lookup(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *addr;
    unsigned long long n, size;
    const char *key;
    Py_ssize_t keylen;
    uintptr_t base;
    if (!PyArg_ParseTuple(args, "OKKy#:lookup", &addr, &n, &size, &key, &keylen) ||
        get_addr(addr, &base) < 0)
        return NULL;
    if (n == 0 || size <= HEAD)
        Py_RETURN_NONE;
    uint64_t h = fnv1a(key, keylen);
    size_t bufsize = (size_t)size - HEAD;
    char *buf = PyMem_Malloc(bufsize);
    if (buf == NULL)
        return PyErr_NoMemory();
    PyObject *result = Py_None;
    Py_INCREF(result);
    for (unsigned long long i = 0; i < n; i++) {
        unsigned long long index = (h + i) % n;
        Entry head;
        if (read_entry((Entry *)(base + index * size), &head, buf, bufsize) < 0) {
            Py_SETREF(result, Py_NewRef(Py_False));
            break;
        }
        if (head.state == 0)
            break;
        if (head.state == 1 && head.hash == h && head.keylen == (uint32_t)keylen &&
            (size_t)head.keylen + head.desclen <= bufsize && memcmp(buf, key, keylen) == 0) {
            Py_SETREF(result,
                      Py_BuildValue("KKKy#", index, head.oid, head.version, buf + keylen,
                                    (Py_ssize_t)head.desclen));
            break;
        }
    }
    PyMem_Free(buf);
    return result;
}

/* Client: whether the entry at `addr` is still live with object `oid`. */
static PyObject *entry_holds(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *addr;
    unsigned long long oid;
    uintptr_t a;
    if (!PyArg_ParseTuple(args, "OK:entry_holds", &addr, &oid) || get_addr(addr, &a) < 0)
        return NULL;
    Entry head;
    if (read_entry((Entry *)a, &head, NULL, 0) < 0)
        Py_RETURN_FALSE;
    return PyBool_FromLong(head.state == 1 && head.oid == oid);
}

/* ---- lease slots (hazard pointers) ------------------------------------------------- */

/* Client: publish `oid` in a slot, then a full fence: the directory is read again only
 * after the broker can see the slot. */
static PyObject *slot_publish(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *addr;
    unsigned long long oid;
    uintptr_t a;
    if (!PyArg_ParseTuple(args, "OK:slot_publish", &addr, &oid) || get_addr(addr, &a) < 0)
        return NULL;
    __atomic_store_n((uint64_t *)a, (uint64_t)oid, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* Client: let go; every read of the object happened before (release). */
static PyObject *slot_clear(PyObject *self, PyObject *arg) {
    (void)self;
    uintptr_t a;
    if (get_addr(arg, &a) < 0)
        return NULL;
    __atomic_store_n((uint64_t *)a, 0, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* Broker: after a full fence (its directory writes before it), the object ids held in
 * `count` slots from `addr`, with how many slots hold each. */
static PyObject *slots_scan(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *addr;
    Py_ssize_t count;
    uintptr_t a;
    if (!PyArg_ParseTuple(args, "On:slots_scan", &addr, &count) || get_addr(addr, &a) < 0)
        return NULL;
    PyObject *held = PyDict_New();
    if (held == NULL)
        return NULL;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t oid = __atomic_load_n((uint64_t *)a + i, __ATOMIC_ACQUIRE);
        if (oid == 0)
            continue;
        PyObject *k = PyLong_FromUnsignedLongLong(oid);
        if (k == NULL)
            goto fail;
        PyObject *old = PyDict_GetItemWithError(held, k);
        long n = old == NULL ? 0 : PyLong_AsLong(old);
        PyObject *v = PyLong_FromLong(n + 1);
        if (v == NULL || (old == NULL && PyErr_Occurred()) || PyDict_SetItem(held, k, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(k);
            goto fail;
        }
        Py_DECREF(v);
        Py_DECREF(k);
    }
    return held;
fail:
    Py_DECREF(held);
    return NULL;
}

static PyObject *fence(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"key_hash", key_hash, METH_O, "FNV-1a 64 of a key's bytes (never 0)."},
    {"map_fd", map_fd, METH_VARARGS,
     "map_fd(fd, size, writable, offset=0) -> address (MAP_POPULATE)."},
    {"unmap", unmap, METH_VARARGS, "unmap(address, size)."},
    {"load", load, METH_O, "load(address) -> u64 (acquire)."},
    {"store", store, METH_VARARGS, "store(address, value) (release)."},
    {"entry_write", entry_write, METH_VARARGS,
     "entry_write(address, entry_size, state, oid, version, key, desc) under the seqlock."},
    {"lookup", lookup, METH_VARARGS,
     "lookup(base, entries, entry_size, key) -> (index, oid, version, desc) | None | False."},
    {"entry_holds", entry_holds, METH_VARARGS, "entry_holds(address, oid) -> bool."},
    {"slot_publish", slot_publish, METH_VARARGS, "slot_publish(address, oid), then a fence."},
    {"slot_clear", slot_clear, METH_O, "slot_clear(address) (release)."},
    {"slots_scan", slots_scan, METH_VARARGS, "slots_scan(address, count) -> {oid: slots}."},
    {"fence", fence, METH_NOARGS, "A full (seq_cst) fence."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tensorbroker.common._shm",
    "Loads, stores and fences on shared memory (see common/_shm.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__shm(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "ENTRY_HEAD", HEAD) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
