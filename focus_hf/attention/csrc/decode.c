/* One decoding query per head over a few runs of keys and values: the CPU kernel of `focus_hf.attention.native`.

   A Focus decoding step attends to its probed groups' keys (slices of `grouped_keys.GroupedKeys`) and its window (a
   slice of the KV cache). This kernel reads each run where it lies - no copy into one buffer, no gather - and keeps
   a running softmax over blocks of BLOCK keys, so keys and values are read once and nothing of size n is written.
   The query heads that share a kv head (GQA) share each key and value row read.

   Compiled on first use with -O3 -march=native -ffast-math: the scores are finite (the running maximum starts at
   -FLT_MAX, never at -inf) and exp is only taken of values <= 0. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float vec __attribute__((vector_size(64)));  /* 16 floats: one AVX-512 register, two AVX2 ones */
#define LANES 16
#define MAX_SHARING 16   /* query heads per kv head */
#define MAX_VECTORS 8    /* head_dim up to 128 */
#define BLOCK 64         /* keys per running-softmax update */

static inline vec load(const float* p) { vec v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float* p, vec v) { memcpy(p, &v, sizeof v); }
static inline float lane_sum(vec v) { float s = 0.f; for (int i = 0; i < LANES; ++i) s += v[i]; return s; }

/* The `sharing` query heads of kv head `head`: query and out point at the first of them ([sharing, dim]). */
static inline __attribute__((always_inline)) void attend_kv_head(
    const int vectors, int64_t sharing, int64_t dim, const float* query, float scale, int64_t runs,
    const float* const* keys, const float* const* values, const int64_t* lengths, const int64_t* head_strides,
    int64_t head, float* out)
{
    vec q[MAX_SHARING][MAX_VECTORS], acc[MAX_SHARING][MAX_VECTORS];
    float running_max[MAX_SHARING], running_sum[MAX_SHARING], weights[MAX_SHARING][BLOCK];
    for (int64_t g = 0; g < sharing; ++g) {
        for (int i = 0; i < vectors; ++i) {
            q[g][i] = load(query + g * dim + i * LANES) * scale;
            acc[g][i] = (vec){0};
        }
        running_max[g] = -FLT_MAX;
        running_sum[g] = 0.f;
    }
    for (int64_t r = 0; r < runs; ++r) {
        const float* run_keys = keys[r] + head * head_strides[r];
        const float* run_values = values[r] + head * head_strides[r];
        for (int64_t start = 0; start < lengths[r]; start += BLOCK) {
            const int64_t rows = lengths[r] - start < BLOCK ? lengths[r] - start : BLOCK;
            const float* block_keys = run_keys + start * dim;
            const float* block_values = run_values + start * dim;
            float block_max[MAX_SHARING];
            for (int64_t g = 0; g < sharing; ++g) block_max[g] = -FLT_MAX;
            for (int64_t j = 0; j < rows; ++j) {
                vec k[MAX_VECTORS];
                for (int i = 0; i < vectors; ++i) k[i] = load(block_keys + j * dim + i * LANES);
                for (int64_t g = 0; g < sharing; ++g) {
                    vec dot = q[g][0] * k[0];
                    for (int i = 1; i < vectors; ++i) dot += q[g][i] * k[i];
                    const float score = lane_sum(dot);
                    weights[g][j] = score;
                    block_max[g] = score > block_max[g] ? score : block_max[g];
                }
            }
            for (int64_t g = 0; g < sharing; ++g) {
                const float top = block_max[g] > running_max[g] ? block_max[g] : running_max[g];
                const float rescale = expf(running_max[g] - top);
                float sum = 0.f;
                running_max[g] = top;
#pragma omp simd reduction(+ : sum)
                for (int64_t j = 0; j < rows; ++j) {
                    const float e = expf(weights[g][j] - top);
                    weights[g][j] = e;
                    sum += e;
                }
                running_sum[g] = running_sum[g] * rescale + sum;
                for (int i = 0; i < vectors; ++i) acc[g][i] *= rescale;
            }
            for (int64_t j = 0; j < rows; ++j) {
                vec v[MAX_VECTORS];
                for (int i = 0; i < vectors; ++i) v[i] = load(block_values + j * dim + i * LANES);
                for (int64_t g = 0; g < sharing; ++g) {
                    const float w = weights[g][j];
                    for (int i = 0; i < vectors; ++i) acc[g][i] += w * v[i];
                }
            }
        }
    }
    for (int64_t g = 0; g < sharing; ++g) {
        const float inverse = running_sum[g] > 0.f ? 1.f / running_sum[g] : 0.f;
        for (int i = 0; i < vectors; ++i) store(out + g * dim + i * LANES, acc[g][i] * inverse);
    }
}

/* 1 if focus_decode_f32 takes this head shape, else 0. */
int focus_decode_supports(int64_t heads, int64_t kv_heads, int64_t dim)
{
    return kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= MAX_SHARING && dim > 0 && dim % LANES == 0 &&
           dim <= MAX_VECTORS * LANES;
}

/* query, out: [heads, dim] contiguous float32; run r: `lengths[r]` rows of keys and values, row j of kv head h at
   keys[r] + h * head_strides[r] + j * dim (rows contiguous). Returns 0, or 1 for a head shape it does not take. */
int focus_decode_f32(const float* query, int64_t heads, int64_t kv_heads, int64_t dim, float scale, int64_t runs,
                     const float* const* keys, const float* const* values, const int64_t* lengths,
                     const int64_t* head_strides, float* out)
{
    if (!focus_decode_supports(heads, kv_heads, dim)) return 1;
    const int64_t sharing = heads / kv_heads;
    for (int64_t h = 0; h < kv_heads; ++h) {
        const float* q = query + h * sharing * dim;
        float* o = out + h * sharing * dim;
        switch (dim / LANES) { /* constant vector counts for the common head sizes 64 and 128: unrolled loops */
            case 4: attend_kv_head(4, sharing, dim, q, scale, runs, keys, values, lengths, head_strides, h, o); break;
            case 8: attend_kv_head(8, sharing, dim, q, scale, runs, keys, values, lengths, head_strides, h, o); break;
            default:
                attend_kv_head(dim / LANES, sharing, dim, q, scale, runs, keys, values, lengths, head_strides, h, o);
        }
    }
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
