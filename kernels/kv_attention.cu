// Paged KV cache in 4-bit (KV4), 8-bit (KV8) or fp16 entries: the kernel that appends new
// tokens to it, and decode attention over it (one query token per sequence, grouped-query
// heads, any context length, sequences of different lengths in one batch).
//
// Why it is shaped this way. Decode attention reads the whole cache once per token, so it
// runs at memory speed only if the arithmetic per byte stays small. A KV4 cache holds 4x
// more values per byte than fp16, so CUDA-core dot products (a convert and an FMA per value
// and query head) would make the kernel compute-bound. Here both products run on tensor
// cores (mma.m16n8k16, fp16 in, fp32 accumulate), and the cache is stored in the order of
// the mma fragments, so that a lane's share of a block is one or two 16-byte loads and turns
// into fp16 operands with about one instruction per value (bit tricks below).
//
// ---- The cache ----------------------------------------------------------------------------
// A layer's cache is an array of pages [num_pages][num_kv_heads][head_bytes]; a page holds
// `page_size` tokens (a power of two >= 16) of one sequence; a page table [seq][max_pages] maps a
// sequence's i-th page to its index. One (page, kv head) region is, in bytes:
//
//   K codes   page_size/16 blocks x 2*D*BITS    (a block = 16 tokens)
//   V codes   page_size/16 blocks x 2*D*BITS
//   K params  page_size x (fp16 scale, fp16 zero)        (KV4/KV8 only)
//   V params  page_size x (fp16 scale, fp16 zero)        (KV4/KV8 only)
//
// Quantization (per token and kv head, asymmetric; exactly quantizers.activations.quantize_kv):
// scale = fp16(max(fp32(max - min) / (2^BITS - 1), 2^-24)), zero = fp16(min),
// q = clamp(rint((x - zero) / scale), 0, 2^BITS - 1), every step rounded as IEEE fp32, so the
// codes are bit-identical to the reference's; x' = q * scale + zero.
//
// Inside a block, K and V are stored in mma fragment order (lane l: g = l / 4, t = l % 4):
//   K, S = Q K^T per 8-token tile (tokens are the mma N): lane (g, t) holds token g of the tile,
//     head dims d = 16c + 8h + 2t + e as register r = 2c + h, element e (the B fragment).
//   V, O = P V per 16-token block (tokens are the mma K): lane (g, t) holds head dims
//     d = 8j + g, tokens 8h + 2t + e as register r = h * D/8 + j, element e.
//   A register is two values: fp16 -> 4 bytes; KV8 -> bytes 2r, 2r+1; KV4 -> nibbles r%4 and
//     r%4 + 4 of word r/4, so one LOP3 with mask 0x000F000F (or 0x00F000F0) puts both into
//     the mantissas of an fp16 pair (see unpack_k_u4).
//   A lane's fragment (K: D*BITS/32 bytes per tile, V: D*BITS/16 per block) is cut into units
//     of up to 16 bytes, and unit u of the 32 lanes is stored contiguously: every warp-wide
//     load reads 32 consecutive units (fragment_offset).
// Each token owns whole bytes (KV4 V: token parity e picks the high or low half-word), so
// appends of different tokens never touch the same byte. qoqtool/runtime/kv_cache.py holds
// the same layout in torch (the CPU reference, and the bit-exact test of the append kernel).
//
// ---- Decode ---------------------------------------------------------------------------------
// One CTA of 4 warps per (context split, kv head, sequence). The query heads that share the
// kv head (up to 16) are the M rows of the mma, so K and V are read once for all of them.
// The split's 16-token blocks are taken in warp steps of NB blocks (DecodeTiling; one online
// softmax update per step), warp w taking every 4th step through its own ring of cp.async
// stages in shared memory; each lane copies 16-byte units, so a block costs a few copy
// instructions and no registers until it is used. Page lookups are shifts (page sizes are
// powers of two) and are fetched a step early.
// Scores stay exact with respect to the dequantized cache: the mma multiplies the query by
// the codes, and the token's scale and zero are applied in fp32 afterwards,
//     q . (c * s + z) = s * (q . c) + z * sum(q).
// The K codes even stay magic-biased (one LOP3 per two codes; see unpack_k_u4): the bias is a
// per-query constant removed in fp32. V is dequantized to fp16 (one HFMA2 per two values) and
// multiplied by P in fp16 with fp32 accumulation, as FlashAttention does; together with the
// fp16 query that is ~3e-4 relative error against fp32 attention over the same cache.
// Warps are merged through shared memory; with several splits each writes (max, sum,
// unnormalized output) and a second small kernel combines them (flash-decoding). The host
// chooses the split count and NB (qoqtool/runtime/attention_ops.py).
//
// Measured design history (benchmarks/RESULTS.md): the first version (16-token steps, page
// lookups by integer division, K codes unbiased by two more ops per pair) issued ~500
// instructions per block and reached only ~2.2 TB/s of KV4 reads on the H200: bound by
// instruction issue, not memory (KV8, the same work per block, reached 3.5-4.1 TB/s).
#include <cuda_bf16.h>
#include <math.h>

#include <type_traits>

#include "kv_common.cuh"

namespace qoq_kv {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockTokens = 16;          // the k extent of one P.V mma
constexpr float kFp16Tiny = 5.9604644775390625e-08f;  // 2^-24: the smallest fp16 scale

template <int BITS, int D>
struct CacheLayout {
  static_assert(BITS == 4 || BITS == 8 || BITS == 16, "KV4, KV8 or fp16 entries");
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  static constexpr bool kQuantized = BITS < 16;
  static constexpr int kKLaneBytes = D * BITS / 32;  // a lane's K fragment of an 8-token tile
  static constexpr int kVLaneBytes = D * BITS / 16;  // a lane's V fragment of a 16-token block
  static constexpr int kTileBytes = D * BITS;        // K codes of 8 tokens
  static constexpr int kBlockBytes = 2 * D * BITS;   // K (or V) codes of 16 tokens
  // A block as the decode kernel stages it in shared memory: K codes, V codes, then 16 K
  // params and 16 V params.
  static constexpr int kStageBlockBytes = 2 * kBlockBytes + (kQuantized ? 2 * 4 * kBlockTokens : 0);

  // Byte offsets inside one (page, kv head) region.
  __host__ __device__ static int64_t v_codes(int page_size) { return (int64_t)(page_size / kBlockTokens) * kBlockBytes; }
  __host__ __device__ static int64_t k_params(int page_size) { return 2 * v_codes(page_size); }
  __host__ __device__ static int64_t v_params(int page_size) { return k_params(page_size) + 4 * page_size; }
  __host__ __device__ static int64_t head_bytes(int page_size) {
    return kQuantized ? v_params(page_size) + 4 * page_size : k_params(page_size);
  }
};

// The decode kernel's tiling: a warp step is NB blocks (one softmax update per 16 * NB tokens:
// NB = 2 halves the per-token bookkeeping, NB = 1 needs fewer registers, so more warps fit);
// each warp keeps a ring of kStages steps in shared memory, about 13 KB, so that up to 4 CTAs
// of 4 warps fit in the SM's 227 KB (registers allow 3 or 4: kMinCtas).
template <int BITS, int D, int NB>
struct DecodeTiling {
  static constexpr int kStageBytes = NB * CacheLayout<BITS, D>::kStageBlockBytes;
  static constexpr int kStages = 13312 / kStageBytes < 2 ? 2 : (13312 / kStageBytes > 8 ? 8 : 13312 / kStageBytes);
  // CTAs per SM the register budget must allow, from ptxas's reports (-Xptxas -v): the
  // largest count without spills.
  static constexpr int kMinCtas = D == 64 || (BITS == 4 && NB == 1) ? 4 : (BITS == 16 ? 1 : 3);
};

// Where byte `cb` of lane `lane`'s fragment (LANE_BYTES long) lies inside its tile.
template <int LANE_BYTES>
__device__ __forceinline__ int fragment_offset(int cb, int lane) {
  constexpr int U = LANE_BYTES < 16 ? LANE_BYTES : 16;
  return ((cb / U) * 32 + lane) * U + cb % U;
}

// A lane's fragment words, from a tile staged in shared memory.
template <int LANE_BYTES>
__device__ __forceinline__ void read_fragment(const uint8_t* tile, int lane, uint32_t (&w)[LANE_BYTES / 4]) {
  if constexpr (LANE_BYTES == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(tile + lane * 8);
    w[0] = v.x;
    w[1] = v.y;
  } else {
#pragma unroll
    for (int u = 0; u < LANE_BYTES / 16; ++u) {
      const uint4 v = *reinterpret_cast<const uint4*>(tile + (u * 32 + lane) * 16);
      w[4 * u] = v.x;
      w[4 * u + 1] = v.y;
      w[4 * u + 2] = v.z;
      w[4 * u + 3] = v.w;
    }
  }
}

// ---- Codes to fp16 operands -------------------------------------------------------------------
constexpr uint32_t kHalf2_1024 = 0x64006400;     // fp16 1024.0 twice; its mantissa LSB is 1.0
constexpr uint32_t kHalf2_16th = 0x2C002C00;     // 1/16
constexpr uint32_t kHalf2_minus64 = 0xD400D400;  // -64
constexpr float kMagic = 1024.f;

// K codes as the B operand of Q K^T, left biased: one LOP3 (or PRMT) per two codes.
// KV4, word w -> registers 4w..4w+3 = nibbles (k, k + 4): 0x6400 | q is fp16 1024 + q, and
// 0x6400 | q << 4 is 1024 + 16q (registers 1 and 3). The query's dims that meet the 16q
// registers are pre-divided by 16, so q'.codes = 1024 sum(q') + q.c: the kernel subtracts
// 1024 sum(q') from the score in fp32 (QueryFrags::bias), exact up to fp32 rounding.
// KV8: PRMT places byte b under 0x64: 1024 + b.
__device__ __forceinline__ void unpack_k_u4(uint32_t w, uint32_t* r) {
  const uint32_t w8 = w >> 8;
  r[0] = and_or(w, 0x000F000F, kHalf2_1024);
  r[1] = and_or(w, 0x00F000F0, kHalf2_1024);
  r[2] = and_or(w8, 0x000F000F, kHalf2_1024);
  r[3] = and_or(w8, 0x00F000F0, kHalf2_1024);
}

__device__ __forceinline__ void unpack_k_u8(uint32_t w, uint32_t* r) {
  r[0] = byte_perm(w, 0x64646464, 0x4140);
  r[1] = byte_perm(w, 0x64646464, 0x4342);
}

// V codes, exact (0..15 or 0..255) in fp16, to be scaled per token: the bias must go here,
// since each register pairs two tokens of different scales. One more HSUB2 (or an exact
// HFMA2 by 1/16, -64) per two codes.
__device__ __forceinline__ void unpack_v_u4(uint32_t w, uint32_t* r) {
  uint32_t b[4];
  unpack_k_u4(w, b);
  r[0] = as_u32(__hsub2(as_half2(b[0]), as_half2(kHalf2_1024)));
  r[1] = as_u32(__hfma2(as_half2(b[1]), as_half2(kHalf2_16th), as_half2(kHalf2_minus64)));
  r[2] = as_u32(__hsub2(as_half2(b[2]), as_half2(kHalf2_1024)));
  r[3] = as_u32(__hfma2(as_half2(b[3]), as_half2(kHalf2_16th), as_half2(kHalf2_minus64)));
}

__device__ __forceinline__ void unpack_v_u8(uint32_t w, uint32_t* r) {
  uint32_t b[2];
  unpack_k_u8(w, b);
  r[0] = as_u32(__hsub2(as_half2(b[0]), as_half2(kHalf2_1024)));
  r[1] = as_u32(__hsub2(as_half2(b[1]), as_half2(kHalf2_1024)));
}

// A fragment's words -> its fp16-pair registers (fp16 entries are already registers).
template <int BITS, bool IS_K, int NW>
__device__ __forceinline__ void unpack_codes(const uint32_t (&w)[NW], uint32_t (&r)[NW * 16 / BITS]) {
#pragma unroll
  for (int i = 0; i < NW; ++i) {
    if constexpr (BITS == 4) IS_K ? unpack_k_u4(w[i], &r[4 * i]) : unpack_v_u4(w[i], &r[4 * i]);
    else if constexpr (BITS == 8) IS_K ? unpack_k_u8(w[i], &r[2 * i]) : unpack_v_u8(w[i], &r[2 * i]);
    else r[i] = w[i];
  }
}

// ---- Decode -----------------------------------------------------------------------------------
struct DecodeParams {
  const half* q;            // [seqs, q_heads, D]
  half* out;                // [seqs, q_heads, D]
  const uint8_t* cache;     // [num_pages, kv_heads, head_bytes]
  const int* page_table;    // [seqs, max_pages]
  const int* context_lens;  // [seqs]
  float* partial_acc;       // [seqs, q_heads, num_splits, D] unnormalized outputs (num_splits > 1)
  float2* partial_ml;       // [seqs, q_heads, num_splits]: (max, sum), scores in log2 units
  int num_q_heads, num_kv_heads, page_size, page_shift, max_pages, num_pages;  // page_size = 16 << page_shift
  int64_t head_bytes, page_bytes;
  int num_splits, blocks_per_split;
  float scale_log2;  // softmax scale * log2(e): exp2 of scaled scores is the softmax numerator
};

// The online-softmax state of one warp: rows g and g + 8 of the mma are query heads.
template <int D, int ROWS>
struct SoftmaxState {
  float m[ROWS / 8];                // running max (log2 units), equal across the row's 4 lanes
  float l[ROWS / 8];                // running sum of this lane's terms
  float acc[D / 8][2 * (ROWS / 8)]; // O fragment: [n-tile j][2r + e] = row g + 8r, dim 8j + 2t + e
};

// The group's queries as the A operand of Q K^T, and what the scores need besides.
template <int D, int ROWS>
struct QueryFrags {
  uint32_t a[D / 16][4];  // a0: row g, a1: row g + 8, a2/a3: the same rows, dims + 8
  float sum[ROWS / 8];    // sum(q) per row: the zero-point term
  float bias[ROWS / 8];   // 1024 * sum(q'): the magic bias of the K codes
};

template <int BITS, int D, int ROWS>
__device__ __forceinline__ void load_query(QueryFrags<D, ROWS>& qf, const half* q, int group, int lane) {
  constexpr int RH = ROWS / 8;
  const int gid = lane / 4, tig = lane % 4;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
    for (int i = 0; i < 4; ++i) qf.a[ks][i] = 0u;
  }
#pragma unroll
  for (int r = 0; r < RH; ++r) {
    float sum = 0.f, biased = 0.f;
    const int row = gid + 8 * r;
    if (row < group) {
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
        for (int hk = 0; hk < 2; ++hk) {
          half2 v = *reinterpret_cast<const half2*>(q + row * D + 16 * ks + 8 * hk + 2 * tig);
          sum += __low2float(v) + __high2float(v);
          if (BITS == 4 && hk == 1) v = __hmul2(v, as_half2(kHalf2_16th));  // meets 1024 + 16q: exact
          biased += __low2float(v) + __high2float(v);
          qf.a[ks][r + 2 * hk] = as_u32(v);
        }
      }
    }
#pragma unroll
    for (int o = 1; o < 4; o *= 2) {
      sum += __shfl_xor_sync(0xffffffffu, sum, o);
      biased += __shfl_xor_sync(0xffffffffu, biased, o);
    }
    qf.sum[r] = sum;
    qf.bias[r] = kMagic * biased;
  }
}

// Start copying block `blk` (K and V codes, K and V params) into `stage` (cp.async; the lanes
// copy 16-byte units, 512 bytes per warp-wide instruction).
template <int BITS, int D>
__device__ __forceinline__ void issue_block(uint8_t* stage, const DecodeParams& p, int page, int blk,
                                            int64_t head_offset, int lane) {
  using L = CacheLayout<BITS, D>;
  // A page index past the cache never reaches memory: the host validates the table before
  // launch, and here such an index reads page 0 instead of faulting.
  page = (unsigned)page < (unsigned)p.num_pages ? page : 0;
  const int in_page = blk & ((1 << p.page_shift) - 1);  // the block's index inside its page
  const uint8_t* head = p.cache + (size_t)page * p.page_bytes + head_offset;
  const uint8_t* k = head + in_page * L::kBlockBytes + 16 * lane;
  const uint8_t* v = k + ((int64_t)L::kBlockBytes << p.page_shift);  // the V codes follow the page's K
  uint8_t* dst = stage + 16 * lane;
#pragma unroll
  for (int i = 0; i < L::kBlockBytes / 512; ++i) {
    cp_async_16(dst + 512 * i, k + 512 * i);
    cp_async_16(dst + L::kBlockBytes + 512 * i, v + 512 * i);
  }
  if constexpr (L::kQuantized) {  // 64 bytes of K params then 64 of V params: lanes 0-7
    const uint8_t* params = head + L::k_params(p.page_size) + 4 * kBlockTokens * in_page +
                            (lane / 4) * 4 * p.page_size + 16 * (lane % 4);
    if (lane < 8) cp_async_16(stage + 2 * L::kBlockBytes + 16 * lane, params);
  }
}

// Fold one step of NB staged blocks (valid[b] tokens each, 0..16) into the softmax state.
template <int BITS, int D, int ROWS, int NB>
__device__ __forceinline__ void attend_step(const uint8_t* stage, const int (&valid)[NB],
                                            const QueryFrags<D, ROWS>& qf, float scale_log2, int lane,
                                            SoftmaxState<D, ROWS>& st) {
  using L = CacheLayout<BITS, D>;
  constexpr int RH = ROWS / 8, NT = D / 8;
  const int tig = lane % 4;

  // Scores: s[b][i][2r + e] = query row g + 8r, token 8i + 2t + e of block b.
  float s[NB][2][2 * RH];
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    const uint8_t* blk = stage + b * L::kStageBlockBytes;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      uint32_t w[L::kKLaneBytes / 4], kb[D / 8];
      read_fragment<L::kKLaneBytes>(blk + i * L::kTileBytes, lane, w);
      unpack_codes<BITS, true>(w, kb);
      float c[4] = {0.f, 0.f, 0.f, 0.f};  // the step's 2 * NB tiles are independent chains
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) mma_16816(c, qf.a[ks], kb[2 * ks], kb[2 * ks + 1], c);
      uint2 params = make_uint2(0u, 0u);
      if constexpr (L::kQuantized) params = *reinterpret_cast<const uint2*>(blk + 2 * L::kBlockBytes + 4 * (8 * i + 2 * tig));
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool inside = 8 * i + 2 * tig + e < valid[b];
#pragma unroll
        for (int r = 0; r < RH; ++r) {
          const float dot = c[2 * r + e];
          float score;
          if constexpr (L::kQuantized) {  // s * (q . codes) + z * sum(q), in fp32
            const half2 sz = as_half2(e ? params.y : params.x);
            score = fmaf(dot - qf.bias[r], __low2float(sz), __high2float(sz) * qf.sum[r]) * scale_log2;
          } else {
            score = dot * scale_log2;
          }
          s[b][i][2 * r + e] = inside ? score : -INFINITY;
        }
      }
    }
  }

  // Online softmax per query row over the step's 16 * NB tokens; P becomes the A operand of
  // P.V (FlashAttention-2's trick: the C fragment of two n-tiles is the A fragment of the next mma).
  uint32_t pa[NB][4];
  float alpha[RH];
  bool moved = false;
#pragma unroll
  for (int r = 0; r < RH; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int b = 0; b < NB; ++b) mx = fmaxf(mx, fmaxf(fmaxf(s[b][0][2 * r], s[b][0][2 * r + 1]), fmaxf(s[b][1][2 * r], s[b][1][2 * r + 1])));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(st.m[r], mx);
    const float base = m_new == -INFINITY ? 0.f : m_new;  // nothing valid yet: avoid inf - inf
    alpha[r] = exp2f(st.m[r] - base);
    moved |= alpha[r] != 1.f;
    st.m[r] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      const float p00 = exp2f(s[b][0][2 * r] - base), p01 = exp2f(s[b][0][2 * r + 1] - base);
      const float p10 = exp2f(s[b][1][2 * r] - base), p11 = exp2f(s[b][1][2 * r + 1] - base);
      sum += (p00 + p01) + (p10 + p11);
      pa[b][r] = as_u32(__floats2half2_rn(p00, p01));      // a0 / a1: tokens 2t, 2t + 1
      pa[b][r + 2] = as_u32(__floats2half2_rn(p10, p11));  // a2 / a3: tokens 8 + 2t, 9 + 2t
    }
    st.l[r] = st.l[r] * alpha[r] + sum;
  }
  if constexpr (RH == 1) {
#pragma unroll
    for (int b = 0; b < NB; ++b) pa[b][1] = pa[b][3] = 0u;
  }
  // Rescale the output only when some row's max moved (after the first steps, rarely).
  if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int k = 0; k < 2 * RH; ++k) st.acc[j][k] *= alpha[k / 2];
    }
  }

#pragma unroll
  for (int b = 0; b < NB; ++b) {
    const uint8_t* blk = stage + b * L::kStageBlockBytes;
    uint32_t w[L::kVLaneBytes / 4], vb[D / 4];
    read_fragment<L::kVLaneBytes>(blk + L::kBlockBytes, lane, w);
    unpack_codes<BITS, false>(w, vb);
    if constexpr (L::kQuantized) {  // v = code * scale + zero, per token: one HFMA2 per pair
      const uint8_t* vp = blk + 2 * L::kBlockBytes + 4 * kBlockTokens + 4 * 2 * tig;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint2 sz = *reinterpret_cast<const uint2*>(vp + 4 * 8 * h);  // tokens 8h + 2t, 8h + 2t + 1
        const half2 scale = __lows2half2(as_half2(sz.x), as_half2(sz.y));
        const half2 zero = __highs2half2(as_half2(sz.x), as_half2(sz.y));
#pragma unroll
        for (int j = 0; j < NT; ++j) vb[h * NT + j] = as_u32(__hfma2(as_half2(vb[h * NT + j]), scale, zero));
      }
    }
    if (valid[b] < kBlockTokens) {  // past the context P is 0, but stale V could be inf: 0 * inf = NaN
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t keep =
            (8 * h + 2 * tig < valid[b] ? 0x0000FFFFu : 0u) | (8 * h + 2 * tig + 1 < valid[b] ? 0xFFFF0000u : 0u);
#pragma unroll
        for (int j = 0; j < NT; ++j) vb[h * NT + j] &= keep;
      }
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      float c[4] = {st.acc[j][0], st.acc[j][1], 0.f, 0.f};
      if constexpr (RH == 2) {
        c[2] = st.acc[j][2];
        c[3] = st.acc[j][3];
      }
      mma_16816(c, pa[b], vb[j], vb[NT + j], c);
#pragma unroll
      for (int k = 0; k < 2 * RH; ++k) st.acc[j][k] = c[k];
    }
  }
}

template <int BITS, int D, int ROWS, int NB>
__global__ void __launch_bounds__(kThreads, (ROWS == 8 ? DecodeTiling<BITS, D, NB>::kMinCtas : 3))
    decode_kernel(const DecodeParams p) {
  using T = DecodeTiling<BITS, D, NB>;
  constexpr int RH = ROWS / 8, NT = D / 8, S = T::kStages;
  const int split = blockIdx.x, kvh = blockIdx.y, seq = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane / 4, tig = lane % 4;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int qh0 = kvh * group;
  // Lengths past the page table are cut (the host rejects them before launch).
  const int len = min(max(p.context_lens[seq], 0), p.max_pages * p.page_size);
  const int begin = split * p.blocks_per_split;
  const int end = min((len + kBlockTokens - 1) / kBlockTokens, begin + p.blocks_per_split);
  if (begin >= end) {  // a split past this sequence's end: the combine kernel skips it
    if (p.num_splits == 1) {  // empty context: zeros
      for (int i = threadIdx.x; i < group * D; i += kThreads)
        p.out[((size_t)seq * p.num_q_heads + qh0) * D + i] = __float2half_rn(0.f);
    }
    return;
  }

  QueryFrags<D, ROWS> qf;
  load_query<BITS, D, ROWS>(qf, p.q + ((size_t)seq * p.num_q_heads + qh0) * D, group, lane);
  SoftmaxState<D, ROWS> st;
#pragma unroll
  for (int r = 0; r < RH; ++r) {
    st.m[r] = -INFINITY;
    st.l[r] = 0.f;
#pragma unroll
    for (int j = 0; j < NT; ++j) st.acc[j][2 * r] = st.acc[j][2 * r + 1] = 0.f;
  }

  // The split's blocks in steps of NB; warp w takes steps w, w + 4, ... through its ring of S
  // stages in shared memory: step n + S - 1 is being copied while step n is computed, and the
  // page indices of the step after that are fetched one turn early.
  uint8_t* ring = dynamic_smem<uint8_t>() + warp * S * T::kStageBytes;
  const int* pages = p.page_table + (size_t)seq * p.max_pages;
  const int64_t head_offset = (int64_t)kvh * p.head_bytes;
  const int page_shift = p.page_shift;
  auto first_block = [&](int step) { return begin + step * NB; };
  auto fetch_pages = [&](int step, int (&pg)[NB]) {
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      const int blk = first_block(step) + b;
      pg[b] = blk < end ? pages[blk >> page_shift] : 0;
    }
  };
  auto issue_step = [&](int step, uint8_t* stage, const int (&pg)[NB]) {
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      const int blk = first_block(step) + b;
      if (blk < end) issue_block<BITS, D>(stage + b * CacheLayout<BITS, D>::kStageBlockBytes, p, pg[b], blk, head_offset, lane);
    }
  };
  const int steps = (end - begin + NB - 1) / NB;
  int pg[NB];
#pragma unroll
  for (int n = 0; n < S - 1; ++n) {
    fetch_pages(warp + n * kWarps, pg);
    if (warp + n * kWarps < steps) issue_step(warp + n * kWarps, ring + n * T::kStageBytes, pg);
    cp_async_commit();  // empty groups keep the count uniform
  }
  fetch_pages(warp + (S - 1) * kWarps, pg);
  for (int n = 0, step = warp; step < steps; ++n, step += kWarps) {
    __syncwarp();  // every lane is done reading the stage about to be refilled
    const int ahead = step + (S - 1) * kWarps;
    if (ahead < steps) issue_step(ahead, ring + ((n + S - 1) % S) * T::kStageBytes, pg);
    cp_async_commit();
    fetch_pages(ahead + kWarps, pg);
    cp_async_wait<S - 1>();  // step n has landed (this lane's copies) ...
    __syncwarp();            // ... and every other lane's
    int valid[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) valid[b] = max(0, min(kBlockTokens, len - (first_block(step) + b) * kBlockTokens));
    if (first_block(step) + NB > end) {  // a step past the split's end (not the context's): drop those blocks
#pragma unroll
      for (int b = 0; b < NB; ++b) valid[b] = first_block(step) + b < end ? valid[b] : 0;
    }
    attend_step<BITS, D, ROWS, NB>(ring + (n % S) * T::kStageBytes, valid, qf, p.scale_log2, lane, st);
  }
  cp_async_wait<0>();
  __syncthreads();  // the rings are free: the merge below reuses the shared memory

  // Merge the 4 warps through shared memory: [w][row] max and sum, [w][row][d] outputs.
#pragma unroll
  for (int r = 0; r < RH; ++r) {
    st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 1);
    st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 2);
  }
  float* sm_m = dynamic_smem<float>();
  float* sm_l = sm_m + kWarps * ROWS;
  float* sm_acc = sm_l + kWarps * ROWS;
#pragma unroll
  for (int r = 0; r < RH; ++r) {
    const int row = gid + 8 * r;
    if (row < group) {
      if (tig == 0) {
        sm_m[warp * ROWS + row] = st.m[r];
        sm_l[warp * ROWS + row] = st.l[r];
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        float* dst = sm_acc + (warp * group + row) * D + 8 * j + 2 * tig;
        dst[0] = st.acc[j][2 * r];
        dst[1] = st.acc[j][2 * r + 1];
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < group * D; i += kThreads) {
    const int row = i / D, d = i % D;
    float mmax = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mmax = fmaxf(mmax, sm_m[w * ROWS + row]);
    float sum = 0.f, a = 0.f;
    if (mmax != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float f = exp2f(sm_m[w * ROWS + row] - mmax);
        sum += sm_l[w * ROWS + row] * f;
        a += sm_acc[(w * group + row) * D + d] * f;
      }
    }
    const size_t qh = (size_t)seq * p.num_q_heads + qh0 + row;
    if (p.num_splits == 1) {
      p.out[qh * D + d] = __float2half_rn(sum > 0.f ? a / sum : 0.f);
    } else {
      const size_t at = qh * p.num_splits + split;
      p.partial_acc[at * D + d] = a;
      if (d == 0) p.partial_ml[at] = make_float2(mmax, sum);
    }
  }
}

// Sum over a CTA of D threads (D / 32 warps) through `scratch` (D / 32 floats); all get it.
template <int D, bool MAX>
__device__ __forceinline__ float block_reduce(float v, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, v, o);
    v = MAX ? fmaxf(v, other) : v + other;
  }
  __syncthreads();  // scratch may still be read by a previous call
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[0];
#pragma unroll
  for (int w = 1; w < D / 32; ++w) v = MAX ? fmaxf(v, scratch[w]) : v + scratch[w];
  return v;
}

// Flash-decoding's second step: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s. The
// splits' weights are computed once, in parallel, into shared memory; each thread then sums
// one output dim over the splits (independent loads).
template <int D>
__global__ void __launch_bounds__(D) combine_kernel(const DecodeParams p) {
  float* scratch = dynamic_smem<float>();  // [D / 32] reduction scratch, then [num_splits] weights
  float* weight = scratch + D / 32;
  const int qh = blockIdx.x, seq = blockIdx.y, d = threadIdx.x;
  const int len = min(max(p.context_lens[seq], 0), p.max_pages * p.page_size);
  const int blocks = (len + kBlockTokens - 1) / kBlockTokens;
  const int splits = min(p.num_splits, (blocks + p.blocks_per_split - 1) / p.blocks_per_split);
  const size_t base = ((size_t)seq * p.num_q_heads + qh) * p.num_splits;
  float mmax = -INFINITY;
  for (int s = d; s < splits; s += D) mmax = fmaxf(mmax, p.partial_ml[base + s].x);
  mmax = block_reduce<D, true>(mmax, scratch);
  float sum = 0.f;
  for (int s = d; s < splits; s += D) {
    const float2 ml = p.partial_ml[base + s];
    const float w = mmax == -INFINITY ? 0.f : exp2f(ml.x - mmax);
    weight[s] = w;
    sum += ml.y * w;
  }
  sum = block_reduce<D, false>(sum, scratch);  // its barriers also publish `weight`
  float a = 0.f;
#pragma unroll 4
  for (int s = 0; s < splits; ++s) a += p.partial_acc[(base + s) * D + d] * weight[s];
  p.out[((size_t)seq * p.num_q_heads + qh) * D + d] = __float2half_rn(sum > 0.f ? a / sum : 0.f);
}

// ---- Append -----------------------------------------------------------------------------------
struct AppendParams {
  const void* k;  // [tokens, kv_heads, D], element strides below (the last dim contiguous)
  const void* v;
  int64_t k_stride_token, k_stride_head, v_stride_token, v_stride_head;
  const int* slots;  // [tokens]: page * page_size + position in the page
  uint8_t* cache;
  int num_tokens, num_kv_heads, page_size, num_pages;
  int64_t head_bytes, page_bytes;
};

__device__ __forceinline__ float to_float(half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

// Head dim of K element (register r, element e) of lane column t (see the file comment).
__device__ __forceinline__ int k_dim(int r, int e, int t) { return 16 * (r / 2) + 8 * (r % 2) + 2 * t + e; }

// K: token `tok` (0..15) of a block owns, in tile tok / 8, the fragments of lanes 4 * (tok % 8) + t.
// `vals` holds the token's codes (or fp16 bits) in head-dim order.
template <int BITS, int D>
__device__ void write_k_token(uint8_t* block, int tok, const uint16_t* vals, int lane) {
  using L = CacheLayout<BITS, D>;
  constexpr int LB = L::kKLaneBytes;
  uint8_t* tile = block + (tok / 8) * L::kTileBytes;
  const int g = tok % 8;
  if constexpr (BITS == 16) {
    for (int i = lane; i < 4 * LB / 2; i += 32) {  // one fp16 value each
      const int t = i / (LB / 2), hv = i % (LB / 2);
      *reinterpret_cast<uint16_t*>(tile + fragment_offset<LB>(2 * hv, 4 * g + t)) = vals[k_dim(hv / 2, hv % 2, t)];
    }
  } else {
    for (int i = lane; i < 4 * LB; i += 32) {  // one byte each
      const int t = i / LB, cb = i % LB;
      uint32_t byte;
      if constexpr (BITS == 8) {
        byte = vals[k_dim(cb / 2, cb % 2, t)];
      } else {  // nibble n of word w is register 4w + n % 4, element n / 4; this byte has n0, n0 + 1
        const int w = cb / 4, n0 = 2 * (cb % 4);
        byte = vals[k_dim(4 * w + n0 % 4, n0 / 4, t)] | (vals[k_dim(4 * w + (n0 + 1) % 4, (n0 + 1) / 4, t)] << 4);
      }
      tile[fragment_offset<LB>(cb, 4 * g + t)] = (uint8_t)byte;
    }
  }
}

// V: token `tok` of a block is element e = tok % 2 of register (tok / 8) * D/8 + j in the
// fragments of lanes 4g + (tok % 8) / 2, for head dims d = 8j + g.
template <int BITS, int D>
__device__ void write_v_token(uint8_t* block, int tok, const uint16_t* vals, int lane) {
  constexpr int LB = CacheLayout<BITS, D>::kVLaneBytes, NT = D / 8;
  const int h = tok / 8, t = (tok % 8) / 2, e = tok % 2;
  if constexpr (BITS == 4) {
    for (int i = lane; i < 8 * NT / 2; i += 32) {  // a byte holds registers r, r + 1 (r even)
      const int g = i / (NT / 2), j = 2 * (i % (NT / 2)), r = h * NT + j;
      const int cb = 4 * (r / 4) + (r % 4) / 2 + 2 * e;
      block[fragment_offset<LB>(cb, 4 * g + t)] = (uint8_t)(vals[8 * j + g] | (vals[8 * (j + 1) + g] << 4));
    }
  } else {
    for (int i = lane; i < 8 * NT; i += 32) {
      const int g = i / NT, j = i % NT, r = h * NT + j;
      if constexpr (BITS == 8) {
        block[fragment_offset<LB>(2 * r + e, 4 * g + t)] = (uint8_t)vals[8 * j + g];
      } else {
        *reinterpret_cast<uint16_t*>(block + fragment_offset<LB>(4 * r + 2 * e, 4 * g + t)) = vals[8 * j + g];
      }
    }
  }
}

// One warp per (token, kv head): quantize K and V exactly as quantize_kv, write them in place.
template <int BITS, int D, typename T>
__global__ void __launch_bounds__(kThreads) append_kernel(const AppendParams p) {
  using L = CacheLayout<BITS, D>;
  constexpr int PER_LANE = D / 32;
  constexpr float QMAX = BITS < 16 ? (float)((1 << BITS) - 1) : 0.f;  // unused for fp16
  __shared__ uint16_t stage[kWarps][D];  // one token's codes (or fp16 bits), head-dim order
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t item = (int64_t)blockIdx.x * kWarps + warp;
  if (item >= (int64_t)p.num_tokens * p.num_kv_heads) return;
  const int tok = (int)(item / p.num_kv_heads), h = (int)(item % p.num_kv_heads);
  const int slot = p.slots[tok];
  if (slot < 0 || slot / p.page_size >= p.num_pages) return;  // host-validated; never write outside
  const int page = slot / p.page_size, pos = slot % p.page_size;
  uint8_t* head = p.cache + (size_t)page * p.page_bytes + (size_t)h * p.head_bytes;
  uint8_t* k_block = head + (pos / kBlockTokens) * L::kBlockBytes;

  for (int which = 0; which < 2; ++which) {  // K, then V
    const T* src = static_cast<const T*>(which ? p.v : p.k) +
                   tok * (which ? p.v_stride_token : p.k_stride_token) + h * (which ? p.v_stride_head : p.k_stride_head);
    float x[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) x[i] = to_float(src[lane * PER_LANE + i]);
    if constexpr (L::kQuantized) {
      float mn = x[0], mx = x[0];
#pragma unroll
      for (int i = 1; i < PER_LANE; ++i) {
        mn = fminf(mn, x[i]);
        mx = fmaxf(mx, x[i]);
      }
#pragma unroll
      for (int o = 16; o > 0; o /= 2) {
        mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, o));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      }
      // Every step IEEE-rounded like the torch reference (fast-math would approximate '/').
      const half scale = __float2half_rn(fmaxf(__fdiv_rn(__fsub_rn(mx, mn), QMAX), kFp16Tiny));
      const half zero = __float2half_rn(mn);
      const float sf = __half2float(scale), zf = __half2float(zero);
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) {
        const float q = fminf(fmaxf(rintf(__fdiv_rn(__fsub_rn(x[i], zf), sf)), 0.f), QMAX);
        stage[warp][lane * PER_LANE + i] = (uint16_t)q;
      }
      if (lane == 0) {
        const int64_t params = which ? L::v_params(p.page_size) : L::k_params(p.page_size);
        *reinterpret_cast<half2*>(head + params + 4 * pos) = __halves2half2(scale, zero);
      }
    } else {
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) stage[warp][lane * PER_LANE + i] = __half_as_ushort(__float2half_rn(x[i]));
    }
    __syncwarp();
    if (which == 0) write_k_token<BITS, D>(k_block, pos % kBlockTokens, stage[warp], lane);
    else write_v_token<BITS, D>(k_block + L::v_codes(p.page_size), pos % kBlockTokens, stage[warp], lane);
    __syncwarp();
  }
}

// ---- Host launchers -------------------------------------------------------------------------
template <int BITS, int D, int NB>
cudaError_t decode(const DecodeParams& p, int num_seqs, cudaStream_t stream) {
  using T = DecodeTiling<BITS, D, NB>;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int rows = group <= 8 ? 8 : 16;
  const dim3 grid(p.num_splits, p.num_kv_heads, num_seqs);
  const size_t merge = sizeof(float) * kWarps * (2 * rows + group * D);
  const size_t ring = (size_t)kWarps * T::kStages * T::kStageBytes;
  const size_t smem = merge > ring ? merge : ring;
  cudaError_t err = rows == 8 ? launch(decode_kernel<BITS, D, 8, NB>, grid, dim3(kThreads), smem, stream, p)
                              : launch(decode_kernel<BITS, D, 16, NB>, grid, dim3(kThreads), smem, stream, p);
  if (err == cudaSuccess && p.num_splits > 1) {
    const size_t weights = sizeof(float) * (D / 32 + p.num_splits);
    err = launch(combine_kernel<D>, dim3(p.num_q_heads, num_seqs), dim3(D), weights, stream, p);
  }
  return err;
}

template <int BITS, int D>
cudaError_t append(const AppendParams& p, int dtype, cudaStream_t stream) {
  const int64_t items = (int64_t)p.num_tokens * p.num_kv_heads;
  const dim3 grid((unsigned)((items + kWarps - 1) / kWarps));
  switch (dtype) {
    case 0: return launch(append_kernel<BITS, D, half>, grid, dim3(kThreads), 0, stream, p);
    case 1: return launch(append_kernel<BITS, D, __nv_bfloat16>, grid, dim3(kThreads), 0, stream, p);
    case 2: return launch(append_kernel<BITS, D, float>, grid, dim3(kThreads), 0, stream, p);
    default: return cudaErrorInvalidValue;
  }
}

// Calls fn(bits, head_dim) with both as compile-time constants, for the supported pairs.
template <int V>
using Int = std::integral_constant<int, V>;

template <typename Fn>
cudaError_t dispatch(int bits, int head_dim, Fn&& fn) {
  if (head_dim == 64) {
    if (bits == 4) return fn(Int<4>(), Int<64>());
    if (bits == 8) return fn(Int<8>(), Int<64>());
    if (bits == 16) return fn(Int<16>(), Int<64>());
  } else if (head_dim == 128) {
    if (bits == 4) return fn(Int<4>(), Int<128>());
    if (bits == 8) return fn(Int<8>(), Int<128>());
    if (bits == 16) return fn(Int<16>(), Int<128>());
  }
  return cudaErrorInvalidValue;
}

}  // namespace qoq_kv

using namespace qoq_kv;

// Bytes of one (page, kv head) region: Python checks its own layout against this.
extern "C" int64_t qoq_kv_head_bytes(int bits, int head_dim, int page_size) {
  int64_t bytes = -1;
  dispatch(bits, head_dim, [&](auto bits_c, auto dim_c) {
    bytes = CacheLayout<bits_c(), dim_c()>::head_bytes(page_size);
    return cudaSuccess;
  });
  return bytes;
}

// Quantize and write new tokens. dtype of k and v: 0 fp16, 1 bf16, 2 fp32.
extern "C" int qoq_kv_append(const void* k, const void* v, int dtype, int64_t k_stride_token, int64_t k_stride_head,
                             int64_t v_stride_token, int64_t v_stride_head, const int* slots, void* cache,
                             int num_tokens, int num_kv_heads, int head_dim, int bits, int page_size, int num_pages,
                             cudaStream_t stream) {
  if (num_tokens <= 0 || num_kv_heads <= 0) return cudaSuccess;
  if (page_size <= 0 || page_size % kBlockTokens) return cudaErrorInvalidValue;
  return dispatch(bits, head_dim, [&](auto bits_c, auto dim_c) {
    constexpr int BITS = bits_c(), D = dim_c();
    const int64_t head_bytes = CacheLayout<BITS, D>::head_bytes(page_size);
    const AppendParams p{k, v, k_stride_token, k_stride_head, v_stride_token, v_stride_head, slots,
                         static_cast<uint8_t*>(cache), num_tokens, num_kv_heads, page_size, num_pages,
                         head_bytes, head_bytes * num_kv_heads};
    return append<BITS, D>(p, dtype, stream);
  });
}

// Decode attention: out[s, h] = softmax(q[s, h] K^T * scale) V over the context_lens[s] tokens
// of sequence s. With num_splits > 1, partial_acc / partial_ml are the split workspace;
// step_blocks (1 or 2) is the tiling of DecodeTiling.
extern "C" int qoq_kv_decode(const void* q, void* out, const void* cache, const int* page_table,
                             const int* context_lens, void* partial_acc, void* partial_ml, int num_seqs,
                             int num_q_heads, int num_kv_heads, int head_dim, int bits, int page_size, int max_pages,
                             int num_pages, int num_splits, int blocks_per_split, int step_blocks,
                             float softmax_scale, cudaStream_t stream) {
  if (num_seqs <= 0) return cudaSuccess;
  int page_shift = 0;  // page_size = 16 << page_shift
  while ((kBlockTokens << page_shift) < page_size) ++page_shift;
  if (num_kv_heads <= 0 || num_q_heads % num_kv_heads || num_q_heads / num_kv_heads > 16 ||
      page_size != (kBlockTokens << page_shift) || num_splits <= 0 || blocks_per_split <= 0 ||
      (step_blocks != 1 && step_blocks != 2))
    return cudaErrorInvalidValue;
  return dispatch(bits, head_dim, [&](auto bits_c, auto dim_c) {
    constexpr int BITS = bits_c(), D = dim_c();
    const int64_t head_bytes = CacheLayout<BITS, D>::head_bytes(page_size);
    const DecodeParams p{static_cast<const half*>(q), static_cast<half*>(out), static_cast<const uint8_t*>(cache),
                         page_table, context_lens, static_cast<float*>(partial_acc),
                         static_cast<float2*>(partial_ml), num_q_heads, num_kv_heads, page_size, page_shift,
                         max_pages, num_pages, head_bytes, head_bytes * num_kv_heads, num_splits, blocks_per_split,
                         softmax_scale * 1.4426950408889634f};
    return step_blocks == 2 ? decode<BITS, D, 2>(p, num_seqs, stream) : decode<BITS, D, 1>(p, num_seqs, stream);
  });
}
