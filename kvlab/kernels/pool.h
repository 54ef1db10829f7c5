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
 */
#ifndef KVLAB_POOL_H
#define KVLAB_POOL_H

/* Items [begin, end) of a loop; ctx: the loop's arguments. */
typedef void (*kvlab_task)(void *ctx, long begin, long end);

/* fn over items [0, n) on up to `threads` threads (the caller one of them), in chunks of
 * `grain` items (grain <= 0: a few chunks per thread); returns when every item is done. Serial
 * when threads <= 1, when n is one chunk, or when called from inside another loop. */
void kvlab_parallel(long n, long grain, int threads, kvlab_task fn, void *ctx);

#endif
