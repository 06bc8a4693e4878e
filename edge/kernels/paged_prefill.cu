// Paged causal prefill attention (float16 / bfloat16, tensor cores: mma.sync m16n8k16,
// sm_80+, so the same code runs on sm_87 and sm_90).
//
// A chunk of T new tokens at positions [start, start + T) attends to the paged prefix
// and to itself (its K/V already written). For one KV head the T * group query rows
// (token-major, head-in-group minor) are flattened, so K/V tiles are shared by the
// whole GQA group. Grid: x = ceil(T * group / 64) row tiles (heaviest first), y =
// kv_heads. 4 warps, 16 query rows each; keys in tiles of 64 gathered from the pages by
// cp.async into padded shared memory (K and V single buffers, 2 x 17 KB for D = 128:
// V of tile j loads while S = Q K^T is computed, K of tile j + 1 while O += P V is);
// FlashAttention-2 style online softmax in float32 registers, P re-used as the A
// operand of the P V product, V read with ldmatrix.trans. Keys past the last one the
// tile needs are zero-filled (cp.async src-size 0), never read from the pool.
//
// With CFG_KV_INT8 the program holds the int8-KV entry point instead (paged_prefill_q8):
// pools of int8 codes with a float32 scale a row (common.cuh, "int8 K/V rows"); the
// tiles hold the codes (rows of D + 16 bytes) and scales, Q K^T and P V run on float16
// tensor cores over the exact codes, the key scales multiply the scores and the value
// scales the probabilities (o kept in units of the largest value scale seen).
#include "common.cuh"

namespace edge {

constexpr int kPfThreads = 128;
constexpr int kBM = 64;  // query rows per CTA
constexpr int kBN = 64;  // keys per tile

// The pools' element type: T, or int8 codes.
template <typename T, bool Q8>
struct PrefillElem {
  typedef T type;
};
template <typename T>
struct PrefillElem<T, true> {
  typedef signed char type;
};

template <typename T, int D, bool Q8 = false>
__device__ __forceinline__ void paged_prefill(
    T* __restrict__ out,            // [T, q_heads, D]
    const T* __restrict__ q,        // [T, q_heads, D]
    const typename PrefillElem<T, Q8>::type* __restrict__ k_pool,  // [num_blocks, page, kv_heads, D]
    const typename PrefillElem<T, Q8>::type* __restrict__ v_pool,
    const float* __restrict__ k_scale,  // Q8: [num_blocks, page, kv_heads]; else null
    const float* __restrict__ v_scale,
    const int* __restrict__ table,  // [max_blocks]
    int num_tokens, int start, int kv_heads, int group, int log2_page, float scale_log2) {
  using KV = typename PrefillElem<T, Q8>::type;
  // Padded smem row (elements): conflict-free fragment loads (int8: 8 rows 4 banks apart).
  constexpr int LDS = Q8 ? D + 16 : D + 8;
  constexpr int KSTEPS = D / 16;
  constexpr int NT_D = D / 8;
  constexpr int NT_N = kBN / 8;
  constexpr int CV = Q8 ? 16 : 8;  // elements a 16-byte chunk
  constexpr int CHUNKS = D / CV;   // 16-byte chunks per row
  __shared__ __align__(16) KV sK[kBN * LDS];
  __shared__ __align__(16) KV sV[kBN * LDS];
  __shared__ __align__(16) float sKs[Q8 ? kBN : 1];  // Q8: the tiles' scales
  __shared__ __align__(16) float sVs[Q8 ? kBN : 1];

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int gid = lane >> 2;
  const int tig = lane & 3;
  const int kvh = blockIdx.y;
  const int mt = gridDim.x - 1 - blockIdx.x;  // heaviest (latest) row tiles first
  const int rows = num_tokens * group;
  const int q_heads = kv_heads * group;
  const int row_base = mt * kBM + warp * 16;

  const int cta_last_row = min(rows - 1, mt * kBM + kBM - 1);
  const int kmax = start + cta_last_row / group;  // last key any row of this CTA sees
  const int n_keys = kmax + 1;
  const int warp_qp_min = start + min(row_base, rows - 1) / group;

  int qp[2];
  bool rvalid[2];
  long long qoff[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = row_base + gid + 8 * i;
    rvalid[i] = r < rows;
    const int tk = rvalid[i] ? r / group : 0;
    const int gi = rvalid[i] ? r - tk * group : 0;
    qp[i] = rvalid[i] ? start + tk : kmax;
    qoff[i] = ((long long)tk * q_heads + kvh * group + gi) * D;
  }

  // Q fragments (A operand, row-major 16 x 16 per k-step; Q8: float16, permuted columns).
  unsigned int qa[KSTEPS][4];
  float rs[2] = {scale_log2, scale_log2};  // Q8: each row's score factor
  if constexpr (Q8) {
    q_fragments_int8<T, D>(qa, rvalid[0] ? q + qoff[0] : nullptr, rvalid[1] ? q + qoff[1] : nullptr, scale_log2, rs);
  } else {
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      const int c0 = ks * 16 + tig * 2;
      qa[ks][0] = rvalid[0] ? *reinterpret_cast<const unsigned int*>(q + qoff[0] + c0) : 0u;
      qa[ks][1] = rvalid[1] ? *reinterpret_cast<const unsigned int*>(q + qoff[1] + c0) : 0u;
      qa[ks][2] = rvalid[0] ? *reinterpret_cast<const unsigned int*>(q + qoff[0] + c0 + 8) : 0u;
      qa[ks][3] = rvalid[1] ? *reinterpret_cast<const unsigned int*>(q + qoff[1] + c0 + 8) : 0u;
    }
  }

  float o[NT_D][4];
#pragma unroll
  for (int n = 0; n < NT_D; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float mrow[2] = {neg_inf(), neg_inf()};
  float lrow[2] = {0.f, 0.f};
  float vref = 0.f, vinv = 0.f;  // Q8: o's unit, the largest value scale seen, and its inverse

  const long long row_stride = (long long)kv_heads * D;
  const long long head_off = (long long)kvh * D;

  auto load_tile = [&](KV* sdst, const KV* __restrict__ pool, float* sscale, const float* __restrict__ scale,
                       int key0) {
    static_assert((kBN * CHUNKS) % kPfThreads == 0, "tile chunks must split evenly");
    static_assert(kBN <= kPfThreads, "a thread copies a row's scale");
#pragma unroll
    for (int it = 0; it < kBN * CHUNKS / kPfThreads; ++it) {
      const int c = tid + it * kPfThreads;
      const int r = c / CHUNKS;
      const int cc = c - r * CHUNKS;
      const int key = key0 + r;
      const KV* src = pool;
      int bytes = 0;
      if (key < n_keys) {
        src = pool + paged_slot(table, key, log2_page) * row_stride + head_off + cc * CV;
        bytes = 16;
      }
      cp_async16(smem_u32(sdst + r * LDS + cc * CV), src, bytes);
    }
    if constexpr (Q8) {
      if (tid < kBN) {  // key tid's scale; zero past the last key (never read from the pool)
        const int key = key0 + tid;
        const bool ok = key < n_keys;
        const long long so = ok ? paged_slot(table, key, log2_page) * kv_heads + kvh : 0;
        cp_async4(smem_u32(sscale + tid), scale + so, ok ? 4 : 0);
      }
    }
    cp_async_commit();
  };

  const int n_tiles = (n_keys + kBN - 1) / kBN;
  load_tile(sK, k_pool, sKs, k_scale, 0);
  cp_async_wait_all();
  __syncthreads();

  for (int kt = 0; kt < n_tiles; ++kt) {
    const int key0 = kt * kBN;
    load_tile(sV, v_pool, sVs, v_scale, key0);  // lands while S is computed

    float s[NT_N][4];
#pragma unroll
    for (int j = 0; j < NT_N; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
#pragma unroll
      for (int j = 0; j < NT_N; ++j) {
        if constexpr (Q8) {  // codes 16 ks + 4 t .. + 3 of key j * 8 + g: the permuted k of qa
          const unsigned int x =
              *reinterpret_cast<const unsigned int*>(sK + (j * 8 + gid) * LDS + ks * 16 + tig * 4) ^ 0x80808080u;
          mma16816<__half>(s[j], qa[ks], codes_h2<0x4140u>(x), codes_h2<0x4342u>(x));
        } else {
          const KV* kp = sK + (j * 8 + gid) * LDS + ks * 16 + tig * 2;
          const unsigned int b0 = *reinterpret_cast<const unsigned int*>(kp);
          const unsigned int b1 = *reinterpret_cast<const unsigned int*>(kp + 8);
          mma16816<T>(s[j], qa[ks], b0, b1);
        }
      }
    }

    const bool need_mask = key0 + kBN - 1 > warp_qp_min;
#pragma unroll
    for (int j = 0; j < NT_N; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float x = Q8 ? s[j][c] * rs[c >> 1] * sKs[j * 8 + tig * 2 + (c & 1)] : s[j][c] * scale_log2;
        if (need_mask) {
          const int key = key0 + j * 8 + tig * 2 + (c & 1);
          if (key > qp[c >> 1]) x = neg_inf();
        }
        s[j][c] = x;
      }
    }

    float corr[2];
    mma_online_softmax<NT_N>(s, mrow, lrow, corr);
    if constexpr (!Q8) mma_scale_rows<NT_D>(o, corr);

    cp_async_wait_all();  // V of this tile landed
    __syncthreads();      // ... for every warp, and every warp is done with sK
    if (kt + 1 < n_tiles) load_tile(sK, k_pool, sKs, k_scale, key0 + kBN);  // lands during P V

    if constexpr (Q8) {
      // The probabilities times value scale / vref (float16 range); o to a larger vref first.
      float vmax = 0.f;
#pragma unroll
      for (int j = 0; j < NT_N; ++j) vmax = fmaxf(vmax, fmaxf(sVs[j * 8 + tig * 2], sVs[j * 8 + tig * 2 + 1]));
      vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 1));
      vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 2));
      if (vmax > vref) {
        corr[0] *= vref / vmax;
        corr[1] *= vref / vmax;
        vref = vmax;
        vinv = 1.f / vmax;
      }
      mma_scale_rows<NT_D>(o, corr);
#pragma unroll
      for (int j = 0; j < NT_N; ++j) {
#pragma unroll
        for (int c = 0; c < 4; ++c) s[j][c] *= sVs[j * 8 + tig * 2 + (c & 1)] * vinv;
      }
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) mma_pv16_int8<D>(o, s[2 * kk], s[2 * kk + 1], sV + kk * 16 * LDS, LDS);
    } else {
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) mma_pv16<T, D>(o, s[2 * kk], s[2 * kk + 1], sV + kk * 16 * LDS, LDS);
    }

    cp_async_wait_all();  // next K landed
    __syncthreads();      // ... and every warp is done with sV
  }

  float inv[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float lsum = lrow[i];
    lsum += __shfl_xor_sync(0xffffffffu, lsum, 1);
    lsum += __shfl_xor_sync(0xffffffffu, lsum, 2);
    inv[i] = 1.f / lsum;
  }
  if constexpr (Q8) {  // columns 16 c + 4 t + {0..3} from the even / odd tiles (mma_pv16_int8), in units of vref
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float f = inv[i] * vref;
#pragma unroll
      for (int c = 0; c < D / 16; ++c) {
        if (rvalid[i])
          *reinterpret_cast<uint2*>(out + qoff[i] + c * 16 + tig * 4) =
              make_uint2(pack2<T>(o[2 * c][2 * i] * f, o[2 * c + 1][2 * i] * f),
                         pack2<T>(o[2 * c][2 * i + 1] * f, o[2 * c + 1][2 * i + 1] * f));
      }
    }
  } else {
#pragma unroll
    for (int n = 0; n < NT_D; ++n) {
      const int col = n * 8 + tig * 2;
      if (rvalid[0])
        *reinterpret_cast<unsigned int*>(out + qoff[0] + col) =
            pack2<T>(o[n][0] * inv[0], o[n][1] * inv[0]);
      if (rvalid[1])
        *reinterpret_cast<unsigned int*>(out + qoff[1] + col) =
            pack2<T>(o[n][2] * inv[1], o[n][3] * inv[1]);
    }
  }
}

}  // namespace edge

#if !defined(CFG_DTYPE) || !defined(CFG_HEAD_DIM)
#error "compile with CFG_DTYPE and CFG_HEAD_DIM defined (see edge/kernels/nvrtc.py)"
#endif
#if CFG_DTYPE == 3
#error "paged_prefill.cu is float16/bfloat16 only (float32 prefill uses paged_decode.cu)"
#endif

#ifndef CFG_KV_INT8
#define CFG_KV_INT8 0
#endif

#if CFG_KV_INT8
extern "C" __global__ void __launch_bounds__(edge::kPfThreads)
    paged_prefill_q8(edge_t* __restrict__ out, const edge_t* __restrict__ q, const signed char* __restrict__ k_pool,
                     const signed char* __restrict__ v_pool, const float* __restrict__ k_scale,
                     const float* __restrict__ v_scale, const int* __restrict__ table, int num_tokens, int start,
                     int kv_heads, int group, int log2_page, float scale_log2) {
  edge::await_inputs();
  edge::paged_prefill<edge_t, CFG_HEAD_DIM, true>(out, q, k_pool, v_pool, k_scale, v_scale, table, num_tokens, start,
                                                   kv_heads, group, log2_page, scale_log2);
}
#else
extern "C" __global__ void __launch_bounds__(edge::kPfThreads)
    paged_prefill(edge_t* __restrict__ out, const edge_t* __restrict__ q,
                  const edge_t* __restrict__ k_pool, const edge_t* __restrict__ v_pool,
                  const int* __restrict__ table, int num_tokens, int start, int kv_heads,
                  int group, int log2_page, float scale_log2) {
  edge::await_inputs();
  edge::paged_prefill<edge_t, CFG_HEAD_DIM>(out, q, k_pool, v_pool, nullptr, nullptr, table, num_tokens, start,
                                             kv_heads, group, log2_page, scale_log2);
}
#endif
