// CPU kernel of dllm_fast::rope: the rotary position embedding of a fused QKV projection's query and key heads in
// one pass (see dllm_fast/schemas.h), the same rounding as the composite it replaces (layers.apply_rope): each
// product and the sum in the tables' dtype, never fused into a multiply-add, then one rounding to x's dtype.

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "dllm_fast/ops.h"

namespace dllm_fast {
namespace {

template <typename scalar_t, typename acc_t>
void rope_rows(const at::Tensor& x, const at::Tensor& tables, int64_t rotated_heads, at::Tensor& out) {
  const int64_t B = x.size(0), L = x.size(1), heads = x.size(2), D = x.size(3), half = D / 2;
  const int64_t xb = x.stride(0), xl = x.stride(1), xh = x.stride(2);
  const int64_t tp = tables.stride(0), tb = tables.stride(1), tl = tables.stride(2);
  const scalar_t* xs = x.data_ptr<scalar_t>();
  const acc_t* ts = tables.data_ptr<acc_t>();
  scalar_t* os = out.data_ptr<scalar_t>();
  at::parallel_for(0, B * L, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / L, l = row % L;
      const acc_t* cos = ts + b * tb + l * tl;
      const acc_t* sin = cos + tp;  // sin on the first half, -sin on the second (rope_tables)
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* in = xs + b * xb + l * xl + h * xh;
        scalar_t* o = os + (row * heads + h) * D;
        if (h >= rotated_heads) {
          for (int64_t j = 0; j < D; ++j) o[j] = in[j];
          continue;
        }
        for (int64_t j = 0; j < D; ++j) {
          const int64_t p = j < half ? j + half : j - half;  // the element roll(., D / 2) moves to j
          const acc_t straight = static_cast<acc_t>(in[j]) * cos[j];
          const acc_t turned = static_cast<acc_t>(in[p]) * sin[p];
          o[j] = static_cast<scalar_t>(straight + turned);
        }
      }
    }
  });
}

}  // namespace

at::Tensor rope_cpu(const at::Tensor& x, const at::Tensor& tables, int64_t rotated_heads) {
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_cpu", [&] {
    if (tables.scalar_type() == at::kDouble) {
      rope_rows<scalar_t, double>(x, tables, rotated_heads, out);
    } else {
      rope_rows<scalar_t, float>(x, tables, rotated_heads, out);
    }
  });
  return out;
}

}  // namespace dllm_fast
