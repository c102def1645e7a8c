/* The hashing code kvtier's compiled modules share: one copy of each C file here,
 * compiled into each module that needs it (hatch_build.py adds this directory to both
 * builds, and to their include path):
 *
 *   blake2b.c   BLAKE2b (RFC 7693): the keys' envelope digests (and the file backends'
 *               page names)
 *   xxh.c       the xxHash functions, bound at import to a loaded copy of the library
 *
 * Users: kvtier.core._envelope (kvtier/core/_envelope_src/: the core's batch calls to the
 * envelope code) and kvtier.backends.filestore._pageio (_pageio_src/: the file backends'
 * page loop). Each module is linked with -fvisibility=hidden, so each has its own copy of
 * these symbols (and of the bound xxHash table): binding one module binds only that one.
 * Nothing here needs Python's headers. (The directory also holds the envelope both modules
 * write and check, envelope.c and envelope.h, its layout, envelope_layout.h, and the
 * Python glue they share, glue.h and glue.c.)
 */
#ifndef KVTIER_KVHASH_H
#define KVTIER_KVHASH_H

#include <stddef.h>
#include <stdint.h>

/* --- xxHash (xxh.c) ---------------------------------------------------------------
 * The part of xxHash's public, stable API (0.8 and later) the modules call. It is bound
 * at import (xxh_bind) to a loaded copy of the library: the one inside the xxhash Python
 * package, whose SIMD-dispatching entry points are about 3x faster here than a distro's
 * SSE2 build, or else the system's libxxhash. No link-time dependency. */
typedef struct XXH3_state_s XXH3_state_t;
typedef struct {
    uint64_t low64;
    uint64_t high64;
} XXH128_hash_t;
struct xxh_functions {
    XXH3_state_t *(*create_state)(void);
    int (*free_state)(XXH3_state_t *state);
    int (*reset)(XXH3_state_t *state);
    int (*update)(XXH3_state_t *state, const void *input, size_t length);
    XXH128_hash_t (*digest)(const XXH3_state_t *state);
    uint64_t (*hash64)(const void *input, size_t length);
};
extern struct xxh_functions xxh;
#define XXH3_createState() xxh.create_state()
#define XXH3_freeState(s) xxh.free_state(s)
#define XXH3_128bits_reset(s) xxh.reset(s)
#define XXH3_128bits_update(s, p, n) xxh.update((s), (p), (n))
#define XXH3_128bits_digest(s) xxh.digest(s)
#define XXH3_64bits(p, n) xxh.hash64((p), (n))

/* Take xxHash's functions from the shared object at path; 1 when it exports them all. */
int xxh_bind(const char *path);
/* Whether xxh_bind succeeded once. */
int xxh_bound(void);

/* An xxh3-128 digest in canonical form (big-endian high64, then low64): what
 * xxhash.xxh3_128().digest() returns and the envelope stores. */
static inline void
xxh128_canonical(XXH128_hash_t hash, unsigned char *out)
{
    for (int i = 0; i < 8; i++) out[i] = (unsigned char)(hash.high64 >> (56 - 8 * i));
    for (int i = 0; i < 8; i++) out[8 + i] = (unsigned char)(hash.low64 >> (56 - 8 * i));
}

/* --- BLAKE2b (blake2b.c) ----------------------------------------------------------- */

/* The unkeyed BLAKE2b digest of `length` bytes, `size` (1..64) bytes long, into out. */
void blake2b(unsigned char *out, size_t size, const unsigned char *in, size_t length);

/* --- little-endian integers -------------------------------------------------------- */

static inline uint64_t
get_le64(const unsigned char *in)
{
    uint64_t value = 0;
    for (int i = 7; i >= 0; i--) value = (value << 8) | in[i];
    return value;
}

static inline void
put_le64(unsigned char *out, uint64_t value)
{
    for (int i = 0; i < 8; i++) out[i] = (unsigned char)(value >> (8 * i));
}

#endif /* KVTIER_KVHASH_H */
