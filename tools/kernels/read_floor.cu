// Read floors for decode attention (tools/bench.py kernels --floor; nothing in the engine
// launches these). Each kernel only reads the bytes one decode attention call reads and
// folds them into a value it never stores, so its time is what moving those bytes costs
// with a given grid: the floor under the attention kernel's own time.
//
//   gather_read  the attention's access: CTA (kv head, split) reads K and V rows
//                [r0, r1) of its head (16-byte chunks, the page found through the block
//                table), the same split ranges as paged_decode_tc.
//   linear_read  the same number of bytes read contiguously (the best case of the
//                memory system), any grid.
//
// Both wait for their predecessor at the start (overlapped launches, common.cuh), so an
// overlapped graph of them hides launch latency but reads nothing early.
#include "common.cuh"

namespace {

// Keeps the loads: an XOR of everything read, stored only if it equals a constant no
// input is made to hit.
__device__ __forceinline__ void sink(uint4 acc, unsigned int* out) {
  unsigned int x = acc.x ^ acc.y ^ acc.z ^ acc.w;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x ^= __shfl_xor_sync(0xffffffffu, x, off);
  if ((threadIdx.x & 31) == 0 && x == 0x9e3779b9u) out[0] = x;
}

__device__ __forceinline__ void fold(uint4& acc, const uint4& a, const uint4& b) {
  acc.x ^= a.x ^ b.x;
  acc.y ^= a.y ^ b.y;
  acc.z ^= a.z ^ b.z;
  acc.w ^= a.w ^ b.w;
}

}  // namespace

// Rows of 16 * `chunks` bytes per head (head_dim * element size / 16 = chunks); 128
// threads: 128 / chunks rows per pass. `step`: split ranges are multiples of it.
extern "C" __global__ void __launch_bounds__(128) gather_read(
    const uint4* __restrict__ k_pool, const uint4* __restrict__ v_pool,
    const int* __restrict__ table, int kv_len, int kv_heads, int chunks, int log2_page,
    int step, unsigned int* __restrict__ out) {
  edge::await_inputs();
  int r0, r1;
  edge::split_range(kv_len, blockIdx.y, gridDim.y, step, r0, r1);
  const int rows_per_pass = blockDim.x / chunks;
  const int c = threadIdx.x % chunks;
  uint4 acc = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll 8
  for (int r = r0 + threadIdx.x / chunks; r < r1; r += rows_per_pass) {
    const long long off =
        (edge::paged_slot(table, r, log2_page) * kv_heads + blockIdx.x) * chunks + c;
    fold(acc, __ldcs(k_pool + off), __ldcs(v_pool + off));
  }
  sink(acc, out);
}

// n 16-byte chunks of k and of v, CTA b reading the b-th contiguous share of each.
extern "C" __global__ void __launch_bounds__(256) linear_read(
    const uint4* __restrict__ k, const uint4* __restrict__ v, long long n,
    unsigned int* __restrict__ out) {
  edge::await_inputs();
  const long long per = (n + gridDim.x - 1) / gridDim.x;
  const long long lo = blockIdx.x * per;
  const long long hi = min(n, lo + per);
  uint4 acc = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll 8
  for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) fold(acc, __ldcs(k + i), __ldcs(v + i));
  sink(acc, out);
}
