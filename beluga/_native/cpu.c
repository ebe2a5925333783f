/*
 * cpu.c - what this CPU can do, read once, and the chicken bits that force a choice.
 *
 * memops.c (flushes, non-temporal copies), crc32c.c and blake3.c each pick
 * their instructions from these features once, when the module loads.  A
 * feature counts only if the OS lets a process use it: AVX2 needs the OS to
 * save the ymm registers and AVX-512 the opmask and zmm ones too (XCR0), which a VM may not do even
 * when CPUID reports the instructions.  Other architectures (and -DBL_PORTABLE)
 * report nothing.
 *
 * A chicken-bit variable (BELUGA_FLUSH, BELUGA_NT, BELUGA_COPY, BELUGA_CRC) names a choice
 * for testing; bl_forced() is how a picker reads one.  A forced choice the
 * CPU cannot honour falls back to the best one it can.
 */
#include <stdlib.h>
#include <string.h>

#include "beluga_native.h"

#if BL_X86
#include <cpuid.h>
#include <immintrin.h>
#endif

static int has_clflushopt, has_clwb, has_avx2, has_avx512f, has_sse42, has_vpclmulqdq;

#if BL_X86
/* Whether the OS saves every register state in `mask` (XCR0 bits: 0x6 ymm, 0xe6 zmm too). */
__attribute__((target("xsave"))) static int os_saves(unsigned mask)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) /* OSXSAVE */
        return 0;
    return (_xgetbv(0) & mask) == mask;
}
#endif

/* Read the CPUID bits once (later calls do nothing; racing first calls write equal values). */
static void cpu_init(void)
{
    static int done;
    if (done)
        return;
    done = 1;
#if BL_X86
    unsigned a, b, c, d;
    if (__get_cpuid(1, &a, &b, &c, &d))
        has_sse42 = (c >> 20) & 1;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        has_avx2 = (b >> 5) & 1;
        has_avx512f = (b >> 16) & 1;
        has_clflushopt = (b >> 23) & 1;
        has_clwb = (b >> 24) & 1;
        has_vpclmulqdq = (c >> 10) & 1;
    }
    has_avx2 = has_avx2 && os_saves(0x6);          /* xmm and ymm state */
    has_avx512f = has_avx512f && os_saves(0xe6); /* a VM may hide the zmm state */
#endif
}

/* Whether the CPU reports a feature (sse4.2, avx2, avx512f, clflushopt, clwb, vpclmulqdq). */
int bl_cpu_has(const char *feature)
{
    cpu_init();
    if (!strcmp(feature, "sse4.2"))
        return has_sse42;
    if (!strcmp(feature, "avx2"))
        return has_avx2;
    if (!strcmp(feature, "avx512f"))
        return has_avx512f;
    if (!strcmp(feature, "clflushopt"))
        return has_clflushopt;
    if (!strcmp(feature, "clwb"))
        return has_clwb;
    if (!strcmp(feature, "vpclmulqdq"))
        return has_vpclmulqdq;
    return 0;
}

/* True when the chicken-bit variable `name` asks for `value`. */
int bl_forced(const char *name, const char *value)
{
    const char *v = getenv(name);
    return v && strcmp(v, value) == 0;
}
