// Paged KV write: K and V [T, kv_heads, D] of positions [start, start + T) copied to
// their pages in one launch (slot = table[p >> log2_page] * page + (p & (page - 1))).
// start comes from a device int32 (`pos`, graph-safe decode write) when non-null, else
// from the host argument. Element-type agnostic: rows move as 16-byte vectors, so one
// instantiation serves float16, bfloat16 and float32. Source rows may be strided
// (e.g. views into a fused QKV projection); strides are in bytes. kv_write_q8_* (below)
// writes int8 pools.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
    kv_write(unsigned char* __restrict__ k_pool, unsigned char* __restrict__ v_pool,
             const int* __restrict__ table, const unsigned char* __restrict__ k,
             const unsigned char* __restrict__ v, const int* __restrict__ pos, int host_start,
             int num_tokens, int kv_heads, int row_vecs, long long k_tok_stride,
             long long k_head_stride, long long v_tok_stride, long long v_head_stride,
             int log2_page) {
  edge::await_inputs();
  const int start = (pos != nullptr) ? __ldg(pos) : host_start;
  const int per_tok = kv_heads * row_vecs;
  const int total = num_tokens * per_tok;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const int t = i / per_tok;
    const int rem = i - t * per_tok;
    const int h = rem / row_vecs;
    const int c = rem - h * row_vecs;
    const long long slot = edge::paged_slot(table, start + t, log2_page);
    const long long dst = ((slot * kv_heads + h) * row_vecs + c) * 16;
    const uint4 kv = *reinterpret_cast<const uint4*>(k + t * k_tok_stride + h * k_head_stride + c * 16);
    const uint4 vv = *reinterpret_cast<const uint4*>(v + t * v_tok_stride + h * v_head_stride + c * 16);
    *reinterpret_cast<uint4*>(k_pool + dst) = kv;
    *reinterpret_cast<uint4*>(v_pool + dst) = vv;
  }
}

// The int8 pools' write (edge/kernels/kv_int8.py): K and V [T, kv_heads, D] of T (strides
// in bytes, rows 16-byte aligned) quantized into codes [slot, kv_heads, D] and scales
// [slot, kv_heads]; a warp a (token, head, K or V) row, lane l holding elements
// [l D / 32, (l + 1) D / 32). Grid: (ceil(2 kv_heads / 8), T), 8 warps a CTA.
template <typename T, int D>
__device__ __forceinline__ void kv_write_q8(signed char* __restrict__ k_pool, signed char* __restrict__ v_pool,
                                            float* __restrict__ k_scale, float* __restrict__ v_scale,
                                            const int* __restrict__ table, const unsigned char* __restrict__ k,
                                            const unsigned char* __restrict__ v, const int* __restrict__ pos,
                                            int host_start, int kv_heads, long long k_tok_stride,
                                            long long k_head_stride, long long v_tok_stride, long long v_head_stride,
                                            int log2_page) {
  constexpr int E = D / 32;
  using P = edge::Pack<T, E>;
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);  // K rows, then V rows
  edge::await_inputs();
  if (row >= 2 * kv_heads) return;  // whole warps
  const int t = blockIdx.y;
  const bool is_v = row >= kv_heads;
  const int h = is_v ? row - kv_heads : row;
  const int start = (pos != nullptr) ? __ldg(pos) : host_start;
  const unsigned char* src = is_v ? v + t * v_tok_stride + h * v_head_stride : k + t * k_tok_stride + h * k_head_stride;
  const P x = *reinterpret_cast<const P*>(src + lane * E * sizeof(T));
  float scale;
  const unsigned int codes = edge::quantize_row_lane<T, E>(x, scale);
  const long long slot = edge::paged_slot(table, start + t, log2_page) * kv_heads + h;
  edge::store_codes<E>((is_v ? v_pool : k_pool) + slot * D + lane * E, codes);
  if (lane == 0) (is_v ? v_scale : k_scale)[slot] = scale;
}

#define EDGE_KV_WRITE_Q8(SUFFIX, T, D)                                                                         \
  extern "C" __global__ void __launch_bounds__(256) kv_write_q8_##SUFFIX##_d##D(                              \
      signed char* __restrict__ k_pool, signed char* __restrict__ v_pool, float* __restrict__ k_scale,         \
      float* __restrict__ v_scale, const int* __restrict__ table, const unsigned char* __restrict__ k,         \
      const unsigned char* __restrict__ v, const int* __restrict__ pos, int host_start, int kv_heads,          \
      long long k_tok_stride, long long k_head_stride, long long v_tok_stride, long long v_head_stride,         \
      int log2_page) {                                                                                         \
    kv_write_q8<T, D>(k_pool, v_pool, k_scale, v_scale, table, k, v, pos, host_start, kv_heads, k_tok_stride, \
                      k_head_stride, v_tok_stride, v_head_stride, log2_page);                                  \
  }

EDGE_KV_WRITE_Q8(f16, __half, 64)
EDGE_KV_WRITE_Q8(f16, __half, 128)
EDGE_KV_WRITE_Q8(bf16, __nv_bfloat16, 64)
EDGE_KV_WRITE_Q8(bf16, __nv_bfloat16, 128)
EDGE_KV_WRITE_Q8(f32, float, 64)
EDGE_KV_WRITE_Q8(f32, float, 128)
