// Stand-in for c10/cuda/CUDAGuard.h in the emulated build: there is one emulated device, so the guard only
// accepts the device it is given (a CPU device: the emulated kernels run on CPU tensors).
#pragma once

#include <c10/core/Device.h>

namespace c10::cuda {

struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
};

}  // namespace c10::cuda
