/* The vector width and register tiles of the kernels, chosen by the instruction set they are compiled for.

   One source for every target: the kernels are written on GCC/Clang generic vectors of FLANES floats, and the
   constants here size those vectors and the kernels' register tiles to what the target has:

   | target (predefined macro) | vector    | registers | score tile (rows x vectors) | value tile  | task rows x keys |
   |---------------------------|-----------|-----------|-----------------------------|-------------|------------------|
   | AVX-512 (__AVX512F__)     | 16 floats | 32        | 8 x 2                       | 4 x 4, held | 32 x 128         |
   | AVX / AVX2 (__AVX__)      | 8 floats  | 16        | 4 x 3, keys held            | 2 x 4, held | 128 x 96         |
   | aarch64 NEON (__ARM_NEON) | 4 floats  | 32        | 4 x 4, keys held            | 4 x 4, held | 128 x 64         |
   | anything else (SSE, ...)  | 4 floats  | 16        | 2 x 4, keys held            | 2 x 4, held | 64 x 64          |

   A tile's accumulators, the vectors it loads and a broadcast must fit the target's registers at once: a vector
   wider than the target's registers is split by the compiler into several, and a tile of them spills to the stack on
   every step (a 16-float tile of 8 x 2 on AVX2's 16 registers ran at a tenth of dense attention's rate). "Keys
   held": the tile's key vectors are kept in registers across its rows (IN_REGISTER), where compilers would fold them
   into each row's instructions as memory operands and load them once per row; a value tile's value vectors are held
   so on every target (`block_values` in prefill.c; with AVX-512 too, where holding the score tile's keys gained
   nothing measurable). The AVX-512 row is as tuned and measured on an AVX-512 EPYC; the AVX2 one on a Zen 3 EPYC
   (2 x 4 against 4 x 2: 3.8 against 4.1 ns per pair; 128 rows per task against 32: fewer passes over keys that stream
   from beyond the core's cache), then with an x86-64-v3 build on the AVX-512 EPYC: a 4 x 3 score tile (12
   accumulators, 3 key vectors and a broadcast: all 16 registers) loads 7 vectors per 12 products where 2 x 4 loads 6
   per 8, and ran the own-group pass at 16K tokens 2-5% faster per pair (its 24-key width sets the key block to 96). The
   SSE row as measured with an x86-64-v2 build on the AVX-512 EPYC: 64 rows per task ran the own-group pass at 8.6
   against 9.2 ns per pair with 128 at 8K tokens, 8.2 against 9.4 at 16K (with the splatted queries below).

   The helpers that reduce or compare whole vectors use the target's instructions where it has them, else halving
   shuffles: nothing in a hot loop walks a vector lane by lane. */
#ifndef FOCUS_VECTORS_H
#define FOCUS_VECTORS_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define VECTOR_BYTES 64
#define QUERY_ROWS 32 /* query rows per task of the prefill kernel */
#define KEY_BLOCK 128 /* keys per block of its online softmax */
#define QK_ROWS 8
#define QK_VECTORS 2
#define PV_ROWS 4
#define KEEP_KEYS 0 /* as tuned on AVX-512, where each row's products read the keys as memory operands */
#elif defined(__AVX__)
#include <immintrin.h>
#define VECTOR_BYTES 32
#define QUERY_ROWS 128
#define KEY_BLOCK 96
#define QK_ROWS 4
#define QK_VECTORS 3
#define PV_ROWS 2
#define KEEP_KEYS 1
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#define VECTOR_BYTES 16
#define QUERY_ROWS 128
#define KEY_BLOCK 64
#define QK_ROWS 4
#define QK_VECTORS 4
#define PV_ROWS 4
#define KEEP_KEYS 1
#else
#if defined(__SSE__)
#include <immintrin.h>
#endif
#define VECTOR_BYTES 16
#define QUERY_ROWS 64
#define KEY_BLOCK 64
#define QK_ROWS 2
#define QK_VECTORS 4
#define PV_ROWS 2
#define KEEP_KEYS 1
#endif
#define FLANES (VECTOR_BYTES / 4) /* floats per vector */
/* Where a splat of a float is a load and a shuffle (SSE: no broadcast from memory), the shuffle takes a port of
   the products it feeds: there the prefill kernel lays out its query rows splatted once per task, each dim in every
   lane, and its products load them as they are. (The softmax weights, splatted once per block likewise, made the
   value products slower: four times the weights no longer stay in the first-level cache beside the value rows.) */
#if !defined(__AVX__) && defined(__SSE__)
#define SPLAT_LANES FLANES
#else
#define SPLAT_LANES 1
#endif
#define PV_VECTORS 4              /* value vectors (dims) per row of the value micro-tile */

typedef float fvec __attribute__((vector_size(VECTOR_BYTES)));
typedef int32_t ivec __attribute__((vector_size(VECTOR_BYTES)));

/* Keeps a vector in a register: compilers otherwise fold a loaded vector into every instruction that uses it, as a
   memory operand, and a tile that reuses it across rows then loads it once per row. */
#if defined(__x86_64__) || defined(__i386__)
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#elif defined(__aarch64__)
#define IN_REGISTER(v) __asm__("" : "+w"(v))
#else
#define IN_REGISTER(v) (void)(v)
#endif

static inline fvec fload(const float* p) { fvec v; memcpy(&v, p, sizeof v); return v; }
static inline void fstore(float* p, fvec v) { memcpy(p, &v, sizeof v); }
static inline ivec iload(const int32_t* p) { ivec v; memcpy(&v, p, sizeof v); return v; }
static inline fvec fsplat(float x) { return (fvec){0} + x; }
/* The float at p in every lane; with SPLAT_LANES > 1, p is an aligned run of SPLAT_LANES copies of it, loaded as
   they are (the load may be an operand of the instruction that uses it). */
static inline fvec splat_at(const float* p)
{
#if SPLAT_LANES > 1
    return *(const fvec*)__builtin_assume_aligned(p, VECTOR_BYTES);
#else
    return fsplat(*p);
#endif
}
static inline ivec isplat(int32_t x) { return (ivec){0} + x; }
static inline fvec as_fvec(ivec v) { fvec f; memcpy(&f, &v, sizeof f); return f; }
static inline ivec as_ivec(fvec v) { ivec i; memcpy(&i, &v, sizeof i); return i; }
/* lanes 0, 1, ..., FLANES - 1 */
static inline ivec lane_index(void)
{
    ivec lanes;
    for (int i = 0; i < FLANES; ++i) lanes[i] = i; /* a constant after folding */
    return lanes;
}

/* The larger of a and b in each lane. */
static inline fvec fmax_lanes(fvec a, fvec b)
{
#if defined(__AVX512F__)
    return (fvec)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(__AVX__)
    return (fvec)_mm256_max_ps((__m256)a, (__m256)b);
#elif defined(__ARM_NEON)
    return (fvec)vmaxq_f32((float32x4_t)a, (float32x4_t)b);
#elif defined(__SSE__)
    return (fvec)_mm_max_ps((__m128)a, (__m128)b); /* a compare and a blend otherwise */
#else
    const ivec greater = a > b;
    return as_fvec((as_ivec(a) & greater) | (as_ivec(b) & ~greater));
#endif
}

/* The vector's lanes, halved by shuffles down to one (the upper half onto the lower each time). */
#ifdef __clang__
#define SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SHUFFLE(v, ...) __builtin_shuffle(v, (ivec){__VA_ARGS__})
#endif
#if FLANES == 16
#define HALVES(v, op)                                                                    \
    v = op(v, SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15)); \
    v = op(v, SHUFFLE(v, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7));             \
    v = op(v, SHUFFLE(v, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3));             \
    v = op(v, SHUFFLE(v, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1))
#elif FLANES == 8
#define HALVES(v, op)                                    \
    v = op(v, SHUFFLE(v, 4, 5, 6, 7, 4, 5, 6, 7)); \
    v = op(v, SHUFFLE(v, 2, 3, 2, 3, 2, 3, 2, 3)); \
    v = op(v, SHUFFLE(v, 1, 1, 1, 1, 1, 1, 1, 1))
#else
#define HALVES(v, op)                    \
    v = op(v, SHUFFLE(v, 2, 3, 2, 3)); \
    v = op(v, SHUFFLE(v, 1, 1, 1, 1))
#endif
static inline fvec add_lanes(fvec a, fvec b) { return a + b; }

/* The largest lane. */
static inline float lane_max(fvec v)
{
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps((__m512)v);
#else
    HALVES(v, fmax_lanes);
    return v[0];
#endif
}

/* The sum of the lanes. */
static inline float lane_total(fvec v)
{
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#else
    HALVES(v, add_lanes);
    return v[0];
#endif
}

#endif
