// The kernels of kernels/cpu/quant.hpp with AVX-512 (built with AVX-512F, FMA and F16C
// enabled).
#define TROUPE_ISA avx512
#define TROUPE_AVX512
#include "kernels/cpu/quant_x86.inc"
