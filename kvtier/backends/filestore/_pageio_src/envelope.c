/* The envelope header: checking a page's and writing one (layout in pageio.h, the
 * format in kvtier/core/envelope.py). */
#include "pageio.h"

void
hash_regions(XXH3_state_t *state, const Py_buffer *buffers, Py_ssize_t from, Py_ssize_t to)
{
    for (Py_ssize_t i = from; i < to; i++) XXH3_128bits_update(state, buffers[i].buf, (size_t)buffers[i].len);
}

/* Whether the header in the page's slot is this store's envelope for the key and payload
 * (and, when hashed is not NULL, whether the payload's checksum matches its digest). */
int
header_valid(const Page *page, const unsigned char *static_fields, XXH3_state_t *hashed)
{
    const unsigned char *slot = page->buffers[0].buf;
    if (page->buffers[0].len < HEADER_BYTES) return 0;
    if (memcmp(slot, static_fields, STATIC_BYTES) != 0) return 0;
    if (memcmp(slot + DIGEST_AT, page->key_digest, 16) != 0) return 0;
    if (get_le64(slot + LENGTH_AT) != payload_length(page)) return 0;
    if (XXH3_64bits(slot, BODY_BYTES) != get_le64(slot + BODY_BYTES)) return 0;
    if (hashed != NULL) {
        unsigned char digest[16];
        xxh128_canonical(XXH3_128bits_digest(hashed), digest);
        if (memcmp(slot + CHECKSUM_AT, digest, 16) != 0) return 0;
    }
    return 1;
}

/* Write the envelope into the page's header slot, from the payload's hash in state. */
void
fill_header(Page *page, XXH3_state_t *state, const unsigned char *static_fields)
{
    unsigned char *slot = page->buffers[0].buf;
    memcpy(slot, static_fields, STATIC_BYTES);
    memcpy(slot + DIGEST_AT, page->key_digest, 16);
    put_le64(slot + LENGTH_AT, payload_length(page));
    xxh128_canonical(XXH3_128bits_digest(state), slot + CHECKSUM_AT);
    put_le64(slot + BODY_BYTES, XXH3_64bits(slot, BODY_BYTES));
    memset(slot + HEADER_BYTES, 0, (size_t)page->buffers[0].len - HEADER_BYTES);
}

void
write_header(Page *page, XXH3_state_t *state, const unsigned char *static_fields)
{
    XXH3_128bits_reset(state);
    hash_regions(state, page->buffers, 1, page->count);
    fill_header(page, state, static_fields);
}
