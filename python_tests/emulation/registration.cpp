// The emulated CUDA build (test-only): the CUDA implementations of csrc/cuda, compiled for the host and run by
// the emulator, registered for CPU tensors as torch.ops.dllm_fast_emulated.* with the schemas of
// torch.ops.dllm_fast.* (dllm_fast/schemas.h). dllm_fast.testing.emulation builds and loads it, and can route the
// dllm_fast ops to it. Also the emulator's self-tests and a few settings, for python_tests/test_emulator.py.

#include <torch/extension.h>

#include <vector>

#include "dllm_fast/ops.h"
#include "dllm_fast/schemas.h"
#include "dllm_fast_emulation/gemm_log.h"
#include "dllm_fast_emulation/runtime.h"
#include "launch.cuh"
#include "selftest.h"

namespace dllm_fast::emulation {
namespace {

void check_emulated(cudaError_t error) {
  TORCH_CHECK(error == cudaSuccess, "CUDA error: ", cudaGetErrorString(error), " (emulated): ", last_error_message());
}

// Runs a self-test kernel on a copy of data (float32, CPU) and returns the copy.
at::Tensor emulator_selftest(const at::Tensor& data, c10::string_view kernel, int64_t blocks, int64_t threads) {
  at::Tensor out = data.to(at::kFloat).contiguous().clone();
  bool known = false;
  const cudaError_t error = selftest::run(std::string(kernel), out.data_ptr<float>(), out.numel(),
                                          static_cast<unsigned>(blocks), static_cast<unsigned>(threads), &known);
  TORCH_CHECK(known, "emulator_selftest: no self-test kernel named ", kernel, " (see python_tests/emulation/selftest.cu)");
  check_emulated(error);
  return out;
}

at::Tensor reduce_logsumexp_rows(const at::Tensor& x_in, int64_t threads, int64_t calls) {
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({x.size(0), calls}, x.options());
  dispatch_accumulate(x.scalar_type(), [&](auto acc) {
    using acc_t = decltype(acc);
    check_emulated(selftest::reduce_logsumexp_rows<acc_t>(x.data_ptr<acc_t>(), x.size(0), x.size(1),
                                                          static_cast<int>(calls), static_cast<unsigned>(threads),
                                                          out.data_ptr<acc_t>()));
  });
  return out;
}

}  // namespace
}  // namespace dllm_fast::emulation

TORCH_LIBRARY(dllm_fast_emulated, m) {
#define DLLM_FAST_DEFINE(name, schema) m.def(schema);
  DLLM_FAST_OP_SCHEMAS(DLLM_FAST_DEFINE)
#undef DLLM_FAST_DEFINE
  m.def("emulator_selftest(Tensor data, str kernel, int blocks, int threads) -> Tensor");
  m.def("reduce_logsumexp_rows(Tensor x, int threads, int calls) -> Tensor");
}

TORCH_LIBRARY_IMPL(dllm_fast_emulated, CPU, m) {
#define DLLM_FAST_BIND(name, function) m.impl(#name, &dllm_fast::function);
  DLLM_FAST_CUDA_KERNELS(DLLM_FAST_BIND)
#undef DLLM_FAST_BIND
  m.impl("emulator_selftest", &dllm_fast::emulation::emulator_selftest);
  m.impl("reduce_logsumexp_rows", &dllm_fast::emulation::reduce_logsumexp_rows);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dllm_fast's CUDA kernels and glue run on the CPU by the host emulator (test-only)";
  std::vector<std::string> ops;
#define DLLM_FAST_NAME(name, function) ops.push_back(#name);
  DLLM_FAST_CUDA_KERNELS(DLLM_FAST_NAME)
#undef DLLM_FAST_NAME
  m.attr("ops") = ops;  // the dllm_fast ops whose CUDA implementation this module holds
#if defined(__SANITIZE_ADDRESS__)
  m.attr("sanitized") = true;
#else
  m.attr("sanitized") = false;
#endif
  m.def("launch_count", &dllm_fast::emulation::launch_count, "kernel launches the emulator has run");
  m.def("gemm_log_begin", &dllm_fast::emulation::gemm_log_begin,
        "open a recording of the host cuBLAS's GEMMs; returns the index its records start at");
  m.def("gemm_log_records",
        [](int64_t start) {
          std::vector<py::tuple> records;
          for (const auto& r : dllm_fast::emulation::gemm_log_records(start)) {
            records.push_back(py::make_tuple(r.a_type, r.b_type, r.c_type, r.compute, r.m, r.n, r.k, r.transa,
                                             r.transb));
          }
          return records;
        },
        "the recorded GEMMs from index `start` on: (a, b, c dtype names, compute, m, n, k, transa, transb)");
  m.def("gemm_log_end", &dllm_fast::emulation::gemm_log_end, "close a recording (the outermost drops the records)");
  m.def("grid_limit_x", &dllm_fast::emulation::grid_limit_x, "gridDim.x's limit on the emulated device");
  m.def("set_grid_limit_x", &dllm_fast::emulation::set_grid_limit_x,
        "lower gridDim.x's limit (tests of the grid-stride loops); 2**31 - 1 restores it");
  m.def("row_grid", [](int64_t rows, int64_t limit) { return dllm_fast::cuda::row_grid(rows, limit); },
        "blocks of a one-block-per-row launch of `rows` rows under a grid limit");
  m.def("item_grid",
        [](int64_t items, int64_t threads, int64_t limit) {
          return dllm_fast::cuda::item_grid(items, static_cast<int>(threads), limit);
        },
        "blocks of a one-item-per-thread launch under a grid limit");
}
