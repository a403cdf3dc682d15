/* Linear layers on GGUF's own quantized blocks: Q4_0 and Q5_0 (groups of 32) and the
 * K-quants Q4_K, Q5_K and Q6_K (super-blocks of 256), on the panels cpu_repack.c makes of
 * a GGUF tensor's bytes. Included by cpu_kernels.c,
 * after the Q4_1 / Q8_0 kernels, whose vector helpers, panels (PW outputs, PV vectors of
 * VW lanes) and activation rounding (furnace_q8_rows) it uses.
 *
 * Weights: the file's values exactly. A block's codes are unpacked to one unsigned code
 * per weight (0 .. 2^bits - 1) and laid out like Q4_1's panels; the scales, minimums and
 * float16 factors are copied, the 6-bit K-quant scales widened to a byte each.
 *   Q4_0: w = d (q - 8)      Q5_0: w = d (q - 16)     (d per output and 32 k)
 *   Q4_K, Q5_K: w = d sc[j] q - dmin m[j]              (sc, m: 6 bits per 32 k; d, dmin per 256)
 *   Q6_K: w = d sc[j] (q - 32)                         (sc: signed 8 bits per 16 k; d per 256)
 *
 * Activations: Q4_0 and Q5_0 take Q4_1's (int8 per row and 32 k, scale max|x| / 127), with
 * the rounded activations' sum for the offset term. The K-quants take llama.cpp's Q8_K
 * arrangement: one scale per row and 256 k (max|x| / 127, codes -127..127), the integer
 * sums of the codes per 32 k and, for Q6_K, its runs' starts per 16 k (kq_q6_start). One
 * activation scale per super-block lets the 6- or 8-bit weight scales enter the integer
 * sum: the products of a run of quads (vp below: up to a sub-block, as many as int16
 * holds) are summed per lane, in int16 from vpmaddubsw with vpaddw (in int32 with VNNI's
 * vpdpbusd), and a run meets its sub-block's scale in one vpmaddwd (vpmulld): one multiply
 * per 32 products and a run's one, not two.
 * Per super-block one float update per row and output. The minimums (Q4_K, Q5_K) are an
 * integer sum of the per-32 code sums times the per-output minimums, also per super-block;
 * Q6_K's offset 32 enters its runs' starts (kq_q6_start).
 *
 * Bounds (no saturation, no overflow of a run's int16 sum or of int32): a pair sum is at
 * most 2 * 63 * 127 = 16002 (vpmaddubsw saturates none), a run's int16 sum at most 32,512
 * (kq_run; vpaddw wraps, so only the run's sum must fit); times a scale (|sc| <= 128) and
 * summed over a super-block: 256 * 63 * 127 * 128 < 2^31. Every sum is exact, so the
 * result does not depend on how the products are grouped.
 *
 * Batch invariance as the other grouped kernels: a row's codes and sums come from that row
 * alone, integer sums are exact, and each (row, output) total is updated once per block in
 * block order, whatever the number of rows.
 *
 * Loop order: per panel, block by block, all row blocks of a block before the next (its
 * weights read from memory once, then from L1: with many rows the kernel is bound by
 * arithmetic, not by memory), with the totals of every row in a per-thread buffer. A
 * register block is KQ_ROWS rows against half the panel's outputs (a block's codes are
 * unpacked once per register block, or once for all of them: kq_unpack_first); a single
 * row takes the whole panel in one pass. */

/* ggml's type numbers (gguf.GGMLQuantizationType). */
enum { GG_Q4_0 = 2, GG_Q4_1 = 3, GG_Q5_0 = 6, GG_Q8_0 = 8, GG_Q4_K = 12, GG_Q5_K = 13, GG_Q6_K = 14 };
#define QK 256
/* Rows per register block of the K-quant kernels and the code vectors (1, 2 or PV) each
 * pass over a block covers: four rows against half a panel (a nibble half: 2 code
 * vectors) on AVX2 (8 run sums, the 2 code vectors and a broadcast in 16 registers; the
 * 8 totals go to memory once per run), six on AVX-512 (24 of its 32; the build takes
 * four on AMD's, and from Zen 5 on four against the whole panel, 16 run sums with the
 * totals partly in memory: native/library.py's tuning_flags); one row alone against the
 * whole panel. (Overridable with -D for measurements; on Zen 3 one code vector a pass,
 * or two rows against the whole panel, measured slower.) */
#ifndef KQ_ROWS
#if VW == 16
#define KQ_ROWS 6
#else
#define KQ_ROWS 4
#endif
#endif
#ifndef KQ_VECS
#define KQ_VECS 2
#endif
/* The blocks are prefetched this many bytes ahead (about one Q6_K or two Q4_K blocks of a
 * panel, so twice as far on AVX-512, whose panels are twice as wide: with 8 KiB there a
 * block's scales, read before its codes, came late; docs/benchmarks.md): on the one-row
 * decode further than the int8 kernels' distance keeps more of the memory bandwidth busy. */
#ifndef KQ_PREFETCH_BYTES
#define KQ_PREFETCH_BYTES (256 * PW)
#endif
/* Q6_K's one-row pass prefetches twice as far: its codes take the most unpacking per byte,
 * and with KQ_PREFETCH_BYTES a one-row call read 3% to 8% slower (Zen 3; docs/benchmarks.md).
 * Several rows keep KQ_PREFETCH_BYTES (further measured no better there). */
#ifndef KQ_PREFETCH_BYTES_Q6
#define KQ_PREFETCH_BYTES_Q6 (2 * KQ_PREFETCH_BYTES)
#endif

/* Integer helpers: vi_u8 / vi_i8 widen VW bytes to int32 lanes; vi_pack2 packs two int16
 * coefficients per lane (c0 low, c1 high) and vi_pairs adds c0 * b[0] + c1 * b[1] per lane
 * (b: two adjacent int16); vb_field moves bits lo .. lo + width - 1 of every byte to bit 4
 * (the rest zero).
 *
 * Runs (vp): the products of a few quads summed per lane before a sub-block's scale
 * multiplies them. Without VNNI a run is the int16 pair sums of vpmaddubsw added with
 * vpaddw (KQ_RUN32 undefined), met by the scale in one vpmaddwd per run instead of one
 * per quad: half the multiplies of the quad-by-quad form. With AVX-512's VNNI (and in
 * plain C) a run is int32 (vpdpbusd) and meets the scale in one vpmulld. The 256-bit
 * AVX-VNNI keeps the int16 runs: its vpdpbusd chains a run's quads through a 5-cycle
 * accumulation, where vpaddw's chain takes one (slower at 16 rows, docs/benchmarks.md). vs_scale widens a scale to what
 * vi_scaled multiplies with (both int16 halves for vpmaddwd). */
#if VW == 16
typedef vi vp;
static inline vb vb_or(vb a, vb b) { return _mm512_or_si512(a, b); }
static inline vb vb_field(vb p, const int lo, const int width) {
    const vb s = lo <= 4 ? _mm512_slli_epi16(p, 4 - lo) : _mm512_srli_epi16(p, lo - 4);
    return _mm512_and_si512(s, _mm512_set1_epi8((char)(((1 << width) - 1) << 4)));
}
static inline vi vi_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline vi vi_i8(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline vi vi_low16(vi a) { return _mm512_and_si512(a, _mm512_set1_epi32(0xffff)); }
static inline vi vi_pack2(vi c0, vi c1) { return _mm512_or_si512(vi_low16(c0), _mm512_slli_epi32(c1, 16)); }
static inline vi vi_pairs(vi acc, vi c, const int16_t *b) {
    int32_t two;
    memcpy(&two, b, 4);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(c, _mm512_set1_epi32(two)));
}
#if defined(__AVX512VNNI__)
#define KQ_RUN32 1
static inline vi vs_scale(vi c) { return c; }
static inline vp vp_start(const int32_t *s) { return _mm512_set1_epi32(*s); }
static inline vp vp_first(vb w, vb x) { return vi_dot4(vi_zero(), w, x); }
static inline vp vp_dot(vp acc, vb w, vb x) { return vi_dot4(acc, w, x); }
static inline vi vi_scaled(vi acc, vp p, vi sc) { return _mm512_add_epi32(acc, _mm512_mullo_epi32(p, sc)); }
#else
static inline vi vs_scale(vi c) { return vi_pack2(c, c); }
static inline vp vp_start(const int32_t *s) { return _mm512_set1_epi32(*s); }
static inline vp vp_first(vb w, vb x) { return _mm512_maddubs_epi16(w, x); }
static inline vp vp_dot(vp acc, vb w, vb x) { return _mm512_add_epi16(acc, _mm512_maddubs_epi16(w, x)); }
static inline vi vi_scaled(vi acc, vp p, vi sc) { return _mm512_add_epi32(acc, _mm512_madd_epi16(p, sc)); }
#endif
#elif VW == 8
typedef vi vp;
static inline vb vb_or(vb a, vb b) { return _mm256_or_si256(a, b); }
static inline vb vb_field(vb p, const int lo, const int width) {
    const vb s = lo <= 4 ? _mm256_slli_epi16(p, 4 - lo) : _mm256_srli_epi16(p, lo - 4);
    return _mm256_and_si256(s, _mm256_set1_epi8((char)(((1 << width) - 1) << 4)));
}
static inline vi vi_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline vi vi_i8(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline vi vi_low16(vi a) { return _mm256_and_si256(a, _mm256_set1_epi32(0xffff)); }
static inline vi vi_pack2(vi c0, vi c1) { return _mm256_or_si256(vi_low16(c0), _mm256_slli_epi32(c1, 16)); }
static inline vi vi_pairs(vi acc, vi c, const int16_t *b) {
    int32_t two;
    memcpy(&two, b, 4);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(c, _mm256_set1_epi32(two)));
}
static inline vi vs_scale(vi c) { return vi_pack2(c, c); }
static inline vp vp_start(const int32_t *s) { return _mm256_set1_epi32(*s); }
static inline vp vp_first(vb w, vb x) { return _mm256_maddubs_epi16(w, x); }
static inline vp vp_dot(vp acc, vb w, vb x) {
    /* In place, as inline asm: GCC otherwise adds into a new register and copies it back
     * (one move per instruction in the inner loop). */
    const vp prod = _mm256_maddubs_epi16(w, x);
    __asm__("vpaddw %1, %0, %0" : "+x"(acc) : "x"(prod));
    return acc;
}
static inline vi vi_scaled(vi acc, vp p, vi sc) { return _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc)); }
#else
typedef int32_t vp;
static inline vb vb_or(vb a, vb b) { return a | b; }
/* (bits shifted in from a neighbouring byte land outside the mask: lo <= 7, width <= 2) */
static inline vb vb_field(vb p, const int lo, const int width) {
    const vb s = lo <= 4 ? p << (4 - lo) : p >> (lo - 4);
    return s & (0x01010101u * (uint32_t)(((1 << width) - 1) << 4));
}
static inline vi vi_u8(const uint8_t *p) { return *p; }
static inline vi vi_i8(const uint8_t *p) { return (int8_t)*p; }
static inline vi vi_pack2(vi c0, vi c1) { return (int32_t)(((uint32_t)c0 & 0xffffu) | ((uint32_t)c1 << 16)); }
static inline vi vi_pairs(vi acc, vi c, const int16_t *b) {
    return acc + (int16_t)(c & 0xffff) * b[0] + (int16_t)((uint32_t)c >> 16) * b[1];
}
#define KQ_RUN32 1
static inline vi vs_scale(vi c) { return c; }
static inline vp vp_start(const int32_t *s) { return *s; }
static inline vp vp_first(vb w, vb x) { return vi_dot4(0, w, x); }
static inline vp vp_dot(vp acc, vb w, vb x) { return vi_dot4(acc, w, x); }
static inline vi vi_scaled(vi acc, vp p, vi sc) { return acc + p * sc; }
#endif

/* Per row and super-block of 256 k: the activation scale, the start of each Q6_K run
 * (q6, per 16 k: see kq_q6_start) and the code sums per 32 (b32). */
typedef struct {
    float s;
    int32_t q6[QK / 16];
    int16_t b32[QK / 32];
} q8k_sums;

/* Where a Q6_K run (a sub-block of 16 k) starts, in a run's lanes (vp_start broadcasts
 * it): -32 times the sum of the activation codes each lane's products take, so that the
 * run sums x (q - 32) rather than x q. even: the codes at k = 0, 1 mod 4, odd: at 2, 3.
 * With int16 runs (vpmaddubsw's pair sums) the low half of a 32-bit lane takes the even
 * products of its output, the high half the odd ones; with int32 runs a lane takes all. */
static inline int32_t kq_q6_start(const int even, const int odd) {
#ifdef KQ_RUN32
    return -32 * (even + odd);
#else
    return (int32_t)(((uint32_t)(-32 * even) & 0xffffu) | ((uint32_t)(-32 * odd) << 16));
#endif
}

/* x [M, K] (K a multiple of 256) -> codes a [M, K] and sums [M, K / 256]. */
void furnace_q8k_rows(const float *x, int64_t M, int64_t K, int8_t *a, q8k_sums *sums) {
    const int64_t n = M * (K / QK);
#pragma omp parallel for schedule(static) if (M * K >= 8 * PARALLEL_ELEMENTS)
    for (int64_t i = 0; i < n; i++) {
        const float *xg = x + i * QK;
        int8_t *ag = a + i * QK;
        q8k_sums *o = sums + i;
        const float amax = abs_max(xg, QK);
        o->s = amax / 127.0f;
        const float inv = amax == 0.0f ? 0.0f : 127.0f / amax;
        for (int j = 0; j < QK; j++) ag[j] = (int8_t)nearbyintf(xg[j] * inv);
        int16_t pair[QK / 2]; /* a[2 p] + a[2 p + 1] */
        for (int p = 0; p < QK / 2; p++) pair[p] = (int16_t)(ag[2 * p] + ag[2 * p + 1]);
        int even[QK / 16], odd[QK / 16];
        for (int u = 0; u < QK / 16; u++) {
            const int16_t *q = pair + 8 * u;
            even[u] = q[0] + q[2] + q[4] + q[6];
            odd[u] = q[1] + q[3] + q[5] + q[7];
            o->q6[u] = kq_q6_start(even[u], odd[u]);
        }
        for (int g = 0; g < QK / 32; g++)
            o->b32[g] = (int16_t)(even[2 * g] + odd[2 * g] + even[2 * g + 1] + odd[2 * g + 1]);
    }
}

/* ---- Panel layouts, per panel of PW outputs and block (32 or 256 k) ----
 *
 * Codes, quad by quad (4 consecutive k): the low 4 bits as in Q4_1's panels (PV / 2
 * vectors of 4 VW bytes, byte 4 i + t of vector h: output h VW + i at k 4 j + t in the low
 * nibble, output (h + PV / 2) VW + i in the high one); higher bits in one more vector of
 * 4 VW bytes (PW bytes) at the same byte positions, bit b of a byte for code vector v:
 *   4-bit:  [quad: 2 PW]
 *   5-bit:  [quad pair: 2 PW, 2 PW, fifth bits PW (bit 4 (j % 2) + v)]
 *   6-bit:  [quad: 2 PW, bits 4-5 PW (bits 2 v, 2 v + 1)]
 * Then, per type, after the codes:
 *   Q4_0, Q5_0:  d[PW] (float16)
 *   Q4_K, Q5_K:  sc[8][PW], m[8][PW] (bytes), d[PW], dmin[PW] (float16)
 *   Q6_K:        sc[16][PW] (signed bytes), d[PW] (float16)
 * Bytes per weight: Q4_0 4.5 bits, Q5_0 5.5, Q4_K 4.625, Q5_K 5.625, Q6_K 6.5625. */
static ALWAYS_INLINE int kq_block_k(const int type) {
    return type == GG_Q4_K || type == GG_Q5_K || type == GG_Q6_K ? QK : Q4_GROUP;
}
static ALWAYS_INLINE int64_t kq_code_bytes(const int type) {
    switch (type) {
    case GG_Q4_0: return 16 * PW;
    case GG_Q5_0: return 20 * PW;
    case GG_Q4_K: return 128 * PW;
    case GG_Q5_K: return 160 * PW;
    default: return 192 * PW; /* GG_Q6_K */
    }
}
static ALWAYS_INLINE int64_t kq_block_bytes(const int type) {
    switch (type) {
    case GG_Q4_0: case GG_Q5_0: return kq_code_bytes(type) + 2 * PW;
    case GG_Q4_K: case GG_Q5_K: return kq_code_bytes(type) + 20 * PW;
    default: return kq_code_bytes(type) + 18 * PW; /* GG_Q6_K */
    }
}
/* Bits above the low four: 0, 1 or 2. */
static ALWAYS_INLINE int kq_extra(const int type) {
    return type == GG_Q5_0 || type == GG_Q5_K ? 1 : type == GG_Q6_K ? 2 : 0;
}

/* Whether code vector v is in vm, a mask of code vectors (bit v). */
static ALWAYS_INLINE int kq_in(const int v, const int vm) { return (vm >> v) & 1; }
/* Every code vector of a panel. */
#define KQ_ALL ((1 << PV) - 1)

/* The codes of quad j of a block: PV vectors of unsigned bytes (kq_codes_of: only those in
 * vm; a load of low nibbles holds vectors h and h + PV / 2). */
static ALWAYS_INLINE void kq_codes_of(const int extra, const uint8_t *c, const int j, const int vm,
                                      vb wv[PV]) {
    const uint8_t *nib = c + j * 2 * PW, *plane = NULL;
    if (extra == 1) {
        nib = c + (j / 2) * 5 * PW + (j % 2) * 2 * PW;
        plane = c + (j / 2) * 5 * PW + 4 * PW;
    } else if (extra == 2) {
        nib = c + j * 3 * PW;
        plane = nib + 2 * PW;
    }
#pragma GCC unroll 2
    for (int h = 0; h < PV / 2; h++) {
        if (!kq_in(h, vm) && !kq_in(h + PV / 2, vm)) continue;
        const vb raw = vb_load(nib + h * 4 * VW);
        wv[h] = vb_low(raw);
        wv[h + PV / 2] = vb_high(raw);
    }
    if (extra) {
        const vb bits = vb_load(plane);
#pragma GCC unroll 4
        for (int v = 0; v < PV; v++)
            if (kq_in(v, vm))
                wv[v] = vb_or(wv[v], vb_field(bits, extra == 1 ? 4 * (j % 2) + v : 2 * v, extra));
    }
}
static ALWAYS_INLINE void kq_codes(const int extra, const uint8_t *c, const int j, vb wv[PV]) {
    kq_codes_of(extra, c, j, KQ_ALL, wv);
}

/* Quads per run (see vp): the most whose int16 sums cannot overflow. A pair sum is at
 * most 2 * cmax * 127 (codes up to 15, 31): 8 quads of Q4_K (30,480), 4 of Q5_K (31,496).
 * A Q6_K run sums x (q - 32) (kq_q6_start), at most 2 * 32 * 127 a pair: its whole
 * sub-block of 4 quads (32,512). (vpaddw wraps, so only a run's final sum must fit.) In
 * int32 a run is a whole sub-block. */
static ALWAYS_INLINE int kq_run(const int type) {
#ifdef KQ_RUN32
    return type == GG_Q6_K ? 4 : 8;
#else
    return type == GG_Q4_K ? 8 : 4;
#endif
}

/* Quad j's share of a K-quant block's bytes (a 64th: codes and the scales after them),
 * ahead bytes on, into L2 (weight_prefetch): the panel is one stream, read once from
 * memory (into the unpacked buffer or by the first pass over a block). With ahead at least
 * a block, a block's scales, read before its codes, arrive during the block before it.
 * exact: every cache line the share touches, in a loop whose count varies from quad to
 * quad; otherwise a fixed count, one a 64 bytes from the share's start, no branch (the
 * line it ends in is its successor's first). The passes of several rows, each register
 * block of a block prefetching again, take the fixed count: 1.24x to 1.32x faster than the
 * loop at 16 rows of Q4_K (Zen 5; docs/benchmarks.md). */
static ALWAYS_INLINE void kq_prefetch_quad(const int type, const uint8_t *blk, const int j,
                                           const int64_t ahead, const int exact) {
    const int64_t step = kq_block_bytes(type) / (QK / 4);
    const uint8_t *from = blk + j * step + ahead;
    if (!exact) {
#pragma GCC unroll 4
        for (int64_t o = 0; o < step; o += 64) weight_prefetch(from + o, 1);
        return;
    }
    for (uintptr_t l = (uintptr_t)from & ~(uintptr_t)63; l < (uintptr_t)from + step; l += 64)
        weight_prefetch((const void *)l, 1);
}

/* Quad j of a block against R rows into their runs: the first quad of a run starts them
 * (a Q6_K run from its rows' kq_q6_start: sums, row stride groups). The codes come
 * unpacked from pre (kq_unpack_first) or are unpacked here. With pre, next (the first
 * pass over the block: its first register block and code vector) prefetches quad j's
 * share of the block after it, so the next block's lines come during this block's
 * arithmetic rather than all at once in its unpacking (Q6_K at 16 rows 1.06x to 1.13x,
 * AVX-512 on Zen 5; the AVX2 build the same there, docs/benchmarks.md). */
static ALWAYS_INLINE void kq_quad(const int type, const int first, const int R, const int vm,
                                  const int next, const uint8_t *blk, const vb *pre, const int j,
                                  const int8_t *a, int64_t K, const q8k_sums *sums,
                                  int64_t groups, vp part[][PV]) {
    vb wv[PV];
    if (pre) {
        if (next) kq_prefetch_quad(type, blk, j, kq_block_bytes(type), 1);
#pragma GCC unroll 4
        for (int v = 0; v < PV; v++)
            if (kq_in(v, vm)) {
                wv[v] = pre[j * PV + v];
#if VW == 8
                /* held in a register for all the rows (GCC otherwise loads it again per row,
                 * and the loads, not the multiplies, bound the loop) */
                __asm__("" : "+x"(wv[v]));
#endif
            }
    } else {
        /* (Q6_K alone: KQ_PREFETCH_BYTES_Q6, see there; on AVX2 this path is the one-row one) */
        kq_prefetch_quad(type, blk, j,
                         type == GG_Q6_K && R == 1 ? KQ_PREFETCH_BYTES_Q6 : KQ_PREFETCH_BYTES,
                         R == 1);
        kq_codes_of(kq_extra(type), blk, j, vm, wv);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        const vb xb = vb_set4(a + r * K + 4 * j);
#pragma GCC unroll 4
        for (int v = 0; v < PV; v++)
            if (kq_in(v, vm)) {
                if (!first)
                    part[r][v] = vp_dot(part[r][v], wv[v], xb);
                else if (type == GG_Q6_K)
                    part[r][v] = vp_dot(vp_start(&sums[r * groups].q6[j / 4]), wv[v], xb);
                else
                    part[r][v] = vp_first(wv[v], xb);
            }
    }
}

/* One K-quant super-block against R rows from row 0 of a (codes, row stride K) and sums
 * (row stride groups), into tot (row stride PW), for the outputs of the code vectors in vm
 * (kq_in). scv: the block's scales (vs_scale), [sub-block][PV]; cp: the minimums of Q4_K
 * and Q5_K in pairs (vi_pack2, [4][PV], against the sums per 32). Q6_K's offset 32 is in
 * its runs (kq_q6_start), so Q6_K has no correction. */
static ALWAYS_INLINE void kq_super_rows(const int type, const int R, const int vm,
                                        const int next, const uint8_t *blk, const vb *pre, const vi *scv, const vi *cp,
                                        const int8_t *a,
                                        int64_t K, const q8k_sums *sums, int64_t groups,
                                        float *tot) {
    const int quads = type == GG_Q6_K ? 4 : 8; /* per sub-block */
    const int run = kq_run(type);
    vi acc[KQ_ROWS][PV];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < PV; v++)
            if (kq_in(v, vm)) acc[r][v] = vi_zero();
#pragma GCC unroll 1
    for (int j0 = 0; j0 < QK / 4; j0 += run) {
        vp part[KQ_ROWS][PV];
        kq_quad(type, 1, R, vm, next, blk, pre, j0, a, K, sums, groups, part);
        /* Several rows on AVX2: the run's quads as one straight stretch of code (no loop
         * branch between the multiplies). One row keeps the loop, which measured faster
         * there; AVX-512 (not measured unrolled) keeps it too. */
        if (R > 1 && VW == 8) {
#pragma GCC unroll 8
            for (int j = j0 + 1; j < j0 + run; j++)
                kq_quad(type, 0, R, vm, next, blk, pre, j, a, K, sums, groups, part);
        } else {
#pragma GCC unroll 1
            for (int j = j0 + 1; j < j0 + run; j++)
                kq_quad(type, 0, R, vm, next, blk, pre, j, a, K, sums, groups, part);
        }
        const vi *sc = scv + (j0 / quads) * PV;
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int v = 0; v < PV; v++)
                if (kq_in(v, vm)) acc[r][v] = vi_scaled(acc[r][v], part[r][v], sc[v]);
    }
    const uint16_t *dh = (const uint16_t *)(blk + kq_code_bytes(type) + 16 * PW);
#pragma GCC unroll 4
    for (int v = 0; v < PV; v++) {
        if (!kq_in(v, vm)) continue;
        const vf d = v_loadh(dh + v * VW);
        const vf dmin = type == GG_Q6_K ? d : v_loadh(dh + PW + v * VW);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const q8k_sums *q = sums + r * groups;
            float *t = tot + r * PW + v * VW;
            vf total = v_fma(vi_float(acc[r][v]), v_mul(d, v_set1(q->s)), v_load(t));
            if (type != GG_Q6_K) {
                vi corr = vi_zero();
#pragma GCC unroll 4
                for (int p = 0; p < 4; p++) corr = vi_pairs(corr, cp[p * PV + v], q->b32 + 2 * p);
                total = v_fma(vi_float(corr), v_mul(dmin, v_set1(-q->s)), total);
            }
            v_store(t, total);
        }
    }
}

/* One group of 32 (Q4_0, Q5_0) against R rows: a as above, s and sum (row stride groups)
 * from furnace_q8_rows, into tot. */
static ALWAYS_INLINE void kq_group_rows(const int type, const int R, const uint8_t *blk,
                                        const int8_t *a, int64_t K, const float *s,
                                        const float *sum, int64_t groups, float *tot) {
    const int extra = kq_extra(type);
    vi acc[Q4_ROWS][PV];
    acc_zero(acc, R);
#pragma GCC unroll 2
    for (int j = 0; j < Q4_GROUP / 4; j++) {
        if ((j & 1) == 0) weight_prefetch(blk + j * 64 + W8_PREFETCH_BYTES, R == 1);
        vb wv[PV];
        kq_codes(extra, blk, j, wv);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const vb xb = vb_set4(a + r * K + 4 * j);
#pragma GCC unroll 4
            for (int v = 0; v < PV; v++) acc[r][v] = vi_dot4(acc[r][v], wv[v], xb);
        }
    }
    const uint16_t *dh = (const uint16_t *)(blk + kq_code_bytes(type));
    const float offset = type == GG_Q4_0 ? -8.0f : -16.0f;
#pragma GCC unroll 4
    for (int v = 0; v < PV; v++) {
        const vf d = v_loadh(dh + v * VW);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            float *t = tot + r * PW + v * VW;
            const vf f = v_mul(vi_float(acc[r][v]), v_set1(s[r * groups]));
            vf total = v_fma(f, d, v_load(t));
            total = v_fma(d, v_set1(offset * sum[r * groups]), total);
            v_store(t, total);
        }
    }
}

/* The scales of a K-quant block widened once for all its row blocks (see kq_super_rows). */
static ALWAYS_INLINE void kq_block_scales(const int type, const uint8_t *blk, vi *scv, vi *cp) {
    const uint8_t *sc = blk + kq_code_bytes(type);
    const int subs = type == GG_Q6_K ? 16 : 8;
    for (int u = 0; u < subs; u++)
        for (int v = 0; v < PV; v++) {
            const vi c = type == GG_Q6_K ? vi_i8(sc + u * PW + v * VW) : vi_u8(sc + u * PW + v * VW);
            scv[u * PV + v] = vs_scale(c);
        }
    if (type == GG_Q6_K) return;
    /* Q4_K and Q5_K correct with their minimums. */
    for (int p = 0; p < 4; p++)
        for (int v = 0; v < PV; v++) {
            const uint8_t *c0 = sc + (8 + 2 * p) * PW + v * VW, *c1 = c0 + PW;
            cp[p * PV + v] = vi_pack2(vi_u8(c0), vi_u8(c1));
        }
}

/* Every row against block g of a K-quant panel, for the outputs of the code vectors in vm,
 * in register blocks of at most KQ_ROWS rows, as even as they go (AVX2, 16 rows: 4 x 4;
 * 5 rows: 3 + 2, not 4 + 1). */
static ALWAYS_INLINE void kq_super_pass(const int type, const int vm, const int8_t *a,
                                        const void *act, int64_t M, int64_t K, int64_t g,
                                        const uint8_t *blk, const vb *pre, const vi *scv, const vi *cp,
                                        float *tot) {
    const int64_t groups = K / QK, blocks = (M + KQ_ROWS - 1) / KQ_ROWS;
    for (int64_t b = 0, m0 = 0, rows; b < blocks; b++, m0 += rows) {
        rows = (M - m0 + blocks - b - 1) / (blocks - b);
        const int8_t *am = a + m0 * K + g * QK;
        float *tm = tot + m0 * PW;
        const q8k_sums *q = (const q8k_sums *)act + m0 * groups + g;
        switch (rows) {
#define KQ_CASE(R)                                                                         \
    case R: kq_super_rows(type, R, vm, b == 0 && (vm & 1), blk, pre, scv, cp, am, K, q, groups, tm); \
        break;
            KQ_CASE(1)
            KQ_CASE(2)
#if KQ_ROWS > 2
            KQ_CASE(3)
            KQ_CASE(4)
#endif
#if KQ_ROWS > 4
            KQ_CASE(5)
            KQ_CASE(6)
#endif
#undef KQ_CASE
        }
    }
}

/* Whether a K-quant block's codes are unpacked once into L1 (pre below) for all its
 * register blocks of several rows, rather than by each pass: on AVX2 for every K-quant, on
 * AVX-512 for Q6_K only, whose codes take the most unpacking (where it measured faster;
 * docs/benchmarks.md). */
static ALWAYS_INLINE int kq_unpack_first(const int type) {
    return VW == 8 || (VW == 16 && type == GG_Q6_K);
}

/* Every row against one panel w of type `type` (a compile-time constant after inlining). */
static ALWAYS_INLINE void kq_panel(const int type, const int8_t *a, const void *act, int64_t M,
                                   int64_t K, const uint8_t *w, float *tot) {
    const int64_t groups = K / kq_block_k(type), bytes = kq_block_bytes(type);
    vi scv[16 * PV], cp[4 * PV];
    vb pre[QK / 4 * PV]; /* a K-quant block's codes, unpacked (more than one row) */
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *blk = w + g * bytes;
        if (kq_block_k(type) == QK) kq_block_scales(type, blk, scv, cp);
        if (kq_block_k(type) == QK) {
            if (M == 1) /* one row: all of the panel at once, the registers allow it */
                kq_super_rows(type, 1, KQ_ALL, 1, blk, NULL, scv, cp, a + g * QK, K,
                              (const q8k_sums *)act + g, groups, tot);
            else
            {
                const vb *codes = kq_unpack_first(type) ? pre : NULL;
                for (int j = 0; codes && j < QK / 4; j++) {
                    if (g == 0) kq_prefetch_quad(type, blk, j, KQ_PREFETCH_BYTES, 1);
                    kq_codes(kq_extra(type), blk, j, pre + j * PV);
                }
#define KQ_PASS(vm) kq_super_pass(type, vm, a, act, M, K, g, blk, codes, scv, cp, tot)
#if KQ_VECS == 4
                KQ_PASS(KQ_ALL);
#elif KQ_VECS == 2 /* a nibble half each: vectors h and h + PV / 2 */
                KQ_PASS(0x5);
                KQ_PASS(0xa);
#else
                KQ_PASS(0x1);
                KQ_PASS(0x2);
                KQ_PASS(0x4);
                KQ_PASS(0x8);
#endif
#undef KQ_PASS
            }
            continue;
        }
        for (int64_t m0 = 0; m0 < M; m0 += Q4_ROWS) {
            const int8_t *am = a + m0 * K + g * kq_block_k(type);
            float *tm = tot + m0 * PW;
            const float *s = (const float *)act + m0 * groups + g, *sum = s + M * groups;
            switch (M - m0 < Q4_ROWS ? M - m0 : Q4_ROWS) {
#define KQ_CASE(R)                                                                     \
    case R: kq_group_rows(type, R, blk, am, K, s, sum, groups, tm); break;
                KQ_CASE(1)
                KQ_CASE(2)
#if Q4_ROWS > 2
                KQ_CASE(3)
                KQ_CASE(4)
#endif
#undef KQ_CASE
            }
        }
    }
}

/* A panel's totals for M rows (row stride PW) into y [M, N] from output n0 on, plus bias
 * when not NULL: whole vectors here, a ragged last panel's through w8_store (the same
 * sums). */
static void panel_store(const float *tot, int64_t M, int64_t n0, int64_t N, const float *bias,
                        float *y) {
    for (int64_t m = 0; m < M; m++)
        for (int v = 0; v < PV; v++) {
            const vf t = v_load(tot + m * PW + v * VW);
            const int64_t n = n0 + v * VW;
            if (n + VW <= N)
                v_store(y + m * N + n, bias ? v_add(t, v_load(bias + n)) : t);
            else
                w8_store(t, n, N, NULL, bias, y + m * N);
        }
}

/* Scratch bytes furnace_kq_linear needs for M rows of K. */
int64_t furnace_kq_scratch(int type, int64_t M, int64_t K) {
    const int64_t sums = kq_block_k(type) == QK ? M * (K / QK) * (int64_t)sizeof(q8k_sums)
                                                : 2 * M * (K / Q4_GROUP) * (int64_t)sizeof(float);
    return sums + M * K;
}

/* y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for w in type's panels (furnace_kq_pack),
 * x [M, K] float32 (K a multiple of the type's block), y [M, N]; scratch: at least
 * furnace_kq_scratch bytes, float-aligned (the rounded activations). Returns 0, or -1
 * for a type without a kernel or when out of memory. */
int furnace_kq_linear(int type, const float *x, int64_t M, int64_t K, const uint8_t *wp,
                      const float *bias, int64_t N, float *y, void *scratch) {
    if (type != GG_Q4_0 && type != GG_Q5_0 && type != GG_Q4_K && type != GG_Q5_K && type != GG_Q6_K)
        return -1;
    const int64_t bk = kq_block_k(type), groups = K / bk;
    const int64_t sum_bytes = furnace_kq_scratch(type, M, K) - M * K;
    int8_t *a = (int8_t *)scratch + sum_bytes;
    if (bk == QK) {
        furnace_q8k_rows(x, M, K, a, (q8k_sums *)scratch);
    } else {
        /* The offset term (d (q - 8), d (q - 16)) takes the rounded activations' sum, as
         * ggml's dot products do: the rounding errors then meet the centred codes, where
         * with the exact sum the codes 0 .. 15 (or 31) met them plus an uncancelled 8 (16)
         * times the errors' sum (about 1% of perplexity on Q4_0). */
        float *s = (float *)scratch;
        q8_rows(x, M, K, a, s, s + M * groups, 1);
    }
    const int64_t panels = (N + PW - 1) / PW, panel_bytes = groups * kq_block_bytes(type);
    int failed = 0;
    panel_queue queue;
    panel_queue_init(&queue, M, panels, max_threads());
#pragma omp parallel
    {
        float *tot = (float *)malloc(sizeof(float) * M * PW);
        if (!tot) {
#pragma omp atomic write
            failed = 1;
        }
        panel_cursor cursor = {0, 0};
        for (int64_t p; (p = panel_next(&queue, &cursor)) >= 0;) {
            if (!tot) continue;
            memset(tot, 0, sizeof(float) * M * PW);
            const uint8_t *w = wp + p * panel_bytes;
            switch (type) {
            case GG_Q4_0: kq_panel(GG_Q4_0, a, scratch, M, K, w, tot); break;
            case GG_Q5_0: kq_panel(GG_Q5_0, a, scratch, M, K, w, tot); break;
            case GG_Q4_K: kq_panel(GG_Q4_K, a, scratch, M, K, w, tot); break;
            case GG_Q5_K: kq_panel(GG_Q5_K, a, scratch, M, K, w, tot); break;
            default: kq_panel(GG_Q6_K, a, scratch, M, K, w, tot); break;
            }
            panel_store(tot, M, p * PW, N, bias, y);
        }
        free(tot);
    }
    return failed ? -1 : 0;
}
