/* Counts the bytes a process holds through the C allocator, and their peak since the last reset: preloaded
   (LD_PRELOAD) into the process whose processor is measured (measure.py). glibc's own entry points do the
   allocating; malloc_usable_size gives each block's bytes. Python's small-object arenas (mmap) are not counted:
   they hold objects of at most 512 bytes. */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stdatomic.h>
#include <stddef.h>
#include <string.h>
#include <unistd.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void __libc_free(void *);

static atomic_llong held;
static atomic_llong peak;

static void *note(void *p) {
    if (p != NULL) {
        long long now = atomic_fetch_add(&held, (long long)malloc_usable_size(p)) + (long long)malloc_usable_size(p);
        long long top = atomic_load(&peak);
        while (now > top && !atomic_compare_exchange_weak(&peak, &top, now)) {
        }
    }
    return p;
}

static void forget(void *p) {
    if (p != NULL) atomic_fetch_sub(&held, (long long)malloc_usable_size(p));
}

void *malloc(size_t n) { return note(__libc_malloc(n)); }
void *calloc(size_t n, size_t m) { return note(__libc_calloc(n, m)); }
void free(void *p) { forget(p); __libc_free(p); }
void *realloc(void *p, size_t n) {
    forget(p);
    return note(__libc_realloc(p, n));
}
void *memalign(size_t a, size_t n) { return note(__libc_memalign(a, n)); }
void *aligned_alloc(size_t a, size_t n) { return note(__libc_memalign(a, n)); }
void *valloc(size_t n) { return note(__libc_memalign((size_t)sysconf(_SC_PAGESIZE), n)); }
int posix_memalign(void **out, size_t a, size_t n) {
    void *p = __libc_memalign(a, n);
    if (p == NULL && n != 0) return ENOMEM;
    *out = note(p);
    return 0;
}

/* The bytes held now; the peak starts again from them. */
long long malloc_peak_reset(void) {
    long long now = atomic_load(&held);
    atomic_store(&peak, now);
    return now;
}

long long malloc_peak_held(void) { return atomic_load(&held); }
long long malloc_peak_peak(void) { return atomic_load(&peak); }
