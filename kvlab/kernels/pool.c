/* kvlab's thread pool: a loop's chunks shared by whichever threads are running.
 *
 * Why not OpenMP: an OpenMP region ends at a barrier that waits for every thread of its team,
 * so on cores shared with another busy process a decode step's ~150 regions each wait for a
 * descheduled thread (measured: 25% of the quiet rate beside one busy process on 2 cores).
 * Here the caller claims chunks itself and waits only for chunks another thread has claimed
 * and not finished: a thread that is not running takes nothing, so the caller does its share.
 * A wait that lasts sleeps on a futex, which frees the core for the thread it waits for.
 *
 * Which thread runs a chunk never changes a value: every kernel computes each output from its
 * inputs alone, so the results are bitwise the same whoever took which chunk.
 *
 * kvlab_parallel (kvlab.h): one loop at a time, its chunks claimed by compare-and-swap.
 *
 * state packs the loop's generation (high 32 bits) and its next unclaimed chunk (low 32): a
 * claim succeeds only while the state is the one the claimer read, so a thread that saw an old
 * loop can never take a chunk of a newer one. The loop's arguments sit in job[generation & 1]:
 * the caller fills the slot of loop g + 1 only after loop g - 1, its previous tenant, is over,
 * so a claim that succeeds read its own loop's arguments.
 */
#define _GNU_SOURCE
#include "kvlab.h"

#include <immintrin.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_WORKERS 63
#define CHUNKS_PER_THREAD 4 /* grain <= 0: enough for the caller to take over a slow thread's share */
#define IDLE_SPIN_NS 200000 /* a worker waits this long for the next loop before it sleeps: a
                               step's loops come microseconds apart, its steps a millisecond */
#define JOIN_SPIN_NS 20000  /* the caller waits this long for claimed chunks before it sleeps */

typedef struct {
    kvlab_task fn;
    void *ctx;
    long n, chunk, chunks;
    int threads;
} job_t;

static struct {
    uint64_t state;  /* generation << 32 | next chunk */
    long done;       /* chunks of this generation finished */
    uint32_t wake;   /* futex: bumped when a loop starts */
    uint32_t joined; /* futex: bumped when the last chunk of a loop ends */
    int sleeping;    /* workers asleep on wake */
    int joining;     /* the caller asleep on joined */
    job_t job[2];
    int workers;     /* started so far */
} pool;

static pthread_mutex_t caller = PTHREAD_MUTEX_INITIALIZER;
static __thread int inside; /* this thread is running a chunk */

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void futex_wait(uint32_t *word, uint32_t expected) {
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake(uint32_t *word) { syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0); }

#define LOAD(p) __atomic_load_n(p, __ATOMIC_ACQUIRE)
#define RELAXED(p) __atomic_load_n(p, __ATOMIC_RELAXED)

/* Claim and run chunks of the loop whose state was s until none is left or the loop is over;
 * worker: the worker's index (0-based), or -1 for the caller. */
static void run_chunks(uint64_t s, int worker) {
    for (;;) {
        const uint32_t gen = s >> 32, i = (uint32_t)s;
        const job_t *j = &pool.job[gen & 1];
        const kvlab_task fn = RELAXED(&j->fn);
        void *ctx = RELAXED(&j->ctx);
        const long n = RELAXED(&j->n), chunk = RELAXED(&j->chunk), chunks = RELAXED(&j->chunks);
        if (i >= chunks || worker + 1 >= RELAXED(&j->threads)) return;
        if (__atomic_compare_exchange_n(&pool.state, &s, s + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            const long begin = i * chunk, end = begin + chunk < n ? begin + chunk : n;
            inside = 1;
            fn(ctx, begin, end);
            inside = 0;
            if (__atomic_add_fetch(&pool.done, 1, __ATOMIC_SEQ_CST) == chunks && LOAD(&pool.joining)) {
                __atomic_add_fetch(&pool.joined, 1, __ATOMIC_RELEASE);
                futex_wake(&pool.joined);
            }
            s = LOAD(&pool.state);
        }
        if (s >> 32 != gen) return; /* a newer loop: its chunks are claimed from its own state */
    }
}

static void *worker_main(void *arg) {
    const int me = (int)(intptr_t)arg;
    uint32_t seen = LOAD(&pool.state) >> 32;
    for (;;) {
        long since = now_ns();
        for (int spins = 0;; spins++) {
            const uint64_t s = LOAD(&pool.state);
            if (s >> 32 != seen) {
                seen = s >> 32;
                run_chunks(s, me);
                since = now_ns();
                continue;
            }
            if (spins % 64) {
                _mm_pause();
                continue;
            }
            /* the caller may be waiting for this core (another process holds the other one) */
            sched_yield();
            if (now_ns() - since > IDLE_SPIN_NS) break;
        }
        const uint32_t w = LOAD(&pool.wake);
        __atomic_add_fetch(&pool.sleeping, 1, __ATOMIC_SEQ_CST);
        if (LOAD(&pool.state) >> 32 == seen) futex_wait(&pool.wake, w);
        __atomic_sub_fetch(&pool.sleeping, 1, __ATOMIC_SEQ_CST);
    }
    return NULL;
}

/* A forked child has the pool's memory but none of its threads: start afresh. */
static void after_fork(void) {
    pool.workers = pool.sleeping = pool.joining = 0;
    pthread_mutex_init(&caller, NULL);
}

static void start_workers(int want) {
    static int registered;
    if (!registered) registered = !pthread_atfork(NULL, NULL, after_fork);
    while (pool.workers < want) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&t, &a, worker_main, (void *)(intptr_t)pool.workers);
        pthread_attr_destroy(&a);
        if (failed) return; /* fewer threads: the caller takes their chunks */
        pool.workers++;
    }
}

/* fn over items [0, n) on up to `threads` threads (the caller one of them), in chunks of
 * `grain` items (grain <= 0: a few chunks per thread); returns when every item is done. Serial
 * when threads <= 1, when n is one chunk, or when called from inside another loop. */
void kvlab_parallel(long n, long grain, int threads, kvlab_task fn, void *ctx) {
    if (threads > MAX_WORKERS + 1) threads = MAX_WORKERS + 1;
    const long chunk = grain > 0 ? grain : (n + threads * CHUNKS_PER_THREAD - 1) / (threads * CHUNKS_PER_THREAD);
    if (threads <= 1 || n <= chunk || inside || pthread_mutex_trylock(&caller)) {
        if (n > 0) fn(ctx, 0, n);
        return;
    }
    start_workers(threads - 1);
    const uint32_t gen = (uint32_t)(pool.state >> 32) + 1;
    job_t *j = &pool.job[gen & 1];
    __atomic_store_n(&j->fn, fn, __ATOMIC_RELAXED);
    __atomic_store_n(&j->ctx, ctx, __ATOMIC_RELAXED);
    __atomic_store_n(&j->n, n, __ATOMIC_RELAXED);
    __atomic_store_n(&j->chunk, chunk, __ATOMIC_RELAXED);
    __atomic_store_n(&j->chunks, (n + chunk - 1) / chunk, __ATOMIC_RELAXED);
    __atomic_store_n(&j->threads, threads, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.done, 0, __ATOMIC_RELAXED);
    const uint64_t s = (uint64_t)gen << 32;
    __atomic_store_n(&pool.state, s, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&pool.wake, 1, __ATOMIC_SEQ_CST);
    if (LOAD(&pool.sleeping)) futex_wake(&pool.wake);
    run_chunks(s, -1);
    const long all = RELAXED(&j->chunks);
    const long since = now_ns();
    for (int spins = 0; LOAD(&pool.done) < all; spins++) {
        if (spins % 64) {
            _mm_pause();
            continue;
        }
        sched_yield(); /* the thread that holds the chunk may be waiting for this core */
        if (now_ns() - since < JOIN_SPIN_NS) continue;
        /* a claimed chunk is late (its thread descheduled, most likely): sleep until it ends */
        const uint32_t w = LOAD(&pool.joined);
        __atomic_store_n(&pool.joining, 1, __ATOMIC_SEQ_CST);
        if (LOAD(&pool.done) < all) futex_wait(&pool.joined, w);
        __atomic_store_n(&pool.joining, 0, __ATOMIC_SEQ_CST);
    }
    pthread_mutex_unlock(&caller);
}
