/* Repacking a GGUF tensor's bytes (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) into the
 * panels the kernels read (the layouts: "Panel layouts" in cpu_kquants.c). Included by
 * cpu_kernels.c after cpu_kquants.c, whose type numbers and layout helpers it uses. Runs
 * once per tensor at load; the values are the file's exactly (codes unpacked to a byte
 * each, scales and minimums widened to a byte, float16 factors copied). */

/* One ggml block, unpacked: unsigned codes (Q8_0's as their bytes), per-sub-block scales
 * and minimums, and the float16 factors as stored. */
typedef struct {
    uint8_t q[QK];
    uint8_t sc[16], mn[8];
    uint16_t d, dmin;
} kq_unpacked;

static int64_t kq_type_bytes(int type) {
    switch (type) {
    case GG_Q4_0: return 18;
    case GG_Q4_1: return 20;
    case GG_Q5_0: return 22;
    case GG_Q8_0: return 34;
    case GG_Q4_K: return 144;
    case GG_Q5_K: return 176;
    case GG_Q6_K: return 210;
    default: return 0;
    }
}

static uint16_t kq_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* Q4_K's and Q5_K's twelve bytes of 6-bit scales and minimums. */
static void kq_scales_6bit(const uint8_t *s, kq_unpacked *o) {
    for (int j = 0; j < 4; j++) {
        o->sc[j] = s[j] & 63;
        o->mn[j] = s[j + 4] & 63;
        o->sc[j + 4] = (uint8_t)((s[j + 8] & 15) | ((s[j] >> 6) << 4));
        o->mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

static void kq_unpack(int type, const uint8_t *b, kq_unpacked *o) {
    switch (type) {
    case GG_Q4_0: case GG_Q4_1: {
        const uint8_t *qs = b + (type == GG_Q4_0 ? 2 : 4);
        o->d = kq_u16(b);
        o->dmin = type == GG_Q4_1 ? kq_u16(b + 2) : 0;
        for (int l = 0; l < 16; l++) o->q[l] = qs[l] & 15, o->q[l + 16] = qs[l] >> 4;
        break;
    }
    case GG_Q5_0: {
        const uint32_t qh = (uint32_t)b[2] | ((uint32_t)b[3] << 8) | ((uint32_t)b[4] << 16) | ((uint32_t)b[5] << 24);
        o->d = kq_u16(b);
        for (int l = 0; l < 16; l++) {
            o->q[l] = (uint8_t)((b[6 + l] & 15) | (((qh >> l) & 1) << 4));
            o->q[l + 16] = (uint8_t)((b[6 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4));
        }
        break;
    }
    case GG_Q8_0:
        o->d = kq_u16(b);
        memcpy(o->q, b + 2, 32);
        break;
    case GG_Q4_K: case GG_Q5_K: {
        const int five = type == GG_Q5_K;
        const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
        o->d = kq_u16(b);
        o->dmin = kq_u16(b + 2);
        kq_scales_6bit(b + 4, o);
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                const uint8_t byte = qs[32 * c + l];
                o->q[64 * c + l] = (uint8_t)((byte & 15) | (five ? ((qh[l] >> (2 * c)) & 1) << 4 : 0));
                o->q[64 * c + 32 + l] = (uint8_t)((byte >> 4) | (five ? ((qh[l] >> (2 * c + 1)) & 1) << 4 : 0));
            }
        break;
    }
    default: { /* GG_Q6_K */
        const uint8_t *ql = b, *qh = b + 128;
        for (int e = 0; e < QK; e++) {
            const int half = e / 128, r = e % 128;
            const int low = (ql[half * 64 + r % 64] >> (4 * (r / 64))) & 15;
            const int high = (qh[half * 32 + r % 32] >> (2 * (r / 32))) & 3;
            o->q[e] = (uint8_t)(low | (high << 4));
        }
        memcpy(o->sc, b + 192, 16);
        o->d = kq_u16(b + 208);
        break;
    }
    }
}

/* Bytes per panel and block of the packed layout: the types above, Q4_1 and Q8_0. */
static int64_t kq_packed_bytes(int type) {
    switch (type) {
    case GG_Q4_1: return Q4_BLOCK;
    case GG_Q8_0: return Q8_BLOCK;
    case GG_Q4_0: return kq_block_bytes(GG_Q4_0);
    case GG_Q5_0: return kq_block_bytes(GG_Q5_0);
    case GG_Q4_K: return kq_block_bytes(GG_Q4_K);
    case GG_Q5_K: return kq_block_bytes(GG_Q5_K);
    case GG_Q6_K: return kq_block_bytes(GG_Q6_K);
    default: return 0;
    }
}

/* Bytes of the packed weight for N outputs of K inputs (0: no such type, or K not a whole
 * number of its blocks). */
int64_t furnace_kq_packed_size(int type, int64_t N, int64_t K) {
    const int64_t bk = type == GG_Q4_K || type == GG_Q5_K || type == GG_Q6_K ? QK : Q4_GROUP;
    if (kq_packed_bytes(type) == 0 || K <= 0 || K % bk) return 0;
    return (N + PW - 1) / PW * (K / bk) * kq_packed_bytes(type);
}

static void kq_put_f16(uint8_t *dst, int64_t i, uint16_t h) {
    dst[2 * i] = (uint8_t)h;
    dst[2 * i + 1] = (uint8_t)(h >> 8);
}

/* Output i of a panel's block from its unpacked ggml block. */
static void kq_place(int type, const kq_unpacked *u, int64_t i, uint8_t *dst) {
    const int64_t v = i / VW, lane = i % VW;
    const int bk = type == GG_Q4_K || type == GG_Q5_K || type == GG_Q6_K ? QK : Q4_GROUP;
    for (int k = 0; k < bk; k++) {
        const int j = k / 4, t = k % 4, q = u->q[k];
        const int64_t at = 4 * lane + t;
        if (type == GG_Q8_0) {
            dst[j * 4 * PW + v * 4 * VW + at] = (uint8_t)q;
            continue;
        }
        const int extra = type == GG_Q5_0 || type == GG_Q5_K ? 1 : type == GG_Q6_K ? 2 : 0;
        uint8_t *nib = dst + j * 2 * PW, *plane = NULL;
        int shift = 0;
        if (extra == 1) {
            nib = dst + (j / 2) * 5 * PW + (j % 2) * 2 * PW;
            plane = dst + (j / 2) * 5 * PW + 4 * PW;
            shift = 4 * (j % 2) + (int)v;
        } else if (extra == 2) {
            nib = dst + j * 3 * PW;
            plane = nib + 2 * PW;
            shift = 2 * (int)v;
        }
        nib[(v % (PV / 2)) * 4 * VW + at] |= (uint8_t)((q & 15) << (v >= PV / 2 ? 4 : 0));
        if (plane) plane[at] |= (uint8_t)((q >> 4) << shift);
    }
    switch (type) {
    case GG_Q4_1: /* d[PW], m[PW] after the codes */
        kq_put_f16(dst + Q4_GROUP / 4 * Q4_QUAD_BYTES, i, u->d);
        kq_put_f16(dst + Q4_GROUP / 4 * Q4_QUAD_BYTES + 2 * PW, i, u->dmin);
        break;
    case GG_Q8_0:
        kq_put_f16(dst + Q4_GROUP / 4 * Q8_QUAD_BYTES, i, u->d);
        break;
    case GG_Q4_0: case GG_Q5_0:
        kq_put_f16(dst + kq_code_bytes(type), i, u->d);
        break;
    case GG_Q4_K: case GG_Q5_K: {
        uint8_t *sc = dst + kq_code_bytes(type);
        for (int j = 0; j < 8; j++) sc[j * PW + i] = u->sc[j], sc[(8 + j) * PW + i] = u->mn[j];
        kq_put_f16(sc + 16 * PW, i, u->d);
        kq_put_f16(sc + 18 * PW, i, u->dmin);
        break;
    }
    default: { /* GG_Q6_K */
        uint8_t *sc = dst + kq_code_bytes(type);
        for (int j = 0; j < 16; j++) sc[j * PW + i] = u->sc[j];
        kq_put_f16(sc + 16 * PW, i, u->d);
        break;
    }
    }
}

/* src: a GGUF tensor's bytes, N rows of K / block weights in ggml's blocks of `type`; dst:
 * furnace_kq_packed_size bytes. Outputs past N (to a whole panel) are zero. Returns 0, or
 * -1 for a type or K the panels do not take. */
int furnace_kq_pack(int type, const uint8_t *src, int64_t N, int64_t K, uint8_t *dst) {
    const int64_t size = furnace_kq_packed_size(type, N, K);
    if (size == 0) return -1;
    const int64_t bk = type == GG_Q4_K || type == GG_Q5_K || type == GG_Q6_K ? QK : Q4_GROUP;
    const int64_t blocks = K / bk, panels = (N + PW - 1) / PW, bytes = kq_packed_bytes(type);
    const int64_t row_bytes = blocks * kq_type_bytes(type);
    memset(dst, 0, (size_t)size);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        kq_unpacked u;
        for (int64_t g = 0; g < blocks; g++) {
            uint8_t *out = dst + (p * blocks + g) * bytes;
            for (int64_t i = 0; i < PW && p * PW + i < N; i++) {
                memset(&u, 0, sizeof u);
                kq_unpack(type, src + (p * PW + i) * row_bytes + g * kq_type_bytes(type), &u);
                kq_place(type, &u, i, out);
            }
        }
    }
    return 0;
}
