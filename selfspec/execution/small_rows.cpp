// selfspec's small-row product: y = x W^T (+ b) for a float32 input of a few rows and a float32 weight [out, in]
// stored as it is (no packed copy). Built once per machine at first use (small_rows.py) and registered as the
// PyTorch operator selfspec::small_rows, which the fast path's linear layers call below their row split and the
// compiled `few` graph calls for every product.
//
// At one to a few rows a product is bound by how fast the weight streams from memory: each task reads a block of
// weight rows once, with every input row in registers, and threads split the output features. Every output element
// is computed the same way whatever the row count or the block it falls in (lane-wise sums over the vector part of
// the input in order, one horizontal sum, the scalar tail, then the bias), so a row's result does not depend on how
// many rows one call has.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>

namespace {

constexpr int64_t kBlock = 8;      // output features a task computes
constexpr int64_t kRowChunk = 4;   // input rows held in registers at once
constexpr int64_t kMaxRows = 16;   // above this many rows: ATen's own product
constexpr int64_t kGrainBlocks = 4;  // the fewest blocks a thread takes

#if defined(__AVX512F__)
#define SELFSPEC_VECTOR 1
using Vec = __m512;
constexpr int64_t kLanes = 16;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float total(Vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define SELFSPEC_VECTOR 1
using Vec = __m256;
constexpr int64_t kLanes = 8;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float total(Vec v) {
  __m128 low = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  low = _mm_add_ps(low, _mm_movehl_ps(low, low));
  return _mm_cvtss_f32(_mm_add_ss(low, _mm_movehdup_ps(low)));
}
#endif

#ifdef SELFSPEC_VECTOR
// F weight rows (features) x R input rows: out[r * ldy + f] = dot(x[r], w[f]) + bias[f]
template <int F, int R>
inline void dots(const float* x, int64_t K, const float* w, const float* bias, float* out, int64_t ldy) {
  Vec acc[F][R];
#pragma GCC unroll 16
  for (int f = 0; f < F; f++)
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[f][r] = zero();
  const int64_t vector_end = K - K % kLanes;
  for (int64_t k = 0; k < vector_end; k += kLanes) {
    Vec xs[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) xs[r] = load(x + r * K + k);
#pragma GCC unroll 16
    for (int f = 0; f < F; f++) {
      const Vec weights = load(w + f * K + k);
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) acc[f][r] = fma(weights, xs[r], acc[f][r]);
    }
  }
  for (int f = 0; f < F; f++) {
    for (int r = 0; r < R; r++) {
      float sum = total(acc[f][r]);
      for (int64_t k = vector_end; k < K; k++) sum += w[f * K + k] * x[r * K + k];
      out[r * ldy + f] = bias == nullptr ? sum : sum + bias[f];
    }
  }
}

template <int R>
void features(const float* x, int64_t K, const float* w, const float* bias, float* y, int64_t N, int64_t begin,
              int64_t end) {
  constexpr int F = R <= 2 ? 8 : 4;  // accumulators F x R within the 16 registers left beside the inputs
  int64_t n = begin;
  for (; n + F <= end; n += F) dots<F, R>(x, K, w + n * K, bias == nullptr ? nullptr : bias + n, y + n, N);
  for (; n < end; n++) dots<1, R>(x, K, w + n * K, bias == nullptr ? nullptr : bias + n, y + n, N);
}

void rows_chunk(const float* x, int64_t rows, int64_t K, const float* w, const float* bias, float* y, int64_t N,
                int64_t begin, int64_t end) {
  switch (rows) {
    case 1: return features<1>(x, K, w, bias, y, N, begin, end);
    case 2: return features<2>(x, K, w, bias, y, N, begin, end);
    case 3: return features<3>(x, K, w, bias, y, N, begin, end);
    default: return features<4>(x, K, w, bias, y, N, begin, end);
  }
}
#endif

at::Tensor small_rows(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const bool has_bias = bias.has_value() && bias->defined();
  const int64_t K = input.size(-1), rows = input.numel() / std::max<int64_t>(K, 1);
  bool ours = input.device().is_cpu() && input.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
              weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == K && K > 0 && rows <= kMaxRows &&
              (!has_bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous()));
#ifndef SELFSPEC_VECTOR
  ours = false;
#endif
  if (!ours) return at::linear(input, weight, has_bias ? *bias : at::Tensor());
  const int64_t N = weight.size(0);
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = N;
  at::Tensor output = at::empty(sizes, input.options());
#ifdef SELFSPEC_VECTOR
  const at::Tensor x = input.contiguous();
  const float* xs = x.data_ptr<float>();
  const float* ws = weight.data_ptr<float>();
  const float* bs = has_bias ? bias->data_ptr<float>() : nullptr;
  float* ys = output.data_ptr<float>();
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t first, int64_t last) {
    const int64_t begin = first * kBlock, end = std::min(N, last * kBlock);
    for (int64_t row = 0; row < rows; row += kRowChunk)
      rows_chunk(xs + row * K, std::min(kRowChunk, rows - row), K, ws, bs, ys + row * N, N, begin, end);
  });
#endif
  return output;
}

}  // namespace

TORCH_LIBRARY(selfspec, m) { m.def("small_rows(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor"); }
TORCH_LIBRARY_IMPL(selfspec, CPU, m) { m.impl("small_rows", &small_rows); }
