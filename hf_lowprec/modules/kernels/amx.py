"""AMX tile kernels of the int8 backend: a packed layer's int8 weight (INT4 codes unpacked, or stored int8 codes)
multiplied by int8 rows, both ways, without the weight ever existing whole as int8.

Why by hand: ``torch._int_mm`` (oneDNN) takes the int8 weight as a plain ``[K, N]`` matrix and reorders it into
AMX's tile layout on every call, and an INT4 weight first has to be unpacked to int8 (``cpp.py``'s
``unpack_int4_int8``, 2 MB blocks at a time: ``packed.WEIGHT_TILE``). Here each thread unpacks the codes of a block of
weight rows straight into tile layout (16 KB-256 KB, in cache) and multiplies them by the rows with the
``TDPBSSD`` instruction; the int32 products are dequantized as each tile finishes. The products are exact int32
sums, dequantized with the same fp32 operations as ``cpp.py``'s ``dequantize``: results are bit-identical to the
``torch._int_mm`` path (``tests/test_int8_tile_kernels.py``).

Measured on a 2-core AMX Xeon (2026-12-04, the kernels alone, bf16 out, int4-g64-asym, 256 rows): the forward of
2048 -> 8192 takes 2.7 ms where unpack + ``_int_mm`` + dequantize took 6.0 and a bf16 GEMM 4.3; the grad-input 3.8
vs 6.5 and 4.3; 8192 -> 2048: forward 2.5 vs 5.4 (bf16 4.2), grad-input 3.4 vs 8.0 (bf16 4.4). The whole layer
(input quantization and outlier channels included) is in ``benchmarks/results/kernels-AMX.json``.

The kernels build only where the compiler targets AMX (``-march=native`` on such a CPU); elsewhere
``amx_ready()`` is false and the int8 backend keeps ``torch._int_mm``. Linux grants a process the AMX tile state
on request (``arch_prctl(ARCH_REQ_XCOMP_PERM)``), done once before the first use.

Tile layout: ``TDPBSSD C[16, 16] += A[16, 64] . B`` with ``B`` as 16 rows of 16 output columns x 4 consecutive
reduction bytes ("VNNI" order). A 64-code row block of the weight becomes such a tile by a 16 x 16 transpose of
its 4-byte words (forward: reduction over ``k``) or by interleaving 4 rows bytewise (grad-input: reduction
over ``n``). Each thread holds a 2 x 2 block of ``C`` tiles (32 x 32 outputs), its two ``A`` and two ``B`` tiles.
"""

AMX_SOURCE = r"""
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__)
#include <sys/syscall.h>
#include <unistd.h>

bool amx_ready() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

struct TileConfig {
  uint8_t palette, start, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tiles 0-3: C (2 x 2 blocks of 16 x 16 int32), 4-5: A (rows x 64 bytes), 6-7: B (16 x 64 bytes). A block of
// fewer than 32 rows (the last) takes `top` rows in tiles 0, 1, 4 and `bottom` in 2, 3, 5 (0: those unused): tile
// loads then read no row past the input's end
static inline void configure_tiles(int top = 16, int bottom = 16) {
  alignas(64) TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  const int rows[8] = {top, top, bottom, bottom, top, bottom, 16, 16};
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows[t]);
    cfg.colsb[t] = rows[t] ? 64 : 0;
  }
  _tile_loadconfig(&cfg);
}

// tiles for the block of `rows` rows starting at m0 (< 32 only for the last): configured for it, and back after
struct RowBlock {
  int64_t rows;
  bool two;  // rows past the first 16: tiles 2, 3, 5 in use
  RowBlock(int64_t m0, int64_t M) : rows(std::min<int64_t>(32, M - m0)), two(rows > 16) {
    if (rows < 32) configure_tiles(two ? 16 : static_cast<int>(rows), two ? static_cast<int>(rows - 16) : 0);
  }
  ~RowBlock() {
    if (rows < 32) configure_tiles();
  }
};

// the weight's int8 values w8[n, k0 .. k0 + 63] in one register (groups of 32 codes or more)
struct WeightRows : PackedRows {
  inline __m512i load64(int64_t n, int64_t k0) const {
    const uint8_t* row = data + n * row_bytes;
    if (!ratio) return _mm512_loadu_si512(row + k0);
    const float* ra = ratio + n * G;
    const float* ze = zero ? zero + n * G : nullptr;
    const int64_t g0 = k0 / group, g1 = (k0 + 32) / group;
    const __m128i t0 = group_table16(ra[g0], ze ? ze[g0] : 0.f, is_signed);
    const __m128i t1 = g1 == g0 ? t0 : group_table16(ra[g1], ze ? ze[g1] : 0.f, is_signed);
    const __m256i lut = _mm256_set_m128i(t1, t0);  // a byte shuffle looks up within 128-bit lanes
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k0 / 2));
    const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(bytes, mask));
    const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask));
    const __m256i a = _mm256_unpacklo_epi8(lo, hi), c = _mm256_unpackhi_epi8(lo, hi);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(a, c, 0x20)),
                              _mm256_permute2x128_si256(a, c, 0x31), 1);
  }
};

// 128-bit lanes transposed: out[t] = [a_t, b_t, c_t, d_t]
static inline void transpose_lanes(__m512i a, __m512i b, __m512i c, __m512i d, __m512i* out) {
  const __m512i v0 = _mm512_shuffle_i32x4(a, b, 0x44), v1 = _mm512_shuffle_i32x4(a, b, 0xEE);
  const __m512i v2 = _mm512_shuffle_i32x4(c, d, 0x44), v3 = _mm512_shuffle_i32x4(c, d, 0xEE);
  out[0] = _mm512_shuffle_i32x4(v0, v2, 0x88);
  out[1] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
  out[2] = _mm512_shuffle_i32x4(v1, v3, 0x88);
  out[3] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
}

// forward B tile of weight rows n0 .. n0 + 15, codes k0 .. k0 + 63: dst [16 (k / 4)][16 n x 4 k] (1 KB)
static inline void forward_tile(const WeightRows& w, int64_t n0, int64_t k0, int8_t* dst) {
  __m512i r[16], t[16], u[16];
  for (int i = 0; i < 16; ++i) r[i] = w.load64(n0 + i, k0);
  for (int i = 0; i < 8; ++i) {  // 16 x 16 transpose of 4-byte words: pairs, then quads, then lanes
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // u[4 i + j], lane L: rows 4i .. 4i + 3 at word 4L + j
    __m512i out[4];
    transpose_lanes(u[j], u[4 + j], u[8 + j], u[12 + j], out);
    for (int L = 0; L < 4; ++L) _mm512_store_si512(dst + (4 * L + j) * 64, out[L]);
  }
}

// grad-input B tiles of weight rows n0 .. n0 + 63, codes k0 .. k0 + 63: dst [4 (16 k each)][16 (n / 4)][16 k x 4 n]
static inline void grad_input_tiles(const WeightRows& w, int64_t n0, int64_t k0, int8_t* dst) {
  for (int r = 0; r < 16; ++r) {
    __m512i q[4];
    for (int j = 0; j < 4; ++j) q[j] = w.load64(n0 + 4 * r + j, k0);
    const __m512i lo_ab = _mm512_unpacklo_epi8(q[0], q[1]), hi_ab = _mm512_unpackhi_epi8(q[0], q[1]);
    const __m512i lo_cd = _mm512_unpacklo_epi8(q[2], q[3]), hi_cd = _mm512_unpackhi_epi8(q[2], q[3]);
    __m512i out[4];  // lane L of the 4 quads: k = 16L + 0..3, 4..7, 8..11, 12..15
    transpose_lanes(_mm512_unpacklo_epi16(lo_ab, lo_cd), _mm512_unpackhi_epi16(lo_ab, lo_cd),
                    _mm512_unpacklo_epi16(hi_ab, hi_cd), _mm512_unpackhi_epi16(hi_ab, hi_cd), out);
    for (int t = 0; t < 4; ++t) _mm512_store_si512(dst + (t * 16 + r) * 64, out[t]);
  }
}

// out [M, N] = (xq [M, K] int8 * x_step [M]) @ (w8 [N, K] * row_step [N])^T; K and N multiples of 64
void amx_linear(torch::Tensor xq, torch::Tensor x_step, torch::Tensor weight, c10::optional<torch::Tensor> ratio,
                c10::optional<torch::Tensor> zero, bool is_signed, torch::Tensor row_step, torch::Tensor out) {
  TORCH_CHECK(amx_ready(), "AMX tile state not granted by the kernel");
  TORCH_CHECK(xq.is_contiguous() && xq.scalar_type() == torch::kChar, "xq: contiguous int8 [M, K]");
  const int64_t M = xq.size(0), K = xq.size(1), N = weight.size(0);
  TORCH_CHECK(K % 64 == 0 && N % 64 == 0, "AMX kernels: K and N multiples of 64");
  const WeightRows w{packed_rows(weight, ratio, zero, is_signed, K, "AMX kernels")};
  const bool bf16 = check_out(out, M, N);
  const float *xs = x_step.data_ptr<float>(), *rs = row_step.data_ptr<float>();
  const int64_t ld = out.stride(0);
  void* o = out.data_ptr();
  const int8_t* A = xq.data_ptr<int8_t>();
  parallel_for(0, N / 32, 1, [&](int64_t b, int64_t e) {
    configure_tiles();
    // this block of 32 weight rows as tiles: [K / 64][2 (16 rows each)][1 KB]
    int8_t* B = static_cast<int8_t*>(std::aligned_alloc(64, 32 * K));
    alignas(64) int32_t C[4][256];
    for (int64_t nb = b; nb < e; ++nb) {
      const int64_t n0 = nb * 32;
      for (int64_t kc = 0; kc < K / 64; ++kc)
        for (int h = 0; h < 2; ++h) forward_tile(w, n0 + 16 * h, kc * 64, B + (kc * 2 + h) * 1024);
      for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const RowBlock block(m0, M);
        _tile_zero(0);
        _tile_zero(1);
        if (block.two) {
          _tile_zero(2);
          _tile_zero(3);
        }
        for (int64_t kc = 0; kc < K / 64; ++kc) {
          _tile_loadd(4, A + m0 * K + kc * 64, K);
          _tile_loadd(6, B + kc * 2048, 64);
          _tile_loadd(7, B + kc * 2048 + 1024, 64);
          _tile_dpbssd(0, 4, 6);
          _tile_dpbssd(1, 4, 7);
          if (block.two) {
            _tile_loadd(5, A + (m0 + 16) * K + kc * 64, K);
            _tile_dpbssd(2, 5, 6);
            _tile_dpbssd(3, 5, 7);
          }
        }
        _tile_stored(0, C[0], 64);
        _tile_stored(1, C[1], 64);
        if (block.two) {
          _tile_stored(2, C[2], 64);
          _tile_stored(3, C[3], 64);
        }
        for (int t = 0; t < (block.two ? 4 : 2); ++t) {
          const int64_t mt = m0 + (t / 2) * 16;
          store_products(C[t], 16, std::min<int64_t>(16, M - mt), 16, xs, rs, o, ld, mt, n0 + (t % 2) * 16, bf16);
        }
      }
    }
    std::free(B);
    _tile_release();
  });
}

// out [M, K] = (gq [M, N] int8 * g_step [M]) @ w8 [N, K] (* col_step [K]); K and N multiples of 64
void amx_linear_grad_input(torch::Tensor gq, torch::Tensor g_step, torch::Tensor weight,
                           c10::optional<torch::Tensor> ratio, c10::optional<torch::Tensor> zero, bool is_signed,
                           c10::optional<torch::Tensor> col_step, int64_t K, torch::Tensor out) {
  TORCH_CHECK(amx_ready(), "AMX tile state not granted by the kernel");
  TORCH_CHECK(gq.is_contiguous() && gq.scalar_type() == torch::kChar, "gq: contiguous int8 [M, N]");
  const int64_t M = gq.size(0), N = gq.size(1);
  TORCH_CHECK(K % 64 == 0 && N % 64 == 0 && weight.size(0) == N, "AMX kernels: K and N multiples of 64");
  const WeightRows w{packed_rows(weight, ratio, zero, is_signed, K, "AMX kernels")};
  const bool bf16 = check_out(out, M, K);
  const float* gs = g_step.data_ptr<float>();
  const float* cs = col_step.has_value() ? col_step->data_ptr<float>() : nullptr;
  const int64_t ld = out.stride(0);
  void* o = out.data_ptr();
  const int8_t* A = gq.data_ptr<int8_t>();
  const int64_t NC = std::min<int64_t>(N, 2048);  // weight rows in tiles at a time (128 KB)
  parallel_for(0, K / 64, 1, [&](int64_t b, int64_t e) {
    configure_tiles();
    int8_t* B = static_cast<int8_t*>(std::aligned_alloc(64, NC * 64));  // [NC / 64][4 (16 k each)][1 KB]
    // [M rounded up to 32][64] int32 sums of this block of output columns, carried between blocks of weight rows
    int32_t* acc = static_cast<int32_t*>(std::aligned_alloc(64, (M + 31) / 32 * 32 * 64 * 4));
    for (int64_t kb = b; kb < e; ++kb) {
      const int64_t k0 = kb * 64;
      for (int64_t c0 = 0; c0 < N; c0 += NC) {
        const int64_t blocks = std::min(NC, N - c0) / 64;
        for (int64_t i = 0; i < blocks; ++i) grad_input_tiles(w, c0 + i * 64, k0, B + i * 4096);
        for (int64_t m0 = 0; m0 < M; m0 += 32) {
          const RowBlock block(m0, M);
          for (int p = 0; p < 2; ++p) {  // output columns k0 + 32p .. + 31: tiles 2p and 2p + 1 of each block
            int32_t* cb = acc + m0 * 64 + p * 32;
            if (c0 == 0) {
              _tile_zero(0);
              _tile_zero(1);
              if (block.two) {
                _tile_zero(2);
                _tile_zero(3);
              }
            } else {
              _tile_loadd(0, cb, 256);
              _tile_loadd(1, cb + 16, 256);
              if (block.two) {
                _tile_loadd(2, cb + 16 * 64, 256);
                _tile_loadd(3, cb + 16 * 64 + 16, 256);
              }
            }
            for (int64_t i = 0; i < blocks; ++i) {
              _tile_loadd(4, A + m0 * N + c0 + i * 64, N);
              _tile_loadd(6, B + i * 4096 + 2 * p * 1024, 64);
              _tile_loadd(7, B + i * 4096 + (2 * p + 1) * 1024, 64);
              _tile_dpbssd(0, 4, 6);
              _tile_dpbssd(1, 4, 7);
              if (block.two) {
                _tile_loadd(5, A + (m0 + 16) * N + c0 + i * 64, N);
                _tile_dpbssd(2, 5, 6);
                _tile_dpbssd(3, 5, 7);
              }
            }
            _tile_stored(0, cb, 256);
            _tile_stored(1, cb + 16, 256);
            if (block.two) {
              _tile_stored(2, cb + 16 * 64, 256);
              _tile_stored(3, cb + 16 * 64 + 16, 256);
            }
          }
        }
      }
      store_products(acc, 64, M, 64, gs, cs, o, ld, 0, k0, bf16);
    }
    std::free(B);
    std::free(acc);
    _tile_release();
  });
}
#else
bool amx_ready() { return false; }

void amx_linear(torch::Tensor, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>,
                c10::optional<torch::Tensor>, bool, torch::Tensor, torch::Tensor) {
  TORCH_CHECK(false, "the CPU kernels were built without AMX");
}

void amx_linear_grad_input(torch::Tensor, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>,
                           c10::optional<torch::Tensor>, bool, c10::optional<torch::Tensor>, int64_t, torch::Tensor) {
  TORCH_CHECK(false, "the CPU kernels were built without AMX");
}
#endif
"""

AMX_FUNCTIONS = ["amx_ready", "amx_linear", "amx_linear_grad_input"]
