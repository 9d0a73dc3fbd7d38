#pragma once
// Hot loops are compiled twice (AVX2 and baseline) and picked at load time, so one wheel runs
// fast on AVX2 machines and still runs elsewhere.
#if defined(__x86_64__) && defined(__GNUC__)
#define MO_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MO_CLONES
#endif
