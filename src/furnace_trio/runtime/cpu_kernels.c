/* CPU kernels: linear layers on int8 weights (float activations) and on Q4_1 / Q8_0 groups
 * (int8 activations), paged decode attention, the elementwise pieces of a decoder layer,
 * a whole all-decode step, and the greedy argmax.
 *
 * Built on first use by native/library.py (gcc -O3 -march=native -fopenmp) and called through
 * ctypes with raw pointers to contiguous tensors.
 *
 * Batch invariance: every output element is computed by the same instruction sequence
 * whatever the number of rows M and whichever block it falls in (the accumulation over k
 * runs in one fixed order per (row, output) pair; blocking only decides which pairs share
 * a loop), so a request's result does not depend on its neighbours in the batch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define VW 16
typedef __m512 vf;
static inline vf v_zero(void) { return _mm512_setzero_ps(); }
static inline vf v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vf v_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf v_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf v_abs(vf a) { return _mm512_abs_ps(a); }
static inline vf v_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline float v_sum(vf a) { return _mm512_reduce_add_ps(a); }
static inline void v_store(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf v_set1(float a) { return _mm512_set1_ps(a); }
static inline vf v_loadh(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
/* Integer lanes for the 4-bit kernel: vb holds 4 bytes per lane, vi an int32 per lane. */
typedef __m512i vb;
typedef __m512i vi;
static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vb vb_load(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline vb vb_low(vb b) { return _mm512_and_si512(b, _mm512_set1_epi8(15)); }
static inline vb vb_high(vb b) { return _mm512_and_si512(_mm512_srli_epi16(b, 4), _mm512_set1_epi8(15)); }
static inline vb vb_set4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
/* acc + the sum of 4 products of unsigned bytes of w (at most 15 here) and signed bytes of x. */
static inline vi vi_dot4(vi acc, vb w, vb x) {
#if defined(__AVX512VNNI__)
    /* As inline asm: GCC 12 copies every accumulator around the intrinsic's tied operand
     * (two register moves per instruction in the inner loop). */
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
    return acc;
#else
    /* Pairs in int16: 2 * 15 * 127 cannot saturate. */
    const __m512i pairs = _mm512_maddubs_epi16(w, x);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
}
static inline vf vi_float(vi a) { return _mm512_cvtepi32_ps(a); }
/* |q| per byte, and x with the sign of q per byte (0 where q is 0): x . q = |q| . sign. */
static inline vb vb_abs(vb q) { return _mm512_abs_epi8(q); }
/* (where q is 0, |q| is too: x is left as it is there) */
static inline vb vb_sign(vb x, vb q) {
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(q), _mm512_setzero_si512(), x);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define VW 8
typedef __m256 vf;
static inline vf v_zero(void) { return _mm256_setzero_ps(); }
static inline vf v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vf v_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf v_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf v_abs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
static inline vf v_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline void v_store(float *p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf v_set1(float a) { return _mm256_set1_ps(a); }
static inline vf v_loadh(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
typedef __m256i vb;
typedef __m256i vi;
static inline vi vi_zero(void) { return _mm256_setzero_si256(); }
static inline vb vb_load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vb vb_low(vb b) { return _mm256_and_si256(b, _mm256_set1_epi8(15)); }
static inline vb vb_high(vb b) { return _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(15)); }
static inline vb vb_set4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
static inline vi vi_dot4(vi acc, vb w, vb x) {
#if defined(__AVXVNNI__)
    /* AVX-VNNI (Intel since Alder Lake, AMD since Zen 5): the same exact sums in one instruction */
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
    const __m256i pairs = _mm256_maddubs_epi16(w, x); /* 2 * 15 * 127: no saturation */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}
static inline vf vi_float(vi a) { return _mm256_cvtepi32_ps(a); }
static inline vb vb_abs(vb q) { return _mm256_abs_epi8(q); }
static inline vb vb_sign(vb x, vb q) { return _mm256_sign_epi8(x, q); }
static inline float v_sum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
#define VW 1
typedef float vf;
static inline vf v_zero(void) { return 0.0f; }
static inline vf v_load(const float *p) { return *p; }
static inline vf v_i8(const int8_t *p) { return (float)*p; }
static inline vf v_fma(vf a, vf b, vf c) { return a * b + c; }
static inline vf v_mul(vf a, vf b) { return a * b; }
static inline vf v_add(vf a, vf b) { return a + b; }
static inline vf v_max(vf a, vf b) { return a > b ? a : b; }
static inline vf v_abs(vf a) { return fabsf(a); }
static inline vf v_div(vf a, vf b) { return a / b; }
static inline float v_sum(vf a) { return a; }
static inline void v_store(float *p, vf a) { *p = a; }
static inline vf v_set1(float a) { return a; }
static inline float h2f(uint16_t h);
static inline vf v_loadh(const uint16_t *p) { return h2f(*p); }
typedef uint32_t vb;
typedef int32_t vi;
static inline vi vi_zero(void) { return 0; }
static inline vb vb_load(const uint8_t *p) {
    vb v;
    memcpy(&v, p, 4);
    return v;
}
static inline vb vb_low(vb b) { return b & 0x0f0f0f0fu; }
static inline vb vb_high(vb b) { return (b >> 4) & 0x0f0f0f0fu; }
static inline vb vb_set4(const int8_t *p) { return vb_load((const uint8_t *)p); }
static inline vi vi_dot4(vi acc, vb w, vb x) {
    for (int t = 0; t < 4; t++) acc += (int32_t)((w >> (8 * t)) & 0xff) * (int8_t)(x >> (8 * t));
    return acc;
}
static inline vf vi_float(vi a) { return (float)a; }
static inline vb vb_abs(vb q) {
    vb out = 0;
    for (int t = 0; t < 4; t++) {
        const int8_t b = (int8_t)(q >> (8 * t));
        out |= (uint32_t)(uint8_t)(b < 0 ? -b : b) << (8 * t);
    }
    return out;
}
static inline vb vb_sign(vb x, vb q) {
    vb out = 0;
    for (int t = 0; t < 4; t++) {
        const int8_t b = (int8_t)(q >> (8 * t)), v = (int8_t)(x >> (8 * t));
        out |= (uint32_t)(uint8_t)(b < 0 ? -v : b == 0 ? 0 : v) << (8 * t);
    }
    return out;
}
#endif

/* float16 <-> float32 for KV cache entries (round to nearest even, as the hardware does). */
#if defined(__F16C__)
static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
static inline uint16_t f2h(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#else
static inline float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0 && mant == 0) {
        bits = sign;
    } else if (exp == 0) { /* subnormal: normalise */
        int e = -1;
        do {
            e++;
            mant <<= 1;
        } while (!(mant & 0x400));
        bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3ff) << 13);
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline uint16_t f2h(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000, fexp = (x >> 23) & 0xff;
    uint32_t mant = x & 0x7fffff;
    const int32_t exp = (int32_t)fexp - 127 + 15;
    if (fexp == 0xff) return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        mant |= 0x800000;
        const uint32_t shift = (uint32_t)(14 - exp), halfway = 1u << (shift - 1);
        uint32_t h = mant >> shift;
        const uint32_t rem = mant & ((1u << shift) - 1);
        if (rem > halfway || (rem == halfway && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = sign | ((uint32_t)exp << 10) | (mant >> 13);
    const uint32_t rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return (uint16_t)h;
}
#endif

/* exp(x) for a vector, Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, a degree-5
 * polynomial for e^r, times 2^n. Within 2 ulp of expf over the clamped range (below it
 * the result is about 1e-38, above it about 2e38). */
static inline vf v_exp(vf x) {
#if VW == 1
    return expf(x);
#else
#if VW == 16
    x = _mm512_max_ps(_mm512_min_ps(x, v_set1(88.3762626647949f)), v_set1(-87.3365447504f));
    const vf n = _mm512_roundscale_ps(v_mul(x, v_set1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
#else
    x = _mm256_max_ps(_mm256_min_ps(x, v_set1(88.3762626647949f)), v_set1(-87.3365447504f));
    const vf n = _mm256_round_ps(v_mul(x, v_set1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
#endif
    vf r = v_fma(n, v_set1(-0.693359375f), x);
    r = v_fma(n, v_set1(2.12194440e-4f), r);
    vf y = v_set1(1.9875691500e-4f);
    y = v_fma(y, r, v_set1(1.3981999507e-3f));
    y = v_fma(y, r, v_set1(8.3334519073e-3f));
    y = v_fma(y, r, v_set1(4.1665795894e-2f));
    y = v_fma(y, r, v_set1(1.6666665459e-1f));
    y = v_fma(y, r, v_set1(5.0000001201e-1f));
    y = v_fma(y, v_mul(r, r), r);
    y = v_add(y, v_set1(1.0f));
#if VW == 16
    return _mm512_scalef_ps(y, n);
#else
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return v_mul(y, _mm256_castsi256_ps(e));
#endif
#endif
}

/* Round-trip helpers for tests of the conversions. */
void furnace_f32_to_f16(const float *src, int64_t n, uint16_t *dst) {
    for (int64_t i = 0; i < n; i++) dst[i] = f2h(src[i]);
}
void furnace_f16_to_f32(const uint16_t *src, int64_t n, float *dst) {
    for (int64_t i = 0; i < n; i++) dst[i] = h2f(src[i]);
}

int furnace_vector_width(void) { return VW; }

#define ALWAYS_INLINE inline __attribute__((always_inline))

/* Elementwise work on rows of at least this many elements in total is split across threads. */
#define PARALLEL_ELEMENTS 32768

/* ---- int8-weight linear layers ----
 *
 * Weights are packed in panels of PW consecutive outputs, k-major: panel p holds
 * w[p*PW + j, k] at [p][k][j] (int8; outputs past N are zero). A step of the inner loop
 * widens one k-row of the panel (PW weights, PV vectors) to float once and multiplies it
 * with one broadcast activation per row: every output is a lane of an accumulator, so
 * no horizontal sums are needed, and each output accumulates x[k] * w[k] in k order with
 * one FMA chain whatever the batch: the result is bitwise the same alone or in any batch.
 *
 * Register blocking: PV accumulators per row, W8_ROWS rows at a time (24 of AVX-512's 32
 * registers; 8 of AVX2's 16). One row alone (single-stream decode) has its own loop. */
#define PV 4
#define PW (PV * VW)
#if VW == 16
#define W8_ROWS 6
#else
#define W8_ROWS 2
#endif

int furnace_w8_panel_width(void) { return PW; }

/* The panels of a linear, shared out among the threads of its parallel region
 * (panel_queue_init before the region, panel_next inside it). One row reads its weights
 * from memory: each thread owns one contiguous span of panels, as a static split would give
 * it (one stream through memory per thread; a finer interleaved split measured 0.86x on the
 * one-row decode step), and takes them front to back; a thread done with its own span takes
 * panels one at a time from the back of the span with the most left, so a thread delayed by
 * other work on its core (the server's own thread, another process) does not hold up the
 * step. Several rows are bound by arithmetic: one span for all, two panels at a time to
 * threads as they come free. Either way a panel's outputs are one thread's work, the same
 * whichever thread does it. */
#define PANEL_SPANS 64
typedef struct {
    _Alignas(64) uint64_t range; /* first panel left in the high 32 bits, end in the low 32 */
} panel_span;
typedef struct {
    panel_span span[PANEL_SPANS];
    int spans;
    int64_t chunk;
} panel_queue;

/* The team a parallel region started here gets. */
static inline int max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}
static inline int thread_number(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline uint64_t span_range(int64_t first, int64_t end) {
    return ((uint64_t)first << 32) | (uint64_t)end;
}

/* For M rows of `panels` panels, shared out among a team of `threads`. */
static void panel_queue_init(panel_queue *q, int64_t M, int64_t panels, int threads) {
    int spans = M == 1 ? threads : 1;
    spans = spans < 1 ? 1 : spans > PANEL_SPANS ? PANEL_SPANS : spans;
    q->spans = spans;
    q->chunk = M == 1 ? 1 : 2;
    for (int i = 0; i < spans; i++)
        q->span[i].range = span_range(panels * i / spans, panels * (i + 1) / spans);
}

/* Takes up to chunk panels from a span, from its front or its back: their number (0
 * when the span is empty), the first in *first. */
static inline int64_t span_take(panel_span *span, int64_t chunk, int back, int64_t *first) {
    uint64_t old = __atomic_load_n(&span->range, __ATOMIC_RELAXED);
    for (;;) {
        const int64_t lo = (int64_t)(old >> 32), hi = (int64_t)(old & 0xffffffffu);
        if (lo >= hi) return 0;
        const int64_t n = hi - lo < chunk ? hi - lo : chunk;
        const uint64_t rest = back ? span_range(lo, hi - n) : span_range(lo + n, hi);
        if (__atomic_compare_exchange_n(&span->range, &old, rest, 1, __ATOMIC_RELAXED,
                                         __ATOMIC_RELAXED)) {
            *first = back ? hi - n : lo;
            return n;
        }
    }
}

/* The calling thread's next panels: their number (0 when none are left), the first in
 * *first. Its own span first, then the back of the fullest other one. */
static int64_t panel_take(panel_queue *q, int64_t *first) {
    const int own = thread_number() % q->spans;
    int64_t n = span_take(&q->span[own], q->chunk, 0, first);
    while (n == 0) {
        int fullest = -1;
        int64_t most = 0;
        for (int i = 0; i < q->spans; i++) {
            const uint64_t r = __atomic_load_n(&q->span[i].range, __ATOMIC_RELAXED);
            const int64_t left = (int64_t)(r & 0xffffffffu) - (int64_t)(r >> 32);
            if (left > most) most = left, fullest = i;
        }
        if (fullest < 0) return 0;
        n = span_take(&q->span[fullest], q->chunk, 1, first);
    }
    return n;
}

/* A thread's panels taken and not yet done. */
typedef struct {
    int64_t next, end;
} panel_cursor;

/* The calling thread's next panel, -1 when none are left. */
static inline int64_t panel_next(panel_queue *q, panel_cursor *c) {
    if (c->next == c->end) {
        int64_t first;
        const int64_t n = panel_take(q, &first);
        if (n == 0) return -1;
        c->next = first;
        c->end = first + n;
    }
    return c->next++;
}

/* Which thread takes each panel of a linear of M rows (owner[panels]), taken as the linears
 * take them, by `threads` threads; with hold_first, thread 0 starts only once every other
 * thread has run out of panels (a thread kept off its core). Returns the number of panels
 * taken in all, or -1 when one was taken twice. (For tests of the sharing out.) */
int64_t furnace_panel_owners(int64_t M, int64_t panels, int threads, int hold_first,
                             int32_t *owner) {
    for (int64_t p = 0; p < panels; p++) owner[p] = -1;
    int64_t taken = 0, twice = 0;
    int finished = 0;
    panel_queue queue;
    panel_queue_init(&queue, M, panels, threads);
#pragma omp parallel num_threads(threads)
    {
        const int t = thread_number();
#ifdef _OPENMP
        const int team = omp_get_num_threads(); /* (fewer than threads under OMP_DYNAMIC) */
#else
        const int team = 1;
#endif
        if (hold_first && t == 0)
            while (__atomic_load_n(&finished, __ATOMIC_ACQUIRE) < team - 1) {
            }
        panel_cursor cursor = {0, 0};
        for (int64_t p; (p = panel_next(&queue, &cursor)) >= 0;) {
            if (__atomic_exchange_n(&owner[p], t, __ATOMIC_RELAXED) != -1)
                __atomic_add_fetch(&twice, 1, __ATOMIC_RELAXED);
            __atomic_add_fetch(&taken, 1, __ATOMIC_RELAXED);
        }
        if (t != 0) __atomic_add_fetch(&finished, 1, __ATOMIC_RELEASE);
    }
    return twice ? -1 : taken;
}

/* y[m, n .. n + VW) from one accumulator: scale (when not NULL), bias, bounds. Outside the hot loop, and
 * kept out of line: inlined into every register-block variant it made the build slow. */
static __attribute__((noinline)) void w8_store(vf acc, int64_t n, int64_t N, const float *scale,
                                   const float *bias, float *yrow) {
    if (n + VW <= N) { /* a whole vector: the same products and sums as the loop below */
        vf s = acc;
        if (scale) s = v_mul(s, v_load(scale + n));
        if (bias) s = v_add(s, v_load(bias + n));
        v_store(yrow + n, s);
        return;
    }
    float tmp[VW];
    v_store(tmp, acc);
    for (int i = 0; i < VW && n + i < N; i++) {
        float s = scale ? tmp[i] * scale[n + i] : tmp[i];
        if (bias) s += bias[n + i];
        yrow[n + i] = s;
    }
}

/* Panel k-rows are prefetched this many bytes ahead: the hardware prefetcher alone
 * leaves a good part of the bandwidth unused on the single-stream decode. */
#define W8_PREFETCH_BYTES 2048
/* A software prefetch of weight bytes, into L2 (T2, to_l2) or L1 (T0). The 4-bit group
 * and K-quant passes that read their lines once (one row; a K-quant block's first pass)
 * prefetch into L2: the core's L1 prefetcher takes the lines on from there, and prefetches
 * into L1 hold its few miss buffers for a whole trip to memory (on Zen 4 one-row K-quant
 * calls ran 1.2x to 1.5x faster than with T0). Lines that the next register blocks read
 * again go to L1, and so do the int8 kernels' (there T2 measured 0.82x on Zen 4's one-row
 * step; docs/benchmarks.md). */
static ALWAYS_INLINE void weight_prefetch(const void *p, const int to_l2) {
#if VW > 1
    if (to_l2)
        _mm_prefetch((const char *)p, _MM_HINT_T2);
    else
        _mm_prefetch((const char *)p, _MM_HINT_T0);
#else
    (void)p, (void)to_l2;
#endif
}

/* R rows from m0 (R a compile-time constant after inlining: 1 .. W8_ROWS). The panel's
 * weights come from w (int8, widened on the fly) or, when wf is not NULL, from wf: the
 * same panel widened to float once (identical values, so identical results), for calls
 * with many row blocks, where widening again for every block costs a third of the FMA
 * ports. */
static ALWAYS_INLINE void w8_panel_rows(const float *x, int64_t m0, const int R, int64_t K,
                                        const int8_t *w, const float *wf, int64_t n0,
                                        int64_t N, const float *scale, const float *bias,
                                        float *y) {
    const float *xr[W8_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) xr[r] = x + (m0 + r) * K;
    vf a[W8_ROWS][PV];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < PV; v++) a[r][v] = v_zero();
    for (int64_t k = 0; k < K; k++) {
        vf wv[PV];
        if (wf) {
#pragma GCC unroll 4
            for (int v = 0; v < PV; v++) wv[v] = v_load(wf + k * PW + v * VW);
        } else {
            const int8_t *wk = w + k * PW;
            weight_prefetch(wk + W8_PREFETCH_BYTES, 0);
#pragma GCC unroll 4
            for (int v = 0; v < PV; v++) wv[v] = v_i8(wk + v * VW);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const vf xb = v_set1(xr[r][k]);
#pragma GCC unroll 4
            for (int v = 0; v < PV; v++) a[r][v] = v_fma(wv[v], xb, a[r][v]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < PV; v++) w8_store(a[r][v], n0 + v * VW, N, scale, bias, y + (m0 + r) * N);
}

/* Above this many rows a panel is widened to float once for all its row blocks. The float
 * panel (K * PW * 4 bytes) lives in L2, not L1, so it pays only with many row blocks
 * (a prefill), and costs a few rows (docs/history.md has the figures). */
#define W8_WIDEN_ROWS (3 * W8_ROWS)

/* y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] (+ bias[n]).
 * x: [M, K] float32; wp: the packed panels (see above); scale: [N]; bias: [N] or NULL;
 * y: [M, N]. Threads split the panels; rows go W8_ROWS at a time, the rest in one
 * block of exactly their number (no wasted lanes). */
void furnace_w8_linear(const float *x, int64_t M, int64_t K, const int8_t *wp,
                       const float *scale, const float *bias, int64_t N, float *y) {
    const int64_t panels = (N + PW - 1) / PW;
    panel_queue queue;
    panel_queue_init(&queue, M, panels, max_threads());
#pragma omp parallel
    {
        float *wf = M > W8_WIDEN_ROWS ? (float *)malloc(sizeof(float) * K * PW) : NULL;
        panel_cursor cursor = {0, 0};
        for (int64_t p; (p = panel_next(&queue, &cursor)) >= 0;) {
            const int8_t *w = wp + p * K * PW;
            const int64_t n0 = p * PW;
            if (wf) {
                for (int64_t i = 0; i < K * PW; i += VW) {
                    if ((i & 63) == 0) weight_prefetch(w + i + W8_PREFETCH_BYTES, 0);
                    v_store(wf + i, v_i8(w + i));
                }
            }
            for (int64_t m0 = 0; m0 < M; m0 += W8_ROWS) {
                switch (M - m0 < W8_ROWS ? M - m0 : W8_ROWS) {
#define W8_CASE(R)                                                                   \
    case R:                                                                          \
        if (wf)                                                                      \
            w8_panel_rows(x, m0, R, K, w, wf, n0, N, scale, bias, y);                \
        else                                                                         \
            w8_panel_rows(x, m0, R, K, w, NULL, n0, N, scale, bias, y);              \
        break;
                    W8_CASE(1)
                    W8_CASE(2)
#if W8_ROWS > 2
                    W8_CASE(3)
                    W8_CASE(4)
                    W8_CASE(5)
                    W8_CASE(6)
#endif
#undef W8_CASE
                }
            }
        }
        free(wf);
    }
}

/* ---- 4-bit linear layers: llama.cpp's Q4_1 weights, Q8_0-style activations ----
 *
 * Weights: w[n, k] = d[n, g] * q[n, k] + m[n, g], codes q in 0..15 and, per output n and
 * group g of Q4_GROUP consecutive k, a float16 scale d and minimum m (Q4_1).
 * Activations: per row and group, x[k] ~= s[g] * a[k] with a in -127..127 and
 * s = max |x| / 127 (Q8_0), so that
 *   y[n] = sum_g d[n, g] * s[g] * (sum_{k in g} q[n, k] a[k]) + m[n, g] * (sum_{k in g} x[k])
 * where the inner sums are exact integer dot products (vpdpbusd, 4 byte products per
 * instruction, or vpmaddubsw + vpmaddwd on AVX2): a quarter of the instructions of the
 * float kernel per weight, so a decode step of many sequences is no longer bound by
 * arithmetic. The group sums of x use the exact activations.
 *
 * Batch invariance: a row's codes, scales and sums come from that row alone, integer sums
 * are exact, and the float fold runs in one fixed order per (row, output).
 *
 * Layout: panel p of PW outputs, group by group, Q4_BLOCK bytes each: Q4_GROUP / 4 quads of
 * 4 consecutive k, each PV / 2 vectors of 4 VW bytes (byte 4 i + t of vector h holds the
 * code of output h VW + i at k = 4 j + t in its low nibble, that of output
 * (h + PV / 2) VW + i in its high one), then d[PW] and m[PW] (float16): Q4_1's 20 bytes
 * per 32 weights, read in one stream. */
#define Q4_GROUP 32
#define Q4_QUAD_BYTES (2 * PW)
#define Q4_BLOCK (Q4_GROUP / 4 * Q4_QUAD_BYTES + 4 * PW)
/* Rows per register block (both formats): PV int32 accumulators each; the float totals,
 * updated once per group, live in memory. Q4_GROUP is the group size of Q8_0 too. */
#if VW == 16
#define Q4_ROWS 4
#else
#define Q4_ROWS 2
#endif

int furnace_q4_group(void) { return Q4_GROUP; }

/* The 8-bit sibling, llama.cpp's Q8_0: w[n, k] = d[n, g] * q[n, k] with signed codes q in
 * -127..127 and a float16 scale per output and group of 32. Per panel and group: 8 quads of
 * PV vectors of 4 VW bytes (byte 4 i + t of vector v: output v VW + i at k = 4 j + t), then
 * d[PW]: Q8_0's 34 bytes per 32 weights. The products of two signed bytes go through the
 * unsigned-times-signed instructions as |q| . (a with the sign of q), which cannot
 * saturate (2 * 127 * 127 < 2^15). */
#define Q8_QUAD_BYTES (4 * PW)
#define Q8_BLOCK (Q4_GROUP / 4 * Q8_QUAD_BYTES + 2 * PW)

/* max |x[j]| over n floats (n a multiple of VW): per vector lane, then across the lanes; a
 * NaN is passed over, as by a > test. */
static inline float abs_max(const float *x, int n) {
    vf lanes = v_zero();
    for (int j = 0; j < n; j += VW) lanes = v_max(v_abs(v_load(x + j)), lanes);
    float lane[VW], amax = 0.0f;
    memcpy(lane, &lanes, sizeof lane);
    for (int j = 0; j < VW; j++) amax = lane[j] > amax ? lane[j] : amax;
    return amax;
}

/* Per row and group of x [M, K]: codes a [M, K], scale s and sum [M, K / Q4_GROUP]: the exact
 * sum of the group's x, or with rounded_sum s times the sum of its codes (what an offset
 * term multiplied with the rounded activations needs: Q4_0's and Q5_0's, as ggml's). */
static void q8_rows(const float *x, int64_t M, int64_t K, int8_t *a, float *s, float *sum,
                    int rounded_sum) {
    const int64_t n = M * (K / Q4_GROUP);
#pragma omp parallel for schedule(static) if (M * K >= 8 * PARALLEL_ELEMENTS)
    for (int64_t i = 0; i < n; i++) {
        const float *xg = x + i * Q4_GROUP;
        int8_t *ag = a + i * Q4_GROUP;
        const float amax = abs_max(xg, Q4_GROUP);
        float total = 0.0f;
        for (int j = 0; j < Q4_GROUP; j++) total += xg[j];
        sum[i] = total;
        if (amax == 0.0f) {
            s[i] = 0.0f;
            memset(ag, 0, Q4_GROUP);
            continue;
        }
        const float inv = 127.0f / amax;
        s[i] = amax / 127.0f;
        int codes = 0;
        for (int j = 0; j < Q4_GROUP; j++) {
            ag[j] = (int8_t)nearbyintf(xg[j] * inv);
            codes += ag[j];
        }
        if (rounded_sum) sum[i] = s[i] * (float)codes;
    }
}

void furnace_q8_rows(const float *x, int64_t M, int64_t K, int8_t *a, float *s, float *sum) {
    q8_rows(x, M, K, a, s, sum, 0);
}

/* Zeroes R rows of integer accumulators. */
static ALWAYS_INLINE void acc_zero(vi acc[][PV], const int R) {
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < PV; v++) acc[r][v] = vi_zero();
}

/* R rows from m0 (R a compile-time constant: 1 .. Q4_ROWS) against one panel w of 4-bit
 * (bits = 4) or 8-bit (bits = 8) codes, both compile-time constants after inlining. */
static ALWAYS_INLINE void qx_panel_rows(const int bits, const int8_t *a, const float *s,
                                        const float *sum, int64_t m0, const int R, int64_t K,
                                        const uint8_t *w, int64_t n0, int64_t N,
                                        const float *bias, float *y) {
    const int64_t groups = K / Q4_GROUP;
    const int64_t quad_bytes = bits == 4 ? Q4_QUAD_BYTES : Q8_QUAD_BYTES;
    const int64_t block_bytes = bits == 4 ? Q4_BLOCK : Q8_BLOCK;
    float tot[Q4_ROWS * PW] __attribute__((aligned(64)));
    memset(tot, 0, sizeof(float) * R * PW);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *block = w + g * block_bytes;
        vi acc[Q4_ROWS][PV];
        acc_zero(acc, R);
#pragma GCC unroll 1
        for (int j = 0; j < Q4_GROUP / 4; j++) {
            const uint8_t *c = block + j * quad_bytes;
            for (int64_t b = 0; b < quad_bytes; b += 64)
                weight_prefetch(c + W8_PREFETCH_BYTES + b, R == 1);
            vb wv[PV], qv[PV];
            if (bits == 4) {
#pragma GCC unroll 2
                for (int h = 0; h < PV / 2; h++) {
                    const vb raw = vb_load(c + h * 4 * VW);
                    wv[h] = vb_low(raw);
                    wv[h + PV / 2] = vb_high(raw);
                }
            } else {
#pragma GCC unroll 4
                for (int v = 0; v < PV; v++) {
                    qv[v] = vb_load(c + v * 4 * VW);
                    wv[v] = vb_abs(qv[v]);
                }
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const vb xb = vb_set4(a + (m0 + r) * K + g * Q4_GROUP + 4 * j);
#pragma GCC unroll 4
                for (int v = 0; v < PV; v++)
                    acc[r][v] = vi_dot4(acc[r][v], wv[v], bits == 4 ? xb : vb_sign(xb, qv[v]));
            }
        }
        const uint16_t *dh = (const uint16_t *)(block + Q4_GROUP / 4 * quad_bytes), *mh = dh + PW;
#pragma GCC unroll 4
        for (int v = 0; v < PV; v++) {
            const vf d = v_loadh(dh + v * VW);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const int64_t rg = (m0 + r) * groups + g;
                float *t = tot + r * PW + v * VW;
                const vf f = v_mul(vi_float(acc[r][v]), v_set1(s[rg]));
                vf total = v_fma(f, d, v_load(t));
                if (bits == 4) total = v_fma(v_loadh(mh + v * VW), v_set1(sum[rg]), total);
                v_store(t, total);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < PV; v++)
            w8_store(v_load(tot + r * PW + v * VW), n0 + v * VW, N, NULL, bias, y + (m0 + r) * N);
}

/* y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) with x quantized as above (K a multiple
 * of Q4_GROUP) and w in 4-bit (bits = 4) or 8-bit (bits = 8) panels. a, s, sum:
 * furnace_q8_rows of x; bias: [N] or NULL; y: [M, N]. */
void furnace_qx_linear_q8(int bits, const int8_t *a, const float *s, const float *sum, int64_t M,
                          int64_t K, const uint8_t *wp, const float *bias, int64_t N, float *y) {
    const int64_t panels = (N + PW - 1) / PW, groups = K / Q4_GROUP;
    const int64_t block_bytes = bits == 4 ? Q4_BLOCK : Q8_BLOCK;
    panel_queue queue;
    panel_queue_init(&queue, M, panels, max_threads());
#pragma omp parallel
    {
        panel_cursor cursor = {0, 0};
        for (int64_t p; (p = panel_next(&queue, &cursor)) >= 0;) {
            const uint8_t *w = wp + p * groups * block_bytes;
            const int64_t n0 = p * PW;
            for (int64_t m0 = 0; m0 < M; m0 += Q4_ROWS) {
                switch (M - m0 < Q4_ROWS ? M - m0 : Q4_ROWS) {
#define QX_CASE(R)                                                                   \
    case R:                                                                          \
        if (bits == 4)                                                               \
            qx_panel_rows(4, a, s, sum, m0, R, K, w, n0, N, bias, y);                \
        else                                                                         \
            qx_panel_rows(8, a, s, sum, m0, R, K, w, n0, N, bias, y);                \
        break;
                    QX_CASE(1)
                    QX_CASE(2)
#if Q4_ROWS > 2
                    QX_CASE(3)
                    QX_CASE(4)
#endif
#if Q4_ROWS > 4
                    QX_CASE(5)
                    QX_CASE(6)
#endif
#undef QX_CASE
                }
            }
        }
    }
}

/* The same from float x: quantizes x into scratch (at least M * K bytes + 8 M * K /
 * Q4_GROUP bytes, float-aligned) first. bits: 4 (Q4_1 panels) or 8 (Q8_0 panels). */
void furnace_qx_linear(int bits, const float *x, int64_t M, int64_t K, const uint8_t *wp,
                       const float *bias, int64_t N, float *y, void *scratch) {
    const int64_t groups = K / Q4_GROUP;
    float *s = (float *)scratch, *sum = s + M * groups;
    int8_t *a = (int8_t *)(sum + M * groups);
    furnace_q8_rows(x, M, K, a, s, sum);
    furnace_qx_linear_q8(bits, a, s, sum, M, K, wp, bias, N, y);
}

#include "cpu_kquants.c"
#include "cpu_repack.c"

/* Decode attention over a paged KV cache: one query token per sequence.
 * q: [S, H, D]; k_cache, v_cache: [blocks, block_size, KV, D]; tables: [S, max_blocks];
 * ctx: [S] keys per sequence (the new token's key already written); out: [S, H, D].
 *
 * A sequence's context is cut into chunks of ATT_CHUNK positions, and each chunk is one
 * task for every head (split-K, as flash-decoding does): a task reads each position's keys
 * and values for all KV heads, which lie side by side in the cache, so it streams whole
 * cache lines instead of one head's rows at a stride, and a single long sequence still
 * gives every thread work. A task leaves, per head, its maximum score, the sum of the
 * exponentials and their weighted sum of values; a second pass merges a sequence's chunks
 * in order. The chunks depend on the context length alone, so a sequence's result is the
 * same in any batch and on any number of threads. */
#define ATT_CHUNK 64
#define ATT_PREFETCH 6
/* Query heads whose weighted values are summed together (twelve accumulators). */
#define ATT_VALUE_HEADS 3

/* sc[p] = exp(sc[p] - shift), returning the sum. */
static float exp_shifted(float *sc, int64_t n, float shift) {
    const int64_t nv = n - n % VW;
    vf acc = v_zero();
    for (int64_t p = 0; p < nv; p += VW) {
        const vf e = v_exp(v_add(v_load(sc + p), v_set1(-shift)));
        v_store(sc + p, e);
        acc = v_add(acc, e);
    }
    float total = v_sum(acc);
    for (int64_t p = nv; p < n; p++) {
        sc[p] = expf(sc[p] - shift);
        total += sc[p];
    }
    return total;
}

/* A KV cache's element format. int8 caches keep one float32 scale per (slot, KV head)
 * row of D values in separate scale arrays [slots, KV]: a value is q * scale. */
enum { KV_F32 = 0, KV_F16 = 1, KV_I8 = 2 };
static ALWAYS_INLINE int64_t kv_bytes(const int kind) {
    return kind == KV_F32 ? 4 : kind == KV_F16 ? 2 : 1;
}

/* A KV cache entry as floats (unscaled for int8). */
static ALWAYS_INLINE vf kv_vec(const void *base, int64_t i, const int kind) {
    return kind == KV_F16  ? v_loadh((const uint16_t *)base + i)
           : kind == KV_I8 ? v_i8((const int8_t *)base + i)
                           : v_load((const float *)base + i);
}
static ALWAYS_INLINE float kv_at(const void *base, int64_t i, const int kind) {
    return kind == KV_F16  ? h2f(((const uint16_t *)base)[i])
           : kind == KV_I8 ? (float)((const int8_t *)base)[i]
                           : ((const float *)base)[i];
}

/* One row of an int8 cache: q = round(x * 127 / max|x|), scale = max|x| / 127 (0 and 0
 * for a row of zeros). */
static void quantize_kv_row(const float *x, int64_t n, int8_t *q, float *scale) {
    float top = 0.0f;
    for (int64_t i = 0; i < n; i++) top = fmaxf(top, fabsf(x[i]));
    const float inv = top > 0.0f ? 127.0f / top : 0.0f;
    for (int64_t i = 0; i < n; i++) q[i] = (int8_t)nearbyintf(x[i] * inv);
    *scale = top / 127.0f;
}

/* Scores of query heads [h0, h0 + cnt) against one key row at kp of exactly nv vectors
 * (D = nv VW), the row widened once into registers: out[h * ATT_CHUNK] = ks (q_h . k). */
static ALWAYS_INLINE void key_scores(const float *qs, const void *k_cache, int64_t kp, int64_t h0,
                                     int64_t cnt, const int nv, int64_t D, float ks, float *out,
                                     const int kind) {
    vf key[8];
    for (int j = 0; j < nv; j++) key[j] = kv_vec(k_cache, kp + j * VW, kind);
    for (int64_t h = h0; h < h0 + cnt; h++) {
        const float *qh = qs + h * D;
        vf acc = v_zero();
        for (int j = 0; j < nv; j++) acc = v_fma(v_load(qh + j * VW), key[j], acc);
        out[h * ATT_CHUNK] = v_sum(acc) * ks;
    }
}

/* The weighted sums of values over a chunk's n positions, for cnt query heads of one KV
 * head (value rows at rows[i] + vo): o[c * D + d] = sum_i w[c * ATT_CHUNK + i] v_i[d] for d
 * below blocked (a multiple of four vectors), four vectors per head kept in registers. */
static ALWAYS_INLINE void value_blocks(const float *w, const int cnt, const void *v_cache,
                                       const int64_t *rows, int64_t n, int64_t vo,
                                       int64_t blocked, float *o, int64_t D, const int kind) {
    for (int64_t d0 = 0; d0 < blocked; d0 += 4 * VW) {
        vf a[ATT_VALUE_HEADS][4];
        for (int c = 0; c < cnt; c++)
            for (int j = 0; j < 4; j++) a[c][j] = v_zero();
        for (int64_t i = 0; i < n; i++) {
            const int64_t vp = rows[i] + vo + d0;
            const vf v0 = kv_vec(v_cache, vp, kind), v1 = kv_vec(v_cache, vp + VW, kind);
            const vf v2 = kv_vec(v_cache, vp + 2 * VW, kind), v3 = kv_vec(v_cache, vp + 3 * VW, kind);
            for (int c = 0; c < cnt; c++) {
                const vf wv = v_set1(w[c * ATT_CHUNK + i]);
                a[c][0] = v_fma(wv, v0, a[c][0]);
                a[c][1] = v_fma(wv, v1, a[c][1]);
                a[c][2] = v_fma(wv, v2, a[c][2]);
                a[c][3] = v_fma(wv, v3, a[c][3]);
            }
        }
        for (int c = 0; c < cnt; c++)
            for (int j = 0; j < 4; j++) v_store(o + c * D + d0 + j * VW, a[c][j]);
    }
}

/* Positions [p0, p1) of one sequence (p1 - p0 <= ATT_CHUNK), every head. qs: the
 * sequence's [H, D] queries; sc: [H, ATT_CHUNK] scratch. Out, per head h: mx[h], the
 * largest scaled score; l[h], the sum of exp(score - mx[h]); o[h * D ..], the sum of
 * exp(score - mx[h]) times the values. */
static ALWAYS_INLINE void attend_chunk(const float *qs, const void *k_cache, const void *v_cache,
                                       const float *k_scale, const float *v_scale,
                                       const int64_t *table, int64_t p0, int64_t p1, int64_t H,
                                       int64_t KV, int64_t D, int64_t block_size, float scale,
                                       float *sc, float *mx, float *l, float *o, const int kind) {
    const int64_t group = H / KV, n = p1 - p0, dv = D - D % VW, width = KV * D;
#if VW > 1
    const int64_t row_bytes = width * kv_bytes(kind);
#endif
    /* Each position's offset in the caches, found once (a division by the block size), and
     * its first row of scales (int8). */
    int64_t rows[ATT_CHUNK], srows[ATT_CHUNK];
    for (int64_t p = p0; p < p1; p++) {
        const int64_t slot = table[p / block_size] * block_size + p % block_size;
        rows[p - p0] = slot * width;
        srows[p - p0] = slot * KV;
    }
    for (int64_t i = 0; i < n; i++) {
#if VW > 1
        /* Blocks are scattered: fetch a position's rows (keys, and values for the second
         * pass) a few positions ahead, across block boundaries too. */
        if (i + ATT_PREFETCH < n) {
            const int64_t off = rows[i + ATT_PREFETCH] * kv_bytes(kind);
            for (int64_t b = 0; b < row_bytes; b += 64) {
                _mm_prefetch((const char *)k_cache + off + b, _MM_HINT_T0);
                _mm_prefetch((const char *)v_cache + off + b, _MM_HINT_T0);
            }
            if (kind == KV_I8) {
                _mm_prefetch((const char *)(k_scale + srows[i + ATT_PREFETCH]), _MM_HINT_T0);
                _mm_prefetch((const char *)(v_scale + srows[i + ATT_PREFETCH]), _MM_HINT_T0);
            }
        }
#endif
        /* Per KV head: its key row read (and widened) once for the group's query heads,
         * whose dot products are independent chains. */
        for (int64_t g = 0; g < KV; g++) {
            const int64_t kp = rows[i] + g * D;
            const float ks = kind == KV_I8 ? scale * k_scale[srows[i] + g] : scale;
            if (D == 4 * VW)
                key_scores(qs, k_cache, kp, g * group, group, 4, D, ks, sc + i, kind);
            else if (D == 8 * VW)
                key_scores(qs, k_cache, kp, g * group, group, 8, D, ks, sc + i, kind);
            else
                for (int64_t h = g * group; h < (g + 1) * group; h++) {
                    const float *qh = qs + h * D;
                    vf acc = v_zero();
                    for (int64_t d = 0; d < dv; d += VW)
                        acc = v_fma(v_load(qh + d), kv_vec(k_cache, kp + d, kind), acc);
                    float dot = v_sum(acc);
                    for (int64_t d = dv; d < D; d++) dot += qh[d] * kv_at(k_cache, kp + d, kind);
                    sc[h * ATT_CHUNK + i] = dot * ks;
                }
        }
    }
    for (int64_t h = 0; h < H; h++) {
        const float *row = sc + h * ATT_CHUNK;
        float top = -INFINITY;
        for (int64_t i = 0; i < n; i++) top = row[i] > top ? row[i] : top;
        mx[h] = top;
    }
    for (int64_t h = 0; h < H; h++) l[h] = exp_shifted(sc + h * ATT_CHUNK, n, mx[h]);
    /* int8 values: each weight takes its row's scale (after the sums above). */
    if (kind == KV_I8)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < n; i++) sc[h * ATT_CHUNK + i] *= v_scale[srows[i] + h / group];
    /* Values: blocks of four vectors of D kept in registers over the chunk, for up to
     * ATT_VALUE_HEADS query heads of one KV head at a time (a value row read once for them). */
    const int64_t blocked = D - D % (4 * VW);
    for (int64_t h = 0; h < H;) {
        const int64_t left = (h / group + 1) * group - h; /* heads left in this KV group */
        const int cnt = left < ATT_VALUE_HEADS ? (int)left : ATT_VALUE_HEADS;
        const float *w = sc + h * ATT_CHUNK;
        const int64_t vo = (h / group) * D;
        if (cnt == 3)
            value_blocks(w, 3, v_cache, rows, n, vo, blocked, o + h * D, D, kind);
        else if (cnt == 2)
            value_blocks(w, 2, v_cache, rows, n, vo, blocked, o + h * D, D, kind);
        else
            value_blocks(w, 1, v_cache, rows, n, vo, blocked, o + h * D, D, kind);
        for (int64_t c = h; c < h + cnt; c++) {
            const float *wc = sc + c * ATT_CHUNK;
            float *oh = o + c * D;
            int64_t d0 = blocked;
            for (; d0 < dv; d0 += VW) {
                vf a = v_zero();
                for (int64_t i = 0; i < n; i++)
                    a = v_fma(v_set1(wc[i]), kv_vec(v_cache, rows[i] + vo + d0, kind), a);
                v_store(oh + d0, a);
            }
            for (; d0 < D; d0++) {
                float a = 0.0f;
                for (int64_t i = 0; i < n; i++)
                    a += wc[i] * kv_at(v_cache, rows[i] + vo + d0, kind);
                oh[d0] = a;
            }
        }
        h += cnt;
    }
}

/* The first position a query at position ctx - 1 sees: ctx - window with a sliding window
 * (window > 0), else 0. */
static inline int64_t window_start(int64_t ctx, int64_t window) {
    return window > 0 && ctx > window ? ctx - window : 0;
}

/* kv_kind: the caches' format (KV_F32, KV_F16, KV_I8; the scales only for KV_I8, else
 * NULL). window: a sliding window (the last window positions seen, the query's own
 * included), or 0 for the whole context; the chunks start at the window's first position,
 * so a position's result depends on its own context alone. Returns 0, or -1 when out of
 * memory. */
int furnace_paged_decode_attention(const float *q, const void *k_cache, const void *v_cache,
                                   const float *k_scale, const float *v_scale,
                                   const int64_t *tables, int64_t max_blocks, const int64_t *ctx,
                                   int64_t S, int64_t H, int64_t KV, int64_t D,
                                   int64_t block_size, float scale, int64_t window, float *out,
                                   int kv_kind) {
    /* first[s]: sequence s's first task; the tasks of all sequences, numbered in order. */
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (S + 1));
    if (!first) return -1;
    first[0] = 0;
    for (int64_t s = 0; s < S; s++)
        first[s + 1] =
            first[s] + (ctx[s] - window_start(ctx[s], window) + ATT_CHUNK - 1) / ATT_CHUNK;
    const int64_t tasks = first[S], per_task = H * (D + 2);
    /* Per task: mx [H], l [H], o [H, D]. */
    float *part = (float *)malloc(sizeof(float) * (tasks > 0 ? tasks : 1) * per_task);
    if (!part) {
        free(first);
        return -1;
    }
#pragma omp parallel if (tasks > 1)
    {
        float sc[H * ATT_CHUNK]; /* a few KiB: H heads' scores for one chunk */
        int64_t s = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            while (first[s + 1] <= t) s++;
            while (first[s] > t) s--;
            const int64_t p0 = window_start(ctx[s], window) + (t - first[s]) * ATT_CHUNK;
            const int64_t p1 = p0 + ATT_CHUNK < ctx[s] ? p0 + ATT_CHUNK : ctx[s];
            float *mx = part + t * per_task, *l = mx + H, *o = l + H;
            const int64_t *table = tables + s * max_blocks;
            if (kv_kind == KV_F16)
                attend_chunk(q + s * H * D, k_cache, v_cache, NULL, NULL, table, p0, p1, H, KV,
                             D, block_size, scale, sc, mx, l, o, KV_F16);
            else if (kv_kind == KV_I8)
                attend_chunk(q + s * H * D, k_cache, v_cache, k_scale, v_scale, table, p0, p1, H,
                             KV, D, block_size, scale, sc, mx, l, o, KV_I8);
            else
                attend_chunk(q + s * H * D, k_cache, v_cache, NULL, NULL, table, p0, p1, H, KV,
                             D, block_size, scale, sc, mx, l, o, KV_F32);
        }
        /* Merge each sequence's chunks, in order. */
#pragma omp for schedule(static)
        for (int64_t sh = 0; sh < S * H; sh++) {
            const int64_t seq = sh / H, h = sh % H;
            float *dst = out + sh * D;
            float top = -INFINITY;
            for (int64_t t = first[seq]; t < first[seq + 1]; t++) {
                const float m = part[t * per_task + h];
                top = m > top ? m : top;
            }
            float total = 0.0f;
            memset(dst, 0, sizeof(float) * D);
            for (int64_t t = first[seq]; t < first[seq + 1]; t++) {
                const float *mx = part + t * per_task;
                const float f = expf(mx[h] - top);
                total += f * mx[H + h];
                const float *o = mx + 2 * H + h * D;
                for (int64_t d = 0; d < D; d++) dst[d] += f * o[d];
            }
            const float inv = total > 0.0f ? 1.0f / total : 0.0f;
            for (int64_t d = 0; d < D; d++) dst[d] *= inv;
        }
    }
    free(part);
    free(first);
    return 0;
}

/* ---- Elementwise pieces of a decoder layer, fused so a step makes few calls. ---- */

/* out[m] = x[m] * w / sqrt(mean(x[m]^2) + eps); with h, first x[m] += h[m] (the residual
 * add, in place). x, h, out: [M, D]; w: [D]. */
void furnace_add_rmsnorm(float *x, const float *h, int64_t M, int64_t D, const float *w,
                         float eps, float *out) {
    const int64_t dv = D - D % VW;
#pragma omp parallel for schedule(static) if (M * D >= PARALLEL_ELEMENTS)
    for (int64_t m = 0; m < M; m++) {
        float *xr = x + m * D;
        if (h) {
            const float *hr = h + m * D;
            for (int64_t d = 0; d < D; d++) xr[d] += hr[d];
        }
        vf acc = v_zero();
        for (int64_t d = 0; d < dv; d += VW) {
            vf v = v_load(xr + d);
            acc = v_fma(v, v, acc);
        }
        float ss = v_sum(acc);
        for (int64_t d = dv; d < D; d++) ss += xr[d] * xr[d];
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
        float *o = out + m * D;
        for (int64_t d = 0; d < D; d++) o[d] = (xr[d] * r) * w[d];
    }
}

/* Rotary embedding of queries and keys, and the step's keys and values stored in the cache.
 * qkv: [T, (H + 2 KV) D] (the fused projection); cos, sin: [T, D], where sin carries the
 * sign of rotate_half (negative first half); slots: [T] cache slot per token.
 * q_out: [T, H, D] and k_out: [T, KV, D] rotated; caches: [slots, KV, D] in kv_kind's format
 * (float16 rounded to nearest even; int8 with its scales [slots, KV], see quantize_kv_row). */
void furnace_rope_store(const float *qkv, int64_t T, int64_t H, int64_t KV, int64_t D,
                        const float *cos_t, const float *sin_t, const int64_t *slots,
                        void *k_cache, void *v_cache, float *k_scale, float *v_scale,
                        float *q_out, float *k_out, int kv_kind) {
    const int64_t width = (H + 2 * KV) * D, half = D / 2;
#pragma omp parallel for schedule(static) if (T * width >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        const float *row = qkv + t * width, *c = cos_t + t * D, *s = sin_t + t * D;
        for (int64_t head = 0; head < H + KV; head++) {
            const float *src = row + head * D;
            float *dst = head < H ? q_out + (t * H + head) * D : k_out + (t * KV + head - H) * D;
            for (int64_t i = 0; i < half; i++) dst[i] = src[i] * c[i] + src[i + half] * s[i];
            for (int64_t i = half; i < D; i++) dst[i] = src[i] * c[i] + src[i - half] * s[i];
        }
        const float *k = k_out + t * KV * D, *v = row + (H + KV) * D;
        const int64_t at = slots[t] * KV * D;
        if (kv_kind == KV_F16) {
            uint16_t *kc = (uint16_t *)k_cache + at, *vc = (uint16_t *)v_cache + at;
            for (int64_t i = 0; i < KV * D; i++) kc[i] = f2h(k[i]), vc[i] = f2h(v[i]);
        } else if (kv_kind == KV_I8) {
            int8_t *kc = (int8_t *)k_cache + at, *vc = (int8_t *)v_cache + at;
            for (int64_t h = 0; h < KV; h++) {
                quantize_kv_row(k + h * D, D, kc + h * D, k_scale + slots[t] * KV + h);
                quantize_kv_row(v + h * D, D, vc + h * D, v_scale + slots[t] * KV + h);
            }
        } else {
            memcpy((float *)k_cache + at, k, sizeof(float) * KV * D);
            memcpy((float *)v_cache + at, v, sizeof(float) * KV * D);
        }
    }
}

/* out[m] = silu(gu[m, :I]) * gu[m, I:]; gu: [M, 2I], out: [M, I]. */
void furnace_silu_mul(const float *gu, int64_t M, int64_t I, float *out) {
    const int64_t iv = I - I % VW;
#pragma omp parallel for schedule(static) if (M * I >= PARALLEL_ELEMENTS)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gu + m * 2 * I, *u = g + I;
        float *o = out + m * I;
        for (int64_t i = 0; i < iv; i += VW) {
            const vf gv = v_load(g + i);
            const vf sig = v_add(v_set1(1.0f), v_exp(v_mul(gv, v_set1(-1.0f))));
            v_store(o + i, v_mul(v_div(gv, sig), v_load(u + i)));
        }
        for (int64_t i = iv; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* out[m] = gelu_tanh(gu[m, :I]) * gu[m, I:] (Gemma's gate): gelu_tanh(g) = g / 2 (1 +
 * tanh(z)), z = sqrt(2 / pi) (g + 0.044715 g^3), with tanh(z) = 1 - 2 / (exp(2 z) + 1). */
void furnace_gelu_mul(const float *gu, int64_t M, int64_t I, float *out) {
    const int64_t iv = I - I % VW;
    const float c = 0.7978845608028654f, a = 0.044715f;
#pragma omp parallel for schedule(static) if (M * I >= PARALLEL_ELEMENTS)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gu + m * 2 * I, *u = g + I;
        float *o = out + m * I;
        for (int64_t i = 0; i < iv; i += VW) {
            const vf gv = v_load(g + i);
            const vf z = v_mul(v_set1(c), v_fma(v_mul(v_set1(a), gv), v_mul(gv, gv), gv));
            const vf e = v_add(v_exp(v_add(z, z)), v_set1(1.0f));
            const vf th = v_add(v_set1(1.0f), v_div(v_set1(-2.0f), e));
            const vf gelu = v_mul(v_mul(v_set1(0.5f), gv), v_add(v_set1(1.0f), th));
            v_store(o + i, v_mul(gelu, v_load(u + i)));
        }
        for (int64_t i = iv; i < I; i++) {
            const float z = c * (g[i] + a * g[i] * g[i] * g[i]);
            o[i] = 0.5f * g[i] * (1.0f + tanhf(z)) * u[i];
        }
    }
}

/* RMSNorm of each query head with wq and each key head with wk ([D] each), in place in the
 * fused projection qkv [T, (H + 2 KV) D] (Gemma 3's and Qwen3's q/k norms); values untouched. */
void furnace_head_rmsnorm(float *qkv, int64_t T, int64_t H, int64_t KV, int64_t D,
                          const float *wq, const float *wk, float eps) {
    const int64_t width = (H + 2 * KV) * D, dv = D - D % VW;
#pragma omp parallel for schedule(static) if (T * width >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < T; t++)
        for (int64_t head = 0; head < H + KV; head++) {
            float *x = qkv + t * width + head * D;
            const float *w = head < H ? wq : wk;
            vf acc = v_zero();
            for (int64_t d = 0; d < dv; d += VW) {
                const vf v = v_load(x + d);
                acc = v_fma(v, v, acc);
            }
            float ss = v_sum(acc);
            for (int64_t d = dv; d < D; d++) ss += x[d] * x[d];
            const float r = 1.0f / sqrtf(ss / (float)D + eps);
            for (int64_t d = 0; d < D; d++) x[d] = (x[d] * r) * w[d];
        }
}

/* out[m] = the first index of the largest value of x[m] (x: [M, N]), as torch.argmax:
 * a NaN counts as the largest (the first NaN wins). One vector pass for the maximum (and a
 * sum of x * 0, NaN when a NaN or an infinity is there: then an exact scalar pass), then a
 * scan to its first occurrence. */
void furnace_argmax_rows(const float *x, int64_t M, int64_t N, int64_t *out) {
    const int64_t nv = N - N % VW;
#pragma omp parallel for schedule(static) if (M * N >= 16 * PARALLEL_ELEMENTS)
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * N;
        vf top = v_set1(-INFINITY), odd = v_zero();
        for (int64_t i = 0; i < nv; i += VW) {
            const vf v = v_load(row + i);
            top = v_max(top, v);
            odd = v_fma(v, v_zero(), odd);
        }
        float best = -INFINITY, special = v_sum(odd);
        float lanes[VW];
        v_store(lanes, top);
        for (int i = 0; i < VW; i++) best = lanes[i] > best ? lanes[i] : best;
        for (int64_t i = nv; i < N; i++) {
            best = row[i] > best ? row[i] : best;
            special += row[i] * 0.0f;
        }
        int64_t at = 0;
        if (special != special) { /* a NaN or an infinity: torch's rule, element by element */
            float b = row[0];
            for (int64_t i = 0; i < N && b == b; i++)
                if (row[i] > b || row[i] != row[i]) b = row[i], at = i;
        } else {
            while (at < N - 1 && row[at] != best) at++;
        }
        out[m] = at;
    }
}

/* ---- A whole decode step through every layer in one call. ---- */

/* Per layer, LAYER_PTRS addresses, in this order. Each linear layer has four: its format
 * (a LINEAR_*, a number, not an address), its packed weight, its scales (int8; 0 for the
 * block formats, whose scales are packed with the weight) and its bias (or 0).
 * Then the two norms' weights, the key and value caches, and their scales (int8 caches; 0
 * for float ones). */
enum {
    P_QKV, P_O = P_QKV + 4, P_GU = P_O + 4, P_DOWN = P_GU + 4,
    P_IN_NORM = P_DOWN + 4, P_POST_NORM, P_K_CACHE, P_V_CACHE, P_K_SCALE, P_V_SCALE,
    LAYER_PTRS
};
enum {
    LINEAR_W8 = 0, LINEAR_Q4 = 1, LINEAR_Q8 = 2,
    /* GGUF's blocks (furnace_kq_pack): */
    LINEAR_Q4_0 = 3, LINEAR_Q5_0 = 4, LINEAR_Q4_K = 5, LINEAR_Q5_K = 6, LINEAR_Q6_K = 7,
    /* Several of the above side by side (a fused projection whose parts a file stores in
     * different types): entry 1 points to [count, then per part its four entries and its
     * output width]. */
    LINEAR_CONCAT = 8
};

int furnace_layer_ptrs(void) { return LAYER_PTRS; }

/* Forward declaration: concat_linear and table_linear call each other. */
static int table_linear(const int64_t *p, int i, const float *x, int64_t M, int64_t K,
                        int64_t N, float *y, float *qs);

#define PTR(type, i) ((type)(intptr_t)p[i])

/* LINEAR_CONCAT: each part into a buffer of its own width, then into its columns of y.
 * Each part computes its outputs as it would alone (the same kernel, the same order). */
static int concat_linear(const int64_t *parts, const float *x, int64_t M, int64_t K, int64_t N,
                         float *y, float *qs) {
    const int64_t count = parts[0];
    int64_t widest = 0;
    for (int64_t c = 0; c < count; c++) widest = parts[5 + 5 * c] > widest ? parts[5 + 5 * c] : widest;
    float *part = (float *)malloc(sizeof(float) * (M * widest > 0 ? M * widest : 1));
    if (!part) return -1;
    int64_t at = 0;
    for (int64_t c = 0; c < count; c++) {
        const int64_t *entry = parts + 1 + 5 * c, n = entry[4];
        if (table_linear(entry, 0, x, M, K, n, part, qs)) {
            free(part);
            return -1;
        }
        for (int64_t m = 0; m < M; m++) memcpy(y + m * N + at, part + m * n, sizeof(float) * n);
        at += n;
    }
    free(part);
    return 0;
}

/* The linear layer whose four table entries start at p[i]: y = x W^T (+ b). qs: scratch
 * for quantized activations (the block formats), M * K floats (more than they need).
 * Returns 0, or -1 when out of memory. */
static int table_linear(const int64_t *p, int i, const float *x, int64_t M, int64_t K,
                        int64_t N, float *y, float *qs) {
    static const int ggml_type[] = {[LINEAR_Q4_0] = GG_Q4_0, [LINEAR_Q5_0] = GG_Q5_0,
                                    [LINEAR_Q4_K] = GG_Q4_K, [LINEAR_Q5_K] = GG_Q5_K,
                                    [LINEAR_Q6_K] = GG_Q6_K};
    const uint8_t *w = PTR(const uint8_t *, i + 1);
    const float *bias = PTR(const float *, i + 3);
    if (p[i] == LINEAR_CONCAT) return concat_linear(PTR(const int64_t *, i + 1), x, M, K, N, y, qs);
    if (p[i] == LINEAR_Q4 || p[i] == LINEAR_Q8)
        furnace_qx_linear(p[i] == LINEAR_Q4 ? 4 : 8, x, M, K, w, bias, N, y, qs);
    else if (p[i] >= LINEAR_Q4_0 && p[i] <= LINEAR_Q6_K)
        return furnace_kq_linear(ggml_type[p[i]], x, M, K, w, bias, N, y, qs);
    else
        furnace_w8_linear(x, M, K, (const int8_t *)w, PTR(const float *, i + 2), bias, N, y);
    return 0;
}

/* Every layer of a step whose S sequences each bring one token (no prefill), with the
 * linear layers above (any LINEAR_*): the same arithmetic as the per-op path, minus the Python and
 * dispatch cost between ops. x: [S, hidden] embeddings in, the residual stream after the
 * last layer out (before the final norm). cos/sin/slots/tables/ctx/kv_kind as for the
 * per-op kernels; scratch: at least S * (2 hidden + (H + 2 KV) D + (H + KV) D + H D + 3 I
 * + max(hidden, H D, I)) floats. */
int furnace_decode_layers(int64_t L, const int64_t *ptrs, int64_t S, int64_t hidden,
                           int64_t H, int64_t KV, int64_t D, int64_t I, float eps, float *x,
                           const float *cos_t, const float *sin_t, const int64_t *slots,
                           const int64_t *tables, int64_t max_blocks, const int64_t *ctx,
                           int64_t block_size, float scale, int kv_kind, float *scratch) {
    const int64_t width = (H + 2 * KV) * D;
    float *normed = scratch;
    float *h = normed + S * hidden;
    float *qkv = h + S * hidden;
    float *q = qkv + S * width;
    float *k = q + S * H * D;
    float *att = k + S * KV * D;
    float *gu = att + S * H * D;
    float *act = gu + S * 2 * I;
    float *qs = act + S * I;
    for (int64_t l = 0; l < L; l++) {
        const int64_t *p = ptrs + l * LAYER_PTRS;
        furnace_add_rmsnorm(x, l == 0 ? NULL : h, S, hidden, PTR(const float *, P_IN_NORM), eps,
                            normed);
        if (table_linear(p, P_QKV, normed, S, hidden, width, qkv, qs)) return -1;
        void *kc = PTR(void *, P_K_CACHE), *vc = PTR(void *, P_V_CACHE);
        float *ks = PTR(float *, P_K_SCALE), *vs = PTR(float *, P_V_SCALE);
        furnace_rope_store(qkv, S, H, KV, D, cos_t, sin_t, slots, kc, vc, ks, vs, q, k, kv_kind);
        if (furnace_paged_decode_attention(q, kc, vc, ks, vs, tables, max_blocks, ctx, S, H, KV,
                                           D, block_size, scale, 0, att, kv_kind))
            return -1;
        if (table_linear(p, P_O, att, S, H * D, hidden, h, qs)) return -1;
        furnace_add_rmsnorm(x, h, S, hidden, PTR(const float *, P_POST_NORM), eps, normed);
        if (table_linear(p, P_GU, normed, S, hidden, 2 * I, gu, qs)) return -1;
        furnace_silu_mul(gu, S, I, act);
        if (table_linear(p, P_DOWN, act, S, I, hidden, h, qs)) return -1;
    }
    for (int64_t i = 0; i < S * hidden; i++) x[i] += h[i];
    return 0;
}
