// The copy into row blocks (see row_blocks.py): dst[b, k, j] = src[b * w + j, k] for blocks b in
// [b0, b1), columns k < cols, rows j < w of a block. fp32 (any 4-byte element: bits are copied).
//
// Why by hand: the copy is a transposition of every block, and the sync writes the whole model
// through it. With AVX-512 it reads 16 rows at a time along their length (16 streams the prefetcher
// follows), transposes 16x16 tiles in registers, and writes each tile's rows as whole cache lines
// that bypass the cache (streaming stores: no read of the destination first, the model is larger
// than the cache anyway). That runs at 1.0-1.7x a memcpy on one core (scripts/bench_row_blocks.py);
// Inductor's tiling of the same copy (64 rows at a time, ordinary stores) ran at 1.8-2.1x. Other
// CPUs get the same tiling in plain C++.
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

void copy_tile(const float* s, int64_t ld, float* d, int64_t kstride, int64_t j0, int64_t j1, int64_t k0, int64_t k1) {
  for (int64_t k = k0; k < k1; ++k)
    for (int64_t j = j0; j < j1; ++j) d[k * kstride + j] = s[j * ld + k];
}

void copy_plain(const float* src, int64_t ld, float* dst, int64_t bstride, int64_t kstride, int64_t b0, int64_t b1,
                int64_t cols, int64_t w) {
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t j0 = 0; j0 < w; j0 += 16)
      for (int64_t k0 = 0; k0 < cols; k0 += 16)
        copy_tile(src + b * w * ld, ld, dst + b * bstride, kstride, j0, j0 + 16 < w ? j0 + 16 : w, k0,
                  k0 + 16 < cols ? k0 + 16 : cols);
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    __m512d c = _mm512_castps_pd(t[i + 2]), e = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

__attribute__((target("avx512f"))) void copy_avx512(const float* src, int64_t ld, float* dst, int64_t bstride,
                                                    int64_t kstride, int64_t b0, int64_t b1, int64_t cols, int64_t w,
                                                    bool stream) {
  // streaming stores need whole, aligned cache lines: 16 floats at a 64-byte boundary
  stream = stream && reinterpret_cast<uintptr_t>(dst) % 64 == 0 && bstride % 16 == 0 && kstride % 16 == 0;
  const int64_t full_j = w / 16 * 16, full_k = cols / 16 * 16;
  for (int64_t b = b0; b < b1; ++b) {
    const float* s = src + b * w * ld;
    float* d = dst + b * bstride;
    for (int64_t j0 = 0; j0 < full_j; j0 += 16) {
      for (int64_t k0 = 0; k0 < full_k; k0 += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(s + (j0 + i) * ld + k0);
        transpose16(r);
        if (stream)
          for (int i = 0; i < 16; ++i) _mm512_stream_ps(d + (k0 + i) * kstride + j0, r[i]);
        else
          for (int i = 0; i < 16; ++i) _mm512_storeu_ps(d + (k0 + i) * kstride + j0, r[i]);
      }
      copy_tile(s, ld, d, kstride, j0, j0 + 16, full_k, cols);
    }
    copy_tile(s, ld, d, kstride, full_j, w, 0, cols);
  }
  if (stream) _mm_sfence();  // the streamed lines are visible before the caller reports the copy done
}
#endif

}  // namespace

extern "C" void siirl_copy_into_row_blocks(const float* src, int64_t ld, float* dst, int64_t bstride,
                                           int64_t kstride, int64_t b0, int64_t b1, int64_t cols, int64_t w,
                                           int stream) {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) return copy_avx512(src, ld, dst, bstride, kstride, b0, b1, cols, w, stream);
#endif
  copy_plain(src, ld, dst, bstride, kstride, b0, b1, cols, w);
}
