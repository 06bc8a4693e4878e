// Paged decode attention on tensor cores (float16 / bfloat16; mma.sync m16n8k16 and
// ldmatrix, sm_80+: the same code runs on sm_87 and sm_90).
//
// One query token. The (up to 16) query heads that share a KV head form the 16 rows of
// one m16 tile (GQA: each K/V row is read from global memory once for the whole group;
// rows past the group are zero and never written), so Q K^T and P V are two small
// matrix products per 16 keys instead of ~100 dependent CUDA-core instructions per
// key: the kernel is left with nothing to do but stream K and V.
//
// Grid: x = kv_heads * ceil(group / 16) (the verify step's: below), y = num_splits
// (each split's key range is derived in-kernel from kv_len, read from the device `pos`
// when given, so one launch configuration serves every length: CUDA-graph safe), z = 1.
// A CTA has W warps; a stage of 16 * W keys is gathered from the pages with cp.async
// into padded shared memory (STAGES deep, dynamic shared memory: the host picks STAGES
// per device so that CFG_TC_MIN_BLOCKS CTAs fit an SM, paged_cuda.tc_stages), warp w
// takes keys [16 w, 16 w + 16) of each stage with its own online softmax (float32, exp2
// domain); the warps merge through shared memory, then the CTA writes the output (one
// split) or its partial as flagged words, and the last `mergers` splits of the KV head
// each merge a share of the outputs as the words arrive (common.cuh, the split merge; as
// in paged_decode.cu).
// Keys at or past kv_len are never read (zero-filled in shared memory, masked -inf).
//
// With CFG_KV_INT8 the program holds the int8-KV entry points instead (*_q8): pools of
// int8 codes with a float32 scale a row (common.cuh, "int8 K/V rows"). A stage then
// holds the codes (rows of D + 16 bytes: conflict-free ldmatrix) and the rows' scales;
// Q K^T and P V run on float16 tensor cores over the exact codes (the query scaled into
// float16 by a power of two a row), the key scale multiplies the scores and the value
// scale the probabilities, each warp keeping its output in units of the largest value
// scale it has seen (rescaled like a moving row maximum).
#include "common.cuh"

// Defaults of a bare compile; the engine always passes CFG_TC_STAGES (chosen per
// device from its shared memory, paged_cuda.tc_stages).
#ifndef CFG_TC_WARPS
#define CFG_TC_WARPS 8
#endif
#ifndef CFG_TC_STAGES
#define CFG_TC_STAGES 2
#endif
// 8 warps: one CTA an SM, so no register cap (~173 used; 128 would spill).
#ifndef CFG_TC_MIN_BLOCKS
#define CFG_TC_MIN_BLOCKS (CFG_TC_WARPS >= 8 ? 1 : CFG_TC_WARPS >= 4 ? 2 : 4)
#endif

namespace edge {

constexpr int kTcRows = 16;  // query heads per CTA: one m16 tile

// The element type of the pools: T, or int8 codes.
template <typename T, bool Q8>
struct KvElem {
  typedef T type;
};
template <typename T>
struct KvElem<T, true> {
  typedef signed char type;
};

// TILES row tiles a CTA (the verify step's pairs, below): its warps split between them,
// W / TILES a tile, and a stage holds 16 keys a warp of one tile.
template <typename T, int D, int W, int STAGES, int TILES = 1, bool Q8 = false>
struct TcCfg {
  static_assert(W % TILES == 0, "the warps split evenly between the row tiles");
  static constexpr int WT = W / TILES;  // warps a row tile
  static constexpr int THREADS = 32 * W;
  static constexpr int KEYS = 16 * WT;  // keys per stage
  static constexpr int EB = Q8 ? 1 : (int)sizeof(T);  // bytes an element of the pools
  static constexpr int VEC = 16 / EB;                   // elements a 16-byte chunk
  // Padded row: conflict-free ldmatrix (int8: 16 bytes more, 8 rows of a matrix then
  // start 4 banks apart).
  static constexpr int LDS = Q8 ? D + 16 : D + 8;
  static constexpr int STAGE_ELEMS = KEYS * LDS;
  static constexpr int KSTEPS = D / 16;
  static constexpr int NT_D = D / 8;
  static constexpr int CHUNKS = D / VEC;  // 16-byte chunks per row
  static constexpr int PER_THREAD = KEYS * CHUNKS / THREADS;  // K copies per thread per stage
  static constexpr int ROWS_PER_PASS = THREADS / CHUNKS;
  static constexpr int DATA_BYTES = STAGES * 2 * STAGE_ELEMS * EB;
  // int8: each stage's K then V scales, float32 [STAGES][2][KEYS], after the rows.
  static constexpr int PIPE_BYTES = DATA_BYTES + (Q8 ? STAGES * 2 * KEYS * 4 : 0);
  static constexpr int ACC_BYTES = W * kTcRows * D * 4;
  // Dynamic shared memory the launch must pass (paged_cuda.tc_smem_bytes says the same).
  static constexpr int SMEM_BYTES = PIPE_BYTES > ACC_BYTES ? PIPE_BYTES : ACC_BYTES;
  static_assert(THREADS % CHUNKS == 0 && KEYS % ROWS_PER_PASS == 0, "stage copies must split over threads");
  static_assert(STAGES >= 1, "need a stage");
};

// With ROPE the kernel also does the step's q/k norm + RoPE and K/V store (the
// qk_norm_rope launch before it, fused.cu): q is then the qkv projection's row
// [(q_heads + 2 kv_heads) * D]; after the grid-dependency wait each CTA normalises and
// rotates its query heads into shared memory, and the CTAs whose split holds the newest
// row rotate its key, store key and value into the pools and into the stage that holds
// the row.
struct RopeArgs {
  const void* qk_norm;  // [q_heads + kv_heads, D] per-head norm weights, or null
  const void* cos_tab;  // [max_pos, D]
  const void* sin_tab;  // [max_pos, D], rotate_half's sign folded in
  int max_pos;
  float eps;
};

// MULTI (the speculative verify step): q is [tokens, q_heads, D] at positions *pos ..
// *pos + tokens - 1 (their K/V already stored), token i attends to keys [0, *pos + i].
// The m16 tile's rows are a KV head's (token, query head) pairs, token-major (group 4: 4
// tokens a tile), each row masked at its own length; a CTA's split range covers its last
// token's keys. Rows land in out at [token, head]; the split words of a CTA's rows are
// contiguous (row kvh * tokens * group + its index).
//
// TILES = 2 (MULTI only): a CTA takes two adjacent row tiles of its KV head, half its
// warps each, so every K/V stage is copied once for both and the grid has half the CTAs
// (a verify step of 5..8 tokens at group 4 has two tiles a KV head: on few SMs, one CTA
// each took two waves). A second tile past the KV head's rows is empty: its warps only
// copy and wait at the barriers.
//
// MULTI and ROPE: q is the qkv projection's rows [tokens, (q_heads + 2 kv_heads) * D]
// (at most 2 W tokens). The CTA normalises and rotates its rows' queries, and the step's
// keys and values inside its split range (warp w: tokens w and w + W) come from
// registers as the decode step's newest row does: stored into the pools by every CTA
// whose range holds them (the same bytes), never copied from there.
template <typename T, int D, int W, int STAGES, bool ROPE, bool MULTI, int TILES = 1, bool Q8 = false>
__device__ __forceinline__ void paged_decode_tc(
    T* __restrict__ out,             // [q_heads, D]
    const T* __restrict__ q,         // [q_heads, D] (ROPE: the qkv row)
    typename KvElem<T, Q8>::type* __restrict__ k_pool,  // [num_blocks, page, kv_heads, D] (written with ROPE)
    typename KvElem<T, Q8>::type* __restrict__ v_pool,  // [num_blocks, page, kv_heads, D]
    float* __restrict__ k_scale,     // Q8: [num_blocks, page, kv_heads] (written with ROPE); else null
    float* __restrict__ v_scale,
    const int* __restrict__ table,   // [max_blocks]
    const int* __restrict__ pos,     // device position (kv_len = *pos + 1) or null
    int host_len,                    // kv_len when pos is null
    int kv_heads, int group, int log2_page, float scale_log2,
    unsigned long long* __restrict__ ws,  // [num_splits, q_heads, D] split words (num_splits > 1)
    unsigned int* __restrict__ counters,  // arrivals per KV head (mergers = 0)
    int mergers,                     // most splits per KV head that merge; 0: the last to arrive
    int min_rows,                    // fewest keys per active split (active_splits)
    RopeArgs rope,
    int tokens) {                    // MULTI: query tokens (1 otherwise)
  static_assert(TILES == 1 || MULTI, "row tiles in pairs for the verify step");
  using C = TcCfg<T, D, W, STAGES, TILES, Q8>;
  using KV = typename KvElem<T, Q8>::type;
  constexpr int THREADS = C::THREADS, KEYS = C::KEYS, LDS = C::LDS, KSTEPS = C::KSTEPS, WT = C::WT;
  constexpr int NT_D = C::NT_D, CHUNKS = C::CHUNKS, VEC = C::VEC;

  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float sm_m[W][kTcRows];
  __shared__ float sm_l[W][kTcRows];
  __shared__ int sm_merger;
  __shared__ __align__(16) T sm_q[ROPE ? TILES * kTcRows : 1][D];  // ROPE: the rotated query heads
  if (dynamic_smem_bytes() < (unsigned int)C::SMEM_BYTES) __trap();  // launched with too little
  KV* pipe = reinterpret_cast<KV*>(smem);  // stage s: K at s * 2 * STAGE_ELEMS, then V
  // Q8: stage s's key scales at s * 2 * KEYS, then its value scales.
  float* sm_scale = reinterpret_cast<float*>(smem + C::DATA_BYTES);
  float(*sm_o)[kTcRows][D] = reinterpret_cast<float(*)[kTcRows][D]>(smem);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int gid = lane >> 2;
  const int tig = lane & 3;
  const int tile = warp / WT;        // this warp's row tile of the CTA's
  const int wk = warp - tile * WT;   // its 16 keys of each stage
  const int rows_all = MULTI ? tokens * group : group;  // a KV head's query rows
  const int ctas_head = (rows_all + TILES * kTcRows - 1) / (TILES * kTcRows);  // CTAs a KV head
  const int kvh = blockIdx.x / ctas_head;
  const int row0 = (blockIdx.x - kvh * ctas_head) * TILES * kTcRows;  // the CTA's first row of the KV head
  const int crows = min(TILES * kTcRows, rows_all - row0);            // the CTA's rows
  const int trow0 = tile * kTcRows;                                   // the warp's tile's first, among them
  const int gcount = max(0, min(kTcRows, crows - trow0));             // its rows (0: an empty tile)
  const int q_heads = kv_heads * group;
  // The CTA's first row's place among the split words' rows (MULTI), or its query head.
  const int head0 = MULTI ? kvh * rows_all + row0 : kvh * group + row0;
  const int split = blockIdx.y;
  const int len0 = pos != nullptr ? __ldg(pos) + 1 : host_len;  // token 0's keys
  // MULTI: row r is token (row0 + r) / group; the CTA's range ends at its last token's.
  const int kv_len = MULTI ? len0 + (row0 + crows - 1) / group : len0;
  const int nsplit = active_splits(kv_len, gridDim.y, min_rows);
  if (split >= nsplit) return;
  const bool by_arrival = mergers == 0;
  mergers = split_mergers(nsplit, mergers);
  int r0, r1;
  split_range(kv_len, split, nsplit, KEYS, r0, r1);
  const int nstage = (r1 - r0 + KEYS - 1) / KEYS;

  const long long row_stride = (long long)kv_heads * D;
  const long long head_off = (long long)kvh * D;

  // Copies of a stage: this thread moves 16-byte chunk `my_cc` of rows my_r + i * RPP.
  // The block-table lookups (a dependent global load before each copy can issue) run one
  // stage ahead into registers, so they are never on a stage's critical path.
  constexpr int PT = C::PER_THREAD, RPP = C::ROWS_PER_PASS;
  const int my_r = tid / CHUNKS;
  const int my_cc = tid - my_r * CHUNKS;
  auto fetch_slots = [&](int s, int (&slot)[PT]) {
    const int sbase = r0 + s * KEYS + my_r;
#pragma unroll
    for (int i = 0; i < PT; ++i) {
      const int row = sbase + i * RPP;
      slot[i] = (s < nstage && row < r1) ? (int)paged_slot(table, row, log2_page) : -1;
    }
  };
  // The copies of stage s for this thread's rows, all but rows [skip_lo, skip_hi) of the
  // range (uncommitted; rows past r1 are zero-filled whatever they are: masked keys are
  // multiplied by 0, which a stale NaN would survive).
  auto copy_stage = [&](int s, const int (&slot)[PT], int skip_lo, int skip_hi) {
    if (s < nstage) {
      KV* dk = pipe + (s % STAGES) * 2 * C::STAGE_ELEMS + my_r * LDS + my_cc * VEC;
      KV* dv = dk + C::STAGE_ELEMS;
      float* dks = sm_scale + (s % STAGES) * 2 * KEYS + my_r;
      const int sbase = r0 + s * KEYS + my_r;
#pragma unroll
      for (int i = 0; i < PT; ++i) {
        const int row = sbase + i * RPP;
        if (row >= skip_lo && row < skip_hi && row < r1) continue;
        const bool ok = slot[i] >= 0;  // rows at or past r1: zero-filled, not read
        const long long off = ok ? (long long)slot[i] * row_stride + head_off + my_cc * VEC : 0;
        cp_async16(smem_u32(dk + i * RPP * LDS), k_pool + off, ok ? 16 : 0);
        cp_async16(smem_u32(dv + i * RPP * LDS), v_pool + off, ok ? 16 : 0);
        if constexpr (Q8) {
          if (my_cc == 0) {  // the row's scales: zero past r1 (a masked key's value then adds 0)
            const long long so = ok ? (long long)slot[i] * kv_heads + kvh : 0;
            cp_async4(smem_u32(dks + i * RPP), k_scale + so, ok ? 4 : 0);
            cp_async4(smem_u32(dks + i * RPP + KEYS), v_scale + so, ok ? 4 : 0);
          }
        }
      }
    }
  };
  // ROPE: the step's K/V rows come from registers (put_new), never from the pool: the
  // decode token's (the newest), or the verify step's tokens' (positions len0 - 1 ..).
  const int newest = kv_len - 1;
  const int new_lo = MULTI ? len0 - 1 : newest;
  const int new_hi = MULTI ? (ROPE ? new_lo + tokens : new_lo) : newest + 1;
  auto issue_stage = [&](int s, const int (&slot)[PT]) {
    copy_stage(s, slot, ROPE ? new_lo : 0, ROPE ? new_hi : 0);
    cp_async_commit();  // (possibly empty) group: keeps the group count uniform
  };

  // Before the grid-dependency wait (overlapped launches, common.cuh): every K/V row but
  // the step's (stored by this kernel, or by the kernel before) is already in the pool,
  // so all STAGES stages' copies go out while the previous kernel finishes (its split
  // merge, in an attention-after-attention graph). After the wait the newest row, when a
  // prologue stage holds it, is loaded into its place by the threads that own it (plain
  // loads: its cp.async group is already committed); q comes after. MULTI without ROPE
  // waits first: the tokens' rows it reads were stored by the kernel before.
  constexpr int E = D / 32;
  using Rp = Pack<T, E>;
  constexpr bool kEarly = !MULTI || ROPE;  // copies before the wait
  constexpr int NEW = MULTI && ROPE ? 2 : 1;  // the step's rows a warp holds
  const T* norm_w = static_cast<const T*>(rope.qk_norm);
  Rp rcos, rsin, knew[NEW] = {}, vnew[NEW] = {};  // ROPE: this lane's slots of the position's tables, the step's K/V
  unsigned int kcodes[NEW] = {}, vcodes[NEW] = {};  // ROPE and Q8: the step's K/V rows as this lane's codes
  float kscale[NEW] = {}, vscale[NEW] = {};         // ... and the rows' scales
  if constexpr (ROPE && !MULTI) {
    const long long p = min(newest, rope.max_pos - 1);  // never read outside the tables
    rcos = *reinterpret_cast<const Rp*>(static_cast<const T*>(rope.cos_tab) + p * D + lane * E);
    rsin = *reinterpret_cast<const Rp*>(static_cast<const T*>(rope.sin_tab) + p * D + lane * E);
  }
  int slots[PT];
  if constexpr (!kEarly) {  // the newest tokens' rows were stored by the kernel before
    grid_dependency_wait();
    allow_dependents();
  }
#pragma unroll
  for (int s = 0; s < STAGES; ++s) {
    fetch_slots(s, slots);
    copy_stage(s, slots, new_lo, new_hi);  // MULTI without ROPE: an empty range
    cp_async_commit();
  }
  fetch_slots(STAGES, slots);
  if constexpr (kEarly) {
    grid_dependency_wait();
    allow_dependents();
  }
  const int new_off = newest - r0;
  const bool holds_newest = !MULTI && new_off >= 0 && newest < r1;
  // Row j of warp `warp`'s share (ROPE): the decode token (last warp) or verify token
  // warp + j * W, when this split's range holds its position.
  auto new_pos = [&](int j) { return MULTI ? new_lo + warp + j * W : newest; };
  auto holds_new = [&](int j) {
    if constexpr (MULTI) {
      const int p = new_pos(j);
      return warp + j * W < tokens && p >= r0 && p < r1;
    } else {
      return holds_newest && warp == W - 1;
    }
  };
  auto new_stage_of = [&](int j) { return (new_pos(j) - r0) / KEYS; };
  auto put_new = [&](int j) {  // ROPE: row j of this warp's share into its stage's buffer
    const int off = new_pos(j) - r0;
    KV* dst = pipe + ((off / KEYS) % STAGES) * 2 * C::STAGE_ELEMS + (off % KEYS) * LDS + lane * E;
    if constexpr (Q8) {
      store_codes<E>(dst, kcodes[j]);
      store_codes<E>(dst + C::STAGE_ELEMS, vcodes[j]);
      if (lane == 0) {
        float* ds = sm_scale + ((off / KEYS) % STAGES) * 2 * KEYS + off % KEYS;
        ds[0] = kscale[j];
        ds[KEYS] = vscale[j];
      }
    } else {
      *reinterpret_cast<Rp*>(dst) = knew[j];
      *reinterpret_cast<Rp*>(dst + C::STAGE_ELEMS) = vnew[j];
    }
  };
  const int new_at = holds_newest ? new_off : 0;  // the row's place in its stage's buffer
  KV* const new_stage = pipe + ((new_at / KEYS) % STAGES) * 2 * C::STAGE_ELEMS + (new_at % KEYS) * LDS;
  if constexpr (ROPE) {
    const int width = (q_heads + 2 * kv_heads) * D;  // a qkv row
    // Loads first (q heads, and the step's k and v rows a warp holds), then the math:
    // one round trip after the wait, as without ROPE.
    Rp kin[NEW], vin[NEW];
#pragma unroll
    for (int j = 0; j < NEW; ++j) {
      if (holds_new(j)) {
        const T* kx = q + (long long)(MULTI ? warp + j * W : 0) * width + (long long)(q_heads + kvh) * D + lane * E;
        kin[j] = *reinterpret_cast<const Rp*>(kx);
        vin[j] = *reinterpret_cast<const Rp*>(kx + (long long)kv_heads * D);
      }
    }
    for (int g = warp; g < crows; g += W) {
      const int i = row0 + g;  // MULTI: the KV head's row i is token i / group
      const int head = MULTI ? kvh * group + i % group : head0 + g;
      const int tok = MULTI ? i / group : 0;
      const Rp x = *reinterpret_cast<const Rp*>(q + (long long)tok * width + (long long)head * D + lane * E);
      Rp c = rcos, sn = rsin;
      if constexpr (MULTI) {
        const long long p = min(new_lo + tok, rope.max_pos - 1);
        c = *reinterpret_cast<const Rp*>(static_cast<const T*>(rope.cos_tab) + p * D + lane * E);
        sn = *reinterpret_cast<const Rp*>(static_cast<const T*>(rope.sin_tab) + p * D + lane * E);
      }
      *reinterpret_cast<Rp*>(&sm_q[g][lane * E]) =
          norm_rope_lane<T, D>(x, norm_w != nullptr ? norm_w + (long long)head * D : nullptr, c, sn, rope.eps, lane);
    }
#pragma unroll
    for (int j = 0; j < NEW; ++j) {
      if (holds_new(j)) {
        // Every CTA holding the row computes it; the chunks and CTAs of one KV head store
        // the same bytes. Its stage gets it from these registers (the copies skip the
        // row), so nothing here waits for the pool store.
        Rp c = rcos, sn = rsin;
        if constexpr (MULTI) {
          const long long p = min(new_pos(j), rope.max_pos - 1);
          c = *reinterpret_cast<const Rp*>(static_cast<const T*>(rope.cos_tab) + p * D + lane * E);
          sn = *reinterpret_cast<const Rp*>(static_cast<const T*>(rope.sin_tab) + p * D + lane * E);
        }
        knew[j] = norm_rope_lane<T, D>(kin[j], norm_w != nullptr ? norm_w + (long long)(q_heads + kvh) * D : nullptr,
                                       c, sn, rope.eps, lane);
        vnew[j] = vin[j];
        const long long slot = paged_slot(table, new_pos(j), log2_page);
        const long long off = slot * row_stride + head_off + lane * E;
        if constexpr (Q8) {
          kcodes[j] = quantize_row_lane<T, E>(knew[j], kscale[j]);
          vcodes[j] = quantize_row_lane<T, E>(vnew[j], vscale[j]);
          store_codes<E>(k_pool + off, kcodes[j]);
          store_codes<E>(v_pool + off, vcodes[j]);
          if (lane == 0) {
            k_scale[slot * kv_heads + kvh] = kscale[j];
            v_scale[slot * kv_heads + kvh] = vscale[j];
          }
        } else {
          *reinterpret_cast<Rp*>(k_pool + off) = knew[j];
          *reinterpret_cast<Rp*>(v_pool + off) = vnew[j];
        }
        if (new_stage_of(j) < STAGES) put_new(j);
      }
    }
    __syncthreads();
  } else if (holds_newest && new_off < STAGES * KEYS && my_r == new_off % RPP) {
    const long long slot = paged_slot(table, newest, log2_page);
    const long long off = slot * row_stride + head_off + my_cc * VEC;
    *reinterpret_cast<uint4*>(new_stage + my_cc * VEC) = __ldcg(reinterpret_cast<const uint4*>(k_pool + off));
    *reinterpret_cast<uint4*>(new_stage + C::STAGE_ELEMS + my_cc * VEC) =
        __ldcg(reinterpret_cast<const uint4*>(v_pool + off));
    if constexpr (Q8) {
      if (my_cc == 0) {
        float* ds = sm_scale + ((new_at / KEYS) % STAGES) * 2 * KEYS + new_at % KEYS;
        ds[0] = __ldcg(k_scale + slot * kv_heads + kvh);
        ds[KEYS] = __ldcg(v_scale + slot * kv_heads + kvh);
      }
    }
  }

  // Q fragments (A operand): rows gid and gid + 8 of the head tile.
  const bool qv0 = gid < gcount;
  const bool qv1 = gid + 8 < gcount;
  // MULTI: row r's token and query head, its key limit and its place in out.
  auto row_token = [&](int r) { return (row0 + r) / group; };  // r: a row of the CTA's
  auto out_row = [&](int r) {
    const int i = row0 + r;
    return MULTI ? (i / group) * q_heads + kvh * group + i % group : head0 + r;
  };
  const T* q0;
  const T* q1;
  if constexpr (MULTI && !ROPE) {
    q0 = q + (long long)out_row(trow0 + (qv0 ? gid : 0)) * D;
    q1 = q + (long long)out_row(trow0 + (qv1 ? gid + 8 : 0)) * D;
  } else {
    const T* qtile = ROPE ? &sm_q[trow0][0] : q + (long long)(head0 + trow0) * D;
    q0 = qtile + gid * D;
    q1 = qtile + (gid + 8) * D;
  }
  const int lim[2] = {MULTI ? min(r1, len0 + row_token(trow0 + gid)) : r1,
                      MULTI ? min(r1, len0 + row_token(trow0 + gid + 8)) : r1};
  unsigned int qa[KSTEPS][4];
  float rs[2] = {scale_log2, scale_log2};  // Q8: each row's score factor (its float16 scaling undone)
  if constexpr (Q8) {
    q_fragments_int8<T, D>(qa, qv0 ? q0 : nullptr, qv1 ? q1 : nullptr, scale_log2, rs);
  } else {
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      const int c0 = ks * 16 + tig * 2;
      qa[ks][0] = qv0 ? *reinterpret_cast<const unsigned int*>(q0 + c0) : 0u;
      qa[ks][1] = qv1 ? *reinterpret_cast<const unsigned int*>(q1 + c0) : 0u;
      qa[ks][2] = qv0 ? *reinterpret_cast<const unsigned int*>(q0 + c0 + 8) : 0u;
      qa[ks][3] = qv1 ? *reinterpret_cast<const unsigned int*>(q1 + c0 + 8) : 0u;
    }
  }

  float o[NT_D][4];
#pragma unroll
  for (int n = 0; n < NT_D; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float mrow[2] = {neg_inf(), neg_inf()};
  float lrow[2] = {0.f, 0.f};
  // Q8: o is kept in units of vref, the largest value scale this warp has seen (so the
  // probabilities times value scale / vref stay in float16's range); vinv = 1 / vref.
  float vref = 0.f, vinv = 0.f;

  for (int s = 0; s < nstage; ++s) {
    if (s > 0) {
      __syncthreads();  // everyone is done with stage s - 1: its buffer takes stage s - 1 + STAGES
      issue_stage(s + STAGES - 1, slots);
      if constexpr (ROPE) {
#pragma unroll
        for (int j = 0; j < NEW; ++j)
          if (holds_new(j) && new_stage_of(j) == s + STAGES - 1) put_new(j);
      }
      fetch_slots(s + STAGES, slots);  // lands while the stages in flight are computed
    }
    cp_async_wait<STAGES - 1>();  // this thread's copies of stage s
    __syncthreads();              // everyone's

    const int k0 = r0 + s * KEYS + wk * 16;
    if constexpr (Q8) {
      if (k0 < r1 && gcount > 0) {
        const KV* sk = pipe + (s % STAGES) * 2 * C::STAGE_ELEMS + wk * 16 * LDS;
        const float* ssk = sm_scale + (s % STAGES) * 2 * KEYS + wk * 16;
        float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        mma_qk16_int8<D>(sc, qa, sk, LDS);
        // Keys j * 8 + 2 t + {0, 1} of the warp's 16: this lane's score columns.
        const float2 ks[2] = {*reinterpret_cast<const float2*>(ssk + tig * 2),
                              *reinterpret_cast<const float2*>(ssk + 8 + tig * 2)};
        const float2 vs[2] = {*reinterpret_cast<const float2*>(ssk + KEYS + tig * 2),
                              *reinterpret_cast<const float2*>(ssk + KEYS + 8 + tig * 2)};
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int key = k0 + j * 8 + tig * 2 + (c & 1);
            sc[j][c] = key < lim[c >> 1] ? sc[j][c] * rs[c >> 1] * ((c & 1) ? ks[j].y : ks[j].x) : neg_inf();
          }
        }
        float corr[2];
        mma_online_softmax<2>(sc, mrow, lrow, corr);
        float vmax = fmaxf(fmaxf(vs[0].x, vs[0].y), fmaxf(vs[1].x, vs[1].y));
        vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 1));
        vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 2));  // the 16 keys' (warp-uniform)
        if (vmax > vref) {  // o to the new unit
          corr[0] *= vref / vmax;
          corr[1] *= vref / vmax;
          vref = vmax;
          vinv = 1.f / vmax;
        }
        if (corr[0] != 1.f || corr[1] != 1.f) mma_scale_rows<NT_D>(o, corr);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
          for (int c = 0; c < 4; ++c) sc[j][c] *= ((c & 1) ? vs[j].y : vs[j].x) * vinv;
        }
        mma_pv16_int8<D>(o, sc[0], sc[1], sk + C::STAGE_ELEMS, LDS);
      }
    } else if (k0 < r1 && gcount > 0) {  // warp-uniform: this warp's 16 keys hold at least one valid key
      const T* sk = pipe + (s % STAGES) * 2 * C::STAGE_ELEMS + wk * 16 * LDS;
      const T* sv = sk + C::STAGE_ELEMS;

      float sc[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
      const T* kaddr = sk + ((lane >> 4) * 8 + (lane & 7)) * LDS + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
        unsigned int b00, b01, b10, b11;
        ldmatrix_x4(b00, b01, b10, b11, smem_u32(kaddr + ks * 16));
        mma16816<T>(sc[0], qa[ks], b00, b01);
        mma16816<T>(sc[1], qa[ks], b10, b11);
      }

#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int key = k0 + j * 8 + tig * 2 + (c & 1);
          sc[j][c] = key < lim[c >> 1] ? sc[j][c] * scale_log2 : neg_inf();
        }
      }
      float corr[2];
      mma_online_softmax<2>(sc, mrow, lrow, corr);
      if (corr[0] != 1.f || corr[1] != 1.f) mma_scale_rows<NT_D>(o, corr);  // only when a row max moved
      mma_pv16<T, D>(o, sc[0], sc[1], sv, LDS);
    }
  }
  cp_async_wait_all();
  __syncthreads();  // the pipeline buffers become sm_o

  // Per-warp state to shared memory (rows < gcount only).
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float lsum = lrow[i];
    lsum += __shfl_xor_sync(0xffffffffu, lsum, 1);
    lsum += __shfl_xor_sync(0xffffffffu, lsum, 2);
    const int row = gid + 8 * i;
    if (row < gcount) {
      if constexpr (Q8) {  // columns 16 c + 4 t + {0..3} from the even / odd tiles (mma_pv16_int8), in units of vref
#pragma unroll
        for (int c = 0; c < D / 16; ++c)
          *reinterpret_cast<float4*>(&sm_o[warp][row][c * 16 + tig * 4]) =
              make_float4(o[2 * c][2 * i] * vref, o[2 * c + 1][2 * i] * vref, o[2 * c][2 * i + 1] * vref,
                          o[2 * c + 1][2 * i + 1] * vref);
      } else {
#pragma unroll
        for (int n = 0; n < NT_D; ++n)
          *reinterpret_cast<float2*>(&sm_o[warp][row][n * 8 + tig * 2]) = make_float2(o[n][2 * i], o[n][2 * i + 1]);
      }
      if (tig == 0) {
        sm_m[warp][row] = mrow[i];
        sm_l[warp][row] = lsum;
      }
    }
  }
  __syncthreads();

  // Merge the warps: output (one split) or this split's words (always written, also for
  // an empty split: lse = -inf, o = 0).
  const bool single = (nsplit == 1);
  for (int i = tid; i < crows * (D / 4); i += THREADS) {
    const int g = i / (D / 4);  // a row of the CTA's: row g % 16 of tile g / 16's warps
    const int d = (i - g * (D / 4)) * 4;
    const int w0 = (g / kTcRows) * WT;
    float M, L;
    const float4 o = merge_warp_partials<WT>(sm_m + w0, sm_l + w0, sm_o + w0, g % kTcRows, d, M, L);
    store_split_words(single, out + (long long)out_row(g) * D,
                      ws + ((long long)split * tokens * q_heads + head0 + g) * D, o, M, L, d);
  }
  if (single) return;

  const int k = split_merger(by_arrival, counters + blockIdx.x, split, nsplit, mergers, sm_merger);
  if (k >= 0)
    merge_split_words<THREADS, D>(out, ws + (long long)head0 * D, (long long)tokens * q_heads * D, nsplit, crows, k,
                                  mergers, out_row);
}

}  // namespace edge

#if !defined(CFG_DTYPE) || !defined(CFG_HEAD_DIM)
#error "compile with CFG_DTYPE and CFG_HEAD_DIM defined (see edge/kernels/nvrtc.py)"
#endif
#if CFG_DTYPE == 3
#error "paged_decode_tc.cu is float16/bfloat16 only (float32 decode uses paged_decode.cu)"
#endif
#ifndef CFG_KV_INT8
#define CFG_KV_INT8 0
#endif

// The parameters every entry point starts with (Q: the query operand, q or the step's
// qkv row; KV: the pools' element type, then the scale pointers, null for float pools)
// and the same names passed on.
#if CFG_KV_INT8
#define EDGE_TC_POOLS                                                                              \
  signed char *__restrict__ k_pool, signed char *__restrict__ v_pool, float *__restrict__ k_scale, \
      float *__restrict__ v_scale
#define EDGE_TC_POOL_ARGS k_pool, v_pool, k_scale, v_scale
#define EDGE_TC_Q8 true
#define EDGE_TC_NAME(NAME) NAME##_q8
#else
#define EDGE_TC_POOLS edge_t *__restrict__ k_pool, edge_t *__restrict__ v_pool
#define EDGE_TC_POOL_ARGS k_pool, v_pool, nullptr, nullptr
#define EDGE_TC_Q8 false
#define EDGE_TC_NAME(NAME) NAME
#endif
#define EDGE_TC_PARAMS(Q)                                                                            \
  edge_t *__restrict__ out, const edge_t *__restrict__ Q, EDGE_TC_POOLS, const int *__restrict__ table, \
      const int *__restrict__ pos, int host_len, int kv_heads, int group, int log2_page, float scale_log2, \
      unsigned long long *__restrict__ ws, unsigned int *__restrict__ counters, int mergers, int min_rows
#define EDGE_TC_ARGS(Q)                                                                                  \
  out, Q, EDGE_TC_POOL_ARGS, table, pos, host_len, kv_heads, group, log2_page, scale_log2, ws, counters, \
      mergers, min_rows

extern "C" __global__ void __launch_bounds__(32 * CFG_TC_WARPS, CFG_TC_MIN_BLOCKS)
    EDGE_TC_NAME(paged_decode_tc)(EDGE_TC_PARAMS(q)) {
  edge::paged_decode_tc<edge_t, CFG_HEAD_DIM, CFG_TC_WARPS, CFG_TC_STAGES, false, false, 1, EDGE_TC_Q8>(
      EDGE_TC_ARGS(q), edge::RopeArgs{}, 1);
}

// The speculative verify step: `tokens` query tokens at *pos .. (MULTI above), TILES row
// tiles a CTA: NAME from q, NAME_rope from the qkv projection's rows (its q/k norms, RoPE
// and K/V store in the launch; at most 2 * CFG_TC_WARPS tokens).
#define EDGE_VERIFY_ENTRIES(NAME, TILES)                                                                      \
  extern "C" __global__ void __launch_bounds__(32 * CFG_TC_WARPS, CFG_TC_MIN_BLOCKS)                          \
      EDGE_TC_NAME(NAME)(EDGE_TC_PARAMS(q), int tokens) {                                                     \
    edge::paged_decode_tc<edge_t, CFG_HEAD_DIM, CFG_TC_WARPS, CFG_TC_STAGES, false, true, TILES, EDGE_TC_Q8>(  \
        EDGE_TC_ARGS(q), edge::RopeArgs{}, tokens);                                                           \
  }                                                                                                           \
  extern "C" __global__ void __launch_bounds__(32 * CFG_TC_WARPS, CFG_TC_MIN_BLOCKS)                          \
      EDGE_TC_NAME(NAME##_rope)(EDGE_TC_PARAMS(qkv), int tokens, const edge_t* __restrict__ qk_norm,          \
                                const edge_t* __restrict__ cos_tab, const edge_t* __restrict__ sin_tab,       \
                                int max_pos, float eps) {                                                     \
    if (tokens > 2 * CFG_TC_WARPS) __trap(); /* a warp holds two of the step's rows */                        \
    edge::paged_decode_tc<edge_t, CFG_HEAD_DIM, CFG_TC_WARPS, CFG_TC_STAGES, true, true, TILES, EDGE_TC_Q8>(   \
        EDGE_TC_ARGS(qkv), edge::RopeArgs{qk_norm, cos_tab, sin_tab, max_pos, eps}, tokens);                  \
  }

EDGE_VERIFY_ENTRIES(paged_verify_tc, 1)
#if CFG_TC_WARPS % 2 == 0  // the pairs split the warps between two row tiles
EDGE_VERIFY_ENTRIES(paged_verify_tc_pair, 2)
#endif

// The same with the step's q/k norm + RoPE and K/V store (qkv: the projection's row).
extern "C" __global__ void __launch_bounds__(32 * CFG_TC_WARPS, CFG_TC_MIN_BLOCKS)
    EDGE_TC_NAME(paged_decode_tc_rope)(EDGE_TC_PARAMS(qkv), const edge_t* __restrict__ qk_norm,
                                       const edge_t* __restrict__ cos_tab, const edge_t* __restrict__ sin_tab,
                                       int max_pos, float eps) {
  edge::paged_decode_tc<edge_t, CFG_HEAD_DIM, CFG_TC_WARPS, CFG_TC_STAGES, true, false, 1, EDGE_TC_Q8>(
      EDGE_TC_ARGS(qkv), edge::RopeArgs{qk_norm, cos_tab, sin_tab, max_pos, eps}, 1);
}
