/* A page's file name and temp name, from its key (kvtier/backends/filestore/paths.py). */
#include "pageio.h"

long
page_name(char *out, const char *store, size_t store_length, const char *key, size_t length)
{
    static const char hex[] = "0123456789abcdef";
    unsigned char shard[2];
    if (store_length + length + 11 >= PATH_MAX) return -1;
    blake2b(shard, 2, (const unsigned char *)key, length);
    char *at = out;
    memcpy(at, store, store_length);
    at += store_length;
    *at++ = '/';
    *at++ = hex[shard[0] >> 4];
    *at++ = hex[shard[0] & 15];
    *at++ = '/';
    *at++ = hex[shard[1] >> 4];
    *at++ = hex[shard[1] & 15];
    *at++ = '/';
    memcpy(at, key, length);
    at += length;
    memcpy(at, ".kv", 4);
    return (long)(at + 3 - out);
}

long
temp_name(char *out, const char *page, size_t dir_length, const char *stem,
          unsigned long long seq)
{
    int written = snprintf(out, PATH_MAX, "%.*s/%s%llu.tmp", (int)dir_length, page, stem, seq);
    return written < 0 || (size_t)written >= PATH_MAX ? -1 : (long)written;
}
