// y = x @ W^T with W from a GGUF file's Q4_0, Q4_1 or Q8_0 blocks of 32, computed as llama.cpp does: each
// activation row is quantized to int8 per block of 32 (scale = max|x| / 127), the block dots are exact integer
// sums, scaled by d_w * d_x and accumulated in float32; Q4's offsets m add m * (the block's float sum of x).
// A float matrix comes as BF16 "blocks" (the weights' bf16 bits, 32 per block): bf16 activations times bf16 weights
// summed in float32, pairs of elements at a time (vdpbf16ps where the CPU has AVX-512 BF16, else the pair's two
// products by FMA, even elements into one sum and odd into another, added at the end).
//
// The weights come repacked by runtime/kernels/quant.py (BlockWeight): 16 output rows side by side, so that each 32-bit lane
// of a register holds 4 codes of one row and a register of dots covers 16 outputs (no horizontal sums). Per group
// of 16 rows and block: codes [4][16 rows][4] bytes for Q4 (low nibbles elements 8i..8i+3, high nibbles 8i+4..8i+7
// of chunk i) or [8][16 rows][4] int8 for Q8 (elements 4j..4j+3 of chunk j), then d and m as fp16 [16 rows]; for BF16
// [16 pairs][16 rows][2] bf16 (elements 2p, 2p+1 of pair p), no d or m.
//
// Every (row, output) is computed by the same instructions in the same order whatever the number of rows and
// whichever thread or tile takes it: a row of an M-row call equals its 1-row call bitwise (batch invariance).
// Implementations chosen when it is built for the CPU (`kernel_isa()` names them): integer blocks on AVX-512 VNNI or
// AVX2; BF16 on AVX-512 BF16, AVX-512F or AVX2. Each is batch invariant on its own; they round differently.
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
#include <vector>

namespace {

constexpr int64_t QK = 32, ROWS = 16;
constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, BF16 = 30;  // gguf.GGMLQuantizationType values

constexpr bool is_q4(int64_t qtype) { return qtype == Q4_0 || qtype == Q4_1; }
constexpr int64_t code_bytes(int64_t qtype) {  // per block of 32 inputs and 16 outputs
  return is_q4(qtype) ? ROWS * QK / 2 : qtype == BF16 ? ROWS * QK * 2 : ROWS * QK;
}

// The activations of R rows: int8 codes in [-127, 127], each block's scale, float sum and code sum.
struct QuantizedRows {
  std::vector<int8_t> codes;  // [R, K]
  std::vector<float> scale;   // [R, K / 32]
  std::vector<float> sum;     // [R, K / 32]
  std::vector<int32_t> code_sum;  // [R, K / 32]
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

struct Weights {
  const uint8_t* codes;   // [groups, nb, code_bytes]
  const at::Half* d;      // [groups, nb, 16]
  const at::Half* m;      // [groups, nb, 16] (Q4)
  int64_t nb;
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
// u8 as q + 128, the excess removed exactly by starting the integer sum at -128 * (the block's activation codes).
constexpr int MAX_RT = 8;

template <int64_t QT, int RT>
void tile(const Weights& w, const QuantizedRows& a, int64_t K, int64_t g, int64_t r0, const Output& out) {
  const int64_t nb = w.nb;
  __m512 acc[RT], acc_m[RT];
  for (int r = 0; r < RT; ++r) acc[r] = acc_m[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* c = w.codes + (g * nb + b) * code_bytes(QT);
    prefetch_next_group<QT>(w, g, b);
    __m512i wv[8];
    if constexpr (is_q4(QT)) {
      const __m512i low = _mm512_set1_epi8(0x0F);
      for (int i = 0; i < 4; ++i) {
        const __m512i v = _mm512_loadu_si512(c + 64 * i);
        wv[2 * i] = _mm512_and_si512(v, low);
        wv[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    } else {
      for (int j = 0; j < 8; ++j)
        wv[j] = _mm512_xor_si512(_mm512_loadu_si512(c + 64 * j), _mm512_set1_epi8(static_cast<char>(0x80)));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.d + (g * nb + b) * ROWS)));
    __m512 m = _mm512_setzero_ps();
    if constexpr (is_q4(QT))
      m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.m + (g * nb + b) * ROWS)));
    for (int r = 0; r < RT; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      const int8_t* x = a.codes.data() + (r0 + r) * K + b * QK;
      // two integer chains (exact: their order does not matter), elements 0-3, 8-11, ... and 4-7, 12-15, ...
      __m512i s0 = QT == Q8_0 ? _mm512_set1_epi32(-128 * a.code_sum[i]) : _mm512_setzero_si512();
      __m512i s1 = _mm512_setzero_si512();
      for (int j = 0; j < 8; j += 2) {
        s0 = _mm512_dpbusd_epi32(s0, wv[j], _mm512_set1_epi32(four_codes(x + 4 * j)));
        s1 = _mm512_dpbusd_epi32(s1, wv[j + 1], _mm512_set1_epi32(four_codes(x + 4 * j + 4)));
      }
      const __m512i dots = _mm512_add_epi32(s0, s1);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(d, _mm512_set1_ps(a.scale[i])), acc[r]);
      if constexpr (is_q4(QT)) acc_m[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sum[i]), acc_m[r]);
    }
  }
  alignas(64) float sums[ROWS];
  for (int r = 0; r < RT; ++r) {
    _mm512_store_ps(sums, _mm512_add_ps(acc[r], acc_m[r]));
    out.store(r0 + r, g * ROWS, sums);
  }
}
#else
constexpr const char* BLOCK_ISA = "avx2";
// AVX2: a register = 8 rows x 4 codes (two per group of 16); maddubs multiplies u8 by s8 and adds pairs exactly
// (|pair| <= 2 * 128 * 127 < 2^15: no saturation). Q4 codes are <= 15, so a block's 16 products per 16-bit lane sum
// to at most 16 * 15 * 127 = 30480: exact in 16 bits, widened once per block. Q8 weights stay signed (|q| times x
// with q's sign), their pairs widened at once. Each half of the 16 outputs takes its RT rows through all blocks
// (RT rows' accumulators in registers, each weight block loaded and unpacked once for them).
constexpr int MAX_RT = 4;

template <int64_t QT, int RT>
void tile(const Weights& w, const QuantizedRows& a, int64_t K, int64_t g, int64_t r0, const Output& out) {
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
      if constexpr (is_q4(QT)) {
        const __m256i low = _mm256_set1_epi8(0x0F);
        for (int i = 0; i < 4; ++i) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * i + 32 * h));
          wv[2 * i] = _mm256_and_si256(v, low);
          wv[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
      } else {
        for (int j = 0; j < 8; ++j) wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * j + 32 * h));
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.d + (g * nb + b) * ROWS + 8 * h)));
      __m256 m = _mm256_setzero_ps();
      if constexpr (is_q4(QT))
        m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.m + (g * nb + b) * ROWS + 8 * h)));
      for (int r = 0; r < RT; ++r) {
        const int64_t i = (r0 + r) * nb + b;
        const int8_t* x = a.codes.data() + (r0 + r) * K + b * QK;
        __m256i dots;
        if constexpr (is_q4(QT)) {
          __m256i s = _mm256_maddubs_epi16(wv[0], _mm256_set1_epi32(four_codes(x)));
          for (int j = 1; j < 8; ++j)
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(wv[j], _mm256_set1_epi32(four_codes(x + 4 * j))));
          dots = _mm256_madd_epi16(s, ones);
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
        if constexpr (is_q4(QT)) acc_m[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.sum[i]), acc_m[r]);
      }
    }
    for (int r = 0; r < RT; ++r) _mm256_store_ps(sums[r] + 8 * h, _mm256_add_ps(acc[r], acc_m[r]));
  }
  for (int r = 0; r < RT; ++r) out.store(r0 + r, g * ROWS, sums[r]);
}
#endif

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
  TORCH_CHECK(qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0 || qtype == BF16, "gguf_matmul: unsupported GGUF type ",
              qtype);
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu(), "gguf_matmul: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "gguf_matmul: float32 or bfloat16 input");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "gguf_matmul: float32 or bfloat16 output");
  const int64_t K = x.size(-1), nb = K / QK;
  TORCH_CHECK(K % QK == 0, "gguf_matmul: the input size must be a multiple of 32");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 3 &&
                  codes.size(1) == nb && codes.size(2) == code_bytes(qtype),
              "gguf_matmul: codes ", codes.sizes(), " are not [groups, ", nb, ", ", code_bytes(qtype), "] uint8");
  const int64_t N = codes.size(0) * ROWS;
  TORCH_CHECK(qtype == BF16 || (d.has_value() && d->scalar_type() == at::kHalf && d->is_contiguous() &&
                                d->numel() == N * nb), "gguf_matmul: bad d");
  TORCH_CHECK(!is_q4(qtype) || (m.has_value() && m->scalar_type() == at::kHalf && m->is_contiguous() &&
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
                  is_q4(qtype) ? m->data_ptr<at::Half>() : nullptr, nb};
  if (qtype == BF16) {  // float32 activations are rounded to bf16 first, as the fast precision's are
    if (x2.scalar_type() != at::kBFloat16) x2 = x2.to(at::kBFloat16);
    matmul_bf16(w, x2.data_ptr<at::BFloat16>(), K, R, out);
    return y;
  }
  thread_local QuantizedRows quantized;
  QuantizedRows& q = quantized;  // (a thread_local is not captured: workers would see their own)
  if (x2.scalar_type() == at::kFloat) quantize_rows(x2.data_ptr<float>(), R, K, q);
  else quantize_rows(x2.data_ptr<at::BFloat16>(), R, K, q);
  switch (qtype) {
    case Q4_0: matmul<Q4_0>(w, q, K, R, out); break;
    case Q4_1: matmul<Q4_1>(w, q, K, R, out); break;
    default: matmul<Q8_0>(w, q, K, R, out); break;
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
