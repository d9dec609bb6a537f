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

typedef float vec __attribute__((vector_size(64)));  /* 16 floats: one AVX-512 register, two AVX2 ones */
typedef uint16_t half_bits __attribute__((vector_size(32)));
typedef uint32_t word_bits __attribute__((vector_size(64)));
#define LANES 16
#define MAX_SHARING 16   /* query heads per kv head */
#define MAX_VECTORS 8    /* head_dim up to 128 */
#define BLOCK 64         /* keys per running-softmax update */
#define PIECE_ROWS 1024  /* keys per parallel task */
#define MAX_RUNS 64      /* runs of one call: the probed groups and the window */
#define PARALLEL_ROWS 4096 /* key rows (all kv heads) from which a call runs on several threads */

/* Element types of the query, keys, values and output (one per call): float32, bfloat16, float16. */
enum { FLOAT32 = 0, BFLOAT16 = 1, FLOAT16 = 2 };
#ifdef __FLT16_MAX__ /* the compiler has _Float16 */
typedef _Float16 half16 __attribute__((vector_size(32)));
#define HAS_FLOAT16 1
#else
#define HAS_FLOAT16 0
#endif

/* 16 elements at p + index (in elements of `type`) as floats; `type` is a constant after inlining. */
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

static inline float lane_sum(vec v) { float s = 0.f; for (int i = 0; i < LANES; ++i) s += v[i]; return s; }

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
            for (int64_t g = 0; g < sharing; ++g) {
                const float top = block_max[g] > part->max[g] ? block_max[g] : part->max[g];
                const float rescale = expf(part->max[g] - top);
                float sum = 0.f;
                part->max[g] = top;
#pragma omp simd reduction(+ : sum)
                for (int64_t j = 0; j < rows; ++j) {
                    const float e = expf(weights[g][j] - top);
                    weights[g][j] = e;
                    sum += e;
                }
                part->sum[g] = part->sum[g] * rescale + sum;
                for (int i = 0; i < vectors; ++i) acc[g][i] *= rescale;
            }
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
        const float mine = expf(part->max[g] - top), theirs = expf(other->max[g] - top);
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

/* 1 if focus_decode takes this head shape and element type, else 0. */
int focus_decode_supports(int64_t heads, int64_t kv_heads, int64_t dim, int type)
{
    return kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= MAX_SHARING && dim > 0 && dim % LANES == 0 &&
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
        if (dim == 64) ROWS(4, FLOAT32); else if (dim == 128) ROWS(8, FLOAT32); else ROWS(dim / LANES, FLOAT32);
    } else if (type == BFLOAT16) {
        if (dim == 64) ROWS(4, BFLOAT16); else if (dim == 128) ROWS(8, BFLOAT16); else ROWS(dim / LANES, BFLOAT16);
    } else {
        if (dim == 64) ROWS(4, FLOAT16); else if (dim == 128) ROWS(8, FLOAT16); else ROWS(dim / LANES, FLOAT16);
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
    for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t index = 1; index < count; ++index) partial_merge(&parts[h * count], &parts[h * count + index], sharing, dim);
        partial_store(&parts[h * count], sharing, dim, out, h * sharing, type);
    }
    free(parts);
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
