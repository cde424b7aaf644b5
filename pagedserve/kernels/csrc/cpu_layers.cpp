// Fused layers on the CPU: RMSNorm, SiLU-and-mul and rotary embeddings, each in one pass over each
// row, in bfloat16, float16 and float32.
//
// In eager torch each is five or so elementwise ops, each a pass over memory and a fresh tensor;
// here each row is read once and written once. Rounding follows the torch layers they replace
// (workers/layers/norm.py, activation.py): RMSNorm normalizes in float32, rounds to the model's
// dtype, then multiplies by the weight and rounds again (Hugging Face's order); SiLU-and-mul
// rounds silu(gate) before multiplying by up. Only the order of the float32 sum of squares
// differs from torch's, so results agree to within one rounding of the dtype. Rotary embeddings
// rotate in float32 from the float32 cos/sin tables and round once (torch rounds cos and sin to
// the dtype first, then each product): within a rounding or two of the dtype. In float32 every
// rounding to the dtype is the identity, and the results differ from torch's by the sum's order
// and the vectorized exp: a few float32 ulps, as the packed GEMM differs from MKL's.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec_math.h"

#include <cmath>
#include <cstdint>

namespace {

using pagedserve::round_to;
using pagedserve::to_float;

template <typename T>
void rms_norm_rows(T* out, const T* x, const T* weight, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * hidden;
      const float sum = pagedserve::fixed_order_sum(hidden, [&](int64_t i) {
        const float v = to_float(row[i]);
        return v * v;
      });
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
      T* dst = out + r * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) {
        const float normed = to_float(round_to<T>(to_float(row[i]) * inv));
        dst[i] = round_to<T>(to_float(weight[i]) * normed);
      }
    }
  });
}

template <typename T>
void silu_and_mul_rows(T* out, const T* x, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) pagedserve::silu_mul_row(out + r * width, x + r * 2 * width, x + r * 2 * width + width, width);
  });
}

// x: [tokens, heads, head_dim] with head_dim contiguous (a view into the fused QKV output).
template <typename T>
void rotate_rows(T* out, const T* x, int64_t x_token_stride, int64_t x_head_stride, const int64_t* positions,
                 const float* cos, const float* sin, int64_t tokens, int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + positions[t] * half;
      const float* s = sin + positions[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* src = x + t * x_token_stride + h * x_head_stride;
        T* dst = out + (t * heads + h) * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = to_float(src[i]), b = to_float(src[i + half]);
          dst[i] = round_to<T>(a * c[i] - b * s[i]);
          dst[i + half] = round_to<T>(b * c[i] + a * s[i]);
        }
      }
    }
  });
}

void check_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  const auto type = t.scalar_type();
  TORCH_CHECK(type == at::kBFloat16 || type == at::kHalf || type == at::kFloat, name, " must be bfloat16, float16 or float32");
}

// f(T()) with T the C++ type of `type` (one of check_dtype's three).
template <typename F>
void by_dtype(at::ScalarType type, F f) {
  if (type == at::kBFloat16)
    f(c10::BFloat16());
  else if (type == at::kHalf)
    f(c10::Half());
  else
    f(0.f);
}

// out = weight * round(x * rsqrt(mean(x^2) + eps)), rows of x's last dimension.
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_dtype(x, "x");
  check_dtype(out, "out");
  check_dtype(weight, "weight");
  const int64_t hidden = x.size(-1), rows = x.numel() / std::max<int64_t>(hidden, 1);
  TORCH_CHECK(weight.numel() == hidden && out.sizes() == x.sizes(), "rms_norm: shapes do not match");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && x.scalar_type() == weight.scalar_type(), "rms_norm: one dtype");
  by_dtype(x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    rms_norm_rows(out.data_ptr<T>(), x.data_ptr<T>(), weight.data_ptr<T>(), rows, hidden, eps);
  });
}

// out[..., :d] = silu(x[..., :d]) * x[..., d:], for x of last dimension 2d.
void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  check_dtype(x, "x");
  check_dtype(out, "out");
  const int64_t width = x.size(-1) / 2, rows = x.numel() / std::max<int64_t>(x.size(-1), 1);
  TORCH_CHECK(x.size(-1) % 2 == 0 && out.size(-1) == width && out.numel() == rows * width, "silu_and_mul: shapes do not match");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "silu_and_mul: one dtype");
  by_dtype(x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    silu_and_mul_rows(out.data_ptr<T>(), x.data_ptr<T>(), rows, width);
  });
}

// out ([tokens, heads, head_dim], contiguous) = x rotated by the angles of each token's position
// (rotate-half layout); cos and sin are the float32 tables [max_positions, head_dim / 2].
void rotary(at::Tensor out, const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  check_dtype(out, "out");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.scalar_type() == out.scalar_type(), "rotary: x must be [tokens, heads, head_dim], head_dim contiguous");
  TORCH_CHECK(out.sizes() == x.sizes() && x.size(2) % 2 == 0, "rotary: shapes do not match");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0), "rotary: positions int64, one per token");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.size(-1) == x.size(2) / 2, "rotary: cos/sin float32 [positions, head_dim / 2]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary: position out of range");
  by_dtype(x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    rotate_rows(out.data_ptr<T>(), x.data_ptr<T>(), x.stride(0), x.stride(1), pos, cos.data_ptr<float>(), sin.data_ptr<float>(),
                x.size(0), x.size(1), x.size(2));
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary(Tensor(a!) out, Tensor x, Tensor positions, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary", &rotary);
}
