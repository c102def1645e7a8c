/* The page envelope in compiled code, one copy for both modules (envelope.c): writing a
 * page's envelope into its header slot, and the verdict on one, the same bytes and the
 * same answers as kvtier.core.envelope (write_envelope, verify_envelope). The core's
 * _envelope calls them for a batch of pages in memory; the file backends' _pageio for
 * each page it reads or writes. A page is its regions: the header slot first (at least
 * HEADER_BYTES), then the payload.
 */
#ifndef KVTIER_ENVELOPE_H
#define KVTIER_ENVELOPE_H

/* The Python glue (Python.h first, Py_buffer, glue_payload_length). */
#include "glue.h"

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

/* What a verdict does with the payload checksum. */
typedef enum {
    PAYLOAD_UNCHECKED, /* header only (verify="header"): CORRUPT_CHECKSUM is never given */
    PAYLOAD_HASH,      /* hash the payload now and compare */
    PAYLOAD_HASHED,    /* the state already holds the payload's hash (taken as it was read) */
} PayloadCheck;

/* Feed the payload, regions[1..count), into state (not reset first). */
void envelope_hash_payload(XXH3_state_t *state, const Py_buffer *regions, Py_ssize_t count);
/* Write the envelope into the header slot regions[0], with the payload's hash already in
 * state: the static fields, the key digest, the payload's length and checksum, the header
 * checksum; zero the rest of the slot. */
void envelope_fill(const Py_buffer *regions, Py_ssize_t count, const unsigned char *key_digest,
                   const XXH3_state_t *state, const unsigned char *static_fields);
/* Hash the payload (state reset first), then envelope_fill. */
void envelope_write(const Py_buffer *regions, Py_ssize_t count, const unsigned char *key_digest,
                    XXH3_state_t *state, const unsigned char *static_fields);
/* The verdict on the page under key_digest against the reader's static fields: VALID, or
 * the first check that fails, in verify_envelope's order. */
int envelope_verdict(const Py_buffer *regions, Py_ssize_t count, const unsigned char *key_digest,
                     const unsigned char *static_fields, XXH3_state_t *state,
                     PayloadCheck payload);
/* Add every layout value of envelope_layout.h to module as a constant of the same name
 * (what kvtier.core.envelope_layout.disagreement compares): 0, or -1 with an exception
 * set. */
int envelope_export(PyObject *module);

#endif /* KVTIER_ENVELOPE_H */
