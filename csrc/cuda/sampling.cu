// CUDA kernels of the sampling ops (CUDA headers only; see sampling.cuh). The chunk GEMMs run in cuBLAS from
// sample_tokens_glue.cpp; these kernels fold each logits chunk into a Gumbel-max and a logsumexp per row, and
// pick the positions to unmask (select_transfer_glue.cpp launches that one).

#include <cstring>

#include "device_math.cuh"
#include "dllm_fast/philox.h"
#include "launch.cuh"
#include "sampling.cuh"

namespace dllm_fast::cuda {
namespace {

// A fixed, unrolled loop keeps the lists in registers (a loop bounded by count spills them to the stack).
__device__ __forceinline__ bool contains(const TokenList& list, int64_t id) {
  bool hit = false;
#pragma unroll
  for (int i = 0; i < TokenList::kCapacity; ++i) hit |= (i < list.count) & (list.ids[i] == id);
  return hit;
}

// Same transform as the CPU kernel: E = -log1p(-v) ~ Exp(1), Gumbel = -log(E).
__device__ __forceinline__ float gumbel(uint32_t word) { return -logf(-log1pf(-uniform_open(word))); }

template <typename acc_t>
struct Best {
  acc_t score;
  int64_t token;
  acc_t logit;
};

// The better of two candidates: the higher score, ties to the lower token id; token -1 is "none yet".
template <typename acc_t>
__device__ __forceinline__ Best<acc_t> better(const Best<acc_t>& a, const Best<acc_t>& b) {
  return b.token >= 0 && (a.token < 0 || b.score > a.score || (b.score == a.score && b.token < a.token)) ? b : a;
}

template <typename acc_t>
__device__ __forceinline__ Best<acc_t> shuffle_down(unsigned mask, const Best<acc_t>& value, unsigned offset) {
  return Best<acc_t>{__shfl_down_sync(mask, value.score, offset), __shfl_down_sync(mask, value.token, offset),
                     __shfl_down_sync(mask, value.logit, offset)};
}

// A block per row (striding over rows beyond the grid). score = logit * logit_scale + noise_scale * Gumbel: the
// glue passes (1, T) for T < 1 and (1 / T, 1) for T >= 1, an order-preserving rescaling of logit / T + Gumbel
// that cannot overflow, and (1, 0) for greedy rows, which skip the noise.
template <typename acc_t>
__global__ void __launch_bounds__(kThreads)
    sample_chunk_kernel(const acc_t* __restrict__ logits, int64_t rows, int64_t cols, int64_t ld, int64_t v0,
                        const int64_t* __restrict__ row_ids, bool greedy, acc_t logit_scale, acc_t noise_scale,
                        uint64_t seed, uint32_t offset, TokenList suppress, TokenList exclude,
                        SampleState<acc_t> state) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const acc_t* x = logits + row * ld;
    const uint64_t rid = static_cast<uint64_t>(row_ids[row]);
    Best<acc_t> best{-INFINITY, -1, 0};
    acc_t m = -INFINITY, s = 0;
    for (int64_t q = threadIdx.x; 4 * q < cols; q += blockDim.x) {
      PhiloxWords words{{0, 0, 0, 0}};
      if (!greedy) words = philox_for_quad(seed, offset, rid, static_cast<uint32_t>(v0 / 4 + q));
      for (int k = 0; k < 4 && 4 * q + k < cols; ++k) {
        const int64_t j = 4 * q + k, token = v0 + j;
        if (contains(suppress, token)) continue;
        const acc_t l = x[j];
        const acc_t score = greedy ? l : l * logit_scale + noise_scale * static_cast<acc_t>(gumbel(words.w[k]));
        if (score > -INFINITY) best = better(best, Best<acc_t>{score, token, l});  // NaN and -inf never win
        if (!contains(exclude, token)) logsumexp_add(m, s, l);
      }
    }
    best = block_reduce(best, [](const Best<acc_t>& a, const Best<acc_t>& b) { return better(a, b); });
    block_logsumexp(m, s);
    if (threadIdx.x == 0) {
      const Best<acc_t> total = better(Best<acc_t>{state.best_score[row], state.best_token[row], state.best_logit[row]},
                                       best);
      state.best_score[row] = total.score;
      state.best_token[row] = total.token;
      state.best_logit[row] = total.logit;
      logsumexp_merge(state.run_max[row], state.run_sum[row], m, s);
    }
  }
}

template <typename acc_t>
__global__ void sample_finalize_kernel(int64_t rows, TokenList exclude, SampleState<acc_t> state,
                                       int64_t* __restrict__ tokens, acc_t* __restrict__ confidence) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < rows; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t token = state.best_token[i];
    tokens[i] = token;
    if (token < 0) {
      confidence[i] = NAN;
    } else if (contains(exclude, token)) {
      confidence[i] = 0;
    } else {
      confidence[i] = exp_acc(state.best_logit[i] - logsumexp_value(state.run_max[i], state.run_sum[i]));
    }
  }
}

// The order of confidences as unsigned integers, larger for more confident: NaN ranks as -inf and -0 as +0, as
// in the CPU kernel. float widens to double exactly.
__device__ __forceinline__ uint64_t order_key(double c) {
  if (c != c) c = -INFINITY;
  if (c == 0.0) c = 0.0;
  uint64_t bits;
  memcpy(&bits, &c, sizeof(bits));
  return (bits >> 63) ? ~bits : bits | (uint64_t{1} << 63);
}

struct Ranked {
  uint64_t key;
  int64_t position;  // -1: none
};

__device__ __forceinline__ Ranked higher(const Ranked& a, const Ranked& b) {
  return b.position >= 0 && (a.position < 0 || b.key > a.key || (b.key == a.key && b.position < a.position)) ? b : a;
}

__device__ __forceinline__ Ranked shuffle_down(unsigned mask, const Ranked& value, unsigned offset) {
  return Ranked{__shfl_down_sync(mask, value.key, offset), __shfl_down_sync(mask, value.position, offset)};
}

// Radix selection over the block: among the positions j < n with included(j), the want-th largest value_of(j)
// (smallest when ascending), 8 bits per pass from the top of `bits`. On return `want` is that value's rank
// among the values equal to it. O(n * bits / 8) per row. Every thread must call it.
template <typename ValueOf, typename Included>
__device__ __forceinline__ uint64_t radix_select(ValueOf value_of, Included included, int64_t n, int bits,
                                                 bool ascending, int64_t& want, SharedArray<unsigned, 256>& histogram,
                                                 SharedArray<int64_t, 2>& found) {
  uint64_t prefix = 0, prefix_mask = 0;
  for (int shift = (bits - 1) / 8 * 8; shift >= 0; shift -= 8) {
    for (unsigned d = threadIdx.x; d < 256; d += blockDim.x) histogram[d] = 0u;
    __syncthreads();
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      if (!included(j)) continue;
      const uint64_t v = value_of(j);
      if ((v & prefix_mask) == prefix) atomicAdd(&histogram[(v >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int64_t before = 0;
      unsigned digit = 0;
      for (unsigned i = 0; i < 256; ++i) {
        digit = ascending ? i : 255u - i;
        const int64_t count = static_cast<unsigned>(histogram[digit]);
        if (before + count >= want) break;
        before += count;
      }
      found[0] = static_cast<int64_t>(prefix | (uint64_t{digit} << shift));
      found[1] = want - before;
    }
    __syncthreads();
    prefix = static_cast<uint64_t>(static_cast<int64_t>(found[0]));
    want = found[1];
    prefix_mask |= uint64_t{255} << shift;
  }
  __syncthreads();  // before a next call rewrites found
  return prefix;
}

// A block per row (striding over rows beyond the grid). Threshold: the candidate of highest confidence (ties to
// the lowest position) plus every candidate at or above the threshold, in one reduction. Top-k: the k-th
// highest confidence K by radix selection, then the candidates above K and, among those at K, the lowest
// positions: the same set as ranking every candidate, in O(n) per row.
template <typename conf_t>
__global__ void select_transfer_kernel(const conf_t* __restrict__ confidence, const bool* __restrict__ candidates,
                                       const int64_t* __restrict__ counts, int64_t rows, int64_t n, double threshold,
                                       bool* __restrict__ transfer) {
  __shared__ SharedArray<unsigned, 256> histogram;
  __shared__ SharedArray<int64_t, 2> found;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const conf_t* c = confidence + row * n;
    const bool* cand = candidates + row * n;
    bool* out = transfer + row * n;
    if (threshold >= 0.0) {
      Ranked top{0, -1};
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
        if (cand[j]) top = higher(top, Ranked{order_key(c[j]), j});
      }
      top = block_reduce(top, [](const Ranked& a, const Ranked& b) { return higher(a, b); });
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
        out[j] = cand[j] && (j == top.position || static_cast<double>(c[j]) >= threshold);
      }
      continue;
    }
    int64_t held = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) held += cand[j];
    const int64_t total = block_reduce(held, [](int64_t a, int64_t b) { return a + b; });
    int64_t want = counts[row];
    if (want <= 0 || want >= total) {
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) out[j] = cand[j] && want > 0;
      continue;
    }
    const auto key_of = [&](int64_t j) { return order_key(c[j]); };
    const uint64_t kth = radix_select(key_of, [&](int64_t j) { return cand[j]; }, n, 64, false, want, histogram, found);
    int position_bits = 1;
    while (position_bits < 63 && (int64_t{1} << position_bits) < n) ++position_bits;
    const int64_t last = static_cast<int64_t>(radix_select([](int64_t j) { return static_cast<uint64_t>(j); },
                                                           [&](int64_t j) { return cand[j] && key_of(j) == kth; }, n,
                                                           position_bits, true, want, histogram, found));
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const uint64_t key = key_of(j);
      out[j] = cand[j] && (key > kth || (key == kth && j <= last));
    }
  }
}

}  // namespace

template <typename acc_t>
cudaError_t launch_sample_chunk(const acc_t* logits, int64_t rows, int64_t cols, int64_t ld, int64_t v0,
                                const int64_t* row_ids, bool greedy, acc_t logit_scale, acc_t noise_scale,
                                uint64_t seed, uint32_t offset, TokenList suppress, TokenList exclude,
                                SampleState<acc_t> state, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  DLLM_FAST_LAUNCH(row_grid(rows), kThreads, 0, stream, sample_chunk_kernel<acc_t>)(
      logits, rows, cols, ld, v0, row_ids, greedy, logit_scale, noise_scale, seed, offset, suppress, exclude, state);
  return cudaGetLastError();
}

template <typename acc_t>
cudaError_t launch_sample_finalize(int64_t rows, TokenList exclude, SampleState<acc_t> state, int64_t* tokens,
                                   acc_t* confidence, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  DLLM_FAST_LAUNCH(item_grid(rows, kThreads), kThreads, 0, stream, sample_finalize_kernel<acc_t>)(
      rows, exclude, state, tokens, confidence);
  return cudaGetLastError();
}

template <typename conf_t>
cudaError_t launch_select_transfer(const conf_t* confidence, const bool* candidates, const int64_t* counts,
                                   int64_t rows, int64_t n, double threshold, bool* transfer, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  const int threads = n >= 256 ? 256 : 32 * static_cast<int>((n + 31) / 32);
  DLLM_FAST_LAUNCH(row_grid(rows), threads, 0, stream, select_transfer_kernel<conf_t>)(
      confidence, candidates, counts, rows, n, threshold, transfer);
  return cudaGetLastError();
}

template cudaError_t launch_sample_chunk<float>(const float*, int64_t, int64_t, int64_t, int64_t, const int64_t*, bool,
                                                float, float, uint64_t, uint32_t, TokenList, TokenList,
                                                SampleState<float>, cudaStream_t);
template cudaError_t launch_sample_chunk<double>(const double*, int64_t, int64_t, int64_t, int64_t, const int64_t*,
                                                 bool, double, double, uint64_t, uint32_t, TokenList, TokenList,
                                                 SampleState<double>, cudaStream_t);
template cudaError_t launch_sample_finalize<float>(int64_t, TokenList, SampleState<float>, int64_t*, float*,
                                                   cudaStream_t);
template cudaError_t launch_sample_finalize<double>(int64_t, TokenList, SampleState<double>, int64_t*, double*,
                                                    cudaStream_t);
template cudaError_t launch_select_transfer<float>(const float*, const bool*, const int64_t*, int64_t, int64_t, double,
                                                   bool*, cudaStream_t);
template cudaError_t launch_select_transfer<double>(const double*, const bool*, const int64_t*, int64_t, int64_t,
                                                    double, bool*, cudaStream_t);

}  // namespace dllm_fast::cuda
