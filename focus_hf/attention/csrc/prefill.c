/* Many queries over many keys, with the Focus pattern applied as it goes: the CPU prefill kernel of
   `focus_hf.attention.native`.

   Query row r of a call is token `first + r` of its sequence; key slot j is token j. A pair (r, j) is visible iff
     - j <= first + r (with `causal`), or j < row_end[r] (with `row_end`, non-decreasing: a staircase),
     - key j is real (`key_valid`, when given), and
     - with a pattern (`query_bits` and `key_bits` given): first + r - j <= window, or query_bits[r] & key_bits[j]
       is not 0 (a query's bits are the groups it probes, a key's the group it is filed under; sinks have every bit).
   With `local`, a call runs the local part of the fast path instead (set B's window pairs): (r, j) is visible iff
   it is causal and real as above, first + r - j <= window and query_bits[r] & key_bits[j] is 0 (pairs that share a
   bit are another part's); only the key blocks of each query block's window are read.
   The pattern is evaluated on the fly from those bits: no n x n mask or bias is built or read. Each task is QB query
   rows of one head over blocks of KB keys: the scores of a block are one register-blocked product into a buffer
   that stays in the core's cache, then an online softmax (running maximum and sum per row), then one
   register-blocked product with the values. The query heads that share a kv head read the same packed keys.
   float32 only; head dims that are multiples of 16 up to 128 (each compiled with its dim as a constant).

   Compiled with -O3 -march=native -ffast-math (see decode.c): scores are finite (hidden pairs are -FLT_MAX, the
   running maximum starts there) and exp is only taken of values <= 0. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float fvec __attribute__((vector_size(64)));
typedef int32_t ivec __attribute__((vector_size(64)));
#define FLANES 16
#define QB 32 /* query rows per task */
#define KB 64 /* keys per block */
#define KVECS (KB / FLANES)
#define QK_ROWS 8 /* rows of the score micro-tile (8 x 32 keys: 16 accumulators) */
#define PV_ROWS 4 /* rows of the value micro-tile (4 x dim) */

static inline fvec fload(const float* p) { fvec v; memcpy(&v, p, sizeof v); return v; }
static inline void fstore(float* p, fvec v) { memcpy(p, &v, sizeof v); }
static inline ivec iload(const int32_t* p) { ivec v; memcpy(&v, p, sizeof v); return v; }
static inline fvec fsplat(float x) { return (fvec){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static inline ivec isplat(int32_t x) { return (ivec){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static inline float lane_max(fvec v)
{
    float m = v[0];
    for (int i = 1; i < FLANES; ++i) m = v[i] > m ? v[i] : m;
    return m;
}
static inline float lane_total(fvec v)
{
    float s = 0.f;
    for (int i = 0; i < FLANES; ++i) s += v[i];
    return s;
}
static inline fvec fmax_lanes(fvec a, fvec b)
{
    fvec r;
    for (int i = 0; i < FLANES; ++i) r[i] = a[i] > b[i] ? a[i] : b[i];
    return r;
}
static inline fvec fexp(fvec x)
{
    float in[FLANES], out[FLANES];
    memcpy(in, &x, sizeof in);
#pragma omp simd
    for (int i = 0; i < FLANES; ++i) out[i] = expf(in[i]);
    fvec r;
    memcpy(&r, out, sizeof r);
    return r;
}

/* keys [S, dim] (row stride `stride`) -> blocks of KB keys, each [dim][KB], zero-padded. */
static void pack_keys(const float* keys, int64_t stride, int64_t S, int dim, float* packed)
{
    for (int64_t block = 0; block * KB < S; ++block) {
        float* out = packed + block * dim * KB;
        for (int j = 0; j < KB; ++j) {
            const int64_t key = block * KB + j;
            const float* row = keys + key * stride;
            for (int d = 0; d < dim; ++d) out[d * KB + j] = key < S ? row[d] : 0.f;
        }
    }
}

/* Scores of vectors first .. last - 1 of a block (even bounds: the micro-tile takes two); the others are left
   unwritten, for `hide` to cover (they lie outside every row's keys). */
static inline __attribute__((always_inline)) void block_scores(const float* q, const float* packed, float* scores,
                                                               int rows, int first, int last, const int dim)
{
    for (int r0 = 0; r0 < rows; r0 += QK_ROWS)
        for (int u0 = first; u0 < last; u0 += 2) {
            fvec s[QK_ROWS][2];
            for (int r = 0; r < QK_ROWS; ++r) s[r][0] = s[r][1] = (fvec){0};
            for (int d = 0; d < dim; ++d) {
                const fvec k0 = fload(packed + d * KB + u0 * FLANES), k1 = fload(packed + d * KB + (u0 + 1) * FLANES);
                for (int r = 0; r < QK_ROWS; ++r) {
                    const fvec qv = fsplat(q[(r0 + r) * dim + d]);
                    s[r][0] += qv * k0;
                    s[r][1] += qv * k1;
                }
            }
            for (int r = 0; r < QK_ROWS; ++r) {
                fstore(scores + (r0 + r) * KB + u0 * FLANES, s[r][0]);
                fstore(scores + (r0 + r) * KB + (u0 + 1) * FLANES, s[r][1]);
            }
        }
}

static inline __attribute__((always_inline)) void block_values(const float* p, const float* values, int64_t stride,
                                                               float* acc, int rows, int begin, int cols,
                                                               const int dim)
{
    const int vectors = dim / FLANES;
    for (int r0 = 0; r0 < rows; r0 += PV_ROWS) {
        fvec a[PV_ROWS][8];
        for (int r = 0; r < PV_ROWS; ++r)
            for (int i = 0; i < vectors; ++i) a[r][i] = fload(acc + (r0 + r) * dim + i * FLANES);
        for (int j = begin; j < cols; ++j) {
            fvec v[8];
            for (int i = 0; i < vectors; ++i) v[i] = fload(values + j * stride + i * FLANES);
            for (int r = 0; r < PV_ROWS; ++r) {
                const fvec w = fsplat(p[(r0 + r) * KB + j]);
                for (int i = 0; i < vectors; ++i) a[r][i] += w * v[i];
            }
        }
        for (int r = 0; r < PV_ROWS; ++r)
            for (int i = 0; i < vectors; ++i) fstore(acc + (r0 + r) * dim + i * FLANES, a[r][i]);
    }
}

typedef struct {
    const int32_t* row_end;    /* [rows of the call] or NULL: causal as `causal` says */
    const int32_t* query_bits; /* [rows of the call] or NULL: no pattern */
    const int32_t* key_bits;   /* [S rounded up to KB], 0 past S */
    const int32_t* key_valid;  /* [S rounded up to KB] 0 / -1, or NULL: all real */
    int64_t window, first;
    int causal, local;
} Rule;

static inline int32_t clamp_offset(int64_t offset)
{
    return (int32_t)(offset < -KB ? -KB : offset > KB ? KB : offset);
}

/* Hide the pairs of score row `row` (call row r, query position `position`) over keys c0 .. c0 + KB - 1 that `rule`
   does not allow; keys at or past `cols` are beyond the call's. */
static inline void hide(float* row, const Rule* rule, int64_t r, int64_t position, int64_t c0, int cols)
{
    const int64_t last = rule->row_end ? rule->row_end[r] - 1 : rule->causal ? position : INT64_MAX; /* last key */
    const int64_t near = rule->query_bits ? position - rule->window : INT64_MIN; /* the window's first key */
    if (!rule->local && c0 + KB - 1 <= last && c0 >= near && cols == KB && !rule->key_valid) return;
    const ivec lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const ivec last_offset = isplat(clamp_offset(last - c0));
    const ivec near_offset = isplat(rule->query_bits ? clamp_offset(near - c0) : -KB);
    const ivec bits = isplat(rule->query_bits ? rule->query_bits[r] : 0), none = isplat(0);
    const union { float f; int32_t i; } hidden_score = {-FLT_MAX};
    const ivec hidden = isplat(hidden_score.i);
    for (int u = 0; u < KVECS; ++u) {
        const ivec slot = lane + isplat(u * FLANES);
        ivec visible = (slot < isplat(cols)) & (slot <= last_offset);
        if (rule->key_valid) visible &= iload(rule->key_valid + c0 + u * FLANES);
        if (rule->local)
            visible &= ((iload(rule->key_bits + c0 + u * FLANES) & bits) == none) & (slot >= near_offset);
        else if (rule->query_bits)
            visible &= ((iload(rule->key_bits + c0 + u * FLANES) & bits) != none) | (slot >= near_offset);
        ivec score;
        memcpy(&score, row + u * FLANES, sizeof score);
        score = (score & visible) | (hidden & ~visible);
        memcpy(row + u * FLANES, &score, sizeof score);
    }
}

static inline __attribute__((always_inline)) void task(const float* q, int64_t q_stride, const float* packed,
                                                       const float* values, int64_t v_stride, float* out,
                                                       int64_t o_stride, float* lse, int64_t start, int64_t rows,
                                                       int64_t S, const Rule* rule, float scale, const int dim)
{
    float queries[QB * 128] __attribute__((aligned(64)));
    float scores[QB * KB] __attribute__((aligned(64)));
    float acc[QB * 128] __attribute__((aligned(64)));
    float maxima[QB], sums[QB];
    const int padded = (int)((rows + QK_ROWS - 1) / QK_ROWS * QK_ROWS);
    for (int r = 0; r < padded; ++r) {
        const int64_t source = start + (r < rows ? r : rows - 1);
        for (int d = 0; d < dim; ++d) queries[r * dim + d] = q[source * q_stride + d] * scale;
        maxima[r] = -FLT_MAX;
        sums[r] = 0.f;
    }
    memset(acc, 0, sizeof(float) * padded * dim);
    int64_t key_end = S;
    if (rule->row_end) {
        key_end = 0;
        for (int64_t r = start; r < start + rows; ++r)
            key_end = rule->row_end[r] > key_end ? rule->row_end[r] : key_end;
        key_end = key_end < S ? key_end : S;
    } else if (rule->causal) {
        const int64_t reach = rule->first + start + rows;
        key_end = reach < S ? reach : S;
    }
    int64_t key_begin = 0;
    if (rule->local) { /* the block holding the window's first key of the block's first query */
        const int64_t near = rule->first + start - rule->window;
        key_begin = near > 0 ? near / KB * KB : 0;
    }
    for (int64_t c0 = key_begin; c0 < key_end; c0 += KB) {
        const int cols = key_end - c0 < KB ? (int)(key_end - c0) : KB;
        /* the block's keys that some row may see, in steps of two vectors: from the window's first key of the
           first row (local part) to the call's last key */
        int first_vector = 0;
        if (rule->local && rule->first + start - rule->window > c0)
            first_vector = (int)((rule->first + start - rule->window - c0) / (2 * FLANES)) * 2;
        const int last_vector = (cols + 2 * FLANES - 1) / (2 * FLANES) * 2;
        block_scores(queries, packed + (c0 / KB) * dim * KB, scores, padded, first_vector, last_vector, dim);
        for (int r = 0; r < padded; ++r) {
            float* row = scores + r * KB;
            const int64_t call_row = start + (r < rows ? r : rows - 1);
            hide(row, rule, call_row, rule->first + call_row, c0, cols);
            fvec top = fload(row);
            for (int u = 1; u < KVECS; ++u) top = fmax_lanes(top, fload(row + u * FLANES));
            const float block_max = lane_max(top);
            if (block_max == -FLT_MAX) { /* nothing visible here: weights 0, the running state unchanged */
                memset(row, 0, sizeof(float) * KB);
                continue;
            }
            const float new_max = block_max > maxima[r] ? block_max : maxima[r];
            const float rescale = expf(maxima[r] - new_max);
            maxima[r] = new_max;
            fvec total = (fvec){0};
            for (int u = 0; u < KVECS; ++u) {
                /* exp's vector routine takes a slow path for arguments below ~-87: hidden scores (-FLT_MAX) are
                   clamped and their weight zeroed after; a visible weight below e^-80 is ~1e-35 of the row's
                   largest, far below float32's resolution of the sum */
                const fvec score = fload(row + u * FLANES);
                const ivec visible = score > fsplat(-FLT_MAX);
                const fvec p = fexp(fmax_lanes(score - fsplat(new_max), fsplat(-80.f)));
                ivec weight;
                memcpy(&weight, &p, sizeof weight);
                weight &= visible;
                memcpy(row + u * FLANES, &weight, sizeof weight);
                fvec kept;
                memcpy(&kept, &weight, sizeof kept);
                total += kept;
            }
            sums[r] = sums[r] * rescale + lane_total(total);
            if (rescale != 1.f)
                for (int d = 0; d < dim; d += FLANES) fstore(acc + r * dim + d, fload(acc + r * dim + d) * fsplat(rescale));
        }
        block_values(scores, values + c0 * v_stride, v_stride, acc, padded, first_vector * FLANES, cols, dim);
    }
    for (int r = 0; r < rows; ++r) {
        const float inverse = sums[r] > 0.f ? 1.f / sums[r] : 0.f; /* a row that sees nothing comes out 0 */
        for (int d = 0; d < dim; ++d) out[(start + r) * o_stride + d] = acc[r * dim + d] * inverse;
        lse[start + r] = sums[r] > 0.f ? maxima[r] + logf(sums[r]) : -FLT_MAX;
    }
}

int focus_prefill_supports(int64_t heads, int64_t kv_heads, int64_t dim)
{
    return kv_heads > 0 && heads % kv_heads == 0 && dim % FLANES == 0 && dim >= FLANES && dim <= 128;
}

/* query [B, H, L, dim], key/value [B, KH, S, dim] float32 with contiguous rows; strides in elements {batch, head,
   row} (q_strides, k_strides, v_strides, o_strides); out [B, H, L, dim] (strides o_strides), lse [B, H, L]
   contiguous. row_end and query_bits [B, L], key_bits and key_valid [B, S rounded up to a multiple of 64] int32 (key_valid -1
   for a real key, 0 for padding), each NULL or contiguous; `local` needs the bits. Returns 0, or 1 for a call it
   does not take (nothing written). */
int focus_prefill(const float* q, const float* k, const float* v, float* out, float* lse, int64_t B, int64_t H,
                  int64_t KH, int64_t L, int64_t S, int64_t dim, const int64_t* q_strides, const int64_t* k_strides,
                  const int64_t* v_strides, const int64_t* o_strides, const int32_t* row_end, const int32_t* query_bits,
                  const int32_t* key_bits, const int32_t* key_valid, int64_t window, int64_t first, int causal,
                  int local, float scale)
{
    if (!focus_prefill_supports(H, KH, dim) || L <= 0 || S <= 0 || (query_bits && !key_bits) || (local && !query_bits))
        return 1;
    const int64_t sharing = H / KH, blocks = (S + KB - 1) / KB, padded_keys = blocks * KB;
    const int64_t packed_size = padded_keys * dim;
    float* packed = aligned_alloc(64, sizeof(float) * packed_size * B * KH);
    if (!packed) return 1;
#pragma omp parallel for
    for (int64_t bh = 0; bh < B * KH; ++bh)
        pack_keys(k + (bh / KH) * k_strides[0] + (bh % KH) * k_strides[1], k_strides[2], S, (int)dim,
                  packed + bh * packed_size);
    const int64_t chunks = (L + QB - 1) / QB, heads = B * H;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t t = 0; t < heads * chunks; ++t) {
        /* the heads of one chunk in a row (they share its rows of the rule); the longest chunks first (causal) */
        const int64_t bh = t % heads, chunk = chunks - 1 - t / heads;
        const int64_t b = bh / H, h = bh % H, kh = h / sharing;
        const int64_t start = chunk * QB, rows = L - start < QB ? L - start : QB;
        const Rule rule = {row_end ? row_end + b * L : NULL, query_bits ? query_bits + b * L : NULL, key_bits ? key_bits + b * padded_keys : NULL,
                           key_valid ? key_valid + b * padded_keys : NULL, window, first, causal, local};
        const float* qh = q + b * q_strides[0] + h * q_strides[1];
        const float* vh = v + b * v_strides[0] + kh * v_strides[1];
        float* oh = out + b * o_strides[0] + h * o_strides[1];
        const float* ph = packed + (b * KH + kh) * packed_size;
#define TASK(D) task(qh, q_strides[2], ph, vh, v_strides[2], oh, o_strides[2], lse + bh * L, start, rows, S, &rule, scale, D)
        switch (dim) {
        case 16: TASK(16); break;
        case 32: TASK(32); break;
        case 48: TASK(48); break;
        case 64: TASK(64); break;
        case 80: TASK(80); break;
        case 96: TASK(96); break;
        case 112: TASK(112); break;
        default: TASK(128); break;
        }
#undef TASK
    }
    free(packed);
    return 0;
}
