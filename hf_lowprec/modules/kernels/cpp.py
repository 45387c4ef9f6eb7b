"""Hand-written C++ CPU kernels of the packed layers: int4 -> int8 unpacking, the outlier channels' weight columns,
per-row int8 quantization, column maxima, dequantization of int32 products, the tiled dequantize-and-multiply of the
``tiled`` backend, the chunked loss's cross-entropy that writes its gradient over the logits, the gradients of
SwiGLU's product, and the per-group weight-gradient sums of learned INT4 steps. The AMX tile kernels of the int8
backend (``amx.py``) build into the same extension.

Why by hand: nothing in torch/torchao unpacks INT4 groups to int8 for ``torch._int_mm``, and eager torch ops
around it make one pass over memory each (an int8 matmul is only worth it when the passes around it are
fused). Nothing multiplies by an INT4 weight both ways at training sizes either: torch's own
``_weight_int4pack_mm_for_cpu`` and ``_weight_int8pack_mm`` are made for a few tokens at a time and measure
0.01x and 0.03x an fp32 GEMM at 256 tokens (``benchmarks/kernel_speed.py``), and neither has a grad-input. The
``tiled_*`` kernels instead dequantize one cache-sized tile of the weight at a time and hand it to the fp32
(or bf16) GEMM of the CPU's BLAS: the arithmetic runs at that GEMM's speed, which is the fastest there is on
an AVX2 CPU, and the dense weight never exists whole. ``cross_entropy_`` exists because torch has no fused
cross-entropy-with-gradient on CPUs: ``torch.compile`` fuses one (``chunked_loss.py``'s fallback) but brings ~30 MB
of compiler runtime into the process and a second ``[tokens, vocab]`` buffer for the gradient. ``silu_mul_backward``:
one pass where eager fp32 torch ops make eight (``training/fused_blocks.py``; 4x faster at 256 x 8192).
``learned_step_sums``: the gradient of a packed layer's learned steps needs only per-group sums of its weight
gradient, plain and times the codes; torch ops make that gradient whole in fp32, unpack the codes and pass over it
~6 times (``packed.py``'s ``_learned_grads``): at Llama-3.2-1B shapes and 256 tokens in fp32 they take 1.0-1.7x this
kernel's time (``benchmarks/kernel_speed.py``); in bf16 the 1B recipe's step went from 7.94 to 4.20 s (``scale.py``;
both on a 2-core AVX512-BF16 EPYC).
``adamw8bit_``: torchao's 8-bit AdamW step in one pass per block, where its compiled CPU step takes 11x fp32 AdamW's
time (``training/adamw8bit.py``); bf16 weights are rounded once, to nearest or stochastically as torchao does.

The kernels build once per machine and CPU flags with the C++ compiler torch uses
(``torch.utils.cpp_extension``, ~45 s, cached under ``~/.cache/torch_extensions``). :func:`cpu_kernels`
returns ``None`` (and logs why) where they cannot build or run; callers then use torch ops.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import torch

from hf_lowprec.modules.kernels.amx import AMX_FUNCTIONS, AMX_SOURCE
from hf_lowprec.modules.kernels.avx2_int8 import AVX2_INT8_FUNCTIONS, AVX2_INT8_SOURCE
from hf_lowprec.modules.kernels.cpu import build_tag, cpu_info

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <optional>
#include <immintrin.h>
#include <cmath>
#include <limits>
#include <cstring>

// at::parallel_for whose body's tensor ops (a tile's mm, its copy_ into the caller's output) run alike on every
// thread, the caller's included: OpenMP's threads have their own thread-local state. Without autograd: with grad
// mode on there (its default), an mm of an input that requires grad recorded a graph, and 8 threads' copy_ into one
// output raced on its autograd metadata ("a leaf Variable that requires grad is being used in an in-place
// operation"); without autocast: under the caller's, its own tiles ran in bf16 and the other threads' in fp32; in
// the caller's InferenceMode: outside it, writing the inference tensors made under it raised. Only these:
// at::ThreadLocalStateGuard also copies Python objects (saved-tensor hooks), whose references need the GIL the caller
// holds while it waits for the threads (a deadlock)
template <typename F>
static void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& body) {
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    std::optional<c10::InferenceMode> inference_mode;
    if (inference) inference_mode.emplace();
    c10::NoGradGuard no_grad;
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    body(b, e);
  });
}

// ---------------------------------------------------------------------------------------------
// packed int4 (byte i: element 2i in the low nibble, 2i+1 in the high nibble) -> int8, per row n and
// group g: w8 = clamp(round_half_even((code - zero) * ratio[n, g]), -127, 127); the 16 possible values of a group
// (byte v: code v, or v - 16 for signed codes v >= 8) are a table looked up with one byte shuffle per 16 or 32
// codes. Shared by unpack_int4_int8 and the int8 tile kernels (avx2_int8.py, amx.py), so all make the same w8.
static inline __m128i group_table16(float ratio, float zero, bool is_signed) {
#if defined(__AVX512F__)
  const __m512 codes = is_signed ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1)
                                 : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 x = _mm512_mul_ps(_mm512_sub_ps(codes, _mm512_set1_ps(zero)), _mm512_set1_ps(ratio));
  x = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
  return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(x));
#else
  const __m256 c0 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 c1 = is_signed ? _mm256_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1)
                              : _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
  const __m256 z = _mm256_set1_ps(zero), r = _mm256_set1_ps(ratio);
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  auto values = [&](__m256 c) {
    __m256 x = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(c, z), r), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(x, lo), hi));
  };
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(values(c0), values(c1)), 0xD8);  // int16, in order
  return _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
#endif
}

// 16 bytes of packed codes -> their 32 int8 values through a group's table (group_table16): codes 0-15 in first,
// 16-31 in second
static inline void lookup_codes16(__m128i lut, __m128i bytes, __m128i& first, __m128i& second) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, mask));
  const __m128i high = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
  first = _mm_unpacklo_epi8(low, high);  // element 2i from the low nibble of byte i
  second = _mm_unpackhi_epi8(low, high);
}

// qweight [N, K / 2], ratio and zero [N, G]: rows may lie apart (a block of a weight's columns: whole groups);
// into_ (optional): a contiguous int8 [N, K] tensor to write (a reused scratch buffer), else a new one
torch::Tensor unpack_int4_int8(torch::Tensor qweight, torch::Tensor ratio, c10::optional<torch::Tensor> zero,
                               bool is_signed, int64_t K, c10::optional<torch::Tensor> into_) {
  TORCH_CHECK(qweight.stride(1) == 1 && ratio.stride(1) == 1 && ratio.scalar_type() == torch::kFloat &&
              (!zero.has_value() || (zero->stride(1) == 1 && zero->scalar_type() == torch::kFloat)),
              "unpack_int4_int8: rows of packed codes and fp32 ratio/zero, each row contiguous");
  const int64_t N = qweight.size(0), H = qweight.stride(0), G = ratio.size(1), RS = ratio.stride(0);
  const int64_t ZS = zero.has_value() ? zero->stride(0) : 0;
  TORCH_CHECK(qweight.size(1) * 2 == K && K % G == 0 && (K / G) % 2 == 0,
              "unpack_int4_int8: K / 2 bytes a row, a group size that divides K and is even");
  const int64_t gbytes = K / G / 2;  // packed bytes per group
  auto out = into_.has_value() ? *into_ : torch::empty({N, K}, qweight.options().dtype(torch::kInt8));
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == torch::kChar && out.size(0) == N && out.size(1) == K,
              "unpack_int4_int8: into must be a contiguous int8 [N, K] tensor");
  const uint8_t* qw = qweight.data_ptr<uint8_t>();
  const float* ra = ratio.data_ptr<float>();
  const float* ze = zero.has_value() ? zero->data_ptr<float>() : nullptr;
  int8_t* o = out.data_ptr<int8_t>();
  parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    alignas(16) int8_t table[16];
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int64_t n = b; n < e; ++n) {
      const uint8_t* row = qw + n * H;
      int8_t* orow = o + n * K;
      for (int64_t g = 0; g < G; ++g) {
        const __m128i values = group_table16(ra[n * RS + g], ze ? ze[n * ZS + g] : 0.f, is_signed);
        _mm_store_si128(reinterpret_cast<__m128i*>(table), values);  // for the group's last bytes, one at a time
        const __m256i lut = _mm256_broadcastsi128_si256(values);
        const uint8_t* src = row + g * gbytes;
        int8_t* dst = orow + g * gbytes * 2;
        int64_t i = 0;
        for (; i + 32 <= gbytes; i += 32) {
          __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
          __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(bytes, mask));
          __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask));
          __m256i a = _mm256_unpacklo_epi8(lo, hi);  // bytes 0-7 | 16-23, interleaved
          __m256i c = _mm256_unpackhi_epi8(lo, hi);  // bytes 8-15 | 24-31
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * i), _mm256_permute2x128_si256(a, c, 0x20));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * i + 32), _mm256_permute2x128_si256(a, c, 0x31));
        }
        for (; i + 16 <= gbytes; i += 16) {  // groups of 32 codes
          __m128i first, second;
          lookup_codes16(values, _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)), first, second);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i), first);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i + 16), second);
        }
        for (; i < gbytes; ++i) {
          dst[2 * i] = table[src[i] & 0x0F];
          dst[2 * i + 1] = table[src[i] >> 4];
        }
      }
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
static inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t float_to_bf16(float f) {  // round to nearest even (inputs are finite)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// round half to even for |x| < 2^22: adding and subtracting 1.5 * 2^23 leaves the integer part (vectorizes,
// unlike nearbyint in a loop)
static inline float round_even(float x) {
  const float magic = 12582912.f;
  return (x + magic) - magic;
}

// row m of x [M, C] (bf16 or fp32) into the fp32 buffer f [C]
template <bool BF16>
static inline void load_row(const void* xv, int64_t m, int64_t C, float* f) {
  if (BF16) {
    const uint16_t* x = static_cast<const uint16_t*>(xv) + m * C;
    #pragma omp simd
    for (int64_t c = 0; c < C; ++c) f[c] = bf16_to_float(x[c]);
  } else {
    std::memcpy(f, static_cast<const float*>(xv) + m * C, C * sizeof(float));
  }
}

// symmetric int8 per row of x [M, C] (times col_scale [C]): codes and fp32 steps [M, 1]. In place (q: x's own
// memory), rows go in order on one thread: row m is loaded whole before its codes, bytes [m C, (m + 1) C), overwrite
// only rows already read (they end where row m of 2- or 4-byte elements ends, or before)
template <bool BF16>
static void quantize_rows_impl(const void* xv, const float* cs, int8_t* q, float* step, int64_t M, int64_t C,
                               bool in_place) {
  auto rows = [&](int64_t b, int64_t e) {
    std::vector<float> buf(C);
    float* f = buf.data();
    for (int64_t m = b; m < e; ++m) {
      load_row<BF16>(xv, m, C, f);
      if (cs) {
        #pragma omp simd
        for (int64_t c = 0; c < C; ++c) f[c] *= cs[c];
      }
      float amax = 0.f;
      int nans = 0;  // std::max drops a NaN: counted apart, it makes the row's step NaN (its outputs NaN, as in fp32)
      #pragma omp simd reduction(max : amax) reduction(+ : nans)
      for (int64_t c = 0; c < C; ++c) {
        amax = std::max(amax, std::fabs(f[c]));
        nans += f[c] != f[c];
      }
      amax = nans ? std::numeric_limits<float>::quiet_NaN() : std::max(amax, 1e-30f);  // packed._SMALLEST_AMAX
      const float inv = 127.f / amax;
      int8_t* qr = q + m * C;
      // clamped before the integer cast, which is undefined for a NaN (fmax/fmin return the number)
      #pragma omp simd
      for (int64_t c = 0; c < C; ++c)
        qr[c] = static_cast<int8_t>(static_cast<int32_t>(round_even(std::fmin(std::fmax(f[c] * inv, -127.f), 127.f))));
      step[m] = amax / 127.f;
    }
  };
  if (in_place)
    rows(0, M);
  else
    parallel_for(0, M, 8, rows);
}

// in_place: the codes overwrite x (a view of its first M * C bytes is returned; x's values are gone)
std::vector<torch::Tensor> quantize_rows(torch::Tensor x, c10::optional<torch::Tensor> col_scale, bool in_place) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous());
  const int64_t M = x.size(0), C = x.size(1);
  auto q = in_place ? x.view(torch::kInt8).view({-1}).slice(0, 0, M * C).view({M, C})
                    : torch::empty({M, C}, x.options().dtype(torch::kInt8));
  auto step = torch::empty({M, 1}, x.options().dtype(torch::kFloat));
  const float* cs = col_scale.has_value() ? col_scale->data_ptr<float>() : nullptr;
  if (x.scalar_type() == torch::kBFloat16)
    quantize_rows_impl<true>(x.data_ptr(), cs, q.data_ptr<int8_t>(), step.data_ptr<float>(), M, C, in_place);
  else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat);
    quantize_rows_impl<false>(x.data_ptr(), cs, q.data_ptr<int8_t>(), step.data_ptr<float>(), M, C, in_place);
  }
  return {q, step};
}

// max over rows of |x [M, C]| (times col_scale [C]) -> fp32 [C]: each thread reduces a block of rows into
// its own partial row, the partials are reduced at the end
template <bool BF16>
static void column_absmax_impl(const void* xv, const float* cs, float* out, int64_t M, int64_t C) {
  const int64_t threads = at::get_num_threads();
  std::vector<float> partial(threads * C, 0.f);
  parallel_for(0, M, 64, [&](int64_t b, int64_t e) {
    float* p = partial.data() + at::get_thread_num() * C;
    std::vector<float> buf(C);
    float* f = buf.data();
    for (int64_t m = b; m < e; ++m) {
      load_row<BF16>(xv, m, C, f);
      #pragma omp simd
      for (int64_t c = 0; c < C; ++c) {
        const float a = f[c] < 0.f ? -f[c] : f[c];
        p[c] = p[c] > a ? p[c] : a;
      }
    }
  });
  for (int64_t c = 0; c < C; ++c) {
    float v = 0.f;
    for (int64_t t = 0; t < threads; ++t) v = std::max(v, partial[t * C + c]);
    out[c] = cs ? v * std::fabs(cs[c]) : v;
  }
}

torch::Tensor column_absmax(torch::Tensor x, c10::optional<torch::Tensor> col_scale) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous());
  const int64_t M = x.size(0), C = x.size(1);
  auto out = torch::empty({C}, x.options().dtype(torch::kFloat));
  const float* cs = col_scale.has_value() ? col_scale->data_ptr<float>() : nullptr;
  if (x.scalar_type() == torch::kBFloat16)
    column_absmax_impl<true>(x.data_ptr(), cs, out.data_ptr<float>(), M, C);
  else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat);
    column_absmax_impl<false>(x.data_ptr(), cs, out.data_ptr<float>(), M, C);
  }
  return out;
}

// acc [M, C] (int32 or int8) * row [M] (* col [C]) -> bf16 or fp32 rows ld elements apart
template <typename In, bool BF16>
static void dequant_impl(const In* acc, const float* rs, const float* cs, void* outv, int64_t M, int64_t C,
                         int64_t ld) {
  parallel_for(0, M, 8, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      const In* a = acc + m * C;
      const float r = rs[m];
      if (BF16) {
        uint16_t* o = static_cast<uint16_t*>(outv) + m * ld;
        #pragma omp simd
        for (int64_t c = 0; c < C; ++c) o[c] = float_to_bf16(static_cast<float>(a[c]) * r * (cs ? cs[c] : 1.f));
      } else {
        float* o = static_cast<float*>(outv) + m * ld;
        #pragma omp simd
        for (int64_t c = 0; c < C; ++c) o[c] = static_cast<float>(a[c]) * r * (cs ? cs[c] : 1.f);
      }
    }
  });
}

// into out when given: a [M, C] view whose rows may lie further apart (a block of columns of a wider output)
torch::Tensor dequantize(torch::Tensor acc, torch::Tensor row_step, c10::optional<torch::Tensor> col_step,
                         at::ScalarType dtype, c10::optional<torch::Tensor> out_arg) {
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && row_step.is_contiguous());
  const int64_t M = acc.size(0), C = acc.size(1);
  auto out = out_arg.has_value() ? *out_arg : torch::empty({M, C}, acc.options().dtype(dtype));
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == C && out.scalar_type() == dtype &&
              (out.stride(1) == 1 || C == 1) && (out.stride(0) >= C || M == 1), "out: a [M, C] view of rows");
  const int64_t ld = M == 1 ? C : out.stride(0);
  const float* cs = col_step.has_value() ? col_step->data_ptr<float>() : nullptr;
  const float* rs = row_step.data_ptr<float>();
  const bool bf16 = dtype == torch::kBFloat16;
  TORCH_CHECK(bf16 || dtype == torch::kFloat);
  if (acc.scalar_type() == torch::kInt) {
    if (bf16) dequant_impl<int32_t, true>(acc.data_ptr<int32_t>(), rs, cs, out.data_ptr(), M, C, ld);
    else dequant_impl<int32_t, false>(acc.data_ptr<int32_t>(), rs, cs, out.data_ptr(), M, C, ld);
  } else {
    TORCH_CHECK(acc.scalar_type() == torch::kChar);
    if (bf16) dequant_impl<int8_t, true>(acc.data_ptr<int8_t>(), rs, cs, out.data_ptr(), M, C, ld);
    else dequant_impl<int8_t, false>(acc.data_ptr<int8_t>(), rs, cs, out.data_ptr(), M, C, ld);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// exp(x) for x <= 0 within a few fp32 ulp: 2^n p(r), x = n ln2 + r, |r| <= ln2 / 2, p of degree 6 (this loop
// vectorizes; std::exp in it would not); below -87 it gives exp(-87), a term under 1e-37 of a sum >= 1
static inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = round_even(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// sigmoid(x) = 1 / (1 + exp(-x)) through exp of -|x| (no overflow), vectorizable
static inline float sigmoid(float x) {
  const float e = exp_nonpositive(x < 0.f ? x : -x);
  const float s = 1.f / (1.f + e);
  return x < 0.f ? e * s : s;
}

static inline float load_value(const void* p, int64_t i, bool bf16) {
  return bf16 ? bf16_to_float(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

static inline void store_value(void* p, int64_t i, float v, bool bf16) {
  if (bf16) static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
  else static_cast<float*>(p)[i] = v;
}

// ---------------------------------------------------------------------------------------------
// the operands of a column gather (gather_columns, int4_columns) of an [N, K] weight: checked, the columns returned
static const int64_t* checked_columns(const char* kernel, int64_t N, int64_t K, const torch::Tensor& columns,
                                      const torch::Tensor& row_step, const torch::Tensor& out) {
  const int64_t C = columns.numel();
  TORCH_CHECK(columns.is_contiguous() && columns.scalar_type() == torch::kLong, "columns: contiguous int64 [k]");
  TORCH_CHECK(row_step.is_contiguous() && row_step.scalar_type() == torch::kFloat && row_step.numel() == N,
              "row_step: contiguous fp32 [N]");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == N && out.size(1) == C &&
              (out.scalar_type() == torch::kBFloat16 || out.scalar_type() == torch::kFloat),
              "out: contiguous bf16 or fp32 [N, k]");
  const int64_t* col = columns.data_ptr<int64_t>();
  for (int64_t j = 0; j < C; ++j) TORCH_CHECK(col[j] >= 0 && col[j] < K, kernel, ": column out of range");
  return col;
}

// out[n, j] = w8[n, columns[j]] * row_step[n] in out's dtype (bf16 or fp32), rounded once: the int8 weight's columns
// of the int8 backend's outlier channels. torch's index_select along dim 1 took 2.5x this kernel's time (a 128k x 2048
// head, 8 columns: 18.8 vs 7.4 ms on a 2-core AMX Xeon; packed.py's weight_columns)
void gather_columns(torch::Tensor w8, torch::Tensor columns, torch::Tensor row_step, torch::Tensor out) {
  TORCH_CHECK(w8.is_contiguous() && w8.scalar_type() == torch::kChar && w8.dim() == 2, "w8: contiguous int8 [N, K]");
  const int64_t N = w8.size(0), K = w8.size(1), C = columns.numel();
  const int64_t* col = checked_columns("gather_columns", N, K, columns, row_step, out);
  const int8_t* w = w8.data_ptr<int8_t>();
  const float* rs = row_step.data_ptr<float>();
  void* o = out.data_ptr();
  const bool bf16 = out.scalar_type() == torch::kBFloat16;
  parallel_for(0, N, 1024, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      const int8_t* row = w + n * K;
      for (int64_t j = 0; j < C; ++j) store_value(o, n * C + j, static_cast<float>(row[col[j]]) * rs[n], bf16);
    }
  });
}

// gather_columns of an INT4 weight's int8 values (unpack_int4_int8's), read from the packed codes: where the AMX
// kernels multiply without ever unpacking the whole weight (amx.py)
void int4_columns(torch::Tensor qweight, torch::Tensor ratio, c10::optional<torch::Tensor> zero, bool is_signed,
                  int64_t K, torch::Tensor columns, torch::Tensor row_step, torch::Tensor out) {
  TORCH_CHECK(qweight.is_contiguous() && qweight.scalar_type() == torch::kByte && qweight.size(1) * 2 >= K,
              "qweight: contiguous uint8 [N, K / 2]");
  TORCH_CHECK(ratio.is_contiguous() && ratio.scalar_type() == torch::kFloat, "ratio: contiguous fp32 [N, G]");
  const int64_t N = qweight.size(0), H = qweight.size(1), G = ratio.size(1), C = columns.numel(), group = K / G;
  const int64_t* col = checked_columns("int4_columns", N, K, columns, row_step, out);
  const uint8_t* qw = qweight.data_ptr<uint8_t>();
  const float* ra = ratio.data_ptr<float>();
  const float* ze = zero.has_value() ? zero->data_ptr<float>() : nullptr;
  const float* rs = row_step.data_ptr<float>();
  void* o = out.data_ptr();
  const bool bf16 = out.scalar_type() == torch::kBFloat16;
  parallel_for(0, N, 1024, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n)
      for (int64_t j = 0; j < C; ++j) {
        const int64_t k = col[j], g = n * G + k / group;
        const int v = (qw[n * H + k / 2] >> (4 * (k & 1))) & 0x0F;
        const int code = is_signed ? (v < 8 ? v : v - 16) : v;
        float x = std::nearbyint((static_cast<float>(code) - (ze ? ze[g] : 0.f)) * ra[g]);
        x = std::max(-127.f, std::min(127.f, x));
        store_value(o, n * C + j, x * rs[n], bf16);
      }
  });
}

// element i is read whole before it is written: dg and du may be g and u themselves
template <bool BF16>
static void silu_mul_backward_impl(const void* gr, const void* g, const void* u, void* dg, void* du, int64_t n) {
  parallel_for(0, n, 1 << 14, [&](int64_t b, int64_t e) {
    #pragma omp simd
    for (int64_t i = b; i < e; ++i) {
      const float x = load_value(g, i, BF16), d = load_value(gr, i, BF16), y = load_value(u, i, BF16);
      const float s = sigmoid(x), silu = x * s;
      store_value(du, i, d * silu, BF16);
      store_value(dg, i, d * y * (s + silu * (1.f - s)), BF16);
    }
  });
}

static bool check_elementwise(const std::vector<torch::Tensor>& ts) {
  for (const auto& t : ts) {
    TORCH_CHECK(t.is_contiguous() && t.sizes() == ts[0].sizes() && t.scalar_type() == ts[0].scalar_type());
  }
  TORCH_CHECK(ts[0].scalar_type() == torch::kBFloat16 || ts[0].scalar_type() == torch::kFloat);
  return ts[0].scalar_type() == torch::kBFloat16;
}

// in_place: the gradients overwrite gate and up (returned as them)
std::vector<torch::Tensor> silu_mul_backward(torch::Tensor grad, torch::Tensor gate, torch::Tensor up, bool in_place) {
  const bool bf16 = check_elementwise({grad, gate, up});  // SwiGLU's gradients, elementwise in fp32
  auto dg = in_place ? gate : torch::empty_like(gate), du = in_place ? up : torch::empty_like(up);
  const void *r = grad.data_ptr(), *g = gate.data_ptr(), *u = up.data_ptr();
  if (bf16) silu_mul_backward_impl<true>(r, g, u, dg.data_ptr(), du.data_ptr(), gate.numel());
  else silu_mul_backward_impl<false>(r, g, u, dg.data_ptr(), du.data_ptr(), gate.numel());
  return {dg, du};
}

// ---------------------------------------------------------------------------------------------
// one AdamW step of fp32 `param` with torchao's 8-bit states (OptimState8bit: uint8 codes into a sorted 256-entry
// qmap, one fp32 scale = block absmax per `block` elements), torchao's single_param_adam in one pass per block:
// dequantize m and v, decay the weight, lerp m to g and v to g^2, re-quantize both (scale, branchless binary
// search, round to the nearer code), then step with the unquantized m and v.
// codes[i] = the index of the qmap entry nearest to x[i] (ties up), for n values: a branchless binary search over
// the 256 sorted entries, one step at a time across all n values so that each step vectorizes (gathers from q)
static void nearest_codes(const float* x, const float* q, int32_t* c, uint8_t* codes, int64_t n) {
  #pragma omp simd
  for (int64_t i = 0; i < n; ++i) c[i] = x[i] >= q[128] ? 128 : 0;
  for (int32_t half = 64; half >= 1; half >>= 1) {
    #pragma omp simd
    for (int64_t i = 0; i < n; ++i) c[i] += x[i] >= q[c[i] + half] ? half : 0;
  }
  #pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const int32_t up = std::min(c[i] + 1, 255);
    const float lo = q[c[i]];
    codes[i] = static_cast<uint8_t>(x[i] - lo >= (q[up] - lo) * 0.5f ? up : c[i]);
  }
}

// lowbias32 (C. Wellons): a 32-bit integer hash whose multiplies vectorize on AVX2
static inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// 16 random bits for element i of a stochastic rounding keyed by one draw: counter-based, so the same bits whatever
// the thread split, and no generator state to keep
static inline uint32_t random16(uint32_t key, uint32_t i) { return mix32(i ^ key) & 0xFFFFu; }

// fp32 -> bf16 rounded away from zero with probability (low 16 bits) / 2^16, as torchao's _fp32_to_bf16_sr
static inline uint16_t float_to_bf16_stochastic(float f, uint32_t r16) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t toward_zero = bits & 0xFFFF0000u;
  return static_cast<uint16_t>(((bits & 0xFFFFu) > r16 ? toward_zero + 0x10000u : toward_zero) >> 16);
}

// torchao's single_param_adam on one tensor with 8-bit states (param and grad fp32, or both bf16: updated in fp32 and
// rounded once, to nearest, or stochastically with seed >= 0)
template <bool BF16>
static void adamw8bit_impl(void* pv, const void* gv, torch::Tensor& m_codes, torch::Tensor& m_scale,
                           const torch::Tensor& m_qmap, torch::Tensor& v_codes, torch::Tensor& v_scale,
                           const torch::Tensor& v_qmap, double lr, double beta1, double beta2, double weight_decay,
                           double eps, double bias_correction1, double bias_correction2, int64_t seed) {
  const int64_t blocks = m_scale.numel(), block = m_codes.numel() / blocks;
  uint8_t *mc = m_codes.data_ptr<uint8_t>(), *vc = v_codes.data_ptr<uint8_t>();
  float *ms = m_scale.data_ptr<float>(), *vs = v_scale.data_ptr<float>();
  const float *mq = m_qmap.data_ptr<float>(), *vq = v_qmap.data_ptr<float>();
  const float decay = static_cast<float>(lr) * static_cast<float>(weight_decay), lr_f = static_cast<float>(lr);
  const float w1 = static_cast<float>(1.0 - beta1), w2 = static_cast<float>(1.0 - beta2);
  const float bc1 = static_cast<float>(bias_correction1), sqrt_bc2 = std::sqrt(static_cast<float>(bias_correction2));
  const float eps_f = static_cast<float>(eps);
  const bool stochastic = seed >= 0;
  const uint32_t key = mix32(static_cast<uint32_t>(seed) ^ mix32(static_cast<uint32_t>(seed >> 32)));
  parallel_for(0, blocks, 16, [&](int64_t b, int64_t e) {
    std::vector<float> m(block), v(block), x(block);
    std::vector<int32_t> c(block);
    for (int64_t k = b; k < e; ++k) {
      const int64_t o = k * block;
      float m_max = 0.f, v_max = 0.f;
      #pragma omp simd reduction(max : m_max, v_max)
      for (int64_t i = 0; i < block; ++i) {
        const float gi = load_value(gv, o + i, BF16);
        const float mi = mq[mc[o + i]] * ms[k], vi = vq[vc[o + i]] * vs[k];
        m[i] = std::fma(w1, gi - mi, mi);  // torch.lerp's vectorized form for a weight below 0.5
        v[i] = std::fma(w2, gi * gi - vi, vi);
        m_max = std::max(m_max, std::abs(m[i]));
        v_max = std::max(v_max, std::abs(v[i]));
      }
      ms[k] = m_max = std::max(m_max, 1e-12f);
      vs[k] = v_max = std::max(v_max, 1e-12f);
      #pragma omp simd
      for (int64_t i = 0; i < block; ++i) x[i] = m[i] / m_max;
      nearest_codes(x.data(), mq, c.data(), mc + o, block);
      #pragma omp simd
      for (int64_t i = 0; i < block; ++i) x[i] = v[i] / v_max;
      nearest_codes(x.data(), vq, c.data(), vc + o, block);
      #pragma omp simd
      for (int64_t i = 0; i < block; ++i) {
        const float p0 = load_value(pv, o + i, BF16);
        const float pi = p0 - decay * p0;
        const float updated = pi - lr_f * (m[i] / bc1) / (std::sqrt(v[i]) / sqrt_bc2 + eps_f);
        if (BF16 && stochastic)
          static_cast<uint16_t*>(pv)[o + i] = float_to_bf16_stochastic(updated, random16(key, o + i));
        else
          store_value(pv, o + i, updated, BF16);
      }
    }
  });
}

void adamw8bit_(torch::Tensor param, torch::Tensor grad, torch::Tensor m_codes, torch::Tensor m_scale,
                torch::Tensor m_qmap, torch::Tensor v_codes, torch::Tensor v_scale, torch::Tensor v_qmap, double lr,
                double beta1, double beta2, double weight_decay, double eps, double bias_correction1,
                double bias_correction2, int64_t seed) {
  const bool bf16 = param.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(param.scalar_type() == torch::kFloat || bf16, "fp32 or bf16 parameters expected");
  TORCH_CHECK(grad.scalar_type() == param.scalar_type(), "the gradient's dtype must be the parameter's");
  TORCH_CHECK(seed < 0 || bf16, "stochastic rounding (seed >= 0) is for bf16 parameters");
  TORCH_CHECK(param.is_contiguous() && grad.is_contiguous(), "contiguous parameter and gradient expected");
  for (const auto& t : {m_scale, m_qmap, v_scale, v_qmap})
    TORCH_CHECK(t.is_contiguous() && t.scalar_type() == torch::kFloat, "fp32 contiguous states expected");
  TORCH_CHECK(m_codes.is_contiguous() && v_codes.is_contiguous() && m_codes.scalar_type() == torch::kByte);
  TORCH_CHECK(grad.numel() == param.numel() && m_codes.numel() == param.numel() && v_codes.numel() == param.numel());
  TORCH_CHECK(m_qmap.numel() == 256 && v_qmap.numel() == 256 && m_scale.numel() == v_scale.numel());
  TORCH_CHECK((param.numel() / m_scale.numel()) * m_scale.numel() == param.numel(),
              "the states' blocks must tile the parameter");
  TORCH_CHECK(param.numel() < (int64_t(1) << 32), "at most 2^32 elements per parameter");
  if (bf16)
    adamw8bit_impl<true>(param.data_ptr(), grad.data_ptr(), m_codes, m_scale, m_qmap, v_codes, v_scale, v_qmap, lr,
                         beta1, beta2, weight_decay, eps, bias_correction1, bias_correction2, seed);
  else
    adamw8bit_impl<false>(param.data_ptr(), grad.data_ptr(), m_codes, m_scale, m_qmap, v_codes, v_scale, v_qmap, lr,
                          beta1, beta2, weight_decay, eps, bias_correction1, bias_correction2, seed);
}

// cross-entropy of the rows of logits [C, V] (bf16 or fp32) against labels [C] (ignore: no loss, zero gradient),
// summed; the gradient softmax - onehot overwrites the logits (fp32 math, one rounding to their dtype)
template <bool BF16>
static double cross_entropy_impl(void* xv, const int64_t* labels, int64_t C, int64_t V, int64_t ignore) {
  std::vector<double> row_loss(C, 0.0);
  parallel_for(0, C, 1, [&](int64_t b, int64_t e) {
    std::vector<float> buf(V);
    float* f = buf.data();
    for (int64_t c = b; c < e; ++c) {
      load_row<BF16>(xv, c, V, f);
      const bool valid = labels[c] != ignore;
      float mx = -INFINITY;
      #pragma omp simd reduction(max : mx)
      for (int64_t v = 0; v < V; ++v) mx = std::max(mx, f[v]);
      const float target = valid ? f[labels[c]] : 0.f;
      float sum = 0.f;
      #pragma omp simd reduction(+ : sum)
      for (int64_t v = 0; v < V; ++v) {
        f[v] = exp_nonpositive(f[v] - mx);
        sum += f[v];
      }
      const float inv = valid ? 1.f / sum : 0.f;
      if (valid) {
        row_loss[c] = static_cast<double>(mx) + std::log(static_cast<double>(sum)) - target;
        f[labels[c]] -= sum;  // (e - sum) / sum = softmax - 1 at the label
      }
      if (BF16) {
        uint16_t* o = static_cast<uint16_t*>(xv) + c * V;
        #pragma omp simd
        for (int64_t v = 0; v < V; ++v) o[v] = float_to_bf16(f[v] * inv);
      } else {
        float* o = static_cast<float*>(xv) + c * V;
        #pragma omp simd
        for (int64_t v = 0; v < V; ++v) o[v] = f[v] * inv;
      }
    }
  });
  double total = 0.0;
  for (double l : row_loss) total += l;
  return total;
}

torch::Tensor cross_entropy_(torch::Tensor logits, torch::Tensor labels, int64_t ignore) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && labels.dim() == 1 && labels.is_contiguous());
  TORCH_CHECK(labels.scalar_type() == torch::kLong && labels.size(0) == logits.size(0));
  const int64_t C = logits.size(0), V = logits.size(1);
  const int64_t* lab = labels.data_ptr<int64_t>();
  for (int64_t c = 0; c < C; ++c)
    TORCH_CHECK(lab[c] == ignore || (lab[c] >= 0 && lab[c] < V), "label ", lab[c], " outside [0, ", V, ")");
  double total;
  if (logits.scalar_type() == torch::kBFloat16) total = cross_entropy_impl<true>(logits.data_ptr(), lab, C, V, ignore);
  else {
    TORCH_CHECK(logits.scalar_type() == torch::kFloat);
    total = cross_entropy_impl<false>(logits.data_ptr(), lab, C, V, ignore);
  }
  return torch::full({}, total, logits.options().dtype(torch::kFloat));
}

// ---------------------------------------------------------------------------------------------
// Tiled dequantize-and-multiply: the packed weight is dequantized one tile at a time into a per-thread
// buffer that stays in cache and multiplied there by a single-threaded at::mm; the whole dense weight is
// never materialized. W[n, k] = (code[n, k] - zero[n, g]) * step[n, g] * inv[k], g = k / (K / G).

// codes of row `row` for columns [k0, k1) (k0 even) into f (as floats)
template <bool INT4>
static inline void row_codes(const uint8_t* row, int64_t k0, int64_t k1, bool is_signed, float* f) {
  if (INT4) {
    const int64_t W = k1 - k0;
    const uint8_t* src = row + k0 / 2;
    if (is_signed) {
      #pragma omp simd
      for (int64_t i = 0; i < W / 2; ++i) {
        const int8_t b = static_cast<int8_t>(src[i]);
        f[2 * i] = static_cast<float>(static_cast<int8_t>(b << 4) >> 4);
        f[2 * i + 1] = static_cast<float>(b >> 4);
      }
    } else {
      #pragma omp simd
      for (int64_t i = 0; i < W / 2; ++i) {
        f[2 * i] = static_cast<float>(src[i] & 0x0F);
        f[2 * i + 1] = static_cast<float>(src[i] >> 4);
      }
    }
  } else {
    const int8_t* src = reinterpret_cast<const int8_t*>(row) + k0;
    #pragma omp simd
    for (int64_t i = 0; i < k1 - k0; ++i) f[i] = static_cast<float>(src[i]);
  }
}

struct PackedWeight {
  const uint8_t* qw; int64_t row_bytes; const float* step; const float* zero; const float* inv;
  int64_t G, gsize; bool is_signed;
};

// rows [n0, n1) x columns [k0, k1) (k0 even) of the dense weight into out [n1-n0, k1-k0]
template <bool INT4, bool BF16>
static void dequant_tile(const PackedWeight& w, int64_t n0, int64_t n1, int64_t k0, int64_t k1, void* outv, float* f) {
  const int64_t W = k1 - k0;
  for (int64_t n = n0; n < n1; ++n) {
    row_codes<INT4>(w.qw + n * w.row_bytes, k0, k1, w.is_signed, f);
    for (int64_t k = k0; k < k1;) {  // one group (or the part of it inside the tile) at a time
      const int64_t g = k / w.gsize, end = std::min(k1, (g + 1) * w.gsize);
      const float s = w.step[n * w.G + g], z = w.zero ? w.zero[n * w.G + g] : 0.f;
      float* fg = f + (k - k0);
      #pragma omp simd
      for (int64_t i = 0; i < end - k; ++i) fg[i] = (fg[i] - z) * s;
      k = end;
    }
    if (w.inv) {
      #pragma omp simd
      for (int64_t i = 0; i < W; ++i) f[i] *= w.inv[k0 + i];
    }
    if (BF16) {
      uint16_t* o = static_cast<uint16_t*>(outv) + (n - n0) * W;
      #pragma omp simd
      for (int64_t i = 0; i < W; ++i) o[i] = float_to_bf16(f[i]);
    } else {
      std::memcpy(static_cast<float*>(outv) + (n - n0) * W, f, W * sizeof(float));
    }
  }
}

// rows [n0, n1) x columns [k0, k1) of W into `tile` [n1-n0, k1-k0] (fp32 or bf16); f: k1-k0 floats of scratch
static void dequant(const PackedWeight& w, bool int4, int64_t n0, int64_t n1, int64_t k0, int64_t k1,
                    torch::Tensor& tile, float* f) {
  const bool bf16 = tile.scalar_type() == torch::kBFloat16;
  if (int4 && bf16) dequant_tile<true, true>(w, n0, n1, k0, k1, tile.data_ptr(), f);
  else if (int4) dequant_tile<true, false>(w, n0, n1, k0, k1, tile.data_ptr(), f);
  else if (bf16) dequant_tile<false, true>(w, n0, n1, k0, k1, tile.data_ptr(), f);
  else dequant_tile<false, false>(w, n0, n1, k0, k1, tile.data_ptr(), f);
}

static PackedWeight packed_weight(const torch::Tensor& qweight, const torch::Tensor& step,
                                  const c10::optional<torch::Tensor>& zero, const c10::optional<torch::Tensor>& inv,
                                  int64_t K, int64_t gsize, bool is_signed) {
  TORCH_CHECK(qweight.is_contiguous() && step.is_contiguous() && step.scalar_type() == torch::kFloat);
  const int64_t G = step.size(1);
  TORCH_CHECK(K % 2 == 0 && (K + gsize - 1) / gsize == G, "K must be even and step hold ceil(K / group size) groups");
  return {qweight.data_ptr<uint8_t>(), qweight.size(1), step.data_ptr<float>(),
          zero.has_value() ? zero->data_ptr<float>() : nullptr, inv.has_value() ? inv->data_ptr<float>() : nullptr,
          G, gsize, is_signed};
}

// body(t, scratch tensor of `elems` in `options`, scratch floats of `floats`) for each of `tiles` tiles, in parallel;
// the BLAS calls inside a parallel region run single-threaded, each on its thread's cache-resident tile
template <typename Body>
static void for_each_tile(int64_t tiles, int64_t elems, int64_t floats, const torch::TensorOptions& options,
                          Body body) {
  parallel_for(0, tiles, 1, [&](int64_t b, int64_t e) {
    auto scratch = torch::empty({elems}, options);
    std::vector<float> f(floats);
    for (int64_t t = b; t < e; ++t) body(t, scratch, f.data());
  });
}

static void check_rows(const torch::Tensor& a, int64_t cols) {
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && a.size(1) == cols);
  TORCH_CHECK(a.scalar_type() == torch::kFloat || a.scalar_type() == torch::kBFloat16);
}

// y [M, N] = x [M, K] @ W^T, parallel over tiles of `tile` output rows
torch::Tensor tiled_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor step,
                           c10::optional<torch::Tensor> zero, c10::optional<torch::Tensor> inv, int64_t K,
                           int64_t gsize, bool is_signed, bool int4, int64_t tile) {
  check_rows(x, K);
  const PackedWeight w = packed_weight(qweight, step, zero, inv, K, gsize, is_signed);
  const int64_t N = qweight.size(0);
  auto out = torch::empty({x.size(0), N}, x.options());
  for_each_tile((N + tile - 1) / tile, tile * K, K, x.options(), [&](int64_t t, torch::Tensor& scratch, float* f) {
    const int64_t n0 = t * tile, rows = std::min(tile, N - n0);
    auto wt = scratch.narrow(0, 0, rows * K).view({rows, K});
    dequant(w, int4, n0, n0 + rows, 0, K, wt, f);
    out.narrow(1, n0, rows).copy_(at::mm(x, wt.t()));
  });
  return out;
}

// grad_x [M, K] = g [M, N] @ W, parallel over tiles of `tile` (even) input columns
torch::Tensor tiled_linear_grad_input(torch::Tensor g, torch::Tensor qweight, torch::Tensor step,
                                      c10::optional<torch::Tensor> zero, c10::optional<torch::Tensor> inv, int64_t K,
                                      int64_t gsize, bool is_signed, bool int4, int64_t tile) {
  const int64_t N = qweight.size(0);
  check_rows(g, N);
  TORCH_CHECK(tile % 2 == 0, "the column tile must be even");
  const PackedWeight w = packed_weight(qweight, step, zero, inv, K, gsize, is_signed);
  auto out = torch::empty({g.size(0), K}, g.options());
  for_each_tile((K + tile - 1) / tile, N * tile, tile, g.options(), [&](int64_t t, torch::Tensor& scratch, float* f) {
    const int64_t k0 = t * tile, cols = std::min(tile, K - k0);
    auto wt = scratch.narrow(0, 0, N * cols).view({N, cols});
    dequant(w, int4, 0, N, k0, k0 + cols, wt, f);
    out.narrow(1, k0, cols).copy_(at::mm(g, wt));
  });
  return out;
}

// grad_x [M, K] = g [M, N] @ W for a tall W (an output head: N >> K), parallel over tiles of `tile` weight rows: each
// thread adds its tiles' products g[:, rows] @ W[rows] into an fp32 [M, K] of its own (a bf16 product is rounded once
// before it is added), and g is read once; a column tile of tiled_linear_grad_input holds N x tile elements
torch::Tensor tiled_linear_grad_input_rows(torch::Tensor g, torch::Tensor qweight, torch::Tensor step,
                                           c10::optional<torch::Tensor> zero, c10::optional<torch::Tensor> inv,
                                           int64_t K, int64_t gsize, bool is_signed, bool int4, int64_t tile) {
  const int64_t N = qweight.size(0), M = g.size(0);
  check_rows(g, N);
  const PackedWeight w = packed_weight(qweight, step, zero, inv, K, gsize, is_signed);
  auto partial = torch::zeros({at::get_num_threads(), M, K}, g.options().dtype(torch::kFloat));
  // the scratch also holds a bf16 tile's product: a tensor made per tile costs a fresh mapping (and its page faults)
  // where glibc maps every block of 64 KiB or more (the 128k head in bf16: 0.25 s instead of 0.07 a chunk)
  for_each_tile((N + tile - 1) / tile, (tile + M) * K, K, g.options(), [&](int64_t t, torch::Tensor& scratch, float* f) {
    const int64_t n0 = t * tile, rows = std::min(tile, N - n0);
    auto wt = scratch.narrow(0, 0, rows * K).view({rows, K});
    dequant(w, int4, n0, n0 + rows, 0, K, wt, f);
    auto acc = partial[at::get_thread_num()];
    if (g.scalar_type() == torch::kFloat) {
      acc.addmm_(g.narrow(1, n0, rows), wt);
    } else {
      auto product = scratch.narrow(0, tile * K, M * K).view({M, K});
      acc.add_(at::mm_out(product, g.narrow(1, n0, rows), wt));
    }
  });
  return partial.sum(0).to(g.scalar_type());
}

// per-group sums of the weight gradient G = g^T x (g [M, N], x [M, K]) that learned INT4 steps need (packed.py's
// _learned_grads): S[n, j] = sum_{k in group j} G[n, k] inv[k] and C[n, j] = the same sum of G[n, k] inv[k] code[n, k],
// fp32 [N, groups] each. Parallel over tiles of `tile` weight rows: each thread's BLAS makes its tile of G
// (single-threaded, cache-resident) and one pass reduces it against the packed codes; G never exists whole
std::vector<torch::Tensor> learned_step_sums(torch::Tensor g, torch::Tensor x, torch::Tensor qweight,
                                             c10::optional<torch::Tensor> inv, int64_t gsize, bool is_signed,
                                             int64_t tile) {
  const int64_t N = qweight.size(0), K = x.size(1), H = qweight.size(1);
  check_rows(g, N);
  check_rows(x, K);
  TORCH_CHECK(g.scalar_type() == x.scalar_type() && qweight.is_contiguous() && H * 2 == K && gsize % 2 == 0 &&
              K % gsize == 0, "learned_step_sums: int4 codes [N, K/2] with an even group size dividing K");
  const int64_t G = K / gsize;
  auto S = torch::empty({N, G}, g.options().dtype(torch::kFloat));
  auto C = torch::empty({N, G}, g.options().dtype(torch::kFloat));
  const bool bf16 = g.scalar_type() == torch::kBFloat16;
  const auto gt = g.t().contiguous();
  const float* iv = inv.has_value() ? inv->data_ptr<float>() : nullptr;
  const uint8_t* qw = qweight.data_ptr<uint8_t>();
  float* s_out = S.data_ptr<float>();
  float* c_out = C.data_ptr<float>();
  const float offset = is_signed ? 8.f : 0.f;  // a signed code is its nibble xor 8, minus 8
  const uint8_t xor_mask = is_signed ? 8 : 0;
  // inv of the even and of the odd columns: a bf16 row of G is read as uint32 pairs, (k = 2i, 2i + 1) a word
  std::vector<float> inv_pairs(K, 1.f);
  for (int64_t i = 0; iv && i < H; ++i) inv_pairs[i] = iv[2 * i], inv_pairs[H + i] = iv[2 * i + 1];
  const float* inv_even = inv_pairs.data();
  const float* inv_odd = inv_pairs.data() + H;
#if defined(__AVX512BW__)
  const __m512i low4 = _mm512_set1_epi32(15), flip = _mm512_set1_epi32(xor_mask);
  const __m512i high16 = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
#endif
  // scratch floats (fp32 g): a row of G scaled by inv, then the row's codes as floats
  for_each_tile((N + tile - 1) / tile, tile * K, 2 * K, g.options(), [&](int64_t t, torch::Tensor& scratch, float* f) {
    const int64_t n0 = t * tile, rows = std::min(tile, N - n0);
    auto gw = scratch.narrow(0, 0, rows * K).view({rows, K});
    at::mm_out(gw, gt.narrow(0, n0, rows), x);
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* packed = qw + (n0 + r) * H;
      float* s_row = s_out + (n0 + r) * G;
      float* c_row = c_out + (n0 + r) * G;
      if (bf16) {
        // one pass over the bf16 row and its codes, two columns a word: the pass that first widened the row and the
        // codes into fp32 arrays took as long as the GEMM (2048 -> 8192 at 256 tokens, 2-core AMX Xeon)
        const uint32_t* words = reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(gw.data_ptr()) + r * K);
        for (int64_t j = 0; j < G; ++j) {
          int64_t i = j * gsize / 2;
          const int64_t end = i + gsize / 2;
          float s = 0.f, c = 0.f;
#if defined(__AVX512BW__)
          // 16 words a step; GCC's vectorized loop spent more on each group's reduction set-up than on its 32 words
          __m512 s16 = _mm512_setzero_ps(), c16 = _mm512_setzero_ps();
          for (; i + 16 <= end; i += 16) {
            const __m512i w = _mm512_loadu_si512(words + i);
            const __m512 lo = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), _mm512_loadu_ps(inv_even + i));
            const __m512 hi = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(w, high16)), _mm512_loadu_ps(inv_odd + i));
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + i)));
            const __m512 code_lo = _mm512_cvtepi32_ps(_mm512_xor_si512(_mm512_and_si512(b, low4), flip));
            const __m512 code_hi = _mm512_cvtepi32_ps(_mm512_xor_si512(_mm512_srli_epi32(b, 4), flip));
            s16 = _mm512_add_ps(s16, _mm512_add_ps(lo, hi));
            c16 = _mm512_fmadd_ps(lo, code_lo, _mm512_fmadd_ps(hi, code_hi, c16));
          }
          s = _mm512_reduce_add_ps(s16);
          c = _mm512_reduce_add_ps(c16);
#endif
          for (; i < end; ++i) {
            const uint32_t lo_bits = words[i] << 16, hi_bits = words[i] & 0xFFFF0000u;
            float lo, hi;
            std::memcpy(&lo, &lo_bits, 4);
            std::memcpy(&hi, &hi_bits, 4);
            lo *= inv_even[i];
            hi *= inv_odd[i];
            s += lo + hi;
            c += lo * static_cast<float>((packed[i] & 15) ^ xor_mask) + hi * static_cast<float>((packed[i] >> 4) ^ xor_mask);
          }
          s_row[j] = s;
          c_row[j] = c - offset * s;
        }
        continue;
      }
      const float* row = gw.data_ptr<float>() + r * K;
      if (iv) {
        #pragma omp simd
        for (int64_t k = 0; k < K; ++k) f[k] = row[k] * iv[k];
        row = f;
      }
      float* codes = f + K;
      #pragma omp simd
      for (int64_t i = 0; i < H; ++i) {
        codes[2 * i] = static_cast<float>((packed[i] & 15) ^ xor_mask);
        codes[2 * i + 1] = static_cast<float>((packed[i] >> 4) ^ xor_mask);
      }
      for (int64_t j = 0; j < G; ++j) {
        const float* fg = row + j * gsize;
        const float* cg = codes + j * gsize;
        float s = 0.f, c = 0.f;
        #pragma omp simd reduction(+ : s, c)
        for (int64_t k = 0; k < gsize; ++k) {
          s += fg[k];
          c += fg[k] * cg[k];
        }
        s_row[j] = s;
        c_row[j] = c - offset * s;
      }
    }
  });
  return {S, C};
}

// ---------------------------------------------------------------------------------------------
// the int8 backend's tile kernels (avx2_int8.py, amx.py): int32 sums dequantized into the output
// out[m0 + i, c0 + j] = acc[i, j] * row_step[m0 + i] (* col_step[c0 + j]), as dequantize rounds it
template <bool BF16>
static inline void store_products_as(const int32_t* acc, int64_t acc_ld, int64_t rows, int64_t cols, const float* rs,
                                     const float* cs, void* out, int64_t ld, int64_t m0, int64_t c0) {
  for (int64_t i = 0; i < rows; ++i) {
    const float r = rs[m0 + i];
    const int32_t* a = acc + i * acc_ld;
    if (BF16) {
      uint16_t* dst = static_cast<uint16_t*>(out) + (m0 + i) * ld + c0;
      for (int64_t j = 0; j < cols; ++j) dst[j] = float_to_bf16(static_cast<float>(a[j]) * r * (cs ? cs[c0 + j] : 1.f));
    } else {
      float* dst = static_cast<float*>(out) + (m0 + i) * ld + c0;
      for (int64_t j = 0; j < cols; ++j) dst[j] = static_cast<float>(a[j]) * r * (cs ? cs[c0 + j] : 1.f);
    }
  }
}

static inline void store_products(const int32_t* acc, int64_t acc_ld, int64_t rows, int64_t cols, const float* rs,
                                  const float* cs, void* out, int64_t ld, int64_t m0, int64_t c0, bool bf16) {
  if (bf16) store_products_as<true>(acc, acc_ld, rows, cols, rs, cs, out, ld, m0, c0);
  else store_products_as<false>(acc, acc_ld, rows, cols, rs, cs, out, ld, m0, c0);
}

// a packed layer's weight rows as the tile kernels read them: INT4 codes (two a byte) with per-group fp32 ratio
// [N, G] and zero [N, G] turning a code into its int8 value (group_table16), or stored int8 codes (ratio null)
struct PackedRows {
  const uint8_t* data;
  int64_t row_bytes, G, group;
  const float *ratio, *zero;
  bool is_signed;
};

static PackedRows packed_rows(const torch::Tensor& weight, const c10::optional<torch::Tensor>& ratio,
                              const c10::optional<torch::Tensor>& zero, bool is_signed, int64_t K,
                              const char* kernels) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight: contiguous [N, K / 2] uint8 or [N, K] int8");
  PackedRows w{static_cast<const uint8_t*>(weight.data_ptr()), weight.size(1), 1, K, nullptr, nullptr, is_signed};
  if (ratio.has_value()) {
    TORCH_CHECK(weight.scalar_type() == torch::kByte && weight.size(1) * 2 == K, "INT4 weight: uint8 [N, K / 2]");
    TORCH_CHECK(ratio->is_contiguous() && ratio->scalar_type() == torch::kFloat, "ratio: contiguous fp32 [N, G]");
    w.G = ratio->size(1);
    w.group = K / w.G;
    TORCH_CHECK(w.group * w.G == K && w.group % 32 == 0, kernels, ": groups of a multiple of 32 codes");
    w.ratio = ratio->data_ptr<float>();
    w.zero = zero.has_value() ? zero->data_ptr<float>() : nullptr;
  } else {
    TORCH_CHECK(weight.scalar_type() == torch::kChar && weight.size(1) == K, "int8 weight: int8 [N, K]");
  }
  return w;
}

static bool check_out(const torch::Tensor& out, int64_t M, int64_t C) {
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == C && out.stride(1) == 1 &&
              (out.scalar_type() == torch::kBFloat16 || out.scalar_type() == torch::kFloat),
              "out: bf16 or fp32 [M, C] rows");
  return out.scalar_type() == torch::kBFloat16;
}

// whether this build's AVX-512 branches exist (the target the compiler was given: target_flags())
bool built_with_avx512() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

""" + AVX2_INT8_SOURCE + AMX_SOURCE

_FUNCTIONS = [
    "built_with_avx512",
    "unpack_int4_int8",
    "gather_columns",
    "int4_columns",
    "quantize_rows",
    "column_absmax",
    "dequantize",
    "cross_entropy_",
    "silu_mul_backward",
    "adamw8bit_",
    "tiled_linear",
    "tiled_linear_grad_input",
    "tiled_linear_grad_input_rows",
    "learned_step_sums",
    *AVX2_INT8_FUNCTIONS,
    *AMX_FUNCTIONS,
]
_state: dict[str, object] = {}
# -fno-trapping-math (no value changes: FP exceptions never trap here) lets GCC turn the loops' selects (clamps, the
# sigmoid's sign choice) into vector blends on AVX2, where without it they stay branches and the loops scalar (GCC 12,
# -fopt-info-vec: "control flow in loop"; AVX-512 has mask registers for them): silu_mul_backward at 512x1536, 2-core
# AVX2 CPU, 3.8 -> 0.46 ms; cross_entropy_ of 170x49152 logits 23 -> 8.4 ms
_CFLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]
# a build takes about 45 s: a lock file older than this was left by a process killed while building, and torch's
# cpp_extension would wait for it to go away forever
STALE_BUILD_LOCK_S = 600
LOCK_POLL_S = 0.5  # how often a waiting process looks at another's build lock


def target_flags() -> list[str]:
    """The compiler's target: this CPU (``-march=native``), or, where ``HF_LOWPREC_CPU_CLASS=avx2`` restricts a
    larger CPU, the AVX2 class itself (``x86-64-v3``: AVX2, FMA, F16C, BMI2; tuned for this CPU). The kernels'
    ``#if defined(__AVX512...)`` branches are then left out as on an AVX2 CPU, and their AVX2 branches are the ones
    that run (built ``-march=native``, the emulation ran this CPU's AVX-512 code)."""
    if cpu_info().restricted_to == "avx2":
        return ["-march=x86-64-v3", "-mtune=native"]
    return ["-march=native"]


def cpu_kernels():
    """The built extension module (the functions of ``_FUNCTIONS``), or ``None``."""
    if "ext" not in _state:
        _state["ext"] = _build()
    return _state["ext"]


def _build():
    if not torch.cpu._is_avx2_supported():
        logger.warning("CPU kernels need AVX2; packed layers use torch ops instead")
        return None
    from torch.utils.cpp_extension import load_inline

    # -march=native code runs only where it was built: the CPU's flags and the target are part of the name. So is the
    # torch install it compiles against: torch's build.ninja names that install's include folders, so two virtual
    # environments sharing one name would each see the other's build as stale and rebuild it (~45 s) on every switch
    cflags = _CFLAGS + target_flags()
    key = _SOURCE + " ".join(cflags) + build_tag() + str(Path(torch.__file__).resolve().parent)
    name = "hf_lowprec_cpu_kernels_" + hashlib.sha256(key.encode()).hexdigest()[:12]
    logger.info("loading hf_lowprec CPU kernels (%s; built once per machine, ~45 s)", name)
    clear_stale_build_lock(name)
    try:
        return load_inline(
            name,
            cpp_sources=_SOURCE,
            functions=_FUNCTIONS,
            verbose=False,
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
        )
    except Exception as e:  # no compiler, no headers, a build error: say so, run the slower path
        logger.warning(
            "building the hf_lowprec CPU kernels failed (%s: %s); packed layers use torch ops",
            type(e).__name__,
            str(e).strip().splitlines()[-1] if str(e).strip() else "",
        )
        return None


def clear_stale_build_lock(name: str) -> None:
    """Remove the build lock of extension ``name`` when it is older than ``STALE_BUILD_LOCK_S``; a fresh one (another
    process building now, or one killed minutes ago) is waited for until it goes or turns stale, and said so."""
    from torch.utils.cpp_extension import _get_build_directory  # private, but the one place the folder is named

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    age = _age(lock)
    if age is not None and age <= STALE_BUILD_LOCK_S:  # torch would wait for it forever: wait until it goes or is stale
        logger.warning(
            "waiting for another process building the CPU kernels (%s, %.0f s old; removed if still there at %d s)",
            lock,
            age,
            STALE_BUILD_LOCK_S,
        )
        while (age := _age(lock)) is not None and age <= STALE_BUILD_LOCK_S:
            time.sleep(LOCK_POLL_S)
    if age is None:  # none, or the build holding it finished (it may go between any two looks at it)
        return
    logger.warning("removing %s: left %.0f min ago by a kernel build that was interrupted", lock, age / 60)
    lock.unlink(missing_ok=True)


def _age(path: Path) -> float | None:
    """Seconds since ``path`` was last modified; ``None`` when it does not exist."""
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
