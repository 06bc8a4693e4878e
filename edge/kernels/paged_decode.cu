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
// Each CTA streams its rows through a STAGES-deep cp.async pipeline of 16-byte copies
// into shared memory (stages of ~8 KB of K and V rows gathered from the pages; rows at
// or past kv_len are never read), so several stages are in flight while one is
// computed. TPR threads per row, online softmax in float32 (exp2 domain), row groups
// merged with shuffles, warps through shared memory; then the CTA either writes the
// output (one split) or its partial as flagged words, and the last `mergers` splits of a
// (token, KV head, chunk) each merge a share of the outputs as the words arrive
// (common.cuh, the split merge). No second kernel; shared memory is fixed (independent
// of kv_len).
//
// With CFG_KV_INT8 the program holds the int8-KV entry points instead (paged_decode_q8_g*):
// pools of int8 codes with a float32 scale a row (common.cuh, "int8 K/V rows"); a stage
// holds the rows' codes (twice the rows of the same bytes) and scales, a key's score is
// its scale times the dot product with the codes, and its probability times its value
// scale weighs the value codes.
#include "common.cuh"

namespace edge {

constexpr int kDecodeThreads = 128;

// Tuning knobs (defines; nvrtc.py folds them into the cache key):
//   CFG_DECODE_QACC_REGS  registers per thread for q + the output accumulator; sets the
//                          threads per K/V row: fewer registers -> more lanes per row
//                          -> more shuffles per row
//   CFG_DECODE_STAGES     pipeline depth (stages of ~CFG_DECODE_STAGE_BYTES of K+V)
//   CFG_DECODE_STAGE_BYTES bytes of K + V per stage
//   CFG_DECODE_MIN_BLOCKS resident CTAs per SM asked of the register allocator (group
//                          tiles of 8 heads ask for 2: their q + acc alone need 128)
#ifndef CFG_DECODE_QACC_REGS
#define CFG_DECODE_QACC_REGS 64
#endif
#ifndef CFG_DECODE_STAGES
#define CFG_DECODE_STAGES 4
#endif
#ifndef CFG_DECODE_STAGE_BYTES
#define CFG_DECODE_STAGE_BYTES 8192
#endif
#ifndef CFG_DECODE_MIN_BLOCKS
#define CFG_DECODE_MIN_BLOCKS 4
#endif

template <typename T, int D, int GT, bool Q8 = false>
struct DecodeCfg {
  static constexpr int VEC = Vec<T>::N;  // elements per 16-byte vector of T (a thread's slice: VEC codes with Q8)
  static constexpr int NVEC = D / VEC;   // vectors per row
  static constexpr int TPR0 = GT * D * 2 / CFG_DECODE_QACC_REGS;
  static constexpr int TPR_MIN = NVEC / 2;  // <= 2 vectors per thread per row
  static constexpr int TPR = TPR0 < TPR_MIN ? TPR_MIN : (TPR0 > NVEC ? NVEC : TPR0);
  static constexpr int NV = NVEC / TPR;                // vectors per thread per row
  static constexpr int EPT = NV * VEC;                 // elements per thread per row
  static constexpr int NRG = kDecodeThreads / TPR;     // row groups per CTA
  static constexpr int EB = Q8 ? 1 : (int)sizeof(T);  // bytes an element of the pools
  static constexpr int ROW_BYTES = D * EB;
  static constexpr int RCH = ROW_BYTES / 16;           // 16-byte chunks a row
  static constexpr int ROWS0 = CFG_DECODE_STAGE_BYTES / (2 * ROW_BYTES);
  static constexpr int ROWS_STAGE = ROWS0 < NRG ? NRG : ROWS0;  // rows per stage
  static constexpr int UNROLL = ROWS_STAGE / NRG;      // rows per row group per stage
  static constexpr int STAGES = CFG_DECODE_STAGES;
  static constexpr int STAGE_ELEMS = ROWS_STAGE * D;   // of K (V as many)
  static constexpr int CHUNKS = ROWS_STAGE * RCH;      // 16-byte copies of K per stage
  static constexpr int WARPS = kDecodeThreads / 32;
  // Shared memory: the pipeline (Q8: then each stage's K and V scales), later reused for
  // the merges.
  static constexpr int DATA_BYTES = STAGES * 2 * STAGE_ELEMS * EB;
  static constexpr int PIPE_BYTES = DATA_BYTES + (Q8 ? STAGES * 2 * ROWS_STAGE * 4 : 0);
  static constexpr int ACC_BYTES = WARPS * GT * D * 4;
  static constexpr int SMEM_BYTES = PIPE_BYTES > ACC_BYTES ? PIPE_BYTES : ACC_BYTES;
  static_assert(NVEC % TPR == 0, "bad TPR");
  static_assert(32 % TPR == 0, "row group must not straddle warps");
  static_assert(ROWS_STAGE % NRG == 0, "stage rows must split over row groups");
  static_assert(CHUNKS % kDecodeThreads == 0, "stage copies must split over threads");
  static_assert(STAGES >= 2, "need at least two stages");
  static_assert(!Q8 || ROWS_STAGE <= kDecodeThreads, "a thread copies a row's scales");
  static_assert(SMEM_BYTES <= 48 * 1024, "static shared memory over 48 KB");
};

// The pools' element type: T, or int8 codes.
template <typename T, bool Q8>
struct PoolElem {
  typedef T type;
};
template <typename T>
struct PoolElem<T, true> {
  typedef signed char type;
};

// VEC codes at p (VEC bytes, VEC-aligned) as floats.
template <int VEC>
__device__ __forceinline__ void codes_to_float(const signed char* p, float* f) {
  static_assert(VEC == 4 || VEC == 8, "4 or 8 codes");
  unsigned int w[VEC / 4];
  if constexpr (VEC == 8) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    w[0] = u.x;
    w[1] = u.y;
  } else {
    w[0] = *reinterpret_cast<const unsigned int*>(p);
  }
#pragma unroll
  for (int i = 0; i < VEC; ++i) f[i] = static_cast<float>(static_cast<signed char>((w[i / 4] >> (8 * (i % 4))) & 0xffu));
}

template <typename T, int D, int GT, bool Q8 = false>
__device__ __forceinline__ void paged_decode(
    T* __restrict__ out,             // [tokens, q_heads, D]
    const T* __restrict__ q,         // [tokens, q_heads, D]
    const typename PoolElem<T, Q8>::type* __restrict__ k_pool,  // [num_blocks, page, kv_heads, D]
    const typename PoolElem<T, Q8>::type* __restrict__ v_pool,  // [num_blocks, page, kv_heads, D]
    const float* __restrict__ k_scale,  // Q8: [num_blocks, page, kv_heads]; else null
    const float* __restrict__ v_scale,
    const int* __restrict__ table,   // [max_blocks]
    const int* __restrict__ pos,     // device position (kv_len = *pos + 1) or null
    int host_len,                    // kv_len of token 0 when pos is null
    int kv_heads, int group, int log2_page, float scale_log2,
    unsigned long long* __restrict__ ws,  // [tokens, num_splits, q_heads, D] split words (num_splits > 1)
    unsigned int* __restrict__ counters,  // arrivals per group (mergers = 0)
    int mergers,                     // most splits per group that merge; 0: the last to arrive
    int min_rows) {                  // fewest keys per active split (active_splits)
  using C = DecodeCfg<T, D, GT, Q8>;
  using KV = typename PoolElem<T, Q8>::type;
  constexpr int VEC = C::VEC, TPR = C::TPR, NV = C::NV, EPT = C::EPT, UNROLL = C::UNROLL;
  constexpr int NRG = C::NRG, WARPS = C::WARPS, STAGES = C::STAGES, RCH = C::RCH;
  constexpr int ROWS_STAGE = C::ROWS_STAGE;
  constexpr int CV = 16 / C::EB;  // elements a 16-byte copy

  __shared__ __align__(16) unsigned char smem[C::SMEM_BYTES];
  __shared__ float sm_m[WARPS][GT];
  __shared__ float sm_l[WARPS][GT];
  __shared__ int sm_merger;
  KV* pipe = reinterpret_cast<KV*>(smem);  // stage s: K at s * 2 * STAGE_ELEMS, then V
  float* sm_scale = reinterpret_cast<float*>(smem + C::DATA_BYTES);  // Q8: stage s's K scales, then V
  float(*sm_acc)[GT][D] = reinterpret_cast<float(*)[GT][D]>(smem);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int lr = lane % TPR;  // lane within the row group
  const int rg = tid / TPR;   // row group within the CTA
  const int hchunks = (group + GT - 1) / GT;
  const int kvh = blockIdx.x / hchunks;
  const int chunk = blockIdx.x - kvh * hchunks;
  const int gcount = min(GT, group - chunk * GT);
  const int q_heads = kv_heads * group;
  const int head0 = kvh * group + chunk * GT;
  const int tok = blockIdx.z;
  const int split = blockIdx.y;
  const int grid_splits = gridDim.y;  // the workspace layout

  await_inputs();
  const int kv_len = (pos != nullptr ? __ldg(pos) + 1 : host_len) + tok;
  const int nsplit = active_splits(kv_len, grid_splits, min_rows);
  if (split >= nsplit) return;
  const bool by_arrival = mergers == 0;
  mergers = split_mergers(nsplit, mergers);

  // This split's rows [r0, r1): the partition is derived from kv_len here, so the
  // launch does not depend on it.
  int r0, r1;
  split_range(kv_len, split, nsplit, ROWS_STAGE, r0, r1);
  const int nstage = (r1 - r0 + ROWS_STAGE - 1) / ROWS_STAGE;

  const long long row_stride = (long long)kv_heads * D;  // elements between slots
  const long long head_off = (long long)kvh * D;

  // Gather stage `s` (rows r0 + s * ROWS_STAGE ...) into pipeline buffer s % STAGES.
  auto load_stage = [&](int s) {
    if (s < nstage) {
      KV* dk = pipe + (s % STAGES) * 2 * C::STAGE_ELEMS;
      KV* dv = dk + C::STAGE_ELEMS;
      const int sbase = r0 + s * ROWS_STAGE;
#pragma unroll
      for (int it = 0; it < C::CHUNKS / kDecodeThreads; ++it) {
        const int c = tid + it * kDecodeThreads;
        const int r = c / RCH;
        const int cc = c - r * RCH;
        const int row = sbase + r;
        const KV* ks = k_pool;
        const KV* vs = v_pool;
        int bytes = 0;
        if (row < r1) {
          const long long off = paged_slot(table, row, log2_page) * row_stride + head_off + cc * CV;
          ks = k_pool + off;
          vs = v_pool + off;
          bytes = 16;
        }
        cp_async16(smem_u32(dk + r * D + cc * CV), ks, bytes);
        cp_async16(smem_u32(dv + r * D + cc * CV), vs, bytes);
      }
      if constexpr (Q8) {
        if (tid < ROWS_STAGE) {  // row tid's scales; zero past r1 (never read from the pool)
          const int row = sbase + tid;
          const bool ok = row < r1;
          const long long so = ok ? paged_slot(table, row, log2_page) * kv_heads + kvh : 0;
          float* ds = sm_scale + (s % STAGES) * 2 * ROWS_STAGE + tid;
          cp_async4(smem_u32(ds), k_scale + so, ok ? 4 : 0);
          cp_async4(smem_u32(ds + ROWS_STAGE), v_scale + so, ok ? 4 : 0);
        }
      }
    }
    cp_async_commit();  // (possibly empty) group: keeps the group count uniform
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) load_stage(s);

  // Query slice of this thread, pre-scaled into the exp2 domain (loads overlap the
  // pipeline's first copies).
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

  for (int s = 0; s < nstage; ++s) {
    cp_async_wait<STAGES - 2>();  // this thread's copies of stage s landed
    __syncthreads();              // everyone's did, and everyone is done with stage s - 1
    load_stage(s + STAGES - 1);   // into the buffer of stage s - 1

    const KV* sk = pipe + (s % STAGES) * 2 * C::STAGE_ELEMS;
    const KV* sv = sk + C::STAGE_ELEMS;
    const float* sks = sm_scale + (s % STAGES) * 2 * ROWS_STAGE;  // Q8
    const int sbase = r0 + s * ROWS_STAGE;

    // Scores (every lane takes part in the shuffles; rows past r1 are masked below by
    // a branch, never by multiplication).
    float sc[UNROLL][GT];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int r = u * NRG + rg;
      float kf[EPT];
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        if constexpr (Q8) {
          codes_to_float<VEC>(sk + r * D + (lr + j * TPR) * VEC, &kf[j * VEC]);
        } else {
          const uint4 kv = *reinterpret_cast<const uint4*>(sk + r * D + (lr + j * TPR) * VEC);
          Vec<T>::to_float(kv, &kf[j * VEC]);
        }
      }
#pragma unroll
      for (int g = 0; g < GT; ++g) {
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < EPT; ++i) a = fmaf(qf[g][i], kf[i], a);
        sc[u][g] = a;
      }
    }
#pragma unroll
    for (int off = TPR / 2; off > 0; off >>= 1) {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
        for (int g = 0; g < GT; ++g) sc[u][g] += __shfl_xor_sync(0xffffffffu, sc[u][g], off);
      }
    }
    if constexpr (Q8) {  // the key scales (0 past r1: masked below anyway)
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const float ksc = sks[u * NRG + rg];
#pragma unroll
        for (int g = 0; g < GT; ++g) sc[u][g] *= ksc;
      }
    }

    if (sbase + rg < r1) {  // row u = 0 is valid, so this group has work in this stage
#pragma unroll
      for (int g = 0; g < GT; ++g) {
        float mx = m[g];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
          if (sbase + u * NRG + rg < r1) mx = fmaxf(mx, sc[u][g]);
        const float corr = exp2f(m[g] - mx);  // m = -inf at first: 0, mx is finite
        m[g] = mx;
        l[g] *= corr;
#pragma unroll
        for (int i = 0; i < EPT; ++i) acc[g][i] *= corr;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) sc[u][g] = exp2f(sc[u][g] - mx);
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int r = u * NRG + rg;
        if (sbase + r < r1) {
          float vf[EPT];
          float vsc = 1.f;  // Q8: the value scale weighs the probability
#pragma unroll
          for (int j = 0; j < NV; ++j) {
            if constexpr (Q8) {
              codes_to_float<VEC>(sv + r * D + (lr + j * TPR) * VEC, &vf[j * VEC]);
              vsc = sks[ROWS_STAGE + r];
            } else {
              const uint4 vv = *reinterpret_cast<const uint4*>(sv + r * D + (lr + j * TPR) * VEC);
              Vec<T>::to_float(vv, &vf[j * VEC]);
            }
          }
#pragma unroll
          for (int g = 0; g < GT; ++g) {
            const float p = sc[u][g];
            l[g] += p;
            const float pv = Q8 ? p * vsc : p;
#pragma unroll
            for (int i = 0; i < EPT; ++i) acc[g][i] = fmaf(pv, vf[i], acc[g][i]);
          }
        }
      }
    }
  }
  cp_async_wait_all();
  __syncthreads();  // the pipeline buffers become sm_acc

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

  // Merge the warps: output (one split) or this split's words (always written, also for
  // an empty split: lse = -inf, o = 0).
  const bool single = (nsplit == 1);
  for (int i = tid; i < gcount * (D / 4); i += kDecodeThreads) {
    const int g = i / (D / 4);
    const int d = (i - g * (D / 4)) * 4;
    float M, L;
    const float4 o = merge_warp_partials<WARPS>(sm_m, sm_l, sm_acc, g, d, M, L);
    const int head = head0 + g;
    const long long pidx = ((long long)tok * grid_splits + split) * q_heads + head;
    store_split_words(single, out + ((long long)tok * q_heads + head) * D, ws + pidx * D, o, M, L, d);
  }
  if (single) return;

  const int k = split_merger(by_arrival, counters + blockIdx.z * gridDim.x + blockIdx.x, split, nsplit, mergers,
                             sm_merger);
  if (k >= 0) {
    const long long row = (long long)tok * grid_splits * q_heads + head0;  // split 0's words of head0
    merge_split_words<kDecodeThreads, D>(out + ((long long)tok * q_heads + head0) * D, ws + row * D,
                                         (long long)q_heads * D, nsplit, gcount, k, mergers);
  }
}

}  // namespace edge

#if !defined(CFG_DTYPE) || !defined(CFG_HEAD_DIM)
#error "compile with CFG_DTYPE and CFG_HEAD_DIM defined (see edge/kernels/nvrtc.py)"
#endif

#ifndef CFG_KV_INT8
#define CFG_KV_INT8 0
#endif
#if CFG_KV_INT8
#define EDGE_DECODE_POOLS                                                                                  \
  const signed char *__restrict__ k_pool, const signed char *__restrict__ v_pool,                          \
      const float *__restrict__ k_scale, const float *__restrict__ v_scale
#define EDGE_DECODE_POOL_ARGS k_pool, v_pool, k_scale, v_scale
#define EDGE_DECODE_NAME(G) paged_decode_q8_g##G
#else
#define EDGE_DECODE_POOLS const edge_t *__restrict__ k_pool, const edge_t *__restrict__ v_pool
#define EDGE_DECODE_POOL_ARGS k_pool, v_pool, nullptr, nullptr
#define EDGE_DECODE_NAME(G) paged_decode_g##G
#endif

#define CFG_DECODE_INST(G)                                                                                   \
  extern "C" __global__ void __launch_bounds__(edge::kDecodeThreads, (G) >= 8 ? 2 : CFG_DECODE_MIN_BLOCKS)   \
      EDGE_DECODE_NAME(G)(edge_t* __restrict__ out, const edge_t* __restrict__ q, EDGE_DECODE_POOLS,         \
                          const int* __restrict__ table, const int* __restrict__ pos, int host_len,          \
                          int kv_heads, int group, int log2_page, float scale_log2,                          \
                          unsigned long long* __restrict__ ws, unsigned int* __restrict__ counters,          \
                          int mergers, int min_rows) {                                                       \
    edge::paged_decode<edge_t, CFG_HEAD_DIM, G, CFG_KV_INT8 != 0>(out, q, EDGE_DECODE_POOL_ARGS, table, pos,  \
                                                                  host_len, kv_heads, group, log2_page,      \
                                                                  scale_log2, ws, counters, mergers, min_rows); \
  }

CFG_DECODE_INST(1)
CFG_DECODE_INST(2)
CFG_DECODE_INST(4)
CFG_DECODE_INST(8)
