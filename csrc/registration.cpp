// The one place where dllm_fast's ops are declared (TORCH_LIBRARY) and bound to their CPU and CUDA kernels.
// The schemas and their documentation are listed in dllm_fast/schemas.h. Python reaches every op through
// torch.ops.dllm_fast.*; see dllm_fast/ops/ for the typed faces, fake (meta) kernels and autograd formulas.
// pybind11 exposes build information only, never tensors.

#include <torch/extension.h>

#include "dllm_fast/ops.h"
#include "dllm_fast/schemas.h"

TORCH_LIBRARY(dllm_fast, m) {
#define DLLM_FAST_DEFINE(name, schema) m.def(schema);
  DLLM_FAST_OP_SCHEMAS(DLLM_FAST_DEFINE)
#undef DLLM_FAST_DEFINE
}

TORCH_LIBRARY_IMPL(dllm_fast, CPU, m) {
  m.impl("masked_logprobs", &dllm_fast::masked_logprobs_cpu);
  m.impl("masked_logprobs_backward", &dllm_fast::masked_logprobs_backward_cpu);
  m.impl("masked_logprobs_grad", &dllm_fast::masked_logprobs_grad_cpu);
  m.impl("sample_tokens", &dllm_fast::sample_tokens_cpu);
  m.impl("select_transfer", &dllm_fast::select_transfer_cpu);
  m.impl("rope", &dllm_fast::rope_cpu);
}

#ifdef DLLM_FAST_WITH_CUDA
TORCH_LIBRARY_IMPL(dllm_fast, CUDA, m) {
#define DLLM_FAST_BIND(name, function) m.impl(#name, &dllm_fast::function);
  DLLM_FAST_CUDA_KERNELS(DLLM_FAST_BIND)
#undef DLLM_FAST_BIND
}
#endif

#ifndef DLLM_FAST_VERSION
#define DLLM_FAST_VERSION "0.1.0"
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "dllm_fast compiled ops; importing this module registers torch.ops.dllm_fast.*";
#ifdef DLLM_FAST_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  // The torch this extension was compiled against; a different runtime torch cannot load it.
  m.attr("torch_version") = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
  m.attr("version") = DLLM_FAST_VERSION;
}
