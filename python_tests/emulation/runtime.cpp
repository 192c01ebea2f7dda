// The emulator's scheduler: fibers for the threads of a block, barriers, warp collectives, the shadow of
// shared memory, and the errors they report. See dllm_fast_emulation/runtime.h for the model.

#include "dllm_fast_emulation/runtime.h"

#include <cxxabi.h>
#include <sys/mman.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <unordered_map>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__)
#error "the emulator's fiber switch (switch_stack below) is written for x86-64"
#endif

// switch_stack(&from, to): saves the callee-saved registers, the SSE and x87 control words and the stack
// pointer of the running fiber in *from, and resumes the one whose stack pointer is `to` (System V x86-64).
// A tenth of swapcontext's cost: no system call to save the signal mask.
extern "C" void dllm_fast_emulation_switch_stack(void** from, void* to);
asm(R"(
  .text
  .globl dllm_fast_emulation_switch_stack
  .type dllm_fast_emulation_switch_stack, @function
dllm_fast_emulation_switch_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  stmxcsr 8(%rsp)
  fnstcw (%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  fldcw (%rsp)
  ldmxcsr 8(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size dllm_fast_emulation_switch_stack, .-dllm_fast_emulation_switch_stack
  .section .note.GNU-stack,"",@progbits
  .text
)");

namespace dllm_fast::emulation {
namespace {

constexpr int kWarpSize = 32;
constexpr size_t kStackBytes = size_t{256} << 10;  // kernels are shallow; AddressSanitizer's frames are larger
constexpr size_t kGuardBytes = size_t{4} << 10;    // an overflow hits this page instead of the next stack

enum class State { kRunnable, kBarrier, kCollective, kExited, kFailed };

const char* collective_name(Collective kind) {
  switch (kind) {
    case Collective::kShuffleIndex: return "__shfl_sync";
    case Collective::kShuffleUp: return "__shfl_up_sync";
    case Collective::kShuffleDown: return "__shfl_down_sync";
    case Collective::kShuffleXor: return "__shfl_xor_sync";
    case Collective::kBallot: return "__ballot_sync";
    case Collective::kSyncWarp: return "__syncwarp";
  }
  return "a warp collective";
}

// A fiber's stack: mmap'd with a guard page below it, kept for the next launch on this OS thread.
struct Stack {
  char* base = nullptr;  // the guard page
  char* bottom() const { return base + kGuardBytes; }
  Stack() {
    void* memory = mmap(nullptr, kGuardBytes + kStackBytes, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (memory == MAP_FAILED) {
      std::fprintf(stderr, "dllm_fast emulator: cannot map a fiber stack\n");
      std::abort();
    }
    base = static_cast<char*>(memory);
    mprotect(base, kGuardBytes, PROT_NONE);
  }
  Stack(const Stack&) = delete;
  Stack& operator=(const Stack&) = delete;
  ~Stack() { munmap(base, kGuardBytes + kStackBytes); }
};

struct Thread {
  State state = State::kRunnable;
  unsigned linear = 0;
  uint3 index{0, 0, 0};
  void* stack_pointer = nullptr;  // while switched out
  void* fake_stack = nullptr;  // AddressSanitizer's, while switched out
  // Where it waits, and what it handed in.
  const char* file = "";
  int line = 0;
  Collective kind = Collective::kSyncWarp;
  unsigned mask = 0;
  int operand = 0, width = kWarpSize;
  uint64_t bits = 0, result = 0;
};

struct ElementShadow {
  bool written = false;
  bool atomic = false;        // the last writes were atomics
  bool many_writers = false;  // by more than one thread in write_epoch (atomics only)
  bool many_readers = false;
  int writer = -1, reader = -1;
  uint64_t write_epoch = 0, read_epoch = 0;
};

struct ArrayShadow {
  std::vector<ElementShadow> elements;
};

// Everything about the launch running on this OS thread.
struct Run {
  const char* kernel;
  dim3 grid, block;
  uint3 block_index{0, 0, 0};
  void (*body)(void*);
  void* closure;
  std::vector<Thread> threads;
  std::vector<unsigned> waiting_lanes;  // per warp, the lanes waiting at a warp collective
  int current = -1;
  uint64_t epoch = 1;  // advances at every completed barrier
  std::string error;
  void* scheduler_stack_pointer = nullptr;
  void* scheduler_fake_stack = nullptr;
  const void* scheduler_stack_bottom = nullptr;
  size_t scheduler_stack_size = 0;
  std::unordered_map<void*, ArrayShadow> shared;
};

thread_local Run* active = nullptr;
thread_local std::vector<std::unique_ptr<Stack>> stacks;
thread_local cudaError_t last_error = cudaSuccess;
thread_local std::string last_message;
int64_t grid_limit = 2147483647;
std::atomic<int64_t> launches{0};

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "dllm_fast emulator: %s\n", what);
  std::abort();
}

Run& run() {
  if (active == nullptr || active->current < 0) die("a device function ran outside an emulated kernel launch");
  return *active;
}

Thread& self() {
  Run& r = run();
  return r.threads[r.current];
}

std::string demangle(const std::type_info& type) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> name(abi::__cxa_demangle(type.name(), nullptr, nullptr, &status), std::free);
  return status == 0 ? name.get() : type.name();
}

std::string dims(uint3 v) {
  return "(" + std::to_string(v.x) + ", " + std::to_string(v.y) + ", " + std::to_string(v.z) + ")";
}

std::string where(const char* file, int line) {
  const char* slash = std::strrchr(file, '/');
  return std::string(slash ? slash + 1 : file) + ":" + std::to_string(line);
}

std::string hex(unsigned mask) {
  char text[16];
  std::snprintf(text, sizeof(text), "0x%08x", mask);
  return text;
}

// "0-31, 40, 64-95": a set of thread (or lane) numbers, compactly.
std::string ranges(const std::vector<unsigned>& ids) {
  std::ostringstream out;
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    out << (i ? ", " : "") << ids[i];
    if (j > i) out << "-" << ids[j];
    i = j + 1;
  }
  return out.str();
}

std::string prefix(const Run& r) {
  return std::string("kernel ") + r.kernel + ", block " + dims(r.block_index) + " of grid " +
         dims(uint3{r.grid.x, r.grid.y, r.grid.z}) + " with " + std::to_string(r.threads.size()) + " threads";
}

// ---- fibers ------------------------------------------------------------------------------------------------

void switch_to_fiber(Run& r, int index) {
  r.current = index;
  Thread& t = r.threads[index];
  Stack& stack = *stacks[index];
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(&r.scheduler_fake_stack, stack.bottom(), kStackBytes);
#else
  (void)stack;
#endif
  dllm_fast_emulation_switch_stack(&r.scheduler_stack_pointer, t.stack_pointer);
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(r.scheduler_fake_stack, nullptr, nullptr);
#endif
  r.current = -1;
}

void arrived_on_fiber(Run& r, Thread& t) {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(t.fake_stack, &r.scheduler_stack_bottom, &r.scheduler_stack_size);
#else
  (void)r;
  (void)t;
#endif
}

// Back to the scheduler; returns when the scheduler resumes this thread. `final`: it never will.
void switch_to_scheduler(Run& r, Thread& t, bool final) {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(final ? nullptr : &t.fake_stack, r.scheduler_stack_bottom, r.scheduler_stack_size);
#else
  (void)final;
#endif
  dllm_fast_emulation_switch_stack(&t.stack_pointer, r.scheduler_stack_pointer);
  arrived_on_fiber(r, t);
}

void fail_block(Run& r, const std::string& message) {
  if (r.error.empty()) r.error = prefix(r) + ": " + message;
}

// A thread has exited: the lanes that wait for it in a warp collective never will be served.
void check_exit(Run& r, Thread& t) {
  const unsigned lane = t.linear % kWarpSize, base = t.linear - lane;
  for (unsigned l = 0; l < kWarpSize && base + l < r.threads.size(); ++l) {
    const Thread& other = r.threads[base + l];
    if (other.state == State::kCollective && ((other.mask >> lane) & 1u)) {
      fail(std::string("exited while lane ") + std::to_string(l) + " of its warp waits for it in " +
           collective_name(other.kind) + " at " + where(other.file, other.line) + " (mask " + hex(other.mask) +
           ")");
    }
  }
}

void fiber_main() {
  Run& r = *active;
  Thread& t = r.threads[r.current];
  arrived_on_fiber(r, t);
  r.body(r.closure);
  check_exit(r, t);
  t.state = State::kExited;
  switch_to_scheduler(r, t, /*final=*/true);
  die("an exited thread was resumed");
}

void start_fiber(Run& r, int index) {
  Thread& t = r.threads[index];
  Stack& stack = *stacks[index];
#if defined(__SANITIZE_ADDRESS__)
  ASAN_UNPOISON_MEMORY_REGION(stack.bottom(), kStackBytes);  // an abandoned fiber may have left redzones
#endif
  // The frame that switch_stack pops on the first switch: control words, six registers, then a "return" into
  // fiber_main with the stack aligned as after a call (and a null return address of its own).
  uint64_t* top = reinterpret_cast<uint64_t*>(stack.bottom() + kStackBytes);
  *--top = 0;
  *--top = reinterpret_cast<uint64_t>(&fiber_main);
  for (int i = 0; i < 6; ++i) *--top = 0;
  top -= 2;
  uint32_t mxcsr;
  uint16_t x87;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(x87));
  std::memcpy(reinterpret_cast<char*>(top) + 8, &mxcsr, sizeof(mxcsr));
  std::memcpy(reinterpret_cast<char*>(top), &x87, sizeof(x87));
  t.stack_pointer = top;
  t.state = State::kRunnable;
  t.fake_stack = nullptr;
  (void)r;
}

// ---- warp collectives --------------------------------------------------------------------------------------

uint64_t poison_bits() { return ~uint64_t{0}; }

// The lane whose value lane `lane` receives, or -1 for its own value.
int source_lane(const Thread& t, unsigned lane) {
  const int w = t.width, group = static_cast<int>(lane) / w * w;
  switch (t.kind) {
    case Collective::kShuffleIndex: return group + ((t.operand % w) + w) % w;
    case Collective::kShuffleUp: {
      const int src = static_cast<int>(lane) - t.operand;
      return src < group ? -1 : src;
    }
    case Collective::kShuffleDown: {
      const int src = static_cast<int>(lane) + t.operand;
      return src >= group + w ? -1 : src;
    }
    case Collective::kShuffleXor: {
      const int src = static_cast<int>(lane) ^ t.operand;
      return src >= group + w ? -1 : src;
    }
    default: return -1;
  }
}

// If every lane of `mask` in the warp starting at `base` waits at a collective, checks that it is one and the
// same, and serves them all.
void complete_collective(Run& r, unsigned base, unsigned mask) {
  unsigned& waiting = r.waiting_lanes[base / kWarpSize];
  if ((waiting & mask) != mask) return;
  const unsigned first = static_cast<unsigned>(__builtin_ctz(mask));
  const Thread& model = r.threads[base + first];
  for (unsigned l = 0; l < kWarpSize; ++l) {
    const Thread& t = r.threads[base + l];
    if (!((mask >> l) & 1u)) continue;
    if (t.kind != model.kind || t.mask != model.mask || t.width != model.width || t.line != model.line ||
        std::strcmp(t.file, model.file) != 0) {
      fail(std::string("the lanes of mask ") + hex(mask) + " wait at different warp collectives: lane " +
           std::to_string(first) + " in " + collective_name(model.kind) + " at " + where(model.file, model.line) +
           " (mask " + hex(model.mask) + "), lane " + std::to_string(l) + " in " + collective_name(t.kind) + " at " +
           where(t.file, t.line) + " (mask " + hex(t.mask) + ")");
    }
  }
  uint64_t ballot = 0;
  for (unsigned l = 0; l < kWarpSize; ++l) {
    if (((mask >> l) & 1u) && r.threads[base + l].bits != 0) ballot |= uint64_t{1} << l;
  }
  for (unsigned l = 0; l < kWarpSize; ++l) {
    if (!((mask >> l) & 1u)) continue;
    Thread& t = r.threads[base + l];
    if (t.kind == Collective::kBallot) {
      t.result = ballot;
    } else if (t.kind != Collective::kSyncWarp) {
      const int src = source_lane(t, l);
      if (src < 0) {
        t.result = t.bits;
      } else if ((mask >> src) & 1u) {
        t.result = r.threads[base + src].bits;
      } else {
        t.result = poison_bits();  // CUDA leaves it undefined: a lane outside the mask handed nothing in
      }
    }
    t.state = State::kRunnable;
  }
  waiting &= ~mask;
}

}  // namespace

// ---- the kernel's view -------------------------------------------------------------------------------------

uint3 thread_index() { return self().index; }
uint3 block_index() { return run().block_index; }
dim3 block_dim() { return run().block; }
dim3 grid_dim() { return run().grid; }

void fail(const std::string& message) {
  Run& r = run();
  Thread& t = r.threads[r.current];
  if (r.error.empty()) r.error = prefix(r) + ", thread " + dims(t.index) + ": " + message;
  t.state = State::kFailed;
  switch_to_scheduler(r, t, /*final=*/true);
  die("a failed thread was resumed");
}

void barrier(const char* file, int line) {
  Run& r = run();
  Thread& t = r.threads[r.current];
  t.state = State::kBarrier;
  t.file = file;
  t.line = line;
  switch_to_scheduler(r, t, /*final=*/false);
}

uint64_t warp_collective(Collective kind, unsigned mask, uint64_t bits, int operand, int width, const char* file,
                         int line) {
  Run& r = run();
  Thread& t = r.threads[r.current];
  const unsigned lane = t.linear % kWarpSize, base = t.linear - lane;
  const auto call = [&] {
    return std::string(collective_name(kind)) + " at " + where(file, line) + " with mask " + hex(mask);
  };
  if (width < 1 || width > kWarpSize || (width & (width - 1)) != 0) {
    fail(call() + ": width " + std::to_string(width) + " is not a power of two in [1, 32]");
  }
  if (!((mask >> lane) & 1u)) fail(call() + ": the mask does not name the calling lane " + std::to_string(lane));
  std::vector<unsigned> missing, exited;  // stay empty (no allocation) in a correct kernel
  for (unsigned l = 0; l < kWarpSize; ++l) {
    if (!((mask >> l) & 1u)) continue;
    if (base + l >= r.threads.size()) {
      missing.push_back(l);
    } else if (r.threads[base + l].state == State::kExited) {
      exited.push_back(l);
    }
  }
  if (!missing.empty()) {
    fail(call() + ": the mask names lanes " + ranges(missing) + ", which this warp does not have (the block has " +
         std::to_string(r.threads.size()) + " threads, so warp " + std::to_string(base / kWarpSize) + " has " +
         std::to_string(r.threads.size() - base) + " lanes)");
  }
  if (!exited.empty()) fail(call() + ": the mask names lanes " + ranges(exited) + ", which have exited");
  t.state = State::kCollective;
  r.waiting_lanes[base / kWarpSize] |= 1u << lane;
  t.kind = kind;
  t.mask = mask;
  t.operand = operand;
  t.width = width;
  t.bits = bits;
  t.file = file;
  t.line = line;
  complete_collective(r, base, mask);
  if (t.state == State::kCollective) switch_to_scheduler(r, t, /*final=*/false);
  return t.result;
}

void shared_access(void* array, size_t array_bytes, int64_t index, int64_t length, const std::type_info& type,
                   Access access) {
  Run& r = run();
  const int me = static_cast<int>(r.threads[r.current].linear);
  auto [entry, first] = r.shared.try_emplace(array);
  if (first) {
    entry->second.elements.assign(static_cast<size_t>(length), ElementShadow{});
    std::memset(array, 0xFF, array_bytes);  // what a read before any write would see
  }
  ElementShadow& e = entry->second.elements[static_cast<size_t>(index)];
  const uint64_t now = r.epoch;
  const auto element = [&] {
    return "element " + std::to_string(index) + " of a shared " + demangle(type) + "[" + std::to_string(length) + "]";
  };
  const auto since_barrier = [&](const char* what, int other) {
    return std::string(what) + (other == me ? " another thread" : " thread " + std::to_string(other)) +
           " since the last __syncthreads()";
  };
  const bool written_now = e.written && e.write_epoch == now;
  const bool read_by_other = e.read_epoch == now && (e.reader != me || e.many_readers);
  switch (access) {
    case Access::kRead:
      if (!e.written) fail("reads " + element() + " that no thread of this block has written");
      if (written_now && (e.writer != me || e.many_writers)) {
        fail("reads " + element() + ", " + since_barrier(e.atomic ? "updated atomically by" : "written by", e.writer) +
             " (a race: put a __syncthreads() between the write and the read)");
      }
      if (e.read_epoch != now) {
        e.read_epoch = now;
        e.reader = me;
        e.many_readers = false;
      } else if (e.reader != me) {
        e.many_readers = true;
      }
      break;
    case Access::kWrite:
      if (written_now && (e.writer != me || e.many_writers)) {
        fail("writes " + element() + ", " + since_barrier("also written by", e.writer) + " (a race)");
      }
      if (read_by_other) {
        fail("writes " + element() + ", " + since_barrier("read by", e.reader) +
             " (a race: put a __syncthreads() between the read and the write)");
      }
      e = ElementShadow{true, false, false, e.many_readers, me, e.reader, now, e.read_epoch};
      break;
    case Access::kAtomic:
      if (!e.written) fail("atomically updates " + element() + " that no thread of this block has written");
      if (written_now && !e.atomic && e.writer != me) {
        fail("atomically updates " + element() + ", " + since_barrier("written by", e.writer) + " (a race)");
      }
      if (read_by_other) {
        fail("atomically updates " + element() + ", " + since_barrier("read by", e.reader) + " (a race)");
      }
      e.many_writers = written_now && e.atomic && (e.many_writers || e.writer != me);
      e.written = true;
      e.atomic = true;
      e.writer = me;
      e.write_epoch = now;
      break;
  }
}

// ---- the launch --------------------------------------------------------------------------------------------

namespace {

std::string configuration_error(dim3 grid, dim3 block, size_t dynamic_shared_bytes) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (block.x == 0 || block.y == 0 || block.z == 0 || threads > 1024 || block.z > 64) {
    return "block " + dims(uint3{block.x, block.y, block.z}) +
           " is not a valid block: 1 to 1024 threads, blockDim.z at most 64";
  }
  if (grid.x == 0 || static_cast<int64_t>(grid.x) > grid_limit || grid.y == 0 || grid.y > 65535 || grid.z == 0 ||
      grid.z > 65535) {
    return "grid " + dims(uint3{grid.x, grid.y, grid.z}) + " is not a valid grid: gridDim.x in [1, " +
           std::to_string(grid_limit) + "], gridDim.y and gridDim.z in [1, 65535]";
  }
  if (dynamic_shared_bytes != 0) return "dynamic shared memory is not emulated (declare SharedArray instead)";
  return "";
}

void run_block(Run& r) {
  r.shared.clear();
  r.epoch = 1;
  r.waiting_lanes.assign((r.threads.size() + kWarpSize - 1) / kWarpSize, 0u);
  const unsigned n = static_cast<unsigned>(r.threads.size());
  for (unsigned i = 0; i < n; ++i) start_fiber(r, static_cast<int>(i));
  for (;;) {
    bool ran = false;
    for (unsigned i = 0; i < n; ++i) {
      if (r.threads[i].state != State::kRunnable) continue;
      switch_to_fiber(r, static_cast<int>(i));
      ran = true;
      if (!r.error.empty()) return;
    }
    if (ran) continue;
    std::vector<unsigned> at_barrier, in_collective, exited;
    for (const Thread& t : r.threads) {
      if (t.state == State::kBarrier) at_barrier.push_back(t.linear);
      if (t.state == State::kCollective) in_collective.push_back(t.linear);
      if (t.state == State::kExited) exited.push_back(t.linear);
    }
    if (exited.size() == n) return;
    const Thread& first = r.threads[at_barrier.empty() ? 0 : at_barrier[0]];
    if (in_collective.empty() && !at_barrier.empty()) {
      if (!exited.empty()) {
        return fail_block(r, "threads " + ranges(at_barrier) + " wait at the __syncthreads() at " +
                                 where(first.file, first.line) + ", which threads " + ranges(exited) +
                                 " never reach: they have exited");
      }
      for (unsigned i : at_barrier) {
        const Thread& t = r.threads[i];
        if (t.line != first.line || std::strcmp(t.file, first.file) != 0) {
          return fail_block(r, "threads wait at different __syncthreads(): thread " + std::to_string(first.linear) +
                                   " at " + where(first.file, first.line) + ", thread " + std::to_string(t.linear) +
                                   " at " + where(t.file, t.line));
        }
      }
      ++r.epoch;
      for (Thread& t : r.threads) t.state = State::kRunnable;
      continue;
    }
    std::string message = "deadlock: no thread can go on;";
    if (!at_barrier.empty()) {
      message += " threads " + ranges(at_barrier) + " wait at the __syncthreads() at " +
                 where(first.file, first.line) + ";";
    }
    const Thread& waiting = r.threads[in_collective[0]];
    message += " threads " + ranges(in_collective) + " wait in warp collectives (thread " +
               std::to_string(waiting.linear) + " in " + collective_name(waiting.kind) + " at " +
               where(waiting.file, waiting.line) + " with mask " + hex(waiting.mask) + ")";
    if (!exited.empty()) message += "; threads " + ranges(exited) + " have exited";
    return fail_block(r, message);
  }
}

}  // namespace

void run_launch(const char* kernel, dim3 grid, dim3 block, size_t dynamic_shared_bytes, cudaStream_t stream,
                void (*body)(void*), void* closure) {
  (void)stream;  // one emulated stream: launches run in program order
  const std::string bad = configuration_error(grid, block, dynamic_shared_bytes);
  if (!bad.empty()) {
    last_error = cudaErrorInvalidConfiguration;
    last_message = std::string("kernel ") + kernel + ": " + bad;
    return;
  }
  if (active != nullptr) die("a kernel launched another kernel; the emulator runs one launch at a time");
  ++launches;
  Run r;
  r.kernel = kernel;
  r.grid = grid;
  r.block = block;
  r.body = body;
  r.closure = closure;
  const unsigned n = block.x * block.y * block.z;
  r.threads.resize(n);
  for (unsigned i = 0; i < n; ++i) {
    r.threads[i].linear = i;
    r.threads[i].index = uint3{i % block.x, i / block.x % block.y, i / (block.x * block.y)};
  }
  while (stacks.size() < n) stacks.push_back(std::make_unique<Stack>());
  active = &r;
  for (unsigned z = 0; z < grid.z && r.error.empty(); ++z) {
    for (unsigned y = 0; y < grid.y && r.error.empty(); ++y) {
      for (unsigned x = 0; x < grid.x && r.error.empty(); ++x) {
        r.block_index = uint3{x, y, z};
        run_block(r);
      }
    }
  }
  active = nullptr;
  if (!r.error.empty()) {
    last_error = cudaErrorLaunchFailure;
    last_message = r.error;
  }
}

cudaError_t take_last_error() {
  const cudaError_t error = last_error;
  last_error = cudaSuccess;
  return error;
}

std::string last_error_message() { return last_message; }

const char* error_name(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
  }
  return "unknown error";
}

int64_t launch_count() { return launches.load(); }

int64_t grid_limit_x() { return grid_limit; }

void set_grid_limit_x(int64_t limit) {
  if (limit < 1 || limit > 2147483647) die("the emulated grid limit must be in [1, 2^31 - 1]");
  grid_limit = limit;
}

}  // namespace dllm_fast::emulation
