/*
 * rpc.c - an RPC made of shared-memory slots, polled in user space.
 *
 * DESIGN
 * Each client host owns one ring in the pool's RPC area:
 *
 *   line 0          ring control (client-written; parsed in Python)
 *   line 1          server status (server-written; parsed in Python)
 *   line 2          client wake line (client-written; a hint, see WAITING)
 *   line 3          server wake line (server-written; a hint, see WAITING)
 *   depth lines     request lines, one per slot, written only by the client
 *   depth lines     response lines, one per slot, written only by the server
 *   depth buffers   request payloads that do not fit a line (client-written)
 *   depth buffers   response payloads that do not fit a line (server-written)
 *
 * One writer per cache line, always.  Request number `seq` (1, 2, ...) goes in
 * slot (seq - 1) % depth; the server consumes the ring in order, so it only
 * ever looks at a window of lines after the next sequence number it expects.
 *
 * A line is a message: sequence number (the doorbell), op or status, flags,
 * length, ring generation, 40 inline payload bytes, the payload's CRC32C when
 * it lives out of line, and the line's own CRC32C.  A stale line has the wrong
 * sequence or generation; a torn line fails its CRC.  A payload that does not
 * fit inline is written (non-temporally) to the slot's buffer and fenced
 * before the line that announces it.
 *
 * Writers stage every line of a batch, then store them non-temporally with one
 * SFENCE (two when a payload went out of line).  Readers invalidate a window
 * of lines, MFENCE once, then load.  All of it goes through the Memory's
 * memops table, so the model mode exercises exactly this code.
 *
 * Each of those steps is a named sabotage point (BL_STEP, beluga_native.h),
 * but one: the SFENCE after a batch's lines.  Nothing is ordered after it; it
 * only bounds how long the lines wait in write-combining buffers, and every
 * writer's next step drains them anyway (a client polls its responses, the
 * server its requests, with an MFENCE).  Without it a message arrives one
 * poll later: latency, never a wrong or lost message.
 *
 * TORN LINES
 * A request line whose sequence and generation are the expected ones but
 * whose CRC fails is, first of all, a line its client is still writing: a
 * client descheduled, or stopped (SIGSTOP, a paused VM), between the stores
 * of one line leaves it torn for as long as it is away, and the model makes
 * a line's non-temporal stores visible piecemeal.  The server waits for it
 * (it serves the ring's later requests only after it, in order) and answers
 * it CORRUPT only once it has stayed torn for torn_ns (TORN_PATIENCE_NS,
 * 10 s; RingServer.torn_patience_s): a client back within that bound gets
 * its request served, and a line really damaged (hostile bytes, a client
 * that wrote garbage) costs its own ring a bounded stall, never another's.
 * (It was 1 ms once: a busy host's scheduler turned healthy puts into
 * "request line corrupt".)
 *
 * A restarted server finds each ring's position in the lines themselves
 * (bl_rpc_server_recover_head): the oldest request with no matching response.
 * It runs none of the requests it finds there: each was sent before this
 * server acknowledged the ring, to a server that is gone, and its caller may
 * have given up on it long ago (a grant made for nobody would stay reserved
 * until its host leaves).  bl_rpc_server_refuse_pending answers each of them
 * RESTARTED, and a caller still waiting sends it again (RpcClient does, within
 * its deadline).  So a request runs at most once per server, and a request
 * pending when its server died runs again only if its caller still wants it.
 *
 * GRANTS NOBODY LEARNED
 * A server that runs an ALLOC writes each grant's WRITING header (with the request's seq
 * in its stamp) before the answer, so that recovery finds a grant whose writer got the
 * answer.  A server killed between the two leaves a grant its caller never learned: the
 * request is answered RESTARTED and sent again, and that extent would wait for a COMMIT
 * that never comes, quarantined while the caller's host lives.  So a server adopting a
 * ring asks, for each such recovered grant, whether its request is still unanswered (or
 * answered RESTARTED by a server that died since): bl_rpc_server_unanswered.  If so no
 * one can store into the extent, and it is freed before the refusal goes out.
 * Python never parses a slot line; rpc_pack_line / rpc_parse_line (rpc_py.c)
 * give tests the format.
 *
 * This file has no Python in it.  The bindings (rpc_py.c) parse and check
 * every argument, then call in here: the server's gather loop runs without
 * the GIL and returns a batch; serve_echo and pump run whole loops in C, to
 * measure the transport alone.  A loop that may wait takes bl_rpc_hooks from
 * its caller: let_go, called before it first waits longer than a short spin
 * (the binding drops the GIL there), and stopping, polled, which ends it
 * early (the binding's section of the Memory says the pool is being closed).
 *
 * WAITING
 * A waiter (a client for its responses, the server for requests on any ring)
 * polls its protocol lines and, while nothing arrives, backs off in steps:
 *
 *   1. spin     poll with PAUSE for spin_s (clients keep the GIL for the first
 *               few microseconds, so a quick answer costs no GIL hand-off);
 *   2. yield    two sched_yield() rounds, only where no wake-up is possible;
 *   3. sleep    with a wake-up when the peer shares our kernel, else timed
 *               naps growing from NAP_MIN_NS to NAP_MAX_NS.
 *
 * Busy-polling alone is right on dedicated cores and wrong on shared ones.  A
 * thread that never sleeps (a spinner, and the Python around it) uses up its
 * share of the core; the scheduler then runs other tasks there before it for
 * a full slice, a millisecond stall, while a thread that sleeps (like one
 * blocked on a socket) is run at once when woken.  A yield is no better: on a
 * busy core the yielder goes to the back of the queue.  So a spinning waiter
 * watches how long it waits for a core (contended()); once it is losing
 * slices it skips spin and yield and sleeps at once for a calm spell.  On an
 * idle machine nothing takes its core, and a round trip stays a spin.
 *
 * The wake-up is an eventcount over futex words in the shared mapping (futex
 * on a MAP_SHARED page works across processes of one kernel).  A sleeper reads
 * the counter, announces itself in its own line, polls the protocol lines once
 * more, and only then sleeps in FUTEX_WAIT on the counter value it read.  A
 * waker publishes its lines as usual, issues a full fence, and only if a
 * sleeper is announced bumps the counter and calls FUTEX_WAKE.  The fence pair
 * (announce, fence, poll / publish, fence, read announcement) means one side
 * always sees the other, so no wake-up is lost on a coherent kernel; and the
 * counter read before announcing makes a wake that comes between the re-poll
 * and the sleep return at once (EAGAIN).  Words:
 *
 *   client sleeps on    its ring's server wake line (a response counter),
 *                       announced in its ring's client wake line;
 *   server sleeps on    the doorbell counter (region 0, BL_RPC_DOORBELL_COUNT),
 *                       announced in the doorbell line (BL_RPC_DOORBELL).
 *
 * The doorbell counter is the one line many hosts write; that is allowed only
 * because wake lines are touched with real atomics, bypassing the memops table
 * (and the model), by peers that share a coherent kernel, and never carry
 * protocol state.  They are hints: every sleep has a short bounded timeout
 * (sleep_s) after which the waiter polls the protocol lines as before, so a
 * lost or missing wake-up costs latency, never correctness.  Peers on other
 * kernels (other boot id: two QEMU guests, two hosts on a CXL switch) cannot
 * reach each other's futexes: Python tells each end (RingClient.wake,
 * set_ring(..., wake)) and those waits use spin, yield and timed naps only.
 * A futex call that fails (some mappings, e.g. device-DAX, may refuse) turns
 * wake-ups off for that object: timed naps from then on.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "beluga_native.h"

#if BL_X86
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() __asm__ __volatile__("" ::: "memory")
#endif

#define TORN_PATIENCE_NS 10000000000ull /* default: a torn line at head 10 s is corrupt */

#define GIL_SPIN_NS 5000ull        /* a client polls this long before it lets go (drops the GIL) */
#define CLIENT_SPIN_NS 20000ull    /* default spin of a client wait */
#define SERVER_SPIN_NS 50000ull    /* default spin of the server after its last request */
#define YIELDS 2u                  /* sched_yield() rounds before a nap (no wake-up only) */
#define CHECK_NS 1000000ull        /* how often a spinning thread looks at its core's contention */
#define LOOK_AFTER_NS 10000ull     /* ... once its wait has spun this long (quick waits never look) */
#define STALLED_SHARE 8            /* contended: it waited for a core > 1/8 of the time since, */
#define LONG_STALL_NS 20000ull     /* ... for longer than this per turn on a core on average */
#define CALM_MIN_NS 50000000ull    /* then it sleeps at once (no spin, no yield) this long, */
#define CALM_MAX_NS 2000000000ull  /* doubling each time spinning is stalled again */
#define SLEEP_NS 5000000ull        /* default longest futex sleep before a re-poll */
#define NAP_MIN_NS 20000ull        /* timed naps (no wake-up) start here ... */
#define NAP_MAX_NS 1000000ull      /* ... and double up to this */
#define PUMP_GIVE_UP_NS 1000000000ull /* pump: the server answered nothing this long */
#define ECHO_BATCH (4 * BL_RPC_WINDOW)   /* serve_echo: requests answered per batch at most */
#define ECHO_POLL_NS 10000000ull         /* serve_echo: each gather's timeout */

/* Bytes of each slot buffer for a ring of ring_bytes with depth slots (0: none fit). */
size_t bl_rpc_buf_size(size_t ring_bytes, uint32_t depth)
{
    size_t fixed = BL_RPC_HEAD + 2 * (size_t)depth * BL_LINE;
    if (!depth || ring_bytes < fixed)
        return 0;
    return ((ring_bytes - fixed) / (2 * (size_t)depth)) & ~(size_t)(BL_LINE - 1);
}

/* Offset of a slot's request line. */
size_t bl_rpc_req_line(const bl_rpc_ring *g, uint32_t slot)
{
    return g->base + BL_RPC_HEAD + (size_t)slot * BL_LINE;
}

/* Offset of a slot's response line. */
size_t bl_rpc_resp_line(const bl_rpc_ring *g, uint32_t slot)
{
    return g->base + BL_RPC_HEAD + ((size_t)g->depth + slot) * BL_LINE;
}

/* Offset of a slot's request buffer. */
size_t bl_rpc_req_buf(const bl_rpc_ring *g, uint32_t slot)
{
    return g->base + BL_RPC_HEAD + 2 * (size_t)g->depth * BL_LINE + (size_t)slot * g->buf;
}

/* Offset of a slot's response buffer (after every request buffer). */
size_t bl_rpc_resp_buf(const bl_rpc_ring *g, uint32_t slot)
{
    return bl_rpc_req_buf(g, g->depth) + (size_t)slot * g->buf;
}

/* The geometry of a ring of ring_bytes at base with depth slots. */
bl_rpc_ring bl_rpc_ring_at(size_t base, size_t ring_bytes, uint32_t depth)
{
    return (bl_rpc_ring){base, depth, bl_rpc_buf_size(ring_bytes, depth)};
}

/* Whether a ring of depth slots fits [base, +ring_bytes) of a mapping: 0, or why not. */
int bl_rpc_ring_check(size_t mem_size, size_t base, size_t ring_bytes, uint32_t depth)
{
    if (!depth || depth > BL_RPC_MAX_DEPTH)
        return BL_RPC_BAD_DEPTH;
    if (ring_bytes < BL_RPC_HEAD + 2 * (size_t)depth * BL_LINE || base % BL_LINE ||
        base > mem_size || ring_bytes > mem_size - base)
        return BL_RPC_NO_ROOM;
    return 0;
}

/* Whether a payload of n bytes fits a message: inline, or in a slot buffer of buf bytes. */
int bl_rpc_fits(size_t n, size_t buf) { return n <= BL_RPC_INLINE || n <= buf; }

/* Monotonic clock in ns. */
uint64_t bl_rpc_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---------------------------------------------------------------- waiting */

/* Count one event (read by other threads; one writer at a time). */
#define COUNT(x) atomic_store_explicit(&(x), atomic_load_explicit(&(x), memory_order_relaxed) + 1, \
                                       memory_order_relaxed)

typedef struct {
    uint64_t since; /* when this wait began (the spin budget runs from here) */
    uint64_t nap;   /* length of the next timed nap */
    unsigned yields;
} backoff;

enum { STEP_SPIN, STEP_YIELD, STEP_SLEEP };

/* How a waiter starts: spin_ns of spinning, sleeps of at most sleep_ns, futexes allowed. */
static bl_rpc_wait wait_cfg(uint64_t spin_ns, int wake)
{
    return (bl_rpc_wait){.spin_ns = spin_ns, .sleep_ns = SLEEP_NS, .wake = wake, .futex_ok = 1,
                         .calm_ns = CALM_MIN_NS};
}

/* Start a wait at now; an idle waiter (nothing came last time) skips spin and yield. */
static void backoff_start(backoff *b, uint64_t now, int idle)
{
    b->since = idle ? 0 : now;
    b->nap = NAP_MIN_NS;
    b->yields = idle ? YIELDS : 0;
}

/*
 * The calling thread's time spent runnable but waiting for a core (ns) and
 * its turns on a core, from schedstat; 0 when the kernel does not tell.
 */
static int read_schedstat(uint64_t *stalled, uint64_t *turns)
{
    char buf[128];
    unsigned long long run, delay, count;
    int fd = open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
    ssize_t n = fd < 0 ? -1 : read(fd, buf, sizeof(buf) - 1);
    if (fd >= 0)
        close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    if (sscanf(buf, "%llu %llu %llu", &run, &delay, &count) != 3)
        return 0;
    *stalled = delay, *turns = count;
    return 1;
}
/*
 * Whether the cores are contended, so that spinning would only hurt.
 *
 * Spinning pays only while we own a core.  A thread that does not sleep
 * (spinning, plus the Python around it) uses up its share, and the scheduler
 * then runs other tasks on the core before it for a full slice: millisecond
 * stalls, where a thread that sleeps (like one blocked on a socket) is run at
 * once on wake-up.  So at most every CHECK_NS, outside calm spells, a waiter
 * reads how long it waited for a core since its last look: past
 * 1/STALLED_SHARE of the time, in stalls that average more than
 * LONG_STALL_NS per turn on a core, it has been losing slices to other tasks,
 * and it sleeps at once for a calm spell, then tries spinning again.  The
 * average tells a slice lost to a hog (milliseconds) from a peer that was
 * woken on our core and ran first (microseconds, every call).  A spell
 * doubles (CALM_MIN_NS up to CALM_MAX_NS) each time spinning is stalled
 * again and shrinks back after a clean look, so busy cores are probed
 * rarely.  A look costs a few syscalls, so only a wait that has already spun
 * LOOK_AFTER_NS looks: a quick round trip never pays for it.  (Hypervisor
 * steal is no run delay.  Where schedstat is missing, waits always spin first.)
 */
static int contended(bl_rpc_wait *c, bl_rpc_wait_stats *st, uint64_t now, uint64_t spun)
{
    int calm = now < c->calm_until;
    if (calm || now < c->next_check || spun < LOOK_AFTER_NS) /* a look costs syscalls */
        return calm;
    uint64_t stalled, turns;
    long tid = (long)syscall(SYS_gettid);
    c->next_check = now + CHECK_NS;
    if (!read_schedstat(&stalled, &turns))
        return 0;
    if (c->checked && tid == c->tid) {
        uint64_t waited = stalled - c->stalled, window = now - c->checked;
        if (waited > window / STALLED_SHARE && waited > (turns - c->turns) * LONG_STALL_NS) {
            c->calm_until = now + c->calm_ns;
            c->calm_ns = c->calm_ns * 2 < CALM_MAX_NS ? c->calm_ns * 2 : CALM_MAX_NS;
            c->checked = 0; /* the next look, after the spell, starts a new window */
            COUNT(st->stalled);
            return 1;
        }
        c->calm_ns = CALM_MIN_NS;
    }
    c->tid = tid, c->stalled = stalled, c->turns = turns, c->checked = now;
    return 0;
}

/*
 * The next step of a wait with nothing to do: spin, then (without a wake-up)
 * yield, then sleep; on contended cores, sleep at once.  A yield is worse than
 * a sleep on a busy core (the yielder goes to the back of the queue), so it is
 * only tried before timed naps.
 */
static int backoff_step(backoff *b, bl_rpc_wait *c, bl_rpc_wait_stats *st, uint64_t now, int can_wake)
{
    if (contended(c, st, now, now - b->since))
        return STEP_SLEEP;
    if (now - b->since < c->spin_ns)
        return STEP_SPIN;
    if (!can_wake && b->yields < YIELDS) {
        b->yields++;
        return STEP_YIELD;
    }
    return STEP_SLEEP;
}

/* Sleep ns (no wake-up can end it). */
static void sleep_ns(uint64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    nanosleep(&ts, NULL);
}

/* The length of the next timed nap (growing), at most left. */
static uint64_t next_nap(backoff *b, uint64_t left)
{
    uint64_t ns = b->nap < left ? b->nap : left;
    b->nap = b->nap * 2 < NAP_MAX_NS ? b->nap * 2 : NAP_MAX_NS;
    return ns;
}

/* A timed nap of a waiter that has no wake-up. */
static void nap(backoff *b, bl_rpc_wait_stats *st, uint64_t left)
{
    COUNT(st->naps);
    sleep_ns(next_nap(b, left));
}

/* The 32-bit wake word at off of the mapping (wake lines only, never protocol lines). */
static atomic_uint *wake_word(bl_mem *m, size_t off) { return (atomic_uint *)(void *)(m->base + off); }

/* Announce a sleep on counter w in flag; returns the counter value to sleep on. */
static uint32_t announce(atomic_uint *flag, atomic_uint *w)
{
    uint32_t key = atomic_load(w);
    atomic_store(flag, 1); /* sequentially consistent: ordered before the re-poll's loads */
    return key;
}

/* FUTEX_WAIT on w while it holds key, at most ns; count how it ended. */
static void futex_sleep(bl_rpc_wait *c, bl_rpc_wait_stats *st, atomic_uint *w, uint32_t key, uint64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    COUNT(st->sleeps);
    if (syscall(SYS_futex, w, FUTEX_WAIT, key, &ts, NULL, 0) == 0 || errno == EAGAIN) {
        COUNT(st->woken); /* woken, or the counter moved before we slept */
    } else if (errno == ETIMEDOUT) {
        COUNT(st->timeouts);
    } else if (errno != EINTR) {
        c->futex_ok = 0; /* this mapping refuses futexes: timed naps from now on */
        COUNT(st->futex_errors);
    }
}

/* After publishing lines: if a sleeper announced itself in flag, bump w and wake it. */
static void wake_sleeper(bl_rpc_wait *c, bl_rpc_wait_stats *st, atomic_uint *flag, atomic_uint *w)
{
    atomic_thread_fence(memory_order_seq_cst); /* our lines before its announcement is read */
    if (!atomic_load_explicit(flag, memory_order_relaxed))
        return;
    atomic_fetch_add(w, 1);
    COUNT(st->wakes);
    if (c->futex_ok && syscall(SYS_futex, w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0) < 0) {
        c->futex_ok = 0;
        COUNT(st->futex_errors);
    }
}

/* Whether the doorbell lines lie in a mapping of mem_size bytes and outside [off, off + n). */
static int doorbell_fits(size_t mem_size, size_t off, size_t n)
{
    size_t end = BL_RPC_DOORBELL_COUNT + BL_LINE;
    return mem_size >= end && (off >= end || off + n <= BL_RPC_DOORBELL);
}

/* ---------------------------------------------------------------- lines */

/* Fill a line; a payload too long for it goes to buf_off first (no fence here).
 * Returns 1 when the payload went out of line, 0 when inline, -1 when it fits neither. */
static int stage(bl_mem *m, bl_rpc_line *ln, size_t buf_off, size_t buf_size, uint32_t seq,
                 uint32_t gen, uint16_t code, const void *p, size_t n)
{
    memset(ln, 0, sizeof(*ln));
    ln->seq = seq, ln->gen = gen, ln->code = code, ln->len = (uint32_t)n;
    if (!bl_rpc_fits(n, buf_size))
        return -1;
    if (n > BL_RPC_INLINE) {
        m->ops->nt_store(m, buf_off, p, n);
        ln->flags = BL_RPC_OOL;
        ln->payload_crc = bl_crc32c_of(p, n);
    } else if (n) {
        memcpy(ln->data, p, n);
    }
    bl_record_seal(ln, sizeof(*ln));
    return ln->flags & BL_RPC_OOL;
}

/* Store staged lines with non-temporal stores, fencing out-of-line payloads first
 * (payload_point: that fence's sabotage point, the client's or the server's). */
static void emit(bl_mem *m, const bl_rpc_line *lines, const size_t *offs, size_t n, int any_ool,
                 int payload_point)
{
    if (any_ool && BL_STEP_ID(payload_point))
        m->ops->sfence(m);
    for (size_t i = 0; i < n; i++)
        m->ops->nt_store(m, offs[i], &lines[i], BL_LINE);
    m->ops->sfence(m);
}

/* Load an out-of-line payload into out; 0, or -1 when it fails its CRC.  `server`: the
 * server reads a request buffer, else the client a response buffer (separate points). */
static int payload_in(bl_mem *m, const bl_rpc_line *ln, size_t buf_off, void *out, int server)
{
    if (BL_STEP_ID(server ? BL_P_RPC_REQUEST_BUFFER_INVALIDATE : BL_P_RPC_RESPONSE_BUFFER_INVALIDATE))
        m->ops->invalidate(m, buf_off, ln->len);
    if (BL_STEP_ID(server ? BL_P_RPC_REQUEST_BUFFER_MFENCE : BL_P_RPC_RESPONSE_BUFFER_MFENCE))
        m->ops->mfence(m);
    m->ops->load(m, buf_off, out, ln->len);
    return bl_crc32c_of(out, ln->len) == ln->payload_crc ? 0 : -1;
}

/* Whether a loaded line is intact (its CRC) and of ring generation gen. */
static int line_of(const bl_rpc_line *ln, uint32_t gen)
{
    return bl_record_sealed(ln, sizeof(*ln)) && ln->gen == gen;
}

/* ---------------------------------------------------------------- client */

/* Attach a client to its ring (checked by the caller: bl_rpc_ring_check); clears a stale
 * "asleep" left in its wake line. */
void bl_rpc_client_init(bl_rpc_client *c, bl_mem *m, size_t base, size_t ring_bytes,
                        uint32_t depth, uint32_t gen, uint32_t first_seq, int wake)
{
    c->m = m;
    c->g = bl_rpc_ring_at(base, ring_bytes, depth);
    c->gen = gen;
    c->next_seq = c->done_seq = first_seq ? first_seq : 1;
    c->doorbell = doorbell_fits(m->size, base, ring_bytes);
    c->wait = wait_cfg(CLIENT_SPIN_NS, wake);
    atomic_store(wake_word(m, base + BL_RPC_CLIENT_WAKE), 0);
}

/* After new requests are visible: wake the server if it sleeps on our kernel. */
static void wake_server(bl_rpc_client *c)
{
    if (!c->wait.wake || !c->doorbell)
        return;
    wake_sleeper(&c->wait, &c->stats, wake_word(c->m, BL_RPC_DOORBELL),
                 wake_word(c->m, BL_RPC_DOORBELL_COUNT));
}

/*
 * Send n requests as one doorbell batch (one or two fences; none for an empty
 * batch); the caller checked that they fit the free slots and each payload
 * fits (bl_rpc_fits).  Returns the first request's sequence number.
 */
uint32_t bl_rpc_client_submit(bl_rpc_client *c, const bl_rpc_msg *msgs, uint32_t n)
{
    bl_rpc_line lines[BL_RPC_MAX_DEPTH];
    size_t offs[BL_RPC_MAX_DEPTH];
    uint32_t first = c->next_seq;
    int any_ool = 0;
    if (!n)
        return first;
    if (n > BL_RPC_MAX_DEPTH) /* never: no ring has more slots (the caller checked) */
        n = BL_RPC_MAX_DEPTH;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t s = first + i, slot = (s - 1) % c->g.depth;
        any_ool |= stage(c->m, &lines[i], bl_rpc_req_buf(&c->g, slot), c->g.buf, s, c->gen,
                         msgs[i].code, msgs[i].p, msgs[i].n) > 0;
        offs[i] = bl_rpc_req_line(&c->g, slot);
    }
    emit(c->m, lines, offs, n, any_ool, BL_P_RPC_REQUEST_PAYLOAD_FENCE);
    wake_server(c);
    c->next_seq += n;
    return first;
}

/* Whether a loaded response line answers request s. */
static int answers(const bl_rpc_client *c, const bl_rpc_line *ln, uint32_t s)
{
    return ln->seq == s && ln->gen == c->gen && bl_record_sealed(ln, sizeof(*ln));
}

/* Load the response lines of requests s.. s+n-1 after one invalidate pass and one fence. */
static void fetch_responses(bl_rpc_client *c, uint32_t s, uint32_t n, bl_rpc_line *out)
{
    bl_mem *m = c->m;
    uint32_t first = (s - 1) % c->g.depth, run = c->g.depth - first < n ? c->g.depth - first : n;
    if (BL_STEP(RPC_RESPONSE_INVALIDATE)) {
        m->ops->invalidate(m, bl_rpc_resp_line(&c->g, first), (size_t)run * BL_LINE);
        if (n > run)
            m->ops->invalidate(m, bl_rpc_resp_line(&c->g, 0), (size_t)(n - run) * BL_LINE);
    }
    if (BL_STEP(RPC_RESPONSE_MFENCE))
        m->ops->mfence(m);
    for (uint32_t i = 0; i < n; i++)
        m->ops->load(m, bl_rpc_resp_line(&c->g, (first + i) % c->g.depth), &out[i], BL_LINE);
}

/* How many of the n lines loaded for requests from done_seq on answer them, in order. */
static uint32_t answered(const bl_rpc_client *c, const bl_rpc_line *lines, uint32_t n)
{
    uint32_t ready = 0;
    while (ready < n && answers(c, &lines[ready], c->done_seq + ready))
        ready++;
    return ready;
}

/* Whether the oldest request in flight has its answer. */
static int oldest_answered(bl_rpc_client *c)
{
    bl_rpc_line ln;
    fetch_responses(c, c->done_seq, 1, &ln);
    return answers(c, &ln, c->done_seq);
}

/* Sleep (let go first) until a response may be there or left ns pass: futex or nap. */
static void client_sleep(bl_rpc_client *c, backoff *b, uint64_t left)
{
    if (!c->wait.wake || !c->wait.futex_ok) {
        nap(b, &c->stats, left);
        return;
    }
    atomic_uint *flag = wake_word(c->m, c->g.base + BL_RPC_CLIENT_WAKE);
    atomic_uint *counter = wake_word(c->m, c->g.base + BL_RPC_SERVER_WAKE);
    uint32_t key = announce(flag, counter);
    if (!oldest_answered(c))
        futex_sleep(&c->wait, &c->stats, counter, key,
                    c->wait.sleep_ns < left ? c->wait.sleep_ns : left);
    atomic_store(flag, 0);
}

/* One step of a client wait with nothing new: spin, yield or sleep (letting go first). */
static void client_wait_step(bl_rpc_client *c, const bl_rpc_hooks *h, backoff *b, uint64_t now,
                             uint64_t left)
{
    int step = backoff_step(b, &c->wait, &c->stats, now, c->wait.wake && c->wait.futex_ok);
    if (step != STEP_SPIN || now - b->since >= GIL_SPIN_NS)
        h->let_go(h->ctx);
    if (step == STEP_SPIN) {
        cpu_relax();
    } else if (step == STEP_YIELD) {
        COUNT(c->stats.yields);
        sched_yield();
    } else {
        client_sleep(c, b, left);
    }
}

/*
 * Wait until the oldest of n (<= BL_RPC_WINDOW) requests from done_seq on is
 * answered: returns how many are, in order, their lines in lines[]; 0 at the
 * deadline; -1 when stopping.  The caller takes the answers and advances
 * done_seq past them.
 */
int bl_rpc_client_wait(bl_rpc_client *c, uint32_t n, bl_rpc_line *lines, uint64_t deadline,
                       const bl_rpc_hooks *h)
{
    backoff b;
    backoff_start(&b, bl_rpc_now_ns(), 0);
    if (n > BL_RPC_WINDOW)
        n = BL_RPC_WINDOW;
    for (;;) {
        fetch_responses(c, c->done_seq, n, lines);
        uint32_t ready = answered(c, lines, n);
        if (ready)
            return (int)ready;
        uint64_t now = bl_rpc_now_ns();
        if (h->stopping(h->ctx))
            return -1;
        if (now >= deadline)
            return 0;
        client_wait_step(c, h, &b, now, deadline - now);
    }
}

/* Load the out-of-line payload of the answer to done_seq into out; 0, or -1 if it is torn. */
int bl_rpc_client_payload(bl_rpc_client *c, const bl_rpc_line *ln, void *out)
{
    return payload_in(c->m, ln, bl_rpc_resp_buf(&c->g, (c->done_seq - 1) % c->g.depth), out, 0);
}

/*
 * Keep depth requests (op, an inline payload) in flight for duration_ns, all
 * in C (a transport benchmark); the ring must be idle.  Returns the requests
 * completed, or -1 when stopping; the server stopped answering when
 * next_seq != done_seq afterwards.
 */
int64_t bl_rpc_client_pump(bl_rpc_client *c, uint16_t op, const void *p, size_t n,
                           uint32_t depth, uint64_t duration_ns, const bl_rpc_hooks *h)
{
    bl_mem *m = c->m;
    bl_rpc_line lines[BL_RPC_MAX_DEPTH], resp[BL_RPC_WINDOW];
    size_t offs[BL_RPC_MAX_DEPTH];
    uint64_t done = 0, end = bl_rpc_now_ns() + duration_ns, last_progress = bl_rpc_now_ns();
    backoff b;
    backoff_start(&b, last_progress, 0);
    while (!h->stopping(h->ctx)) {
        uint64_t t = bl_rpc_now_ns();
        uint32_t k = 0, room = t < end ? depth - (c->next_seq - c->done_seq) : 0;
        for (; k < room; k++) {
            uint32_t s = c->next_seq + k;
            stage(m, &lines[k], 0, 0, s, c->gen, op, p, n);
            offs[k] = bl_rpc_req_line(&c->g, (s - 1) % c->g.depth);
        }
        if (k) {
            emit(m, lines, offs, k, 0, BL_P_RPC_REQUEST_PAYLOAD_FENCE);
            wake_server(c);
        }
        c->next_seq += k;
        /* one window of answers per turn: requests refill as answers come (see scan_ring) */
        uint32_t inflight = c->next_seq - c->done_seq;
        uint32_t want = inflight < BL_RPC_WINDOW ? inflight : BL_RPC_WINDOW;
        fetch_responses(c, c->done_seq, want, resp);
        uint32_t ready = answered(c, resp, want);
        c->done_seq += ready;
        done += ready;
        if (t >= end && c->next_seq == c->done_seq)
            return (int64_t)done;
        if (ready || k) {
            last_progress = t;
            backoff_start(&b, t, 0);
        } else if (t - last_progress > PUMP_GIVE_UP_NS) {
            return (int64_t)done; /* the server stopped answering */
        } else {
            client_wait_step(c, h, &b, t, last_progress + PUMP_GIVE_UP_NS - t);
        }
    }
    return -1;
}

/* ---------------------------------------------------------------- server */

/* Set up a server over nrings rings of ring_bytes from area_off (checked by the caller);
 * -1 when out of memory (then s is unchanged).  s starts zeroed or from an earlier init. */
int bl_rpc_server_init(bl_rpc_server *s, bl_mem *m, size_t area_off, size_t ring_bytes,
                       uint32_t nrings)
{
    bl_rpc_ring_state *rings = calloc(nrings, sizeof(*rings));
    if (!rings)
        return -1;
    free(s->rings);
    s->rings = rings;
    s->m = m;
    s->area_off = area_off, s->ring_bytes = ring_bytes, s->nrings = nrings;
    s->nactive = s->nwake = 0;
    s->doorbell = doorbell_fits(m->size, area_off, ring_bytes * nrings);
    s->wait = wait_cfg(SERVER_SPIN_NS, 1);
    s->torn_ns = TORN_PATIENCE_NS;
    if (s->doorbell) /* a server that died asleep left its announcement behind */
        atomic_store(wake_word(m, BL_RPC_DOORBELL), 0);
    return 0;
}

/* Free the ring table. */
void bl_rpc_server_free(bl_rpc_server *s)
{
    free(s->rings);
    s->rings = NULL;
}

/* Offset of ring idx of the server's area. */
size_t bl_rpc_server_ring_base(const bl_rpc_server *s, uint32_t idx)
{
    return s->area_off + (size_t)idx * s->ring_bytes;
}

/* Stop counting ring idx among the active (and wake-up) rings: its client is gone. */
void bl_rpc_server_clear_ring(bl_rpc_server *s, uint32_t idx)
{
    bl_rpc_ring_state *r = &s->rings[idx];
    if (r->active)
        s->nactive--, s->nwake -= r->wake != 0;
    r->active = 0;
}

/* Start serving ring idx (its geometry checked by the caller) from sequence number head. */
void bl_rpc_server_set_ring(bl_rpc_server *s, uint32_t idx, uint32_t gen, uint32_t depth,
                            uint32_t head, int wake)
{
    bl_rpc_server_clear_ring(s, idx);
    bl_rpc_ring g = bl_rpc_ring_at(bl_rpc_server_ring_base(s, idx), s->ring_bytes, depth);
    s->rings[idx] = (bl_rpc_ring_state){g, 1, gen, head ? head : 1, wake, 0, 0};
    s->nactive++, s->nwake += wake != 0;
}

/*
 * The sequence number to serve next on a ring found in the pool (a restarted
 * server; geometry checked by the caller): the oldest request of generation
 * gen without its response, else the one after the newest request, else
 * first_seq.
 */
uint64_t bl_rpc_server_recover_head(bl_rpc_server *s, uint32_t idx, uint32_t gen, uint32_t depth,
                                    uint32_t first_seq)
{
    bl_mem *m = s->m;
    bl_rpc_ring g = {bl_rpc_server_ring_base(s, idx), depth, 0};
    bl_rpc_line req[BL_RPC_MAX_DEPTH], resp[BL_RPC_MAX_DEPTH];
    m->ops->invalidate(m, bl_rpc_req_line(&g, 0), 2 * (size_t)depth * BL_LINE); /* both arrays */
    m->ops->mfence(m);
    m->ops->load(m, bl_rpc_req_line(&g, 0), req, (size_t)depth * BL_LINE);
    m->ops->load(m, bl_rpc_resp_line(&g, 0), resp, (size_t)depth * BL_LINE);
    uint64_t pending = UINT64_MAX, newest = 0;
    for (uint32_t slot = 0; slot < depth; slot++) {
        if (!line_of(&req[slot], gen) || !req[slot].seq)
            continue;
        newest = req[slot].seq > newest ? req[slot].seq : newest;
        if (!line_of(&resp[slot], gen) || resp[slot].seq != req[slot].seq)
            pending = req[slot].seq < pending ? req[slot].seq : pending;
    }
    return pending != UINT64_MAX ? pending : newest ? newest + 1 : first_seq;
}

/*
 * Answer RESTARTED, without running them, the requests ring idx holds when this
 * server adopts it (after bl_rpc_server_set_ring at the recovered head): the
 * consecutive sealed request lines of its generation from head on.  Each was
 * sent before this server acknowledged the ring (a client sends only once it
 * sees its generation acknowledged), so to a server that is gone.  Stops at the
 * first line that is not one: a line still torn is left to the ordinary scan
 * and its patience.  Returns how many were refused.
 */
uint32_t bl_rpc_server_refuse_pending(bl_rpc_server *s, uint32_t idx)
{
    bl_rpc_ring_state *r = &s->rings[idx];
    bl_mem *m = s->m;
    uint32_t depth = r->g.depth, n = 0;
    m->ops->invalidate(m, bl_rpc_req_line(&r->g, 0), (size_t)depth * BL_LINE);
    m->ops->mfence(m);
    for (; n < depth; n++) {
        bl_rpc_line ln;
        m->ops->load(m, bl_rpc_req_line(&r->g, (r->head - 1) % depth), &ln, BL_LINE);
        if (ln.seq != r->head || ln.gen != r->gen || !bl_record_sealed(&ln, sizeof(ln)))
            break;
        bl_rpc_server_reject(s, idx, r->head, BL_RPC_RESTARTED,
                             "sent to a server that is gone; not run: send it again");
        r->head++;
    }
    return n;
}

/*
 * Whether request seq of a ring just adopted is there with no answer, or answered
 * RESTARTED: either way its caller never learned what a server that ran it before dying
 * granted (GRANTS NOBODY LEARNED, above).  A request line of another seq means its caller
 * went on past seq, which it does only once seq is answered.
 */
int bl_rpc_server_unanswered(bl_rpc_server *s, uint32_t idx, uint32_t seq)
{
    bl_rpc_ring_state *r = &s->rings[idx];
    bl_mem *m = s->m;
    uint32_t slot = (seq - 1) % r->g.depth;
    bl_rpc_line req, resp;
    m->ops->invalidate(m, bl_rpc_req_line(&r->g, slot), BL_LINE);
    m->ops->invalidate(m, bl_rpc_resp_line(&r->g, slot), BL_LINE);
    m->ops->mfence(m);
    m->ops->load(m, bl_rpc_req_line(&r->g, slot), &req, BL_LINE);
    m->ops->load(m, bl_rpc_resp_line(&r->g, slot), &resp, BL_LINE);
    if (!seq || !line_of(&req, r->gen) || req.seq != seq)
        return 0;
    return !line_of(&resp, r->gen) || resp.seq != seq || resp.code == BL_RPC_RESTARTED;
}

/* After responses on ring r are visible: wake its client if it sleeps on our kernel. */
static void wake_client(bl_rpc_server *s, bl_rpc_ring_state *r)
{
    if (!r->wake)
        return;
    wake_sleeper(&s->wait, &s->stats, wake_word(s->m, r->g.base + BL_RPC_CLIENT_WAKE),
                 wake_word(s->m, r->g.base + BL_RPC_SERVER_WAKE));
}

/* After a batch of responses (entries on rings idx[0..n), stride bytes apart): wake each
 * client once. */
static void wake_clients(bl_rpc_server *s, const uint32_t *idx, size_t n, size_t stride)
{
    uint64_t batch = ++s->batches;
    for (size_t i = 0; i < n; i++) {
        bl_rpc_ring_state *r = &s->rings[*(const uint32_t *)((const char *)idx + i * stride)];
        if (r->marked != batch) {
            r->marked = batch;
            wake_client(s, r);
        }
    }
}

/* Answer request seq of ring idx at once with a transport error status. */
void bl_rpc_server_reject(bl_rpc_server *s, uint32_t idx, uint32_t seq, uint16_t status,
                          const char *why)
{
    bl_rpc_ring_state *r = &s->rings[idx];
    bl_rpc_line ln;
    uint32_t slot = (seq - 1) % r->g.depth;
    stage(s->m, &ln, bl_rpc_resp_buf(&r->g, slot), r->g.buf, seq, r->gen, status, why,
          strlen(why));
    size_t off = bl_rpc_resp_line(&r->g, slot);
    emit(s->m, &ln, &off, 1, 0, BL_P_RPC_RESPONSE_PAYLOAD_FENCE);
    wake_client(s, r);
    s->rejected++;
}

/* Collect the consecutive new requests of one window of a ring, up to room; no GIL needed. */
static int scan_window(bl_rpc_server *s, uint32_t idx, bl_rpc_request *out, int room)
{
    bl_rpc_ring_state *r = &s->rings[idx];
    bl_mem *m = s->m;
    uint32_t depth = r->g.depth, window = depth < BL_RPC_WINDOW ? depth : BL_RPC_WINDOW;
    if (window > (uint32_t)room)
        window = (uint32_t)room;
    uint32_t first = (r->head - 1) % depth, run = depth - first < window ? depth - first : window;
    if (BL_STEP(RPC_REQUEST_INVALIDATE)) {
        m->ops->invalidate(m, bl_rpc_req_line(&r->g, first), (size_t)run * BL_LINE);
        if (window > run)
            m->ops->invalidate(m, bl_rpc_req_line(&r->g, 0), (size_t)(window - run) * BL_LINE);
    }
    if (BL_STEP(RPC_REQUEST_MFENCE))
        m->ops->mfence(m);
    int got = 0;
    for (uint32_t i = 0; i < window; i++) {
        bl_rpc_request *q = &out[got];
        uint32_t slot = (first + i) % depth;
        m->ops->load(m, bl_rpc_req_line(&r->g, slot), &q->line, BL_LINE);
        if (q->line.seq != r->head || q->line.gen != r->gen) {
            r->bad_since = 0;
            break;
        }
        uint32_t seq = r->head;
        if (!bl_record_sealed(&q->line, sizeof(q->line))) {
            uint64_t t = bl_rpc_now_ns();
            if (!r->bad_since)
                r->bad_since = t;
            if (t - r->bad_since < s->torn_ns)
                break; /* a client between the stores of this line: look again later */
            bl_rpc_server_reject(s, idx, seq, BL_RPC_CORRUPT, "request line corrupt");
        } else if (q->line.len > ((q->line.flags & BL_RPC_OOL) ? r->g.buf : BL_RPC_INLINE)) {
            bl_rpc_server_reject(s, idx, seq, BL_RPC_BAD_LENGTH,
                                 "request length impossible for this ring");
        } else {
            q->ring = idx, q->seq = seq;
            got++;
        }
        r->bad_since = 0;
        r->head++;
    }
    return got;
}

/*
 * Collect the consecutive new requests of one ring: one window per look.  A
 * server that found work looks again at once (no sleep in between), so taking
 * a window at a time costs no wake-ups, and it keeps client and server working
 * side by side: taking everything queued turns a deep pipeline into lock-step
 * bursts in which each end waits for the other (half the throughput at depth
 * 128 on two cores).
 */
static int scan_ring(bl_rpc_server *s, uint32_t idx, bl_rpc_request *out, int room)
{
    return scan_window(s, idx, out, room);
}

/* Scan every active ring once; returns the requests collected. */
static int scan_all(bl_rpc_server *s, bl_rpc_request *batch, int max_batch)
{
    int got = 0;
    for (uint32_t i = 0; i < s->nrings && got < max_batch; i++)
        if (s->rings[i].active)
            got += scan_ring(s, i, batch + got, max_batch - got);
    return got;
}

/* Sleep until a request may have come (futex on the doorbell, or a nap); returns any found. */
static int server_sleep(bl_rpc_server *s, backoff *b, bl_rpc_request *batch, int max_batch,
                        uint64_t left)
{
    if (!s->doorbell || !s->nwake || !s->wait.futex_ok) {
        nap(b, &s->stats, left);
        return 0;
    }
    atomic_uint *flag = wake_word(s->m, BL_RPC_DOORBELL);
    atomic_uint *counter = wake_word(s->m, BL_RPC_DOORBELL_COUNT);
    uint32_t key = announce(flag, counter);
    int got = scan_all(s, batch, max_batch);
    if (!got) {
        /* clients on other kernels cannot ring: sleep only as long as a nap then */
        uint64_t ns = s->nwake == s->nactive ? s->wait.sleep_ns : next_nap(b, left);
        futex_sleep(&s->wait, &s->stats, counter, key, ns < left ? ns : left);
    }
    atomic_store(flag, 0);
    return got;
}

/*
 * Poll every active ring until a batch arrives, bl_rpc_server_stop(), stopping,
 * or timeout_ns pass (run it without the GIL); returns the requests collected
 * into batch.  A request whose payload is out of line still has it in its
 * slot's buffer: bl_rpc_server_payload loads it.
 */
int bl_rpc_server_gather(bl_rpc_server *s, bl_rpc_request *batch, int max_batch,
                         uint64_t timeout_ns, const bl_rpc_hooks *h)
{
    uint64_t start = bl_rpc_now_ns(), deadline = start + timeout_ns;
    backoff b;
    backoff_start(&b, start, s->idle);
    for (;;) {
        int got = scan_all(s, batch, max_batch);
        if (got || atomic_load(&s->stop) || h->stopping(h->ctx)) {
            s->idle = 0;
            return got;
        }
        uint64_t now = bl_rpc_now_ns();
        if (now >= deadline) {
            s->idle = 1;
            return 0;
        }
        int can_wake = s->doorbell && s->nwake && s->wait.futex_ok;
        int step = backoff_step(&b, &s->wait, &s->stats, now, can_wake);
        if (step == STEP_SPIN) {
            cpu_relax();
        } else if (step == STEP_YIELD) {
            COUNT(s->stats.yields);
            sched_yield();
        } else if ((got = server_sleep(s, &b, batch, max_batch, deadline - now))) {
            s->idle = 0;
            return got;
        }
    }
}

/* Load a gathered request's out-of-line payload into out; 0, or -1 if it is torn. */
int bl_rpc_server_payload(bl_rpc_server *s, const bl_rpc_request *q, void *out)
{
    const bl_rpc_ring_state *r = &s->rings[q->ring];
    return payload_in(s->m, &q->line, bl_rpc_req_buf(&r->g, (q->seq - 1) % r->g.depth), out, 1);
}

/*
 * Write n answers as one batch (one or two fences; none for an empty batch)
 * and wake their clients; the caller checked that each answers an outstanding
 * request and fits its ring (bl_rpc_fits).  Returns 0, or -1 when out of
 * memory (nothing written).
 */
int bl_rpc_server_respond(bl_rpc_server *s, const bl_rpc_reply *replies, size_t n)
{
    if (!n)
        return 0;
    bl_rpc_line *lines = malloc(n * sizeof(*lines));
    size_t *offs = malloc(n * sizeof(*offs));
    int any_ool = 0;
    if (!lines || !offs) {
        free(lines);
        free(offs);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        const bl_rpc_reply *a = &replies[i];
        bl_rpc_ring_state *r = &s->rings[a->ring];
        uint32_t slot = (a->seq - 1) % r->g.depth;
        any_ool |= stage(s->m, &lines[i], bl_rpc_resp_buf(&r->g, slot), r->g.buf, a->seq, r->gen,
                         a->status, a->p, a->n) > 0;
        offs[i] = bl_rpc_resp_line(&r->g, slot);
    }
    emit(s->m, lines, offs, n, any_ool, BL_P_RPC_RESPONSE_PAYLOAD_FENCE);
    wake_clients(s, &replies[0].ring, n, sizeof(*replies));
    s->served += (uint64_t)n;
    free(lines);
    free(offs);
    return 0;
}

/*
 * Answer every request with its own payload until duration_ns pass, stop, or
 * stopping: the transport alone, all in C (run it without the GIL).  Returns
 * the requests answered, or -1 when out of memory.
 */
int64_t bl_rpc_server_serve_echo(bl_rpc_server *s, uint64_t duration_ns, const bl_rpc_hooks *h)
{
    bl_rpc_request batch[ECHO_BATCH];
    bl_rpc_line lines[ECHO_BATCH];
    size_t offs[ECHO_BATCH], max_buf = 0;
    for (uint32_t i = 0; i < s->nrings; i++)
        if (s->rings[i].g.buf > max_buf)
            max_buf = s->rings[i].g.buf;
    uint8_t *tmp = malloc(max_buf + 1);
    if (!tmp)
        return -1;
    uint64_t answered = 0, end = bl_rpc_now_ns() + duration_ns;
    bl_mem *m = s->m;
    while (!atomic_load(&s->stop) && !h->stopping(h->ctx) && bl_rpc_now_ns() < end) {
        int got = bl_rpc_server_gather(s, batch, ECHO_BATCH, ECHO_POLL_NS, h);
        int any_ool = 0, k = 0;
        for (int i = 0; i < got; i++) {
            bl_rpc_request *q = &batch[i];
            bl_rpc_ring_state *r = &s->rings[q->ring];
            uint32_t slot = (q->seq - 1) % r->g.depth;
            const void *p = q->line.data;
            if (q->line.flags & BL_RPC_OOL) {
                if (bl_rpc_server_payload(s, q, tmp) < 0) {
                    bl_rpc_server_reject(s, q->ring, q->seq, BL_RPC_CORRUPT,
                                         "request payload corrupt");
                    continue;
                }
                p = tmp;
            }
            any_ool |= stage(m, &lines[k], bl_rpc_resp_buf(&r->g, slot), r->g.buf, q->seq, r->gen,
                             0, p, q->line.len) > 0;
            offs[k++] = bl_rpc_resp_line(&r->g, slot);
        }
        if (k) {
            emit(m, lines, offs, (size_t)k, any_ool, BL_P_RPC_RESPONSE_PAYLOAD_FENCE);
            wake_clients(s, &batch[0].ring, (size_t)k, sizeof(bl_rpc_request));
        }
        answered += (uint64_t)k;
    }
    free(tmp);
    s->served += answered;
    return (int64_t)answered;
}

/* Make a running gather or serve_echo return promptly (thread-safe); `wake`: the mapping
 * is attached, so a server asleep on the doorbell can be woken too. */
void bl_rpc_server_stop(bl_rpc_server *s, int wake)
{
    atomic_store(&s->stop, 1);
    if (wake && s->doorbell) {
        atomic_uint *counter = wake_word(s->m, BL_RPC_DOORBELL_COUNT);
        atomic_fetch_add(counter, 1);
        syscall(SYS_futex, counter, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    }
}
