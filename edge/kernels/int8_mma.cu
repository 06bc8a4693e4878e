// W8A16 linear for 2..8 tokens on tensor cores (compiled at run time by NVRTC, see
// edge/kernels/nvrtc.py): the speculative verify step's linears. Same semantics and
// layout as int8_gemv.cu (q int8 [out, in] row-major, scale float32 [out, in / group]):
//
//   y[t, o] = sum_k x[t, k] * q[o, k] * scale[o, k / group]  (+ bias[o])
//
// int8_gemv.cu gives each token its own CTAs, so k tokens read the weights k times;
// here every weight byte is read once for all the CTA's tokens (mma.sync m16n8k16,
// float32 accumulation, the tokens are the B operand's 8 columns: 8 cost what 2 do).
//
// A warp's unit of work is a tile of 16 rows x 64 columns. Lane (g, t) (g = lane / 4,
// t = lane % 4) loads 16 bytes of row g and 16 of row g + 8 at columns 16t..16t+15 of
// the tile: 4 lanes read a row's 64 bytes, coalesced. Byte j of word s of a lane's load
// is column 16t + 4s + j, and k16 step s takes word s of both rows: the step runs over
// columns {16t + 4s + j}, a permutation of the tile that the B operand follows (lane
// 4n + t reads token n's 4 consecutive activations there). Inside a step, the mma's k
// index 2t, 2t + 1 is column byte 0, 2 of the word and 2t + 8, 2t + 9 bytes 1, 3.
//
// Staged tokens (every mode but the direct ones) are float16 in shared memory: a float16
// lane holds a whole byte exactly, 1024 + (q ^ 0x80) = 1152 + q by one logic op (bytes 0,
// 2 of a word; a shift more for bytes 1, 3), so one tile is one mma chain S. Each token's
// 64 columns of a tile are staged times a power of two f of their own (their largest
// magnitude into [2^14, 2^15): exact for bfloat16's 8 bits and float16's 11, never
// overflowing), and with the tile's sum x of the staged values
//   sum q x = (S - 1152 sum x) / f,
// float32 keeping the cancellation ~16 bits clear of the result. (A bfloat16 lane could
// hold 7 bits of a byte at most: two chains.)
//
// Direct tokens (read from global memory with the weights) keep the model's dtype and
// split each byte 16 h + l into its nibbles, each into a 16-bit lane by one logic op as
// Base + l (Base = 1024.0 in float16, 128.0 in bfloat16: both exact for 4-bit l) and
// Base + 8 + h (XOR-ing the raw high nibble with 8 in the same op); one HSUB2 a pair
// removes the base exactly, and two mma chains S_l, S_h give sum q x = 16 S_h + S_l.
// The group scale (a group holds whole tiles: group a multiple of 64) multiplies each
// tile's sum.
//
// A CTA is kWarps warps on one unit of kTiles row tiles at a time (kSwiglu: a gate tile
// and its up tile), the warps splitting its column tiles, kUnroll adjacent tiles a warp
// (kNormUnroll in the one-tile norm mode; whole 128-byte lines of a row); the partial
// sums meet in shared memory and gemv_epilogue.cuh finishes each output (bias, RMSNorm
// scale, residual, SwiGLU, argmax) once. Activations are staged once per CTA
// (stage_bytes: kNorm folds the norm weight in) and serve every unit the CTA takes; the
// host sizes the tokens a CTA stages to its shared memory, and launches no more CTAs
// than are resident. Or they are prestaged once for the whole launch (int8_stage, a
// launch of its own before it, the same math) and each CTA reads them from there with
// each batch or copies them into its shared memory as they are: staging in every CTA
// costs each one the whole conversion, which on few SMs outweighed a small launch.
//
// No host-visible state, shapes-only grids: safe in CUDA graphs. sm_80+ (sm_87, sm_90).
#include "gemv_epilogue.cuh"

namespace {

using edge::kArgmax;
using edge::kGemvMaxTokens;
using edge::kResidual;
using edge::kStore;
using edge::kSwiglu;

#ifndef CFG_INT8_MMA_WARPS
#define CFG_INT8_MMA_WARPS 8
#endif
#ifndef CFG_INT8_MMA_UNROLL
#define CFG_INT8_MMA_UNROLL 2
#endif
constexpr int kWarps = CFG_INT8_MMA_WARPS;  // warps a CTA: its unit's column split (int8_cuda.py reads it)
constexpr int kThreads = 32 * kWarps;
#ifndef CFG_INT8_MMA_NORM_UNROLL
#define CFG_INT8_MMA_NORM_UNROLL CFG_INT8_MMA_UNROLL
#endif
constexpr int kUnroll = CFG_INT8_MMA_UNROLL;  // column tiles a register stage, per warp and row tile
constexpr int kNormUnroll = CFG_INT8_MMA_NORM_UNROLL;  // the same for the one-tile norm mode (the qkv projection)
// Elements between staged token rows (int8_cuda.py MMA_PAD): 16 bytes, so that rows of
// different parity fall in different banks for the B fragments' 16-byte loads (below).
constexpr int kStagePad = 8;

// (a & b) ^ c in one instruction.
__device__ __forceinline__ unsigned int and_xor(unsigned int a, unsigned int b, unsigned int c) {
  return edge::lop3<0x6A>(a, b, c);
}

// A staged weight word's bytes 0, 2 as float16 1152 + q in both lanes (bytes 1, 3: the word
// shifted right by 8).
__device__ __forceinline__ unsigned int byte_pair(unsigned int w) {
  return and_xor(w, 0x00FF00FFu, 0x64806480u);
}
constexpr float kByteBase = 1152.f;

// Where a CTA's tokens come from: staged by the CTA in shared memory (float16, byte
// chain), read directly in the model's dtype (nibble chains), or prestaged once for the
// whole launch by int8_stage (the staged layout in global memory, byte chain), read from
// there with each batch or copied as they are into the CTA's shared memory.
enum TokenSource { kStagedSrc = 0, kDirectSrc = 1, kPrestagedSrc = 2, kCopiedSrc = 3 };

// Tokens a CTA reads from its shared memory (staged or copied there).
__device__ constexpr bool from_smem(int src) { return src == kStagedSrc || src == kCopiedSrc; }

// One batch of a warp: kU adjacent column tiles of each of its kTiles row tiles
// (rows g and g + 8, so a row's kU x 64 bytes are read by the one warp), with the
// group scales of those rows; tokens from global memory: their B fragments too (and
// prestaged: each tile's sums).
template <int kTiles, int kSrc, int kU>
struct Batch {
  static constexpr bool kLoadsX = !from_smem(kSrc);
  uint4 lo[kU][kTiles], hi[kU][kTiles];  // rows g, g + 8
  float s0[kU][kTiles], s1[kU][kTiles];
  uint4 xv[kLoadsX ? kU : 1][2];  // columns 16t .. + 7 (steps 0, 1) and + 8 .. + 15 (steps 2, 3)
  float4 fc[kSrc == kPrestagedSrc ? kU : 1];
};

// The weight loads of the batch starting at column tile kb0, branch-free: a tile past the
// row's end re-reads the last one (scaled by 0 when multiplied). Row g + 8 is row8 bytes
// (and sc8 scales) after row g: computed per load, as a pointer a row would cost the
// kernel registers.
template <int kTiles, int kSrc, int kU>
__device__ __forceinline__ void load_batch(Batch<kTiles, kSrc, kU>& b, const signed char* const (&row_g)[kTiles],
                                           const float* const (&sc_g)[kTiles], int kb0, int kb_count,
                                           int group_shift, long long row8, int sc8) {
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int kb = min(kb0 + u, kb_count - 1);
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      b.lo[u][i] = edge::ld_weights(row_g[i] + kb * 64);
      b.hi[u][i] = edge::ld_weights(row_g[i] + row8 + kb * 64);
    }
  }
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int gi = min(kb0 + u, kb_count - 1) >> group_shift;
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      b.s0[u][i] = __ldg(sc_g[i] + gi);
      b.s1[u][i] = __ldg(sc_g[i] + sc8 + gi);
    }
  }
}

// Tokens from global memory: the batch's B fragments from token g's row (zeros past the
// tokens), columns 16t + 4s .. + 3 of each tile (below); prestaged, each tile's sums of
// tokens 2t, 2t + 1 too.
template <int kTiles, int kSrc, int kU, typename S>
__device__ __forceinline__ void load_x(Batch<kTiles, kSrc, kU>& b, const S* __restrict__ xrow,
                                       const float2* __restrict__ tiles, bool has_tok, int kb0, int kb_count, int t) {
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int kb = min(kb0 + u, kb_count - 1);
#pragma unroll
    for (int h = 0; h < 2; ++h)  // two 16-byte loads, not four 8-byte ones: half the L1 requests
      b.xv[u][h] = has_tok ? __ldg(reinterpret_cast<const uint4*>(xrow + kb * 64 + 16 * t + 8 * h))
                           : make_uint4(0u, 0u, 0u, 0u);
    if constexpr (kSrc == kPrestagedSrc)
      b.fc[u] = __ldg(reinterpret_cast<const float4*>(tiles + kb * kGemvMaxTokens + 2 * t));
  }
}

__device__ __forceinline__ unsigned int word(const uint4& w, int s) {
  return s == 0 ? w.x : s == 1 ? w.y : s == 2 ? w.z : w.w;
}

// acc += the batch's products (module comment), per column tile 4 k16 steps, times the
// group scale. Staged (S float16, scaled tokens): one chain of whole bytes, less the
// activation sum's share of their base. Direct (S = T): two chains, low and high nibbles,
// bases removed in the lanes.
template <typename S, int kTiles, int kSrc, int kU>
__device__ __forceinline__ void mma_batch(const Batch<kTiles, kSrc, kU>& b, float (&acc)[kTiles][4],
                                          const S* __restrict__ xrow, const float2* __restrict__ tiles, bool has_tok,
                                          int kb0, int kb_count, int t) {
  constexpr bool kDirect = kSrc == kDirectSrc;
  constexpr unsigned int kLo = edge::MagicBase<S>::kBase * 0x10001u;
  constexpr unsigned int kHi = (edge::MagicBase<S>::kBase + 8u) * 0x10001u;
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int kb = min(kb0 + u, kb_count - 1);
    const float live = kb0 + u < kb_count ? 1.f : 0.f;
    float pl[kTiles][4], ph[kTiles][4];  // ph: the direct path's high nibbles
    // From shared memory: token g's 16 columns of the tile in two 16-byte loads (steps 0,
    // 1 and 2, 3); four 8-byte loads, rows 16 elements apart, conflicted in the banks.
    uint4 xa, xb;
    if constexpr (from_smem(kSrc)) {
      xa = edge::staged_quad(xrow + kb * 64 + 16 * t, has_tok);
      xb = edge::staged_quad(xrow + kb * 64 + 16 * t + 8, has_tok);
    } else {
      xa = b.xv[u][0];
      xb = b.xv[u][1];
    }
#pragma unroll
    for (int i = 0; i < kTiles; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) pl[i][c] = ph[i][c] = 0.f;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      // Token g's activations at columns 16t + 4s .. + 3: k 2t, 2t + 1 <- columns 0, 2;
      // k 2t + 8, 2t + 9 <- columns 1, 3.
      const uint2 xv = s == 0   ? make_uint2(xa.x, xa.y)
                       : s == 1 ? make_uint2(xa.z, xa.w)
                       : s == 2 ? make_uint2(xb.x, xb.y)
                                : make_uint2(xb.z, xb.w);
      const unsigned int b0 = __byte_perm(xv.x, xv.y, 0x5410);
      const unsigned int b1 = __byte_perm(xv.x, xv.y, 0x7632);
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
        const unsigned int wg = word(b.lo[u][i], s), wh = word(b.hi[u][i], s);
        unsigned int a[4];  // a0 / a2 row g (bytes 0, 2 / 1, 3), a1 / a3 row g + 8
        if constexpr (!kDirect) {
          a[0] = byte_pair(wg);
          a[1] = byte_pair(wh);
          a[2] = byte_pair(wg >> 8);
          a[3] = byte_pair(wh >> 8);
          edge::mma16816<S>(pl[i], a, b0, b1);
        } else {
          a[0] = edge::sub_pairs<S>(and_xor(wg, 0x000F000Fu, kLo), kLo);
          a[1] = edge::sub_pairs<S>(and_xor(wh, 0x000F000Fu, kLo), kLo);
          a[2] = edge::sub_pairs<S>(and_xor(wg >> 8, 0x000F000Fu, kLo), kLo);
          a[3] = edge::sub_pairs<S>(and_xor(wh >> 8, 0x000F000Fu, kLo), kLo);
          edge::mma16816<S>(pl[i], a, b0, b1);
          // High nibbles, XOR 8: Base + 8 + h for the signed nibble h.
          a[0] = edge::sub_pairs<S>(and_xor(wg >> 4, 0x000F000Fu, kHi), kHi);
          a[1] = edge::sub_pairs<S>(and_xor(wh >> 4, 0x000F000Fu, kHi), kHi);
          a[2] = edge::sub_pairs<S>(and_xor(wg >> 12, 0x000F000Fu, kHi), kHi);
          a[3] = edge::sub_pairs<S>(and_xor(wh >> 12, 0x000F000Fu, kHi), kHi);
          edge::mma16816<S>(ph[i], a, b0, b1);
        }
      }
    }
    float4 fc = make_float4(0.f, 0.f, 0.f, 0.f);  // tokens 2t, 2t + 1: (1 / f, 1152 / f sum x) each
    if constexpr (kSrc == kPrestagedSrc) fc = b.fc[u];
    if constexpr (from_smem(kSrc)) fc = *reinterpret_cast<const float4*>(tiles + kb * kGemvMaxTokens + 2 * t);
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      const float s0 = live * b.s0[u][i], s1 = live * b.s1[u][i];
      if constexpr (kDirect) {
        acc[i][0] = fmaf(s0, fmaf(16.f, ph[i][0], pl[i][0]), acc[i][0]);
        acc[i][1] = fmaf(s0, fmaf(16.f, ph[i][1], pl[i][1]), acc[i][1]);
        acc[i][2] = fmaf(s1, fmaf(16.f, ph[i][2], pl[i][2]), acc[i][2]);
        acc[i][3] = fmaf(s1, fmaf(16.f, ph[i][3], pl[i][3]), acc[i][3]);
      } else {
        acc[i][0] = fmaf(s0, fmaf(fc.x, pl[i][0], -fc.y), acc[i][0]);
        acc[i][1] = fmaf(s0, fmaf(fc.z, pl[i][1], -fc.w), acc[i][1]);
        acc[i][2] = fmaf(s1, fmaf(fc.x, pl[i][2], -fc.y), acc[i][2]);
        acc[i][3] = fmaf(s1, fmaf(fc.z, pl[i][3], -fc.w), acc[i][3]);
      }
    }
  }
}

// The row g and scale pointers of unit `unit`'s tiles for lane (g, t). kSwiglu: the gate
// tile, then the up tile `out` rows further. Out is a multiple of 16 (whole row tiles,
// int8_cuda.py: mma_support); a tile past the end re-reads the last one of its half (its
// rows are never written).
template <int kTiles, int kEpi>
__device__ __forceinline__ void unit_rows(const signed char* (&row_g)[kTiles], const float* (&sc_g)[kTiles],
                                          const signed char* __restrict__ q, const float* __restrict__ scale,
                                          int unit, int out, int in, int groups, int g, int t) {
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
    const int r0 = min((kEpi == kSwiglu ? unit : unit * kTiles + i) * 16, out - 16);
    const int ra = r0 + g + (kEpi == kSwiglu ? i * out : 0);
    row_g[i] = q + (long long)ra * in + 16 * t;
    sc_g[i] = scale + (long long)ra * groups;
  }
}

// 2^(14 - e) for a largest magnitude m in [2^e, 2^(e + 1)): values times it lie in
// float16's range with the largest in [2^14, 2^15).
__device__ __forceinline__ float half_range(float m) {
  const int e = static_cast<int>((__float_as_uint(m) >> 23) & 0xFFu) - 127;
  const int k = min(max(14 - e, -126), 126);
  return __uint_as_float(static_cast<unsigned int>(127 + k) << 23);
}

template <bool kFirst, typename A, typename B>
struct Pick {
  using type = A;
};
template <typename A, typename B>
struct Pick<false, A, B> {
  using type = B;
};

// One thread's chunk v (8 values f of x, in float32) of a token staged for the byte chain
// (module comment) at xs_v, and its tile's sums at tile_n: kNorm, T(x * norm_w) and x's
// squares into ss; the tile's power of two f (its 8 lanes' largest magnitude), the values
// times f in float16, and (1 / f, 1152 / f sum of the staged values).
template <typename T, bool kNorm>
__device__ __forceinline__ void stage_chunk(float (&f)[8], const T* __restrict__ norm_w, int v, float& ss,
                                            __half* __restrict__ xs_v, float2* __restrict__ tile_n) {
  const unsigned int group = 0xFFu << (threadIdx.x & 24);  // the 8 lanes of a 64-column tile
  if constexpr (kNorm) {
    float nw[8];
    edge::Vec<T>::to_float(__ldg(reinterpret_cast<const uint4*>(norm_w + 8 * v)), nw);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      ss = fmaf(f[i], f[i], ss);
      f[i] = edge::round_to<T>(f[i] * nw[i]);
    }
  }
  float m = 0.f, sum = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(f[i]));
  m = fmaxf(m, __shfl_xor_sync(group, m, 1));
  m = fmaxf(m, __shfl_xor_sync(group, m, 2));
  m = fmaxf(m, __shfl_xor_sync(group, m, 4));
  const float up = half_range(m);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    f[i] *= up;
    sum += f[i];
  }
  sum += __shfl_xor_sync(group, sum, 1);
  sum += __shfl_xor_sync(group, sum, 2);
  sum += __shfl_xor_sync(group, sum, 4);
  if ((threadIdx.x & 7) == 0) *tile_n = make_float2(1.f / up, kByteBase / up * sum);
  *reinterpret_cast<uint4*>(xs_v) = edge::Vec<__half>::from_float(f);
}

// The CTA's tokens [0, ntok) of x into xs for the byte chain: copied (gemv_stage_x), then
// each thread stages the chunks it copied (stage_chunk; kNorm: each warp's share of a
// token's sum of squares into red_ss), tiles[tile][token] the tiles' sums.
template <typename T, bool kNorm>
__device__ __forceinline__ void stage_bytes(__half* __restrict__ xs, float (*red_ss)[kGemvMaxTokens],
                                            float2* __restrict__ tiles, const T* __restrict__ x,
                                            const T* __restrict__ norm_w, int in, int ntok) {
  T* xt = reinterpret_cast<T*>(xs);
  edge::gemv_stage_x<T, false, kThreads, kStagePad>(xt, red_ss, x, nullptr, nullptr, in, ntok);
  const int stride = in + kStagePad, vecs = in >> 3;
  for (int n = 0; n < ntok; ++n) {
    float ss = 0.f;
#pragma unroll 1
    for (int v = threadIdx.x; v < vecs; v += kThreads) {
      float f[8];
      edge::Vec<T>::to_float(*reinterpret_cast<const uint4*>(xt + n * stride + 8 * v), f);
      stage_chunk<T, kNorm>(f, norm_w, v, ss, xs + n * stride + 8 * v, tiles + (v >> 3) * kGemvMaxTokens + n);
    }
    if constexpr (kNorm) edge::stage_sum_squares(red_ss, ss, n);
  }
  __syncthreads();
}

// The prestaged layout (int8_stage writes it, int8_cuda.py sizes it): each tile's sums
// [kb_count][kGemvMaxTokens] float2, each token's sums of squares by stage CTA
// [kGemvMaxTokens][kGemvMaxTokens] float, then the tokens' rows [ntok][in] float16.
// Byte offsets of the sums of squares and of the rows.
__device__ __forceinline__ int prestaged_ss(int in) { return (in >> 6) * kGemvMaxTokens * (int)sizeof(float2); }
__device__ __forceinline__ int prestaged_xs(int in) {
  return prestaged_ss(in) + kGemvMaxTokens * kGemvMaxTokens * (int)sizeof(float);
}

// The prestaged tile sums and tokens [0, ntok) into this CTA's shared memory as
// stage_bytes lays them out, copied as they are (cp.async, then a barrier).
__device__ __forceinline__ void copy_prestaged(unsigned char* __restrict__ smem_x, const unsigned char* __restrict__ pre,
                                               int in, int ntok) {
  const int sums = prestaged_ss(in), vecs = in >> 3;
  for (int i = threadIdx.x; i < sums / 16; i += kThreads) edge::cp_async16(edge::smem_u32(smem_x + 16 * i), pre + 16 * i, 16);
  __half* xs = reinterpret_cast<__half*>(smem_x + sums);
  const __half* src = reinterpret_cast<const __half*>(pre + prestaged_xs(in));
  for (int n = 0; n < ntok; ++n)
    for (int v = threadIdx.x; v < vecs; v += kThreads)
      edge::cp_async16(edge::smem_u32(xs + n * (in + kStagePad) + 8 * v), src + (long long)n * in + 8 * v, 16);
  edge::cp_async_commit();
  edge::cp_async_wait_all();
  __syncthreads();
}

// A CTA takes units blockIdx.x, + gridDim.x, ... (the host launches at most the resident
// CTAs, so the staged activations serve every unit a CTA takes) and tokens
// [blockIdx.y * tok_chunk, + tok_chunk) (at most kGemvMaxTokens; the host sizes tok_chunk
// so their staged rows and tile sums fit its dynamic shared memory). Tokens read from
// global memory (kDirectSrc: x, no norm; kPrestagedSrc: pre, the norm folded in by
// int8_stage, whose `chunks` CTAs a token each left a share of its sum of squares) are
// loaded with each batch and nothing is staged.
template <typename T, int kTiles, bool kNorm, int kEpi, int kSrc>
__device__ __forceinline__ void int8_mma(T* __restrict__ y, const T* __restrict__ x, const unsigned char* __restrict__ pre,
                                         const signed char* __restrict__ q, const float* __restrict__ scale,
                                         const T* __restrict__ bias, const T* __restrict__ norm_w, float eps, int out,
                                         int in, int group_shift, int num_tokens, int tok_chunk, int chunks,
                                         unsigned long long* __restrict__ best) {
  static_assert(kEpi != kSwiglu || kTiles == 2, "SwiGLU pairs a gate tile with its up tile");
  static_assert(kEpi != kArgmax || kTiles == 2, "argmax reduces 32 outputs a warp");
  static_assert(kSrc != kDirectSrc || !kNorm, "the norm is applied while staging");
  using S = typename Pick<kSrc == kDirectSrc, T, __half>::type;  // the mma's operand type (module comment)
  __shared__ float red[kWarps][kTiles][16][kGemvMaxTokens];
  __shared__ float red_ss[kWarps][kGemvMaxTokens];
  extern __shared__ __align__(16) unsigned char smem_x[];
  const int kb_count = in >> 6;
  const float2* tiles = reinterpret_cast<const float2*>(smem_x);  // [kb_count][kGemvMaxTokens], then the staged rows
  __half* xs = reinterpret_cast<__half*>(smem_x + kb_count * kGemvMaxTokens * sizeof(float2));
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.y * tok_chunk;
  const int ntok = min(tok_chunk, num_tokens - n0);
  const int units = kEpi == kSwiglu ? out >> 4 : (out + 16 * kTiles - 1) / (16 * kTiles);
  const int groups = in >> (group_shift + 6);
  const bool has_tok = g < ntok;
  const S* xrow;
  if constexpr (kSrc == kDirectSrc) {
    xrow = x + (long long)(n0 + (has_tok ? g : 0)) * in;
  } else if constexpr (kSrc == kPrestagedSrc) {
    tiles = reinterpret_cast<const float2*>(pre);
    xrow = reinterpret_cast<const __half*>(pre + prestaged_xs(in)) + (long long)(n0 + (has_tok ? g : 0)) * in;
  } else {
    xrow = xs + (has_tok ? g : 0) * (in + kStagePad);
  }
  const signed char* row_g[kTiles];
  const float* sc_g[kTiles];
  const long long row8 = 8ll * in;  // row g + 8 (load_batch)
  const int sc8 = 8 * groups;
  constexpr int kU = kTiles == 1 && kNorm && from_smem(kSrc) ? kNormUnroll : kUnroll;
  constexpr bool kLoadsX = Batch<kTiles, kSrc, kU>::kLoadsX;
  const int step = kWarps * kU;
  Batch<kTiles, kSrc, kU> st0, st1;
  int unit = blockIdx.x;
  unit_rows<kTiles, kEpi>(row_g, sc_g, q, scale, unit, out, in, groups, g, t);
  // The first batch's weights are a constant of the step: loaded before the wait, under
  // the previous kernel's tail.
  load_batch<kTiles, kSrc, kU>(st0, row_g, sc_g, warp * kU, kb_count, group_shift, row8, sc8);
  edge::await_inputs();
  if constexpr (kLoadsX) load_x<kTiles, kSrc, kU, S>(st0, xrow, tiles, has_tok, warp * kU, kb_count, t);
  if constexpr (kSrc == kStagedSrc)
    stage_bytes<T, kNorm>(xs, red_ss, reinterpret_cast<float2*>(smem_x), x + (long long)n0 * in, norm_w, in, ntok);
  if constexpr (kSrc == kCopiedSrc) copy_prestaged(smem_x, pre, in, ntok);
  if constexpr ((kSrc == kPrestagedSrc || kSrc == kCopiedSrc) && kNorm) {
    const int w = threadIdx.x >> 3, n = threadIdx.x & 7;  // kWarps x kGemvMaxTokens <= kThreads
    if (w < kWarps)
      red_ss[w][n] = w < chunks && n < ntok
                         ? __ldg(reinterpret_cast<const float*>(pre + prestaged_ss(in)) + (n0 + n) * kGemvMaxTokens + w)
                         : 0.f;
  }
  for (;;) {
    int kb0 = warp * kU;
    float acc[kTiles][4];
#pragma unroll
    for (int i = 0; i < kTiles; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][c] = 0.f;
    for (; kb0 < kb_count; kb0 += 2 * step) {
      load_batch<kTiles, kSrc, kU>(st1, row_g, sc_g, kb0 + step, kb_count, group_shift, row8, sc8);
      if constexpr (kLoadsX) load_x<kTiles, kSrc, kU, S>(st1, xrow, tiles, has_tok, kb0 + step, kb_count, t);
      mma_batch<S, kTiles, kSrc, kU>(st0, acc, xrow, tiles, has_tok, kb0, kb_count, t);
      if (kb0 + step >= kb_count) break;
      load_batch<kTiles, kSrc, kU>(st0, row_g, sc_g, kb0 + 2 * step, kb_count, group_shift, row8, sc8);
      if constexpr (kLoadsX) load_x<kTiles, kSrc, kU, S>(st0, xrow, tiles, has_tok, kb0 + 2 * step, kb_count, t);
      mma_batch<S, kTiles, kSrc, kU>(st1, acc, xrow, tiles, has_tok, kb0 + step, kb_count, t);
    }
    const int next = unit + gridDim.x;
    if (next < units) {  // the next unit's first weights in flight under this one's epilogue
      unit_rows<kTiles, kEpi>(row_g, sc_g, q, scale, next, out, in, groups, g, t);
      load_batch<kTiles, kSrc, kU>(st0, row_g, sc_g, warp * kU, kb_count, group_shift, row8, sc8);
      if constexpr (kLoadsX) load_x<kTiles, kSrc, kU, S>(st0, xrow, tiles, has_tok, warp * kU, kb_count, t);
    }
    edge::gemv_store_partials<kTiles>(red[warp], acc, g, t);
    __syncthreads();
    edge::gemv_epilogue<T, kWarps, kTiles, kNorm, kEpi>(red, red_ss, y, bias, eps, out, in, unit, 1, kWarps, ntok,
                                                        n0, best);
    if (next >= units) break;
    unit = next;
    __syncthreads();  // red is rewritten by the next unit
  }
}

// The launch's tokens staged once for every CTA of the int8_mma_pre kernel after it
// (instead of by each of them): token blockIdx.x's columns in `chunks` (gridDim.y) CTAs,
// each 64-column tile as stage_bytes stages it (kNorm: T(x * norm_w), and the CTA's share
// of the token's sum of squares), into the Prestaged layout at pre.
template <typename T, bool kNorm>
__device__ __forceinline__ void int8_stage(unsigned char* __restrict__ pre, const T* __restrict__ x,
                                           const T* __restrict__ norm_w, int in) {
  __shared__ float part[kWarps][kGemvMaxTokens];
  const int n = blockIdx.x, vecs = in >> 3;
  float2* tiles = reinterpret_cast<float2*>(pre);
  __half* xs = reinterpret_cast<__half*>(pre + prestaged_xs(in)) + (long long)n * in;
  const T* xr = x + (long long)n * in;
  edge::await_inputs();
  float ss = 0.f;
  for (int v = blockIdx.y * kThreads + threadIdx.x; v < vecs; v += gridDim.y * kThreads) {
    float f[8];
    edge::Vec<T>::to_float(__ldg(reinterpret_cast<const uint4*>(xr + 8 * v)), f);
    stage_chunk<T, kNorm>(f, norm_w, v, ss, xs + 8 * v, tiles + (v >> 3) * kGemvMaxTokens + n);
  }
  if constexpr (kNorm) {
    edge::stage_sum_squares(part, ss, 0);  // each warp's share into part[warp][0]
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) total += part[w][0];
      reinterpret_cast<float*>(pre + prestaged_ss(in))[n * kGemvMaxTokens + blockIdx.y] = total;
    }
  }
}

}  // namespace

// One signature for every mode (norm_w / eps unused without the norm, best without argmax).
#define CFG_INT8_MMA(NAME, T, TILES, NORM, EPI, SRC)                                                             \
  extern "C" __global__ void __launch_bounds__(kThreads) NAME(                                              \
      T* __restrict__ y, const T* __restrict__ x, const signed char* __restrict__ q,                         \
      const float* __restrict__ scale, const T* __restrict__ bias, const T* __restrict__ norm_w, float eps,  \
      int out, int in, int group_shift, int num_tokens, int tok_chunk, unsigned long long* __restrict__ best) { \
    int8_mma<T, TILES, NORM, EPI, SRC>(y, x, nullptr, q, scale, bias, norm_w, eps, out, in, group_shift,      \
                                       num_tokens, tok_chunk, 0, best);                                      \
  }

// The prestaged modes: pre (int8_stage's output) instead of x and the norm weight, and
// the stage's CTAs a token. The one-tile modes read the tokens with each batch
// (pre_direct_); the two-tile ones copy them into shared memory (pre_), or read them
// too where they do not fit.
#define CFG_INT8_MMA_PRE(NAME, T, TILES, NORM, EPI, SRC)                                                           \
  extern "C" __global__ void __launch_bounds__(kThreads) NAME(                                              \
      T* __restrict__ y, const unsigned char* __restrict__ pre, const signed char* __restrict__ q,           \
      const float* __restrict__ scale, const T* __restrict__ bias, float eps, int out, int in,               \
      int group_shift, int num_tokens, int chunks, unsigned long long* __restrict__ best) {                  \
    int8_mma<T, TILES, NORM, EPI, SRC>(y, nullptr, pre, q, scale, bias, nullptr, eps, out, in, group_shift,   \
                                       num_tokens, num_tokens, chunks, best);                                \
  }

// The modes of int8_gemv.cu (int8_cuda.py: MODES, ARGMAX_MODES): one row tile a CTA,
// two for SwiGLU (gate and up) and argmax (32 outputs a warp); the plain and residual
// modes also direct (for tokens whose rows do not fit the staging); every mode prestaged,
// the one-tile modes also in pairs of adjacent row tiles a unit (pre_pair_: each B
// fragment read serves two tiles, and there are half the units to balance over CTAs).
#define CFG_INT8_MMA_MODES(DT, T)                                                          \
  CFG_INT8_MMA(int8_mma_##DT, T, 1, false, kStore, kStagedSrc)                            \
  CFG_INT8_MMA(int8_mma_norm_##DT, T, 1, true, kStore, kStagedSrc)                        \
  CFG_INT8_MMA(int8_mma_residual_##DT, T, 1, false, kResidual, kStagedSrc)                \
  CFG_INT8_MMA(int8_mma_norm_swiglu_##DT, T, 2, true, kSwiglu, kStagedSrc)                \
  CFG_INT8_MMA(int8_mma_argmax_##DT, T, 2, false, kArgmax, kStagedSrc)                    \
  CFG_INT8_MMA(int8_mma_norm_argmax_##DT, T, 2, true, kArgmax, kStagedSrc)                \
  CFG_INT8_MMA(int8_mma_direct_##DT, T, 1, false, kStore, kDirectSrc)                     \
  CFG_INT8_MMA(int8_mma_direct_residual_##DT, T, 1, false, kResidual, kDirectSrc)         \
  CFG_INT8_MMA_PRE(int8_mma_pre_direct_##DT, T, 1, false, kStore, kPrestagedSrc)        \
  CFG_INT8_MMA_PRE(int8_mma_pre_direct_norm_##DT, T, 1, true, kStore, kPrestagedSrc)    \
  CFG_INT8_MMA_PRE(int8_mma_pre_direct_residual_##DT, T, 1, false, kResidual, kPrestagedSrc)\
  CFG_INT8_MMA_PRE(int8_mma_pre_pair_##DT, T, 2, false, kStore, kPrestagedSrc)          \
  CFG_INT8_MMA_PRE(int8_mma_pre_pair_norm_##DT, T, 2, true, kStore, kPrestagedSrc)      \
  CFG_INT8_MMA_PRE(int8_mma_pre_pair_residual_##DT, T, 2, false, kResidual, kPrestagedSrc)\
  CFG_INT8_MMA_PRE(int8_mma_pre_norm_swiglu_##DT, T, 2, true, kSwiglu, kCopiedSrc)      \
  CFG_INT8_MMA_PRE(int8_mma_pre_direct_norm_swiglu_##DT, T, 2, true, kSwiglu, kPrestagedSrc)\
  CFG_INT8_MMA_PRE(int8_mma_pre_argmax_##DT, T, 2, false, kArgmax, kCopiedSrc)          \
  CFG_INT8_MMA_PRE(int8_mma_pre_direct_argmax_##DT, T, 2, false, kArgmax, kPrestagedSrc)\
  CFG_INT8_MMA_PRE(int8_mma_pre_norm_argmax_##DT, T, 2, true, kArgmax, kCopiedSrc)      \
  CFG_INT8_MMA_PRE(int8_mma_pre_direct_norm_argmax_##DT, T, 2, true, kArgmax, kPrestagedSrc)\
  extern "C" __global__ void __launch_bounds__(kThreads)                                  \
      int8_stage_##DT(unsigned char* __restrict__ pre, const T* __restrict__ x, int in) { \
    int8_stage<T, false>(pre, x, nullptr, in);                                            \
  }                                                                                       \
  extern "C" __global__ void __launch_bounds__(kThreads) int8_stage_norm_##DT(            \
      unsigned char* __restrict__ pre, const T* __restrict__ x, const T* __restrict__ norm_w, int in) { \
    int8_stage<T, true>(pre, x, norm_w, in);                                              \
  }

CFG_INT8_MMA_MODES(bf16, __nv_bfloat16)
CFG_INT8_MMA_MODES(f16, __half)
