/* BLAKE2b as RFC 7693 specifies it, unkeyed, one message at a time.
 *
 * Every envelope carries its key K's 16-byte blake2b (kvtier/core/envelope.py), and in
 * the file backends a page of key K lives at STORE/xx/yy/K.kv, xxyy the hex of K's 2-byte
 * blake2b (kvtier/backends/filestore/paths.py). Both digests are computed here, so a
 * batch's envelopes and names cost no Python per page. Shared by the compiled modules
 * (kvhash.h). */
#include <string.h>

#include "kvhash.h"

static const uint64_t B2_IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

/* The message schedule; rounds 10 and 11 use rows 0 and 1 again (r % 10). */
static const uint8_t B2_SIGMA[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
};

static inline uint64_t
rotr64(uint64_t x, int n)
{
    return (x >> n) | (x << (64 - n));
}

#define B2_G(a, b, c, d, x, y)                                                                 \
    do {                                                                                       \
        v[a] += v[b] + (x);                                                                    \
        v[d] = rotr64(v[d] ^ v[a], 32);                                                        \
        v[c] += v[d];                                                                          \
        v[b] = rotr64(v[b] ^ v[c], 24);                                                        \
        v[a] += v[b] + (y);                                                                    \
        v[d] = rotr64(v[d] ^ v[a], 16);                                                        \
        v[c] += v[d];                                                                          \
        v[b] = rotr64(v[b] ^ v[c], 63);                                                        \
    } while (0)

/* Mix one 128-byte block into h; `count` is the bytes hashed so far, this block included. */
static void
b2_compress(uint64_t h[8], const unsigned char block[128], uint64_t count, int last)
{
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = get_le64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = B2_IV[i];
    }
    v[12] ^= count; /* messages here are far below 2**64 bytes: the high word stays 0 */
    if (last) v[14] = ~v[14];
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = B2_SIGMA[r % 10];
        B2_G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        B2_G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        B2_G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        B2_G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        B2_G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        B2_G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        B2_G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        B2_G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

void
blake2b(unsigned char *out, size_t size, const unsigned char *in, size_t length)
{
    uint64_t h[8];
    unsigned char block[128];
    memcpy(h, B2_IV, sizeof h);
    h[0] ^= 0x01010000ULL ^ (uint64_t)size; /* depth 1, fanout 1, no key, `size` bytes */
    size_t done = 0;
    while (length - done > 128) {
        b2_compress(h, in + done, done + 128, 0);
        done += 128;
    }
    memset(block, 0, sizeof block);
    memcpy(block, in + done, length - done);
    b2_compress(h, block, length, 1);
    for (size_t i = 0; i < size; i++) out[i] = (unsigned char)(h[i / 8] >> (8 * (i % 8)));
}
