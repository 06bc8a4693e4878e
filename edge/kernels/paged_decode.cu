// Paged decode attention: one query token per sequence, GQA, flash-decoding split.
//
// Grid: x = kv_heads * ceil(group / GT) (one CTA per KV head and chunk of <= GT query
// heads of its group, so each K/V row is read from global memory once for the whole
// group when group <= GT), y = num_splits (the sequence is cut into num_splits ranges
// derived in-kernel from kv_len, so the launch configuration does not depend on the
// length: with a device-resident `pos` the same launch works in a CUDA graph whatever
// the length at replay), z = tokens (1 for decode; >1 only with num_splits == 1, where
// token t sees kv_len + t keys: the float32 prefill path).
//
// Each CTA streams its rows with 16-byte loads, TPR threads per row, UNROLL rows per
// row group in flight, online softmax in float32 (exp2 domain), merges its row groups
// (shuffles, then shared memory), and then either writes the output (one split) or
// its partial (m, l, unnormalized o) to a float32 workspace; the last CTA of a
// (KV head, chunk) to finish (atomic ticket) merges all splits and writes the output,
// then resets its ticket to 0 for the next launch. No second kernel, fixed shared
// memory, nothing at or beyond kv_len is ever read.
#include "common.cuh"

namespace edge {

constexpr int kDecodeThreads = 128;
constexpr int kMaxSplits = 128;

// Tuning knobs (defines; nvrtc.py folds them into the cache key):
//   EDGE_DECODE_MIN_BLOCKS  resident CTAs per SM asked of the register allocator
//   EDGE_DECODE_QACC_REGS   registers per thread for q + the output accumulator; sets the
//                           threads per K/V row: fewer registers -> more lanes per row
//                           -> more shuffles per row
//   EDGE_DECODE_UNROLL_VECS 16-byte K vectors per thread per iteration (V as many)
//   EDGE_DECODE_PREFETCH    1: load the next iteration's rows while computing this one
#ifndef EDGE_DECODE_MIN_BLOCKS
#define EDGE_DECODE_MIN_BLOCKS 2
#endif
#ifndef EDGE_DECODE_QACC_REGS
#define EDGE_DECODE_QACC_REGS 128
#endif
#ifndef EDGE_DECODE_UNROLL_VECS
#define EDGE_DECODE_UNROLL_VECS 4
#endif
#ifndef EDGE_DECODE_PREFETCH
#define EDGE_DECODE_PREFETCH 0
#endif

template <typename T, int D, int GT>
struct DecodeCfg {
  static constexpr int VEC = Vec<T>::N;       // elements per 16-byte vector
  static constexpr int NVEC = D / VEC;        // vectors per row
  static constexpr int TPR0 = GT * D * 2 / EDGE_DECODE_QACC_REGS;
  static constexpr int TPR_MIN = NVEC / 4 > 2 ? NVEC / 4 : 2;  // <= 4 vectors per thread
  static constexpr int TPR = TPR0 < TPR_MIN ? TPR_MIN : (TPR0 > NVEC ? NVEC : TPR0);
  static constexpr int NV = NVEC / TPR;       // vectors per thread per row
  static constexpr int EPT = NV * VEC;        // elements per thread per row
  static constexpr int UNROLL = NV >= EDGE_DECODE_UNROLL_VECS ? 1 : EDGE_DECODE_UNROLL_VECS / NV;
  static constexpr int NRG = kDecodeThreads / TPR;    // row groups per CTA
  static constexpr int ROWS_ITER = NRG * UNROLL;
  static constexpr int WARPS = kDecodeThreads / 32;
  static_assert(NVEC % TPR == 0, "bad TPR");
  static_assert(32 % TPR == 0, "row group must not straddle warps");
};

__device__ __forceinline__ void store4(__half* p, float4 v) {
  uint2 u = make_uint2(pack2<__half>(v.x, v.y), pack2<__half>(v.z, v.w));
  *reinterpret_cast<uint2*>(p) = u;
}
__device__ __forceinline__ void store4(__nv_bfloat16* p, float4 v) {
  uint2 u = make_uint2(pack2<__nv_bfloat16>(v.x, v.y), pack2<__nv_bfloat16>(v.z, v.w));
  *reinterpret_cast<uint2*>(p) = u;
}
__device__ __forceinline__ void store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }

template <typename T, int D, int GT>
__device__ __forceinline__ void paged_decode(
    T* __restrict__ out,             // [tokens, q_heads, D]
    const T* __restrict__ q,         // [tokens, q_heads, D]
    const T* __restrict__ k_pool,    // [num_blocks, page, kv_heads, D]
    const T* __restrict__ v_pool,    // [num_blocks, page, kv_heads, D]
    const int* __restrict__ table,   // [max_blocks]
    const int* __restrict__ pos,     // device position (kv_len = *pos + 1) or null
    int host_len,                    // kv_len of token 0 when pos is null
    int kv_heads, int group, int log2_page, float scale_log2,
    float* __restrict__ ws,          // split partials (num_splits > 1)
    unsigned int* __restrict__ counters) {
  using C = DecodeCfg<T, D, GT>;
  constexpr int VEC = C::VEC, TPR = C::TPR, NV = C::NV, EPT = C::EPT, UNROLL = C::UNROLL;
  constexpr int NRG = C::NRG, WARPS = C::WARPS;

  __shared__ float sm_m[WARPS][GT];
  __shared__ float sm_l[WARPS][GT];
  __shared__ __align__(16) float sm_acc[WARPS][GT][D];
  __shared__ float sm_sm[kMaxSplits][GT];  // per-split m, then merge weights
  __shared__ float sm_sl[kMaxSplits][GT];  // per-split l
  __shared__ float sm_M[GT];
  __shared__ float sm_invL[GT];
  __shared__ int sm_last;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int lr = lane % TPR;   // lane within the row group
  const int rg = tid / TPR;    // row group within the CTA
  const int hchunks = (group + GT - 1) / GT;
  const int kvh = blockIdx.x / hchunks;
  const int chunk = blockIdx.x - kvh * hchunks;
  const int gcount = min(GT, group - chunk * GT);
  const int q_heads = kv_heads * group;
  const int head0 = kvh * group + chunk * GT;
  const int tok = blockIdx.z;
  const int split = blockIdx.y;
  const int nsplit = gridDim.y;

  const int kv_len = (pos != nullptr ? __ldg(pos) + 1 : host_len) + tok;

  // This split's rows [r0, r1): the partition is derived from kv_len here, so the
  // launch does not depend on it.
  int per = (kv_len + nsplit - 1) / nsplit;
  per = (per + C::ROWS_ITER - 1) / C::ROWS_ITER * C::ROWS_ITER;
  const int r0 = split * per;
  const int r1 = min(kv_len, r0 + per);

  // Query slice of this thread, pre-scaled into the exp2 domain.
  float qf[GT][EPT];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      if (g < gcount) {
        const T* qp = q + ((long long)tok * q_heads + head0 + g) * D + (lr + j * TPR) * VEC;
        uint4 u = *reinterpret_cast<const uint4*>(qp);
        Vec<T>::to_float(u, &qf[g][j * VEC]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) qf[g][j * VEC + e] *= scale_log2;
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) qf[g][j * VEC + e] = 0.f;
      }
    }
  }

  float m[GT], l[GT], acc[GT][EPT];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    m[g] = neg_inf();
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < EPT; ++i) acc[g][i] = 0.f;
  }

  const long long row_stride = (long long)kv_heads * D;  // elements between slots
  const T* kbase = k_pool + (long long)kvh * D + lr * VEC;
  const T* vbase = v_pool + (long long)kvh * D + lr * VEC;

  // Rows base + u * NRG + rg (u < UNROLL) of one iteration; rows at or past r1 are
  // not read (zeros).
  auto load_rows = [&](int base, uint4 (&kr)[UNROLL][NV], uint4 (&vr)[UNROLL][NV]) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int row = base + u * NRG + rg;
      if (row < r1) {
        const long long off = paged_slot(table, row, log2_page) * row_stride;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
          kr[u][j] = load_stream(kbase + off + j * TPR * VEC);
          vr[u][j] = load_stream(vbase + off + j * TPR * VEC);
        }
      } else {
#pragma unroll
        for (int j = 0; j < NV; ++j) {
          kr[u][j] = make_uint4(0u, 0u, 0u, 0u);
          vr[u][j] = make_uint4(0u, 0u, 0u, 0u);
        }
      }
    }
  };

#if EDGE_DECODE_PREFETCH
  uint4 kr[UNROLL][NV], vr[UNROLL][NV];
  load_rows(r0, kr, vr);
#endif
  for (int base = r0; base < r1; base += C::ROWS_ITER) {
#if EDGE_DECODE_PREFETCH
    uint4 kn[UNROLL][NV], vn[UNROLL][NV];
    load_rows(base + C::ROWS_ITER, kn, vn);  // in flight while this iteration computes
#else
    uint4 kr[UNROLL][NV], vr[UNROLL][NV];
    load_rows(base, kr, vr);
#endif

    // Scores (every lane takes part in the shuffles; rows not loaded score 0 and are
    // masked below by a branch, never by multiplication).
    float s[UNROLL][GT];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float kf[EPT];
#pragma unroll
      for (int j = 0; j < NV; ++j) Vec<T>::to_float(kr[u][j], &kf[j * VEC]);
#pragma unroll
      for (int g = 0; g < GT; ++g) {
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < EPT; ++i) a = fmaf(qf[g][i], kf[i], a);
        s[u][g] = a;
      }
    }
#pragma unroll
    for (int off = TPR / 2; off > 0; off >>= 1) {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
        for (int g = 0; g < GT; ++g) s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], off);
      }
    }

    if (base + rg < r1) {  // row u = 0 is valid, so this group has work this round
#pragma unroll
      for (int g = 0; g < GT; ++g) {
        float mx = m[g];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
          if (base + u * NRG + rg < r1) mx = fmaxf(mx, s[u][g]);
        const float corr = exp2f(m[g] - mx);  // m = -inf at first: 0, mx is finite
        m[g] = mx;
        l[g] *= corr;
#pragma unroll
        for (int i = 0; i < EPT; ++i) acc[g][i] *= corr;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) s[u][g] = exp2f(s[u][g] - mx);
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        if (base + u * NRG + rg < r1) {
          float vf[EPT];
#pragma unroll
          for (int j = 0; j < NV; ++j) Vec<T>::to_float(vr[u][j], &vf[j * VEC]);
#pragma unroll
          for (int g = 0; g < GT; ++g) {
            const float p = s[u][g];
            l[g] += p;
#pragma unroll
            for (int i = 0; i < EPT; ++i) acc[g][i] = fmaf(p, vf[i], acc[g][i]);
          }
        }
      }
    }
#if EDGE_DECODE_PREFETCH
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        kr[u][j] = kn[u][j];
        vr[u][j] = vn[u][j];
      }
    }
#endif
  }

  // Merge the row groups of each warp (lane bits above the row-group lanes).
#pragma unroll
  for (int off = TPR; off < 32; off <<= 1) {
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[g], off);
      const float lo = __shfl_xor_sync(0xffffffffu, l[g], off);
      const float mn = fmaxf(m[g], mo);
      const float ca = (m[g] == neg_inf()) ? 0.f : exp2f(m[g] - mn);
      const float cb = (mo == neg_inf()) ? 0.f : exp2f(mo - mn);
      l[g] = l[g] * ca + lo * cb;
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        const float ao = __shfl_xor_sync(0xffffffffu, acc[g][i], off);
        acc[g][i] = acc[g][i] * ca + ao * cb;
      }
      m[g] = mn;
    }
  }
  if (lane < TPR) {
#pragma unroll
    for (int g = 0; g < GT; ++g) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        float* dst = &sm_acc[warp][g][(lr + j * TPR) * VEC];
#pragma unroll
        for (int e = 0; e < VEC; e += 4)
          *reinterpret_cast<float4*>(dst + e) =
              make_float4(acc[g][j * VEC + e], acc[g][j * VEC + e + 1], acc[g][j * VEC + e + 2],
                          acc[g][j * VEC + e + 3]);
      }
      if (lane == 0) {
        sm_m[warp][g] = m[g];
        sm_l[warp][g] = l[g];
      }
    }
  }
  __syncthreads();

  // Merge the warps: output (one split) or this split's partial.
  const bool single = (nsplit == 1);
  float* ws_o = ws;
  float* ws_ml = ws + (long long)gridDim.z * nsplit * q_heads * D;
  for (int i = tid; i < gcount * (D / 4); i += kDecodeThreads) {
    const int g = i / (D / 4);
    const int d = (i - g * (D / 4)) * 4;
    float M = neg_inf();
#pragma unroll
    for (int w = 0; w < WARPS; ++w) M = fmaxf(M, sm_m[w][g]);
    float L = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float mw = sm_m[w][g];
      if (mw != neg_inf()) {
        const float c = exp2f(mw - M);
        L += sm_l[w][g] * c;
        const float4 a = *reinterpret_cast<const float4*>(&sm_acc[w][g][d]);
        o.x += a.x * c;
        o.y += a.y * c;
        o.z += a.z * c;
        o.w += a.w * c;
      }
    }
    const int head = head0 + g;
    if (single) {
      const float inv = 1.f / L;
      store4(out + ((long long)tok * q_heads + head) * D + d,
             make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv));
    } else {
      const long long pidx = ((long long)tok * nsplit + split) * q_heads + head;
      *reinterpret_cast<float4*>(ws_o + pidx * D + d) = o;
      if (d == 0) *reinterpret_cast<float2*>(ws_ml + pidx * 2) = make_float2(M, L);
    }
  }
  if (single) return;

  // Ticket: the last split CTA of this (token, KV head, chunk) merges the splits.
  __threadfence();
  __syncthreads();
  const int cidx = blockIdx.z * gridDim.x + blockIdx.x;
  if (tid == 0) {
    const unsigned int prev = atomicAdd(&counters[cidx], 1u);
    sm_last = (prev == (unsigned int)(nsplit - 1));
  }
  __syncthreads();
  if (!sm_last) return;
  __threadfence();
  if (tid == 0) counters[cidx] = 0u;  // ready for the next launch (graph replay too)

  for (int sidx = tid; sidx < nsplit; sidx += kDecodeThreads) {
    for (int g = 0; g < gcount; ++g) {
      const long long pidx = ((long long)tok * nsplit + sidx) * q_heads + head0 + g;
      const float2 ml = __ldcg(reinterpret_cast<const float2*>(ws_ml + pidx * 2));
      sm_sm[sidx][g] = ml.x;
      sm_sl[sidx][g] = ml.y;
    }
  }
  __syncthreads();
  if (tid < gcount) {
    float M = neg_inf();
    for (int sidx = 0; sidx < nsplit; ++sidx) M = fmaxf(M, sm_sm[sidx][tid]);
    float L = 0.f;
    for (int sidx = 0; sidx < nsplit; ++sidx)
      if (sm_sl[sidx][tid] > 0.f) L += sm_sl[sidx][tid] * exp2f(sm_sm[sidx][tid] - M);
    sm_M[tid] = M;
    sm_invL[tid] = 1.f / L;
  }
  __syncthreads();
  for (int sidx = tid; sidx < nsplit; sidx += kDecodeThreads) {
    for (int g = 0; g < gcount; ++g) {
      sm_sm[sidx][g] =
          (sm_sl[sidx][g] > 0.f) ? exp2f(sm_sm[sidx][g] - sm_M[g]) * sm_invL[g] : 0.f;
    }
  }
  __syncthreads();
  for (int i = tid; i < gcount * (D / 4); i += kDecodeThreads) {
    const int g = i / (D / 4);
    const int d = (i - g * (D / 4)) * 4;
    const int head = head0 + g;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int sidx = 0; sidx < nsplit; ++sidx) {
      const float w = sm_sm[sidx][g];
      if (w != 0.f) {  // empty split (or underflow): skip, never 0 * x
        const long long pidx = ((long long)tok * nsplit + sidx) * q_heads + head;
        const float4 a = __ldcg(reinterpret_cast<const float4*>(ws_o + pidx * D + d));
        o.x = fmaf(w, a.x, o.x);
        o.y = fmaf(w, a.y, o.y);
        o.z = fmaf(w, a.z, o.z);
        o.w = fmaf(w, a.w, o.w);
      }
    }
    store4(out + ((long long)tok * q_heads + head) * D + d, o);
  }
}

}  // namespace edge

#if !defined(EDGE_DTYPE) || !defined(EDGE_HEAD_DIM)
#error "compile with EDGE_DTYPE and EDGE_HEAD_DIM defined (see edge/kernels/nvrtc.py)"
#endif

#define EDGE_DECODE_INST(G)                                                                     \
  extern "C" __global__ void __launch_bounds__(edge::kDecodeThreads, EDGE_DECODE_MIN_BLOCKS) paged_decode_g##G(         \
      edge_t* __restrict__ out, const edge_t* __restrict__ q, const edge_t* __restrict__ k_pool, \
      const edge_t* __restrict__ v_pool, const int* __restrict__ table,                         \
      const int* __restrict__ pos, int host_len, int kv_heads, int group, int log2_page,         \
      float scale_log2, float* __restrict__ ws, unsigned int* __restrict__ counters) {          \
    edge::paged_decode<edge_t, EDGE_HEAD_DIM, G>(out, q, k_pool, v_pool, table, pos, host_len,  \
                                                 kv_heads, group, log2_page, scale_log2, ws,    \
                                                 counters);                                     \
  }

EDGE_DECODE_INST(1)
EDGE_DECODE_INST(2)
EDGE_DECODE_INST(4)
EDGE_DECODE_INST(8)
