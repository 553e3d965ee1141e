// selfspec's native kernels, built once per machine at first use (native.py) and registered as PyTorch operators:
//
// selfspec::small_rows(input, weight, bias): y = x W^T (+ b) for a float32 input of a few rows and a float32 weight
// [out, in] stored as it is (no packed copy). The fast path's linear layers call it below their row split and the
// compiled `few` graph calls it for every product. At one to a few rows a product is bound by how fast the weight
// streams from memory: threads split the output features, and each block of weight rows is read from memory once (one
// input row meets eight weight rows at a time, two rows eight, three or four rows four, all in one pass; more rows
// pass over a block of four, kept in the L1 cache, four at a time), with the lines kFarAhead bytes further on asked
// for as each streams. On the 2-core EPYC all of SmolLM2's products at 4 / 8 / 16 rows took 0.95-1.00 / 0.97-1.02 /
// 1.08-1.16x oneDNN's packed kernel with blocks read once, against 1.01-1.12 / 1.21 / 1.53-1.71x when every four rows
// streamed the weights again (two runs each, 2026-11-27). Every output element is computed the same way whatever the
// row count or the block it falls in (lane-wise sums over the vector part of the input in order, one horizontal sum,
// the scalar tail, then the bias), so a row's result does not depend on how many rows one call has.
//
// selfspec::row_attention(query, key, value, mask, scale): softmax(q k^T * scale + mask) v in float32 for grouped
// key/value heads, each query row computed on its own in one fixed order: its scores key by key, their maximum, then
// the exponentials summed and the values accumulated key by key in the keys' order, masked keys skipped. A row's
// result therefore depends only on the keys it sees and their order, not on how many rows, keys or masked keys the
// call has: a tree's row equals the one-token step at that position bit for bit (the q4 path, attention.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kBlock = 8;      // output features a task computes
constexpr int64_t kMaxRows = 16;   // above this many rows: ATen's own product
constexpr int64_t kGrainBlocks = 4;  // the fewest blocks a thread takes
constexpr int kOneRowFeatures = 8;  // weight rows one input row meets at once
// How far ahead in a weight's memory the products ask for lines (into L2) as they stream it. Without it, the time a
// product of 3-4 rows spends computing on lines that have arrived added to the time memory took to deliver them,
// instead of overlapping it: all of SmolLM2's products took 19.7 ms at 4 rows and 18.7 at 1 on the 2-core Zen 4
// (memory-bound, 29 GB/s), against 13.1-13.4 and 16.0 with lines asked 32-64 KB ahead into L2 (asked 4-18 KB ahead
// into L1: 1-5% faster; a probe, 2026-11-28).
constexpr int64_t kFarAhead = 48 * 1024;

#if defined(__AVX512F__)
#define SELFSPEC_VECTOR 1
using Vec = __m512;
constexpr int64_t kLanes = 16;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float total(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec broadcast(float x) { return _mm512_set1_ps(x); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
constexpr int kFeatures = 8;  // weight rows two input rows meet at once: 16 accumulators of the 32 registers
constexpr int kQuadFeatures = 4;  // weight rows three or four input rows meet at once: up to 16 accumulators
#elif defined(__AVX2__) && defined(__FMA__)
#define SELFSPEC_VECTOR 1
using Vec = __m256;
constexpr int64_t kLanes = 8;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec broadcast(float x) { return _mm256_set1_ps(x); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
constexpr int kFeatures = 4;  // weight rows two input rows meet at once: 8 accumulators of the 16 registers
constexpr int kQuadFeatures = 2;  // weight rows three or four input rows meet at once: up to 8 accumulators
inline float total(Vec v) {
  __m128 low = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  low = _mm_add_ps(low, _mm_movehl_ps(low, low));
  return _mm_cvtss_f32(_mm_add_ss(low, _mm_movehdup_ps(low)));
}
#endif

#ifdef SELFSPEC_VECTOR
// bfloat16 weights widened in registers (exact: a bfloat16 is the upper half of a float32)
#if defined(__AVX512F__)
inline Vec load_wide(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#else
inline Vec load_wide(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#endif
inline float widen(uint16_t bits) {
  const uint32_t wide = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

inline Vec load_weights(const float* p) { return load(p); }
inline Vec load_weights(const uint16_t* p) { return load_wide(p); }
inline float weight_value(float w) { return w; }
inline float weight_value(uint16_t w) { return widen(w); }

// F weight rows (features) x R input rows: out[r * ldy + f] = dot(x[r], w[f]) + bias[f], the weights float32 or
// bfloat16 (widened exactly); `ahead`, if given: F more weight rows (the next block) asked of memory as these stream;
// `far`: each weight line read is followed by a request, into L2, for the line kFarAhead bytes further on
template <int F, int R, typename T>
inline void dots(const float* x, int64_t K, const T* w, const float* bias, float* out, int64_t ldy,
                 const T* ahead = nullptr, bool far = false) {
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
    if (ahead != nullptr) {
#pragma GCC unroll 16
      for (int f = 0; f < F; f++) _mm_prefetch(reinterpret_cast<const char*>(ahead + f * K + k), _MM_HINT_T0);
    }
    if (far) {
#pragma GCC unroll 16
      for (int f = 0; f < F; f++) _mm_prefetch(reinterpret_cast<const char*>(w + f * K + k) + kFarAhead, _MM_HINT_T1);
    }
#pragma GCC unroll 16
    for (int f = 0; f < F; f++) {
      const Vec weights = load_weights(w + f * K + k);
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) acc[f][r] = fma(weights, xs[r], acc[f][r]);
    }
  }
  for (int f = 0; f < F; f++) {
    for (int r = 0; r < R; r++) {
      float sum = total(acc[f][r]);
      for (int64_t k = vector_end; k < K; k++) sum += weight_value(w[f * K + k]) * x[r * K + k];
      out[r * ldy + f] = bias == nullptr ? sum : sum + bias[f];
    }
  }
}

constexpr const float* kNoBlock = nullptr;  // no next block to ask for (dots' `ahead`)

// the features [begin, end) of one input row: kOneRowFeatures weight rows read at once
void one_row(const float* x, int64_t K, const float* w, const float* bias, float* y, int64_t begin, int64_t end) {
  int64_t n = begin;
  for (; n + kOneRowFeatures <= end; n += kOneRowFeatures)
    dots<kOneRowFeatures, 1>(x, K, w + n * K, bias == nullptr ? nullptr : bias + n, y + n, 1, kNoBlock, true);
  for (; n < end; n++) dots<1, 1>(x, K, w + n * K, bias == nullptr ? nullptr : bias + n, y + n, 1);
}

// rows [0, R) of x over the features [begin, end) in one pass: each block of F weight rows read once
template <int F, int R>
void one_pass(const float* x, int64_t K, const float* w, const float* bias, float* y, int64_t N, int64_t begin,
              int64_t end) {
  int64_t n = begin;
  for (; n + F <= end; n += F)
    dots<F, R>(x, K, w + n * K, bias == nullptr ? nullptr : bias + n, y + n, N, kNoBlock, true);
  for (; n < end; n++)
    for (int r = 0; r < R; r++)
      dots<1, 1>(x + r * K, K, w + n * K, bias == nullptr ? nullptr : bias + n, y + r * N + n, N);
}

// the features [begin, end) of every input row, each block of weight rows read from memory once. Up to four rows
// meet a block in one pass. More rows pass over a block of kQuadFeatures weight rows four at a time, the first pass
// reading it from memory, the others from the L1 cache; the last pass asks for the next block, so that memory keeps
// streaming while the cached block is computed on.
void many_rows(const float* x, int64_t rows, int64_t K, const float* w, const float* bias, float* y, int64_t N,
               int64_t begin, int64_t end) {
  if (rows == 2) return one_pass<kFeatures, 2>(x, K, w, bias, y, N, begin, end);
  if (rows == 3) return one_pass<kQuadFeatures, 3>(x, K, w, bias, y, N, begin, end);
  if (rows == 4) return one_pass<kQuadFeatures, 4>(x, K, w, bias, y, N, begin, end);
  constexpr int F = kQuadFeatures;
  int64_t n = begin;
  for (; n + F <= end; n += F) {
    const float* block = w + n * K;
    const float* block_bias = bias == nullptr ? nullptr : bias + n;
    const float* next = n + 2 * F <= end ? block + F * K : nullptr;
    int64_t row = 0;
    for (; row + 4 <= rows; row += 4) {
      const float* ahead = row + 4 >= rows ? next : nullptr;
      dots<F, 4>(x + row * K, K, block, block_bias, y + row * N + n, N, ahead, row == 0);
    }
    const float* xr = x + row * K;
    float* yr = y + row * N + n;
    if (rows - row == 3) dots<F, 3>(xr, K, block, block_bias, yr, N, next);
    if (rows - row == 2) dots<F, 2>(xr, K, block, block_bias, yr, N, next);
    if (rows - row == 1) dots<F, 1>(xr, K, block, block_bias, yr, N, next);
  }
  for (; n < end; n++)
    for (int64_t row = 0; row < rows; row++)
      dots<1, 1>(x + row * K, K, w + n * K, bias == nullptr ? nullptr : bias + n, y + row * N + n, N);
}

// the features [begin, end) of every input row against bfloat16 weight rows, each block read from memory once
void wide_rows(const float* x, int64_t rows, int64_t K, const uint16_t* w, float* y, int64_t N, int64_t begin,
               int64_t end) {
  int64_t n = begin;
  if (rows == 1) {
    for (; n + kOneRowFeatures <= end; n += kOneRowFeatures)
      dots<kOneRowFeatures, 1>(x, K, w + n * K, nullptr, y + n, 1);
  } else {
    for (; n + kFeatures <= end; n += kFeatures) {
      int64_t row = 0;
      for (; row + 2 <= rows; row += 2) dots<kFeatures, 2>(x + row * K, K, w + n * K, nullptr, y + row * N + n, N);
      if (row < rows) dots<kFeatures, 1>(x + row * K, K, w + n * K, nullptr, y + row * N + n, N);
    }
  }
  for (; n < end; n++)
    for (int64_t row = 0; row < rows; row++) dots<1, 1>(x + row * K, K, w + n * K, nullptr, y + row * N + n, N);
}

// int8 codes widened in registers (exact)
#if defined(__AVX512F__)
inline Vec load_codes(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
#else
inline Vec load_codes(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
#endif

// an int8 proxy's F rows x R input rows: out[r * ldy + f] = scale[f] * (sum over k of code[f][k] * x[r][k]), each
// code widened once for the R rows; every element summed in one order whatever F and R (lanes, one horizontal sum,
// the tail, then the scale)
template <int F, int R>
inline void code_dots(const float* x, int64_t K, const int8_t* q, const float* scale, float* out, int64_t ldy,
                      bool far = false) {
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
    if (far && k % 64 == 0) {  // a line holds 64 codes
#pragma GCC unroll 16
      for (int f = 0; f < F; f++) _mm_prefetch(reinterpret_cast<const char*>(q + f * K + k) + kFarAhead, _MM_HINT_T1);
    }
#pragma GCC unroll 16
    for (int f = 0; f < F; f++) {
      const Vec codes = load_codes(q + f * K + k);
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) acc[f][r] = fma(codes, xs[r], acc[f][r]);
    }
  }
  for (int f = 0; f < F; f++) {
    for (int r = 0; r < R; r++) {
      float sum = total(acc[f][r]);
      for (int64_t k = vector_end; k < K; k++) sum += float(q[f * K + k]) * x[r * K + k];
      out[r * ldy + f] = scale[f] * sum;
    }
  }
}

// the proxy's features [begin, end) for every input row: each block of codes comes from memory once (its lines
// asked for kFarAhead bytes ahead) and stays in the L1 cache while the rows pass over it two at a time, so more rows
// cost compute, not memory traffic
void code_rows(const float* x, int64_t rows, int64_t K, const int8_t* q, const float* scale, float* y, int64_t N,
               int64_t begin, int64_t end) {
  int64_t n = begin;
  if (rows == 1) {
    for (; n + kOneRowFeatures <= end; n += kOneRowFeatures)
      code_dots<kOneRowFeatures, 1>(x, K, q + n * K, scale + n, y + n, N, true);
  } else {
    for (; n + kFeatures <= end; n += kFeatures) {
      int64_t row = 0;
      for (; row + 2 <= rows; row += 2)
        code_dots<kFeatures, 2>(x + row * K, K, q + n * K, scale + n, y + row * N + n, N, row == 0);
      if (row < rows) code_dots<kFeatures, 1>(x + row * K, K, q + n * K, scale + n, y + row * N + n, N, row == 0);
    }
  }
  for (; n < end; n++)
    for (int64_t row = 0; row < rows; row++) code_dots<1, 1>(x + row * K, K, q + n * K, scale + n, y + row * N + n, N);
}

constexpr int64_t kMaxHeadDim = 256;
constexpr float kMaskedBelow = -1e30f;  // an additive mask entry this low hides its key (finfo.min, -inf)

inline float dot(const float* a, const float* b, int64_t n) {
  float sum;
  dots<1, 1>(a, n, b, nullptr, &sum, 1);  // the small-row product's order: lanes, one horizontal sum, the tail
  return sum;
}

// one query row: q [D]; keys/values [S, D] rows `key_stride` / `value_stride` apart; mask [S] (stride `mask_stride`,
// or none: the first `visible` keys); out [D]; scores: scratch of S floats
void attend_row(const float* q, const float* keys, int64_t key_stride, const float* values, int64_t value_stride,
                const float* mask, int64_t mask_stride, int64_t visible, int64_t S, int64_t D, float scale,
                float* scores, float* out) {
  float high = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < S; s++) {
    const float bias = mask == nullptr ? (s < visible ? 0.0f : -std::numeric_limits<float>::infinity())
                                       : mask[s * mask_stride];
    if (!(bias > kMaskedBelow)) {
      scores[s] = -std::numeric_limits<float>::infinity();
      continue;
    }
    scores[s] = dot(q, keys + s * key_stride, D) * scale + bias;
    high = std::max(high, scores[s]);
  }
  Vec acc[kMaxHeadDim / kLanes];
  const int64_t vectors = D / kLanes, vector_end = vectors * kLanes;
  float tail[kLanes];
  for (int64_t v = 0; v < vectors; v++) acc[v] = zero();
  for (int64_t k = vector_end; k < D; k++) tail[k - vector_end] = 0.0f;
  float sum = 0.0f;
  for (int64_t s = 0; s < S; s++) {
    if (scores[s] == -std::numeric_limits<float>::infinity()) continue;
    const float p = std::exp(scores[s] - high);
    sum += p;
    const float* row = values + s * value_stride;
    for (int64_t v = 0; v < vectors; v++) acc[v] = fma(broadcast(p), load(row + v * kLanes), acc[v]);
    for (int64_t k = vector_end; k < D; k++) tail[k - vector_end] += p * row[k];
  }
  const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
  for (int64_t v = 0; v < vectors; v++) store(out + v * kLanes, mul(acc[v], broadcast(inverse)));
  for (int64_t k = vector_end; k < D; k++) out[k] = tail[k - vector_end] * inverse;
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
    if (rows == 1)
      one_row(xs, K, ws, bs, ys, begin, end);
    else
      many_rows(xs, rows, K, ws, bs, ys, N, begin, end);
  });
#endif
  return output;
}


// selfspec::wide_product(input, weight): a float32 input [..., K] x a bfloat16 weight [N, K]^T in float32 (the
// weight widened exactly, the input as it is, float32 sums: no rounding but the sums'), any number of rows, each
// output element computed the same way whatever the row count (the q4 path's LM head, q4.py)
at::Tensor wide_product(const at::Tensor& input, const at::Tensor& weight) {
  const int64_t K = input.size(-1), rows = input.numel() / std::max<int64_t>(K, 1);
  TORCH_CHECK(input.scalar_type() == at::kFloat && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 &&
                  weight.is_contiguous() && weight.size(1) == K && input.device().is_cpu(),
              "wide_product: a float32 input [..., K] and a contiguous bfloat16 weight [N, K] on the CPU");
  const int64_t N = weight.size(0);
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = N;
  at::Tensor output = at::empty(sizes, input.options());
#ifdef SELFSPEC_VECTOR
  const at::Tensor x = input.contiguous();
  const float* xs = x.data_ptr<float>();
  const uint16_t* ws = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  float* ys = output.data_ptr<float>();
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t first, int64_t last) {
    wide_rows(xs, rows, K, ws, ys, N, first * kBlock, std::min(N, last * kBlock));
  });
#else
  TORCH_CHECK(false, "wide_product: built without AVX2/AVX-512");
#endif
  return output;
}

// selfspec::bounded_head(input, weight, codes, scale, bound, argmax_only): an LM head's product for 1-16 rows, the
// weight float32 (then small_rows' product) or bfloat16 (then wide_product's). Where `argmax_only` is false, exactly
// that product. Where it is true, each row's logits are exact (that product's bits) where they could be the row's
// maximum and -inf elsewhere, so that their argmax is the full product's, bit for bit, ties to the lower index
// included: the row is first multiplied by an int8 proxy of the weight (codes [N, K] times a scale per row: a quarter
// of float32's bytes to stream, read once for all the rows: `code_rows`), and `bound[n]` * |x| (the Euclidean norm)
// bounds how far the proxy's computed value can lie from the exact product's for weight row n (execution/head.py).
// Every logit whose upper bound reaches the row's largest lower bound is computed exactly: on SmolLM2 a few of the
// 49,152.
at::Tensor bounded_head(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& codes,
                        const at::Tensor& scale, const at::Tensor& bound, const at::Tensor& argmax_only) {
  const bool wide = weight.scalar_type() == at::kBFloat16;
  const auto full = [&]() { return wide ? wide_product(input, weight) : small_rows(input, weight, c10::nullopt); };
  const int64_t K = input.size(-1), rows = input.numel() / std::max<int64_t>(K, 1), N = weight.size(0);
  bool ours = argmax_only.item<bool>() && input.device().is_cpu() && input.scalar_type() == at::kFloat &&
              (wide || weight.scalar_type() == at::kFloat) && weight.dim() == 2 && weight.is_contiguous() &&
              weight.size(1) == K && K > 0 && rows <= kMaxRows && codes.scalar_type() == at::kChar &&
              codes.is_contiguous() && codes.sizes() == weight.sizes() && scale.scalar_type() == at::kFloat &&
              scale.is_contiguous() && scale.numel() == N && bound.scalar_type() == at::kFloat &&
              bound.is_contiguous() && bound.numel() == N;
#ifndef SELFSPEC_VECTOR
  ours = false;
#endif
  if (!ours) return full();
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = N;
  at::Tensor output = at::empty(sizes, input.options());
#ifdef SELFSPEC_VECTOR
  const at::Tensor x = input.contiguous();
  const float* xs = x.data_ptr<float>();
  const float* ws = wide ? nullptr : weight.data_ptr<float>();
  const uint16_t* ws16 = wide ? reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()) : nullptr;
  const int8_t* qs = codes.data_ptr<int8_t>();
  const float* ss = scale.data_ptr<float>();
  const float* cs = bound.data_ptr<float>();
  float* ys = output.data_ptr<float>();
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t first, int64_t last) {
    code_rows(xs, rows, K, qs, ss, ys, N, first * kBlock, std::min(N, last * kBlock));
  });
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; r++) {
      const float* xr = xs + r * K;
      float* yr = ys + r * N;
      double squares = 0.0;
      for (int64_t k = 0; k < K; k++) squares += double(xr[k]) * double(xr[k]);
      const double norm = std::sqrt(squares) * (1.0 + 1e-9);  // |x|, rounded up past double's own error
      double floor = -std::numeric_limits<double>::infinity();  // the largest lower bound of an exact value
      for (int64_t n = 0; n < N; n++) floor = std::max(floor, double(yr[n]) - double(cs[n]) * norm);
      for (int64_t n = 0; n < N; n++) {
        if (!(double(yr[n]) + double(cs[n]) * norm >= floor))
          yr[n] = -std::numeric_limits<float>::infinity();
        else if (wide)
          dots<1, 1>(xr, K, ws16 + n * K, nullptr, yr + n, 1);  // wide_product's bits for this element
        else
          dots<1, 1>(xr, K, ws + n * K, nullptr, yr + n, 1);  // small_rows' bits for this element
      }
    }
  });
#endif
  return output;
}

// query [B, H, n, D]; key, value [B, KV, S, D] (H a multiple of KV; any strides, the last dimension contiguous);
// mask: an additive [B or 1, 1, n, S] float32 mask (any strides), or undefined: causal, the last n keys being the
// queries' own -> [B, H, n, D]
at::Tensor row_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "row_attention: 4-dimensional inputs");
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat, "row_attention: float32 inputs");
  const int64_t B = query.size(0), H = query.size(1), n = query.size(2), D = query.size(3);
  const int64_t KV = key.size(1), S = key.size(2);
  TORCH_CHECK(H % KV == 0 && key.size(3) == D && value.sizes() == key.sizes() && key.size(0) == B,
              "row_attention: mismatched shapes");
  TORCH_CHECK(D <= 256, "row_attention: head dimension over 256");
  const at::Tensor q = query.contiguous();
  const at::Tensor k = key.stride(3) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(3) == 1 ? value : value.contiguous();
  const bool has_mask = mask.has_value() && mask->defined();
  at::Tensor m;
  if (has_mask) {
    m = mask->scalar_type() == at::kFloat ? *mask : mask->to(at::kFloat);
    TORCH_CHECK(m.dim() == 4 && (m.size(0) == B || m.size(0) == 1) && m.size(2) == n && m.size(3) == S,
                "row_attention: the mask must be [B or 1, 1, n, S]");
  }
  at::Tensor output = at::empty({B, H, n, D}, query.options());
#ifdef SELFSPEC_VECTOR
  const float* qs = q.data_ptr<float>();
  const float* ks = k.data_ptr<float>();
  const float* vs = v.data_ptr<float>();
  const float* ms = has_mask ? m.data_ptr<float>() : nullptr;
  float* out = output.data_ptr<float>();
  const int64_t group = H / KV;
  at::parallel_for(0, B * H * n, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores(S);
    for (int64_t task = first; task < last; task++) {
      const int64_t b = task / (H * n), h = (task / n) % H, i = task % n, g = h / group;
      const float* row_mask = has_mask ? ms + (m.size(0) == 1 ? 0 : b) * m.stride(0) + i * m.stride(2) : nullptr;
      attend_row(qs + task * D, ks + b * k.stride(0) + g * k.stride(1), k.stride(2),
                 vs + b * v.stride(0) + g * v.stride(1), v.stride(2), row_mask, has_mask ? m.stride(3) : 0,
                 S - n + i + 1, S, D, static_cast<float>(scale), scores.data(), out + task * D);
    }
  });
#else
  TORCH_CHECK(false, "row_attention: built without AVX2/AVX-512");
#endif
  return output;
}

}  // namespace

TORCH_LIBRARY(selfspec, m) {
  m.def("small_rows(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("row_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
  m.def(
      "bounded_head(Tensor input, Tensor weight, Tensor codes, Tensor scale, Tensor bound, Tensor argmax_only) -> "
      "Tensor");
  m.def("wide_product(Tensor input, Tensor weight) -> Tensor");
}
TORCH_LIBRARY_IMPL(selfspec, CPU, m) {
  m.impl("small_rows", &small_rows);
  m.impl("row_attention", &row_attention);
  m.impl("bounded_head", &bounded_head);
  m.impl("wide_product", &wide_product);
}
