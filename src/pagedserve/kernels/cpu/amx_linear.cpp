// bf16 linear layers on Intel AMX: y = x @ W^T (+ bias) with W packed once, at load, into the
// tile layout tdpbf16ps reads, so a call streams each weight byte from memory exactly once.
//
// Why not oneDNN for this: at decode sizes (a few to 64 rows) the layer is bound by reading its
// weights, and oneDNN's packed bf16 matmul streamed SmolLM2's cold weights at 9-14 GB/s on a 2-core
// AMX Xeon whose cores read 25-30 GB/s; its per-call set-up (~20 us) also shows at one row.
//
// Packed layout. W [N, K] (out_features x in_features) is cut into 32-column groups of outputs
// and 32-wide slices of K. For group g and slice s the packed tensor holds two 1 KB tiles, one per
// 16 outputs, each in the VNNI form tdpbf16ps takes for its B operand: tile row r (0..15) holds,
// for output columns c = 0..15, the pair W[n0 + c][k0 + 2r], W[n0 + c][k0 + 2r + 1]. Groups are
// laid out one after the other, slices in order within a group: a thread reading its groups reads
// one sequential stream, in transparent huge pages (huge_pages.cpp). N and K must be multiples of
// 32 (the Python side checks and keeps oneDNN otherwise).
//
// Compute. Tiles tmm0-3 accumulate a 32 x 32 block of y in fp32 (two 16-row tiles of x times the
// group's two column tiles), tmm4/5 hold x's rows, tmm6/7 the weight tiles. Rows are taken 32 at
// a time; a last partial 16-row tile is read from a zero-padded copy, so no tile reads past x.
// Results are rounded once to bf16 (round to nearest even), as oneDNN's bf16 matmul does, after
// adding the bias in fp32; with fp32_out they are stored widened back to fp32: the values .float()
// of the bf16 result gives, without that second pass over the output (the LM head's logits).
// Groups are split across threads; each thread configures its tiles. amx_linear_argmax folds the
// same rounded values into each row's greedy token instead of storing them (row_argmax.h).
// amx_gated_linear computes a gate_up projection's gate and up blocks side by side and stores
// act(gate) * up (the gated MLP's activation, activations.h) instead of both: the [rows, 2 n]
// output is never written and read back, and the separate elementwise pass disappears.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

#include "activations.h"
#include "amx_rows.h"
#include "huge_pages.h"
#include "isa.h"
#include "ops.h"
#include "row_argmax.h"
#include "vec.h"
#include "work_share.h"

namespace pagedserve {
namespace {

constexpr int64_t kTile = 16;       // rows of a tile, and output columns of a weight tile
constexpr int64_t kSlice = 32;      // K values one tile row holds (32 bf16 = 64 bytes)
constexpr int64_t kGroup = 32;      // output columns per group (two weight tiles)
constexpr int64_t kTileElems = 512; // bf16 values in one 1 KB tile
// Weight bytes ahead of the current slice that the first row block prefetches into L2 (software
// prefetch into L2 measured ~5% faster than the hardware prefetchers alone on cold weights).
constexpr int64_t kPrefetchBytes = 16384;

// Linux hands a process the AMX tile state only once it asks (arch_prctl); oneDNN asks too.
bool request_amx_permission() {
#if defined(__x86_64__) && defined(SYS_arch_prctl)
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

bool cpu_has_amx_bf16() {
#if defined(__x86_64__) && defined(__GNUC__)
  unsigned eax, ebx, ecx, edx;
  __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
  const bool tile = edx & (1u << 24), bf16 = edx & (1u << 22);
  return tile && bf16;
#else
  return false;
#endif
}

#ifdef PAGEDSERVE_HAVE_AMX
using amx::configure_tiles;

using amx::fold_rows;
using amx::gated_rows;
using amx::write_rows;

// Groups [g0, g1) of y = x @ W^T for x [M, K], into y (bf16) or, when y32 is not null, into y32
// (the same values widened to fp32); when best is not null, folded into best[0 .. M) instead.
PAGEDSERVE_AMX void amx_groups(const amx::PaddedRows& x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                               float* y32, row_argmax::Best* best, int64_t M, int64_t K, int64_t N, int64_t g0,
                               int64_t g1) {
  configure_tiles();
  alignas(64) float c[2 * kTile * kGroup];
  const int64_t slices = K / kSlice;
  const int64_t x_stride = K * 2;  // bytes between rows of x
  for (int64_t g = g0; g < g1; ++g) {
    const uint16_t* wg = w + g * slices * 2 * kTileElems;
    for (int64_t r0 = 0; r0 < M; r0 += 2 * kTile) {
      const bool two = r0 + kTile < M;
      // Later row blocks find the group's tiles in L1/L2: only the first prefetches.
      amx::block_32x32(x.at(r0), two ? x.at(r0 + kTile) : nullptr, x_stride, wg, slices,
                       r0 == 0 ? kPrefetchBytes : 0, c);
      const int64_t rows = std::min<int64_t>(2 * kTile, M - r0);
      if (best != nullptr) {
        fold_rows(c, bias == nullptr ? nullptr : bias + g * kGroup, best + r0, g * kGroup, rows);
        continue;
      }
      const int64_t at = r0 * N + g * kGroup;
      write_rows(c, bias == nullptr ? nullptr : bias + g * kGroup, y32 == nullptr ? y + at : nullptr,
                 y32 == nullptr ? nullptr : y32 + at, N, rows);
    }
  }
  _tile_release();
}

// Gate groups [g0, g1) of amx_gated_linear: group g's gate columns and the matching up columns
// (group g + n / 32), each streamed from the packed weight in order.
template <class Act>
PAGEDSERVE_AMX void amx_gated_groups(const amx::PaddedRows& x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                                     int64_t M, int64_t K, int64_t n, int64_t g0, int64_t g1) {
  configure_tiles();
  alignas(64) float cg[2 * kTile * kGroup];
  alignas(64) float cu[2 * kTile * kGroup];
  const int64_t slices = K / kSlice, up_groups = n / kGroup;
  const int64_t x_stride = K * 2;
  for (int64_t g = g0; g < g1; ++g) {
    const uint16_t* wg = w + g * slices * 2 * kTileElems;
    const uint16_t* wu = w + (g + up_groups) * slices * 2 * kTileElems;
    for (int64_t r0 = 0; r0 < M; r0 += 2 * kTile) {
      const bool two = r0 + kTile < M;
      const uint16_t* a1 = two ? x.at(r0 + kTile) : nullptr;
      const int64_t prefetch = r0 == 0 ? kPrefetchBytes : 0;
      amx::block_32x32(x.at(r0), a1, x_stride, wg, slices, prefetch, cg);
      amx::block_32x32(x.at(r0), a1, x_stride, wu, slices, prefetch, cu);
      const uint16_t* bg = bias == nullptr ? nullptr : bias + g * kGroup;
      gated_rows<Act>(cg, cu, bg, bias == nullptr ? nullptr : bg + n, y + r0 * n + g * kGroup, n,
                      std::min<int64_t>(2 * kTile, M - r0));
    }
  }
  _tile_release();
}
#endif

void check_bf16_matrix(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16 && t.dim() == 2 && t.is_contiguous(), name,
              " must be a contiguous 2-D bfloat16 tensor, got ", t.scalar_type(), " ", t.sizes());
}

}  // namespace

bool amx_linear_available() {
#ifdef PAGEDSERVE_HAVE_AMX
  static const bool ok = isa_allowed(Isa::kAmx) && cpu_has_amx_bf16() && request_amx_permission();
  return ok;
#else
  return false;
#endif
}

torch::Tensor amx_pack_weight(torch::Tensor weight) {
  check_bf16_matrix(weight, "weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kGroup == 0 && K % kSlice == 0, "amx_pack_weight: out_features must be a multiple of ", kGroup,
              " and in_features of ", kSlice, ", got ", weight.sizes());
  torch::Tensor packed = huge_page_empty(N * K, weight.options());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  uint16_t* p = reinterpret_cast<uint16_t*>(packed.data_ptr());
  const int64_t slices = K / kSlice;
  at::parallel_for(0, N / kGroup, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t s = 0; s < slices; ++s) {
        for (int64_t half = 0; half < 2; ++half) {
          uint16_t* tile = p + ((g * slices + s) * 2 + half) * kTileElems;
          const int64_t n0 = g * kGroup + half * kTile, k0 = s * kSlice;
          for (int64_t r = 0; r < kTile; ++r) {
            for (int64_t c = 0; c < kTile; ++c) {
              tile[r * 32 + c * 2] = w[(n0 + c) * K + k0 + 2 * r];
              tile[r * 32 + c * 2 + 1] = w[(n0 + c) * K + k0 + 2 * r + 1];
            }
          }
        }
      }
    }
  });
  return packed;
}

namespace {

// The checks amx_linear, amx_linear_argmax and amx_gated_linear share; the bias as a pointer (null: none).
const uint16_t* checked_bias(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                             int64_t N, const char* name) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(), name,
              ": x must be a contiguous 2-D bfloat16 tensor, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(amx_linear_available(), name, ": this CPU (or kernel) offers no AMX bf16");
  const int64_t K = x.size(1);
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() && packed.numel() == N * K, name,
              ": packed must be amx_pack_weight's result for a [", N, ", ", K, "] weight");
  TORCH_CHECK(N % kGroup == 0 && K % kSlice == 0, name, ": unsupported shape");
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->is_contiguous() && bias->numel() == N, name,
              ": bias must be contiguous bfloat16 [out_features]");
  return reinterpret_cast<const uint16_t*>(bias->data_ptr());
}

}  // namespace

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                         int64_t out_features, bool fp32_out, c10::optional<torch::Tensor> out) {
  const int64_t N = out_features;
  const uint16_t* b = checked_bias(x, packed, bias, N, "amx_linear");
  const int64_t M = x.size(0), K = x.size(1);
  torch::Tensor y = output_for(x, N, fp32_out ? torch::kFloat : torch::kBFloat16, out, "amx_linear");
  if (M == 0) return y;
#ifdef PAGEDSERVE_HAVE_AMX
  const amx::PaddedRows rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  // By value, x (rows points into it), the weights and the bias: under work_share.h the helper may
  // run it late.
  auto groups = [rows, x, packed, bias, w, b, fp32_out, M, K, N](int64_t g0, int64_t g1, void* dst) {
    amx_groups(rows, w, b, fp32_out ? nullptr : static_cast<uint16_t*>(dst),
               fp32_out ? static_cast<float*>(dst) : nullptr, nullptr, M, K, N, g0, g1);
  };
  void* yp = y.data_ptr();
  if (work_share::sharing()) {
    work_share::run_columns(N / kGroup, kGroup, yp, M, N, y.element_size(), groups);
    return y;
  }
  at::parallel_for(0, N / kGroup, 1, [&](int64_t g0, int64_t g1) { groups(g0, g1, yp); });
#endif
  return y;
}

torch::Tensor amx_linear_argmax(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                                int64_t out_features) {
  const int64_t N = out_features;
  const uint16_t* b = checked_bias(x, packed, bias, N, "amx_linear_argmax");
  const int64_t M = x.size(0), K = x.size(1);
  if (M == 0) return torch::empty({0}, x.options().dtype(torch::kLong));
#ifdef PAGEDSERVE_HAVE_AMX
  const amx::PaddedRows rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  // By value, x and the weights with it: under work_share.h the helper may run the fold late.
  return row_argmax::argmax_over_ranges(
      M, N / kGroup, x.options(),
      [rows, x, packed, bias, w, b, M, K, N](int64_t g0, int64_t g1, row_argmax::Best* best) {
        amx_groups(rows, w, b, nullptr, nullptr, best, M, K, N, g0, g1);
      });
#else
  return torch::empty({0}, x.options().dtype(torch::kLong));
#endif
}

torch::Tensor amx_gated_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                               int64_t out_features, std::string activation) {
  const int64_t N = out_features, n = N / 2;
  const uint16_t* b = checked_bias(x, packed, bias, N, "amx_gated_linear");
  TORCH_CHECK(n % kGroup == 0, "amx_gated_linear: out_features (gate and up) must be a multiple of ", 2 * kGroup,
              ", got ", N);
  const bool silu = activation == "silu";
  TORCH_CHECK(silu || activation == "gelu_tanh", "amx_gated_linear: activation must be 'silu' or 'gelu_tanh', got '",
              activation, "'");
  const int64_t M = x.size(0), K = x.size(1);
  torch::Tensor y = torch::empty({M, n}, x.options());
  if (M == 0) return y;
#ifdef PAGEDSERVE_HAVE_AMX
  const amx::PaddedRows rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  // By value, x and the weights with it: under work_share.h the helper may run it late.
  auto groups = [rows, x, packed, bias, w, b, silu, M, K, n](int64_t g0, int64_t g1, void* dst) {
    uint16_t* out = static_cast<uint16_t*>(dst);
    if (silu) {
      amx_gated_groups<Silu>(rows, w, b, out, M, K, n, g0, g1);
    } else {
      amx_gated_groups<GeluTanh>(rows, w, b, out, M, K, n, g0, g1);
    }
  };
  if (work_share::sharing()) {
    work_share::run_columns(n / kGroup, kGroup, yp, M, n, sizeof(uint16_t), groups);
    return y;
  }
  at::parallel_for(0, n / kGroup, 1, [&](int64_t g0, int64_t g1) { groups(g0, g1, yp); });
#endif
  return y;
}

// Rows of W read back from amx_pack_weight's layout: row n sits in group n / 32, tile (n % 32) / 16,
// column n % 16 of every slice's tile, as 16 bf16 pairs 64 bytes apart. A tied embedding is looked
// up here, so the model need not keep its plain copy beside the packed LM head.
torch::Tensor amx_packed_rows(torch::Tensor packed, torch::Tensor ids, int64_t in_features) {
  const int64_t K = in_features;
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() && K > 0 && K % kSlice == 0 &&
                  packed.numel() % (K * kGroup) == 0,
              "amx_packed_rows: packed must be amx_pack_weight's result for a weight of ", K, " input features");
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.dim() == 1, "amx_packed_rows: ids must be 1-D int64");
  const int64_t N = packed.numel() / K, M = ids.numel(), slices = K / kSlice;
  const torch::Tensor idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < M; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < N, "amx_packed_rows: id ", id[i], " is out of range [0, ", N, ")");
  }
  torch::Tensor rows = torch::empty({M, K}, packed.options());
  const char* p = static_cast<const char*>(packed.data_ptr());
  char* out = static_cast<char*>(rows.data_ptr());
  constexpr int64_t kPair = 2 * sizeof(uint16_t);
  at::parallel_for(0, M, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = id[i], g = n / kGroup, half = (n % kGroup) / kTile, c = n % kTile;
      char* row = out + i * K * sizeof(uint16_t);
      for (int64_t s = 0; s < slices; ++s) {
        const char* tile = p + ((g * slices + s) * 2 + half) * kTileElems * sizeof(uint16_t);
        for (int64_t r = 0; r < kTile; ++r) {  // W[n][k0 + 2r], W[n][k0 + 2r + 1]
          std::memcpy(row + (s * kSlice + 2 * r) * sizeof(uint16_t), tile + (r * kTile + c) * kPair, kPair);
        }
      }
    }
  });
  return rows;
}

}  // namespace pagedserve
