/* One decoding token's routing, the kernel of `focus_hf.attention.cpu.native_decode.route_token`.

   The operations `routing.causal_sinkhorn` runs on one token in probability space (`_one_token_sinkhorn`, float64)
   and `routing.token_groups` then runs on its result (float32), in one call: a decoding step routes one token in
   every routed layer, where torch's per-operation overhead (about fifty operations of eight numbers) was most of
   the routing's cost. The same values within rounding: exp and log of libm against torch's vectorised ones differ in
   the last bit of a float64 at most, far below the float32 the results are stored in. */
#include <float.h>
#include <math.h>
#include <stdint.h>

#define MAX_ROUTE_GROUPS 1024
#define LOG_ZERO -1.0e4f /* routing.LOG_ZERO: the floor of a stored log column sum */

/* Key scores [groups] (cosine / tau), the running log column sums before the token [iterations][groups] (`columns`),
   optionally a query router's scores [groups] (NULL: none). Writes the sums after the token to `new_columns` (it
   may be `columns`), the groups the token probes as a query to probes[top_k] (best first; with probe_mass >= 0, a
   slot after the first that the mass before it already covers repeats the first: `routing.probed_groups`) and its
   own group as a key to key_group. Returns 0, or 1 for arguments it does not take (nothing written then). */
int focus_route_token(const float* key_scores, const float* query_scores, int64_t groups, int64_t iterations,
                      const float* columns, float* new_columns, int64_t top_k, double probe_mass, int64_t* probes,
                      int64_t* key_group)
{
    if (groups < 1 || groups > MAX_ROUTE_GROUPS || top_k < 1 || top_k > groups || iterations < 0) return 1;
    double q[MAX_ROUTE_GROUPS];
    float log_probs[MAX_ROUTE_GROUPS], query_log_probs[MAX_ROUTE_GROUPS];
    for (int64_t k = 0; k < groups; ++k) {
        q[k] = exp((double)key_scores[k]);
        q[k] = q[k] < DBL_MIN ? DBL_MIN : q[k];
    }
    for (int64_t step = 0; step < iterations; ++step) {
        double sum = 0.0;
        for (int64_t k = 0; k < groups; ++k) {
            const int64_t at = step * groups + k;
            const double prefix = exp((double)columns[at]) + q[k];
            const float stored = (float)log(prefix);
            new_columns[at] = stored > LOG_ZERO ? stored : LOG_ZERO;
            q[k] = q[k] / prefix;
        }
        for (int64_t k = 0; k < groups; ++k) sum += q[k];
        for (int64_t k = 0; k < groups; ++k) {
            q[k] = q[k] / sum;
            q[k] = q[k] < DBL_MIN ? DBL_MIN : q[k];
        }
    }
    for (int64_t k = 0; k < groups; ++k) log_probs[k] = (float)log(q[k]);
    int64_t best = 0; /* the key side's group: the first largest */
    for (int64_t k = 1; k < groups; ++k) best = log_probs[k] > log_probs[best] ? k : best;
    const float* ranked = log_probs;
    if (query_scores) { /* log_softmax in float32, as torch: x - max - log(sum(exp(x - max))) */
        float top = query_scores[0], total = 0.f;
        for (int64_t k = 1; k < groups; ++k) top = query_scores[k] > top ? query_scores[k] : top;
        for (int64_t k = 0; k < groups; ++k) total += expf(query_scores[k] - top);
        const float log_total = logf(total);
        for (int64_t k = 0; k < groups; ++k) query_log_probs[k] = query_scores[k] - top - log_total;
        ranked = query_log_probs;
    }
    /* the top_k groups, best first, the lower index first among equals (a stable descending sort) */
    unsigned char taken[MAX_ROUTE_GROUPS] = {0};
    float cumulative = 0.f; /* float32 cumsum of the picks' probabilities, as probed_groups sums them */
    for (int64_t slot = 0; slot < top_k; ++slot) {
        int64_t pick = -1;
        for (int64_t k = 0; k < groups; ++k)
            if (!taken[k] && (pick < 0 || ranked[k] > ranked[pick])) pick = k;
        taken[pick] = 1;
        const float probability = expf(ranked[pick]);
        cumulative += probability;
        const int probed = slot == 0 || probe_mass < 0.0 || cumulative - probability < (float)probe_mass;
        probes[slot] = probed ? pick : probes[0];
    }
    *key_group = query_scores ? best : probes[0];
    return 0;
}
