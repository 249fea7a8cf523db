/* Buffer arguments of the package's C modules (gpusparse._jsonl_native, gpusparse._queries_native):
 * a C-contiguous view of an argument and whether it is held (to release it once, on every path). */
#ifndef GPUSPARSE_NATIVE_BUFFERS_H
#define GPUSPARSE_NATIVE_BUFFERS_H

typedef struct {
    Py_buffer view;
    int held;
} Buf;

/* obj's buffer into b (writable if asked), refused unless it holds whole items of itemsize bytes. */
static int get(PyObject *obj, Buf *b, int writable, Py_ssize_t itemsize, const char *name) {
    if (PyObject_GetBuffer(obj, &b->view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    b->held = 1;
    if (itemsize > 1 && b->view.len % itemsize != 0) {
        PyErr_Format(PyExc_ValueError, "%s: not a whole number of %zd-byte items", name, itemsize);
        return -1;
    }
    return 0;
}

/* Release the held views of b[0 .. n). */
static void release(Buf *b, int n) {
    for (int i = 0; i < n; i++)
        if (b[i].held) PyBuffer_Release(&b[i].view);
}

#endif
