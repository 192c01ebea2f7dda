// cuBLAS GEMMs for the CUDA glue files (torch side; compiled only in CUDA builds). Each call names the op that
// made it, so a failure reads "sample_tokens: ..." rather than blaming another op.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace dllm_fast::blas {

// kTF32: fp32 operands are rounded to TF32 (10 mantissa bits, fp32's range) for the tensor cores. For operands
// that hold bf16 or fp16 values, which TF32 represents exactly, only the other operand is rounded.
enum class Precision { kExact, kTF32 };

// Row-major C[m, n] = alpha * op(A)[m, k] @ op(B)[k, n] + beta * C, where op transposes when trans_* is set and
// lda/ldb/ldc are the row lengths as stored. Runs on the current stream with torch's cuBLAS handle. Products
// accumulate in fp32 (fp64 when C is fp64) whatever the input types.
void gemm(const char* op, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* A,
          at::ScalarType a_type, int64_t lda, const void* B, at::ScalarType b_type, int64_t ldb, void* C,
          at::ScalarType c_type, int64_t ldc, double alpha, double beta, Precision precision = Precision::kExact);

// Address of element `index` of a contiguous tensor: the first row of a vocabulary chunk, for a GEMM operand.
const void* element_address(const at::Tensor& t, int64_t index);
void* element_address(at::Tensor& t, int64_t index);

}  // namespace dllm_fast::blas
