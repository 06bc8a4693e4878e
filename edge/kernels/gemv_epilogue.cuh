// The epilogue of the tensor-core GEMVs (int4_gemv.cu, int8_mma.cu): the CTA's split
// warps' partial sums meet in shared memory and each output gets, once, the RMSNorm
// scale, bias, then one of the modes below, for every token the CTA staged.
//
//   kStore      y[row] = T(dot + bias).
//   kResidual   y[row] = T(y[row] + T(dot + bias)), in place (y must not alias x).
//   kSwiglu     the weight is [gate; up]; y[j] = T(silu(T(g)) * T(u)).
//   kArgmax     nothing stored: the largest T-rounded output of each token (lowest
//               row among equals, NaN largest) into best[token] by a 64-bit atomicMax
//               (a unit must give 32 outputs a token: a warp reduces them).
#pragma once
#include "common.cuh"

namespace edge {

constexpr int kGemvMaxTokens = 8;  // tokens a CTA multiplies at once: the mma's N

enum GemvEpilogue { kStore = 0, kResidual = 1, kSwiglu = 2, kArgmax = 3 };

constexpr int kGemvPad = 16;

// One LOP3 of truth table kLut over a, b, c (0xEA: (a & b) | c; 0x6A: (a & b) ^ c): a
// nibble masked into the mantissa of a magic base in one instruction.
template <unsigned int kLut>
__device__ __forceinline__ unsigned int lop3(unsigned int a, unsigned int b, unsigned int c) {
  unsigned int d;
  asm("lop3.b32 %0, %1, %2, %3, %4;" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(kLut));
  return d;
}

// The magic base of a 16-bit lane: kBase + n is exact for a nibble n (its mantissa's low
// bits hold n).
template <typename T>
struct MagicBase;
template <>
struct MagicBase<__half> {
  static constexpr unsigned int kBase = 0x6400u;  // 1024.0
};
template <>
struct MagicBase<__nv_bfloat16> {
  static constexpr unsigned int kBase = 0x4300u;  // 128.0
};

// a - b in both 16-bit lanes of a packed pair (the tensor-core GEMVs remove the magic
// bases of their dequantized codes with it: exact for the small integers they hold).
template <typename T>
__device__ __forceinline__ unsigned int sub_pairs(unsigned int a, unsigned int b);
template <>
__device__ __forceinline__ unsigned int sub_pairs<__half>(unsigned int a, unsigned int b) {
  __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<unsigned int*>(&r);
}
template <>
__device__ __forceinline__ unsigned int sub_pairs<__nv_bfloat16>(unsigned int a, unsigned int b) {
  __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<unsigned int*>(&r);
}  // a staged token's row starts 32 bytes (8 banks) after the previous one

// A lane's 4 staged activations of its B fragment (zeros for a lane past the tokens; the
// load is unconditional: a predicated one costs the GEMVs registers).
template <typename T>
__device__ __forceinline__ uint2 staged_pair(const T* at, bool has_tok) {
  const uint2 v = *reinterpret_cast<const uint2*>(at);
  return has_tok ? v : make_uint2(0u, 0u);
}

// The same for 8 activations (two k16 steps' B fragments in one 16-byte load).
template <typename T>
__device__ __forceinline__ uint4 staged_quad(const T* at, bool has_tok) {
  const uint4 v = *reinterpret_cast<const uint4*>(at);
  return has_tok ? v : make_uint4(0u, 0u, 0u, 0u);
}

// One thread's 8-element chunk of a staged token: T(x * norm_w) in place and x's squares
// added to ss.
template <typename T>
__device__ __forceinline__ void stage_norm_chunk(T (&val)[8], const T (&nw)[8], float& ss) {
#pragma unroll
  for (int i = 0; i < 8; i += 2) {
    const float a = to_float(val[i]), b = to_float(val[i + 1]);
    ss = fmaf(a, a, fmaf(b, b, ss));
    *reinterpret_cast<unsigned int*>(val + i) = pack2<T>(a * to_float(nw[i]), b * to_float(nw[i + 1]));
  }
}

// A warp's share of token n's sum of squares into red_ss[warp][n].
__device__ __forceinline__ void stage_sum_squares(float (*red_ss)[kGemvMaxTokens], float ss, int n) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if ((threadIdx.x & 31) == 0) red_ss[threadIdx.x >> 5][n] = ss;
}

// Activations are staged once per CTA in shared memory (a token a row, `in + kGemvPad`
// elements apart), gathered through perm and, with kNorm, multiplied by the norm weight
// there: the k16 steps then read their B fragments from shared memory instead of each
// waiting for a global load (the weights of the next stage are in flight meanwhile).
// Tokens [0, ntok) of x (rows of `in`, 16-byte aligned) into xs; kNorm: T(x * norm_w),
// and each warp's share of every token's sum of squares of x into red_ss[warp][token].
// Without perm every token's row is copied at once
// by cp.async (one memory latency for all tokens, no registers held), then each thread
// finishes the very chunks it copied (no barrier between the passes).
template <typename T, bool kNorm, int kThreads, int kPad = kGemvPad>
__device__ __forceinline__ void gemv_stage_x(T* __restrict__ xs, float (*red_ss)[kGemvMaxTokens],
                                             const T* __restrict__ x, const int* __restrict__ perm,
                                             const T* __restrict__ norm_w, int in, int ntok) {
  const int stride = in + kPad;
  const int vecs = in >> 3;  // 8 elements (16 bytes) a thread and step
  alignas(16) T val[8];
  alignas(16) T nw[8];
  if (perm == nullptr) {
#pragma unroll 1
    for (int n = 0; n < ntok; ++n)
#pragma unroll 1
      for (int v = threadIdx.x; v < vecs; v += kThreads)
        cp_async16(smem_u32(xs + (long long)n * stride + 8 * v), x + (long long)n * in + 8 * v, 16);
    cp_async_commit();
    cp_async_wait_all();
    if constexpr (kNorm) {
      for (int n = 0; n < ntok; ++n) {
        T* xsr = xs + (long long)n * stride;
        float ss = 0.f;
#pragma unroll 1  // a pass unrolled around the norm weight's loads costs the GEMV registers
        for (int v = threadIdx.x; v < vecs; v += kThreads) {
          *reinterpret_cast<uint4*>(val) = *reinterpret_cast<const uint4*>(xsr + 8 * v);
          *reinterpret_cast<uint4*>(nw) = __ldg(reinterpret_cast<const uint4*>(norm_w + 8 * v));
          stage_norm_chunk<T>(val, nw, ss);
          *reinterpret_cast<uint4*>(xsr + 8 * v) = *reinterpret_cast<const uint4*>(val);
        }
        stage_sum_squares(red_ss, ss, n);
      }
    }
    return;
  }
  for (int n = 0; n < ntok; ++n) {  // act order: the columns gathered through perm
    const T* xr = x + (long long)n * in;
    float ss = 0.f;
#pragma unroll 1  // unrolled, the gathers' registers would set the whole GEMV's count
    for (int v = threadIdx.x; v < vecs; v += kThreads) {
      const int4 i0 = __ldg(reinterpret_cast<const int4*>(perm + 8 * v));
      const int4 i1 = __ldg(reinterpret_cast<const int4*>(perm + 8 * v + 4));
      const int idx[8] = {i0.x, i0.y, i0.z, i0.w, i1.x, i1.y, i1.z, i1.w};
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        val[i] = xr[idx[i]];
        if (kNorm) nw[i] = norm_w[idx[i]];
      }
      if (kNorm) stage_norm_chunk<T>(val, nw, ss);
      *reinterpret_cast<uint4*>(xs + (long long)n * stride + 8 * v) = *reinterpret_cast<const uint4*>(val);
    }
    if (kNorm) stage_sum_squares(red_ss, ss, n);
  }
}

// A warp's C fragments into its red[warp]: c0, c1 are row g, tokens 2t, 2t + 1; c2, c3 row g + 8.
template <int kTiles>
__device__ __forceinline__ void gemv_store_partials(float (*red)[16][kGemvMaxTokens], const float (&acc)[kTiles][4],
                                                    int g, int t) {
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
    red[i][g][2 * t] = acc[i][0];
    red[i][g][2 * t + 1] = acc[i][1];
    red[i][g + 8][2 * t] = acc[i][2];
    red[i][g + 8][2 * t + 1] = acc[i][3];
  }
}

// red[warp][tile][row][token]: the warps' partial sums (C fragments); red_ss[warp][token]:
// each warp's share of a token's sum of squares (kNorm). A CTA holds `units` units of
// kTiles row tiles (kSwiglu: a gate tile and its up tile), `split` warps a unit, the
// tokens [n0, n0 + ntok); its first unit is unit0. Called by every thread after a
// __syncthreads.
template <typename T, int kWarps, int kTiles, bool kNorm, int kEpi>
__device__ __forceinline__ void gemv_epilogue(const float (*red)[kTiles][16][kGemvMaxTokens],
                                              const float (*red_ss)[kGemvMaxTokens], T* __restrict__ y,
                                              const T* __restrict__ bias, float eps, int out, int in, int unit0,
                                              int units, int split, int ntok, int n0,
                                              unsigned long long* __restrict__ best) {
  constexpr int kThreads = 32 * kWarps;
  const int lane = threadIdx.x & 31;
  constexpr int kOutTiles = kEpi == kSwiglu ? 1 : kTiles;  // tiles that give outputs
  // Outputs token-major, then unit, tile, row: a warp's 32 (argmax: one token's unit).
  const int per_token = units * kOutTiles * 16;
  const int total = per_token * ntok;
  for (int o = threadIdx.x; o < ((total + 31) & ~31); o += kThreads) {
    const bool live = o < total;
    const int oo = live ? o : 0;
    const int n = oo / per_token;
    const int grp = (oo % per_token) / (kOutTiles * 16);
    const int i = (oo / 16) % kOutTiles;
    const int r = oo & 15;
    float v = 0.f, up = 0.f;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) {
      if (k < split) {
        v += red[grp * split + k][i][r][n];
        if (kEpi == kSwiglu) up += red[grp * split + k][kTiles - 1][r][n];
      }
    }
    if (kNorm) {
      float sq = 0.f;
#pragma unroll
      for (int k = 0; k < kWarps; ++k) sq += red_ss[k][n];  // every warp staged a share of the columns
      const float inv_rms = rsqrtf(sq / static_cast<float>(in) + eps);
      v *= inv_rms;
      up *= inv_rms;
    }
    // A clamped duplicate tile (past the last row block) has rows >= out: not written.
    const int ounit = unit0 + grp;
    const int row = (kEpi == kSwiglu ? ounit : ounit * kTiles + i) * 16 + r;
    const bool writes = live && row < out;
    if (bias != nullptr && writes) {
      v += to_float(bias[row]);
      if (kEpi == kSwiglu) up += to_float(bias[out + row]);
    }
    if (kEpi == kArgmax) {
      unsigned long long key = writes ? argmax_key(round_to<T>(v), row) : 0ull;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, off);
        key = other > key ? other : key;
      }
      if (lane == 0 && key != 0ull) atomicMax(best + n0 + n, key);
      continue;
    }
    if (!writes) continue;
    T* yo = y + (long long)(n0 + n) * out + row;
    if (kEpi == kSwiglu) {
      const float gg = round_to<T>(v);
      v = gg / (1.f + __expf(-gg)) * round_to<T>(up);
    } else if (kEpi == kResidual) {
      v = to_float(*yo) + round_to<T>(v);
    }
    *yo = from_float<T>(v);
  }
}

}  // namespace edge
