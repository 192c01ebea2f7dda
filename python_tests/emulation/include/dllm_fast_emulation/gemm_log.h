// The emulator's record of the GEMMs its host cuBLAS runs (python_tests/emulation/cublas.cpp): which operand and output
// types, compute type and sizes each call had, so that a test (and the planner's cost model) can check without a
// GPU which GEMMs an op runs. Each entry is the cublasGemmEx call as given: column-major m, n, k and transposes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dllm_fast::emulation {

struct GemmRecord {
  std::string a_type, b_type, c_type;  // torch dtype names: "float32", "float64", "bfloat16", "float16"
  std::string compute;                 // "fp32", "tf32" or "fp64"
  int64_t m, n, k;
  bool transa, transb;
};

// Starts (or nests) recording; returns the index of the next record, from which this recording's records count.
int64_t gemm_log_begin();
// The records from index `start` on, in call order.
std::vector<GemmRecord> gemm_log_records(int64_t start);
// Ends one recording; the records are dropped when the outermost one ends.
void gemm_log_end();

}  // namespace dllm_fast::emulation
