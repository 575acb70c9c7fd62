// What this CPU runs, asked in one place: every kernel's run-time choice of tiles reads `isa()`, never the CPU's
// flags itself. Each answer is the CPU's own (__builtin_cpu_supports), so a build on one host runs the fast path of
// whichever CPU loads it, held to AVX2 by TIDAL_CPU_ISA=avx2 (an AVX2-only CPU's paths, which kernels.py then also
// builds without AVX-512 flags), so one host can run, test and measure what an AVX2-only host runs.
#pragma once

// Whether the compiler can emit AVX512-BF16 code (vdpbf16ps); whether the CPU runs it is isa().avx512_bf16.
#if (defined(__x86_64__) || defined(__i386__)) && \
    ((defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#define TIDAL_AVX512_BF16 1
#include <immintrin.h>
#endif

#include <cstdlib>
#include <cstring>

namespace tidal_cpu {

struct Isa {
  bool avx2_fma = false;     // AVX2 and FMA: every x86 kernel's baseline
  bool avx512 = false;       // AVX512 F, BW, VL and DQ
  bool avx512_bf16 = false;  // and AVX512-BF16 (vdpbf16ps)
  bool avx512_vnni = false;  // and AVX512-VNNI (vpdpbusd)
};

inline const Isa& isa() {
  static const Isa answer = [] {
    Isa a;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    const char* held = std::getenv("TIDAL_CPU_ISA");
    const bool avx512_allowed = held == nullptr || std::strcmp(held, "avx2") != 0;
    a.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    a.avx512 = avx512_allowed && a.avx2_fma && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512dq");
    a.avx512_bf16 = a.avx512 && __builtin_cpu_supports("avx512bf16");
    a.avx512_vnni = a.avx512 && __builtin_cpu_supports("avx512vnni");
#endif
    return a;
  }();
  return answer;
}

}  // namespace tidal_cpu
