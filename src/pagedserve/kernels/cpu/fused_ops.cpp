// Fused elementwise operations of the decoder layer on CPU, each one pass over its rows instead of
// the 5-10 separate torch ops (and as many passes over memory and dispatches) of the eager code:
//
//   add_rms_norm   residual += x; x = weight * rms_norm(residual)         (both in place)
//   rms_norm       out = weight * rms_norm(x)
//   silu_and_mul   out = silu(gate) * up for gate_up = [gate | up]
//   gelu_tanh_and_mul  the same with torch's tanh GELU (Gemma)
//   rotary_qkv     split a fused qkv projection into q, k, v (optionally RMS-normalising each head
//                  of q and k, Qwen3), rotating q and k by their positions (neox halves)
//   store_kv       key_cache[slot] = k, value_cache[slot] = v for fp32 and bf16 caches
//
// Numerics follow the pure-torch code they replace (core/layers, kernels/reference), which
// follows Hugging Face: activations in the model dtype (fp32 or bf16), reductions in fp32, and for
// bf16 the result of every torch op rounded to bf16 where torch rounds it, so bf16 outputs equal the
// reference's but for the order of the fp32 sum in the norm and exp's last bits in silu and GELU.
// Rows are split across threads with at::parallel_for.

#include <ATen/Parallel.h>

#include <vector>

#include "activations.h"
#include "ops.h"
#include "vec.h"
#include "vec_avx2.h"

namespace pagedserve {
namespace {

// A row of values in fp32 or bf16, read and written as fp32: 32 values as two vectors in an order
// of the type's choosing (get32 / put32: elementwise loops, or sums whose order may change), 16
// lanes in order, or one value at a time.
template <typename T>
struct Io;

template <>
struct Io<float> {
  static PAGEDSERVE_INLINE float get(const float* p, int64_t i) { return p[i]; }
  static PAGEDSERVE_INLINE void put(float* p, int64_t i, float v) { p[i] = v; }
  static PAGEDSERVE_INLINE float round(float v) { return v; }
  static PAGEDSERVE_INLINE v16sf get16(const float* p, int64_t i) { return loadv<v16sf>(p + i); }
  static PAGEDSERVE_INLINE void put16(float* p, int64_t i, v16sf v) { storev(p + i, v); }
  static PAGEDSERVE_INLINE v16sf round16(v16sf v) { return v; }
  static PAGEDSERVE_INLINE void get32(const float* p, int64_t i, v16sf& a, v16sf& b) {
    a = loadv<v16sf>(p + i);
    b = loadv<v16sf>(p + i + 16);
  }
  static PAGEDSERVE_INLINE void put32(float* p, int64_t i, v16sf a, v16sf b) {
    storev(p + i, a);
    storev(p + i + 16, b);
  }
};

template <>
struct Io<uint16_t> {
  static PAGEDSERVE_INLINE float get(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }
  static PAGEDSERVE_INLINE void put(uint16_t* p, int64_t i, float v) { p[i] = float_to_bf16(v); }
  // What a torch op with a bf16 result does to its fp32 value.
  static PAGEDSERVE_INLINE float round(float v) { return bf16_to_float(float_to_bf16(v)); }
  static PAGEDSERVE_INLINE v16sf get16(const uint16_t* p, int64_t i) { return bf16x16_to_float(p + i); }
  static PAGEDSERVE_INLINE void put16(uint16_t* p, int64_t i, v16sf v) { float_to_bf16x16(v, p + i); }
  static PAGEDSERVE_INLINE v16sf round16(v16sf v) { return round_to_bf16x16(v); }
  // One 64-byte load split into the even values (a: x << 16) and the odd ones (b: the top halves),
  // both exact, and back: rounded, a's into the low halves and b's into the high ones. Two
  // instructions each way where the in-order get16 / put16 need a widening and a narrowing
  // shuffle (measured: bf16 silu_and_mul at 56 rows of 1536 was 2.4x its fp32 time).
  static PAGEDSERVE_INLINE void get32(const uint16_t* p, int64_t i, v16sf& a, v16sf& b) {
    bf16x32_to_float_even_odd(p + i, a, b);
  }
  static PAGEDSERVE_INLINE void put32(uint16_t* p, int64_t i, v16sf a, v16sf b) {
    const v16sf ra = round_to_bf16x16(a), rb = round_to_bf16x16(b);
    storev(p + i, (reinterpret_cast<const v16su&>(ra) >> 16) | reinterpret_cast<const v16su&>(rb));
  }
};

// rms_norm of one row as kernels/reference/layers.py computes it: h = x.float(); h * rsqrt(mean(h^2) +
// eps), rounded to the model dtype, times the weight (a model-dtype multiply). Loops run 16 lanes
// at a time, then one at a time over the tail.
template <typename T>
PAGEDSERVE_INLINE void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  v16sf ss16 = v16sf{};
  float ss = 0.f;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    v16sf a, b;
    Io<T>::get32(x, i, a, b);
    ss16 += a * a + b * b;
  }
  for (; i + 16 <= n; i += 16) {
    const v16sf h = Io<T>::get16(x, i);
    ss16 += h * h;
  }
  for (; i < n; ++i) ss += Io<T>::get(x, i) * Io<T>::get(x, i);
  const float inv = 1.f / std::sqrt((hsum16(ss16) + ss) / static_cast<float>(n) + eps);
  for (i = 0; i + 32 <= n; i += 32) {
    v16sf xa, xb, wa, wb;
    Io<T>::get32(x, i, xa, xb);
    Io<T>::get32(w, i, wa, wb);
    Io<T>::put32(out, i, wa * Io<T>::round16(xa * inv), wb * Io<T>::round16(xb * inv));
  }
  for (; i + 16 <= n; i += 16) {
    Io<T>::put16(out, i, Io<T>::get16(w, i) * Io<T>::round16(Io<T>::get16(x, i) * inv));
  }
  for (; i < n; ++i) Io<T>::put(out, i, Io<T>::get(w, i) * Io<T>::round(Io<T>::get(x, i) * inv));
}

template <typename T>
PAGEDSERVE_INLINE void add_rms_norm_range(T* x, T* residual, const T* w, int64_t r0, int64_t r1, int64_t n, float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    T* xr = x + r * n;
    T* res = residual + r * n;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
      v16sf ra, rb, xa, xb;
      Io<T>::get32(res, i, ra, rb);
      Io<T>::get32(xr, i, xa, xb);
      Io<T>::put32(res, i, ra + xa, rb + xb);
    }
    for (; i + 16 <= n; i += 16) Io<T>::put16(res, i, Io<T>::get16(res, i) + Io<T>::get16(xr, i));
    for (; i < n; ++i) Io<T>::put(res, i, Io<T>::get(res, i) + Io<T>::get(xr, i));
    norm_row(res, w, xr, n, eps);
  }
}

template <typename T>
PAGEDSERVE_INLINE void rms_norm_range(const T* x, const T* w, T* out, int64_t r0, int64_t r1, int64_t n, float eps) {
  for (int64_t r = r0; r < r1; ++r) norm_row(x + r * n, w, out + r * n, n, eps);
}

// act(g), rounded to the model dtype, times up (rounded again): F.silu(gate) * up, or F.gelu's.
template <class Act, typename T>
PAGEDSERVE_INLINE void act_and_mul_range(const T* gate_up, T* out, int64_t r0, int64_t r1, int64_t n) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = gate_up + r * 2 * n;
    const T* u = g + n;
    T* o = out + r * n;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
      v16sf ga, gb, ua, ub;
      Io<T>::get32(g, i, ga, gb);
      Io<T>::get32(u, i, ua, ub);
      const v16sf sa = Io<T>::round16(Act::vec(ga)), sb = Io<T>::round16(Act::vec(gb));
      Io<T>::put32(o, i, sa * ua, sb * ub);
    }
    for (; i + 16 <= n; i += 16) {
      Io<T>::put16(o, i, Io<T>::round16(Act::vec(Io<T>::get16(g, i))) * Io<T>::get16(u, i));
    }
    for (; i < n; ++i) Io<T>::put(o, i, Io<T>::round(Act::one(Io<T>::get(g, i))) * Io<T>::get(u, i));
  }
}

#ifdef PAGEDSERVE_HAVE_F8X2
// act_and_mul_range<Silu> for fp32, 8 lanes at a time: the same operations on every value (v8sf, not
// v16sf: vec_avx2.h says why v16sf is slow in an AVX2 build).
__attribute__((target("arch=x86-64-v3"))) void silu_and_mul_fp32_avx2(const float* gate_up, float* out, int64_t r0,
                                                                      int64_t r1, int64_t n) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* g = gate_up + r * 2 * n;
    const float* u = g + n;
    float* o = out + r * n;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const v8sf x = loadv<v8sf>(g + i);
      storev(o + i, x / (1.f + exp_lanes<v8sf, v8si>(-x)) * loadv<v8sf>(u + i));
    }
    for (; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
}
#endif

// One head of q or k: optional per-head RMS norm (weight wn, Qwen3), then the neox rotation with
// this position's cos/sin (model dtype, head_dim values each), as core/layers/rotary.apply_rotary:
// x * cos + rotate_half(x) * sin, each product and the sum a model-dtype op.
template <typename T>
PAGEDSERVE_INLINE void rotate_head(const T* in, T* out, const T* cos, const T* sin, const T* wn, int64_t D, float eps,
                                   T* tmp) {
  const T* x = in;
  if (wn != nullptr) {
    norm_row(in, wn, tmp, D, eps);
    x = tmp;
  }
  const int64_t half = D / 2;
  const T* x2 = x + half;
  const T* cos2 = cos + half;
  const T* sin2 = sin + half;
  int64_t i = 0;
  for (; i + 32 <= half; i += 32) {
    v16sf a[2], b[2], c[2], sn[2], c2[2], s2[2];
    Io<T>::get32(x, i, a[0], a[1]);
    Io<T>::get32(x2, i, b[0], b[1]);
    Io<T>::get32(cos, i, c[0], c[1]);
    Io<T>::get32(sin, i, sn[0], sn[1]);
    Io<T>::get32(cos2, i, c2[0], c2[1]);
    Io<T>::get32(sin2, i, s2[0], s2[1]);
    v16sf lo[2], hi[2];
    for (int j = 0; j < 2; ++j) {
      lo[j] = Io<T>::round16(a[j] * c[j]) - Io<T>::round16(b[j] * sn[j]);
      hi[j] = Io<T>::round16(b[j] * c2[j]) + Io<T>::round16(a[j] * s2[j]);
    }
    Io<T>::put32(out, i, lo[0], lo[1]);
    Io<T>::put32(out + half, i, hi[0], hi[1]);
  }
  for (; i + 16 <= half; i += 16) {
    const v16sf a = Io<T>::get16(x, i), b = Io<T>::get16(x2, i);
    Io<T>::put16(out, i, Io<T>::round16(a * Io<T>::get16(cos, i)) - Io<T>::round16(b * Io<T>::get16(sin, i)));
    Io<T>::put16(out + half, i, Io<T>::round16(b * Io<T>::get16(cos2, i)) + Io<T>::round16(a * Io<T>::get16(sin2, i)));
  }
  for (; i < half; ++i) {
    const float a = Io<T>::get(x, i), b = Io<T>::get(x2, i);
    Io<T>::put(out, i, Io<T>::round(a * Io<T>::get(cos, i)) - Io<T>::round(b * Io<T>::get(sin, i)));
    Io<T>::put(out + half, i, Io<T>::round(b * Io<T>::get(cos2, i)) + Io<T>::round(a * Io<T>::get(sin2, i)));
  }
}

template <typename T>
PAGEDSERVE_INLINE void rotary_qkv_range(const T* qkv, const int64_t* positions, const T* cos, const T* sin,
                                        const T* q_norm, const T* k_norm, T* q, T* k, T* v, int64_t r0, int64_t r1,
                                        int64_t H, int64_t KV, int64_t D, float eps) {
  const int64_t width = (H + 2 * KV) * D;
  std::vector<T> tmp(D);  // a normalised head
  for (int64_t r = r0; r < r1; ++r) {
    const T* row = qkv + r * width;
    const T* c = cos + positions[r] * D;
    const T* s = sin + positions[r] * D;
    for (int64_t h = 0; h < H; ++h) rotate_head(row + h * D, q + (r * H + h) * D, c, s, q_norm, D, eps, tmp.data());
    for (int64_t h = 0; h < KV; ++h) rotate_head(row + (H + h) * D, k + (r * KV + h) * D, c, s, k_norm, D, eps, tmp.data());
    std::memcpy(v + r * KV * D, row + (H + KV) * D, KV * D * sizeof(T));
  }
}

// Rows of the activation type A into cache slots of type C (bf16: round to nearest even, as
// Tensor.to does).
template <typename A, typename C>
PAGEDSERVE_INLINE void store_range(const A* src, C* cache, const int64_t* slots, int64_t r0, int64_t r1, int64_t width) {
  for (int64_t r = r0; r < r1; ++r) {
    const A* in = src + r * width;
    C* out = cache + slots[r] * width;
    if constexpr (std::is_same_v<A, C>) {
      std::memcpy(out, in, width * sizeof(C));
    } else {
      int64_t i = 0;
      for (; i + 16 <= width; i += 16) Io<C>::put16(out, i, Io<A>::get16(in, i));
      for (; i < width; ++i) Io<C>::put(out, i, Io<A>::get(in, i));
    }
  }
}

// One ISA-cloned entry per (operation, dtype); the threads split rows outside, so each thread
// runs the clone its CPU picked (a lambda inside a cloned function would not be cloned).
PAGEDSERVE_MULTIVERSION void add_rms_norm_bf16(uint16_t* x, uint16_t* res, const uint16_t* w, int64_t r0, int64_t r1, int64_t n, float eps) { add_rms_norm_range(x, res, w, r0, r1, n, eps); }
PAGEDSERVE_MULTIVERSION void add_rms_norm_fp32(float* x, float* res, const float* w, int64_t r0, int64_t r1, int64_t n, float eps) { add_rms_norm_range(x, res, w, r0, r1, n, eps); }
PAGEDSERVE_MULTIVERSION void rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t r0, int64_t r1, int64_t n, float eps) { rms_norm_range(x, w, out, r0, r1, n, eps); }
PAGEDSERVE_MULTIVERSION void rms_norm_fp32(const float* x, const float* w, float* out, int64_t r0, int64_t r1, int64_t n, float eps) { rms_norm_range(x, w, out, r0, r1, n, eps); }
PAGEDSERVE_MULTIVERSION void silu_and_mul_bf16(const uint16_t* gu, uint16_t* out, int64_t r0, int64_t r1, int64_t n) { act_and_mul_range<Silu>(gu, out, r0, r1, n); }
PAGEDSERVE_MULTIVERSION void silu_and_mul_fp32(const float* gu, float* out, int64_t r0, int64_t r1, int64_t n) { act_and_mul_range<Silu>(gu, out, r0, r1, n); }
PAGEDSERVE_MULTIVERSION void gelu_tanh_and_mul_bf16(const uint16_t* gu, uint16_t* out, int64_t r0, int64_t r1, int64_t n) { act_and_mul_range<GeluTanh>(gu, out, r0, r1, n); }
PAGEDSERVE_MULTIVERSION void gelu_tanh_and_mul_fp32(const float* gu, float* out, int64_t r0, int64_t r1, int64_t n) { act_and_mul_range<GeluTanh>(gu, out, r0, r1, n); }
PAGEDSERVE_MULTIVERSION void rotary_qkv_bf16(const uint16_t* qkv, const int64_t* pos, const uint16_t* c, const uint16_t* s, const uint16_t* qn, const uint16_t* kn, uint16_t* q, uint16_t* k, uint16_t* v, int64_t r0, int64_t r1, int64_t H, int64_t KV, int64_t D, float eps) { rotary_qkv_range(qkv, pos, c, s, qn, kn, q, k, v, r0, r1, H, KV, D, eps); }
PAGEDSERVE_MULTIVERSION void rotary_qkv_fp32(const float* qkv, const int64_t* pos, const float* c, const float* s, const float* qn, const float* kn, float* q, float* k, float* v, int64_t r0, int64_t r1, int64_t H, int64_t KV, int64_t D, float eps) { rotary_qkv_range(qkv, pos, c, s, qn, kn, q, k, v, r0, r1, H, KV, D, eps); }
PAGEDSERVE_MULTIVERSION void store_bf16_bf16(const uint16_t* a, uint16_t* c, const int64_t* s, int64_t r0, int64_t r1, int64_t w) { store_range(a, c, s, r0, r1, w); }
PAGEDSERVE_MULTIVERSION void store_bf16_fp32(const uint16_t* a, float* c, const int64_t* s, int64_t r0, int64_t r1, int64_t w) { store_range(a, c, s, r0, r1, w); }
PAGEDSERVE_MULTIVERSION void store_fp32_bf16(const float* a, uint16_t* c, const int64_t* s, int64_t r0, int64_t r1, int64_t w) { store_range(a, c, s, r0, r1, w); }
PAGEDSERVE_MULTIVERSION void store_fp32_fp32(const float* a, float* c, const int64_t* s, int64_t r0, int64_t r1, int64_t w) { store_range(a, c, s, r0, r1, w); }

bool is_bf16(const torch::Tensor& t) { return t.scalar_type() == torch::kBFloat16; }

void check_activation(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 || is_bf16(t), name, " must be float32 or bfloat16, got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_same(const torch::Tensor& a, const torch::Tensor& b, const char* name) {
  TORCH_CHECK(b.scalar_type() == a.scalar_type(), name, " has dtype ", b.scalar_type(), ", expected ", a.scalar_type());
  TORCH_CHECK(b.is_contiguous(), name, " must be contiguous");
}

template <typename T>
T* ptr(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// Whether every value of a contiguous int64 tensor lies in [0, end): a plain loop, where
// torch::aminmax and two .item() reads were a few microseconds of dispatch per call, twice per
// layer and step (the rows are one per token; the loop costs nanoseconds).
bool all_in_range(const torch::Tensor& indices, int64_t end) {
  const int64_t* v = indices.data_ptr<int64_t>();
  bool ok = true;
  for (int64_t i = 0, n = indices.numel(); i < n; ++i) ok &= v[i] >= 0 && v[i] < end;
  return ok;
}

// A gated activation's checks of gate_up = [gate | up] ([rows, 2 n]) and its output [rows, n].
torch::Tensor gated_output(const torch::Tensor& gate_up, const char* op) {
  check_activation(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, op, ": gate_up [rows, 2 * intermediate]");
  return torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
}

// Rows split across threads in runs of at least `grain`.
template <typename F>
void for_rows(int64_t rows, int64_t grain, const F& f) {
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) { f(r0, r1); });
}

}  // namespace

void add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_activation(x, "x");
  check_same(x, residual, "residual");
  check_same(x, weight, "weight");
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1),
              "add_rms_norm: x and residual [rows, hidden], weight [hidden]");
  const int64_t n = x.size(1);
  for_rows(x.size(0), 16, [&](int64_t r0, int64_t r1) {
    if (is_bf16(x)) add_rms_norm_bf16(ptr<uint16_t>(x), ptr<uint16_t>(residual), ptr<uint16_t>(weight), r0, r1, n, eps);
    else add_rms_norm_fp32(ptr<float>(x), ptr<float>(residual), ptr<float>(weight), r0, r1, n, eps);
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_activation(x, "x");
  check_same(x, weight, "weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "rms_norm: x [rows, hidden], weight [hidden]");
  torch::Tensor out = torch::empty_like(x);
  const int64_t n = x.size(1);
  for_rows(x.size(0), 16, [&](int64_t r0, int64_t r1) {
    if (is_bf16(x)) rms_norm_bf16(ptr<uint16_t>(x), ptr<uint16_t>(weight), ptr<uint16_t>(out), r0, r1, n, eps);
    else rms_norm_fp32(ptr<float>(x), ptr<float>(weight), ptr<float>(out), r0, r1, n, eps);
  });
  return out;
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  torch::Tensor out = gated_output(gate_up, "silu_and_mul");
  const int64_t n = out.size(1);
  for_rows(out.size(0), 8, [&](int64_t r0, int64_t r1) {
    if (is_bf16(gate_up)) silu_and_mul_bf16(ptr<uint16_t>(gate_up), ptr<uint16_t>(out), r0, r1, n);
#ifdef PAGEDSERVE_HAVE_F8X2
    else if (use_avx2_builds()) silu_and_mul_fp32_avx2(ptr<float>(gate_up), ptr<float>(out), r0, r1, n);
#endif
    else silu_and_mul_fp32(ptr<float>(gate_up), ptr<float>(out), r0, r1, n);
  });
  return out;
}

torch::Tensor gelu_tanh_and_mul(torch::Tensor gate_up) {
  torch::Tensor out = gated_output(gate_up, "gelu_tanh_and_mul");
  const int64_t n = out.size(1);
  for_rows(out.size(0), 8, [&](int64_t r0, int64_t r1) {
    if (is_bf16(gate_up)) gelu_tanh_and_mul_bf16(ptr<uint16_t>(gate_up), ptr<uint16_t>(out), r0, r1, n);
    else gelu_tanh_and_mul_fp32(ptr<float>(gate_up), ptr<float>(out), r0, r1, n);
  });
  return out;
}

std::vector<torch::Tensor> rotary_qkv(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos,
                                      torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads,
                                      c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm,
                                      double eps) {
  check_activation(qkv, "qkv");
  check_same(qkv, cos, "cos");
  check_same(qkv, sin, "sin");
  TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.is_contiguous() && positions.dim() == 1 &&
                  positions.size(0) == qkv.size(0),
              "positions must be contiguous int64 [rows]");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(1) % 2 == 0, "cos/sin must be [max_position, head_dim]");
  const int64_t D = cos.size(1), rows = qkv.size(0), H = num_heads, KV = num_kv_heads;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (H + 2 * KV) * D, "qkv must be [rows, (num_heads + 2 * num_kv_heads) * head_dim]");
  TORCH_CHECK(all_in_range(positions, cos.size(0)), "a position is outside the cos/sin table");
  const bool norms = q_norm.has_value();
  TORCH_CHECK(norms == k_norm.has_value(), "q_norm and k_norm come together");
  if (norms) {
    check_same(qkv, *q_norm, "q_norm");
    check_same(qkv, *k_norm, "k_norm");
    TORCH_CHECK(q_norm->numel() == D && k_norm->numel() == D, "q_norm/k_norm must have head_dim values");
  }
  torch::Tensor q = torch::empty({rows, H, D}, qkv.options());
  torch::Tensor k = torch::empty({rows, KV, D}, qkv.options());
  torch::Tensor v = torch::empty({rows, KV, D}, qkv.options());
  const int64_t* pos = positions.data_ptr<int64_t>();
  for_rows(rows, 8, [&](int64_t r0, int64_t r1) {
    if (is_bf16(qkv)) {
      rotary_qkv_bf16(ptr<uint16_t>(qkv), pos, ptr<uint16_t>(cos), ptr<uint16_t>(sin),
                      norms ? ptr<uint16_t>(*q_norm) : nullptr, norms ? ptr<uint16_t>(*k_norm) : nullptr,
                      ptr<uint16_t>(q), ptr<uint16_t>(k), ptr<uint16_t>(v), r0, r1, H, KV, D, eps);
    } else {
      rotary_qkv_fp32(ptr<float>(qkv), pos, ptr<float>(cos), ptr<float>(sin),
                      norms ? ptr<float>(*q_norm) : nullptr, norms ? ptr<float>(*k_norm) : nullptr,
                      ptr<float>(q), ptr<float>(k), ptr<float>(v), r0, r1, H, KV, D, eps);
    }
  });
  return {q, k, v};
}

void store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
              torch::Tensor slot_mapping) {
  check_activation(key, "key");
  check_same(key, value, "value");
  check_activation(key_cache, "key_cache");
  check_same(key_cache, value_cache, "value_cache");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.is_contiguous() && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0),
              "slot_mapping must be contiguous int64 [rows]");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key_cache.dim() == 4 &&
                  key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2) &&
                  value_cache.sizes() == key_cache.sizes(),
              "store_kv: key/value [rows, num_kv_heads, head_dim], caches [num_blocks, block_size, num_kv_heads, head_dim]");
  const int64_t rows = key.size(0), width = key.size(1) * key.size(2);
  TORCH_CHECK(all_in_range(slot_mapping, key_cache.size(0) * key_cache.size(1)), "a slot is outside the cache");
  const int64_t* s = slot_mapping.data_ptr<int64_t>();
  const bool act16 = is_bf16(key), cache16 = is_bf16(key_cache);
  for (const auto& [src, dst] : {std::pair(key, key_cache), std::pair(value, value_cache)}) {
    for_rows(rows, 64, [&](int64_t r0, int64_t r1) {
      if (act16 && cache16) store_bf16_bf16(ptr<uint16_t>(src), ptr<uint16_t>(dst), s, r0, r1, width);
      else if (act16) store_bf16_fp32(ptr<uint16_t>(src), ptr<float>(dst), s, r0, r1, width);
      else if (cache16) store_fp32_bf16(ptr<float>(src), ptr<uint16_t>(dst), s, r0, r1, width);
      else store_fp32_fp32(ptr<float>(src), ptr<float>(dst), s, r0, r1, width);
    });
  }
}

}  // namespace pagedserve
