/* Counter-based RNG: a value is a pure function of (seed, stream, index). The mixer is a
 * SplitMix64-style finalizer applied twice over the combined key, which passes the usual
 * avalanche checks and costs a few multiplies. */
#include "ds4/core.h"

#include <math.h>

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

uint64_t ds4_rng_u64(uint64_t seed, uint64_t stream, uint64_t index) {
    uint64_t k = mix64(seed + 0x9e3779b97f4a7c15ULL);
    k = mix64(k ^ (stream * 0xd1b54a32d192ed03ULL));
    return mix64(k ^ (index + 0x632be59bd9b4e019ULL));
}

float ds4_rng_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
    return (float)(ds4_rng_u64(seed, stream, index) >> 40) * (1.0f / 16777216.0f);
}

/* Box-Muller on two independent uniforms derived from the same counter. */
float ds4_rng_normal(uint64_t seed, uint64_t stream, uint64_t index) {
    uint64_t a = ds4_rng_u64(seed, stream, 2 * index), b = ds4_rng_u64(seed, stream, 2 * index + 1);
    double u1 = ((double)(a >> 11) + 1.0) * (1.0 / 9007199254740992.0); /* (0, 1] */
    double u2 = (double)(b >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2));
}

uint64_t ds4_hash_str(const char *s) {
    uint64_t h = 0xcbf29ce484222325ULL; /* FNV-1a */
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 0x100000001b3ULL;
    return h;
}
