/* The envelope header's layout, one copy for both compiled modules (the core's envelope
 * writer and verifier, and the file backends' page loop); the format is
 * kvtier/core/envelope.py's (docs/integrity.md). Little-endian:
 *   [0, 8) magic  [8, 10) version  [10, 12) header length  [12, 16) flags
 *   [16, 48) fingerprint  [48] layout code  [49] checksum id  [50, 56) reserved
 *   -- [0, 56) are the fields every page of a store shares ("static") --
 *   [56, 72) key digest (BLAKE2b-128)   [72, 80) payload length (u64)
 *   [80, 96) payload xxh3-128, canonical (big-endian high64 then low64)
 *   [96, 104) xxh3-64 of [0, 96)  then zeros to the end of the slot.
 */
#ifndef KVTIER_ENVELOPE_LAYOUT_H
#define KVTIER_ENVELOPE_LAYOUT_H

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

#endif /* KVTIER_ENVELOPE_LAYOUT_H */
