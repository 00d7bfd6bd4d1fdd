// Attention for the compiled step's rows (runtime/compiled_step.py): first every row's new key and value are written
// into its slot of the layer's K/V store (in place: as a mutation the graph's own index writes made inductor copy
// the store), then each row's query heads attend to the first C rows of its slot, masked by its mask row, in
// float32. A row is computed the same way whatever the other rows (batch invariance); keys are read in place.
//
// o[r, h] = sum_c softmax_c(q[r, h] . k[slot[r], h / G, c] / sqrt(D) | mask[r, c]) v[slot[r], h / G, c], G = H / KV.
// Built with runtime/gguf_matmul.cpp by runtime/cpu_kernels.py, registered as torch.ops.dspark.row_attention.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t LANES = 16;
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline f32x16 load_bf16(const at::BFloat16* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;  // bf16 is float32's upper half
  f32x16 f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

inline float lane_sum(f32x16 v) {  // a fixed tree: the same for every row
  float s[LANES];
  std::memcpy(s, &v, sizeof(s));
  for (int64_t width = LANES / 2; width > 0; width /= 2)
    for (int64_t i = 0; i < width; ++i) s[i] += s[i + width];
  return s[0];
}

// One row and one key/value head: its G query heads at once (each key and value read once for them).
void attend(const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v, const bool* mask, int64_t C,
            int64_t G, int64_t D, float scale, at::BFloat16* out, std::vector<float>& scores) {
  const int64_t chunks = D / LANES;
  std::vector<f32x16> qf(G * chunks), acc(G * chunks);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < chunks; ++j) qf[g * chunks + j] = load_bf16(q + g * D + j * LANES);
  scores.assign(G * C, -std::numeric_limits<float>::infinity());
  std::vector<float> best(G, -std::numeric_limits<float>::infinity()), total(G, 0.f);
  for (int64_t c = 0; c < C; ++c) {
    if (!mask[c]) continue;
    for (int64_t g = 0; g < G; ++g) {
      f32x16 dot = {};
      for (int64_t j = 0; j < chunks; ++j) dot += qf[g * chunks + j] * load_bf16(k + c * D + j * LANES);
      const float s = lane_sum(dot) * scale;
      scores[g * C + c] = s;
      best[g] = std::max(best[g], s);
    }
  }
  for (auto& a : acc) a = f32x16{};
  for (int64_t c = 0; c < C; ++c) {
    if (!mask[c]) continue;
    for (int64_t g = 0; g < G; ++g) {
      const float p = std::exp(scores[g * C + c] - best[g]);
      total[g] += p;
      for (int64_t j = 0; j < chunks; ++j) acc[g * chunks + j] += p * load_bf16(v + c * D + j * LANES);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float o[LANES];
    for (int64_t j = 0; j < chunks; ++j) {
      const f32x16 r = acc[g * chunks + j] / total[g];
      std::memcpy(o, &r, sizeof(o));
      for (int64_t l = 0; l < LANES; ++l) out[g * D + j * LANES + l] = at::BFloat16(o[l]);
    }
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
  TORCH_CHECK(D % LANES == 0 && k_store.size(3) == D && H % KV == 0, "row_attention: head sizes");
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
  at::parallel_for(0, R * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / KV, kv = i % KV;
      const int64_t base = (slot[r] * KV + kv) * CAP * D;
      attend(qp + (r * H + kv * G) * D, kp + base, vp + base, mp + r * C, C, G, D, scale, op + (r * H + kv * G) * D,
             scores);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dspark, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_store, Tensor(b!) v_store, Tensor slots, "
        "Tensor write_rows, Tensor mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(dspark, CPU, m) { m.impl("row_attention", &row_attention); }
