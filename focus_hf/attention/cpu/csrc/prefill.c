/* Many queries over many keys, with the Focus pattern applied as it goes: the CPU prefill kernel of
   `focus_hf.attention.native`.

   `focus_prefill`: query row r of a call is token `first + r` of its sequence; key slot j is token j. A pair (r, j)
   is visible iff
     - j <= first + r (with `causal`), or j < row_end[r] (with `row_end`, non-decreasing: a staircase),
     - key j is real (`key_valid`, when given), and
     - with a pattern (`query_bits` and `key_bits` given): first + r - j <= window, or query_bits[r] & key_bits[j]
       is not 0 (a query's bits are the groups it probes, a key's the group it is filed under; sinks have every bit).
   With `local`, a call runs the local part of the fast path instead (set B's window pairs): (r, j) is visible iff
   it is causal and real as above, first + r - j <= window and query_bits[r] & key_bits[j] is 0 (pairs that share a
   bit are another part's); only the key blocks of each query block's window are read.
   `focus_prefill_segments`: set A of the fast path in one call - group-sorted query entries over their segment's
   keys, read where they lie through token indices, each entry seeing keys row_begin[e] .. row_end[e] - 1.
   The pattern is evaluated on the fly: no n x n mask or bias is built or read. Each task is QB query rows of one
   head over blocks of KB keys: the scores of a block are one register-blocked product into a buffer that stays in
   the core's cache, then an online softmax (running maximum and sum per row), then one register-blocked product
   with the values. The query heads that share a kv head read the same packed keys. A row's result is written, or
   folded by log-sum-exp into a partial result already in its output row (`finish_row`).
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
#define KB 128 /* keys per block (64: 6-8% slower per pair on long calls) */
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
/* e^x for x in [-80, 0], inline (a call into libm's vector routine per 16 lanes cost more than the products it
   sits between): x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' degree-6 polynomial (a few ulp), 2^n built in the
   exponent bits. Truncating x log2(e) - 1/2 toward zero rounds it to the nearest integer for x <= 0. */
static inline fvec fexp(fvec x)
{
    const ivec n = __builtin_convertvector(x * fsplat(1.44269504088896341f) - fsplat(0.5f), ivec);
    const fvec nf = __builtin_convertvector(n, fvec);
    const fvec r = x - nf * fsplat(0.693359375f) - nf * fsplat(-2.12194440e-4f);
    fvec p = fsplat(1.9875691500e-4f);
    p = p * r + fsplat(1.3981999507e-3f);
    p = p * r + fsplat(8.3334519073e-3f);
    p = p * r + fsplat(4.1665795894e-2f);
    p = p * r + fsplat(1.6666665459e-1f);
    p = p * r + fsplat(5.0000001201e-1f);
    p = p * r * r + r + fsplat(1.f);
    const ivec scale_bits = (n + isplat(127)) << 23;
    fvec two_n;
    memcpy(&two_n, &scale_bits, sizeof two_n);
    return p * two_n;
}

/* Key j's row lies at `offsets[j]` elements past the head's base (or j * stride without offsets). */
static inline int64_t row_offset(const int64_t* offsets, int64_t stride, int64_t j)
{
    return offsets ? offsets[j] : j * stride;
}

/* The packed keys' buffer: the caller's `scratch` (64-byte aligned) where it holds `floats`, else a new one (which
   the caller frees). A caller that loops over calls passes one buffer to all of them: buffers allocated and freed
   by each call land in different places of the heap and leave it larger than any one of them needs. */
static float* take_scratch(float* scratch, int64_t scratch_floats, int64_t floats)
{
    if (scratch && scratch_floats >= floats && ((uintptr_t)scratch & 63) == 0) return scratch;
    return aligned_alloc(64, sizeof(float) * floats);
}

/* keys [S rows] -> blocks of KB keys, each [dim][KB], zero-padded. */
static void pack_keys(const float* keys, const int64_t* offsets, int64_t stride, int64_t S, int dim, float* packed)
{
    for (int64_t block = 0; block * KB < S; ++block) {
        float* out = packed + block * dim * KB;
        for (int j = 0; j < KB; ++j) {
            const int64_t key = block * KB + j;
            const float* row = key < S ? keys + row_offset(offsets, stride, key) : NULL;
            for (int d = 0; d < dim; ++d) out[d * KB + j] = row ? row[d] : 0.f;
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

/* acc[rows][dim] += p[rows][begin .. cols - 1] x the value rows `values[begin .. cols - 1]`. */
static inline __attribute__((always_inline)) void block_values(const float* p, const float* const* values, float* acc,
                                                               int rows, int begin, int cols, const int dim)
{
    const int vectors = dim / FLANES;
    for (int r0 = 0; r0 < rows; r0 += PV_ROWS) {
        fvec a[PV_ROWS][8];
        for (int r = 0; r < PV_ROWS; ++r)
            for (int i = 0; i < vectors; ++i) a[r][i] = fload(acc + (r0 + r) * dim + i * FLANES);
        for (int j = begin; j < cols; ++j) {
            fvec v[8];
            for (int i = 0; i < vectors; ++i) v[i] = fload(values[j] + i * FLANES);
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
    const int32_t* row_begin;  /* [rows of the call] or NULL: from key 0 */
    const int32_t* row_end;    /* [rows of the call] or NULL: causal as `causal` says */
    int64_t base;              /* row_begin and row_end count keys from `base` slots before the call's first */
    const int32_t* query_bits; /* [rows of the call] or NULL: no pattern */
    const int32_t* key_bits;   /* [S rounded up to KB], 0 past S */
    const int32_t* key_valid;  /* [S rounded up to KB] 0 / -1, or NULL: all real */
    int64_t window, first;
    int causal, local;
} Rule;

/* Where a task's rows read and write: query row r (unscaled), its output row and its log-sum-exp. */
typedef struct {
    const float* query[QB];
    float* out[QB];
    float* lse[QB];
} Rows;

/* A task's keys: packed blocks (`pack_keys`) and value rows at `values` + row_offset(offsets, stride, j). */
typedef struct {
    const float* packed;
    const float* values;
    const int64_t* offsets;
    int64_t stride, count;
} Keys;

static inline int32_t clamp_offset(int64_t offset)
{
    return (int32_t)(offset < -KB ? -KB : offset > KB ? KB : offset);
}

/* Hide the pairs of score row `row` (call row r, query position `position`) over keys c0 .. c0 + KB - 1 that `rule`
   does not allow; keys at or past `cols` are beyond the call's. */
static inline void hide(float* row, const Rule* rule, int64_t r, int64_t position, int64_t c0, int cols)
{
    const int64_t begin = rule->row_begin ? rule->row_begin[r] - rule->base : 0; /* first key */
    const int64_t last = rule->row_end ? rule->row_end[r] - 1 - rule->base : rule->causal ? position : INT64_MAX;
    const int64_t near = rule->query_bits ? position - rule->window : INT64_MIN; /* the window's first key */
    if (!rule->local && c0 >= begin && c0 + KB - 1 <= last && c0 >= near && cols == KB && !rule->key_valid) return;
    const ivec lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const ivec begin_offset = isplat(clamp_offset(begin - c0));
    const ivec last_offset = isplat(clamp_offset(last - c0));
    const ivec near_offset = isplat(rule->query_bits ? clamp_offset(near - c0) : -KB);
    const ivec bits = isplat(rule->query_bits ? rule->query_bits[r] : 0), none = isplat(0);
    const union { float f; int32_t i; } hidden_score = {-FLT_MAX};
    const ivec hidden = isplat(hidden_score.i);
    for (int u = 0; u < KVECS; ++u) {
        const ivec slot = lane + isplat(u * FLANES);
        ivec visible = (slot < isplat(cols)) & (slot <= last_offset) & (slot >= begin_offset);
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

/* Write a row's result (acc / sum, lse) to its output row, or with `merge` fold it into what the row holds there
   already (a partial over other keys: an lse of -FLT_MAX means none yet) by log-sum-exp. A row that saw no key
   writes 0 and -FLT_MAX, or with `merge` leaves its row as it is. */
static inline void finish_row(const float* acc, float maximum, float sum, float* out, float* lse, int merge,
                              int dim)
{
    if (sum <= 0.f) {
        if (!merge) {
            memset(out, 0, sizeof(float) * dim);
            *lse = -FLT_MAX;
        }
        return;
    }
    const float part_lse = maximum + logf(sum);
    if (merge && *lse > -FLT_MAX) {
        const float held = *lse, top = held > part_lse ? held : part_lse;
        const float held_weight = expf(held - top), part_weight = expf(part_lse - top), total = held_weight + part_weight;
        const float keep = held_weight / total, add = part_weight / total / sum;
        for (int d = 0; d < dim; ++d) out[d] = out[d] * keep + acc[d] * add;
        *lse = top + logf(total);
        return;
    }
    const float inverse = 1.f / sum;
    for (int d = 0; d < dim; ++d) out[d] = acc[d] * inverse;
    *lse = part_lse;
}

static inline __attribute__((always_inline)) void task(const Rows* where, int64_t rows, const Keys* keys, int64_t start,
                                                       const Rule* rule, float scale, int merge, const int dim)
{
    float queries[QB * 128] __attribute__((aligned(64)));
    float scores[QB * KB] __attribute__((aligned(64)));
    float acc[QB * 128] __attribute__((aligned(64)));
    float maxima[QB], sums[QB];
    const float* value_rows[KB];
    const int64_t S = keys->count;
    const int padded = (int)((rows + QK_ROWS - 1) / QK_ROWS * QK_ROWS);
    for (int r = 0; r < padded; ++r) {
        const float* source = where->query[r < rows ? r : rows - 1];
        for (int d = 0; d < dim; ++d) queries[r * dim + d] = source[d] * scale;
        maxima[r] = -FLT_MAX;
        sums[r] = 0.f;
    }
    memset(acc, 0, sizeof(float) * padded * dim);
    int64_t key_end = S;
    if (rule->row_end) {
        key_end = 0;
        for (int64_t r = start; r < start + rows; ++r)
            key_end = rule->row_end[r] > key_end ? rule->row_end[r] : key_end;
        key_end = key_end - rule->base < S ? key_end - rule->base : S;
    } else if (rule->causal) {
        const int64_t reach = rule->first + start + rows;
        key_end = reach < S ? reach : S;
    }
    int64_t lowest = 0; /* the first key some row may see */
    if (rule->local) { /* the window's first key of the block's first query */
        const int64_t near = rule->first + start - rule->window;
        lowest = near > 0 ? near : 0;
    } else if (rule->row_begin) {
        lowest = INT64_MAX;
        for (int64_t r = start; r < start + rows; ++r)
            lowest = rule->row_begin[r] < lowest ? rule->row_begin[r] : lowest;
        lowest = lowest > rule->base ? lowest - rule->base : 0;
    }
    for (int64_t c0 = lowest / KB * KB; c0 < key_end; c0 += KB) {
        const int cols = key_end - c0 < KB ? (int)(key_end - c0) : KB;
        /* the block's keys that some row may see, in steps of two vectors: from `lowest` to the call's last key */
        const int first_vector = lowest > c0 ? (int)((lowest - c0) / (2 * FLANES)) * 2 : 0;
        const int last_vector = (cols + 2 * FLANES - 1) / (2 * FLANES) * 2;
        block_scores(queries, keys->packed + (c0 / KB) * dim * KB, scores, padded, first_vector, last_vector, dim);
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
                /* hidden scores (-FLT_MAX) are clamped for exp and their weight zeroed after; a visible weight below
                   e^-80 is ~1e-35 of the row's largest, far below float32's resolution of the sum */
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
        for (int j = first_vector * FLANES; j < cols; ++j)
            value_rows[j] = keys->values + row_offset(keys->offsets, keys->stride, c0 + j);
        block_values(scores, value_rows, acc, padded, first_vector * FLANES, cols, dim);
    }
    for (int r = 0; r < rows; ++r) finish_row(acc + r * dim, maxima[r], sums[r], where->out[r], where->lse[r], merge, dim);
}

/* `call(D)` with the head size as a constant D (each size compiles its own task). */
#define DISPATCH(dim, call)                                                                                             \
    switch (dim) {                                                                                                     \
    case 16: call(16); break;                                                                                          \
    case 32: call(32); break;                                                                                          \
    case 48: call(48); break;                                                                                          \
    case 64: call(64); break;                                                                                          \
    case 80: call(80); break;                                                                                          \
    case 96: call(96); break;                                                                                          \
    case 112: call(112); break;                                                                                        \
    default: call(128); break;                                                                                         \
    }

int focus_prefill_supports(int64_t heads, int64_t kv_heads, int64_t dim)
{
    return kv_heads > 0 && heads % kv_heads == 0 && dim % FLANES == 0 && dim >= FLANES && dim <= 128;
}

/* query [B, H, L, dim], key/value [B, KH, S, dim] float32 with contiguous rows; strides in elements {batch, head,
   row} (q_strides, k_strides, v_strides, o_strides, l_strides); out [B, H, L, dim], lse [B, H, L]. row_end and
   query_bits [B, L], key_bits and key_valid [B, S rounded up to a multiple of KB] int32 (key_valid -1 for a real
   key, 0 for padding), each NULL or contiguous; `local` needs the bits. With `merge`, out and lse hold a partial
   result over other keys, which each row's is folded into (`finish_row`). Returns 0, or 1 for a call it does not
   take (nothing written). */
int focus_prefill(const float* q, const float* k, const float* v, float* out, float* lse, int64_t B, int64_t H,
                  int64_t KH, int64_t L, int64_t S, int64_t dim, const int64_t* q_strides, const int64_t* k_strides,
                  const int64_t* v_strides, const int64_t* o_strides, const int64_t* l_strides, const int32_t* row_end,
                  const int32_t* query_bits, const int32_t* key_bits, const int32_t* key_valid, int64_t window,
                  int64_t first, int causal, int local, int merge, float scale, float* scratch,
                  int64_t scratch_floats)
{
    if (!focus_prefill_supports(H, KH, dim) || L <= 0 || S <= 0 || (query_bits && !key_bits) || (local && !query_bits))
        return 1;
    const int64_t sharing = H / KH, blocks = (S + KB - 1) / KB, padded_keys = blocks * KB;
    const int64_t packed_size = padded_keys * dim;
    float* packed = take_scratch(scratch, scratch_floats, packed_size * B * KH);
    if (!packed) return 1;
#pragma omp parallel for
    for (int64_t bh = 0; bh < B * KH; ++bh)
        pack_keys(k + (bh / KH) * k_strides[0] + (bh % KH) * k_strides[1], NULL, k_strides[2], S, (int)dim,
                  packed + bh * packed_size);
    const int64_t chunks = (L + QB - 1) / QB, heads = B * H;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t t = 0; t < heads * chunks; ++t) {
        /* the heads of one chunk in a row (they share its rows of the rule); the longest chunks first (causal) */
        const int64_t bh = t % heads, chunk = chunks - 1 - t / heads;
        const int64_t b = bh / H, h = bh % H, kh = h / sharing;
        const int64_t start = chunk * QB, rows = L - start < QB ? L - start : QB;
        const Rule rule = {NULL, row_end ? row_end + b * L : NULL, 0, query_bits ? query_bits + b * L : NULL,
                           key_bits ? key_bits + b * padded_keys : NULL, key_valid ? key_valid + b * padded_keys : NULL,
                           window, first, causal, local};
        const Keys keys = {packed + (b * KH + kh) * packed_size, v + b * v_strides[0] + kh * v_strides[1], NULL,
                           v_strides[2], S};
        Rows where;
        for (int64_t r = 0; r < rows; ++r) {
            where.query[r] = q + b * q_strides[0] + h * q_strides[1] + (start + r) * q_strides[2];
            where.out[r] = out + b * o_strides[0] + h * o_strides[1] + (start + r) * o_strides[2];
            where.lse[r] = lse + b * l_strides[0] + h * l_strides[1] + (start + r) * l_strides[2];
        }
#define TASK(D) task(&where, rows, &keys, start, &rule, scale, merge, D)
        DISPATCH(dim, TASK)
#undef TASK
    }
    if (packed != scratch) free(packed);
    return 0;
}

/* Set A of the fast path in one call: query entries and keys sorted into segments (one per sample and group,
   `focus_segment_keys` and `focus_segment_entries` in segments.c). Segment s holds entries entry_starts[s] ..
   entry_starts[s + 1] - 1 and keys key_starts[s] .. key_starts[s + 1] - 1; entry e is query row entry_query[e]
   (sample * q_tokens + token) and sees the segment's keys row_begin[e] .. row_end[e] - 1 (counted from the
   segment's first key; row_end non-decreasing within a segment); key i is token key_token[i] (sample * kv_tokens +
   token). query [B, H, q_tokens, dim], key/value [B, KH, kv_tokens, dim], out [B, H, q_tokens, dim] and lse
   [B, H, q_tokens] (strides in elements {batch, head, row}); out and lse hold a partial result (lse -FLT_MAX: none
   yet) that each entry is folded into.
   A segment's keys are packed `slab_keys` at a time, and each slab's entries are folded into their rows before the next:
   the packed copy stays small whatever the length, and a row's merges never overlap - slabs and segments run one
   after another, and a query's entries lie in segments of their own. Returns 0, or 1 for a call it does not take
   (nothing written). */
int focus_prefill_segments(const float* q, const float* k, const float* v, float* out, float* lse, int64_t H,
                           int64_t KH, int64_t dim, const int64_t* q_strides, const int64_t* k_strides,
                           const int64_t* v_strides, const int64_t* o_strides, const int64_t* l_strides,
                           int64_t q_tokens, int64_t kv_tokens, int64_t segments, const int64_t* entry_starts,
                           const int64_t* key_starts, const int32_t* entry_query, const int32_t* key_token,
                           const int32_t* row_begin, const int32_t* row_end, int64_t slab_keys, float scale,
                           float* scratch, int64_t scratch_floats)
{
    if (!focus_prefill_supports(H, KH, dim) || q_tokens <= 0 || kv_tokens <= 0 || slab_keys <= 0) return 1;
    int64_t most = 0;
    for (int64_t s = 0; s < segments; ++s)
        most = key_starts[s + 1] - key_starts[s] > most ? key_starts[s + 1] - key_starts[s] : most;
    if (most == 0) return 0;
    most = most < slab_keys ? most : slab_keys;
    const int64_t padded_keys = (most + KB - 1) / KB * KB, packed_size = padded_keys * dim, sharing = H / KH;
    float* packed = take_scratch(scratch, scratch_floats, packed_size * KH);
    int64_t* key_offsets = malloc(sizeof(int64_t) * 2 * padded_keys);
    if (!packed || !key_offsets) {
        if (packed != scratch) free(packed);
        free(key_offsets);
        return 1;
    }
    int64_t* value_offsets = key_offsets + padded_keys;
    for (int64_t s = 0; s < segments; ++s) {
        const int64_t count = key_starts[s + 1] - key_starts[s], first_entry = entry_starts[s];
        const int64_t entries = entry_starts[s + 1] - first_entry;
        int64_t reaching = 0; /* the segment's first entry that reaches into the slab */
        for (int64_t base = 0; base < count && entries > 0; base += slab_keys) {
            const int64_t slab = count - base < slab_keys ? count - base : slab_keys;
            while (reaching < entries && row_end[first_entry + reaching] <= base) ++reaching;
            if (reaching == entries) break;
            for (int64_t j = 0; j < slab; ++j) {
                const int64_t token = key_token[key_starts[s] + base + j];
                const int64_t b = token / kv_tokens, position = token % kv_tokens;
                key_offsets[j] = b * k_strides[0] + position * k_strides[2];
                value_offsets[j] = b * v_strides[0] + position * v_strides[2];
            }
#pragma omp parallel for
            for (int64_t kh = 0; kh < KH; ++kh)
                pack_keys(k + kh * k_strides[1], key_offsets, 0, slab, (int)dim, packed + kh * packed_size);
            const int64_t first_chunk = reaching / QB, chunks = (entries + QB - 1) / QB - first_chunk;
            const Rule rule = {row_begin + first_entry, row_end + first_entry, base, NULL, NULL, NULL, 0, 0, 0, 0};
#pragma omp parallel for schedule(dynamic, 1)
            for (int64_t t = 0; t < H * chunks; ++t) {
                /* the heads of one chunk in a row; the last chunks (the entries that reach the most keys) first */
                const int64_t h = t % H, kh = h / sharing, chunk = first_chunk + chunks - 1 - t / H;
                const int64_t start = chunk * QB, rows = entries - start < QB ? entries - start : QB;
                const Keys keys = {packed + kh * packed_size, v + kh * v_strides[1], value_offsets, 0, slab};
                Rows where;
                for (int64_t r = 0; r < rows; ++r) {
                    const int64_t row = entry_query[first_entry + start + r];
                    const int64_t b = row / q_tokens, position = row % q_tokens;
                    where.query[r] = q + b * q_strides[0] + h * q_strides[1] + position * q_strides[2];
                    where.out[r] = out + b * o_strides[0] + h * o_strides[1] + position * o_strides[2];
                    where.lse[r] = lse + b * l_strides[0] + h * l_strides[1] + position * l_strides[2];
                }
#define TASK(D) task(&where, rows, &keys, start, &rule, scale, 1, D)
                DISPATCH(dim, TASK)
#undef TASK
            }
        }
    }
    if (packed != scratch) free(packed);
    free(key_offsets);
    return 0;
}

/* Set B's sink pairs of query rows 0 .. L - 1 (row r is position first + r of its sample), folded into out and lse
   by log-sum-exp (`finish_row`): sink t of sample b - position sink_position[b * S + t] (-1: none), group
   sink_group[b * S + t] - is visible to row r iff it lies more than `window` before it, its group is none of the
   row's probes [B, L, top_k] (int64, contiguous) and done[b * L + r] (when given) is 0. A handful of keys per row:
   scores, softmax and the weighted values in one pass, with nothing allocated. Strides as in `focus_prefill`. */
int focus_sink_pairs(const float* q, const float* k, const float* v, float* out, float* lse, int64_t B, int64_t H,
                     int64_t KH, int64_t L, int64_t dim, const int64_t* q_strides, const int64_t* k_strides,
                     const int64_t* v_strides, const int64_t* o_strides, const int64_t* l_strides,
                     const int64_t* sink_position, const int64_t* sink_group, int64_t S, const int64_t* probes,
                     int64_t top_k, const uint8_t* done, int64_t window, int64_t first, float scale)
{
    if (!focus_prefill_supports(H, KH, dim) || S > 64) return 1;
    const int64_t sharing = H / KH;
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < B * L; ++row) {
        const int64_t b = row / L, r = row % L, position = first + r;
        if (done && done[row]) continue;
        int64_t visible[64], count = 0;
        for (int64_t t = 0; t < S; ++t) {
            const int64_t sink = sink_position[b * S + t], group = sink_group[b * S + t];
            if (sink < 0 || position - sink <= window) continue;
            int probed = 0;
            for (int64_t slot = 0; slot < top_k; ++slot) probed |= probes[row * top_k + slot] == group;
            if (!probed) visible[count++] = sink;
        }
        if (!count) continue;
        for (int64_t h = 0; h < H; ++h) {
            const int64_t kh = h / sharing;
            const float* query = q + b * q_strides[0] + h * q_strides[1] + r * q_strides[2];
            float scores[64], maximum = -FLT_MAX, sum = 0.f, acc[128] = {0};
            for (int64_t t = 0; t < count; ++t) {
                const float* key = k + b * k_strides[0] + kh * k_strides[1] + visible[t] * k_strides[2];
                float dot = 0.f;
                for (int64_t d = 0; d < dim; ++d) dot += query[d] * key[d];
                scores[t] = dot * scale;
                maximum = scores[t] > maximum ? scores[t] : maximum;
            }
            for (int64_t t = 0; t < count; ++t) {
                const float weight = expf(scores[t] - maximum);
                const float* value = v + b * v_strides[0] + kh * v_strides[1] + visible[t] * v_strides[2];
                sum += weight;
                for (int64_t d = 0; d < dim; ++d) acc[d] += weight * value[d];
            }
            finish_row(acc, maximum, sum, out + b * o_strides[0] + h * o_strides[1] + r * o_strides[2],
                       lse + b * l_strides[0] + h * l_strides[1] + r * l_strides[2], 1, (int)dim);
        }
    }
    return 0;
}
