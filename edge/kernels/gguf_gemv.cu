// GGUF linears on the blocks as llama.cpp stores them (compiled at run time by NVRTC, see
// edge/kernels/nvrtc.py; block formats: edge/quant/gguf.py). One module per ggml type
// (CFG_GGUF_TYPE: 2 Q4_0, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K):
//
//   gguf_gemv_*     decode (a token a CTA row): y[t, o] = sum_k x[t, k] * W[o, k] (+ bias[o])
//   gguf_dequant_*  prefill: rows of W as float16 / bfloat16 for cuBLAS
//
// Layout. A weight row is in / B blocks of S bytes (B values each); rows are S * in / B
// bytes apart, so a block starts only 2-byte aligned for Q4_0 (18), Q8_0 (34) and Q6_K
// (210): their fields are read as 16-bit words. A block is cut into pieces of 16 values
// whose scales are the same numbers (Q4_K / Q5_K: 8 codes of sub-block 2c and the 8 at
// the same place of sub-block 2c + 1; Q6_K: 4 codes of each of 4 sub-blocks; Q4_0 / Q8_0:
// half a block). Lane l of a warp takes pieces l, l + 32, ... of each of the warp's R rows,
// so a warp's loads of a block's codes are contiguous.
//
// Arithmetic. Codes become floats without the slow I2F conversion: the float whose bits
// are 0x4B0000uu is 2^23 + u, so subtracting 2^23 (+ an offset) is exact. The value
// d * sc * q - dmin * m of a K-quant is summed as (d * sc) * sum(q x) - (dmin * m) * sum(x)
// over the piece's values of one sub-block (the sums of x shared by the warp's rows);
// Q6_K's (d * sc) * (q - 32), Q4_0's d * (q - 8) and Q8_0's d * q likewise, float32
// throughout: each weight enters with its exact value (the reference rounds the
// dequantized weight to T once before its matmul).
//
// Modes (int8_gemv.cu has the same epilogues and their reasons):
//   kNorm       the input is the residual stream; the dot products run on x * norm_w (the
//               norm weight staged in shared memory, except for argmax) and are scaled by
//               1 / rms(x), whose sum of squares the warp takes while it reads x.
//   kResidual   y[row] = T(y[row] + T(dot + bias)), in place (y must not alias x).
//   kSwiglu     the weight is [gate; up]: a warp's rows are R / 2 gate rows and their up
//               rows; y[j] = T(silu(T(g)) * T(u)).
//   kArgmax     nothing stored: the largest T-rounded output of each token (lowest row
//               among equals) into best[token] by a 64-bit atomicMax; gguf_argmax_take
//               turns it into the token id.
// kStore writes y[t * ld_y + y_off + row] (the part of a fused weight whose parts have
// different types: a launch each, into its columns).
//
// No host-visible state, shapes-only grids: safe in CUDA graphs. sm_80+ (sm_87 Orin, sm_90).
#include "common.cuh"

#ifndef CFG_GGUF_TYPE
#define CFG_GGUF_TYPE 12
#endif
#ifndef CFG_GGUF_WARPS
#define CFG_GGUF_WARPS 4
#endif
#ifndef CFG_GGUF_UNROLL  // pieces a lane loads per row before using any of them
#define CFG_GGUF_UNROLL 4
#endif
#ifndef CFG_GGUF_MIN_BLOCKS
#define CFG_GGUF_MIN_BLOCKS 4
#endif

namespace {

constexpr int kType = CFG_GGUF_TYPE;
constexpr int kWarps = CFG_GGUF_WARPS;
constexpr int kThreads = 32 * kWarps;
constexpr int kUnroll = CFG_GGUF_UNROLL;

constexpr int kQ4_0 = 2, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
static_assert(kType == kQ4_0 || kType == kQ8_0 || kType == kQ4_K || kType == kQ5_K || kType == kQ6_K,
              "CFG_GGUF_TYPE must be 2 (Q4_0), 8 (Q8_0), 12 (Q4_K), 13 (Q5_K) or 14 (Q6_K)");
constexpr bool kKQuant = kType >= kQ4_K;
constexpr int kBlockValues = kKQuant ? 256 : 32;
constexpr int kBlockBytes = kType == kQ4_0 ? 18 : kType == kQ8_0 ? 34 : kType == kQ4_K ? 144 : kType == kQ5_K ? 176 : 210;
constexpr int kPieces = kBlockValues / 16;  // per block
constexpr int kSegs = kType == kQ6_K ? 4 : 2;  // runs of consecutive values in a piece
constexpr int kSegLen = 16 / kSegs;

enum Epilogue { kStore = 0, kResidual = 1, kSwiglu = 2, kArgmax = 3 };

// ---- loads --------------------------------------------------------------------------

__device__ __forceinline__ unsigned int ld_u16(const unsigned char* p) {
  return __ldg(reinterpret_cast<const unsigned short*>(p));
}
// 4 bytes at a 2-byte aligned address.
__device__ __forceinline__ unsigned int ld_u32_a2(const unsigned char* p) {
  return ld_u16(p) | (ld_u16(p + 2) << 16);
}

// What a lane loads for one piece: up to 16 bytes of codes (c), the words its scales
// come from (s) and the piece's index within its block.
struct Piece {
  unsigned int c[4];
  unsigned int s[4];
  int idx;
};

// Load piece p (of the row starting at `row`).
__device__ __forceinline__ void load_piece(const unsigned char* __restrict__ row, int p, Piece& pc) {
  const unsigned char* blk = row + static_cast<long long>(p / kPieces) * kBlockBytes;
  const int i = p % kPieces;
  pc.idx = i;
  if constexpr (kType == kQ4_0) {  // d | qs[16]; piece h = qs[8h, 8h + 8)
    pc.s[0] = ld_u16(blk);
    pc.c[0] = ld_u32_a2(blk + 2 + 8 * i);
    pc.c[1] = ld_u32_a2(blk + 6 + 8 * i);
  } else if constexpr (kType == kQ8_0) {  // d | qs[32]; piece h = qs[16h, 16h + 16)
    pc.s[0] = ld_u16(blk);
#pragma unroll
    for (int k = 0; k < 4; ++k) pc.c[k] = ld_u32_a2(blk + 2 + 16 * i + 4 * k);
  } else if constexpr (kType == kQ4_K || kType == kQ5_K) {
    // d, dmin | scales[12] | (Q5_K: qh[32]) | qs[128]; piece (c, j) = qs[32c + 8j, +8)
    const int c = i >> 2, j = i & 3;
    const uint4 hdr = __ldg(reinterpret_cast<const uint4*>(blk));  // 16-byte aligned blocks
    pc.s[0] = hdr.x;
    pc.s[1] = hdr.y;
    pc.s[2] = hdr.z;
    pc.s[3] = hdr.w;
    const int qs = kType == kQ4_K ? 16 : 48;
    const uint2 q = __ldg(reinterpret_cast<const uint2*>(blk + qs + 32 * c + 8 * j));
    pc.c[0] = q.x;
    pc.c[1] = q.y;
    if constexpr (kType == kQ5_K) {
      const uint2 h = __ldg(reinterpret_cast<const uint2*>(blk + 16 + 8 * j));
      pc.c[2] = h.x;
      pc.c[3] = h.y;
    }
  } else {  // Q6_K: ql[128] | qh[64] | scales[16] (int8) | d; piece (n, k)
    const int n = i >> 3, k = i & 7;
    pc.c[0] = ld_u32_a2(blk + 64 * n + 4 * k);
    pc.c[1] = ld_u32_a2(blk + 64 * n + 32 + 4 * k);
    pc.c[2] = ld_u32_a2(blk + 128 + 32 * n + 4 * k);
    const unsigned char* sc = blk + 192 + 8 * n + (k >> 2);  // sub-blocks 8n + 2g + k / 4, g = 0..3
#pragma unroll
    for (int g = 0; g < 4; ++g) pc.s[g] = __ldg(sc + 2 * g);
    pc.idx |= ld_u16(blk + 208) << 8;  // d rides in the index's upper bits
  }
}

// First value of segment s of piece i of a block (the piece's x positions).
__device__ __forceinline__ int seg_start(int i, int s) {
  if constexpr (kType == kQ4_0) return 8 * i + 16 * s;
  else if constexpr (kType == kQ8_0) return 16 * i + 8 * s;
  else if constexpr (kType == kQ6_K) return 128 * (i >> 3) + 32 * s + 4 * (i & 7);
  else return 64 * (i >> 2) + 32 * s + 8 * (i & 3);
}

// Byte i (0..3) of a word of bytes u, as float: exactly u - offset (0 <= u < 256).
__device__ __forceinline__ float byte_f(unsigned int w, unsigned int i, float offset) {
  return __int_as_float(__byte_perm(w, 0x4B000000u, 0x7540u | i)) - (8388608.0f + offset);
}

// sum_{i<4} (byte_i(w) - offset) * x[i]
__device__ __forceinline__ float dot4(unsigned int w, const float* x, float offset) {
  float s = byte_f(w, 0, offset) * x[0];
  s = fmaf(byte_f(w, 1, offset), x[1], s);
  s = fmaf(byte_f(w, 2, offset), x[2], s);
  return fmaf(byte_f(w, 3, offset), x[3], s);
}

__device__ __forceinline__ float sum8(const float* x) {
  return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
}

// The 6-bit (scale, min) pair of sub-block j of a Q4_K / Q5_K block (scales at bytes 4..15
// of the header words h).
__device__ __forceinline__ void scale_min(const unsigned int* h, int j, float& sc, float& m) {
  auto byte = [&](int b) -> unsigned int { return (h[1 + (b >> 2)] >> (8 * (b & 3))) & 0xFFu; };
  if (j < 4) {
    sc = static_cast<float>(byte(j) & 63u);
    m = static_cast<float>(byte(j + 4) & 63u);
  } else {
    sc = static_cast<float>((byte(j + 4) & 0xFu) | ((byte(j - 4) >> 6) << 4));
    m = static_cast<float>((byte(j + 4) >> 4) | ((byte(j) >> 6) << 4));
  }
}

// The piece's dot product with its 16 activations xf (segment by segment) and, for the
// K-quants' mins, the sums of xf's segments (xs: computed once for all rows).
__device__ __forceinline__ float piece_dot(const Piece& pc, const float* xf, const float* xs) {
  if constexpr (kType == kQ4_0) {
    const float d = __half2float(__ushort_as_half(static_cast<unsigned short>(pc.s[0])));
    const unsigned int lo0 = pc.c[0] & 0x0F0F0F0Fu, lo1 = pc.c[1] & 0x0F0F0F0Fu;
    const unsigned int hi0 = (pc.c[0] >> 4) & 0x0F0F0F0Fu, hi1 = (pc.c[1] >> 4) & 0x0F0F0F0Fu;
    const float s = (dot4(lo0, xf, 8.f) + dot4(lo1, xf + 4, 8.f)) + (dot4(hi0, xf + 8, 8.f) + dot4(hi1, xf + 12, 8.f));
    return d * s;
  } else if constexpr (kType == kQ8_0) {
    const float d = __half2float(__ushort_as_half(static_cast<unsigned short>(pc.s[0])));
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) s += dot4(pc.c[k] ^ 0x80808080u, xf + 4 * k, 128.f);
    return d * s;
  } else if constexpr (kType == kQ4_K || kType == kQ5_K) {
    const int c = pc.idx >> 2;
    unsigned int lo0 = pc.c[0] & 0x0F0F0F0Fu, lo1 = pc.c[1] & 0x0F0F0F0Fu;
    unsigned int hi0 = (pc.c[0] >> 4) & 0x0F0F0F0Fu, hi1 = (pc.c[1] >> 4) & 0x0F0F0F0Fu;
    if constexpr (kType == kQ5_K) {  // bit 2c (2c + 1) of qh[l] is bit 4 of sub-block 2c's (2c + 1's) code l
      lo0 |= ((pc.c[2] >> (2 * c)) & 0x01010101u) << 4;
      lo1 |= ((pc.c[3] >> (2 * c)) & 0x01010101u) << 4;
      hi0 |= ((pc.c[2] >> (2 * c + 1)) & 0x01010101u) << 4;
      hi1 |= ((pc.c[3] >> (2 * c + 1)) & 0x01010101u) << 4;
    }
    const float2 dm = __half22float2(*reinterpret_cast<const __half2*>(&pc.s[0]));
    float sc0, m0, sc1, m1;
    scale_min(pc.s, 2 * c, sc0, m0);
    scale_min(pc.s, 2 * c + 1, sc1, m1);
    const float q0 = dot4(lo0, xf, 0.f) + dot4(lo1, xf + 4, 0.f);
    const float q1 = dot4(hi0, xf + 8, 0.f) + dot4(hi1, xf + 12, 0.f);
    return (dm.x * sc0) * q0 - (dm.y * m0) * xs[0] + ((dm.x * sc1) * q1 - (dm.y * m1) * xs[1]);
  } else {  // Q6_K
    const float d = __half2float(__ushort_as_half(static_cast<unsigned short>(pc.idx >> 8)));
    const unsigned int qa = pc.c[0], qb = pc.c[1], qh = pc.c[2];
    const unsigned int g0 = (qa & 0x0F0F0F0Fu) | ((qh << 4) & 0x30303030u);
    const unsigned int g1 = (qb & 0x0F0F0F0Fu) | ((qh << 2) & 0x30303030u);
    const unsigned int g2 = ((qa >> 4) & 0x0F0F0F0Fu) | (qh & 0x30303030u);
    const unsigned int g3 = ((qb >> 4) & 0x0F0F0F0Fu) | ((qh >> 2) & 0x30303030u);
    auto sc = [&](int g) { return d * static_cast<float>(static_cast<signed char>(pc.s[g])); };
    return (sc(0) * dot4(g0, xf, 32.f) + sc(1) * dot4(g1, xf + 4, 32.f)) +
           (sc(2) * dot4(g2, xf + 8, 32.f) + sc(3) * dot4(g3, xf + 12, 32.f));
  }
}

// The piece's 16 values of a T row (x or the norm weight) as float, segment by segment.
template <typename T, bool kGlobal>
__device__ __forceinline__ void load_vals(const T* __restrict__ base, int blk, int i, float* f) {
  const T* p = base + static_cast<long long>(blk) * kBlockValues;
#pragma unroll
  for (int s = 0; s < kSegs; ++s) {
    const T* at = p + seg_start(i, s);
    if constexpr (kSegLen == 8) {
      const uint4 v = kGlobal ? __ldg(reinterpret_cast<const uint4*>(at)) : *reinterpret_cast<const uint4*>(at);
      edge::Vec<T>::to_float(v, f + 8 * s);
    } else {
      const uint2 v = kGlobal ? __ldg(reinterpret_cast<const uint2*>(at)) : *reinterpret_cast<const uint2*>(at);
      const uint4 w = make_uint4(v.x, v.y, 0u, 0u);
      float tmp[8];
      edge::Vec<T>::to_float(w, tmp);
#pragma unroll
      for (int k = 0; k < 4; ++k) f[4 * s + k] = tmp[k];
    }
  }
}

// R weight rows per warp. `out`: outputs per token (kSwiglu: half the weight's rows). A
// CTA takes row block blockIdx.x / num_tokens of token blockIdx.x % num_tokens.
template <typename T, int R, bool kNorm, int kEpi>
__device__ __forceinline__ void gguf_gemv(T* __restrict__ y, const T* __restrict__ x,
                                          const unsigned char* __restrict__ w, const T* __restrict__ bias,
                                          const T* __restrict__ norm_w, float eps, int out, int in, int ld_y,
                                          int y_off, int num_tokens, unsigned long long* __restrict__ best) {
  static_assert(kEpi != kSwiglu || R % 2 == 0, "SwiGLU needs row pairs");
  constexpr int kOuts = kEpi == kSwiglu ? R / 2 : R;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int tok = blockIdx.x % num_tokens;
  x += static_cast<long long>(tok) * in;
  y += static_cast<long long>(tok) * ld_y + y_off;
  const long long row_bytes = static_cast<long long>(in / kBlockValues) * kBlockBytes;
  const int pieces = in / 16;

  const int row0 = (blockIdx.x / num_tokens * kWarps + warp) * kOuts;
  const unsigned char* wrow[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int o = r < kOuts ? r : r - kOuts;
    const int row = min(row0 + o, out - 1) + (r < kOuts ? 0 : out);
    wrow[r] = w + row * row_bytes;
  }
  const int row = row0 + lane;
  const bool writes = lane < kOuts && row < out;
  float bias_v = 0.f, bias_up = 0.f;  // constants of the step: read before the wait
  if (bias != nullptr && writes) {
    bias_v = edge::to_float(bias[row]);
    if (kEpi == kSwiglu) bias_up = edge::to_float(bias[out + row]);
  }
  extern __shared__ __align__(16) unsigned char smem_w[];
  const T* sw = reinterpret_cast<const T*>(smem_w);
  // The argmax lm_head (thousands of CTAs) reads the norm weight beside x through L1
  // rather than staging it in every CTA.
  constexpr bool kStaged = kNorm && kEpi != kArgmax;
  if (kStaged) {  // the norm weight, by the whole CTA
    for (int v = threadIdx.x; v < (in >> 3); v += kThreads)
      reinterpret_cast<uint4*>(smem_w)[v] = __ldg(reinterpret_cast<const uint4*>(norm_w) + v);
    __syncthreads();
  }
  edge::await_inputs();
  if (row0 >= out) return;  // a short last CTA's idle warps (nothing synchronises below)
  const float residual = kEpi == kResidual && writes ? edge::to_float(y[row]) : 0.f;

  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  float ss = 0.f;
  for (int base = lane; base < pieces; base += 32 * kUnroll) {
    Piece pc[kUnroll][R];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int p = base + 32 * u;
      if (p < pieces) {
#pragma unroll
        for (int r = 0; r < R; ++r) load_piece(wrow[r], p, pc[u][r]);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int p = base + 32 * u;
      if (p < pieces) {
        const int blk = p / kPieces, i = p % kPieces;
        float xf[16];
        load_vals<T, true>(x, blk, i, xf);
        if (kNorm) {
          float nw[16];
          if (kStaged) load_vals<T, false>(sw, blk, i, nw);
          else load_vals<T, true>(norm_w, blk, i, nw);
#pragma unroll
          for (int k = 0; k < 16; ++k) {
            ss = fmaf(xf[k], xf[k], ss);
            xf[k] *= nw[k];
          }
        }
        float xs[2] = {0.f, 0.f};
        if (kKQuant && kType != kQ6_K) {
          xs[0] = sum8(xf);
          xs[1] = sum8(xf + 8);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] += piece_dot(pc[u][r], xf, xs);
      }
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
    if (kNorm) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  }
  if (kNorm) {
    const float inv_rms = rsqrtf(ss / static_cast<float>(in) + eps);
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] *= inv_rms;
  }
  float v = acc[0];
  float up = acc[kOuts % R];
#pragma unroll
  for (int o = 1; o < kOuts; ++o) {
    if (lane == o) {
      v = acc[o];
      up = acc[(o + kOuts) % R];
    }
  }
  if (bias != nullptr) v += bias_v;
  if (kEpi == kArgmax) {
    unsigned long long key = writes ? edge::argmax_key(edge::round_to<T>(v), row) : 0ull;
#pragma unroll
    for (int off = 1; off < kOuts; off <<= 1) {
      const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, off);
      key = other > key ? other : key;
    }
    if (lane == 0) atomicMax(best + tok, key);
    return;
  }
  if (writes) {
    if (kEpi == kSwiglu) {
      const float g = edge::round_to<T>(v);
      if (bias != nullptr) up += bias_up;
      v = g / (1.f + __expf(-g)) * edge::round_to<T>(up);
    } else if (kEpi == kResidual) {
      v = residual + edge::round_to<T>(v);
    }
    y[row] = edge::from_float<T>(v);
  }
}

// Rows [0, rows) of the weight (the host offsets the pointer) as T: one thread a piece,
// each value d * sc * q - dmin * m (one rounding, as edge/quant/gguf.py computes it in
// float32) rounded once to T.
template <typename T>
__device__ __forceinline__ void gguf_dequant(T* __restrict__ y, const unsigned char* __restrict__ w, int rows, int in) {
  edge::await_inputs();
  const int pieces = in / 16;
  const long long id = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (id >= static_cast<long long>(rows) * pieces) return;
  const int r = static_cast<int>(id / pieces), p = static_cast<int>(id % pieces);
  const long long row_bytes = static_cast<long long>(in / kBlockValues) * kBlockBytes;
  Piece pc;
  load_piece(w + r * row_bytes, p, pc);
  const int blk = p / kPieces, i = p % kPieces;
  float v[16];
  if constexpr (kType == kQ4_0 || kType == kQ8_0) {
    const float d = __half2float(__ushort_as_half(static_cast<unsigned short>(pc.s[0])));
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      float q;
      if (kType == kQ4_0) {
        const unsigned int word = pc.c[(k & 7) >> 2];
        q = static_cast<float>(static_cast<int>(((word >> (8 * (k & 3) + (k >= 8 ? 4 : 0))) & 0xFu)) - 8);
      } else {
        q = static_cast<float>(static_cast<signed char>((pc.c[k >> 2] >> (8 * (k & 3))) & 0xFFu));
      }
      v[k] = d * q;
    }
  } else if constexpr (kType == kQ4_K || kType == kQ5_K) {
    const int c = i >> 2;
    const float2 dm = __half22float2(*reinterpret_cast<const __half2*>(&pc.s[0]));
    float sc[2], m[2];
    scale_min(pc.s, 2 * c, sc[0], m[0]);
    scale_min(pc.s, 2 * c + 1, sc[1], m[1]);
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const int s = k >> 3;
      const unsigned int byte = (pc.c[(k & 7) >> 2] >> (8 * (k & 3))) & 0xFFu;
      unsigned int q = s == 0 ? (byte & 0xFu) : (byte >> 4);
      if (kType == kQ5_K) q |= ((pc.c[2 + ((k & 7) >> 2)] >> (8 * (k & 3) + 2 * c + s)) & 1u) << 4;
      v[k] = fmaf(dm.x * sc[s], static_cast<float>(q), -(dm.y * m[s]));  // the product is exact
    }
  } else {
    const float d = __half2float(__ushort_as_half(static_cast<unsigned short>(pc.idx >> 8)));
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const int g = k >> 2, b = k & 3;
      const unsigned int ql = (pc.c[g & 1] >> (8 * b)) & 0xFFu;
      const unsigned int qh = (pc.c[2] >> (8 * b + 2 * g)) & 3u;
      const int q = static_cast<int>(((g >= 2 ? ql >> 4 : ql & 0xFu) | (qh << 4))) - 32;
      v[k] = (d * static_cast<float>(static_cast<signed char>(pc.s[g]))) * static_cast<float>(q);
    }
  }
  T* yr = y + static_cast<long long>(r) * in + static_cast<long long>(blk) * kBlockValues;
#pragma unroll
  for (int s = 0; s < kSegs; ++s) {
#pragma unroll
    for (int k = 0; k < kSegLen; ++k) yr[seg_start(i, s) + k] = edge::from_float<T>(v[kSegLen * s + k]);
  }
}

}  // namespace

#if CFG_GGUF_MIN_BLOCKS > 0
#define CFG_GGUF_BOUNDS __launch_bounds__(kThreads, CFG_GGUF_MIN_BLOCKS)
#else
#define CFG_GGUF_BOUNDS __launch_bounds__(kThreads)
#endif

#define CFG_GGUF_GEMV(NAME, T, R, NORM, EPI)                                                                  \
  extern "C" __global__ void CFG_GGUF_BOUNDS NAME(                                                            \
      T* __restrict__ y, const T* __restrict__ x, const unsigned char* __restrict__ w, const T* __restrict__ bias, \
      const T* __restrict__ norm_w, float eps, int out, int in, int ld_y, int y_off, int num_tokens,          \
      unsigned long long* __restrict__ best) {                                                                \
    gguf_gemv<T, R, NORM, EPI>(y, x, w, bias, norm_w, eps, out, in, ld_y, y_off, num_tokens, best);           \
  }

#define CFG_GGUF_MODES(DT, T)                                                         \
  CFG_GGUF_GEMV(gguf_gemv_##DT##_r1, T, 1, false, kStore)                             \
  CFG_GGUF_GEMV(gguf_gemv_##DT##_r2, T, 2, false, kStore)                             \
  CFG_GGUF_GEMV(gguf_gemv_norm_##DT##_r1, T, 1, true, kStore)                         \
  CFG_GGUF_GEMV(gguf_gemv_norm_##DT##_r2, T, 2, true, kStore)                         \
  CFG_GGUF_GEMV(gguf_gemv_residual_##DT##_r1, T, 1, false, kResidual)                 \
  CFG_GGUF_GEMV(gguf_gemv_residual_##DT##_r2, T, 2, false, kResidual)                 \
  CFG_GGUF_GEMV(gguf_gemv_swiglu_##DT##_r2, T, 2, false, kSwiglu)                     \
  CFG_GGUF_GEMV(gguf_gemv_norm_swiglu_##DT##_r2, T, 2, true, kSwiglu)                 \
  CFG_GGUF_GEMV(gguf_gemv_argmax_##DT##_r2, T, 2, false, kArgmax)                     \
  CFG_GGUF_GEMV(gguf_gemv_norm_argmax_##DT##_r2, T, 2, true, kArgmax)                 \
  extern "C" __global__ void gguf_dequant_##DT(T* __restrict__ y, const unsigned char* __restrict__ w, int rows, \
                                               int in) {                              \
    gguf_dequant<T>(y, w, rows, in);                                                  \
  }

CFG_GGUF_MODES(bf16, __nv_bfloat16)
CFG_GGUF_MODES(f16, __half)

extern "C" __global__ void gguf_argmax_take(unsigned long long* __restrict__ best, long long* __restrict__ token, int n) {
  edge::argmax_take(best, token, n);
}
