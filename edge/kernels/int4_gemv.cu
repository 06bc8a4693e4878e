// W4A16 linear kernels (compiled at run time by NVRTC, see edge/kernels/nvrtc.py) for the
// packed layout of edge/int4.py:
//
//   y[t, o] = sum_k x[t, perm[k]] * (q[o, k] - zero[o, k / G]) * scale[o, k / G]  (+ bias[o])
//
// int4_gemv_*: decode (1..8 tokens). Memory-bound: each weight byte is read once with
// 16-byte streaming loads. The products run on tensor cores (mma.sync m16n8k16, float32
// accumulation): a lane's 16-byte load is exactly its A fragments of 4 k16 steps of a
// 16-row x 64-column tile, dequantized in registers with two logic ops per pair of
// codes: OR-ing a nibble pair into the mantissas of 1024.0 (float16) or 128.0
// (bfloat16) and subtracting 1024 + zero (128 + zero) gives q - zero exactly. The B
// operand is the tokens (lane 4n + t holds token n's 4 consecutive activations), so 8
// tokens cost what one does. A CTA first stages its tokens' activations in shared
// memory (gathered through perm; times the norm weight with kNorm), so no k16 step waits
// on a global load. The scale multiplies each group's float32 partial sums (a group is
// a run of 64-column tiles: G a multiple of 64).
//
// A unit is kTiles tiles of 16 rows (kSwiglu: the gate tile and its up tile). The CTA's
// kWarps warps form groups of `split` warps, a unit each; a group's warps share the
// unit's columns tile by tile (warp k of a group takes tiles k, k + split, ...), with two
// register stages of loads in flight a warp. The host picks the split per shape and SM
// count: long streams a warp where SMs are few, split columns where they are many.
// Partial sums meet in shared memory and the epilogue (bias, RMSNorm scale, residual
// add, SwiGLU, argmax) runs once per output.
//
//   kNorm       the input is the residual stream x and the linear reads rms_norm(x):
//               the mma runs on T(x * norm_w) and the sums are scaled by 1 / rms(x) at
//               the end (the sum of squares is taken while staging). float16 inputs whose x * norm_w exceeds 65504
//               would overflow here; the bf16 models this targets cannot.
//   kResidual   y[row] = T(y[row] + T(dot + bias)), in place (y must not alias x).
//   kSwiglu     the weight is [gate; up]; y[j] = T(silu(T(g)) * T(u)).
//   kArgmax     nothing stored: the largest T-rounded output of each token (lowest
//               row among equals, NaN largest) into best[token] by a 64-bit atomicMax;
//               int4_argmax_take turns it into the token id (edge/kernels/int8_gemv.cu
//               has the same scheme).
//
// No host-visible state, shapes-only grids: safe in CUDA graphs. sm_80+ (sm_87 Orin, sm_90).
#include "gemv_epilogue.cuh"

#ifndef CFG_INT4_SCALE
#define CFG_INT4_SCALE 1
#endif
#if CFG_INT4_SCALE == 1
typedef __half edge_scale_t;
#elif CFG_INT4_SCALE == 2
typedef __nv_bfloat16 edge_scale_t;
#elif CFG_INT4_SCALE == 3
typedef float edge_scale_t;
#else
#error "CFG_INT4_SCALE must be 1 (float16), 2 (bfloat16) or 3 (float32)"
#endif

namespace {

using edge::kArgmax;
using edge::kResidual;
using edge::kStore;
using edge::kSwiglu;

#ifndef CFG_INT4_WARPS
#define CFG_INT4_WARPS 8
#endif
#ifndef CFG_INT4_UNROLL
#define CFG_INT4_UNROLL 2
#endif
#ifndef CFG_INT4_DIRECT_UNROLL  // the direct kernels' (their B fragments ride in each batch's registers)
#define CFG_INT4_DIRECT_UNROLL CFG_INT4_UNROLL
#endif
#ifndef CFG_INT4_MIN_BLOCKS
#define CFG_INT4_MIN_BLOCKS 2
#endif
#ifndef CFG_INT4_PREFETCH  // tiles of a warp's stream ahead of its loads fetched into L2 (0: none)
#define CFG_INT4_PREFETCH 0
#endif
#ifndef CFG_INT4_SKIP_MATH  // benchmark only: stream the weights without the products
#define CFG_INT4_SKIP_MATH 0
#endif
constexpr int kWarps = CFG_INT4_WARPS;  // warps per CTA (int4_cuda.py reads the same knob)
constexpr int kThreads = 32 * kWarps;
// Column tiles a stage, per warp and row tile (kDirect: of the direct kernels).
template <bool kDirect>
constexpr int kUnroll = kDirect ? CFG_INT4_DIRECT_UNROLL : CFG_INT4_UNROLL;
constexpr int kMaxTokens = edge::kGemvMaxTokens;  // the mma's N
constexpr int kTileWords = 128;            // 16 x 64 codes

// (a & b) | c in one instruction.
__device__ __forceinline__ unsigned int and_or(unsigned int a, unsigned int b, unsigned int c) {
  return edge::lop3<0xEA>(a, b, c);
}

// kBase + z in both lanes: subtracting it leaves q - z, exact (z <= 16).
template <typename T>
__device__ __forceinline__ unsigned int zero_pair(unsigned int z) {
  return (edge::MagicBase<T>::kBase + z) * 0x10001u;
}

// One word of the layout -> the 4 A-fragment registers (q - z) of an m16n8k16 step:
// register p holds nibbles p and p + 4 (row g for even p with zero z0, row g + 8 for odd
// p with z1).
template <typename T>
__device__ __forceinline__ void dequant_word(unsigned int w, unsigned int z0, unsigned int z1, unsigned int (&a)[4]) {
  constexpr unsigned int bias = edge::MagicBase<T>::kBase * 0x10001u;
  a[0] = edge::sub_pairs<T>(and_or(w, 0x000F000Fu, bias), z0);
  a[1] = edge::sub_pairs<T>(and_or(w >> 4, 0x000F000Fu, bias), z1);
  a[2] = edge::sub_pairs<T>(and_or(w >> 8, 0x000F000Fu, bias), z0);
  a[3] = edge::sub_pairs<T>(and_or(w >> 12, 0x000F000Fu, bias), z1);
}

__device__ __forceinline__ float scale_at(const edge_scale_t* s) { return edge::to_float(s[0]); }

// One batch of a warp: kUnroll<kDirect> column tiles of each of its kTiles row tiles, with the
// group scales (rows g, g + 8) and zero points they need, kept as loaded: converting
// them here would make the warp wait for those loads before the batch is used. kDirect:
// the tokens' B fragments of those tiles too (read from global memory, nothing staged).
template <int kTiles, bool kDirect>
struct Batch {
  uint4 w[kUnroll<kDirect>][kTiles];
  edge_scale_t s0[kUnroll<kDirect>][kTiles], s1[kUnroll<kDirect>][kTiles];
  unsigned char z0[kUnroll<kDirect>][kTiles], z1[kUnroll<kDirect>][kTiles];
  uint2 xv[kDirect ? kUnroll<kDirect> : 1][4];
};

// Issue the loads of the batch starting at column tile kb0 (tiles kb0 + u * stride):
// branch-free, a tile past the row's end re-reads the last one (never multiplied).
// rowbase[i] indexes row g of tile i's first group in the scale / zero arrays; a tile's
// group is kb >> group_shift; zmask 0 reads zero[0] for every tile (symmetric weights).
template <int kTiles, bool kDirect>
__device__ __forceinline__ void load_batch(Batch<kTiles, kDirect>& b, const unsigned int* const (&base)[kTiles],
                                           const edge_scale_t* __restrict__ scale,
                                           const unsigned char* __restrict__ zero, const int (&rowbase)[kTiles],
                                           int kb0, int stride, int kb_count, int group_shift, int zmask) {
#pragma unroll
  for (int u = 0; u < kUnroll<kDirect>; ++u) {
    const int kb = min(kb0 + u * stride, kb_count - 1);
#pragma unroll
    for (int i = 0; i < kTiles; ++i) b.w[u][i] = edge::ld_weights(base[i] + kb * kTileWords);
  }
#if CFG_INT4_PREFETCH > 0
  // Bytes in flight without registers: a lane per 128-byte line of a later tile.
  if ((threadIdx.x & 7) == 0) {
#pragma unroll
    for (int u = 0; u < kUnroll<kDirect>; ++u) {
      const int kb = kb0 + (u + CFG_INT4_PREFETCH) * stride;
      if (kb < kb_count) {
#pragma unroll
        for (int i = 0; i < kTiles; ++i) edge::prefetch_l2(base[i] + kb * kTileWords);
      }
    }
  }
#endif
#pragma unroll
  for (int u = 0; u < kUnroll<kDirect>; ++u) {
    const int gi16 = (min(kb0 + u * stride, kb_count - 1) >> group_shift) * 16;
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      const int at = rowbase[i] + gi16;
      b.s0[u][i] = scale[at];
      b.s1[u][i] = scale[at + 8];
      b.z0[u][i] = __ldg(zero + (at & zmask));
      b.z1[u][i] = __ldg(zero + ((at + 8) & zmask));
    }
  }
}

// kDirect: the batch's B fragments from token g's row of x (zeros past the tokens).
template <int kTiles, bool kDirect, typename T>
__device__ __forceinline__ void load_x(Batch<kTiles, kDirect>& b, const T* __restrict__ xrow, bool has_tok, int kb0,
                                       int stride, int kb_count, int t) {
#pragma unroll
  for (int u = 0; u < kUnroll<kDirect>; ++u) {
    const int kb = min(kb0 + u * stride, kb_count - 1);
#pragma unroll
    for (int s = 0; s < 4; ++s)
      b.xv[u][s] = has_tok ? __ldg(reinterpret_cast<const uint2*>(xrow + kb * 64 + 16 * s + 4 * t)) : make_uint2(0u, 0u);
  }
}

// acc += the batch's products: per column tile 4 k16 steps of mma on the dequantized
// codes (B fragments from the staged activations: lane 4n + t holds token n's 4
// consecutive values, zeros past the CTA's tokens), the tile's group scale applied to
// the float32 partial sums. Branch-free (a tile past the row's end is scaled by 0), so
// the mma chains of the batch's tiles interleave.
template <typename T, int kTiles, bool kDirect>
__device__ __forceinline__ void mma_batch(const Batch<kTiles, kDirect>& b, float (&acc)[kTiles][4], const T* __restrict__ xrow,
                                          bool has_tok, int kb0, int stride, int kb_count, int t) {
#pragma unroll
  for (int u = 0; u < kUnroll<kDirect>; ++u) {
    const int kb = min(kb0 + u * stride, kb_count - 1);
    const float live = kb0 + u * stride < kb_count ? 1.f : 0.f;
    float part[kTiles][4];
#pragma unroll
    for (int i = 0; i < kTiles; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) part[i][c] = 0.f;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      uint2 xv;
      if constexpr (kDirect) xv = b.xv[u][s];
      else xv = edge::staged_pair(xrow + kb * 64 + 16 * s + 4 * t, has_tok);
      const unsigned int b0 = xv.x, b1 = xv.y;
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
        const unsigned int word = s == 0 ? b.w[u][i].x : s == 1 ? b.w[u][i].y : s == 2 ? b.w[u][i].z : b.w[u][i].w;
#if CFG_INT4_SKIP_MATH
        part[i][0] += __uint_as_float(and_or(word ^ b.z0[u][i], 0x3F800000u, (b0 ^ b1) & 1u));
#else
        unsigned int a[4];
        dequant_word<T>(word, zero_pair<T>(b.z0[u][i]), zero_pair<T>(b.z1[u][i]), a);
        edge::mma16816<T>(part[i], a, b0, b1);
#endif
      }
    }
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      const float s0 = live * edge::to_float(b.s0[u][i]), s1 = live * edge::to_float(b.s1[u][i]);
      acc[i][0] = fmaf(s0, part[i][0], acc[i][0]);
      acc[i][1] = fmaf(s0, part[i][1], acc[i][1]);
      acc[i][2] = fmaf(s1, part[i][2], acc[i][2]);
      acc[i][3] = fmaf(s1, part[i][3], acc[i][3]);
    }
  }
}

// Row tile i of a warp's unit (clamped: a unit past the last re-reads a valid block,
// which the epilogue does not store): base[i] its lane's first packed word, rowbase[i]
// row g of its first group in the scale and zero arrays.
template <int kTiles, int kEpi>
__device__ __forceinline__ void unit_rows(const unsigned int* (&base)[kTiles], int (&rowbase)[kTiles],
                                          const unsigned int* __restrict__ packed, int unit, int out, int row_blocks,
                                          int kb_count, int groups, int lane) {
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
    const int b = min(kEpi == kSwiglu ? unit + i * (out >> 4) : unit * kTiles + i, row_blocks - 1);
    base[i] = packed + (long long)b * kb_count * kTileWords + 4 * lane;
    rowbase[i] = b * groups * 16 + (lane >> 2);
  }
}

// A CTA takes units [blockIdx.x * U, + U) (U = kWarps / split), then the same again
// gridDim.x * U further on while units remain (a launch of at most the resident CTAs
// stages its tokens once per CTA, not once per U units), and tokens
// [blockIdx.y * tok_chunk, + tok_chunk) (at most kMaxTokens; the host sizes tok_chunk so
// their staged rows fit its dynamic shared memory). kDirect stages nothing: each batch
// loads its B fragments with its weights (for tokens whose rows do not fit the staging;
// no norm, no act-order permutation).
template <typename T, int kTiles, bool kNorm, int kEpi, bool kDirect>
__device__ __forceinline__ void int4_gemv(T* __restrict__ y, const T* __restrict__ x,
                                          const unsigned int* __restrict__ packed,
                                          const edge_scale_t* __restrict__ scale,
                                          const unsigned char* __restrict__ zero, const int* __restrict__ perm,
                                          const T* __restrict__ bias, const T* __restrict__ norm_w, float eps,
                                          int out, int in, int group_shift, int zmask, int num_tokens, int split,
                                          int tok_chunk, unsigned long long* __restrict__ best) {
  static_assert(kEpi != kSwiglu || kTiles == 2, "SwiGLU pairs a gate tile with its up tile");
  static_assert(kEpi != kArgmax || kTiles == 2, "argmax reduces 32 outputs a warp");
  static_assert(!(kDirect && kNorm), "the norm is applied while staging");
  __shared__ float red[kWarps][kTiles][16][kMaxTokens];
  __shared__ float red_ss[kWarps][kMaxTokens];
  extern __shared__ __align__(16) unsigned char smem_x[];
  T* xs = reinterpret_cast<T*>(smem_x);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.y * tok_chunk;
  const int ntok = min(tok_chunk, num_tokens - n0);
  // The CTA's warps form kWarps / split groups; each group owns one unit (kTiles row
  // tiles, or a gate tile and its up tile) and its split warps share the unit's columns.
  const int units = kWarps / split;
  const int kw = warp % split;
  const int kb_count = in >> 6;
  const int groups = ((kb_count - 1) >> group_shift) + 1;
  // Rows of the weight: kSwiglu's [gate; up] has 2 * out.
  const int rows = kEpi == kSwiglu ? 2 * out : out;
  const int row_blocks = (rows + 15) >> 4;
  const int total_units = kEpi == kSwiglu ? out >> 4 : (row_blocks + kTiles - 1) / kTiles;
  int unit0 = blockIdx.x * units;
  const unsigned int* base[kTiles];
  int rowbase[kTiles];
  unit_rows<kTiles, kEpi>(base, rowbase, packed, unit0 + warp / split, out, row_blocks, kb_count, groups, lane);
  // Two register stages: the next batch's weights, scales and zero points are in flight
  // while the current batch is multiplied, so each warp keeps loads outstanding. The
  // first batch is a constant of the step: loaded before the wait, under the previous
  // kernel's tail.
  const int step = split * kUnroll<kDirect>;
  Batch<kTiles, kDirect> st0, st1;
  load_batch<kTiles, kDirect>(st0, base, scale, zero, rowbase, kw, split, kb_count, group_shift, zmask);
  edge::await_inputs();
  if constexpr (!kDirect) {
    edge::gemv_stage_x<T, kNorm, kThreads>(xs, red_ss, x + (long long)n0 * in, perm, norm_w, in, ntok);
    __syncthreads();
  }
  const bool has_tok = g < ntok;
  const T* xrow = kDirect ? x + (long long)(n0 + (has_tok ? g : 0)) * in : xs + (has_tok ? g : 0) * (in + edge::kGemvPad);
  if constexpr (kDirect) load_x<kTiles, kDirect, T>(st0, xrow, has_tok, kw, split, kb_count, t);

  for (;;) {
    float acc[kTiles][4];
#pragma unroll
    for (int i = 0; i < kTiles; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][c] = 0.f;

    for (int kb0 = kw; kb0 < kb_count; kb0 += 2 * step) {
      load_batch<kTiles, kDirect>(st1, base, scale, zero, rowbase, kb0 + step, split, kb_count, group_shift, zmask);
      if constexpr (kDirect) load_x<kTiles, kDirect, T>(st1, xrow, has_tok, kb0 + step, split, kb_count, t);
      mma_batch<T, kTiles, kDirect>(st0, acc, xrow, has_tok, kb0, split, kb_count, t);
      if (kb0 + step >= kb_count) break;
      load_batch<kTiles, kDirect>(st0, base, scale, zero, rowbase, kb0 + 2 * step, split, kb_count, group_shift, zmask);
      if constexpr (kDirect) load_x<kTiles, kDirect, T>(st0, xrow, has_tok, kb0 + 2 * step, split, kb_count, t);
      mma_batch<T, kTiles, kDirect>(st1, acc, xrow, has_tok, kb0 + step, split, kb_count, t);
    }
    edge::gemv_store_partials<kTiles>(red[warp], acc, g, t);
    __syncthreads();
    const int next = unit0 + gridDim.x * units;
    if (next < total_units) {  // the next units' first weights in flight under this epilogue
      unit_rows<kTiles, kEpi>(base, rowbase, packed, next + warp / split, out, row_blocks, kb_count, groups, lane);
      load_batch<kTiles, kDirect>(st0, base, scale, zero, rowbase, kw, split, kb_count, group_shift, zmask);
      if constexpr (kDirect) load_x<kTiles, kDirect, T>(st0, xrow, has_tok, kw, split, kb_count, t);
    }
    edge::gemv_epilogue<T, kWarps, kTiles, kNorm, kEpi>(red, red_ss, y, bias, eps, out, in, unit0, units, split,
                                                      ntok, n0, best);
    if (next >= total_units) break;
    unit0 = next;
    __syncthreads();  // red is rewritten by the next units
  }
}

// ---- prefill GEMM: the packed codes straight into the tile loop ------------------------
//
// y[T, out] = x[T, in] @ dequant(w)^T (+ bias). A CTA computes 64 rows (4 row tiles, one
// per warp) x 64 tokens (8 mma n-tiles); per 64-column tile each warp loads its 16-byte A
// fragments from global memory (one tile ahead in registers) and the CTA copies the
// x tile [64 tokens][64 columns] into shared memory with cp.async (two stages; rows padded
// to 160 bytes so a half-warp's 8-byte B loads hit distinct banks). x must already be in
// the layout's column order (act order: the caller gathers x[:, perm] once).
constexpr int kGemmTokens = 64, kGemmLd = 80;  // tokens a CTA; x tile row: 64 + 16 pad elements

template <typename T>
__device__ __forceinline__ void gemm_load_x(T* __restrict__ dst, const T* __restrict__ x, int tok0, int tokens,
                                            int in, int kb) {
  // 64 rows x 128 bytes = 512 chunks of 16 bytes, 4 a thread.
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int chunk = threadIdx.x + 128 * c;
    const int r = chunk >> 3, q = chunk & 7;
    const int tok = tok0 + r;
    const T* src = x + (long long)min(tok, tokens - 1) * in + kb * 64 + q * 8;
    edge::cp_async16(edge::smem_u32(dst + r * kGemmLd + q * 8), src, tok < tokens ? 16 : 0);
  }
}

template <typename T>
__device__ __forceinline__ void int4_gemm(T* __restrict__ y, const T* __restrict__ x,
                                          const unsigned int* __restrict__ packed,
                                          const edge_scale_t* __restrict__ scale,
                                          const unsigned char* __restrict__ zero, const T* __restrict__ bias,
                                          int out, int in, int group, int tokens) {
  __shared__ __align__(16) T xs[2][kGemmTokens * kGemmLd];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int kb_count = in >> 6, groups = in / group, tiles_per_group = group >> 6;
  const int row_blocks = (out + 15) >> 4;
  const int blk = blockIdx.x * 4 + warp;
  const int rb = min(blk, row_blocks - 1);
  const int tok0 = blockIdx.y * kGemmTokens;
  const unsigned int* a_ptr = packed + (long long)rb * kb_count * kTileWords + 4 * lane;
  edge::await_inputs();

  float acc[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[j][c] = 0.f;
  gemm_load_x<T>(xs[0], x, tok0, tokens, in, 0);
  edge::cp_async_commit();
  uint4 wa = edge::ld_weights(a_ptr);
  for (int kb = 0; kb < kb_count; ++kb) {
    uint4 wn = wa;
    if (kb + 1 < kb_count) {
      gemm_load_x<T>(xs[(kb + 1) & 1], x, tok0, tokens, in, kb + 1);
      edge::cp_async_commit();
      wn = edge::ld_weights(a_ptr + (long long)(kb + 1) * kTileWords);
      edge::cp_async_wait<1>();
    } else {
      edge::cp_async_wait<0>();
    }
    __syncthreads();
    const int gi = kb / tiles_per_group;
    const int at = (rb * groups + gi) * 16 + g;
    const float s0 = scale_at(scale + at), s1 = scale_at(scale + at + 8);
    const unsigned int z0 = zero_pair<T>(zero == nullptr ? 8u : __ldg(zero + at));
    const unsigned int z1 = zero_pair<T>(zero == nullptr ? 8u : __ldg(zero + at + 8));
    const T* xt = xs[kb & 1];
    float part[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) part[j][c] = 0.f;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const unsigned int word = s == 0 ? wa.x : s == 1 ? wa.y : s == 2 ? wa.z : wa.w;
      unsigned int a[4];
      dequant_word<T>(word, z0, z1, a);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint2 b = *reinterpret_cast<const uint2*>(xt + (8 * j + g) * kGemmLd + 16 * s + 4 * t);
        edge::mma16816<T>(part[j], a, b.x, b.y);
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      acc[j][0] = fmaf(s0, part[j][0], acc[j][0]);
      acc[j][1] = fmaf(s0, part[j][1], acc[j][1]);
      acc[j][2] = fmaf(s1, part[j][2], acc[j][2]);
      acc[j][3] = fmaf(s1, part[j][3], acc[j][3]);
    }
    __syncthreads();  // the stage is overwritten by the copy issued next iteration
    wa = wn;
  }
  // C fragment of n-tile j: c0, c1 row g, tokens 8j + 2t, + 1; c2, c3 row g + 8.
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int row = blk * 16 + g + 8 * rh;
    if (blk >= row_blocks || row >= out) continue;
    const float bv = bias == nullptr ? 0.f : edge::to_float(bias[row]);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int tok = tok0 + 8 * j + 2 * t + e;
        if (tok < tokens) y[(long long)tok * out + row] = edge::from_float<T>(acc[j][2 * rh + e] + bv);
      }
    }
  }
}

}  // namespace

#if CFG_INT4_MIN_BLOCKS > 0
#define CFG_INT4_BOUNDS __launch_bounds__(kThreads, CFG_INT4_MIN_BLOCKS)
#else
#define CFG_INT4_BOUNDS __launch_bounds__(kThreads)
#endif

// One signature for every mode (norm_w / eps unused without the norm, best without argmax).
#define CFG_INT4_GEMV(NAME, T, TILES, NORM, EPI, DIRECT)                                                    \
  extern "C" __global__ void CFG_INT4_BOUNDS NAME(                                                    \
      T* __restrict__ y, const T* __restrict__ x, const unsigned int* __restrict__ packed,             \
      const edge_scale_t* __restrict__ scale, const unsigned char* __restrict__ zero,                  \
      const int* __restrict__ perm, const T* __restrict__ bias, const T* __restrict__ norm_w, float eps, \
      int out, int in, int group_shift, int zmask, int num_tokens, int split, int tok_chunk,         \
      unsigned long long* __restrict__ best) {                                                         \
    int4_gemv<T, TILES, NORM, EPI, DIRECT>(y, x, packed, scale, zero, perm, bias, norm_w, eps, out, in,  \
                                           group_shift, zmask, num_tokens, split, tok_chunk, best);     \
  }

// The modes the decoder layer uses (int4_cuda.py: MODES), with 1 or 2 row tiles a CTA; the
// plain and residual modes also direct (tokens whose rows do not fit the staging).
#define CFG_INT4_MODES(DT, T)                                                              \
  CFG_INT4_GEMV(int4_gemv_##DT##_t1, T, 1, false, kStore, false) \
  CFG_INT4_GEMV(int4_gemv_##DT##_t2, T, 2, false, kStore, false) \
  CFG_INT4_GEMV(int4_gemv_norm_##DT##_t1, T, 1, true, kStore, false) \
  CFG_INT4_GEMV(int4_gemv_norm_##DT##_t2, T, 2, true, kStore, false) \
  CFG_INT4_GEMV(int4_gemv_residual_##DT##_t1, T, 1, false, kResidual, false) \
  CFG_INT4_GEMV(int4_gemv_residual_##DT##_t2, T, 2, false, kResidual, false) \
  CFG_INT4_GEMV(int4_gemv_norm_swiglu_##DT##_t2, T, 2, true, kSwiglu, false) \
  CFG_INT4_GEMV(int4_gemv_swiglu_##DT##_t2, T, 2, false, kSwiglu, false) \
  CFG_INT4_GEMV(int4_gemv_direct_##DT##_t1, T, 1, false, kStore, true) \
  CFG_INT4_GEMV(int4_gemv_direct_##DT##_t2, T, 2, false, kStore, true) \
  CFG_INT4_GEMV(int4_gemv_direct_residual_##DT##_t1, T, 1, false, kResidual, true) \
  CFG_INT4_GEMV(int4_gemv_direct_residual_##DT##_t2, T, 2, false, kResidual, true) \
  CFG_INT4_GEMV(int4_gemv_argmax_##DT##_t2, T, 2, false, kArgmax, false) \
  CFG_INT4_GEMV(int4_gemv_norm_argmax_##DT##_t2, T, 2, true, kArgmax, false) \
  extern "C" __global__ void __launch_bounds__(128) int4_gemm_##DT(                                 \
      T* __restrict__ y, const T* __restrict__ x, const unsigned int* __restrict__ packed,           \
      const edge_scale_t* __restrict__ scale, const unsigned char* __restrict__ zero,                \
      const T* __restrict__ bias, int out, int in, int group, int tokens) {                          \
    int4_gemm<T>(y, x, packed, scale, zero, bias, out, in, group, tokens);                           \
  }

CFG_INT4_MODES(bf16, __nv_bfloat16)
CFG_INT4_MODES(f16, __half)

// After an argmax launch: the token ids, and the slots emptied (common.cuh).
extern "C" __global__ void int4_argmax_take(unsigned long long* __restrict__ best, long long* __restrict__ token,
                                            int n) {
  edge::argmax_take(best, token, n);
}
