// Fused element-wise / row-wise kernels of the decoder layer (compiled at run time by
// NVRTC, see edge/kernels/nvrtc.py; wrapped by edge/kernels/fused_cuda.py with the
// semantics of the functions of the same names in edge/kernels/reference.py).
//
//   embedding     out[t] = table[ids[t]], ids read on the device (the graph's token)
//   decode_step_end  a graph decode step's sampled token into the host's pinned ring,
//                 and the position advanced
//   rms_norm      out = rms_norm(x) * w                        (one row per CTA)
//   add_rms_norm  x += r (in place, rounded to T); out = rms_norm(x) * w
//   silu_mul      out = silu(gate) * up, gate_up = [gate | up] per row
//   qk_norm_rope  q, k heads of a fused qkv row: optional per-head RMSNorm (Qwen3) then
//                 RoPE (x * cos + rotate_half(x) * sin) at positions read on the device;
//                 optionally k and v go straight into their paged-pool rows (the slot of
//                 each token from the block table and the same device positions), which
//                 saves the KV-write launch of every layer; int8 pools (scale pointers
//                 given) get each row's codes and scale (common.cuh, "int8 K/V rows")
//
// float32 math inside; one rounding to T per output (plus the roundings HF does between
// the q/k norm and its weight, so that float16/bfloat16 match transformers' order).
// Every kernel is one launch for any number of tokens T (decode T = 1, prefill chunks),
// uses no workspace and no host-visible state, and its grid depends on shapes only:
// safe inside CUDA graphs. sm_80+ only (sm_87 Orin; sm_90 too).
//
// One program holds every instantiation: *_f16, *_bf16, *_f32 (and _d64 / _d128 for the
// head dim of qk_norm_rope).
#include "common.cuh"

namespace {

using edge::Vec;
using edge::warp_sum;

// Sum over the CTA (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int warps = blockDim.x >> 5;
  v = lane < warps ? partial[lane] : 0.f;
  return warp_sum(v);
}

// ---- RMSNorm (optionally after the residual add) ---------------------------------------
//
// One CTA per row of `hidden` elements (16-byte vectors: 8 half / 4 float); thread i
// holds vectors i, i + blockDim, ... (at most kMaxVec) in registers between the
// statistics and the scaling, so x is read once. The wrapper sizes blockDim (a multiple
// of 32) so that ceil(nvec / blockDim) <= kMaxVec.
constexpr int kMaxVec = 4;

template <typename T, bool kAdd>
__device__ __forceinline__ void rms_norm_row(T* __restrict__ out, T* __restrict__ x,
                                             const T* __restrict__ res,
                                             const T* __restrict__ w, float eps, int hidden) {
  constexpr int N = Vec<T>::N;
  edge::await_inputs();
  const int nvec = hidden / N;
  const long long row = blockIdx.x;
  uint4* xr = reinterpret_cast<uint4*>(x + row * hidden);
  float v[kMaxVec][N];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxVec; ++i) {
    const int c = threadIdx.x + i * blockDim.x;
    if (c < nvec) {
      Vec<T>::to_float(xr[c], v[i]);
      if (kAdd) {
        float r[N];
        Vec<T>::to_float(reinterpret_cast<const uint4*>(res + row * hidden)[c], r);
#pragma unroll
        for (int j = 0; j < N; ++j) v[i][j] = edge::round_to<T>(v[i][j] + r[j]);
        xr[c] = Vec<T>::from_float(v[i]);  // the residual stream, updated in place
      }
#pragma unroll
      for (int j = 0; j < N; ++j) ss = fmaf(v[i][j], v[i][j], ss);
    }
  }
  const float rstd = rsqrtf(block_sum(ss) / static_cast<float>(hidden) + eps);
  uint4* o = reinterpret_cast<uint4*>(out + row * hidden);
  const uint4* wv = reinterpret_cast<const uint4*>(w);
#pragma unroll
  for (int i = 0; i < kMaxVec; ++i) {
    const int c = threadIdx.x + i * blockDim.x;
    if (c < nvec) {
      float g[N];
      Vec<T>::to_float(__ldg(wv + c), g);
#pragma unroll
      for (int j = 0; j < N; ++j) v[i][j] = v[i][j] * rstd * g[j];
      o[c] = Vec<T>::from_float(v[i]);
    }
  }
}

// ---- SiLU(gate) * up ---------------------------------------------------------------------
//
// gate_up [rows, 2 * inter] -> out [rows, inter]; one 16-byte vector per thread.
template <typename T>
__device__ __forceinline__ void silu_mul_vec(T* __restrict__ out, const T* __restrict__ gu,
                                             int inter, long long total_vecs) {
  constexpr int N = Vec<T>::N;
  edge::await_inputs();
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total_vecs) return;
  const int row_vecs = inter / N;
  const long long row = i / row_vecs;
  const int c = static_cast<int>(i - row * row_vecs);
  const uint4* src = reinterpret_cast<const uint4*>(gu + row * 2 * inter);
  float g[N], u[N];
  Vec<T>::to_float(__ldg(src + c), g);
  Vec<T>::to_float(__ldg(src + row_vecs + c), u);
#pragma unroll
  for (int j = 0; j < N; ++j) g[j] = g[j] / (1.f + __expf(-g[j])) * u[j];
  reinterpret_cast<uint4*>(out)[i] = Vec<T>::from_float(g);
}

// ---- q/k per-head RMSNorm + RoPE ------------------------------------------------------
//
// One warp per (token, head) of the q and k parts of a qkv row; lane l holds elements
// [l * E, l * E + E) (E = D / 32), so the rotate_half partner of element i (i +- D/2)
// is the same slot of lane l ^ 16. Grid: (ceil((heads + kv_heads) / warps), T).
template <typename T, int D>
__device__ __forceinline__ void qk_norm_rope_head(
    T* __restrict__ q_out, T* __restrict__ k_out, const T* __restrict__ qkv,
    const T* __restrict__ weight, const T* __restrict__ cos_tab, const T* __restrict__ sin_tab,
    const void* __restrict__ positions, int pos_is_i64, int heads, int kv_heads,
    long long row_stride, int max_pos, float eps, void* __restrict__ k_pool, void* __restrict__ v_pool,
    float* __restrict__ k_scale, float* __restrict__ v_scale, const int* __restrict__ table, int log2_page) {
  constexpr int E = D / 32;
  using P = edge::Pack<T, E>;
  const int lane = threadIdx.x & 31;
  const int head = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  // With a pool, kv_heads more warps copy the v heads into it.
  const int rows = heads + kv_heads * (k_pool != nullptr ? 2 : 1);
  if (head >= rows) return;  // whole warps; nothing below syncs the CTA
  const int t = blockIdx.y;
  edge::await_inputs();  // positions too are written in the step (from pos)
  long long p = pos_is_i64 ? __ldg(reinterpret_cast<const long long*>(positions) + t)
                           : static_cast<long long>(__ldg(reinterpret_cast<const int*>(positions) + t));
  p = p < 0 ? 0 : (p >= max_pos ? max_pos - 1 : p);  // never read outside the tables

  const P xin = *reinterpret_cast<const P*>(qkv + t * row_stride + head * D + lane * E);
  T* pool_row = nullptr;  // this token's row of kv head (head - heads) mod kv_heads
  long long row = -1;     // ... its index in the pool, [slot, kv_heads]
  const bool q8 = k_scale != nullptr;  // int8 pools: codes [row, D] and a scale a row
  if (k_pool != nullptr && head >= heads) {
    const int kvh = (head - heads) % kv_heads;
    row = edge::paged_slot(table, static_cast<int>(p), log2_page) * kv_heads + kvh;
    void* pool = head < heads + kv_heads ? k_pool : v_pool;
    pool_row = static_cast<T*>(pool) + row * D;
    if (head >= heads + kv_heads) {  // v: a plain copy (int8: its codes and scale)
      if (q8) {
        float scale;
        const unsigned int codes = edge::quantize_row_lane<T, E>(xin, scale);
        edge::store_codes<E>(static_cast<signed char*>(pool) + row * D + lane * E, codes);
        if (lane == 0) v_scale[row] = scale;
      } else {
        *reinterpret_cast<P*>(pool_row + lane * E) = xin;
      }
      return;
    }
  }
  const P cv = *reinterpret_cast<const P*>(cos_tab + p * D + lane * E);
  const P sv = *reinterpret_cast<const P*>(sin_tab + p * D + lane * E);
  const P o = edge::norm_rope_lane<T, D>(xin, weight != nullptr ? weight + head * D : nullptr, cv, sv, eps, lane);
  if (row >= 0 && q8) {  // k into an int8 pool
    float scale;
    const unsigned int codes = edge::quantize_row_lane<T, E>(o, scale);
    edge::store_codes<E>(static_cast<signed char*>(k_pool) + row * D + lane * E, codes);
    if (lane == 0) k_scale[row] = scale;
    return;
  }
  T* dst = pool_row != nullptr ? pool_row
           : head < heads     ? q_out + (static_cast<long long>(t) * heads + head) * D
                              : k_out + (static_cast<long long>(t) * kv_heads + (head - heads)) * D;
  *reinterpret_cast<P*>(dst + lane * E) = o;
}

}  // namespace

// ---- extern "C" instantiations -------------------------------------------------------------

// The end of a graph decode step: the sampled token goes straight into the host's pinned
// ring (slot *ring_pos % ring_len, mapped memory), so no device-to-host copy sits
// between two replays on the stream (docs/kernels.md has its cost); then the ring
// position and the decode position advance. The host reads the slot once the step's
// event has completed.
extern "C" __global__ void __launch_bounds__(32)
    decode_step_end(const long long* __restrict__ token, long long* __restrict__ ring, int* __restrict__ ring_pos,
                    int ring_len, int* __restrict__ pos) {
  edge::await_inputs();
  if (threadIdx.x == 0) {
    const int i = *ring_pos;
    ring[i % ring_len] = *token;
    __threadfence_system();  // the host may read the slot as soon as the step completes
    *ring_pos = i + 1;
    *pos += 1;
  }
}

// out[t] = table[ids[t]] for rows of row_vecs 16-byte vectors (byte-oriented: one
// instantiation serves every dtype); grid y = tokens. ids (int64 or int32) come from an
// earlier kernel in a graph step (the sampled token), so they are read after the wait;
// letting dependents go first lets the first projection's CTAs start their weight
// streams beside this copy (a torch embedding launch cannot). An id outside
// [0, vocab) gives a zero row: nothing is read outside the table.
extern "C" __global__ void __launch_bounds__(256)
    embedding(uint4* __restrict__ out, const uint4* __restrict__ table, const void* __restrict__ ids,
              int ids_i64, long long vocab, int row_vecs) {
  edge::await_inputs();
  const int t = blockIdx.y;
  const long long id = ids_i64 ? static_cast<const long long*>(ids)[t] : static_cast<const int*>(ids)[t];
  const bool ok = id >= 0 && id < vocab;
  for (int v = blockIdx.x * blockDim.x + threadIdx.x; v < row_vecs; v += gridDim.x * blockDim.x)
    out[static_cast<long long>(t) * row_vecs + v] = ok ? __ldg(table + id * row_vecs + v) : make_uint4(0u, 0u, 0u, 0u);
}

#define CFG_FUSED_NORM(SUFFIX, T)                                                            \
  extern "C" __global__ void __launch_bounds__(1024)                                         \
      rms_norm_##SUFFIX(T* __restrict__ out, T* __restrict__ x, const T* __restrict__ w,     \
                        float eps, int hidden) {                                               \
    rms_norm_row<T, false>(out, x, nullptr, w, eps, hidden);                                  \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(1024)                                         \
      add_rms_norm_##SUFFIX(T* __restrict__ out, T* __restrict__ x, const T* __restrict__ r, \
                            const T* __restrict__ w, float eps, int hidden) {                \
    rms_norm_row<T, true>(out, x, r, w, eps, hidden);                                         \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(256)                                          \
      silu_mul_##SUFFIX(T* __restrict__ out, const T* __restrict__ gate_up, int inter,        \
                        long long total_vecs) {                                                \
    silu_mul_vec<T>(out, gate_up, inter, total_vecs);                                         \
  }

#define CFG_FUSED_QK(SUFFIX, T, D)                                                           \
  extern "C" __global__ void __launch_bounds__(256) qk_norm_rope_##SUFFIX##_d##D(            \
      T* __restrict__ q_out, T* __restrict__ k_out, const T* __restrict__ qkv,                \
      const T* __restrict__ weight, const T* __restrict__ cos_tab,                            \
      const T* __restrict__ sin_tab, const void* __restrict__ positions, int pos_is_i64,      \
      int heads, int kv_heads, long long row_stride, int max_pos, float eps,                  \
      void* __restrict__ k_pool, void* __restrict__ v_pool, float* __restrict__ k_scale,      \
      float* __restrict__ v_scale, const int* __restrict__ table, int log2_page) {            \
    qk_norm_rope_head<T, D>(q_out, k_out, qkv, weight, cos_tab, sin_tab, positions,           \
                            pos_is_i64, heads, kv_heads, row_stride, max_pos, eps, k_pool,    \
                            v_pool, k_scale, v_scale, table, log2_page);                      \
  }

CFG_FUSED_NORM(f16, __half)
CFG_FUSED_NORM(bf16, __nv_bfloat16)
CFG_FUSED_NORM(f32, float)
CFG_FUSED_QK(f16, __half, 64)
CFG_FUSED_QK(f16, __half, 128)
CFG_FUSED_QK(bf16, __nv_bfloat16, 64)
CFG_FUSED_QK(bf16, __nv_bfloat16, 128)
CFG_FUSED_QK(f32, float, 64)
CFG_FUSED_QK(f32, float, 128)
