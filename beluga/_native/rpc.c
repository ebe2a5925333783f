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
 * A restarted server finds each ring's position in the lines themselves
 * (recover_head): a request with no matching response is still pending and is
 * served again, so requests are at-least-once across a restart.  Python never
 * parses a slot line; rpc_pack_line / rpc_parse_line give tests the format.
 *
 * The server loop (poll) runs without the GIL and returns a batch to Python;
 * serve_echo answers every request in C, to measure the transport alone.
 * Every loop that runs without the GIL does so inside a section of the
 * Memory (module.c), and ends early when the pool is being closed.
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
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "beluga_native.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() __asm__ __volatile__("" ::: "memory")
#endif

typedef struct {
    uint32_t seq;
    uint16_t code; /* request: op; response: status */
    uint16_t flags;
    uint32_t len;
    uint32_t gen;
    uint8_t data[BL_RPC_INLINE];
    uint32_t payload_crc;
    uint32_t crc;
} rpc_line;

_Static_assert(sizeof(rpc_line) == BL_LINE, "an RPC message is one cache line");

#define RPC_OOL 1u
#define ST_BAD_LENGTH 0xfff0
#define ST_CORRUPT 0xfff1
#define SCAN_WINDOW 32u
#define BAD_NS 1000000ull /* a torn line at head this long is answered as corrupt */

#define GIL_SPIN_NS 5000ull        /* a client polls this long before it drops the GIL */
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

static const char CLIENT_CLOSED[] =
    "the pool this RPC client uses was closed (Pool.close()) while it waited; the request may or "
    "may not have been served: attach the pool and connect again";
static const char SERVER_CLOSED[] =
    "the pool was closed (Pool.close()) while this server polled it; close the RpcServer "
    "before its pool";

typedef struct {
    size_t base;
    uint32_t depth;
    size_t buf;
} ring_geo;

/* Bytes of each slot buffer for a ring of ring_bytes with depth slots (0: none fit). */
size_t bl_rpc_buf_size(size_t ring_bytes, uint32_t depth)
{
    size_t fixed = BL_RPC_HEAD + 2 * (size_t)depth * BL_LINE;
    if (!depth || ring_bytes < fixed)
        return 0;
    return ((ring_bytes - fixed) / (2 * (size_t)depth)) & ~(size_t)(BL_LINE - 1);
}

/* Offsets of a slot's request line, response line, request and response buffers. */
static size_t req_line(const ring_geo *g, uint32_t slot) { return g->base + BL_RPC_HEAD + (size_t)slot * BL_LINE; }
static size_t resp_line(const ring_geo *g, uint32_t slot)
{
    return g->base + BL_RPC_HEAD + ((size_t)g->depth + slot) * BL_LINE;
}
static size_t req_buf(const ring_geo *g, uint32_t slot)
{
    return g->base + BL_RPC_HEAD + 2 * (size_t)g->depth * BL_LINE + (size_t)slot * g->buf;
}
static size_t resp_buf(const ring_geo *g, uint32_t slot) { return req_buf(g, g->depth) + (size_t)slot * g->buf; }

/* Monotonic clock in ns. */
static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Seconds (from Python) to ns, 0 for negatives. */
static uint64_t ns_of(double s) { return s > 0 ? (uint64_t)(s * 1e9) : 0; }

/* ---------------------------------------------------------------- waiting */

/* How one end waits (tunable from Python), and counters the tests read. */
typedef struct {
    uint64_t spin_ns;    /* spin this long before yielding and sleeping */
    uint64_t sleep_ns;   /* longest futex sleep before polling again */
    int wake;            /* (client) the server shares our kernel: use the wake lines */
    int futex_ok;        /* cleared at the first futex error: timed naps only */
    uint64_t calm_until; /* the core is contended: sleep at once until then */
    uint64_t calm_ns;    /* length of the next calm spell */
    uint64_t next_check; /* when to look at the thread's contention again */
    uint64_t checked;    /* when it last looked (0: not while spinning) */
    uint64_t stalled;    /* its time waiting for a core then */
    uint64_t turns;      /* its turns on a core then */
    long tid;            /* the thread that looked */
} wait_cfg;

typedef struct {
    _Atomic uint64_t yields, naps, sleeps, woken, timeouts, wakes, futex_errors, stalled;
} wait_stats;

/* Count one event (read by other threads; one writer at a time). */
#define COUNT(x) atomic_store_explicit(&(x), atomic_load_explicit(&(x), memory_order_relaxed) + 1, \
                                       memory_order_relaxed)

typedef struct {
    uint64_t since; /* when this wait began (the spin budget runs from here) */
    uint64_t nap;   /* length of the next timed nap */
    unsigned yields;
} backoff;

enum { STEP_SPIN, STEP_YIELD, STEP_SLEEP };

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
static int contended(wait_cfg *c, wait_stats *st, uint64_t now, uint64_t spun)
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
static int backoff_step(backoff *b, wait_cfg *c, wait_stats *st, uint64_t now, int can_wake)
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
static void nap(backoff *b, wait_stats *st, uint64_t left)
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
static void futex_sleep(wait_cfg *c, wait_stats *st, atomic_uint *w, uint32_t key, uint64_t ns)
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
static void wake_sleeper(wait_cfg *c, wait_stats *st, atomic_uint *flag, atomic_uint *w)
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

/* Whether the doorbell lines lie in the mapping and outside [off, off + n). */
static int doorbell_fits(MemoryObject *mem, size_t off, size_t n)
{
    size_t end = BL_RPC_DOORBELL_COUNT + BL_LINE;
    return mem->mem.size >= end && (off >= end || off + n <= BL_RPC_DOORBELL);
}

/* wait_stats as a dict. */
static PyObject *stats_dict(wait_stats *st)
{
    return Py_BuildValue("{sKsKsKsKsKsKsKsK}", "yields", (unsigned long long)st->yields, "naps",
                         (unsigned long long)st->naps, "sleeps", (unsigned long long)st->sleeps,
                         "woken", (unsigned long long)st->woken, "timeouts",
                         (unsigned long long)st->timeouts, "wakes", (unsigned long long)st->wakes,
                         "futex_errors", (unsigned long long)st->futex_errors, "stalled",
                         (unsigned long long)st->stalled);
}

/* Set a duration attribute from seconds within [lo, hi]; else raise ValueError(msg). */
static int set_seconds(uint64_t *dst, PyObject *v, double lo, double hi, const char *msg)
{
    double s = v ? PyFloat_AsDouble(v) : -1.0;
    if (s == -1.0 && PyErr_Occurred())
        return -1;
    if (!v || !(s >= lo && s <= hi)) {
        PyErr_SetString(PyExc_ValueError, msg);
        return -1;
    }
    *dst = ns_of(s);
    return 0;
}

/* CRC32C of a line's first 60 bytes. */
static uint32_t line_crc(const rpc_line *ln) { return ~bl_crc32c(~0u, ln, offsetof(rpc_line, crc)); }

/* Fill a line; a payload too long for it goes to buf_off first (no fence here). */
static int stage(bl_mem *m, rpc_line *ln, size_t buf_off, size_t buf_size, uint32_t seq, uint32_t gen,
                 uint16_t code, const void *p, size_t n)
{
    memset(ln, 0, sizeof(*ln));
    ln->seq = seq, ln->gen = gen, ln->code = code, ln->len = (uint32_t)n;
    if (n > BL_RPC_INLINE) {
        if (n > buf_size)
            return -1;
        m->ops->nt_store(m, buf_off, p, n);
        ln->flags = RPC_OOL;
        ln->payload_crc = ~bl_crc32c(~0u, p, n);
    } else if (n) {
        memcpy(ln->data, p, n);
    }
    ln->crc = line_crc(ln);
    return ln->flags & RPC_OOL;
}

/* Store staged lines with non-temporal stores, fencing out-of-line payloads first
 * (payload_point: that fence's sabotage point, the client's or the server's). */
static void emit(bl_mem *m, const rpc_line *lines, const size_t *offs, size_t n, int any_ool,
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
static int payload_in(bl_mem *m, const rpc_line *ln, size_t buf_off, void *out, int server)
{
    if (BL_STEP_ID(server ? BL_P_RPC_REQUEST_BUFFER_INVALIDATE : BL_P_RPC_RESPONSE_BUFFER_INVALIDATE))
        m->ops->invalidate(m, buf_off, ln->len);
    if (BL_STEP_ID(server ? BL_P_RPC_REQUEST_BUFFER_MFENCE : BL_P_RPC_RESPONSE_BUFFER_MFENCE))
        m->ops->mfence(m);
    m->ops->load(m, buf_off, out, ln->len);
    return ~bl_crc32c(~0u, out, ln->len) == ln->payload_crc ? 0 : -1;
}

/* Load a message's payload into a new bytes object; NULL with no error set if corrupt. */
static PyObject *payload_of(bl_mem *m, const rpc_line *ln, size_t buf_off, int server)
{
    if (!(ln->flags & RPC_OOL))
        return PyBytes_FromStringAndSize((const char *)ln->data, ln->len);
    PyObject *b = PyBytes_FromStringAndSize(NULL, ln->len);
    if (b && payload_in(m, ln, buf_off, PyBytes_AS_STRING(b), server) < 0)
        Py_CLEAR(b);
    return b;
}

/* Check that a ring of depth slots lies inside the mapping. */
static int ring_fits(MemoryObject *mem, size_t base, size_t ring_bytes, uint32_t depth)
{
    if (!mem->has_view)
        return !!bl_fail(bl_rpc_error, "the pool's Memory was released");
    if (!depth || depth > BL_RPC_MAX_DEPTH)
        return !!bl_fail(bl_rpc_error, "ring depth must be 1..%u, not %u", BL_RPC_MAX_DEPTH, depth);
    if (ring_bytes < BL_RPC_HEAD + 2 * (size_t)depth * BL_LINE || base % BL_LINE ||
        base > mem->mem.size || ring_bytes > mem->mem.size - base)
        return !!bl_fail(bl_rpc_error, "a %u-slot ring does not fit [%zu, +%zu) of the pool", depth,
                         base, ring_bytes);
    return 1;
}

/* ---------------------------------------------------------------- client */

typedef struct {
    PyObject_HEAD
    MemoryObject *mem;
    ring_geo g;
    uint32_t gen;
    uint32_t next_seq; /* sequence number of the next submit */
    uint32_t done_seq; /* oldest sequence number not yet completed */
    int doorbell;      /* the server's doorbell lies in this mapping */
    wait_cfg wait;
    wait_stats stats;
} ClientObject;

/* RingClient(memory, ring_offset, ring_bytes, depth, gen, first_seq=1, *, wake=False) */
static int Client_init(ClientObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"memory", "ring_offset", "ring_bytes", "depth", "gen", "first_seq",
                             "wake", NULL};
    PyObject *mem;
    unsigned long long base, ring_bytes;
    unsigned int depth, gen, first = 1;
    int wake = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!KKII|I$p", kwlist, &BlMemoryType, &mem, &base,
                                     &ring_bytes, &depth, &gen, &first, &wake))
        return -1;
    MemoryObject *mo = (MemoryObject *)mem;
    if (!ring_fits(mo, base, ring_bytes, depth))
        return -1;
    Py_INCREF(mem);
    Py_XSETREF(self->mem, mo);
    self->g = (ring_geo){base, depth, bl_rpc_buf_size(ring_bytes, depth)};
    self->gen = gen;
    self->next_seq = self->done_seq = first ? first : 1;
    self->doorbell = doorbell_fits(mo, base, ring_bytes);
    self->wait = (wait_cfg){.spin_ns = CLIENT_SPIN_NS, .sleep_ns = SLEEP_NS, .wake = wake,
                            .futex_ok = 1, .calm_ns = CALM_MIN_NS};
    atomic_store(wake_word(&mo->mem, base + BL_RPC_CLIENT_WAKE), 0); /* no stale "asleep" */
    return 0;
}

/* Dealloc: drop the Memory reference. */
static void Client_dealloc(ClientObject *self)
{
    Py_XDECREF(self->mem);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Check the memory is attached before touching the ring. */
static int client_ok(ClientObject *self)
{
    if (self->mem && self->mem->has_view)
        return 1;
    bl_fail(bl_rpc_error, "the pool this RPC client used was closed; connect again");
    return 0;
}

/* After new requests are visible: wake the server if it sleeps on our kernel. */
static void wake_server(ClientObject *self)
{
    if (!self->wait.wake || !self->doorbell)
        return;
    bl_mem *m = &self->mem->mem;
    wake_sleeper(&self->wait, &self->stats, wake_word(m, BL_RPC_DOORBELL),
                 wake_word(m, BL_RPC_DOORBELL_COUNT));
}

/* submit_many([(op, payload), ...]) -> first sequence number; one doorbell batch. */
static PyObject *Client_submit_many(ClientObject *self, PyObject *list)
{
    if (!client_ok(self))
        return NULL;
    PyObject *seq = PySequence_Fast(list, "submit_many takes a sequence of (op, payload)");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    uint32_t inflight = self->next_seq - self->done_seq;
    if ((size_t)n > self->g.depth - inflight) {
        Py_DECREF(seq);
        return bl_fail(bl_rpc_error, "%zd requests do not fit: %u of %u slots are in flight", n,
                       inflight, self->g.depth);
    }
    rpc_line *lines = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(rpc_line));
    size_t *offs = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(size_t));
    bl_mem *m = &self->mem->mem;
    int any_ool = 0;
    PyObject *result = NULL;
    if (!lines || !offs) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned int op;
        Py_buffer p;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "Iy*", &op, &p))
            goto done;
        uint32_t s = self->next_seq + (uint32_t)i, slot = (s - 1) % self->g.depth;
        int r = op > 0xffff ? -2
                            : stage(m, &lines[i], req_buf(&self->g, slot), self->g.buf, s, self->gen,
                                    (uint16_t)op, p.buf, (size_t)p.len);
        Py_ssize_t len = p.len;
        PyBuffer_Release(&p);
        if (r == -2) {
            bl_fail(PyExc_ValueError, "op %u does not fit 16 bits", op);
            goto done;
        }
        if (r < 0) {
            bl_fail(bl_rpc_error, "a %zd-byte request exceeds this ring's %zu-byte slot buffer; "
                    "send less per call or connect with a smaller depth", len, self->g.buf);
            goto done;
        }
        any_ool |= r;
        offs[i] = req_line(&self->g, slot);
    }
    emit(m, lines, offs, (size_t)n, any_ool, BL_P_RPC_REQUEST_PAYLOAD_FENCE);
    if (n)
        wake_server(self);
    result = PyLong_FromUnsignedLong(self->next_seq);
    self->next_seq += (uint32_t)n;
done:
    PyMem_Free(lines);
    PyMem_Free(offs);
    Py_DECREF(seq);
    return result;
}

/* Whether a loaded response line answers request s. */
static int answers(const ClientObject *self, const rpc_line *ln, uint32_t s)
{
    return ln->seq == s && ln->gen == self->gen && ln->crc == line_crc(ln);
}

/* Load the response lines of requests s.. s+n-1 after one invalidate pass and one fence. */
static void fetch_responses(ClientObject *self, uint32_t s, uint32_t n, rpc_line *out)
{
    bl_mem *m = &self->mem->mem;
    uint32_t first = (s - 1) % self->g.depth, run = self->g.depth - first < n ? self->g.depth - first : n;
    if (BL_STEP(RPC_RESPONSE_INVALIDATE)) {
        m->ops->invalidate(m, resp_line(&self->g, first), (size_t)run * BL_LINE);
        if (n > run)
            m->ops->invalidate(m, resp_line(&self->g, 0), (size_t)(n - run) * BL_LINE);
    }
    if (BL_STEP(RPC_RESPONSE_MFENCE))
        m->ops->mfence(m);
    for (uint32_t i = 0; i < n; i++)
        m->ops->load(m, resp_line(&self->g, (first + i) % self->g.depth), &out[i], BL_LINE);
}

/* Whether the oldest request in flight has its answer. */
static int oldest_answered(ClientObject *self)
{
    rpc_line ln;
    fetch_responses(self, self->done_seq, 1, &ln);
    return answers(self, &ln, self->done_seq);
}

/* Sleep (the GIL dropped) until a response may be there or left ns pass: futex or nap. */
static void client_sleep(ClientObject *self, backoff *b, uint64_t left)
{
    if (!self->wait.wake || !self->wait.futex_ok) {
        nap(b, &self->stats, left);
        return;
    }
    bl_mem *m = &self->mem->mem;
    atomic_uint *flag = wake_word(m, self->g.base + BL_RPC_CLIENT_WAKE);
    atomic_uint *counter = wake_word(m, self->g.base + BL_RPC_SERVER_WAKE);
    uint32_t key = announce(flag, counter);
    if (!oldest_answered(self))
        futex_sleep(&self->wait, &self->stats, counter, key,
                    self->wait.sleep_ns < left ? self->wait.sleep_ns : left);
    atomic_store(flag, 0);
}

/* One step of a client wait with nothing new: spin, yield or sleep (dropping the GIL first). */
static void client_wait_step(ClientObject *self, bl_section *sec, backoff *b, uint64_t now,
                             uint64_t left)
{
    int step = backoff_step(b, &self->wait, &self->stats, now, self->wait.wake && self->wait.futex_ok);
    if (step != STEP_SPIN || now - b->since >= GIL_SPIN_NS)
        bl_section_gil(sec, 1);
    if (step == STEP_SPIN) {
        cpu_relax();
    } else if (step == STEP_YIELD) {
        COUNT(self->stats.yields);
        sched_yield();
    } else {
        client_sleep(self, b, left);
    }
}

/* Append (status, payload) of a ready response line to out; -1 on a Python error. */
static int take_response(ClientObject *self, const rpc_line *ln, PyObject *out)
{
    PyObject *payload =
        payload_of(&self->mem->mem, ln, resp_buf(&self->g, (self->done_seq - 1) % self->g.depth), 0);
    if (!payload && PyErr_Occurred())
        return -1;
    PyObject *item = payload ? Py_BuildValue("(IN)", (unsigned)ln->code, payload)
                             : Py_BuildValue("(Iy)", (unsigned)ST_CORRUPT, "response payload corrupt");
    int r = item ? PyList_Append(out, item) : -1;
    Py_XDECREF(item);
    return r;
}

/* complete(n, timeout_s) -> [(status, payload), ...] for up to n oldest requests. */
static PyObject *Client_complete(ClientObject *self, PyObject *args)
{
    unsigned int want;
    double timeout;
    if (!PyArg_ParseTuple(args, "Id", &want, &timeout) || !client_ok(self))
        return NULL;
    uint32_t inflight = self->next_seq - self->done_seq;
    if (want > inflight)
        return bl_fail(bl_rpc_error, "asked to complete %u requests but %u are in flight", want,
                       inflight);
    PyObject *out = PyList_New(0);
    bl_section sec;
    if (!out || bl_section_enter(&sec, self->mem, 0, bl_rpc_error, CLIENT_CLOSED) < 0) {
        Py_XDECREF(out);
        return NULL;
    }
    uint64_t start = now_ns(), deadline = start + ns_of(timeout);
    rpc_line lines[SCAN_WINDOW];
    backoff b;
    int failed = 0, closed = 0;
    backoff_start(&b, start, 0);
    while (PyList_GET_SIZE(out) < (Py_ssize_t)want) {
        uint32_t left = want - (uint32_t)PyList_GET_SIZE(out);
        uint32_t n = left < SCAN_WINDOW ? left : SCAN_WINDOW, ready = 0;
        fetch_responses(self, self->done_seq, n, lines);
        while (ready < n && answers(self, &lines[ready], self->done_seq + ready))
            ready++;
        if (ready) {
            bl_section_gil(&sec, 0);
            for (uint32_t i = 0; i < ready && !failed; i++) {
                failed = take_response(self, &lines[i], out) < 0;
                self->done_seq += !failed;
            }
            if (failed)
                break;
            backoff_start(&b, now_ns(), 0);
            continue;
        }
        uint64_t now = now_ns();
        if ((closed = bl_section_closing(&sec)) || now >= deadline)
            break;
        client_wait_step(self, &sec, &b, now, deadline - now);
    }
    bl_section_leave(&sec);
    if (failed || closed) {
        Py_DECREF(out);
        return closed ? bl_fail(bl_rpc_error, "%s", CLIENT_CLOSED) : NULL;
    }
    return out;
}

/* pump(op, payload, depth, duration_s) -> requests completed: keep depth in flight, in C. */
static PyObject *Client_pump(ClientObject *self, PyObject *args)
{
    unsigned int op, depth;
    Py_buffer p;
    double duration;
    if (!PyArg_ParseTuple(args, "Iy*Id", &op, &p, &depth, &duration))
        return NULL;
    if (!client_ok(self) || op > 0xffff || p.len > BL_RPC_INLINE || !depth ||
        depth > self->g.depth || self->next_seq != self->done_seq) {
        if (!PyErr_Occurred())
            bl_fail(PyExc_ValueError, "pump needs an idle ring, an inline payload (<= %u bytes) "
                    "and 1 <= depth <= %u", BL_RPC_INLINE, self->g.depth);
        PyBuffer_Release(&p);
        return NULL;
    }
    bl_section sec;
    if (bl_section_enter(&sec, self->mem, 1, bl_rpc_error, CLIENT_CLOSED) < 0) {
        PyBuffer_Release(&p);
        return NULL;
    }
    bl_mem *m = &self->mem->mem;
    rpc_line lines[BL_RPC_MAX_DEPTH], resp[SCAN_WINDOW];
    size_t offs[BL_RPC_MAX_DEPTH];
    uint64_t done = 0, end = now_ns() + ns_of(duration), last_progress = now_ns();
    backoff b;
    int closed = 0;
    backoff_start(&b, last_progress, 0);
    while (!(closed = bl_section_closing(&sec))) {
        uint64_t t = now_ns();
        uint32_t k = 0, room = t < end ? depth - (self->next_seq - self->done_seq) : 0;
        for (; k < room; k++) {
            uint32_t s = self->next_seq + k;
            stage(m, &lines[k], 0, 0, s, self->gen, (uint16_t)op, p.buf, (size_t)p.len);
            offs[k] = req_line(&self->g, (s - 1) % self->g.depth);
        }
        if (k) {
            emit(m, lines, offs, k, 0, BL_P_RPC_REQUEST_PAYLOAD_FENCE);
            wake_server(self);
        }
        self->next_seq += k;
        /* one window of answers per turn: requests refill as answers come (see scan_ring) */
        uint32_t inflight = self->next_seq - self->done_seq, ready = 0;
        uint32_t n = inflight < SCAN_WINDOW ? inflight : SCAN_WINDOW;
        fetch_responses(self, self->done_seq, n, resp);
        while (ready < n && answers(self, &resp[ready], self->done_seq + ready))
            ready++;
        self->done_seq += ready;
        done += ready;
        if (t >= end && self->next_seq == self->done_seq)
            break;
        if (ready || k) {
            last_progress = t;
            backoff_start(&b, t, 0);
        } else if (t - last_progress > PUMP_GIVE_UP_NS) {
            break; /* the server stopped answering */
        } else {
            client_wait_step(self, &sec, &b, t, last_progress + PUMP_GIVE_UP_NS - t);
        }
    }
    bl_section_leave(&sec);
    PyBuffer_Release(&p);
    if (closed)
        return bl_fail(bl_rpc_error, "%s", CLIENT_CLOSED);
    if (self->next_seq != self->done_seq)
        return bl_fail(bl_rpc_error, "the server stopped answering during pump (%u in flight)",
                       self->next_seq - self->done_seq);
    return PyLong_FromUnsignedLongLong(done);
}

/* call(op, payload, timeout_s) -> (status, payload) or None if not answered in time. */
static PyObject *Client_call(ClientObject *self, PyObject *args)
{
    unsigned int op;
    Py_buffer p;
    double timeout;
    if (!PyArg_ParseTuple(args, "Iy*d", &op, &p, &timeout))
        return NULL;
    PyObject *req = Py_BuildValue("((Iy#))", op, p.buf, p.len);
    PyBuffer_Release(&p);
    if (!req)
        return NULL;
    PyObject *first = Client_submit_many(self, req);
    Py_DECREF(req);
    if (!first)
        return NULL;
    Py_DECREF(first);
    PyObject *args2 = Py_BuildValue("(Id)", 1u, timeout);
    PyObject *done = args2 ? Client_complete(self, args2) : NULL;
    Py_XDECREF(args2);
    if (!done)
        return NULL;
    PyObject *r = PyList_GET_SIZE(done) ? PyList_GET_ITEM(done, 0) : Py_None;
    Py_INCREF(r);
    Py_DECREF(done);
    return r;
}

/* Properties: next sequence number, slot buffer size, depth. */
static PyObject *Client_get_next_seq(ClientObject *self, void *c)
{
    return PyLong_FromUnsignedLong(self->next_seq);
}
static PyObject *Client_get_buf_size(ClientObject *self, void *c) { return PyLong_FromSize_t(self->g.buf); }
static PyObject *Client_get_depth(ClientObject *self, void *c) { return PyLong_FromUnsignedLong(self->g.depth); }

/* wake: whether waits use the wake lines (the server shares this kernel). */
static PyObject *Client_get_wake(ClientObject *self, void *c) { return PyBool_FromLong(self->wait.wake); }
static int Client_set_wake(ClientObject *self, PyObject *v, void *c)
{
    int on = v ? PyObject_IsTrue(v) : -1;
    if (on < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_AttributeError, "wake cannot be deleted");
        return -1;
    }
    self->wait.wake = on;
    return 0;
}

/* spin_s / sleep_s: how long a wait spins, and the longest futex sleep. */
static PyObject *Client_get_spin(ClientObject *self, void *c) { return PyFloat_FromDouble(1e-9 * (double)self->wait.spin_ns); }
static int Client_set_spin(ClientObject *self, PyObject *v, void *c)
{
    return set_seconds(&self->wait.spin_ns, v, 0, 10, "spin_s must be 0..10 s");
}
static PyObject *Client_get_sleep(ClientObject *self, void *c) { return PyFloat_FromDouble(1e-9 * (double)self->wait.sleep_ns); }
static int Client_set_sleep(ClientObject *self, PyObject *v, void *c)
{
    return set_seconds(&self->wait.sleep_ns, v, 1e-6, 10, "sleep_s must be 1e-6..10 s");
}

/* wait_stats: how waits backed off (yields, naps, futex sleeps and how they ended, wakes sent). */
static PyObject *Client_get_stats(ClientObject *self, void *c) { return stats_dict(&self->stats); }

static PyMethodDef Client_methods[] = {
    {"submit_many", (PyCFunction)Client_submit_many, METH_O,
     "submit_many([(op, payload), ...]) -> first seq"},
    {"complete", (PyCFunction)Client_complete, METH_VARARGS,
     "complete(n, timeout_s) -> [(status, payload)] (fewer on timeout)"},
    {"call", (PyCFunction)Client_call, METH_VARARGS,
     "call(op, payload, timeout_s) -> (status, payload) | None"},
    {"pump", (PyCFunction)Client_pump, METH_VARARGS,
     "pump(op, payload, depth, duration_s) -> completed (transport benchmark)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Client_getset[] = {
    {"next_seq", (getter)Client_get_next_seq, NULL, "sequence number of the next request", NULL},
    {"buf_size", (getter)Client_get_buf_size, NULL, "largest payload per request", NULL},
    {"depth", (getter)Client_get_depth, NULL, "slots in the ring", NULL},
    {"wake", (getter)Client_get_wake, (setter)Client_set_wake,
     "use the wake lines (only when the server shares this kernel)", NULL},
    {"spin_s", (getter)Client_get_spin, (setter)Client_set_spin, "spin before backing off", NULL},
    {"sleep_s", (getter)Client_get_sleep, (setter)Client_set_sleep, "longest futex sleep", NULL},
    {"wait_stats", (getter)Client_get_stats, NULL, "how waits backed off", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ClientType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = BL_TYPE_PREFIX "RingClient",
    .tp_basicsize = sizeof(ClientObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The client end of one RPC ring.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Client_init,
    .tp_dealloc = (destructor)Client_dealloc,
    .tp_methods = Client_methods,
    .tp_getset = Client_getset,
};

/* ---------------------------------------------------------------- server */

typedef struct {
    ring_geo g;
    uint32_t active, gen;
    uint32_t head;     /* next sequence number expected */
    int wake;          /* the client shares our kernel: wake it through the wake lines */
    uint64_t bad_since; /* when a torn line at head was first seen (0: none) */
    uint64_t marked;   /* the respond batch that last looked at this client's wake line */
} ring_state;

typedef struct {
    uint32_t ring, seq;
    rpc_line line;
} request;

typedef struct {
    PyObject_HEAD
    MemoryObject *mem;
    size_t area_off, ring_bytes;
    uint32_t nrings;
    uint32_t nactive, nwake; /* rings served, and those whose client shares our kernel */
    ring_state *rings;
    atomic_int stop, polling;
    int doorbell; /* the doorbell lines lie in this mapping, outside the rings */
    int idle;     /* the last poll found nothing: the next one skips spinning */
    uint64_t served, rejected, batches;
    wait_cfg wait;
    wait_stats stats;
} ServerObject;

/* RingServer(memory, area_offset, ring_bytes, nrings) */
static int Server_init(ServerObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"memory", "area_offset", "ring_bytes", "nrings", NULL};
    PyObject *mem;
    unsigned long long off, ring_bytes;
    unsigned int n;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!KKI", kwlist, &BlMemoryType, &mem, &off,
                                     &ring_bytes, &n))
        return -1;
    MemoryObject *mo = (MemoryObject *)mem;
    if (!n || !ring_fits(mo, off, ring_bytes * n, 1))
        return n ? -1 : !!bl_fail(bl_rpc_error, "a server needs at least one ring") - 1;
    ring_state *rings = PyMem_Calloc(n, sizeof(ring_state));
    if (!rings) {
        PyErr_NoMemory();
        return -1;
    }
    PyMem_Free(self->rings);
    self->rings = rings;
    Py_INCREF(mem);
    Py_XSETREF(self->mem, mo);
    self->area_off = off, self->ring_bytes = ring_bytes, self->nrings = n;
    self->nactive = self->nwake = 0;
    self->doorbell = doorbell_fits(mo, off, ring_bytes * n);
    self->wait = (wait_cfg){.spin_ns = SERVER_SPIN_NS, .sleep_ns = SLEEP_NS, .wake = 1,
                            .futex_ok = 1, .calm_ns = CALM_MIN_NS};
    if (self->doorbell) /* a server that died asleep left its announcement behind */
        atomic_store(wake_word(&mo->mem, BL_RPC_DOORBELL), 0);
    return 0;
}

/* Dealloc: drop the Memory reference and the ring table. */
static void Server_dealloc(ServerObject *self)
{
    Py_XDECREF(self->mem);
    PyMem_Free(self->rings);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Check a ring index and that the pool is still attached (see ring_idle for a running poll). */
static ring_state *ring_arg(ServerObject *self, unsigned int idx)
{
    if (!self->rings || !self->mem->has_view)
        return bl_fail(bl_rpc_error, "the server's pool was closed"), NULL;
    if (idx >= self->nrings)
        return bl_fail(bl_rpc_error, "ring %u does not exist (the pool has %u)", idx, self->nrings), NULL;
    return &self->rings[idx];
}

/* ring_arg, and no poll running in another thread (it reads the ring table without the GIL). */
static ring_state *ring_idle(ServerObject *self, unsigned int idx)
{
    ring_state *r = ring_arg(self, idx);
    if (r && atomic_load(&self->polling))
        return bl_fail(bl_rpc_error, "cannot change or read rings while poll() runs"), NULL;
    return r;
}

/* Stop counting a ring among the active (and wake-up) rings. */
static void ring_off(ServerObject *self, ring_state *r)
{
    if (r->active)
        self->nactive--, self->nwake -= r->wake != 0;
    r->active = 0;
}

/* set_ring(idx, gen, depth, head, wake=False): start serving a client's ring. */
static PyObject *Server_set_ring(ServerObject *self, PyObject *args)
{
    unsigned int idx, gen, depth, head;
    int wake = 0;
    if (!PyArg_ParseTuple(args, "IIII|p", &idx, &gen, &depth, &head, &wake))
        return NULL;
    ring_state *r = ring_idle(self, idx);
    if (!r)
        return NULL;
    size_t base = self->area_off + (size_t)idx * self->ring_bytes;
    if (!ring_fits(self->mem, base, self->ring_bytes, depth))
        return NULL;
    ring_off(self, r);
    *r = (ring_state){{base, depth, bl_rpc_buf_size(self->ring_bytes, depth)}, 1, gen,
                      head ? head : 1, wake, 0, 0};
    self->nactive++, self->nwake += wake != 0;
    Py_RETURN_NONE;
}

/* clear_ring(idx): stop serving a ring (its client is gone). */
static PyObject *Server_clear_ring(ServerObject *self, PyObject *args)
{
    unsigned int idx;
    if (!PyArg_ParseTuple(args, "I", &idx))
        return NULL;
    ring_state *r = ring_idle(self, idx);
    if (!r)
        return NULL;
    ring_off(self, r);
    Py_RETURN_NONE;
}

/* Whether a loaded line is intact (its CRC) and of ring generation gen. */
static int line_of(const rpc_line *ln, uint32_t gen)
{
    return ln->crc == line_crc(ln) && ln->gen == gen;
}

/*
 * recover_head(idx, gen, depth, first_seq) -> the sequence number to serve next on a
 * ring found in the pool (a restarted server): the oldest request of generation gen
 * without its response, else the one after the newest request, else first_seq.
 */
static PyObject *Server_recover_head(ServerObject *self, PyObject *args)
{
    unsigned int idx, gen, depth, first;
    if (!PyArg_ParseTuple(args, "IIII", &idx, &gen, &depth, &first))
        return NULL;
    ring_state *r = ring_idle(self, idx);
    ring_geo g = {self->area_off + (size_t)idx * self->ring_bytes, depth, 0};
    if (!r || !ring_fits(self->mem, g.base, self->ring_bytes, depth))
        return NULL;
    bl_mem *m = &self->mem->mem;
    rpc_line req[BL_RPC_MAX_DEPTH], resp[BL_RPC_MAX_DEPTH];
    m->ops->invalidate(m, req_line(&g, 0), 2 * (size_t)depth * BL_LINE); /* both line arrays */
    m->ops->mfence(m);
    m->ops->load(m, req_line(&g, 0), req, (size_t)depth * BL_LINE);
    m->ops->load(m, resp_line(&g, 0), resp, (size_t)depth * BL_LINE);
    uint64_t pending = UINT64_MAX, newest = 0;
    for (uint32_t slot = 0; slot < depth; slot++) {
        if (!line_of(&req[slot], gen) || !req[slot].seq)
            continue;
        newest = req[slot].seq > newest ? req[slot].seq : newest;
        if (!line_of(&resp[slot], gen) || resp[slot].seq != req[slot].seq)
            pending = req[slot].seq < pending ? req[slot].seq : pending;
    }
    return PyLong_FromUnsignedLongLong(pending != UINT64_MAX ? pending : newest ? newest + 1 : first);
}

/* After responses on ring r are visible: wake its client if it sleeps on our kernel. */
static void wake_client(ServerObject *self, ring_state *r)
{
    if (!r->wake)
        return;
    bl_mem *m = &self->mem->mem;
    wake_sleeper(&self->wait, &self->stats, wake_word(m, r->g.base + BL_RPC_CLIENT_WAKE),
                 wake_word(m, r->g.base + BL_RPC_SERVER_WAKE));
}

/* After a batch of responses (entries on rings idx[0..n)): wake each client once. */
static void wake_clients(ServerObject *self, const uint32_t *idx, size_t n, size_t stride)
{
    uint64_t batch = ++self->batches;
    for (size_t i = 0; i < n; i++) {
        ring_state *r = &self->rings[*(const uint32_t *)((const char *)idx + i * stride)];
        if (r->marked != batch) {
            r->marked = batch;
            wake_client(self, r);
        }
    }
}

/* Answer one request at once with a transport error status. */
static void reject(ServerObject *self, ring_state *r, uint32_t seq, uint16_t status, const char *why)
{
    bl_mem *m = &self->mem->mem;
    rpc_line ln;
    uint32_t slot = (seq - 1) % r->g.depth;
    stage(m, &ln, resp_buf(&r->g, slot), r->g.buf, seq, r->gen, status, why, strlen(why));
    size_t off = resp_line(&r->g, slot);
    emit(m, &ln, &off, 1, 0, BL_P_RPC_RESPONSE_PAYLOAD_FENCE);
    wake_client(self, r);
    self->rejected++;
}

/* Collect the consecutive new requests of one window of a ring, up to room; no GIL needed. */
static int scan_window(ServerObject *self, uint32_t idx, request *out, int room)
{
    ring_state *r = &self->rings[idx];
    bl_mem *m = &self->mem->mem;
    uint32_t depth = r->g.depth, window = depth < SCAN_WINDOW ? depth : SCAN_WINDOW;
    if (window > (uint32_t)room)
        window = (uint32_t)room;
    uint32_t first = (r->head - 1) % depth, run = depth - first < window ? depth - first : window;
    if (BL_STEP(RPC_REQUEST_INVALIDATE)) {
        m->ops->invalidate(m, req_line(&r->g, first), (size_t)run * BL_LINE);
        if (window > run)
            m->ops->invalidate(m, req_line(&r->g, 0), (size_t)(window - run) * BL_LINE);
    }
    if (BL_STEP(RPC_REQUEST_MFENCE))
        m->ops->mfence(m);
    int got = 0;
    for (uint32_t i = 0; i < window; i++) {
        request *q = &out[got];
        uint32_t slot = (first + i) % depth;
        m->ops->load(m, req_line(&r->g, slot), &q->line, BL_LINE);
        if (q->line.seq != r->head || q->line.gen != r->gen)
            break;
        uint32_t seq = r->head;
        if (q->line.crc != line_crc(&q->line)) {
            uint64_t t = now_ns();
            if (!r->bad_since)
                r->bad_since = t;
            if (t - r->bad_since < BAD_NS)
                break; /* maybe a line still being written: look again later */
            reject(self, r, seq, ST_CORRUPT, "request line corrupt");
        } else if (q->line.len > ((q->line.flags & RPC_OOL) ? r->g.buf : BL_RPC_INLINE)) {
            reject(self, r, seq, ST_BAD_LENGTH, "request length impossible for this ring");
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
static int scan_ring(ServerObject *self, uint32_t idx, request *out, int room)
{
    return scan_window(self, idx, out, room);
}

/* Scan every active ring once; returns the requests collected. */
static int scan_all(ServerObject *self, request *batch, int max_batch)
{
    int got = 0;
    for (uint32_t i = 0; i < self->nrings && got < max_batch; i++)
        if (self->rings[i].active)
            got += scan_ring(self, i, batch + got, max_batch - got);
    return got;
}

/* Sleep until a request may have come (futex on the doorbell, or a nap); returns any found. */
static int server_sleep(ServerObject *self, backoff *b, request *batch, int max_batch, uint64_t left)
{
    if (!self->doorbell || !self->nwake || !self->wait.futex_ok) {
        nap(b, &self->stats, left);
        return 0;
    }
    bl_mem *m = &self->mem->mem;
    atomic_uint *flag = wake_word(m, BL_RPC_DOORBELL), *counter = wake_word(m, BL_RPC_DOORBELL_COUNT);
    uint32_t key = announce(flag, counter);
    int got = scan_all(self, batch, max_batch);
    if (!got) {
        /* clients on other kernels cannot ring: sleep only as long as a nap then */
        uint64_t ns = self->nwake == self->nactive ? self->wait.sleep_ns : next_nap(b, left);
        futex_sleep(&self->wait, &self->stats, counter, key, ns < left ? ns : left);
    }
    atomic_store(flag, 0);
    return got;
}

/* Poll all active rings until a batch arrives, stop(), closing, or time runs out. */
static int gather(ServerObject *self, bl_section *sec, request *batch, int max_batch, double timeout)
{
    uint64_t start = now_ns(), deadline = start + ns_of(timeout);
    backoff b;
    backoff_start(&b, start, self->idle);
    for (;;) {
        int got = scan_all(self, batch, max_batch);
        if (got || atomic_load(&self->stop) || bl_section_closing(sec)) {
            self->idle = 0;
            return got;
        }
        uint64_t now = now_ns();
        if (now >= deadline) {
            self->idle = 1;
            return 0;
        }
        int can_wake = self->doorbell && self->nwake && self->wait.futex_ok;
        int step = backoff_step(&b, &self->wait, &self->stats, now, can_wake);
        if (step == STEP_SPIN) {
            cpu_relax();
        } else if (step == STEP_YIELD) {
            COUNT(self->stats.yields);
            sched_yield();
        } else if ((got = server_sleep(self, &b, batch, max_batch, deadline - now))) {
            self->idle = 0;
            return got;
        }
    }
}

/* Start a polling call: check limits, allocate the batch, enter the section, mark polling. */
static request *begin_poll(ServerObject *self, unsigned int max_batch, bl_section *sec)
{
    if (!self->rings || !self->mem->has_view)
        return bl_fail(bl_rpc_error, "the server's pool was closed"), NULL;
    if (!max_batch || max_batch > 4096)
        return bl_fail(PyExc_ValueError, "max_batch must be 1..4096"), NULL;
    int expected = 0;
    if (!atomic_compare_exchange_strong(&self->polling, &expected, 1))
        return bl_fail(bl_rpc_error, "poll() is already running in another thread"), NULL;
    request *batch = PyMem_Malloc(max_batch * sizeof(request));
    if (!batch)
        PyErr_NoMemory();
    else if (bl_section_enter(sec, self->mem, 1, bl_rpc_error, SERVER_CLOSED) < 0)
        PyMem_Free(batch), batch = NULL;
    if (!batch)
        atomic_store(&self->polling, 0);
    return batch;
}

/* End a polling call: leave the section, unmark polling; 0, or -1 raised if the pool closed. */
static int end_poll(ServerObject *self, bl_section *sec)
{
    int closed = bl_section_closing(sec);
    bl_section_leave(sec);
    atomic_store(&self->polling, 0);
    if (!closed)
        return 0;
    bl_fail(bl_rpc_error, "%s", SERVER_CLOSED);
    return -1;
}

/* poll(max_batch, timeout_s) -> [(ring, seq, op, payload), ...] */
static PyObject *Server_poll(ServerObject *self, PyObject *args)
{
    unsigned int max_batch;
    double timeout;
    bl_section sec;
    if (!PyArg_ParseTuple(args, "Id", &max_batch, &timeout))
        return NULL;
    request *batch = begin_poll(self, max_batch, &sec);
    if (!batch)
        return NULL;
    int got = gather(self, &sec, batch, (int)max_batch, timeout);
    PyObject *out = end_poll(self, &sec) < 0 ? NULL : PyList_New(0);
    for (int i = 0; out && i < got; i++) {
        request *q = &batch[i];
        ring_state *r = &self->rings[q->ring];
        PyObject *payload =
            payload_of(&self->mem->mem, &q->line, req_buf(&r->g, (q->seq - 1) % r->g.depth), 1);
        if (!payload) {
            if (PyErr_Occurred()) {
                Py_CLEAR(out);
                break;
            }
            reject(self, r, q->seq, ST_CORRUPT, "request payload corrupt");
            continue;
        }
        PyObject *item = Py_BuildValue("(IIIN)", q->ring, q->seq, (unsigned)q->line.code, payload);
        if (!item || PyList_Append(out, item) < 0)
            Py_CLEAR(out);
        Py_XDECREF(item);
    }
    PyMem_Free(batch);
    return out;
}

/* respond([(ring, seq, status, payload), ...]): one batch of answers, one or two fences. */
static PyObject *Server_respond(ServerObject *self, PyObject *list)
{
    PyObject *seq = PySequence_Fast(list, "respond takes a sequence of (ring, seq, status, payload)");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    rpc_line *lines = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(rpc_line));
    size_t *offs = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(size_t));
    uint32_t *rings = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
    int any_ool = 0, ok = lines && offs && rings;
    if (!ok)
        PyErr_NoMemory();
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        unsigned int idx, s, status;
        Py_buffer p;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "IIIy*", &idx, &s, &status, &p)) {
            ok = 0;
            break;
        }
        ring_state *r = ring_arg(self, idx);
        if (!r || !r->active || (uint32_t)(r->head - s) - 1 >= r->g.depth || status > 0xffff) {
            if (r)
                bl_fail(bl_rpc_error, "ring %u has no outstanding request %u", idx, s);
            ok = 0;
        } else {
            uint32_t slot = (s - 1) % r->g.depth;
            int st = stage(&self->mem->mem, &lines[i], resp_buf(&r->g, slot), r->g.buf, s, r->gen,
                           (uint16_t)status, p.buf, (size_t)p.len);
            if (st < 0) {
                bl_fail(bl_rpc_error, "a %zd-byte response exceeds ring %u's %zu-byte slot buffer",
                        p.len, idx, r->g.buf);
                ok = 0;
            }
            any_ool |= st > 0;
            offs[i] = resp_line(&r->g, slot);
            rings[i] = idx;
        }
        PyBuffer_Release(&p);
    }
    if (ok) {
        emit(&self->mem->mem, lines, offs, (size_t)n, any_ool, BL_P_RPC_RESPONSE_PAYLOAD_FENCE);
        wake_clients(self, rings, (size_t)n, sizeof(uint32_t));
        self->served += (uint64_t)n;
    }
    PyMem_Free(lines);
    PyMem_Free(offs);
    PyMem_Free(rings);
    Py_DECREF(seq);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

/* serve_echo(duration_s) -> requests answered: the transport alone, all in C. */
static PyObject *Server_serve_echo(ServerObject *self, PyObject *args)
{
    double duration;
    bl_section sec;
    if (!PyArg_ParseTuple(args, "d", &duration))
        return NULL;
    size_t max_buf = 0;
    for (uint32_t i = 0; self->rings && i < self->nrings; i++)
        if (self->rings[i].g.buf > max_buf)
            max_buf = self->rings[i].g.buf;
    uint8_t *tmp = PyMem_Malloc(max_buf + 1);
    if (!tmp)
        return PyErr_NoMemory();
    request *batch = begin_poll(self, SCAN_WINDOW * 4, &sec);
    if (!batch) {
        PyMem_Free(tmp);
        return NULL;
    }
    rpc_line lines[SCAN_WINDOW * 4];
    size_t offs[SCAN_WINDOW * 4];
    uint64_t answered = 0, end = now_ns() + ns_of(duration);
    bl_mem *m = &self->mem->mem;
    while (!atomic_load(&self->stop) && !bl_section_closing(&sec) && now_ns() < end) {
        int got = gather(self, &sec, batch, SCAN_WINDOW * 4, 0.01);
        int any_ool = 0, k = 0;
        for (int i = 0; i < got; i++) {
            request *q = &batch[i];
            ring_state *r = &self->rings[q->ring];
            uint32_t slot = (q->seq - 1) % r->g.depth;
            const void *p = q->line.data;
            if (q->line.flags & RPC_OOL) {
                if (payload_in(m, &q->line, req_buf(&r->g, slot), tmp, 1) < 0) {
                    reject(self, r, q->seq, ST_CORRUPT, "request payload corrupt");
                    continue;
                }
                p = tmp;
            }
            any_ool |= stage(m, &lines[k], resp_buf(&r->g, slot), r->g.buf, q->seq, r->gen, 0, p,
                             q->line.len) > 0;
            offs[k++] = resp_line(&r->g, slot);
        }
        if (k) {
            emit(m, lines, offs, (size_t)k, any_ool, BL_P_RPC_RESPONSE_PAYLOAD_FENCE);
            wake_clients(self, &batch[0].ring, (size_t)k, sizeof(request));
        }
        answered += (uint64_t)k;
    }
    int failed = end_poll(self, &sec) < 0;
    PyMem_Free(batch);
    PyMem_Free(tmp);
    self->served += answered;
    return failed ? NULL : PyLong_FromUnsignedLongLong(answered);
}

/* stop(): make a running poll or serve_echo return promptly, waking it (thread-safe). */
static PyObject *Server_stop(ServerObject *self, PyObject *unused)
{
    atomic_store(&self->stop, 1);
    if (self->doorbell && self->mem && self->mem->has_view) {
        atomic_uint *counter = wake_word(&self->mem->mem, BL_RPC_DOORBELL_COUNT);
        atomic_fetch_add(counter, 1);
        syscall(SYS_futex, counter, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    }
    Py_RETURN_NONE;
}

/* Properties: responses written, malformed requests answered with an error. */
static PyObject *Server_get_served(ServerObject *self, void *c) { return PyLong_FromUnsignedLongLong(self->served); }
static PyObject *Server_get_rejected(ServerObject *self, void *c)
{
    return PyLong_FromUnsignedLongLong(self->rejected);
}

/* spin_s / sleep_s: spin after the last request, and the longest futex sleep. */
static PyObject *Server_get_spin(ServerObject *self, void *c) { return PyFloat_FromDouble(1e-9 * (double)self->wait.spin_ns); }
static int Server_set_spin(ServerObject *self, PyObject *v, void *c)
{
    return set_seconds(&self->wait.spin_ns, v, 0, 3600, "spin_s must be 0..3600 s");
}
static PyObject *Server_get_sleep(ServerObject *self, void *c) { return PyFloat_FromDouble(1e-9 * (double)self->wait.sleep_ns); }
static int Server_set_sleep(ServerObject *self, PyObject *v, void *c)
{
    return set_seconds(&self->wait.sleep_ns, v, 1e-6, 10, "sleep_s must be 1e-6..10 s");
}

/* wait_stats: how polls backed off (yields, naps, futex sleeps and how they ended, wakes sent). */
static PyObject *Server_get_stats(ServerObject *self, void *c) { return stats_dict(&self->stats); }

static PyMethodDef Server_methods[] = {
    {"set_ring", (PyCFunction)Server_set_ring, METH_VARARGS, "set_ring(idx, gen, depth, head, wake=False)"},
    {"clear_ring", (PyCFunction)Server_clear_ring, METH_VARARGS, "clear_ring(idx)"},
    {"recover_head", (PyCFunction)Server_recover_head, METH_VARARGS,
     "recover_head(idx, gen, depth, first_seq) -> next seq: the oldest request left unanswered"},
    {"poll", (PyCFunction)Server_poll, METH_VARARGS,
     "poll(max_batch, timeout_s) -> [(ring, seq, op, payload)]"},
    {"respond", (PyCFunction)Server_respond, METH_O, "respond([(ring, seq, status, payload)])"},
    {"serve_echo", (PyCFunction)Server_serve_echo, METH_VARARGS,
     "serve_echo(duration_s) -> answered"},
    {"stop", (PyCFunction)Server_stop, METH_NOARGS, "end a running poll / serve_echo"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Server_getset[] = {
    {"served", (getter)Server_get_served, NULL, "responses written", NULL},
    {"rejected", (getter)Server_get_rejected, NULL, "malformed requests answered with an error", NULL},
    {"spin_s", (getter)Server_get_spin, (setter)Server_set_spin, "spin after the last request", NULL},
    {"sleep_s", (getter)Server_get_sleep, (setter)Server_set_sleep, "longest futex sleep", NULL},
    {"wait_stats", (getter)Server_get_stats, NULL, "how polls backed off", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ServerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = BL_TYPE_PREFIX "RingServer",
    .tp_basicsize = sizeof(ServerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The server end of every RPC ring of a pool.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Server_init,
    .tp_dealloc = (destructor)Server_dealloc,
    .tp_methods = Server_methods,
    .tp_getset = Server_getset,
};

/* rpc_buf_size(ring_bytes, depth) -> slot buffer bytes (shared geometry). */
static PyObject *mod_rpc_buf_size(PyObject *mod, PyObject *args)
{
    unsigned long long ring_bytes;
    unsigned int depth;
    if (!PyArg_ParseTuple(args, "KI", &ring_bytes, &depth))
        return NULL;
    return PyLong_FromSize_t(bl_rpc_buf_size(ring_bytes, depth));
}

/* rpc_slot_lines(depth, slot) -> (request line, response line) offsets inside a ring. */
static PyObject *mod_rpc_slot_lines(PyObject *mod, PyObject *args)
{
    unsigned int depth, slot;
    if (!PyArg_ParseTuple(args, "II", &depth, &slot))
        return NULL;
    if (!depth || depth > BL_RPC_MAX_DEPTH || slot >= depth)
        return bl_fail(PyExc_ValueError, "need 1 <= depth <= %u and slot < depth", BL_RPC_MAX_DEPTH);
    ring_geo g = {0, depth, 0};
    return Py_BuildValue("(nn)", (Py_ssize_t)req_line(&g, slot), (Py_ssize_t)resp_line(&g, slot));
}

/* rpc_pack_line(seq, code, flags, length, gen, inline, payload_crc) -> one sealed line. */
static PyObject *mod_rpc_pack_line(PyObject *mod, PyObject *args)
{
    unsigned int seq, code, flags, len, gen, payload_crc;
    const char *data;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "IIIIIy#I", &seq, &code, &flags, &len, &gen, &data, &n,
                          &payload_crc))
        return NULL;
    if (code > 0xffff || flags > 0xffff || n > BL_RPC_INLINE)
        return bl_fail(PyExc_ValueError, "code and flags are 16 bits, inline at most %u bytes",
                       BL_RPC_INLINE);
    rpc_line ln = {.seq = seq, .code = (uint16_t)code, .flags = (uint16_t)flags, .len = len,
                   .gen = gen, .payload_crc = payload_crc};
    memcpy(ln.data, data, (size_t)n);
    ln.crc = line_crc(&ln);
    return PyBytes_FromStringAndSize((const char *)&ln, sizeof(ln));
}

/* rpc_parse_line(line) -> (seq, code, flags, length, gen, inline, payload_crc), or None if torn. */
static PyObject *mod_rpc_parse_line(PyObject *mod, PyObject *args)
{
    Py_buffer b;
    rpc_line ln;
    if (!PyArg_ParseTuple(args, "y*", &b))
        return NULL;
    if (b.len != (Py_ssize_t)sizeof(ln)) {
        PyBuffer_Release(&b);
        return bl_fail(PyExc_ValueError, "an RPC line is %u bytes, got %zd", BL_LINE, b.len);
    }
    memcpy(&ln, b.buf, sizeof(ln));
    PyBuffer_Release(&b);
    if (ln.crc != line_crc(&ln))
        Py_RETURN_NONE;
    return Py_BuildValue("(IIIIIy#I)", ln.seq, (unsigned)ln.code, (unsigned)ln.flags, ln.len, ln.gen,
                         (const char *)ln.data, (Py_ssize_t)BL_RPC_INLINE, ln.payload_crc);
}

static PyMethodDef rpc_functions[] = {
    {"rpc_pack_line", mod_rpc_pack_line, METH_VARARGS,
     "rpc_pack_line(seq, code, flags, length, gen, inline, payload_crc) -> bytes"},
    {"rpc_parse_line", mod_rpc_parse_line, METH_VARARGS,
     "rpc_parse_line(line) -> (seq, code, flags, length, gen, inline, payload_crc) | None"},
    {"rpc_buf_size", mod_rpc_buf_size, METH_VARARGS, "rpc_buf_size(ring_bytes, depth) -> int"},
    {"rpc_slot_lines", mod_rpc_slot_lines, METH_VARARGS,
     "rpc_slot_lines(depth, slot) -> (request line offset, response line offset)"},
    {NULL, NULL, 0, NULL},
};

/* Add the RPC types, functions and constants to the module. */
int bl_rpc_init(PyObject *module)
{
    if (PyType_Ready(&ClientType) < 0 || PyType_Ready(&ServerType) < 0)
        return -1;
    Py_INCREF(&ClientType);
    Py_INCREF(&ServerType);
    if (PyModule_AddObject(module, "RingClient", (PyObject *)&ClientType) < 0 ||
        PyModule_AddObject(module, "RingServer", (PyObject *)&ServerType) < 0 ||
        PyModule_AddFunctions(module, rpc_functions) < 0 ||
        PyModule_AddIntConstant(module, "RPC_INLINE", BL_RPC_INLINE) < 0 ||
        PyModule_AddIntConstant(module, "RPC_CONTROL", BL_RPC_CONTROL) < 0 ||
        PyModule_AddIntConstant(module, "RPC_STATUS", BL_RPC_STATUS) < 0 ||
        PyModule_AddIntConstant(module, "RPC_CLIENT_WAKE", BL_RPC_CLIENT_WAKE) < 0 ||
        PyModule_AddIntConstant(module, "RPC_SERVER_WAKE", BL_RPC_SERVER_WAKE) < 0 ||
        PyModule_AddIntConstant(module, "RPC_HEAD", BL_RPC_HEAD) < 0 ||
        PyModule_AddIntConstant(module, "RPC_DOORBELL", BL_RPC_DOORBELL) < 0 ||
        PyModule_AddIntConstant(module, "RPC_DOORBELL_COUNT", BL_RPC_DOORBELL_COUNT) < 0 ||
        PyModule_AddIntConstant(module, "RPC_MAX_DEPTH", BL_RPC_MAX_DEPTH) < 0 ||
        PyModule_AddIntConstant(module, "RPC_OOL", RPC_OOL) < 0 ||
        PyModule_AddIntConstant(module, "ST_BAD_LENGTH", ST_BAD_LENGTH) < 0 ||
        PyModule_AddIntConstant(module, "ST_CORRUPT", ST_CORRUPT) < 0)
        return -1;
    return 0;
}
