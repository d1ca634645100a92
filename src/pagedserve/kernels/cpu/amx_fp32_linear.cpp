// fp32 linear layers on AMX's bf16 tile unit: y = x @ W^T (+ bias) over fp32_pack_weight's panels,
// for calls of many rows (prefill chunks), where simd_linear.cpp's fp32 FMAs are compute-bound.
//
// Each fp32 value v is split into three bf16 terms, v = hi + mid + lo + rest (hi = v rounded to
// bf16, mid = what is left rounded, lo = what is left then rounded; |rest| <= 2^-27 |v|), and each
// product x.w is taken as its six terms that matter, hi.hi + mid.hi + lo.hi + mid.mid + hi.mid +
// hi.lo, each exact in fp32 and added by tdpbf16ps into fp32 accumulators. What is left out (mid.lo,
// lo.mid, lo.lo and the rests) is at most 2^-25 |x.w| together, a quarter of fp32's unit roundoff:
// the error stays that of an fp32 dot product (tests/kernels/test_amx_fp32_linear.py holds each
// output to its bound and the error to within twice that of the FMAs' blocked sums; it came out
// 1.0-1.5x theirs and below MKL's sgemm). This is cuBLAS's BF16x9 fp32 emulation less its three
// smallest products. Six tile products take a 32 x 32 x 32 block 384 cycles of the tile unit where
// AVX-512's FMAs need 1,024 at their peak. Measured on a 2-core AMX Xeon, SmolLM2's four
// projections at 512 rows: 7.8 ms a layer against 11.2-12.1 on the FMAs; the 512-token fp32 prefill
// 1,690-1,770 tok/s against 1,090-1,190.
//
// Data. x is split once per call into 32-row blocks, each block's 32-wide K slices stored as
// three parts (hi, mid, lo) of two 16-row tiles: 6 KB a slice, contiguous, read in order. Each
// thread takes whole panels (32 output columns) and splits a panel's weights into a per-thread
// buffer (per slice: three parts of two 16-column tiles in the VNNI form tdpbf16ps takes for B)
// that stays in L2 while the row blocks of a chunk (~1.2 MB of split rows) pass over it; the next
// panel is split meanwhile (amx_panels). The weights are never stored split: resident memory is
// that of the fp32 weights, which decode reads through simd_linear.cpp. K is padded with zeros to a
// multiple of 32 and M to a multiple of 32 in the split copies only.
//
// Non-finite values. A call whose x holds an infinity or NaN runs on simd_linear.cpp's FMAs
// instead (inf times a weight's mid term of the other sign would add inf - inf); weights are taken
// to be finite, as a checkpoint's are (an infinite weight could give NaN where fp32 gives +-inf).

#include <ATen/Parallel.h>

#include <atomic>

#include "amx.h"
#include "fp32_gemm.h"
#include "ops.h"
#include "work_share.h"

namespace pagedserve {
namespace {

constexpr int64_t kPanel = fp32_gemm::kPanel;  // output columns per panel (two 16-column tiles)

#ifdef PAGEDSERVE_HAVE_AMX
using amx::kTileElems;
constexpr int64_t kRows = 32;   // rows of x per block (two 16-row tiles)
constexpr int64_t kSlice = 32;  // k values per tile row (32 bf16 = 64 bytes)
constexpr int64_t kParts = 3;   // hi, mid, lo
constexpr int64_t kSliceElems = kParts * 2 * kTileElems;  // one slice of a block or a panel, split

// 16 fp32 values rounded to bf16 (to nearest even), each in the low half of its 32-bit lane.
PAGEDSERVE_AMX inline __m512i to_bf16(__m512 v) {
  return _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

PAGEDSERVE_AMX inline __m512 widen(__m512i b) { return _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)); }

// v = hi + mid + lo, each in bf16 (low halves of 32-bit lanes); returns the lanes where hi is
// finite. Where it is not (v infinite or NaN, or beyond bf16's range) hi carries v alone.
PAGEDSERVE_AMX inline __mmask16 split3(__m512 v, __m512i& hi, __m512i& mid, __m512i& lo) {
  hi = to_bf16(v);
  const __m512i exponent = _mm512_set1_epi32(0x7f800000);
  const __mmask16 finite =
      _mm512_cmpneq_epi32_mask(_mm512_and_si512(_mm512_slli_epi32(hi, 16), exponent), exponent);
  const __m512 rest = _mm512_maskz_sub_ps(finite, v, widen(hi));
  mid = to_bf16(rest);
  lo = to_bf16(_mm512_sub_ps(rest, widen(mid)));
  return finite;
}

// 16 fp32 values from p, zeros past `valid` (0..16).
PAGEDSERVE_AMX inline __m512 load_upto(const float* p, int64_t valid) {
  if (valid >= 16) return _mm512_loadu_ps(p);
  if (valid <= 0) return _mm512_setzero_ps();
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << valid) - 1), p);
}

// Rows [r0, r0 + 32) of x [M, K] split into block `out`: slice s, part j, row r (0..31) at
// out + s * kSliceElems + j * 2 * kTileElems + r * 32 (a 16-row tile is 16 such rows); rows past M
// and k past K are zeros. Returns whether every value was finite.
PAGEDSERVE_AMX bool split_block(const float* x, int64_t M, int64_t K, int64_t r0, int64_t slices, uint16_t* out) {
  __mmask16 finite = 0xffff;
  for (int64_t s = 0; s < slices; ++s) {
    uint16_t* slice = out + s * kSliceElems;
    const int64_t k0 = s * kSlice;
    for (int64_t r = 0; r < kRows; ++r) {
      const bool row = r0 + r < M;
      const float* src = x + (r0 + r) * K + k0;
      __m512i parts[2][kParts];
      for (int h = 0; h < 2; ++h) {
        const __m512 v = row ? load_upto(src + 16 * h, K - k0 - 16 * h) : _mm512_setzero_ps();
        finite &= split3(v, parts[h][0], parts[h][1], parts[h][2]);
      }
      for (int j = 0; j < kParts; ++j) {
        uint16_t* dst = slice + j * 2 * kTileElems + r * kSlice;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(parts[0][j]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), _mm512_cvtepi32_epi16(parts[1][j]));
      }
    }
  }
  return finite == 0xffff;
}

// Part of one fp32 panel (K steps of 32 columns, fp32_gemm::Fp32Panel) split into `out`: units
// [u0, u1) of slices * 16, unit u being tile row r = u % 16 of slice s = u / 16. Slice s, part j,
// column half h is a B tile at out + s * kSliceElems + (j * 2 + h) * kTileElems whose row r holds,
// for columns c = 0..15, the pair (W[16 h + c][k0 + 2r], W[16 h + c][k0 + 2r + 1]).
PAGEDSERVE_AMX void split_panel(const float* panel, int64_t K, int64_t u0, int64_t u1, uint16_t* out) {
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t s = u / 16, r = u % 16, k = s * kSlice + 2 * r;
    for (int h = 0; h < 2; ++h) {
      __m512i even[kParts], odd[kParts];
      split3(k < K ? _mm512_loadu_ps(panel + k * kPanel + 16 * h) : _mm512_setzero_ps(), even[0], even[1], even[2]);
      split3(k + 1 < K ? _mm512_loadu_ps(panel + (k + 1) * kPanel + 16 * h) : _mm512_setzero_ps(), odd[0], odd[1],
             odd[2]);
      for (int j = 0; j < kParts; ++j) {
        const __m512i pair = _mm512_or_si512(even[j], _mm512_slli_epi32(odd[j], 16));
        _mm512_store_si512(out + s * kSliceElems + (j * 2 + h) * kTileElems + r * 32, pair);
      }
    }
  }
}

// c (32 x 32 fp32, row stride 32) = a split block times a split panel over `slices` slices: per
// slice the six products as 2 x 2 tile products, in an order that reloads as few tiles as it can
// (16 tile loads for 24 tile products). Tiles 0-3 accumulate, 4-5 hold one part of the panel's two
// column tiles, 6-7 one part of the block's two row tiles.
// after_slice(s) runs once slice s's products are issued: the vector units split the next panel
// while the tile unit works through them.
template <class AfterSlice>
PAGEDSERVE_AMX void block(const uint16_t* a, const uint16_t* b, int64_t slices, float* c, const AfterSlice& after_slice) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < slices; ++s) {
    const uint16_t* as = a + s * kSliceElems;
    const uint16_t* bs = b + s * kSliceElems;
    auto load_w = [bs](int part) {
      _tile_loadd(4, bs + part * 2 * kTileElems, 64);
      _tile_loadd(5, bs + part * 2 * kTileElems + kTileElems, 64);
    };
    auto load_x = [as](int part) {
      _tile_loadd(6, as + part * 2 * kTileElems, 64);
      _tile_loadd(7, as + part * 2 * kTileElems + kTileElems, 64);
    };
    auto multiply = [] {
      _tile_dpbf16ps(0, 6, 4);
      _tile_dpbf16ps(1, 6, 5);
      _tile_dpbf16ps(2, 7, 4);
      _tile_dpbf16ps(3, 7, 5);
    };
    load_w(0);  // w.hi times x.hi, x.mid, x.lo
    load_x(0);
    multiply();
    load_x(1);
    multiply();
    load_x(2);
    multiply();
    load_w(1);  // w.mid times x.mid, x.hi
    load_x(1);
    multiply();
    load_x(0);
    multiply();
    load_w(2);  // w.lo times x.hi
    multiply();
    after_slice(s);
  }
  _tile_stored(0, c, kPanel * 4);
  _tile_stored(1, c + 16, kPanel * 4);
  _tile_stored(2, c + 16 * kPanel, kPanel * 4);
  _tile_stored(3, c + 16 * kPanel + 16, kPanel * 4);
}

// Row blocks per chunk: as few chunks as keep a chunk's split rows within ~1.2 MB (in L2 with the
// split panel while every panel passes), of about equal size. Each chunk splits each panel again,
// which measured cheaper than reading the split rows from L3 (512 rows: K = 576 in 2 chunks, 1536 in 4).
inline int64_t chunk_blocks(int64_t blocks, int64_t slices) {
  constexpr int64_t kChunkBytes = 1200 * 1024;
  const int64_t most = std::max<int64_t>(1, kChunkBytes / (slices * kSliceElems * 2));
  const int64_t chunks = (blocks + most - 1) / most;
  return (blocks + chunks - 1) / chunks;
}

// Panels [p0, p1) of y [M, N] (row stride N) from x split at xs (split_block's blocks, in order),
// plus the bias. Pipelined: the steps (each panel, for each chunk of row blocks) alternate between
// two panel buffers; while a step's blocks compute, the next step's panel is split into the other
// buffer, a share after every slice of every block: the vector units split while the tile unit
// works through the products (split between the steps instead, the splits took about a quarter
// of the layer's time at 512 rows; pipelined, SmolLM2's projections went from 8.7 to 7.8 ms).
PAGEDSERVE_AMX void amx_panels(const uint16_t* xs, const float* w, const float* bias, float* y, int64_t M, int64_t K,
                               int64_t N, int64_t p0, int64_t p1) {
  if (p0 >= p1) return;
  amx::configure_tiles();
  const int64_t slices = (K + kSlice - 1) / kSlice, blocks = (M + kRows - 1) / kRows, units = slices * 16;
  uint16_t* buffers[2] = {amx::thread_buffer(2 * slices * kSliceElems), nullptr};
  buffers[1] = buffers[0] + slices * kSliceElems;
  alignas(64) float c[kRows * kPanel];
  const int64_t chunk = chunk_blocks(blocks, slices), panels = p1 - p0;
  const int64_t steps = (blocks + chunk - 1) / chunk * panels;
  auto panel_of = [&](int64_t step) { return w + (p0 + step % panels) * K * kPanel; };
  split_panel(panel_of(0), K, 0, units, buffers[0]);
  for (int64_t step = 0; step < steps; ++step) {
    const int64_t p = p0 + step % panels, i0 = step / panels * chunk, i1 = std::min(blocks, i0 + chunk);
    const uint16_t* panel = buffers[step % 2];
    const float* next = step + 1 < steps ? panel_of(step + 1) : nullptr;
    uint16_t* next_split = buffers[(step + 1) % 2];
    const int64_t shares = (i1 - i0) * slices;  // the next panel's units spread over this step's slices
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t first_share = (i - i0) * slices;
      block(xs + i * slices * kSliceElems, panel, slices, c, [&](int64_t s) {
        if (next == nullptr) return;
        const int64_t g = first_share + s;
        split_panel(next, K, units * g / shares, units * (g + 1) / shares, next_split);
      });
      const int64_t rows = std::min(kRows, M - i * kRows);
      for (int64_t r = 0; r < rows; ++r) {
        float* out = y + (i * kRows + r) * N + p * kPanel;
        for (int h = 0; h < 2; ++h) {
          __m512 v = _mm512_load_ps(c + r * kPanel + 16 * h);
          if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + p * kPanel + 16 * h));
          _mm512_storeu_ps(out + 16 * h, v);
        }
      }
    }
  }
  _tile_release();
}
#endif

}  // namespace

// SmolLM2's projections measured 1.15-1.45x faster here than on the FMAs at 128 rows (1.1-1.8x at
// 512); at 64 rows (full decode batches) 0.95-1.2x, and W64 was no faster with them here either
// (29.8-32.2 s against 29.4-34.4 s, alternated), so decode keeps the kernel made for streaming.
int64_t fp32_amx_min_rows() { return 128; }

torch::Tensor fp32_amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                              int64_t out_features, c10::optional<torch::Tensor> out) {
  const int64_t N = out_features;
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous(),
              "fp32_amx_linear: x must be a contiguous 2-D float32 tensor, got ", dtype_name(x.scalar_type()), " ",
              x.sizes());
  TORCH_CHECK(amx_linear_available(), "fp32_amx_linear: this CPU (or kernel) offers no AMX bf16");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.scalar_type() == torch::kFloat && packed.is_contiguous() && packed.numel() == N * K &&
                  N % kPanel == 0 && K > 0,
              "fp32_amx_linear: packed must be fp32_pack_weight's result for a [", N, ", ", K, "] weight");
  torch::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == N,
                "fp32_amx_linear: bias must be contiguous float32 [out_features]");
    bias32 = *bias;
  }
  if (M == 0) return output_for(x, N, torch::kFloat, out, "fp32_amx_linear");
#ifdef PAGEDSERVE_HAVE_AMX
  const int64_t slices = (K + kSlice - 1) / kSlice, blocks = (M + kRows - 1) / kRows;
  torch::Tensor split = torch::empty({blocks * slices * kSliceElems}, x.options().dtype(torch::kBFloat16));
  auto* xs = reinterpret_cast<uint16_t*>(split.data_ptr());
  const float* xp = x.data_ptr<float>();
  std::atomic<bool> finite{true};
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) {
      if (!split_block(xp, M, K, i * kRows, slices, xs + i * slices * kSliceElems)) finite = false;
    }
  });
  // An infinity in x times a weight's mid or lo term of the other sign would add inf - inf: NaN
  // where the exact product is infinite. Such rare calls (an activation overflowed) take the FMAs.
  if (!finite) return fp32_fma_linear(x, packed, bias, out_features, out);
  torch::Tensor y = output_for(x, N, torch::kFloat, out, "fp32_amx_linear");
  const float* w = packed.data_ptr<float>();
  const float* bp = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  // By value, the split copy, the weights and the bias: under work_share.h the helper may run it late.
  auto columns = [split, packed, bias32, xs, w, bp, M, K, N](int64_t p0, int64_t p1, void* dst) {
    amx_panels(xs, w, bp, static_cast<float*>(dst), M, K, N, p0, p1);
  };
  if (work_share::sharing()) {
    work_share::run_columns(N / kPanel, kPanel, y.data_ptr(), M, N, sizeof(float), columns);
    return y;
  }
  void* dst = y.data_ptr();
  at::parallel_for(0, N / kPanel, 1, [&](int64_t p0, int64_t p1) { columns(p0, p1, dst); });
  return y;
#else
  return output_for(x, N, torch::kFloat, out, "fp32_amx_linear");
#endif
}

}  // namespace pagedserve
