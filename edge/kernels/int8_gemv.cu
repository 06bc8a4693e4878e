// W8A16 GEMV for decode (compiled at run time by NVRTC, see edge/kernels/nvrtc.py):
//
//   y[t, o] = sum_k x[t, k] * (q[o, k] * scale[o, k >> log2_group])  (+ bias[o])
//
// q int8 [out, in] (row-major, 16-byte aligned rows), scale float32 [out, in / group],
// x / y / bias float16 or bfloat16, float32 accumulation, y in x's dtype. A handful of
// tokens (t < num_tokens, the wrapper allows up to 4) run in one launch; one is decode.
//
// Memory-bound: every weight byte is read exactly once (per token; the CTAs of the
// tokens of one row block are adjacent, so extra tokens mostly hit L2), with 16-byte
// streaming loads (ld.global.nc.L1::no_allocate: weights do not evict x from L1).
// Layout: a warp owns R consecutive rows; lane l reads the 16-byte chunks l, l + 32,
// l + 64, ... of each of them, so one warp-wide load covers 512 contiguous bytes of a
// row. Every chunk lies in one group (group a power of two >= 16), so the chunk's
// 16 products are summed first and multiplied by the group scale once (the lanes of a
// group read the same scale word: one transaction per group and row). x is read with
// __ldg (16 bytes at a time, L1-resident: at most 2 * in bytes, shared by the R rows of
// the warp and every warp of the SM). Each iteration issues R * U weight loads before
// using any of them (U: the CFG_INT8_UNROLL_R<R> knobs below; 4-8 loads, 64-128 bytes
// in flight per lane). The warp's R sums are reduced with shuffles; lane r writes row
// r. The wrapper picks R per matrix: the most rows per warp that still give every SM
// two CTAs, so small matrices get more, shorter warps.
//
// int8 -> float32 without the low-throughput I2F conversion: with u = b ^ 0x80 (the
// byte biased to 0..255), the float whose bits are 0x4B0000uu is 2^23 + u, so
// (2^23 + u) - (2^23 + 128) = b exactly: one PRMT and one FADD per element.
//
// Shared memory and __syncthreads only in the norm modes; no host-visible state: safe in
// CUDA graphs.
// sm_80+ PTX only (sm_87 Orin; sm_90 too).
#include "common.cuh"

namespace {

#ifndef CFG_INT8_WARPS
#define CFG_INT8_WARPS 4
#endif
constexpr int kWarps = CFG_INT8_WARPS;  // warps per CTA (int8_cuda.py reads the same knob)
constexpr int kThreads = 32 * kWarps;

__device__ __forceinline__ uint4 ld_x(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// Element i (0..3) of a word of 4 biased bytes (b ^ 0x80) as float: exactly b.
__device__ __forceinline__ float biased_byte(unsigned int u, unsigned int i) {
  return __int_as_float(__byte_perm(u, 0x4B000000u, 0x7540u | i)) - 8388736.0f;
}

// sum_{j<16} q_j * xf[j] for one 16-byte chunk of int8 weights (two partial chains).
__device__ __forceinline__ float dot16(const uint4& w, const float* xf) {
  const unsigned int b[4] = {w.x ^ 0x80808080u, w.y ^ 0x80808080u, w.z ^ 0x80808080u,
                             w.w ^ 0x80808080u};
  float s0 = 0.f, s1 = 0.f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    s0 = fmaf(biased_byte(b[k], 0), xf[4 * k], s0);
    s1 = fmaf(biased_byte(b[k], 1), xf[4 * k + 1], s1);
    s0 = fmaf(biased_byte(b[k], 2), xf[4 * k + 2], s0);
    s1 = fmaf(biased_byte(b[k], 3), xf[4 * k + 3], s1);
  }
  return s0 + s1;
}

// What a launch does around the dot products (the fused decoder-layer modes; the
// wrapper's supports() says which arguments each mode takes).
//
//   kNorm       RMSNorm of the input folded in: the input is the residual stream x and
//               the linear reads rms_norm(x) = x * inv_rms * norm_w. Since inv_rms is
//               one number per token, the dot product runs on x * norm_w (float32)
//               and is scaled by inv_rms at the end; every warp reads the whole row in
//               its loop anyway, so it sums the squares there too, and nothing waits
//               for the statistic: after the grid-dependency wait the weights stream
//               at once, as in the plain mode. (The first version normalised the row
//               into shared memory after the wait, a CTA-wide reduction on every norm
//               GEMV's critical path.) The norm weight, a constant of the step, is
//               staged in shared memory before the wait. One rounding fewer than the
//               composition rms_norm -> linear, whose normalised row is rounded to T.
//   kResidual   residual-add epilogue, in place: y[row] = T(y[row] + T(dot + bias)),
//               what `y += linear(...)` gives. One lane reads and writes each output,
//               so in place is race-free (y must not alias x).
//   kSwiglu     SwiGLU epilogue: the weight is [gate; up] ([2 * out, in]); a warp owns
//               R / 2 row pairs {j, out + j} and writes y[j] = T(silu(g) * u) with g, u
//               the linear outputs rounded to T (reference.silu_mul after the linear).
//   kArgmax     greedy decoding's lm_head: nothing is stored; each warp folds its
//               outputs (rounded to T, as the logits would be) into best[token] with
//               one 64-bit atomicMax of (order-preserving bits of the value, ~row), so
//               the largest value wins and, among equal values, the lowest row: what
//               torch.argmax gives on the stored logits (NaN counts as the largest).
//               int8_argmax_take turns best into the token id and resets it. This
//               takes the float cast and torch's two-pass argmax off the end of every
//               graph step.
enum Epilogue { kStore = 0, kResidual = 1, kSwiglu = 2, kArgmax = 3 };

// The norm weight [in] into sw, by the whole CTA (it synchronises): read before the
// grid-dependency wait (no kernel of the step writes it).
template <typename T>
__device__ __forceinline__ void stage_norm_weight(T* __restrict__ sw, const T* __restrict__ norm_w, int in) {
  const int nvec = in >> 3;
  for (int v = threadIdx.x; v < nvec; v += kThreads)
    reinterpret_cast<uint4*>(sw)[v] = ld_x(norm_w + 8 * v);
  __syncthreads();
}

// Weight rows and scale rows of the warp's R rows starting at output row0. A short last
// warp re-reads a valid row. kSwiglu: rows r < R/2 are gate rows, the others the
// matching up rows `out` further down.
template <int R, int kOuts>
__device__ __forceinline__ void warp_rows(const signed char* q, const float* scale, int row0,
                                          int out, int in, int groups,
                                          const signed char* (&qrow)[R], const float* (&srow)[R]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int o = r < kOuts ? r : r - kOuts;
    const int row = min(row0 + o, out - 1) + (r < kOuts ? 0 : out);
    qrow[r] = q + (long long)row * in;
    srow[r] = scale + (long long)row * groups;
  }
}

// The first iteration's weight lines of the warp's rows into L2, a lane per 128-byte line.
template <int R, int U>
__device__ __forceinline__ void prefetch_rows(const signed char* const (&qrow)[R], int lane, int in) {
  if (lane < min(4 * U, in >> 7)) {
#pragma unroll
    for (int r = 0; r < R; ++r) edge::prefetch_l2(qrow[r] + 128 * lane);
  }
}

// R weight rows per warp, U chunks per lane and row in flight per iteration. `out` is
// the number of outputs per token (kSwiglu: half the weight's rows). A CTA takes row
// block (kWarps * outputs per warp) blockIdx.x / num_tokens of token
// blockIdx.x % num_tokens (int8_cuda.plan).
template <typename T, int R, int U, bool kNorm, int kEpi>
__device__ __forceinline__ void int8_gemv(T* __restrict__ y, const T* __restrict__ x,
                                          const signed char* __restrict__ q,
                                          const float* __restrict__ scale,
                                          const T* __restrict__ bias,
                                          const T* __restrict__ norm_w, float eps, int out,
                                          int in, int log2_group, int num_tokens,
                                          unsigned long long* __restrict__ best) {
  static_assert(kEpi != kSwiglu || R % 2 == 0, "SwiGLU needs row pairs");
  constexpr int kOuts = kEpi == kSwiglu ? R / 2 : R;  // outputs per warp
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int tok = blockIdx.x % num_tokens;
  x += (long long)tok * in;
  y += (long long)tok * out;
  const int nchunks = in >> 4;
  const int groups = in >> log2_group;
  const int chunk_shift = log2_group - 4;  // chunks per group = 1 << chunk_shift

  const int row0 = (blockIdx.x / num_tokens * kWarps + warp) * kOuts;
  const signed char* qrow[R];
  const float* srow[R];
  warp_rows<R, kOuts>(q, scale, row0, out, in, groups, qrow, srow);
  // Weights are constants of the step: the lines of the first iteration are prefetched
  // into L2 before the grid-dependency wait, so with overlapped launches (common.cuh)
  // they stream in under the previous kernel's tail (register holding or deeper
  // prefetch measured slower: docs/kernels.md).
  if (row0 < out) prefetch_rows<R, U>(qrow, lane, in);
  // The epilogue's other inputs are loaded now, not after the loop, so that no round
  // trip follows the warp's last weights: lane o < kOuts ends with output row0 + o.
  const int row = row0 + lane;
  const bool writes = lane < kOuts && row < out;
  float bias_v = 0.f, bias_up = 0.f;  // constants: read before the wait
  if (bias != nullptr && writes) {
    bias_v = edge::to_float(bias[row]);
    if (kEpi == kSwiglu) bias_up = edge::to_float(bias[out + row]);
  }
  extern __shared__ __align__(16) unsigned char smem_w[];
  const uint4* sw = reinterpret_cast<const uint4*>(smem_w);
  // The argmax lm_head (thousands of CTAs) reads the norm weight beside x through L1
  // rather than staging it in every CTA.
  constexpr bool kStaged = kNorm && kEpi != kArgmax;
  if (kStaged) stage_norm_weight<T>(reinterpret_cast<T*>(smem_w), norm_w, in);
  edge::await_inputs();

  if (row0 >= out) return;  // a short last CTA's idle warps (nothing synchronises below)
  // The residual stream, written by an earlier kernel of the step: after the wait.
  const float residual = kEpi == kResidual && writes ? edge::to_float(y[row]) : 0.f;
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  float ss = 0.f;  // kNorm: this lane's share of sum(x^2)

  for (int base = lane; base < nchunks; base += 32 * U) {
    uint4 w[U][R];
    uint4 xa[U], xb[U], wa[U], wb[U];
    float s[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = base + 32 * u;
      if (c < nchunks) {
#pragma unroll
        for (int r = 0; r < R; ++r) w[u][r] = edge::ld_weights(qrow[r] + 16 * c);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = base + 32 * u;
      if (c < nchunks) {
        xa[u] = ld_x(x + 16 * c);
        xb[u] = ld_x(x + 16 * c + 8);
        if (kStaged) {
          wa[u] = sw[2 * c];
          wb[u] = sw[2 * c + 1];
        } else if (kNorm) {
          wa[u] = ld_x(norm_w + 16 * c);
          wb[u] = ld_x(norm_w + 16 * c + 8);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) s[u][r] = __ldg(srow[r] + (c >> chunk_shift));
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = base + 32 * u;
      if (c < nchunks) {
        float xf[16];
        edge::Vec<T>::to_float(xa[u], xf);
        edge::Vec<T>::to_float(xb[u], xf + 8);
        if (kNorm) {
          float wf[16];
          edge::Vec<T>::to_float(wa[u], wf);
          edge::Vec<T>::to_float(wb[u], wf + 8);
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            ss = fmaf(xf[j], xf[j], ss);
            xf[j] *= wf[j];
          }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = fmaf(s[u][r], dot16(w[u][r], xf), acc[r]);
      }
    }
  }
  // Butterfly reduction: every lane ends with all R sums; lane o writes output o.
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
    if (kNorm) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  }
  if (kNorm) {  // the row's 1/rms, as fused.cu's rms_norm computes it
    const float inv_rms = rsqrtf(ss / static_cast<float>(in) + eps);
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] *= inv_rms;
  }
  float v = acc[0];
  float up = acc[kOuts % R];  // kSwiglu: the up row of the lane's pair
#pragma unroll
  for (int o = 1; o < kOuts; ++o) {
    if (lane == o) {
      v = acc[o];
      up = acc[(o + kOuts) % R];
    }
  }
  if (bias != nullptr) v += bias_v;
  if (kEpi == kArgmax) {  // lanes [0, kOuts) hold the warp's outputs
    unsigned long long key = writes ? edge::argmax_key(edge::round_to<T>(v), row) : 0ull;
#pragma unroll
    for (int off = 1; off < kOuts; off <<= 1) {
      const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, off);
      key = other > key ? other : key;
    }
    if (lane == 0) atomicMax(best + tok, key);
    return;
  }
  if (writes) {
    if (kEpi == kSwiglu) {
      const float g = edge::round_to<T>(v);
      if (bias != nullptr) up += bias_up;
      v = g / (1.f + __expf(-g)) * edge::round_to<T>(up);  // fused.cu's silu_mul
    } else if (kEpi == kResidual) {
      v = residual + edge::round_to<T>(v);
    }
    y[row] = edge::from_float<T>(v);
  }
}

}  // namespace

// Compile-time knobs (int8_cuda.py: Int8Tuning): CFG_INT8_WARPS (warps per CTA, above),
// chunks in flight per lane and row for the 1-, 2- and 4-row variants, and the minimum
// resident CTAs per SM asked of the register allocator (0: no constraint). 4 (at most 128
// registers a thread) leaves room for the next kernel's CTAs to start beside a GEMV's
// when launches overlap.
#ifndef CFG_INT8_UNROLL_R1
#define CFG_INT8_UNROLL_R1 4
#endif
#ifndef CFG_INT8_UNROLL_R2
#define CFG_INT8_UNROLL_R2 4
#endif
#ifndef CFG_INT8_UNROLL_R4
#define CFG_INT8_UNROLL_R4 2
#endif
#ifndef CFG_INT8_MIN_BLOCKS
#define CFG_INT8_MIN_BLOCKS 4
#endif
#if CFG_INT8_MIN_BLOCKS > 0
#define CFG_INT8_BOUNDS __launch_bounds__(kThreads, CFG_INT8_MIN_BLOCKS)
#else
#define CFG_INT8_BOUNDS __launch_bounds__(kThreads)
#endif

// One signature for every mode (norm_w / eps unused without the norm, best without
// argmax, y with it).
#define CFG_INT8_GEMV(NAME, T, R, U, NORM, EPI)                                            \
  extern "C" __global__ void CFG_INT8_BOUNDS                                              \
      NAME(T* __restrict__ y, const T* __restrict__ x, const signed char* __restrict__ q,  \
           const float* __restrict__ scale, const T* __restrict__ bias,                     \
           const T* __restrict__ norm_w, float eps, int out, int in, int log2_group,        \
           int num_tokens, unsigned long long* __restrict__ best) {                         \
    int8_gemv<T, R, U, NORM, EPI>(y, x, q, scale, bias, norm_w, eps, out, in, log2_group,   \
                                  num_tokens, best);                                        \
  }

// The modes the decoder layer uses (int8_cuda.py: MODES): plain, norm (qkv),
// residual epilogue (o, down), norm + SwiGLU epilogue (gate_up; even R only), and the
// greedy lm_head (argmax; with the final norm folded in, norm + argmax).
#define CFG_INT8_MODES(DT, T)                                                                \
  CFG_INT8_GEMV(int8_gemv_##DT##_r1, T, 1, CFG_INT8_UNROLL_R1, false, kStore)                \
  CFG_INT8_GEMV(int8_gemv_##DT##_r2, T, 2, CFG_INT8_UNROLL_R2, false, kStore)                \
  CFG_INT8_GEMV(int8_gemv_##DT##_r4, T, 4, CFG_INT8_UNROLL_R4, false, kStore)                \
  CFG_INT8_GEMV(int8_gemv_norm_##DT##_r1, T, 1, CFG_INT8_UNROLL_R1, true, kStore)            \
  CFG_INT8_GEMV(int8_gemv_norm_##DT##_r2, T, 2, CFG_INT8_UNROLL_R2, true, kStore)            \
  CFG_INT8_GEMV(int8_gemv_norm_##DT##_r4, T, 4, CFG_INT8_UNROLL_R4, true, kStore)            \
  CFG_INT8_GEMV(int8_gemv_residual_##DT##_r1, T, 1, CFG_INT8_UNROLL_R1, false, kResidual)    \
  CFG_INT8_GEMV(int8_gemv_residual_##DT##_r2, T, 2, CFG_INT8_UNROLL_R2, false, kResidual)    \
  CFG_INT8_GEMV(int8_gemv_residual_##DT##_r4, T, 4, CFG_INT8_UNROLL_R4, false, kResidual)    \
  CFG_INT8_GEMV(int8_gemv_norm_swiglu_##DT##_r2, T, 2, CFG_INT8_UNROLL_R2, true, kSwiglu)    \
  CFG_INT8_GEMV(int8_gemv_norm_swiglu_##DT##_r4, T, 4, CFG_INT8_UNROLL_R4, true, kSwiglu)    \
  CFG_INT8_GEMV(int8_gemv_argmax_##DT##_r1, T, 1, CFG_INT8_UNROLL_R1, false, kArgmax)        \
  CFG_INT8_GEMV(int8_gemv_argmax_##DT##_r2, T, 2, CFG_INT8_UNROLL_R2, false, kArgmax)        \
  CFG_INT8_GEMV(int8_gemv_argmax_##DT##_r4, T, 4, CFG_INT8_UNROLL_R4, false, kArgmax)        \
  CFG_INT8_GEMV(int8_gemv_norm_argmax_##DT##_r1, T, 1, CFG_INT8_UNROLL_R1, true, kArgmax)    \
  CFG_INT8_GEMV(int8_gemv_norm_argmax_##DT##_r2, T, 2, CFG_INT8_UNROLL_R2, true, kArgmax)    \
  CFG_INT8_GEMV(int8_gemv_norm_argmax_##DT##_r4, T, 4, CFG_INT8_UNROLL_R4, true, kArgmax)

CFG_INT8_MODES(bf16, __nv_bfloat16)
CFG_INT8_MODES(f16, __half)

// After an argmax launch: the token ids, and the slots emptied (common.cuh).
extern "C" __global__ void int8_argmax_take(unsigned long long* __restrict__ best, long long* __restrict__ token,
                                            int n) {
  edge::argmax_take(best, token, n);
}
