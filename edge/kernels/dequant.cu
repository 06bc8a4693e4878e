// Weight expansion for prefill (compiled at run time by NVRTC, see edge/kernels/nvrtc.py):
// quantized weights -> a row-major T matrix [rows, in] that cuBLAS multiplies.
//
// Memory-bound: every thread writes 8 consecutive elements of a row as one 16-byte store,
// and the threads of a warp write consecutive pieces of the same row, so a warp's store
// is 512 contiguous bytes. Values are computed as the torch references compute them:
// the code (minus the zero point) in float32, times the float32 scale, rounded once to T.
//
// int4_dequant_<T>_s<S>: the packed layout of edge/int4.py (16-row blocks of 16 x 64
// tiles, word 4 * lane + s of a tile holds lane (g, t)'s A fragment of k16 step s). The
// 8 columns 16 s + 8 h .. + 7 of a tile are lanes t = 2 h and 2 h + 1 of row group g,
// words 4 (4 g + 2 h) + s and 4 later; both words hold rows g and g + 8 (nibbles
// rh + 2 kh + 4 e), so a thread writes that piece of both rows. A warp reads each word
// of its rows' tiles exactly once (64 contiguous bytes a tile).
//
// int8_dequant_<T>: int8 [rows, in] times float32 scales [rows, in / G] (G a power of
// two >= 8: a piece lies in one group), 8 bytes read and 16 written a thread.
//
// No host-visible state, shapes-only grids: safe in CUDA graphs. sm_80+ (sm_87 Orin, sm_90).
#include "common.cuh"

namespace {

__device__ __forceinline__ float scale_to_float(__half s) { return __half2float(s); }
__device__ __forceinline__ float scale_to_float(__nv_bfloat16 s) { return __bfloat162float(s); }
__device__ __forceinline__ float scale_to_float(float s) { return s; }

// Columns c .. c + 3 of lane t's k16 slice in row half rh: nibbles rh, rh + 4, rh + 2, rh + 6.
__device__ __forceinline__ void int4_lane(unsigned int w, int rh, float z, float sc, float* f) {
  f[0] = (static_cast<float>((w >> (4 * rh)) & 15u) - z) * sc;
  f[1] = (static_cast<float>((w >> (4 * rh + 16)) & 15u) - z) * sc;
  f[2] = (static_cast<float>((w >> (4 * rh + 8)) & 15u) - z) * sc;
  f[3] = (static_cast<float>((w >> (4 * rh + 24)) & 15u) - z) * sc;
}

// Rows [16 rb0, 16 (rb0 + nrb)) into out (row 16 rb0 at out[0]); one thread per (row
// block, row group g, 8-column piece p). The host keeps nrb * 8 * (in / 8) below 2^31.
template <typename T, typename S>
__device__ __forceinline__ void int4_dequant(T* __restrict__ out, const unsigned int* __restrict__ packed,
                                             const S* __restrict__ scale, const unsigned char* __restrict__ zero,
                                             int rb0, int nrb, int in, int group) {
  edge::await_inputs();
  const unsigned int pieces = static_cast<unsigned int>(in) >> 3;
  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= static_cast<unsigned int>(nrb) * 8u * pieces) return;
  const unsigned int p = i % pieces, pair = i / pieces;
  const unsigned int b = pair >> 3, g = pair & 7u;
  const unsigned int kb = p >> 3, s = (p >> 1) & 3u, h = p & 1u;
  const long long rb = static_cast<long long>(rb0) + b;
  const unsigned int* wp = packed + rb * 2LL * in + kb * 128u + 4u * (4u * g + 2u * h) + s;
  const unsigned int w0 = __ldg(wp), w1 = __ldg(wp + 4);
  const long long at = (rb * (in / group) + static_cast<long long>(8u * p) / group) * 16 + g;
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const float sc = scale_to_float(scale[at + 8 * rh]);
    const float z = zero == nullptr ? 8.f : static_cast<float>(zero[at + 8 * rh]);
    float f[8];
    int4_lane(w0, rh, z, sc, f);
    int4_lane(w1, rh, z, sc, f + 4);
    *reinterpret_cast<uint4*>(out + (static_cast<long long>(b) * 16 + g + 8 * rh) * in + 8u * p) =
        edge::Vec<T>::from_float(f);
  }
}

// Rows [0, rows) of q / scale (the host offsets the pointers) into out; one thread per
// 8-column piece. The host keeps rows * (in / 8) below 2^31.
template <typename T>
__device__ __forceinline__ void int8_dequant(T* __restrict__ out, const signed char* __restrict__ q,
                                             const float* __restrict__ scale, int rows, int in, int group_shift) {
  edge::await_inputs();
  const unsigned int pieces = static_cast<unsigned int>(in) >> 3;
  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= static_cast<unsigned int>(rows) * pieces) return;
  const unsigned int r = i / pieces, p = i % pieces;
  const long long at = static_cast<long long>(r) * in + 8u * p;
  const uint2 v = __ldg(reinterpret_cast<const uint2*>(q + at));
  const float sc = scale[static_cast<long long>(r) * (in >> group_shift) + ((8u * p) >> group_shift)];
  float f[8];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    f[k] = static_cast<float>(static_cast<signed char>((v.x >> (8 * k)) & 0xffu)) * sc;
    f[k + 4] = static_cast<float>(static_cast<signed char>((v.y >> (8 * k)) & 0xffu)) * sc;
  }
  *reinterpret_cast<uint4*>(out + at) = edge::Vec<T>::from_float(f);
}

}  // namespace

#define CFG_INT4_DEQUANT(DT, T, SN, S)                                                                        \
  extern "C" __global__ void int4_dequant_##DT##_s##SN(T* __restrict__ out, const unsigned int* __restrict__ packed, \
                                                        const S* __restrict__ scale,                            \
                                                        const unsigned char* __restrict__ zero, int rb0, int nrb, \
                                                        int in, int group) {                                    \
    int4_dequant<T, S>(out, packed, scale, zero, rb0, nrb, in, group);                                          \
  }

#define CFG_DEQUANT(DT, T)                                                                                    \
  CFG_INT4_DEQUANT(DT, T, f16, __half)                                                                        \
  CFG_INT4_DEQUANT(DT, T, bf16, __nv_bfloat16)                                                                \
  CFG_INT4_DEQUANT(DT, T, f32, float)                                                                         \
  extern "C" __global__ void int8_dequant_##DT(T* __restrict__ out, const signed char* __restrict__ q,         \
                                               const float* __restrict__ scale, int rows, int in, int group_shift) { \
    int8_dequant<T>(out, q, scale, rows, in, group_shift);                                                    \
  }

CFG_DEQUANT(bf16, __nv_bfloat16)
CFG_DEQUANT(f16, __half)
