/* The CPU kernels checked by themselves, without Python: `focus_prefill` (prefill.c) and `focus_decode` (decode.c)
   against a float64 softmax computed here, on the same inputs on every target (a fixed generator). Built and run by
   tests/attention/cpu/test_cross_builds.py for the host and for aarch64 (under qemu-aarch64), so that a target's vector
   width and register tiles (vectors.h) are checked where no such processor is at hand.

   Prints each case's largest error (|kernel - reference| / max(1, |reference|), outputs and log-sum-exps) and the
   build's vector width; exits 1 where a kernel refuses a call, leaves an output unwritten (outputs start as NaN) or
   is off by more than TOLERANCE, else 0. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOLERANCE 1e-4

int focus_prefill(const void* q, const void* k, const void* v, void* out, float* lse, int64_t B, int64_t H,
                  int64_t KH, int64_t L, int64_t S, int64_t dim, const int64_t* q_strides, const int64_t* k_strides,
                  const int64_t* v_strides, const int64_t* o_strides, const int64_t* l_strides, const int32_t* row_end,
                  const int32_t* query_bits, const int32_t* key_bits, const int32_t* key_valid, int64_t window,
                  int64_t first, int causal, int local, int merge, float scale, float* scratch,
                  int64_t scratch_words, int type);
int focus_decode(const void* query, int64_t heads, int64_t kv_heads, int64_t dim, float scale, int64_t runs,
                 const void* const* keys, const void* const* values, const int64_t* lengths,
                 const int64_t* head_strides, void* out, int type);
int focus_vector_floats(void);
int focus_key_array_step(void); /* per-key arrays' padding (prefill.c) */

static uint64_t state = 0x9e3779b97f4a7c15u;
static uint64_t next_bits(void) /* xorshift64*: the same inputs on every target */
{
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    return state * 0x2545f4914f6cdd1du;
}
static float uniform(float low, float high) { return low + (high - low) * (float)((next_bits() >> 40) / 16777216.0); }
static void fill(float* x, int64_t n, float low, float high)
{
    for (int64_t i = 0; i < n; ++i) x[i] = uniform(low, high);
}
static float* floats(int64_t n)
{
    float* x = malloc(sizeof(float) * (n > 0 ? n : 1));
    if (!x) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return x;
}

static double worst = 0.0;
static int failed = 0;

/* |got - want| / max(1, |want|); NaN (an output left unwritten) counts as infinite. */
static double error_of(double got, double want)
{
    const double e = fabs(got - want) / (fabs(want) > 1.0 ? fabs(want) : 1.0);
    return e == e ? e : INFINITY;
}

static void report(const char* name, double output_error, double lse_error, int visible_rows, int rows)
{
    const double e = output_error > lse_error ? output_error : lse_error;
    const int bad = !(e <= TOLERANCE);
    printf("%-44s output %.3e  lse %.3e  rows with keys %d/%d%s\n", name, output_error, lse_error, visible_rows, rows,
           bad ? "  FAIL" : "");
    worst = e > worst ? e : worst;
    failed |= bad;
}

typedef struct {
    const char* name;
    int64_t B, H, KH, L, S, dim, first, window;
    int causal, local, pattern, padding;
} PrefillCase;

/* One focus_prefill call (float32, writing, no row_end) against the rule of its comment in prefill.c. */
static void check_prefill(const PrefillCase* c)
{
    const int64_t B = c->B, H = c->H, KH = c->KH, L = c->L, S = c->S, dim = c->dim;
    const int64_t step = focus_key_array_step(), padded = (S + step - 1) / step * step;
    float *q = floats(B * H * L * dim), *k = floats(B * KH * S * dim), *v = floats(B * KH * S * dim);
    float *out = floats(B * H * L * dim), *lse = floats(B * H * L);
    int32_t* query_bits = calloc(B * L, sizeof(int32_t));
    int32_t* key_bits = calloc(B * padded, sizeof(int32_t));
    int32_t* key_valid = calloc(B * padded, sizeof(int32_t));
    fill(q, B * H * L * dim, -2.f, 2.f); /* scores of a few units: softmaxes neither flat nor one-hot */
    fill(k, B * KH * S * dim, -1.f, 1.f);
    fill(v, B * KH * S * dim, -1.f, 1.f);
    for (int64_t i = 0; i < B * H * L * dim; ++i) out[i] = NAN;
    for (int64_t i = 0; i < B * H * L; ++i) lse[i] = NAN;
    for (int64_t b = 0; b < B; ++b) {
        for (int64_t r = 0; r < L; ++r) /* two of eight groups probed */
            query_bits[b * L + r] = (int32_t)(1u << (next_bits() % 8) | 1u << (next_bits() % 8));
        for (int64_t j = 0; j < S; ++j) {
            key_bits[b * padded + j] = j < 3 ? -1 : (int32_t)(1u << (next_bits() % 8)); /* 3 sinks: every bit */
            /* the last sample's keys 0 and 1 and every seventh are padding (its first rows of a causal call from 0
               see no key) */
            key_valid[b * padded + j] = c->padding && b == B - 1 && (j < 2 || j % 7 == 5) ? 0 : -1;
        }
    }
    const int64_t q_strides[3] = {H * L * dim, L * dim, dim}, k_strides[3] = {KH * S * dim, S * dim, dim};
    const int64_t l_strides[3] = {H * L, L, 1};
    const float scale = 1.f / sqrtf((float)dim);
    const int refused = focus_prefill(q, k, v, out, lse, B, H, KH, L, S, dim, q_strides, k_strides, k_strides,
                                      q_strides, l_strides, NULL, c->pattern ? query_bits : NULL,
                                      c->pattern ? key_bits : NULL, c->padding ? key_valid : NULL, c->window,
                                      c->first, c->causal, c->local, 0, scale, NULL, 0, 0);
    if (refused) {
        printf("%-44s refused by focus_prefill  FAIL\n", c->name);
        failed = 1;
    } else {
        double output_error = 0.0, lse_error = 0.0, *scores = malloc(sizeof(double) * S), want[128];
        int visible_rows = 0;
        for (int64_t b = 0; b < B; ++b)
            for (int64_t h = 0; h < H; ++h)
                for (int64_t r = 0; r < L; ++r) {
                    const float* query = q + ((b * H + h) * L + r) * dim;
                    const int64_t kh = h / (H / KH), position = c->first + r;
                    double top = -INFINITY;
                    for (int64_t j = 0; j < S; ++j) {
                        int visible = (!c->causal || j <= position) && key_valid[b * padded + j] != 0;
                        const int shared = (query_bits[b * L + r] & key_bits[b * padded + j]) != 0;
                        if (c->local)
                            visible = visible && position - j <= c->window && !shared;
                        else if (c->pattern)
                            visible = visible && (position - j <= c->window || shared);
                        scores[j] = -INFINITY;
                        if (!visible) continue;
                        const float* key = k + ((b * KH + kh) * S + j) * dim;
                        double dot = 0.0;
                        for (int64_t d = 0; d < dim; ++d) dot += (double)query[d] * key[d];
                        scores[j] = dot * scale;
                        top = scores[j] > top ? scores[j] : top;
                    }
                    const float* row = out + ((b * H + h) * L + r) * dim;
                    const double got_lse = lse[(b * H + h) * L + r];
                    if (top == -INFINITY) { /* no key: 0 and -FLT_MAX */
                        for (int64_t d = 0; d < dim; ++d) {
                            const double e = error_of(row[d], 0.0);
                            output_error = e > output_error ? e : output_error;
                        }
                        const double e = got_lse == -FLT_MAX ? 0.0 : INFINITY;
                        lse_error = e > lse_error ? e : lse_error;
                        continue;
                    }
                    ++visible_rows;
                    double sum = 0.0;
                    for (int64_t j = 0; j < S; ++j) { /* scores become weights */
                        scores[j] = scores[j] == -INFINITY ? 0.0 : exp(scores[j] - top);
                        sum += scores[j];
                    }
                    for (int64_t d = 0; d < dim; ++d) want[d] = 0.0;
                    for (int64_t j = 0; j < S; ++j)
                        for (int64_t d = 0; scores[j] > 0.0 && d < dim; ++d)
                            want[d] += scores[j] / sum * v[((b * KH + kh) * S + j) * dim + d];
                    for (int64_t d = 0; d < dim; ++d) {
                        const double e = error_of(row[d], want[d]);
                        output_error = e > output_error ? e : output_error;
                    }
                    const double e = error_of(got_lse, top + log(sum));
                    lse_error = e > lse_error ? e : lse_error;
                }
        free(scores);
        report(c->name, output_error, lse_error, visible_rows, (int)(B * H * L));
    }
    free(q), free(k), free(v), free(out), free(lse), free(query_bits), free(key_bits), free(key_valid);
}

/* One focus_decode call: query [heads, dim] over `runs` runs of keys, each a slice of a longer cache of its own
   (head stride past its length), against a softmax over the runs joined. */
static void check_decode(const char* name, int64_t heads, int64_t kv_heads, int64_t dim, int64_t runs,
                         const int64_t* lengths)
{
    float *query = floats(heads * dim), *out = floats(heads * dim);
    float *keys[8], *values[8];
    int64_t head_strides[8], total = 0;
    fill(query, heads * dim, -3.f, 3.f);
    for (int64_t i = 0; i < heads * dim; ++i) out[i] = NAN;
    for (int64_t r = 0; r < runs; ++r) {
        head_strides[r] = (lengths[r] + 5) * dim;
        keys[r] = floats(kv_heads * head_strides[r]);
        values[r] = floats(kv_heads * head_strides[r]);
        fill(keys[r], kv_heads * head_strides[r], -1.f, 1.f);
        fill(values[r], kv_heads * head_strides[r], -1.f, 1.f);
        total += lengths[r];
    }
    const float scale = 1.f / sqrtf((float)dim);
    if (focus_decode(query, heads, kv_heads, dim, scale, runs, (const void* const*)keys, (const void* const*)values,
                     lengths, head_strides, out, 0)) {
        printf("%-44s refused by focus_decode  FAIL\n", name);
        failed = 1;
    } else {
        double output_error = 0.0, *scores = malloc(sizeof(double) * total);
        for (int64_t h = 0; h < heads; ++h) {
            const int64_t kh = h / (heads / kv_heads);
            double top = -INFINITY, sum = 0.0;
            for (int64_t r = 0, j = 0; r < runs; ++r)
                for (int64_t t = 0; t < lengths[r]; ++t, ++j) {
                    const float* key = keys[r] + kh * head_strides[r] + t * dim;
                    double dot = 0.0;
                    for (int64_t d = 0; d < dim; ++d) dot += (double)query[h * dim + d] * key[d];
                    scores[j] = dot * scale;
                    top = scores[j] > top ? scores[j] : top;
                }
            for (int64_t j = 0; j < total; ++j) { /* scores become weights */
                scores[j] = exp(scores[j] - top);
                sum += scores[j];
            }
            double want[128] = {0};
            for (int64_t r = 0, j = 0; r < runs; ++r)
                for (int64_t t = 0; t < lengths[r]; ++t, ++j)
                    for (int64_t d = 0; d < dim; ++d)
                        want[d] += scores[j] / sum * values[r][kh * head_strides[r] + t * dim + d];
            for (int64_t d = 0; d < dim; ++d) {
                const double e = error_of(out[h * dim + d], want[d]);
                output_error = e > output_error ? e : output_error;
            }
        }
        free(scores);
        report(name, output_error, 0.0, (int)heads, (int)heads);
    }
    for (int64_t r = 0; r < runs; ++r) free(keys[r]), free(values[r]);
    free(query), free(out);
}

int main(void)
{
    printf("vector floats %d\n", focus_vector_floats());
    /* name, B, H, KH, L, S, dim, first, window, causal, local, pattern, padding */
    const PrefillCase prefill[] = {
        {"prefill causal dim 64, padding", 1, 2, 2, 150, 150, 64, 0, 0, 1, 0, 0, 1},
        {"prefill non-causal dim 128 GQA 3", 1, 6, 2, 70, 200, 128, 0, 0, 0, 0, 0, 0},
        {"prefill causal later chunk dim 128 GQA 3", 2, 3, 1, 90, 300, 128, 210, 0, 1, 0, 0, 1},
        {"prefill pattern causal dim 64 GQA 3", 2, 6, 2, 140, 260, 64, 120, 40, 1, 0, 1, 1},
        {"prefill pattern non-causal dim 128", 1, 2, 1, 60, 190, 128, 0, 30, 0, 0, 1, 0},
        {"prefill local window dim 64 GQA 3", 1, 3, 1, 160, 230, 64, 70, 50, 1, 1, 1, 1},
    };
    for (size_t i = 0; i < sizeof prefill / sizeof prefill[0]; ++i) check_prefill(&prefill[i]);
    const int64_t short_runs[] = {63, 1, 130}, long_runs[] = {1500, 700, 37};
    check_decode("decode dim 64 GQA 3, three runs", 6, 2, 64, 3, short_runs);
    check_decode("decode dim 128 GQA 3, in pieces", 6, 2, 128, 3, long_runs); /* past PARALLEL_ROWS */
    check_decode("decode dim 80, one run", 4, 4, 80, 1, short_runs + 2);
    printf("max error %.3e (tolerance %.0e): %s\n", worst, TOLERANCE, failed ? "FAIL" : "ok");
    return failed;
}
