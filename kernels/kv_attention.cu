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
// One CTA of 4 warps per (context split, kv head, sequence). The products run transposed,
//     S^T = K Q^T  and  O^T = V^T P^T,
// so that the cache supplies the mma's A operand (16 rows: tokens for S^T, head dims for O^T)
// and the query heads that share the kv head are its N columns (8 per tile; up to 16 heads,
// HT = 1 or 2 tiles): K and V are read once for all of them, and a kv head with one query
// head (MHA) wastes 7 of 8 columns instead of 15 of 16 rows. The layout above was made for
// the untransposed products, yet a lane's K registers of a block's two 8-token tiles are
// exactly its A fragment of the 16 tokens, and its V registers exactly its A fragments of
// V^T, so the transposition costs no data movement; only P^T is moved, from the C fragment
// of S^T (token rows) into the B fragment of the P.V mma (movmatrix, 2 per block and tile).
// The split's 16-token blocks are taken in warp steps of NB blocks (DecodeTiling; one online
// softmax update per step), warp w taking every 4th step through its own ring of cp.async
// stages in shared memory; each lane copies 16-byte units, so a block costs a few copy
// instructions and no registers until it is used. Page lookups are shifts (page sizes are
// powers of two) and are fetched a step early.
// Scores stay exact with respect to the dequantized cache: the mma multiplies the codes by the
// query, and the token's scale and zero are applied in fp32 afterwards,
//     (c * s + z) . q = s * (c . q) + z * sum(q).
// The K codes even stay magic-biased (one LOP3 per two codes; see unpack_k_u4): the bias is a
// per-query constant that the mma chain starts from (C = -bias). V is not dequantized either:
//     sum_t p_t v_t = sum_t (p_t s_t)(c_t - 8) + sum_t p_t (z_t + 8 s_t),
// the mma multiplies the centred codes (one LOP3 and one HSUB2 per two) by p * s, formed in
// fp32 and rounded to fp16 once, like P in FlashAttention, with fp32 accumulation; the second
// sum is fp32 arithmetic per token. Together with the fp16 query that is ~3e-4 relative
// error against fp32 attention over the same cache, at any context length (attend_step also
// keeps p * s clear of fp16 subnormals whatever the magnitude of V).
// Warps are merged through shared memory; with several splits each writes (max, sum,
// unnormalized output) and the last split of each (sequence, kv head) to finish combines them
// (flash-decoding in one launch; last_to_finish). The host chooses the split count and NB
// (qoqtool/runtime/attention_ops.py).
//
// Measured design history (benchmarks/RESULTS.md): the first version (16-token steps, page
// lookups by integer division, K codes unbiased by two more ops per pair) issued ~500
// instructions per block and reached only ~2.2 TB/s of KV4 reads on the H200: bound by
// instruction issue, not memory (KV8, the same work per block, reached 3.5-4.1 TB/s). The
// second (heads as mma rows, V dequantized to fp16, a separate combine kernel) issued ~500
// per block at B = 16 and reached 2.4 TB/s; this one issues ~330 (ncu) and 3.2-4.3 TB/s.
#include <cuda_bf16.h>
#include <math.h>

#include <algorithm>
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
// of 4 warps fit in the SM's 227 KB (registers allow 2 to 4: min_ctas).
template <int BITS, int D, int NB>
struct DecodeTiling {
  static constexpr int kStageBytes = NB * CacheLayout<BITS, D>::kStageBlockBytes;
  static constexpr int kStages = 13312 / kStageBytes < 2 ? 2 : (13312 / kStageBytes > 8 ? 8 : 13312 / kStageBytes);
};

// CTAs per SM the decode kernel's register budget must allow with HT head tiles, from
// ptxas's reports (-Xptxas -v): the largest count without spills (4 leave 128 registers).
constexpr int min_ctas(int bits, int d, int ht) {
  return d == 64 || (ht == 1 && bits < 16) ? 4 : (ht == 1 ? 3 : (bits == 16 ? 2 : 3));
}

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
constexpr float kMagic = 1024.f;

// K codes as the A operand of K Q^T, left biased: one LOP3 (or PRMT) per two codes.
// KV4, word w -> registers 4w..4w+3 = nibbles (k, k + 4): 0x6400 | q is fp16 1024 + q, and
// 0x6400 | q << 4 is 1024 + 16q (registers 1 and 3). The query's dims that meet the 16q
// registers are pre-divided by 16, so codes.q' = 1024 sum(q') + c.q: the mma chain starts
// from -1024 sum(q') (QueryFrags::c0), with fp32 accumulation.
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

// V codes in fp16, exact and centred (c - 8, or c - 128 for KV8): the kernel multiplies them
// by p * scale and adds sum(p * (zero + 8 scale)) apart (attend_step); centred codes keep that
// fp32 accumulator a signed sum of about the output's size rather than a large positive one
// that the zero-point term would cancel. The bias must go here, since each register pairs two
// tokens: one more HSUB2 (or an exact HFMA2 by 1/16, -72) per two codes.
constexpr uint32_t kHalf2_1032 = 0x64086408;     // 1024 + 8
constexpr uint32_t kHalf2_1152 = 0x64806480;     // 1024 + 128
constexpr uint32_t kHalf2_minus72 = 0xD480D480;  // -64 - 8
template <int BITS>
constexpr float kCodeMid = BITS == 4 ? 8.f : 128.f;  // what the V codes are centred on

__device__ __forceinline__ void unpack_v_u4(uint32_t w, uint32_t* r) {
  uint32_t b[4];
  unpack_k_u4(w, b);
  r[0] = as_u32(__hsub2(as_half2(b[0]), as_half2(kHalf2_1032)));
  r[1] = as_u32(__hfma2(as_half2(b[1]), as_half2(kHalf2_16th), as_half2(kHalf2_minus72)));
  r[2] = as_u32(__hsub2(as_half2(b[2]), as_half2(kHalf2_1032)));
  r[3] = as_u32(__hfma2(as_half2(b[3]), as_half2(kHalf2_16th), as_half2(kHalf2_minus72)));
}

__device__ __forceinline__ void unpack_v_u8(uint32_t w, uint32_t* r) {
  uint32_t b[2];
  unpack_k_u8(w, b);
  r[0] = as_u32(__hsub2(as_half2(b[0]), as_half2(kHalf2_1152)));
  r[1] = as_u32(__hsub2(as_half2(b[1]), as_half2(kHalf2_1152)));
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
  int* tickets;             // [seqs, kv_heads], zero between launches (num_splits > 1)
  int num_q_heads, num_kv_heads, page_size, page_shift, max_pages, num_pages;  // page_size = 16 << page_shift
  int64_t head_bytes, page_bytes;
  int num_splits, blocks_per_split;
  float scale_log2;  // softmax scale * log2(e): exp2 of scaled scores is the softmax numerator
};

// The online-softmax state of one warp. The mma's N (8 columns) are query heads: lane (g, t)
// holds heads 8n + 2t + e of head tile n (HT tiles of 8 heads) and, of the output O^T, dims
// 16i + g (+ 8).
template <int D, int HT>
struct SoftmaxState {
  float m[HT][2];   // running max per head (log2 units), equal across the lanes of a head
  float l[HT][2];   // running sum of this lane's terms p
  float zl[HT][2];  // running sum of this lane's p * (V zero): the zero-point part of P.V
  float g;          // the power of two that P * (V scale) is multiplied by (KV4/KV8; warp-uniform)
  // O^T fragments [m-tile i][head tile n]: [e] = dim 16i + g, head 8n + 2t + e; [2 + e] = dim
  // 16i + 8 + g; times g.
  float acc[D / 16][HT][4];
};

// The group's queries as the B operand of S^T = K Q^T, and what the scores need besides.
template <int D, int HT>
struct QueryFrags {
  uint32_t b[HT][D / 16][2];  // head 8n + g, dims 16ks + 2t (+1) in b0, the same + 8 in b1
  float sum_log2[HT][2];      // sum(q) * scale_log2 of heads 8n + 2t + e: the zero-point term
  float c0[HT][4];            // each tile's first C: -1024 sum(q') of heads 8n + 2t + (0, 1, 0, 1)
};

template <int BITS, int D, int HT>
__device__ __forceinline__ void load_query(QueryFrags<D, HT>& qf, const half* q, int group, float scale_log2,
                                           int lane) {
  const int gid = lane / 4, tig = lane % 4;
#pragma unroll
  for (int n = 0; n < HT; ++n) {
    float sum = 0.f, biased = 0.f;  // of head 8n + g, over this lane's dims
    const int head = 8 * n + gid;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
      for (int hk = 0; hk < 2; ++hk) {
        half2 v = __float2half2_rn(0.f);
        if (head < group) v = *reinterpret_cast<const half2*>(q + head * D + 16 * ks + 8 * hk + 2 * tig);
        sum += __low2float(v) + __high2float(v);
        if (BITS == 4 && hk == 1) v = __hmul2(v, as_half2(kHalf2_16th));  // meets 1024 + 16q: exact
        biased += __low2float(v) + __high2float(v);
        qf.b[n][ks][hk] = as_u32(v);
      }
    }
#pragma unroll
    for (int o = 1; o < 4; o *= 2) {
      sum += __shfl_xor_sync(0xffffffffu, sum, o);
      biased += __shfl_xor_sync(0xffffffffu, biased, o);
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {  // lane (g, t) needs heads 2t + e: from lane 4 (2t + e)
      qf.sum_log2[n][e] = __shfl_sync(0xffffffffu, sum, 4 * (2 * tig + e)) * scale_log2;
      // The codes' magic bias, removed by the tensor core itself: each tile's mma chain starts
      // from C = -1024 sum(q') instead of 0 (fp16 entries: no bias).
      const float bias = __shfl_sync(0xffffffffu, biased, 4 * (2 * tig + e));
      qf.c0[n][e] = qf.c0[n][2 + e] = BITS < 16 ? -kMagic * bias : 0.f;
    }
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

// A lane's K fragments of a staged block as the A operand of S^T = K Q^T (tokens are the mma
// M): tile 0 holds token g and tile 1 token 8 + g, register 2ks + h dims 16ks + 8h + 2t (+1),
// which is exactly a0..a3 = (token g, token 8 + g) x (dims 16ks + 2t, the same + 8).
template <int BITS, int D>
__device__ __forceinline__ void block_k(const uint8_t* blk, int lane, uint32_t (&ka)[D / 16][4]) {
  using L = CacheLayout<BITS, D>;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    uint32_t w[L::kKLaneBytes / 4], kb[D / 8];
    read_fragment<L::kKLaneBytes>(blk + i * L::kTileBytes, lane, w);
    unpack_codes<BITS, true>(w, kb);
#pragma unroll
    for (int r = 0; r < D / 8; ++r) ka[r / 2][2 * (r % 2) + i] = kb[r];
  }
}

// A lane's V fragment of a staged block as the A operand of O^T = V^T P^T (dims are the mma M):
// register h * D/8 + j holds dims 8j + g, tokens 8h + 2t (+1), which is exactly a0..a3 =
// (dims 16i + g, the same + 8) x (tokens 2t, 8 + 2t) for j = 2i, 2i + 1. KV4/KV8: exact codes.
template <int BITS, int D>
__device__ __forceinline__ void block_v(const uint8_t* blk, int valid, int lane, uint32_t (&va)[D / 16][4]) {
  using L = CacheLayout<BITS, D>;
  constexpr int NT = D / 8;
  uint32_t w[L::kVLaneBytes / 4], vb[D / 4];
  read_fragment<L::kVLaneBytes>(blk + L::kBlockBytes, lane, w);
  unpack_codes<BITS, false>(w, vb);
  if constexpr (!L::kQuantized) {
    if (valid < kBlockTokens) {  // past the context P is 0, but stale fp16 V could be inf: 0 * inf = NaN
      const int tig = lane % 4;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t keep =
            (8 * h + 2 * tig < valid ? 0x0000FFFFu : 0u) | (8 * h + 2 * tig + 1 < valid ? 0xFFFF0000u : 0u);
#pragma unroll
        for (int j = 0; j < NT; ++j) vb[h * NT + j] &= keep;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < D / 4; ++r) va[(r % NT) / 2][(r % NT) % 2 + 2 * (r / NT)] = vb[r];
}

// Scores of one staged block, in log2 units: s[n][2i + e] = token g + 8i, head 8n + 2t + e
// (the C fragment of S^T); -inf past the context (valid tokens of 16).
template <int BITS, int D, int HT>
__device__ __forceinline__ void block_scores(const uint8_t* blk, int valid, const QueryFrags<D, HT>& qf,
                                             float scale_log2, int lane, float (&s)[HT][4]) {
  using L = CacheLayout<BITS, D>;
  const int gid = lane / 4;
  uint32_t ka[D / 16][4];
  block_k<BITS, D>(blk, lane, ka);
  float k_scale[2], k_zero[2];  // of tokens g, 8 + g; the scale times scale_log2
  if constexpr (L::kQuantized) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const half2 sz = *reinterpret_cast<const half2*>(blk + 2 * L::kBlockBytes + 4 * (8 * i + gid));
      k_scale[i] = __low2float(sz) * scale_log2;
      k_zero[i] = __high2float(sz);
    }
  }
#pragma unroll
  for (int n = 0; n < HT; ++n) {
    float c[4];  // the chain starts at C = -bias: c ends as codes . q (fp32 accumulation)
    mma_16816(c, ka[0], qf.b[n][0][0], qf.b[n][0][1], qf.c0[n]);
#pragma unroll
    for (int ks = 1; ks < D / 16; ++ks) mma_16816(c, ka[ks], qf.b[n][ks][0], qf.b[n][ks][1], c);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (L::kQuantized)  // (code * scale + zero) . q = scale * (code . q) + zero * sum(q)
        s[n][k] = fmaf(c[k], k_scale[k / 2], k_zero[k / 2] * qf.sum_log2[n][k % 2]);
      else
        s[n][k] = c[k] * scale_log2;
    }
  }
  if (valid < kBlockTokens) {  // the context's last block (warp-uniform branch)
#pragma unroll
    for (int n = 0; n < HT; ++n) {
#pragma unroll
      for (int k = 0; k < 4; ++k) s[n][k] = gid + 8 * (k / 2) < valid ? s[n][k] : -INFINITY;
    }
  }
}

// V scale and zero of tokens g and 8 + g of a staged block, in fp32, the zero moved to the
// centre of the codes (zero + 8 scale for KV4); 0 past the context (P is 0 there, but stale
// params could be inf or NaN: 0 * inf = NaN).
template <int BITS, int D>
__device__ __forceinline__ void block_v_params(const uint8_t* blk, int valid, int lane, float (&vs)[2],
                                               float (&vz)[2]) {
  using L = CacheLayout<BITS, D>;
  const int gid = lane / 4;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const half2 sz = *reinterpret_cast<const half2*>(blk + 2 * L::kBlockBytes + 4 * kBlockTokens + 4 * (8 * i + gid));
    const bool inside = valid >= kBlockTokens || gid + 8 * i < valid;
    vs[i] = inside ? __low2float(sz) : 0.f;
    vz[i] = inside ? fmaf(kCodeMid<BITS>, __low2float(sz), __high2float(sz)) : 0.f;
  }
}

// Fold one step of NB staged blocks (valid[b] tokens each, 0..16) into the softmax state.
//
// P.V for KV4/KV8 without dequantizing V: with v = c * s + z = (c - 8) s + (z + 8 s) per token,
//     sum_t p_t v_t = sum_t (p_t s_t) (c_t - 8) + sum_t p_t (z_t + 8 s_t),
// so the mma multiplies the exact centred codes by p * s (formed in fp32 and rounded to fp16
// once, as P alone was), and the zero-point term is a per-head fp32 sum (st.zl). To keep p * s clear of
// fp16's subnormals whatever the magnitude of V, it is scaled by a power of two g, the
// largest with g * max(s) < 2^15 over the tokens seen so far (p <= 1): g only shrinks, and the
// output is rescaled with it exactly like with the softmax max (the merge divides g out).
template <int BITS, int D, int HT, int NB>
__device__ __forceinline__ void attend_step(const uint8_t* stage, const int (&valid)[NB],
                                            const QueryFrags<D, HT>& qf, float scale_log2, int lane,
                                            SoftmaxState<D, HT>& st) {
  using L = CacheLayout<BITS, D>;
  float s[NB][HT][4];
#pragma unroll
  for (int b = 0; b < NB; ++b)
    block_scores<BITS, D, HT>(stage + b * L::kStageBlockBytes, valid[b], qf, scale_log2, lane, s[b]);

  float vs[NB][2], vz[NB][2];  // KV4/KV8: V scales (times g) and zeros of tokens g, 8 + g
  float shrink = 1.f;          // g_new / g_old
  if constexpr (L::kQuantized) {
    float smax = kFp16Tiny;  // the smallest scale quantize_kv writes: g stays finite
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      block_v_params<BITS, D>(stage + b * L::kStageBlockBytes, valid[b], lane, vs[b], vz[b]);
      smax = fmaxf(smax, fmaxf(vs[b][0], vs[b][1]));
    }
#pragma unroll
    for (int o = 4; o < 32; o *= 2) smax = fmaxf(smax, __shfl_xor_sync(0xffffffffu, smax, o));  // over g: all 16 tokens
    // 2^(14 - E) for smax in [2^E, 2^(E + 1)), E in -24..13: built from smax's exponent bits.
    const float g_step = __uint_as_float((268u << 23) - (__float_as_uint(smax) & 0x7F800000u));
    const float g = fminf(st.g, g_step);
    shrink = g * (1.f / st.g);  // powers of two: exact
    st.g = g;
#pragma unroll
    for (int b = 0; b < NB; ++b) vs[b][0] *= g, vs[b][1] *= g;
  }

  // Online softmax per head over the step's 16 * NB tokens (a head's tokens are spread over
  // the 8 lanes g of its column t).
  float base[HT][2], rescale[HT][2];
  bool moved = shrink != 1.f;
#pragma unroll
  for (int n = 0; n < HT; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float mx = -INFINITY;
#pragma unroll
      for (int b = 0; b < NB; ++b) mx = fmaxf(mx, fmaxf(s[b][n][e], s[b][n][2 + e]));
#pragma unroll
      for (int o = 4; o < 32; o *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_new = fmaxf(st.m[n][e], mx);
      base[n][e] = m_new == -INFINITY ? 0.f : m_new;  // nothing valid yet: avoid inf - inf
      const float alpha = exp2f(st.m[n][e] - base[n][e]);
      rescale[n][e] = alpha * shrink;
      moved |= alpha != 1.f;
      st.m[n][e] = m_new;
      st.l[n][e] *= alpha;
      st.zl[n][e] *= alpha;
    }
  }
  // P^T (times V's scale) as the B operand of O^T = V^T P^T: the C fragment of S^T holds token
  // g (8 + g) x heads 2t, 2t + 1; transposed, lane (g, t) holds head g x tokens 2t, 2t + 1.
  uint32_t pb[NB][HT][2];
#pragma unroll
  for (int b = 0; b < NB; ++b) {
#pragma unroll
    for (int n = 0; n < HT; ++n) {
      float p[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        p[k] = exp2f(s[b][n][k] - base[n][k % 2]);
        st.l[n][k % 2] += p[k];
        if constexpr (L::kQuantized) {
          st.zl[n][k % 2] = fmaf(p[k], vz[b][k / 2], st.zl[n][k % 2]);
          p[k] *= vs[b][k / 2];
        }
      }
      pb[b][n][0] = transpose_8x8(as_u32(__floats2half2_rn(p[0], p[1])));
      pb[b][n][1] = transpose_8x8(as_u32(__floats2half2_rn(p[2], p[3])));
    }
  }
  // Rescale the output only when a head's max or g moved (after the first steps, rarely).
  if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
#pragma unroll
      for (int n = 0; n < HT; ++n) {
#pragma unroll
        for (int k = 0; k < 4; ++k) st.acc[i][n][k] *= rescale[n][k % 2];
      }
    }
  }
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    uint32_t va[D / 16][4];
    block_v<BITS, D>(stage + b * L::kStageBlockBytes, valid[b], lane, va);
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
#pragma unroll
      for (int n = 0; n < HT; ++n) mma_16816(st.acc[i][n], va[i], pb[b][n][0], pb[b][n][1], st.acc[i][n]);
    }
  }
}

// The last of a (sequence, kv head)'s splits to finish combines them: each split publishes its
// partial results, then takes a ticket; the one that draws the last ticket resets the counter
// (so the next launch, or a CUDA-graph replay, starts from 0) and returns true.
__device__ __forceinline__ bool last_to_finish(int* ticket_counter, int splits) {
  __threadfence();  // this thread's partial results are visible device-wide ...
  __syncthreads();  // ... for every thread, before the ticket is taken
  bool last = false;
  if (threadIdx.x == 0) {
    last = atomicAdd(ticket_counter, 1) == splits - 1;
    if (last) *ticket_counter = 0;  // every other split of this launch has taken its ticket
  }
  last = __syncthreads_or(last);
  if (last) __threadfence();  // and their results are visible here
  return last;
}

// Flash-decoding's second step, for the `group` query heads of one (sequence, kv head):
// out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the `splits` splits. The weights go
// to shared memory first (one warp per row); then each thread sums 4 output dims (16-byte loads).
template <int D>
__device__ void combine_splits(const DecodeParams& p, int seq, int qh0, int group, int splits) {
  float* weight = dynamic_smem<float>();  // [group][splits]
  float* row_sum = weight + group * splits;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const size_t head0 = (size_t)seq * p.num_q_heads + qh0;
  for (int row = warp; row < group; row += kWarps) {
    const float2* ml = p.partial_ml + (head0 + row) * p.num_splits;
    float mmax = -INFINITY;
    for (int s = lane; s < splits; s += 32) mmax = fmaxf(mmax, __ldcg(ml + s).x);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) mmax = fmaxf(mmax, __shfl_xor_sync(0xffffffffu, mmax, o));
    float sum = 0.f;
    for (int s = lane; s < splits; s += 32) {
      const float2 v = __ldcg(ml + s);
      const float w = mmax == -INFINITY ? 0.f : exp2f(v.x - mmax);
      weight[row * splits + s] = w;
      sum += v.y * w;
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) row_sum[row] = sum;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < group * D / 4; i += kThreads) {
    const int row = i / (D / 4), d4 = i % (D / 4);
    const float4* acc = reinterpret_cast<const float4*>(p.partial_acc + (head0 + row) * p.num_splits * D) + d4;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int s = 0; s < splits; ++s) {
      const float w = weight[row * splits + s];
      const float4 v = __ldcg(acc + s * (D / 4));
      a = make_float4(fmaf(w, v.x, a.x), fmaf(w, v.y, a.y), fmaf(w, v.z, a.z), fmaf(w, v.w, a.w));
    }
    const float inv = row_sum[row] > 0.f ? 1.f / row_sum[row] : 0.f;
    half2* out = reinterpret_cast<half2*>(p.out + (head0 + row) * D + 4 * d4);
    out[0] = __floats2half2_rn(a.x * inv, a.y * inv);
    out[1] = __floats2half2_rn(a.z * inv, a.w * inv);
  }
}

template <int BITS, int D, int HT, int NB>
__global__ void __launch_bounds__(kThreads, min_ctas(BITS, D, HT)) decode_kernel(const DecodeParams p) {
  using T = DecodeTiling<BITS, D, NB>;
  constexpr int ROWS = 8 * HT, S = T::kStages;
  const int split = blockIdx.x, kvh = blockIdx.y, seq = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane / 4, tig = lane % 4;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int qh0 = kvh * group;
  // Lengths past the page table are cut (the host rejects them before launch).
  const int len = min(max(p.context_lens[seq], 0), p.max_pages * p.page_size);
  const int blocks = (len + kBlockTokens - 1) / kBlockTokens;
  const int begin = split * p.blocks_per_split;
  const int end = min(blocks, begin + p.blocks_per_split);
  if (begin >= end) {  // a split past this sequence's end takes no part
    if (blocks == 0 && split == 0) {  // empty context: zeros
      for (int i = threadIdx.x; i < group * D; i += kThreads)
        p.out[((size_t)seq * p.num_q_heads + qh0) * D + i] = __float2half_rn(0.f);
    }
    return;
  }

  QueryFrags<D, HT> qf;
  load_query<BITS, D, HT>(qf, p.q + ((size_t)seq * p.num_q_heads + qh0) * D, group, p.scale_log2, lane);
  SoftmaxState<D, HT> st;
  st.g = 274877906944.f;  // 2^38, the largest g (V scale 2^-24): the first step sets it
#pragma unroll
  for (int n = 0; n < HT; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      st.m[n][e] = -INFINITY;
      st.l[n][e] = st.zl[n][e] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
#pragma unroll
      for (int k = 0; k < 4; ++k) st.acc[i][n][k] = 0.f;
    }
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
  uint8_t* computed = ring;                             // the stage of step n
  uint8_t* refilled = ring + (S - 1) * T::kStageBytes;  // the stage of step n + S - 1
  uint8_t* const ring_end = ring + S * T::kStageBytes;
  for (int step = warp; step < steps; step += kWarps) {
    __syncwarp();  // every lane is done reading the stage about to be refilled
    const int ahead = step + (S - 1) * kWarps;
    if (ahead < steps) issue_step(ahead, refilled, pg);
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
    attend_step<BITS, D, HT, NB>(computed, valid, qf, p.scale_log2, lane, st);
    computed = computed + T::kStageBytes == ring_end ? ring : computed + T::kStageBytes;
    refilled = refilled + T::kStageBytes == ring_end ? ring : refilled + T::kStageBytes;
  }
  cp_async_wait<0>();
  __syncthreads();  // the rings are free: the merge below reuses the shared memory

  // Merge the 4 warps through shared memory: [w][head] max and sum, [w][head][d] outputs (g
  // and the zero-point term folded in).
  const float inv_g = CacheLayout<BITS, D>::kQuantized ? 1.f / st.g : 1.f;
  float* sm_m = dynamic_smem<float>();
  float* sm_l = sm_m + kWarps * ROWS;
  float* sm_acc = sm_l + kWarps * ROWS;
#pragma unroll
  for (int n = 0; n < HT; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int o = 4; o < 32; o *= 2) {  // a head's terms are spread over the lanes g
        st.l[n][e] += __shfl_xor_sync(0xffffffffu, st.l[n][e], o);
        st.zl[n][e] += __shfl_xor_sync(0xffffffffu, st.zl[n][e], o);
      }
      const int head = 8 * n + 2 * tig + e;
      if (head < group) {
        if (gid == 0) {
          sm_m[warp * ROWS + head] = st.m[n][e];
          sm_l[warp * ROWS + head] = st.l[n][e];
        }
        float* dst = sm_acc + (warp * group + head) * D + gid;
#pragma unroll
        for (int i = 0; i < D / 16; ++i) {
          dst[16 * i] = fmaf(st.acc[i][n][e], inv_g, st.zl[n][e]);
          dst[16 * i + 8] = fmaf(st.acc[i][n][2 + e], inv_g, st.zl[n][e]);
        }
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
  if (p.num_splits == 1) return;
  const int splits = min(p.num_splits, (blocks + p.blocks_per_split - 1) / p.blocks_per_split);
  if (last_to_finish(p.tickets + (size_t)seq * p.num_kv_heads + kvh, splits))
    combine_splits<D>(p, seq, qh0, group, splits);
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
  const int rows = group <= 8 ? 8 : 16;  // heads: one or two mma column tiles
  const dim3 grid(p.num_splits, p.num_kv_heads, num_seqs);
  const size_t merge = sizeof(float) * kWarps * (2 * rows + group * D);
  const size_t ring = (size_t)kWarps * T::kStages * T::kStageBytes;
  const size_t weights = p.num_splits > 1 ? sizeof(float) * group * (p.num_splits + 1) : 0;  // combine_splits
  const size_t smem = std::max(std::max(merge, ring), weights);
  return rows == 8 ? launch(decode_kernel<BITS, D, 1, NB>, grid, dim3(kThreads), smem, stream, p)
                   : launch(decode_kernel<BITS, D, 2, NB>, grid, dim3(kThreads), smem, stream, p);
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
// of sequence s. With num_splits > 1 (flash-decoding, combined inside the same launch),
// partial_acc / partial_ml are the split workspace and tickets an int [seqs, kv_heads] that
// is zero before the launch and is left zero after it (one launch at a time may use it);
// num_splits * (q_heads / kv_heads) is at most 4096. step_blocks (1 or 2) is the tiling of
// DecodeTiling.
extern "C" int qoq_kv_decode(const void* q, void* out, const void* cache, const int* page_table,
                             const int* context_lens, void* partial_acc, void* partial_ml, int* tickets,
                             int num_seqs, int num_q_heads, int num_kv_heads, int head_dim, int bits, int page_size,
                             int max_pages, int num_pages, int num_splits, int blocks_per_split, int step_blocks,
                             float softmax_scale, cudaStream_t stream) {
  if (num_seqs <= 0) return cudaSuccess;
  int page_shift = 0;  // page_size = 16 << page_shift
  while ((kBlockTokens << page_shift) < page_size) ++page_shift;
  if (num_kv_heads <= 0 || num_q_heads % num_kv_heads || num_q_heads / num_kv_heads > 16 ||
      page_size != (kBlockTokens << page_shift) || num_splits <= 0 || blocks_per_split <= 0 ||
      (step_blocks != 1 && step_blocks != 2) || num_splits * (num_q_heads / num_kv_heads) > 4096 ||
      (num_splits > 1 && (!partial_acc || !partial_ml || !tickets)))
    return cudaErrorInvalidValue;
  return dispatch(bits, head_dim, [&](auto bits_c, auto dim_c) {
    constexpr int BITS = bits_c(), D = dim_c();
    const int64_t head_bytes = CacheLayout<BITS, D>::head_bytes(page_size);
    const DecodeParams p{static_cast<const half*>(q), static_cast<half*>(out), static_cast<const uint8_t*>(cache),
                         page_table, context_lens, static_cast<float*>(partial_acc),
                         static_cast<float2*>(partial_ml), tickets, num_q_heads, num_kv_heads, page_size, page_shift,
                         max_pages, num_pages, head_bytes, head_bytes * num_kv_heads, num_splits, blocks_per_split,
                         softmax_scale * 1.4426950408889634f};
    return step_blocks == 2 ? decode<BITS, D, 2>(p, num_seqs, stream) : decode<BITS, D, 1>(p, num_seqs, stream);
  });
}
