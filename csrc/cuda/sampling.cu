// CUDA kernels of the sampling ops (CUDA headers only; see sampling.cuh). The chunk GEMMs run in cuBLAS from
// sample_tokens_glue.cpp; these kernels fold each logits chunk into a Gumbel-max and a logsumexp per row, and
// pick the positions to unmask (select_transfer_glue.cpp launches that one).

#include "device_math.cuh"
#include "dllm_fast/philox.h"
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

template <typename acc_t>
__device__ __forceinline__ void take_better(Best<acc_t>& a, const Best<acc_t>& b) {
  if (b.token >= 0 && (a.token < 0 || b.score > a.score || (b.score == a.score && b.token < a.token))) a = b;
}

template <typename acc_t>
__global__ void __launch_bounds__(kThreads)
    sample_chunk_kernel(const acc_t* __restrict__ logits, int64_t cols, int64_t ld, int64_t v0,
                        const int64_t* __restrict__ row_ids, bool greedy, acc_t inv_temperature, uint64_t seed,
                        uint32_t offset, TokenList suppress, TokenList exclude, SampleState<acc_t> state) {
  const int64_t row = blockIdx.x;
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
      const acc_t score = greedy ? l : l * inv_temperature + static_cast<acc_t>(gumbel(words.w[k]));
      if (score > -INFINITY) take_better(best, Best<acc_t>{score, token, l});  // NaN and -inf never win, as on CPU
      if (!contains(exclude, token)) logsumexp_add(m, s, l);
    }
  }
  for (int step = 16; step > 0; step >>= 1) {
    Best<acc_t> other{__shfl_down_sync(0xffffffffu, best.score, step),
                      __shfl_down_sync(0xffffffffu, best.token, step),
                      __shfl_down_sync(0xffffffffu, best.logit, step)};
    take_better(best, other);
  }
  __shared__ SharedArray<Best<acc_t>, kWarps> warp_best;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_best[warp] = best;
  block_logsumexp(m, s);  // synchronises the block, which also publishes warp_best
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) take_better(best, static_cast<Best<acc_t>>(warp_best[w]));
    Best<acc_t> total{state.best_score[row], state.best_token[row], state.best_logit[row]};
    take_better(total, best);
    state.best_score[row] = total.score;
    state.best_token[row] = total.token;
    state.best_logit[row] = total.logit;
    logsumexp_merge(state.run_max[row], state.run_sum[row], m, s);
  }
}

template <typename acc_t>
__global__ void sample_finalize_kernel(int64_t rows, TokenList exclude, SampleState<acc_t> state,
                                       int64_t* __restrict__ tokens, acc_t* __restrict__ confidence) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows) return;
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

// One block per row; each thread ranks its positions by counting the candidates ahead of them.
template <typename conf_t>
__global__ void select_transfer_kernel(const conf_t* __restrict__ confidence, const bool* __restrict__ candidates,
                                       const int64_t* __restrict__ counts, int64_t n, double threshold,
                                       bool* __restrict__ transfer) {
  const int64_t row = blockIdx.x;
  const conf_t* c = confidence + row * n;
  const bool* cand = candidates + row * n;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    bool take = false;
    if (cand[i]) {
      int64_t rank = 0;
      for (int64_t j = 0; j < n; ++j) {
        rank += cand[j] && (c[j] > c[i] || (c[j] == c[i] && j < i));
      }
      take = threshold >= 0.0 ? (rank == 0 || static_cast<double>(c[i]) >= threshold) : rank < counts[row];
    }
    transfer[row * n + i] = take;
  }
}

}  // namespace

template <typename acc_t>
cudaError_t launch_sample_chunk(const acc_t* logits, int64_t rows, int64_t cols, int64_t ld, int64_t v0,
                                const int64_t* row_ids, bool greedy, acc_t inv_temperature, uint64_t seed,
                                uint32_t offset, TokenList suppress, TokenList exclude, SampleState<acc_t> state,
                                cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  DLLM_FAST_LAUNCH(static_cast<unsigned>(rows), kThreads, 0, stream, sample_chunk_kernel<acc_t>)(
      logits, cols, ld, v0, row_ids, greedy, inv_temperature, seed, offset, suppress, exclude, state);
  return cudaGetLastError();
}

template <typename acc_t>
cudaError_t launch_sample_finalize(int64_t rows, TokenList exclude, SampleState<acc_t> state, int64_t* tokens,
                                   acc_t* confidence, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((rows + kThreads - 1) / kThreads);
  DLLM_FAST_LAUNCH(blocks, kThreads, 0, stream, sample_finalize_kernel<acc_t>)(rows, exclude, state, tokens, confidence);
  return cudaGetLastError();
}

template <typename conf_t>
cudaError_t launch_select_transfer(const conf_t* confidence, const bool* candidates, const int64_t* counts,
                                   int64_t rows, int64_t n, double threshold, bool* transfer, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  const int threads = n >= 256 ? 256 : 32 * static_cast<int>((n + 31) / 32);
  DLLM_FAST_LAUNCH(static_cast<unsigned>(rows), threads, 0, stream, select_transfer_kernel<conf_t>)(confidence, candidates, counts,
                                                                                       n, threshold, transfer);
  return cudaGetLastError();
}

template cudaError_t launch_sample_chunk<float>(const float*, int64_t, int64_t, int64_t, int64_t, const int64_t*, bool,
                                                float, uint64_t, uint32_t, TokenList, TokenList, SampleState<float>,
                                                cudaStream_t);
template cudaError_t launch_sample_chunk<double>(const double*, int64_t, int64_t, int64_t, int64_t, const int64_t*,
                                                 bool, double, uint64_t, uint32_t, TokenList, TokenList,
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
