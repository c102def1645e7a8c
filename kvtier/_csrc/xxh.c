/* The xxHash functions a module calls, bound at import to a loaded library (see
 * kvhash.h): no link-time dependency. Each module that compiles this file has its own
 * table, bound by its own bind(). */
#include <dlfcn.h>
#include <stdio.h>

#include "kvhash.h"

struct xxh_functions xxh;

/* The address of symbol name (preferring name + "_dispatch") in the library handle. */
static void *
find(void *library, const char *name)
{
    char dispatch[64];
    snprintf(dispatch, sizeof dispatch, "%s_dispatch", name);
    void *address = dlsym(library, dispatch);
    return address != NULL ? address : dlsym(library, name);
}

int
xxh_bind(const char *path)
{
    void *library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (library == NULL) return 0;
    void *create = dlsym(library, "XXH3_createState");
    void *free_state = dlsym(library, "XXH3_freeState");
    void *reset = dlsym(library, "XXH3_128bits_reset");
    void *update = find(library, "XXH3_128bits_update");
    void *digest = dlsym(library, "XXH3_128bits_digest");
    void *hash64 = find(library, "XXH3_64bits");
    if (!create || !free_state || !reset || !update || !digest || !hash64) {
        dlclose(library);
        return 0;
    }
    /* the library stays loaded for the life of the process (its functions are kept) */
    *(void **)&xxh.create_state = create;
    *(void **)&xxh.free_state = free_state;
    *(void **)&xxh.reset = reset;
    *(void **)&xxh.update = update;
    *(void **)&xxh.digest = digest;
    *(void **)&xxh.hash64 = hash64;
    return 1;
}

int
xxh_bound(void)
{
    return xxh.update != NULL;
}
