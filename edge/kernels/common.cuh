// Shared helpers for the edge paged-attention kernels (compiled at run time by NVRTC,
// see edge/kernels/nvrtc.py). Plain CUDA C++17, sm_80+ features only (mma.sync,
// ldmatrix, cp.async): runs on sm_87 (Orin) and sm_90 alike.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

// Variant selection: every program is compiled for one element type and one head_dim.
//   CFG_DTYPE: 1 = float16, 2 = bfloat16, 3 = float32
//   CFG_HEAD_DIM: 64 or 128
#if defined(CFG_DTYPE)
#if CFG_DTYPE == 1
typedef __half edge_t;
#elif CFG_DTYPE == 2
typedef __nv_bfloat16 edge_t;
#elif CFG_DTYPE == 3
typedef float edge_t;
#else
#error "CFG_DTYPE must be 1 (float16), 2 (bfloat16) or 3 (float32)"
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

// Round to T and back (the value a T tensor would hold).
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}
template <>
__device__ __forceinline__ float round_to<float>(float v) {
  return v;
}

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

// ---- overlapped launches (programmatic dependent launch, sm_90+) ----------------------
//
// Inside the CUDA-graph decode step (nvrtc.overlapped), sm_90+ launches a kernel while
// the previous one is still finishing. Every kernel calls grid_dependency_wait() before
// it touches anything an earlier kernel of the step may write or still read (activations,
// q, outputs, workspaces); before it, only what no kernel of the step writes may be read
// (weights, the block table, pos, K/V rows before pos), which is how weight and K/V
// streams start under the previous kernel's tail. allow_dependents() right after the
// wait lets the next kernel launch once every CTA has got that far, so a grid's
// predecessor has always finished when its successor starts. Both compile to nothing
// below sm_90 (Orin): there launches are plainly serialised, as without the attribute.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// The usual kernel start: nothing worth doing before the wait.
__device__ __forceinline__ void await_inputs() {
  grid_dependency_wait();
  allow_dependents();
}

// 16 bytes of weights, read once a step: through the read-only path, not kept in L1
// (weights do not evict the activations every warp re-reads).
__device__ __forceinline__ uint4 ld_weights(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// ---- small helpers ------------------------------------------------------------------

__device__ __forceinline__ void store4(__half* p, float4 v) {
  uint2 u = make_uint2(pack2<__half>(v.x, v.y), pack2<__half>(v.z, v.w));
  *reinterpret_cast<uint2*>(p) = u;
}
__device__ __forceinline__ void store4(__nv_bfloat16* p, float4 v) {
  uint2 u = make_uint2(pack2<__nv_bfloat16>(v.x, v.y), pack2<__nv_bfloat16>(v.z, v.w));
  *reinterpret_cast<uint2*>(p) = u;
}
__device__ __forceinline__ void store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// ---- per-head RMSNorm + RoPE, a warp per head ----------------------------------------
//
// Lane l holds elements [l * E, l * E + E) of a head (E = D / 32), so the rotate_half
// partner of element i (i +- D/2) is the same slot of lane l ^ 16.
template <typename T, int E>
struct alignas(sizeof(T) * E) Pack {
  T v[E];
};

// One lane's share of RoPE(rms_norm(x) * weight) (no norm when weight is null), with
// cv / sv the lane's slots of the position's cos and signed-sin rows: the head's x in T
// comes back in T. HF order: normalise in float32, cast to T, multiply by the weight in
// T, RoPE in float32 from those T values, one rounding. Every lane of the warp must call
// it (shuffles).
template <typename T, int D>
__device__ __forceinline__ Pack<T, D / 32> norm_rope_lane(const Pack<T, D / 32>& xin, const T* weight,
                                                         const Pack<T, D / 32>& cv, const Pack<T, D / 32>& sv,
                                                         float eps, int lane) {
  constexpr int E = D / 32;
  typedef Pack<T, E> P;
  float x[E];
#pragma unroll
  for (int j = 0; j < E; ++j) x[j] = to_float(xin.v[j]);
  if (weight != nullptr) {
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < E; ++j) ss = fmaf(x[j], x[j], ss);
    const float rstd = rsqrtf(warp_sum(ss) / static_cast<float>(D) + eps);
    const P wv = *reinterpret_cast<const P*>(weight + lane * E);
#pragma unroll
    for (int j = 0; j < E; ++j) x[j] = round_to<T>(round_to<T>(x[j] * rstd) * to_float(wv.v[j]));
  }
  P o;
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const float partner = __shfl_xor_sync(0xffffffffu, x[j], 16);
    o.v[j] = from_float<T>(x[j] * to_float(cv.v[j]) + partner * to_float(sv.v[j]));
  }
  return o;
}

// ---- async copies (sm_80+) -------------------------------------------------------------

// Dynamic shared memory this launch was given.
__device__ __forceinline__ unsigned int dynamic_smem_bytes() {
  unsigned int n;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
  return n;
}

__device__ __forceinline__ unsigned int smem_u32(const void* p) {
  return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}

// 16-byte async global->shared copy; src_bytes == 0 writes zeros and reads nothing.
// No "memory" clobber on purpose: it would stop the compiler from hoisting the
// independent global loads (block-table lookups) of later copies above earlier ones,
// serializing one round trip per copy. Ordering against shared-memory reads comes from
// cp_async_wait (which has the clobber) and __syncthreads.
__device__ __forceinline__ void cp_async16(unsigned int dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most N of this thread's most recent copy groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { cp_async_wait<0>(); }

// ---- tensor cores (mma.sync m16n8k16, f32 accumulate; sm_80+) -----------------------------

template <typename T>
__device__ __forceinline__ void mma16816(float* c, const unsigned int* a, unsigned int b0,
                                         unsigned int b1);

template <>
__device__ __forceinline__ void mma16816<__half>(float* c, const unsigned int* a, unsigned int b0,
                                                 unsigned int b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float* c, const unsigned int* a,
                                                        unsigned int b0, unsigned int b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int& r0, unsigned int& r1,
                                                  unsigned int& r2, unsigned int& r3,
                                                  unsigned int addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned int& r0, unsigned int& r1, unsigned int& r2,
                                            unsigned int& r3, unsigned int addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// o += P V for 16 keys: P is the softmax weights of the keys as two m16n8 score
// fragments (keys 0-7, 8-15), reused as the A operand; V is the 16 rows of D elements
// at v (row stride ldv elements, shared memory), read transposed by ldmatrix.
template <typename T, int D>
__device__ __forceinline__ void mma_pv16(float (&o)[D / 8][4], const float (&p0)[4],
                                         const float (&p1)[4], const T* v, int ldv) {
  const int lane = threadIdx.x & 31;
  unsigned int pa[4];
  pa[0] = pack2<T>(p0[0], p0[1]);
  pa[1] = pack2<T>(p0[2], p0[3]);
  pa[2] = pack2<T>(p1[0], p1[1]);
  pa[3] = pack2<T>(p1[2], p1[3]);
  const T* vaddr = v + ((lane & 7) + ((lane >> 3) & 1) * 8) * ldv + (lane >> 4) * 8;
#pragma unroll
  for (int np = 0; np < D / 16; ++np) {
    unsigned int v0, v1, v2, v3;
    ldmatrix_x4_trans(v0, v1, v2, v3, smem_u32(vaddr + np * 16));
    mma16816<T>(o[2 * np], pa, v0, v1);
    mma16816<T>(o[2 * np + 1], pa, v2, v3);
  }
}

// ---- int8 K/V rows (edge/kernels/kv_int8.py) -----------------------------------------
//
// A row (a token's KV head) is held as D int8 codes round(x * 127 / amax) and one float32
// scale amax / 127, from the row's values as the model dtype holds them; every store
// below computes exactly what kv_int8.quantize_rows does (IEEE division and product,
// round half to even). Readers never round a dequantized row to the model dtype: the
// tensor-core kernels multiply exact codes on float16 tensor cores and apply the key
// scale to the scores, the value scale to the probabilities.

// One lane's E codes (bytes 0..E-1 of the result) and the row's scale, from a warp that
// holds the row E values a lane (lane l: elements [l E, l E + E)). Every lane calls it.
template <typename T, int E>
__device__ __forceinline__ unsigned int quantize_row_lane(const Pack<T, E>& x, float& scale) {
  static_assert(E <= 4, "a lane's codes fit one word");
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < E; ++j) amax = fmaxf(amax, fabsf(to_float(x.v[j])));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  scale = amax / 127.f;
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  unsigned int w = 0;
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const int c = min(127, max(-127, __float2int_rn(to_float(x.v[j]) * inv)));
    w |= (static_cast<unsigned int>(c) & 0xffu) << (8 * j);
  }
  return w;
}

// Store a lane's E codes (from quantize_row_lane) at p (E-byte aligned).
template <int E>
__device__ __forceinline__ void store_codes(signed char* p, unsigned int w) {
  if constexpr (E == 4) {
    *reinterpret_cast<unsigned int*>(p) = w;
  } else if constexpr (E == 2) {
    *reinterpret_cast<unsigned short*>(p) = static_cast<unsigned short>(w);
  } else {
#pragma unroll
    for (int j = 0; j < E; ++j) p[j] = static_cast<signed char>((w >> (8 * j)) & 0xffu);
  }
}

// Two codes of a word as exact float16 values: x is the word XOR 0x80808080 (code + 128
// in each byte), SEL a byte_perm selector 0x4B4A (code bytes A, B into the low bytes
// of two halves of 0x64..: 1024 + code + 128 each), less 1152 in both halves.
template <unsigned int SEL>
__device__ __forceinline__ unsigned int codes_h2(unsigned int x) {
  const unsigned int h = __byte_perm(x, 0x64646464u, SEL);
  const unsigned int bias = 0x64806480u;  // 1152.0 in both halves
  const __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&h), *reinterpret_cast<const __half2*>(&bias));
  return *reinterpret_cast<const unsigned int*>(&r);
}

// 4-byte async global->shared copy (a row's scale); src_bytes == 0 writes zeros.
__device__ __forceinline__ void cp_async4(unsigned int dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// Four T values at p (8-byte aligned for 16-bit T, 16-byte for float) as floats.
template <typename T>
__device__ __forceinline__ void load4f(const T* p, float (&f)[4]) {
  if constexpr (sizeof(T) == 4) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    f[0] = v.x, f[1] = v.y, f[2] = v.z, f[3] = v.w;
  } else {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const T* h = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = to_float(h[i]);
  }
}

// The power of two that takes a row of largest magnitude amax into [2^14, 2^15) (its
// values then fit float16 exactly down to 2^-28 of amax), and its inverse.
__device__ __forceinline__ void half_row_scale(float amax, float& f, float& inv_f) {
  const int e = static_cast<int>((__float_as_uint(amax) >> 23) & 0xffu);  // biased exponent
  const int fe = min(253, max(1, 268 - e));                                 // 2^(14 - floor(log2 amax))
  f = __uint_as_float(static_cast<unsigned int>(fe) << 23);
  inv_f = __uint_as_float(static_cast<unsigned int>(254 - fe) << 23);
}

// The query A fragments of an m16 tile for K held as int8 codes (qk_int8_b): rows q0, q1
// (D elements of T each, 8-byte aligned; null: a zero row) scaled row by row into
// float16 (half_row_scale), the k16 step s of the permuted columns: lane (g, t) holds
// columns 16 s + 4 t + {0, 1} as its k = 2 t, 2 t + 1 and 16 s + 4 t + {2, 3} as its
// k = 2 t + 8, 2 t + 9 (the key fragments read 4 adjacent codes a lane). rs gets each
// row's inverse factor (times `mul`) for its scores.
template <typename T, int D>
__device__ __forceinline__ void q_fragments_int8(unsigned int (&qa)[D / 16][4], const T* q0, const T* q1, float mul,
                                                 float (&rs)[2]) {
  const int tig = threadIdx.x & 3;
  float amax[2] = {0.f, 0.f};
  const T* rows[2] = {q0, q1};
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (rows[i] != nullptr) {
        float f[4];
        load4f(rows[i] + ks * 16 + tig * 4, f);
        amax[i] = fmaxf(amax[i], fmaxf(fmaxf(fabsf(f[0]), fabsf(f[1])), fmaxf(fabsf(f[2]), fabsf(f[3]))));
      }
    }
  }
  float fac[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    amax[i] = fmaxf(amax[i], __shfl_xor_sync(0xffffffffu, amax[i], 1));
    amax[i] = fmaxf(amax[i], __shfl_xor_sync(0xffffffffu, amax[i], 2));
    float inv;
    half_row_scale(amax[i], fac[i], inv);
    rs[i] = mul * inv;
  }
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float f[4] = {0.f, 0.f, 0.f, 0.f};
      if (rows[i] != nullptr) load4f(rows[i] + ks * 16 + tig * 4, f);
      qa[ks][i] = pack2<__half>(f[0] * fac[i], f[1] * fac[i]);
      qa[ks][2 + i] = pack2<__half>(f[2] * fac[i], f[3] * fac[i]);
    }
  }
}

// S += Q K^T for 16 keys held as int8 codes (rows of ldb bytes at k, shared memory): the
// two m16n8 score tiles (keys 0-7, 8-15), products of exact codes, unscaled. One
// ldmatrix.x4 a pair of k16 steps: matrices (keys 0-7, 8-15) x (columns 16 s, 16 s + 16)
// of 16 bytes; lane (g, t) gets codes 4 t .. 4 t + 3 of its key's 16 columns, the
// permuted k of q_fragments_int8.
template <int D>
__device__ __forceinline__ void mma_qk16_int8(float (&sc)[2][4], const unsigned int (&qa)[D / 16][4],
                                              const signed char* k, int ldb) {
  const int lane = threadIdx.x & 31;
  const int idx = lane >> 3;
  const signed char* addr = k + ((idx & 1) * 8 + (lane & 7)) * ldb + (idx >> 1) * 16;
#pragma unroll
  for (int s = 0; s < D / 16; s += 2) {
    unsigned int r[4];
    ldmatrix_x4(r[0], r[1], r[2], r[3], smem_u32(addr + s * 16));
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const unsigned int x = r[m] ^ 0x80808080u;
      mma16816<__half>(sc[m & 1], qa[s + (m >> 1)], codes_h2<0x4140u>(x), codes_h2<0x4342u>(x));
    }
  }
}

// o += P V for 16 keys held as int8 codes (rows of ldb bytes at v, shared memory): p0, p1
// the probabilities already times each key's value scale (float16 range), as in
// mma_pv16. ldmatrix.trans of 16-bit pairs of codes gives lane (g, t) keys 2 t, 2 t + 1
// (8 more: the second matrix) of columns 2 g, 2 g + 1 of a 16-column chunk c: tile 2 c
// of o takes the even columns, tile 2 c + 1 the odd ones, so o's row g holds columns
// 16 c + 4 t + {0, 1, 2, 3} as (o[2c][0], o[2c+1][0], o[2c][1], o[2c+1][1]) (rows g + 8:
// elements 2, 3).
template <int D>
__device__ __forceinline__ void mma_pv16_int8(float (&o)[D / 8][4], const float (&p0)[4], const float (&p1)[4],
                                              const signed char* v, int ldb) {
  const int lane = threadIdx.x & 31;
  unsigned int pa[4];
  pa[0] = pack2<__half>(p0[0], p0[1]);
  pa[1] = pack2<__half>(p0[2], p0[3]);
  pa[2] = pack2<__half>(p1[0], p1[1]);
  pa[3] = pack2<__half>(p1[2], p1[3]);
  const int idx = lane >> 3;
  const signed char* addr = v + ((idx & 1) * 8 + (lane & 7)) * ldb + (idx >> 1) * 16;
#pragma unroll
  for (int c = 0; c < D / 16; c += 2) {
    unsigned int r[4];
    ldmatrix_x4_trans(r[0], r[1], r[2], r[3], smem_u32(addr + c * 16));
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // chunk c + h: keys 0-7 in r[2h], 8-15 in r[2h + 1]
      const unsigned int x0 = r[2 * h] ^ 0x80808080u, x1 = r[2 * h + 1] ^ 0x80808080u;
      mma16816<__half>(o[2 * (c + h)], pa, codes_h2<0x4240u>(x0), codes_h2<0x4240u>(x1));
      mma16816<__half>(o[2 * (c + h) + 1], pa, codes_h2<0x4341u>(x0), codes_h2<0x4341u>(x1));
    }
  }
}

// Row index of position p in a paged pool of one KV head:
//   slot = table[p >> log2_page] * page + (p & (page - 1)).
__device__ __forceinline__ long long paged_slot(const int* __restrict__ table, int p, int log2_page) {
  const int blk = __ldg(table + (p >> log2_page));
  return ((long long)blk << log2_page) + (p & ((1 << log2_page) - 1));
}

// ---- online softmax ------------------------------------------------------------------

// One online-softmax step for the two rows a thread holds in m16n8 mma tiles: s[j][c]
// are the scores (log2 units) of NT key tiles, row c >> 1. Updates the running row max
// and sum, turns s into probabilities, and gives in corr the factor each row's output
// accumulators must be scaled by. A row with no key yet (max -inf) stays at zero.
template <int NT>
__device__ __forceinline__ void mma_online_softmax(float (&s)[NT][4], float (&mrow)[2], float (&lrow)[2],
                                                   float (&corr)[2]) {
  float muse[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float mx = neg_inf();
#pragma unroll
    for (int j = 0; j < NT; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * i], s[j][2 * i + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mnew = fmaxf(mrow[i], mx);
    muse[i] = (mnew == neg_inf()) ? 0.f : mnew;
    corr[i] = exp2f(mrow[i] - muse[i]);
    mrow[i] = mnew;
    lrow[i] *= corr[i];
  }
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float p = exp2f(s[j][c] - muse[c >> 1]);
      s[j][c] = p;
      lrow[c >> 1] += p;
    }
  }
}

// Scale m16n8 output accumulators row-wise by corr (from mma_online_softmax).
template <int NT>
__device__ __forceinline__ void mma_scale_rows(float (&o)[NT][4], const float (&corr)[2]) {
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    o[n][0] *= corr[0];
    o[n][1] *= corr[0];
    o[n][2] *= corr[1];
    o[n][3] *= corr[1];
  }
}

// Merge the online-softmax partials (max m, sum l, unnormalised output o) of W warps
// for row g, columns [d, d + 4): returns the merged unnormalised output and sets M and
// L. Warps that saw no key (m = -inf) contribute nothing (never 0 * garbage).
template <int W, typename ML, typename O>
__device__ __forceinline__ float4 merge_warp_partials(const ML& sm_m, const ML& sm_l, const O& sm_o, int g, int d,
                                                      float& M, float& L) {
  M = neg_inf();
#pragma unroll
  for (int w = 0; w < W; ++w) M = fmaxf(M, sm_m[w][g]);
  L = 0.f;
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int w = 0; w < W; ++w) {
    const float mw = sm_m[w][g];
    if (mw != neg_inf()) {
      const float c = exp2f(mw - M);
      L += sm_l[w][g] * c;
      const float4 a = *reinterpret_cast<const float4*>(&sm_o[w][g][d]);
      o.x += a.x * c;
      o.y += a.y * c;
      o.z += a.z * c;
      o.w += a.w * c;
    }
  }
  return o;
}

// ---- flash-decoding splits -------------------------------------------------------------

// Split `split` of `nsplit`: key rows [r0, r1) of kv_len, in whole steps of `step` rows.
// Derived from kv_len on the device, so the launch configuration does not depend on it.
__device__ __forceinline__ void split_range(int kv_len, int split, int nsplit, int step, int& r0, int& r1) {
  int per = (kv_len + nsplit - 1) / nsplit;
  per = (per + step - 1) / step * step;
  r0 = min(split * per, kv_len);
  r1 = min(kv_len, r0 + per);
}

// Splits of a launch that get keys: the launch's nsplit (a graph launch carries the most
// any length needs) cut so that no split has fewer than min_rows keys; CTAs of the other
// splits return at once, and the active ones merge among themselves.
__device__ __forceinline__ int active_splits(int kv_len, int nsplit, int min_rows) {
  return max(1, min(nsplit, (kv_len + min_rows - 1) / min_rows));
}

// ---- the split merge ------------------------------------------------------------------
//
// A group (token, KV head, chunk of query heads) runs nsplit CTAs. Each stores its split's
// partial normalised, as 8-byte words (value, lse = m + log2 l) per output column: lse
// makes a word complete on its own, and a word whose lse bits are all ones (kWordEmpty, a
// NaN no split produces) has not been written. The last `mergers` splits of the group
// each poll the words of a share of its outputs until every split's are there, fold them
// in split order (so the result does not depend on who arrived first) and write all ones
// back: the workspace (filled with ones when made) is clear again when the launch ends,
// ready for the next launch or graph replay, with no fence, counter or reset. Those
// mergers wait for every split of their group, so the host passes mergers >= 1 only when
// the whole grid is resident at once (they are also its highest blockIdx.y, dispatched
// last); a larger grid gets 0 and is merged by the group's last CTA to arrive (an arrival
// counter, last_arrival), whose words are then all there.

// Mergers among nsplit active splits, at most `cap` (the host's: 0 or 1 unless the whole
// grid is resident; 0 counts as 1): one below 16 splits, else at most one per 2 splits
// (fewer or more measured slower: docs/kernels.md, "The split merge through flagged words").
__device__ __forceinline__ int split_mergers(int nsplit, int cap) {
  return nsplit < 16 || cap <= 1 ? 1 : min(cap, nsplit >> 1);
}

// Called by every thread once the CTA stored its words: whether it is the group's last CTA
// to arrive (every split's words then visible to it). The last resets the counter for the
// next launch.
__device__ __forceinline__ bool last_arrival(unsigned int* counter, int nsplit, int& sm_flag) {
  __threadfence();  // this thread's words are visible before the CTA's arrival counts
  __syncthreads();
  if (threadIdx.x == 0) {
    const bool last = atomicAdd(counter, 1u) == (unsigned int)(nsplit - 1);
    if (last) *counter = 0u;
    sm_flag = last;
  }
  __syncthreads();
  if (!sm_flag) return false;
  __threadfence();
  return true;
}

// The merger index of split `split` of the group: a static one of the last `mergers`
// splits, or (by_arrival) 0 for the last CTA to arrive; -1 for the others. Every thread
// calls it.
__device__ __forceinline__ int split_merger(bool by_arrival, unsigned int* counter, int split, int nsplit, int mergers,
                                            int& sm_flag) {
  if (by_arrival) return last_arrival(counter, nsplit, sm_flag) ? 0 : -1;
  return split - (nsplit - mergers);  // the shortest splits: split_range gives the remainder to the last
}

// Folds partial (m2, l2, a2) into (M, L, acc): both unnormalised under their own maxima;
// an empty partial (l2 = 0, m2 = -inf) changes nothing and is never multiplied.
__device__ __forceinline__ void fold_partial(float& M, float& L, float4& acc, float m2, float l2, float4 a2) {
  const float mn = fmaxf(M, m2);
  if (mn == neg_inf()) return;  // both empty
  const float ca = exp2f(M - mn);
  const float cb = exp2f(m2 - mn);
  acc = make_float4(fmaf(acc.x, ca, a2.x * cb), fmaf(acc.y, ca, a2.y * cb), fmaf(acc.z, ca, a2.z * cb),
                    fmaf(acc.w, ca, a2.w * cb));
  L = fmaf(L, ca, l2 * cb);
  M = mn;
}

constexpr unsigned int kWordEmpty = 0xffffffffu;

__device__ __forceinline__ unsigned long long split_word(float v, float lse) {
  return (unsigned long long)__float_as_uint(v) | ((unsigned long long)__float_as_uint(lse) << 32);
}
__device__ __forceinline__ bool word_ready(unsigned long long w) { return (unsigned int)(w >> 32) != kWordEmpty; }
__device__ __forceinline__ float word_value(unsigned long long w) { return __uint_as_float((unsigned int)w); }
__device__ __forceinline__ float word_lse(unsigned long long w) { return __uint_as_float((unsigned int)(w >> 32)); }

// Two words at p; each is single-copy atomic (64-bit elements, gpu scope).
__device__ __forceinline__ void store_words(unsigned long long* p, unsigned long long a, unsigned long long b) {
  asm volatile("st.relaxed.gpu.global.v2.b64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}
__device__ __forceinline__ void load_words(const unsigned long long* p, unsigned long long& a, unsigned long long& b) {
  asm volatile("ld.relaxed.gpu.global.v2.b64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}

// One split's result for a row's columns [d, d + 4): the normalised output when the split
// covers the whole sequence, else its four words. out and words point at the row.
template <typename T>
__device__ __forceinline__ void store_split_words(bool single, T* out, unsigned long long* words, float4 o, float M,
                                                  float L, int d) {
  const float inv = L > 0.f ? 1.f / L : 0.f;  // an empty split: o = 0, lse = -inf
  if (single) {
    store4(out + d, make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv));
    return;
  }
  float lse = L > 0.f ? M + log2f(L) : neg_inf();
  if (isnan(lse)) lse = __uint_as_float(0x7fc00000u);  // NaN inputs: a NaN that is not kWordEmpty
  store_words(words + d, split_word(o.x * inv, lse), split_word(o.y * inv, lse));
  store_words(words + d + 2, split_word(o.z * inv, lse), split_word(o.w * inv, lse));
}

// Merger k of `mergers`: merges its share of the group's gcount * D / 4 column quads over
// the nsplit splits' words and stores them normalised. out and words point at the group's
// first row (words at split 0; stride words between splits). J threads per quad (a power
// of two, as many as the share leaves) each take every J-th split, U at a time, then
// combine through shuffles. Every thread of the CTA calls it.
struct SameRow {  // merge_split_words' default: output row g is row g
  __device__ __forceinline__ int operator()(int g) const { return g; }
};

template <int THREADS, int D, typename T, typename RowOf = SameRow>
__device__ __forceinline__ void merge_split_words(T* out, unsigned long long* words, long long stride, int nsplit,
                                                  int gcount, int k, int mergers, RowOf row_of = RowOf()) {
  constexpr int DQ = D / 4;
  constexpr int U = 4;
  constexpr unsigned long long empty = ~0ull;  // as the workspace is made
  const int items = gcount * DQ;
  const int lo = items * k / mergers;
  const int hi = items * (k + 1) / mergers;
  int J = 32;
  while (J > 1 && J * (hi - lo) > THREADS) J >>= 1;
  const int j = threadIdx.x & (J - 1);
  for (int base = lo; base < hi; base += THREADS / J) {  // uniform: every thread reaches the barriers
    const int item = base + threadIdx.x / J;
    const bool ok = item < hi;
    const int g = ok ? item / DQ : 0;
    const int d = ok ? (item - g * DQ) * 4 : 0;
    unsigned long long* p = words + (long long)g * D + d;
    float M = neg_inf(), L = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < nsplit; s0 += U * J) {
      unsigned long long w[U][4];
      unsigned int mine = 0;
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (ok && s0 + u * J + j < nsplit) mine |= 1u << u;
      for (unsigned int todo = mine; todo;) {
#pragma unroll
        for (int u = 0; u < U; ++u)
          if ((todo >> u) & 1u) {
            const unsigned long long* q = p + (long long)(s0 + u * J + j) * stride;
            load_words(q, w[u][0], w[u][1]);
            load_words(q + 2, w[u][2], w[u][3]);
          }
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (((todo >> u) & 1u) && word_ready(w[u][0]) && word_ready(w[u][1]) && word_ready(w[u][2]) &&
              word_ready(w[u][3]))
            todo &= ~(1u << u);
        if (todo) __nanosleep(64);
      }
      // Joining the CTA's polls before any thread folds measured faster (docs/kernels.md, "The split
      // merge through flagged words"); the cause is not pinned down.
      __syncthreads();
#pragma unroll
      for (int u = 0; u < U; ++u)
        if ((mine >> u) & 1u) {
          fold_partial(M, L, acc, word_lse(w[u][0]), 1.f,
                       make_float4(word_value(w[u][0]), word_value(w[u][1]), word_value(w[u][2]), word_value(w[u][3])));
          unsigned long long* q = p + (long long)(s0 + u * J + j) * stride;
          store_words(q, empty, empty);
          store_words(q + 2, empty, empty);
        }
    }
    for (int off = 1; off < J; off <<= 1) {  // in lane order; every lane shuffles
      const float m2 = __shfl_xor_sync(0xffffffffu, M, off);
      const float l2 = __shfl_xor_sync(0xffffffffu, L, off);
      float4 a2;
      a2.x = __shfl_xor_sync(0xffffffffu, acc.x, off);
      a2.y = __shfl_xor_sync(0xffffffffu, acc.y, off);
      a2.z = __shfl_xor_sync(0xffffffffu, acc.z, off);
      a2.w = __shfl_xor_sync(0xffffffffu, acc.w, off);
      fold_partial(M, L, acc, m2, l2, a2);
    }
    if (ok && j == 0) {
      const float inv = 1.f / L;
      store4(out + (long long)row_of(g) * D + d, make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv));
    }
  }
}

// ---- greedy argmax epilogues (int8 / int4 GEMVs) -----------------------------------------

// (value, row) as one 64-bit key whose unsigned order is argmax's: larger values first,
// then lower rows. 0 is below every key (the empty slot).
__device__ __forceinline__ unsigned long long argmax_key(float v, int row) {
  const unsigned int u = __float_as_uint(v);
  const unsigned int ordered = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<unsigned long long>(ordered) << 32) | (0xFFFFFFFFu - static_cast<unsigned int>(row));
}

// After an argmax launch: token[t] = the row in best[t], and best[t] back to 0 (empty)
// for the next launch on the stream. One warp; n <= 32 tokens.
__device__ __forceinline__ void argmax_take(unsigned long long* __restrict__ best, long long* __restrict__ token,
                                            int n) {
  await_inputs();
  const int t = threadIdx.x;
  if (t < n) {
    token[t] = static_cast<long long>(0xFFFFFFFFu - static_cast<unsigned int>(best[t]));
    best[t] = 0ull;
  }
}

}  // namespace edge
