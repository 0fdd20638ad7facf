// What every kernel that programs the AMX tile registers itself shares (builds whose flags enable
// AMX-BF16 and AVX512-BF16; included by quant_linear.h and paged_attention_avx512.h): Linux's leave to
// use the tiles, the configuration block and loading it, the A/B switches. Users: decode_tiles.h
// (decode attention) and quant_linear.h (the quantized linear from past its fused rows up to 16).
//
// ATen's brgemm keeps its own tile configuration per thread and reloads it only when it thinks the
// registers hold another; `configure` releases it first, so that its next call configures again.

#pragma once

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)

#include <ATen/native/CPUBlas.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#define PAGEDSERVE_AMX_TILES 1

namespace {
namespace amx_tiles {

inline bool permitted() {  // Linux's leave to use the tile registers (idempotent; oneDNN asks too)
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Whether the environment variable `name` leaves a tile path on (anything but "0"; A/B runs: docs/design.md).
inline bool env_on(const char* name) {
  const char* env = std::getenv(name);
  return !(env != nullptr && std::strcmp(env, "0") == 0);
}

struct alignas(64) Config {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  Config& tile(int index, int64_t tile_rows, int64_t bytes_per_row) {
    rows[index] = static_cast<uint8_t>(tile_rows);
    colsb[index] = static_cast<uint16_t>(bytes_per_row);
    return *this;
  }
};

inline void configure(const Config& cfg) {
  at::native::cpublas::brgemm_release(true);  // ATen's brgemm configures again at its next call
  asm volatile("" : : "r"(&cfg) : "memory");  // GCC does not count ldtilecfg as reading cfg: keep the stores
  _tile_loadconfig(&cfg);
}

// The tiles of this thread released when a run ends, a thrown check included.
struct Release {
  ~Release() { _tile_release(); }
};

}  // namespace amx_tiles
}  // namespace

#endif
