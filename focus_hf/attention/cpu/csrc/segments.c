/* The group sort of the own-group pass for `focus_prefill_segments` (prefill.c): keys and query entries into segments
   (one per sample and group, s = sample * K + group), each in position order - counting sorts, O(n), writing only their
   int32 results (a sort in tensor operations holds several n-long int64 temporaries: at 128K tokens they outweigh what
   the rest of the call adds to the output).

   Tokens are numbered sample * kv + position. `groups` [batch, kv] int64 is read through its strides
   (group_strides {sample, token}: routers hand out views of wider tensors, and a contiguous copy would be one more
   n-long array); `valid` [batch, kv] (0 / 1: padding keys and queries have no place in any segment) and `sinks`
   [batch, kv] are contiguous. Both return 0, or 1 (nothing written) for a group outside 0 .. K - 1: a valid key's
   in `focus_segment_keys`, a probe in `focus_segment_entries`. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline int64_t group_of(const int64_t* groups, const int64_t* strides, int64_t b, int64_t position)
{
    return groups[b * strides[0] + position * strides[1]];
}

/* Keys: segment s gets its sample's sinks of other groups in front (its riders; with `sinks`, else none), then its
   valid keys. Writes key_starts [segments + 1], riders [segments], last_sink [batch] (the sample's last sink, -1 for
   none) and, when given, key_token [key_starts[segments]] (a first call without it sizes the second's). */
int focus_segment_keys(const int64_t* groups, const int64_t* group_strides, const uint8_t* valid, const uint8_t* sinks,
                       int64_t batch, int64_t kv, int64_t K, int32_t* key_token, int64_t* key_starts, int64_t* riders,
                       int64_t* last_sink)
{
    const int64_t segments = batch * K;
    int64_t* fill = calloc(segments + 1, sizeof(int64_t));
    if (!fill) return 1;
    int64_t* counts = fill + 1;
    for (int64_t b = 0; b < batch; ++b) {
        int64_t sample_sinks = 0;
        last_sink[b] = -1;
        for (int64_t s = b * K; s < (b + 1) * K; ++s) riders[s] = 0;
        for (int64_t position = 0; position < kv; ++position) {
            const int64_t group = group_of(groups, group_strides, b, position), j = b * kv + position;
            const int in_range = group >= 0 && group < K;
            if (valid[j]) {
                if (!in_range) {
                    free(fill);
                    return 1;
                }
                ++counts[b * K + group];
            }
            if (sinks && sinks[j]) {
                ++sample_sinks;
                last_sink[b] = position;
                if (in_range) --riders[b * K + group]; /* its own group's segment does not carry it */
            }
        }
        for (int64_t s = b * K; s < (b + 1) * K; ++s) riders[s] += sample_sinks;
    }
    key_starts[0] = 0;
    for (int64_t s = 0; s < segments; ++s) key_starts[s + 1] = key_starts[s] + riders[s] + counts[s];
    for (int64_t s = 0; s < segments; ++s) fill[s] = key_starts[s];
    for (int64_t b = 0; b < batch && key_token; ++b) {
        for (int64_t position = 0; sinks && position <= last_sink[b]; ++position)
            if (sinks[b * kv + position])
                for (int64_t group = 0; group < K; ++group)
                    if (group != group_of(groups, group_strides, b, position))
                        key_token[fill[b * K + group]++] = (int32_t)(b * kv + position);
        for (int64_t position = 0; position < kv; ++position)
            if (valid[b * kv + position])
                key_token[fill[b * K + group_of(groups, group_strides, b, position)]++] = (int32_t)(b * kv + position);
    }
    free(fill);
    return 0;
}

/* Query entries of query rows first .. first + rows - 1 (row r is position offset + r: the queries are the last
   q = kv - offset tokens), one per probed group - `probes` [batch, q, top_k] int64 (probe_strides {sample, token,
   slot}); a slot after the first that repeats it is not probed - of each valid query. Writes entry_starts
   [segments + 1] and per entry, in segment then position order: entry_query (sample * rows + r - first, the row
   within the block), row_begin and row_end (the keys of its segment it sees: its reach - the segment's valid keys
   at or before it - after the riders). An entry reads its segment's riders (row_begin 0, and rides[sample * rows +
   r - first] = 1) iff `last_sink` is given and it lies after its sample's last sink; `rides` [batch * rows] is
   written for every row, when given.
   `running` [segments] holds each segment's count of valid keys at positions before `counted`, and is brought up to
   the block's last query (blocks run in order; `counted` 0 and `running` zeros for the first). The keys' groups were
   checked by `focus_segment_keys`; only the probes are checked here. */
int focus_segment_entries(const int64_t* probes, const int64_t* probe_strides, const int64_t* groups,
                          const int64_t* group_strides, const uint8_t* valid, int64_t batch, int64_t kv, int64_t q,
                          int64_t K, int64_t top_k, int64_t first, int64_t rows, int64_t* running, int64_t counted,
                          const int64_t* riders, const int64_t* last_sink, int64_t* entry_starts, int32_t* entry_query,
                          int32_t* row_begin, int32_t* row_end, uint8_t* rides)
{
    const int64_t segments = batch * K, offset = kv - q;
    int64_t* fill = calloc(segments + 1, sizeof(int64_t));
    if (!fill) return 1;
    int64_t* counts = fill + 1;
#define PROBE(b, r, t) probes[(b) * probe_strides[0] + (r) * probe_strides[1] + (t) * probe_strides[2]]
    for (int64_t b = 0; b < batch; ++b) {
        for (int64_t r = first; r < first + rows; ++r) {
            if (!valid[b * kv + offset + r]) continue;
            for (int64_t t = 0; t < top_k; ++t) {
                const int64_t group = PROBE(b, r, t);
                if (group < 0 || group >= K) goto out_of_range;
                if (t == 0 || group != PROBE(b, r, 0)) ++counts[b * K + group];
            }
        }
    }
    entry_starts[0] = 0;
    for (int64_t s = 0; s < segments; ++s) entry_starts[s + 1] = entry_starts[s] + counts[s];
    for (int64_t s = 0; s < segments; ++s) fill[s] = entry_starts[s];
    for (int64_t b = 0; b < batch; ++b) {
        for (int64_t position = counted; position < offset + first; ++position)
            if (valid[b * kv + position]) ++running[b * K + group_of(groups, group_strides, b, position)];
        for (int64_t r = first; r < first + rows; ++r) {
            const int64_t position = offset + r, row = b * rows + r - first;
            const int valid_query = valid[b * kv + position], ride = last_sink && position > last_sink[b];
            if (rides) rides[row] = (uint8_t)(ride && valid_query);
            if (!valid_query) continue;
            ++running[b * K + group_of(groups, group_strides, b, position)];
            for (int64_t t = 0; t < top_k; ++t) {
                const int64_t group = PROBE(b, r, t);
                if (t > 0 && group == PROBE(b, r, 0)) continue;
                const int64_t s = b * K + group, e = fill[s]++, extra = riders ? riders[s] : 0;
                entry_query[e] = (int32_t)row;
                row_begin[e] = (int32_t)(ride ? 0 : extra);
                row_end[e] = (int32_t)(running[s] + extra);
            }
        }
    }
#undef PROBE
    free(fill);
    return 0;
out_of_range:
    free(fill);
    return 1;
}
