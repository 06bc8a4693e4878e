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
#include "common.cuh"

namespace edge {

constexpr int kPfThreads = 128;
constexpr int kBM = 64;  // query rows per CTA
constexpr int kBN = 64;  // keys per tile

template <typename T, int D>
__device__ __forceinline__ void paged_prefill(
    T* __restrict__ out,            // [T, q_heads, D]
    const T* __restrict__ q,        // [T, q_heads, D]
    const T* __restrict__ k_pool,   // [num_blocks, page, kv_heads, D]
    const T* __restrict__ v_pool,
    const int* __restrict__ table,  // [max_blocks]
    int num_tokens, int start, int kv_heads, int group, int log2_page, float scale_log2) {
  constexpr int LDS = D + 8;  // padded smem row (elements): conflict-free fragment loads
  constexpr int KSTEPS = D / 16;
  constexpr int NT_D = D / 8;
  constexpr int NT_N = kBN / 8;
  constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
  __shared__ __align__(16) T sK[kBN * LDS];
  __shared__ __align__(16) T sV[kBN * LDS];

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

  // Q fragments (A operand, row-major 16 x 16 per k-step).
  unsigned int qa[KSTEPS][4];
#pragma unroll
  for (int ks = 0; ks < KSTEPS; ++ks) {
    const int c0 = ks * 16 + tig * 2;
    qa[ks][0] = rvalid[0] ? *reinterpret_cast<const unsigned int*>(q + qoff[0] + c0) : 0u;
    qa[ks][1] = rvalid[1] ? *reinterpret_cast<const unsigned int*>(q + qoff[1] + c0) : 0u;
    qa[ks][2] = rvalid[0] ? *reinterpret_cast<const unsigned int*>(q + qoff[0] + c0 + 8) : 0u;
    qa[ks][3] = rvalid[1] ? *reinterpret_cast<const unsigned int*>(q + qoff[1] + c0 + 8) : 0u;
  }

  float o[NT_D][4];
#pragma unroll
  for (int n = 0; n < NT_D; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float mrow[2] = {neg_inf(), neg_inf()};
  float lrow[2] = {0.f, 0.f};

  const long long row_stride = (long long)kv_heads * D;
  const long long head_off = (long long)kvh * D;

  auto load_tile = [&](T* sdst, const T* __restrict__ pool, int key0) {
    static_assert((kBN * CHUNKS) % kPfThreads == 0, "tile chunks must split evenly");
#pragma unroll
    for (int it = 0; it < kBN * CHUNKS / kPfThreads; ++it) {
      const int c = tid + it * kPfThreads;
      const int r = c / CHUNKS;
      const int cc = c - r * CHUNKS;
      const int key = key0 + r;
      const T* src = pool;
      int bytes = 0;
      if (key < n_keys) {
        src = pool + paged_slot(table, key, log2_page) * row_stride + head_off + cc * 8;
        bytes = 16;
      }
      cp_async16(smem_u32(sdst + r * LDS + cc * 8), src, bytes);
    }
    cp_async_commit();
  };

  const int n_tiles = (n_keys + kBN - 1) / kBN;
  load_tile(sK, k_pool, 0);
  cp_async_wait_all();
  __syncthreads();

  for (int kt = 0; kt < n_tiles; ++kt) {
    const int key0 = kt * kBN;
    load_tile(sV, v_pool, key0);  // lands while S is computed

    float s[NT_N][4];
#pragma unroll
    for (int j = 0; j < NT_N; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
#pragma unroll
      for (int j = 0; j < NT_N; ++j) {
        const T* kp = sK + (j * 8 + gid) * LDS + ks * 16 + tig * 2;
        const unsigned int b0 = *reinterpret_cast<const unsigned int*>(kp);
        const unsigned int b1 = *reinterpret_cast<const unsigned int*>(kp + 8);
        mma16816<T>(s[j], qa[ks], b0, b1);
      }
    }

    const bool need_mask = key0 + kBN - 1 > warp_qp_min;
#pragma unroll
    for (int j = 0; j < NT_N; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float x = s[j][c] * scale_log2;
        if (need_mask) {
          const int key = key0 + j * 8 + tig * 2 + (c & 1);
          if (key > qp[c >> 1]) x = neg_inf();
        }
        s[j][c] = x;
      }
    }

    float corr[2];
    mma_online_softmax<NT_N>(s, mrow, lrow, corr);
    mma_scale_rows<NT_D>(o, corr);

    cp_async_wait_all();  // V of this tile landed
    __syncthreads();      // ... for every warp, and every warp is done with sK
    if (kt + 1 < n_tiles) load_tile(sK, k_pool, key0 + kBN);  // lands during P V

#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) mma_pv16<T, D>(o, s[2 * kk], s[2 * kk + 1], sV + kk * 16 * LDS, LDS);

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

}  // namespace edge

#if !defined(CFG_DTYPE) || !defined(CFG_HEAD_DIM)
#error "compile with CFG_DTYPE and CFG_HEAD_DIM defined (see edge/kernels/nvrtc.py)"
#endif
#if CFG_DTYPE == 3
#error "paged_prefill.cu is float16/bfloat16 only (float32 prefill uses paged_decode.cu)"
#endif

extern "C" __global__ void __launch_bounds__(edge::kPfThreads)
    paged_prefill(edge_t* __restrict__ out, const edge_t* __restrict__ q,
                  const edge_t* __restrict__ k_pool, const edge_t* __restrict__ v_pool,
                  const int* __restrict__ table, int num_tokens, int start, int kv_heads,
                  int group, int log2_page, float scale_log2) {
  edge::await_inputs();
  edge::paged_prefill<edge_t, CFG_HEAD_DIM>(out, q, k_pool, v_pool, table, num_tokens, start,
                                             kv_heads, group, log2_page, scale_log2);
}
