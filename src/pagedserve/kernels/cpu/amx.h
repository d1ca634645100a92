// What the AMX kernels share (amx_linear.cpp, amx_int8_linear.cpp, amx_prefill_attention.cpp):
// the target attribute, the tile configuration (every tile 16 rows x 64 bytes: 16 x 32 bf16
// operands, 16 x 16 fp32 accumulators), the size of one tile and the 2 x 2 tile product they all
// run. Availability (CPU, ISA cap, the kernel's permission) is amx_linear_available() (ops.h).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// (Every AMX CPU has AVX512-BF16 too: vcvtneps2bf16 rounds fp32 to bf16 in one instruction.)
#define PAGEDSERVE_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
#define PAGEDSERVE_HAVE_AMX 1

namespace pagedserve {
namespace amx {

constexpr int64_t kTileRows = 16;    // rows of every tile
constexpr int64_t kTileElems = 512;  // bf16 values in one 1 KB operand tile

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7 as 16 rows x 64 bytes, on the calling thread (a tile configuration is per thread).
PAGEDSERVE_AMX inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Where a 2 x 2 tile product finds slice s's two 16-column B tiles (1 KB each, in the VNNI form
// tdpbf16ps takes): at b + s * step and that + second (in bf16 values). Packed linear weights hold
// a slice's two tiles side by side (the defaults); the prefill attention's gathered keys and
// values lie otherwise.
struct BTiles {
  const uint16_t* b;
  int64_t step = 2 * kTileElems;
  int64_t second = kTileElems;
};

// C (32 rows x 32 fp32 columns, ldc floats between rows) = A B over `slices` slices of 32 k: A's
// first 16 rows at a0 and 16 more at a1 unless it is null (a_stride bytes between rows, slice s
// 32 values on), C zeroed first or, with accumulate, loaded from c and added to. after_slice(s)
// runs once slice s's tile products are issued: the tile unit works through them while the core
// runs it (a weight prefetch; amx_int8_linear.cpp widens its next panel there). Tiles 0-3
// accumulate, 4-5 hold A, 6-7 B.
template <class AfterSlice>
PAGEDSERVE_AMX inline void product_2x2(const uint16_t* a0, const uint16_t* a1, int64_t a_stride, BTiles w,
                                       int64_t slices, float* c, int64_t ldc, bool accumulate,
                                       const AfterSlice& after_slice) {
  float* c1 = c + kTileRows * ldc;
  const int64_t c_stride = ldc * 4;
  if (accumulate) {
    _tile_loadd(0, c, c_stride);
    _tile_loadd(1, c + 16, c_stride);
    if (a1 != nullptr) {
      _tile_loadd(2, c1, c_stride);
      _tile_loadd(3, c1 + 16, c_stride);
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  const uint16_t* b = w.b;
  for (int64_t s = 0; s < slices; ++s, b += w.step) {
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + w.second, 64);
    _tile_loadd(4, a0 + s * 32, a_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (a1 != nullptr) {
      _tile_loadd(5, a1 + s * 32, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    after_slice(s);
  }
  _tile_stored(0, c, c_stride);
  _tile_stored(1, c + 16, c_stride);
  if (a1 != nullptr) {
    _tile_stored(2, c1, c_stride);
    _tile_stored(3, c1 + 16, c_stride);
  }
}

// c (32 x 32 fp32, row stride 32) = 16 rows of x at a0, and 16 more at a1 unless it is null
// (x_stride bytes between rows), times one 32-column group of packed weights b (a slice's two
// tiles side by side), with after_slice as in product_2x2.
template <class AfterSlice>
PAGEDSERVE_AMX inline void block_32x32(const uint16_t* a0, const uint16_t* a1, int64_t x_stride, const uint16_t* b,
                                       int64_t slices, float* c, const AfterSlice& after_slice) {
  product_2x2(a0, a1, x_stride, BTiles{b}, slices, c, 32, false, after_slice);
}

// The same with prefetch_bytes > 0: the weight bytes that far ahead of each slice prefetched into
// L2 (the first row block, over cold weights).
PAGEDSERVE_AMX inline void block_32x32(const uint16_t* a0, const uint16_t* a1, int64_t x_stride, const uint16_t* b,
                                       int64_t slices, int64_t prefetch_bytes, float* c) {
  if (prefetch_bytes <= 0) {
    block_32x32(a0, a1, x_stride, b, slices, c, [](int64_t) {});
    return;
  }
  const char* ahead = reinterpret_cast<const char*>(b) + prefetch_bytes;
  block_32x32(a0, a1, x_stride, b, slices, c, [ahead](int64_t s) {
    const char* p = ahead + s * 2 * kTileElems * sizeof(uint16_t);
    for (int i = 0; i < 32; ++i) _mm_prefetch(p + 64 * i, _MM_HINT_T1);
  });
}

// `values` bf16 of this thread's scratch, aligned for 64-byte stores and kept across calls: where
// the AMX linear kernels put the weight tiles they make per call (int8 codes widened, fp32 values
// split). One buffer per thread serves every kernel, since a thread runs one kernel at a time.
inline uint16_t* thread_buffer(int64_t values) {
  thread_local std::vector<uint16_t> storage;
  const size_t need = static_cast<size_t>(values + 32);
  if (storage.size() < need) storage.resize(need);
  return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
}

// x [M, K] bf16 as tile loads read it: at(r0) is 16 rows from row r0, taken from x, or for the
// last partial tile (when M is not a multiple of 16) from a zero-padded copy of its rows, so that
// no tile load reads past x. No copy and no allocation when M is a multiple of 16.
class PaddedRows {
 public:
  PaddedRows(const uint16_t* x, int64_t M, int64_t K) : x_(x), K_(K), tail_row0_(M - M % kTileRows) {
    if (tail_row0_ < M) {
      tail_.assign(static_cast<size_t>(kTileRows * K), 0);
      std::memcpy(tail_.data(), x + tail_row0_ * K, (M - tail_row0_) * K * sizeof(uint16_t));
    }
  }
  const uint16_t* at(int64_t r0) const {
    return r0 >= tail_row0_ ? tail_.data() + (r0 - tail_row0_) * K_ : x_ + r0 * K_;
  }

 private:
  const uint16_t* x_;
  int64_t K_;
  int64_t tail_row0_;
  std::vector<uint16_t> tail_;
};

}  // namespace amx
}  // namespace pagedserve
#endif
