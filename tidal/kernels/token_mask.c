/* Grammar bitmasks applied to logits in place: one pass over a row's mask words.
 *
 *   for each masked row i (logits row rows[i], mask row i of `words` int32 words):
 *     token t is allowed when bit (t % 32) of word (t / 32) is set; every other logit of the row,
 *     and every logit past words * 32, becomes -inf. A row whose mask allows no token of the
 *     vocabulary is left as it is (the sampler never draws from all -inf), and counted.
 *
 * Only elementwise work on the row itself, so a row's result never depends on its batch.
 * Single-threaded: a mask word that allows everything (-1) is skipped and one that allows
 * nothing (0, most words under a grammar) is a plain fill, so a row costs about one read of its
 * mask plus the writes of its disallowed tokens.
 * Built by tidal/kernels/build.py. */
#include <math.h>
#include <stdint.h>

int64_t tidal_apply_token_bitmask(float *logits, int64_t ld, int64_t vocab, const int32_t *mask,
                                  int64_t words, const int64_t *rows, int64_t num_rows) {
    int64_t dead = 0;
    const int64_t full_words = vocab / 32 < words ? vocab / 32 : words;
    for (int64_t i = 0; i < num_rows; i++) {
        const uint32_t *m = (const uint32_t *)(mask + i * words);
        float *row = logits + rows[i] * ld;
        int64_t allowed = 0;
        for (int64_t w = 0; w < full_words; w++) allowed += __builtin_popcount(m[w]);
        if (full_words < words && vocab % 32) {
            uint32_t tail = m[full_words] & ((1u << (vocab % 32)) - 1u);
            allowed += __builtin_popcount(tail);
        }
        if (allowed == 0) {
            dead++;
            continue;
        }
        for (int64_t w = 0; w < words && w * 32 < vocab; w++) {
            uint32_t word = m[w];
            if (word == 0xFFFFFFFFu) continue;
            int64_t base = w * 32;
            int64_t end = base + 32 < vocab ? base + 32 : vocab;
            if (word == 0) { /* the common case under a grammar: 32 at once, vectorized */
                for (int64_t t = base; t < end; t++) row[t] = -INFINITY;
                continue;
            }
            for (int64_t t = base; t < end; t++)
                if (!((word >> (t - base)) & 1u)) row[t] = -INFINITY;
        }
        for (int64_t t = words * 32; t < vocab; t++) row[t] = -INFINITY;
    }
    return dead;
}
