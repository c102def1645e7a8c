/* Writing one page's envelope, and the verdict on one (see envelope.h): the same bytes as
 * kvtier.core.envelope.write_envelope, the same answer as verify_envelope. */
#include "envelope.h"

#include <string.h>

void
envelope_hash_payload(XXH3_state_t *state, const Py_buffer *regions, Py_ssize_t count)
{
    for (Py_ssize_t i = 1; i < count; i++)
        XXH3_128bits_update(state, regions[i].buf, (size_t)regions[i].len);
}

void
envelope_fill(const Py_buffer *regions, Py_ssize_t count, const unsigned char *key_digest,
              const XXH3_state_t *state, const unsigned char *static_fields)
{
    unsigned char *slot = regions[0].buf;
    memcpy(slot, static_fields, STATIC_BYTES);
    memcpy(slot + KEY_DIGEST_AT, key_digest, KEY_DIGEST_BYTES);
    put_le64(slot + PAYLOAD_LENGTH_AT, glue_payload_length(regions, count));
    xxh128_canonical(XXH3_128bits_digest(state), slot + PAYLOAD_CHECKSUM_AT);
    put_le64(slot + HEADER_CHECKSUM_AT, XXH3_64bits(slot, BODY_BYTES));
    memset(slot + HEADER_BYTES, 0, (size_t)regions[0].len - HEADER_BYTES);
}

void
envelope_write(const Py_buffer *regions, Py_ssize_t count, const unsigned char *key_digest,
               XXH3_state_t *state, const unsigned char *static_fields)
{
    XXH3_128bits_reset(state);
    envelope_hash_payload(state, regions, count); /* before the slot is touched */
    envelope_fill(regions, count, key_digest, state, static_fields);
}

/* verify_envelope's checks, in its order: each field against the reader's (the static
 * fields hold its magic, version, header length, fingerprint and layout code). Flags and
 * the reserved bytes are covered by the header checksum only, as there. */
int
envelope_verdict(const Py_buffer *regions, Py_ssize_t count, const unsigned char *key_digest,
                 const unsigned char *static_fields, XXH3_state_t *state, PayloadCheck payload)
{
    const unsigned char *slot = regions[0].buf;
    if (memcmp(slot + MAGIC_AT, static_fields + MAGIC_AT, MAGIC_BYTES) != 0) return BAD_MAGIC;
    if (memcmp(slot + VERSION_AT, static_fields + VERSION_AT, VERSION_BYTES) != 0)
        return UNSUPPORTED_VERSION;
    if (memcmp(slot + HEADER_LENGTH_AT, static_fields + HEADER_LENGTH_AT, HEADER_LENGTH_BYTES) != 0)
        return CORRUPT_HEADER;
    if (XXH3_64bits(slot, BODY_BYTES) != get_le64(slot + HEADER_CHECKSUM_AT)) return CORRUPT_HEADER;
    if (memcmp(slot + FINGERPRINT_AT, static_fields + FINGERPRINT_AT, FINGERPRINT_BYTES) != 0)
        return WRONG_GEOMETRY;
    if (slot[LAYOUT_AT] != static_fields[LAYOUT_AT]) return LAYOUT_MISMATCH;
    if (memcmp(slot + KEY_DIGEST_AT, key_digest, KEY_DIGEST_BYTES) != 0) return WRONG_KEY;
    if (slot[CHECKSUM_ID_AT] != CHECKSUM_XXH3_128) return UNKNOWN_CHECKSUM;
    if (get_le64(slot + PAYLOAD_LENGTH_AT) != glue_payload_length(regions, count))
        return WRONG_LENGTH;
    if (payload == PAYLOAD_UNCHECKED) return VALID;
    if (payload == PAYLOAD_HASH) {
        XXH3_128bits_reset(state);
        envelope_hash_payload(state, regions, count);
    }
    unsigned char checksum[PAYLOAD_CHECKSUM_BYTES];
    xxh128_canonical(XXH3_128bits_digest(state), checksum);
    if (memcmp(slot + PAYLOAD_CHECKSUM_AT, checksum, PAYLOAD_CHECKSUM_BYTES) != 0)
        return CORRUPT_CHECKSUM;
    return VALID;
}

int
envelope_export(PyObject *module)
{
#define FIELD(name) {#name "_AT", name##_AT}, {#name "_BYTES", name##_BYTES}
    static const GlueConstant layout[] = {
        FIELD(MAGIC), FIELD(VERSION), FIELD(HEADER_LENGTH), FIELD(FLAGS),
        FIELD(FINGERPRINT), FIELD(LAYOUT), FIELD(CHECKSUM_ID), FIELD(RESERVED),
        FIELD(KEY_DIGEST), FIELD(PAYLOAD_LENGTH), FIELD(PAYLOAD_CHECKSUM),
        FIELD(HEADER_CHECKSUM),
        {"STATIC_BYTES", STATIC_BYTES}, {"BODY_BYTES", BODY_BYTES},
        {"HEADER_BYTES", HEADER_BYTES}, {"FORMAT_VERSION", FORMAT_VERSION},
        {"CHECKSUM_XXH3_128", CHECKSUM_XXH3_128},
    };
#undef FIELD
    for (size_t i = 0; i < sizeof layout / sizeof layout[0]; i++)
        if (PyModule_AddIntConstant(module, layout[i].name, layout[i].value) != 0) return -1;
    PyObject *magic = PyBytes_FromStringAndSize(MAGIC, MAGIC_BYTES);
    if (magic == NULL) return -1;
    int failed = PyModule_AddObject(module, "MAGIC", magic);
    if (failed) Py_DECREF(magic);
    return failed;
}
