// What the AMX kernels share (amx_linear.cpp, amx_prefill_attention.cpp): the target attribute,
// the tile configuration (every tile 16 rows x 64 bytes: 16 x 32 bf16 operands, 16 x 16 fp32
// accumulators) and the size of one tile. Availability (CPU, ISA cap, the kernel's permission) is
// amx_linear_available() (ops.h).
#pragma once

#include <immintrin.h>

#include <cstdint>

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

}  // namespace amx
}  // namespace pagedserve
#endif
