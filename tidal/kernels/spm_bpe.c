/* SentencePiece-style BPE encoding over a vocabulary held as one UTF-8 blob (tidal/loader/
 * token_encoder.py): what `tokenizers`' BPE model does with the merges tidal derives from a GGUF's
 * vocabulary (tidal/loader/tokenizer_gguf.py _merges_from_vocab), without a merge table.
 *
 * A merge there is "piece a + piece b -> token t" for every split of t into two vocabulary
 * pieces, ranked by (t's score rank, longer left piece first, t's id). So two adjacent symbols
 * can merge exactly when the concatenation of their pieces is a token, and the rank follows from
 * that token and the left piece's length in characters: one hash lookup replaces the ~515k-entry
 * merge map (Gemma 3), and the whole encoder is the blob, its offsets, one rank per token and a
 * hash table of token ids (~8 MiB for a 262k-token vocabulary, against ~95 MiB for the
 * `tokenizers` object).
 *
 * Encoding follows `tokenizers` step by step:
 *   1. added tokens (control and user-defined) are cut out of the raw text, leftmost match
 *      first, the longest one where several start at the same byte (its Aho-Corasick
 *      LeftmostLongest);
 *   2. each piece of text between them gets spaces replaced by U+2581 (the normalizer);
 *   3. every character becomes a symbol: its token if the vocabulary has it, else one symbol per
 *      UTF-8 byte ("<0xHH>" tokens, byte fallback), else the unknown token (consecutive unknown
 *      characters fused into one);
 *   4. the adjacent pair with the lowest (rank, position) merges, repeatedly, from a heap with
 *      stale entries skipped (BPE's merge_all).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const uint8_t *blob;
    const uint32_t *off; /* token i is blob[off[i] .. off[i + 1]) */
    const int32_t *rank; /* per token: rank of its score, ties equal (lower merges first) */
    int32_t n;
    uint32_t max_len; /* longest token in bytes: a longer concatenation is no token */
    int32_t *table;   /* open addressing, token ids, -1 empty */
    uint64_t mask;
    int32_t byte_id[256]; /* "<0xHH>" tokens, -1 where the vocabulary lacks one */
    int32_t unk_id;       /* -1: none */
    /* The added tokens' trie: edges hashed by (node << 8 | byte). */
    int64_t *edge_key;
    int32_t *edge_node;
    uint64_t edge_mask;
    int32_t *term; /* per node: the added token ending there, or -1 */
    int32_t n_nodes;
} spm_t;

static uint64_t hash_bytes(uint64_t h, const uint8_t *p, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ULL;
    return h;
}

#define HASH_SEED 0xcbf29ce484222325ULL

/* The token whose bytes are a (la bytes) then b (lb bytes), or -1. */
static int32_t lookup2(const spm_t *s, const uint8_t *a, uint32_t la, const uint8_t *b,
                       uint32_t lb) {
    if (la + lb > s->max_len) return -1;
    uint64_t h = hash_bytes(hash_bytes(HASH_SEED, a, la), b, lb);
    for (uint64_t i = h & s->mask;; i = (i + 1) & s->mask) {
        int32_t t = s->table[i];
        if (t < 0) return -1;
        uint32_t len = s->off[t + 1] - s->off[t];
        const uint8_t *p = s->blob + s->off[t];
        if (len == la + lb && memcmp(p, a, la) == 0 && memcmp(p + la, b, lb) == 0) return t;
    }
}

static int32_t child(const spm_t *s, int32_t node, uint8_t byte) {
    int64_t key = ((int64_t)node << 8) | byte;
    uint64_t h = (uint64_t)key * 0x9e3779b97f4a7c15ULL;
    for (uint64_t i = (h >> 20) & s->edge_mask;; i = (i + 1) & s->edge_mask) {
        if (s->edge_key[i] == key) return s->edge_node[i];
        if (s->edge_key[i] < 0) return -1;
    }
}

static void add_child(spm_t *s, int32_t node, uint8_t byte, int32_t to) {
    int64_t key = ((int64_t)node << 8) | byte;
    uint64_t h = (uint64_t)key * 0x9e3779b97f4a7c15ULL;
    uint64_t i = (h >> 20) & s->edge_mask;
    while (s->edge_key[i] >= 0) i = (i + 1) & s->edge_mask;
    s->edge_key[i] = key;
    s->edge_node[i] = to;
}

void tidal_spm_free(spm_t *s) {
    if (s == NULL) return;
    free(s->table);
    free(s->edge_key);
    free(s->edge_node);
    free(s->term);
    free(s);
}

/* A handle over the caller's blob, offsets and ranks (kept alive by the caller); `added` lists
 * the added tokens' ids. NULL when out of memory. Where two tokens have the same bytes the later
 * one owns them, as in the Python dict the merges were derived from. */
spm_t *tidal_spm_new(const uint8_t *blob, const uint32_t *off, const int32_t *rank, int32_t n,
                     int32_t unk_id, const int32_t *added, int32_t n_added) {
    spm_t *s = calloc(1, sizeof *s);
    if (s == NULL) return NULL;
    s->blob = blob;
    s->off = off;
    s->rank = rank;
    s->n = n;
    s->unk_id = unk_id;
    uint64_t size = 16;
    while (size < 2 * (uint64_t)n) size <<= 1;
    s->mask = size - 1;
    s->table = malloc(size * sizeof *s->table);
    uint64_t added_bytes = 0;
    for (int32_t i = 0; i < n_added; i++) added_bytes += off[added[i] + 1] - off[added[i]];
    uint64_t esize = 16;
    while (esize < 2 * (added_bytes + 1)) esize <<= 1;
    s->edge_mask = esize - 1;
    s->edge_key = malloc(esize * sizeof *s->edge_key);
    s->edge_node = malloc(esize * sizeof *s->edge_node);
    s->term = malloc((added_bytes + 1) * sizeof *s->term);
    if (!s->table || !s->edge_key || !s->edge_node || !s->term) {
        tidal_spm_free(s);
        return NULL;
    }
    memset(s->table, 0xff, size * sizeof *s->table);
    for (int32_t t = 0; t < n; t++) {
        uint32_t len = off[t + 1] - off[t];
        const uint8_t *p = blob + off[t];
        if (len == 0) continue; /* an id with no token */
        if (len > s->max_len) s->max_len = len;
        uint64_t i = hash_bytes(HASH_SEED, p, len) & s->mask;
        for (;; i = (i + 1) & s->mask) {
            int32_t u = s->table[i];
            if (u < 0 || (off[u + 1] - off[u] == len && memcmp(blob + off[u], p, len) == 0)) break;
        }
        s->table[i] = t;
    }
    for (int b = 0; b < 256; b++) {
        static const char hex[] = "0123456789ABCDEF";
        uint8_t name[6] = {'<', '0', 'x', (uint8_t)hex[b >> 4], (uint8_t)hex[b & 15], '>'};
        s->byte_id[b] = lookup2(s, name, 6, name, 0);
    }
    memset(s->edge_key, 0xff, esize * sizeof *s->edge_key);
    s->n_nodes = 1;
    s->term[0] = -1;
    for (int32_t i = 0; i < n_added; i++) {
        int32_t t = added[i], node = 0;
        for (uint32_t j = off[t]; j < off[t + 1]; j++) {
            int32_t next = child(s, node, blob[j]);
            if (next < 0) {
                next = s->n_nodes++;
                s->term[next] = -1;
                add_child(s, node, blob[j], next);
            }
            node = next;
        }
        /* The id the bytes belong to (the later of two tokens with the same bytes). */
        if (node != 0) s->term[node] = lookup2(s, blob + off[t], off[t + 1] - off[t], blob, 0);
    }
    return s;
}

typedef struct {
    int32_t id, prev, next;
} sym_t;

typedef struct {
    int32_t rank, cut, tok, pos, left, right;
} merge_t;

/* Lower first: rank, then the longer left piece, then the token id, then the position. */
static int merge_less(const merge_t *a, const merge_t *b) {
    if (a->rank != b->rank) return a->rank < b->rank;
    if (a->cut != b->cut) return a->cut > b->cut;
    if (a->tok != b->tok) return a->tok < b->tok;
    return a->pos < b->pos;
}

typedef struct {
    merge_t *v;
    int64_t n, cap;
} heap_t;

static int heap_push(heap_t *h, merge_t m) {
    if (h->n == h->cap) {
        int64_t cap = h->cap ? 2 * h->cap : 64;
        merge_t *v = realloc(h->v, (size_t)cap * sizeof *v);
        if (v == NULL) return -1;
        h->v = v;
        h->cap = cap;
    }
    int64_t i = h->n++;
    while (i > 0) {
        int64_t parent = (i - 1) / 2;
        if (!merge_less(&m, &h->v[parent])) break;
        h->v[i] = h->v[parent];
        i = parent;
    }
    h->v[i] = m;
    return 0;
}

static merge_t heap_pop(heap_t *h) {
    merge_t top = h->v[0], last = h->v[--h->n];
    int64_t i = 0;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && merge_less(&h->v[c + 1], &h->v[c])) c++;
        if (!merge_less(&h->v[c], &last)) break;
        h->v[i] = h->v[c];
        i = c;
    }
    h->v[i] = last;
    return top;
}

static uint32_t num_chars(const uint8_t *p, uint32_t n) {
    uint32_t c = 0;
    for (uint32_t i = 0; i < n; i++) c += (p[i] & 0xC0) != 0x80;
    return c;
}

/* Queue the merge of symbols l and r if their pieces concatenate to a token. */
static int push_pair(const spm_t *s, heap_t *h, const sym_t *sym, int32_t l, int32_t r) {
    if (l < 0 || r < 0) return 0;
    int32_t a = sym[l].id, b = sym[r].id;
    const uint8_t *pa = s->blob + s->off[a], *pb = s->blob + s->off[b];
    uint32_t la = s->off[a + 1] - s->off[a], lb = s->off[b + 1] - s->off[b];
    int32_t t = lookup2(s, pa, la, pb, lb);
    if (t < 0) return 0;
    merge_t m = {s->rank[t], (int32_t)num_chars(pa, la), t, l, a, b};
    return heap_push(h, m);
}

static int utf8_len(uint8_t c) {
    if (c < 0x80) return 1;
    if ((c & 0xE0) == 0xC0) return 2;
    if ((c & 0xF0) == 0xE0) return 3;
    if ((c & 0xF8) == 0xF0) return 4;
    return 1; /* not UTF-8 (Python hands valid UTF-8): one byte */
}

/* BPE over text[0 .. len) (no added tokens inside); appends the ids to out. Returns the new
 * count, -1 out of memory, -2 a character the vocabulary cannot spell (no unknown token). */
static int64_t encode_piece(const spm_t *s, const uint8_t *text, int64_t len, int32_t *out,
                            int64_t n_out, uint8_t *norm, sym_t *sym, heap_t *h) {
    static const uint8_t space[3] = {0xE2, 0x96, 0x81}; /* U+2581 */
    int64_t m = 0;
    for (int64_t i = 0; i < len; i++) {
        if (text[i] == ' ') {
            memcpy(norm + m, space, 3);
            m += 3;
        } else {
            norm[m++] = text[i];
        }
    }
    int32_t n = 0;
    for (int64_t i = 0; i < m;) {
        int k = utf8_len(norm[i]);
        if (i + k > m) k = (int)(m - i);
        int32_t t = lookup2(s, norm + i, (uint32_t)k, norm, 0);
        if (t >= 0) {
            sym[n++].id = t;
        } else {
            int all = 1;
            for (int j = 0; j < k; j++) all &= s->byte_id[norm[i + j]] >= 0;
            if (all) {
                for (int j = 0; j < k; j++) sym[n++].id = s->byte_id[norm[i + j]];
            } else if (s->unk_id < 0) {
                return -2;
            } else if (n == 0 || sym[n - 1].id != s->unk_id) {
                sym[n++].id = s->unk_id; /* fuse_unk: one symbol for a run of unknowns */
            }
        }
        i += k;
    }
    for (int32_t i = 0; i < n; i++) {
        sym[i].prev = i - 1;
        sym[i].next = i + 1 < n ? i + 1 : -1;
    }
    h->n = 0;
    for (int32_t i = 0; i + 1 < n; i++)
        if (push_pair(s, h, sym, i, i + 1)) return -1;
    while (h->n > 0) {
        merge_t top = heap_pop(h);
        int32_t l = top.pos, r = sym[l].next;
        /* Stale: l was merged into its left neighbour (id -1), or either side changed since. */
        if (sym[l].id != top.left || r < 0 || sym[r].id != top.right) continue;
        sym[l].id = top.tok;
        sym[l].next = sym[r].next;
        if (sym[r].next >= 0) sym[sym[r].next].prev = l;
        sym[r].id = -1;
        if (push_pair(s, h, sym, sym[l].prev, l) || push_pair(s, h, sym, l, sym[l].next)) return -1;
    }
    for (int32_t i = 0; i >= 0 && n > 0; i = sym[i].next) out[n_out++] = sym[i].id;
    return n_out;
}

/* Token ids of text[0 .. len) (UTF-8) into out, which must hold `len` ids (every id covers at
 * least one byte). Returns the count, -1 out of memory, -2 a character with no token. */
int64_t tidal_spm_encode(const spm_t *s, const uint8_t *text, int64_t len, int32_t *out) {
    uint8_t *norm = malloc((size_t)(3 * len + 1));
    sym_t *sym = malloc((size_t)(3 * len + 1) * sizeof *sym);
    heap_t h = {0};
    int64_t n_out = 0, start = 0;
    if (norm == NULL || sym == NULL) n_out = -1;
    for (int64_t i = 0; n_out >= 0 && i <= len;) {
        /* The longest added token starting at i, if any. */
        int32_t found = -1, node = 0;
        int64_t end = i;
        for (int64_t j = i; j < len; j++) {
            node = child(s, node, text[j]);
            if (node < 0) break;
            if (s->term[node] >= 0) {
                found = s->term[node];
                end = j + 1;
            }
        }
        if (found < 0 && i < len) {
            i++;
            continue;
        }
        if (i > start) n_out = encode_piece(s, text + start, i - start, out, n_out, norm, sym, &h);
        if (found < 0 || n_out < 0) break;
        out[n_out++] = found;
        start = i = end;
    }
    free(h.v);
    free(sym);
    free(norm);
    return n_out;
}

/* The id of the token spelled p[0 .. n) (the later of two with the same bytes), or -1. */
int32_t tidal_spm_token_id(const spm_t *s, const uint8_t *p, int64_t n) {
    if (n <= 0 || (uint64_t)n > s->max_len) return -1;
    return lookup2(s, p, (uint32_t)n, p, 0);
}
