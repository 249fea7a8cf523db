/* A query batch's work per term on the host, one pass each (gpusparse._queries_native).
 *
 * quantize() gives each row's weights as levels of the row's own power-of-two step, as
 * gpusparse.quantize.quantize_queries defines them: the smallest step 2**e with
 * max / step <= 2**bits - 1 (e from the largest weight's binary exponent), each weight
 * rounded half to even to a level, level * step stored as float32, terms of level 0 dropped
 * (level * step is a float32 exactly: 0 only for level 0). pad() lays rows out as the
 * tiled engine's CUDA graph reads a batch: int64 terms (-1 after a row's end) and float32
 * weights (0 there), [rows, width]. longest() and stage() serve a CUDA graph's batch: its
 * longest row (the graph's width) and its rows copied as they are into the graph's staging
 * buffer. Each is one pass in C instead of several numpy calls: a batch's host time before its
 * launch is on a single batch's latency.
 *
 * Limited API (abi3, CPython 3.11+): one binary for every later CPython. The passes run
 * without the GIL.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_native_buffers.h"

/* Row pointers [n + 1] that never decrease: 0, else -1 with an error. */
static int rising(const int64_t *indptr, Py_ssize_t n) {
    for (Py_ssize_t r = 0; r < n; r++)
        if (indptr[r + 1] < indptr[r]) {
            PyErr_SetString(PyExc_ValueError, "indptr must not decrease");
            return -1;
        }
    return 0;
}

/* Row pointers [n + 1] that rise from indptr[0] and end at indptr[0] + nnz: 0, else -1 with an error. */
static int check_rows(const int64_t *indptr, Py_ssize_t n, Py_ssize_t nnz) {
    if (rising(indptr, n) < 0) return -1;
    if (indptr[n] - indptr[0] != nnz) {
        PyErr_SetString(PyExc_ValueError, "indptr does not end at the number of values");
        return -1;
    }
    return 0;
}

/* The rows' three arrays (indptr int64, indices int32, values float32) into b[0], b[1], b[2]: 0, else -1. */
static int get_rows(PyObject *indptr, PyObject *indices, PyObject *values, Buf *b) {
    if (get(indptr, &b[0], 0, 8, "indptr") < 0 || get(indices, &b[1], 0, 4, "indices") < 0 ||
        get(values, &b[2], 0, 4, "values") < 0)
        return -1;
    return 0;
}

PyDoc_STRVAR(quantize_doc, "quantize(indptr, indices, values, bits, out_indptr, out_indices, out_values)\n--\n\n"
                           "Each row (indptr int64, indices int32, values float32) with its weights as levels of "
                           "its own\npower-of-two step, level * step (float32), terms of level 0 dropped, into the "
                           "outputs (room for\nevery term); returns how many terms are kept.");

static PyObject *quantize(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_indptr, *o_indices, *o_values, *o_optr, *o_oind, *o_oval;
    int bits;
    if (!PyArg_ParseTuple(args, "OOOiOOO", &o_indptr, &o_indices, &o_values, &bits, &o_optr, &o_oind, &o_oval))
        return NULL;
    if (bits < 1 || bits > 16) {
        PyErr_SetString(PyExc_ValueError, "bits must be in 1..16");
        return NULL;
    }
    Buf b[6];
    memset(b, 0, sizeof b);
    PyObject *result = NULL;
    if (get_rows(o_indptr, o_indices, o_values, b) < 0 || get(o_optr, &b[3], 1, 8, "out_indptr") < 0 ||
        get(o_oind, &b[4], 1, 4, "out_indices") < 0 || get(o_oval, &b[5], 1, 4, "out_values") < 0)
        goto done;
    Py_ssize_t n = b[0].view.len / 8 - 1, nnz = b[2].view.len / 4;
    if (n < 0 || b[1].view.len / 4 != nnz || b[3].view.len / 8 != n + 1 || b[4].view.len / 4 != nnz ||
        b[5].view.len / 4 != nnz) {
        PyErr_SetString(PyExc_ValueError, "indptr needs n + 1 entries, indices as many as values; outputs alike");
        goto done;
    }
    const int64_t *indptr = b[0].view.buf;
    const int32_t *indices = b[1].view.buf;
    const float *values = b[2].view.buf;
    int64_t *optr = b[3].view.buf;
    int32_t *oind = b[4].view.buf;
    float *oval = b[5].view.buf;
    if (check_rows(indptr, n, nnz) < 0) goto done;
    Py_ssize_t kept = 0;
    const double top = (double)((1 << bits) - 1);
    Py_BEGIN_ALLOW_THREADS
    optr[0] = 0;
    for (Py_ssize_t r = 0; r < n; r++) {
        const int64_t a = indptr[r] - indptr[0], e = indptr[r + 1] - indptr[0];
        /* the row's largest weight: four running maxima (one would wait on each compare) */
        float m4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (a < e) m4[0] = m4[1] = m4[2] = m4[3] = values[a];
        int64_t i = a;
        for (; i + 4 <= e; i += 4)
            for (int j = 0; j < 4; j++) m4[j] = values[i + j] > m4[j] ? values[i + j] : m4[j];
        for (; i < e; i++) m4[0] = values[i] > m4[0] ? values[i] : m4[0];
        const double m = (double)(m4[0] > m4[1] ? m4[0] : m4[1]) > (double)(m4[2] > m4[3] ? m4[2] : m4[3])
                             ? (double)(m4[0] > m4[1] ? m4[0] : m4[1])
                             : (double)(m4[2] > m4[3] ? m4[2] : m4[3]);
        double step = 1.0;
        if (m > 0) { /* quantize.power_of_two_steps: m = f * 2**x, f in [0.5, 1); e = x - bits, or one more */
            int x;
            frexp(m, &x);
            x -= bits;
            if (m > ldexp(top, x)) x += 1;
            step = ldexp(1.0, x);
        }
        /* v / step as v * (1 / step): both the exact v * 2**-x rounded once, 1 / step being a
         * power of two in float64's range for every float32 row maximum (2**-165 <= step <= 2**128) */
        const double inv = 1.0 / step;
        /* One branch-free pass over the row (the compiler vectorises it), then, only where a
         * level is 0 (rare), the row's kept terms moved together. Half to even: y + 2**52 rounds
         * y to an integer in the default rounding mode for 0 <= y < 2**52, and every y of a row
         * is at most 2**bits - 1 (its largest weight over the step). A negative weight's y gives
         * a level <= 0, and a NaN a NaN, whose q is not > 0: dropped, as rint's would be. */
        int64_t zeros = 0;
        for (i = a; i < e; i++) {
            const double y = (double)values[i] * inv;
            const float q = (float)(((y + 0x1p52) - 0x1p52) * step);
            oind[kept + (i - a)] = indices[i];
            oval[kept + (i - a)] = q;
            zeros += !(q > 0);
        }
        if (zeros) {
            Py_ssize_t w = kept;
            for (Py_ssize_t j = kept; j < kept + (e - a); j++)
                if (oval[j] > 0) {
                    oind[w] = oind[j];
                    oval[w] = oval[j];
                    w++;
                }
            kept = w;
        } else {
            kept += e - a;
        }
        optr[r + 1] = kept;
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(kept);
done:
    release(b, 6);
    return result;
}

PyDoc_STRVAR(pad_doc, "pad(indptr, indices, values, terms, weights)\n--\n\n"
                      "Rows (indptr int64, indices int32, values float32) into terms (int64) and weights (float32),\n"
                      "both [rows, width] C-contiguous: -1 and 0 after each row's end. A row longer than width is "
                      "an error.");

static PyObject *pad(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_indptr, *o_indices, *o_values, *o_terms, *o_weights;
    if (!PyArg_ParseTuple(args, "OOOOO", &o_indptr, &o_indices, &o_values, &o_terms, &o_weights)) return NULL;
    Buf b[5];
    memset(b, 0, sizeof b);
    PyObject *result = NULL;
    if (get_rows(o_indptr, o_indices, o_values, b) < 0 || get(o_terms, &b[3], 1, 8, "terms") < 0 ||
        get(o_weights, &b[4], 1, 4, "weights") < 0)
        goto done;
    Py_ssize_t n = b[0].view.len / 8 - 1, nnz = b[1].view.len / 4, cells = b[3].view.len / 8;
    if (n < 0 || b[2].view.len / 4 != nnz || b[4].view.len / 4 != cells || (n == 0 ? cells != 0 : cells % n != 0)) {
        PyErr_SetString(PyExc_ValueError, "indices and values, terms and weights must match; terms [rows, width]");
        goto done;
    }
    const int64_t *indptr = b[0].view.buf;
    if (check_rows(indptr, n, nnz) < 0) goto done;
    const Py_ssize_t width = n ? cells / n : 0;
    for (Py_ssize_t r = 0; r < n; r++)
        if (indptr[r + 1] - indptr[r] > width) {
            PyErr_Format(PyExc_ValueError, "row %zd has %lld terms, more than the width %zd", r,
                         (long long)(indptr[r + 1] - indptr[r]), width);
            goto done;
        }
    const int32_t *indices = b[1].view.buf;
    const float *values = b[2].view.buf;
    int64_t *terms = b[3].view.buf;
    float *weights = b[4].view.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < n; r++) {
        const int64_t a = indptr[r] - indptr[0], len = indptr[r + 1] - indptr[r];
        int64_t *t = terms + r * width;
        float *w = weights + r * width;
        for (int64_t i = 0; i < len; i++) {
            t[i] = indices[a + i];
            w[i] = values[a + i];
        }
        for (int64_t i = len; i < width; i++) {
            t[i] = -1;
            w[i] = 0.0f;
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    release(b, 5);
    return result;
}

PyDoc_STRVAR(longest_doc, "longest(indptr)\n--\n\n"
                          "The most terms of a row (indptr int64, rising): max(indptr[r + 1] - indptr[r]), 0 for no "
                          "rows.");

static PyObject *longest(PyObject *self, PyObject *arg) {
    (void)self;
    Buf b[1];
    memset(b, 0, sizeof b);
    PyObject *result = NULL;
    if (get(arg, &b[0], 0, 8, "indptr") < 0) goto done;
    const Py_ssize_t n = b[0].view.len / 8 - 1;
    const int64_t *indptr = b[0].view.buf;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "indptr needs at least one entry");
        goto done;
    }
    if (rising(indptr, n) < 0) goto done;
    int64_t most = 0;
    for (Py_ssize_t r = 0; r < n; r++)
        if (indptr[r + 1] - indptr[r] > most) most = indptr[r + 1] - indptr[r];
    result = PyLong_FromLongLong(most);
done:
    release(b, 1);
    return result;
}

PyDoc_STRVAR(stage_doc, "stage(indptr, indices, values, out_indptr, out_indices, out_values)\n--\n\n"
                        "Rows (indptr int64, indices int32, values float32) as they are into a CUDA graph's staging "
                        "views:\nint32 row pointers from 0 (out_indptr: [rows + 1]), the terms and weights at the "
                        "start of\nout_indices (int32) and out_values (float32), which must have room for them. "
                        "Returns the most\nterms of a row (0 for no rows).");

static PyObject *stage(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_indptr, *o_indices, *o_values, *o_optr, *o_oind, *o_oval;
    if (!PyArg_ParseTuple(args, "OOOOOO", &o_indptr, &o_indices, &o_values, &o_optr, &o_oind, &o_oval)) return NULL;
    Buf b[6];
    memset(b, 0, sizeof b);
    PyObject *result = NULL;
    if (get_rows(o_indptr, o_indices, o_values, b) < 0 || get(o_optr, &b[3], 1, 4, "out_indptr") < 0 ||
        get(o_oind, &b[4], 1, 4, "out_indices") < 0 || get(o_oval, &b[5], 1, 4, "out_values") < 0)
        goto done;
    const Py_ssize_t n = b[0].view.len / 8 - 1, nnz = b[1].view.len / 4;
    if (n < 0 || b[2].view.len / 4 != nnz || b[3].view.len / 4 != n + 1) {
        PyErr_SetString(PyExc_ValueError, "indices and values must match, and out_indptr hold rows + 1 entries");
        goto done;
    }
    if (b[4].view.len / 4 < nnz || b[5].view.len / 4 < nnz) {
        PyErr_SetString(PyExc_ValueError, "out_indices and out_values have no room for every term");
        goto done;
    }
    const int64_t *indptr = b[0].view.buf;
    if (check_rows(indptr, n, nnz) < 0) goto done;
    if (indptr[n] - indptr[0] > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "more terms than int32 row pointers hold");
        goto done;
    }
    int32_t *optr = b[3].view.buf;
    int64_t most = 0;  /* the longest row, in the same pass: a batch's caller needs it, and one call less */
    optr[0] = 0;
    for (Py_ssize_t r = 0; r < n; r++) {
        optr[r + 1] = (int32_t)(indptr[r + 1] - indptr[0]);
        if (indptr[r + 1] - indptr[r] > most) most = indptr[r + 1] - indptr[r];
    }
    memcpy(b[4].view.buf, b[1].view.buf, (size_t)nnz * 4);
    memcpy(b[5].view.buf, b[2].view.buf, (size_t)nnz * 4);
    result = PyLong_FromLongLong(most);
done:
    release(b, 6);
    return result;
}

static PyMethodDef methods[] = {{"quantize", quantize, METH_VARARGS, quantize_doc},
                                {"pad", pad, METH_VARARGS, pad_doc},
                                {"longest", longest, METH_O, longest_doc},
                                {"stage", stage, METH_VARARGS, stage_doc},
                                {NULL, NULL, 0, NULL}};

static PyModuleDef_Slot slots[] = {{0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_queries_native", "A query batch's work per term on the host, one pass each.", 0, methods,
    slots, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__queries_native(void) { return PyModuleDef_Init(&module); }
