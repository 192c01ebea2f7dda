// cuBLAS GEMMs for the CUDA glue files; see blas.h.

#include "blas.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/util/Exception.h>
#include <cublas_v2.h>

#include <climits>

namespace dllm_fast::blas {
namespace {

cudaDataType_t cuda_type(at::ScalarType t, const char* op) {
  switch (t) {
    case at::kFloat: return CUDA_R_32F;
    case at::kDouble: return CUDA_R_64F;
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", t, " for a cuBLAS GEMM; use float32, float64, "
                         "bfloat16 or float16.");
  }
}

int to_int(int64_t v, const char* what, const char* op) {
  TORCH_CHECK(v <= INT_MAX, op, ": GEMM size ", what, " = ", v, " exceeds cuBLAS's 32-bit sizes; pass a smaller "
              "chunk_size or fewer rows.");
  return static_cast<int>(v);
}

}  // namespace

void gemm(const char* op, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* A,
          at::ScalarType a_type, int64_t lda, const void* B, at::ScalarType b_type, int64_t ldb, void* C,
          at::ScalarType c_type, int64_t ldc, double alpha, double beta, Precision precision) {
  // cuBLAS is column-major, where a row-major X reads as X^T, so it computes C^T = op(B)^T @ op(A)^T.
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  const bool wide = c_type == at::kDouble;
  const cublasComputeType_t compute =
      wide ? CUBLAS_COMPUTE_64F : (precision == Precision::kTF32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F);
  const float alpha_f = static_cast<float>(alpha), beta_f = static_cast<float>(beta);
  const void* alpha_p = wide ? static_cast<const void*>(&alpha) : static_cast<const void*>(&alpha_f);
  const void* beta_p = wide ? static_cast<const void*>(&beta) : static_cast<const void*>(&beta_f);
  const cublasStatus_t status = cublasGemmEx(
      handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, to_int(n, "n", op),
      to_int(m, "m", op), to_int(k, "k", op), alpha_p, B, cuda_type(b_type, op), to_int(ldb, "ldb", op), A,
      cuda_type(a_type, op), to_int(lda, "lda", op), beta_p, C, cuda_type(c_type, op), to_int(ldc, "ldc", op),
      compute, CUBLAS_GEMM_DEFAULT);
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, op, ": cublasGemmEx failed with status ", static_cast<int>(status),
              " (", cublasGetStatusString(status), ").");
}

const void* element_address(const at::Tensor& t, int64_t index) {
  return static_cast<const char*>(t.data_ptr()) + index * t.element_size();
}

void* element_address(at::Tensor& t, int64_t index) {
  return static_cast<char*>(t.data_ptr()) + index * t.element_size();
}

}  // namespace dllm_fast::blas
