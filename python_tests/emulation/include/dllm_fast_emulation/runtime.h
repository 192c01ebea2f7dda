// The host emulator of CUDA kernels (test infrastructure; see python_tests/emulation/README.md).
//
// A launch runs its blocks one after another on the calling OS thread. Inside a block every CUDA thread is a
// fiber with its own stack; a fiber runs until it waits (a __syncthreads() barrier or a warp collective such
// as a shuffle) or exits, and the scheduler then resumes the next one. So threads really cooperate: a barrier
// holds every thread until all have arrived, and a shuffle exchanges the values that the lanes of its mask hand
// in. Everything is deterministic. A block that cannot go on (a barrier some thread never reaches, a shuffle
// naming a lane that has exited, threads waiting at different barriers) fails the launch with a message that
// names the kernel, the block, the threads and the source lines, as does a read of shared memory that the block
// never wrote or two threads touching one shared element with no barrier in between (SharedArray below).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>

#include "dllm_fast_emulation/types.h"

namespace dllm_fast::emulation {

// ------------------------------------------------------------------------------------------------------------
// The running thread, as kernels see it through threadIdx, blockIdx, blockDim and gridDim.
uint3 thread_index();
uint3 block_index();
dim3 block_dim();
dim3 grid_dim();

// Fails the running launch with `message` (prefixed by the kernel, block and thread) and never returns to the
// calling thread of the kernel: its fiber is abandoned.
[[noreturn]] void fail(const std::string& message);

// ------------------------------------------------------------------------------------------------------------
// Synchronisation.
void barrier(const char* file, int line);

enum class Collective { kShuffleIndex, kShuffleUp, kShuffleDown, kShuffleXor, kBallot, kSyncWarp };

// Waits until every lane named in `mask` has arrived at the same collective, then returns this lane's result:
// the source lane's `bits` for shuffles (all-ones poison when that lane is not in the mask), the ballot of the
// lanes' `bits != 0` for kBallot.
uint64_t warp_collective(Collective kind, unsigned mask, uint64_t bits, int operand, int width, const char* file,
                         int line);

// ------------------------------------------------------------------------------------------------------------
// Shared memory. Kernels declare it as `__shared__ SharedArray<T, N> name;` (a plain T[N] under nvcc). Here every
// element access goes through a reference that tells the block's shadow what happened, which reports a read
// of an element the block never wrote and a race: an element written by one thread and read or written by
// another, or read by one and written by another, with no barrier in between (atomics may meet atomics).
enum class Access { kRead, kWrite, kAtomic };

// The shadow of an array is created, and its bytes filled with 0xFF (NaN, or -1), at its first access in a
// block; `type` names the element type in messages.
void shared_access(void* array, size_t array_bytes, int64_t index, int64_t length, const std::type_info& type,
                   Access access);

template <typename T>
class SharedPtr;

template <typename T>
class SharedRef {
 public:
  SharedRef(T* array, int64_t length, int64_t index) : array_(array), length_(length), index_(index) {}
  operator T() const {
    shared_access(array_, sizeof(T) * length_, index_, length_, typeid(T), Access::kRead);
    return array_[index_];
  }
  SharedRef& operator=(const T& value) {
    shared_access(array_, sizeof(T) * length_, index_, length_, typeid(T), Access::kWrite);
    array_[index_] = value;
    return *this;
  }
  SharedRef& operator=(const SharedRef& other) { return *this = static_cast<T>(other); }
  template <typename U>
  SharedRef& operator+=(const U& value) {
    return *this = static_cast<T>(static_cast<T>(*this) + value);
  }
  SharedPtr<T> operator&() const { return SharedPtr<T>(array_, length_, index_); }

 private:
  T* array_;
  int64_t length_, index_;
};

// The address of a shared element, for atomics (atomicAdd(&counts[i], 1u)).
template <typename T>
class SharedPtr {
 public:
  SharedPtr(T* array, int64_t length, int64_t index) : array_(array), length_(length), index_(index) {}
  T* claim_atomic() const {
    shared_access(array_, sizeof(T) * length_, index_, length_, typeid(T), Access::kAtomic);
    return array_ + index_;
  }

 private:
  T* array_;
  int64_t length_, index_;
};

template <typename T, int N>
struct SharedArray {
  static_assert(std::is_trivially_copyable_v<T>, "shared memory holds trivially copyable values");
  T data[N];

  SharedRef<T> operator[](int64_t i) {
    if (i < 0 || i >= N) {
      fail("shared memory index " + std::to_string(i) + " is outside its array [0, " + std::to_string(N) + ")");
    }
    return SharedRef<T>(data, N, i);
  }
};

// ------------------------------------------------------------------------------------------------------------
// Launches. DLLM_FAST_LAUNCH(grid, block, smem, stream, kernel)(args...) becomes Launcher(...)(args...): the
// arguments are converted to the kernel's parameter types once, as CUDA copies them at the launch.

// Runs `body` for every thread of every block. A bad configuration or a failed block sets the calling OS
// thread's last error (cudaGetLastError) and its message (last_error_message).
void run_launch(const char* kernel, dim3 grid, dim3 block, size_t dynamic_shared_bytes, cudaStream_t stream,
                void (*body)(void*), void* closure);

template <typename... Params>
class Launcher {
 public:
  Launcher(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes = 0,
           cudaStream_t stream = nullptr)
      : name_(name), kernel_(kernel), grid_(grid), block_(block), shared_bytes_(shared_bytes), stream_(stream) {}

  template <typename... Args>
  void operator()(Args&&... args) const {
    static_assert(sizeof...(Args) == sizeof...(Params), "a kernel launch passes one argument per parameter");
    Call call{kernel_, std::tuple<std::decay_t<Params>...>(static_cast<std::decay_t<Params>>(args)...)};
    run_launch(name_, grid_, block_, shared_bytes_, stream_, &Call::run, &call);
  }

 private:
  struct Call {
    void (*kernel)(Params...);
    std::tuple<std::decay_t<Params>...> values;
    static void run(void* self) {
      Call& call = *static_cast<Call*>(self);
      std::apply(call.kernel, call.values);  // copies: every thread gets its own parameters
    }
  };

  const char* name_;
  void (*kernel_)(Params...);
  dim3 grid_, block_;
  size_t shared_bytes_;
  cudaStream_t stream_;
};

// ------------------------------------------------------------------------------------------------------------
// Errors and settings of the emulated device.
cudaError_t take_last_error();          // cudaGetLastError: returns the last error and resets it
std::string last_error_message();       // the detail of the last failed launch on this OS thread
const char* error_name(cudaError_t error);

// Launches run so far (in every OS thread): lets a test see that the emulated kernels ran.
int64_t launch_count();

// gridDim.x's limit (2^31 - 1 by default, as on every GPU since compute capability 3.0). Tests lower it to run
// the grid-stride loops of every kernel without giant tensors.
int64_t grid_limit_x();
void set_grid_limit_x(int64_t limit);

}  // namespace dllm_fast::emulation
