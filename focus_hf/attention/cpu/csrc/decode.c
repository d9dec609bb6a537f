/* One decoding query per head over a few runs of keys and values: the CPU kernel of `focus_hf.attention.native`.

   A Focus decoding step attends to its probed groups' keys (slices of `grouped_keys.GroupedKeys`) and its window (a
   slice of the KV cache). This kernel reads each run where it lies - no copy into one buffer, no gather - and keeps
   a running softmax over blocks of BLOCK keys, so keys and values are read once and nothing of size n is written.
   The query heads that share a kv head (GQA) share each key and value row read. float32, bfloat16 and float16
   inputs; scores, softmax and sums in float32.

   Compiled on first use with -O3 -march=native -ffast-math: the scores are finite (the running maximum starts at
   -FLT_MAX, never at -inf) and exp is only taken of values <= 0. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vectors.h"

/* One register of the target (vectors.h): 16 floats with AVX-512, 8 with AVX, 4 elsewhere. A vector wider than the
   target's registers is split by the compiler into several, each crossing non-inlined calls through memory, and
   the kernel's specialisations took minutes to compile. */
typedef fvec vec;
typedef uint16_t half_bits __attribute__((vector_size(VECTOR_BYTES / 2)));
typedef uint32_t word_bits __attribute__((vector_size(VECTOR_BYTES)));
#define LANES FLANES
/* e^x is 0 in float32 below it: exponents are clamped to it, so that a running maximum of -FLT_MAX (no key yet)
   beside a large score never makes an infinite intermediate (compiled with -ffast-math: no infinities assumed) */
#define EXP_FLOOR -256.f
#define MAX_SHARING 16   /* query heads per kv head */
#define MAX_VECTORS (128 / LANES) /* head_dim up to 128 */
#define BLOCK 64         /* keys per running-softmax update */
#define PIECE_ROWS 1024  /* keys per parallel task */
#define MAX_RUNS 64      /* runs of one call: the probed groups and the window */
#define PARALLEL_ROWS 4096 /* key rows (all kv heads) from which a call runs on several threads */

/* Element types of the query, keys, values and output (one per call): float32, bfloat16, float16. */
enum { FLOAT32 = 0, BFLOAT16 = 1, FLOAT16 = 2 };
#ifdef __FLT16_MAX__ /* the compiler has _Float16 */
typedef _Float16 half16 __attribute__((vector_size(VECTOR_BYTES / 2)));
#define HAS_FLOAT16 1
#else
#define HAS_FLOAT16 0
#endif

/* LANES elements at p + index (in elements of `type`) as floats; `type` is a constant after inlining. */
static inline __attribute__((always_inline)) vec load(const void* p, int64_t index, const int type)
{
    vec v;
    if (type == BFLOAT16) { /* a bfloat16 is the high half of a float32 */
        half_bits h;
        memcpy(&h, (const uint16_t*)p + index, sizeof h);
        word_bits w = __builtin_convertvector(h, word_bits) << 16;
        memcpy(&v, &w, sizeof v);
#if HAS_FLOAT16
    } else if (type == FLOAT16) {
        half16 h;
        memcpy(&h, (const uint16_t*)p + index, sizeof h);
        v = __builtin_convertvector(h, vec);
#endif
    } else {
        memcpy(&v, (const float*)p + index, sizeof v);
    }
    return v;
}

static inline __attribute__((always_inline)) void store(void* p, int64_t index, vec v, const int type)
{
    if (type == BFLOAT16) { /* round to nearest even, as torch does */
        word_bits w;
        memcpy(&w, &v, sizeof w);
        w += 0x7fff + ((w >> 16) & 1);
        half_bits h = __builtin_convertvector(w >> 16, half_bits);
        memcpy((uint16_t*)p + index, &h, sizeof h);
#if HAS_FLOAT16
    } else if (type == FLOAT16) {
        half16 h = __builtin_convertvector(v, half16);
        memcpy((uint16_t*)p + index, &h, sizeof h);
#endif
    } else {
        memcpy((float*)p + index, &v, sizeof v);
    }
}

static inline float lane_sum(vec v) { return lane_total(v); }

/* What the query heads of one kv head have summed over some keys: running maximum, sum of exp and weighted values. */
typedef struct {
    float max[MAX_SHARING], sum[MAX_SHARING];
    float acc[MAX_SHARING][MAX_VECTORS * LANES];
} Partial;

static void partial_init(Partial* part, int64_t sharing, int64_t dim)
{
    for (int64_t g = 0; g < sharing; ++g) {
        part->max[g] = -FLT_MAX;
        part->sum[g] = 0.f;
        memset(part->acc[g], 0, sizeof(float) * dim);
    }
}

/* Fold one block's scores into the running softmax of `sharing` query heads: weights + g * stride holds query head
   g's `rows` scores and comes out as their exp(score - new maximum); the running maximum and sum of `part` and the
   accumulated values `acc` are rescaled to that maximum. block_max: the block's maximum per query head, or NULL
   (found here). */
static inline __attribute__((always_inline)) void fold_softmax(
    const int vectors, int64_t sharing, float* weights, int64_t stride, int64_t rows, const float* block_max,
    Partial* part, vec acc[MAX_SHARING][MAX_VECTORS])
{
    for (int64_t g = 0; g < sharing; ++g) {
        float* row = weights + g * stride;
        float top = part->max[g];
        if (block_max) {
            top = block_max[g] > top ? block_max[g] : top;
        } else {
            for (int64_t j = 0; j < rows; ++j) top = row[j] > top ? row[j] : top;
        }
        const float rescale = expf(fmaxf(part->max[g] - top, EXP_FLOOR));
        float sum = 0.f;
        part->max[g] = top;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < rows; ++j) {
            const float e = expf(row[j] - top);
            row[j] = e;
            sum += e;
        }
        part->sum[g] = part->sum[g] * rescale + sum;
        for (int i = 0; i < vectors; ++i) acc[g][i] *= rescale;
    }
}

/* One piece of work: rows [begin, end) of run `run` for kv head `head`. */
typedef struct {
    int64_t head, run, begin, end;
} Piece;

/* Fold `count` pieces of one kv head into `part`, for its `sharing` query heads (query points at the first of
   them, [sharing, dim] at element first_row * dim); the query stays in registers across the pieces. */
static inline __attribute__((always_inline)) void attend_rows(
    const int vectors, const int type, int64_t sharing, int64_t dim, const void* query, int64_t first_row,
    float scale, const void* const* keys_of_run, const void* const* values_of_run, const int64_t* head_strides,
    const Piece* pieces, int64_t count, Partial* part)
{
    vec q[MAX_SHARING][MAX_VECTORS], acc[MAX_SHARING][MAX_VECTORS];
    float weights[MAX_SHARING][BLOCK];
    for (int64_t g = 0; g < sharing; ++g)
        for (int i = 0; i < vectors; ++i) {
            q[g][i] = load(query, (first_row + g) * dim + i * LANES, type) * scale;
            acc[g][i] = load(part->acc[g], i * LANES, FLOAT32);
        }
    for (int64_t p = 0; p < count; ++p) {
        const void* keys = keys_of_run[pieces[p].run];
        const void* values = values_of_run[pieces[p].run];
        const int64_t head_offset = pieces[p].head * head_strides[pieces[p].run], end = pieces[p].end;
        for (int64_t start = pieces[p].begin; start < end; start += BLOCK) {
            const int64_t rows = end - start < BLOCK ? end - start : BLOCK;
            const int64_t block_start = head_offset + start * dim;
            float block_max[MAX_SHARING];
            for (int64_t g = 0; g < sharing; ++g) block_max[g] = -FLT_MAX;
            for (int64_t j = 0; j < rows; ++j) {
                vec k[MAX_VECTORS];
                for (int i = 0; i < vectors; ++i) k[i] = load(keys, block_start + j * dim + i * LANES, type);
                for (int64_t g = 0; g < sharing; ++g) {
                    vec dot = q[g][0] * k[0];
                    for (int i = 1; i < vectors; ++i) dot += q[g][i] * k[i];
                    const float score = lane_sum(dot);
                    weights[g][j] = score;
                    block_max[g] = score > block_max[g] ? score : block_max[g];
                }
            }
            fold_softmax(vectors, sharing, &weights[0][0], BLOCK, rows, block_max, part, acc);
            for (int64_t j = 0; j < rows; ++j) {
                vec v[MAX_VECTORS];
                for (int i = 0; i < vectors; ++i) v[i] = load(values, block_start + j * dim + i * LANES, type);
                for (int64_t g = 0; g < sharing; ++g) {
                    const float w = weights[g][j];
                    for (int i = 0; i < vectors; ++i) acc[g][i] += w * v[i];
                }
            }
        }
    }
    for (int64_t g = 0; g < sharing; ++g)
        for (int i = 0; i < vectors; ++i) store(part->acc[g], i * LANES, acc[g][i], FLOAT32);
}

/* Fold `other` into `part` (both over disjoint keys of the same query heads). */
static void partial_merge(Partial* part, const Partial* other, int64_t sharing, int64_t dim)
{
    for (int64_t g = 0; g < sharing; ++g) {
        const float top = other->max[g] > part->max[g] ? other->max[g] : part->max[g];
        const float mine = expf(fmaxf(part->max[g] - top, EXP_FLOOR));
        const float theirs = expf(fmaxf(other->max[g] - top, EXP_FLOOR));
        part->max[g] = top;
        part->sum[g] = part->sum[g] * mine + other->sum[g] * theirs;
        for (int64_t d = 0; d < dim; ++d) part->acc[g][d] = part->acc[g][d] * mine + other->acc[g][d] * theirs;
    }
}

static void partial_store(const Partial* part, int64_t sharing, int64_t dim, void* out, int64_t first_row, int type)
{
    for (int64_t g = 0; g < sharing; ++g) {
        const float inverse = part->sum[g] > 0.f ? 1.f / part->sum[g] : 0.f;
        for (int64_t i = 0; i < dim / LANES; ++i)
            store(out, (first_row + g) * dim + i * LANES, load(part->acc[g], i * LANES, FLOAT32) * inverse, type);
    }
}

/* The parallel calls' ending: each kv head's `count` pieces (parts[h * count ...], in key order) merged into its
   first and stored to out; then the pieces are freed. */
static void merge_pieces(Partial* parts, int64_t count, int64_t kv_heads, int64_t sharing, int64_t dim, void* out,
                         int type)
{
    for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t index = 1; index < count; ++index)
            partial_merge(&parts[h * count], &parts[h * count + index], sharing, dim);
        partial_store(&parts[h * count], sharing, dim, out, h * sharing, type);
    }
    free(parts);
}

/* 1 if focus_decode takes this head shape and element type, else 0. */
int focus_decode_supports(int64_t heads, int64_t kv_heads, int64_t dim, int type)
{
    return kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= MAX_SHARING && dim > 0 && dim % 16 == 0 &&
           dim <= MAX_VECTORS * LANES && (type == FLOAT32 || type == BFLOAT16 || (type == FLOAT16 && HAS_FLOAT16));
}

#define ROWS(vectors, type)                                                                                    \
    attend_rows(vectors, type, sharing, dim, query, pieces[0].head * sharing, scale, keys, values, head_strides, \
                pieces, count, part)

/* Pieces of one kv head, in order, folded into `part`. */
static void attend_pieces(const Piece* pieces, int64_t count, int64_t sharing, int64_t dim, const void* query,
                          float scale, const void* const* keys, const void* const* values,
                          const int64_t* head_strides, int type, Partial* part)
{
    /* constant vector counts for the common head sizes 64 and 128 (unrolled loops), constant element types */
    if (type == FLOAT32) {
        if (dim == 64) ROWS(64 / LANES, FLOAT32); else if (dim == 128) ROWS(128 / LANES, FLOAT32); else ROWS(dim / LANES, FLOAT32);
    } else if (type == BFLOAT16) {
        if (dim == 64) ROWS(64 / LANES, BFLOAT16); else if (dim == 128) ROWS(128 / LANES, BFLOAT16); else ROWS(dim / LANES, BFLOAT16);
    } else {
        if (dim == 64) ROWS(64 / LANES, FLOAT16); else if (dim == 128) ROWS(128 / LANES, FLOAT16); else ROWS(dim / LANES, FLOAT16);
    }
}

/* query, out: [heads, dim] contiguous; run r: `lengths[r]` rows of keys and values, row j of kv head h at element
   h * head_strides[r] + j * dim of keys[r] / values[r] (rows contiguous); every tensor of element type `type`,
   accumulated in float32. Calls that read at least PARALLEL_ROWS rows (over all kv heads) go in pieces of up to
   PIECE_ROWS rows on the OpenMP threads (built with -fopenmp: torch's own pool), merged in order. Returns 0, or 1 for
   a call focus_decode_supports refuses (or out of memory). */
int focus_decode(const void* query, int64_t heads, int64_t kv_heads, int64_t dim, float scale, int64_t runs,
                 const void* const* keys, const void* const* values, const int64_t* lengths,
                 const int64_t* head_strides, void* out, int type)
{
    if (!focus_decode_supports(heads, kv_heads, dim, type)) return 1;
    const int64_t sharing = heads / kv_heads;
    int64_t rows = 0, count = 0;
    for (int64_t r = 0; r < runs; ++r) {
        rows += lengths[r];
        count += (lengths[r] + PIECE_ROWS - 1) / PIECE_ROWS;
    }
    if (rows * kv_heads < PARALLEL_ROWS) {
        Partial part;
        Piece whole[MAX_RUNS];
        if (runs > MAX_RUNS) return 1;
        for (int64_t h = 0; h < kv_heads; ++h) {
            for (int64_t r = 0; r < runs; ++r) whole[r] = (Piece){h, r, 0, lengths[r]};
            partial_init(&part, sharing, dim);
            attend_pieces(whole, runs, sharing, dim, query, scale, keys, values, head_strides, type, &part);
            partial_store(&part, sharing, dim, out, h * sharing, type);
        }
        return 0;
    }
    Partial* parts = malloc(sizeof(Partial) * count * kv_heads);
    if (!parts) return 1;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < count * kv_heads; ++task) {
        const int64_t h = task / count;
        int64_t index = task % count, r = 0;
        while (index >= (lengths[r] + PIECE_ROWS - 1) / PIECE_ROWS) index -= (lengths[r++] + PIECE_ROWS - 1) / PIECE_ROWS;
        const int64_t begin = index * PIECE_ROWS, end = begin + PIECE_ROWS < lengths[r] ? begin + PIECE_ROWS : lengths[r];
        const Piece piece = {h, r, begin, end};
        partial_init(&parts[task], sharing, dim);
        attend_pieces(&piece, 1, sharing, dim, query, scale, keys, values, head_strides, type, &parts[task]);
    }
    merge_pieces(parts, count, kv_heads, sharing, dim, out, type);
    return 0;
}

/* One row of `row_bytes` bytes per head, from src + h * src_head_stride to dst + h * dst_head_stride (strides in
   bytes): a decoding step's one-key append to a group's buffer, keys and values in one call. */
void focus_copy_row(char* dst_keys, char* dst_values, int64_t dst_head_stride, const char* src_keys,
                    const char* src_values, int64_t src_head_stride, int64_t heads, int64_t row_bytes)
{
    for (int64_t h = 0; h < heads; ++h) {
        memcpy(dst_keys + h * dst_head_stride, src_keys + h * src_head_stride, row_bytes);
        memcpy(dst_values + h * dst_head_stride, src_values + h * src_head_stride, row_bytes);
    }
}

/* Append rows 0 .. count - 1 of a run of the cache to their groups' buffers, in position order, in one pass (a
   prompt's distant keys, taken in at its first decoding step): row j, where take[j] (not a sink, not padding), goes
   to slot counts[groups[j]] of that group's buffers, which then grows by one. Group g's buffers as
   focus_grouped_step's: [kv_heads, capacities[g], dim] contiguous; the caller has grown each to hold its rows, and
   every groups[j] of a row taken is a group of the tables. Key row j of kv head h lies h * head_stride + j *
   row_stride bytes from keys (values alike). A sort and a gather of all the rows, then a copy of each group's, cost two
   more passes over them and two temporaries as large (at 16K tokens, 12 MB each per layer). */
void focus_grouped_fill(void* const* buffer_keys, void* const* buffer_values, const int64_t* capacities,
                        int64_t* counts, const char* keys, const char* values, int64_t head_stride, int64_t row_stride,
                        int64_t kv_heads, int64_t row_bytes, const int64_t* groups, const uint8_t* take, int64_t count)
{
    for (int64_t j = 0; j < count; ++j) {
        if (!take[j]) continue;
        const int64_t g = groups[j], slot = counts[g]++;
        const int64_t buffer_head = capacities[g] * row_bytes;
        for (int64_t h = 0; h < kv_heads; ++h) {
            memcpy((char*)buffer_keys[g] + h * buffer_head + slot * row_bytes, keys + h * head_stride + j * row_stride,
                   row_bytes);
            memcpy((char*)buffer_values[g] + h * buffer_head + slot * row_bytes,
                   values + h * head_stride + j * row_stride, row_bytes);
        }
    }
}

/* A decoding step of one sample over its group-sorted copy (`grouped_keys.GroupedKeys`), in one call: the key that
   has just left the window is appended to its group's buffers, then the query attends to its probed groups' buffers
   and the window (focus_decode). Per step this replaces the reads of the key's flags, the append and the tables of
   runs that Python would otherwise build, each an operation run from cold caches between two layers' weights.

   Group g's buffers: buffer_keys[g] / buffer_values[g], [kv_heads, capacities[g], dim] contiguous (NULL while
   capacities[g] is 0), counts[g] slots filled, the first `sinks` of them the sinks (in every buffer). The cache:
   key row j of kv head h at element h * cache_head_stride + j * dim of cache_keys / cache_values; the new key is row
   `position`, its group, sink flag and validity at *group, *sink, *valid (valid NULL: a real key); the window is
   rows position + 1 .. position + width. probes: the query's `top_k` groups, best first (repeats are read once).
   Returns 0 (done, counts[group] grown by one), 1 for a call focus_decode refuses, and, with nothing changed:
   2 where the key's group has no free slot (the caller grows its buffers and calls again), 3 where the key is a sink
   (the caller appends it to every buffer), 4 where a probe or the key's group is not routed yet (negative); 5 where
   the key was appended but focus_decode failed (out of memory: the caller attends another way). */
int focus_grouped_step(const void* query, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                       void* const* buffer_keys, void* const* buffer_values, const int64_t* capacities,
                       int64_t* counts, int64_t num_groups, int64_t sinks, const void* cache_keys,
                       const void* cache_values, int64_t cache_head_stride, int64_t position, int64_t width,
                       const int64_t* group, const uint8_t* sink, const uint8_t* valid, const int64_t* probes,
                       int64_t top_k, void* out, int type)
{
    if (!focus_decode_supports(heads, kv_heads, dim, type) || top_k + 1 > MAX_RUNS) return 1;
    for (int64_t p = 0; p < top_k; ++p)
        if (probes[p] < 0 || probes[p] >= num_groups) return 4;
    const int64_t element = type == FLOAT32 ? 4 : 2;
    if (valid == NULL || *valid) {
        if (*sink) return 3;
        const int64_t g = *group;
        if (g < 0 || g >= num_groups) return 4;
        if (counts[g] >= capacities[g]) return 2;
        const int64_t row_bytes = dim * element;
        for (int64_t h = 0; h < kv_heads; ++h) {
            const int64_t into = (h * capacities[g] + counts[g]) * row_bytes;
            const int64_t from = (h * cache_head_stride + position * dim) * element;
            memcpy((char*)buffer_keys[g] + into, (const char*)cache_keys + from, row_bytes);
            memcpy((char*)buffer_values[g] + into, (const char*)cache_values + from, row_bytes);
        }
        counts[g] += 1;
    }
    const void* keys[MAX_RUNS];
    const void* values[MAX_RUNS];
    int64_t lengths[MAX_RUNS], head_strides[MAX_RUNS], runs = 0;
    for (int64_t p = 0; p < top_k; ++p) {
        const int64_t g = probes[p];
        int repeat = 0;
        for (int64_t q = 0; q < p; ++q) repeat |= probes[q] == g;
        /* the sinks are read once, with the first group */
        const int64_t skip = p == 0 ? 0 : sinks, length = counts[g] - skip;
        if (repeat || length <= 0) continue;
        keys[runs] = (const char*)buffer_keys[g] + skip * dim * element;
        values[runs] = (const char*)buffer_values[g] + skip * dim * element;
        lengths[runs] = length;
        head_strides[runs++] = capacities[g] * dim;
    }
    keys[runs] = (const char*)cache_keys + (position + 1) * dim * element;
    values[runs] = (const char*)cache_values + (position + 1) * dim * element;
    lengths[runs] = width;
    head_strides[runs++] = cache_head_stride;
    return focus_decode(query, heads, kv_heads, dim, scale, runs, keys, values, lengths, head_strides, out, type) ? 5 : 0;
}

/* ---- A decoding step read straight from vLLM's paged KV cache (`focus_hf.vllm.decode`) ----

   One query of a request whose tokens lie in blocks of `block_size` slots (block b of the request is block
   block_row[b] of the cache). Key (t, d) of kv head h in cache block B lies at element B * block_stride +
   h * head_stride + t * key_row_stride + d * key_dim_stride of `keys` (vLLM's CPU layout stores a block's keys
   transposed: key_row_stride 1, key_dim_stride block_size; rows, key_dim_stride 1, are read too), value (t, d) at
   B * block_stride + h * head_stride + t * value_row_stride + d. A kv head with every_key[h] sees every token;
   the others see position p of the `length` tokens iff p < sink_tokens, length - 1 - p <= window, or the group
   of its slot (groups[B * block_size + t], int32) is one of the query's `top_k` probes. Scores are computed only
   for the LANES-slot pieces of a block that hold a visible key (in the transposed layout, a piece's keys are one
   cache line per element: a piece without one is never read), values read only for visible keys. float32. */
#define MAX_BLOCK_SLOTS 1024
#define MAX_GROUPS 4096
#define PAGED_PIECE_KEYS 1024
#define CHUNK_PIECES 8 /* LANES-slot pieces whose scores are computed together (with 16 lanes, 128 slots x 64 dims: 32 KiB of keys) */

typedef struct {
    const float *query, *keys, *values;
    int64_t sharing, dim, block_size, length;
    int64_t block_stride, head_stride, key_row_stride, key_dim_stride, value_row_stride;
    const int32_t *block_row, *groups;
    const unsigned char *probed, *every_key;
    int64_t sink_tokens, window;
    float scale;
} PagedCall;

/* The blocks first_block .. end_block - 1 of kv head h folded into `part`. `shares` is the number of query heads per
   kv head where it is a constant of the call site (the running sums then stay in registers across keys), 0 where it
   is read from the call. */
static inline __attribute__((always_inline)) void paged_blocks(
    const int vectors, const int shares, const PagedCall* c, int64_t h, int64_t first_block, int64_t end_block,
    Partial* part)
{
    const int64_t sharing = shares ? shares : c->sharing, dim = c->dim, bs = c->block_size, last = c->length - 1;
    const int transposed = c->key_row_stride == 1 && bs % LANES == 0;
    vec acc[MAX_SHARING][MAX_VECTORS];
    float qf[MAX_SHARING][MAX_VECTORS * LANES];
    float scores[MAX_SHARING][MAX_BLOCK_SLOTS];
    int32_t visible[MAX_BLOCK_SLOTS];
    unsigned char piece_seen[MAX_BLOCK_SLOTS / LANES];
    for (int64_t g = 0; g < sharing; ++g)
        for (int i = 0; i < vectors; ++i) {
            acc[g][i] = load(part->acc[g], i * LANES, FLOAT32);
            store(qf[g], i * LANES, load(c->query, (h * sharing + g) * dim + i * LANES, FLOAT32) * c->scale, FLOAT32);
        }
    for (int64_t b = first_block; b < end_block; ++b) {
        const int64_t p0 = b * bs, count = c->length - p0 < bs ? c->length - p0 : bs;
        const int64_t block = c->block_row[b];
        const float* kb = c->keys + block * c->block_stride + h * c->head_stride;
        const float* vb = c->values + block * c->block_stride + h * c->head_stride;
        int64_t n = 0;
        memset(piece_seen, 0, (size_t)((bs + LANES - 1) / LANES));
        if (c->every_key[h]) {
            for (int64_t t = 0; t < count; ++t) visible[n++] = (int32_t)t;
            memset(piece_seen, 1, (size_t)((count + LANES - 1) / LANES));
        } else {
            const int32_t* groups = c->groups + block * bs;
            for (int64_t t = 0; t < count; ++t) {
                const int64_t p = p0 + t;
                if (p < c->sink_tokens || last - p <= c->window || c->probed[groups[t]]) {
                    visible[n++] = (int32_t)t;
                    piece_seen[t / LANES] = 1;
                }
            }
        }
        if (n == 0) continue;
        if (transposed) { /* the LANES keys of a piece lie side by side in each element d: one line per element */
            int32_t seen[MAX_BLOCK_SLOTS / LANES];
            int64_t seen_count = 0;
            for (int64_t i = 0; i < (count + LANES - 1) / LANES; ++i)
                if (piece_seen[i]) seen[seen_count++] = (int32_t)i;
            for (int64_t first = 0; first < seen_count; first += CHUNK_PIECES) {
                const int64_t pieces = seen_count - first < CHUNK_PIECES ? seen_count - first : CHUNK_PIECES;
                const float* at[CHUNK_PIECES];
                for (int64_t i = 0; i < pieces; ++i) at[i] = kb + (int64_t)seen[first + i] * LANES;
                /* each line is read once, for every query head of the kv head */
                vec s[MAX_SHARING][CHUNK_PIECES];
                for (int64_t g = 0; g < sharing; ++g)
                    for (int i = 0; i < CHUNK_PIECES; ++i) s[g][i] = (vec){0};
                if (pieces == CHUNK_PIECES) {
                    for (int64_t d = 0; d < dim; ++d)
                        for (int i = 0; i < CHUNK_PIECES; ++i) {
                            const vec k = load(at[i], d * c->key_dim_stride, FLOAT32);
                            for (int64_t g = 0; g < sharing; ++g) s[g][i] += qf[g][d] * k;
                        }
                } else {
                    for (int64_t d = 0; d < dim; ++d)
                        for (int64_t i = 0; i < pieces; ++i) {
                            const vec k = load(at[i], d * c->key_dim_stride, FLOAT32);
                            for (int64_t g = 0; g < sharing; ++g) s[g][i] += qf[g][d] * k;
                        }
                }
                for (int64_t g = 0; g < sharing; ++g)
                    for (int64_t i = 0; i < pieces; ++i) memcpy(&scores[g][seen[first + i] * LANES], &s[g][i], sizeof(vec));
            }
            for (int64_t g = 0; g < sharing; ++g) /* compacted in place: visible[j] >= j */
                for (int64_t j = 0; j < n; ++j) scores[g][j] = scores[g][visible[j]];
        } else {
            for (int64_t j = 0; j < n; ++j) {
                const float* row = kb + visible[j] * c->key_row_stride;
                for (int64_t g = 0; g < sharing; ++g) {
                    float dot = 0.f;
                    for (int64_t d = 0; d < dim; ++d) dot += qf[g][d] * row[d * c->key_dim_stride];
                    scores[g][j] = dot;
                }
            }
        }
        fold_softmax(vectors, sharing, &scores[0][0], MAX_BLOCK_SLOTS, n, NULL, part, acc);
        for (int64_t j = 0; j < n; ++j) {
            vec v[MAX_VECTORS];
            for (int i = 0; i < vectors; ++i) v[i] = load(vb, visible[j] * c->value_row_stride + i * LANES, FLOAT32);
            for (int64_t g = 0; g < sharing; ++g) {
                const float w = scores[g][j];
                for (int i = 0; i < vectors; ++i) acc[g][i] += w * v[i];
            }
        }
    }
    for (int64_t g = 0; g < sharing; ++g)
        for (int i = 0; i < vectors; ++i) store(part->acc[g], i * LANES, acc[g][i], FLOAT32);
}

/* paged_blocks with the common head sizes (64, 128) and GQA shares (1 to 4) as constants: unrolled loops, sums in
   registers. */
#define PAGED_SHARES(vectors)                                                                      \
    switch (c->sharing) {                                                                          \
    case 1: paged_blocks(vectors, 1, c, h, first_block, end_block, part); break;                  \
    case 2: paged_blocks(vectors, 2, c, h, first_block, end_block, part); break;                  \
    case 3: paged_blocks(vectors, 3, c, h, first_block, end_block, part); break;                  \
    case 4: paged_blocks(vectors, 4, c, h, first_block, end_block, part); break;                  \
    default: paged_blocks(vectors, 0, c, h, first_block, end_block, part);                        \
    }

static void paged_piece(const PagedCall* c, int64_t h, int64_t first_block, int64_t end_block, Partial* part)
{
    if (c->dim == 64) PAGED_SHARES(64 / LANES)
    else if (c->dim == 128) PAGED_SHARES(128 / LANES)
    else paged_blocks(c->dim / LANES, 0, c, h, first_block, end_block, part);
}

/* query, out: [heads, dim] contiguous float32; probes: the query's `top_k` groups (of `groups_count`); every_key:
   [kv_heads] flags. Calls over at least PARALLEL_ROWS rows (all kv heads) go in pieces of about PAGED_PIECE_KEYS
   keys on the OpenMP threads, merged in order. Returns 0, or 1 for a call it does not take (head shape, block size,
   groups, out of memory): nothing is written then. */
int focus_paged_decode(const float* query, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                       const float* keys, const float* values, int64_t block_stride, int64_t head_stride,
                       int64_t key_row_stride, int64_t key_dim_stride, int64_t value_row_stride, int64_t block_size,
                       const int32_t* block_row, int64_t length, const int32_t* groups, int64_t groups_count,
                       const int64_t* probes, int64_t top_k, const unsigned char* every_key, int64_t sink_tokens,
                       int64_t window, float* out)
{
    if (!focus_decode_supports(heads, kv_heads, dim, FLOAT32) || block_size < 1 || block_size > MAX_BLOCK_SLOTS ||
        groups_count < 1 || groups_count > MAX_GROUPS || length < 1)
        return 1;
    unsigned char probed[MAX_GROUPS];
    memset(probed, 0, (size_t)groups_count);
    for (int64_t k = 0; k < top_k; ++k) {
        if (probes[k] < 0 || probes[k] >= groups_count) return 1;
        probed[probes[k]] = 1;
    }
    const PagedCall call = {query, keys, values, heads / kv_heads, dim, block_size, length, block_stride,
                            head_stride, key_row_stride, key_dim_stride, value_row_stride, block_row, groups,
                            probed, every_key, sink_tokens, window, scale};
    const int64_t sharing = heads / kv_heads, blocks = (length + block_size - 1) / block_size;
    const int64_t per_piece = block_size >= PAGED_PIECE_KEYS ? 1 : PAGED_PIECE_KEYS / block_size;
    const int64_t count = (blocks + per_piece - 1) / per_piece;
    if (length * kv_heads < PARALLEL_ROWS || count == 1) {
        Partial part;
        for (int64_t h = 0; h < kv_heads; ++h) {
            partial_init(&part, sharing, dim);
            paged_piece(&call, h, 0, blocks, &part);
            partial_store(&part, sharing, dim, out, h * sharing, FLOAT32);
        }
        return 0;
    }
    Partial* parts = malloc(sizeof(Partial) * count * kv_heads);
    if (!parts) return 1;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < count * kv_heads; ++task) {
        const int64_t h = task / count, first = (task % count) * per_piece;
        const int64_t end = first + per_piece < blocks ? first + per_piece : blocks;
        partial_init(&parts[task], sharing, dim);
        paged_piece(&call, h, first, end, &parts[task]);
    }
    merge_pieces(parts, count, kv_heads, sharing, dim, out, FLOAT32);
    return 0;
}
