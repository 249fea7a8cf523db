/* One native pass over a chunk of JSONL vector lines (gpusparse._jsonl_native).
 *
 * parse() reads the bytes of whole lines of JsonVectorCollection JSONL
 * ({"id": ..., "contents": ..., "vector": {token: weight, ...}}) in one pass: it checks each
 * line against JSON's grammar (strings: escapes, control characters, UTF-8 as Python's
 * decoder accepts it; numbers; literals; whitespace), finds the id, looks each token up in
 * the vocabulary's hash table (gpusparse.jsonl_keys.KeyTable: its arrays are passed as
 * buffers, its hash is reproduced here) and parses each weight exactly as Python's float()
 * does, then stores it as float32. The caller allocates the outputs.
 *
 * It reads only what it is sure of and returns None for anything else (the caller then hands
 * the chunk to its next path, whose messages are the strict path's): a line that is not one
 * flat object with a "vector" object; a repeated id, _id or vector key; a key of the record
 * spelled with an escape; arrays or nested objects; an id that is not a string or an
 * integer; a weight that is not a number or not finite; a number longer than 400 characters;
 * an unknown token while unknown tokens are errors; more tokens to look up in Python than
 * the caller's room for them. Lines it accepts are well-formed JSON the strict path decodes.
 *
 * Limited API (abi3, CPython 3.11+): one binary for every later CPython. The pass runs
 * without the GIL.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <Python.h>

#include <locale.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_native_buffers.h"

#define KEY_BYTES 24
#define MAX_NUMBER 400
#define F32_MAX 3.4028234663852886e38

enum { OK = 0, UNSURE = 1 };
enum { ID_NONE = 0, ID_STRING, ID_ESCAPED, ID_INTEGER, ID_OTHER };

typedef struct {
    /* input */
    const uint8_t *data;
    Py_ssize_t size;
    const uint64_t *w0, *w1, *w2;
    const int64_t *tid;
    int bits, probes, skip_unknown;
    /* outputs and their room */
    int64_t *lines, *lengths, *id_spans, *pending;
    int32_t *terms;
    float *weights;
    Py_ssize_t room_records, room_postings, room_pending;
    /* counts */
    Py_ssize_t records, postings, n_pending, skipped, newlines;
    Py_ssize_t neg_record, over_record;
    double neg_value, over_value;
} Pass;

static const double P10[23] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,  1e8,  1e9,  1e10, 1e11,
                               1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

#ifdef __GLIBC__
static locale_t c_locale;
#endif

static double to_double(const char *text) {
#ifdef __GLIBC__
    return strtod_l(text, NULL, c_locale);
#else
    return strtod(text, NULL);
#endif
}

static inline const uint8_t *skip_ws(const uint8_t *p, const uint8_t *end) {
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\r')) p++;
    return p;
}

static inline int hex(uint8_t c) {
    return (c >= '0' && c <= '9') || ((c | 0x20) >= 'a' && (c | 0x20) <= 'f');
}

/* A JSON string from just after its opening quote: *p ends just after the closing quote, the
 * bytes between the quotes are [start, *close). Valid escapes, no control characters, UTF-8
 * as Python's strict decoder reads it (no overlong forms, no surrogates, up to U+10FFFF). */
static int string(const uint8_t **p, const uint8_t *end, const uint8_t **close, int *escaped) {
    const uint8_t *q = *p;
    *escaped = 0;
    for (;;) {
        /* the common bytes, eight at a time where there are eight */
        while (q + 8 <= end) {
            uint64_t w;
            memcpy(&w, q, 8);
            uint64_t quote = w ^ 0x2222222222222222ULL, slash = w ^ 0x5C5C5C5C5C5C5C5CULL;
            uint64_t t = ((quote - 0x0101010101010101ULL) & ~quote) | ((slash - 0x0101010101010101ULL) & ~slash);
            t |= (w - 0x2020202020202020ULL) & ~w; /* a byte below 0x20 */
            t |= w;                                /* a byte from 0x80 on */
            t &= 0x8080808080808080ULL;
            if (t) { /* the lowest flag is exact (a borrow only flags bytes above a flagged one) */
#if defined(__GNUC__)
                q += __builtin_ctzll(t) >> 3;
#endif
                break;
            }
            q += 8;
        }
        if (q >= end) return UNSURE;
        uint8_t c = *q;
        if (c == '"') {
            *close = q;
            *p = q + 1;
            return OK;
        }
        if (c == '\\') {
            *escaped = 1;
            if (q + 1 >= end) return UNSURE;
            uint8_t e = q[1];
            if (e == 'u') {
                if (q + 6 > end || !hex(q[2]) || !hex(q[3]) || !hex(q[4]) || !hex(q[5])) return UNSURE;
                q += 6;
            } else if (e == '"' || e == '\\' || e == '/' || e == 'b' || e == 'f' || e == 'n' || e == 'r' || e == 't') {
                q += 2;
            } else {
                return UNSURE;
            }
        } else if (c < 0x20) {
            return UNSURE;
        } else if (c < 0x80) {
            q++;
        } else if (c >= 0xC2 && c <= 0xDF) {
            if (q + 2 > end || (q[1] & 0xC0) != 0x80) return UNSURE;
            q += 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            if (q + 3 > end || (q[1] & 0xC0) != 0x80 || (q[2] & 0xC0) != 0x80) return UNSURE;
            if (c == 0xE0 && q[1] < 0xA0) return UNSURE; /* overlong */
            if (c == 0xED && q[1] >= 0xA0) return UNSURE; /* a surrogate */
            q += 3;
        } else if (c >= 0xF0 && c <= 0xF4) {
            if (q + 4 > end || (q[1] & 0xC0) != 0x80 || (q[2] & 0xC0) != 0x80 || (q[3] & 0xC0) != 0x80) return UNSURE;
            if (c == 0xF0 && q[1] < 0x90) return UNSURE; /* overlong */
            if (c == 0xF4 && q[1] >= 0x90) return UNSURE; /* beyond U+10FFFF */
            q += 4;
        } else {
            return UNSURE;
        }
    }
}

/* A JSON number at *p (its grammar exactly: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?);
 * *p ends after it. *is_int: no fraction and no exponent. With value != NULL, its value as
 * Python reads it: float(text) for a float, float(int(text)) for an integer (so -0 is 0.0);
 * UNSURE where that is not finite. */
static int number(const uint8_t **p, const uint8_t *end, int *is_int, double *value) {
    const uint8_t *s = *p, *q = *p;
    int neg = 0;
    if (q < end && *q == '-') {
        neg = 1;
        q++;
    }
    if (q >= end) return UNSURE;
    uint64_t mant = 0;
    int digits = 0, dropped = 0; /* significant digits read into mant, and beyond them */
    long exp10 = 0;
    if (*q == '0') {
        q++;
    } else if (*q >= '1' && *q <= '9') {
        while (q < end && *q >= '0' && *q <= '9') {
            if (digits < 19) {
                mant = mant * 10 + (uint64_t)(*q - '0');
                digits++;
            } else {
                dropped = 1;
                exp10++;
            }
            q++;
        }
    } else {
        return UNSURE;
    }
    int frac = 0, exp = 0;
    if (q < end && *q == '.') {
        frac = 1;
        q++;
        if (q >= end || *q < '0' || *q > '9') return UNSURE;
        while (q < end && *q >= '0' && *q <= '9') {
            if (digits < 19) {
                if (mant != 0 || *q != '0') {
                    mant = mant * 10 + (uint64_t)(*q - '0');
                    digits += mant != 0;
                }
                exp10--;
            } else if (*q != '0') {
                dropped = 1;
            }
            q++;
        }
    }
    if (q < end && (*q == 'e' || *q == 'E')) {
        exp = 1;
        q++;
        int eneg = 0;
        if (q < end && (*q == '+' || *q == '-')) eneg = *q++ == '-';
        if (q >= end || *q < '0' || *q > '9') return UNSURE;
        long e = 0;
        while (q < end && *q >= '0' && *q <= '9') {
            if (e < 100000) e = e * 10 + (*q - '0');
            q++;
        }
        exp10 += eneg ? -e : e;
    }
    if (q - s > MAX_NUMBER) return UNSURE;
    *p = q;
    *is_int = !frac && !exp;
    if (value == NULL) return OK;
    double v;
    if (!dropped && mant <= (1ULL << 53) && exp10 >= -22 && exp10 <= 22) {
        /* Clinger's fast path: an exact mantissa and an exact power of ten, one rounding */
        v = exp10 >= 0 ? (double)mant * P10[exp10] : (double)mant / P10[-exp10];
        if (neg) v = -v;
    } else {
        char text[MAX_NUMBER + 1];
        memcpy(text, s, (size_t)(q - s));
        text[q - s] = '\0';
        v = to_double(text); /* correctly rounded (glibc), as float() */
    }
    if (*is_int && v == 0.0) v = 0.0; /* json reads -0 as the integer 0 */
    if (!isfinite(v)) return UNSURE;
    *value = v;
    return OK;
}

/* A value of another field of the record: a string, a number or a literal (arrays and
 * objects: UNSURE). */
static int scalar(const uint8_t **p, const uint8_t *end) {
    const uint8_t *q = *p;
    if (q >= end) return UNSURE;
    if (*q == '"') {
        const uint8_t *close;
        int escaped;
        *p = q + 1;
        return string(p, end, &close, &escaped);
    }
    if (*q == '-' || (*q >= '0' && *q <= '9')) {
        int is_int;
        return number(p, end, &is_int, NULL);
    }
    static const char *const literals[3] = {"true", "false", "null"};
    for (int i = 0; i < 3; i++) {
        size_t n = strlen(literals[i]);
        if ((size_t)(end - q) >= n && memcmp(q, literals[i], n) == 0) {
            *p = q + n;
            return OK;
        }
    }
    return UNSURE;
}

/* The term id of a token's spelling [s, e): >= 0 found, -1 not in the table. */
static inline int64_t find(const Pass *ps, const uint8_t *s, Py_ssize_t n) {
    uint8_t key[KEY_BYTES] = {0};
    memcpy(key, s, (size_t)n);
    uint64_t k0, k1, k2;
    memcpy(&k0, key, 8);
    memcpy(&k1, key + 8, 8);
    memcpy(&k2, key + 16, 8);
    uint64_t h = k0 * 0x9E3779B97F4A7C15ULL + k1 * 0xC2B2AE3D27D4EB4FULL + k2 * 0x165667B19E3779F9ULL;
    uint64_t mask = (1ULL << ps->bits) - 1;
    uint64_t slot = h >> (64 - ps->bits);
    for (int r = 0; r < ps->probes; r++) {
        uint64_t at = (slot + (uint64_t)r) & mask;
        int64_t t = ps->tid[at];
        if (t == 0) return -1;
        if (ps->w0[at] == k0 && ps->w1[at] == k1 && ps->w2[at] == k2) return t - 1;
    }
    return -1;
}

/* An object member's key and its colon, from *p on the key's opening quote: the key's text is
 * [*ks, *ke), *escaped as string() says; *p ends on the value (blanks skipped). */
static inline int member_key(const uint8_t **p, const uint8_t *end, const uint8_t **ks, const uint8_t **ke,
                             int *escaped) {
    const uint8_t *q = *p;
    if (q >= end || *q != '"') return UNSURE;
    *ks = ++q;
    if (string(&q, end, ke, escaped)) return UNSURE;
    q = skip_ws(q, end);
    if (q >= end || *q != ':') return UNSURE;
    *p = skip_ws(q + 1, end);
    return OK;
}

/* After an object member's value: MORE past a ',' and the blanks after it (*p on the next key), OK on
 * the object's closing '}' (*p on it), UNSURE otherwise. */
enum { MORE = 2 };
static inline int member_end(const uint8_t **p, const uint8_t *end) {
    const uint8_t *q = skip_ws(*p, end);
    if (q < end && *q == ',') {
        *p = skip_ws(q + 1, end);
        return MORE;
    }
    *p = q;
    return q < end && *q == '}' ? OK : UNSURE;
}

/* The vector object from just after its '{'; *p ends after its '}'. */
static int vector(Pass *ps, const uint8_t **p, const uint8_t *end) {
    const uint8_t *q = skip_ws(*p, end);
    Py_ssize_t length = 0;
    if (q < end && *q == '}') {
        *p = q + 1;
        ps->lengths[ps->records] = 0;
        return OK;
    }
    for (;;) {
        const uint8_t *ks, *ke;
        int escaped;
        if (member_key(&q, end, &ks, &ke, &escaped)) return UNSURE;
        if (q >= end || !(*q == '-' || (*q >= '0' && *q <= '9'))) return UNSURE;
        int is_int;
        double v;
        if (number(&q, end, &is_int, &v)) return UNSURE;
        Py_ssize_t n = ke - ks;
        int64_t t = n <= KEY_BYTES ? find(ps, ks, n) : -1;
        int look_later = t < 0 && (escaped || n > KEY_BYTES); /* other spellings: Python decides */
        if (t < 0 && !look_later) {                          /* an unknown token */
            if (!ps->skip_unknown) return UNSURE;           /* the strict path names it */
            ps->skipped++;
        } else {
            Py_ssize_t at = ps->postings;
            if (at >= ps->room_postings) return UNSURE;
            if (look_later) {
                if (ps->n_pending >= ps->room_pending) return UNSURE;
                int64_t *row = ps->pending + 3 * ps->n_pending++;
                row[0] = at;
                row[1] = ks - ps->data;
                row[2] = ke - ps->data;
            }
            ps->terms[at] = (int32_t)t;
            ps->weights[at] = (float)v;
            if (v < 0 && ps->neg_record < 0) {
                ps->neg_record = ps->records;
                ps->neg_value = v;
            }
            if (fabs(v) > F32_MAX && ps->over_record < 0) {
                ps->over_record = ps->records;
                ps->over_value = v;
            }
            ps->postings++;
            length++;
        }
        const int after = member_end(&q, end);
        if (after == MORE) continue;
        if (after) return UNSURE;
        break;
    }
    *p = q + 1;
    ps->lengths[ps->records] = length;
    return OK;
}

static inline int is_blank(const uint8_t *s, const uint8_t *end) {
    for (; s < end; s++) /* bytes.strip()'s whitespace */
        if (!(*s == ' ' || *s == '\t' || *s == '\r' || *s == '\x0b' || *s == '\x0c')) return 0;
    return 1;
}

/* One non-blank line [q, end): one object holding a "vector" object. */
static int line(Pass *ps, const uint8_t *q, const uint8_t *end, Py_ssize_t lineno) {
    q = skip_ws(q, end);
    if (q >= end || *q != '{') return UNSURE;
    q = skip_ws(q + 1, end);
    int seen_id = 0, seen_alt = 0, seen_vector = 0;
    int id_kind = ID_NONE, alt_kind = ID_NONE;
    const uint8_t *id_s = NULL, *id_e = NULL, *alt_s = NULL, *alt_e = NULL;
    if (ps->records >= ps->room_records) return UNSURE;
    for (;;) {
        const uint8_t *ks, *ke;
        int escaped;
        if (member_key(&q, end, &ks, &ke, &escaped) || escaped) return UNSURE;
        if (q >= end) return UNSURE;
        Py_ssize_t n = ke - ks;
        int which = 0; /* 1: id, 2: _id, 3: vector */
        if (n == 2 && memcmp(ks, "id", 2) == 0)
            which = 1;
        else if (n == 3 && memcmp(ks, "_id", 3) == 0)
            which = 2;
        else if (n == 6 && memcmp(ks, "vector", 6) == 0)
            which = 3;
        if (which == 3) {
            if (seen_vector++ || *q != '{') return UNSURE;
            q++;
            if (vector(ps, &q, end)) return UNSURE;
        } else if (which) {
            if (which == 1 ? seen_id++ : seen_alt++) return UNSURE;
            const uint8_t *vs = q, *ve = NULL;
            int kind;
            if (*q == '"') {
                int esc;
                q++;
                if (string(&q, end, &ve, &esc)) return UNSURE;
                vs++;
                kind = esc ? ID_ESCAPED : ID_STRING;
            } else if (*q == '-' || (*q >= '0' && *q <= '9')) {
                int is_int;
                if (number(&q, end, &is_int, NULL)) return UNSURE;
                ve = q;
                /* str(int(text)) is the text itself, but for -0 */
                kind = is_int && !(ve - vs == 2 && vs[0] == '-' && vs[1] == '0') ? ID_INTEGER : ID_OTHER;
            } else {
                if (scalar(&q, end)) return UNSURE;
                kind = ID_OTHER;
            }
            if (which == 1) {
                id_kind = kind, id_s = vs, id_e = ve;
            } else {
                alt_kind = kind, alt_s = vs, alt_e = ve;
            }
        } else if (scalar(&q, end)) {
            return UNSURE;
        }
        const int after = member_end(&q, end);
        if (after == MORE) continue;
        if (after) return UNSURE;
        break;
    }
    q = skip_ws(q + 1, end);
    if (q != end || !seen_vector) return UNSURE;
    /* the id as obj.get("id", obj.get("_id")) reads it */
    if (!seen_id) id_kind = alt_kind, id_s = alt_s, id_e = alt_e;
    if (id_kind == ID_NONE || id_kind == ID_OTHER) return UNSURE; /* check_id's errors */
    int64_t *span = ps->id_spans + 2 * ps->records;
    span[0] = id_s - ps->data;
    span[1] = (id_e - ps->data) | (id_kind == ID_ESCAPED ? (int64_t)1 << 62 : 0);
    ps->lines[ps->records] = lineno;
    ps->records++;
    return OK;
}

static int run(Pass *ps) {
    const uint8_t *p = ps->data, *end = ps->data + ps->size;
    Py_ssize_t lineno = 0;
    while (p < end) {
        const uint8_t *eol = memchr(p, '\n', (size_t)(end - p));
        const uint8_t *stop = eol ? eol : end;
        if (!is_blank(p, stop) && line(ps, p, stop, lineno)) return UNSURE;
        if (!eol) break;
        ps->newlines++;
        lineno++;
        p = eol + 1;
    }
    return OK;
}

PyDoc_STRVAR(parse_doc,
             "parse(data, w0, w1, w2, tid, bits, probes, skip_unknown, lines, lengths, id_spans, terms, weights, "
             "pending)\n--\n\n"
             "Read a chunk of whole JSONL vector lines into the given arrays; None where not sure.\n\n"
             "w0, w1, w2 (uint64), tid (int64), bits, probes: a KeyTable. Outputs: lines, lengths (int64, room\n"
             "for every line), id_spans (int64, 2 a line: start, end; bit 62 of the end: escaped), terms\n"
             "(int32), weights (float32), pending (int64, 3 a row: posting, start, end of a token to look up\n"
             "in Python; its term is -1). Returns (ids, records, postings, pending rows, skipped unknown\n"
             "tokens, newlines, (record, value) of the first negative weight or None, and of the first\n"
             "beyond float32 or None); ids: a str per record, None for an id spelled with escapes.");

static PyObject *parse(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o[14];
    if (!PyArg_UnpackTuple(args, "parse", 14, 14, &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8],
                           &o[9], &o[10], &o[11], &o[12], &o[13]))
        return NULL;
    Buf b[14];
    memset(b, 0, sizeof b);
    PyObject *result = NULL;
    Pass ps;
    memset(&ps, 0, sizeof ps);
    static const int slots[] = {0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 13};
    static const Py_ssize_t sizes[] = {1, 8, 8, 8, 8, 8, 8, 8, 4, 4, 8};
    static const char *const names[] = {"data",     "w0",    "w1",      "w2",      "tid",    "lines",
                                        "lengths", "id_spans", "terms", "weights", "pending"};
    for (int i = 0; i < 11; i++)
        if (get(o[slots[i]], &b[slots[i]], slots[i] >= 8, sizes[i], names[i]) < 0) goto done;
    ps.bits = (int)PyLong_AsLong(o[5]);
    ps.probes = (int)PyLong_AsLong(o[6]);
    ps.skip_unknown = PyObject_IsTrue(o[7]);
    if (PyErr_Occurred()) goto done;
    if (ps.bits < 1 || ps.bits > 63 || b[1].view.len != ((Py_ssize_t)8 << ps.bits) || b[2].view.len != b[1].view.len ||
        b[3].view.len != b[1].view.len || b[4].view.len != b[1].view.len) {
        PyErr_SetString(PyExc_ValueError, "the key table's arrays do not match its bits");
        goto done;
    }
    ps.data = b[0].view.buf;
    ps.size = b[0].view.len;
    ps.w0 = b[1].view.buf;
    ps.w1 = b[2].view.buf;
    ps.w2 = b[3].view.buf;
    ps.tid = b[4].view.buf;
    ps.lines = b[8].view.buf;
    ps.lengths = b[9].view.buf;
    ps.id_spans = b[10].view.buf;
    ps.terms = b[11].view.buf;
    ps.weights = b[12].view.buf;
    ps.pending = b[13].view.buf;
    ps.room_records = b[8].view.len / 8;
    if (b[9].view.len / 8 < ps.room_records) ps.room_records = b[9].view.len / 8;
    if (b[10].view.len / 16 < ps.room_records) ps.room_records = b[10].view.len / 16;
    ps.room_postings = b[11].view.len / 4;
    if (b[12].view.len / 4 < ps.room_postings) ps.room_postings = b[12].view.len / 4;
    ps.room_pending = b[13].view.len / 24;
    ps.neg_record = ps.over_record = -1;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = run(&ps);
    Py_END_ALLOW_THREADS
    if (status != OK) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *ids = PyList_New(ps.records);
    if (ids == NULL) goto done;
    for (Py_ssize_t r = 0; r < ps.records; r++) {
        int64_t s = ps.id_spans[2 * r], e = ps.id_spans[2 * r + 1];
        PyObject *id;
        if (e & ((int64_t)1 << 62)) {
            id = Py_NewRef(Py_None);
        } else {
            id = PyUnicode_DecodeUTF8((const char *)ps.data + s, (Py_ssize_t)(e - s), "strict");
            if (id == NULL) {
                Py_DECREF(ids);
                goto done;
            }
        }
        PyList_SetItem(ids, r, id);
    }
    PyObject *neg = ps.neg_record < 0 ? Py_NewRef(Py_None) : Py_BuildValue("(nd)", ps.neg_record, ps.neg_value);
    PyObject *over = ps.over_record < 0 ? Py_NewRef(Py_None) : Py_BuildValue("(nd)", ps.over_record, ps.over_value);
    if (neg == NULL || over == NULL) {
        Py_XDECREF(neg);
        Py_XDECREF(over);
        Py_DECREF(ids);
        goto done;
    }
    result = Py_BuildValue("(NnnnnnNN)", ids, ps.records, ps.postings, ps.n_pending, ps.skipped, ps.newlines, neg, over);
done:
    release(b, 14);
    return result;
}

PyDoc_STRVAR(bounds_doc, "bounds(data)\n--\n\n"
                         "(newlines, colons) in data: the room parse needs for records (newlines + 1) and postings "
                         "(colons).");

/* Bytes counted in blocks of 255 with 8-bit counters (vectorised by the compiler): many times
 * faster than bytes.count, which reads a byte at a time. */
static PyObject *bounds(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    const uint8_t *p = view.buf;
    Py_ssize_t n = view.len, newlines = 0, colons = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n;) {
        Py_ssize_t stop = n - i < 255 * 32 ? n : i + 255 * 32;
        uint8_t nl[32] = {0}, co[32] = {0};
        for (; i + 32 <= stop; i += 32)
            for (int j = 0; j < 32; j++) {
                nl[j] += p[i + j] == '\n';
                co[j] += p[i + j] == ':';
            }
        for (int j = 0; j < 32; j++) newlines += nl[j], colons += co[j];
        if (stop == n) {
            for (; i < n; i++) newlines += p[i] == '\n', colons += p[i] == ':';
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return Py_BuildValue("(nn)", newlines, colons);
}

static PyMethodDef methods[] = {{"parse", parse, METH_VARARGS, parse_doc},
                                {"bounds", bounds, METH_O, bounds_doc},
                                {NULL, NULL, 0, NULL}};

static int exec_module(PyObject *m) {
    (void)m;
#ifdef __GLIBC__
    if (c_locale == (locale_t)0) {
        c_locale = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0);
        if (c_locale == (locale_t)0) {
            PyErr_SetString(PyExc_OSError, "newlocale(C) failed");
            return -1;
        }
    }
#endif
    return 0;
}

static PyModuleDef_Slot slots[] = {{Py_mod_exec, exec_module}, {0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jsonl_native", "One native pass over a chunk of JSONL vector lines.", 0, methods, slots,
    NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__jsonl_native(void) { return PyModuleDef_Init(&module); }
