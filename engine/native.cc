// The engine's one native kernel: float rows times weights held narrow, at the memory's speed, and
// the few other steps XLA:CPU ran slowly. engine/native.py builds it with the host's compiler for the
// CPU's tier and registers each entry point with XLA as a custom call.
//
// Contents, in file order: each section, its entry points (the XLA FFI handlers at the end of the
// file), the engine/native.py function that calls each, and that function's callers. A *Matmul
// multiplies a few float rows (decode steps, a draft's verification, small prefill chunks) by the
// held weights; a *Widen widens the held weights to bfloat16 for a prefill chunk's dot.
//   (no title)                       the tier macros and constants, Peak, Rounded, Dpbusd, HeldBytes,
//                                    AddTerm, Parallel (XLA's intra-op pool): what the sections share
//   the whole product of float rows  Int8Matmul: int8_matmul <- products._int8_packed_matmul
//   the weights widened              Int8Widen: widen <- products._int8_packed_matmul
//   5-bit weights                    Int5Matmul, Int5Widen: int5_matmul, widen5 <- products._q5_0_matmul
//   8-bit blocks                     Q8Matmul, Q8Widen: q8_matmul, widen8 <- products._q8_0_matmul
//   K-quant blocks                   Q4KMatmul, Q5KMatmul, Q6KMatmul, Q4KWiden, Q5KWiden, Q6KWiden:
//                                    k_matmul, widen_k <- products._k_matmul
//   scaled-level blocks              Iq4NlMatmul, Iq4XsMatmul, Iq3SMatmul, Q3KMatmul, Iq4NlWiden,
//                                    Iq4XsWiden, Iq3SWiden, Q3KWiden: s_matmul, widen_s
//                                    <- products._s_matmul
//   attention over the int8 cache    Int8Attend: int8_attend <- attention.attend
//   float products in one order      RowDot: row_dot <- products.row_exact_matmul
//   the delta rule, token by token   DeltaSteps, DeltaStepsInPlace: delta_steps, delta_steps_in_place
//                                    <- model._delta_steps, model._linear_attention
//   the greedy pick                  FirstMax: first_max <- sampler._first_max
//   the sampling filters' cuts       FilterCuts: filter_cuts <- sampler.filter_cut
// (tests/test_layout.py holds this list to the handlers, the titles and engine/native.py.)
//
// Why: XLA:CPU hands an integer dot to YNNPACK, whose kernels run compute-bound, well short of the
// memory's speed (docs/perf-log.md: "YNNPACK's integer kernels, not the memory, set the pace"). A
// decode step reads every weight once for a handful of rows, so it should run at the memory's speed.
// This kernel does: weights packed so that one 64-byte load holds 4 consecutive inputs of 16
// outputs, each term's 4 inputs broadcast to all 16 lanes, and vpdpbusd accumulates 16 outputs at
// once with no horizontal sums; the weights stream in one sequential pass per thread.
//
// Packed weights (row-major): uint8 [N/16, K/4, 16, 4], the int8 weight q[n, k] + 128 at
// [n/16, k/4, n%16, k%4]. vpdpbusd multiplies unsigned by signed bytes, so the weights are held
// offset (uint8) and 128 times each term row's sum comes off. int32 cannot overflow for K < 65536
// (|q| <= 127 is stored as at most 255, |term| <= 127).
//
// Tiers. Exactly one of MASHBOX_AVX512 (AVX-512 VNNI), MASHBOX_AVX2 (AVX2 with FMA and F16C) and
// MASHBOX_NEON (AArch64 with dot products) is 1, as the compiler flags choose (engine/native.py:
// TIERS); MASHBOX_AVXVNNI is 1 within the AVX2 tier where AVX-VNNI is there too (Alder Lake and later
// Intel cores without AVX-512), and MASHBOX_AMX within the AVX-512 tier where the build has Intel's
// matrix units (a long chunk's int8 products on their tiles: TilePass). Each step that differs by
// tier is written once per tier, side by side, as ScaledBlock (one block of 16 outputs of the int8
// product) is:
//   #if MASHBOX_AVX512    16 outputs in one 512-bit register; vpdpbusd on the offset weights
//   #elif MASHBOX_AVX2    two 8-lane halves; vpmaddubsw into int16 pairs, vpmaddwd into int32, on
//                         the weights' signed values (below); under MASHBOX_AVXVNNI one vpdpbusd on
//                         the offset weights, as AVX-512's (HeldBytes and AddTerm choose)
//   #else                 NEON: four 4-lane quarters; sdot on the weights' signed values
//   #endif
// and where the AVX2 and NEON tiers' step is plain C++, one "#else  // AVX2 and NEON" branch serves
// both (QuantizeRow). Every tier makes the same exact integer sums, so every product and rounding
// after them is the same bit for bit (tests/test_native.py holds each tier to the same numpy
// definitions; the NEON tier's tests run cross-compiled, under qemu-user: tests/kernel_harness/).
//
// The weights' signed values: vpmaddubsw's int16 pair would overflow with an offset weight (up to
// 255) times a term, so the AVX2 tier without AVX-VNNI flips the offset byte's top bit (the signed
// weight) and gives it the term's sign, the term's magnitude being the unsigned operand: |t| q pairs
// stay within 2 x 127 x 127 (a weight is never -128: engine.weights holds -127..127). sdot multiplies
// signed bytes by signed bytes, 4 to an int32 lane of 4, so NEON takes the signed weights and the
// terms as they are.
#if defined(__aarch64__)
#include <arm_neon.h>
#else
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// The tier: exactly one of these is 1.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define MASHBOX_AVX512 1
#define MASHBOX_AVX2 0
#define MASHBOX_NEON 0
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MASHBOX_AVX512 0
#define MASHBOX_AVX2 1
#define MASHBOX_NEON 0
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define MASHBOX_AVX512 0
#define MASHBOX_AVX2 0
#define MASHBOX_NEON 1
#else
#error "engine/native.cc is built for AVX-512 VNNI, AVX2 with FMA and F16C, or AArch64 with dot products (engine/native.py: TIERS)"
#endif
// The AVX-VNNI tier is the AVX2 tier with AVX-VNNI's 256-bit vpdpbusd and vpdpwssd (Alder Lake and
// later Intel cores without AVX-512): each "multiply byte pairs, widen, add" step in one instruction,
// the same exact int32 sums, so every result equals the AVX2 tier's bit for bit.
#if MASHBOX_AVX2 && defined(__AVXVNNI__)
#define MASHBOX_AVXVNNI 1
#else
#define MASHBOX_AVXVNNI 0
#endif
// Intel's matrix units (AMX) within the AVX-512 tier, where the build has them (-mamx-tile -mamx-int8:
// engine/native.py), or emulated for the tests (MASHBOX_AMX_EMULATED): a long chunk's int8 products
// on tiles (TilePass).
#if MASHBOX_AVX512 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define MASHBOX_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define MASHBOX_AMX 0
#endif
#if MASHBOX_AMX || defined(MASHBOX_AMX_EMULATED)
#define MASHBOX_TILES 1
#else
#define MASHBOX_TILES 0
#endif

namespace {

constexpr int kLanes = 16;          // outputs per packed block (int32 lanes of a 512-bit register)
constexpr int kGroup = 4;           // inputs per lane and instruction (vpdpbusd)
#if MASHBOX_AVX512
constexpr int kMaxTerms = 8;        // rows of int8 terms per pass: 8 accumulators plus loads
#else
constexpr int kMaxTerms = 4;        // AVX2: 8 accumulators (two 8-lane halves each) plus loads;
                                    // NEON: 16 (four 4-lane quarters each) of its 32 registers
#endif
// Blocks of 16 outputs a thread claims at a time: small enough to share out the smallest matrix
// (896 outputs: 14 chunks of 64), large enough that claiming costs nothing. A chunk (at most 64
// outputs x K bytes, 311 KB for K = 4864) stays in L2 while every pass of 8 terms reads it.
constexpr int64_t kChunkBlocks = 4;
// Software prefetch this many bytes ahead in the weights' stream: hardware prefetch alone left one
// thread well short of the memory's speed, and 1024 was the best distance tried (docs/performance.md).
constexpr int64_t kPrefetch = 1024;
// And into L2 this far ahead as well: with the near prefetch alone, a few rows' loads waited for the
// memory and then the arithmetic, in turn; fetched into L2 ahead, they overlap (5-15% at 4 rows;
// docs/performance.md).
constexpr int64_t kPrefetchL2 = 6144;

// Fetch ahead into L1 (prefetcht0 on x86), and into L2 (prefetcht1); never faults.
inline void Prefetch(const void* at) { __builtin_prefetch(at, 0, 3); }
inline void PrefetchL2(const void* at) { __builtin_prefetch(at, 0, 2); }

#if MASHBOX_AVX512
// A mask of the first `left` of 16 lanes.
inline __mmask16 Lanes(int64_t left) { return left >= 16 ? 0xFFFF : left <= 0 ? 0 : (1u << left) - 1; }

// The largest magnitude of x [K]; a NaN never wins (max_ps returns its second operand).
inline float Peak(const float* x, int64_t K) {
  __m512 top = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kLanes)
    top = _mm512_max_ps(_mm512_abs_ps(_mm512_maskz_loadu_ps(Lanes(K - k), x + k)), top);
  return _mm512_reduce_max_ps(top);
}

// The lanes m of x divided by `divisor`, rounded half to even (zero in the others).
inline __m512 Rounded(const float* x, __mmask16 m, __m512 divisor) {
  return _mm512_roundscale_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(m, x), divisor),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// acc += unsigned bytes a times signed bytes b, 4 to a lane (vpdpbusd), in asm: around the
// intrinsic GCC 12 copied every accumulator through another register.
inline void Dpbusd(__m512i& acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}
#else
// The largest magnitude of x [K]; a NaN never wins (as max_ps: a > b ? a : b). AVX2 and NEON.
inline float Peak(const float* x, int64_t K) {
  float top = 0.0f;
  for (int64_t k = 0; k < K; k++) {
    const float a = std::fabs(x[k]);
    top = a > top ? a : top;
  }
  return top;
}
#endif

#if MASHBOX_AVX2
// A mask of the first `left` of 8 float lanes (all bits set in each lane taken).
inline __m256i Lanes8(int64_t left) {
  const int32_t n = static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(left, 0), 8));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline float ReduceAdd(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

inline float ReduceMax(__m256 v) {
  const __m128 four = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_max_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_max_ss(two, _mm_shuffle_ps(two, two, 1)));
}

// acc += the 4-byte dot products of unsigned bytes u and signed bytes s in each int32 lane (|u s|
// pairs must fit int16 for vpmaddubsw: the callers' operands do).
inline __m256i DotBytes(__m256i acc, __m256i u, __m256i s) {
#if MASHBOX_AVXVNNI
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// 32 packed weight bytes as this tier multiplies them: the offset bytes as they are where AVX-VNNI's
// vpdpbusd takes them (unsigned), else their signed values (the top bit flipped) for the sign trick.
inline __m256i HeldBytes(const uint8_t* at) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
  return MASHBOX_AVXVNNI ? v : _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80)));
}

// acc += HeldBytes' weights w times a term's 4 inputs tv (the same 4 in every lane). With the sign
// trick, the term's magnitudes are the unsigned operand and the weights take its signs.
inline __m256i AddTerm(__m256i acc, __m256i w, __m256i tv) {
#if MASHBOX_AVXVNNI
  return DotBytes(acc, w, tv);
#else
  return DotBytes(acc, _mm256_abs_epi8(tv), _mm256_sign_epi8(w, tv));
#endif
}
#endif

#if MASHBOX_AVX512 || MASHBOX_AVX2
// acc += the 2-word dot products of int16 a and b in each int32 lane (vpdpwssd where there is VNNI).
inline __m256i DotWords(__m256i acc, __m256i a, __m256i b) {
#if MASHBOX_AVX512
  return _mm256_dpwssd_epi32(acc, a, b);
#elif MASHBOX_AVXVNNI
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
#endif

#if MASHBOX_NEON
// 4 float16 -> float32 (exact).
inline float32x4_t Halves4(const uint16_t* h) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h))); }

// 4 bytes -> int32 lanes, signed or unsigned.
inline int32x4_t Bytes4(const int8_t* at) {
  int32_t four;
  __builtin_memcpy(&four, at, sizeof four);
  return vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(four)))));
}

inline int32x4_t UBytes4(const uint8_t* at) {
  int32_t four;
  __builtin_memcpy(&four, at, sizeof four);
  return vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_s32(vdup_n_s32(four))))));
}

// The 4 floats at `at`, zero past `left` (never read past it: the cache may end there).
inline float32x4_t Load4(const float* at, int64_t left) {
  if (left >= 4) return vld1q_f32(at);
  float part[4] = {};
  __builtin_memcpy(part, at, std::max<int64_t>(left, 0) * sizeof(float));
  return vld1q_f32(part);
}

// All bits set in each of the first `left` of 4 lanes.
inline uint32x4_t Lanes4(int64_t left) {
  const int32_t n = static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(left, 0), 4));
  const int32x4_t index = {0, 1, 2, 3};
  return vcltq_s32(index, vdupq_n_s32(n));
}

// 4 unsigned bytes minus `offset`, as floats (exact).
inline float32x4_t Levels4(const uint8_t* at, int offset) {
  return vcvtq_f32_s32(vsubq_s32(UBytes4(at), vdupq_n_s32(offset)));
}

// 4 floats -> bfloat16 (nearest, ties to even; NaN not expected), as Bf16x8 below.
inline uint16x4_t Bf16x4(float32x4_t value) {
  const uint32x4_t bits = vreinterpretq_u32_f32(value);
  const uint32x4_t odd = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
  return vshrn_n_u32(vaddq_u32(bits, vaddq_u32(vdupq_n_u32(0x7FFF), odd)), 16);
}
#else
// 8 floats -> bfloat16 (nearest, ties to even; NaN not expected), in the low 128 bits
// (both x86 tiers: the K-quant blocks are written once, in 256-bit form).
inline __m128i Bf16x8(__m256 value) {
  __m256i bits = _mm256_castps_si256(value);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
  const __m256i packed = _mm256_packus_epi32(bits, bits);          // per 128-bit lane: 0-3 0-3 | 4-7 4-7
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}
#endif

// A spinning wait's pause (x86) or yield (ARM): lets the core's other thread run.
inline void Pause() {
#if MASHBOX_NEON
  asm volatile("yield");
#else
  _mm_pause();
#endif
}

// Runs fn(chunk) for chunks 0 .. chunks-1 on the calling thread and XLA's intra-op pool. Each
// thread claims chunks until none is left; the caller works too and waits only for chunks another
// thread claimed, so the call completes even when no pool thread is free to help (a helper that
// starts late finds nothing left). fn must stay valid until then: it is shared with the helpers.
void Parallel(ffi::ThreadPool& pool, int64_t chunks, std::function<void(int64_t)> fn) {
  struct Shared {
    std::function<void(int64_t)> fn;
    int64_t chunks;
    std::atomic<int64_t> next{0}, done{0};
    void Work() {
      for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
        fn(c);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto shared = std::make_shared<Shared>();
  shared->fn = std::move(fn);
  shared->chunks = chunks;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), chunks) - 1;
  for (int64_t i = 0; i < helpers; i++) pool.Schedule([shared] { shared->Work(); });
  shared->Work();
  while (shared->done.load(std::memory_order_acquire) < chunks) Pause();
}

// The rows of x [R, K] a product computes: up to the last row with a value other than zero. The
// trailing rows are a prompt chunk's padding, which the model zeroes before each product
// (engine/model.py: _padding_zeroed): a 6-token prompt in a 32-token chunk pays for 6 rows'
// arithmetic, not 32. Their outputs are written zero, what their all-zero terms would sum to.
int64_t LiveRows(const float* x, int64_t R, int64_t K) {
  while (R > 0 && std::all_of(x + (R - 1) * K, x + R * K, [](float v) { return v == 0.0f; })) R--;
  return R;
}

// out [R, N] past the first `live` rows: zero (LiveRows).
void ZeroRowsFrom(float* out, int64_t live, int64_t R, int64_t N) { std::fill(out + live * N, out + R * N, 0.0f); }

bool Packed(const ffi::Span<const int64_t>& d) {
  return d.size() == 4 && d[2] == kLanes && d[3] == kGroup;
}

int64_t Chunks(int64_t blocks) { return (blocks + kChunkBlocks - 1) / kChunkBlocks; }

// ---- the whole product of float rows: terms, products and scales in one call -------------------

// Row x [K] -> int8 q [K] on its own scale (largest magnitude / 127; 1 for a zero row), so that
// x ~= q * scale, rounded half to even; returns the scale, and the levels' sum in *sum. The same
// numbers as engine/products.py's quantize_rows, 16 at a time (3x faster than one at a time). The
// terms are made before the pool's threads start.
#if MASHBOX_AVX512
float QuantizeRow(const float* x, int8_t* q, int64_t K, int32_t* sum) {
  const float peak = Peak(x, K);
  const float scale = peak > 0.0f ? peak / 127.0f : 1.0f;
  const __m512 divisor = _mm512_set1_ps(scale);
  const __m512 low = _mm512_set1_ps(-127.0f), high = _mm512_set1_ps(127.0f);
  __m512i levels = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += kLanes) {
    const __mmask16 m = Lanes(K - k);
    const __m512 v = Rounded(x + k, m, divisor);
    // Clipped to +-127 (a NaN to -127, as std::max(-127.f, NaN) gives).
    const __m512i level = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, low), high));
    levels = _mm512_add_epi32(levels, level);
    _mm512_mask_cvtepi32_storeu_epi8(q + k, m, level);
  }
  *sum = _mm512_reduce_add_epi32(levels);        // lanes past K are zero
  return scale;
}

// Float rows x [R, K] -> two int8 terms per row, row r's at 2r and 2r + 1 of terms [2R, K]: the row
// on its own scale, then what its rounding left on its own (about 14 bits in all), their scales,
// and 128 times each term's sum (what the offset weights add to its products).
void MakeTerms(const float* x, int64_t R, int64_t K, int8_t* terms, float* term_scales, int32_t* offsets) {
  std::vector<float> rest(K);
  for (int64_t r = 0; r < R; r++) {
    int8_t* q0 = terms + 2 * r * K;
    const float* row = x + r * K;
    const float s0 = term_scales[2 * r] = QuantizeRow(row, q0, K, &offsets[2 * r]);
    for (int64_t k = 0; k < K; k += kLanes) {     // x - q s0, each operation rounded once
      const __mmask16 m = Lanes(K - k);
      const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, q0 + k)));
      _mm512_mask_storeu_ps(&rest[k], m, _mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + k),
                                                       _mm512_mul_ps(q, _mm512_set1_ps(s0))));
    }
    term_scales[2 * r + 1] = QuantizeRow(rest.data(), q0 + K, K, &offsets[2 * r + 1]);
    offsets[2 * r] *= 128;
    offsets[2 * r + 1] *= 128;
  }
}
#else  // AVX2 and NEON
float QuantizeRow(const float* x, int8_t* q, int64_t K, int32_t* sum) {
  const float peak = Peak(x, K);
  const float scale = peak > 0.0f ? peak / 127.0f : 1.0f;
  int32_t levels = 0;
  for (int64_t k = 0; k < K; k++) {
    float v = std::nearbyint(x[k] / scale);
    v = v > -127.0f ? v : -127.0f;             // a NaN to -127, as max_ps gives
    v = v < 127.0f ? v : 127.0f;
    q[k] = static_cast<int8_t>(v);
    levels += static_cast<int32_t>(v);
  }
  *sum = levels;
  return scale;
}

// As the AVX-512 tier's (the offsets too: the tiers that multiply the weights' signed values, AVX2
// without VNNI and NEON, leave them unread, the tiles' pass reads them).
void MakeTerms(const float* x, int64_t R, int64_t K, int8_t* terms, float* term_scales, int32_t* offsets) {
  std::vector<float> rest(K);
  for (int64_t r = 0; r < R; r++) {
    int8_t* q0 = terms + 2 * r * K;
    const float* row = x + r * K;
    const float s0 = term_scales[2 * r] = QuantizeRow(row, q0, K, &offsets[2 * r]);
    for (int64_t k = 0; k < K; k++) rest[k] = row[k] - static_cast<float>(q0[k]) * s0;
    term_scales[2 * r + 1] = QuantizeRow(rest.data(), q0 + K, K, &offsets[2 * r + 1]);
    offsets[2 * r] *= 128;
    offsets[2 * r + 1] *= 128;
  }
}
#endif

// One block of 16 outputs for R float rows, each row's two int8 terms at term rows 2r and 2r + 1:
// each output leaves the accumulators as (p0 s0 + p1 s1) * scale in float32, with no buffer of int32
// products between. One block at a time reads one stream of weights (two streams sharing each
// term's broadcast were slower). Always inlined: called on its own, GCC 12 kept the 8 accumulators
// of 4 rows on the stack (docs/performance.md).
#if MASHBOX_AVX512
template <int R>
__attribute__((always_inline)) inline void ScaledBlock(const uint8_t* w, const int8_t* terms,
                                                       const float* term_scales, const int32_t* offsets,
                                                       const float* scale, float* out, int64_t K,
                                                       int64_t N, int64_t block) {
  constexpr int T = 2 * R;
  __m512i acc[T];                        // start at minus the offsets: they end at the products
  for (int t = 0; t < T; t++) acc[t] = _mm512_set1_epi32(-offsets[t]);
  const uint8_t* wb = w + block * kLanes * K;
  for (int64_t k = 0; k < K; k += kGroup) {
    const uint8_t* at = wb + k * kLanes;
    Prefetch(at + kPrefetch);
    PrefetchL2(at + kPrefetchL2);
    const __m512i wv = _mm512_loadu_si512(at);
    for (int t = 0; t < T; t++) {
      int32_t four;                                        // terms[t, k .. k+3]
      __builtin_memcpy(&four, terms + t * K + k, sizeof four);
      Dpbusd(acc[t], wv, _mm512_set1_epi32(four));
    }
  }
  const __m512 sc = _mm512_loadu_ps(scale + block * kLanes);
  for (int r = 0; r < R; r++) {
    const __m512 p0 = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[2 * r]), _mm512_set1_ps(term_scales[2 * r]));
    const __m512 p1 = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[2 * r + 1]),
                                    _mm512_set1_ps(term_scales[2 * r + 1]));
    _mm512_storeu_ps(out + r * N + block * kLanes, _mm512_mul_ps(_mm512_add_ps(p0, p1), sc));
  }
}
#elif MASHBOX_AVX2
// With AVX-VNNI, vpdpbusd takes the offset weights as they are, as the AVX-512 tier's does (the
// accumulators start at minus the offsets); without it, the sign trick.
template <int R>
__attribute__((always_inline)) inline void ScaledBlock(const uint8_t* w, const int8_t* terms,
                                                       const float* term_scales, const int32_t* offsets,
                                                       const float* scale, float* out, int64_t K,
                                                       int64_t N, int64_t block) {
  constexpr int T = 2 * R;
  __m256i acc[T][2];                     // outputs 0-7 and 8-15
  for (int t = 0; t < T; t++) acc[t][0] = acc[t][1] = _mm256_set1_epi32(MASHBOX_AVXVNNI ? -offsets[t] : 0);
  const uint8_t* wb = w + block * kLanes * K;
  for (int64_t k = 0; k < K; k += kGroup) {
    const uint8_t* at = wb + k * kLanes;
    Prefetch(at + kPrefetch);
    PrefetchL2(at + kPrefetchL2);
    const __m256i w0 = HeldBytes(at), w1 = HeldBytes(at + 32);
    for (int t = 0; t < T; t++) {
      int32_t four;                                        // terms[t, k .. k+3]
      __builtin_memcpy(&four, terms + t * K + k, sizeof four);
      const __m256i tv = _mm256_set1_epi32(four);
      acc[t][0] = AddTerm(acc[t][0], w0, tv);
      acc[t][1] = AddTerm(acc[t][1], w1, tv);
    }
  }
  for (int h = 0; h < 2; h++) {
    const __m256 sc = _mm256_loadu_ps(scale + block * kLanes + 8 * h);
    for (int r = 0; r < R; r++) {
      const __m256 p0 = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[2 * r][h]), _mm256_set1_ps(term_scales[2 * r]));
      const __m256 p1 = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[2 * r + 1][h]),
                                      _mm256_set1_ps(term_scales[2 * r + 1]));
      _mm256_storeu_ps(out + r * N + block * kLanes + 8 * h, _mm256_mul_ps(_mm256_add_ps(p0, p1), sc));
    }
  }
}
#else
// NEON: one 16-byte register holds 4 inputs of 4 outputs; sdot takes the weights' signed values (the
// offset byte's top bit flipped) times the term's 4 inputs, repeated in each lane.
template <int R>
__attribute__((always_inline)) inline void ScaledBlock(const uint8_t* w, const int8_t* terms,
                                                       const float* term_scales, const int32_t*,
                                                       const float* scale, float* out, int64_t K,
                                                       int64_t N, int64_t block) {
  constexpr int T = 2 * R;
  int32x4_t acc[T][4];                   // outputs 0-3, 4-7, 8-11, 12-15
  for (int t = 0; t < T; t++)
    for (int q = 0; q < 4; q++) acc[t][q] = vdupq_n_s32(0);
  const uint8x16_t flip = vdupq_n_u8(0x80);
  const uint8_t* wb = w + block * kLanes * K;
  for (int64_t k = 0; k < K; k += kGroup) {
    const uint8_t* at = wb + k * kLanes;
    Prefetch(at + kPrefetch);
    PrefetchL2(at + kPrefetchL2);
    int8x16_t wv[4];
    for (int q = 0; q < 4; q++) wv[q] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(at + 16 * q), flip));
    for (int t = 0; t < T; t++) {
      int32_t four;                                        // terms[t, k .. k+3]
      __builtin_memcpy(&four, terms + t * K + k, sizeof four);
      const int8x16_t tv = vreinterpretq_s8_s32(vdupq_n_s32(four));
      for (int q = 0; q < 4; q++) acc[t][q] = vdotq_s32(acc[t][q], wv[q], tv);
    }
  }
  for (int q = 0; q < 4; q++) {
    const float32x4_t sc = vld1q_f32(scale + block * kLanes + 4 * q);
    for (int r = 0; r < R; r++) {
      const float32x4_t p0 = vmulq_f32(vcvtq_f32_s32(acc[2 * r][q]), vdupq_n_f32(term_scales[2 * r]));
      const float32x4_t p1 = vmulq_f32(vcvtq_f32_s32(acc[2 * r + 1][q]), vdupq_n_f32(term_scales[2 * r + 1]));
      vst1q_f32(out + r * N + block * kLanes + 4 * q, vmulq_f32(vaddq_f32(p0, p1), sc));
    }
  }
}
#endif

template <int R>
void ScaledPass(const uint8_t* w, const int8_t* terms, const float* term_scales, const int32_t* offsets,
                const float* scale, float* out, int64_t K, int64_t N, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; b++) ScaledBlock<R>(w, terms, term_scales, offsets, scale, out, K, N, b);
}

constexpr int kMaxRows = kMaxTerms / 2;  // float rows per pass: two terms each
using ScaledPassFn = void (*)(const uint8_t*, const int8_t*, const float*, const int32_t*, const float*,
                              float*, int64_t, int64_t, int64_t, int64_t);
#if MASHBOX_AVX512
constexpr ScaledPassFn kScaledPasses[kMaxRows + 1] = {nullptr, ScaledPass<1>, ScaledPass<2>,
                                                      ScaledPass<3>, ScaledPass<4>};
#else
constexpr ScaledPassFn kScaledPasses[kMaxRows + 1] = {nullptr, ScaledPass<1>, ScaledPass<2>};
#endif

// Blocks b0 .. b1 of the product for R float rows: 4 rows per pass over the blocks (AVX2: 2).
void RowPasses(const uint8_t* w, const int8_t* terms, const float* term_scales, const int32_t* offsets,
               const float* scale, float* out, int64_t K, int64_t N, int64_t R, int64_t b0, int64_t b1) {
  for (int64_t r0 = 0; r0 < R; r0 += kMaxRows) {
    const int64_t n = std::min<int64_t>(kMaxRows, R - r0);
    kScaledPasses[n](w, terms + 2 * r0 * K, term_scales + 2 * r0, offsets + 2 * r0, scale, out + r0 * N, K, N,
                     b0, b1);
  }
}

// A long chunk's products on Intel's matrix units (AMX: Sapphire Rapids and later Xeons). Built with
// -mamx-tile -mamx-int8 (MASHBOX_AMX: engine/native.py adds them on such a CPU), tdpbsud multiplies a
// tile of 16 term rows x 64 inputs (signed bytes) by a tile of 64 inputs x 16 outputs (unsigned
// bytes, 4 inputs of an output side by side): the packed offset weights as they are, a block's 16
// groups of 4 inputs being a tile's 16 rows of 64 bytes. Its int32 sums are the ones the row passes
// make, exactly, and each output leaves them through the same float operations in the same order
// (TileOutputs), so a row's numbers are the decode step's in a chunk of any length, at the matrix
// units' speed. Linux hands a process the tiles' state only when asked (arch_prctl); refused, or with
// K not a whole number of tiles, the row passes serve. MASHBOX_AMX_EMULATED (the tests' harness,
// tests/test_native.py) runs each tile instruction in plain C++ as Intel's manual defines it, so the
// tiling itself runs, and is held to the same definitions, on any CPU.
#if MASHBOX_TILES
constexpr int kTileRows = 16;            // a tile's rows: term rows of a row tile, input groups of a
                                         // weight tile, term rows of a sum tile
constexpr int64_t kTileInputs = 64;      // inputs per tdpbsud: a row tile's 64 bytes
constexpr int64_t kTilePanel = 2 * kTileRows;  // term rows per pass: two row tiles, each against two
                                               // weight tiles, into four sum tiles (8 tiles in all)
// Float rows from which a chunk takes the tiles: a full panel (fewer would multiply padding rows).
// Below it the row passes read the weights once for all rows, as a decode step does.
constexpr int64_t kTileMinRows = kTilePanel / 2;
// Blocks of 16 outputs a thread claims at a time on the tiles: each panel of terms is read once per
// claim, so claims are larger than the row passes', up to 16 blocks and as many as keep the claim's
// weights (16 x K bytes a block, as int8 or as a block form's levels) within kTileClaimBytes, which
// stay in a Sapphire Rapids core's 2 MB of L2 while every panel passes over them (16 blocks at
// K = 4864, 1.2 MB; 4 at a 27B's K = 17408). Even, so that claims pair their blocks.
constexpr int64_t kTileChunkBlocks = 16;
constexpr int64_t kTileClaimBytes = 1280 * 1024;
int64_t TileClaim(int64_t K) {
  return std::clamp<int64_t>(kTileClaimBytes / (kLanes * K) / 2 * 2, 2, kTileChunkBlocks);
}

#if MASHBOX_AMX
// Tiles t (0-7) as the instructions name them: tmm<t>.
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, at, stride) _tile_loadd(t, at, stride)
#define TILE_STORE(t, at, stride) _tile_stored(t, at, stride)
#define TILE_DOT(sums, rows, weights) _tile_dpbsud(sums, rows, weights)

// Whether this process may use the tiles: Linux (5.16 on) grants their state on request
// (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), once for every thread.
bool TilesGranted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                      18 /* XFEATURE_XTILEDATA */) == 0;
  return granted;
}
#else
// Each tile instruction as Intel's manual defines it, on this thread's 8 tiles (up to 16 rows x 64
// bytes) in the shapes the thread's configuration gives them (TileShapes).
thread_local uint8_t emulated_tiles[8][kTileRows][64];
thread_local int emulated_rows[8], emulated_bytes[8];
#define TILE_ZERO(t) std::fill(&emulated_tiles[t][0][0], &emulated_tiles[t][0][0] + kTileRows * 64, 0)
#define TILE_LOAD(t, at, stride) EmulatedLoad(t, at, stride)
#define TILE_STORE(t, at, stride) EmulatedStore(t, at, stride)
#define TILE_DOT(sums, rows, weights) EmulatedDot(sums, rows, weights)

inline void EmulatedLoad(int t, const void* at, int64_t stride) {
  for (int r = 0; r < emulated_rows[t]; r++)
    __builtin_memcpy(emulated_tiles[t][r], static_cast<const uint8_t*>(at) + r * stride, emulated_bytes[t]);
}

inline void EmulatedStore(int t, void* at, int64_t stride) {
  for (int r = 0; r < emulated_rows[t]; r++)
    __builtin_memcpy(static_cast<uint8_t*>(at) + r * stride, emulated_tiles[t][r], emulated_bytes[t]);
}

// tdpbsud: sums[m][n] += sum over j < K/4, i < 4 of signed rows[m][4j + i] x unsigned weights[j][4n + i],
// with the weight tile's rows the row tile's groups of 4 bytes (K/4).
inline void EmulatedDot(int sums, int rows, int weights) {
  for (int m = 0; m < emulated_rows[sums]; m++)
    for (int n = 0; n < emulated_bytes[sums] / 4; n++) {
      int32_t total;
      __builtin_memcpy(&total, &emulated_tiles[sums][m][4 * n], 4);
      for (int j = 0; j < emulated_rows[weights]; j++)
        for (int i = 0; i < 4; i++)
          total += static_cast<int8_t>(emulated_tiles[rows][m][4 * j + i]) *
                   emulated_tiles[weights][j][4 * n + i];
      __builtin_memcpy(&emulated_tiles[sums][m][4 * n], &total, 4);
    }
}

bool TilesGranted() { return true; }
#endif

// The tiles' shapes for a pass that sums `step` inputs per tdpbsud (64: whole tiles; 32 and 16: a
// block form's sub-block, whose sums leave the tiles before the next one's): sum tiles 0-3 are 16
// rows x 16 int32, row tiles 4-5 16 rows x `step` bytes, weight tiles 6-7 step / 4 groups x 64 bytes.
#if MASHBOX_AMX
// ldtilecfg's operand, palette 1. Constants in the binary, not locals: GCC's _tile_loadconfig tells
// the compiler it reads 8 bytes, so a local's other stores could go.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes[16];
  uint8_t rows[16];
};
constexpr TileConfig TileShapes(int step) {
  return {1, 0, {}, {64, 64, 64, 64, static_cast<uint16_t>(step), static_cast<uint16_t>(step), 64, 64},
          {16, 16, 16, 16, 16, 16, static_cast<uint8_t>(step / 4), static_cast<uint8_t>(step / 4)}};
}
constexpr TileConfig kTileConfigs[3] = {TileShapes(64), TileShapes(32), TileShapes(16)};
#endif

// This thread's tiles configured for `step` while it lives, and released after (a configured
// thread's switches save 8 KB more state). The compiler's barrier: tileloadd's asm names no memory it
// reads, so every store before (the terms, a claim's levels) is made before the first load.
struct TileScope {
  explicit TileScope(int step) {
#if MASHBOX_AMX
    _tile_loadconfig(&kTileConfigs[step == 64 ? 0 : step == 32 ? 1 : 2]);
#else
    for (int t = 0; t < 8; t++) {
      emulated_rows[t] = t < 6 ? kTileRows : step / 4;
      emulated_bytes[t] = t == 4 || t == 5 ? step : 64;
    }
#endif
    asm volatile("" ::: "memory");
  }
  ~TileScope() {
#if MASHBOX_AMX
    _tile_release();
#endif
  }
};

// sums [32 term rows][32 outputs] of a panel (term rows t0 ..) and two blocks (b, b + 1; `Blocks` of
// them) -> the outputs of its float rows below R, as ScaledBlock makes them: p0 s0 + p1 s1, times the
// output's scale, each operation rounded once (plain C++: the build contracts nothing into an FMA).
template <int Blocks>
void TileOutputs(const int32_t (*sums)[32], const float* term_scales, const int32_t* offsets, const float* scale,
                 float* out, int64_t N, int64_t R, int64_t t0, int64_t b) {
  for (int64_t r = t0 / 2; r < std::min(R, (t0 + kTilePanel) / 2); r++) {
    const int32_t* a0 = sums[2 * r - t0];
    const int32_t* a1 = sums[2 * r + 1 - t0];
    const float s0 = term_scales[2 * r], s1 = term_scales[2 * r + 1];
    for (int n = 0; n < Blocks * kLanes; n++) {
      const float p0 = static_cast<float>(a0[n] - offsets[2 * r]) * s0;
      const float p1 = static_cast<float>(a1[n] - offsets[2 * r + 1]) * s1;
      out[r * N + b * kLanes + n] = (p0 + p1) * scale[b * kLanes + n];
    }
  }
}

// Blocks b0 .. b1 of the product for the R float rows whose terms [T, K] (padded with zero rows to
// whole panels) are given: per panel, per pair of blocks, row tiles 4-5 times weight tiles 6-7 into
// sum tiles 0-3 over K, then out. The weights (kTileChunkBlocks blocks) stay in L2 across panels.
void TilePass(const uint8_t* w, const int8_t* terms, const float* term_scales, const int32_t* offsets,
              const float* scale, float* out, int64_t K, int64_t N, int64_t R, int64_t b0, int64_t b1) {
  const TileScope scope(kTileInputs);
  alignas(64) int32_t sums[kTilePanel][32];
  for (int64_t t0 = 0; t0 < 2 * R; t0 += kTilePanel) {
    const int8_t* rows = terms + t0 * K;
    for (int64_t b = b0; b < b1; b += 2) {
      const uint8_t* wb = w + b * kLanes * K;          // block b's groups, 64 bytes each
      TILE_ZERO(0);
      TILE_ZERO(1);
      TILE_ZERO(2);
      TILE_ZERO(3);
      if (b + 1 < b1) {
        for (int64_t k = 0; k < K; k += kTileInputs) {
          TILE_LOAD(4, rows + k, K);
          TILE_LOAD(5, rows + kTileRows * K + k, K);
          TILE_LOAD(6, wb + k * kLanes, 64);
          TILE_LOAD(7, wb + kLanes * K + k * kLanes, 64);
          TILE_DOT(0, 4, 6);
          TILE_DOT(1, 4, 7);
          TILE_DOT(2, 5, 6);
          TILE_DOT(3, 5, 7);
        }
      } else {                                         // the claim's last block alone
        for (int64_t k = 0; k < K; k += kTileInputs) {
          TILE_LOAD(4, rows + k, K);
          TILE_LOAD(5, rows + kTileRows * K + k, K);
          TILE_LOAD(6, wb + k * kLanes, 64);
          TILE_DOT(0, 4, 6);
          TILE_DOT(2, 5, 6);
        }
      }
      TILE_STORE(0, &sums[0][0], sizeof sums[0]);
      TILE_STORE(1, &sums[0][16], sizeof sums[0]);
      TILE_STORE(2, &sums[kTileRows][0], sizeof sums[0]);
      TILE_STORE(3, &sums[kTileRows][16], sizeof sums[0]);
      if (b + 1 < b1)
        TileOutputs<2>(sums, term_scales, offsets, scale, out, N, R, t0, b);
      else
        TileOutputs<1>(sums, term_scales, offsets, scale, out, N, R, t0, b);
    }
  }
}

// Whether a chunk of R float rows by K inputs takes the tiles, `step` inputs per tdpbsud.
bool TakesTiles(int64_t R, int64_t K, int64_t step = kTileInputs) {
  return R >= kTileMinRows && K % step == 0 && TilesGranted();
}

// T term rows and the zero rows after them up to a whole panel.
int64_t PanelRows(int64_t T) { return (T + kTilePanel - 1) / kTilePanel * kTilePanel; }

// A block form's product on the tiles (Q5_0 and Q8_0: Blocks32; the K-quants: TilesK; the scaled-level
// forms: TilesS). Its scales change every sub-block of Form::kStep inputs (32; Q6_K's and Q3_K's 16),
// so each tdpbsud sums one sub-block, and its exact int32 sums per row and output leave the tiles for
// the form's Step, which takes them through the row passes' own integer and float operations in
// their order (one term per row here: the block forms round a row per 32 or 256 inputs, not in two
// terms). The form gives:
//   kStep                           inputs per sub-block
//   BlockLevels(b, buffer)          block b's levels (unsigned bytes) as weight tiles' rows, 4 inputs
//                                   of its 16 outputs in each 64 bytes: unpacked into buffer (16 x K
//                                   bytes) or, where held so (Q8_0), in place
//   Step(j, sums, total, whole, r0, live, b, blocks)
//                                   sub-block j's sums [row][output] for rows r0 .. r0 + live and
//                                   blocks b .. b + blocks -> the float outputs total (and whole, an
//                                   int32 sum per row and output the form may carry between steps;
//                                   both zero at the start)
// A panel's rows past R are zero terms, their outputs never written.
template <typename Form>
void BlockTilePass(const Form& form, const int8_t* terms, float* out, int64_t K, int64_t N, int64_t R, int64_t b0,
                   int64_t b1) {
  constexpr int64_t step = Form::kStep;
  thread_local std::vector<uint8_t> buffer;
  buffer.resize((b1 - b0) * kLanes * K);
  const uint8_t* levels[kTileChunkBlocks];
  for (int64_t b = b0; b < b1; b++) levels[b - b0] = form.BlockLevels(b, buffer.data() + (b - b0) * kLanes * K);
  const TileScope scope(step);                        // after the levels' stores (its barrier)
  alignas(64) int32_t sums[kTilePanel][32];
  alignas(64) float total[kTilePanel][32];
  alignas(64) int32_t whole[kTilePanel][32];
  for (int64_t t0 = 0; t0 < R; t0 += kTilePanel) {
    const int8_t* rows = terms + t0 * K;
    const int64_t live = std::min(kTilePanel, R - t0);
    for (int64_t b = b0; b < b1; b += 2) {
      const bool pair = b + 1 < b1;                   // else the claim's last block alone
      const uint8_t* w0 = levels[b - b0];
      const uint8_t* w1 = pair ? levels[b + 1 - b0] : nullptr;
      std::fill(&total[0][0], &total[0][0] + kTilePanel * 32, 0.0f);
      std::fill(&whole[0][0], &whole[0][0] + kTilePanel * 32, 0);
      for (int64_t k = 0; k < K; k += step) {
        TILE_ZERO(0);
        TILE_ZERO(2);
        TILE_LOAD(4, rows + k, K);
        TILE_LOAD(5, rows + kTileRows * K + k, K);
        TILE_LOAD(6, w0 + k * kLanes, 64);
        TILE_DOT(0, 4, 6);
        TILE_DOT(2, 5, 6);
        TILE_STORE(0, &sums[0][0], sizeof sums[0]);
        TILE_STORE(2, &sums[kTileRows][0], sizeof sums[0]);
        if (pair) {
          TILE_ZERO(1);
          TILE_ZERO(3);
          TILE_LOAD(7, w1 + k * kLanes, 64);
          TILE_DOT(1, 4, 7);
          TILE_DOT(3, 5, 7);
          TILE_STORE(1, &sums[0][16], sizeof sums[0]);
          TILE_STORE(3, &sums[kTileRows][16], sizeof sums[0]);
        }
        form.Step(k / step, sums, total, whole, t0, live, b, pair ? 2 : 1);
      }
      for (int64_t r = 0; r < live; r++)
        std::copy(total[r], total[r] + (pair ? 2 : 1) * kLanes, out + (t0 + r) * N + b * kLanes);
    }
  }
}

// Each of a claim's blocks b0 .. b1 on one of the pool's threads (BlockTilePass), K a whole number
// of the form's steps and the terms padded to whole panels.
template <typename Form>
void BlockTiles(ffi::ThreadPool& pool, const Form& form, const int8_t* terms, float* out, int64_t K, int64_t N,
                int64_t R, int64_t blocks) {
  const int64_t claim = TileClaim(K);
  Parallel(pool, (blocks + claim - 1) / claim, [&](int64_t c) {
    BlockTilePass(form, terms, out, K, N, R, c * claim, std::min((c + 1) * claim, blocks));
  });
}

// A half (float16's bits) as float, exactly (the row passes' vcvtph2ps).
inline float HalfFloat(uint16_t h) { return _cvtsh_ss(h); }

// A block form's step after its super-block (span) s: each row's and output's int32 sum `whole`
// leaves as AddBlock32 adds it, times d (float16 [N/16, spans, 16]) times the row's scale in one
// fused multiply-add, and starts again at zero (TilesK, TilesS).
inline void LeaveWhole(const uint16_t* d, int64_t spans, int64_t s, const float* term_scales, int64_t r0,
                       int64_t live, int64_t b, int blocks, int32_t (*whole)[32], float (*total)[32]) {
  float scale[32];
  for (int n = 0; n < blocks * kLanes; n++)
    scale[n] = HalfFloat(d[((b + n / kLanes) * spans + s) * kLanes + n % kLanes]);
  for (int64_t r = 0; r < live; r++) {
    const float ts = term_scales[(r0 + r) * spans + s];
    for (int n = 0; n < blocks * kLanes; n++) {
      total[r][n] = std::fma(static_cast<float>(whole[r][n]), scale[n] * ts, total[r][n]);
      whole[r][n] = 0;
    }
  }
}
#else
bool TakesTiles(int64_t, int64_t, int64_t = 0) { return false; }
int64_t PanelRows(int64_t T) { return T; }
#endif

// x float32 [R, K] times the packed offset weights, each output times its channel's scale ->
// float32 [R, N]. Each row becomes two int8 terms (the row, then what its rounding left, on its own
// scale) as engine/products.py's int8_terms makes them, and y = (p0 s0 + p1 s1) * scale in float32, in
// that order: the same numbers as the XLA path's, and no separate XLA loops around the product (at
// 1-4 decode rows those cost about as much as the product itself).
ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                      ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> out) {
  const auto wd = w.dimensions();
  const auto xd = x.dimensions();
  if (!Packed(wd) || xd.size() != 2 || xd[1] != wd[1] * kGroup ||
      scale.element_count() != wd[0] * kLanes)
    return ffi::Error::InvalidArgument("int8_matmul: x [R, K], weights [N/16, K/4, 16, 4], scale [N]");
  const int64_t blocks = wd[0], K = xd[1], N = blocks * kLanes, R = LiveRows(x.typed_data(), xd[0], K), T = 2 * R;
  ZeroRowsFrom(out->typed_data(), R, xd[0], N);
  const bool tiles = TakesTiles(R, K);
  // Row r's terms at 2r, 2r + 1; on the tiles, zero rows after them up to a whole panel.
  std::vector<int8_t> terms((tiles ? PanelRows(T) : T) * K);
  std::vector<float> term_scales(T);
  std::vector<int32_t> offsets(T);
  MakeTerms(x.typed_data(), R, K, terms.data(), term_scales.data(), offsets.data());
  const float* sp = scale.typed_data();
  float* op = out->typed_data();
#if MASHBOX_TILES
  if (tiles) {
    const int64_t claim = TileClaim(K);
    Parallel(pool, (blocks + claim - 1) / claim, [&](int64_t c) {
      TilePass(w.typed_data(), terms.data(), term_scales.data(), offsets.data(), sp, op, K, N, R, c * claim,
               std::min((c + 1) * claim, blocks));
    });
    return ffi::Error::Success();
  }
#endif
  Parallel(pool, Chunks(blocks), [&](int64_t c) {
    const int64_t b0 = c * kChunkBlocks;
    RowPasses(w.typed_data(), terms.data(), term_scales.data(), offsets.data(), sp, op, K, N, R, b0,
              std::min(b0 + kChunkBlocks, blocks));
  });
  return ffi::Error::Success();
}

// ---- the weights widened, for a prefill chunk's bfloat16 dot -----------------------------------

#if MASHBOX_AVX512
// 16 vectors of 16 dwords -> their transpose, in place: v[r] lane i becomes the old v[i] lane r.
inline void Transpose16(__m512i* v) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) {           // u[4i + m], 128-bit lane L: v[4i .. 4i+3] at dword 4L + m
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int m = 0; m < 4; m++) {           // a 4 x 4 transpose of 128-bit lanes per m
    const __m512i b0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44);
    const __m512i b1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE);
    const __m512i b2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
    const __m512i b3 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
    v[m] = _mm512_shuffle_i32x4(b0, b2, 0x88);
    v[4 + m] = _mm512_shuffle_i32x4(b0, b2, 0xDD);
    v[8 + m] = _mm512_shuffle_i32x4(b1, b3, 0x88);
    v[12 + m] = _mm512_shuffle_i32x4(b1, b3, 0xDD);
  }
}

// 16 offset bytes -> their int8 values as bfloat16 (exact: a float32 of |v| <= 128 keeps its value
// in its top 16 bits).
inline __m256i Bf16(__m128i bytes) {
  const __m512i values = _mm512_cvtepi8_epi32(_mm_xor_si128(bytes, _mm_set1_epi8(-128)));
  const __m512i bits = _mm512_castps_si512(_mm512_cvtepi32_ps(values));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}
#endif

// Packed offset weights [N/16, K/4, 16, 4] -> their int8 values as bfloat16 [N, K]. XLA's own
// transpose of the packed layout cost a 512-token prefill chunk of the demo 0.5 s (2.35 against
// 1.86 s); this runs at the speed of writing the copy, as the plain layout's convert does.
// `after` is not read: the product's input, so that XLA widens each matrix when its product is
// next, instead of hoisting every layer's widening to the program's start and holding all the
// copies at once (engine/native.py: widen).
ffi::Error Int8Widen(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> w, ffi::AnyBuffer after,
                     ffi::ResultBuffer<ffi::BF16> out) {
  const auto wd = w.dimensions();
  if (!Packed(wd)) return ffi::Error::InvalidArgument("int8_widen: weights [N/16, K/4, 16, 4]");
  const int64_t blocks = wd[0], groups = wd[1], K = groups * kGroup;
  const uint8_t* wp = w.typed_data();
  uint16_t* op = reinterpret_cast<uint16_t*>(out->typed_data());
  Parallel(pool, blocks, [&](int64_t b) {
    const uint8_t* block = wp + b * groups * kLanes * kGroup;
    uint16_t* rows = op + b * kLanes * K;
    int64_t g = 0;
#if MASHBOX_AVX512
    for (; g + 16 <= groups; g += 16) {   // 16 groups of 4 inputs x 16 outputs: 64 inputs of each
      __m512i v[16];
      for (int i = 0; i < 16; i++) v[i] = _mm512_loadu_si512(block + (g + i) * kLanes * kGroup);
      Transpose16(v);                     // v[l]: output l's 64 inputs from 4g
      for (int l = 0; l < kLanes; l++) {
        __m256i* to = reinterpret_cast<__m256i*>(rows + l * K + g * kGroup);
        _mm256_storeu_si256(to, Bf16(_mm512_extracti32x4_epi32(v[l], 0)));
        _mm256_storeu_si256(to + 1, Bf16(_mm512_extracti32x4_epi32(v[l], 1)));
        _mm256_storeu_si256(to + 2, Bf16(_mm512_extracti32x4_epi32(v[l], 2)));
        _mm256_storeu_si256(to + 3, Bf16(_mm512_extracti32x4_epi32(v[l], 3)));
      }
    }
#elif MASHBOX_AVX2
    const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
    for (; g + 4 <= groups; g += 4) {     // 4 groups: 16 inputs of each of the 16 outputs
      const uint8_t* at = block + g * kLanes * kGroup;
      for (int l = 0; l < kLanes; l++) {
        int32_t four[4];
        for (int i = 0; i < 4; i++) __builtin_memcpy(&four[i], at + i * kLanes * kGroup + l * kGroup, 4);
        const __m128i bytes = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(four)), flip);
        const __m128i low = Bf16x8(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
        const __m128i high = Bf16x8(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))));
        __m128i* to = reinterpret_cast<__m128i*>(rows + l * K + g * kGroup);
        _mm_storeu_si128(to, low);
        _mm_storeu_si128(to + 1, high);
      }
    }
#else
    const uint8x16_t flip = vdupq_n_u8(0x80);
    for (; g + 4 <= groups; g += 4) {     // 4 groups: 16 inputs of each of the 16 outputs
      const uint8_t* at = block + g * kLanes * kGroup;
      for (int l = 0; l < kLanes; l++) {
        uint8_t sixteen[16];
        for (int i = 0; i < 4; i++) __builtin_memcpy(sixteen + 4 * i, at + i * kLanes * kGroup + l * kGroup, 4);
        const int8x16_t values = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(sixteen), flip));
        const int16x8_t words[2] = {vmovl_s8(vget_low_s8(values)), vmovl_high_s8(values)};
        uint16_t* to = rows + l * K + g * kGroup;
        for (int h = 0; h < 2; h++)         // exact in bfloat16: a float32's top half
          vst1q_u16(to + 8 * h, vcombine_u16(
              vshrn_n_u32(vreinterpretq_u32_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(words[h])))), 16),
              vshrn_n_u32(vreinterpretq_u32_f32(vcvtq_f32_s32(vmovl_high_s16(words[h]))), 16)));
      }
    }
#endif
    for (; g < groups; g++)               // the rest
      for (int l = 0; l < kLanes; l++)
        for (int j = 0; j < kGroup; j++) {
          const float value = static_cast<float>(block[(g * kLanes + l) * kGroup + j]) - 128.0f;
          uint32_t bits;
          __builtin_memcpy(&bits, &value, sizeof bits);
          rows[l * K + g * kGroup + j] = static_cast<uint16_t>(bits >> 16);
        }
  });
  return ffi::Error::Success();
}

// ---- 5-bit weights: Q5_0's blocks as the file holds them ------------------------------------

// A GGUF's Q5_0 matrix holds each weight as q in 0..31 with a float16 scale d per 32 inputs,
// w = d (q - 16): 5.5 bits per weight, which per-channel int8 (8 bits) would widen and round
// again. Held as they are, in the layout engine.native.pack5 states (its docstring is the one
// statement), which this kernel reads per block b of 16 outputs and group g of 8 inputs as:
//   nib    uint8 [N/16, K/8, 16, 4]: 64 bytes, byte 4l + j with output 16b + l's level of input
//          8g + j in its low nibble and of input 8g + 4 + j in its high;
//   fifth  uint64 [N/16, K/8, 2] (held as uint32 [N/16, K/8, 4], the same bytes): two masks over
//          those 64 bytes, bit 4l + j of the first the fifth bit of byte 4l + j's low nibble's level,
//          of the second its high nibble's;
//   d      float16 [N/16, K/32, 16]: the 16 outputs' scales per 32 inputs.
// One 64-byte load holds 8 inputs of 16 outputs: two vpdpbusd per row, as the int8 layout's 4
// inputs take one. Products are exact per 32-input block; each block's sum leaves as float32 times
// its scales.
// The rows are rounded to int8 per 32 inputs (one term, its own scale per block) where the int8
// product makes two terms per row on per-row scales: two terms here made four rows cost 1.6x one
// row, one term per block 1.3x, for a mean KL of 0.00235 nats against 0.00211 (docs/performance.md).
constexpr int kNibbleGroup = 8;          // inputs per lane in one 64-byte load of nibbles
constexpr int kQ5Block = 32;             // inputs per scale
constexpr int kQ5Offset = 16;            // q - 16 is the weight's level

bool Packed5(const ffi::Span<const int64_t>& nib, const ffi::Span<const int64_t>& fifth,
             const ffi::Span<const int64_t>& d) {
  return nib.size() == 4 && nib[2] == kLanes && nib[3] == 4 && fifth.size() == 3 &&
         fifth[0] == nib[0] && fifth[1] == nib[1] && fifth[2] == 4 && d.size() == 3 &&
         d[0] == nib[0] && d[1] * kQ5Block == nib[1] * kNibbleGroup && d[2] == kLanes;
}

#if MASHBOX_NEON
// 16 bits -> 16 bytes, 0xFF where the bit is set (byte i: bit i): Levels' and KLevels' fifth bits.
inline uint8x16_t BitBytes(uint32_t bits) {
  const uint8x16_t spread = vcombine_u8(vdup_n_u8(static_cast<uint8_t>(bits)), vdup_n_u8(static_cast<uint8_t>(bits >> 8)));
  const uint8x16_t select = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  return vtstq_u8(spread, select);
}
#else
// 32 bits -> 32 bytes, 0xFF where the bit is set (byte i: bit i). Both x86 tiers: the AVX2 tier's
// Levels and the K-quant blocks' fifth bits.
inline __m256i BitBytes(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)),
                                             _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                              2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
}
#endif

// 64 bytes of nibbles and their fifth bits -> the levels q (0..31) of the low and the high nibbles.
#if MASHBOX_AVX512
inline void Levels(const uint8_t* nib, const uint64_t* fifth, __m512i* low, __m512i* high) {
  const __m512i four = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(kQ5Offset);
  const __m512i v = _mm512_loadu_si512(nib);
  const __m512i lo = _mm512_and_si512(v, four);
  const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), four);
  *low = _mm512_mask_add_epi8(lo, _cvtu64_mask64(fifth[0]), lo, sixteen);
  *high = _mm512_mask_add_epi8(hi, _cvtu64_mask64(fifth[1]), hi, sixteen);
}
#elif MASHBOX_AVX2
// As above, each as two 32-byte halves.
inline void Levels(const uint8_t* nib, const uint64_t* fifth, __m256i* low, __m256i* high) {
  const __m256i four = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(kQ5Offset);
  for (int h = 0; h < 2; h++) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nib + 32 * h));
    low[h] = _mm256_add_epi8(_mm256_and_si256(v, four),
                             _mm256_and_si256(BitBytes(static_cast<uint32_t>(fifth[0] >> (32 * h))), sixteen));
    high[h] = _mm256_add_epi8(_mm256_and_si256(_mm256_srli_epi16(v, 4), four),
                              _mm256_and_si256(BitBytes(static_cast<uint32_t>(fifth[1] >> (32 * h))), sixteen));
  }
}
#else
// As above, each as four 16-byte quarters.
inline void Levels(const uint8_t* nib, const uint64_t* fifth, uint8x16_t* low, uint8x16_t* high) {
  const uint8x16_t four = vdupq_n_u8(0x0F), sixteen = vdupq_n_u8(kQ5Offset);
  for (int h = 0; h < 4; h++) {
    const uint8x16_t v = vld1q_u8(nib + 16 * h);
    low[h] = vaddq_u8(vandq_u8(v, four), vandq_u8(BitBytes(static_cast<uint32_t>(fifth[0] >> (16 * h))), sixteen));
    high[h] = vaddq_u8(vshrq_n_u8(v, 4), vandq_u8(BitBytes(static_cast<uint32_t>(fifth[1] >> (16 * h))), sixteen));
  }
}
#endif

// A group's decoded levels (64 bytes low, 64 high, as the tier's vectors V) stored as a block's rows
// 2g and 2g + 1, and read back (DecodedGroup).
template <typename V>
__attribute__((always_inline)) inline void StoreGroup(uint8_t* decoded, int64_t g, const V* low, const V* high) {
  constexpr int kBytes = sizeof(V);
  for (int h = 0; h < 64 / kBytes; h++) {
    __builtin_memcpy(decoded + g * 128 + kBytes * h, &low[h], kBytes);
    __builtin_memcpy(decoded + g * 128 + 64 + kBytes * h, &high[h], kBytes);
  }
}

template <typename V>
__attribute__((always_inline)) inline void DecodedGroup(const uint8_t* decoded, int64_t g, V* low, V* high) {
  constexpr int kBytes = sizeof(V);
  for (int h = 0; h < 64 / kBytes; h++) {
    __builtin_memcpy(&low[h], decoded + g * 128 + kBytes * h, kBytes);
    __builtin_memcpy(&high[h], decoded + g * 128 + 64 + kBytes * h, kBytes);
  }
}

// Block b's levels decoded once (DecodeLevels5) as 64-byte rows of 4 inputs of its 16 outputs, group
// g's low nibbles' at row 2g and high nibbles' at 2g + 1: the weight tiles' rows (BlockTilePass), and
// what a long chunk's row passes read instead of decoding each group again for every few rows
// (Block5<R, true>): the same levels, so the same sums.
void DecodeLevels5(const uint8_t* nib, const uint64_t* fifth, int64_t K, int64_t b, uint8_t* out) {
  const int64_t groups = K / kNibbleGroup;
  for (int64_t g = 0; g < groups; g++) {
#if MASHBOX_AVX512
    __m512i low[1], high[1];
#elif MASHBOX_AVX2
    __m256i low[2], high[2];
#else
    uint8x16_t low[4], high[4];
#endif
    Levels(nib + (b * groups + g) * 64, fifth + (b * groups + g) * 2, low, high);
    StoreGroup(out, g, low, high);
  }
}

// Group g's levels for Block5: decoded before (kDecoded: the block's DecodeLevels5 rows), or from
// the nibbles and fifth bits.
template <bool kDecoded, typename V>
__attribute__((always_inline)) inline void GroupLevels(const uint8_t* nb, const uint64_t* fb, const uint8_t* decoded,
                                                       int64_t g, V* low, V* high) {
  if constexpr (kDecoded) {
    DecodedGroup(decoded, g, low, high);
  } else {
    Prefetch(nb + g * 64 + kPrefetch);
    PrefetchL2(nb + g * 64 + kPrefetchL2);
    Levels(nb + g * 64, fb + g * 2, low, high);
  }
}

// A per-block product's step (Block5, Block8): total[r] += float(acc[r]) * (the 16 outputs' float16
// scales d16 times row r's scale ts[r * stride]), each operation rounded once (the multiply-add fused).
#if MASHBOX_AVX512
template <int R>
__attribute__((always_inline)) inline void AddBlock32(__m512* total, const __m512i* acc, const uint16_t* d16,
                                                      const float* ts, int64_t stride) {
  const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d16)));
  for (int r = 0; r < R; r++)
    total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(scale, _mm512_set1_ps(ts[r * stride])),
                               total[r]);
}
#elif MASHBOX_AVX2
template <int R>
__attribute__((always_inline)) inline void AddBlock32(__m256 (*total)[2], const __m256i (*acc)[2],
                                                      const uint16_t* d16, const float* ts, int64_t stride) {
  for (int h = 0; h < 2; h++) {
    const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d16 + 8 * h)));
    for (int r = 0; r < R; r++) {
      const __m256 both = _mm256_mul_ps(scale, _mm256_set1_ps(ts[r * stride]));
      total[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), both, total[r][h]);
    }
  }
}
#else
template <int R>
__attribute__((always_inline)) inline void AddBlock32(float32x4_t (*total)[4], const int32x4_t (*acc)[4],
                                                      const uint16_t* d16, const float* ts, int64_t stride) {
  for (int h = 0; h < 4; h++) {
    const float32x4_t scale = Halves4(d16 + 4 * h);
    for (int r = 0; r < R; r++) {
      const float32x4_t both = vmulq_f32(scale, vdupq_n_f32(ts[r * stride]));
      total[r][h] = vfmaq_f32(total[r][h], vcvtq_f32_s32(acc[r][h]), both);
    }
  }
}
#endif

// One block of 16 outputs for R rows, each quantized per 32 inputs (Int5Matmul): per 32 inputs, sum
// q t exactly, take 16 times the terms' sum off (the level is q - 16), and add it times the weights'
// and the row's scales in float32.
#if MASHBOX_AVX512
template <int R, bool kDecoded>
void Block5(const uint8_t* nib, const uint64_t* fifth, const uint8_t* decoded, const uint16_t* d,
            const int8_t* terms, const int32_t* sums, const float* term_scales, float* out, int64_t K,
            int64_t N, int64_t b) {
  const int64_t groups = K / kNibbleGroup, blocks32 = K / kQ5Block;
  const uint8_t* nb = nib + b * groups * 64;
  const uint64_t* fb = fifth + b * groups * 2;
  const uint16_t* db = d + b * blocks32 * kLanes;
  __m512 total[R];
  for (int r = 0; r < R; r++) total[r] = _mm512_setzero_ps();
  for (int64_t g32 = 0; g32 < blocks32; g32++) {
    __m512i acc[R];                  // starts at -16 x the terms' sum: it ends at the levels' product
    for (int r = 0; r < R; r++) acc[r] = _mm512_set1_epi32(-kQ5Offset * sums[r * blocks32 + g32]);
    for (int i = 0; i < kQ5Block / kNibbleGroup; i++) {
      const int64_t g = g32 * (kQ5Block / kNibbleGroup) + i;
      if (i == 0) {                 // the fifth bits and scales of the same weights, once per 32 inputs
        if (!kDecoded) PrefetchL2(fb + (g + kPrefetchL2 / 64) * 2);
        PrefetchL2(db + (g32 + kPrefetchL2 / 256) * kLanes);
      }
      __m512i low, high;
      GroupLevels<kDecoded>(nb, fb, decoded, g, &low, &high);
      for (int r = 0; r < R; r++) {
        int32_t first, second;                             // terms[r, 8g .. 8g+3], [8g+4 .. 8g+7]
        __builtin_memcpy(&first, terms + r * K + g * kNibbleGroup, sizeof first);
        __builtin_memcpy(&second, terms + r * K + g * kNibbleGroup + 4, sizeof second);
        Dpbusd(acc[r], low, _mm512_set1_epi32(first));
        Dpbusd(acc[r], high, _mm512_set1_epi32(second));
      }
    }
    AddBlock32<R>(total, acc, db + g32 * kLanes, term_scales + g32, blocks32);
  }
  for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * N + b * kLanes, total[r]);
}
#elif MASHBOX_AVX2
template <int R, bool kDecoded>
void Block5(const uint8_t* nib, const uint64_t* fifth, const uint8_t* decoded, const uint16_t* d,
            const int8_t* terms, const int32_t* sums, const float* term_scales, float* out, int64_t K,
            int64_t N, int64_t b) {
  const int64_t groups = K / kNibbleGroup, blocks32 = K / kQ5Block;
  const uint8_t* nb = nib + b * groups * 64;
  const uint64_t* fb = fifth + b * groups * 2;
  const uint16_t* db = d + b * blocks32 * kLanes;
  __m256 total[R][2];
  for (int r = 0; r < R; r++) total[r][0] = total[r][1] = _mm256_setzero_ps();
  for (int64_t g32 = 0; g32 < blocks32; g32++) {
    __m256i acc[R][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_set1_epi32(-kQ5Offset * sums[r * blocks32 + g32]);
    // Two groups of 8 inputs at a time: their four vpmaddubsw pairs add up in int16 (levels <= 31:
    // at most 4 x 2 x 31 x 127 = 31,496) before one vpmaddwd widens them, a quarter fewer
    // instructions per row than widening each group's pairs.
    for (int i = 0; i < kQ5Block / kNibbleGroup; i += 2) {
      const int64_t g = g32 * (kQ5Block / kNibbleGroup) + i;
      if (i == 0) {
        if (!kDecoded) PrefetchL2(fb + (g + kPrefetchL2 / 64) * 2);
        PrefetchL2(db + (g32 + kPrefetchL2 / 256) * kLanes);
      }
      __m256i low[2][2], high[2][2];                       // [group][half]
      GroupLevels<kDecoded>(nb, fb, decoded, g, low[0], high[0]);
      GroupLevels<kDecoded>(nb, fb, decoded, g + 1, low[1], high[1]);
      for (int r = 0; r < R; r++) {
        int32_t four[4];                                   // terms[r, 8g .. 8g+15], 4 at a time
        __builtin_memcpy(four, terms + r * K + g * kNibbleGroup, sizeof four);
        const __m256i f0 = _mm256_set1_epi32(four[0]), s0 = _mm256_set1_epi32(four[1]);
        const __m256i f1 = _mm256_set1_epi32(four[2]), s1 = _mm256_set1_epi32(four[3]);
        for (int h = 0; h < 2; h++) {
          const __m256i pairs = _mm256_add_epi16(
              _mm256_add_epi16(_mm256_maddubs_epi16(low[0][h], f0), _mm256_maddubs_epi16(high[0][h], s0)),
              _mm256_add_epi16(_mm256_maddubs_epi16(low[1][h], f1), _mm256_maddubs_epi16(high[1][h], s1)));
          acc[r][h] = DotWords(acc[r][h], pairs, _mm256_set1_epi16(1));
        }
      }
    }
    AddBlock32<R>(total, acc, db + g32 * kLanes, term_scales + g32, blocks32);
  }
  for (int r = 0; r < R; r++)
    for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + r * N + b * kLanes + 8 * h, total[r][h]);
}
#else
// NEON: the levels (0..31) are sdot's signed operand as they are.
template <int R, bool kDecoded>
void Block5(const uint8_t* nib, const uint64_t* fifth, const uint8_t* decoded, const uint16_t* d,
            const int8_t* terms, const int32_t* sums, const float* term_scales, float* out, int64_t K,
            int64_t N, int64_t b) {
  const int64_t groups = K / kNibbleGroup, blocks32 = K / kQ5Block;
  const uint8_t* nb = nib + b * groups * 64;
  const uint64_t* fb = fifth + b * groups * 2;
  const uint16_t* db = d + b * blocks32 * kLanes;
  float32x4_t total[R][4];
  for (int r = 0; r < R; r++)
    for (int q = 0; q < 4; q++) total[r][q] = vdupq_n_f32(0.0f);
  for (int64_t g32 = 0; g32 < blocks32; g32++) {
    int32x4_t acc[R][4];
    for (int r = 0; r < R; r++)
      for (int q = 0; q < 4; q++) acc[r][q] = vdupq_n_s32(-kQ5Offset * sums[r * blocks32 + g32]);
    for (int i = 0; i < kQ5Block / kNibbleGroup; i++) {
      const int64_t g = g32 * (kQ5Block / kNibbleGroup) + i;
      if (i == 0) {
        if (!kDecoded) PrefetchL2(fb + (g + kPrefetchL2 / 64) * 2);
        PrefetchL2(db + (g32 + kPrefetchL2 / 256) * kLanes);
      }
      uint8x16_t low[4], high[4];
      GroupLevels<kDecoded>(nb, fb, decoded, g, low, high);
      for (int r = 0; r < R; r++) {
        int32_t first, second;                             // terms[r, 8g .. 8g+3], [8g+4 .. 8g+7]
        __builtin_memcpy(&first, terms + r * K + g * kNibbleGroup, sizeof first);
        __builtin_memcpy(&second, terms + r * K + g * kNibbleGroup + 4, sizeof second);
        const int8x16_t f = vreinterpretq_s8_s32(vdupq_n_s32(first)), t = vreinterpretq_s8_s32(vdupq_n_s32(second));
        for (int q = 0; q < 4; q++) {
          acc[r][q] = vdotq_s32(acc[r][q], vreinterpretq_s8_u8(low[q]), f);
          acc[r][q] = vdotq_s32(acc[r][q], vreinterpretq_s8_u8(high[q]), t);
        }
      }
    }
    AddBlock32<R>(total, acc, db + g32 * kLanes, term_scales + g32, blocks32);
  }
  for (int r = 0; r < R; r++)
    for (int q = 0; q < 4; q++) vst1q_f32(out + r * N + b * kLanes + 4 * q, total[r][q]);
}
#endif

using Block5Fn = void (*)(const uint8_t*, const uint64_t*, const uint8_t*, const uint16_t*, const int8_t*,
                          const int32_t*, const float*, float*, int64_t, int64_t, int64_t);
// [decoded][rows]: Block5 from the nibbles and fifth bits, or from a block's decoded levels.
#if MASHBOX_AVX512
constexpr Block5Fn kBlocks5[2][kMaxTerms + 1] = {
    {nullptr, Block5<1, false>, Block5<2, false>, Block5<3, false>, Block5<4, false>, Block5<5, false>,
     Block5<6, false>, Block5<7, false>, Block5<8, false>},
    {nullptr, Block5<1, true>, Block5<2, true>, Block5<3, true>, Block5<4, true>, Block5<5, true>,
     Block5<6, true>, Block5<7, true>, Block5<8, true>}};
#else
constexpr Block5Fn kBlocks5[2][kMaxTerms + 1] = {
    {nullptr, Block5<1, false>, Block5<2, false>, Block5<3, false>, Block5<4, false>},
    {nullptr, Block5<1, true>, Block5<2, true>, Block5<3, true>, Block5<4, true>}};
#endif

// The products whose weights change scale every 32 inputs (Q5_0's and Q8_0's blocks): rows x [R, K]
// rounded to int8 per 32 inputs on each block's own scale (one term, where the int8 product's
// per-row scales need two: BlockTerms), then block(n, decoded, terms, sums, term_scales, out, b) for
// each block b of 16 outputs, n <= kMaxTerms rows at a time (terms [n, K]; sums, term_scales
// [n, K/32]; out [n, N]), or a long chunk on the tiles (the form's BlockTilePass).
constexpr int kTermBlock = 32;           // inputs per row scale

// Rows x [R, K] -> their int8 terms [R, K] per 32 inputs, each block's scale and the terms' sum
// [R, K/32].
void BlockTerms(const float* x, int64_t R, int64_t K, int8_t* terms, float* term_scales, int32_t* sums) {
  const int64_t blocks32 = K / kTermBlock;
  for (int64_t r = 0; r < R; r++)
    for (int64_t j = 0; j < blocks32; j++) {
      const int64_t at = r * K + j * kTermBlock;
      term_scales[r * blocks32 + j] = QuantizeRow(x + at, terms + at, kTermBlock, &sums[r * blocks32 + j]);
    }
}

// A Q5_0 or Q8_0 matrix: its levels as 64-byte rows of 4 inputs (Q5_0's decoded, Q8_0's as held),
// which a long chunk's row passes read, and as the tiles take it (BlockTilePass's form): per 32
// inputs, the levels' exact sum less the offset times the terms' sum, then AddBlock32's float
// operations.
struct Blocks32 {
  static constexpr int kStep = kTermBlock;
  const uint8_t* nib;                    // Q5_0's nibbles and fifth bits (pack5), or null
  const uint64_t* fifth;
  const uint8_t* held;                   // Q8_0's levels + 128 (pack8): weight tiles' rows as held
  const uint16_t* d;                     // [N/16, K/32, 16]
  int32_t offset;                        // what the held levels add: 16 or 128
  int64_t K;
  const int32_t* sums = nullptr;         // the call's terms' sums and scales [R, K/32] (BlockTerms)
  const float* term_scales = nullptr;

  // Block b's levels: decoded into buffer (16 x K bytes), or as held.
  const uint8_t* BlockLevels(int64_t b, uint8_t* buffer) const {
    if (held) return held + b * kLanes * K;
    DecodeLevels5(nib, fifth, K, b, buffer);
    return buffer;
  }
#if MASHBOX_TILES

  void Step(int64_t j, const int32_t (*c)[32], float (*total)[32], int32_t (*)[32], int64_t r0, int64_t live,
            int64_t b, int blocks) const {
    const int64_t blocks32 = K / kTermBlock;
    float scale[32];
    for (int n = 0; n < blocks * kLanes; n++)
      scale[n] = HalfFloat(d[((b + n / kLanes) * blocks32 + j) * kLanes + n % kLanes]);
    for (int64_t r = 0; r < live; r++) {
      const float ts = term_scales[(r0 + r) * blocks32 + j];
      const int32_t less = offset * sums[(r0 + r) * blocks32 + j];
      for (int n = 0; n < blocks * kLanes; n++)
        total[r][n] = std::fma(static_cast<float>(c[r][n] - less), scale[n] * ts, total[r][n]);
    }
  }
#endif
};

// A chunk's rows pass over each block R / kMaxTerms times: past one pass, Q5_0's blocks are decoded
// once per chunk of blocks (Blocks32::BlockLevels, into the thread's buffer: 64 outputs x K bytes,
// within L2), and every pass reads the levels decoded (block's `decoded`; null: from the nibbles).
// Q8_0's held levels need no decoding.
template <typename Block>
void PerBlockProduct(ffi::ThreadPool& pool, const float* x, int64_t rows, int64_t K, int64_t blocks, float* out,
                     Block block, Blocks32 form) {
  const int64_t N = blocks * kLanes, blocks32 = K / kTermBlock, R = LiveRows(x, rows, K);
  ZeroRowsFrom(out, R, rows, N);
  const bool tiles = TakesTiles(R, K, kTermBlock);
  std::vector<int8_t> terms((tiles ? PanelRows(R) : R) * K);   // on the tiles, zero rows to a whole panel
  std::vector<float> term_scales(R * blocks32);             // per row and 32 inputs
  std::vector<int32_t> sums(R * blocks32, 0);               // the terms' sum per row and 32 inputs
  BlockTerms(x, R, K, terms.data(), term_scales.data(), sums.data());
#if MASHBOX_TILES
  if (tiles) {
    form.sums = sums.data();
    form.term_scales = term_scales.data();
    BlockTiles(pool, form, terms.data(), out, K, N, R, blocks);
    return;
  }
#endif
  const bool decode = form.nib != nullptr && R > kMaxTerms;
  Parallel(pool, Chunks(blocks), [&](int64_t c) {
    const int64_t b0 = c * kChunkBlocks, b1 = std::min(b0 + kChunkBlocks, blocks);
    thread_local std::vector<uint8_t> decoded;
    if (decode) {
      decoded.resize((b1 - b0) * kLanes * K);
      for (int64_t b = b0; b < b1; b++) form.BlockLevels(b, decoded.data() + (b - b0) * kLanes * K);
    }
    for (int64_t r0 = 0; r0 < R; r0 += kMaxTerms) {        // 8 rows per pass over the chunk (AVX2, NEON: 4)
      const int64_t n = std::min<int64_t>(kMaxTerms, R - r0);
      for (int64_t b = b0; b < b1; b++)
        block(n, decode ? decoded.data() + (b - b0) * kLanes * K : nullptr, terms.data() + r0 * K,
              sums.data() + r0 * blocks32, term_scales.data() + r0 * blocks32, out + r0 * N, b);
    }
  });
}

// x float32 [R, K] times 5-bit weights -> float32 [R, N] (PerBlockProduct): each 32 inputs' exact
// product is added times both scales.
ffi::Error Int5Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> nib,
                      ffi::Buffer<ffi::U32> fifth, ffi::Buffer<ffi::F16> d,
                      ffi::ResultBuffer<ffi::F32> out) {
  static_assert(kQ5Block == kTermBlock, "a Q5_0 block is a row term's block");
  const auto xd = x.dimensions();
  if (!Packed5(nib.dimensions(), fifth.dimensions(), d.dimensions()) || xd.size() != 2 ||
      xd[1] != nib.dimensions()[1] * kNibbleGroup)
    return ffi::Error::InvalidArgument("int5_matmul: x [R, K], nib [N/16, K/8, 16, 4], fifth [N/16, K/8, 4], "
                                       "d [N/16, K/32, 16]");
  const int64_t blocks = nib.dimensions()[0], K = xd[1], N = blocks * kLanes;
  const uint8_t* np_ = nib.typed_data();
  const uint64_t* fp = reinterpret_cast<const uint64_t*>(fifth.typed_data());
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.typed_data());
  PerBlockProduct(pool, x.typed_data(), xd[0], K, blocks, out->typed_data(),
                  [&](int64_t n, const uint8_t* decoded, const int8_t* terms, const int32_t* sums,
                      const float* term_scales, float* o, int64_t b) {
                    kBlocks5[decoded != nullptr][n](np_, fp, decoded, dp, terms, sums, term_scales, o, K, N, b);
                  },
                  Blocks32{np_, fp, nullptr, dp, kQ5Offset, K});
  return ffi::Error::Success();
}

// 5-bit weights -> their values d (q - 16) rounded to bfloat16 (nearest, ties to even) [N, K], for a
// prefill chunk's dot: the scales change every 32 inputs, so they cannot wait until after the dot
// as int8's per-channel ones do. `after` as Int8Widen's.
ffi::Error Int5Widen(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> nib, ffi::Buffer<ffi::U32> fifth,
                     ffi::Buffer<ffi::F16> d, ffi::AnyBuffer after, ffi::ResultBuffer<ffi::BF16> out) {
  if (!Packed5(nib.dimensions(), fifth.dimensions(), d.dimensions()))
    return ffi::Error::InvalidArgument("int5_widen: nib [N/16, K/8, 16, 4], fifth [N/16, K/8, 4], d [N/16, K/32, 16]");
  const int64_t blocks = nib.dimensions()[0], groups = nib.dimensions()[1], K = groups * kNibbleGroup;
  const int64_t blocks32 = K / kQ5Block;
  const uint8_t* np_ = nib.typed_data();
  const uint64_t* fp = reinterpret_cast<const uint64_t*>(fifth.typed_data());
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.typed_data());
  uint16_t* op = reinterpret_cast<uint16_t*>(out->typed_data());
  Parallel(pool, blocks, [&](int64_t b) {
    alignas(64) uint8_t lanes[kLanes][kQ5Block];           // one scale block's levels per output
    alignas(64) uint8_t low[64], high[64];
    for (int64_t g32 = 0; g32 < blocks32; g32++) {
      for (int i = 0; i < kQ5Block / kNibbleGroup; i++) {
        const int64_t g = g32 * (kQ5Block / kNibbleGroup) + i;
#if MASHBOX_AVX512
        __m512i lo, hi;
        Levels(np_ + (b * groups + g) * 64, fp + (b * groups + g) * 2, &lo, &hi);
        _mm512_store_si512(low, lo);
        _mm512_store_si512(high, hi);
#elif MASHBOX_AVX2
        __m256i lo[2], hi[2];
        Levels(np_ + (b * groups + g) * 64, fp + (b * groups + g) * 2, lo, hi);
        for (int h = 0; h < 2; h++) {
          _mm256_store_si256(reinterpret_cast<__m256i*>(low + 32 * h), lo[h]);
          _mm256_store_si256(reinterpret_cast<__m256i*>(high + 32 * h), hi[h]);
        }
#else
        uint8x16_t lo[4], hi[4];
        Levels(np_ + (b * groups + g) * 64, fp + (b * groups + g) * 2, lo, hi);
        for (int h = 0; h < 4; h++) {
          vst1q_u8(low + 16 * h, lo[h]);
          vst1q_u8(high + 16 * h, hi[h]);
        }
#endif
        for (int l = 0; l < kLanes; l++) {
          __builtin_memcpy(&lanes[l][i * kNibbleGroup], low + 4 * l, 4);
          __builtin_memcpy(&lanes[l][i * kNibbleGroup + 4], high + 4 * l, 4);
        }
      }
      alignas(64) float scale[kLanes];
#if MASHBOX_AVX512
      const __m512 scales = _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(dp + (b * blocks32 + g32) * kLanes)));
      _mm512_store_ps(scale, scales);
#elif MASHBOX_AVX2
      for (int h = 0; h < 2; h++)
        _mm256_store_ps(scale + 8 * h, _mm256_cvtph_ps(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(dp + (b * blocks32 + g32) * kLanes + 8 * h))));
#else
      for (int q = 0; q < 4; q++) vst1q_f32(scale + 4 * q, Halves4(dp + (b * blocks32 + g32) * kLanes + 4 * q));
#endif
      for (int l = 0; l < kLanes; l++) {
        uint16_t* row = op + (b * kLanes + l) * K + g32 * kQ5Block;
#if MASHBOX_AVX512
        for (int h = 0; h < kQ5Block; h += 16) {
          const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(&lanes[l][h]));
          const __m512i level = _mm512_sub_epi32(_mm512_cvtepu8_epi32(q), _mm512_set1_epi32(kQ5Offset));
          const __m512 value = _mm512_mul_ps(_mm512_cvtepi32_ps(level), _mm512_set1_ps(scale[l]));
          __m512i bits = _mm512_castps_si512(value);        // round to nearest even, then the top half
          const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
          bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + h),
                              _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
        }
#elif MASHBOX_AVX2
        for (int h = 0; h < kQ5Block; h += 8) {
          const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(&lanes[l][h]));
          const __m256i level = _mm256_sub_epi32(_mm256_cvtepu8_epi32(q), _mm256_set1_epi32(kQ5Offset));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(row + h),
                           Bf16x8(_mm256_mul_ps(_mm256_cvtepi32_ps(level), _mm256_set1_ps(scale[l]))));
        }
#else
        for (int h = 0; h < kQ5Block; h += 4)
          vst1_u16(row + h, Bf16x4(vmulq_f32(Levels4(&lanes[l][h], kQ5Offset), vdupq_n_f32(scale[l]))));
#endif
      }
    }
  });
  return ffi::Error::Success();
}

// ---- 8-bit blocks: Q8_0's as the file holds them ------------------------------------------------

// A GGUF's Q8_0 matrix holds each weight as an int8 level q with a float16 scale d per 32 inputs,
// w = d q (the demo's tied embedding and LM head; every matrix of a Q8_0 file). Held as they are
// (engine.native.pack8): the levels plus 128 in the int8 layout's packed blocks (one 64-byte load:
// 4 inputs of 16 outputs), and d float16 [N/16, K/32, 16] as Q5_0's. The rows are rounded to int8
// per 32 inputs as Int5Matmul's are (one term on each block's scale, where the int8 product takes
// two per row): half the products of the int8 form for the same weights, which per channel would be
// rounded a second time. Each 32 inputs' exact sum leaves as float32 times both scales.
constexpr int kQ8Block = 32;             // inputs per scale
constexpr int kQ8Offset = 128;           // held level = q + 128 (vpdpbusd's unsigned operand)

bool Packed8(const ffi::Span<const int64_t>& q, const ffi::Span<const int64_t>& d) {
  return Packed(q) && (q[1] * kGroup) % kQ8Block == 0 && d.size() == 3 && d[0] == q[0] &&
         d[1] * kQ8Block == q[1] * kGroup && d[2] == kLanes;
}

// One block of 16 outputs for R rows (terms per 32 inputs: sums and term_scales [R, K/32]).
#if MASHBOX_AVX512
template <int R>
void Block8(const uint8_t* q, const uint16_t* d, const int8_t* terms, const int32_t* sums,
            const float* term_scales, float* out, int64_t K, int64_t N, int64_t b) {
  const int64_t groups = K / kGroup, blocks32 = K / kQ8Block;
  const uint8_t* qb = q + b * groups * 64;
  const uint16_t* db = d + b * blocks32 * kLanes;
  __m512 total[R];
  for (int r = 0; r < R; r++) total[r] = _mm512_setzero_ps();
  for (int64_t g32 = 0; g32 < blocks32; g32++) {
    __m512i acc[R];                  // starts at -128 x the terms' sum: the offset's part
    for (int r = 0; r < R; r++) acc[r] = _mm512_set1_epi32(-kQ8Offset * sums[r * blocks32 + g32]);
    PrefetchL2(db + (g32 + kPrefetchL2 / 512) * kLanes);
    for (int i = 0; i < kQ8Block / kGroup; i++) {
      const int64_t g = g32 * (kQ8Block / kGroup) + i;
      Prefetch(qb + g * 64 + kPrefetch);
      PrefetchL2(qb + g * 64 + kPrefetchL2);
      const __m512i wv = _mm512_loadu_si512(qb + g * 64);
      for (int r = 0; r < R; r++) {
        int32_t four;                                      // terms[r, 4g .. 4g+3]
        __builtin_memcpy(&four, terms + r * K + g * kGroup, sizeof four);
        Dpbusd(acc[r], wv, _mm512_set1_epi32(four));
      }
    }
    AddBlock32<R>(total, acc, db + g32 * kLanes, term_scales + g32, blocks32);
  }
  for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * N + b * kLanes, total[r]);
}
#elif MASHBOX_AVX2
// The signed levels (the top bit flipped) take the terms' signs, as ScaledBlock's: a level of -128
// would not (engine.weights keeps Q8_0 blocks only where none is). With AVX-VNNI, the held levels
// as they are, as the AVX-512 tier's.
template <int R>
void Block8(const uint8_t* q, const uint16_t* d, const int8_t* terms, const int32_t* sums,
            const float* term_scales, float* out, int64_t K, int64_t N, int64_t b) {
  const int64_t groups = K / kGroup, blocks32 = K / kQ8Block;
  const uint8_t* qb = q + b * groups * 64;
  const uint16_t* db = d + b * blocks32 * kLanes;
  const int32_t offset = MASHBOX_AVXVNNI ? kQ8Offset : 0;
  __m256 total[R][2];
  for (int r = 0; r < R; r++) total[r][0] = total[r][1] = _mm256_setzero_ps();
  for (int64_t g32 = 0; g32 < blocks32; g32++) {
    __m256i acc[R][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_set1_epi32(-offset * sums[r * blocks32 + g32]);
    PrefetchL2(db + (g32 + kPrefetchL2 / 512) * kLanes);
    for (int i = 0; i < kQ8Block / kGroup; i++) {
      const int64_t g = g32 * (kQ8Block / kGroup) + i;
      const uint8_t* at = qb + g * 64;
      Prefetch(at + kPrefetch);
      PrefetchL2(at + kPrefetchL2);
      const __m256i w0 = HeldBytes(at), w1 = HeldBytes(at + 32);
      for (int r = 0; r < R; r++) {
        int32_t four;
        __builtin_memcpy(&four, terms + r * K + g * kGroup, sizeof four);
        const __m256i tv = _mm256_set1_epi32(four);
        acc[r][0] = AddTerm(acc[r][0], w0, tv);
        acc[r][1] = AddTerm(acc[r][1], w1, tv);
      }
    }
    AddBlock32<R>(total, acc, db + g32 * kLanes, term_scales + g32, blocks32);
  }
  for (int r = 0; r < R; r++)
    for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + r * N + b * kLanes + 8 * h, total[r][h]);
}
#else
template <int R>
void Block8(const uint8_t* q, const uint16_t* d, const int8_t* terms, const int32_t*,
            const float* term_scales, float* out, int64_t K, int64_t N, int64_t b) {
  const int64_t groups = K / kGroup, blocks32 = K / kQ8Block;
  const uint8_t* qb = q + b * groups * 64;
  const uint16_t* db = d + b * blocks32 * kLanes;
  const uint8x16_t flip = vdupq_n_u8(0x80);
  float32x4_t total[R][4];
  for (int r = 0; r < R; r++)
    for (int h = 0; h < 4; h++) total[r][h] = vdupq_n_f32(0.0f);
  for (int64_t g32 = 0; g32 < blocks32; g32++) {
    int32x4_t acc[R][4];
    for (int r = 0; r < R; r++)
      for (int h = 0; h < 4; h++) acc[r][h] = vdupq_n_s32(0);
    PrefetchL2(db + (g32 + kPrefetchL2 / 512) * kLanes);
    for (int i = 0; i < kQ8Block / kGroup; i++) {
      const int64_t g = g32 * (kQ8Block / kGroup) + i;
      const uint8_t* at = qb + g * 64;
      Prefetch(at + kPrefetch);
      PrefetchL2(at + kPrefetchL2);
      int8x16_t wv[4];
      for (int h = 0; h < 4; h++) wv[h] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(at + 16 * h), flip));
      for (int r = 0; r < R; r++) {
        int32_t four;
        __builtin_memcpy(&four, terms + r * K + g * kGroup, sizeof four);
        const int8x16_t tv = vreinterpretq_s8_s32(vdupq_n_s32(four));
        for (int h = 0; h < 4; h++) acc[r][h] = vdotq_s32(acc[r][h], wv[h], tv);
      }
    }
    AddBlock32<R>(total, acc, db + g32 * kLanes, term_scales + g32, blocks32);
  }
  for (int r = 0; r < R; r++)
    for (int h = 0; h < 4; h++) vst1q_f32(out + r * N + b * kLanes + 4 * h, total[r][h]);
}
#endif

using Block8Fn = void (*)(const uint8_t*, const uint16_t*, const int8_t*, const int32_t*, const float*, float*,
                          int64_t, int64_t, int64_t);
#if MASHBOX_AVX512
constexpr Block8Fn kBlocks8[kMaxTerms + 1] = {nullptr, Block8<1>, Block8<2>, Block8<3>, Block8<4>,
                                              Block8<5>, Block8<6>, Block8<7>, Block8<8>};
#else
constexpr Block8Fn kBlocks8[kMaxTerms + 1] = {nullptr, Block8<1>, Block8<2>, Block8<3>, Block8<4>};
#endif

// x float32 [R, K] times Q8_0 blocks (q: levels + 128, packed; d) -> float32 [R, N]
// (PerBlockProduct): each 32 inputs' exact product is added times both scales.
ffi::Error Q8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                    ffi::Buffer<ffi::F16> d, ffi::ResultBuffer<ffi::F32> out) {
  static_assert(kQ8Block == kTermBlock, "a Q8_0 block is a row term's block");
  const auto xd = x.dimensions();
  if (!Packed8(q.dimensions(), d.dimensions()) || xd.size() != 2 || xd[1] != q.dimensions()[1] * kGroup)
    return ffi::Error::InvalidArgument("q8_matmul: x [R, K], q [N/16, K/4, 16, 4], d [N/16, K/32, 16]");
  const int64_t blocks = q.dimensions()[0], K = xd[1], N = blocks * kLanes;
  const uint8_t* qp = q.typed_data();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.typed_data());
  PerBlockProduct(pool, x.typed_data(), xd[0], K, blocks, out->typed_data(),
                  [&](int64_t n, const uint8_t*, const int8_t* terms, const int32_t* sums, const float* term_scales,
                      float* o, int64_t b) { kBlocks8[n](qp, dp, terms, sums, term_scales, o, K, N, b); },
                  Blocks32{nullptr, nullptr, qp, dp, kQ8Offset, K});
  return ffi::Error::Success();
}

// Q8_0 blocks -> their values d q rounded to bfloat16 (nearest, ties to even) [N, K], for a prefill
// chunk's dot. `after` as Int8Widen's.
ffi::Error Q8Widen(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> q, ffi::Buffer<ffi::F16> d, ffi::AnyBuffer after,
                   ffi::ResultBuffer<ffi::BF16> out) {
  if (!Packed8(q.dimensions(), d.dimensions()))
    return ffi::Error::InvalidArgument("q8_widen: q [N/16, K/4, 16, 4], d [N/16, K/32, 16]");
  const int64_t blocks = q.dimensions()[0], groups = q.dimensions()[1], K = groups * kGroup;
  const int64_t blocks32 = K / kQ8Block;
  const uint8_t* qp = q.typed_data();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.typed_data());
  uint16_t* op = reinterpret_cast<uint16_t*>(out->typed_data());
  Parallel(pool, blocks, [&](int64_t b) {
    for (int64_t g32 = 0; g32 < blocks32; g32++) {
      alignas(32) float scale[kLanes];
#if MASHBOX_NEON
      for (int h = 0; h < 4; h++) vst1q_f32(scale + 4 * h, Halves4(dp + (b * blocks32 + g32) * kLanes + 4 * h));
#else
      for (int h = 0; h < 2; h++)
        _mm256_store_ps(scale + 8 * h, _mm256_cvtph_ps(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(dp + (b * blocks32 + g32) * kLanes + 8 * h))));
#endif
      const uint8_t* group = qp + (b * groups + g32 * (kQ8Block / kGroup)) * kLanes * kGroup;
      for (int l = 0; l < kLanes; l++) {
        uint16_t* row = op + (b * kLanes + l) * K + g32 * kQ8Block;
        for (int i = 0; i < kQ8Block / kGroup; i += 2) {   // 8 inputs: two groups' 4 of lane l
#if MASHBOX_NEON
          for (int j = 0; j < 2; j++)
            vst1_u16(row + (i + j) * kGroup, Bf16x4(vmulq_f32(Levels4(group + ((i + j) * kLanes + l) * kGroup, kQ8Offset),
                                                              vdupq_n_f32(scale[l]))));
#else
          int32_t four[2];
          __builtin_memcpy(&four[0], group + (i * kLanes + l) * kGroup, 4);
          __builtin_memcpy(&four[1], group + ((i + 1) * kLanes + l) * kGroup, 4);
          const __m256i level = _mm256_sub_epi32(
              _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(four))),
              _mm256_set1_epi32(kQ8Offset));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(row + i * kGroup),
                           Bf16x8(_mm256_mul_ps(_mm256_cvtepi32_ps(level), _mm256_set1_ps(scale[l]))));
#endif
        }
      }
    }
  });
  return ffi::Error::Success();
}

// ---- K-quant blocks: Q4_K, Q5_K and Q6_K as the file holds them ---------------------------------

// The blocks of a GGUF's Q4_K_M / Q5_K_M / Q6_K files. Each holds 256 inputs per super-block with a
// float16 d (Q4_K and Q5_K a float16 dmin too), and small integer scales per sub-block:
//   Q4_K  w = d sc q - dmin m   q 0..15, sc and m 0..63 per 32 inputs    (4.5 bits per weight)
//   Q5_K  the same with q 0..31                                          (5.5 bits)
//   Q6_K  w = d sc (q - 32)     q 0..63, sc int8 per 16 inputs           (6.5625 bits)
// Held as they are, in the layout engine.native.pack_k states (its docstring is the one statement):
// the levels' low four bits as pack5's nibbles, Q5_K's fifth bits as pack5's masks, Q6_K's top two
// bits beside the nibbles (32 bytes per 64-byte nibble group: byte p's bits 0-1 and 2-3 the low and
// high nibble's of nibble byte p, bits 4-5 and 6-7 those of byte p + 32), and per block of 16
// outputs the 16 lanes' sub-block scales (and mins), d and dmin.
//
// The rows are rounded to int8 per 256 inputs (one term on its own scale, as the blocks' own
// reference products do). Per 8 inputs (Q4_K and Q5_K 16: kKSummed) the two nibble halves' products
// stay in int16, vpmaddwd multiplies them by each lane's sub-block scale into int32, so a super-block
// sums exactly in one register: A = sum_j sc_j sum_i q t. The mins' part, sum_j m_j sum_i t (Q6_K:
// 32 sc_j), is folded into the float sums per sub-block. Written once, with 256-bit instructions,
// for both x86 tiers (no AVX-512 form: this is the form tests/test_native.py checks on this tier's
// CPUs); NEON's sdot sums each sub-block's q t in int32 and multiplies it by the lane's scale there.
constexpr int kSuper = 256;              // inputs per super-block (d, dmin)
constexpr int kKRows = 4;                // float rows per pass over a block of 16 outputs
constexpr int kQ6Offset = 32;            // Q6_K: q - 32 is the weight's level

enum class KForm { kQ4, kQ5, kQ6 };      // Q4_K, Q5_K, Q6_K

// One K-quant matrix's arrays (pack_k), all per block of 16 outputs.
struct KBlocks {
  const uint8_t* nib;     // [N/16, K/8, 16, 4]
  const uint8_t* hi;      // Q6_K: [N/16, K/8, 32]; else null
  const uint64_t* fifth;  // Q5_K: [N/16, K/8, 2]; else null
  const int8_t* sc;       // [N/16, K/sub, 16]
  const uint8_t* mins;    // Q4_K, Q5_K: [N/16, K/32, 16]; Q6_K: null
  const uint16_t* d;      // float16 [N/16, K/256, 16]
  const uint16_t* dmin;   // Q4_K, Q5_K: float16 [N/16, K/256, 16]; Q6_K: null
  int64_t blocks, K;
};

template <KForm F>
constexpr int kSub = F == KForm::kQ6 ? 16 : 32;     // inputs per sub-block scale
// Groups of 8 inputs whose vpmaddubsw pairs add up in int16 before vpmaddwd takes their sub-block's
// scale: each group's two pairs reach 2 x 2 x top level x 127, so Q4_K's (15) and Q5_K's (31) leave
// room for two groups, Q6_K's (63) for one. Half the vpmaddwd per row, and their additions into the
// accumulator; four of Q4_K's groups at once ran out of registers (slower from 16 rows on).
template <KForm F>
constexpr int kKSummed = F == KForm::kQ6 ? 1 : 2;

// 64 bytes of nibbles (and Q5_K's fifth bits or Q6_K's top bits) -> the levels of the low and the
// high nibbles, each as two 32-byte halves (NEON: four 16-byte quarters).
#if MASHBOX_NEON
template <KForm F>
inline void KLevels(const uint8_t* nib, const uint8_t* hi, const uint64_t* fifth, uint8x16_t* low, uint8x16_t* high) {
  const uint8x16_t four = vdupq_n_u8(0x0F);
  for (int h = 0; h < 4; h++) {
    const uint8x16_t v = vld1q_u8(nib + 16 * h);
    low[h] = vandq_u8(v, four);
    high[h] = vshrq_n_u8(v, 4);
  }
  if (F == KForm::kQ5) {
    const uint8x16_t sixteen = vdupq_n_u8(16);
    for (int h = 0; h < 4; h++) {
      low[h] = vorrq_u8(low[h], vandq_u8(BitBytes(static_cast<uint32_t>(fifth[0] >> (16 * h))), sixteen));
      high[h] = vorrq_u8(high[h], vandq_u8(BitBytes(static_cast<uint32_t>(fifth[1] >> (16 * h))), sixteen));
    }
  }
  if (F == KForm::kQ6) {                 // top byte p serves nibble bytes p and p + 32
    const uint8x16_t two = vdupq_n_u8(0x30);
    for (int h = 0; h < 2; h++) {
      const uint8x16_t top = vld1q_u8(hi + 16 * h);
      low[h] = vorrq_u8(low[h], vandq_u8(vshlq_n_u8(top, 4), two));
      high[h] = vorrq_u8(high[h], vandq_u8(vshlq_n_u8(top, 2), two));
      low[h + 2] = vorrq_u8(low[h + 2], vandq_u8(top, two));
      high[h + 2] = vorrq_u8(high[h + 2], vandq_u8(vshrq_n_u8(top, 2), two));
    }
  }
}
#else
template <KForm F>
inline void KLevels(const uint8_t* nib, const uint8_t* hi, const uint64_t* fifth, __m256i* low, __m256i* high) {
  const __m256i four = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < 2; h++) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nib + 32 * h));
    low[h] = _mm256_and_si256(v, four);
    high[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), four);
  }
  if (F == KForm::kQ5) {
    const __m256i sixteen = _mm256_set1_epi8(16);
    for (int h = 0; h < 2; h++) {
      const uint32_t lows = static_cast<uint32_t>(fifth[0] >> (32 * h)), highs = static_cast<uint32_t>(fifth[1] >> (32 * h));
      low[h] = _mm256_or_si256(low[h], _mm256_and_si256(BitBytes(lows), sixteen));
      high[h] = _mm256_or_si256(high[h], _mm256_and_si256(BitBytes(highs), sixteen));
    }
  }
  if (F == KForm::kQ6) {                 // each top-bit pair moved to bits 4-5 of its byte
    const __m256i top = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi));
    const __m256i two = _mm256_set1_epi8(0x30);
    low[0] = _mm256_or_si256(low[0], _mm256_and_si256(_mm256_slli_epi16(top, 4), two));
    high[0] = _mm256_or_si256(high[0], _mm256_and_si256(_mm256_slli_epi16(top, 2), two));
    low[1] = _mm256_or_si256(low[1], _mm256_and_si256(top, two));
    high[1] = _mm256_or_si256(high[1], _mm256_and_si256(_mm256_srli_epi16(top, 2), two));
  }
}

// 8 lanes' sub-block scales (int8) -> each in both int16 halves of its int32 lane, vpmaddwd's operand.
inline __m256i ScalePairs(const int8_t* sc) {
  const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)));
  return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
}
#endif

// Block b's levels decoded once as DecodeLevels5's rows (group g's low nibbles' at 2g, high at
// 2g + 1): the weight tiles' rows (TilesK), and what a long chunk's row passes read (BlockK<R, F,
// true>) instead of decoding each group again for every few rows.
template <KForm F>
void DecodeLevelsK(const KBlocks& w, int64_t b, uint8_t* out) {
  const int64_t groups = w.K / kNibbleGroup;
  for (int64_t g = 0; g < groups; g++) {
    const int64_t at = b * groups + g;
#if MASHBOX_NEON
    uint8x16_t low[4], high[4];
#else
    __m256i low[2], high[2];
#endif
    KLevels<F>(w.nib + at * 64, F == KForm::kQ6 ? w.hi + at * 32 : nullptr, F == KForm::kQ5 ? w.fifth + at * 2 : nullptr,
               low, high);
    StoreGroup(out, g, low, high);
  }
}

// Group g of block b's levels for BlockK (nb, hb, fb: the block's nibbles, top bits, fifth bits):
// decoded before (kDecoded: the block's DecodeLevelsK rows), or decoded here.
template <KForm F, bool kDecoded, typename V>
__attribute__((always_inline)) inline void KGroupLevels(const uint8_t* nb, const uint8_t* hb, const uint64_t* fb,
                                                        const uint8_t* decoded, int64_t g, V* low, V* high) {
  if constexpr (kDecoded) {
    DecodedGroup(decoded, g, low, high);
  } else {
    Prefetch(nb + g * 64 + kPrefetch);
    PrefetchL2(nb + g * 64 + kPrefetchL2);
    if (F == KForm::kQ6) PrefetchL2(hb + g * 32 + kPrefetchL2 / 2);
    if (F == KForm::kQ5) PrefetchL2(fb + (g + kPrefetchL2 / 64) * 2);
    KLevels<F>(nb + g * 64, F == KForm::kQ6 ? hb + g * 32 : nullptr, F == KForm::kQ5 ? fb + g * 2 : nullptr, low,
               high);
  }
}

// One block of 16 outputs for R rows (terms per 256 inputs: term_scales [R, K/256], sub_sums [R,
// K/sub] the terms' sums per sub-block as floats). Per sub-block j of super-block s, first the mins'
// part: total -= (dmin m_j) (scale_s sum_j) (Q6_K: (32 d) sc_j); after the super-block, total +=
// float(A) (d scale_s). Each operation rounded once, in that order (tests/test_native.py).
#if MASHBOX_NEON
template <int R, KForm F, bool kDecoded>
void BlockK(const KBlocks& w, const uint8_t* decoded, const int8_t* terms, const float* sub_sums,
            const float* term_scales, float* out, int64_t N, int64_t b) {
  constexpr bool kSix = F == KForm::kQ6;
  constexpr int sub = kSub<F>;
  const int64_t K = w.K, groups = K / kNibbleGroup, supers = K / kSuper, subs = K / sub;
  const uint8_t* nb = w.nib + b * groups * 64;
  const uint8_t* hb = kSix ? w.hi + b * groups * 32 : nullptr;
  const uint64_t* fb = F == KForm::kQ5 ? w.fifth + b * groups * 2 : nullptr;
  const int8_t* sb = w.sc + b * subs * kLanes;
  const uint8_t* minsb = kSix ? reinterpret_cast<const uint8_t*>(sb) : w.mins + b * (K / 32) * kLanes;
  const uint16_t* db = w.d + b * supers * kLanes;
  const uint16_t* dmb = kSix ? nullptr : w.dmin + b * supers * kLanes;
  float32x4_t total[R][4];
  for (int r = 0; r < R; r++)
    for (int q = 0; q < 4; q++) total[r][q] = vdupq_n_f32(0.0f);
  for (int64_t s = 0; s < supers; s++) {
    float32x4_t dd[4], dm[4];
    for (int q = 0; q < 4; q++) {
      dd[q] = Halves4(db + s * kLanes + 4 * q);
      dm[q] = kSix ? vmulq_f32(dd[q], vdupq_n_f32(static_cast<float>(kQ6Offset))) : Halves4(dmb + s * kLanes + 4 * q);
    }
    int32x4_t acc[R][4];
    for (int r = 0; r < R; r++)
      for (int q = 0; q < 4; q++) acc[r][q] = vdupq_n_s32(0);
    for (int64_t j = s * (kSuper / sub); j < (s + 1) * (kSuper / sub); j++) {
      int32x4_t scales[4];
      for (int q = 0; q < 4; q++) {
        scales[q] = Bytes4(sb + j * kLanes + 4 * q);
        const int32x4_t m = kSix ? Bytes4(reinterpret_cast<const int8_t*>(minsb) + j * kLanes + 4 * q)
                                 : UBytes4(minsb + j * kLanes + 4 * q);
        const float32x4_t mins = vmulq_f32(dm[q], vcvtq_f32_s32(m));
        for (int r = 0; r < R; r++) {
          const float part = term_scales[r * supers + s] * sub_sums[r * subs + j];
          total[r][q] = vfmsq_f32(total[r][q], mins, vdupq_n_f32(part));
        }
      }
      int32x4_t sums[R][4];                                 // the sub-block's q t per lane
      for (int r = 0; r < R; r++)
        for (int q = 0; q < 4; q++) sums[r][q] = vdupq_n_s32(0);
      for (int64_t g = j * (sub / kNibbleGroup); g < (j + 1) * (sub / kNibbleGroup); g++) {
        uint8x16_t low[4], high[4];
        KGroupLevels<F, kDecoded>(nb, hb, fb, decoded, g, low, high);
        for (int r = 0; r < R; r++) {
          int32_t first, second;                           // terms[r, 8g .. 8g+3], [8g+4 .. 8g+7]
          __builtin_memcpy(&first, terms + r * K + g * kNibbleGroup, sizeof first);
          __builtin_memcpy(&second, terms + r * K + g * kNibbleGroup + 4, sizeof second);
          const int8x16_t f = vreinterpretq_s8_s32(vdupq_n_s32(first)), t = vreinterpretq_s8_s32(vdupq_n_s32(second));
          for (int q = 0; q < 4; q++) {
            sums[r][q] = vdotq_s32(sums[r][q], vreinterpretq_s8_u8(low[q]), f);
            sums[r][q] = vdotq_s32(sums[r][q], vreinterpretq_s8_u8(high[q]), t);
          }
        }
      }
      for (int r = 0; r < R; r++)
        for (int q = 0; q < 4; q++) acc[r][q] = vmlaq_s32(acc[r][q], sums[r][q], scales[q]);
    }
    for (int r = 0; r < R; r++)
      for (int q = 0; q < 4; q++) {
        const float32x4_t scale = vmulq_f32(dd[q], vdupq_n_f32(term_scales[r * supers + s]));
        total[r][q] = vfmaq_f32(total[r][q], vcvtq_f32_s32(acc[r][q]), scale);
      }
  }
  for (int r = 0; r < R; r++)
    for (int q = 0; q < 4; q++) vst1q_f32(out + r * N + b * kLanes + 4 * q, total[r][q]);
}
#else
template <int R, KForm F, bool kDecoded>
void BlockK(const KBlocks& w, const uint8_t* decoded, const int8_t* terms, const float* sub_sums,
            const float* term_scales, float* out, int64_t N, int64_t b) {
  constexpr bool kSix = F == KForm::kQ6;
  constexpr int sub = kSub<F>;
  const int64_t K = w.K, groups = K / kNibbleGroup, supers = K / kSuper, subs = K / sub;
  const uint8_t* nb = w.nib + b * groups * 64;
  const uint8_t* hb = kSix ? w.hi + b * groups * 32 : nullptr;
  const uint64_t* fb = F == KForm::kQ5 ? w.fifth + b * groups * 2 : nullptr;
  const int8_t* sb = w.sc + b * subs * kLanes;
  // The mins' multipliers per sub-block: Q4_K's and Q5_K's mins, Q6_K's scales (times 32 d).
  const uint8_t* minsb = kSix ? reinterpret_cast<const uint8_t*>(sb) : w.mins + b * (K / 32) * kLanes;
  const uint16_t* db = w.d + b * supers * kLanes;
  const uint16_t* dmb = kSix ? nullptr : w.dmin + b * supers * kLanes;
  __m256 total[R][2];
  for (int r = 0; r < R; r++) total[r][0] = total[r][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < supers; s++) {
    __m256 dd[2], dm[2];
    for (int h = 0; h < 2; h++) {
      dd[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(db + s * kLanes + 8 * h)));
      dm[h] = kSix ? _mm256_mul_ps(dd[h], _mm256_set1_ps(static_cast<float>(kQ6Offset)))
                   : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dmb + s * kLanes + 8 * h)));
    }
    __m256i acc[R][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t j = s * (kSuper / sub); j < (s + 1) * (kSuper / sub); j++) {
      __m256i pairs[2];
      for (int h = 0; h < 2; h++) {
        pairs[h] = ScalePairs(sb + j * kLanes + 8 * h);
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(minsb + j * kLanes + 8 * h));
        const __m256i m = kSix ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
        const __m256 mins = _mm256_mul_ps(dm[h], _mm256_cvtepi32_ps(m));
        for (int r = 0; r < R; r++) {
          const float part = term_scales[r * supers + s] * sub_sums[r * subs + j];
          total[r][h] = _mm256_fnmadd_ps(mins, _mm256_set1_ps(part), total[r][h]);
        }
      }
      for (int64_t g0 = j * (sub / kNibbleGroup); g0 < (j + 1) * (sub / kNibbleGroup); g0 += kKSummed<F>) {
        __m256i low[kKSummed<F>][2], high[kKSummed<F>][2];   // [group][half]
        for (int i = 0; i < kKSummed<F>; i++) {
          KGroupLevels<F, kDecoded>(nb, hb, fb, decoded, g0 + i, low[i], high[i]);
        }
        for (int r = 0; r < R; r++) {
          int32_t four[2 * kKSummed<F>];                 // terms[r, 8g0 ..], 4 at a time
          __builtin_memcpy(four, terms + r * K + g0 * kNibbleGroup, sizeof four);
          for (int h = 0; h < 2; h++) {
            __m256i both = _mm256_setzero_si256();
            for (int i = 0; i < kKSummed<F>; i++)
              both = _mm256_add_epi16(both, _mm256_add_epi16(
                  _mm256_maddubs_epi16(low[i][h], _mm256_set1_epi32(four[2 * i])),
                  _mm256_maddubs_epi16(high[i][h], _mm256_set1_epi32(four[2 * i + 1]))));
            acc[r][h] = DotWords(acc[r][h], both, pairs[h]);
          }
        }
      }
    }
    for (int r = 0; r < R; r++)
      for (int h = 0; h < 2; h++) {
        const __m256 scale = _mm256_mul_ps(dd[h], _mm256_set1_ps(term_scales[r * supers + s]));
        total[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), scale, total[r][h]);
      }
  }
  for (int r = 0; r < R; r++)
    for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + r * N + b * kLanes + 8 * h, total[r][h]);
}
#endif

using BlockKFn = void (*)(const KBlocks&, const uint8_t*, const int8_t*, const float*, const float*, float*, int64_t,
                          int64_t);
// BlockK for R rows of a block's decoded levels: Q6_K's only (KMatmul decodes no other form).
template <int R, KForm F>
constexpr BlockKFn DecodedBlockK() {
  if constexpr (F == KForm::kQ6) return BlockK<R, F, true>;
  else return nullptr;
}
// [decoded][rows]: BlockK from the packed levels, or from a block's decoded levels.
template <KForm F>
constexpr BlockKFn kBlocksK[2][kKRows + 1] = {
    {nullptr, BlockK<1, F, false>, BlockK<2, F, false>, BlockK<3, F, false>, BlockK<4, F, false>},
    {nullptr, DecodedBlockK<1, F>(), DecodedBlockK<2, F>(), DecodedBlockK<3, F>(), DecodedBlockK<4, F>()}};

// Rows x [R, K] -> their int8 terms [R, K] per 256 inputs, each super-block's scale [R, K/256] and
// the terms' sums per sub-block as floats [R, K/sub].
template <KForm F>
void KTerms(const float* x, int64_t R, int64_t K, int8_t* terms, float* term_scales, float* sub_sums) {
  constexpr int sub = kSub<F>;
  const int64_t supers = K / kSuper, subs = K / sub;
  for (int64_t r = 0; r < R; r++) {
    for (int64_t s = 0; s < supers; s++) {
      int32_t unused;
      term_scales[r * supers + s] = QuantizeRow(x + r * K + s * kSuper, terms + r * K + s * kSuper, kSuper, &unused);
    }
    for (int64_t j = 0; j < subs; j++) {
      int32_t sum = 0;
      for (int i = 0; i < sub; i++) sum += terms[r * K + j * sub + i];
      sub_sums[r * subs + j] = static_cast<float>(sum);
    }
  }
}

#if MASHBOX_TILES
// A K-quant matrix as the tiles take it (BlockTilePass's form): per sub-block, BlockK's mins' part,
// and its levels' exact sum times the lane's sub-block scale into the super-block's integer sum
// (whole), which after the super-block's last sub-block leaves as BlockK's does.
template <KForm F>
struct TilesK {
  static constexpr int kStep = kSub<F>;
  const KBlocks& w;
  const float* sub_sums;                 // the call's [R, K/sub] and [R, K/256] (KTerms)
  const float* term_scales;

  const uint8_t* BlockLevels(int64_t b, uint8_t* buffer) const {
    DecodeLevelsK<F>(w, b, buffer);
    return buffer;
  }

  void Step(int64_t j, const int32_t (*c)[32], float (*total)[32], int32_t (*whole)[32], int64_t r0, int64_t live,
            int64_t b, int blocks) const {
    constexpr bool kSix = F == KForm::kQ6;
    constexpr int per = kSuper / kSub<F>;            // sub-blocks per super-block
    const int64_t K = w.K, supers = K / kSuper, subs = K / kSub<F>, s = j / per;
    const int outputs = blocks * kLanes;
    float mins[32];
    int32_t scales[32];
    for (int n = 0; n < outputs; n++) {
      const int64_t lane = n % kLanes, bb = b + n / kLanes, sup = (bb * supers + s) * kLanes + lane;
      scales[n] = w.sc[(bb * subs + j) * kLanes + lane];
      const float dm = kSix ? HalfFloat(w.d[sup]) * static_cast<float>(kQ6Offset) : HalfFloat(w.dmin[sup]);
      const int32_t m = kSix ? scales[n] : w.mins[(bb * (K / 32) + j) * kLanes + lane];
      mins[n] = dm * static_cast<float>(m);
    }
    for (int64_t r = 0; r < live; r++) {
      const float part = term_scales[(r0 + r) * supers + s] * sub_sums[(r0 + r) * subs + j];
      for (int n = 0; n < outputs; n++) {
        total[r][n] = std::fma(-mins[n], part, total[r][n]);
        whole[r][n] += scales[n] * c[r][n];
      }
    }
    if (j % per == per - 1) LeaveWhole(w.d, supers, s, term_scales, r0, live, b, blocks, whole, total);
  }
};
#endif

// x float32 [R, K] times K-quant blocks -> float32 [R, N]: each row rounded to int8 per 256 inputs,
// then the blocks' exact integer sums, their scales and mins (BlockK; a long chunk's on the tiles).
template <KForm F>
void KMatmul(ffi::ThreadPool& pool, const float* x, int64_t rows, const KBlocks& w, float* out) {
  constexpr int sub = kSub<F>;
  const int64_t K = w.K, N = w.blocks * kLanes, supers = K / kSuper, subs = K / sub, R = LiveRows(x, rows, K);
  ZeroRowsFrom(out, R, rows, N);
  const bool tiles = TakesTiles(R, K, sub);
  std::vector<int8_t> terms((tiles ? PanelRows(R) : R) * K);   // on the tiles, zero rows to a whole panel
  std::vector<float> term_scales(R * supers), sub_sums(R * subs);
  KTerms<F>(x, R, K, terms.data(), term_scales.data(), sub_sums.data());
#if MASHBOX_TILES
  if (tiles) {
    BlockTiles(pool, TilesK<F>{w, sub_sums.data(), term_scales.data()}, terms.data(), out, K, N, R, w.blocks);
    return;
  }
#endif
  // Past one pass of rows, Q6_K's blocks decoded once per chunk for every pass (PerBlockProduct's
  // way). Q4_K's and Q5_K's measured slower so (their levels' bytes read back cost more than
  // decoding them again: docs/perf-log.md), and decode per pass.
  const bool decode = F == KForm::kQ6 && R > kKRows;
  Parallel(pool, Chunks(w.blocks), [&](int64_t c) {
    const int64_t b0 = c * kChunkBlocks, b1 = std::min(b0 + kChunkBlocks, w.blocks);
    thread_local std::vector<uint8_t> decoded;
    if (decode) {
      decoded.resize((b1 - b0) * kLanes * K);
      for (int64_t b = b0; b < b1; b++) DecodeLevelsK<F>(w, b, decoded.data() + (b - b0) * kLanes * K);
    }
    for (int64_t r0 = 0; r0 < R; r0 += kKRows) {
      const int64_t n = std::min<int64_t>(kKRows, R - r0);
      for (int64_t b = b0; b < b1; b++)
        kBlocksK<F>[decode][n](w, decode ? decoded.data() + (b - b0) * kLanes * K : nullptr, terms.data() + r0 * K,
                               sub_sums.data() + r0 * subs, term_scales.data() + r0 * supers, out + r0 * N, N, b);
    }
  });
}

// K-quant blocks -> their values rounded to bfloat16 [N, K] (nearest, ties to even), for a prefill
// chunk's dot: (d sc) q - (dmin m), Q6_K's (d sc) (q - 32), each operation rounded once in float32:
// gguf's own dequantization's numbers, then rounded to bfloat16.
template <KForm F>
void KWiden(ffi::ThreadPool& pool, const KBlocks& w, uint16_t* out) {
  constexpr bool kSix = F == KForm::kQ6;
  constexpr int sub = kSub<F>;
  const int64_t K = w.K, groups = K / kNibbleGroup, supers = K / kSuper, subs = K / sub;
  Parallel(pool, w.blocks, [&](int64_t b) {
    alignas(64) uint8_t lanes[kLanes][kSuper];           // one super-block's levels per output
    alignas(32) uint8_t low[64], high[64];
    for (int64_t s = 0; s < supers; s++) {
      for (int64_t i = 0; i < kSuper / kNibbleGroup; i++) {
        const int64_t g = s * (kSuper / kNibbleGroup) + i;
#if MASHBOX_NEON
        uint8x16_t lo[4], hi[4];
        KLevels<F>(w.nib + (b * groups + g) * 64, kSix ? w.hi + (b * groups + g) * 32 : nullptr,
                   F == KForm::kQ5 ? w.fifth + (b * groups + g) * 2 : nullptr, lo, hi);
        for (int h = 0; h < 4; h++) {
          vst1q_u8(low + 16 * h, lo[h]);
          vst1q_u8(high + 16 * h, hi[h]);
        }
#else
        __m256i lo[2], hi[2];
        KLevels<F>(w.nib + (b * groups + g) * 64, kSix ? w.hi + (b * groups + g) * 32 : nullptr,
                   F == KForm::kQ5 ? w.fifth + (b * groups + g) * 2 : nullptr, lo, hi);
        for (int h = 0; h < 2; h++) {
          _mm256_store_si256(reinterpret_cast<__m256i*>(low + 32 * h), lo[h]);
          _mm256_store_si256(reinterpret_cast<__m256i*>(high + 32 * h), hi[h]);
        }
#endif
        for (int l = 0; l < kLanes; l++) {
          __builtin_memcpy(&lanes[l][i * kNibbleGroup], low + 4 * l, 4);
          __builtin_memcpy(&lanes[l][i * kNibbleGroup + 4], high + 4 * l, 4);
        }
      }
      alignas(32) float d[kLanes], dmin[kLanes];
#if MASHBOX_NEON
      for (int q = 0; q < 4; q++) {
        vst1q_f32(d + 4 * q, Halves4(w.d + (b * supers + s) * kLanes + 4 * q));
        if (!kSix) vst1q_f32(dmin + 4 * q, Halves4(w.dmin + (b * supers + s) * kLanes + 4 * q));
      }
#else
      for (int h = 0; h < 2; h++) {
        _mm256_store_ps(d + 8 * h, _mm256_cvtph_ps(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(w.d + (b * supers + s) * kLanes + 8 * h))));
        if (!kSix)
          _mm256_store_ps(dmin + 8 * h, _mm256_cvtph_ps(_mm_loadu_si128(
              reinterpret_cast<const __m128i*>(w.dmin + (b * supers + s) * kLanes + 8 * h))));
      }
#endif
      for (int l = 0; l < kLanes; l++) {
        uint16_t* row = out + (b * kLanes + l) * K + s * kSuper;
        for (int j = 0; j < kSuper / sub; j++) {
          const int64_t at = (b * subs + s * (kSuper / sub) + j) * kLanes + l;
          const float scale = d[l] * static_cast<float>(w.sc[at]);
          const float offset = kSix ? 0.0f : dmin[l] * static_cast<float>(w.mins[
              (b * (K / 32) + s * (kSuper / 32) + j) * kLanes + l]);
#if MASHBOX_NEON
          for (int h = 0; h < sub; h += 4) {
            const float32x4_t level = Levels4(&lanes[l][j * sub + h], kSix ? kQ6Offset : 0);
            vst1_u16(row + j * sub + h, Bf16x4(vsubq_f32(vmulq_f32(vdupq_n_f32(scale), level), vdupq_n_f32(offset))));
          }
#else
          for (int h = 0; h < sub; h += 8) {
            const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(&lanes[l][j * sub + h]));
            __m256i level = _mm256_cvtepu8_epi32(q);
            if (kSix) level = _mm256_sub_epi32(level, _mm256_set1_epi32(kQ6Offset));
            const __m256 value = _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(level)),
                                               _mm256_set1_ps(offset));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(row + j * sub + h), Bf16x8(value));
          }
#endif
        }
      }
    }
  });
}

bool PackedK(const ffi::Span<const int64_t>& nib, const ffi::Span<const int64_t>& sc, int sub,
             const ffi::Span<const int64_t>& d) {
  return nib.size() == 4 && nib[2] == kLanes && nib[3] == 4 && (nib[1] * kNibbleGroup) % kSuper == 0 &&
         sc.size() == 3 && sc[0] == nib[0] && sc[1] * sub == nib[1] * kNibbleGroup && sc[2] == kLanes &&
         d.size() == 3 && d[0] == nib[0] && d[1] * kSuper == nib[1] * kNibbleGroup && d[2] == kLanes;
}

bool Same(const ffi::Span<const int64_t>& a, const ffi::Span<const int64_t>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end());
}

// The arrays of a Q4_K or Q5_K matrix (fifth: Q5_K's, else null) into w.
ffi::Error MinArrays(ffi::Buffer<ffi::U8>& nib, const uint32_t* fifth, ffi::Buffer<ffi::S8>& sc,
                     ffi::Buffer<ffi::U8>& mins, ffi::Buffer<ffi::F16>& d, ffi::Buffer<ffi::F16>& dmin,
                     KBlocks* w) {
  if (!PackedK(nib.dimensions(), sc.dimensions(), kSub<KForm::kQ4>, d.dimensions()) ||
      !Same(sc.dimensions(), mins.dimensions()) || !Same(d.dimensions(), dmin.dimensions()))
    return ffi::Error::InvalidArgument("q4_k / q5_k: nib [N/16, K/8, 16, 4], sc and mins [N/16, K/32, 16], "
                                       "d and dmin [N/16, K/256, 16]");
  *w = {nib.typed_data(), nullptr, reinterpret_cast<const uint64_t*>(fifth), sc.typed_data(), mins.typed_data(),
        reinterpret_cast<const uint16_t*>(d.typed_data()), reinterpret_cast<const uint16_t*>(dmin.typed_data()),
        nib.dimensions()[0], nib.dimensions()[1] * kNibbleGroup};
  return ffi::Error::Success();
}

ffi::Error Q5KArrays(ffi::Buffer<ffi::U8>& nib, ffi::Buffer<ffi::U32>& fifth, ffi::Buffer<ffi::S8>& sc,
                     ffi::Buffer<ffi::U8>& mins, ffi::Buffer<ffi::F16>& d, ffi::Buffer<ffi::F16>& dmin,
                     KBlocks* w) {
  const auto fd = fifth.dimensions();
  if (fd.size() != 3 || nib.dimensions().size() != 4 || fd[0] != nib.dimensions()[0] ||
      fd[1] != nib.dimensions()[1] || fd[2] != 4)
    return ffi::Error::InvalidArgument("q5_k: fifth [N/16, K/8, 4]");
  return MinArrays(nib, fifth.typed_data(), sc, mins, d, dmin, w);
}

ffi::Error Q6KArrays(ffi::Buffer<ffi::U8>& nib, ffi::Buffer<ffi::U8>& hi, ffi::Buffer<ffi::S8>& sc,
                     ffi::Buffer<ffi::F16>& d, KBlocks* w) {
  const auto hd = hi.dimensions();
  if (!PackedK(nib.dimensions(), sc.dimensions(), kSub<KForm::kQ6>, d.dimensions()) || hd.size() != 3 ||
      hd[0] != nib.dimensions()[0] || hd[1] != nib.dimensions()[1] || hd[2] != 32)
    return ffi::Error::InvalidArgument("q6_k: nib [N/16, K/8, 16, 4], hi [N/16, K/8, 32], sc [N/16, K/16, 16], "
                                       "d [N/16, K/256, 16]");
  *w = {nib.typed_data(), hi.typed_data(), nullptr, sc.typed_data(), nullptr,
        reinterpret_cast<const uint16_t*>(d.typed_data()), nullptr, nib.dimensions()[0],
        nib.dimensions()[1] * kNibbleGroup};
  return ffi::Error::Success();
}

// x [R, K] times the blocks w (their arrays' check's error first), into out.
template <KForm F>
ffi::Error KProduct(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Error checked, const KBlocks& w,
                    ffi::ResultBuffer<ffi::F32>& out) {
  if (checked.failure()) return checked;
  if (x.dimensions().size() != 2 || x.dimensions()[1] != w.K)
    return ffi::Error::InvalidArgument("k-quant matmul: x [R, K]");
  KMatmul<F>(pool, x.typed_data(), x.dimensions()[0], w, out->typed_data());
  return ffi::Error::Success();
}

template <KForm F>
ffi::Error KWidened(ffi::ThreadPool& pool, ffi::Error checked, const KBlocks& w, ffi::ResultBuffer<ffi::BF16>& out) {
  if (checked.failure()) return checked;
  KWiden<F>(pool, w, reinterpret_cast<uint16_t*>(out->typed_data()));
  return ffi::Error::Success();
}

ffi::Error Q4KMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> nib,
                     ffi::Buffer<ffi::S8> sc, ffi::Buffer<ffi::U8> mins, ffi::Buffer<ffi::F16> d,
                     ffi::Buffer<ffi::F16> dmin, ffi::ResultBuffer<ffi::F32> out) {
  KBlocks w;
  return KProduct<KForm::kQ4>(pool, x, MinArrays(nib, nullptr, sc, mins, d, dmin, &w), w, out);
}

ffi::Error Q5KMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> nib,
                     ffi::Buffer<ffi::U32> fifth, ffi::Buffer<ffi::S8> sc, ffi::Buffer<ffi::U8> mins,
                     ffi::Buffer<ffi::F16> d, ffi::Buffer<ffi::F16> dmin, ffi::ResultBuffer<ffi::F32> out) {
  KBlocks w;
  return KProduct<KForm::kQ5>(pool, x, Q5KArrays(nib, fifth, sc, mins, d, dmin, &w), w, out);
}

ffi::Error Q6KMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> nib,
                     ffi::Buffer<ffi::U8> hi, ffi::Buffer<ffi::S8> sc, ffi::Buffer<ffi::F16> d,
                     ffi::ResultBuffer<ffi::F32> out) {
  KBlocks w;
  return KProduct<KForm::kQ6>(pool, x, Q6KArrays(nib, hi, sc, d, &w), w, out);
}

// `after` as Int8Widen's.
ffi::Error Q4KWiden(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> nib, ffi::Buffer<ffi::S8> sc,
                    ffi::Buffer<ffi::U8> mins, ffi::Buffer<ffi::F16> d, ffi::Buffer<ffi::F16> dmin,
                    ffi::AnyBuffer after, ffi::ResultBuffer<ffi::BF16> out) {
  KBlocks w;
  return KWidened<KForm::kQ4>(pool, MinArrays(nib, nullptr, sc, mins, d, dmin, &w), w, out);
}

ffi::Error Q5KWiden(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> nib, ffi::Buffer<ffi::U32> fifth,
                    ffi::Buffer<ffi::S8> sc, ffi::Buffer<ffi::U8> mins, ffi::Buffer<ffi::F16> d,
                    ffi::Buffer<ffi::F16> dmin, ffi::AnyBuffer after, ffi::ResultBuffer<ffi::BF16> out) {
  KBlocks w;
  return KWidened<KForm::kQ5>(pool, Q5KArrays(nib, fifth, sc, mins, d, dmin, &w), w, out);
}

ffi::Error Q6KWiden(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> nib, ffi::Buffer<ffi::U8> hi,
                    ffi::Buffer<ffi::S8> sc, ffi::Buffer<ffi::F16> d, ffi::AnyBuffer after,
                    ffi::ResultBuffer<ffi::BF16> out) {
  KBlocks w;
  return KWidened<KForm::kQ6>(pool, Q6KArrays(nib, hi, sc, d, &w), w, out);
}

// ---- scaled-level blocks: IQ4_NL, IQ4_XS, IQ3_S and Q3_K as the file holds them ------------------

// The blocks Unsloth's dynamic quants mix into their K-quants (and llama.cpp's IQ files). Each weight
// is a small signed level times a float16 d and, but for IQ4_NL, an integer scale per sub-block; no
// mins. The level is a 4-bit code's (Q3_K: a 3-bit code's) entry in a table of 16 (8):
//   IQ4_NL  w = d v[c]           v: IQ4's 16 levels (-127 .. 113), d per 32 inputs     (4.5 bits)
//   IQ4_XS  w = d sc v[c]        sc -32..31 per 32 inputs, d per 256                   (4.25 bits)
//   IQ3_S   w = d sc (2c - 15)   sc odd 1..31 per 32 inputs, d per 256; the file's 9-bit grid
//                                index per 4 inputs and their signs, expanded to a code each
//                                (the file: 3.4375 bits; held: 4.3125): the grid read as it is
//                                would be a gather per 4 inputs of 16 outputs (NEON has none),
//                                where the codes take IQ4's one shuffle
//   Q3_K    w = d sc (c - 4)     c 0..7, sc -32..31 per 16 inputs, d per 256           (3.4375 bits)
// Held in the layout engine.native.pack_s states (its docstring is the one statement): the 4-bit
// codes as pack5's nibbles; Q3_K's codes' low two bits as Q6_K's top bits (32 bytes per group of 8
// inputs) and their third bits as pack5's fifth-bit masks; per block of 16 outputs the 16 lanes'
// scales and d.
//
// A group of 8 inputs decodes into two vectors of 64 level bytes, as Levels' and KLevels' do (inputs
// 0-3 and 4-7 of the 16 outputs): the 4-bit codes through the table in one byte shuffle (vpshufb;
// NEON's tbl), Q3_K's bits by shifts and masks. The table's bytes are the level + 128 on the AVX-512
// tier (vpdpbusd's unsigned operand), else the signed level (the AVX2 tiers' sign trick, NEON's
// sdot); Q3_K's bytes are the codes on every tier. The rows are rounded to int8 per d's span (IQ4_NL:
// 32 inputs, its block; else 256), one term on its own scale; per sub-block the levels' exact sum
// S_j = sum held byte x term - offset x the terms' sum, then A = sum_j sc_j S_j exactly in int32
// (|A| <= 32 x 256 x 127 x 127 < 2^31), and the float32 sum takes A times d times the row's scale in
// one fused multiply-add (AddBlock32).
enum class SForm { kIq4Nl, kIq4Xs, kIq3S, kQ3K };

template <SForm F>
constexpr bool kTabled = F != SForm::kQ3K;               // 4-bit codes through a table of 16
template <SForm F>
constexpr bool kScaled = F != SForm::kIq4Nl;             // an integer scale per sub-block
template <SForm F>
constexpr int kSSpan = F == SForm::kIq4Nl ? 32 : 256;    // inputs per d, and per row term
template <SForm F>
constexpr int kSSub = F == SForm::kQ3K ? 16 : 32;        // inputs per sub-block scale
constexpr int kTableOffset = MASHBOX_AVX512 ? 128 : 0;  // vpdpbusd's unsigned operand (AVX-512: BlockS)
template <SForm F>
constexpr int kSOffset = kTabled<F> ? kTableOffset : 4;  // level = held byte - offset
constexpr int kSRows = kMaxTerms;                        // float rows per pass over a block

// IQ4's 16 levels (IQ4_NL and IQ4_XS share them).
constexpr int8_t kIq4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// A table form's 16 levels as this tier holds them (level + kTableOffset, as bytes).
template <SForm F>
struct STable {
  alignas(16) uint8_t held[16] = {};
  constexpr STable() {
    for (int c = 0; c < 16; c++)
      held[c] = static_cast<uint8_t>((F == SForm::kIq3S ? 2 * c - 15 : kIq4Levels[c]) + kTableOffset);
  }
};
template <SForm F>
constexpr STable<F> kSTable{};

// One matrix's arrays (pack_s), all per block of 16 outputs.
struct SBlocks {
  const uint8_t* codes;   // table forms: nibbles [N/16, K/8, 16, 4]; Q3_K: low two bits [N/16, K/8, 32]
  const uint64_t* third;  // Q3_K: the codes' third bits [N/16, K/8, 2]; else null
  const int8_t* sc;       // [N/16, K/sub, 16]; IQ4_NL: null
  const uint16_t* d;      // float16 [N/16, K/span, 16]
  int64_t blocks, K;
};

// Bytes of codes per group of 8 inputs of 16 outputs.
template <SForm F>
constexpr int kCodeBytes = kTabled<F> ? 64 : 32;

// Group `at` (block b's group g: b * K/8 + g) -> its held level bytes, low (inputs 0-3) and high
// (4-7): AVX-512 in one register each; both x86 tiers in two 32-byte halves (the AVX2 tiers'
// products, and every x86 tier's widening); NEON in four 16-byte quarters.
#if MASHBOX_AVX512
template <SForm F>
inline void SLevels(const SBlocks& w, int64_t at, __m512i table, __m512i* low, __m512i* high) {
  if constexpr (kTabled<F>) {
    const __m512i four = _mm512_set1_epi8(0x0F);
    const __m512i v = _mm512_loadu_si512(w.codes + at * 64);
    *low = _mm512_shuffle_epi8(table, _mm512_and_si512(v, four));
    *high = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), four));
  } else {                               // byte p: low p, high p, low p + 32, high p + 32
    const __m256i top = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.codes + at * 32));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(top), _mm256_srli_epi16(top, 4), 1);
    const __m512i three = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
    const __m512i lo = _mm512_and_si512(both, three), hi = _mm512_and_si512(_mm512_srli_epi16(both, 2), three);
    *low = _mm512_mask_add_epi8(lo, _cvtu64_mask64(w.third[at * 2]), lo, four);
    *high = _mm512_mask_add_epi8(hi, _cvtu64_mask64(w.third[at * 2 + 1]), hi, four);
  }
}
#endif

#if MASHBOX_NEON
template <SForm F>
inline void SLevels(const SBlocks& w, int64_t at, uint8x16_t table, uint8x16_t* low, uint8x16_t* high) {
  if constexpr (kTabled<F>) {
    for (int h = 0; h < 4; h++) {
      const uint8x16_t v = vld1q_u8(w.codes + at * 64 + 16 * h);
      low[h] = vqtbl1q_u8(table, vandq_u8(v, vdupq_n_u8(0x0F)));
      high[h] = vqtbl1q_u8(table, vshrq_n_u8(v, 4));
    }
  } else {
    const uint8x16_t three = vdupq_n_u8(3), four = vdupq_n_u8(4);
    for (int h = 0; h < 2; h++) {
      const uint8x16_t top = vld1q_u8(w.codes + at * 32 + 16 * h);
      low[h] = vandq_u8(top, three);
      high[h] = vandq_u8(vshrq_n_u8(top, 2), three);
      low[h + 2] = vandq_u8(vshrq_n_u8(top, 4), three);
      high[h + 2] = vshrq_n_u8(top, 6);
    }
    for (int h = 0; h < 4; h++) {
      low[h] = vorrq_u8(low[h], vandq_u8(BitBytes(static_cast<uint32_t>(w.third[at * 2] >> (16 * h))), four));
      high[h] = vorrq_u8(high[h], vandq_u8(BitBytes(static_cast<uint32_t>(w.third[at * 2 + 1] >> (16 * h))), four));
    }
  }
}
#else
template <SForm F>
inline void SLevels(const SBlocks& w, int64_t at, __m256i table, __m256i* low, __m256i* high) {
  if constexpr (kTabled<F>) {
    const __m256i four = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < 2; h++) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.codes + at * 64 + 32 * h));
      low[h] = _mm256_shuffle_epi8(table, _mm256_and_si256(v, four));
      high[h] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), four));
    }
  } else {
    const __m256i top = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.codes + at * 32));
    const __m256i three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    low[0] = _mm256_and_si256(top, three);
    high[0] = _mm256_and_si256(_mm256_srli_epi16(top, 2), three);
    low[1] = _mm256_and_si256(_mm256_srli_epi16(top, 4), three);
    high[1] = _mm256_and_si256(_mm256_srli_epi16(top, 6), three);
    for (int h = 0; h < 2; h++) {
      const uint32_t lows = static_cast<uint32_t>(w.third[at * 2] >> (32 * h));
      const uint32_t highs = static_cast<uint32_t>(w.third[at * 2 + 1] >> (32 * h));
      low[h] = _mm256_or_si256(low[h], _mm256_and_si256(BitBytes(lows), four));
      high[h] = _mm256_or_si256(high[h], _mm256_and_si256(BitBytes(highs), four));
    }
  }
}
#endif

// The next groups' codes (and Q3_K's third bits) fetched ahead, as the other block products do.
template <SForm F>
inline void SPrefetch(const SBlocks& w, int64_t at) {
  const uint8_t* codes = w.codes + at * kCodeBytes<F>;
  Prefetch(codes + kPrefetch);
  PrefetchL2(codes + kPrefetchL2);
  if (!kTabled<F>) PrefetchL2(w.third + (at + kPrefetchL2 / kCodeBytes<F>) * 2);
}

// One block of 16 outputs for R rows (terms per span: term_scales [R, K/span]; sub_sums [R, K/sub]
// the terms' sums per sub-block). Per sub-block j the exact S_j (acc, starting at -offset x the
// terms' sum), into A (whole) times sc_j; per span, A times d times the row's scale into the float32
// sum (AddBlock32). IQ4_NL's span is its one sub-block, unscaled: its S is its A.
#if MASHBOX_AVX512
template <int R, SForm F>
void BlockS(const SBlocks& w, const int8_t* terms, const int32_t* sub_sums, const float* term_scales,
            float* out, int64_t N, int64_t b) {
  constexpr int span = kSSpan<F>, sub = kSSub<F>;
  const int64_t K = w.K, groups = K / kNibbleGroup, spans = K / span, subs = K / sub;
  const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kSTable<F>.held)));
  __m512 total[R];
  for (int r = 0; r < R; r++) total[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < spans; s++) {
    __m512i whole[R];
    for (int r = 0; r < R; r++) whole[r] = _mm512_setzero_si512();
    for (int64_t j = s * (span / sub); j < (s + 1) * (span / sub); j++) {
      __m512i acc[R];
      for (int r = 0; r < R; r++) acc[r] = _mm512_set1_epi32(-kSOffset<F> * sub_sums[r * subs + j]);
      for (int64_t g = j * (sub / kNibbleGroup); g < (j + 1) * (sub / kNibbleGroup); g++) {
        SPrefetch<F>(w, b * groups + g);
        __m512i low, high;
        SLevels<F>(w, b * groups + g, table, &low, &high);
        for (int r = 0; r < R; r++) {
          int32_t first, second;                           // terms[r, 8g .. 8g+3], [8g+4 .. 8g+7]
          __builtin_memcpy(&first, terms + r * K + g * kNibbleGroup, sizeof first);
          __builtin_memcpy(&second, terms + r * K + g * kNibbleGroup + 4, sizeof second);
          Dpbusd(acc[r], low, _mm512_set1_epi32(first));
          Dpbusd(acc[r], high, _mm512_set1_epi32(second));
        }
      }
      if constexpr (kScaled<F>) {
        const __m512i sc = _mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + (b * subs + j) * kLanes)));
        for (int r = 0; r < R; r++) acc[r] = _mm512_mullo_epi32(acc[r], sc);
      }
      for (int r = 0; r < R; r++) whole[r] = _mm512_add_epi32(whole[r], acc[r]);
    }
    AddBlock32<R>(total, whole, w.d + (b * spans + s) * kLanes, term_scales + s, spans);
  }
  for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * N + b * kLanes, total[r]);
}
#elif MASHBOX_AVX2
// Both AVX2 tiers take the table's signed levels with the terms' signs (the sign trick: kTableOffset
// is 0 here, with or without VNNI), and each sub-block's scale in the instruction that widens the
// pairs into int32 (vpmaddwd, AVX-VNNI's vpdpwssd; IQ4_NL's scale is 1), as the K-quant products do:
// no int32 multiply. Q3_K's codes (0..7) are the unsigned operand as they are: a sub-block's two
// groups' pairs add up in int16 (at most 4 x 2 x 7 x 127 = 7,112) before one vpmaddwd takes the
// scale, and sc times -4 times the terms' sum comes off in another.
template <int R, SForm F>
void BlockS(const SBlocks& w, const int8_t* terms, const int32_t* sub_sums, const float* term_scales,
            float* out, int64_t N, int64_t b) {
  constexpr int span = kSSpan<F>, sub = kSSub<F>;
  const int64_t K = w.K, groups = K / kNibbleGroup, spans = K / span, subs = K / sub;
  const __m256i table = _mm256_broadcastsi128_si256(
      _mm_load_si128(reinterpret_cast<const __m128i*>(kSTable<F>.held)));
  __m256 total[R][2];
  for (int r = 0; r < R; r++) total[r][0] = total[r][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < spans; s++) {
    __m256i whole[R][2];                 // sum_j sc_j S_j, so far
    for (int r = 0; r < R; r++) whole[r][0] = whole[r][1] = _mm256_setzero_si256();
    for (int64_t j = s * (span / sub); j < (s + 1) * (span / sub); j++) {
      __m256i scale[2];                  // the lanes' sc_j in both int16 halves of each int32 lane
      for (int h = 0; h < 2; h++)
        scale[h] = kScaled<F> ? ScalePairs(w.sc + (b * subs + j) * kLanes + 8 * h) : _mm256_set1_epi16(1);
      if constexpr (F == SForm::kQ3K) {
        static_assert(kSSub<F> == 2 * kNibbleGroup, "a Q3_K sub-block is two groups");
        const int64_t g = j * 2;
        __m256i low[2][2], high[2][2];   // [group][half]
        for (int i = 0; i < 2; i++) {
          SPrefetch<F>(w, b * groups + g + i);
          SLevels<F>(w, b * groups + g + i, table, low[i], high[i]);
        }
        for (int r = 0; r < R; r++) {
          int32_t four[4];               // terms[r, 8g .. 8g+15], 4 at a time
          __builtin_memcpy(four, terms + r * K + g * kNibbleGroup, sizeof four);
          const __m256i minus = _mm256_set1_epi32(static_cast<uint16_t>(-kSOffset<F> * sub_sums[r * subs + j]));
          for (int h = 0; h < 2; h++) {
            const __m256i pairs = _mm256_add_epi16(
                _mm256_add_epi16(_mm256_maddubs_epi16(low[0][h], _mm256_set1_epi32(four[0])),
                                 _mm256_maddubs_epi16(high[0][h], _mm256_set1_epi32(four[1]))),
                _mm256_add_epi16(_mm256_maddubs_epi16(low[1][h], _mm256_set1_epi32(four[2])),
                                 _mm256_maddubs_epi16(high[1][h], _mm256_set1_epi32(four[3]))));
            whole[r][h] = DotWords(DotWords(whole[r][h], pairs, scale[h]), scale[h], minus);
          }
        }
      } else {
        for (int64_t g = j * (sub / kNibbleGroup); g < (j + 1) * (sub / kNibbleGroup); g++) {
          SPrefetch<F>(w, b * groups + g);
          __m256i low[2], high[2];
          SLevels<F>(w, b * groups + g, table, low, high);
          for (int r = 0; r < R; r++) {
            int32_t first, second;         // terms[r, 8g .. 8g+3], [8g+4 .. 8g+7]
            __builtin_memcpy(&first, terms + r * K + g * kNibbleGroup, sizeof first);
            __builtin_memcpy(&second, terms + r * K + g * kNibbleGroup + 4, sizeof second);
            const __m256i f = _mm256_set1_epi32(first), t = _mm256_set1_epi32(second);
            const __m256i fm = _mm256_abs_epi8(f), tm = _mm256_abs_epi8(t);
            for (int h = 0; h < 2; h++) {
              whole[r][h] = DotWords(whole[r][h], _mm256_maddubs_epi16(fm, _mm256_sign_epi8(low[h], f)), scale[h]);
              whole[r][h] = DotWords(whole[r][h], _mm256_maddubs_epi16(tm, _mm256_sign_epi8(high[h], t)), scale[h]);
            }
          }
        }
      }
    }
    AddBlock32<R>(total, whole, w.d + (b * spans + s) * kLanes, term_scales + s, spans);
  }
  for (int r = 0; r < R; r++)
    for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + r * N + b * kLanes + 8 * h, total[r][h]);
}
#else
template <int R, SForm F>
void BlockS(const SBlocks& w, const int8_t* terms, const int32_t* sub_sums, const float* term_scales,
            float* out, int64_t N, int64_t b) {
  constexpr int span = kSSpan<F>, sub = kSSub<F>;
  const int64_t K = w.K, groups = K / kNibbleGroup, spans = K / span, subs = K / sub;
  const uint8x16_t table = vld1q_u8(kSTable<F>.held);
  float32x4_t total[R][4];
  for (int r = 0; r < R; r++)
    for (int q = 0; q < 4; q++) total[r][q] = vdupq_n_f32(0.0f);
  for (int64_t s = 0; s < spans; s++) {
    int32x4_t whole[R][4];
    for (int r = 0; r < R; r++)
      for (int q = 0; q < 4; q++) whole[r][q] = vdupq_n_s32(0);
    for (int64_t j = s * (span / sub); j < (s + 1) * (span / sub); j++) {
      int32x4_t acc[R][4];
      for (int r = 0; r < R; r++)
        for (int q = 0; q < 4; q++) acc[r][q] = vdupq_n_s32(-kSOffset<F> * sub_sums[r * subs + j]);
      for (int64_t g = j * (sub / kNibbleGroup); g < (j + 1) * (sub / kNibbleGroup); g++) {
        SPrefetch<F>(w, b * groups + g);
        uint8x16_t low[4], high[4];
        SLevels<F>(w, b * groups + g, table, low, high);
        for (int r = 0; r < R; r++) {
          int32_t first, second;
          __builtin_memcpy(&first, terms + r * K + g * kNibbleGroup, sizeof first);
          __builtin_memcpy(&second, terms + r * K + g * kNibbleGroup + 4, sizeof second);
          const int8x16_t f = vreinterpretq_s8_s32(vdupq_n_s32(first)), t = vreinterpretq_s8_s32(vdupq_n_s32(second));
          for (int q = 0; q < 4; q++) {
            acc[r][q] = vdotq_s32(acc[r][q], vreinterpretq_s8_u8(low[q]), f);
            acc[r][q] = vdotq_s32(acc[r][q], vreinterpretq_s8_u8(high[q]), t);
          }
        }
      }
      for (int q = 0; q < 4; q++) {
        const int32x4_t sc = kScaled<F> ? Bytes4(w.sc + (b * subs + j) * kLanes + 4 * q) : vdupq_n_s32(1);
        for (int r = 0; r < R; r++) whole[r][q] = vmlaq_s32(whole[r][q], acc[r][q], sc);
      }
    }
    AddBlock32<R>(total, whole, w.d + (b * spans + s) * kLanes, term_scales + s, spans);
  }
  for (int r = 0; r < R; r++)
    for (int q = 0; q < 4; q++) vst1q_f32(out + r * N + b * kLanes + 4 * q, total[r][q]);
}
#endif

using BlockSFn = void (*)(const SBlocks&, const int8_t*, const int32_t*, const float*, float*, int64_t, int64_t);
#if MASHBOX_AVX512
template <SForm F>
constexpr BlockSFn kBlocksS[kSRows + 1] = {nullptr, BlockS<1, F>, BlockS<2, F>, BlockS<3, F>, BlockS<4, F>,
                                           BlockS<5, F>, BlockS<6, F>, BlockS<7, F>, BlockS<8, F>};
#else
template <SForm F>
constexpr BlockSFn kBlocksS[kSRows + 1] = {nullptr, BlockS<1, F>, BlockS<2, F>, BlockS<3, F>, BlockS<4, F>};
#endif

#if MASHBOX_TILES
// A scaled-level matrix as the tiles take it (BlockTilePass's form): the table forms' levels + 128 on
// every tier (tdpbsud's unsigned operand; the AVX2 tiers' row passes hold them signed), Q3_K's codes
// as they are; per sub-block BlockS's exact S_j (the offset times the terms' sum taken off) times sc_j
// into the span's integer sum (whole), which after the span's last sub-block leaves as AddBlock32
// takes it.
template <SForm F>
struct TilesS {
  static constexpr int kStep = kSSub<F>;
  static constexpr int kOffset = kTabled<F> ? 128 : kSOffset<F>;
  const SBlocks& w;
  const int32_t* sub_sums;               // the call's [R, K/sub] and [R, K/span]
  const float* term_scales;

  const uint8_t* BlockLevels(int64_t b, uint8_t* buffer) const {
    alignas(16) uint8_t held[16];
    for (int c = 0; c < 16; c++) held[c] = static_cast<uint8_t>(kSTable<F>.held[c] - kTableOffset + 128);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(held)));
    const int64_t groups = w.K / kNibbleGroup;
    for (int64_t g = 0; g < groups; g++) {           // rows 2g and 2g + 1: inputs 8g .. 8g+3, 8g+4 .. 8g+7
      __m256i low[2], high[2];
      SLevels<F>(w, b * groups + g, table, low, high);
      StoreGroup(buffer, g, low, high);
    }
    return buffer;
  }

  void Step(int64_t j, const int32_t (*c)[32], float (*total)[32], int32_t (*whole)[32], int64_t r0, int64_t live,
            int64_t b, int blocks) const {
    constexpr int per = kSSpan<F> / kSSub<F>;        // sub-blocks per span
    const int64_t K = w.K, spans = K / kSSpan<F>, subs = K / kSSub<F>, s = j / per;
    const int outputs = blocks * kLanes;
    int32_t scales[32];
    for (int n = 0; n < outputs; n++)
      scales[n] = kScaled<F> ? w.sc[((b + n / kLanes) * subs + j) * kLanes + n % kLanes] : 1;
    for (int64_t r = 0; r < live; r++) {
      const int32_t less = kOffset * sub_sums[(r0 + r) * subs + j];
      for (int n = 0; n < outputs; n++) whole[r][n] += (c[r][n] - less) * scales[n];
    }
    if (j % per == per - 1) LeaveWhole(w.d, spans, s, term_scales, r0, live, b, blocks, whole, total);
  }
};
#endif

// x float32 [R, K] times scaled-level blocks -> float32 [R, N]: each row rounded to int8 per span,
// the terms' sums per sub-block, then BlockS, kSRows rows per pass over each chunk (a long chunk's on
// the tiles).
template <SForm F>
void SMatmul(ffi::ThreadPool& pool, const float* x, int64_t rows, const SBlocks& w, float* out) {
  constexpr int span = kSSpan<F>, sub = kSSub<F>;
  const int64_t K = w.K, N = w.blocks * kLanes, spans = K / span, subs = K / sub, R = LiveRows(x, rows, K);
  ZeroRowsFrom(out, R, rows, N);
  const bool tiles = TakesTiles(R, K, sub);
  std::vector<int8_t> terms((tiles ? PanelRows(R) : R) * K);   // on the tiles, zero rows to a whole panel
  std::vector<float> term_scales(R * spans);
  std::vector<int32_t> sub_sums(R * subs);
  for (int64_t r = 0; r < R; r++) {
    for (int64_t s = 0; s < spans; s++) {
      int32_t unused;
      term_scales[r * spans + s] = QuantizeRow(x + r * K + s * span, terms.data() + r * K + s * span, span, &unused);
    }
    for (int64_t j = 0; j < subs; j++) {
      int32_t sum = 0;
      for (int i = 0; i < sub; i++) sum += terms[r * K + j * sub + i];
      sub_sums[r * subs + j] = sum;
    }
  }
#if MASHBOX_TILES
  if (tiles) {
    BlockTiles(pool, TilesS<F>{w, sub_sums.data(), term_scales.data()}, terms.data(), out, K, N, R, w.blocks);
    return;
  }
#endif
  Parallel(pool, Chunks(w.blocks), [&](int64_t c) {
    const int64_t b0 = c * kChunkBlocks, b1 = std::min(b0 + kChunkBlocks, w.blocks);
    for (int64_t r0 = 0; r0 < R; r0 += kSRows) {
      const int64_t n = std::min<int64_t>(kSRows, R - r0);
      for (int64_t b = b0; b < b1; b++)
        kBlocksS<F>[n](w, terms.data() + r0 * K, sub_sums.data() + r0 * subs, term_scales.data() + r0 * spans,
                       out + r0 * N, N, b);
    }
  });
}

// Scaled-level blocks -> their values (d sc) level, rounded to bfloat16 [N, K] (nearest, ties to
// even), for a prefill chunk's dot. d sc and its product with the level are exact in float32 (at most
// 11 + 6 + 7 significant bits): gguf's own dequantization's numbers, rounded once to bfloat16.
template <SForm F>
void SWiden(ffi::ThreadPool& pool, const SBlocks& w, uint16_t* out) {
  constexpr int span = kSSpan<F>, sub = kSSub<F>;
  const int64_t K = w.K, groups = K / kNibbleGroup, spans = K / span, subs = K / sub;
  Parallel(pool, w.blocks, [&](int64_t b) {
    alignas(64) uint8_t lanes[kLanes][span];             // one span's held levels per output
    alignas(32) uint8_t low[64], high[64];
#if MASHBOX_NEON
    const uint8x16_t table = vld1q_u8(kSTable<F>.held);
#else
    const __m256i table = _mm256_broadcastsi128_si256(
      _mm_load_si128(reinterpret_cast<const __m128i*>(kSTable<F>.held)));
#endif
    for (int64_t s = 0; s < spans; s++) {
      for (int64_t i = 0; i < span / kNibbleGroup; i++) {
        const int64_t at = b * groups + s * (span / kNibbleGroup) + i;
#if MASHBOX_NEON
        uint8x16_t lo[4], hi[4];
        SLevels<F>(w, at, table, lo, hi);
        for (int h = 0; h < 4; h++) {
          vst1q_u8(low + 16 * h, lo[h]);
          vst1q_u8(high + 16 * h, hi[h]);
        }
#else
        __m256i lo[2], hi[2];
        SLevels<F>(w, at, table, lo, hi);
        for (int h = 0; h < 2; h++) {
          _mm256_store_si256(reinterpret_cast<__m256i*>(low + 32 * h), lo[h]);
          _mm256_store_si256(reinterpret_cast<__m256i*>(high + 32 * h), hi[h]);
        }
#endif
        for (int l = 0; l < kLanes; l++) {
          __builtin_memcpy(&lanes[l][i * kNibbleGroup], low + 4 * l, 4);
          __builtin_memcpy(&lanes[l][i * kNibbleGroup + 4], high + 4 * l, 4);
        }
      }
      alignas(32) float d[kLanes];
#if MASHBOX_NEON
      for (int q = 0; q < 4; q++) vst1q_f32(d + 4 * q, Halves4(w.d + (b * spans + s) * kLanes + 4 * q));
#else
      for (int h = 0; h < 2; h++)
        _mm256_store_ps(d + 8 * h, _mm256_cvtph_ps(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(w.d + (b * spans + s) * kLanes + 8 * h))));
#endif
      for (int l = 0; l < kLanes; l++) {
        for (int j = 0; j < span / sub; j++) {
          const int64_t at = (b * subs + s * (span / sub) + j) * kLanes + l;
          const float scale = kScaled<F> ? d[l] * static_cast<float>(w.sc[at]) : d[l];
          uint16_t* row = out + (b * kLanes + l) * K + s * span + j * sub;
#if MASHBOX_NEON                          // held bytes signed (offset 0) or 0..7 (Q3_K's, offset 4)
          for (int h = 0; h < sub; h += 4) {
            const int32x4_t level = vsubq_s32(Bytes4(reinterpret_cast<const int8_t*>(&lanes[l][j * sub + h])),
                                              vdupq_n_s32(kSOffset<F>));
            vst1_u16(row + h, Bf16x4(vmulq_f32(vdupq_n_f32(scale), vcvtq_f32_s32(level))));
          }
#else
          for (int h = 0; h < sub; h += 8) {   // held bytes unsigned where the offset is 128, else signed
            const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(&lanes[l][j * sub + h]));
            const __m256i held = kSOffset<F> == 128 ? _mm256_cvtepu8_epi32(q) : _mm256_cvtepi8_epi32(q);
            const __m256i level = _mm256_sub_epi32(held, _mm256_set1_epi32(kSOffset<F>));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(row + h),
                             Bf16x8(_mm256_mul_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(level))));
          }
#endif
        }
      }
    }
  });
}

// The arrays of a scaled-level matrix into w: codes (pack_s), Q3_K's third bits, the scales (IQ4_NL:
// none) and d, their shapes checked.
template <SForm F>
ffi::Error SArrays(ffi::Buffer<ffi::U8>& codes, ffi::Buffer<ffi::U32>* third, ffi::Buffer<ffi::S8>* sc,
                   ffi::Buffer<ffi::F16>& d, SBlocks* w) {
  const auto cd = codes.dimensions(), dd = d.dimensions();
  const bool codes_ok = kTabled<F> ? cd.size() == 4 && cd[2] == kLanes && cd[3] == 4
                                   : cd.size() == 3 && cd[2] == kCodeBytes<F>;
  const int64_t K = cd.size() >= 2 ? cd[1] * kNibbleGroup : 0;
  bool ok = codes_ok && K % kSSpan<F> == 0 && dd.size() == 3 && dd[0] == cd[0] && dd[1] * kSSpan<F> == K &&
            dd[2] == kLanes;
  if (third) {
    const auto td = third->dimensions();
    ok = ok && td.size() == 3 && td[0] == cd[0] && td[1] == cd[1] && td[2] == 4;
  }
  if (sc) {
    const auto sd = sc->dimensions();
    ok = ok && sd.size() == 3 && sd[0] == cd[0] && sd[1] * kSSub<F> == K && sd[2] == kLanes;
  }
  if (!ok)
    return ffi::Error::InvalidArgument(
        "scaled-level blocks: codes [N/16, K/8, 16, 4] (Q3_K: [N/16, K/8, 32]), Q3_K's third [N/16, K/8, 4], "
        "sc [N/16, K/sub, 16], d [N/16, K/span, 16] (engine.native.pack_s)");
  *w = {codes.typed_data(), third ? reinterpret_cast<const uint64_t*>(third->typed_data()) : nullptr,
        sc ? sc->typed_data() : nullptr, reinterpret_cast<const uint16_t*>(d.typed_data()), cd[0], K};
  return ffi::Error::Success();
}

// x [R, K] times the blocks w (their arrays' check's error first), into out.
template <SForm F>
ffi::Error SProduct(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Error checked, const SBlocks& w,
                    ffi::ResultBuffer<ffi::F32>& out) {
  if (checked.failure()) return checked;
  if (x.dimensions().size() != 2 || x.dimensions()[1] != w.K)
    return ffi::Error::InvalidArgument("scaled-level matmul: x [R, K]");
  SMatmul<F>(pool, x.typed_data(), x.dimensions()[0], w, out->typed_data());
  return ffi::Error::Success();
}

template <SForm F>
ffi::Error SWidened(ffi::ThreadPool& pool, ffi::Error checked, const SBlocks& w, ffi::ResultBuffer<ffi::BF16>& out) {
  if (checked.failure()) return checked;
  SWiden<F>(pool, w, reinterpret_cast<uint16_t*>(out->typed_data()));
  return ffi::Error::Success();
}

ffi::Error Iq4NlMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                       ffi::Buffer<ffi::F16> d, ffi::ResultBuffer<ffi::F32> out) {
  SBlocks w;
  return SProduct<SForm::kIq4Nl>(pool, x, SArrays<SForm::kIq4Nl>(codes, nullptr, nullptr, d, &w), w, out);
}

ffi::Error Iq4XsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                       ffi::Buffer<ffi::S8> sc, ffi::Buffer<ffi::F16> d, ffi::ResultBuffer<ffi::F32> out) {
  SBlocks w;
  return SProduct<SForm::kIq4Xs>(pool, x, SArrays<SForm::kIq4Xs>(codes, nullptr, &sc, d, &w), w, out);
}

ffi::Error Iq3SMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                      ffi::Buffer<ffi::S8> sc, ffi::Buffer<ffi::F16> d, ffi::ResultBuffer<ffi::F32> out) {
  SBlocks w;
  return SProduct<SForm::kIq3S>(pool, x, SArrays<SForm::kIq3S>(codes, nullptr, &sc, d, &w), w, out);
}

ffi::Error Q3KMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                     ffi::Buffer<ffi::U32> third, ffi::Buffer<ffi::S8> sc, ffi::Buffer<ffi::F16> d,
                     ffi::ResultBuffer<ffi::F32> out) {
  SBlocks w;
  return SProduct<SForm::kQ3K>(pool, x, SArrays<SForm::kQ3K>(codes, &third, &sc, d, &w), w, out);
}

// `after` as Int8Widen's.
ffi::Error Iq4NlWiden(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F16> d,
                      ffi::AnyBuffer after, ffi::ResultBuffer<ffi::BF16> out) {
  SBlocks w;
  return SWidened<SForm::kIq4Nl>(pool, SArrays<SForm::kIq4Nl>(codes, nullptr, nullptr, d, &w), w, out);
}

ffi::Error Iq4XsWiden(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::S8> sc,
                      ffi::Buffer<ffi::F16> d, ffi::AnyBuffer after, ffi::ResultBuffer<ffi::BF16> out) {
  SBlocks w;
  return SWidened<SForm::kIq4Xs>(pool, SArrays<SForm::kIq4Xs>(codes, nullptr, &sc, d, &w), w, out);
}

ffi::Error Iq3SWiden(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::S8> sc,
                     ffi::Buffer<ffi::F16> d, ffi::AnyBuffer after, ffi::ResultBuffer<ffi::BF16> out) {
  SBlocks w;
  return SWidened<SForm::kIq3S>(pool, SArrays<SForm::kIq3S>(codes, nullptr, &sc, d, &w), w, out);
}

ffi::Error Q3KWiden(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::U32> third,
                    ffi::Buffer<ffi::S8> sc, ffi::Buffer<ffi::F16> d, ffi::AnyBuffer after,
                    ffi::ResultBuffer<ffi::BF16> out) {
  SBlocks w;
  return SWidened<SForm::kQ3K>(pool, SArrays<SForm::kQ3K>(codes, &third, &sc, d, &w), w, out);
}

// ---- attention over the int8 cache ---------------------------------------------------------

// Both products run on vpdpwssd (int16 pairs into int32, exact): the query rows are rounded to int16
// on their own scales, and per task each row's softmax weights (times the values' scales) on
// theirs, while the keys and values are widened from int8 as they are read. One instruction then
// takes two of the int8 cache's numbers per lane where a float32 multiply-add took one and a
// conversion besides. The roundings are 14 and 15 bits, against the 8 bits the cache keeps of each
// key and value: as accurate as float32 products (mean KL 0.00211 nats against 0.00213) and about
// 1.4x faster (docs/performance.md, where the forms tried and left out are listed too).
//
// Positions one task of Int8Attend covers: a row's context is cut at fixed multiples of this (never
// where other rows end), so its sums run in the same order whatever the batch.
constexpr int64_t kSplit = 2048;
#if MASHBOX_AVX512
constexpr int kRows = 8;                 // query rows per pass (2 accumulators each)
#else
constexpr int kRows = 4;                 // AVX2 and NEON: query rows per pass
#endif
constexpr int64_t kStep = 32;            // positions per step of both passes (two 16-lane halves)
constexpr int64_t kMaxHeadDim = 1024;    // int16 queries: 16383 * 127 * D stays below 2^31
constexpr float kQueryLevels = 16383.0f;
constexpr float kWeightLevels = 32767.0f;  // the weights are never negative: all of int16's range

// e^x for x <= 0, about 1 ulp: x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial, times 2^n.
#if MASHBOX_AVX512
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __mmask32 Words(int64_t left) { return left >= 32 ? ~0u : left <= 0 ? 0 : (1u << left) - 1; }

// 32 int8 at `at` (zero past the mask) -> int16.
inline __m512i Words16(const int8_t* at, __mmask32 m) {
  return _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, at));
}

// acc += the pairwise int16 products of a and b (vpdpwssd), in asm: around the intrinsic GCC 12
// copied every accumulator through another register, about doubling the loops' instructions.
inline void Dpwssd(__m512i& acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}
#elif MASHBOX_AVX2
inline __m256 Exp(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // 2^n built from its exponent bits: n >= -126 (x >= -87), a normal float.
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// 16 int8 at `at` -> int16 (zero past `left`; never read past it: the cache may end there).
inline __m256i Words16(const int8_t* at, int64_t left) {
  if (left >= 16) return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
  alignas(16) int8_t part[16] = {};
  __builtin_memcpy(part, at, std::max<int64_t>(left, 0));
  return _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(part)));
}
#else
inline float32x4_t Exp(float32x4_t x) {
  x = vmaxq_f32(x, vdupq_n_f32(-87.0f));
  const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504f)));
  float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693145752f));
  r = vfmsq_f32(r, n, vdupq_n_f32(1.42860677e-6f));
  float32x4_t p = vdupq_n_f32(1.0f / 720);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 120), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 24), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 6), p, r);
  p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
  const int32x4_t two_n = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vmulq_f32(p, vreinterpretq_f32_s32(two_n));
}

// 16 int8 at `at` -> int16, positions 0-7 and 8-15 (zero past `left`; never read past it).
inline void Words16(const int8_t* at, int64_t left, int16x8_t* words) {
  int8x16_t bytes;
  if (left >= 16) {
    bytes = vld1q_s8(at);
  } else {
    int8_t part[16] = {};
    __builtin_memcpy(part, at, std::max<int64_t>(left, 0));
    bytes = vld1q_s8(part);
  }
  words[0] = vmovl_s8(vget_low_s8(bytes));
  words[1] = vmovl_high_s8(bytes);
}
#endif

// Scores of R query rows (int16, as pairs of dimensions: qp [R, D/2], scales qs [R]) over n
// positions of keys k [D, C] from `begin`, times the keys' scales, into w (row stride `stride`).
// Each step widens two dimensions of 32 positions to int16 and interleaves them per position
// (vpermt2w), so that one vpdpwssd adds both dimensions' products for 16 positions. `later`: the
// values [D, C], fetched ahead for Weighted (about 10% at 16k positions; keys fetched ahead gained
// nothing).
#if MASHBOX_AVX512
template <int R>
void Scores(const int32_t* qp, const float* qs, const int8_t* k, const float* ks, int64_t D, int64_t C,
            int64_t begin, int64_t n, float* w, int64_t stride, const int8_t* later) {
  alignas(64) int16_t order[2][32];
  for (int i = 0; i < 16; i++)
    for (int h = 0; h < 2; h++) order[h][2 * i] = 16 * h + i, order[h][2 * i + 1] = 32 + 16 * h + i;
  const __m512i first = _mm512_load_si512(order[0]), second = _mm512_load_si512(order[1]);
  const int64_t pairs = D / 2;
  for (int64_t p = 0; p < n; p += kStep) {
    const __mmask32 m = Words(n - p);
    __m512i s[2][R];
    for (int r = 0; r < R; r++) s[0][r] = s[1][r] = _mm512_setzero_si512();
    const int8_t* at = k + begin + p;
    if (later && p % 64 == 0)         // into L2: the values' pass reads these positions next
      for (int64_t d = 0; d < D; d++)
        PrefetchL2(later + d * C + begin + p);
    for (int64_t d = 0; d < pairs; d++, at += 2 * C) {
      const __m512i a = Words16(at, m), b = Words16(at + C, m);
      const __m512i lo = _mm512_permutex2var_epi16(a, first, b);    // positions p .. p+15
      const __m512i hi = _mm512_permutex2var_epi16(a, second, b);   // p+16 .. p+31
      for (int r = 0; r < R; r++) {
        const __m512i q = _mm512_set1_epi32(qp[r * pairs + d]);
        Dpwssd(s[0][r], lo, q);
        Dpwssd(s[1][r], hi, q);
      }
    }
    for (int h = 0; h < 2; h++) {
      const __m512 scale = _mm512_maskz_loadu_ps(Lanes(n - p - 16 * h), ks + begin + p + 16 * h);
      for (int r = 0; r < R; r++)
        _mm512_storeu_ps(w + r * stride + p + 16 * h,
                         _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s[h][r]), _mm512_set1_ps(qs[r])), scale));
    }
  }
}

// acc [R, D] = the int16 weights wq [R, stride] (zero past n) times values v [D, C] over n
// positions from `begin`: each lane adds a pair of positions per vpdpwssd, two dimensions at a
// time, and its 16 partial sums are added at the end (in float32: they may pass 2^31 together).
template <int R>
void Weighted(const int16_t* wq, int64_t stride, const int8_t* v, int64_t D, int64_t C, int64_t begin,
              int64_t n, float* acc) {
  for (int64_t d = 0; d < D; d += 2) {
    __m512i a[2][R];
    for (int r = 0; r < R; r++) a[0][r] = a[1][r] = _mm512_setzero_si512();
    const int8_t* at = v + d * C + begin;
    for (int64_t p = 0; p < n; p += kStep) {
      const __mmask32 m = Words(n - p);
      const __m512i v0 = Words16(at + p, m), v1 = Words16(at + C + p, m);
      for (int r = 0; r < R; r++) {
        const __m512i wr = _mm512_loadu_si512(wq + r * stride + p);
        Dpwssd(a[0][r], v0, wr);
        Dpwssd(a[1][r], v1, wr);
      }
    }
    for (int r = 0; r < R; r++) {
      acc[r * D + d] = _mm512_reduce_add_ps(_mm512_cvtepi32_ps(a[0][r]));
      acc[r * D + d + 1] = _mm512_reduce_add_ps(_mm512_cvtepi32_ps(a[1][r]));
    }
  }
}
#elif MASHBOX_AVX2
// AVX2: 16 positions per step; vpunpck{l,h}wd interleave the two dimensions per position within
// 128-bit lanes (positions 0-3 and 8-11, then 4-7 and 12-15), put back in order before the store.
template <int R>
void Scores(const int32_t* qp, const float* qs, const int8_t* k, const float* ks, int64_t D, int64_t C,
            int64_t begin, int64_t n, float* w, int64_t stride, const int8_t* later) {
  const int64_t pairs = D / 2;
  for (int64_t p = 0; p < n; p += 16) {
    const int64_t left = n - p;
    __m256i s[2][R];
    for (int r = 0; r < R; r++) s[0][r] = s[1][r] = _mm256_setzero_si256();
    const int8_t* at = k + begin + p;
    if (later && p % 64 == 0)
      for (int64_t d = 0; d < D; d++)
        PrefetchL2(later + d * C + begin + p);
    for (int64_t d = 0; d < pairs; d++, at += 2 * C) {
      const __m256i a = Words16(at, left), b = Words16(at + C, left);
      const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
      for (int r = 0; r < R; r++) {
        const __m256i q = _mm256_set1_epi32(qp[r * pairs + d]);
        s[0][r] = DotWords(s[0][r], lo, q);
        s[1][r] = DotWords(s[1][r], hi, q);
      }
    }
    for (int h = 0; h < 2; h++) {
      const __m256 scale = _mm256_maskload_ps(ks + begin + p + 8 * h, Lanes8(left - 8 * h));
      for (int r = 0; r < R; r++) {
        const __m256i ordered = _mm256_permute2x128_si256(s[0][r], s[1][r], h == 0 ? 0x20 : 0x31);
        _mm256_storeu_ps(w + r * stride + p + 8 * h,
                         _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(ordered), _mm256_set1_ps(qs[r])), scale));
      }
    }
  }
}

template <int R>
void Weighted(const int16_t* wq, int64_t stride, const int8_t* v, int64_t D, int64_t C, int64_t begin,
              int64_t n, float* acc) {
  for (int64_t d = 0; d < D; d += 2) {
    __m256i a[2][R];
    for (int r = 0; r < R; r++) a[0][r] = a[1][r] = _mm256_setzero_si256();
    const int8_t* at = v + d * C + begin;
    for (int64_t p = 0; p < n; p += 16) {
      const __m256i v0 = Words16(at + p, n - p), v1 = Words16(at + C + p, n - p);
      for (int r = 0; r < R; r++) {
        const __m256i wr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + r * stride + p));
        a[0][r] = DotWords(a[0][r], v0, wr);
        a[1][r] = DotWords(a[1][r], v1, wr);
      }
    }
    for (int r = 0; r < R; r++) {
      acc[r * D + d] = ReduceAdd(_mm256_cvtepi32_ps(a[0][r]));
      acc[r * D + d + 1] = ReduceAdd(_mm256_cvtepi32_ps(a[1][r]));
    }
  }
}
#else
// NEON: 16 positions per step, as 4 lanes of 4; each query pair's two dimensions are multiplied and
// added into int32 (smlal) one after the other.
template <int R>
void Scores(const int32_t* qp, const float* qs, const int8_t* k, const float* ks, int64_t D, int64_t C,
            int64_t begin, int64_t n, float* w, int64_t stride, const int8_t* later) {
  const int64_t pairs = D / 2;
  const int16_t* qw = reinterpret_cast<const int16_t*>(qp);      // dimension 2d at 2d, 2d + 1 next
  for (int64_t p = 0; p < n; p += 16) {
    const int64_t left = n - p;
    int32x4_t s[R][4];
    for (int r = 0; r < R; r++)
      for (int q = 0; q < 4; q++) s[r][q] = vdupq_n_s32(0);
    const int8_t* at = k + begin + p;
    if (later && p % 64 == 0)
      for (int64_t d = 0; d < D; d++) PrefetchL2(later + d * C + begin + p);
    for (int64_t d = 0; d < pairs; d++, at += 2 * C) {
      int16x8_t a[2], b[2];
      Words16(at, left, a);
      Words16(at + C, left, b);
      for (int r = 0; r < R; r++) {
        const int16_t q0 = qw[r * D + 2 * d], q1 = qw[r * D + 2 * d + 1];
        for (int h = 0; h < 2; h++) {
          s[r][2 * h] = vmlal_n_s16(vmlal_n_s16(s[r][2 * h], vget_low_s16(a[h]), q0), vget_low_s16(b[h]), q1);
          s[r][2 * h + 1] = vmlal_high_n_s16(vmlal_high_n_s16(s[r][2 * h + 1], a[h], q0), b[h], q1);
        }
      }
    }
    for (int q = 0; q < 4; q++) {
      const float32x4_t scale = Load4(ks + begin + p + 4 * q, left - 4 * q);
      for (int r = 0; r < R; r++)
        vst1q_f32(w + r * stride + p + 4 * q,
                  vmulq_f32(vmulq_f32(vcvtq_f32_s32(s[r][q]), vdupq_n_f32(qs[r])), scale));
    }
  }
}

// Each dimension's products in 8 int32 lanes (two registers), as the AVX2 tier's: no lane sums more
// than 256 products of a task's 2048 positions, within int32.
template <int R>
void Weighted(const int16_t* wq, int64_t stride, const int8_t* v, int64_t D, int64_t C, int64_t begin,
              int64_t n, float* acc) {
  for (int64_t d = 0; d < D; d += 2) {
    int32x4_t a[2][R][2];
    for (int e = 0; e < 2; e++)
      for (int r = 0; r < R; r++) a[e][r][0] = a[e][r][1] = vdupq_n_s32(0);
    const int8_t* at = v + d * C + begin;
    for (int64_t p = 0; p < n; p += 16) {
      int16x8_t values[2][2];                              // [dimension][positions 0-7, 8-15]
      Words16(at + p, n - p, values[0]);
      Words16(at + C + p, n - p, values[1]);
      for (int r = 0; r < R; r++) {
        const int16x8_t w0 = vld1q_s16(wq + r * stride + p), w1 = vld1q_s16(wq + r * stride + p + 8);
        for (int e = 0; e < 2; e++) {
          a[e][r][0] = vmlal_s16(vmlal_s16(a[e][r][0], vget_low_s16(values[e][0]), vget_low_s16(w0)),
                                 vget_low_s16(values[e][1]), vget_low_s16(w1));
          a[e][r][1] = vmlal_high_s16(vmlal_high_s16(a[e][r][1], values[e][0], w0), values[e][1], w1);
        }
      }
    }
    for (int r = 0; r < R; r++)
      for (int e = 0; e < 2; e++)
        acc[r * D + d + e] = vaddvq_f32(vaddq_f32(vcvtq_f32_s32(a[e][r][0]), vcvtq_f32_s32(a[e][r][1])));
  }
}
#endif

using ScoresFn = void (*)(const int32_t*, const float*, const int8_t*, const float*, int64_t, int64_t,
                          int64_t, int64_t, float*, int64_t, const int8_t*);
using WeightedFn = void (*)(const int16_t*, int64_t, const int8_t*, int64_t, int64_t, int64_t, int64_t,
                            float*);
#if MASHBOX_AVX512
constexpr ScoresFn kScores[kRows + 1] = {nullptr, Scores<1>, Scores<2>, Scores<3>, Scores<4>,
                                         Scores<5>, Scores<6>, Scores<7>, Scores<8>};
constexpr WeightedFn kWeighted[kRows + 1] = {nullptr, Weighted<1>, Weighted<2>, Weighted<3>,
                                             Weighted<4>, Weighted<5>, Weighted<6>, Weighted<7>,
                                             Weighted<8>};
#else
constexpr ScoresFn kScores[kRows + 1] = {nullptr, Scores<1>, Scores<2>, Scores<3>, Scores<4>};
constexpr WeightedFn kWeighted[kRows + 1] = {nullptr, Weighted<1>, Weighted<2>, Weighted<3>, Weighted<4>};
#endif

// One task: the query rows of `tokens` consecutive tokens of one slot and KV head (token j's G rows
// at q + j * stride, D floats each) over positions [begin, begin + n) of the slot's keys k and values
// v [D, C] (positions last) and their scales [C], token j seeing the first seen[j] <= n of them.
// Leaves each row's largest score, its sum of e^(score - largest) and its weighted values [D] (not
// yet divided by the sum); a row that sees none gets -inf, 0 and zeros. A row's numbers do not
// depend on the rows beside it: each pass multiplies up to kRows rows by the same keys and values,
// but every sum is the row's own, and positions past its count add exact zeros.
void AttendSpan(const float* q, int64_t stride, int64_t tokens, int64_t G, const int64_t* seen,
                const int8_t* k, const int8_t* v, const float* ks, const float* vs, int64_t D, int64_t C,
                int64_t begin, int64_t n, float* best, float* total, float* acc) {
  const int64_t rows = tokens * G, padded = (n + kStep - 1) / kStep * kStep, pairs = D / 2;
  // The queries as int16 on each row's own scale, two dimensions to an int32.
  std::vector<int32_t> qp(rows * pairs);
  std::vector<float> qs(rows), unit(kRows);
  int16_t* levels = reinterpret_cast<int16_t*>(qp.data());
  for (int64_t g = 0; g < rows; g++) {
    const float* row = q + (g / G) * stride + (g % G) * D;
    const float peak = Peak(row, D);
    qs[g] = peak > 0.0f ? peak / kQueryLevels : 1.0f;
#if MASHBOX_AVX512
    const __m512 divisor = _mm512_set1_ps(qs[g]);
    for (int64_t e = 0; e < D; e += kLanes) {
      const __mmask16 m = Lanes(D - e);
      const __m512i level = _mm512_cvtps_epi32(Rounded(row + e, m, divisor));
      _mm512_mask_cvtepi32_storeu_epi16(levels + g * D + e, m, level);
    }
#else
    for (int64_t e = 0; e < D; e++) levels[g * D + e] = static_cast<int16_t>(std::nearbyint(row[e] / qs[g]));
#endif
  }
  // Per pass of up to kRows rows: scores, weights, weighted values (every lane written before it is
  // read: no zeroing).
  std::unique_ptr<float[]> w(new float[kRows * padded]);
  std::unique_ptr<int16_t[]> wq(new int16_t[kRows * padded]);
  for (int64_t first = 0; first < rows; first += kRows) {
    const int64_t R = std::min<int64_t>(kRows, rows - first);
    kScores[R](&qp[first * pairs], &qs[first], k, ks, D, C, begin, n, w.get(), padded, v);
    for (int64_t i = 0; i < R; i++) {
      const int64_t g = first + i, own = seen[g / G];
      float* row = &w[i * padded];
      if (own <= 0) {
        best[g] = -INFINITY, total[g] = 0.0f, unit[i] = 0.0f;
        std::fill(&wq[i * padded], &wq[(i + 1) * padded], int16_t{0});
        continue;
      }
#if MASHBOX_AVX512
      __m512 top = _mm512_set1_ps(-INFINITY);
      for (int64_t p = 0; p < own; p += 16)
        top = _mm512_mask_max_ps(top, Lanes(own - p), top, _mm512_loadu_ps(row + p));
      const float peak = _mm512_reduce_max_ps(top);
      __m512 sum = _mm512_setzero_ps(), largest = _mm512_setzero_ps();
      for (int64_t p = 0; p < padded; p += 16) {
        const __mmask16 m = Lanes(own - p);
        const __m512 shifted = _mm512_sub_ps(_mm512_loadu_ps(row + p), _mm512_set1_ps(peak));
        const __m512 e = _mm512_maskz_mov_ps(m, Exp(shifted));
        sum = _mm512_add_ps(sum, e);
        const __m512 weight = _mm512_mul_ps(e, _mm512_maskz_loadu_ps(m, vs + begin + p));
        largest = _mm512_max_ps(largest, weight);
        _mm512_storeu_ps(row + p, weight);
      }
      best[g] = peak;
      total[g] = _mm512_reduce_add_ps(sum);
      // The weights (e^(score - largest) times the values' scales) as int16 on the row's own scale.
      const float top_weight = _mm512_reduce_max_ps(largest);
      unit[i] = top_weight > 0.0f ? top_weight / kWeightLevels : 0.0f;
      const __m512 levels = _mm512_set1_ps(top_weight > 0.0f ? kWeightLevels / top_weight : 0.0f);
      for (int64_t p = 0; p < padded; p += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&wq[i * padded + p]),
                            _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + p), levels))));
#elif MASHBOX_AVX2
      __m256 top = _mm256_set1_ps(-INFINITY);
      for (int64_t p = 0; p < own; p += 8) {
        const __m256 m = _mm256_castsi256_ps(Lanes8(own - p));
        top = _mm256_max_ps(top, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(row + p), m));
      }
      const float peak = ReduceMax(top);
      __m256 sum = _mm256_setzero_ps(), largest = _mm256_setzero_ps();
      for (int64_t p = 0; p < padded; p += 8) {
        const __m256i mi = Lanes8(own - p);
        const __m256 m = _mm256_castsi256_ps(mi);
        const __m256 e = _mm256_and_ps(m, Exp(_mm256_sub_ps(_mm256_loadu_ps(row + p), _mm256_set1_ps(peak))));
        sum = _mm256_add_ps(sum, e);
        const __m256 weight = _mm256_mul_ps(e, _mm256_maskload_ps(vs + begin + p, mi));
        largest = _mm256_max_ps(largest, weight);
        _mm256_storeu_ps(row + p, weight);
      }
      best[g] = peak;
      total[g] = ReduceAdd(sum);
      const float top_weight = ReduceMax(largest);
      unit[i] = top_weight > 0.0f ? top_weight / kWeightLevels : 0.0f;
      const __m256 levels = _mm256_set1_ps(top_weight > 0.0f ? kWeightLevels / top_weight : 0.0f);
      for (int64_t p = 0; p < padded; p += 16) {
        const __m256i low = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + p), levels));
        const __m256i high = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + p + 8), levels));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&wq[i * padded + p]),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(low, high), 0xD8));
      }
#else
      float peak = -INFINITY;
      for (int64_t p = 0; p < own; p++) peak = row[p] > peak ? row[p] : peak;
      float32x4_t sum = vdupq_n_f32(0.0f), largest = vdupq_n_f32(0.0f);
      for (int64_t p = 0; p < padded; p += 4) {        // past own: e and the weight 0
        const float32x4_t shifted = vsubq_f32(vld1q_f32(row + p), vdupq_n_f32(peak));
        const float32x4_t e = vreinterpretq_f32_u32(vandq_u32(Lanes4(own - p), vreinterpretq_u32_f32(Exp(shifted))));
        sum = vaddq_f32(sum, e);
        const float32x4_t weight = vmulq_f32(e, Load4(vs + begin + p, own - p));
        largest = vmaxq_f32(largest, weight);
        vst1q_f32(row + p, weight);
      }
      best[g] = peak;
      total[g] = vaddvq_f32(sum);
      const float top_weight = vmaxvq_f32(largest);
      unit[i] = top_weight > 0.0f ? top_weight / kWeightLevels : 0.0f;
      const float32x4_t levels = vdupq_n_f32(top_weight > 0.0f ? kWeightLevels / top_weight : 0.0f);
      for (int64_t p = 0; p < padded; p += 4)           // nearest, ties to even, as cvtps_epi32
        vst1_s16(&wq[i * padded + p], vqmovn_s32(vcvtnq_s32_f32(vmulq_f32(vld1q_f32(row + p), levels))));
#endif
    }
    kWeighted[R](wq.get(), padded, v, D, C, begin, n, acc + first * D);
    for (int64_t i = 0; i < R; i++)
      for (int64_t e = 0; e < D; e++) acc[(first + i) * D + e] *= unit[i];
  }
}

// Tokens whose query rows share one task's passes over the keys: consecutive rows of the call with
// the same slot (a prefill chunk's or a verification's tokens; each decode row stands alone).
constexpr int64_t kBlockTokens = 16;

// Attention over an int8 cache: q [B, KV, G, D] float32 (one token per row, scaled and multiplied
// by the keys' smoothing), the cache's k, v [slots, KV, D, C] int8 and k_scale, v_scale
// [slots, KV, C], each row's slot and position [B] -> out [B, KV, G, D]: row b's queries attend to
// positions 0 .. position[b] of slot slots[b]; a row at a negative position (padding) reads nothing
// and its outputs are zero. Tasks of (block of rows, KV head, kSplit positions)
// run on the pool; a row's partial softmaxes are merged in a fixed order. Each row gets the numbers
// it gets alone: a decode step's, a verification's and a prefill chunk's rows agree to the bit.
ffi::Error Int8Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S8> k,
                      ffi::Buffer<ffi::S8> v, ffi::Buffer<ffi::F32> k_scale,
                      ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> slots,
                      ffi::Buffer<ffi::S32> positions, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || kd[1] != qd[1] || kd[2] != qd[3] ||
      slots.element_count() != qd[0] || positions.element_count() != qd[0] || qd[3] % 2 != 0 ||
      qd[3] > kMaxHeadDim)
    return ffi::Error::InvalidArgument("int8_attend: q [B, KV, G, D], cache [slots, KV, D, C], D even, at most 1024");
  const int64_t B = qd[0], KV = qd[1], G = qd[2], D = qd[3], S = kd[0], C = kd[3];
  const int32_t* slot = slots.typed_data();
  std::vector<int64_t> last(B);                                // each row's last position read
  struct Block { int64_t first, count, last; };
  std::vector<Block> blocks;
  for (int64_t b = 0; b < B; b++) {
    if (slot[b] < 0 || slot[b] >= S) return ffi::Error::InvalidArgument("int8_attend: slot out of range");
    last[b] = std::min<int64_t>(positions.typed_data()[b], C - 1);
    if (last[b] < 0) continue;                                 // padding: in no block
    const Block* before = blocks.empty() ? nullptr : &blocks.back();
    if (!before || slot[before->first] != slot[b] || before->count == kBlockTokens ||
        before->first + before->count != b)                    // a block's rows are adjacent
      blocks.push_back({b, 0, 0});
    blocks.back().count++;
    blocks.back().last = std::max(blocks.back().last, last[b]);
  }
  struct Task { int64_t block, h, begin, end, at; };          // at: its first row's index
  std::vector<Task> tasks;
  int64_t rows = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(blocks.size()); i++)
    for (int64_t h = 0; h < KV; h++)
      for (int64_t begin = 0; begin <= blocks[i].last; begin += kSplit) {
        tasks.push_back({i, h, begin, std::min(begin + kSplit, blocks[i].last + 1), rows});
        rows += blocks[i].count * G;
      }
  std::vector<float> best(rows), total(rows), acc(rows * D);
  const float* qp = q.typed_data();
  Parallel(pool, tasks.size(), [&](int64_t i) {
    const Task& t = tasks[i];
    const Block& block = blocks[t.block];
    int64_t seen[kBlockTokens];
    for (int64_t j = 0; j < block.count; j++) seen[j] = std::min(t.end, last[block.first + j] + 1) - t.begin;
    const int64_t cache = (slot[block.first] * KV + t.h);
    AttendSpan(qp + (block.first * KV + t.h) * G * D, KV * G * D, block.count, G, seen,
               k.typed_data() + cache * D * C, v.typed_data() + cache * D * C, k_scale.typed_data() + cache * C,
               v_scale.typed_data() + cache * C, D, C, t.begin, t.end - t.begin, &best[t.at], &total[t.at],
               &acc[t.at * D]);
  });
  float* op = out->typed_data();
  for (int64_t b = 0; b < B; b++)
    if (last[b] < 0) std::fill_n(op + b * KV * G * D, KV * G * D, 0.0f);
  for (size_t i = 0; i < tasks.size();) {                    // a (block, KV head)'s tasks are adjacent
    size_t j = i;
    while (j < tasks.size() && tasks[j].block == tasks[i].block && tasks[j].h == tasks[i].h) j++;
    const Block& block = blocks[tasks[i].block];
    for (int64_t r = 0; r < block.count * G; r++) {
      const int64_t b = block.first + r / G;
      float* o = op + ((b * KV + tasks[i].h) * G + r % G) * D;
      size_t end = i;                                         // the row's tasks: those from 0 to its last
      while (end < j && tasks[end].begin <= last[b]) end++;
      float peak = -INFINITY, sum = 0.0f;
      for (size_t t = i; t < end; t++) peak = std::max(peak, best[tasks[t].at + r]);
      for (int64_t e = 0; e < D; e++) o[e] = 0.0f;
      for (size_t t = i; t < end; t++) {
        const int64_t at = tasks[t].at + r;
        const float f = std::exp(best[at] - peak);
        sum += total[at] * f;
        for (int64_t e = 0; e < D; e++) o[e] += acc[at * D + e] * f;
      }
      for (int64_t e = 0; e < D; e++) o[e] /= sum;
    }
    i = j;
  }
  return ffi::Error::Success();
}

// ---- float products in one order for every row count -----------------------------------------

// A MoE router's scores and Qwen3-Next's shared expert run on float weights, whose product XLA sums
// in an order it picks by the shape of the call: a token's experts could then differ between a
// prefill chunk, a decode step and a verification. Here each output sums its K products (each
// rounded, then added: no fused multiply-add) in 16 partial sums, partial j taking inputs j, j + 16,
// j + 32, ... in turn, which a fixed tree adds at the end (8 + 8, 4 + 4, 2 + 2, 1 + 1). The same
// bits for any rows beside it, and on every tier: AVX-512 holds the 16 partials in one register,
// AVX2 in two, NEON in four.
#if MASHBOX_AVX512
struct Sum16 {
  __m512 s = _mm512_setzero_ps();
  static Sum16 Load(const float* at, int64_t left) { return {_mm512_maskz_loadu_ps(Lanes(left), at)}; }
  void AddProduct(const Sum16& a, const Sum16& b) { s = _mm512_add_ps(s, _mm512_mul_ps(a.s, b.s)); }
  void Store(float* out) const { _mm512_storeu_ps(out, s); }
};
constexpr int kDotRows = 4, kDotOuts = 4;  // a block's accumulators: 16 of the 32 registers
#elif MASHBOX_AVX2
struct Sum16 {
  __m256 s[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  static Sum16 Load(const float* at, int64_t left) {
    Sum16 x;
    for (int h = 0; h < 2; h++) x.s[h] = _mm256_maskload_ps(at + 8 * h, Lanes8(left - 8 * h));
    return x;
  }
  void AddProduct(const Sum16& a, const Sum16& b) {
    for (int h = 0; h < 2; h++) s[h] = _mm256_add_ps(s[h], _mm256_mul_ps(a.s[h], b.s[h]));
  }
  void Store(float* out) const { for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + 8 * h, s[h]); }
};
constexpr int kDotRows = 2, kDotOuts = 2;  // 8 of the 16 registers
#else
struct Sum16 {
  float32x4_t s[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
  static Sum16 Load(const float* at, int64_t left) {
    Sum16 x;
    for (int h = 0; h < 4; h++) x.s[h] = Load4(at + 4 * h, left - 4 * h);
    return x;
  }
  void AddProduct(const Sum16& a, const Sum16& b) {
    for (int h = 0; h < 4; h++) s[h] = vaddq_f32(s[h], vmulq_f32(a.s[h], b.s[h]));
  }
  void Store(float* out) const { for (int h = 0; h < 4; h++) vst1q_f32(out + 4 * h, s[h]); }
};
constexpr int kDotRows = 2, kDotOuts = 2;  // 16 of the 32 registers
#endif

inline float Total16(const Sum16& sum) {
  float part[16];
  sum.Store(part);
  for (int width = 8; width >= 1; width /= 2)
    for (int j = 0; j < width; j++) part[j] += part[j + width];
  return part[0];
}

// out[r, n] for R rows of x [., K] and NB outputs of w [., K] (out's row stride N).
template <int R, int NB>
void DotBlock(const float* x, const float* w, int64_t K, int64_t N, float* out) {
  Sum16 acc[R][NB];
  for (int64_t k = 0; k < K; k += 16) {
    Sum16 xs[R], ws[NB];
    for (int r = 0; r < R; r++) xs[r] = Sum16::Load(x + r * K + k, K - k);
    for (int n = 0; n < NB; n++) ws[n] = Sum16::Load(w + n * K + k, K - k);
    for (int r = 0; r < R; r++)
      for (int n = 0; n < NB; n++) acc[r][n].AddProduct(xs[r], ws[n]);
  }
  for (int r = 0; r < R; r++)
    for (int n = 0; n < NB; n++) out[r * N + n] = Total16(acc[r][n]);
}

// Rows and outputs per task of RowDot.
constexpr int64_t kDotTaskRows = 32, kDotTaskOuts = 64;

// x [R, K] float32 times w [N, K] float32 -> out [R, N], each output summed as above.
ffi::Error RowDot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("row_dot: x [R, K], w [N, K]");
  const int64_t R = xd[0], K = xd[1], N = wd[0];
  const int64_t row_tasks = (R + kDotTaskRows - 1) / kDotTaskRows, out_tasks = (N + kDotTaskOuts - 1) / kDotTaskOuts;
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* op = out->typed_data();
  Parallel(pool, row_tasks * out_tasks, [&](int64_t task) {
    const int64_t r0 = task / out_tasks * kDotTaskRows, n0 = task % out_tasks * kDotTaskOuts;
    const int64_t r1 = std::min(R, r0 + kDotTaskRows), n1 = std::min(N, n0 + kDotTaskOuts);
    for (int64_t r = r0; r < r1;) {
      const bool rows = r + kDotRows <= r1;
      for (int64_t n = n0; n < n1;) {
        const bool outs = n + kDotOuts <= n1;
        const float* xr = xp + r * K;
        const float* wn = wp + n * K;
        float* o = op + r * N + n;
        if (rows && outs) DotBlock<kDotRows, kDotOuts>(xr, wn, K, N, o);
        else if (rows) DotBlock<kDotRows, 1>(xr, wn, K, N, o);
        else if (outs) DotBlock<1, kDotOuts>(xr, wn, K, N, o);
        else DotBlock<1, 1>(xr, wn, K, N, o);
        n += outs ? kDotOuts : 1;
      }
      r += rows ? kDotRows : 1;
    }
  });
  return ffi::Error::Success();
}

// ---- the delta rule, token by token ---------------------------------------------------------------

// A Gated DeltaNet layer's recurrent state S [dk, dv] per value head, one token at a time, exactly
// as engine/model.py: _delta_step writes it in XLA's operations: with d the token's decay and b its
// strength, S <- d S; p = S^T k; w = (v - p) b; S <- S + k w^T; out = S^T q. Every product is
// rounded before it is added (-ffp-contract=off) and both sums over the keys take _key_sum's order
// (the keys padded with zeros to a power of two, then the second half added to the first until one
// is left), so a token's output and state are the decode step's bits whether it runs here or there.
// A call holds each head's state as blocks of kDeltaColumns value columns of every key row (8 KB
// at dk = 128, contiguous: rows dv apart would share a few of L1's sets), and a token runs block by
// block, the block and its products in L1. A block's row is whole registers of the tier's width
// (GCC's vector types, lane by lane as the scalar operations; a type wider than the registers went
// through the stack: docs/perf-log.md, "The delta rule in the kernel"). A call of at most
// kDeltaDirectTokens tokens (a decode step, a verification) takes each block where the state holds
// it instead, its rows dv apart: each block is read a few times only, and copying the state into
// blocks and back cost more than the misses (docs/perf-log.md, "Weights in huge pages": the delta
// rule's few tokens).
constexpr int64_t kDeltaColumns = 16;
constexpr int64_t kDeltaDirectTokens = 4;
#if MASHBOX_AVX512
#define MASHBOX_DELTA_VECTOR_BYTES 64
#elif MASHBOX_AVX2
#define MASHBOX_DELTA_VECTOR_BYTES 32
#else
#define MASHBOX_DELTA_VECTOR_BYTES 16
#endif
// Aligned as a float: a block taken where the state holds it starts wherever the buffer puts it.
typedef float DeltaVector __attribute__((vector_size(MASHBOX_DELTA_VECTOR_BYTES), aligned(4)));
constexpr int64_t kDeltaVectors = kDeltaColumns * sizeof(float) / sizeof(DeltaVector);
struct DeltaRow {
  DeltaVector v[kDeltaVectors];
  float& operator[](int64_t j) { return reinterpret_cast<float*>(v)[j]; }
};

// p [size] summed over its rows (size a power of two), in place, into p[0].
inline void KeySum(DeltaRow* p, int64_t size) {
  for (int64_t half = size / 2; half >= 1; half /= 2)
    for (int64_t i = 0; i < half; i++)
      for (int64_t h = 0; h < kDeltaVectors; h++) p[i].v[h] += p[i + half].v[h];
}

// One token for one block of a head's state, key row i at s[i * stride], whose first `columns`
// columns are the state's (the rest zero, never read back); p the products' scratch [size], its
// rows from dk on zero (KeySum never writes them). v, out and written: the block's columns.
void DeltaBlock(DeltaRow* s, int64_t stride, int64_t dk, int64_t size, int64_t columns, const float* q,
                const float* k, const float* v, float decay, float beta, DeltaRow* p, float* out, float* written) {
  for (int64_t i = 0; i < dk; i++)
    for (int64_t h = 0; h < kDeltaVectors; h++) {
      const DeltaVector decayed = s[i * stride].v[h] * decay;
      s[i * stride].v[h] = decayed;
      p[i].v[h] = k[i] * decayed;
    }
  KeySum(p, size);
  DeltaRow w = {};
  for (int64_t j = 0; j < columns; j++) written[j] = w[j] = (v[j] - p[0][j]) * beta;
  for (int64_t i = 0; i < dk; i++)
    for (int64_t h = 0; h < kDeltaVectors; h++) {
      const DeltaVector now = s[i * stride].v[h] + k[i] * w.v[h];
      s[i * stride].v[h] = now;
      p[i].v[h] = q[i] * now;
    }
  KeySum(p, size);
  for (int64_t j = 0; j < columns; j++) out[j] = p[0][j];
}

// What a call's tokens and heads are: q, k [B, T, H, dk], v [B, T, H, dv], decay, beta [B, T, H].
struct DeltaTokens {
  const float *q, *k, *v, *decay, *beta;
  int64_t B, T, H, dk, dv;
};

// The shapes both entry points check: q, k, v, decay and beta as DeltaTokens says, and the states'
// last three dimensions [H, dk, dv].
ffi::Error DeltaShapes(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v,
                       ffi::Buffer<ffi::F32>& decay, ffi::Buffer<ffi::F32>& beta, ffi::Buffer<ffi::F32>& states,
                       DeltaTokens& tokens) {
  const auto qd = q.dimensions(), vd = v.dimensions(), sd = states.dimensions();
  if (qd.size() != 4 || vd.size() != 4 || sd.size() != 4 || k.element_count() != q.element_count() ||
      vd[0] != qd[0] || vd[1] != qd[1] || vd[2] != qd[2] || sd[1] != qd[2] || sd[2] != qd[3] ||
      sd[3] != vd[3] || decay.element_count() != qd[0] * qd[1] * qd[2] ||
      beta.element_count() != decay.element_count())
    return ffi::Error::InvalidArgument("delta_steps: q, k [B, T, H, dk], v [B, T, H, dv], decay, beta "
                                       "[B, T, H], states [., H, dk, dv]");
  tokens = {q.typed_data(), k.typed_data(), v.typed_data(), decay.typed_data(), beta.typed_data(),
            qd[0], qd[1], qd[2], qd[3], vd[3]};
  return ffi::Error::Success();
}

// Row b's head h for its T tokens: the state from `from` (null: zero) into `to` (may be `from`),
// each token's output and what it wrote into out and written [B, T, H, dv].
void DeltaHead(const DeltaTokens& x, int64_t b, int64_t h, const float* from, float* to, float* out,
               float* written) {
  const int64_t dk = x.dk, dv = x.dv, blocks = (dv + kDeltaColumns - 1) / kDeltaColumns;
  int64_t size = 1;
  while (size < dk) size *= 2;
  std::vector<DeltaRow> p(size, DeltaRow{});
  const bool direct = x.T <= kDeltaDirectTokens && dv % kDeltaColumns == 0;
  std::vector<DeltaRow> s(direct ? 0 : blocks * dk, DeltaRow{});
  if (direct) {                                     // block c is column block c of `to`'s rows
    if (!from) std::fill_n(to, dk * dv, 0.0f);
    else if (from != to) std::copy_n(from, dk * dv, to);
  } else if (from) {
    for (int64_t i = 0; i < dk; i++)
      for (int64_t j = 0; j < dv; j++) s[j / kDeltaColumns * dk + i][j % kDeltaColumns] = from[i * dv + j];
  }
  DeltaRow* rows = direct ? reinterpret_cast<DeltaRow*>(to) : s.data();
  const int64_t stride = direct ? blocks : 1, step = direct ? 1 : dk;
  for (int64_t t = 0; t < x.T; t++) {
    const int64_t at = (b * x.T + t) * x.H + h;     // this token's head in the [B, T, H] inputs
    for (int64_t c = 0; c < blocks; c++) {
      const int64_t j = c * kDeltaColumns;
      DeltaBlock(rows + c * step, stride, dk, size, std::min(kDeltaColumns, dv - j), x.q + at * dk,
                 x.k + at * dk, x.v + at * dv + j, x.decay[at], x.beta[at], p.data(), out + at * dv + j,
                 written + at * dv + j);
    }
  }
  if (!direct)
    for (int64_t i = 0; i < dk; i++)
      for (int64_t j = 0; j < dv; j++) to[i * dv + j] = s[j / kDeltaColumns * dk + i][j % kDeltaColumns];
}

// tokens, state [B, H, dk, dv] -> out [B, T, H, dv], the state after the T tokens, what each token
// wrote (w) [B, T, H, dv]; a verification's (its pool left as it was). One task per row's head.
ffi::Error DeltaSteps(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                      ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> decay, ffi::Buffer<ffi::F32> beta,
                      ffi::Buffer<ffi::F32> state, ffi::ResultBuffer<ffi::F32> out,
                      ffi::ResultBuffer<ffi::F32> state_out, ffi::ResultBuffer<ffi::F32> written) {
  DeltaTokens x;
  if (auto e = DeltaShapes(q, k, v, decay, beta, state, x); e.failure()) return e;
  if (state.dimensions()[0] != x.B) return ffi::Error::InvalidArgument("delta_steps: a state per row");
  const int64_t head = x.dk * x.dv;
  Parallel(pool, x.B * x.H, [&](int64_t task) {
    DeltaHead(x, task / x.H, task % x.H, state.typed_data() + task * head, state_out->typed_data() + task * head,
              out->typed_data(), written->typed_data());
  });
  return ffi::Error::Success();
}

// As DeltaSteps, for a decode step or a prefill chunk: each row's state read from, and written back
// into, its slot of the layer's pool [S, H, dk, dv], which XLA hands over as the result's buffer
// (aliased), so a step passes each state through memory once each way where a gather and a scatter
// around DeltaSteps passed it three times. A row starting at position 0 (starts) starts from zero;
// a row with no tokens (lengths 0: an idle decode row, whose slot may be another row's) reads and
// writes no state, its outputs zero.
ffi::Error DeltaStepsInPlace(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                             ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> decay, ffi::Buffer<ffi::F32> beta,
                             ffi::Buffer<ffi::F32> states, ffi::Buffer<ffi::S32> slots,
                             ffi::Buffer<ffi::S32> starts, ffi::Buffer<ffi::S32> lengths,
                             ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> written,
                             ffi::ResultBuffer<ffi::F32> states_out) {
  DeltaTokens x;
  if (auto e = DeltaShapes(q, k, v, decay, beta, states, x); e.failure()) return e;
  const int64_t S = states.dimensions()[0], head = x.dk * x.dv;
  if (slots.element_count() != x.B || starts.element_count() != x.B || lengths.element_count() != x.B)
    return ffi::Error::InvalidArgument("delta_steps_in_place: slots, starts, lengths [B]");
  for (int64_t b = 0; b < x.B; b++)
    if (lengths.typed_data()[b] > 0 && (slots.typed_data()[b] < 0 || slots.typed_data()[b] >= S))
      return ffi::Error::InvalidArgument("delta_steps_in_place: a slot past the pool");
  float* pool_out = states_out->typed_data();
  if (pool_out != states.typed_data()) std::copy_n(states.typed_data(), S * x.H * head, pool_out);
  Parallel(pool, x.B * x.H, [&](int64_t task) {
    const int64_t b = task / x.H, h = task % x.H;
    if (lengths.typed_data()[b] <= 0) {
      for (int64_t t = 0; t < x.T; t++) {
        const int64_t at = ((b * x.T + t) * x.H + h) * x.dv;
        std::fill_n(out->typed_data() + at, x.dv, 0.0f);
        std::fill_n(written->typed_data() + at, x.dv, 0.0f);
      }
      return;
    }
    float* slot = pool_out + (slots.typed_data()[b] * x.H + h) * head;
    DeltaHead(x, b, h, starts.typed_data()[b] == 0 ? nullptr : slot, slot, out->typed_data(),
              written->typed_data());
  });
  return ffi::Error::Success();
}

// ---- the greedy pick: each row's first largest logit ------------------------------------------

// XLA:CPU's two reductions over a 152k vocabulary (engine/sampler.py: _first_max) take about 5x as
// long as this one pass (docs/performance.md).
constexpr int64_t kPickPiece = 16384;    // logits per task: 64 KB, a row of 152k in 10 tasks

struct Pick {
  float value;
  int64_t index;
};

// The first largest of x[begin, end). Each lane keeps its first largest (only a greater value
// replaces it, never a NaN), then the lanes' largest with the lowest index wins.
#if MASHBOX_AVX512
Pick PickPiece(const float* x, int64_t begin, int64_t end) {
  const __m512i step = _mm512_set1_epi32(kLanes);
  __m512i at = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(begin)),
                                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i where = at;
  for (int64_t i = begin; i < end; i += kLanes) {
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), Lanes(end - i), x + i);
    const __mmask16 more = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, more, v);
    where = _mm512_mask_mov_epi32(where, more, at);
    at = _mm512_add_epi32(at, step);
  }
  const float peak = _mm512_reduce_max_ps(best);
  const __mmask16 tops = _mm512_cmp_ps_mask(best, _mm512_set1_ps(peak), _CMP_EQ_OQ);
  return {peak, _mm512_mask_reduce_min_epi32(tops, where)};
}
#else
// AVX2 and NEON: one element at a time (the same first largest).
Pick PickPiece(const float* x, int64_t begin, int64_t end) {
  Pick best{-INFINITY, begin};
  for (int64_t i = begin; i < end; i++)
    if (x[i] > best.value) best = {x[i], i};
  return best;
}
#endif

// logits float32 [R, V] -> int32 [R]: the first index of each row's largest value. NaN is never
// picked (a row of NaN and -inf picks 0): a token always in the vocabulary.
ffi::Error FirstMax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::ResultBuffer<ffi::S32> out) {
  const auto d = logits.dimensions();
  if (d.size() != 2 || d[1] < 1 || d[1] > INT32_MAX - kLanes)
    return ffi::Error::InvalidArgument("first_max: logits [R, V], 0 < V < 2^31 - 16");
  const int64_t R = d[0], V = d[1], pieces = (V + kPickPiece - 1) / kPickPiece;
  const float* x = logits.typed_data();
  std::vector<Pick> picks(R * pieces);
  Parallel(pool, R * pieces, [&](int64_t t) {
    const int64_t r = t / pieces, begin = (t % pieces) * kPickPiece;
    picks[t] = PickPiece(x + r * V, begin, std::min(begin + kPickPiece, V));
  });
  int32_t* o = out->typed_data();
  for (int64_t r = 0; r < R; r++) {
    Pick best = picks[r * pieces];
    for (int64_t t = 1; t < pieces; t++)         // a later piece wins only by a larger value
      if (picks[r * pieces + t].value > best.value) best = picks[r * pieces + t];
    o[r] = static_cast<int32_t>(best.index);
  }
  return ffi::Error::Success();
}

// ---- the sampling filters' cuts: top-k, then top-p over what top-k kept ---------------------------

// XLA:CPU found a cut beyond a row's 256 largest probabilities (a wide nucleus, a large top-k) by
// bisection, 48 passes over the vocabulary (engine/sampler.py: _bisected_thresholds), and the others
// from lax.top_k of 256. This finds both exactly, from one histogram of the row's float bits (a
// probability's bits order as its value): the bucket each cut falls in is gathered and sorted.
constexpr int kCutShift = 16;                         // bucket = bits >> 16: 7 bits of mantissa
constexpr int64_t kCutBuckets = (0x3F800000 >> kCutShift) + 1;   // probabilities are at most 1

// A probability's value as the filters see it (a NaN, or anything not above 0, is 0) and its bucket.
inline float CutValue(float p) { return p > 0.0f ? p : 0.0f; }

inline int64_t CutBucket(float v) {
  uint32_t bits;
  __builtin_memcpy(&bits, &v, sizeof bits);
  return std::min<int64_t>(bits >> kCutShift, kCutBuckets - 1);
}

// One row of probabilities p [V] -> (t_k, t_p): the k-th largest (k = min(top_k, V); 0 when top_k
// <= 0), and among the values >= t_k sorted largest first, the first whose running sum (float64)
// reaches top_p of their sum (the smallest of them if rounding never gets there; 0 when top_p >= 1).
// probs >= max(t_k, t_p) is then what the two filters keep, ties included.
void RowCuts(const float* p, int64_t V, int32_t top_k, float top_p, float* t_k, float* t_p) {
  std::vector<int64_t> count(kCutBuckets, 0);
  std::vector<double> mass(kCutBuckets, 0.0);
  for (int64_t i = 0; i < V; i++) {
    const float v = CutValue(p[i]);
    const int64_t b = CutBucket(v);
    count[b]++;
    mass[b] += v;
  }
  // Bucket b's values that are at least `floor`, largest first (16 at a time: CutValue and
  // CutBucket as above, then the matching lanes compressed out; `in` has room for a whole store).
  auto sorted = [&](int64_t b, float floor) {
    std::vector<float> in(count[b] + kLanes);
    int64_t n = 0;
#if MASHBOX_AVX512
    const __m512i last = _mm512_set1_epi32(kCutBuckets - 1), want = _mm512_set1_epi32(b);
    const __m512 zero = _mm512_setzero_ps(), at_least = _mm512_set1_ps(floor);
    for (int64_t i = 0; i < V; i += kLanes) {
      const __mmask16 m = Lanes(V - i);
      const __m512 v = _mm512_max_ps(_mm512_maskz_loadu_ps(m, p + i), zero);   // NaN, -0 -> 0
      const __m512i bucket = _mm512_min_epu32(_mm512_srli_epi32(_mm512_castps_si512(v), kCutShift), last);
      const __mmask16 in_b = _mm512_mask_cmpeq_epi32_mask(m, bucket, want) &
                             _mm512_cmp_ps_mask(v, at_least, _CMP_GE_OQ);
      if (in_b) {             // compressed in a register, then stored: Zen 4's compress to memory is slow
        _mm512_storeu_ps(&in[n], _mm512_maskz_compress_ps(in_b, v));
        n += __builtin_popcount(in_b);
      }
    }
#else
    for (int64_t i = 0; i < V; i++) {
      const float v = CutValue(p[i]);
      if (CutBucket(v) == b && v >= floor) in[n++] = v;
    }
#endif
    in.resize(n);
    std::sort(in.begin(), in.end(), [](float a, float c) { return a > c; });
    return in;
  };
  // top-k: the bucket where the count from the top reaches k, then the value it takes there.
  *t_k = *t_p = 0.0f;
  int64_t lowest = 0;                                    // the lowest bucket top-k keeps values of
  double kept = 0.0;                                     // their sum
  if (top_k > 0) {
    const int64_t k = std::min<int64_t>(top_k, V);
    int64_t above = 0;
    for (lowest = kCutBuckets - 1; lowest > 0 && above + count[lowest] < k; lowest--)
      above += count[lowest];
    const std::vector<float> edge = sorted(lowest, 0.0f);
    *t_k = edge[k - above - 1];
    for (float v : edge)
      if (v >= *t_k) kept += v;                          // ties with the k-th are kept too
  } else {
    kept = mass[0];
  }
  if (!(top_p < 1.0f)) return;
  for (int64_t b = kCutBuckets - 1; b > lowest; b--) kept += mass[b];
  // top-p: skip whole buckets while the running sum stays below the target, then walk the bucket
  // it crosses in, largest first.
  const double target = static_cast<double>(top_p) * kept;
  double run = 0.0;
  for (int64_t b = kCutBuckets - 1; b >= lowest; b--) {
    if (count[b] == 0) continue;
    if (b > lowest && run + mass[b] < target) {
      run += mass[b];
      continue;
    }
    for (float v : sorted(b, b == lowest ? *t_k : 0.0f)) {
      run += v;
      *t_p = v;
      if (run >= target) return;
    }
  }
}

// probs float32 [R, V], top_k int32 [R] (<= 0: off), top_p float32 [R] (>= 1: off) -> cuts float32
// [R, 2]: each row's (t_k, t_p), as RowCuts. One task per row.
ffi::Error FilterCuts(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> probs, ffi::Buffer<ffi::S32> top_k,
                      ffi::Buffer<ffi::F32> top_p, ffi::ResultBuffer<ffi::F32> out) {
  const auto d = probs.dimensions();
  if (d.size() != 2 || d[1] < 1 || top_k.element_count() != d[0] || top_p.element_count() != d[0])
    return ffi::Error::InvalidArgument("filter_cuts: probs [R, V], top_k [R], top_p [R]");
  const int64_t V = d[1];
  const float* p = probs.typed_data();
  float* o = out->typed_data();
  Parallel(pool, d[0], [&](int64_t r) {
    RowCuts(p + r * V, V, top_k.typed_data()[r], top_p.typed_data()[r], &o[2 * r], &o[2 * r + 1]);
  });
  return ffi::Error::Success();
}

}  // namespace

// Whether the tiles' passes serve this process: 0 when Linux grants the tiles and a product on them
// equals the row passes' bit for bit (int8's TilePass; BlockTilePass at 32 and 16 inputs a step, as
// Q5_0 and Q6_K), 1 when Linux refuses them, 2 when the two differ, 3 when the build has no tiles.
// engine/native.py runs it in a process of its own before the kernel serves, so that no fault of the
// tiles can take a worker down.
extern "C" int mashbox_tiles_check() {
#if MASHBOX_TILES
  if (!TilesGranted()) return 1;
  uint32_t seed = 1;
  auto next = [&seed] { return (seed = seed * 1664525u + 1013904223u) >> 8; };
  auto bytes = [&next](int64_t n, int low, int span) {
    std::vector<uint8_t> v(n);
    for (uint8_t& b : v) b = static_cast<uint8_t>(low + next() % span);
    return v;
  };
  // Float16 scales between 2^-9 and 2^-8 (0x1800 .. 0x1BFF), some negative.
  auto halves = [&next](int64_t n) {
    std::vector<uint16_t> v(n);
    for (uint16_t& h : v) h = static_cast<uint16_t>(0x1800 + next() % 0x400 + (next() % 2) * 0x8000);
    return v;
  };
  constexpr int64_t R = kTileMinRows + 3, blocks = 3, N = blocks * kLanes;
  std::vector<float> x(R * 512), by_tiles(R * N), by_rows(R * N);
  for (float& v : x) v = static_cast<float>(next() % 20001) / 1000.0f - 10.0f;
  // The int8 product: whole tiles.
  {
    constexpr int64_t K = 3 * kTileInputs;
    const std::vector<uint8_t> w = bytes(N * K, 1, 255);
    std::vector<float> scale(N);
    for (float& v : scale) v = static_cast<float>(1 + next() % 1000) / 1000.0f;
    std::vector<int8_t> terms(PanelRows(2 * R) * K);
    std::vector<float> term_scales(2 * R);
    std::vector<int32_t> offsets(2 * R);
    MakeTerms(x.data(), R, K, terms.data(), term_scales.data(), offsets.data());
    TilePass(w.data(), terms.data(), term_scales.data(), offsets.data(), scale.data(), by_tiles.data(), K, N, R, 0,
             blocks);
    RowPasses(w.data(), terms.data(), term_scales.data(), offsets.data(), scale.data(), by_rows.data(), K, N, R, 0,
              blocks);
    if (by_tiles != by_rows) return 2;
  }
  // Q5_0: 32 inputs per tdpbsud.
  {
    constexpr int64_t K = 128;
    const std::vector<uint8_t> nib = bytes(blocks * K / kNibbleGroup * 64, 0, 256);
    std::vector<uint64_t> fifth(blocks * K / kNibbleGroup * 2);
    for (uint64_t& v : fifth) v = (uint64_t{next()} << 40) ^ (uint64_t{next()} << 16) ^ next();
    const std::vector<uint16_t> d = halves(blocks * K / kQ5Block * kLanes);
    std::vector<int8_t> terms(PanelRows(R) * K);
    std::vector<float> term_scales(R * K / kTermBlock);
    std::vector<int32_t> sums(R * K / kTermBlock);
    BlockTerms(x.data(), R, K, terms.data(), term_scales.data(), sums.data());
    Blocks32 form{nib.data(), fifth.data(), nullptr, d.data(), kQ5Offset, K, sums.data(), term_scales.data()};
    BlockTilePass(form, terms.data(), by_tiles.data(), K, N, R, 0, blocks);
    for (int64_t r0 = 0; r0 < R; r0 += kMaxTerms)
      for (int64_t b = 0; b < blocks; b++)
        kBlocks5[0][std::min<int64_t>(kMaxTerms, R - r0)](
            nib.data(), fifth.data(), nullptr, d.data(), terms.data() + r0 * K, sums.data() + r0 * K / kTermBlock,
            term_scales.data() + r0 * K / kTermBlock, by_rows.data() + r0 * N, K, N, b);
    if (by_tiles != by_rows) return 2;
  }
  // Q6_K: 16 inputs per tdpbsud, a super-block's integer sum across them.
  {
    constexpr int64_t K = 2 * kSuper;
    const std::vector<uint8_t> nib = bytes(blocks * K / kNibbleGroup * 64, 0, 256);
    const std::vector<uint8_t> hi = bytes(blocks * K / kNibbleGroup * 32, 0, 256);
    const std::vector<uint8_t> sc = bytes(blocks * K / 16 * kLanes, 0, 256);
    const std::vector<uint16_t> d = halves(blocks * K / kSuper * kLanes);
    const KBlocks w{nib.data(), hi.data(), nullptr, reinterpret_cast<const int8_t*>(sc.data()), nullptr, d.data(),
                    nullptr, blocks, K};
    std::vector<int8_t> terms(PanelRows(R) * K);
    std::vector<float> term_scales(R * K / kSuper), sub_sums(R * K / 16);
    KTerms<KForm::kQ6>(x.data(), R, K, terms.data(), term_scales.data(), sub_sums.data());
    BlockTilePass(TilesK<KForm::kQ6>{w, sub_sums.data(), term_scales.data()}, terms.data(), by_tiles.data(), K, N, R,
                  0, blocks);
    for (int64_t r0 = 0; r0 < R; r0 += kKRows)
      for (int64_t b = 0; b < blocks; b++)
        kBlocksK<KForm::kQ6>[0][std::min<int64_t>(kKRows, R - r0)](
            w, nullptr, terms.data() + r0 * K, sub_sums.data() + r0 * K / 16, term_scales.data() + r0 * K / kSuper,
            by_rows.data() + r0 * N, N, b);
    if (by_tiles != by_rows) return 2;
  }
  return 0;
#else
  return 3;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxInt8Matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxInt8Attend, Int8Attend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxInt8Widen, Int8Widen,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxInt5Matmul, Int5Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxInt5Widen, Int5Widen,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxQ8Matmul, Q8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxQ8Widen, Q8Widen,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxQ4KMatmul, Q4KMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxQ5KMatmul, Q5KMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxQ5KWiden, Q5KWiden,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxQ6KMatmul, Q6KMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxQ4KWiden, Q4KWiden,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxQ6KWiden, Q6KWiden,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxIq4NlMatmul, Iq4NlMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxIq4NlWiden, Iq4NlWiden,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxIq4XsMatmul, Iq4XsMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxIq4XsWiden, Iq4XsWiden,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxIq3SMatmul, Iq3SMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxIq3SWiden, Iq3SWiden,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxQ3KMatmul, Q3KMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxQ3KWiden, Q3KWiden,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxRowDot, RowDot,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxDeltaSteps, DeltaSteps,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxDeltaStepsInPlace, DeltaStepsInPlace,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxFirstMax, FirstMax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MashboxFilterCuts, FilterCuts,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
