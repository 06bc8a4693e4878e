// Paged KV write: K and V [T, kv_heads, D] of positions [start, start + T) copied to
// their pages in one launch (slot = table[p >> log2_page] * page + (p & (page - 1))).
// start comes from a device int32 (`pos`, graph-safe decode write) when non-null, else
// from the host argument. Element-type agnostic: rows move as 16-byte vectors, so one
// instantiation serves float16, bfloat16 and float32. Source rows may be strided
// (e.g. views into a fused QKV projection); strides are in bytes.
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
