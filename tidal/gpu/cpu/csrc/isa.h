// Whether the kernels may pick AVX-512 tiles: every run-time choice of tiles asks this before the CPU's flags.
// TIDAL_CPU_ISA=avx2 holds them to their AVX2 tiles, as a CPU without AVX-512 runs them (kernels.py then builds
// the library without AVX-512 flags too), so one host can run, test and measure what an AVX2-only host runs.
#pragma once

#include <cstdlib>
#include <cstring>

namespace tidal_cpu {

inline bool avx512_allowed() {
  static const bool allowed = [] {
    const char* isa = std::getenv("TIDAL_CPU_ISA");
    return isa == nullptr || std::strcmp(isa, "avx2") != 0;
  }();
  return allowed;
}

}  // namespace tidal_cpu
