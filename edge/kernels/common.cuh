// Shared helpers for the edge paged-attention kernels (compiled at run time by NVRTC,
// see edge/kernels/nvrtc.py). Plain CUDA C++17, sm_80+ features only (mma.sync,
// ldmatrix, cp.async): runs on sm_87 (Orin) and sm_90 (H100/H200) alike.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

// Variant selection: every program is compiled for one element type and one head_dim.
//   EDGE_DTYPE: 1 = float16, 2 = bfloat16, 3 = float32
//   EDGE_HEAD_DIM: 64 or 128
#if defined(EDGE_DTYPE)
#if EDGE_DTYPE == 1
typedef __half edge_t;
#elif EDGE_DTYPE == 2
typedef __nv_bfloat16 edge_t;
#elif EDGE_DTYPE == 3
typedef float edge_t;
#else
#error "EDGE_DTYPE must be 1 (float16), 2 (bfloat16) or 3 (float32)"
#endif
#endif

namespace edge {

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// ---- 16-byte vectors <-> float ------------------------------------------------------

template <typename T>
struct Vec;  // elements per 16-byte vector and conversions

template <>
struct Vec<__half> {
  static constexpr int N = 8;
  __device__ __forceinline__ static void to_float(const uint4& u, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 x = __half22float2(h[i]);
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  }
  __device__ __forceinline__ static uint4 from_float(const float* f) {
    uint4 u;
    __half2* h = reinterpret_cast<__half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    return u;
  }
};

template <>
struct Vec<__nv_bfloat16> {
  static constexpr int N = 8;
  __device__ __forceinline__ static void to_float(const uint4& u, float* f) {
    const unsigned int* w = reinterpret_cast<const unsigned int*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // bf16 -> f32 is a 16-bit shift: exact and cheaper than the intrinsics.
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  __device__ __forceinline__ static uint4 from_float(const float* f) {
    uint4 u;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    return u;
  }
};

template <>
struct Vec<float> {
  static constexpr int N = 4;
  __device__ __forceinline__ static void to_float(const uint4& u, float* f) {
    f[0] = __uint_as_float(u.x);
    f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z);
    f[3] = __uint_as_float(u.w);
  }
  __device__ __forceinline__ static uint4 from_float(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
  }
};

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }

// Pack two floats into one 32-bit register of two 16-bit elements (low half = a).
template <typename T>
__device__ __forceinline__ unsigned int pack2(float a, float b);
template <>
__device__ __forceinline__ unsigned int pack2<__half>(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<unsigned int*>(&h);
}
template <>
__device__ __forceinline__ unsigned int pack2<__nv_bfloat16>(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<unsigned int*>(&h);
}

// Read-once global loads of K/V rows: keep them out of L1 (each byte is used once).
__device__ __forceinline__ uint4 load_stream(const void* p) {
  return __ldcs(reinterpret_cast<const uint4*>(p));
}

// Row index of position p in a paged pool of one KV head:
//   slot = table[p >> log2_page] * page + (p & (page - 1)).
__device__ __forceinline__ long long paged_slot(const int* __restrict__ table, int p, int log2_page) {
  const int blk = __ldg(table + (p >> log2_page));
  return ((long long)blk << log2_page) + (p & ((1 << log2_page) - 1));
}

}  // namespace edge
