/* What the generated wrappers (kernels.h) call when the kernel profile is on (ds4/profile.h): the op ids,
 * generated from ops.def like every other list of ops, the switch, and the clock around a call. */
#ifndef DS4_KERNELS_PROFILE_H
#define DS4_KERNELS_PROFILE_H

#include <stdint.h>

#include "ds4/core.h"
#include "ds4/profile.h"

/* One id per entry of ops.def, in its order (the order of ds4_kernel_op_names). */
enum {
#define DS4_OP(name, plan, cpu, params, args) DS4_OPID_##name,
#define DS4_QUERY(name, plan, cpu, type, absent, params, args) DS4_OPID_##name,
#include "kernels/ops.def"
    DS4_OPID_COUNT
};

/* The switch the wrappers test before each call (ds4_profile_enable sets it). */
extern bool ds4_profile_on;

/* Nanoseconds of the monotonic clock, taken before the call. */
int64_t ds4_profile_begin(void);
/* After the call of op `op` in context ex with the op's own arguments after ex (its parameter order in
 * ops.def): adds the call, the time since t0 and the op's estimated FLOPs. Calls in a plan are not counted. */
void ds4_profile_end(int op, int64_t t0, const ds4_exec *ex, ...);

/* A parenthesised argument list without its parentheses: DS4_SPREAD (ex, a, b) is ex, a, b. */
#define DS4_SPREAD(...) __VA_ARGS__

#endif
