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
 *   module.c    the module's functions: arguments in, verdicts out
 * and, shared with the file backends' _pageio (one copy of each, in kvtier/_csrc/):
 * blake2b.c and xxh.c (kvhash.h), the Python glue both modules need (glue.c, glue.h) and
 * the envelope's layout (envelope_layout.h). hatch_build.py compiles them into the one
 * module.
 */
#ifndef KVTIER_ENVELOPE_H
#define KVTIER_ENVELOPE_H

/* The Python glue (and Python.h), xxHash (bound at import), BLAKE2b, the little-endian
 * helpers and the envelope's layout: kvtier/_csrc/. */
#include "glue.h"

#include <stdint.h>
#include <string.h>

#include "envelope_layout.h"
#include "kvhash.h"

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

/* Hash the page's payload, then write its envelope (static fields, key digest, length,
 * payload checksum, header checksum) into its header slot and zero the slot's rest. */
void env_write(EnvPage *page, XXH3_state_t *state, const unsigned char *static_fields);
/* The page's verdict: VALID or why its envelope rejects it, checked in verify_envelope's
 * order; the payload checksum (CORRUPT_CHECKSUM) only when full. */
int env_verdict(const EnvPage *page, XXH3_state_t *state, const unsigned char *static_fields,
                int full);

#endif /* KVTIER_ENVELOPE_H */
