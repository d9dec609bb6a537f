/* Many queries over many keys, with the Focus pattern applied as it goes: the CPU prefill kernel of
   `focus_hf.attention.native`.

   `focus_prefill`: query row r of a call is token `first + r` of its sequence; key slot j is token j. A pair (r, j)
   is visible iff
     - j <= first + r (with `causal`), or j < row_end[r] (with `row_end`, non-decreasing: a staircase),
     - key j is real (`key_valid`, when given), and
     - with a pattern (`query_bits` and `key_bits` given): first + r - j <= window, or query_bits[r] & key_bits[j]
       is not 0 (a query's bits are the groups it probes, a key's the group it is filed under; sinks have every bit).
   With `local`, a call runs the window band's window pairs of the CPU path instead: (r, j) is visible iff it is causal
   and real as above, first + r - j <= window and query_bits[r] & key_bits[j] is 0 (pairs that share a bit are another
   part's); only the key blocks of each query block's window are read.
   `focus_prefill_segments`: the CPU path's own-group pass in one call - group-sorted query entries over their segment's
   keys, read where they lie through token indices, each entry seeing keys row_begin[e] .. row_end[e] - 1.
   The pattern is evaluated on the fly: no n x n mask or bias is built or read. Each task is QB query rows of one
   head over blocks of KB keys (QB, KB and the register tiles are the target's: vectors.h): the scores of a block
   are one register-blocked product into a buffer that stays in the core's cache, then an online softmax (running maximum and sum per row, in powers of two: the scale and log2(e)
   are one multiplier of the raw scores), then one register-blocked product with the values. The query heads that
   share a kv head read the same packed keys. A row's result is written, or folded by log-sum-exp into a partial
   result already in its output row (`finish_row`).

   Element types: float32, or bfloat16 queries, keys and values with float32 sums. Where the processor has bfloat16
   dot products (AVX512_BF16, compiled in with -march=native), a bfloat16 call multiplies bfloat16 pairs into
   float32 sums (`vdpbf16ps`: twice the products per instruction of a float32 FMA): keys packed in pairs of dims,
   values in pairs of keys, the softmax weights rounded to bfloat16 for the product with the values (as torch's
   kernels do) while their sum stays float32. Elsewhere bfloat16 keys and values are widened to float32 as they are
   packed and the float32 products run. Head dims that are multiples of 16 up to 128 (each compiled with its dim as
   a constant).

   Compiled with -O3 -ffast-math for FOCUS_HF_CPU_TARGET (default -march=native; see native.py and decode.c): scores are finite (hidden pairs are -FLT_MAX, the
   running maximum starts there) and powers of two are only taken of values <= 0. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vectors.h"

#define QB QUERY_ROWS /* query rows per task (vectors.h: per target) */
#define KB KEY_BLOCK /* keys per block (on AVX-512 64 was 6-8% slower per pair on long calls than 128) */
_Static_assert(QB % QK_ROWS == 0 && QK_ROWS % PV_ROWS == 0, "the tiles must divide a task's rows");
/* Per-key arrays (key_bits, key_valid) come padded to a multiple of this for every target (`focus_key_array_step`),
   so that the caller's layout does not depend on the build */
#define KEY_ARRAY_STEP 384 /* 128, 96 and 64 divide it */
_Static_assert(KB % (QK_VECTORS * FLANES) == 0 && KEY_ARRAY_STEP % KB == 0,
               "the score tile must divide a key block, and a block the per-key arrays' padding");
#define LOG2E 1.44269504088896341f
/* Query rows per task of a local call: its rows see only their window, so a task reads window + rows keys for rows
   x window pairs; fewer rows than QB waste less (AVX2, K=8, window 128: 10 -> 7.5 ns per pair at 32 rows) */
#define LOCAL_ROWS (QB < 32 ? QB : 32)
/* Segments of fewer keys than this take LOCAL_ROWS rows per task in `focus_prefill_segments`: a task computed every
   pair of its rows up to the keys of its last row, about half a rows x rows triangle more than its rows see, which
   in a short segment is a large share of its pairs (AVX2, 1K tokens, K 8: 15.8 -> 13 ns per visible pair). Its
   tiles now skip the keys beyond their own rows', but QB rows in short segments were still slower (AVX-512 EPYC,
   x86-64-v3 build, 4K: 4.35 against 4.12 ns per pair). */
#define SHORT_SEGMENT (8 * QB)

/* Element types of queries, keys and values (one per call; as in decode.c); outputs are float32, or with a call
   that writes rather than merges, of the inputs' type. */
enum { FLOAT32 = 0, BFLOAT16 = 1 };
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define BF16_DOT 1 /* bfloat16 calls multiply bfloat16 pairs (`vdpbf16ps`) */
#else
#define BF16_DOT 0 /* bfloat16 calls widen to float32 as they pack */
#endif
/* Where the build targets AMX (Intel's tile unit: Sapphire Rapids and later, compiled in with -march=native) and the
   OS lets the process use it (`tiles_granted`), a bfloat16 call of a head size that is a multiple of 32 takes both of
   its products in tiles (`tile_scores`, `tile_values`): the same packed layouts as the pairs above, which are the
   tiles' own, 16 x 16 float32 sums per instruction. torch's dense attention takes bfloat16 products in tiles there
   (about 0.9 ns per pair and head on a 2-core Xeon, Emerald Rapids), several times the rate of `vdpbf16ps`. */
#if BF16_DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define AMX_TILES 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define AMX_TILES 0
#endif
/* A task's kind of products (`task_function`): float32 (bfloat16 widened), bfloat16 pairs, bfloat16 pairs in tiles. */
enum { WIDE = 0, PAIRS = 1, TILES = 2 };
/* Rows of an AMX tile, and the rows a task of TILES pads its rows to; a tile row is 64 bytes: 16 float32 sums, 16
   pairs of bfloat16 (32 dims, or 32 keys' weights) or 16 key pairs' values (16 dims). */
#define TILE 16

static inline float widen(uint16_t bits) /* a bfloat16 is the high half of a float32 */
{
    const uint32_t word = (uint32_t)bits << 16;
    float x;
    memcpy(&x, &word, sizeof x);
    return x;
}
static inline uint16_t narrow(float x) /* round to nearest even, as torch does */
{
    uint32_t word;
    memcpy(&word, &x, sizeof word);
    return (uint16_t)((word + 0x7fff + ((word >> 16) & 1)) >> 16);
}
/* Element i of a row of `type`, as a float. */
static inline float element(const void* row, int64_t i, int type)
{
    return type == BFLOAT16 ? widen(((const uint16_t*)row)[i]) : ((const float*)row)[i];
}
static inline size_t element_size(int type) { return type == BFLOAT16 ? 2 : 4; }
static inline const void* element_at(const void* base, int64_t offset, int type)
{
    return (const char*)base + offset * (int64_t)element_size(type);
}
/* 2^x for x <= 0, inline (a call into libm's vector routine per 16 lanes cost more than the products it sits
   between): x = n + r with |r| <= 1/2, 2^r by Cephes' degree-6 polynomial (a few ulp), times 2^n (with AVX-512,
   rounding and scaling by 2^n are one instruction each; elsewhere 2^n is built in the exponent bits).
   Powers below 2^EXP2_FLOOR are 0: x is clamped there, so that every power computed is a normal float, and the lanes
   below are then zeroed by a mask. A power that underflows into a subnormal float (or to 0, from a subnormal
   intermediate) costs a microcode assist of a hundred cycles and more on Intel processors unless the thread flushes
   subnormals to zero, which the caller's may not: hidden scores (-FLT_MAX), a large share of a local call's, made its
   pairs four times dearer per pair than the own-group pass's on a Xeon (Emerald Rapids), where AMD's Zen takes them at
   full speed. Weights below 2^-125 of a row's largest (which is 1) are far below what a float32 sum can hold. */
#define EXP2_FLOOR -125.f
#define EXP_FLOOR -256.f /* e^x's clamp for the scalar log-sum-exp merges (libm's expf) */
static inline fvec fexp2(fvec x)
{
    const ivec kept = x >= fsplat(EXP2_FLOOR);
    x = fmax_lanes(x, fsplat(EXP2_FLOOR));
#ifdef __AVX512F__
    const fvec n = (fvec)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const fvec r = x - n;
#else
    /* truncating x - 1/2 toward zero rounds it to the nearest integer for x <= 0 */
    const ivec whole = __builtin_convertvector(x - fsplat(0.5f), ivec);
    const fvec r = x - __builtin_convertvector(whole, fvec);
#endif
    fvec p = fsplat(1.535336188319500e-4f);
    p = p * r + fsplat(1.339887440266574e-3f);
    p = p * r + fsplat(9.618437357674640e-3f);
    p = p * r + fsplat(5.550332471162809e-2f);
    p = p * r + fsplat(2.402264791363012e-1f);
    p = p * r + fsplat(6.931472028550421e-1f);
    p = p * r + fsplat(1.f);
#ifdef __AVX512F__
    p = (fvec)_mm512_scalef_ps((__m512)p, (__m512)n);
#else
    const ivec scale_bits = (whole + isplat(127)) << 23;
    fvec two_n;
    memcpy(&two_n, &scale_bits, sizeof two_n);
    p = p * two_n;
#endif
    return as_fvec(as_ivec(p) & kept);
}

/* Key j's row lies at `offsets[j]` elements past the head's base (or j * stride without offsets). */
static inline int64_t row_offset(const int64_t* offsets, int64_t stride, int64_t j)
{
    return offsets ? offsets[j] : j * stride;
}

/* How a call of element type `type` packs its keys and values (`pack_keys`):
   - float32 calls pack their keys, each block [dim][KB] floats, and read their values where they lie - except with
     `pack_values` (`focus_prefill_segments`, whose keys are gathered from all over the sequence through token
     indices), which pack the values as [KB][dim] floats too (the own-group pass a few percent faster per pair at 16K
     on the AVX-512 EPYC, in the native, x86-64-v3 and x86-64-v2 builds; the window band, whose rows lie in order,
     paid the copy and gained nothing);
   - bfloat16 calls with BF16_DOT ("pairs") pack keys as [dim / 2][KB] pairs of dims and values as [KB / 2][dim]
     pairs of keys (32 bits each);
   - other bfloat16 calls pack keys as float32 calls do and values as [KB][dim] floats, widened. */
static inline int pairs_of(int type) { return BF16_DOT && type == BFLOAT16; }

/* Whether a call packs its values as [KB][dim] floats (widened bfloat16, or float32 with `pack_values`). */
static inline int packs_float_values(int type, int pack_values)
{
    return type == FLOAT32 ? pack_values : !pairs_of(type);
}

/* 32-bit words a kv head's packed keys and values take, for `blocks` blocks. */
static inline int64_t packed_words(int64_t blocks, int64_t dim, int type, int pack_values)
{
    const int64_t keys = blocks * KB * dim;
    return packs_float_values(type, pack_values) ? 2 * keys : keys;
}

/* The packed buffer: the caller's `scratch` (64-byte aligned) where it holds `words`, else a new one (which the
   caller frees). A caller that loops over calls passes one buffer to all of them: buffers allocated and freed by
   each call land in different places of the heap and leave it larger than any one of them needs. */
static float* take_scratch(float* scratch, int64_t scratch_words, int64_t words)
{
    if (scratch && scratch_words >= words && ((uintptr_t)scratch & 63) == 0) return scratch;
    return aligned_alloc(64, sizeof(float) * words);
}

/* Rows gathered through offsets (the own-group pass's keys, from all over the sequence) are beyond the hardware
   prefetchers' reach: each key's rows are asked for this many keys before they are packed (the bfloat16 own-group pass
   at 16K on the AVX-512 EPYC: the packing took about 7% of the call's time, then about 2%) */
#define PREFETCH_AHEAD 8
/* GCC 12's dead-code pass deleted __builtin_prefetch from `prefetch_rows` (it kept it in simpler loops): on x86 and
   aarch64 the instruction is written out */
static inline void prefetch(const char* p)
{
#if defined(__x86_64__) || defined(__i386__)
    __asm__ volatile("prefetcht0 %0" : : "m"(*p));
#elif defined(__aarch64__)
    __asm__ volatile("prfm pldl1keep, %0" : : "Q"(*p));
#else
    __builtin_prefetch(p);
#endif
}
static inline void prefetch_rows(const void* keys, const void* values, const int64_t* key_offsets,
                                 const int64_t* value_offsets, int64_t key, int64_t S, int dim, int type)
{
    if (!key_offsets || key >= S) return;
    const char* k_row = element_at(keys, key_offsets[key], type);
    const char* v_row = element_at(values, value_offsets[key], type);
    for (int64_t byte = 0, bytes = dim * (int64_t)element_size(type); byte < bytes; byte += 64) {
        prefetch(k_row + byte);
        prefetch(v_row + byte);
    }
}

/* Pack keys (and values, for bfloat16 or with `pack_values`) rows 0 .. S - 1 into `packed` (`packed_words(blocks)`
   words: the keys' blocks, then the values' blocks), zero-padded to whole blocks. Row j lies at
   row_offset(key_offsets, key_stride, j) elements from `keys`, and likewise for `values`. */
static void pack_keys(const void* keys, const void* values, const int64_t* key_offsets, const int64_t* value_offsets,
                      int64_t key_stride, int64_t value_stride, int64_t S, int dim, int type, int pack_values,
                      float* packed)
{
    const int64_t blocks = (S + KB - 1) / KB;
    if (pairs_of(type)) {
        /* two keys at a time, branch-free (a key past S reads a row of zeros), so that the loops vectorize */
        static const uint16_t zeros[128] = {0};
        uint32_t* key_pairs = (uint32_t*)packed;
        uint32_t* value_pairs = key_pairs + blocks * KB * dim / 2;
        for (int64_t block = 0; block < blocks; ++block) {
            uint32_t* k_out = key_pairs + block * KB * dim / 2;
            uint32_t* v_out = value_pairs + block * KB * dim / 2;
            for (int j = 0; j < KB; j += 2) {
                const uint16_t *k_rows[2], *v_rows[2];
                for (int i = 0; i < 2; ++i) {
                    const int64_t key = block * KB + j + i;
                    prefetch_rows(keys, values, key_offsets, value_offsets, key + PREFETCH_AHEAD, S, dim, type);
                    k_rows[i] = key < S ? (const uint16_t*)keys + row_offset(key_offsets, key_stride, key) : zeros;
                    v_rows[i] = key < S ? (const uint16_t*)values + row_offset(value_offsets, value_stride, key) : zeros;
                }
                /* a key's dims 2w and 2w + 1 are pair w; keys j and j + 1's values share a word, j's the low half */
                for (int i = 0; i < 2; ++i)
                    for (int w = 0; w < dim / 2; ++w)
                        k_out[w * KB + j + i] = (uint32_t)k_rows[i][2 * w] | (uint32_t)k_rows[i][2 * w + 1] << 16;
                for (int d = 0; d < dim; ++d)
                    v_out[j / 2 * dim + d] = (uint32_t)v_rows[0][d] | (uint32_t)v_rows[1][d] << 16;
            }
        }
        return;
    }
    float* value_rows = packed + blocks * KB * dim;
    for (int64_t block = 0; block < blocks; ++block) {
        float* out = packed + block * dim * KB;
        for (int j = 0; j < KB; ++j) {
            const int64_t key = block * KB + j;
            prefetch_rows(keys, values, key_offsets, value_offsets, key + PREFETCH_AHEAD, S, dim, type);
            const void* row = key < S ? element_at(keys, row_offset(key_offsets, key_stride, key), type) : NULL;
            for (int d = 0; d < dim; ++d) out[d * KB + j] = row ? element(row, d, type) : 0.f;
            if (!packs_float_values(type, pack_values)) continue;
            const void* v_row = key < S ? element_at(values, row_offset(value_offsets, value_stride, key), type) : NULL;
            for (int d = 0; d < dim; ++d) value_rows[key * dim + d] = v_row ? element(v_row, d, type) : 0.f;
        }
    }
}

/* Keys begin .. end - 1 of a block (offsets from its first key): the only ones a row may see there. */
typedef struct {
    int begin, end;
} KeySpan;

/* The keys some row of `spans[0 .. count - 1]` may see: the tiles of the products skip the others (the rows of a
   task end at a staircase of keys, and a tile over keys beyond them all would be hidden after it is computed). */
static inline KeySpan rows_span(const KeySpan* spans, int count)
{
    KeySpan all = {KB, 0};
    for (int i = 0; i < count; ++i)
        if (spans[i].end > spans[i].begin) {
            all.begin = spans[i].begin < all.begin ? spans[i].begin : all.begin;
            all.end = spans[i].end > all.end ? spans[i].end : all.end;
        }
    return all;
}

/* Scores of vectors first .. last - 1 of a block (bounds multiples of QK_VECTORS: the micro-tile takes that many),
   for each group of QK_ROWS rows only the tiles over keys some row of the group may see (`spans`, one per row); the
   others are left unwritten, for `hide` to cover (they lie outside the rows' keys). Float32: q [rows][dim]
   floats, the block [dim][KB]; pairs: q [rows][dim / 2] and the block [dim / 2][KB] pairs. Each tile of key vectors
   is taken by every row in turn, so that its slice of the block stays in the first-level cache. */
static inline __attribute__((always_inline)) void block_scores(const void* q, const void* block, float* scores,
                                                               int rows, int first, int last, const KeySpan* spans,
                                                               const int dim, const int pairs)
{
    /* each group's keys, once per block rather than once per tile */
    KeySpan groups[QB / QK_ROWS];
    for (int r0 = 0; r0 < rows; r0 += QK_ROWS) groups[r0 / QK_ROWS] = rows_span(spans + r0, QK_ROWS);
    for (int u0 = first; u0 < last; u0 += QK_VECTORS)
        for (int r0 = 0; r0 < rows; r0 += QK_ROWS) {
            const KeySpan span = groups[r0 / QK_ROWS];
            if ((u0 + QK_VECTORS) * FLANES <= span.begin || u0 * FLANES >= span.end) continue; /* no row sees it */
            fvec s[QK_ROWS][QK_VECTORS];
            for (int r = 0; r < QK_ROWS; ++r)
                for (int i = 0; i < QK_VECTORS; ++i) s[r][i] = (fvec){0};
            if (pairs) {
#if BF16_DOT
                const uint32_t* qp = (const uint32_t*)q + r0 * (dim / 2);
                const uint32_t* kp = (const uint32_t*)block + u0 * FLANES;
                for (int d = 0; d < dim / 2; ++d) {
                    __m512bh k[QK_VECTORS];
                    for (int i = 0; i < QK_VECTORS; ++i) k[i] = (__m512bh)_mm512_loadu_si512(kp + d * KB + i * FLANES);
                    for (int r = 0; r < QK_ROWS; ++r) {
                        const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)qp[r * (dim / 2) + d]);
                        for (int i = 0; i < QK_VECTORS; ++i) s[r][i] = (fvec)_mm512_dpbf16_ps((__m512)s[r][i], qv, k[i]);
                    }
                }
#endif
            } else {
                const float* qf = (const float*)q + r0 * dim * SPLAT_LANES;
                const float* kf = (const float*)block + u0 * FLANES;
                for (int d = 0; d < dim; ++d) {
                    fvec k[QK_VECTORS];
                    for (int i = 0; i < QK_VECTORS; ++i) {
                        k[i] = fload(kf + d * KB + i * FLANES);
#if KEEP_KEYS
                        IN_REGISTER(k[i]);
#endif
                    }
                    for (int r = 0; r < QK_ROWS; ++r) {
                        const fvec qv = splat_at(qf + (r * dim + d) * SPLAT_LANES);
                        for (int i = 0; i < QK_VECTORS; ++i) s[r][i] += qv * k[i];
                    }
                }
            }
            for (int r = 0; r < QK_ROWS; ++r)
                for (int i = 0; i < QK_VECTORS; ++i) fstore(scores + (r0 + r) * KB + (u0 + i) * FLANES, s[r][i]);
        }
}

/* acc[rows][dim] += p[rows][begin .. cols - 1] x the block's value rows (float32), row j at values + j * stride (the
   packed rows, stride dim, or the rows where they lie). The micro-tile is PV_ROWS rows x PV_VECTORS vectors of dims:
   its accumulators, value vectors and weights fit the registers. The value vectors are held in registers across the
   tile's rows on every target (IN_REGISTER): folded into each row's products as memory operands, they were loaded once
   per row (the own-group pass at 16K on the AVX-512 EPYC, one thread: native 2.93-2.99 -> 2.79-2.83 ns per pair,
   x86-64-v3 3.30-3.35 -> 3.16-3.23, x86-64-v2 capped 8.63-9.12 -> 7.93-8.09). */
static inline __attribute__((always_inline)) void block_values(const float* p, const float* values, int64_t stride,
                                                               float* acc, int rows, int begin, int cols,
                                                               const KeySpan* spans, const int dim)
{
    const int vectors = dim / FLANES;
    /* dims outermost: a slice of PV_VECTORS vectors of the block's values stays in the first-level cache while every
       row takes it */
    for (int c0 = 0; c0 < vectors; c0 += PV_VECTORS)
        for (int r0 = 0; r0 < rows; r0 += PV_ROWS) {
            const int count = vectors - c0 < PV_VECTORS ? vectors - c0 : PV_VECTORS; /* a constant per c0 */
            fvec a[PV_ROWS][PV_VECTORS];
            for (int r = 0; r < PV_ROWS; ++r)
                for (int i = 0; i < count; ++i) a[r][i] = fload(acc + (r0 + r) * dim + (c0 + i) * FLANES);
            const KeySpan span = rows_span(spans + r0, PV_ROWS); /* the other keys' weights are 0 in these rows */
            const int from = span.begin > begin ? span.begin : begin, to = span.end < cols ? span.end : cols;
            for (int j = from; j < to; ++j) {
                fvec v[PV_VECTORS];
                const float* row = values + j * stride;
                for (int i = 0; i < count; ++i) {
                    v[i] = fload(row + (c0 + i) * FLANES);
                    IN_REGISTER(v[i]);
                }
                for (int r = 0; r < PV_ROWS; ++r) {
                    const fvec w = fsplat(p[(r0 + r) * KB + j]);
                    for (int i = 0; i < count; ++i) a[r][i] += w * v[i];
                }
            }
            for (int r = 0; r < PV_ROWS; ++r)
                for (int i = 0; i < count; ++i) fstore(acc + (r0 + r) * dim + (c0 + i) * FLANES, a[r][i]);
        }
}

#if BF16_DOT
/* acc[rows][dim] += w[rows][pairs first .. last - 1] x the block's value pairs [KB / 2][dim] (bfloat16 pairs: the
   weights of keys 2i and 2i + 1 against their values, one `vdpbf16ps` per 16 dims). */
static inline __attribute__((always_inline)) void block_value_pairs(const uint32_t* w, const uint32_t* values,
                                                                    float* acc, int rows, int first, int last,
                                                                    const int dim)
{
    const int vectors = dim / FLANES;
    for (int r0 = 0; r0 < rows; r0 += PV_ROWS) {
        __m512 a[PV_ROWS][8];
        for (int r = 0; r < PV_ROWS; ++r)
            for (int i = 0; i < vectors; ++i) a[r][i] = _mm512_loadu_ps(acc + (r0 + r) * dim + i * FLANES);
        for (int j = first; j < last; ++j) {
            __m512bh v[8];
            for (int i = 0; i < vectors; ++i) v[i] = (__m512bh)_mm512_loadu_si512(values + j * dim + i * FLANES);
            for (int r = 0; r < PV_ROWS; ++r) {
                const __m512bh weight = (__m512bh)_mm512_set1_epi32((int)w[(r0 + r) * (KB / 2) + j]);
                for (int i = 0; i < vectors; ++i) a[r][i] = _mm512_dpbf16_ps(a[r][i], weight, v[i]);
            }
        }
        for (int r = 0; r < PV_ROWS; ++r)
            for (int i = 0; i < vectors; ++i) _mm512_storeu_ps(acc + (r0 + r) * dim + i * FLANES, a[r][i]);
    }
}
#endif

#if AMX_TILES
/* Tile registers: 0-3 sums (two row tiles x two column tiles), 4-5 the rows' operands, 6-7 the columns'. */
_Static_assert(TILE == FLANES && QB % (2 * TILE) == 0 && KB % (2 * TILE) == 0, "a vector is a tile's 16 columns");
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes[16];
    uint8_t rows[16];
} TileConfig;

/* Each thread that uses the tiles configures them first (and releases them after its task). */
static void configure_tiles(void)
{
    TileConfig config = {.palette = 1};
    for (int t = 0; t < 8; ++t) {
        config.bytes[t] = 64;
        config.rows[t] = TILE;
    }
    _tile_loadconfig(&config);
}

/* Whether the OS lets this process use the tile registers: Linux hands out their 8 KB of state per process, on
   request (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); without it the first tile instruction stops the
   process. torch's oneDNN asks too; asking again is harmless. */
#define ARCH_REQ_XCOMP_PERM 0x1023 /* <asm/prctl.h>, which older kernel headers lack */
#define XFEATURE_XTILEDATA 18
static int tiles_granted(void)
{
    static int granted = -1; /* asked once; threads that race ask twice and agree */
    if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

/* Scores of vectors (16-key tiles) first .. last - 1 of a block, both even, for rows 0 .. rows - 1 (a multiple of
   TILE): q [rows][dim] bfloat16, the block [dim / 2][KB] pairs, dim a multiple of 32. Column tiles no row of a pair of
   row tiles sees (`spans`) are skipped, as in `block_scores`. */
static inline __attribute__((always_inline)) void tile_scores(const uint16_t* q, const uint32_t* block, float* scores,
                                                              int rows, int first, int last, const KeySpan* spans,
                                                              const int dim)
{
    for (int r0 = 0; r0 < rows; r0 += 2 * TILE) {
        const int two = r0 + TILE < rows;
        const KeySpan span = rows_span(spans + r0, two ? 2 * TILE : TILE);
        for (int u0 = first; u0 < last; u0 += 2) {
            if ((u0 + 2) * FLANES <= span.begin || u0 * FLANES >= span.end) continue;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int c = 0; c < dim / 32; ++c) {
                const uint32_t* keys = block + c * TILE * KB + u0 * FLANES;
                _tile_loadd(6, keys, KB * 4);
                _tile_loadd(7, keys + FLANES, KB * 4);
                _tile_loadd(4, q + r0 * dim + c * 32, dim * 2);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (two) {
                    _tile_loadd(5, q + (r0 + TILE) * dim + c * 32, dim * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            float* out = scores + r0 * KB + u0 * FLANES;
            _tile_stored(0, out, KB * 4);
            _tile_stored(1, out + FLANES, KB * 4);
            if (two) {
                _tile_stored(2, out + TILE * KB, KB * 4);
                _tile_stored(3, out + TILE * KB + FLANES, KB * 4);
            }
        }
    }
}

/* acc[rows][dim] += w[rows][pairs first .. last - 1] x the block's value pairs [KB / 2][dim]: first and last
   multiples of TILE (32 keys), rows of TILE, dim a multiple of 32. */
static inline __attribute__((always_inline)) void tile_values(const uint32_t* w, const uint32_t* values, float* acc,
                                                              int rows, int first, int last, const int dim)
{
    for (int r0 = 0; r0 < rows; r0 += 2 * TILE) {
        const int two = r0 + TILE < rows;
        for (int d0 = 0; d0 < dim; d0 += 2 * TILE) {
            float* sums = acc + r0 * dim + d0;
            _tile_loadd(0, sums, dim * 4);
            _tile_loadd(1, sums + TILE, dim * 4);
            if (two) {
                _tile_loadd(2, sums + TILE * dim, dim * 4);
                _tile_loadd(3, sums + TILE * dim + TILE, dim * 4);
            }
            for (int p0 = first; p0 < last; p0 += TILE) {
                _tile_loadd(6, values + p0 * dim + d0, dim * 4);
                _tile_loadd(7, values + p0 * dim + d0 + TILE, dim * 4);
                _tile_loadd(4, w + r0 * (KB / 2) + p0, KB * 2);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (two) {
                    _tile_loadd(5, w + (r0 + TILE) * (KB / 2) + p0, KB * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, sums, dim * 4);
            _tile_stored(1, sums + TILE, dim * 4);
            if (two) {
                _tile_stored(2, sums + TILE * dim, dim * 4);
                _tile_stored(3, sums + TILE * dim + TILE, dim * 4);
            }
        }
    }
}
#endif

typedef struct {
    const int32_t* row_begin;  /* [rows of the call] or NULL: from key 0 */
    const int32_t* row_end;    /* [rows of the call] or NULL: causal as `causal` says */
    int64_t base;              /* row_begin and row_end count keys from `base` slots before the call's first */
    const int32_t* query_bits; /* [rows of the call] or NULL: no pattern */
    const int32_t* key_bits;   /* [S rounded up to KEY_ARRAY_STEP], 0 past S */
    const int32_t* key_valid;  /* [S rounded up to KEY_ARRAY_STEP] 0 / -1, or NULL: all real */
    int64_t window, first;
    int causal, local;
} Rule;

/* Where a task's rows read and write: query row r (unscaled, of the call's element type), its output row (float32,
   or of `out_type`) and its log-sum-exp. */
typedef struct {
    const void* query[QB];
    void* out[QB];
    float* lse[QB];
    int type, out_type;
} Rows;

/* A task's keys: packed blocks (`pack_keys`); value row j at `values` + j * stride (float32 calls that read them
   where they lie), else (`values` NULL) in the packed buffer. */
typedef struct {
    const float* packed;
    const float* values;
    int64_t stride, count;
    int type;
} Keys;

static inline int32_t clamp_offset(int64_t offset)
{
    return (int32_t)(offset < -KB ? -KB : offset > KB ? KB : offset);
}

/* The first and the last key (slots from the call's first) that `rule` may let call row r, at query position
   `position`, see: its row_begin (else 0) and its row_end or causal bound. */
static inline void row_bounds(const Rule* rule, int64_t r, int64_t position, int64_t* begin, int64_t* last)
{
    *begin = rule->row_begin ? rule->row_begin[r] - rule->base : 0;
    *last = rule->row_end ? rule->row_end[r] - 1 - rule->base : rule->causal ? position : INT64_MAX;
}

/* A row's span in the block at c0 of `cols` keys; a local call's rows see no key before their window. */
static inline KeySpan key_span(const Rule* rule, int64_t r, int64_t position, int64_t c0, int cols)
{
    int64_t begin, last;
    row_bounds(rule, r, position, &begin, &last);
    if (rule->local && position - rule->window > begin) begin = position - rule->window;
    begin = begin > c0 ? begin - c0 : 0;
    last = last < c0 + cols - 1 ? last - c0 : cols - 1;
    return (KeySpan){(int)(begin < cols ? begin : cols), (int)(last + 1 > begin ? last + 1 : begin)};
}

/* Hide the pairs of score row `row` (call row r, query position `position`) over the keys of vectors first_vector ..
   last_vector - 1 of the block at c0 that `rule` does not allow; keys at or past `cols` are beyond the call's. */
static inline void hide(float* row, const Rule* rule, int64_t r, int64_t position, int64_t c0, int cols,
                        int first_vector, int last_vector)
{
    int64_t begin, last;
    row_bounds(rule, r, position, &begin, &last);
    const int64_t near = rule->query_bits ? position - rule->window : INT64_MIN; /* the window's first key */
    if (!rule->local && c0 >= begin && c0 + KB - 1 <= last && c0 >= near && cols == KB && !rule->key_valid) return;
    const ivec lane = lane_index();
    const ivec begin_offset = isplat(clamp_offset(begin - c0));
    const ivec last_offset = isplat(clamp_offset(last - c0));
    const ivec near_offset = isplat(rule->query_bits ? clamp_offset(near - c0) : -KB);
    const ivec bits = isplat(rule->query_bits ? rule->query_bits[r] : 0), none = isplat(0);
    const union { float f; int32_t i; } hidden_score = {-FLT_MAX};
    const ivec hidden = isplat(hidden_score.i);
    for (int u = first_vector; u < last_vector; ++u) {
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

/* Write a row's result (acc / sum, lse; `maximum` of the scaled scores) to its output row - float32 or bfloat16 as
   `out_type` says - or with `merge` fold it into what the float32 row holds there already (a partial over other
   keys: an lse of -FLT_MAX means none yet) by log-sum-exp. A row that saw no key writes 0 and -FLT_MAX, or with
   `merge` leaves its row as it is. */
static inline void finish_row(const float* acc, float maximum, float sum, void* out, float* lse, int merge,
                              int out_type, int dim)
{
    if (sum <= 0.f) {
        if (!merge) {
            memset(out, 0, element_size(out_type) * dim);
            *lse = -FLT_MAX;
        }
        return;
    }
    const float part_lse = maximum + logf(sum);
    float* row = out;
    if (merge && *lse > -FLT_MAX) {
        const float held = *lse, top = held > part_lse ? held : part_lse;
        const float held_weight = expf(fmaxf(held - top, EXP_FLOOR));
        const float part_weight = expf(fmaxf(part_lse - top, EXP_FLOOR));
        const float total = held_weight + part_weight;
        const float keep = held_weight / total, add = part_weight / total / sum;
        for (int d = 0; d < dim; ++d) row[d] = row[d] * keep + acc[d] * add;
        *lse = top + logf(total);
        return;
    }
    const float inverse = 1.f / sum;
    if (out_type == BFLOAT16)
        for (int d = 0; d < dim; ++d) ((uint16_t*)out)[d] = narrow(acc[d] * inverse);
    else
        for (int d = 0; d < dim; ++d) row[d] = acc[d] * inverse;
    *lse = part_lse;
}

/* The query rows of a task in the layout its products take: float32 [rows][dim][SPLAT_LANES] (bfloat16 widened;
   each dim in SPLAT_LANES lanes), or with `pairs` the bfloat16 rows as they are ([rows][dim / 2] pairs). Rows past
   `rows` repeat the last (the micro-tiles take QK_ROWS at a time). */
static void load_queries(const Rows* where, int64_t rows, int padded, int dim, int pairs, void* queries)
{
    for (int r = 0; r < padded; ++r) {
        const void* source = where->query[r < rows ? r : rows - 1];
        if (pairs)
            memcpy((uint16_t*)queries + r * dim, source, sizeof(uint16_t) * dim);
        else
            for (int d = 0; d < dim; ++d)
                for (int lane = 0; lane < SPLAT_LANES; ++lane)
                    ((float*)queries)[(r * dim + d) * SPLAT_LANES + lane] = element(source, d, where->type);
    }
}

static inline __attribute__((always_inline)) void task(const Rows* where, int64_t rows, const Keys* keys, int64_t start,
                                                       const Rule* rule, float scale, int merge, const int dim,
                                                       const int kind)
{
    const int pairs = kind != WIDE, tiles = kind == TILES; /* `task_function` */
    float queries[QB * 128 * SPLAT_LANES] __attribute__((aligned(64)));
    float scores[QB * KB] __attribute__((aligned(64)));
    uint32_t weight_pairs[QB * KB / 2] __attribute__((aligned(64))); /* with `pairs` */
    float acc[QB * 128] __attribute__((aligned(64)));
    float maxima[QB], sums[QB];
    KeySpan spans[QB];
    const int64_t S = keys->count, blocks = (S + KB - 1) / KB;
    const float* packed_values = keys->packed + blocks * KB * dim / (pairs ? 2 : 1); /* past the keys' blocks */
    /* 2^(s * unit) = e^(s * scale) for a raw score s */
    const float unit = scale * LOG2E;
    const int row_step = tiles ? TILE : QK_ROWS;
    const int padded = (int)((rows + row_step - 1) / row_step * row_step);
    load_queries(where, rows, padded, dim, pairs, queries);
#if AMX_TILES
    if (tiles) configure_tiles();
#endif
    for (int r = 0; r < padded; ++r) {
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
        /* the block's keys that some row may see, in steps of QK_VECTORS: from `lowest` to the call's last key; the
           scores, weights and products cover those vectors only (a local block's window spans parts of two blocks) */
        const int step = QK_VECTORS * FLANES;
        const int first_vector = lowest > c0 ? (int)((lowest - c0) / step) * QK_VECTORS : 0;
        const int last_vector = (cols + step - 1) / step * QK_VECTORS;
        const float* block = keys->packed + (c0 / KB) * dim * KB / (pairs ? 2 : 1);
        for (int r = 0; r < padded; ++r) {
            const int64_t call_row = start + (r < rows ? r : rows - 1);
            spans[r] = key_span(rule, call_row, rule->first + call_row, c0, cols);
        }
#if AMX_TILES
        if (tiles)
            tile_scores((const uint16_t*)queries, (const uint32_t*)block, scores, padded, first_vector, last_vector,
                        spans, dim);
        else
#endif
            block_scores(queries, block, scores, padded, first_vector, last_vector, spans, dim, pairs);
        for (int r = 0; r < padded; ++r) {
            float* row = scores + r * KB;
            const int64_t call_row = start + (r < rows ? r : rows - 1);
            hide(row, rule, call_row, rule->first + call_row, c0, cols, first_vector, last_vector);
            fvec top = fload(row + first_vector * FLANES);
            for (int u = first_vector + 1; u < last_vector; ++u) top = fmax_lanes(top, fload(row + u * FLANES));
            const float block_max = lane_max(top);
            if (block_max == -FLT_MAX) { /* nothing visible here: weights 0, the running state unchanged */
                memset(row, 0, sizeof(float) * KB);
                if (pairs) memset(weight_pairs + r * (KB / 2), 0, sizeof(uint32_t) * (KB / 2));
                continue;
            }
            const float new_max = block_max > maxima[r] ? block_max : maxima[r];
            /* no libm call where a row's maximum stays put (mostly, after its first blocks), where it had none or
               where the power is below EXP2_FLOOR (libm's underflow path is slow; `fexp2`) */
            const float drop = (maxima[r] - new_max) * unit;
            const float rescale = new_max == maxima[r] ? 1.f : drop < EXP2_FLOOR ? 0.f : exp2f(drop);
            maxima[r] = new_max;
            /* (score - max) * unit, never score * unit - max * unit: that FMA is off by up to half an ulp of
               max * unit, above 0 where scores are large (2^65536 = inf from scores near 1e13, NaN in the row) */
            const fvec largest = fsplat(new_max), multiplier = fsplat(unit);
            fvec total = (fvec){0};
            for (int u = first_vector; u < last_vector; ++u) {
                const fvec score = fload(row + u * FLANES);
                const fvec p = fexp2((score - largest) * multiplier);
                fstore(row + u * FLANES, p);
                total += p;
            }
            sums[r] = sums[r] * rescale + lane_total(total);
            if (rescale != 1.f)
                for (int d = 0; d < dim; d += FLANES) fstore(acc + r * dim + d, fload(acc + r * dim + d) * fsplat(rescale));
#if BF16_DOT
            if (pairs) /* the weights as bfloat16, two keys to a word, for the product with the value pairs */
                for (int u = first_vector; u < last_vector; u += 2) {
                    const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_load_ps(row + (u + 1) * FLANES),
                                                              _mm512_load_ps(row + u * FLANES));
                    _mm512_store_si512(weight_pairs + r * (KB / 2) + u * FLANES / 2, (__m512i)both);
                }
#endif
        }
#if BF16_DOT
        if (pairs) {
            const uint32_t* value_block = (const uint32_t*)packed_values + (c0 / KB) * (KB / 2) * dim;
#if AMX_TILES
            if (tiles) { /* whole 32-key tiles: the weights past `cols` are 0, and the packed values there too */
                tile_values(weight_pairs, value_block, acc, padded, first_vector * FLANES / 2, last_vector * FLANES / 2,
                            dim);
                continue;
            }
#endif
            block_value_pairs(weight_pairs, value_block, acc, padded, first_vector * FLANES / 2, (cols + 1) / 2, dim);
            continue;
        }
#endif
        if (keys->values)
            block_values(scores, keys->values + c0 * keys->stride, keys->stride, acc, padded, first_vector * FLANES,
                         cols, spans, dim);
        else
            block_values(scores, packed_values + c0 * dim, dim, acc, padded, first_vector * FLANES, cols, spans, dim);
    }
#if AMX_TILES
    if (tiles) _tile_release();
#endif
    for (int r = 0; r < rows; ++r)
        finish_row(acc + r * dim, maxima[r] * scale, sums[r], where->out[r], where->lse[r], merge, where->out_type, dim);
}

/* One task function per head size D and kind of product P (WIDE, PAIRS, TILES), each compiled with both as
   constants; the entry points call them through `task_function` (one copy of each, not one per caller: the build
   takes half the time). */
typedef void (*TaskFunction)(const Rows*, int64_t, const Keys*, int64_t, const Rule*, float, int);
#define TASK_FUNCTION(D, P)                                                                                            \
    static void task_##D##_##P(const Rows* where, int64_t rows, const Keys* keys, int64_t start, const Rule* rule,   \
                               float scale, int merge)                                                                 \
    {                                                                                                                  \
        task(where, rows, keys, start, rule, scale, merge, D, P);                                                      \
    }
#define TASK_FUNCTIONS(P)                                                                                              \
    TASK_FUNCTION(16, P)                                                                                               \
    TASK_FUNCTION(32, P)                                                                                               \
    TASK_FUNCTION(48, P)                                                                                               \
    TASK_FUNCTION(64, P)                                                                                               \
    TASK_FUNCTION(80, P)                                                                                               \
    TASK_FUNCTION(96, P)                                                                                               \
    TASK_FUNCTION(112, P)                                                                                              \
    TASK_FUNCTION(128, P)
TASK_FUNCTIONS(WIDE)
#if BF16_DOT
TASK_FUNCTIONS(PAIRS)
#endif
#if AMX_TILES
TASK_FUNCTION(32, TILES)
TASK_FUNCTION(64, TILES)
TASK_FUNCTION(96, TILES)
TASK_FUNCTION(128, TILES)
#endif
#define TASK_TABLE(P) {task_16_##P, task_32_##P, task_48_##P, task_64_##P, task_80_##P, task_96_##P, task_112_##P, task_128_##P}

/* The task of a call of head size `dim` (a multiple of 16 up to 128) and element type `type`. */
static TaskFunction task_function(int64_t dim, int type)
{
    static const TaskFunction wide[8] = TASK_TABLE(WIDE);
#if AMX_TILES
    static const TaskFunction tiles[4] = {task_32_TILES, task_64_TILES, task_96_TILES, task_128_TILES};
    if (pairs_of(type) && dim % 32 == 0 && tiles_granted()) return tiles[dim / 32 - 1];
#endif
#if BF16_DOT
    static const TaskFunction pairs[8] = TASK_TABLE(PAIRS);
    if (pairs_of(type)) return pairs[dim / 16 - 1];
#else
    (void)type;
#endif
    return wide[dim / 16 - 1];
}

int focus_prefill_supports(int64_t heads, int64_t kv_heads, int64_t dim)
{
    return kv_heads > 0 && heads % kv_heads == 0 && dim % 16 == 0 && dim >= 16 && dim <= 128;
}

/* 32-bit words of packed keys (and values) a call of element type `type` over `keys` keys of one kv head takes: the
   size of the `scratch` that spares it an allocation (times kv heads and samples). `segments`: a
   `focus_prefill_segments` call (which packs float32 values too), else a `focus_prefill` one. */
int64_t focus_packed_words(int64_t keys, int64_t dim, int type, int segments)
{
    return packed_words((keys + KB - 1) / KB, dim, type, segments);
}

/* Floats per vector in this build (vectors.h): 16 with AVX-512, 8 with AVX, 4 elsewhere. */
int focus_vector_floats(void) { return FLANES; }

/* What a `focus_prefill` call's per-key arrays (key_bits, key_valid) are padded to: callers read it here, so that
   the padding and the key blocks that read it cannot disagree. */
int focus_key_array_step(void) { return KEY_ARRAY_STEP; }

/* What the library was compiled to use: 1 AVX-512 (16-float vectors in one register), 2 AVX2 and FMA, 4 bfloat16
   dot products (`vdpbf16ps`, BF16_DOT), 8 OpenMP threads, 16 AMX tiles for bfloat16 (compiled in and granted by the
   OS: `tiles_granted`). */
int focus_build_features(void)
{
    int features = 0;
#ifdef __AVX512F__
    features |= 1;
#endif
#if defined(__AVX2__) && defined(__FMA__)
    features |= 2;
#endif
#if BF16_DOT
    features |= 4;
#endif
#ifdef _OPENMP
    features |= 8;
#endif
#if AMX_TILES
    if (tiles_granted()) features |= 16;
#endif
    return features;
}

/* query [B, H, L, dim], key/value [B, KH, S, dim] of element type `type` (float32 or bfloat16) with contiguous rows;
   strides in elements {batch, head, row} (q_strides, k_strides, v_strides, o_strides, l_strides); out [B, H, L,
   dim] (float32 with `merge`, else of `type`), lse [B, H, L] float32. row_end and query_bits [B, L], key_bits and
   key_valid [B, S rounded up to a multiple of KEY_ARRAY_STEP] int32 (key_valid -1 for a real key, 0 for padding), each NULL or
   contiguous; `local` needs the bits. With `merge`, out and lse hold a partial result over other keys, which each
   row's is folded into (`finish_row`). `scratch` holds `scratch_words` 32-bit words (`focus_packed_words` per kv
   head and sample) or is NULL. Returns 0, or 1 for a call it does not take (nothing written). */
int focus_prefill(const void* q, const void* k, const void* v, void* out, float* lse, int64_t B, int64_t H,
                  int64_t KH, int64_t L, int64_t S, int64_t dim, const int64_t* q_strides, const int64_t* k_strides,
                  const int64_t* v_strides, const int64_t* o_strides, const int64_t* l_strides, const int32_t* row_end,
                  const int32_t* query_bits, const int32_t* key_bits, const int32_t* key_valid, int64_t window,
                  int64_t first, int causal, int local, int merge, float scale, float* scratch,
                  int64_t scratch_words, int type)
{
    if (!focus_prefill_supports(H, KH, dim) || L <= 0 || S <= 0 || (query_bits && !key_bits) || (local && !query_bits) ||
        (type != FLOAT32 && type != BFLOAT16))
        return 1;
    const int out_type = merge ? FLOAT32 : type;
    const int64_t sharing = H / KH, blocks = (S + KB - 1) / KB;
    const int64_t padded_keys = (S + KEY_ARRAY_STEP - 1) / KEY_ARRAY_STEP * KEY_ARRAY_STEP;
    const int64_t packed_size = packed_words(blocks, dim, type, 0);
    const TaskFunction run_task = task_function(dim, type);
    float* packed = take_scratch(scratch, scratch_words, packed_size * B * KH);
    if (!packed) return 1;
#pragma omp parallel for
    for (int64_t bh = 0; bh < B * KH; ++bh) {
        const int64_t b = bh / KH, kh = bh % KH;
        pack_keys(element_at(k, b * k_strides[0] + kh * k_strides[1], type),
                  element_at(v, b * v_strides[0] + kh * v_strides[1], type), NULL, NULL, k_strides[2], v_strides[2],
                  S, (int)dim, type, 0, packed + bh * packed_size);
    }
    const int64_t task_rows = local ? LOCAL_ROWS : QB;
    const int64_t chunks = (L + task_rows - 1) / task_rows, heads = B * H;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t t = 0; t < heads * chunks; ++t) {
        /* the heads of one chunk in a row (they share its rows of the rule); the longest chunks first (causal) */
        const int64_t bh = t % heads, chunk = chunks - 1 - t / heads;
        const int64_t b = bh / H, h = bh % H, kh = h / sharing;
        const int64_t start = chunk * task_rows, rows = L - start < task_rows ? L - start : task_rows;
        const Rule rule = {NULL, row_end ? row_end + b * L : NULL, 0, query_bits ? query_bits + b * L : NULL,
                           key_bits ? key_bits + b * padded_keys : NULL, key_valid ? key_valid + b * padded_keys : NULL,
                           window, first, causal, local};
        const float* values = type == FLOAT32 ? (const float*)v + b * v_strides[0] + kh * v_strides[1] : NULL;
        const Keys keys = {packed + (b * KH + kh) * packed_size, values, v_strides[2], S, type};
        Rows where = {.type = type, .out_type = out_type};
        for (int64_t r = 0; r < rows; ++r) {
            where.query[r] = element_at(q, b * q_strides[0] + h * q_strides[1] + (start + r) * q_strides[2], type);
            where.out[r] =
                (char*)out + (b * o_strides[0] + h * o_strides[1] + (start + r) * o_strides[2]) * element_size(out_type);
            where.lse[r] = lse + b * l_strides[0] + h * l_strides[1] + (start + r) * l_strides[2];
        }
        run_task(&where, rows, &keys, start, &rule, scale, merge);
    }
    if (packed != scratch) free(packed);
    return 0;
}

/* The CPU path's own-group pass in one call: query entries and keys sorted into segments (one per sample and group,
   `focus_segment_keys` and `focus_segment_entries` in segments.c). Segment s holds entries entry_starts[s] ..
   entry_starts[s + 1] - 1 and keys key_starts[s] .. key_starts[s + 1] - 1; entry e is query row entry_query[e]
   (sample * q_tokens + token) and sees the segment's keys row_begin[e] .. row_end[e] - 1 (counted from the
   segment's first key; row_end non-decreasing within a segment); key i is token key_token[i] (sample * kv_tokens +
   token). query [B, H, q_tokens, dim], key/value [B, KH, kv_tokens, dim] of element type `type`, out [B, H, q_tokens,
   dim] and lse [B, H, q_tokens] float32 (strides in elements {batch, head, row}); out and lse hold a partial result
   (lse -FLT_MAX: none yet) that each entry is folded into.
   A segment's keys are packed `slab_keys` at a time, and each slab's entries are folded into their rows before the next:
   the packed copy stays small whatever the length, and a row's merges never overlap - slabs and segments run one
   after another, and a query's entries lie in segments of their own. Returns 0, or 1 for a call it does not take
   (nothing written). */
int focus_prefill_segments(const void* q, const void* k, const void* v, float* out, float* lse, int64_t H,
                           int64_t KH, int64_t dim, const int64_t* q_strides, const int64_t* k_strides,
                           const int64_t* v_strides, const int64_t* o_strides, const int64_t* l_strides,
                           int64_t q_tokens, int64_t kv_tokens, int64_t segments, const int64_t* entry_starts,
                           const int64_t* key_starts, const int32_t* entry_query, const int32_t* key_token,
                           const int32_t* row_begin, const int32_t* row_end, int64_t slab_keys, float scale,
                           float* scratch, int64_t scratch_words, int type)
{
    if (!focus_prefill_supports(H, KH, dim) || q_tokens <= 0 || kv_tokens <= 0 || slab_keys <= 0 ||
        (type != FLOAT32 && type != BFLOAT16))
        return 1;
    int64_t most = 0;
    for (int64_t s = 0; s < segments; ++s)
        most = key_starts[s + 1] - key_starts[s] > most ? key_starts[s + 1] - key_starts[s] : most;
    if (most == 0) return 0;
    most = most < slab_keys ? most : slab_keys;
    const int64_t padded_keys = (most + KB - 1) / KB * KB, sharing = H / KH;
    const int64_t packed_size = packed_words(padded_keys / KB, dim, type, 1);
    const TaskFunction run_task = task_function(dim, type);
    float* packed = take_scratch(scratch, scratch_words, packed_size * KH);
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
                pack_keys(element_at(k, kh * k_strides[1], type), element_at(v, kh * v_strides[1], type), key_offsets,
                          value_offsets, 0, 0, slab, (int)dim, type, 1, packed + kh * packed_size);
            const int64_t task_rows = count < SHORT_SEGMENT ? LOCAL_ROWS : QB;
            const int64_t first_chunk = reaching / task_rows;
            const int64_t chunks = (entries + task_rows - 1) / task_rows - first_chunk;
            const Rule rule = {row_begin + first_entry, row_end + first_entry, base, NULL, NULL, NULL, 0, 0, 0, 0};
#pragma omp parallel for schedule(dynamic, 1)
            for (int64_t t = 0; t < H * chunks; ++t) {
                /* the heads of one chunk in a row; the last chunks (the entries that reach the most keys) first */
                const int64_t h = t % H, kh = h / sharing, chunk = first_chunk + chunks - 1 - t / H;
                const int64_t start = chunk * task_rows;
                const int64_t rows = entries - start < task_rows ? entries - start : task_rows;
                const Keys keys = {packed + kh * packed_size, NULL, 0, slab, type}; /* values packed too */
                Rows where = {.type = type, .out_type = FLOAT32};
                for (int64_t r = 0; r < rows; ++r) {
                    const int64_t row = entry_query[first_entry + start + r];
                    const int64_t b = row / q_tokens, position = row % q_tokens;
                    where.query[r] = element_at(q, b * q_strides[0] + h * q_strides[1] + position * q_strides[2], type);
                    where.out[r] = out + b * o_strides[0] + h * o_strides[1] + position * o_strides[2];
                    where.lse[r] = lse + b * l_strides[0] + h * l_strides[1] + position * l_strides[2];
                }
                run_task(&where, rows, &keys, start, &rule, scale, 1);
            }
        }
    }
    if (packed != scratch) free(packed);
    free(key_offsets);
    return 0;
}

/* The window band's sink pairs of query rows 0 .. L - 1 (row r is position first + r of its sample), folded into out
   and lse by log-sum-exp (`finish_row`): sink t of sample b - position sink_position[b * S + t] (-1: none), group
   sink_group[b * S + t] - is visible to row r iff it lies more than `window` before it, its group is none of the row's
   probes [B, L, top_k] (int64, contiguous) and done[b * L + r] (when given) is 0. A handful of keys per row: scores,
   softmax and the weighted values in one pass, with nothing allocated. Strides as in `focus_prefill`; q, k and v of
   element type `type`, out and lse float32. */
int focus_sink_pairs(const void* q, const void* k, const void* v, float* out, float* lse, int64_t B, int64_t H,
                     int64_t KH, int64_t L, int64_t dim, const int64_t* q_strides, const int64_t* k_strides,
                     const int64_t* v_strides, const int64_t* o_strides, const int64_t* l_strides,
                     const int64_t* sink_position, const int64_t* sink_group, int64_t S, const int64_t* probes,
                     int64_t top_k, const uint8_t* done, int64_t window, int64_t first, float scale, int type)
{
    if (!focus_prefill_supports(H, KH, dim) || S > 64 || (type != FLOAT32 && type != BFLOAT16)) return 1;
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
            const void* query = element_at(q, b * q_strides[0] + h * q_strides[1] + r * q_strides[2], type);
            float scores[64], maximum = -FLT_MAX, sum = 0.f, acc[128] = {0};
            for (int64_t t = 0; t < count; ++t) {
                const void* key = element_at(k, b * k_strides[0] + kh * k_strides[1] + visible[t] * k_strides[2], type);
                float dot = 0.f;
                for (int64_t d = 0; d < dim; ++d) dot += element(query, d, type) * element(key, d, type);
                scores[t] = dot * scale;
                maximum = scores[t] > maximum ? scores[t] : maximum;
            }
            for (int64_t t = 0; t < count; ++t) {
                const float weight = expf(scores[t] - maximum);
                const void* value = element_at(v, b * v_strides[0] + kh * v_strides[1] + visible[t] * v_strides[2], type);
                sum += weight;
                for (int64_t d = 0; d < dim; ++d) acc[d] += weight * element(value, d, type);
            }
            finish_row(acc, maximum, sum, out + b * o_strides[0] + h * o_strides[1] + r * o_strides[2],
                       lse + b * l_strides[0] + h * l_strides[1] + r * l_strides[2], 1, FLOAT32, (int)dim);
        }
    }
    return 0;
}
