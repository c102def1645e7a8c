/* The envelope header's layout, for the compiled code: the values of
 * kvtier.core.envelope_layout.LAYOUT (the one declaration, docs/integrity.md) under the
 * same names. tests/test_envelope_layout.py fails when a value here differs from the
 * Python one, and both modules export them (envelope_export_layout) so that a module
 * built from another layout is refused at import. Little-endian, in this order:
 *   magic, version, header length, flags, fingerprint, layout code, checksum id,
 *   reserved  -- [0, STATIC_BYTES): the fields every page of a store shares ("static")
 *   key digest (BLAKE2b-128), payload length (u64), payload xxh3-128 (canonical:
 *   big-endian high64 then low64)  -- [0, BODY_BYTES): what the header checksum covers
 *   header checksum (xxh3-64 of the body, u64), then zeros to the end of the slot.
 * The compiled code never writes the magic, version or checksum id itself: Python packs
 * them into the static fields it hands over (BatchEnvelope.static).
 */
#ifndef KVTIER_ENVELOPE_LAYOUT_H
#define KVTIER_ENVELOPE_LAYOUT_H

#define MAGIC_AT 0
#define MAGIC_BYTES 8
#define VERSION_AT 8
#define VERSION_BYTES 2
#define HEADER_LENGTH_AT 10
#define HEADER_LENGTH_BYTES 2
#define FLAGS_AT 12
#define FLAGS_BYTES 4
#define FINGERPRINT_AT 16
#define FINGERPRINT_BYTES 32
#define LAYOUT_AT 48
#define LAYOUT_BYTES 1
#define CHECKSUM_ID_AT 49
#define CHECKSUM_ID_BYTES 1
#define RESERVED_AT 50
#define RESERVED_BYTES 6
#define KEY_DIGEST_AT 56
#define KEY_DIGEST_BYTES 16
#define PAYLOAD_LENGTH_AT 72
#define PAYLOAD_LENGTH_BYTES 8
#define PAYLOAD_CHECKSUM_AT 80
#define PAYLOAD_CHECKSUM_BYTES 16
#define HEADER_CHECKSUM_AT 96
#define HEADER_CHECKSUM_BYTES 8

#define STATIC_BYTES 56
#define BODY_BYTES 96
#define HEADER_BYTES 104

#define MAGIC "KVTIERPG"
#define FORMAT_VERSION 1
/* The payload checksums the format knows (kvtier.core.envelope.ChecksumAlgorithm). */
#define CHECKSUM_XXH3_128 1

#endif /* KVTIER_ENVELOPE_LAYOUT_H */
