// Attention for the compiled step's rows (runtime/kernels/compiled_step.py): first every row's new key and value are written
// into its slot of the layer's K/V store (in place: as a mutation the graph's own index writes made inductor copy
// the store), then each row's query heads attend to the first C rows of its slot, masked by its mask row: scores as
// bf16 dot products summed in float32 (vdpbf16ps where the CPU has AVX-512 BF16, else float32 products), softmax and
// the values' weighted sum in float32. A row is computed the same way whatever the other rows (batch invariance);
// keys are read in place.
//
// o[r, h] = sum_c softmax_c(q[r, h] . k[slot[r], h / G, c] / sqrt(D) | mask[r, c]) v[slot[r], h / G, c], G = H / KV.
// Built with runtime/kernels/gguf_matmul.cpp by runtime/kernels/cpu_kernels.py, registered as torch.ops.dspark.row_attention.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// One vector register's floats: 16 with AVX-512, 8 with AVX2 (a 16-float vector on AVX2 is two registers and its
// shuffles and masks split into scalar code). The arithmetic per lane is the same; only how keys and channels are
// grouped into lanes (so the order of the sums) differs between the two builds, never between rows of one build.
#ifdef __AVX512F__
constexpr int64_t LANES = 16;
#else
constexpr int64_t LANES = 8;
#endif
constexpr int64_t MAX_GROUP = 16, MAX_CHUNKS = 256 / LANES;  // G <= 16 query heads per KV head, D <= 256
typedef float fvec __attribute__((vector_size(LANES * 4)));
typedef int32_t ivec __attribute__((vector_size(LANES * 4)));
typedef uint16_t hvec __attribute__((vector_size(LANES * 2)));
typedef uint32_t uvec __attribute__((vector_size(LANES * 4)));
#ifdef __AVX512BF16__
constexpr bool HAVE_BF16_DOT = true;  // vdpbf16ps: pairs of bf16 products summed into float32 lanes
#else
constexpr bool HAVE_BF16_DOT = false;
#endif

inline fvec load_bf16(const at::BFloat16* p) {
  hvec h;
  std::memcpy(&h, p, sizeof(h));
  const uvec w = __builtin_convertvector(h, uvec) << 16;  // bf16 is float32's upper half
  fvec f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

inline fvec splat(float x) { return fvec{} + x; }

// Sums of LANES vectors' lanes at once: result lane i = sum of v[i]'s lanes (a fixed tree of halvings).
#ifdef __AVX512F__
inline fvec lane_sums(fvec v[16]) {
  fvec w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: v[2i]'s 8 half sums, 8-15: v[2i+1]'s
    w[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // 4 lanes per vector, v[4i .. 4i+3]
    x[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // 2 lanes per vector, v[8i .. 8i+7]
    y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#else
inline fvec lane_sums(fvec v[8]) {
  fvec x[4], y[2];
  for (int i = 0; i < 4; ++i)  // lanes 0-3: v[2i]'s 4 half sums, 4-7: v[2i+1]'s
    x[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)  // 2 lanes per vector, v[4i .. 4i+3]
    y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

// exp(x) for x <= 0 (softmax after subtracting the maximum), a degree-6 polynomial on [-ln2/2, ln2/2] scaled by
// 2^n: within ~2 ulp of expf; exp(-inf) = 0.
inline fvec exp_nonpositive(fvec x) {
  const ivec finite = x > -std::numeric_limits<float>::infinity();
  x = x < -87.f ? splat(-87.f) : x;
  // k = the integer nearest x / ln2 (x <= 0: truncating x / ln2 - 0.5 rounds to nearest)
  const fvec k = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f - 0.5f, ivec), fvec);
  const fvec r = (x - k * 0.693359375f) - k * -2.12194440e-4f;
  fvec p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const ivec bits = (__builtin_convertvector(k, ivec) + 127) << 23;
  fvec scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return finite ? p * scale : fvec{};
}

// One row and one key/value head: its G query heads at once (each key and value read once for them), LANES keys at
// a time. Masked keys get probability 0. GT and CT, when not 0, are G and D / LANES known when it is compiled: the
// loops over heads and channels unroll and the queries and accumulators stay in registers (the same arithmetic).
template <int64_t GT, int64_t CT>
void attend(const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v, const bool* mask, int64_t C,
            int64_t G_run, int64_t D_run, float scale, at::BFloat16* out, std::vector<float>& scores) {
  constexpr int64_t GM = GT ? GT : MAX_GROUP, CM = CT ? CT : MAX_CHUNKS;
  const int64_t G = GT ? GT : G_run, chunks = CT ? CT : D_run / LANES, D = chunks * LANES;
  const int64_t blocks = (C + LANES - 1) / LANES;
  // With vdpbf16ps (a head size compiled in, an even number of chunks) the scores are bf16 dots of the raw query
  // and key, scaled after; otherwise float32 products of the scaled query and the key.
  constexpr bool BF16_DOT = HAVE_BF16_DOT && CT != 0 && CT % 2 == 0;
  fvec qf[GM][CM], acc[GM][CM] = {};
#ifdef __AVX512BF16__
  __m512bh qb[GM][CM / 2];
  if constexpr (BF16_DOT)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < chunks / 2; ++j) qb[g][j] = (__m512bh)_mm512_loadu_si512(q + g * D + j * 2 * LANES);
#endif
  if constexpr (!BF16_DOT)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < chunks; ++j) qf[g][j] = load_bf16(q + g * D + j * LANES) * scale;
  const float score_scale = BF16_DOT ? scale : 1.f;
  scores.resize(G * blocks * LANES);
  fvec best[GM], sums[GM];
  int64_t dense = 0;  // keys 0 .. dense - 1 are all seen
  while (dense < C && mask[dense]) ++dense;  // per head: each lane's largest score; the probabilities' sum
  for (int64_t g = 0; g < G; ++g) best[g] = splat(-std::numeric_limits<float>::infinity());
  for (int64_t b = 0; b < blocks; ++b) {
    fvec dots[GM][LANES];
    for (int64_t l = 0; l < LANES; ++l) {
      const int64_t c = b * LANES + l;
      if (c >= C || !mask[c]) {
        for (int64_t g = 0; g < G; ++g) dots[g][l] = fvec{};
        continue;
      }
#ifdef __AVX512BF16__
      if constexpr (BF16_DOT) {
        __m512bh kb[CM / 2];
        for (int64_t j = 0; j < chunks / 2; ++j) kb[j] = (__m512bh)_mm512_loadu_si512(k + c * D + j * 2 * LANES);
        for (int64_t g = 0; g < G; ++g) {
          __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g][0], kb[0]);
          for (int64_t j = 1; j < chunks / 2; ++j) dot = _mm512_dpbf16_ps(dot, qb[g][j], kb[j]);
          dots[g][l] = (fvec)dot;
        }
        continue;
      }
#endif
      fvec kf[CM];
      for (int64_t j = 0; j < chunks; ++j) kf[j] = load_bf16(k + c * D + j * LANES);
      for (int64_t g = 0; g < G; ++g) {
        fvec dot = qf[g][0] * kf[0];
        for (int64_t j = 1; j < chunks; ++j) dot += qf[g][j] * kf[j];
        dots[g][l] = dot;
      }
    }
    ivec live;
    for (int64_t l = 0; l < LANES; ++l) live[l] = b * LANES + l < C && mask[b * LANES + l] ? -1 : 0;
    for (int64_t g = 0; g < G; ++g) {
      const fvec s = live ? lane_sums(dots[g]) * score_scale : splat(-std::numeric_limits<float>::infinity());
      std::memcpy(&scores[(g * blocks + b) * LANES], &s, sizeof(s));
      best[g] = best[g] > s ? best[g] : s;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t l = 0; l < LANES; ++l) top = std::max(top, best[g][l]);
    for (int64_t b = 0; b < blocks; ++b) {
      fvec s;
      std::memcpy(&s, &scores[(g * blocks + b) * LANES], sizeof(s));
      const fvec p = exp_nonpositive(s - top);
      std::memcpy(&scores[(g * blocks + b) * LANES], &p, sizeof(p));
    }
    // The probabilities' sum, each in the lane of its key's rank among the seen keys (not of its slot): a tree row
    // whose ancestors sit among masked rows then sums exactly as the AR step that sees them side by side.
    // Over the mask's leading run of seen keys (the committed context) a key's rank is its slot: whole blocks of it
    // add as vectors, lane by lane in the same order.
    const float* sg = &scores[g * blocks * LANES];
    fvec ranked_blocks = {};
    for (int64_t b = 0; b < dense / LANES; ++b) {
      fvec p;
      std::memcpy(&p, sg + b * LANES, sizeof(p));
      ranked_blocks += p;
    }
    float ranked[LANES];
    std::memcpy(ranked, &ranked_blocks, sizeof(ranked));
    for (int64_t c = dense / LANES * LANES, n = c; c < C; ++c)
      if (mask[c]) ranked[n++ % LANES] += sg[c];
    fvec one[LANES] = {};
    std::memcpy(&one[0], ranked, sizeof(ranked));
    sums[g] = splat(lane_sums(one)[0]);
  }
  // With a head size compiled in, a value row's 2 * LANES bf16 channels become two vectors with one operation each:
  // the even channels (shifted up) and the odd ones (masked); acc[g][2i] and acc[g][2i + 1] then hold the even and
  // odd channels of 2 * LANES * i onward (the same products in the same order, channels placed apart).
  constexpr bool PAIRED = CT != 0 && CT % 2 == 0;
  for (int64_t c = 0; c < C; ++c) {
    if (!mask[c]) continue;
    fvec vf[CM];
    if constexpr (PAIRED) {
      for (int64_t j = 0; j < chunks; j += 2) {
        uvec raw;
        std::memcpy(&raw, v + c * D + j * LANES, sizeof(raw));
        const uvec even = raw << 16, odd = raw & 0xFFFF0000u;
        std::memcpy(&vf[j], &even, sizeof(fvec));
        std::memcpy(&vf[j + 1], &odd, sizeof(fvec));
      }
    } else {
      for (int64_t j = 0; j < chunks; ++j) vf[j] = load_bf16(v + c * D + j * LANES);
    }
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * blocks * LANES + c];
      for (int64_t j = 0; j < chunks; ++j) acc[g][j] += p * vf[j];
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float o[LANES];
    for (int64_t j = 0; j < chunks; ++j) {
      const fvec r = acc[g][j] / sums[g];
      std::memcpy(o, &r, sizeof(o));
      for (int64_t l = 0; l < LANES; ++l) {
        const int64_t channel = PAIRED ? (j - j % 2) * LANES + 2 * l + j % 2 : j * LANES + l;
        out[g * D + channel] = at::BFloat16(o[l]);
      }
    }
  }
}

using AttendFn = void (*)(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*, const bool*, int64_t,
                          int64_t, int64_t, float, at::BFloat16*, std::vector<float>&);

template <int64_t CT>
AttendFn attend_for_group(int64_t G) {
  switch (G) {
    case 1: return attend<1, CT>;
    case 2: return attend<2, CT>;
    case 3: return attend<3, CT>;
    case 4: return attend<4, CT>;
    case 5: return attend<5, CT>;
    case 6: return attend<6, CT>;
    case 7: return attend<7, CT>;
    case 8: return attend<8, CT>;
    default: return attend<0, 0>;
  }
}

// Head dimensions 64 and 128 (4 or 8 registers a head with AVX-512, 8 or 16 with AVX2) and up to 8 query heads per
// key/value head compiled for their sizes; others at run time.
AttendFn attend_for(int64_t G, int64_t chunks) {
  switch (chunks * LANES) {
    case 64: return attend_for_group<64 / LANES>(G);
    case 128: return attend_for_group<128 / LANES>(G);
    default: return attend<0, 0>;
  }
}

at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_store,
                         at::Tensor& v_store, const at::Tensor& slots, const at::Tensor& write_rows,
                         const at::Tensor& mask) {
  TORCH_CHECK(q.dim() == 3 && k_store.dim() == 4 && v_store.sizes() == k_store.sizes(),
              "row_attention: q [R, H, D], k/v stores [slots, KV, capacity, D]");
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), KV = k_store.size(1), CAP = k_store.size(2);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_store.scalar_type() == at::kBFloat16 &&
                  v_store.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16, "row_attention: bfloat16 tensors");
  TORCH_CHECK(D % LANES == 0 && D <= LANES * MAX_CHUNKS && k_store.size(3) == D && H % KV == 0 &&
                  H / KV <= MAX_GROUP, "row_attention: head sizes");
  TORCH_CHECK(k.numel() == R * KV * D && v.numel() == R * KV * D, "row_attention: k, v [R, KV, D]");
  TORCH_CHECK(k_store.is_contiguous() && v_store.is_contiguous(), "row_attention: contiguous stores");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 2 && mask.size(0) == R && mask.size(1) <= CAP,
              "row_attention: mask [R, C <= capacity] bool");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == R && write_rows.scalar_type() == at::kLong &&
                  write_rows.numel() == R, "row_attention: slots, write_rows [R] int64");
  const int64_t C = mask.size(1), G = H / KV, S = k_store.size(0);
  const at::Tensor sc = slots.contiguous(), wc = write_rows.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const int64_t *slot = sc.data_ptr<int64_t>(), *row = wc.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(slot[r] >= 0 && slot[r] < S, "row_attention: slot out of range");
    TORCH_CHECK(row[r] >= 0 && row[r] < CAP, "row_attention: write row out of range");
    for (int64_t kv = 0; kv < KV; ++kv) {
      const int64_t to = ((slot[r] * KV + kv) * CAP + row[r]) * D, from = (r * KV + kv) * D;
      std::memcpy(k_store.data_ptr<at::BFloat16>() + to, kc.data_ptr<at::BFloat16>() + from, D * 2);
      std::memcpy(v_store.data_ptr<at::BFloat16>() + to, vc.data_ptr<at::BFloat16>() + from, D * 2);
    }
  }
  const at::Tensor qc = q.contiguous(), mc = mask.contiguous();
  at::Tensor out = at::empty({R, H, D}, q.options());
  const at::BFloat16 *qp = qc.data_ptr<at::BFloat16>(), *kp = k_store.data_ptr<at::BFloat16>(),
                     *vp = v_store.data_ptr<at::BFloat16>();
  const bool* mp = mc.data_ptr<bool>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const AttendFn attend_one = attend_for(G, D / LANES);
  at::parallel_for(0, R * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / KV, kv = i % KV;
      const int64_t base = (slot[r] * KV + kv) * CAP * D;
      attend_one(qp + (r * H + kv * G) * D, kp + base, vp + base, mp + r * C, C, G, D, scale,
                 op + (r * H + kv * G) * D, scores);
    }
  });
  return out;
}

}  // namespace

// Which implementation it was built with (gguf_matmul.cpp's kernel_isa names it too).
const char* row_attention_isa() { return HAVE_BF16_DOT ? "avx512-bf16" : LANES == 16 ? "avx512f" : "avx2"; }

TORCH_LIBRARY_FRAGMENT(dspark, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_store, Tensor(b!) v_store, Tensor slots, "
        "Tensor write_rows, Tensor mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(dspark, CPU, m) { m.impl("row_attention", &row_attention); }
