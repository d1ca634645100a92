// fp32 linear layers on AVX-512: y = x @ W^T (+ bias) with W packed once, at load, into 32-column
// panels that a call streams in order, each weight byte read from memory once per call.
//
// Why not MKL / oneDNN for this: at decode sizes (a few to 64 rows) MKL's sgemm reached about half
// of this host's fp32 FMA peak on SmolLM2's projections (147 of ~300 GFLOP/s over W64's decode
// steps): the weights are cold on every call (430 MB per step, far beyond L2), and reading them and
// computing on them do not overlap. Here the next panel is prefetched into L2 while the current
// one is multiplied with every row, so the stream hides behind the FMAs.
//
// Packed layout. W [N, K] (out_features x in_features) is cut into panels of 32 output columns;
// panel p holds, for k = 0 .. K-1, the 32 values W[32p + c][k] (c = 0..31) as 128 contiguous
// bytes. Panels follow one another, so a thread reading its panels reads one sequential stream,
// in transparent huge pages (huge_pages.cpp). N must be a multiple of 32 (the Python side checks
// and keeps torch's matmul otherwise); K is free.
//
// Compute. Blocks of up to 12 rows times one panel (fp32_gemm.h: 24 zmm accumulators, blocked
// fp32 sums), then the bias. Rows are taken in chunks of 96, so a chunk's rows of x stay in L2
// while every panel passes. Panels are split across threads.

#include <ATen/Parallel.h>

#include "fp32_gemm.h"
#include "huge_pages.h"
#include "ops.h"

namespace pagedserve {
namespace {

using fp32_gemm::kBlockRows;
using fp32_gemm::kPanel;
constexpr int64_t kChunkRows = 96;  // rows whose x stays in L2 while all panels pass

#ifdef PAGEDSERVE_HAVE_AVX512_GEMM

// Panels [p0, p1) of y for rows [0, M), from x packed by pack_x, plus the bias.
void fp32_panels(const float* xp, const float* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                 int64_t p0, int64_t p1) {
  for (int64_t c0 = 0; c0 < M; c0 += kChunkRows) {
    const int64_t c1 = std::min(M, c0 + kChunkRows);
    const int64_t num_blocks = (c1 - c0 + kBlockRows - 1) / kBlockRows;
    for (int64_t p = p0; p < p1; ++p) {
      const float* panel = w + p * K * kPanel;
      const float* next = p + 1 < p1 ? panel + K * kPanel : nullptr;
      for (int64_t i = 0; i < num_blocks; ++i) {
        const int64_t r0 = c0 + i * kBlockRows, rows = std::min(kBlockRows, c1 - r0);
        fp32_gemm::packed_rows_block(rows, xp + r0 * K, panel, kPanel, K, y + r0 * N + p * kPanel, N,
                                     {next, i, num_blocks});
      }
      if (bias == nullptr) continue;
      for (int64_t r = c0; r < c1; ++r) {
        for (int64_t c = 0; c < kPanel; ++c) y[r * N + p * kPanel + c] += bias[p * kPanel + c];
      }
    }
  }
}

// x [M, K] with each 12-row block interleaved (fp32_gemm::pack_rows), blocks in row order: block i
// starts at row 12 i's offset, i * 12 * K.
torch::Tensor pack_x(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  torch::Tensor packed = torch::empty_like(x);
  const float* src = x.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, (M + kBlockRows - 1) / kBlockRows, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * kBlockRows;
      fp32_gemm::pack_rows(src + r0 * K, std::min(kBlockRows, M - r0), K, dst + r0 * K);
    }
  });
  return packed;
}
#endif

void check_fp32_matrix(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.dim() == 2 && t.is_contiguous(), name,
              " must be a contiguous 2-D float32 tensor, got ", t.scalar_type(), " ", t.sizes());
}

}  // namespace

bool fp32_kernels_available() { return fp32_gemm::available(); }

torch::Tensor fp32_pack_weight(torch::Tensor weight) {
  check_fp32_matrix(weight, "weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kPanel == 0 && K > 0, "fp32_pack_weight: out_features must be a multiple of ", kPanel,
              ", got ", weight.sizes());
  torch::Tensor packed = huge_page_empty(N * K, weight.options());
  const float* w = weight.data_ptr<float>();
  float* p = packed.data_ptr<float>();
  at::parallel_for(0, N / kPanel, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t c = 0; c < kPanel; ++c) p[(g * K + k) * kPanel + c] = w[(g * kPanel + c) * K + k];
      }
    }
  });
  return packed;
}

torch::Tensor fp32_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                          int64_t out_features) {
  check_fp32_matrix(x, "x");
  TORCH_CHECK(fp32_gemm::available(), "fp32_linear: this CPU (or build) offers no AVX-512");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(packed.scalar_type() == torch::kFloat && packed.is_contiguous() && packed.numel() == N * K &&
                  N % kPanel == 0,
              "fp32_linear: packed must be fp32_pack_weight's result for a [", N, ", ", K, "] weight");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == N,
                "fp32_linear: bias must be contiguous float32 [out_features]");
    b = bias->data_ptr<float>();
  }
  torch::Tensor y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
#ifdef PAGEDSERVE_HAVE_AVX512_GEMM
  const torch::Tensor x_packed = pack_x(x);
  const float* xp = x_packed.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N / kPanel, 1, [&](int64_t p0, int64_t p1) { fp32_panels(xp, w, b, yp, M, K, N, p0, p1); });
#endif
  return y;
}

// Rows of W read back from fp32_pack_weight's layout: row n is column n % 32 of panel n / 32, one
// value per 128-byte panel row. A tied embedding is looked up here, so the model need not keep its
// plain copy beside the packed LM head.
torch::Tensor fp32_packed_rows(torch::Tensor packed, torch::Tensor ids, int64_t in_features) {
  const int64_t K = in_features;
  TORCH_CHECK(packed.scalar_type() == torch::kFloat && packed.is_contiguous() && K > 0 &&
                  packed.numel() % (K * kPanel) == 0,
              "fp32_packed_rows: packed must be fp32_pack_weight's result for a weight of ", K, " input features");
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.dim() == 1, "fp32_packed_rows: ids must be 1-D int64");
  const int64_t N = packed.numel() / K, M = ids.numel();
  const torch::Tensor idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < M; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < N, "fp32_packed_rows: id ", id[i], " is out of range [0, ", N, ")");
  }
  torch::Tensor rows = torch::empty({M, K}, packed.options());
  const float* p = packed.data_ptr<float>();
  float* out = rows.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* col = p + (id[i] / kPanel) * K * kPanel + id[i] % kPanel;
      for (int64_t k = 0; k < K; ++k) out[i * K + k] = col[k * kPanel];
    }
  });
  return rows;
}

}  // namespace pagedserve
