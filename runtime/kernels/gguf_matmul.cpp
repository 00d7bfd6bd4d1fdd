// y = x @ W^T with W as a GGUF file stores it, computed as llama.cpp computes it (its block layouts and dot products,
// 8-bit activations), or with W a float matrix's bf16 bits.
//
// Blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): each activation row is quantized to int8 per block of 32 (scale
// d_x = max|x| / 127, codes rounded half to even), the block dots are exact integer sums, scaled by d_w * d_x and
// accumulated in float32. Q5_0 and Q8_0 dot their signed codes (q - 16, q) as llama.cpp does; Q4_0, Q4_1 and Q5_1 dot
// their unsigned codes and add m * (the block's float sum of x), m being Q4_1's and Q5_1's m and Q4_0's -8d.
// K-quants, super-blocks of 256 (Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scales sc and mins mn, w = d sc q -
// dmin mn; Q6_K: 16 sub-blocks of 16 with int8 scales, w = d sc (q - 32)): each activation row is quantized per 256 as
// llama.cpp's Q8_K (the element of largest |x| maps to -127: iscale = -127 / x_max, codes round(iscale x) half to
// even, d_x = 1 / iscale, the codes summed per 16), and per super-block two exact integer sums: S = sum_s sc_s (q_s .
// x_s) (Q6_K: (q_s - 32) . x_s, the 32 taken off as 32 times the code sums) and, for Q4_K/Q5_K, M = sum_s mn_s (the sum
// of x_s's codes). The output's float32 sum takes S * (d_w d_x), then M * (-dmin_w d_x), super-block by super-block.
// A float matrix comes as BF16 "blocks" (the weights' bf16 bits, 32 per block): bf16 activations times bf16 weights
// summed in float32, pairs of elements at a time (vdpbf16ps where the CPU has AVX-512 BF16, else the pair's two
// products by FMA, even elements into one sum and odd into another, added at the end).
//
// The weights come repacked by runtime/kernels/quant.py (BlockWeight): 16 output rows side by side, so that each 32-bit
// lane of a register holds 4 codes of one row and a register of dots covers 16 outputs (no horizontal sums). A block of
// 32 inputs of a group of 16 rows is 8 such registers, register j holding elements 4j..4j+3 of every row. Per group and
// block (K-quants: super-block, its 8 blocks of 32 one after the other):
//   Q8_0: [8][16 rows][4] int8 (register j);
//   4, 5 and 6 bits: the low nibbles, [4 chunks][16 rows][4] bytes (chunk i: low nibbles register 2i, high nibbles
//   2i + 1); then for 5 bits one plane of [16 rows][4] bytes whose bit j is bit 4 of register j's code in the same
//   byte, for 6 bits two planes whose bits 2j, 2j + 1 are bits 4, 5 of register 4p + j's code (plane p): the file's
//   bits, a shift and an or per register of codes;
//   K-quants then: the scales, [pairs t][16 rows][2] bytes (sub-blocks 2t and 2t + 1 of a row side by side): Q4_K and
//   Q5_K 4 pairs of 6-bit scales then 4 pairs of mins, Q6_K 8 pairs of int8 scales;
//   BF16: [16 pairs][16 rows][2] bf16 (elements 2p, 2p + 1 of pair p).
// and, in tensors of their own, d and m as fp16 [16 rows] per group and (super-)block (m: Q4_1's and Q5_1's m, Q4_0's
// -8d, Q4_K's and Q5_K's -dmin; none for Q5_0, Q8_0, Q6_K; BF16 has neither).
//
// Every (row, output) is computed by the same instructions in the same order whatever the number of rows and
// whichever thread or tile takes it: a row of an M-row call equals its 1-row call bitwise (batch invariance).
// Implementations chosen when it is built for the CPU (`kernel_isa()` names them): integer blocks on AVX-512 VNNI or
// AVX2 (the same integers and the same float operations per output: they agree bitwise); BF16 on AVX-512 BF16,
// AVX-512F or AVX2 (each batch invariant on its own; they round differently).
// Built by runtime/kernels/cpu_kernels.py (g++ -march=native, torch headers), registered as torch.ops.dspark.gguf_matmul.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t QK = 32, QK_K = 256, ROWS = 16;
// gguf.GGMLQuantizationType values
constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30;

constexpr bool is_k(int64_t qtype) { return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K; }
constexpr int code_bits(int64_t qtype) {
  return qtype == Q4_0 || qtype == Q4_1 || qtype == Q4_K ? 4 : qtype == Q5_0 || qtype == Q5_1 || qtype == Q5_K ? 5
       : qtype == Q6_K ? 6 : 8;
}
constexpr bool has_m(int64_t qtype) {
  return qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_1 || qtype == Q4_K || qtype == Q5_K;
}
constexpr int64_t block_inputs(int64_t qtype) { return is_k(qtype) ? QK_K : QK; }
// one block of 32 inputs' codes for 16 rows: the nibbles and a plane of 64 bytes per bit above 4
constexpr int64_t block32_bytes(int64_t qtype) {
  return code_bits(qtype) == 8 ? ROWS * QK : ROWS * QK / 2 + (code_bits(qtype) - 4) * ROWS * 4;
}
constexpr int64_t code_bytes(int64_t qtype) {  // per block (K-quants: super-block, with its scales) and 16 outputs
  return qtype == BF16 ? ROWS * QK * 2 : is_k(qtype) ? 8 * block32_bytes(qtype) + 16 * ROWS : block32_bytes(qtype);
}
constexpr bool supported(int64_t qtype) {
  return qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0 || qtype == Q5_1 || qtype == Q8_0 || is_k(qtype) ||
         qtype == BF16;
}

// f(std::integral_constant<int, 0>{}), ..., f(std::integral_constant<int, N - 1>{}): shifts by compile-time counts
template <typename F, int... J>
inline void unrolled(F&& f, std::integer_sequence<int, J...>) { (f(std::integral_constant<int, J>{}), ...); }
template <int N, typename F>
inline void unrolled(F&& f) { unrolled(f, std::make_integer_sequence<int, N>{}); }

// The activations of R rows: int8 codes; per block of 32 (legacy types) the block's scale, float sum and code sum,
// or per super-block of 256 (K-quants: llama.cpp's Q8_K) its scale and its code sums per 16.
struct QuantizedRows {
  std::vector<int8_t> codes;      // [R, K]
  std::vector<float> scale;       // [R, K / 32] or [R, K / 256]
  std::vector<float> sum;         // [R, K / 32]
  std::vector<int32_t> code_sum;  // [R, K / 32] or (Q8_K) [R, K / 16]
};

template <typename T>
void quantize_rows(const T* x, int64_t R, int64_t K, QuantizedRows& q) {
  const int64_t nb = K / QK;
  q.codes.resize(R * K);
  q.scale.resize(R * nb);
  q.sum.resize(R * nb);
  q.code_sum.resize(R * nb);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      float xb[QK];
      for (int64_t j = 0; j < QK; ++j) xb[j] = static_cast<float>(x[r * K + b * QK + j]);
      float amax = 0.f, sum = 0.f;
      for (int64_t j = 0; j < QK; ++j) {
        amax = std::max(amax, std::fabs(xb[j]));
        sum += xb[j];
      }
      const float d = amax / 127.f;
      const float inv = d > 0.f ? 1.f / d : 0.f;
      int8_t* qb = q.codes.data() + r * K + b * QK;
      int32_t code_sum = 0;
      for (int64_t j = 0; j < QK; ++j) {
        qb[j] = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
        code_sum += qb[j];
      }
      q.scale[r * nb + b] = d;
      q.sum[r * nb + b] = sum;
      q.code_sum[r * nb + b] = code_sum;
    }
  }
}

// llama.cpp's quantize_row_q8_K: the first element of largest |x| sets the scale (its code is -127), codes rounded half
// to even (as its nearest_int), at most 127.
template <typename T>
void quantize_rows_k(const T* x, int64_t R, int64_t K, QuantizedRows& q) {
  const int64_t nb = K / QK_K;
  q.codes.resize(R * K);
  q.scale.resize(R * nb);
  q.code_sum.resize(R * K / 16);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      float xb[QK_K];
      for (int64_t j = 0; j < QK_K; ++j) xb[j] = static_cast<float>(x[r * K + b * QK_K + j]);
      float amax = 0.f, max = 0.f;
      for (int64_t j = 0; j < QK_K; ++j) {
        const float ax = std::fabs(xb[j]);
        if (ax > amax) {
          amax = ax;
          max = xb[j];
        }
      }
      int8_t* qb = q.codes.data() + r * K + b * QK_K;
      float d = 0.f;
      if (amax > 0.f) {
        const float iscale = -127.f / max;
        for (int64_t j = 0; j < QK_K; ++j) qb[j] = static_cast<int8_t>(std::min(127.f, std::nearbyint(iscale * xb[j])));
        d = 1.f / iscale;
      } else {
        std::memset(qb, 0, QK_K);
      }
      q.scale[r * nb + b] = d;
      for (int64_t s = 0; s < QK_K / 16; ++s) {
        int32_t sum = 0;
        for (int64_t j = 0; j < 16; ++j) sum += qb[16 * s + j];
        q.code_sum[(r * K + b * QK_K) / 16 + s] = sum;
      }
    }
  }
}

// Two int16 in one 32-bit lane (a low, b high), for vpmaddwd with a register of int16 pairs.
inline int32_t int16_pair(int32_t a, int32_t b) {
  return static_cast<int32_t>((static_cast<uint32_t>(b) << 16) | (static_cast<uint32_t>(a) & 0xFFFFu));
}

// A row's code sums of Q8_K sub-blocks 2t and 2t + 1 of 32 (Q4_K/Q5_K's mins), or of 16 (Q6_K's scales), paired.
inline int32_t sums32_pair(const int32_t* sums16, int t) {
  return int16_pair(sums16[4 * t] + sums16[4 * t + 1], sums16[4 * t + 2] + sums16[4 * t + 3]);
}

struct Weights {
  const uint8_t* codes;   // [groups, nb, code_bytes]
  const at::Half* d;      // [groups, nb, 16]
  const at::Half* m;      // [groups, nb, 16] (has_m)
  int64_t nb;             // blocks (K-quants: super-blocks) per row
};

// Where results go: out[r * N + o] = sum + bias[o], as float32 or bf16.
struct Output {
  float* f;
  at::BFloat16* h;
  const float* bias;
  int64_t N;
  void store(int64_t r, int64_t o0, const float* sums) const {
    for (int64_t t = 0; t < ROWS; ++t) {
      const float v = bias != nullptr ? sums[t] + bias[o0 + t] : sums[t];
      if (h != nullptr) h[r * N + o0 + t] = at::BFloat16(v);
      else f[r * N + o0 + t] = v;
    }
  }
};

// The same block of the next group of outputs, into L1 ahead of its tile: the thread's next group (parallel_for gives
// each thread consecutive groups), so its weights stream in while this group's rows compute. (A prefetch past the
// end does not fault.)
template <int64_t QT>
inline void prefetch_next_group(const Weights& w, int64_t g, int64_t b) {
  const char* next = reinterpret_cast<const char*>(w.codes + ((g + 1) * w.nb + b) * code_bytes(QT));
  for (int64_t line = 0; line < code_bytes(QT); line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
}

inline int32_t four_codes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr const char* BLOCK_ISA = "avx512-vnni";
// AVX-512 VNNI: a register = 16 rows x 4 codes; vpdpbusd multiplies u8 weights by s8 activations. Q8 weights become
// u8 as q + 128, the excess removed exactly by starting the integer sum at -128 * (the block's activation codes), as
// Q5_0's 16 and Q6_K's 32 are.
constexpr int MAX_RT = 8;

template <int S>  // v << S within 16-bit lanes (S < 0: >> -S); the bits that cross a byte are masked off after
inline __m512i shift16(__m512i v) {
  if constexpr (S > 0) return _mm512_slli_epi16(v, S);
  else if constexpr (S < 0) return _mm512_srli_epi16(v, -S);
  else return v;
}

// The 8 registers of one block of 32 inputs: wv[j] = elements 4j..4j+3 of the 16 rows, unsigned codes (Q8: q + 128).
template <int64_t QT>
inline void unpack_block(const uint8_t* c, __m512i (&wv)[8]) {
  if constexpr (code_bits(QT) == 8) {
    for (int j = 0; j < 8; ++j)
      wv[j] = _mm512_xor_si512(_mm512_loadu_si512(c + 64 * j), _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int i = 0; i < 4; ++i) {
      const __m512i v = _mm512_loadu_si512(c + 64 * i);
      wv[2 * i] = _mm512_and_si512(v, low);
      wv[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    if constexpr (code_bits(QT) == 5) {  // bit j of the plane -> bit 4 of register j (0xF8: a | (b & c))
      const __m512i plane = _mm512_loadu_si512(c + 256), bit4 = _mm512_set1_epi8(0x10);
      unrolled<8>([&](auto j) {
        constexpr int J = decltype(j)::value;
        wv[J] = _mm512_ternarylogic_epi32(wv[J], shift16<4 - J>(plane), bit4, 0xF8);
      });
    } else if constexpr (code_bits(QT) == 6) {  // bits 2j, 2j + 1 of plane p -> bits 4, 5 of register 4p + j
      const __m512i planes[2] = {_mm512_loadu_si512(c + 256), _mm512_loadu_si512(c + 320)};
      const __m512i bits45 = _mm512_set1_epi8(0x30);
      unrolled<8>([&](auto j) {
        constexpr int J = decltype(j)::value;
        wv[J] = _mm512_ternarylogic_epi32(wv[J], shift16<4 - 2 * (J % 4)>(planes[J / 4]), bits45, 0xF8);
      });
    }
  }
}

template <int64_t QT, int RT>
void tile_blocks(const Weights& w, const QuantizedRows& a, int64_t K, int64_t g, int64_t r0, const Output& out) {
  const int64_t nb = w.nb;
  __m512 acc[RT], acc_m[RT];
  for (int r = 0; r < RT; ++r) acc[r] = acc_m[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* c = w.codes + (g * nb + b) * code_bytes(QT);
    prefetch_next_group<QT>(w, g, b);
    __m512i wv[8];
    unpack_block<QT>(c, wv);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.d + (g * nb + b) * ROWS)));
    __m512 m = _mm512_setzero_ps();
    if constexpr (has_m(QT))
      m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.m + (g * nb + b) * ROWS)));
    for (int r = 0; r < RT; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      const int8_t* x = a.codes.data() + (r0 + r) * K + b * QK;
      // two integer chains (exact: their order does not matter), elements 0-3, 8-11, ... and 4-7, 12-15, ...
      constexpr int offset = QT == Q8_0 ? 128 : QT == Q5_0 ? 16 : 0;
      __m512i s0 = offset != 0 ? _mm512_set1_epi32(-offset * a.code_sum[i]) : _mm512_setzero_si512();
      __m512i s1 = _mm512_setzero_si512();
      for (int j = 0; j < 8; j += 2) {
        s0 = _mm512_dpbusd_epi32(s0, wv[j], _mm512_set1_epi32(four_codes(x + 4 * j)));
        s1 = _mm512_dpbusd_epi32(s1, wv[j + 1], _mm512_set1_epi32(four_codes(x + 4 * j + 4)));
      }
      const __m512i dots = _mm512_add_epi32(s0, s1);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(d, _mm512_set1_ps(a.scale[i])), acc[r]);
      if constexpr (has_m(QT)) acc_m[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sum[i]), acc_m[r]);
    }
  }
  alignas(64) float sums[ROWS];
  for (int r = 0; r < RT; ++r) {
    _mm512_store_ps(sums, _mm512_add_ps(acc[r], acc_m[r]));
    out.store(r0 + r, g * ROWS, sums);
  }
}

// K-quants: per super-block and row, S in int32 lanes (each sub-block's exact dot times its scale, vpmulld), then M
// by vpdpwssd of the mins' int16 pairs with the paired code sums.
template <int64_t QT, int RT>
void tile_k(const Weights& w, const QuantizedRows& a, int64_t K, int64_t g, int64_t r0, const Output& out) {
  const int64_t nb = w.nb;
  __m512 acc[RT];
  for (int r = 0; r < RT; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* c = w.codes + (g * nb + b) * code_bytes(QT);
    const uint8_t* scales = c + 8 * block32_bytes(QT);  // [pairs][16 rows][2]
    prefetch_next_group<QT>(w, g, b);
    __m512i isum[RT];
    for (int r = 0; r < RT; ++r) isum[r] = _mm512_setzero_si512();
    for (int blk = 0; blk < 8; ++blk) {
      __m512i wv[8];
      unpack_block<QT>(c + blk * block32_bytes(QT), wv);
      if constexpr (QT == Q6_K) {  // sub-blocks 2 blk (registers 0-3) and 2 blk + 1 (4-7)
        const __m512i pair =
            _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32 * blk)));
        const __m512i sc0 = _mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16), sc1 = _mm512_srai_epi32(pair, 16);
        for (int r = 0; r < RT; ++r) {
          const int8_t* x = a.codes.data() + (r0 + r) * K + b * QK_K + blk * QK;
          const int32_t* sums16 = a.code_sum.data() + ((r0 + r) * K + b * QK_K) / 16 + 2 * blk;
          __m512i s0 = _mm512_set1_epi32(-32 * sums16[0]), s1 = _mm512_set1_epi32(-32 * sums16[1]);
          for (int j = 0; j < 4; ++j) {
            s0 = _mm512_dpbusd_epi32(s0, wv[j], _mm512_set1_epi32(four_codes(x + 4 * j)));
            s1 = _mm512_dpbusd_epi32(s1, wv[j + 4], _mm512_set1_epi32(four_codes(x + 16 + 4 * j)));
          }
          isum[r] = _mm512_add_epi32(isum[r],
                                     _mm512_add_epi32(_mm512_mullo_epi32(s0, sc0), _mm512_mullo_epi32(s1, sc1)));
        }
      } else {  // sub-block blk
        const __m512i pair =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32 * (blk / 2))));
        const __m512i sc =
            blk % 2 == 0 ? _mm512_and_si512(pair, _mm512_set1_epi32(0xFFFF)) : _mm512_srli_epi32(pair, 16);
        for (int r = 0; r < RT; ++r) {
          const int8_t* x = a.codes.data() + (r0 + r) * K + b * QK_K + blk * QK;
          __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
          for (int j = 0; j < 8; j += 2) {
            s0 = _mm512_dpbusd_epi32(s0, wv[j], _mm512_set1_epi32(four_codes(x + 4 * j)));
            s1 = _mm512_dpbusd_epi32(s1, wv[j + 1], _mm512_set1_epi32(four_codes(x + 4 * j + 4)));
          }
          isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), sc));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.d + (g * nb + b) * ROWS)));
    __m512 m = _mm512_setzero_ps();
    __m512i mins[4];
    if constexpr (has_m(QT)) {
      m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.m + (g * nb + b) * ROWS)));
      for (int t = 0; t < 4; ++t)
        mins[t] = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 128 + 32 * t)));
    }
    for (int r = 0; r < RT; ++r) {
      const __m512 dx = _mm512_set1_ps(a.scale[(r0 + r) * nb + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, dx), acc[r]);
      if constexpr (has_m(QT)) {
        const int32_t* sums16 = a.code_sum.data() + ((r0 + r) * K + b * QK_K) / 16;
        __m512i imin = _mm512_setzero_si512();
        for (int t = 0; t < 4; ++t)
          imin = _mm512_dpwssd_epi32(imin, mins[t], _mm512_set1_epi32(sums32_pair(sums16, t)));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(imin), _mm512_mul_ps(m, dx), acc[r]);
      }
    }
  }
  alignas(64) float sums[ROWS];
  for (int r = 0; r < RT; ++r) {
    _mm512_store_ps(sums, acc[r]);
    out.store(r0 + r, g * ROWS, sums);
  }
}
#else
constexpr const char* BLOCK_ISA = "avx2";
// AVX2: a register = 8 rows x 4 codes (two per group of 16); maddubs multiplies u8 by s8 and adds pairs exactly
// (|pair| <= 2 * 128 * 127 < 2^15: no saturation), and the int16 sums are widened (vpmaddwd) before they can
// overflow: Q4 codes are <= 15, so a block's 16 products per 16-bit lane sum to at most 16 * 15 * 127 = 30480, widened
// once per block; 5-bit codes (<= 31) per 8 products (31496), 6-bit ones (<= 63) per 4 (32004). Q8 weights stay signed
// (|q| times x with q's sign), their pairs widened at once. K-quants widen by their sub-block scale as int16 pairs
// (vpmaddwd: exact), and take Q6_K's 32 off as 32 sum_s sc_s (code sum of s). Each half of the 16 outputs takes its RT
// rows through all blocks (RT rows' accumulators in registers, each weight block loaded and unpacked once for them).
constexpr int MAX_RT = 4;

template <int S>
inline __m256i shift16(__m256i v) {
  if constexpr (S > 0) return _mm256_slli_epi16(v, S);
  else if constexpr (S < 0) return _mm256_srli_epi16(v, -S);
  else return v;
}

// Registers J0..J0 + N - 1 of one block of 32 inputs, rows 8h..8h + 7: unsigned codes (Q8: signed).
template <int64_t QT, int J0, int N>
inline void unpack_half(const uint8_t* c, int h, __m256i* wv) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  unrolled<N>([&](auto n) {
    constexpr int J = J0 + decltype(n)::value;
    if constexpr (code_bits(QT) == 8) {
      wv[J - J0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * J + 32 * h));
    } else {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * (J / 2) + 32 * h));
      __m256i q = _mm256_and_si256(J % 2 == 0 ? v : _mm256_srli_epi16(v, 4), low);
      if constexpr (code_bits(QT) == 5) {
        const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 256 + 32 * h));
        q = _mm256_or_si256(q, _mm256_and_si256(shift16<4 - J>(plane), _mm256_set1_epi8(0x10)));
      } else if constexpr (code_bits(QT) == 6) {
        const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 256 + 64 * (J / 4) + 32 * h));
        q = _mm256_or_si256(q, _mm256_and_si256(shift16<4 - 2 * (J % 4)>(plane), _mm256_set1_epi8(0x30)));
      }
      wv[J - J0] = q;
    }
  });
}

inline __m256i maddubs4(const __m256i& w, const int8_t* x) {
  return _mm256_maddubs_epi16(w, _mm256_set1_epi32(four_codes(x)));
}

template <int64_t QT, int RT>
void tile_blocks(const Weights& w, const QuantizedRows& a, int64_t K, int64_t g, int64_t r0, const Output& out) {
  const int64_t nb = w.nb;
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) float sums[RT][ROWS];
  for (int h = 0; h < 2; ++h) {  // rows 0-7, then 8-15
    __m256 acc[RT], acc_m[RT];
    for (int r = 0; r < RT; ++r) acc[r] = acc_m[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* c = w.codes + (g * nb + b) * code_bytes(QT);
      if (h == 0) prefetch_next_group<QT>(w, g, b);
      __m256i wv[8];
      unpack_half<QT, 0, 8>(c, h, wv);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.d + (g * nb + b) * ROWS + 8 * h)));
      __m256 m = _mm256_setzero_ps();
      if constexpr (has_m(QT))
        m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.m + (g * nb + b) * ROWS + 8 * h)));
      for (int r = 0; r < RT; ++r) {
        const int64_t i = (r0 + r) * nb + b;
        const int8_t* x = a.codes.data() + (r0 + r) * K + b * QK;
        __m256i dots;
        if constexpr (code_bits(QT) == 4) {
          __m256i s = maddubs4(wv[0], x);
          for (int j = 1; j < 8; ++j) s = _mm256_add_epi16(s, maddubs4(wv[j], x + 4 * j));
          dots = _mm256_madd_epi16(s, ones);
        } else if constexpr (code_bits(QT) == 5) {
          __m256i s0 = maddubs4(wv[0], x), s1 = maddubs4(wv[4], x + 16);
          for (int j = 1; j < 4; ++j) {
            s0 = _mm256_add_epi16(s0, maddubs4(wv[j], x + 4 * j));
            s1 = _mm256_add_epi16(s1, maddubs4(wv[j + 4], x + 16 + 4 * j));
          }
          dots = _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
          if constexpr (QT == Q5_0) dots = _mm256_add_epi32(dots, _mm256_set1_epi32(-16 * a.code_sum[i]));
        } else {
          __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
          for (int j = 0; j < 8; j += 2) {
            __m256i x0 = _mm256_set1_epi32(four_codes(x + 4 * j)), x1 = _mm256_set1_epi32(four_codes(x + 4 * j + 4));
            x0 = _mm256_sign_epi8(x0, wv[j]), x1 = _mm256_sign_epi8(x1, wv[j + 1]);
            const __m256i w0 = _mm256_sign_epi8(wv[j], wv[j]), w1 = _mm256_sign_epi8(wv[j + 1], wv[j + 1]);
            s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(w0, x0), ones));
            s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(w1, x1), ones));
          }
          dots = _mm256_add_epi32(s0, s1);
        }
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(d, _mm256_set1_ps(a.scale[i])), acc[r]);
        if constexpr (has_m(QT)) acc_m[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.sum[i]), acc_m[r]);
      }
    }
    for (int r = 0; r < RT; ++r) _mm256_store_ps(sums[r] + 8 * h, _mm256_add_ps(acc[r], acc_m[r]));
  }
  for (int r = 0; r < RT; ++r) out.store(r0 + r, g * ROWS, sums[r]);
}

// A row's int16 pair (low, high) of each 32-bit lane, broadcast to both halves: vpmaddwd then multiplies both of a
// lane's int16 sums by the lane's own scale.
inline __m256i low_pairs(__m256i v) { return _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(v, 0xA0), 0xA0); }
inline __m256i high_pairs(__m256i v) { return _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(v, 0xF5), 0xF5); }

template <int64_t QT, int RT>
void tile_k(const Weights& w, const QuantizedRows& a, int64_t K, int64_t g, int64_t r0, const Output& out) {
  const int64_t nb = w.nb;
  alignas(32) float sums[RT][ROWS];
  for (int h = 0; h < 2; ++h) {  // rows 0-7, then 8-15
    __m256 acc[RT];
    for (int r = 0; r < RT; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* c = w.codes + (g * nb + b) * code_bytes(QT);
      const uint8_t* scales = c + 8 * block32_bytes(QT);  // [pairs][16 rows][2]
      if (h == 0) prefetch_next_group<QT>(w, g, b);
      __m256i isum[RT];
      for (int r = 0; r < RT; ++r) isum[r] = _mm256_setzero_si256();
      auto scale_pairs = [&](int t) {  // rows 8h..8h + 7's pair t of scales (then mins), as int16
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 32 * t + 16 * h));
        return QT == Q6_K ? _mm256_cvtepi8_epi16(v) : _mm256_cvtepu8_epi16(v);
      };
      for (int blk = 0; blk < 8; ++blk) {
        const uint8_t* cb = c + blk * block32_bytes(QT);
        __m256i wv[4];
        if constexpr (QT == Q6_K) {  // sub-blocks 2 blk (registers 0-3) and 2 blk + 1 (4-7), 4 products per int16
          const __m256i pair = scale_pairs(blk);
          const __m256i sc[2] = {low_pairs(pair), high_pairs(pair)};
          for (int half = 0; half < 2; ++half) {
            if (half == 0) unpack_half<QT, 0, 4>(cb, h, wv);
            else unpack_half<QT, 4, 4>(cb, h, wv);
            for (int r = 0; r < RT; ++r) {
              const int8_t* x = a.codes.data() + (r0 + r) * K + b * QK_K + blk * QK + 16 * half;
              const __m256i s01 = _mm256_add_epi16(maddubs4(wv[0], x), maddubs4(wv[1], x + 4));
              const __m256i s23 = _mm256_add_epi16(maddubs4(wv[2], x + 8), maddubs4(wv[3], x + 12));
              isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(s01, sc[half]),
                                                                   _mm256_madd_epi16(s23, sc[half])));
            }
          }
        } else {  // sub-block blk, 8 products per int16
          const __m256i pair = scale_pairs(blk / 2);
          const __m256i sc = blk % 2 == 0 ? low_pairs(pair) : high_pairs(pair);
          for (int half = 0; half < 2; ++half) {
            if (half == 0) unpack_half<QT, 0, 4>(cb, h, wv);
            else unpack_half<QT, 4, 4>(cb, h, wv);
            for (int r = 0; r < RT; ++r) {
              const int8_t* x = a.codes.data() + (r0 + r) * K + b * QK_K + blk * QK + 16 * half;
              const __m256i s = _mm256_add_epi16(_mm256_add_epi16(maddubs4(wv[0], x), maddubs4(wv[1], x + 4)),
                                                 _mm256_add_epi16(maddubs4(wv[2], x + 8), maddubs4(wv[3], x + 12)));
              isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(s, sc));
            }
          }
        }
      }
      const int64_t dm = (g * nb + b) * ROWS + 8 * h;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.d + dm)));
      __m256 m = _mm256_setzero_ps();
      if constexpr (has_m(QT)) m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.m + dm)));
      for (int r = 0; r < RT; ++r) {
        const int32_t* sums16 = a.code_sum.data() + ((r0 + r) * K + b * QK_K) / 16;
        const __m256 dx = _mm256_set1_ps(a.scale[(r0 + r) * nb + b]);
        if constexpr (QT == Q6_K) {  // - 32 sum_s sc_s (code sum of s)
          __m256i offset = _mm256_setzero_si256();
          for (int t = 0; t < 8; ++t)
            offset = _mm256_add_epi32(offset, _mm256_madd_epi16(scale_pairs(t), _mm256_set1_epi32(
                                                                    int16_pair(sums16[2 * t], sums16[2 * t + 1]))));
          isum[r] = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(offset, 5));
        }
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, dx), acc[r]);
        if constexpr (has_m(QT)) {
          __m256i imin = _mm256_setzero_si256();
          for (int t = 0; t < 4; ++t)
            imin = _mm256_add_epi32(imin, _mm256_madd_epi16(scale_pairs(4 + t),
                                                            _mm256_set1_epi32(sums32_pair(sums16, t))));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(m, dx), acc[r]);
        }
      }
    }
    for (int r = 0; r < RT; ++r) _mm256_store_ps(sums[r] + 8 * h, acc[r]);
  }
  for (int r = 0; r < RT; ++r) out.store(r0 + r, g * ROWS, sums[r]);
}
#endif

template <int64_t QT, int RT>
void tile(const Weights& w, const QuantizedRows& a, int64_t K, int64_t g, int64_t r0, const Output& out) {
  if constexpr (is_k(QT)) tile_k<QT, RT>(w, a, K, g, r0, out);
  else tile_blocks<QT, RT>(w, a, K, g, r0, out);
}

// BF16 weights: one register holds a pair of inputs for 16 (AVX-512) or 8 (AVX2) outputs, 32 bits a lane, and the
// activations' pair is broadcast to every lane. x is bf16 [R, K].
inline int32_t pair_bits(const at::BFloat16* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return v;
}

#if defined(__AVX512F__)
constexpr int BF16_RT = 8;
#if defined(__AVX512BF16__)
constexpr const char* BF16_ISA = "avx512-bf16";
#else
constexpr const char* BF16_ISA = "avx512f";
#endif

template <int RT>
void tile_bf16(const Weights& w, const at::BFloat16* x, int64_t K, int64_t g, int64_t r0, const Output& out) {
  const int64_t nb = w.nb;
  __m512 even[RT], odd[RT];
  for (int r = 0; r < RT; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* c = w.codes + (g * nb + b) * code_bytes(BF16);
    prefetch_next_group<BF16>(w, g, b);
    for (int p = 0; p < QK / 2; ++p) {
      const __m512i wv = _mm512_loadu_si512(c + 64 * p);
#if defined(__AVX512BF16__)
      // even[] and odd[] take alternate pairs: two dependency chains
      __m512* acc = p % 2 == 0 ? even : odd;
      for (int r = 0; r < RT; ++r) {
        const __m512i xv = _mm512_set1_epi32(pair_bits(x + (r0 + r) * K + b * QK + 2 * p));
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)wv, (__m512bh)xv);
      }
#else
      const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
      const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(wv, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
      for (int r = 0; r < RT; ++r) {
        const at::BFloat16* xp = x + (r0 + r) * K + b * QK + 2 * p;
        even[r] = _mm512_fmadd_ps(we, _mm512_set1_ps(static_cast<float>(xp[0])), even[r]);
        odd[r] = _mm512_fmadd_ps(wo, _mm512_set1_ps(static_cast<float>(xp[1])), odd[r]);
      }
#endif
    }
  }
  alignas(64) float sums[ROWS];
  for (int r = 0; r < RT; ++r) {
    _mm512_store_ps(sums, _mm512_add_ps(even[r], odd[r]));
    out.store(r0 + r, g * ROWS, sums);
  }
}
#else
constexpr int BF16_RT = 4;
constexpr const char* BF16_ISA = "avx2";

template <int RT>
void tile_bf16(const Weights& w, const at::BFloat16* x, int64_t K, int64_t g, int64_t r0, const Output& out) {
  const int64_t nb = w.nb;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  alignas(32) float sums[RT][ROWS];
  for (int h = 0; h < 2; ++h) {  // outputs 0-7, then 8-15
    __m256 even[RT], odd[RT];
    for (int r = 0; r < RT; ++r) even[r] = odd[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* c = w.codes + (g * nb + b) * code_bytes(BF16);
      if (h == 0) prefetch_next_group<BF16>(w, g, b);
      for (int p = 0; p < QK / 2; ++p) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * p + 32 * h));
        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
        const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(wv, high));
        for (int r = 0; r < RT; ++r) {
          const at::BFloat16* xp = x + (r0 + r) * K + b * QK + 2 * p;
          even[r] = _mm256_fmadd_ps(we, _mm256_set1_ps(static_cast<float>(xp[0])), even[r]);
          odd[r] = _mm256_fmadd_ps(wo, _mm256_set1_ps(static_cast<float>(xp[1])), odd[r]);
        }
      }
    }
    for (int r = 0; r < RT; ++r) _mm256_store_ps(sums[r] + 8 * h, _mm256_add_ps(even[r], odd[r]));
  }
  for (int r = 0; r < RT; ++r) out.store(r0 + r, g * ROWS, sums[r]);
}
#endif

template <int RT>
void bf16_rows_from(const Weights& w, const at::BFloat16* x, int64_t K, int64_t R, int64_t g, int64_t r0,
                    const Output& out) {
  if constexpr (RT > 0) {
    if (R - r0 >= RT) return tile_bf16<RT>(w, x, K, g, r0, out);
    return bf16_rows_from<RT - 1>(w, x, K, R, g, r0, out);
  }
}

void matmul_bf16(const Weights& w, const at::BFloat16* x, int64_t K, int64_t R, const Output& out) {
  at::parallel_for(0, out.N / ROWS, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      int64_t r0 = 0;
      for (; r0 + BF16_RT <= R; r0 += BF16_RT) tile_bf16<BF16_RT>(w, x, K, g, r0, out);
      if (r0 < R) bf16_rows_from<BF16_RT - 1>(w, x, K, R, g, r0, out);
    }
  });
}

template <int64_t QT, int RT>
void rows_from(const Weights& w, const QuantizedRows& a, int64_t K, int64_t R, int64_t g, int64_t r0,
               const Output& out) {
  if constexpr (RT > 0) {
    if (R - r0 >= RT) return tile<QT, RT>(w, a, K, g, r0, out);
    return rows_from<QT, RT - 1>(w, a, K, R, g, r0, out);
  }
}

template <int64_t QT>
void matmul(const Weights& w, const QuantizedRows& a, int64_t K, int64_t R, const Output& out) {
  at::parallel_for(0, out.N / ROWS, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      int64_t r0 = 0;
      for (; r0 + MAX_RT <= R; r0 += MAX_RT) tile<QT, MAX_RT>(w, a, K, g, r0, out);
      if (r0 < R) rows_from<QT, MAX_RT - 1>(w, a, K, R, g, r0, out);
    }
  });
}

at::Tensor gguf_matmul(const at::Tensor& x, const at::Tensor& codes, const std::optional<at::Tensor>& d,
                       const std::optional<at::Tensor>& m, int64_t qtype, const std::optional<at::Tensor>& bias,
                       at::ScalarType out_dtype) {
  TORCH_CHECK(supported(qtype), "gguf_matmul: unsupported GGUF type ", qtype);
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu(), "gguf_matmul: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "gguf_matmul: float32 or bfloat16 input");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "gguf_matmul: float32 or bfloat16 output");
  const int64_t K = x.size(-1), nb = K / block_inputs(qtype);
  TORCH_CHECK(K % block_inputs(qtype) == 0, "gguf_matmul: the input size must be a multiple of ", block_inputs(qtype));
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 3 &&
                  codes.size(1) == nb && codes.size(2) == code_bytes(qtype),
              "gguf_matmul: codes ", codes.sizes(), " are not [groups, ", nb, ", ", code_bytes(qtype), "] uint8");
  const int64_t N = codes.size(0) * ROWS;
  TORCH_CHECK(qtype == BF16 || (d.has_value() && d->scalar_type() == at::kHalf && d->is_contiguous() &&
                                d->numel() == N * nb), "gguf_matmul: bad d");
  TORCH_CHECK(!has_m(qtype) || (m.has_value() && m->scalar_type() == at::kHalf && m->is_contiguous() &&
                                m->numel() == N * nb), "gguf_matmul: bad m");
  at::Tensor x2 = x.is_contiguous() ? x : x.contiguous();
  const int64_t R = x2.numel() / K;
  at::DimVector out_shape(x.sizes());
  out_shape.back() = N;
  at::Tensor y = at::empty(out_shape, x.options().dtype(out_dtype));
  if (R == 0) return y;
  at::Tensor bias_f;
  if (bias.has_value()) {
    bias_f = bias->scalar_type() == at::kFloat && bias->is_contiguous() ? *bias : bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_f.numel() == N, "gguf_matmul: bias of ", bias_f.numel(), " values for ", N, " outputs");
  }
  const Output out{out_dtype == at::kFloat ? y.data_ptr<float>() : nullptr,
                   out_dtype == at::kBFloat16 ? y.data_ptr<at::BFloat16>() : nullptr,
                   bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, N};
  const Weights w{codes.data_ptr<uint8_t>(), qtype == BF16 ? nullptr : d->data_ptr<at::Half>(),
                  has_m(qtype) ? m->data_ptr<at::Half>() : nullptr, nb};
  if (qtype == BF16) {  // float32 activations are rounded to bf16 first, as the fast precision's are
    if (x2.scalar_type() != at::kBFloat16) x2 = x2.to(at::kBFloat16);
    matmul_bf16(w, x2.data_ptr<at::BFloat16>(), K, R, out);
    return y;
  }
  thread_local QuantizedRows quantized;
  QuantizedRows& q = quantized;  // (a thread_local is not captured: workers would see their own)
  if (is_k(qtype)) {
    if (x2.scalar_type() == at::kFloat) quantize_rows_k(x2.data_ptr<float>(), R, K, q);
    else quantize_rows_k(x2.data_ptr<at::BFloat16>(), R, K, q);
  } else {
    if (x2.scalar_type() == at::kFloat) quantize_rows(x2.data_ptr<float>(), R, K, q);
    else quantize_rows(x2.data_ptr<at::BFloat16>(), R, K, q);
  }
  switch (qtype) {
    case Q4_0: matmul<Q4_0>(w, q, K, R, out); break;
    case Q4_1: matmul<Q4_1>(w, q, K, R, out); break;
    case Q5_0: matmul<Q5_0>(w, q, K, R, out); break;
    case Q5_1: matmul<Q5_1>(w, q, K, R, out); break;
    case Q8_0: matmul<Q8_0>(w, q, K, R, out); break;
    case Q4_K: matmul<Q4_K>(w, q, K, R, out); break;
    case Q5_K: matmul<Q5_K>(w, q, K, R, out); break;
    default: matmul<Q6_K>(w, q, K, R, out); break;
  }
  return y;
}

}  // namespace

const char* row_attention_isa();  // row_attention.cpp

// Which implementation each kernel was built with (logged at start-up).
std::string kernel_isa() {
  return std::string("blocks ") + BLOCK_ISA + ", bf16 " + BF16_ISA + ", attention " + row_attention_isa();
}

TORCH_LIBRARY(dspark, m) {
  m.def("gguf_matmul(Tensor x, Tensor codes, Tensor? d, Tensor? m, int qtype, Tensor? bias, ScalarType out_dtype) "
        "-> Tensor");
  m.def("kernel_isa() -> str", &kernel_isa);
}

TORCH_LIBRARY_IMPL(dspark, CPU, m) { m.impl("gguf_matmul", &gguf_matmul); }
