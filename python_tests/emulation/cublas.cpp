// cuBLAS's cublasGemmEx on the host, for the emulated build: the same column-major contract, argument checks,
// type combinations and status codes, so csrc/cuda/blas.cpp runs unchanged. Products accumulate in fp32 (fp64
// for CUBLAS_COMPUTE_64F); CUBLAS_COMPUTE_32F_FAST_TF32 rounds both inputs to TF32 first, as tensor cores do.
// While a recording is open (dllm_fast_emulation/gemm_log.h) every GEMM it runs is logged.

#include <ATen/ATen.h>
#include <cublas_v2.h>

#include <algorithm>
#include <mutex>

#include "dllm_fast_emulation/gemm_log.h"

namespace {

bool scalar_type(cudaDataType_t type, at::ScalarType* out) {
  switch (type) {
    case CUDA_R_32F: *out = at::kFloat; return true;
    case CUDA_R_64F: *out = at::kDouble; return true;
    case CUDA_R_16F: *out = at::kHalf; return true;
    case CUDA_R_16BF: *out = at::kBFloat16; return true;
  }
  return false;
}

// The (A, B, C) types cuBLAS accepts for each compute type (its cublasGemmEx table, the float rows).
bool supported(cublasComputeType_t compute, cudaDataType_t a, cudaDataType_t b, cudaDataType_t c) {
  if (a != b) return false;
  switch (compute) {
    case CUBLAS_COMPUTE_32F:
      return (a == CUDA_R_32F && c == CUDA_R_32F) ||
             ((a == CUDA_R_16BF || a == CUDA_R_16F) && (c == a || c == CUDA_R_32F));
    case CUBLAS_COMPUTE_32F_FAST_TF32: return a == CUDA_R_32F && c == CUDA_R_32F;
    case CUBLAS_COMPUTE_64F: return a == CUDA_R_64F && c == CUDA_R_64F;
  }
  return false;
}

// A column-major rows x cols matrix with leading dimension ld, as a tensor view of its memory.
at::Tensor column_major(const void* data, at::ScalarType type, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(const_cast<void*>(data), {rows, cols}, {1, ld}, at::TensorOptions().dtype(type));
}

// Reads the first and the last byte of an operand in instrumented code, so that AddressSanitizer reports a
// GEMM whose operand runs past its allocation (the GEMM itself runs in uninstrumented MKL).
void probe_extent(const void* data, int64_t rows, int64_t cols, int64_t ld, size_t element_size) {
  if (rows == 0 || cols == 0) return;
  const volatile char* bytes = static_cast<const volatile char*>(data);
  (void)bytes[0];
  (void)bytes[((cols - 1) * ld + rows - 1) * static_cast<int64_t>(element_size) + element_size - 1];
}

// fp32 -> TF32 (10 explicit mantissa bits), to nearest with ties away from zero; inf and NaN stay.
at::Tensor round_to_tf32(const at::Tensor& x) {
  at::Tensor bits = x.contiguous().view(at::kInt);
  return ((bits + 0x1000).bitwise_and(~0x1FFF)).view(at::kFloat).view(x.sizes());
}

std::mutex log_mutex;
int recordings = 0;  // open recordings; GEMMs are logged while it is positive
std::vector<dllm_fast::emulation::GemmRecord> log_records;

// A compute type that supported() accepted, by name.
const char* compute_name(cublasComputeType_t compute) {
  return compute == CUBLAS_COMPUTE_64F ? "fp64" : compute == CUBLAS_COMPUTE_32F_FAST_TF32 ? "tf32" : "fp32";
}

std::string dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    default: return c10::toString(type);
  }
}

void log_gemm(at::ScalarType a, at::ScalarType b, at::ScalarType c, cublasComputeType_t compute, int m, int n, int k,
              bool transa, bool transb) {
  const std::lock_guard<std::mutex> lock(log_mutex);
  if (recordings > 0) {
    log_records.push_back({dtype_name(a), dtype_name(b), dtype_name(c), compute_name(compute), m, n, k, transa,
                           transb});
  }
}

}  // namespace

namespace dllm_fast::emulation {

int64_t gemm_log_begin() {
  const std::lock_guard<std::mutex> lock(log_mutex);
  ++recordings;
  return static_cast<int64_t>(log_records.size());
}

std::vector<GemmRecord> gemm_log_records(int64_t start) {
  const std::lock_guard<std::mutex> lock(log_mutex);
  const auto first = log_records.begin() + std::clamp<int64_t>(start, 0, log_records.size());
  return std::vector<GemmRecord>(first, log_records.end());
}

void gemm_log_end() {
  const std::lock_guard<std::mutex> lock(log_mutex);
  if (recordings > 0 && --recordings == 0) log_records.clear();
}

}  // namespace dllm_fast::emulation

cublasStatus_t cublasGemmEx(cublasHandle_t, cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k,
                            const void* alpha, const void* A, cudaDataType_t Atype, int lda, const void* B,
                            cudaDataType_t Btype, int ldb, const void* beta, void* C, cudaDataType_t Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t) {
  const bool a_plain = transa == CUBLAS_OP_N, b_plain = transb == CUBLAS_OP_N;
  if (m < 0 || n < 0 || k < 0 || lda < std::max(1, a_plain ? m : k) || ldb < std::max(1, b_plain ? k : n) ||
      ldc < std::max(1, m) || (transa != CUBLAS_OP_N && transa != CUBLAS_OP_T) ||
      (transb != CUBLAS_OP_N && transb != CUBLAS_OP_T)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  at::ScalarType a_type, b_type, c_type;
  if (!scalar_type(Atype, &a_type) || !scalar_type(Btype, &b_type) || !scalar_type(Ctype, &c_type) ||
      !supported(computeType, Atype, Btype, Ctype)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  log_gemm(a_type, b_type, c_type, computeType, m, n, k, !a_plain, !b_plain);
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  const int64_t a_rows = a_plain ? m : k, a_cols = a_plain ? k : m;
  const int64_t b_rows = b_plain ? k : n, b_cols = b_plain ? n : k;
  const size_t a_size = at::elementSize(a_type), c_size = at::elementSize(c_type);
  probe_extent(A, a_rows, a_cols, lda, a_size);
  probe_extent(B, b_rows, b_cols, ldb, a_size);
  probe_extent(C, m, n, ldc, c_size);

  const bool wide = computeType == CUBLAS_COMPUTE_64F;
  const at::ScalarType acc = wide ? at::kDouble : at::kFloat;
  const double alpha_v = wide ? *static_cast<const double*>(alpha) : *static_cast<const float*>(alpha);
  const double beta_v = wide ? *static_cast<const double*>(beta) : *static_cast<const float*>(beta);
  at::Tensor a = column_major(A, a_type, a_rows, a_cols, lda).to(acc);
  at::Tensor b = column_major(B, b_type, b_rows, b_cols, ldb).to(acc);
  if (computeType == CUBLAS_COMPUTE_32F_FAST_TF32) {
    a = round_to_tf32(a);
    b = round_to_tf32(b);
  }
  at::Tensor product = at::mm(a_plain ? a : a.t(), b_plain ? b : b.t());  // [m, n]
  at::Tensor c = column_major(C, c_type, m, n, ldc);
  at::Tensor result = product.mul(alpha_v);
  if (beta_v != 0.0) result.add_(c.to(acc), beta_v);  // beta == 0: C is not read, as in cuBLAS
  c.copy_(result);
  return CUBLAS_STATUS_SUCCESS;
}

const char* cublasGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}
