"""AVX2 kernels of the int8 backend for CPUs without int8 dot products: a packed layer's int8 weight (INT4 codes
unpacked, or stored int8 codes) multiplied by int8 rows, both ways, with 16-bit multiply-adds (``VPMADDWD``).

Why by hand: on an AVX2 CPU (no VNNI, no AMX) ``torch._int_mm`` is 35x slower than an fp32 GEMM (``ENVIRONMENT.md``:
1.8 against 63 GFLOP/s) and, where oneDNN's AVX2 int8 GEMM runs it (``ONEDNN_MAX_CPU_ISA=AVX2`` on an AMX Xeon), not
exact: its 16-bit pair sums saturate. So the int8 backend could not run there, and the ``tiled`` backend (dequantize
a tile to fp32, multiply with the BLAS) was the only fast path: at best the fp32 GEMM's speed, less the
dequantization. ``VPMADDWD`` multiplies 16 int16 pairs and adds each pair into 8 int32 lanes, 16 multiply-adds an
instruction where an fp32 FMA makes 8; with the add that accumulates them, 2 instructions per 16 against 1 per 8,
but on 3-4 vector ports instead of 2. ``VPMADDUBSW`` (u8 x s8) would not be faster: signed x signed int8 needs
a sign-moving instruction per product vector, and its 16-bit pair sums saturate.

Numerics: the int32 sums are exact, dequantized with the same fp32 operations as the ``torch._int_mm`` path
(``store_products``): results are bit-identical to that path where ``torch._int_mm`` is exact
(``tests/test_int8_tile_kernels.py``), so to the int8 backend on VNNI and AMX CPUs.

Measured on the AVX2 class emulated on a 2-core AMX Xeon (its AVX2 instructions, MKL capped to AVX2; 2026-12-04,
``benchmarks/results/kernels-AVX2-emulated.json``, 256 rows, int4-g64-asym): the whole int8 layer at Llama-3.2-1B's
shapes runs at 0.99-1.21x the fp32 GEMM's throughput forward and 1.14-1.28x for the grad-input, the tiled one at
0.87-1.04x; the kernels alone at 2048 -> 8192: forward 31-35 ms, grad-input 33-37, the fp32 GEMM 40-42 (probes
minutes apart).

Blocking (each thread: a block of 64 output columns; its int32 sums ``[M, 64]`` in memory between chunks of the
reduction): the weight's int8 values of 64 columns x 512 reduction steps are unpacked into a panel of int16 pairs
``[256][64]`` (64 KB, in L2), and a 4-row x 16-column block of sums is held in 8 registers while the panel's pairs
are multiplied by the rows' pairs, broadcast. The rows' int8 values of a panel's reduction steps are converted to int16
per panel (``M`` KB a thread; the whole rows in int16 once per call cost the 1B shape's 128k-vocabulary head 17 MB at
its peak). GCC 12 keeps the 8 sums in registers but adds a register move per sum and pair step (the disassembly):
about 20 of the 24 multiply-adds per cycle the Intel core's ports allow are reached.
"""

AVX2_INT8_SOURCE = r"""
// ---------------------------------------------------------------------------------------------
// AVX2 int8 backend (avx2_int8.py)

// the weight's int8 values w8[n, k], 32 at a time as int16 (groups of a multiple of 32 codes)
struct Int16Rows : PackedRows {
  // w8[n, k0 .. k0 + 15] in a, w8[n, k0 + 16 .. k0 + 31] in b (k0 a multiple of 32)
  inline void load32(int64_t n, int64_t k0, __m256i& a, __m256i& b) const {
    const uint8_t* row = data + n * row_bytes;
    __m128i first, second;
    if (!ratio) {
      first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0));
      second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0 + 16));
    } else {
      const int64_t g = n * G + k0 / group;
      const __m128i lut = group_table16(ratio[g], zero ? zero[g] : 0.f, is_signed);
      lookup_codes16(lut, _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0 / 2)), first, second);
    }
    a = _mm256_cvtepi8_epi16(first);
    b = _mm256_cvtepi8_epi16(second);
  }
};

// 8 x 8 transpose of 32-bit words: r[i] word j -> r[j] word i
static inline void transpose8x8_epi32(__m256i* r) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
    r[4 + j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
  }
}

constexpr int64_t PANEL_COLUMNS = 64;  // output columns of a panel (a thread's block)
constexpr int64_t PANEL_PAIRS = 256;   // reduction pairs of a panel: [256][64] int32 words = 64 KB

// forward panel: weight rows n0 .. n0 + 8c - 1 (c blocks of 8), codes k0 .. k0 + kw - 1 (kw a multiple of 32):
// panel[p][j] = the int16 pair (w8[n0 + j, k0 + 2p], w8[n0 + j, k0 + 2p + 1])
static void forward_panel(const Int16Rows& w, int64_t n0, int64_t cols, int64_t k0, int64_t kw, int32_t* panel) {
  for (int64_t j0 = 0; j0 < cols; j0 += 8)
    for (int64_t k = 0; k < kw; k += 32) {
      __m256i a[8], b[8];
      for (int i = 0; i < 8; ++i) w.load32(n0 + j0 + i, k0 + k, a[i], b[i]);
      transpose8x8_epi32(a);
      transpose8x8_epi32(b);
      for (int i = 0; i < 8; ++i) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(panel + (k / 2 + i) * PANEL_COLUMNS + j0), a[i]);
        _mm256_store_si256(reinterpret_cast<__m256i*>(panel + (k / 2 + 8 + i) * PANEL_COLUMNS + j0), b[i]);
      }
    }
}

// grad-input panel: weight rows n0 .. n0 + 2 pairs - 1, codes k0 .. k0 + cols - 1 (cols 32 or 64):
// panel[p][j] = the int16 pair (w8[n0 + 2p, k0 + j], w8[n0 + 2p + 1, k0 + j])
static void grad_input_panel(const Int16Rows& w, int64_t n0, int64_t pairs, int64_t k0, int64_t cols,
                             int32_t* panel) {
  for (int64_t p = 0; p < pairs; ++p)
    for (int64_t k = 0; k < cols; k += 32) {
      __m256i x[2], y[2];  // rows 2p and 2p + 1: codes k .. k + 15, k + 16 .. k + 31
      w.load32(n0 + 2 * p, k0 + k, x[0], x[1]);
      w.load32(n0 + 2 * p + 1, k0 + k, y[0], y[1]);
      for (int h = 0; h < 2; ++h) {
        const __m256i lo = _mm256_unpacklo_epi16(x[h], y[h]), hi = _mm256_unpackhi_epi16(x[h], y[h]);
        int32_t* dst = panel + p * PANEL_COLUMNS + k + 16 * h;  // words of codes 0-3 | 8-11 in lo, 4-7 | 12-15 in hi
        _mm256_store_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_store_si256(reinterpret_cast<__m256i*>(dst + 8), _mm256_permute2x128_si256(lo, hi, 0x31));
      }
    }
}

// C[r, 0 .. 15] (+)= sum_p A[r, 2p] panel[p][.].lo + A[r, 2p + 1] panel[p][.].hi, r < R: int16 rows A (lda apart)
// times the panel's pairs (columns 0 .. 15 of it), int32 sums C (ldc apart)
template <int R>
static inline void madd_block(const int16_t* A, int64_t lda, const int32_t* panel, int64_t pairs, int32_t* C,
                              int64_t ldc, bool accumulate) {
  __m256i acc[R][2];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h)
      acc[r][h] = accumulate ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(C + r * ldc + 8 * h))
                             : _mm256_setzero_si256();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m256i b0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(panel + p * PANEL_COLUMNS));
    const __m256i b1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(panel + p * PANEL_COLUMNS + 8));
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + r * lda + 2 * p, 4);
      const __m256i a = _mm256_set1_epi32(pair);
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(a, b0));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(a, b1));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_si256(reinterpret_cast<__m256i*>(C + r * ldc + 8 * h), acc[r][h]);
}

// C[M, cols] (+)= A[M, 2 pairs] . panel: int8 rows A (lda apart) converted to int16 into a16 [M][2 pairs] (once per
// panel, read cols / 16 times), then blocks of 4 rows x 16 columns
static void madd_panel(const int8_t* A, int64_t lda, int64_t M, const int32_t* panel, int64_t pairs, int64_t cols,
                       int32_t* C, bool accumulate, int16_t* a16) {
  const int64_t width = 2 * pairs;  // a multiple of 16
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < width; i += 16) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(A + m * lda + i));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a16 + m * width + i), _mm256_cvtepi8_epi16(bytes));
    }
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int64_t rows = std::min<int64_t>(4, M - m0);
    for (int64_t c = 0; c < cols; c += 16) {
      const int16_t* a = a16 + m0 * width;
      int32_t* acc = C + m0 * PANEL_COLUMNS + c;
      switch (rows) {
        case 4: madd_block<4>(a, width, panel + c, pairs, acc, PANEL_COLUMNS, accumulate); break;
        case 3: madd_block<3>(a, width, panel + c, pairs, acc, PANEL_COLUMNS, accumulate); break;
        case 2: madd_block<2>(a, width, panel + c, pairs, acc, PANEL_COLUMNS, accumulate); break;
        default: madd_block<1>(a, width, panel + c, pairs, acc, PANEL_COLUMNS, accumulate);
      }
    }
  }
}

// a thread's buffers, freed at the end of its blocks: the int32 sums of its column block [M rounded up to 4][64], the
// weight panel, and the rows' int16 values of the panel's reduction steps [M][512] (1 KB a row)
struct MaddScratch {
  int32_t* sums;
  int32_t* panel;
  int16_t* a16;
  explicit MaddScratch(int64_t M)
      : sums(static_cast<int32_t*>(std::aligned_alloc(64, (M + 3) / 4 * 4 * PANEL_COLUMNS * 4))),
        panel(static_cast<int32_t*>(std::aligned_alloc(64, PANEL_PAIRS * PANEL_COLUMNS * 4))),
        a16(static_cast<int16_t*>(std::aligned_alloc(64, M * 2 * PANEL_PAIRS * 2))) {}
  ~MaddScratch() {
    std::free(sums);
    std::free(panel);
    std::free(a16);
  }
};

// out [M, C] = (A [M, R] int8 * row_step [M]) . W (* col_step [C]): the weight's int16 pairs of output columns
// c0 .. c0 + cols - 1 and reduction steps r0 .. r0 + width - 1 made into a panel by pack(c0, cols, r0, width, panel);
// each thread a block of 64 output columns at a time, its sums carried between panels of 512 reduction steps
template <typename Pack>
static void madd_product(const int8_t* A, int64_t M, int64_t R, int64_t C, Pack pack, const float* row_step,
                         const float* col_step, const torch::Tensor& out) {
  const bool bf16 = check_out(out, M, C);
  const int64_t ld = out.stride(0);
  void* o = out.data_ptr();
  parallel_for(0, (C + PANEL_COLUMNS - 1) / PANEL_COLUMNS, 1, [&](int64_t b, int64_t e) {
    MaddScratch scratch(M);
    for (int64_t cb = b; cb < e; ++cb) {
      const int64_t c0 = cb * PANEL_COLUMNS, cols = std::min(PANEL_COLUMNS, C - c0);
      for (int64_t r0 = 0; r0 < R; r0 += 2 * PANEL_PAIRS) {
        const int64_t width = std::min(2 * PANEL_PAIRS, R - r0);
        pack(c0, cols, r0, width, scratch.panel);
        madd_panel(A + r0, R, M, scratch.panel, width / 2, cols, scratch.sums, r0 > 0, scratch.a16);
      }
      store_products(scratch.sums, PANEL_COLUMNS, M, cols, row_step, col_step, o, ld, 0, c0, bf16);
    }
  });
}

// out [M, N] = (xq [M, K] int8 * x_step [M]) @ (w8 [N, K] * row_step [N])^T; K a multiple of 32, N of 16
void avx2_int8_linear(torch::Tensor xq, torch::Tensor x_step, torch::Tensor weight, c10::optional<torch::Tensor> ratio,
                      c10::optional<torch::Tensor> zero, bool is_signed, torch::Tensor row_step, torch::Tensor out) {
  TORCH_CHECK(xq.is_contiguous() && xq.scalar_type() == torch::kChar, "xq: contiguous int8 [M, K]");
  const int64_t M = xq.size(0), K = xq.size(1), N = weight.size(0);
  TORCH_CHECK(K % 32 == 0 && N % 16 == 0, "AVX2 int8 kernels: K a multiple of 32, N of 16");
  const Int16Rows w{packed_rows(weight, ratio, zero, is_signed, K, "AVX2 int8 kernels")};
  auto pack = [&](int64_t n0, int64_t cols, int64_t k0, int64_t width, int32_t* panel) {
    forward_panel(w, n0, cols, k0, width, panel);
  };
  madd_product(xq.data_ptr<int8_t>(), M, K, N, pack, x_step.data_ptr<float>(), row_step.data_ptr<float>(), out);
}

// out [M, K] = (gq [M, N] int8 * g_step [M]) @ w8 [N, K] (* col_step [K]); K a multiple of 32, N of 16
void avx2_int8_linear_grad_input(torch::Tensor gq, torch::Tensor g_step, torch::Tensor weight,
                                 c10::optional<torch::Tensor> ratio, c10::optional<torch::Tensor> zero,
                                 bool is_signed, c10::optional<torch::Tensor> col_step, int64_t K, torch::Tensor out) {
  TORCH_CHECK(gq.is_contiguous() && gq.scalar_type() == torch::kChar, "gq: contiguous int8 [M, N]");
  const int64_t M = gq.size(0), N = gq.size(1);
  TORCH_CHECK(K % 32 == 0 && N % 16 == 0 && weight.size(0) == N, "AVX2 int8 kernels: K a multiple of 32, N of 16");
  const Int16Rows w{packed_rows(weight, ratio, zero, is_signed, K, "AVX2 int8 kernels")};
  auto pack = [&](int64_t k0, int64_t cols, int64_t n0, int64_t width, int32_t* panel) {
    grad_input_panel(w, n0, width / 2, k0, cols, panel);
  };
  const float* cs = col_step.has_value() ? col_step->data_ptr<float>() : nullptr;
  madd_product(gq.data_ptr<int8_t>(), M, N, K, pack, g_step.data_ptr<float>(), cs, out);
}
"""

AVX2_INT8_FUNCTIONS = ["avx2_int8_linear", "avx2_int8_linear_grad_input"]
