/* One pass over each of many CPU tensors: the partial-statistics row of each.
 *
 * Built and loaded by library.py; called by frameworks/torch/cpu_reduce.py (ctypes), where what it
 * computes is described, and by frameworks/mindspore/kernel_op.py (MindSpore custom operators).
 * Row columns: min, max, sum, sumsq, nan count, inf count, zero count, numel.
 *
 * The hot loop keeps LANES independent running min, max, sum and sum of squares (and, when
 * asked, zero counts), which the compiler turns into vector instructions. float32/16/bf16
 * values are summed in float32 for STEPS values per lane, then added into float64 lanes; their
 * squares are taken and summed in float64 (exact squares: no overflow or underflow); float64
 * values, and int64/int32 values read as float64 (as the torch path converts them), in float64
 * throughout. nan and inf are not counted in the hot loop: any nan or inf
 * makes the sum or the sum of squares non-finite, and only then a second loop counts them
 * (a finite sum proves there is none).
 *
 * On x86-64 each loop is compiled for x86-64-v4 (AVX-512), v3 (AVX2, FMA, F16C) and the
 * baseline, and the loader picks the best the CPU has (GCC's target_clones).
 *
 * The loops read each value as LOAD(x, y, i): x[i] for a tensor's row, x[i] - y[i] (float32 or
 * float64, the same bits as torch's subtraction) for the row of a difference of two tensors that
 * is never materialised (msprobe_cpu_diff_rows); y is unused (NULL) for the former.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

enum { DT_F32 = 0, DT_F64 = 1, DT_F16 = 2, DT_BF16 = 3, DT_I64 = 4, DT_I32 = 5 };

#define LANES 32
#define STEPS 16
#define BLOCK (LANES * STEPS)
/* int32 zero counters are added into int64 totals at least this often */
#define COUNT_SPAN (1 << 24)

typedef struct {
    double lo, hi, sum, sumsq;
    int64_t zeros;
} part_t;

static inline float load_bf16(const uint16_t *p, int64_t i) {
    uint32_t bits = (uint32_t)p[i] << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

#ifdef __FLT16_MAX__
static inline float load_f16(const _Float16 *p, int64_t i) { return (float)p[i]; }
typedef _Float16 f16_t;
#else
static inline float load_f16(const uint16_t *p, int64_t i) {
    uint32_t h = p[i], sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else {  /* zero or subnormal: exact as float */
        float v = ldexpf((float)man, -24);
        return sign ? -v : v;
    }
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}
typedef uint16_t f16_t;
#endif

static inline float load_f32(const float *p, const float *q, int64_t i) { (void)q; return p[i]; }
static inline float load_f32_diff(const float *p, const float *q, int64_t i) { return p[i] - q[i]; }
static inline float load_f16_one(const f16_t *p, const f16_t *q, int64_t i) { (void)q; return load_f16(p, i); }
static inline float load_bf16_one(const uint16_t *p, const uint16_t *q, int64_t i) { (void)q; return load_bf16(p, i); }
static inline double load_f64(const double *p, const double *q, int64_t i) { (void)q; return p[i]; }
static inline double load_f64_diff(const double *p, const double *q, int64_t i) { return p[i] - q[i]; }
static inline double load_i64(const int64_t *p, const int64_t *q, int64_t i) { (void)q; return (double)p[i]; }
static inline double load_i32(const int32_t *p, const int32_t *q, int64_t i) { (void)q; return (double)p[i]; }

/* The hot loop for a dtype read as float: min/max/sum/sumsq and optionally the zero count. */
#define DEFINE_FLOAT_REDUCE(NAME, T, LOAD, ZEROS)                                              \
    CLONES static void NAME(const T *x, const T *y, int64_t n, part_t *out) {                 \
        float lo[LANES], hi[LANES];                                                           \
        double s[LANES], q[LANES];                                                            \
        int32_t z[LANES];                                                                     \
        int64_t zeros = 0;                                                                    \
        for (int j = 0; j < LANES; j++) {                                                     \
            lo[j] = INFINITY; hi[j] = -INFINITY; s[j] = 0; q[j] = 0; z[j] = 0;                \
        }                                                                                     \
        int64_t i = 0, body = n / BLOCK * BLOCK, since = 0;                                   \
        for (; i < body; i += BLOCK) {                                                        \
            float s32[LANES];                                                                 \
            for (int j = 0; j < LANES; j++) s32[j] = 0;                                       \
            for (int k = 0; k < BLOCK; k += LANES) {                                          \
                for (int j = 0; j < LANES; j++) {                                             \
                    float v = LOAD(x, y, i + k + j);                                          \
                    lo[j] = v < lo[j] ? v : lo[j];                                            \
                    hi[j] = v > hi[j] ? v : hi[j];                                            \
                    s32[j] += v;                                                              \
                    q[j] += (double)v * v;                                                          \
                    if (ZEROS) z[j] += v == 0.0f;                                             \
                }                                                                             \
            }                                                                                 \
            for (int j = 0; j < LANES; j++) s[j] += s32[j];                                   \
            if (ZEROS && (since += BLOCK) >= COUNT_SPAN) {                                    \
                for (int j = 0; j < LANES; j++) { zeros += z[j]; z[j] = 0; }                  \
                since = 0;                                                                    \
            }                                                                                 \
        }                                                                                     \
        for (int j = 0; i < n; i++, j++) { /* the tail: fewer than BLOCK values */             \
            float v = LOAD(x, y, i);                                                          \
            lo[j] = v < lo[j] ? v : lo[j];                                                    \
            hi[j] = v > hi[j] ? v : hi[j];                                                    \
            s[j] += v;                                                                        \
            q[j] += (double)v * v;                                                            \
            if (ZEROS) z[j] += v == 0.0f;                                                     \
            if (j == LANES - 1) j = -1;                                                       \
        }                                                                                     \
        double L = INFINITY, H = -INFINITY, S = 0, Q = 0;                                     \
        for (int j = 0; j < LANES; j++) {                                                     \
            L = lo[j] < L ? lo[j] : L; H = hi[j] > H ? hi[j] : H;                             \
            S += s[j]; Q += q[j]; zeros += z[j];                                              \
        }                                                                                     \
        out->lo = L; out->hi = H; out->sum = S; out->sumsq = Q; out->zeros = zeros;           \
    }

DEFINE_FLOAT_REDUCE(reduce_f32, float, load_f32, 0)
DEFINE_FLOAT_REDUCE(reduce_f32_zeros, float, load_f32, 1)
DEFINE_FLOAT_REDUCE(reduce_f32_diff, float, load_f32_diff, 0)
DEFINE_FLOAT_REDUCE(reduce_f32_diff_zeros, float, load_f32_diff, 1)
DEFINE_FLOAT_REDUCE(reduce_f16, f16_t, load_f16_one, 0)
DEFINE_FLOAT_REDUCE(reduce_f16_zeros, f16_t, load_f16_one, 1)
DEFINE_FLOAT_REDUCE(reduce_bf16, uint16_t, load_bf16_one, 0)
DEFINE_FLOAT_REDUCE(reduce_bf16_zeros, uint16_t, load_bf16_one, 1)

/* float64 (and integers read as float64): the same loop in float64 throughout. */
#define DEFINE_DOUBLE_REDUCE(NAME, T, LOAD, ZEROS)                                            \
    CLONES static void NAME(const T *x, const T *y, int64_t n, part_t *out) {                 \
        double lo[LANES], hi[LANES], s[LANES], q[LANES];                                      \
        int64_t z[LANES];                                                                     \
        for (int j = 0; j < LANES; j++) {                                                     \
            lo[j] = INFINITY; hi[j] = -INFINITY; s[j] = 0; q[j] = 0; z[j] = 0;                \
        }                                                                                     \
        int64_t i = 0, body = n / LANES * LANES;                                              \
        for (; i < body; i += LANES) {                                                        \
            for (int j = 0; j < LANES; j++) {                                                 \
                double v = LOAD(x, y, i + j);                                                 \
                lo[j] = v < lo[j] ? v : lo[j];                                                \
                hi[j] = v > hi[j] ? v : hi[j];                                                \
                s[j] += v;                                                                    \
                q[j] += v * v;                                                                \
                if (ZEROS) z[j] += v == 0.0;                                                  \
            }                                                                                 \
        }                                                                                     \
        for (int j = 0; i < n; i++, j++) {                                                    \
            double v = LOAD(x, y, i);                                                         \
            lo[j] = v < lo[j] ? v : lo[j];                                                    \
            hi[j] = v > hi[j] ? v : hi[j];                                                    \
            s[j] += v; q[j] += v * v;                                                         \
            if (ZEROS) z[j] += v == 0.0;                                                      \
        }                                                                                     \
        double L = INFINITY, H = -INFINITY, S = 0, Q = 0;                                     \
        int64_t zeros = 0;                                                                    \
        for (int j = 0; j < LANES; j++) {                                                     \
            L = lo[j] < L ? lo[j] : L; H = hi[j] > H ? hi[j] : H;                             \
            S += s[j]; Q += q[j]; zeros += z[j];                                              \
        }                                                                                     \
        out->lo = L; out->hi = H; out->sum = S; out->sumsq = Q; out->zeros = zeros;           \
    }

DEFINE_DOUBLE_REDUCE(reduce_f64, double, load_f64, 0)
DEFINE_DOUBLE_REDUCE(reduce_f64_zeros, double, load_f64, 1)
DEFINE_DOUBLE_REDUCE(reduce_f64_diff, double, load_f64_diff, 0)
DEFINE_DOUBLE_REDUCE(reduce_f64_diff_zeros, double, load_f64_diff, 1)
DEFINE_DOUBLE_REDUCE(reduce_i64, int64_t, load_i64, 0)
DEFINE_DOUBLE_REDUCE(reduce_i64_zeros, int64_t, load_i64, 1)
DEFINE_DOUBLE_REDUCE(reduce_i32, int32_t, load_i32, 0)
DEFINE_DOUBLE_REDUCE(reduce_i32_zeros, int32_t, load_i32, 1)

/* The rare second loop: nan and inf counts of a floating-point tensor (or a difference, `minus`
 * not NULL) whose sum or sum of squares is not finite (an integer tensor's never is). */
static void count_non_finite(const void *data, const void *minus, int dtype, int64_t n, int64_t *nans, int64_t *infs) {
    int64_t a = 0, b = 0;
    for (int64_t i = 0; i < n; i++) {
        double v;
        switch (dtype) {
        case DT_F32: v = minus ? load_f32_diff(data, minus, i) : ((const float *)data)[i]; break;
        case DT_F64: v = minus ? load_f64_diff(data, minus, i) : ((const double *)data)[i]; break;
        case DT_F16: v = load_f16((const f16_t *)data, i); break;
        default: v = load_bf16((const uint16_t *)data, i); break;
        }
        a += isnan(v) != 0;
        b += isinf(v) != 0;
    }
    *nans = a;
    *infs = b;
}

/* The row of one reduced tensor (or difference) into row[0..7]. */
static void write_row(const part_t *p, const void *data, const void *minus, int dtype, int64_t n,
                      int32_t count_zeros, double *row) {
    int64_t nans = 0, infs = 0;
    if (!isfinite(p->sum) || !isfinite(p->sumsq))
        count_non_finite(data, minus, dtype, n, &nans, &infs);
    row[0] = nans ? NAN : p->lo;
    row[1] = nans ? NAN : p->hi;
    row[2] = p->sum;
    row[3] = p->sumsq;
    row[4] = (double)nans;
    row[5] = (double)infs;
    row[6] = count_zeros || n == 0 ? (double)p->zeros : NAN;
    row[7] = (double)n;
}

/* Rows of `count` tensors into out[8 * t ...]: `table` holds the tensors' addresses, then their
 * lengths, then their dtype codes (count int64 each; contiguous values). The zero count is nan
 * unless `count_zeros` (an empty tensor's is 0); a tensor holding a nan has nan min and max. */
void msprobe_cpu_rows(int64_t count, const int64_t *table, int32_t count_zeros, double *out) {
    const int64_t *addresses = table, *numels = table + count, *dtypes = table + 2 * count;
    for (int64_t t = 0; t < count; t++) {
        const void *data = (const void *)(intptr_t)addresses[t];
        int64_t n = numels[t];
        part_t p;
        switch (dtypes[t]) {
        case DT_F32: (count_zeros ? reduce_f32_zeros : reduce_f32)((const float *)data, NULL, n, &p); break;
        case DT_F64: (count_zeros ? reduce_f64_zeros : reduce_f64)((const double *)data, NULL, n, &p); break;
        case DT_I64: (count_zeros ? reduce_i64_zeros : reduce_i64)((const int64_t *)data, NULL, n, &p); break;
        case DT_I32: (count_zeros ? reduce_i32_zeros : reduce_i32)((const int32_t *)data, NULL, n, &p); break;
        case DT_F16: (count_zeros ? reduce_f16_zeros : reduce_f16)((const f16_t *)data, NULL, n, &p); break;
        default: (count_zeros ? reduce_bf16_zeros : reduce_bf16)((const uint16_t *)data, NULL, n, &p); break;
        }
        write_row(&p, data, NULL, (int)dtypes[t], n, count_zeros, out + 8 * t);
    }
}

/* Rows of the differences a - b of `count` pairs of float32 or float64 tensors of one length
 * each, into out[8 * t ...], the differences never written: `table` holds the addresses of the
 * a's, then of the b's, then the lengths, then the dtype codes (DT_F32 or DT_F64). */
void msprobe_cpu_diff_rows(int64_t count, const int64_t *table, int32_t count_zeros, double *out) {
    const int64_t *as = table, *bs = table + count, *numels = table + 2 * count, *dtypes = table + 3 * count;
    for (int64_t t = 0; t < count; t++) {
        const void *a = (const void *)(intptr_t)as[t], *b = (const void *)(intptr_t)bs[t];
        int64_t n = numels[t];
        part_t p;
        if (dtypes[t] == DT_F64)
            (count_zeros ? reduce_f64_diff_zeros : reduce_f64_diff)((const double *)a, (const double *)b, n, &p);
        else
            (count_zeros ? reduce_f32_diff_zeros : reduce_f32_diff)((const float *)a, (const float *)b, n, &p);
        write_row(&p, a, b, (int)dtypes[t], n, count_zeros, out + 8 * t);
    }
}

/* How many dtype codes this library reads (cpu_reduce.py refuses a library built from an older
 * source, which would read a newer code as another dtype). */
int64_t msprobe_cpu_dtypes(void) { return 6; }

/* One tensor's row (the one-tensor call of a hook: no lookup table to build). */
void msprobe_cpu_row(int64_t address, int64_t numel, int64_t dtype, int32_t count_zeros, double *out) {
    const int64_t table[3] = {address, numel, dtype};
    msprobe_cpu_rows(1, table, count_zeros, out);
}

/* MindSpore custom operators (ops.Custom, func_type "aot"), compiled into a GRAPH_MODE graph:
 * MindSpore calls an entry with its inputs' and outputs' addresses (params: the inputs, then the
 * one output), ranks, shapes and dtype names; 0 is success. The first input is a bool flag (the
 * monitor's "this step is measured", a Parameter the host sets): when it is false the output's
 * rows are nan and no tensor is read, so an unmonitored step costs the call only, with no branch
 * in the graph. The output is [k, 8] float64, a row per measured tensor (or difference). No
 * MindSpore header is needed: the calling convention is plain C. frameworks/mindspore/kernel_op.py
 * offers only the dtypes ms_code maps. */
static int ms_code(const char *name) {
    if (!strcmp(name, "float32") || !strcmp(name, "float")) return DT_F32;
    if (!strcmp(name, "float64") || !strcmp(name, "double")) return DT_F64;
    if (!strcmp(name, "float16")) return DT_F16;
    if (!strcmp(name, "bfloat16")) return DT_BF16;
    if (!strcmp(name, "int64")) return DT_I64;
    if (!strcmp(name, "int32") || !strcmp(name, "int")) return DT_I32;
    return -1;
}

static int64_t ms_numel(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        n *= shape[d];
    return n;
}

/* Whether the step is measured (params[0], a bool); when not, the `rows` rows of `out` are nan. */
static int ms_measured(void **params, const char **dtypes, double *out, int rows) {
    if (strcmp(dtypes[0], "bool"))
        return -1;
    if (*(const uint8_t *)params[0])
        return 1;
    for (int i = 0; i < 8 * rows; i++)
        out[i] = NAN;
    return 0;
}

/* The rows of the nparam - 2 tensors after the flag. */
static int ms_rows(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, int32_t zeros) {
    int count = nparam - 2;
    double *out = (double *)params[nparam - 1];
    int measured = ms_measured(params, dtypes, out, count);
    if (measured <= 0)
        return measured < 0;
    for (int t = 1; t <= count; t++) {
        int code = ms_code(dtypes[t]);
        if (code < 0)
            return 1;
        const int64_t table[3] = {(int64_t)(intptr_t)params[t], ms_numel(ndims[t], shapes[t]), code};
        msprobe_cpu_rows(1, table, zeros, out + 8 * (t - 1));
    }
    return 0;
}

/* After the flag, a_0..a_{k-1}, b_0..b_{k-1} (float32 or float64, pairs of one shape): the rows of a_i - b_i. */
static int ms_diff_rows(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, int32_t zeros) {
    int count = (nparam - 2) / 2;
    double *out = (double *)params[nparam - 1];
    int measured = ms_measured(params, dtypes, out, count);
    if (measured <= 0)
        return measured < 0;
    for (int t = 1; t <= count; t++) {
        int code = ms_code(dtypes[t]);
        if ((code != DT_F32 && code != DT_F64) || strcmp(dtypes[t], dtypes[count + t]))
            return 1;
        const int64_t table[4] = {(int64_t)(intptr_t)params[t], (int64_t)(intptr_t)params[count + t],
                                  ms_numel(ndims[t], shapes[t]), code};
        msprobe_cpu_diff_rows(1, table, zeros, out + 8 * (t - 1));
    }
    return 0;
}

static inline double min_nan(double a, double b) { return isnan(a) || isnan(b) ? NAN : (a < b ? a : b); }
static inline double max_nan(double a, double b) { return isnan(a) || isnan(b) ? NAN : (a > b ? a : b); }

/* The dtype code of a graph tap's meta columns (the index in frameworks/mindspore/graph_rows.py's
 * DTYPES) of the dtypes ms_code reads. */
static int ms_meta_code(int code) {
    static const int meta[] = {[DT_F32] = 0, [DT_F16] = 1, [DT_BF16] = 2, [DT_F64] = 3, [DT_I32] = 6, [DT_I64] = 7};
    return meta[code];
}

/* A graph tap's write, in one call: after the flag, the statistics Parameter `buffer` ([slots + 1,
 * width] float64: per slot the 8 columns of a row, its order and its meta columns (dtype code,
 * ndim, the first width - 11 sizes); the last row a counter), the rows written (int32 [2]: the slot,
 * then slots) and the tensor x. The output is [2, width]: the slot's row merged with x's row (min
 * and max by nan-propagating min and max, the other columns summed; the order and meta columns keep
 * the smaller: a reset slot's are inf, so the first write's stay), the order being the counter + 1;
 * then the counter row, all of it that count. The caller scatters the two rows to `rows`. Flag
 * false: the two rows as they are (x not read). */
static int ms_write(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, int32_t zeros) {
    if (nparam != 5 || ndims[1] != 2 || strcmp(dtypes[0], "bool") || strcmp(dtypes[1], "float64") ||
        strcmp(dtypes[2], "int32") || ms_numel(ndims[2], shapes[2]) != 2)
        return 1;
    const double *buffer = (const double *)params[1];
    const int32_t *rows = (const int32_t *)params[2];
    int64_t slots = shapes[1][0] - 1, width = shapes[1][1], slot = rows[0], dims = width - 11;
    int code = ms_code(dtypes[3]);
    if (slot < 0 || slot >= slots || rows[1] != slots || dims < 0 || code < 0)
        return 1;
    const double *old = buffer + slot * width, *counter = buffer + slots * width;
    double *out = (double *)params[4];
    if (!*(const uint8_t *)params[0]) {
        memcpy(out, old, width * sizeof(double));
        memcpy(out + width, counter, width * sizeof(double));
        return 0;
    }
    double row[8], stamp = counter[0] + 1;
    const int64_t table[3] = {(int64_t)(intptr_t)params[3], ms_numel(ndims[3], shapes[3]), code};
    msprobe_cpu_rows(1, table, zeros, row);
    out[0] = min_nan(old[0], row[0]);
    out[1] = max_nan(old[1], row[1]);
    for (int c = 2; c < 8; c++)
        out[c] = old[c] + row[c];
    double tail[3] = {stamp, (double)ms_meta_code(code), (double)ndims[3]};
    for (int c = 0; c < 3; c++)
        out[8 + c] = min_nan(old[8 + c], tail[c]);
    for (int64_t d = 0; d < dims; d++)
        out[11 + d] = min_nan(old[11 + d], d < ndims[3] ? (double)shapes[3][d] : 0.0);
    for (int64_t c = 0; c < width; c++)
        out[width + c] = stamp;
    return 0;
}

#define MS_ENTRY(name, body, zeros)                                                                     \
    int name(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream, \
             void *extra) {                                                                             \
        (void)stream;                                                                                   \
        (void)extra;                                                                                    \
        return body(nparam, params, ndims, shapes, dtypes, zeros);                                      \
    }

MS_ENTRY(msprobe_ms_rows, ms_rows, 0)
MS_ENTRY(msprobe_ms_rows_zeros, ms_rows, 1)
MS_ENTRY(msprobe_ms_diff_rows, ms_diff_rows, 0)
MS_ENTRY(msprobe_ms_diff_rows_zeros, ms_diff_rows, 1)
MS_ENTRY(msprobe_ms_write, ms_write, 0)
MS_ENTRY(msprobe_ms_write_zeros, ms_write, 1)
