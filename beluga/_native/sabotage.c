/*
 * sabotage.c - named sabotage points: proof that the model catches each
 * missing fence, flush and invalidate.
 *
 * DESIGN
 * A coherence bug on a coherent CI machine fails only if the model (model.c)
 * reorders what the hardware reorders.  To prove it does, every step a
 * protocol needs on non-coherent hardware has a name (BL_SABOTAGE_POINTS in
 * beluga_native.h: the step, and why the hardware needs it), and a mutation
 * run removes one step at a time and checks that some test fails
 * (tests/test_mutation.py).
 *
 * The switch costs nothing and cannot be thrown by accident:
 *
 *   - the production core (beluga._native._core) is built without
 *     BL_SABOTAGE: BL_STEP(name) is the constant 1, so a guarded step is the
 *     plain call it always was, and arming is refused;
 *   - the same sources built with -DBL_SABOTAGE give another module,
 *     beluga._native._core_sabotage, which only the mutation harness builds,
 *     into a temporary directory; setup.py never builds it and no package
 *     ships it;
 *   - beluga._native loads it only from the explicit path in
 *     BELUGA_SABOTAGE_CORE, which the harness sets in the processes it spawns;
 *   - an armed core refuses native-mode Memory: removing a step can only ever
 *     weaken the simulated model, never a real CXL mapping.
 *
 * Python points (beluga/pool, beluga/server) take their names from the same
 * table (_core.SABOTAGE_POINTS) and are bound once, at import: the real
 * operation in production, a recording no-op only when their point is armed.
 *
 * A point that skips its step says so, once per process, in the file named
 * by BELUGA_SABOTAGE_LOG, so the harness can tell a check that caught the
 * sabotage from one that failed without ever reaching it.
 */
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "beluga_native.h"

#define BL_POINT_ROW(name, where, step, why) {#name, where, step, why},
const bl_point bl_points[BL_NPOINTS] = {BL_SABOTAGE_POINTS(BL_POINT_ROW)};
#undef BL_POINT_ROW

#ifdef BL_SABOTAGE
static int armed = -1;
static atomic_int logged[BL_NPOINTS];

/* Arm one point by name (the only one armed from then on); -1 for an unknown name. */
int bl_sabotage_arm(const char *name)
{
    for (int i = 0; i < BL_NPOINTS; i++)
        if (!strcmp(bl_points[i].name, name))
            return armed = i, 0;
    return -1;
}

/* Record, once per process, that a point skipped its step. */
void bl_sabotage_fired(int point)
{
    const char *path = getenv("BELUGA_SABOTAGE_LOG");
    if (point < 0 || point >= BL_NPOINTS || atomic_exchange(&logged[point], 1) || !path)
        return;
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0)
        return;
    char line[96];
    size_t n = strlen(bl_points[point].name);
    if (n > sizeof(line) - 1)
        n = sizeof(line) - 1;
    memcpy(line, bl_points[point].name, n);
    line[n++] = '\n';
    ssize_t w = write(fd, line, n); /* one append: lines of concurrent processes never mix */
    (void)w;
    close(fd);
}

/* Whether a guarded step runs: always, except the armed point, which fires instead. */
int bl_step_runs(int point)
{
    if (point != armed)
        return 1;
    bl_sabotage_fired(point);
    return 0;
}
#else
/* Production build: nothing can be armed. */
int bl_sabotage_arm(const char *name) { return -1; }

/* Production build: nothing ever fires. */
void bl_sabotage_fired(int point) {}
#endif

/* The armed point, or -1 (always -1 in production). */
int bl_sabotage_armed(void)
{
#ifdef BL_SABOTAGE
    return armed;
#else
    return -1;
#endif
}
