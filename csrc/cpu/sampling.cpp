// CPU kernels of the block-diffusion sampling ops.
//
// sample_tokens: per vocabulary chunk, one GEMM into a reused [N, C] buffer, then per row: Gumbel-max over
// logits / T with Philox noise keyed by (seed, offset, row id, column), and a running logsumexp of the
// unscaled logits for the confidence softmax(logits)[token]. One pass over V; no [N, V] tensor.
// select_transfer: per row, the positions to unmask this step (top-k by confidence, ties to the lowest
// position, or Fast-dLLM's threshold rule).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <vector>

#include "dllm_fast/gumbel_max.h"
#include "dllm_fast/ops.h"
#include "dllm_fast/philox.h"
#include "vec_math.h"

namespace dllm_fast {
namespace {

using cpu::gumbel_from_uniform;
using cpu::online_logsumexp_update;
using cpu::row_max;

// Philox words for the columns [4 * first_quad, 4 * (first_quad + quads)) of one row.
DLLM_FAST_MULTIVERSION
[[maybe_unused]] static void philox_words(uint32_t* words, int64_t quads, uint64_t seed, uint32_t offset,
                                          uint64_t row, uint32_t first_quad) {
  for (int64_t q = 0; q < quads; ++q) {
    const PhiloxWords r = philox_for_quad(seed, offset, row, first_quad + static_cast<uint32_t>(q));
    words[4 * q] = r.w[0];
    words[4 * q + 1] = r.w[1];
    words[4 * q + 2] = r.w[2];
    words[4 * q + 3] = r.w[3];
  }
}

// scores[j] = logits[j] * logit_scale + noise_scale * Gumbel(words[j]) (gumbel_max.h).
DLLM_FAST_MULTIVERSION
[[maybe_unused]] static void gumbel_scores(float* scores, const float* logits, const uint32_t* words, int64_t n,
                                           float logit_scale, float noise_scale) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = logits[j] * logit_scale + noise_scale * gumbel_from_uniform(uniform_open(words[j]));
  }
}

[[maybe_unused]] static void gumbel_scores(double* scores, const double* logits, const uint32_t* words, int64_t n,
                                           double logit_scale, double noise_scale) {
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = logits[j] * logit_scale +
                noise_scale * static_cast<double>(gumbel_from_uniform(uniform_open(words[j])));
  }
}

template <typename acc_t>
int64_t first_index_of(const acc_t* x, int64_t n, acc_t value) {
  for (int64_t j = 0; j < n; ++j) {
    if (x[j] == value) return j;
  }
  return -1;
}

template <typename acc_t>
struct RowState {
  acc_t best_score = -std::numeric_limits<acc_t>::infinity();
  int64_t best_token = -1;
  acc_t best_logit = 0;
  acc_t max = -std::numeric_limits<acc_t>::infinity();
  acc_t sum = 0;
};

template <typename acc_t>
std::tuple<Tensor, Tensor> sample_impl(const Tensor& hidden, const Tensor& weight, const Tensor& row_ids,
                                       double temperature, int64_t seed, int64_t offset,
                                       at::IntArrayRef suppress_ids, at::IntArrayRef exclude_ids, int64_t chunk_size) {
  const int64_t N = hidden.size(0), V = weight.size(0);
  const auto acc = c10::CppTypeToScalarType<acc_t>::value;
  const auto opts = hidden.options().dtype(acc);
  Tensor tokens = at::empty({N}, hidden.options().dtype(at::kLong));
  Tensor confidence = at::empty({N}, opts);
  if (N == 0) return {tokens, confidence};

  const Tensor h = hidden.to(acc).contiguous();
  const Tensor w_all = weight.contiguous();
  const Tensor rows = row_ids.contiguous();
  const int64_t* row_id = rows.data_ptr<int64_t>();
  const std::vector<int64_t> suppressed(suppress_ids.begin(), suppress_ids.end());
  const std::vector<int64_t> excluded(exclude_ids.begin(), exclude_ids.end());
  const bool greedy = temperature == 0.0;
  const SampleScales<acc_t> scales = sample_scales<acc_t>(temperature);
  // Chunks start at multiples of 4 so each Philox call fills one whole quad of columns.
  const int64_t C = std::min((chunk_size + 3) / 4 * 4, (V + 3) / 4 * 4);
  Tensor buffer = at::empty({N * C}, opts);
  std::vector<RowState<acc_t>> state(N);

  for (int64_t v0 = 0; v0 < V; v0 += C) {
    const int64_t c = std::min(C, V - v0);
    const Tensor w = w_all.narrow(0, v0, c).to(acc);
    Tensor logits = buffer.narrow(0, 0, N * c).view({N, c});
    at::mm_out(logits, h, w.t());
    acc_t* L = logits.data_ptr<acc_t>();
    at::parallel_for(0, N, std::max<int64_t>(1, 16384 / c), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> scores(greedy ? 0 : c);
      std::vector<uint32_t> words(greedy ? 0 : (c + 3) / 4 * 4);
      for (int64_t i = begin; i < end; ++i) {
        acc_t* row = L + i * c;
        for (const int64_t id : suppressed) {
          if (id >= v0 && id < v0 + c) row[id - v0] = -std::numeric_limits<acc_t>::infinity();
        }
        const acc_t* score = row;
        if (!greedy) {
          philox_words(words.data(), (c + 3) / 4, static_cast<uint64_t>(seed), static_cast<uint32_t>(offset),
                       static_cast<uint64_t>(row_id[i]), static_cast<uint32_t>(v0 / 4));
          gumbel_scores(scores.data(), row, words.data(), c, scales.logit, scales.noise);
          score = scores.data();
        }
        RowState<acc_t>& s = state[i];
        const acc_t chunk_best = row_max(score, c);
        if (chunk_best > s.best_score) {  // strict: an earlier chunk keeps ties (lowest token id)
          const int64_t j = first_index_of(score, c, chunk_best);
          s.best_score = chunk_best;
          s.best_token = v0 + j;
          s.best_logit = row[j];
        }
        for (const int64_t id : excluded) {  // out of the confidence softmax only
          if (id >= v0 && id < v0 + c) row[id - v0] = -std::numeric_limits<acc_t>::infinity();
        }
        online_logsumexp_update(s.max, s.sum, row, c);
      }
    });
  }

  int64_t* tok = tokens.data_ptr<int64_t>();
  acc_t* conf = confidence.data_ptr<acc_t>();
  for (int64_t i = 0; i < N; ++i) {
    const RowState<acc_t>& s = state[i];
    tok[i] = s.best_token;  // -1 when no score was finite (NaN hidden states), as on CUDA
    const bool is_excluded = std::find(excluded.begin(), excluded.end(), s.best_token) != excluded.end();
    conf[i] = s.best_token < 0 ? std::numeric_limits<acc_t>::quiet_NaN()
              : is_excluded    ? acc_t(0)
                               : std::exp(s.best_logit - (s.max + std::log(s.sum)));
  }
  return {tokens, confidence};
}

}  // namespace

std::tuple<Tensor, Tensor> sample_tokens_cpu(const Tensor& hidden, const Tensor& weight, const Tensor& row_ids,
                                             double temperature, int64_t seed, int64_t offset,
                                             at::IntArrayRef suppress_ids, at::IntArrayRef confidence_exclude_ids,
                                             int64_t chunk_size) {
  return dispatch_accumulate(hidden.scalar_type(), [&](auto acc) {
    return sample_impl<decltype(acc)>(hidden, weight, row_ids, temperature, seed, offset, suppress_ids,
                                      confidence_exclude_ids, chunk_size);
  });
}

Tensor select_transfer_cpu(const Tensor& confidence, const Tensor& candidates, const Tensor& counts,
                           double threshold) {
  const int64_t B = confidence.size(0), n = confidence.size(1);
  // The ranking key: NaN as -inf (below every number, tied with -inf by position) and -0 as +0, as on CUDA.
  Tensor conf = confidence.to(at::kDouble);
  conf = conf.masked_fill(conf.isnan(), -std::numeric_limits<double>::infinity()).add(0.0).contiguous();
  const Tensor cand = candidates.contiguous();
  const Tensor k = counts.contiguous();
  Tensor transfer = at::zeros({B, n}, confidence.options().dtype(at::kBool));
  const double* c = conf.data_ptr<double>();
  const bool* ok = cand.data_ptr<bool>();
  const int64_t* kk = k.data_ptr<int64_t>();
  bool* out = transfer.data_ptr<bool>();
  const bool use_threshold = threshold >= 0.0;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> order;
    for (int64_t b = begin; b < end; ++b) {
      const double* row = c + b * n;
      order.clear();
      for (int64_t j = 0; j < n; ++j) {
        if (ok[b * n + j]) order.push_back(j);
      }
      // Highest confidence first; a stable sort keeps ties in position order (lowest position first).
      std::stable_sort(order.begin(), order.end(), [row](int64_t x, int64_t y) { return row[x] > row[y]; });
      for (size_t r = 0; r < order.size(); ++r) {
        const int64_t j = order[r];
        const bool take = use_threshold ? (r == 0 || row[j] >= threshold) : static_cast<int64_t>(r) < kk[b];
        out[b * n + j] = take;
      }
    }
  });
  return transfer;
}

}  // namespace dllm_fast
