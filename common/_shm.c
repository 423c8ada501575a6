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
 *
 * Mailbox (MAILBOX bytes, 64-aligned), one per client that has lease slots (Note [direct
 * handoff] in common/mailbox.py):
 *
 *     0  state    u64   token << 8 | IDLE 0, OPEN 1, CLAIMED 2, FILLED 3
 *     8  bell     u32   a futex word: bumped (and woken) for each thing its client waits for
 *    12  bodylen  u32
 *    16  body[bodylen]  (up to BODY_END): the get it answers, lease, version, oid, put, base
 *        (the block's offset) u64; then the tail, msgpack [name, bundle, segment, [[name,
 *        dtype, shape, strides, offset from base], ...]] (common/mailbox.py)
 *   256  offer: a grant offered to the client as a producer, written by the broker under a
 *        seqlock: seq u64 (odd while written), queue, token, mailbox index, lease, version,
 *        request (the consumer's get), applied (the id of the producer's last seal the
 *        broker had applied) u64, consumer[32] (its session token)
 *
 * Broadcast ring (one segment per ring of a broadcast queue, the broker's; its subscribers
 * map it read-write; Note [broadcast ring] in common/ring.py):
 *
 *     header (RING_HEADER bytes): magic u64, bell u32 (a futex word: bumped, and every
 *         waiter woken, for each batch of items published and when the stream ends), pad,
 *         slots u64, members u64 (the bits of the subscriptions it serves), end u64 (0:
 *         open; else the last version it will publish, plus 1), why u64 (1 closed, 2 removed),
 *         top u64 (the last version written to a slot)
 *     slot i (RING_SLOT bytes), any free one (version % slots when it is free):
 *         0  seq      u64   its version, stored last (release); 0: free
 *         8  unread   u64   the subscriptions that have not taken it yet, a bit each
 *        16  held     u64   those that took it and still hold it
 *        24  flags    u32   RING_ASK: not described here (ask the broker for it)
 *        28  taillen  u32
 *        32  oid, put, base (the block's offset) u64; 56 unused
 *        64  tail[taillen]  as a mailbox body's (common/mailbox.py)
 *     A subscriber sets its bit in `held` before it clears it in `unread`; whoever reads
 *     both zero (unread first) after clearing a bit tells the broker, which frees the slot.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define HEAD 48
#define MAX_SPINS 100000
#define MAILBOX 512
#define BODY_END 256
#define MAILBOX_BODY (BODY_END - 16)
#define BODY_HEAD 48
#define OFFER 256
#define OFFER_WORDS 8
#define CONSUMER 32
#define MAX_OFFER_TRIES 64
#define M_OPEN 1
#define M_CLAIMED 2
#define M_FILLED 3
#define RING_HEADER 64
#define RING_SLOT 512
#define RING_TAIL (RING_SLOT - 64)
#define RING_ASK 1

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

/* Find `key` (hash `h`) in the `n` entries of `size` bytes from `base`: 1 if live, with its
 * entry's index and head (its key and descriptor copied to `buf`); 0 if absent (an empty
 * entry ends the probe, or every entry was probed); -1 if an entry stayed torn. */
static int find(uintptr_t base, unsigned long long n, unsigned long long size, const char *key,
                Py_ssize_t keylen, uint64_t h, char *buf, size_t bufsize,
                unsigned long long *index, Entry *head) {
    for (unsigned long long i = 0; i < n; i++) {
        *index = (h + i) % n;
        if (read_entry((Entry *)(base + *index * size), head, buf, bufsize) < 0)
            return -1;
        if (head->state == 0)
            return 0;
        if (head->state == 1 && head->hash == h && head->keylen == (uint32_t)keylen &&
            (size_t)head->keylen + head->desclen <= bufsize && memcmp(buf, key, keylen) == 0)
            return 1;
    }
    return 0;
}

/* Client: find `key`. (index, oid, version, desc) if live, None if absent, or False if an
 * entry stayed torn. */
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
    size_t bufsize = (size_t)size - HEAD;
    char *buf = PyMem_Malloc(bufsize);
    if (buf == NULL)
        return PyErr_NoMemory();
    unsigned long long index;
    Entry head;
    PyObject *result;
    switch (find(base, n, size, key, keylen, fnv1a(key, keylen), buf, bufsize, &index, &head)) {
    case 1:
        result = Py_BuildValue("KKKy#", index, head.oid, head.version, buf + keylen,
                               (Py_ssize_t)head.desclen);
        break;
    case 0:
        result = Py_NewRef(Py_None);
        break;
    default:
        result = Py_NewRef(Py_False);
    }
    PyMem_Free(buf);
    return result;
}

/* Client: lease the live objects under `keys` (a list of bytes) at once, each through the
 * lease slot at the same place in `slots` (Note [directory and lease slots], steps 1 to 3):
 * find each entry, publish the object ids, one full fence, then check that each entry still
 * holds its id in a table not moved (the word at `moved`). A list: (oid, version, desc) for
 * a key leased; None if absent or torn (ask the broker); True if its entry changed or the
 * table moved under the lease (its slot is cleared: try again). */
static PyObject *lease_entries(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *addr, *keys, *slots, *moved_addr;
    unsigned long long n, size;
    uintptr_t base, moved;
    if (!PyArg_ParseTuple(args, "OKKO!O!O:lease_entries", &addr, &n, &size, &PyList_Type, &keys,
                          &PyList_Type, &slots, &moved_addr) ||
        get_addr(addr, &base) < 0 || get_addr(moved_addr, &moved) < 0)
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(keys);
    if (PyList_GET_SIZE(slots) != count) {
        PyErr_SetString(PyExc_ValueError, "lease_entries: one slot per key");
        return NULL;
    }
    PyObject *out = PyList_New(count);
    size_t bufsize = size > HEAD ? (size_t)size - HEAD : 0;
    char *buf = PyMem_Malloc(bufsize + 1);
    unsigned long long *found = PyMem_Malloc(sizeof(unsigned long long) * (size_t)(count + 1));
    if (out == NULL || buf == NULL || found == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < count; i++) { /* steps 1 and 2: find, publish */
        PyObject *key = PyList_GET_ITEM(keys, i);
        uintptr_t slot;
        if (!PyBytes_Check(key)) {
            PyErr_SetString(PyExc_TypeError, "lease_entries: keys must be bytes");
            goto fail;
        }
        if (get_addr(PyList_GET_ITEM(slots, i), &slot) < 0)
            goto fail;
        const char *k = PyBytes_AS_STRING(key);
        Py_ssize_t keylen = PyBytes_GET_SIZE(key);
        Entry head;
        PyObject *result = Py_None; /* absent, or torn: the broker answers */
        if (bufsize > 0 &&
            find(base, n, size, k, keylen, fnv1a(k, keylen), buf, bufsize, &found[i], &head) ==
                1) {
            result = Py_BuildValue("KKy#", head.oid, head.version, buf + keylen,
                                   (Py_ssize_t)head.desclen);
            if (result == NULL)
                goto fail;
            __atomic_store_n((uint64_t *)slot, head.oid, __ATOMIC_SEQ_CST);
        } else {
            Py_INCREF(result);
        }
        PyList_SET_ITEM(out, i, result);
    }
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the slots seen before the entries are read again */
    int table_moved = __atomic_load_n((uint64_t *)moved, __ATOMIC_ACQUIRE) != 0;
    for (Py_ssize_t i = 0; i < count; i++) { /* step 3: still listed, in a table not moved */
        PyObject *result = PyList_GET_ITEM(out, i);
        if (result == Py_None)
            continue;
        uint64_t oid = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(result, 0));
        Entry now;
        if (!table_moved && read_entry((Entry *)(base + found[i] * size), &now, NULL, 0) == 0 &&
            now.state == 1 && now.oid == oid)
            continue;
        uintptr_t slot;
        get_addr(PyList_GET_ITEM(slots, i), &slot); /* read once already */
        __atomic_store_n((uint64_t *)slot, 0, __ATOMIC_RELEASE);
        PyList_SET_ITEM(out, i, Py_NewRef(Py_True));
        Py_DECREF(result);
    }
    PyMem_Free(buf);
    PyMem_Free(found);
    return out;
fail:
    Py_XDECREF(out);
    PyMem_Free(buf);
    PyMem_Free(found);
    return PyErr_Occurred() ? NULL : PyErr_NoMemory();
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

/* A slot let go keeps its object id with this bit set until the client takes the slot again
 * or the broker harvests it (slots_harvest): a read the broker can count as a use. */
#define RELEASED (1ULL << 63)

/* Client: let go; every read of the object happened before (release). */
static PyObject *slot_clear(PyObject *self, PyObject *arg) {
    (void)self;
    uintptr_t a;
    if (get_addr(arg, &a) < 0)
        return NULL;
    uint64_t oid = __atomic_load_n((uint64_t *)a, __ATOMIC_RELAXED); /* only this client's */
    __atomic_store_n((uint64_t *)a, oid == 0 ? 0 : oid | RELEASED, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* Broker: the object ids of the slots let go since the last harvest, in `count` slots from
 * `addr`; each such slot becomes empty (a CAS: a slot its client took again keeps what it
 * holds). */
static PyObject *slots_harvest(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *addr;
    Py_ssize_t count;
    uintptr_t a;
    if (!PyArg_ParseTuple(args, "On:slots_harvest", &addr, &count) || get_addr(addr, &a) < 0)
        return NULL;
    PyObject *used = PySet_New(NULL);
    if (used == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t *slot = (uint64_t *)a + i;
        uint64_t v = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
        if (!(v & RELEASED) ||
            !__atomic_compare_exchange_n(slot, &v, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;
        PyObject *k = PyLong_FromUnsignedLongLong(v & ~RELEASED);
        if (k == NULL || PySet_Add(used, k) < 0) {
            Py_XDECREF(k);
            Py_DECREF(used);
            return NULL;
        }
        Py_DECREF(k);
    }
    return used;
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
        if (oid == 0 || (oid & RELEASED))
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

static PyObject *cas(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *a;
    unsigned long long expected, desired;
    uintptr_t addr;
    if (!PyArg_ParseTuple(args, "OKK", &a, &expected, &desired) || get_addr(a, &addr) < 0)
        return NULL;
    uint64_t want = expected;
    int done = __atomic_compare_exchange_n((uint64_t *)addr, &want, (uint64_t)desired, 0,
                                           __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    return PyBool_FromLong(done);
}

static void bell_ring(uintptr_t mailbox) {
    uint32_t *bell = (uint32_t *)(mailbox + 8);
    __atomic_add_fetch(bell, 1, __ATOMIC_SEQ_CST);
    syscall(SYS_futex, bell, FUTEX_WAKE, 1, NULL, NULL, 0);
}

static PyObject *ring(PyObject *self, PyObject *arg) {
    (void)self;
    uintptr_t addr;
    if (get_addr(arg, &addr) < 0)
        return NULL;
    bell_ring(addr);
    Py_RETURN_NONE;
}

static PyObject *bell(PyObject *self, PyObject *arg) {
    (void)self;
    uintptr_t addr;
    if (get_addr(arg, &addr) < 0)
        return NULL;
    return PyLong_FromUnsignedLong(__atomic_load_n((uint32_t *)(addr + 8), __ATOMIC_SEQ_CST));
}

static PyObject *bell_wait(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *a;
    unsigned long seen;
    double timeout;
    uintptr_t addr;
    if (!PyArg_ParseTuple(args, "Okd", &a, &seen, &timeout) || get_addr(a, &addr) < 0)
        return NULL;
    if (timeout < 0)
        timeout = 0;
    struct timespec ts = {(time_t)timeout, (long)((timeout - (double)(time_t)timeout) * 1e9)};
    Py_BEGIN_ALLOW_THREADS
    syscall(SYS_futex, (uint32_t *)(addr + 8), FUTEX_WAIT, (uint32_t)seen, &ts, NULL, 0);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* The offer made to the client of mailbox `addr`, read under its seqlock into f (queue,
 * token, mailbox index, lease, version, request, applied) and c (the consumer's session
 * token); 0 if there is none. The broker rewrites an offer as each of the producer's seals
 * is applied: a read that meets a write under way tries again, a few times, rather than
 * miss the offer. */
static int read_offer(uintptr_t addr, uint64_t *f, char *c) {
    uint64_t *w = (uint64_t *)(addr + OFFER);
    for (int tries = 0;; tries++) {
        uint64_t seq = __atomic_load_n(w, __ATOMIC_ACQUIRE);
        if (seq == 0)
            return 0;
        if (!(seq & 1)) {
            for (int i = 0; i < OFFER_WORDS - 1; i++)
                f[i] = __atomic_load_n(&w[1 + i], __ATOMIC_RELAXED);
            memcpy(c, (char *)&w[OFFER_WORDS], CONSUMER);
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (__atomic_load_n(w, __ATOMIC_RELAXED) == seq)
                return f[1] != 0;
        }
        if (tries == MAX_OFFER_TRIES)
            return 0;
    }
}

static Py_ssize_t token_len(const char *c) {
    Py_ssize_t n = 0;
    while (n < CONSUMER && c[n])
        n++;
    return n;
}

static PyObject *hand_over(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *a, *b;
    unsigned long long size, queue, last, oid, put, base;
    const char *tail;
    Py_ssize_t n;
    uintptr_t addr, boxes;
    if (!PyArg_ParseTuple(args, "OOKKKKKKy#", &a, &b, &size, &queue, &last, &oid, &put, &base,
                          &tail, &n) ||
        get_addr(a, &addr) < 0 || get_addr(b, &boxes) < 0)
        return NULL;
    uint64_t f[OFFER_WORDS - 1];
    char c[CONSUMER];
    if (!read_offer(addr, f, c) || f[0] != queue || f[6] < last)
        Py_RETURN_NONE;
    uint64_t token = f[1], index = f[2], lease = f[3], version = f[4], request = f[5];
    if (index >= size / MAILBOX || n > MAILBOX_BODY - BODY_HEAD)
        Py_RETURN_NONE; /* an index out of the segment, or an item too big: the broker's way */
    uintptr_t box = boxes + index * MAILBOX;
    /* The answer is made first: no Python error may come once the mailbox is claimed. */
    PyObject *handed = Py_BuildValue("(iKs#KK)", 1, (unsigned long long)token, c, token_len(c),
                                     (unsigned long long)lease, (unsigned long long)version);
    PyObject *undone = PyLong_FromLong(2);
    if (handed == NULL || undone == NULL) {
        Py_XDECREF(handed);
        Py_XDECREF(undone);
        return NULL; /* nothing claimed: the item goes through the broker */
    }
    uint64_t want = (token << 8) | M_OPEN;
    if (!__atomic_compare_exchange_n((uint64_t *)box, &want, (token << 8) | M_CLAIMED, 0,
                                     __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        Py_DECREF(handed);
        Py_DECREF(undone);
        Py_RETURN_NONE;
    }
    uint64_t head[6] = {request, lease, version, oid, put, base};
    memcpy((char *)(box + 16), head, BODY_HEAD);
    memcpy((char *)(box + 16 + BODY_HEAD), tail, (size_t)n);
    __atomic_store_n((uint32_t *)(box + 12), (uint32_t)(BODY_HEAD + n), __ATOMIC_RELAXED);
    want = (token << 8) | M_CLAIMED;
    if (__atomic_compare_exchange_n((uint64_t *)box, &want, (token << 8) | M_FILLED, 0,
                                    __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        bell_ring(box);
        Py_DECREF(undone);
        return handed;
    }
    /* Taken back before the fill: (2, token, ...). The tuple is ours alone, just made. */
    PyObject *one = PyTuple_GET_ITEM(handed, 0);
    PyTuple_SET_ITEM(handed, 0, undone);
    Py_DECREF(one);
    return handed;
}

/* The item handed to get `request` in mailbox `addr`, if it is filled and for that get. */
static PyObject *mailbox_take(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *a;
    unsigned long long request;
    uintptr_t addr;
    if (!PyArg_ParseTuple(args, "OK", &a, &request) || get_addr(a, &addr) < 0)
        return NULL;
    uint64_t state = __atomic_load_n((uint64_t *)addr, __ATOMIC_ACQUIRE);
    uint32_t len = __atomic_load_n((uint32_t *)(addr + 12), __ATOMIC_RELAXED);
    if ((state & 0xff) != M_FILLED || len < BODY_HEAD || len > MAILBOX_BODY)
        Py_RETURN_NONE;
    uint64_t head[6];
    memcpy(head, (char *)(addr + 16), BODY_HEAD);
    if (head[0] != request)
        Py_RETURN_NONE; /* for a get given up earlier: it stays where it is */
    return Py_BuildValue("(KKKKKy#)", (unsigned long long)head[1], (unsigned long long)head[2],
                         (unsigned long long)head[3], (unsigned long long)head[4],
                         (unsigned long long)head[5], (const char *)(addr + 16 + BODY_HEAD),
                         (Py_ssize_t)(len - BODY_HEAD));
}

/* ---- broadcast rings ------------------------------------------------------------------ */

static inline uint64_t *ring_slot(uintptr_t ring, uint64_t index) {
    return (uint64_t *)(ring + RING_HEADER + index * RING_SLOT);
}

/* Both bit sets of a slot empty: `unread` loaded first (a taker sets `held` before it clears
 * `unread`, so this order never sees a taken item as let go). */
static inline int ring_slot_idle(uint64_t *slot) {
    return __atomic_load_n(&slot[1], __ATOMIC_SEQ_CST) == 0 &&
           __atomic_load_n(&slot[2], __ATOMIC_SEQ_CST) == 0;
}

static PyObject *ring_publish(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *a;
    unsigned long long index, version, unread, oid, put, base;
    unsigned int flags;
    const char *tail;
    Py_ssize_t taillen;
    uintptr_t ring;
    if (!PyArg_ParseTuple(args, "OKKKIKKKy#:ring_publish", &a, &index, &version, &unread,
                          &flags, &oid, &put, &base, &tail, &taillen) ||
        get_addr(a, &ring) < 0)
        return NULL;
    if (taillen > RING_TAIL) {
        PyErr_Format(PyExc_ValueError, "a ring slot's tail of %zd bytes (at most %d)", taillen,
                     RING_TAIL);
        return NULL;
    }
    uint64_t *slot = ring_slot(ring, index);
    __atomic_store_n(&slot[1], (uint64_t)unread, __ATOMIC_RELAXED);
    __atomic_store_n(&slot[2], (uint64_t)0, __ATOMIC_RELAXED);
    uint32_t *f = (uint32_t *)&slot[3];
    f[0] = flags;
    f[1] = (uint32_t)taillen;
    slot[4] = oid;
    slot[5] = put;
    slot[6] = base;
    memcpy(&slot[8], tail, (size_t)taillen);
    __atomic_store_n(&slot[0], (uint64_t)version, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *ring_wake(PyObject *self, PyObject *arg) {
    (void)self;
    uintptr_t ring;
    if (get_addr(arg, &ring) < 0)
        return NULL;
    uint32_t *bell = (uint32_t *)(ring + 8);
    __atomic_add_fetch(bell, 1, __ATOMIC_SEQ_CST);
    syscall(SYS_futex, bell, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
    Py_RETURN_NONE;
}

/* The slot that holds `version`, looked for from `hint` on; -1 if none does. */
static long long ring_find(uintptr_t ring, uint64_t slots, uint64_t hint, uint64_t version) {
    for (uint64_t i = 0; i < slots; i++) {
        uint64_t index = (hint + i) % slots;
        if (__atomic_load_n(ring_slot(ring, index), __ATOMIC_ACQUIRE) == version)
            return (long long)index;
    }
    return -1;
}

static PyObject *ring_take(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *a;
    unsigned long long slots, version;
    unsigned int bit;
    uintptr_t ring;
    if (!PyArg_ParseTuple(args, "OKKI:ring_take", &a, &slots, &version, &bit) ||
        get_addr(a, &ring) < 0)
        return NULL;
    long long index = ring_find(ring, slots, version % slots, version);
    if (index < 0)
        Py_RETURN_NONE;
    uint64_t *slot = ring_slot(ring, (uint64_t)index);
    uint64_t mine = (uint64_t)1 << (bit & 63);
    if (!(__atomic_load_n(&slot[1], __ATOMIC_SEQ_CST) & mine))
        Py_RETURN_FALSE; /* not for this subscription (ended, or subscribed after it) */
    uint32_t *f = (uint32_t *)&slot[3];
    uint32_t flags = f[0], taillen = f[1];
    if (taillen > RING_TAIL)
        taillen = 0;
    /* Read while this subscription's bit is set (the slot cannot be emptied), then claim:
     * `held` first, so that no one sees both sets empty in between; the bit in `unread` is
     * cleared by one side only (this, or the broker ending the subscription). */
    PyObject *out = Py_BuildValue("(IKKKKy#O)", flags, (unsigned long long)index,
                                  (unsigned long long)slot[4], (unsigned long long)slot[5],
                                  (unsigned long long)slot[6], (const char *)&slot[8],
                                  (Py_ssize_t)((flags & RING_ASK) ? 0 : taillen), Py_False);
    if (out == NULL)
        return NULL;
    uint64_t had = __atomic_fetch_or(&slot[2], mine, __ATOMIC_SEQ_CST);
    uint64_t was = __atomic_fetch_and(&slot[1], ~mine, __ATOMIC_SEQ_CST);
    if (!(was & mine) || __atomic_load_n(&slot[0], __ATOMIC_SEQ_CST) != version) {
        if (!(had & mine)) /* ended meanwhile: undo only what this call set */
            __atomic_fetch_and(&slot[2], ~mine, __ATOMIC_SEQ_CST);
        Py_DECREF(out);
        Py_RETURN_FALSE;
    }
    if (flags & RING_ASK) { /* nothing to hold: the broker has the item for this get */
        __atomic_fetch_and(&slot[2], ~mine, __ATOMIC_SEQ_CST);
        if (ring_slot_idle(slot)) {
            Py_DECREF(out);
            return Py_BuildValue("(IKKKKy#O)", flags, (unsigned long long)index, 0ULL, 0ULL,
                                 0ULL, "", (Py_ssize_t)0, Py_True);
        }
    }
    return out;
}

static PyObject *ring_release(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *a;
    unsigned long long index, version, unread, held;
    uintptr_t ring;
    if (!PyArg_ParseTuple(args, "OKKKK:ring_release", &a, &index, &version, &unread, &held) ||
        get_addr(a, &ring) < 0)
        return NULL;
    uint64_t *slot = ring_slot(ring, index);
    if (__atomic_load_n(&slot[0], __ATOMIC_ACQUIRE) != version)
        Py_RETURN_FALSE; /* emptied already: its subscribers' bits went with it */
    if (unread)
        __atomic_fetch_and(&slot[1], ~(uint64_t)unread, __ATOMIC_SEQ_CST);
    if (held)
        __atomic_fetch_and(&slot[2], ~(uint64_t)held, __ATOMIC_SEQ_CST);
    return PyBool_FromLong(ring_slot_idle(slot));
}

static PyObject *ring_idle(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *a;
    unsigned long long index;
    uintptr_t ring;
    if (!PyArg_ParseTuple(args, "OK:ring_idle", &a, &index) || get_addr(a, &ring) < 0)
        return NULL;
    return PyBool_FromLong(ring_slot_idle(ring_slot(ring, index)));
}

/* The bytes of a C-contiguous buffer, copied to `address`: one call for a small put's copy. */
static PyObject *copy_in(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *a, *src;
    uintptr_t addr;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "OO:copy_in", &a, &src) || get_addr(a, &addr) < 0)
        return NULL;
    if (PyObject_GetBuffer(src, &view, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (view.len >= (1 << 16)) {
        Py_BEGIN_ALLOW_THREADS
        memcpy((void *)addr, view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        memcpy((void *)addr, view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *mailbox_read(PyObject *self, PyObject *arg) {
    (void)self;
    uintptr_t addr;
    if (get_addr(arg, &addr) < 0)
        return NULL;
    uint64_t state = __atomic_load_n((uint64_t *)addr, __ATOMIC_ACQUIRE);
    if ((state & 0xff) != M_FILLED)
        return Py_BuildValue("(KO)", (unsigned long long)state, Py_None);
    uint32_t len = __atomic_load_n((uint32_t *)(addr + 12), __ATOMIC_RELAXED);
    if (len > MAILBOX_BODY)
        len = 0;
    return Py_BuildValue("(Ky#)", (unsigned long long)state, (const char *)(addr + 16),
                         (Py_ssize_t)len);
}

static PyObject *offer_write(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *a;
    unsigned long long f[OFFER_WORDS - 1];
    const char *consumer;
    Py_ssize_t n;
    uintptr_t addr;
    if (!PyArg_ParseTuple(args, "OKKKKKKKy#", &a, &f[0], &f[1], &f[2], &f[3], &f[4], &f[5],
                          &f[6], &consumer, &n) ||
        get_addr(a, &addr) < 0)
        return NULL;
    if (n > CONSUMER) {
        PyErr_SetString(PyExc_ValueError, "consumer token too long");
        return NULL;
    }
    uint64_t *w = (uint64_t *)(addr + OFFER);
    uint64_t seq = __atomic_load_n(w, __ATOMIC_RELAXED);
    __atomic_store_n(w, seq | 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    for (int i = 0; i < OFFER_WORDS - 1; i++)
        __atomic_store_n(&w[1 + i], (uint64_t)f[i], __ATOMIC_RELAXED);
    char *c = (char *)&w[OFFER_WORDS];
    memset(c, 0, CONSUMER);
    memcpy(c, consumer, (size_t)n);
    __atomic_store_n(w, (seq | 1) + 1, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *offer_read(PyObject *self, PyObject *arg) {
    (void)self;
    uintptr_t addr;
    if (get_addr(arg, &addr) < 0)
        return NULL;
    uint64_t f[OFFER_WORDS - 1];
    char c[CONSUMER];
    if (!read_offer(addr, f, c))
        Py_RETURN_NONE;
    return Py_BuildValue("(KKKKKKKs#)", (unsigned long long)f[0], (unsigned long long)f[1],
                         (unsigned long long)f[2], (unsigned long long)f[3],
                         (unsigned long long)f[4], (unsigned long long)f[5],
                         (unsigned long long)f[6], c, token_len(c));
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
    {"lease_entries", lease_entries, METH_VARARGS,
     "lease_entries(base, entries, entry_size, keys, slots, moved) -> [(oid, version, desc) | "
     "None absent or torn | True changed under the lease (slot cleared)]."},
    {"slot_publish", slot_publish, METH_VARARGS, "slot_publish(address, oid), then a fence."},
    {"slot_clear", slot_clear, METH_O,
     "slot_clear(address): let go (release); the id stays, marked, for slots_harvest."},
    {"slots_scan", slots_scan, METH_VARARGS, "slots_scan(address, count) -> {oid: slots}."},
    {"slots_harvest", slots_harvest, METH_VARARGS,
     "slots_harvest(address, count) -> {oid of a slot let go since}; those slots emptied."},
    {"fence", fence, METH_NOARGS, "A full (seq_cst) fence."},
    {"cas", cas, METH_VARARGS, "cas(address, expected, new) -> bool (acq_rel)."},
    {"ring", ring, METH_O, "ring(mailbox): bump its bell and wake one waiter."},
    {"bell", bell, METH_O, "bell(mailbox) -> the bell's count."},
    {"bell_wait", bell_wait, METH_VARARGS,
     "bell_wait(mailbox, seen, timeout): sleep while the bell is `seen`, at most `timeout` s."},
    {"hand_over", hand_over, METH_VARARGS,
     "hand_over(bell, mailboxes, size, queue, last, oid, put, base, tail) -> None if not "
     "claimed (no offer for `queue` made once seal `last` was applied, or OPEN(token) no "
     "more), else (done, token, consumer, lease, version): done 1 claimed, filled and rung, 2 "
     "claimed but taken back before it was filled."},
    {"mailbox_take", mailbox_take, METH_VARARGS,
     "mailbox_take(mailbox, request) -> (lease, version, oid, put, base, tail) of the item "
     "filled for get `request`, or None."},
    {"copy_in", copy_in, METH_VARARGS,
     "copy_in(address, buffer): its bytes (C-contiguous) copied to `address`."},
    {"mailbox_read", mailbox_read, METH_O,
     "mailbox_read(mailbox) -> (state, body or None unless filled)."},
    {"offer_write", offer_write, METH_VARARGS,
     "offer_write(mailbox, queue, token, index, lease, version, request, applied, consumer) "
     "under its seqlock."},
    {"offer_read", offer_read, METH_O,
     "offer_read(mailbox) -> (queue, token, index, lease, version, request, applied, consumer)"
     " | None."},
    {"ring_publish", ring_publish, METH_VARARGS,
     "ring_publish(ring, index, version, unread, flags, oid, put, base, tail): fill slot "
     "`index`, its version stored last (release). No wake: ring_wake."},
    {"ring_wake", ring_wake, METH_O, "ring_wake(ring): bump its bell and wake every waiter."},
    {"ring_take", ring_take, METH_VARARGS,
     "ring_take(ring, slots, version, bit) -> None if no slot holds `version`, False if it "
     "is not for subscription `bit`, else (flags, index, oid, put, base, tail, idle): taken "
     "(held, unless an ASK slot; idle: an ASK slot every subscription took)."},
    {"ring_release", ring_release, METH_VARARGS,
     "ring_release(ring, index, version, unread, held) -> whether slot `index`, if it still "
     "holds `version`, is idle once those bits are cleared from its unread and held sets."},
    {"ring_idle", ring_idle, METH_VARARGS,
     "ring_idle(ring, index) -> whether no subscription has slot `index` to take or holds it."},
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
    if (PyModule_AddIntConstant(m, "ENTRY_HEAD", HEAD) < 0 ||
        PyModule_AddIntConstant(m, "MAILBOX", MAILBOX) < 0 ||
        PyModule_AddIntConstant(m, "MAILBOX_BODY", MAILBOX_BODY) < 0 ||
        PyModule_AddIntConstant(m, "BODY_HEAD", BODY_HEAD) < 0 ||
        PyModule_AddIntConstant(m, "RING_HEADER", RING_HEADER) < 0 ||
        PyModule_AddIntConstant(m, "RING_SLOT", RING_SLOT) < 0 ||
        PyModule_AddIntConstant(m, "RING_TAIL", RING_TAIL) < 0 ||
        PyModule_AddIntConstant(m, "RING_ASK", RING_ASK) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
