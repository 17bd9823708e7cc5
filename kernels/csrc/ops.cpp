// Every C++ CPU op in one translation unit, the one library `kernels/cpu_extension.py` builds:
// the torch headers they share are then compiled once, not once a source.

#include "dense_gemm.cpp"
#include "fp4_gemm.cpp"
#include "paged_attention.cpp"
