/* kvtier.core._envelope: the core's per-page envelope work in compiled code.
 *
 * PageStore writes every page's envelope on put and verifies it on get
 * (kvtier/core/envelope.py, docs/integrity.md). For a backend without a compiled loop of
 * its own (memory, mooncake, segment, third-party plugins) that work is the core's
 * cost per page; here one call does it for a batch (or one checksum thread's slice of
 * one) with the GIL released: the key digests (BLAKE2b-128), the payload xxh3-128
 * streamed over the page's regions in place, the header's xxh3-64, and for a get one
 * verdict per page that is exactly the one kvtier.core.envelope.verify_envelope decides.
 *
 * Files, one job each:
 *   envelope.c  writing one envelope, and the verdict on one
 *   module.c    the Python glue: arguments, the module's functions and constants
 * and, shared with the file backends' _pageio (one copy of each, in kvtier/_csrc/,
 * kvhash.h): blake2b.c, xxh.c. hatch_build.py compiles them into the one module.
 *
 * Envelope layout, little-endian (the same as _pageio_src/pageio.h):
 *   [0, 8) magic  [8, 10) version  [10, 12) header length  [12, 16) flags
 *   [16, 48) fingerprint  [48] layout code  [49] checksum id  [50, 56) reserved
 *   -- [0, 56) are the fields every page of a store shares ("static") --
 *   [56, 72) key digest          [72, 80) payload length (u64)
 *   [80, 96) payload xxh3-128, canonical (big-endian high64 then low64)
 *   [96, 104) xxh3-64 of [0, 96)  then zeros to the end of the slot.
 */
#ifndef KVTIER_ENVELOPE_H
#define KVTIER_ENVELOPE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

/* xxHash (bound at import), BLAKE2b and the little-endian helpers: kvtier/_csrc/. */
#include "kvhash.h"

/* --- sizes and offsets (kvtier.core.envelope) ------------------------------------ */
#define MAGIC_AT 0
#define VERSION_AT 8
#define HEADER_LENGTH_AT 10
#define FINGERPRINT_AT 16
#define FINGERPRINT_BYTES 32
#define LAYOUT_AT 48
#define CHECKSUM_ID_AT 49
#define STATIC_BYTES 56
#define DIGEST_AT 56
#define DIGEST_BYTES 16
#define LENGTH_AT 72
#define CHECKSUM_AT 80
#define BODY_BYTES 96
#define HEADER_BYTES 104
/* The payload checksums the format knows (kvtier.core.envelope.ChecksumAlgorithm). */
#define CHECKSUM_XXH3_128 1

/* Verdicts (module constants of the same names): VALID, or the
 * kvtier.core.envelope.Rejection of that name, in the order verify_envelope checks. */
enum {
    VALID = 0,
    BAD_MAGIC = 1,
    UNSUPPORTED_VERSION = 2,
    CORRUPT_HEADER = 3,
    WRONG_GEOMETRY = 4,
    LAYOUT_MISMATCH = 5,
    WRONG_KEY = 6,
    UNKNOWN_CHECKSUM = 7,
    WRONG_LENGTH = 8,
    CORRUPT_CHECKSUM = 9,
};

/* One page of a call: its regions (header slot first, then the payload), its key's
 * UTF-8 bytes (the key object is held for the call) and, once computed, the key digest
 * and the page's verdict. */
typedef struct {
    Py_buffer *regions;
    Py_ssize_t count;
    PyObject *key;
    const char *text;
    Py_ssize_t length;
    unsigned char digest[DIGEST_BYTES];
    int verdict;
} EnvPage;

/* The payload's bytes: every region after the header slot. */
static inline uint64_t
env_payload_length(const EnvPage *page)
{
    uint64_t total = 0;
    for (Py_ssize_t i = 1; i < page->count; i++) total += (uint64_t)page->regions[i].len;
    return total;
}

/* Hash the page's payload, then write its envelope (static fields, key digest, length,
 * payload checksum, header checksum) into its header slot and zero the slot's rest. */
void env_write(EnvPage *page, XXH3_state_t *state, const unsigned char *static_fields);
/* The page's verdict: VALID or why its envelope rejects it, checked in verify_envelope's
 * order; the payload checksum (CORRUPT_CHECKSUM) only when full. */
int env_verdict(const EnvPage *page, XXH3_state_t *state, const unsigned char *static_fields,
                int full);

#endif /* KVTIER_ENVELOPE_H */
