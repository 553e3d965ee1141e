// selfspec's native kernels, built once per machine at first use (native.py) and registered as PyTorch operators:
//
// selfspec::small_rows(input, weight, bias): y = x W^T (+ b) for a float32 input of a few rows and a float32 or
// bfloat16 weight [out, in] stored as it is (no packed copy; bfloat16 widened exactly in registers, every sum as over
// its float32 widening, bit for bit, at half the bytes streamed). The fast path's linear layers call it below their
// row split and the compiled `few` graph calls it for every product. At one to a few rows a product is bound by how fast the weight
// streams from memory: threads split the output features, and each block of weight rows is read from memory once (one
// input row meets eight weight rows at a time, two rows eight in one pass, three or four rows eight in two passes of
// two, the second from the L1 cache; more rows pass over a block of four, kept in L1, four at a time), with the lines
// kFarAhead bytes further on asked for as each streams. On the 2-core EPYC all of SmolLM2's products at 4 / 8 / 16 rows
// took 0.95-1.00 / 0.97-1.02 / 1.08-1.16x oneDNN's packed kernel with blocks read once, against 1.01-1.12 / 1.21 /
// 1.53-1.71x when every four rows streamed the weights again (two runs each, 2026-11-27). Every output element is
// computed the same way whatever the row count or the block it falls in (lane-wise sums over the vector part of the
// input in order, one horizontal sum, the scalar tail, then the bias), so a row's result does not depend on how many
// rows one call has.
//
// selfspec::row_attention(query, key, value, mask, scale): softmax(q k^T * scale + mask) v in float32 for grouped
// key/value heads, each query row computed on its own in one fixed order: each key's score from its own product (the
// same arithmetic wherever the key falls among the others), their maximum, the exponentials lane by lane, then the
// weights summed and the values accumulated key by key in the keys' order, masked keys skipped. A row's result
// therefore depends only on the keys it sees and their order, not on how many rows, keys or masked keys the call has:
// a tree's row equals the one-token step at that position bit for bit (the q4 path, attention.py). The rows that share
// a key/value head (a group's heads, a tree's rows) take each block of keys and values in turn while it is in the L1
// cache: on the 2-core Zen 4, SmolLM2's 30 layers after 512 cached keys took 0.6 / 1.5 / 3.0 ms at 1 / 4 / 8 rows,
// against 1.1 / 3.0 / 5.9 when each row streamed every key and value itself and took its exponentials one by one
// (interleaved probe, medians, 2026-11-28).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
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
constexpr int kQuadFeatures = 4;  // weight rows four input rows meet at once (five or more rows): 16 accumulators
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
constexpr int kQuadFeatures = 2;  // weight rows four input rows meet at once (five or more rows): 8 accumulators
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

// Q4_1-coded weights, widened exactly: rows of blocks of 32 weights, each block 24 bytes (its scale d and minimum m as
// float32, then 16 bytes whose byte j holds the codes of weights j, low nibble, and j + 16, high nibble), weight =
// fma(d, code, m): d a float16 and code at most 15, d * code is exact and the sum is rounded once, as a 4-bit GGUF's
// weights are when de-quantised to float32 (d * code + m), so a coded weight is that float32 weight bit for bit
// (q4_1_coded, execution/compact.py, checks every weight before it codes a tensor).
constexpr int64_t kCodedBlock = 32;       // weights a block codes
constexpr int64_t kCodedBlockBytes = 24;  // its bytes
struct Coded {  // where in a coded weight: the weight at `index` (row-major, as in its float32 [N, K] form)
  const uint8_t* base = nullptr;
  int64_t index = 0;
  Coded operator+(int64_t n) const { return {base, index + n}; }
  const uint8_t* block() const { return base + index / kCodedBlock * kCodedBlockBytes; }
};
inline bool present(Coded p) { return p.base != nullptr; }

inline Vec load_weights(const float* p) { return load(p); }
inline Vec load_weights(const uint16_t* p) { return load_wide(p); }
inline float weight_at(const float* p, int64_t i) { return p[i]; }
inline float weight_at(const uint16_t* p, int64_t i) { return widen(p[i]); }
template <typename T>
inline bool present(const T* p) { return p != nullptr; }
template <typename T>
inline const char* address(const T* p) { return reinterpret_cast<const char*>(p); }
// whether a vector of weights from k on is the first in its 64-byte line (so that each line is asked for once ahead)
inline bool line_starts(const float*, int64_t) { return true; }                      // a vector: a line (AVX-512)
inline bool line_starts(const uint16_t*, int64_t k) { return k % (2 * kLanes) == 0; }  // every other vector

// F weight rows (features) x R input rows: out[r * ldy + f] = dot(x[r], w[f]) + bias[f], the weights float32 or
// bfloat16 (widened exactly); `ahead`, if given: F more weight rows (the next block) asked of memory as these stream;
// `far`: each weight line read is followed by a request, into L2, for the line kFarAhead bytes further on
template <int F, int R, typename W>
inline void stored_dots(const float* x, int64_t K, W w, const float* bias, float* out, int64_t ldy, W ahead,
                        bool far) {
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
    if (present(ahead)) {
#pragma GCC unroll 16
      for (int f = 0; f < F; f++) _mm_prefetch(address(ahead + f * K + k), _MM_HINT_T0);
    }
    if (far && line_starts(w, k)) {
#pragma GCC unroll 16
      for (int f = 0; f < F; f++) _mm_prefetch(address(w + f * K + k) + kFarAhead, _MM_HINT_T1);
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
      // one fused multiply-add a tail element, written out: the compiler would contract the two weight types' tails
      // differently, and a bfloat16 weight's results must be its float32 widening's bit for bit
      for (int64_t k = vector_end; k < K; k++) sum = std::fma(weight_at(w, f * K + k), x[r * K + k], sum);
      out[r * ldy + f] = bias == nullptr ? sum : sum + bias[f];
    }
  }
}

constexpr int kBlockVectors = kCodedBlock / kLanes;  // vectors of weights a coded block holds

// a coded block's 32 weights, widened: their exact float32 values, kLanes at a time in the order of k
inline void widen_block(const uint8_t* block, Vec* weights) {
  float d, m;
  std::memcpy(&d, block, sizeof d);
  std::memcpy(&m, block + 4, sizeof m);
  const Vec scale = broadcast(d), minimum = broadcast(m);
#if defined(__AVX512F__)
  // the block's 16 possible weights, fma(d, code, m) for codes 0..15, looked up by each code (a permute reads the low
  // 4 bits of its index: the low nibble needs no mask)
  const Vec table = _mm512_fmadd_ps(scale, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), minimum);
  const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(block + 8)));
  weights[0] = _mm512_permutexvar_ps(codes, table);
  weights[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);
#else
  const __m256i low = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(block + 8)));
  const __m256i high = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(block + 16)));
  const __m256i mask = _mm256_set1_epi32(0x0F);
  weights[0] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(_mm256_and_si256(low, mask)), minimum);
  weights[1] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(_mm256_and_si256(high, mask)), minimum);
  weights[2] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(_mm256_srli_epi32(low, 4)), minimum);
  weights[3] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(_mm256_srli_epi32(high, 4)), minimum);
#endif
}

// dots over Q4_1-coded weight rows (K a multiple of 32): a block's codes are read once and widened into its
// 32 / kLanes vectors of weights, which meet the input in the order dots' vectors do (k = 0, kLanes, ...), so every
// element is summed exactly as over the float32 weight
template <int F, int R>
inline void coded_dots(const float* x, int64_t K, Coded w, const float* bias, float* out, int64_t ldy, Coded ahead,
                       bool far) {
  constexpr int kVectors = kBlockVectors;
  Vec acc[F][R];
#pragma GCC unroll 16
  for (int f = 0; f < F; f++)
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[f][r] = zero();
  const int64_t blocks = K / kCodedBlock, row_bytes = blocks * kCodedBlockBytes;
  const uint8_t* first = w.block();
  const uint8_t* next = present(ahead) ? ahead.block() : nullptr;
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t offset = b * kCodedBlockBytes;
    const bool line = offset % 64 < kCodedBlockBytes;  // one block a 64-byte line starts in its first 24 bytes
    if (next != nullptr && line) {
#pragma GCC unroll 16
      for (int f = 0; f < F; f++) _mm_prefetch(reinterpret_cast<const char*>(next + f * row_bytes + offset), _MM_HINT_T0);
    }
    if (far && line) {
#pragma GCC unroll 16
      for (int f = 0; f < F; f++)
        _mm_prefetch(reinterpret_cast<const char*>(first + f * row_bytes + offset) + kFarAhead, _MM_HINT_T1);
    }
    const float* xb = x + b * kCodedBlock;
#pragma GCC unroll 16
    for (int f = 0; f < F; f++) {
      Vec weights[kVectors];
      widen_block(first + f * row_bytes + offset, weights);
#pragma GCC unroll 4
      for (int v = 0; v < kVectors; v++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) acc[f][r] = fma(weights[v], load(xb + r * K + v * kLanes), acc[f][r]);
    }
  }
  for (int f = 0; f < F; f++)
    for (int r = 0; r < R; r++) {
      const float sum = total(acc[f][r]);
      out[r * ldy + f] = bias == nullptr ? sum : sum + bias[f];
    }
}

// dots over F weight rows in whichever form they are stored (float32, bfloat16: stored_dots; Q4_1-coded: coded_dots)
template <int F, int R, typename W>
inline void dots(const float* x, int64_t K, W w, const float* bias, float* out, int64_t ldy, W ahead = W(),
                 bool far = false) {
  if constexpr (std::is_same_v<W, Coded>)
    coded_dots<F, R>(x, K, w, bias, out, ldy, ahead, far);
  else
    stored_dots<F, R, W>(x, K, w, bias, out, ldy, ahead, far);
}

constexpr const float* kNoBias = nullptr;  // a product without a bias (remaining_features' `bias`)

// the features [n, end) left after the whole blocks, for every input row: one weight row at a time
template <typename W>
void remaining_features(const float* x, int64_t rows, int64_t K, W w, const float* bias, float* y, int64_t N,
                        int64_t n, int64_t end) {
  for (; n < end; n++)
    for (int64_t row = 0; row < rows; row++)
      dots<1, 1>(x + row * K, K, w + n * K, bias == nullptr ? nullptr : bias + n, y + row * N + n, N);
}

// every whole block of F weight rows in the features [begin, end), in order: pass(n, block, its bias, the next block
// or nullptr for the last); then the features left, one weight row at a time
template <int F, typename W, typename Pass>
void by_blocks(const float* x, int64_t rows, int64_t K, W w, const float* bias, float* y, int64_t N,
               int64_t begin, int64_t end, Pass pass) {
  int64_t n = begin;
  for (; n + F <= end; n += F) {
    W block = w + n * K;
    pass(n, block, bias == nullptr ? nullptr : bias + n, n + 2 * F <= end ? block + F * K : W());
  }
  remaining_features(x, rows, K, w, bias, y, N, n, end);
}

// the features [begin, end) of one input row: kOneRowFeatures weight rows read at once
template <typename W>
void one_row(const float* x, int64_t K, W w, const float* bias, float* y, int64_t begin, int64_t end) {
  int64_t n = begin;
  for (; n + kOneRowFeatures <= end; n += kOneRowFeatures)
    dots<kOneRowFeatures, 1, W>(x, K, w + n * K, bias == nullptr ? nullptr : bias + n, y + n, 1, W(), true);
  remaining_features(x, 1, K, w, bias, y, 1, n, end);
}

// rows [0, R) of x over the features [begin, end) in one pass: each block of F weight rows read once
template <int F, int R, typename W>
void one_pass(const float* x, int64_t K, W w, const float* bias, float* y, int64_t N, int64_t begin,
              int64_t end) {
  int64_t n = begin;
  for (; n + F <= end; n += F)
    dots<F, R, W>(x, K, w + n * K, bias == nullptr ? nullptr : bias + n, y + n, N, W(), true);
  remaining_features(x, R, K, w, bias, y, N, n, end);
}

// three or four rows over the features [begin, end): two rows meet a block of kFeatures weight rows (as two rows alone
// do), then the third (and fourth) meet it again from the L1 cache while the next block is asked for. On the 2-core
// Zen 5, all of SmolLM2's products at 3 / 4 rows took 0.92-0.95 / 0.89-0.97x the time of one pass of all rows over a
// block of kQuadFeatures (random weights of the real shapes, three runs, each interleaved, medians of 31); in the batch
// engine's steps of four requests, 10.6 ms of products a step against 12.3 (the step 15.5 ms against 16.8), one
// request's steps unchanged (both kernels in one process taking turns, medians of 5 rounds of 10 steps, 2026-11-29).
template <typename W>
void pair_passes(const float* x, int64_t rows, int64_t K, W w, const float* bias, float* y, int64_t N,
                 int64_t begin, int64_t end) {
  constexpr int F = kFeatures;
  by_blocks<F>(x, rows, K, w, bias, y, N, begin, end, [&](int64_t n, W block, const float* block_bias,
                                                          W next) {
    dots<F, 2, W>(x, K, block, block_bias, y + n, N, W(), true);
    if (rows == 4)
      dots<F, 2>(x + 2 * K, K, block, block_bias, y + 2 * N + n, N, next);
    else
      dots<F, 1>(x + 2 * K, K, block, block_bias, y + 2 * N + n, N, next);
  });
}

// the features [begin, end) of every input row, each block of weight rows read from memory once. Two rows meet a
// block in one pass, three or four in two (pair_passes). More rows pass over a block of kQuadFeatures weight rows
// four at a time, the first pass reading it from memory, the others from the L1 cache; the last pass asks for the
// next block, so that memory keeps streaming while the cached block is computed on.
template <typename W>
void many_rows(const float* x, int64_t rows, int64_t K, W w, const float* bias, float* y, int64_t N,
               int64_t begin, int64_t end) {
  if (rows == 2) return one_pass<kFeatures, 2, W>(x, K, w, bias, y, N, begin, end);
  if (rows <= 4 && !std::is_same_v<W, Coded>) return pair_passes(x, rows, K, w, bias, y, N, begin, end);
  constexpr int F = kQuadFeatures;
  by_blocks<F>(x, rows, K, w, bias, y, N, begin, end, [&](int64_t n, W block, const float* block_bias,
                                                          W next) {
    int64_t row = 0;
    for (; row + 4 <= rows; row += 4) {
      W ahead = row + 4 >= rows ? next : W();
      dots<F, 4>(x + row * K, K, block, block_bias, y + row * N + n, N, ahead, row == 0);
    }
    const float* xr = x + row * K;
    float* yr = y + row * N + n;
    if (rows - row == 3) dots<F, 3>(xr, K, block, block_bias, yr, N, next);
    if (rows - row == 2) dots<F, 2>(xr, K, block, block_bias, yr, N, next);
    if (rows - row == 1) dots<F, 1>(xr, K, block, block_bias, yr, N, next);
  });
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
  remaining_features(x, rows, K, w, kNoBias, y, N, n, end);
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
// asked for kFarAhead bytes ahead) and stays in the L1 cache while the rows pass over it, one or two rows over
// blocks of kOneRowFeatures / kFeatures, more rows over blocks of kQuadFeatures up to four at a time (as many_rows
// does), so more rows cost compute, not memory traffic, and widen each code once per four rows
void code_rows(const float* x, int64_t rows, int64_t K, const int8_t* q, const float* scale, float* y, int64_t N,
               int64_t begin, int64_t end) {
  int64_t n = begin;
  if (rows == 1) {
    for (; n + kOneRowFeatures <= end; n += kOneRowFeatures)
      code_dots<kOneRowFeatures, 1>(x, K, q + n * K, scale + n, y + n, N, true);
  } else if (rows == 2) {
    for (; n + kFeatures <= end; n += kFeatures) code_dots<kFeatures, 2>(x, K, q + n * K, scale + n, y + n, N, true);
  } else {
    constexpr int F = kQuadFeatures;
    for (; n + F <= end; n += F) {
      const int8_t* block = q + n * K;
      int64_t row = 0;
      for (; row + 4 <= rows; row += 4) code_dots<F, 4>(x + row * K, K, block, scale + n, y + row * N + n, N, row == 0);
      const float* xr = x + row * K;
      float* yr = y + row * N + n;
      if (rows - row == 3) code_dots<F, 3>(xr, K, block, scale + n, yr, N, row == 0);
      if (rows - row == 2) code_dots<F, 2>(xr, K, block, scale + n, yr, N, row == 0);
      if (rows - row == 1) code_dots<F, 1>(xr, K, block, scale + n, yr, N, row == 0);
    }
  }
  for (; n < end; n++)
    for (int64_t row = 0; row < rows; row++) code_dots<1, 1>(x + row * K, K, q + n * K, scale + n, y + row * N + n, N);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SELFSPEC_WORD_DOTS 1
constexpr int64_t kWordLanes = 32;   // int16 values in a vector
constexpr float kWordCodes = 16383;  // an input row's codes lie in [-kWordCodes, kWordCodes]: int32 sums cannot
constexpr int64_t kMaxWordK = 16384;  // overflow up to this many inputs (2 x 16383 x 127 x K / 32 < 2^31)

// An input row as int16 codes of its own for the head's proxy on integer products: x_k ~ step * c_k with c_k =
// round(x_k / step), step = max |x_k| / kWordCodes, padded to whole vectors with 0 -> step, and |x - step c| (float64,
// rounded up): about 2e-4 |x|, next to the int8 weights' own error about 1e-2.
struct WordRow {
  float step;
  double error;
};

WordRow word_row(const float* x, int64_t K, int16_t* out, int64_t padded) {
  float high = 0.0f;
  for (int64_t k = 0; k < K; k++) high = std::max(high, std::fabs(x[k]));
  const float step = high > 0.0f ? high / kWordCodes : 1.0f;
  double squares = 0.0;
  for (int64_t k = 0; k < K; k++) {
    const float code = std::min(kWordCodes, std::max(-kWordCodes, std::nearbyint(x[k] / step)));
    out[k] = static_cast<int16_t>(code);
    const double miss = double(x[k]) - double(step) * double(code);  // step * code is exact in float64
    squares += miss * miss;
  }
  std::fill(out + K, out + padded, int16_t(0));
  return {step, std::sqrt(squares) * (1.0 + 1e-9)};
}

// F code rows x R word rows: sums[r][f] = sum_k code[f][k] * word[r][k], exact in int32, each code widened to int16
// once for the R rows; `far`: the lines kFarAhead on asked for (the first pass over a block)
template <int F, int R>
inline void word_dots(const int16_t* u, int64_t padded, const int8_t* q, int64_t K, int32_t (*sums)[F], bool far) {
  __m512i acc[F][R];
#pragma GCC unroll 8
  for (int f = 0; f < F; f++)
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[f][r] = _mm512_setzero_si512();
  const auto step = [&](int64_t k, __mmask32 lanes) {
    __m512i words[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) words[r] = _mm512_loadu_si512(u + r * padded + k);
#pragma GCC unroll 8
    for (int f = 0; f < F; f++) {
      if (far) _mm_prefetch(reinterpret_cast<const char*>(q + f * K + k) + kFarAhead, _MM_HINT_T1);
      const __m512i codes = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(lanes, q + f * K + k));
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) acc[f][r] = _mm512_dpwssd_epi32(acc[f][r], words[r], codes);
    }
  };
  int64_t k = 0;
  for (; k + kWordLanes <= K; k += kWordLanes) step(k, ~__mmask32(0));
  if (k < K) step(k, (__mmask32(1) << (K - k)) - 1);
#pragma GCC unroll 8
  for (int f = 0; f < F; f++)
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) sums[r][f] = _mm512_reduce_add_epi32(acc[f][r]);
}

// the proxy's features [begin, end) for every word row, four code rows by up to four word rows at a time (the block
// read from memory in the first pass, from the L1 cache after): y[r][n] = scale[n] * step[r] * the exact sum (in
// float64, then float32)
void word_rows(const int16_t* u, const float* steps, int64_t rows, int64_t padded, const int8_t* q, int64_t K,
               const float* scale, float* y, int64_t N, int64_t begin, int64_t end) {
  constexpr int F = 4;
  int32_t sums[4][F];
  int64_t n = begin;
  for (; n + F <= end; n += F) {
    const int8_t* block = q + n * K;
    for (int64_t row = 0; row < rows; row += 4) {
      const int16_t* ur = u + row * padded;
      const int64_t count = std::min<int64_t>(4, rows - row);
      if (count == 4) word_dots<F, 4>(ur, padded, block, K, sums, row == 0);
      if (count == 3) word_dots<F, 3>(ur, padded, block, K, sums, row == 0);
      if (count == 2) word_dots<F, 2>(ur, padded, block, K, sums, row == 0);
      if (count == 1) word_dots<F, 1>(ur, padded, block, K, sums, row == 0);
      for (int64_t r = 0; r < count; r++)
        for (int64_t f = 0; f < F; f++)
          y[(row + r) * N + n + f] = float(double(scale[n + f]) * double(steps[row + r]) * double(sums[r][f]));
    }
  }
  for (; n < end; n++) {
    int32_t one[4][1];
    for (int64_t row = 0; row < rows; row++) {
      word_dots<1, 1>(u + row * padded, padded, q + n * K, K, one, false);
      y[row * N + n] = float(double(scale[n]) * double(steps[row]) * double(one[0][0]));
    }
  }
}
#endif

constexpr int64_t kMaxHeadDim = 256;
constexpr float kMaskedBelow = -1e30f;  // an additive mask entry this low hides its key (finfo.min, -inf)

// e^x lane by lane for x <= 0 (a score less the row's highest), to about a float32 unit in the last place: x = n ln 2
// + r with |r| <= ln(2) / 2, a degree-6 polynomial for e^r, 2^n put into the exponent; below -87 it is taken at -87
// (1.6e-38, still a normal float) and -inf (a hidden key) gives exactly 0. Each lane's result depends on its own x
// only, so a key's weight does not depend on where in a vector it falls.
#if defined(__AVX512F__)
inline Vec max_lanes(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec nearest(Vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec two_to(Vec n) {  // 2^n for whole n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline Vec zero_where(Vec x, float at, Vec value) {  // 0 in the lanes where x == at, `value` elsewhere
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, broadcast(at), _CMP_EQ_OQ), value, zero());
}
#else
inline Vec max_lanes(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec nearest(Vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec two_to(Vec n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline Vec zero_where(Vec x, float at, Vec value) {
  return _mm256_blendv_ps(value, zero(), _mm256_cmp_ps(x, broadcast(at), _CMP_EQ_OQ));
}
#endif

inline Vec exp_lanes(Vec x) {
  const Vec clamped = max_lanes(x, broadcast(-87.0f));
  const Vec n = nearest(mul(clamped, broadcast(1.44269504088896341f)));
  Vec r = fma(n, broadcast(-0.693359375f), clamped);  // x - n ln 2, ln 2 in two parts
  r = fma(n, broadcast(2.12194440e-4f), r);
  Vec p = broadcast(1.9875691500e-4f);
  p = fma(p, r, broadcast(1.3981999507e-3f));
  p = fma(p, r, broadcast(8.3334519073e-3f));
  p = fma(p, r, broadcast(4.1665795894e-2f));
  p = fma(p, r, broadcast(1.6666665459e-1f));
  p = fma(p, r, broadcast(5.0000001201e-1f));
  p = fma(p, mul(r, r), r + broadcast(1.0f));
  return zero_where(x, -std::numeric_limits<float>::infinity(), mul(p, two_to(n)));
}

// kLanes sums at once: lane j of the result is the sum of vector j's lanes, added in one fixed tree (pairs of lanes
// within 128-bit blocks, then the blocks), the same for every j
#if defined(__AVX512F__)
inline Vec lane_sums(Vec* a) {
  Vec pairs[8], quads[4];
  for (int j = 0; j < 8; j++)
    pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 4; j++)
    quads[j] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], 0xEE));
  // each 128-bit block of quads[j]: the partial sums of vectors 4j..4j+3 over that block's lanes
  const Vec low =
      _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88), _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const Vec high =
      _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88), _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xDD));
}
#else
inline Vec lane_sums(Vec* a) {
  Vec pairs[4], quads[2];
  for (int j = 0; j < 4; j++)
    pairs[j] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm256_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 2; j++)
    quads[j] = _mm256_add_ps(_mm256_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], 0x44),
                             _mm256_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], 0xEE));
  return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                       _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
}
#endif

// -inf in the lanes whose additive mask `bias` hides their key (not above kMaskedBelow), `value` elsewhere
#if defined(__AVX512F__)
inline Vec hide_where(Vec bias, Vec value) {
  const __mmask16 hidden = _mm512_cmp_ps_mask(bias, broadcast(kMaskedBelow), _CMP_NGT_UQ);
  return _mm512_mask_blend_ps(hidden, value, broadcast(-std::numeric_limits<float>::infinity()));
}
#else
inline Vec hide_where(Vec bias, Vec value) {
  const Vec hidden = _mm256_cmp_ps(bias, broadcast(kMaskedBelow), _CMP_NGT_UQ);
  return _mm256_blendv_ps(value, broadcast(-std::numeric_limits<float>::infinity()), hidden);
}
#endif

#if defined(__AVX512F__)
inline bool any_above(Vec x, Vec floor) { return _mm512_cmp_ps_mask(x, floor, _CMP_GT_OQ) != 0; }
#else
inline bool any_above(Vec x, Vec floor) { return _mm256_movemask_ps(_mm256_cmp_ps(x, floor, _CMP_GT_OQ)) != 0; }
#endif

// whether any of `count` additive mask entries (`stride` apart) leaves its key seen
inline bool any_seen(const float* mask, int64_t stride, int64_t count) {
  int64_t s = 0;
  if (stride == 1)
    for (; s + kLanes <= count; s += kLanes)
      if (any_above(load(mask + s), broadcast(kMaskedBelow))) return true;
  for (; s < count; s++)
    if (mask[s * stride] > kMaskedBelow) return true;
  return false;
}

// the scores of `count` (at most kLanes) keys: key j's q . key over D's whole vectors (`vectors`) lane by lane, its
// lanes summed (lane_sums), then the scalar tail; the same for a key whatever its place among the keys
inline void key_scores(const float* q, const float* keys, int64_t key_stride, int64_t vectors, int64_t D,
                       int64_t count, float* out) {
  Vec acc[kLanes];
#pragma GCC unroll 16
  for (int j = 0; j < kLanes; j++) acc[j] = zero();
  if (count == kLanes) {
    for (int64_t v = 0; v < vectors; v++) {
      const Vec query = load(q + v * kLanes);
#pragma GCC unroll 16
      for (int j = 0; j < kLanes; j++) acc[j] = fma(query, load(keys + j * key_stride + v * kLanes), acc[j]);
    }
  } else {
    for (int64_t j = 0; j < count; j++)
      for (int64_t v = 0; v < vectors; v++)
        acc[j] = fma(load(q + v * kLanes), load(keys + j * key_stride + v * kLanes), acc[j]);
  }
  float sums[kLanes];
  store(sums, lane_sums(acc));
  for (int64_t j = 0; j < count; j++) {
    float sum = sums[j];
    for (int64_t k = vectors * kLanes; k < D; k++) sum += q[k] * keys[j * key_stride + k];
    out[j] = sum;
  }
}

// The rows one task of row_attention computes: query rows that share one key/value head (heads of a group, rows of a
// tree), each with its own mask row.
constexpr int64_t kMaxAttendRows = 8;
struct AttendRows {
  int64_t count;                      // rows, at most kMaxAttendRows
  const float* q[kMaxAttendRows];     // each row's query [D]
  float* out[kMaxAttendRows];         // each row's output [D]
  const float* mask[kMaxAttendRows];  // each row's additive mask [S] (stride `mask_stride`), or none: its first
  int64_t visible[kMaxAttendRows];    // `visible` keys
};
constexpr int64_t kValueBlock = 64;  // keys whose value rows stay in the L1 cache while every row takes them

// softmax(q k^T * scale + mask) v for the rows of `rows` over keys/values [S, D] (rows `key_stride` / `value_stride`
// apart); scores: scratch of rows.count x `padded` floats (S rounded up to whole vectors). Each row in three passes:
// its scores (each key's product on its own: key_scores), their exponentials a vector at a time, then the weights
// summed and the values accumulated key by key in the keys' order, hidden keys skipped. The rows take each block of
// keys in turn while it is in the L1 cache, but a row's arithmetic is its own: the same whatever the other rows are.
// V: the whole vectors in D when it is a compile-time constant (the accumulators then stay in registers), 0 for any D.
// Skips: `seen` marks the blocks of kLanes keys some row sees, the others passed over (a ragged batch's); else null.
template <int V, bool Skips>
void attend_rows(const AttendRows& rows, const float* keys, int64_t key_stride, const float* values,
                 int64_t value_stride, int64_t mask_stride, int64_t S, int64_t D, float scale, float* scores,
                 int64_t padded, const uint8_t* seen) {
  constexpr float kHidden = -std::numeric_limits<float>::infinity();
  const int64_t vectors = V > 0 ? V : D / kLanes, vector_end = vectors * kLanes;
  for (int64_t s = 0; s < S; s += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, S - s);
    if (Skips && !seen[s / kLanes]) continue;  // keys no row sees: not read (nor their scores below)
    for (int64_t r = 0; r < rows.count; r++)
      key_scores(rows.q[r], keys + s * key_stride, key_stride, vectors, D, count, scores + r * padded + s);
  }
  float sums[kMaxAttendRows];
  for (int64_t r = 0; r < rows.count; r++) {
    float* row_scores = scores + r * padded;
    const float* mask = rows.mask[r];
    float high = kHidden;
    int64_t s = 0;
    if (mask != nullptr && mask_stride == 1) {  // a vector at a time: the same fused multiply-add as the tail's
      Vec highs = broadcast(kHidden);
      for (; s + kLanes <= S; s += kLanes) {
        if (Skips && !seen[s / kLanes]) {  // what the mask makes of any score there
          store(row_scores + s, broadcast(kHidden));
          continue;
        }
        const Vec bias = load(mask + s);
        const Vec value = hide_where(bias, fma(load(row_scores + s), broadcast(scale), bias));
        store(row_scores + s, value);
        highs = max_lanes(highs, value);
      }
      float lanes[kLanes];
      store(lanes, highs);
      for (int64_t lane = 0; lane < kLanes; lane++) high = std::max(high, lanes[lane]);
    }
    for (; s < S; s++) {
      const float bias = mask == nullptr ? (s < rows.visible[r] ? 0.0f : kHidden) : mask[s * mask_stride];
      row_scores[s] = bias > kMaskedBelow ? std::fma(row_scores[s], scale, bias) : kHidden;
      high = std::max(high, row_scores[s]);
    }
    if (high == kHidden) {  // no key seen: weights 0, output 0
      std::fill(row_scores, row_scores + padded, 0.0f);
    } else {
      std::fill(row_scores + S, row_scores + padded, kHidden);
      for (int64_t s = 0; s < padded; s += kLanes)  // (a hidden key's weight is exactly 0)
        store(row_scores + s, Skips && !seen[s / kLanes] ? zero()
                                                                  : exp_lanes(load(row_scores + s) - broadcast(high)));
    }
    std::fill(rows.out[r], rows.out[r] + D, 0.0f);
    sums[r] = 0.0f;
  }
  for (int64_t block = 0; block < S; block += kValueBlock) {
    const int64_t block_end = std::min(S, block + kValueBlock);
    for (int64_t r = 0; r < rows.count; r++) {
      const float* weights = scores + r * padded;
      float* out = rows.out[r];
      Vec acc[kMaxHeadDim / kLanes];
#pragma GCC unroll 16
      for (int64_t v = 0; v < vectors; v++) acc[v] = load(out + v * kLanes);
      float sum = sums[r];
      for (int64_t s = block; s < block_end; s++) {
        if (Skips && s % kLanes == 0 && !seen[s / kLanes]) {  // kValueBlock is whole vectors
          s += kLanes - 1;
          continue;
        }
        const float p = weights[s];
        if (p == 0.0f) continue;  // a hidden key (a seen one's weight is at least e^-87)
        sum += p;
        const float* row = values + s * value_stride;
#pragma GCC unroll 16
        for (int64_t v = 0; v < vectors; v++) acc[v] = fma(broadcast(p), load(row + v * kLanes), acc[v]);
        for (int64_t k = vector_end; k < D; k++) out[k] += p * row[k];
      }
#pragma GCC unroll 16
      for (int64_t v = 0; v < vectors; v++) store(out + v * kLanes, acc[v]);
      sums[r] = sum;
    }
  }
  for (int64_t r = 0; r < rows.count; r++) {
    const float inverse = sums[r] > 0.0f ? 1.0f / sums[r] : 0.0f;
    float* out = rows.out[r];
#pragma GCC unroll 16
    for (int64_t v = 0; v < vectors; v++) store(out + v * kLanes, mul(load(out + v * kLanes), broadcast(inverse)));
    for (int64_t k = vector_end; k < D; k++) out[k] *= inverse;
  }
}

using AttendRowsKernel = void (*)(const AttendRows&, const float*, int64_t, const float*, int64_t, int64_t, int64_t,
                                  int64_t, float, float*, int64_t, const uint8_t*);

// the kernel for head dimension D: one built for its count of whole vectors where that is a common one
template <bool Skips>
AttendRowsKernel attend_rows_for(int64_t D) {
  switch (D / kLanes) {
    case 1: return &attend_rows<1, Skips>;
    case 2: return &attend_rows<2, Skips>;
    case 4: return &attend_rows<4, Skips>;
    case 8: return &attend_rows<8, Skips>;
    case 16: return &attend_rows<16, Skips>;
    default: return &attend_rows<0, Skips>;
  }
}
#endif

// a Q4_1-coded weight [N, K / 32 * 24] (load_weights(Coded)) as the float32 weight [N, K] it codes
at::Tensor decoded(const at::Tensor& coded, int64_t K) {
  const int64_t N = coded.size(0);
  at::Tensor weight = at::empty({N, K}, coded.options().dtype(at::kFloat));
  const uint8_t* bytes = coded.data_ptr<uint8_t>();
  float* out = weight.data_ptr<float>();
  for (int64_t i = 0; i < N * K; i++) {
    const uint8_t* block = bytes + i / 32 * 24;
    float d, m;
    std::memcpy(&d, block, sizeof d);
    std::memcpy(&m, block + 4, sizeof m);
    const int64_t within = i % 32;
    const uint8_t byte = block[8 + within % 16];
    out[i] = std::fma(d, float(within < 16 ? byte & 0x0F : byte >> 4), m);
  }
  return weight;
}

// the product of an input of no rows ([..., 0, K]: a prefill whose logits nobody reads) with a weight of N rows
at::Tensor empty_product(const at::Tensor& input, int64_t N) {
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = N;
  return at::empty(sizes, input.options());
}

at::Tensor small_rows(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const bool has_bias = bias.has_value() && bias->defined();
  const int64_t K = input.size(-1), rows = input.numel() / std::max<int64_t>(K, 1);
  const bool wide = weight.scalar_type() == at::kBFloat16;
  const bool coded = weight.scalar_type() == at::kByte;  // Q4_1-coded (load_weights(Coded)): [N, K / 32 * 24]
  const int64_t stored = coded ? (K % 32 == 0 ? K / 32 * 24 : -1) : K;  // a weight row's stored elements
  if (rows == 0 && weight.dim() == 2) return empty_product(input, weight.size(0));
  bool ours = input.device().is_cpu() && input.scalar_type() == at::kFloat &&
              (weight.scalar_type() == at::kFloat || wide || coded) && weight.dim() == 2 &&
              weight.is_contiguous() && weight.size(1) == stored && K > 0 && rows <= kMaxRows &&
              (!has_bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous()));
#ifndef SELFSPEC_VECTOR
  ours = false;
#endif
  if (!ours && input.scalar_type() == at::kFloat && (wide || coded)) {  // the float32 weight (a copy), ATen's product
    TORCH_CHECK(!coded || (weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == stored),
                "small_rows: a coded weight is [N, K / 32 * 24] bytes, contiguous");
    const at::Tensor full = coded ? decoded(weight, K) : weight.to(at::kFloat);
    return at::linear(input, full, has_bias ? *bias : at::Tensor());
  }
  if (!ours) return at::linear(input, weight, has_bias ? *bias : at::Tensor());
  const int64_t N = weight.size(0);
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = N;
  at::Tensor output = at::empty(sizes, input.options());
#ifdef SELFSPEC_VECTOR
  const at::Tensor x = input.contiguous();
  const float* xs = x.data_ptr<float>();
  const float* bs = has_bias ? bias->data_ptr<float>() : nullptr;
  float* ys = output.data_ptr<float>();
  const auto product = [&](auto ws) {
    const int64_t blocks = (N + kBlock - 1) / kBlock;
    at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t first, int64_t last) {
      const int64_t begin = first * kBlock, end = std::min(N, last * kBlock);
      if (rows == 1)
        one_row(xs, K, ws, bs, ys, begin, end);
      else
        many_rows(xs, rows, K, ws, bs, ys, N, begin, end);
    });
  };
  if (coded)
    product(Coded{weight.data_ptr<uint8_t>(), 0});
  else if (wide)
    product(reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()));
  else
    product(weight.data_ptr<float>());
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
  if (rows == 0) return empty_product(input, N);
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
// 49,152. With AVX-512 VNNI the rows are coded as int16 too (`word_row`: steps of max |x| / 16,383) and the proxy's
// products are integer ones, exact in int32 (`word_rows`: twice float32's multiplies an instruction, no widening of
// the codes to float32); the slack then also counts the coding's error, |b| |x - step c| <= 127 sqrt(K) scale[n]
// |x - step c|, and the rounding of the proxy's value to float32. On the 2-core Zen 4, SmolLM2's head at 1 / 4 / 8 rows
// took 0.47 / 1.06 / 2.00 ms against 0.71 / 1.80 / 3.48 with the float32 proxy (interleaved probe, 2026-11-28), with as
// many logits left to compute exactly (1-9 of a row's 49,152 on real hidden states).
at::Tensor bounded_head(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& codes,
                        const at::Tensor& scale, const at::Tensor& bound, const at::Tensor& argmax_only) {
  const bool wide = weight.scalar_type() == at::kBFloat16;
  const auto full = [&]() { return wide ? wide_product(input, weight) : small_rows(input, weight, c10::nullopt); };
  const int64_t K = input.size(-1), rows = input.numel() / std::max<int64_t>(K, 1), N = weight.size(0);
  bool ours = argmax_only.item<bool>() && input.device().is_cpu() && input.scalar_type() == at::kFloat &&
              (wide || weight.scalar_type() == at::kFloat) && weight.dim() == 2 && weight.is_contiguous() &&
              weight.size(1) == K && K > 0 && rows > 0 && rows <= kMaxRows && codes.scalar_type() == at::kChar &&
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
#ifdef SELFSPEC_WORD_DOTS
  // the input rows as int16 codes: integer products, twice the multiplies of float32's per instruction and no
  // widening of the int8 codes to float32
  bool words = K <= kMaxWordK;
  for (int64_t k = 0; words && k < rows * K; k++) words = std::isfinite(xs[k]);  // else the float32 proxy's inf / NaN
  const int64_t padded = (K + kWordLanes - 1) / kWordLanes * kWordLanes;
  std::vector<int16_t> coded(words ? rows * padded : 0);
  std::vector<float> steps(rows);
  std::vector<double> errors(rows);
  for (int64_t r = 0; words && r < rows; r++) {
    const WordRow row = word_row(xs + r * K, K, coded.data() + r * padded, padded);
    steps[r] = row.step;
    errors[r] = row.error;
  }
  at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t first, int64_t last) {
    if (words)
      word_rows(coded.data(), steps.data(), rows, padded, qs, K, ss, ys, N, first * kBlock, std::min(N, last * kBlock));
    else
      code_rows(xs, rows, K, qs, ss, ys, N, first * kBlock, std::min(N, last * kBlock));
  });
#else
  at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t first, int64_t last) {
    code_rows(xs, rows, K, qs, ss, ys, N, first * kBlock, std::min(N, last * kBlock));
  });
#endif
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; r++) {
      const float* xr = xs + r * K;
      float* yr = ys + r * N;
      double squares = 0.0;
      for (int64_t k = 0; k < K; k++) squares += double(xr[k]) * double(xr[k]);
      const double norm = std::sqrt(squares) * (1.0 + 1e-9);  // |x|, rounded up past double's own error
#ifdef SELFSPEC_WORD_DOTS
      // the integer proxy's exact sum lies within |b| |x - step c| of the float32 proxy's, where b = scale * code is
      // the proxy row and |b| <= 127 sqrt(K) scale, and its computed value within 2u of itself (u = 2^-24: float64's
      // product, then float32's rounding)
      const double error = words ? errors[r] * 127.0 * std::sqrt(double(K)) * (1.0 + 1e-9) : 0.0;
      const auto slack = [&](int64_t n) {
        return words ? double(cs[n]) * norm + double(ss[n]) * error + 0x1p-23 * std::fabs(double(yr[n]))
                     : double(cs[n]) * norm;
      };
#else
      const auto slack = [&](int64_t n) { return double(cs[n]) * norm; };
#endif
      // a logit is computed exactly where its upper bound reaches the largest lower bound (`floor`), else -inf
      const auto settle = [&](int64_t n, bool candidate) {
        if (!candidate)
          yr[n] = -std::numeric_limits<float>::infinity();
        else if (wide)
          dots<1, 1>(xr, K, ws16 + n * K, nullptr, yr + n, 1);  // wide_product's bits for this element
        else
          dots<1, 1>(xr, K, ws + n * K, nullptr, yr + n, 1);  // small_rows' bits for this element
      };
      double floor = -std::numeric_limits<double>::infinity();
      int64_t n = 0, settled = 0;
#ifdef SELFSPEC_WORD_DOTS
      // eight at a time: the same slack as the scalar loop's up to rounding, which the bounds' margins cover
      const __m512d magnitude = _mm512_set1_pd(0x1p-23), norms = _mm512_set1_pd(norm), errs = _mm512_set1_pd(error);
      const auto slacks = [&](int64_t at, __m512d value) {
        const __m512d scaled = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm256_loadu_ps(ss + at)), errs,
                                               _mm512_mul_pd(magnitude, _mm512_abs_pd(value)));
        return _mm512_fmadd_pd(_mm512_cvtps_pd(_mm256_loadu_ps(cs + at)), norms, scaled);
      };
      if (words) {
        __m512d floors = _mm512_set1_pd(-std::numeric_limits<double>::infinity());
        for (; n + 8 <= N; n += 8) {
          const __m512d value = _mm512_cvtps_pd(_mm256_loadu_ps(yr + n));
          floors = _mm512_max_pd(floors, _mm512_sub_pd(value, slacks(n, value)));
        }
        floor = _mm512_reduce_max_pd(floors);
      }
#endif
      for (; n < N; n++) floor = std::max(floor, double(yr[n]) - slack(n));
#ifdef SELFSPEC_WORD_DOTS
      if (words) {
        const __m512d bar = _mm512_set1_pd(floor);
        for (; settled + 8 <= N; settled += 8) {
          const __m512d value = _mm512_cvtps_pd(_mm256_loadu_ps(yr + settled));
          const __mmask8 hit = _mm512_cmp_pd_mask(_mm512_add_pd(value, slacks(settled, value)), bar, _CMP_GE_OQ);
          for (int lane = 0; lane < 8; lane++) settle(settled + lane, (hit >> lane) & 1);
        }
      }
#endif
      for (; settled < N; settled++) settle(settled, double(yr[settled]) + slack(settled) >= floor);
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
  const int64_t group = H / KV, group_rows = group * n;  // query rows that share a key/value head
  const int64_t padded = (S + kLanes - 1) / kLanes * kLanes, blocks = padded / kLanes;
  // In a batch of sequences, each one's blocks of kLanes keys that some query row of it sees (one list where the mask
  // is shared): the others, a shorter sequence's keys before the ragged batch's new ones, are not read (their weights
  // are 0 anyway: no row's result changes). On the 2-core Zen 5, SmolLM2's 30 layers for four one-token rows after
  // 454, 152, 153 and 162 keys took 0.52-0.69x the time they took reading every row's keys up to the longest
  // (interleaved probes, medians, 2026-11-29).
  const int64_t masks = has_mask && B > 1 ? m.size(0) : 0;
  std::vector<uint8_t> seen(masks * blocks, 0);
  std::vector<int64_t> seen_keys(B, S);  // keys each sequence's rows read, to share the work out by
  for (int64_t b = 0; b < masks; b++) {
    int64_t keys = 0;
    for (int64_t block = 0; block < blocks; block++) {
      const int64_t count = std::min<int64_t>(kLanes, S - block * kLanes);
      bool any = false;
      for (int64_t i = 0; i < n && !any; i++)
        any = any_seen(ms + b * m.stride(0) + i * m.stride(2) + block * kLanes * m.stride(3), m.stride(3), count);
      seen[b * blocks + block] = any;
      keys += any ? count : 0;
    }
    if (masks == B) seen_keys[b] = keys;
    else std::fill(seen_keys.begin(), seen_keys.end(), keys);
  }
  // Tasks: a sequence's group of rows, split into pieces of at most kMaxAttendRows; where there are fewer groups
  // than four a thread, at least two pieces a group of two or more rows (both threads busy on a one-token step of one
  // sequence), as even as they go. The threads take runs of tasks in order (a group's pieces together) of about
  // equal work (rows x keys read).
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t fewest = (group_rows + kMaxAttendRows - 1) / kMaxAttendRows;
  const int64_t pieces = B * KV >= 4 * threads ? fewest : std::max<int64_t>(std::min<int64_t>(2, group_rows), fewest);
  const int64_t piece_rows = (group_rows + pieces - 1) / pieces;
  const int64_t tasks = B * KV * pieces;
  std::vector<int64_t> owner(tasks), work(tasks);
  int64_t total = 0;
  for (int64_t task = 0; task < tasks; task++) {
    const int64_t piece = task % pieces;
    work[task] = (std::min(group_rows, (piece + 1) * piece_rows) - piece * piece_rows) * seen_keys[task / (KV * pieces)];
    total += work[task];
  }
  for (int64_t task = 0, before = 0; task < tasks; before += work[task], task++)  // the thread its work's middle is in
    owner[task] = std::min(threads - 1, (2 * before + work[task]) * threads / std::max<int64_t>(1, 2 * total));
  const AttendRowsKernel attend = masks > 0 ? attend_rows_for<true>(D) : attend_rows_for<false>(D);
  at::parallel_for(0, threads, 1, [&](int64_t first_thread, int64_t last_thread) {
    std::vector<float> scores(piece_rows * padded);
    for (int64_t task = 0; task < tasks; task++) {
      if (owner[task] < first_thread || owner[task] >= last_thread) continue;
      const int64_t b = task / (KV * pieces), g = (task / pieces) % KV, piece = task % pieces;
      AttendRows rows;
      rows.count = 0;
      for (int64_t r = piece * piece_rows; r < std::min(group_rows, (piece + 1) * piece_rows); r++) {
        const int64_t h = g * group + r / n, i = r % n, row = (b * H + h) * n + i;
        rows.q[rows.count] = qs + row * D;
        rows.out[rows.count] = out + row * D;
        rows.mask[rows.count] = has_mask ? ms + (m.size(0) == 1 ? 0 : b) * m.stride(0) + i * m.stride(2) : nullptr;
        rows.visible[rows.count] = S - n + i + 1;
        rows.count++;
      }
      const uint8_t* row_seen = masks == 0 ? nullptr : seen.data() + (masks == 1 ? 0 : b) * blocks;
      attend(rows, ks + b * k.stride(0) + g * k.stride(1), k.stride(2), vs + b * v.stride(0) + g * v.stride(1),
             v.stride(2), has_mask ? m.stride(3) : 0, S, D, static_cast<float>(scale), scores.data(), padded, row_seen);
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
