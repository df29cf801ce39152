/*
 * shoal._shmalloc: a numpy data-memory handler that lets large arrays made by a task
 * live in shared memory from the start, so that publishing a result to same-host
 * readers needs no copy.
 *
 * Allocations of at least `threshold` bytes ask a Python callable, `provide(size)`,
 * for an address (it hands out space in a shared-memory segment that is already
 * mapped and faulted in) and fall back to numpy's default handler when it returns
 * None. Everything else goes to numpy's default handler untouched, so small arrays
 * cost what they always cost. Freeing one of the provided blocks calls
 * `release(address)`; that callable must not take locks (it may run inside the
 * garbage collector): shoal's queues the address and deals with it later.
 *
 * numpy keeps the current handler in a context variable: `install()` affects the
 * calling thread's context only (shoal calls it in its task threads).
 *
 * No numpy headers are needed: the handler struct below is numpy's documented
 * PyDataMem_Handler (version 1, numpy >= 1.22) and the two functions are taken from
 * numpy's C-API table at run time.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    void *ctx;
    void *(*malloc)(void *ctx, size_t size);
    void *(*calloc)(void *ctx, size_t nelem, size_t elsize);
    void *(*realloc)(void *ctx, void *ptr, size_t new_size);
    void (*free)(void *ctx, void *ptr, size_t size);
} Allocator;

typedef struct {
    char name[127];
    uint8_t version;
    Allocator allocator;
} Handler;

/* indices in numpy's C-API table (stable since numpy 1.22) */
#define API_SET_HANDLER 304
#define API_DEFAULT_HANDLER 306

static PyObject *(*set_handler)(PyObject *) = NULL;
static Allocator *fallback = NULL; /* numpy's default allocator */
static PyObject *provide_cb = NULL;
static PyObject *release_cb = NULL;
static size_t threshold = 1 << 20;

/* the live provided blocks: address -> size (few at a time: a linear table) */
typedef struct {
    void *ptr;
    size_t size;
} Block;
static Block *blocks = NULL;
static size_t nblocks = 0, capblocks = 0;
static pthread_mutex_t blocks_lock = PTHREAD_MUTEX_INITIALIZER;
static __thread int in_callback = 0;

static int remember(void *ptr, size_t size) {
    int ok = 1;
    pthread_mutex_lock(&blocks_lock);
    if (nblocks == capblocks) {
        size_t cap = capblocks ? 2 * capblocks : 64;
        Block *grown = realloc(blocks, cap * sizeof(Block));
        if (grown == NULL) {
            ok = 0;
        } else {
            blocks = grown;
            capblocks = cap;
        }
    }
    if (ok) {
        blocks[nblocks].ptr = ptr;
        blocks[nblocks].size = size;
        nblocks++;
    }
    pthread_mutex_unlock(&blocks_lock);
    return ok;
}

/* forget `ptr` if it is a provided block; its size in *size; 1 if it was one */
static int forget(void *ptr, size_t *size) {
    int found = 0;
    pthread_mutex_lock(&blocks_lock);
    for (size_t i = 0; i < nblocks; i++) {
        if (blocks[i].ptr == ptr) {
            *size = blocks[i].size;
            blocks[i] = blocks[--nblocks];
            found = 1;
            break;
        }
    }
    pthread_mutex_unlock(&blocks_lock);
    return found;
}

static void give_back(void *ptr);

static void *provide(size_t size) {
    if (size < threshold || provide_cb == NULL || in_callback) return NULL;
    void *ptr = NULL;
    PyGILState_STATE gil = PyGILState_Ensure();
    in_callback = 1;
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *res = PyObject_CallFunction(provide_cb, "n", (Py_ssize_t)size);
    if (res == NULL) {
        PyErr_WriteUnraisable(provide_cb);
    } else {
        if (res != Py_None) {
            ptr = PyLong_AsVoidPtr(res);
            if (ptr == NULL && PyErr_Occurred()) PyErr_WriteUnraisable(provide_cb);
        }
        Py_DECREF(res);
    }
    PyErr_Restore(et, ev, tb);
    in_callback = 0;
    if (ptr != NULL && !remember(ptr, size)) {
        /* cannot track it: hand it back at once */
        give_back(ptr);
        ptr = NULL;
    }
    PyGILState_Release(gil);
    return ptr;
}

static void give_back(void *ptr) {
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *addr = PyLong_FromVoidPtr(ptr);
    PyObject *res = addr ? PyObject_CallOneArg(release_cb, addr) : NULL;
    if (res == NULL) PyErr_WriteUnraisable(release_cb);
    Py_XDECREF(res);
    Py_XDECREF(addr);
    PyErr_Restore(et, ev, tb);
    PyGILState_Release(gil);
}

static void *h_malloc(void *ctx, size_t size) {
    void *p = provide(size);
    return p ? p : fallback->malloc(fallback->ctx, size);
}

static void *h_calloc(void *ctx, size_t nelem, size_t elsize) {
    size_t size;
    if (__builtin_mul_overflow(nelem, elsize, &size)) return NULL;
    void *p = provide(size);
    if (p) {
        memset(p, 0, size); /* reused pages hold old data */
        return p;
    }
    return fallback->calloc(fallback->ctx, nelem, elsize);
}

static void *h_realloc(void *ctx, void *ptr, size_t new_size) {
    size_t old;
    if (ptr != NULL && forget(ptr, &old)) {
        void *p = h_malloc(ctx, new_size ? new_size : 1);
        if (p == NULL) {
            remember(ptr, old); /* realloc failed: the old block stays valid */
            return NULL;
        }
        memcpy(p, ptr, old < new_size ? old : new_size);
        give_back(ptr);
        return p;
    }
    return fallback->realloc(fallback->ctx, ptr, new_size);
}

static void h_free(void *ctx, void *ptr, size_t size) {
    size_t old;
    /* nblocks read without the lock: a block being added concurrently is not ptr */
    if (ptr != NULL && nblocks > 0 && forget(ptr, &old)) {
        give_back(ptr);
        return;
    }
    fallback->free(fallback->ctx, ptr, size);
}

static Handler handler = {
    "shoal_shared_memory", 1, {NULL, h_malloc, h_calloc, h_realloc, h_free},
};
static PyObject *handler_capsule = NULL;

static int load_numpy(void) {
    if (set_handler != NULL) return 0;
    PyObject *mod = PyImport_ImportModule("numpy._core._multiarray_umath");
    if (mod == NULL) {
        PyErr_Clear();
        mod = PyImport_ImportModule("numpy.core._multiarray_umath");
    }
    if (mod == NULL) return -1;
    PyObject *cap = PyObject_GetAttrString(mod, "_ARRAY_API");
    Py_DECREF(mod);
    if (cap == NULL) return -1;
    void **api = (void **)PyCapsule_GetPointer(cap, NULL);
    Py_DECREF(cap);
    if (api == NULL) return -1;
    PyObject *dflt = *(PyObject **)api[API_DEFAULT_HANDLER];
    Handler *d = (Handler *)PyCapsule_GetPointer(dflt, "mem_handler");
    if (d == NULL) return -1;
    if (d->version != 1) {
        PyErr_Format(PyExc_RuntimeError, "numpy's memory handler has version %d, not 1", d->version);
        return -1;
    }
    fallback = &d->allocator;
    set_handler = (PyObject * (*)(PyObject *)) api[API_SET_HANDLER];
    handler_capsule = PyCapsule_New(&handler, "mem_handler", NULL);
    return handler_capsule ? 0 : -1;
}

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *prov, *rel;
    Py_ssize_t thr;
    if (!PyArg_ParseTuple(args, "OOn", &prov, &rel, &thr)) return NULL;
    if (!PyCallable_Check(prov) || !PyCallable_Check(rel)) {
        PyErr_SetString(PyExc_TypeError, "provide and release must be callable");
        return NULL;
    }
    if (thr < 1) {
        PyErr_SetString(PyExc_ValueError, "threshold must be >= 1");
        return NULL;
    }
    if (load_numpy() < 0) return NULL;
    Py_INCREF(prov);
    Py_INCREF(rel);
    Py_XSETREF(provide_cb, prov);
    Py_XSETREF(release_cb, rel);
    threshold = (size_t)thr;
    Py_RETURN_NONE;
}

static PyObject *install(PyObject *self, PyObject *unused) {
    if (provide_cb == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "configure() first");
        return NULL;
    }
    PyObject *old = set_handler(handler_capsule);
    if (old == NULL) return NULL;
    Py_DECREF(old);
    Py_RETURN_NONE;
}

static PyObject *live(PyObject *self, PyObject *unused) {
    pthread_mutex_lock(&blocks_lock);
    size_t n = nblocks;
    pthread_mutex_unlock(&blocks_lock);
    return PyLong_FromSize_t(n);
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(provide, release, threshold): the callables that hand out and take back "
     "shared memory, and the smallest allocation offered to them."},
    {"install", install, METH_NOARGS,
     "Use this handler for numpy arrays made in the calling thread's context."},
    {"live", live, METH_NOARGS, "How many provided blocks numpy still holds."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shoal._shmalloc",
    "Large numpy arrays of shoal's task threads, allocated in shared memory.", -1, methods,
};

PyMODINIT_FUNC PyInit__shmalloc(void) { return PyModule_Create(&module); }
