/* Writing one page's envelope, and the verdict on one: the same bytes as
 * kvtier.core.envelope.write_envelope, the same answer as verify_envelope. */
#include "envelope.h"

static void
hash_payload(const EnvPage *page, XXH3_state_t *state, unsigned char out[16])
{
    XXH3_128bits_reset(state);
    for (Py_ssize_t i = 1; i < page->count; i++)
        XXH3_128bits_update(state, page->regions[i].buf, (size_t)page->regions[i].len);
    xxh128_canonical(XXH3_128bits_digest(state), out);
}

void
env_write(EnvPage *page, XXH3_state_t *state, const unsigned char *static_fields)
{
    unsigned char *slot = page->regions[0].buf;
    unsigned char checksum[16];
    hash_payload(page, state, checksum); /* before the slot is touched */
    memcpy(slot, static_fields, STATIC_BYTES);
    memcpy(slot + DIGEST_AT, page->digest, DIGEST_BYTES);
    put_le64(slot + LENGTH_AT, glue_payload_length(page->regions, page->count));
    memcpy(slot + CHECKSUM_AT, checksum, 16);
    put_le64(slot + BODY_BYTES, XXH3_64bits(slot, BODY_BYTES));
    memset(slot + HEADER_BYTES, 0, (size_t)page->regions[0].len - HEADER_BYTES);
}

/* verify_envelope's checks, in its order: each field against the reader's (the static
 * fields hold its magic, version, header length, fingerprint and layout code). Flags and
 * the reserved bytes are covered by the header checksum only, as there. */
int
env_verdict(const EnvPage *page, XXH3_state_t *state, const unsigned char *static_fields,
            int full)
{
    const unsigned char *slot = page->regions[0].buf;
    if (memcmp(slot + MAGIC_AT, static_fields + MAGIC_AT, 8) != 0) return BAD_MAGIC;
    if (memcmp(slot + VERSION_AT, static_fields + VERSION_AT, 2) != 0) return UNSUPPORTED_VERSION;
    if (memcmp(slot + HEADER_LENGTH_AT, static_fields + HEADER_LENGTH_AT, 2) != 0)
        return CORRUPT_HEADER;
    if (XXH3_64bits(slot, BODY_BYTES) != get_le64(slot + BODY_BYTES)) return CORRUPT_HEADER;
    if (memcmp(slot + FINGERPRINT_AT, static_fields + FINGERPRINT_AT, FINGERPRINT_BYTES) != 0)
        return WRONG_GEOMETRY;
    if (slot[LAYOUT_AT] != static_fields[LAYOUT_AT]) return LAYOUT_MISMATCH;
    if (memcmp(slot + DIGEST_AT, page->digest, DIGEST_BYTES) != 0) return WRONG_KEY;
    if (slot[CHECKSUM_ID_AT] != CHECKSUM_XXH3_128) return UNKNOWN_CHECKSUM;
    if (get_le64(slot + LENGTH_AT) != glue_payload_length(page->regions, page->count))
        return WRONG_LENGTH;
    if (full) {
        unsigned char checksum[16];
        hash_payload(page, state, checksum);
        if (memcmp(slot + CHECKSUM_AT, checksum, 16) != 0) return CORRUPT_CHECKSUM;
    }
    return VALID;
}
