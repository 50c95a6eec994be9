// The kernels of kernels/cpu/quant.hpp with AVX2, FMA and F16C (built with those enabled).
#define TROUPE_ISA avx2
#include "kernels/cpu/quant_x86.inc"
