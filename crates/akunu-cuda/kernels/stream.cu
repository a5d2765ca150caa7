// The streaming persistent decode kernel: a greedy chain of a llama model
// with F16 matrices too large for persist.cu (which keeps a layer's rows in
// shared memory) as one cooperative launch. The design is the one
// bench/cuda/stream_probe.cu measured (bench/RESULTS.md, session 25; docs/
// ARCHITECTURE.md, "the streaming persistent kernel"):
//
//   - one block an SM; a producer warp copies the block's share of every
//     product, in the order the token uses them (each layer's q|k|v, o,
//     gate|up and down rows, then the logits rows), through SD_NST stages
//     of SD_STB bytes with cp.async.bulk, and waits only for a stage to be
//     freed (or for the chain to end);
//   - SD_CW consumer warps stage each product's input from tagged words
//     (the value in the low half, the number of the phase that wrote it in
//     the high half), reloading every stale word at once, then take the
//     stages as they land: warp w always takes the same columns of every
//     row, its piece of the input in registers for the whole product; a
//     row's SD_CW partials are added in a fixed order;
//   - attention on one block per (query head, split of the positions), the
//     splits merged where the o product stages its input.
//
// stream.rs compiles one module per shape (SD_* macros) and checks what the
// kernel assumes: plain llama layers, F16 matrices and embedding (or, with
// SD_Q4, Q4_0 ones in the backend's repacked layout), heads of SD_HD, every
// product's rows at least one unit a block.
//
// The Q4_0 form (SD_Q4): a stage holds a tile of 16 rows of one matrix over
// a slice of their columns (two tensor-map copies: the quants, the scales),
// and the consumers multiply on the tensor cores as
// gemv_tc.cu's decode gemv does: a lane turns its nibbles into f16 pairs,
// the input is staged as the f16 hi/lo halves of x in gemv_tc.cu's B image,
// and each group of four blocks takes 8 m16n8k16 products. Converting and
// multiplying in f32 instead (session 25's probe) bound the token on the
// consumers' arithmetic at 45% of the H200's floor. stream.rs gives this
// form 16 consumer warps where the shape allows (8 otherwise, and in the
// F16 form): with two a scheduler, the nibble conversions and products of
// a stage ran as short dependent chains with little to hide their latency.

#ifndef SD_CW
#define SD_CW 8
#endif
#ifndef SD_NST
#define SD_NST 4
#endif
#ifndef SD_STB
#define SD_STB 32768
#endif
#ifndef SD_ATT_S
#define SD_ATT_S 4
#endif
#ifndef SD_Q4
#define SD_Q4 0
#endif
// The Q4_0 form's output matrix (SD_OUT_Q6) or embedding (SD_EMB_Q6) in
// the Q6 form (repack.rs q6k_stream_form: a Q6_K matrix, which llama.cpp's
// quantizer writes for a Q4_0 model's logits, as the nibbles in Q4_0's
// order, then the top two bits, each 16 elements' int8 scale and each 256
// elements' f32 one). A logits tile's slice takes two stages: the nibbles
// (copied as Q4_0's quants), then the rest; the consumers OR the top bits
// onto the nibbles and take the two 16-element halves of a block, which
// the tensor-core products keep apart, each with its scale.
#ifndef SD_OUT_Q6
#define SD_OUT_Q6 0
#endif
#ifndef SD_EMB_Q6
#define SD_EMB_Q6 0
#endif
static_assert(SD_Q4 || !(SD_OUT_Q6 || SD_EMB_Q6), "the Q6 form is the Q4_0 form's");
// SD_STAGED (the Q4_0 form; stream.rs sets it where the device had room
// for the copy): the producer copies each stage as one linear bulk copy
// from stage images that stream.rs lays out once (k_stage_form), block by
// block in the order the producer takes them, instead of two tensor-map
// boxes of the row-major matrix; and inside a stage the quants and scales
// lie in the order the consumers' lanes read them, so that a warp's loads
// meet no bank twice. A Q6 form's logits keep the tensor maps.
// Measured (bench/RESULTS.md, session 49, H200, 8B Q4_0): the stream
// alone (SD_DIAG=3) 888 -> 975 tok/s (the boxes' 1 KB row pieces and
// 128-byte scale rows left HBM a fifth idle); the kernel 680 -> 701 tok/s
// greedy, 717 with two copies in flight (stream.rs INFLIGHT_CAP).
#ifndef SD_STAGED
#define SD_STAGED 0
#endif
static_assert(SD_Q4 || !SD_STAGED, "stage images are the Q4_0 form's");
// SD_B_FEED (default): only the lanes whose B fragment is not zero load it
// (sd_consume); the others take zeros in registers. Loading zeros from
// shared memory, every LDS.128 of B met the feeders' banks twice: 8B Q4_0
// +2.5% with the tensor-map boxes, +1.9% greedy with stage images
// (session 49). -DSD_B_FEED=0 for A/B runs.
#ifndef SD_B_FEED
#define SD_B_FEED 1
#endif
// Measurement switches (wrong tokens; bench/RESULTS.md), bits of SD_DIAG:
// 1, the Q4_0 form's consumers take each stage without computing; 2, no
// wait for a tagged word (sd_poll takes what one load finds), so that the
// phases do not wait for each other and the stream alone paces a token;
// 4, clock counts (right tokens): each block prints, at the end of a
// launch, the cycles its producer waited for a free stage, those its first
// consumer thread waited for a full stage, for tagged words (the other
// blocks) and in all, those from a full stage to its arrival (the warp's
// work on it) and that thread's cycles in each section of a token
// (SD_MARK; scripts/gpu.sh stream-clock sums them); 8, the Q4_0 form's
// consumers load each stage but do not multiply; 16, the Q4_0 form's
// producer copies every tile from its matrix's first (L2, not HBM); 32,
// the Q6 form's consumers drop the top bits (a negative control for the
// GPU tests); 64, block times (right tokens; SD_BT below).
#ifndef SD_DIAG
#define SD_DIAG 0
#endif
// The Q4_0 consumers' loop over a tile's slices kept rolled (9% less code).
// Measured (bench/RESULTS.md, session 30): the greedy module 2.4% slower
// rolled, the Q4_0 sampled one 2.7% faster (sampled 587 against greedy
// 596, where unrolled it ran 572); so only the Q4_0 sampled module rolls it.
#ifndef SD_K_ROLLED
#define SD_K_ROLLED (SD_SAMPLED && SD_Q4)
#endif
#ifndef SD_OPAQUE_TAIL
#define SD_OPAQUE_TAIL (!(SD_SAMPLED && SD_Q4))  // k_stream_decode: what follows the barriers
#endif
// Bit 64, block times (right tokens): every block's thread 0 notes
// %globaltimer at the start of layer SD_BT_LAYER of chain token SD_BT_TOKEN
// and at each of that layer's section ends (SD_MARK 0-12), and prints them
// at the launch's end (scripts/gpu.sh stream-blocks): how far apart the
// blocks reach each phase boundary.
#if SD_DIAG & 64
#ifndef SD_BT_LAYER
#define SD_BT_LAYER 5
#endif
#ifndef SD_BT_TOKEN
#define SD_BT_TOKEN 2
#endif
__shared__ unsigned long long sd_bt[14];  // 0-12: SD_MARK's; 13: the layer's start
__shared__ u32 sd_bt_on;
#define SD_BT(i) \
    if (threadIdx.x == 0 && sd_bt_on && (i) < 13) sd_bt[i] = globaltimer_ns();
#else
#define SD_BT(i)
#endif
#if SD_DIAG & 4
__shared__ unsigned long long sd_clk[3];  // consumer: full stages, tagged words, stage work
__shared__ unsigned long long sd_pclk;    // producer: free stages
// Consumer: each section of a token (SD_MARK): 0-14 in the token's order,
// 15 + M the loop of product M (its section then holds only the final
// barrier's wait for the other warps).
__shared__ unsigned long long sd_sec[20];
__shared__ long long sd_last;
#define SD_MARK(i)                                         \
    SD_BT(i)                                               \
    if (threadIdx.x == 0) {                                \
        const long long now_ = clock64();                  \
        sd_sec[i] += (unsigned long long)(now_ - sd_last); \
        sd_last = now_;                                    \
    }
#define SD_CLK_BEGIN(slot) const long long sd_t0_##slot = threadIdx.x == 0 ? clock64() : 0
#define SD_CLK_END(slot) \
    if (threadIdx.x == 0) sd_clk[slot] += (unsigned long long)(clock64() - sd_t0_##slot)
#else
#define SD_CLK_BEGIN(slot)
#define SD_CLK_END(slot)
#define SD_MARK(i) SD_BT(i)
#endif
#define SD_THREADS ((SD_CW + 1) * 32)
#define SD_CT (SD_CW * 32)
// A sampled table's module (stream.rs): the in-kernel sampler
// (chain_sampler.cuh) in the logits phase; a greedy one compiles it out.
#ifndef SD_SAMPLED
#define SD_SAMPLED 0
#endif
// With SD_SAMPLED: where the sampler's scalars and per-token areas lie in
// the scratch (floats from its start; stream.rs `samp_window`), or 0 for
// after the rest, the scalars static. SD_SAMP_SS: the bytes kept for the
// scalars there (stream.rs `SAMP_SHARED`).
#ifndef SD_SAMP_OFF
#define SD_SAMP_OFF 0
#endif

constexpr int D = SD_D, QD = SD_QD, KVD = SD_KVD, FF = SD_FF, NH = SD_NH, NKV = SD_NKV, HD = SD_HD;
constexpr int QKV = QD + 2 * KVD;
static_assert(QD == NH * HD && KVD == NKV * HD, "heads of SD_HD");

// A matrix's storage: F16 elements, or the bytes of Q4_0 blocks repacked
// (repack.rs: every row's quants, then every row's scales).
#if SD_Q4
typedef u8 sd_w_t;
#else
typedef u16 sd_w_t;
#endif

struct SdLayer {
    const sd_w_t* w[7];  // q, k, v, o, gate, up, down (row-major)
    const float* attn_norm;
    const float* ffn_norm;
    kv_t* k;  // [kv head][capacity][HD]
    kv_t* v;
};

struct SdArgs {
    const SdLayer* layers;
    const sd_w_t* emb;  // vocab x d
    const sd_w_t* out;  // vocab x d (the embedding when tied)
    const float* out_norm;
    u32* conveyor;  // token ids: input at ctl->tok0, outputs after it
    Ctl* ctl;
    u64* x;      // 2 x SD_XW tagged words
    u64* best;   // 2 x (blocks + 1): each block's best key, then the cancel word
    u32* flags;  // blocks
    const u8* maps;  // SD_Q4: two CUtensorMaps (quants, scales) a matrix, layer by layer, then the output's
    const float* freq;  // Llama 3.1-style RoPE divisors (HD / 2), or null
    u32 nl, vocab, capacity, max_pos;
    float eps, theta, freq_scale, scale;
    // SD_STAGED: each product's stage images (sd_stage_form), 4 a layer
    // (q|k|v, o, gate|up, down), then the logits'; block b's stage i of
    // product M at staged[.] + (b sns[M] + i) x its stage's bytes.
    const u64* staged;
    u32 sns[5], pad;
    SampArgs s;  // the in-kernel sampler (SD_SAMPLED)
};

// The products, in the order a layer streams them, then the logits.
enum { M_QKV = 0, M_O = 1, M_GU = 2, M_DN = 3, M_LOG = 4 };
__host__ __device__ constexpr int sd_pow2_floor(int n) { return n >= 2 ? 2 * sd_pow2_floor(n / 2) : 1; }
#if SD_Q4
// A product's tiles (16 rows) and their chunks: KS slices of KC columns,
// GPS groups of four blocks each. In a stage, row r's quants start at
// r KC / 2 and its scales at 16 KC / 2 + r KC / 16 (a tensor-map copy
// writes its box densely). SD_MAP_BYTES: a CUtensorMap.
#define SD_MAP_BYTES 128
template <int M>
struct Mat {
    static constexpr int K = M == M_O ? QD : M == M_DN ? FF : D;
    static constexpr int KS = M == M_O ? SD_KS_Q : M == M_DN ? SD_KS_F : SD_KS_D;
    static constexpr int KC = K / KS;
    static constexpr int GPS = KC / 128;
    static_assert(K % KS == 0 && GPS % SD_CW == 0, "a slice is whole groups for every warp");
    static_assert(KC / 8 <= 256, "a box row is at most 256 words");
    static constexpr int SB = 16 * (KC / 2 + KC / 16);  // a stage's bytes
    static_assert(SB <= SD_STB, "a tile's slice fits a stage");
};
#else
template <int M>
struct Mat {
    static constexpr int UR = (M == M_QKV || M == M_GU) ? 2 : 1;  // rows a unit
    static constexpr int K = M == M_O ? QD : M == M_DN ? FF : D;
    static constexpr int RB = 2 * K;                    // bytes a row
    static constexpr int UB = UR * RB;                  // bytes a unit
    static constexpr int UPC = sd_pow2_floor(SD_STB / UB);  // units a chunk
    static constexpr int RPC = UPC * UR;                // rows a chunk
    static constexpr int SEG = K / SD_CW;               // columns a warp
    static_assert(UB <= SD_STB, "a unit fits a stage");
    static_assert(RPC <= 32, "a chunk's rows reduce by halving");
    static_assert(SEG % 256 == 0, "a warp's segment is whole 256-column steps");
};
#endif
__device__ __forceinline__ u32 sd_units(int m, u32 vocab) {
    return m == M_QKV ? QKV / 2 : m == M_O ? D : m == M_GU ? FF : m == M_DN ? D : vocab;
}

// Tagged-word areas of one set (two sets, by the parity of the layer
// counted over the chain).
constexpr int X_HO = 0, X_HD = X_HO + D, X_Q = X_HD + D, X_K = X_Q + QD, X_V = X_K + KVD, X_ACT = X_V + KVD,
              X_PART = X_ACT + FF, SD_XW = X_PART + NH * SD_ATT_S * (HD + 2);

static_assert(X_ACT % 2 == 0 && SD_XW % 2 == 0, "down's input and h's units are read 16 bytes at a time");
// down's input (the FFN activation, FF words a set) as 4-byte words: the
// f32 rounded to its top 24 bits (15 of mantissa), the tag's low byte in
// the bottom 8. Every block reads all FF of them a layer: as 8-byte tagged
// words that was 115 KB a block and 15 MB over the grid on the 8B shape.
// The low byte tells a stale word from a fresh one because each set's word
// is rewritten every second layer, 16 tags later (sd_tag), and no phase-3
// tag is 0 mod 256 (the words start zeroed). The 8-byte words measured
// level on 8B Q4_0 and 8B F16 and 1.6% slower on llama-1b F16 (session 43).
__device__ __forceinline__ void sd_act_store(u32* a, float v, u32 tag) {
    const u32 w = ((__float_as_uint(v) + 0x80u) & 0xFFFFFF00u) | (tag & 0xFFu);
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(a), "r"(w) : "memory");
}
__device__ __forceinline__ uint4 sd_act_load4(const u32* a) {
    uint4 w;
    asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
                 : "l"(a)
                 : "memory");
    return w;
}
// Whether any of w's four words carries another tag than t8.
__device__ __forceinline__ bool sd_act_stale(uint4 w, u32 t8) {
    return (((w.x ^ t8) | (w.y ^ t8) | (w.z ^ t8) | (w.w ^ t8)) & 0xFFu) != 0u;
}
__device__ __forceinline__ float sd_act_val(u32 w) { return __uint_as_float(w & 0xFFFFFF00u); }

// common.cuh's tag_wait_all, with SD_DIAG's no-wait bit and clock count.
// Tried and not kept (bench/RESULTS.md, session 43): a pause before each
// reload (8B Q4_0 0.6% slower at 200 ns, 3.8% at 1 us).
template <int N, class F>
__device__ __forceinline__ void sd_poll(u64 (&w)[N], F addr, u32 tag) {
    if (SD_DIAG & 2) return;
    SD_CLK_BEGIN(1);
    tag_wait_all(w, addr, tag);
    SD_CLK_END(1);
}
__device__ __forceinline__ float sd_val(u64 w) { return __uint_as_float((u32)w); }
// Phase ph of layer l of chain token t; 0 is never a tag (the words start
// zeroed).
__device__ __forceinline__ u32 sd_tag(u32 t, u32 nl, u32 l, u32 ph) { return ((t * nl + l) * 8u + ph) + 1u; }

// Whether the mbarrier's phase of `parity` has completed: test_wait
// answers at once, try_wait (SUSPEND) may first suspend the thread until
// it completes or a time limit passes.
#define SD_MBAR_POLL(OP) \
    "{\n .reg .pred p;\n mbarrier." OP ".parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
template <bool SUSPEND>
__device__ __forceinline__ bool sd_mbar_done(u64* bar, u32 parity) {
    u32 ok;
    if constexpr (SUSPEND)
        asm volatile(SD_MBAR_POLL("try_wait") : "=r"(ok) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    else
        asm volatile(SD_MBAR_POLL("test_wait") : "=r"(ok) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    return ok != 0;
}
__device__ __forceinline__ void sd_mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// The producer keeps at most SD_INFLIGHT copies in flight (0: no cap),
// waiting for copy c - SD_INFLIGHT to land before issuing copy c: a ring
// refilled all at once after a serial section would queue its whole depth
// in the memory system, on every SM, ahead of the consumers' loads of the
// other blocks' words (stream.rs `inflight`). Returns false if the chain
// ended before token t.
#ifndef SD_INFLIGHT
#define SD_INFLIGHT 0
#endif
__device__ __forceinline__ bool sd_cap_inflight(u64* full, u32 c, u32 t, const volatile u32* last) {
    if (SD_INFLIGHT == 0 || c < (u32)SD_INFLIGHT) return true;
    const u32 k = c - (u32)SD_INFLIGHT;
    while (!sd_mbar_done<false>(&full[k % SD_NST], (k / SD_NST) & 1u))
        if (t > *last) return false;
    return true;
}
// The consumers' barrier (named barrier 1; the producer warp never joins).
__device__ __forceinline__ void sd_csync() { asm volatile("bar.sync 1, %0;" ::"r"(SD_CT) : "memory"); }
// The sampler's configuration (chain_sampler.cuh): the consumer warps, their
// barrier; SD_PICK_KPT keys a thread (stream.rs: top-64 lists of 132
// blocks over the consumer threads).
#ifndef SD_PICK_KPT
#define SD_PICK_KPT 33
#endif
struct SdCfg {
    static constexpr int WARPS = SD_CW, PICK_KPT = SD_PICK_KPT, PICK_HEAD_KPT = 0;
    static constexpr bool REDUX_MAX = false, PRED_APPEND = false, SPEC_PICK = false;
    static __device__ __forceinline__ void sync() { sd_csync(); }
    static __device__ __forceinline__ u32 bid() { return blockIdx.x; }
};

// x in shared memory is permuted so that lane i reads columns 8i..8i+7 of
// each 256-column step as two conflict-free float4.
__device__ __forceinline__ u32 sd_xperm(u32 k) {
    const u32 r = k & 255u, l = r >> 3, j = r & 7u;
    return (k & ~255u) + (j >> 2) * 128u + l * 4u + (j & 3u);
}
// Element e of a product's input, v, into the staged x: permuted f32
// (F16), or its f16 hi and lo halves at their places in the B image (Q4:
// tc.cuh q4_img_at; element e is half (e >> 1) & 1 of word e & 1 of the
// pair of e & ~3).
__device__ __forceinline__ void sd_put(float* xs, u32 e, float v) {
#if SD_Q4
    u16* img = (u16*)xs;
    const u32 w = q4_img_at(e & ~3u, 0) + (e & 1u), half = (e >> 1) & 1u;
    const u16 hi = f16_bits(v);
    img[2 * w + half] = hi;
    img[2 * (w + 4) + half] = f16_bits(v - f16_to_f32(hi));  // lo: the next B lane's words
#else
    xs[sd_xperm(e)] = v;
#endif
}
#if SD_Q4
// A staging unit of the Q4_0 form's B image: elements 4j..4j+3 and
// 16+4j..16+4j+3 of block t of a group G of four blocks (u = 16 G + 4 j +
// t). Their hi and lo pairs are the image's eight words at G 128 + j 32 +
// t 8 (q4_img_at), stored as two 16-byte words: with t fastest over the
// lanes a quarter warp meets each bank twice. Element by element (sd_put:
// 16 two-byte stores a unit, each meeting its bank four times) the 8B
// shape's staging of down's input took about 2.6 us a layer after the
// last word had arrived (bench/RESULTS.md, session 43).
__device__ __forceinline__ u32 sd_unit_elem(u32 u, int k) {
    return (u >> 4) * 128 + (u & 3u) * 32 + ((u >> 2) & 3u) * 4 + (u32)(k & 3) + (u32)(k >> 2) * 16;
}
__device__ __forceinline__ void sd_put_unit(float* xs, u32 u, const float (&v)[8]) {
    u32 hi[8], lo[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const u16 h = f16_bits(v[e]);
        hi[e] = h;
        lo[e] = f16_bits(v[e] - f16_to_f32(h));
    }
    // Pairs (e, e + 2) and (e + 1, e + 3) of each half.
    uint4* img = (uint4*)xs + ((u >> 4) * 128 + ((u >> 2) & 3u) * 32 + (u & 3u) * 8) / 4;
    img[0] = make_uint4(hi[0] | hi[2] << 16, hi[1] | hi[3] << 16, hi[4] | hi[6] << 16, hi[5] | hi[7] << 16);
    img[1] = make_uint4(lo[0] | lo[2] << 16, lo[1] | lo[3] << 16, lo[4] | lo[6] << 16, lo[5] | lo[7] << 16);
}
#endif
// SD_H_UNITS (the Q4_0 form's default): h's tagged words (the o and down
// sums) are written so that a norm's staging loads whole units, each
// load of a warp 512 contiguous bytes, and stores them with sd_put_unit:
// the words of units 32 c .. 32 c + 31 take 256 words from 256 c, word j
// of unit u (element sd_unit_elem(u, j)) at 256 c + 64 (j / 2) +
// 2 (u % 32) + j % 2, so that a lane's four 16-byte loads hold its unit.
// Measured (bench/RESULTS.md, session 44): 8B Q4_0 +1.5% greedy against
// the norms element by element (whose 2-byte stores meet each bank four
// times). Loading units from words in element order cost 2.2% (session
// 43: each 8-byte load met 32 sectors), and 64 contiguous bytes a lane
// cost 2.5% (session 44: each 16-byte load met 32 sectors, half of each;
// every block reads the same words at once, so the requests count).
// Tried and not kept (session 44): these words as 4 bytes, as down's
// input's are (+0.5%; the Q4_0 GPU tests failed with them, not
// diagnosed). -DSD_H_UNITS=0 for A/B runs.
#ifndef SD_H_UNITS
#define SD_H_UNITS (SD_Q4 && SD_D % 256 == 0)
#endif
static_assert(!SD_H_UNITS || (SD_Q4 && D % 256 == 0), "h in units: the Q4_0 form, whole chunks of 32 units");
// The word of unit u's word j (sd_unit_elem's k).
__device__ __forceinline__ u32 sd_uword(u32 u, u32 j) { return (u >> 5) * 256 + (j >> 1) * 64 + (u & 31u) * 2 + (j & 1u); }
// The word of h's element e.
__device__ __forceinline__ u32 sd_hword(u32 e) {
#if SD_H_UNITS
    const u32 r = e & 127u, w = r & 31u;
    const u32 u = (e >> 7) * 16 + ((w & 15u) >> 2) * 4 + (r >> 5);
    return sd_uword(u, (w & 3u) + (w >> 4) * 4);
#else
    return e;
#endif
}
// h's element e (or o's input's) into the tagged words at area.
__device__ __forceinline__ void sd_h_store(u64* area, u32 e, float v, u32 tag) { tag_store(area + sd_hword(e), v, tag); }
// Element i of token's embedding row.
#if SD_EMB_Q6
// Element i of token's row of the Q6 form; not inlined: inlined into the
// embedding's loops it made the sampled module spill 96 bytes, not 12.
__device__ __noinline__ float sd_emb_q6(const u8* emb, u32 vocab, u32 token, u32 i) {
    // The Q6 form: the nibble, its top bits (word j of the block: byte
    // 4 (j / 2) + i % 4, bits 4 (j % 2) + 2 (which half)), the scales.
    const u64 e = (u64)token * D + i, blk = e >> 5;
    const u32 w = i & 31u, j = (w & 15u) >> 2;
    const u8 b = emb[blk * 16 + (w & 15u)];
    const u32 nib = (w & 16u) ? b >> 4 : b & 15u;
    const u64 n = (u64)vocab * D;
    const u8 hb = emb[n / 2 + blk * 8 + (j >> 1) * 4 + (w & 3u)];
    const u32 top = (hb >> ((j & 1u) * 4 + (w >> 4) * 2)) & 3u;
    const float sc = (float)(signed char)emb[n * 3 / 4 + (e >> 4)];
    const float d = ((const float*)(emb + n * 13 / 16))[e >> 8];
    return d * sc * (float)((int)(nib | top << 4) - 32);
}
#endif
__device__ __forceinline__ float sd_emb(const sd_w_t* emb, u32 vocab, u32 token, u32 i) {
#if SD_EMB_Q6
    return sd_emb_q6(emb, vocab, token, i);
#elif SD_Q4
    const u8 b = emb[(u64)token * (D / 2) + (i >> 5) * 16 + (i & 15u)];
    const int q = (int)((i & 16u) ? b >> 4 : b & 15u) - 8;
    return f16_to_f32(ld_u16(emb + (u64)vocab * (D / 2) + ((u64)token * (D / 32) + (i >> 5)) * 2)) * (float)q;
#else
    return f16_to_f32(emb[(u64)token * D + i]);
#endif
}
__device__ __forceinline__ float sd_dot8(uint4 q, float4 a, float4 b) {
    const float2 w0 = f16x2_to_f32(q.x), w1 = f16x2_to_f32(q.y), w2 = f16x2_to_f32(q.z), w3 = f16x2_to_f32(q.w);
    float s = w0.x * a.x;
    s = fmaf(w0.y, a.y, s);
    s = fmaf(w1.x, a.z, s);
    s = fmaf(w1.y, a.w, s);
    s = fmaf(w2.x, b.x, s);
    s = fmaf(w2.y, b.y, s);
    s = fmaf(w3.x, b.z, s);
    s = fmaf(w3.y, b.w, s);
    return s;
}

__device__ __forceinline__ void sd_range(u32 units, u32& u0, u32& u1) {
    u0 = (u32)((u64)units * blockIdx.x / gridDim.x);
    u1 = (u32)((u64)units * (blockIdx.x + 1) / gridDim.x);
}

struct SdRing {
    unsigned char* buf;  // SD_NST x SD_STB
    u64* full;
    u64* empty;
};

#if !SD_Q4
// The chunks of this block's share of product M of layer L (or the logits),
// in order: f(src0, bytes0, src1, bytes1, rows) for each, src1 a second copy
// into the same stage after the first (gate|up: the up rows). q|k|v chunks
// never straddle two of its matrices.
template <int M, class F>
__device__ __forceinline__ void sd_chunks(const SdArgs& a, const SdLayer& L, F f) {
    using T = Mat<M>;
    u32 u0, u1;
    sd_range(sd_units(M, a.vocab), u0, u1);
    if (M == M_QKV) {
        // Units (RoPE pairs) by matrix: q [0, QD/2), k, v.
        const u32 lo[3] = {0, QD / 2, (QD + KVD) / 2}, hi[3] = {QD / 2, (QD + KVD) / 2, QKV / 2};
#pragma unroll
        for (int g = 0; g < 3; ++g) {
            const u32 b = max(u0, lo[g]), e = min(u1, hi[g]);
            for (u32 u = b; u < e; u += T::UPC) {
                const u32 n = min((u32)T::UPC, e - u);
                f((const unsigned char*)(L.w[g] + (u64)(u - lo[g]) * 2 * T::K), n * T::UB,
                  (const unsigned char*)nullptr, 0u, n * 2);
            }
        }
    } else if (M == M_GU) {
        for (u32 u = u0; u < u1; u += T::UPC) {
            const u32 n = min((u32)T::UPC, u1 - u);
            f((const unsigned char*)(L.w[4] + (u64)u * T::K), n * T::RB, (const unsigned char*)(L.w[5] + (u64)u * T::K),
              n * T::RB, n * 2);
        }
    } else {
        const u16* m = M == M_O ? L.w[3] : M == M_DN ? L.w[6] : a.out;
        for (u32 u = u0; u < u1; u += T::UPC) {
            const u32 n = min((u32)T::UPC, u1 - u);
            f((const unsigned char*)(m + (u64)u * T::K), n * T::RB, (const unsigned char*)nullptr, 0u, n);
        }
    }
}

// The sums of N rows' lane partials over the warp by halving: afterwards
// lane l holds the sum of row (l >> (5 - log2 N)) % N.
template <int N>
__device__ __forceinline__ float sd_reduce_rows(float (&v)[N], u32 lane) {
#pragma unroll
    for (int half = N / 2, off = 16; half >= 1; half /= 2, off /= 2) {
        const bool hi = (lane & (u32)off) != 0;
#pragma unroll
        for (int i = 0; i < half; ++i) {
            const float keep = hi ? v[i + half] : v[i], send = hi ? v[i] : v[i + half];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, off);
        }
    }
    float s = v[0];
#pragma unroll
    for (int off = 16 / N; off >= 1; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
    return s;
}
template <int N>
struct SdLog2 {
    static constexpr int v = 1 + SdLog2<N / 2>::v;
};
template <>
struct SdLog2<1> {
    static constexpr int v = 0;
};

// The consumers' side of product M: each chunk's row partials into part
// (this block's rows in order, SD_CW a row). Ends synchronised.
template <int M>
__device__ __forceinline__ void sd_consume(const SdArgs& a, const SdLayer& L, const SdRing& r, const float* xs,
                                           float* part, u32& c, const uint4* /* the Q4_0 form's zeros */) {
    using T = Mat<M>;
    constexpr int STEPS = T::SEG / 256, N = T::RPC, SH = 5 - SdLog2<N>::v;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    float4 xa[STEPS], xb[STEPS];
#pragma unroll
    for (int i = 0; i < STEPS; ++i) {
        const float* x = xs + warp * T::SEG + i * 256;
        xa[i] = ((const float4*)x)[lane];
        xb[i] = ((const float4*)(x + 128))[lane];
    }
    u32 row0 = 0;  // this chunk's first row among the block's rows
    sd_chunks<M>(a, L, [&](const unsigned char*, u32, const unsigned char*, u32, u32 rows) {
        const u32 s = c % SD_NST, n = c / SD_NST;
        SD_CLK_BEGIN(0);
        mbar_wait(&r.full[s], n & 1u);
        SD_CLK_END(0);
        SD_CLK_BEGIN(2);
        const uint4* wq = (const uint4*)(r.buf + (u64)s * SD_STB) + warp * (T::SEG / 8) + lane;
        float acc[N];
#pragma unroll
        for (int j = 0; j < N; ++j) {
            float v = 0.0f;
#pragma unroll
            for (int i = 0; i < STEPS; ++i) v += sd_dot8(wq[j * (T::K / 8) + i * 32], xa[i], xb[i]);
            acc[j] = v;
        }
        __syncwarp();
        if (lane == 0) sd_mbar_arrive(&r.empty[s]);  // the stage is in registers
        SD_CLK_END(2);
        const float sum = sd_reduce_rows<N>(acc, lane);
        const u32 row = (lane >> SH) % N;
        if ((lane & ((1u << SH) - 1u)) == 0 && row < rows) part[(row0 + row) * SD_CW + warp] = sum;
        row0 += rows;
        ++c;
    });
    sd_csync();
}
#else
// A run of rows of one matrix in this block's share of product M: the
// matrix (0..6 the layer's, as SdLayer::w; 7 the output), its first row
// there, how many, and where they start among the block's row partials.
// q|k|v: the block's concatenated rows cut at the matrices' bounds (their
// partials in row order, as the F16 form keeps them); gate|up: the gate
// rows, then the up rows.
struct SdSeg {
    u32 m, r0, n, part;
};
template <int M>
__device__ __forceinline__ int sd_segs(const SdArgs& a, SdSeg (&s)[3]) {
    u32 u0, u1;
    sd_range(sd_units(M, a.vocab), u0, u1);
    if (M == M_QKV) {
        const u32 b = 2 * u0, e = 2 * u1;
        const u32 lo[3] = {0, QD, QD + KVD}, hi[3] = {QD, QD + KVD, QKV};
        int n = 0;
#pragma unroll
        for (int g = 0; g < 3; ++g) {
            const u32 x = max(b, lo[g]), y = min(e, hi[g]);
            if (x < y) s[n++] = {(u32)g, x - lo[g], y - x, x - b};
        }
        return n;
    }
    if (M == M_GU) {
        s[0] = {4, u0, u1 - u0, 0};
        s[1] = {5, u0, u1 - u0, u1 - u0};
        return 2;
    }
    s[0] = {M == M_O ? 3u : M == M_DN ? 6u : 7u, u0, u1 - u0, 0};
    return 1;
}

// A 2-D tensor-map copy (the tile's 16 rows of one slice, quants or
// scales) into shared memory, completing on bar.
__device__ __forceinline__ void sd_tile_copy(void* dst, const u8* map, u32 x, u32 y, u64* bar, u64 policy) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, "
        "%3}], [%4], %5;" ::"r"(smem_u32(dst)),
        "l"(map), "r"(x), "r"(y), "r"(smem_u32(bar)), "l"(policy)
        : "memory");
}

// The producer's next stage (c's): waits until the consumers freed it, or
// returns null once the chain ended before token t.
__device__ __forceinline__ unsigned char* sd_take_stage(const SdRing& r, u32 c, u32 t, bool& ended,
                                                        const volatile u32* last) {
    const u32 st = c % SD_NST, n = c / SD_NST;
    // try_wait may suspend the thread rather than spin (measured the same
    // as test_wait's spin: bench/RESULTS.md, session 27).
#if SD_DIAG & 4
    const long long p0 = clock64();
#endif
    if (n > 0)
        while (!sd_mbar_done<true>(&r.empty[st], (n - 1) & 1u)) {
            if (t > *last) {
                ended = true;
                return nullptr;
            }
        }
#if SD_DIAG & 4
    sd_pclk += (unsigned long long)(clock64() - p0);
#endif
    if (t > *last || !sd_cap_inflight(r.full, c, t, last)) {
        ended = true;
        return nullptr;
    }
    return r.buf + (u64)st * SD_STB;
}

// The producer's side of product M of layer l (nl: the logits): for each
// 16-row tile and slice, wait for a free stage (or learn that the chain
// ended before token t), then copy the quants and scales with two
// tensor-map copies (stream.rs: the maps of every matrix; rows past a
// matrix's end land as zeros, and the copies count whole boxes). One copy
// a row piece instead, 32 a stage, ran at 1.4 us a stage whatever its
// bytes (bench/RESULTS.md, session 27). The Q6 form's logits tiles take
// two stages (SD_OUT_Q6).
template <int M>
__device__ __forceinline__ void sd_produce(const SdArgs& a, u32 l, const SdRing& r, u32 t, u32& c, bool& ended,
                                           u64 policy, const volatile u32* last) {
    using T = Mat<M>;
    constexpr bool Q6 = SD_OUT_Q6 && M == M_LOG;
#if SD_STAGED
    if constexpr (!Q6) {
        // This block's stage images of the product, one after another.
        const u32 n = a.sns[M];
        const u8* src = (const u8*)a.staged[M == M_LOG ? 4 * a.nl : 4 * l + M] + (u64)blockIdx.x * n * T::SB;
        SdSeg sg[3];
        const int ns = sd_segs<M>(a, sg);
        for (int j = 0; j < ns; ++j)
            for (u32 i = 0; i < sg[j].n; i += 16)
                for (u32 k = 0; k < (u32)T::KS; ++k) {
                    unsigned char* dst = sd_take_stage(r, c, t, ended, last);
                    if (!dst) return;
                    u64* full = &r.full[c % SD_NST];
                    mbar_expect_tx(full, T::SB);
                    bulk_copy_hint(dst, src, T::SB, full, policy);
                    src += T::SB;
                    ++c;
                }
        return;
    }
#endif
    SdSeg sg[3];
    const int ns = sd_segs<M>(a, sg);
    for (int j = 0; j < ns; ++j) {
        const u8* map = a.maps + (u64)(sg[j].m == 7 ? a.nl * 7 : l * 7 + sg[j].m) * 2 * SD_MAP_BYTES;
        for (u32 i = 0; i < sg[j].n; i += 16) {
            for (u32 k = 0; k < (u32)T::KS; ++k) {
                unsigned char* dst = sd_take_stage(r, c, t, ended, last);
                if (!dst) return;
                u64* full = &r.full[c % SD_NST];
                // SD_DIAG bit 16: every copy takes the matrix's first tile
                // (from L2 after the first), so that HBM does not pace it.
                const u32 kx = (SD_DIAG & 16) ? 0u : k, ry = (SD_DIAG & 16) ? 0u : sg[j].r0 + i;
                if constexpr (Q6) {
                    // The nibbles in this stage; the top bits, the scales
                    // and the super-block scales (maps 1-3) in the next.
                    mbar_expect_tx(full, 16 * (T::KC / 2));
                    sd_tile_copy(dst, map, kx * (T::KC / 8), ry, full, policy);
                    ++c;
                    dst = sd_take_stage(r, c, t, ended, last);
                    if (!dst) return;
                    full = &r.full[c % SD_NST];
                    mbar_expect_tx(full, 16 * (T::KC / 4 + T::KC / 16 + T::KC / 64));
                    sd_tile_copy(dst, map + SD_MAP_BYTES, kx * (T::KC / 16), ry, full, policy);
                    sd_tile_copy(dst + 16 * (T::KC / 4), map + 2 * SD_MAP_BYTES, kx * (T::KC / 64), ry, full, policy);
                    sd_tile_copy(dst + 16 * (T::KC / 4 + T::KC / 16), map + 3 * SD_MAP_BYTES, kx * (T::KC / 256), ry, full, policy);
                } else {
                    mbar_expect_tx(full, 16 * (T::KC / 2 + T::KC / 16));
                    sd_tile_copy(dst, map, kx * (T::KC / 8), ry, full, policy);
                    sd_tile_copy(dst + 16 * (T::KC / 2), map + SD_MAP_BYTES, kx * (T::KC / 64), ry, full, policy);
                }
                ++c;
            }
        }
    }
}

// The stage images of product M of layer l (the logits: l = nl) for this
// block (SD_STAGED): its stages in sd_produce's order (sd_segs' runs, their
// 16-row tiles, each tile's slices), each a tile's slice as sd_consume's
// lanes read it. Quants: group j's 1 KB, rows 0-7 then 8-15, row r's
// block 4j + t at 16 (4 (r % 8) + t). Scales after them: group j's 128
// bytes, block 4j + t's rows r and r + 8 (r < 8) as one word at
// 4 (8t + r). Rows past the matrix are zeros. Read from the repacked
// row-major matrices (every row's quants, then every row's scales);
// stream.rs launches it once a product with the decode kernel's grid, so
// that sd_range gives each block the rows it will stream.
template <int M>
__device__ void sd_stage_form(const SdArgs& a, u32 l, u8* dst) {
    using T = Mat<M>;
    constexpr u32 NB = T::KC / 32;  // Q4_0 blocks in a row of a slice
    SdSeg sg[3];
    const int ns = sd_segs<M>(a, sg);
    dst += (u64)blockIdx.x * a.sns[M] * T::SB;
    for (int j = 0; j < ns; ++j) {
        const u32 m = sg[j].m;
        const u8* w = m == 7 ? a.out : a.layers[l].w[m];
        const u32 rows = m == 7 ? a.vocab : m == 0 ? QD : m < 3 ? KVD : (m == 4 || m == 5) ? FF : D;
        const u8* scales = w + (u64)rows * (T::K / 2);
        for (u32 i = 0; i < sg[j].n; i += 16) {
            const u32 r0 = sg[j].r0 + i;
            for (u32 k = 0; k < (u32)T::KS; ++k, dst += T::SB) {
                for (u32 e = threadIdx.x; e < 16 * NB; e += blockDim.x) {
                    const u32 r = e / NB, b = e % NB;
                    uint4 q = make_uint4(0, 0, 0, 0);
                    if (r0 + r < rows) q = *(const uint4*)(w + (u64)(r0 + r) * (T::K / 2) + (k * NB + b) * 16);
                    *(uint4*)(dst + (b / 4) * 1024 + (r / 8) * 512 + ((r % 8) * 4 + b % 4) * 16) = q;
                }
                for (u32 e = threadIdx.x; e < 8 * NB; e += blockDim.x) {
                    const u32 r = e / NB, b = e % NB;
                    u32 lo = 0, hi = 0;
                    if (r0 + r < rows) lo = *(const u16*)(scales + (u64)(r0 + r) * (T::K / 16) + (k * NB + b) * 2);
                    if (r0 + r + 8 < rows) hi = *(const u16*)(scales + (u64)(r0 + r + 8) * (T::K / 16) + (k * NB + b) * 2);
                    *(u32*)(dst + 16 * (T::KC / 2) + (b / 4) * 128 + ((b % 4) * 8 + r) * 4) = lo | hi << 16;
                }
            }
        }
    }
}
extern "C" __global__ void k_stage_form(SdArgs a, u32 l, u32 m, u8* dst) {
    if (m == M_QKV) sd_stage_form<M_QKV>(a, l, dst);
    if (m == M_O) sd_stage_form<M_O>(a, l, dst);
    if (m == M_GU) sd_stage_form<M_GU>(a, l, dst);
    if (m == M_DN) sd_stage_form<M_DN>(a, l, dst);
    if (m == M_LOG) sd_stage_form<M_LOG>(a, l, dst);
}

// Word w of a Q6 block's nibbles, w's top bits in bits 0-3 of each byte
// (bits 0-1 for the low nibble's element, 2-3 for the high one's), as
// tcg_q4_pairs gives a Q4_0 word: f16 pairs of q - 32, q = nibble | top
// << 4 (1024 + q under 0x64, less 1056).
// Bits 4-7 of each byte of top are not read (the masks drop them).
// SD_DIAG bit 32 drops the top bits.
#define SD_Q6_TOP(x) ((SD_DIAG & 32) ? 0u : (x))
__device__ __forceinline__ void sd_q6_pairs(u32 w, u32 top, u32& l0, u32& l1, u32& h0, u32& h1) {
    const u32 lo = (w & 0x0F0F0F0Fu) | ((top << 4) & 0x30303030u);
    const u32 hi = ((w >> 4) & 0x0F0F0F0Fu) | ((top << 2) & 0x30303030u);
    const u32 sub = 0x64206420u;  // 1056
    l0 = hsub2_u(__byte_perm(lo, 0x64646464u, 0x4240), sub);
    l1 = hsub2_u(__byte_perm(lo, 0x64646464u, 0x4341), sub);
    h0 = hsub2_u(__byte_perm(hi, 0x64646464u, 0x4240), sub);
    h1 = hsub2_u(__byte_perm(hi, 0x64646464u, 0x4341), sub);
}

// Tried and not kept (bench/RESULTS.md, session 29): the scales' tensor
// map swizzled, so that the eight rows a scale load takes sit in
// different banks, not one (536 tok/s against 544 unswizzled on the 8B
// shape, in a build that loaded B under a predicate); and every tile of a
// slice taken before the next, with the slice's B fragments kept in
// registers (458 against 594: each row's slices were then read far apart);
// and the nibbles turned into f16 subnormals by masks alone (q 2^-24, the
// zero point taken off each block's sum from the staged input's block
// sums): five instructions a word where tcg_q4_pairs takes eleven, 108
// SASS instructions a warp a stage where this loop takes 153, but 563 and
// 565 against 560 in the same call.
// The consumers' side of product M: lane (g, t) multiplies rows g and
// g + 8 of each tile, block t of each of its warp's groups (group G of a
// row goes to warp G % SD_CW: NGW of each chunk), against the B image of
// the staged input xs (lanes that feed no B read zeros); the four lanes of
// a row are then summed into part (SD_CW a row). Ends synchronised.
template <int M>
__device__ __forceinline__ void sd_consume(const SdArgs& a, const SdLayer&, const SdRing& r, const float* xs,
                                           float* part, u32& c, const uint4* zeros) {
    using T = Mat<M>;
    constexpr bool Q6 = SD_OUT_Q6 && M == M_LOG;
    constexpr int NGW = T::GPS / SD_CW;  // groups a warp takes of each chunk
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31u, g = lane >> 2, t = lane & 3u;
    const u32* img = (const u32*)xs;
    const bool feeds = (g >> 1) == t;
    SdSeg sg[3];
    const int ns = sd_segs<M>(a, sg);
    for (int sj = 0; sj < ns; ++sj) {
        for (u32 i = 0; i < sg[sj].n; i += 16) {
            float acc0 = 0.0f, acc1 = 0.0f;
#if SD_K_ROLLED
#pragma unroll 1
#endif
            for (u32 k = 0; k < (u32)T::KS; ++k) {
                const u32 s = c % SD_NST, n = c / SD_NST;
                // The Q6 form's second stage: the top bits, then the scales.
                const u32 s2 = (c + 1) % SD_NST, n2 = (c + 1) / SD_NST;
                SD_CLK_BEGIN(0);
                mbar_wait(&r.full[s], n & 1u);
                if constexpr (Q6) mbar_wait(&r.full[s2], n2 & 1u);
                SD_CLK_END(0);
                SD_CLK_BEGIN(2);
                const u8* st = r.buf + (u64)s * SD_STB;
                const u8* st2 = r.buf + (u64)s2 * SD_STB;
                // All of the warp's loads first, then its products in NGW x 2
                // independent chains (measured the same as one group after
                // another: bench/RESULTS.md, session 27). Tried and not
                // kept (session 45): two stages a warp at once (7% slower),
                // the stage freed as soon as these loads are done (0.9%),
                // the nibbles as f16 subnormals with the -8 from one more
                // product a word (3.5%) or from each block's sum of x kept
                // by the stagings (2.3%). Nor (session 46) x staged as Q8
                // activations with the products on the integer tensor
                // cores (mma.m16n8k32, one a word for both rows: a quarter
                // of the tensor work): greedy level, sampled +2 to +2.7%,
                // and the tokens then follow the CPU's q8 mode, not its
                // f32 one.
                uint4 qa[NGW], qb[NGW], bv[NGW][4];
                float d0[NGW], d1[NGW];
                // Q6: rows g's and g + 8's top bits.
                uint2 ha[NGW], hb[NGW];
#pragma unroll
                for (int gi = 0; gi < NGW; ++gi) {
                    const u32 j = warp + gi * SD_CW, off = (j * 4 + t) * 16;
                    if (SD_STAGED && !Q6) {
                        // Stage images (sd_stage_form): group j's 1 KB, rows
                        // 0-7 then 8-15, lane (g, t)'s 16 bytes at 16 (4g + t).
                        qa[gi] = *(const uint4*)(st + j * 1024 + (g * 4 + t) * 16);
                        qb[gi] = *(const uint4*)(st + j * 1024 + 512 + (g * 4 + t) * 16);
                    } else {
                        qa[gi] = *(const uint4*)(st + g * (T::KC / 2) + off);
                        qb[gi] = *(const uint4*)(st + (g + 8) * (T::KC / 2) + off);
                    }
                    if constexpr (Q6) {
                        // Block 4j + t's top bits for rows g and g + 8 (its
                        // scales are read after the products).
                        const u8* hs = st2 + (j * 4 + t) * 8;
                        ha[gi] = *(const uint2*)(hs + g * (T::KC / 4));
                        hb[gi] = *(const uint2*)(hs + (g + 8) * (T::KC / 4));
                    } else if (SD_STAGED) {
                        // Rows g's and g + 8's scales of block 4j + t, one word.
                        const u32 sw = *(const u32*)(st + 16 * (T::KC / 2) + j * 128 + (t * 8 + g) * 4);
                        d0[gi] = f16_to_f32((u16)sw);
                        d1[gi] = f16_to_f32((u16)(sw >> 16));
                    } else {
                        const u8* sc = st + 16 * (T::KC / 2) + (j * 4 + t) * 2;
                        d0[gi] = f16_to_f32(*(const u16*)(sc + g * (T::KC / 16)));
                        d1[gi] = f16_to_f32(*(const u16*)(sc + (g + 8) * (T::KC / 16)));
                    }
                    // SD_B_FEED: lanes that feed no B take zeros in registers,
                    // otherwise they read them from the zeroed area.
                    const uint4* bp = (const uint4*)(img + (k * T::GPS + j) * 128 + g * 4);
                    if (!SD_B_FEED && !feeds) bp = zeros;
#pragma unroll
                    for (int w = 0; w < 4; ++w)
                        bv[gi][w] = SD_B_FEED && !feeds ? make_uint4(0, 0, 0, 0) : bp[w * 8];
                }
#if SD_DIAG & 8
                // Bit 8: the loads, folded into the sums, and no products.
                u32 fold = 0;
#pragma unroll
                for (int gi = 0; gi < NGW; ++gi) {
                    fold ^= qa[gi].x ^ qa[gi].y ^ qa[gi].z ^ qa[gi].w ^ qb[gi].x ^ qb[gi].y ^ qb[gi].z ^ qb[gi].w;
#pragma unroll
                    for (int w = 0; w < 4; ++w) fold ^= bv[gi][w].x ^ bv[gi][w].y ^ bv[gi][w].z ^ bv[gi][w].w;
                    acc0 += d0[gi] + (float)(fold & 1u);
                    acc1 += d1[gi];
                }
#else
                if ((SD_DIAG & 1) == 0) {
                    float cc[NGW][2][4] = {};
#pragma unroll
                    for (int w = 0; w < 4; ++w) {
#pragma unroll
                        for (int gi = 0; gi < NGW; ++gi) {
                            // Word w of the block: products 2w (low nibbles), 2w + 1.
                            const u32 wa = w == 0 ? qa[gi].x : w == 1 ? qa[gi].y : w == 2 ? qa[gi].z : qa[gi].w;
                            const u32 wb = w == 0 ? qb[gi].x : w == 1 ? qb[gi].y : w == 2 ? qb[gi].z : qb[gi].w;
                            u32 lo[4], hi[4];
                            if constexpr (Q6) {
                                // Word w's top bits: nibble w % 2 of each
                                // byte of word w / 2.
                                const u32 sh = (w & 1) * 4;
                                const u32 ta = SD_Q6_TOP((w < 2 ? ha[gi].x : ha[gi].y) >> sh);
                                const u32 tb = SD_Q6_TOP((w < 2 ? hb[gi].x : hb[gi].y) >> sh);
                                sd_q6_pairs(wa, ta, lo[0], lo[2], hi[0], hi[2]);
                                sd_q6_pairs(wb, tb, lo[1], lo[3], hi[1], hi[3]);
                            } else {
                                tcg_q4_pairs<false>(wa, lo[0], lo[2], hi[0], hi[2]);
                                tcg_q4_pairs<false>(wb, lo[1], lo[3], hi[1], hi[3]);
                            }
                            mma_f16(cc[gi][0], lo, bv[gi][w].x, bv[gi][w].y);
                            mma_f16(cc[gi][1], hi, bv[gi][w].z, bv[gi][w].w);
                        }
                    }
#pragma unroll
                    for (int gi = 0; gi < NGW; ++gi) {
                        if constexpr (Q6) {
                            // Block 4j + t's two int8 scales and its
                            // super-block's (j / 2 of the slice), rows g and
                            // g + 8, read once the products are issued.
                            const u32 j = warp + gi * SD_CW;
                            const u8* sc = st2 + 16 * (T::KC / 4) + (j * 4 + t) * 2;
                            const u32 ca = *(const u16*)(sc + g * (T::KC / 16));
                            const u32 cb = *(const u16*)(sc + (g + 8) * (T::KC / 16));
                            const float* sup = (const float*)(st2 + 16 * (T::KC / 4 + T::KC / 16)) + j / 2;
                            const float da = sup[g * (T::KC / 256)], db = sup[(g + 8) * (T::KC / 256)];
                            const float2 sa = make_float2(da * (float)(signed char)ca, da * (float)(signed char)(ca >> 8));
                            const float2 sb = make_float2(db * (float)(signed char)cb, db * (float)(signed char)(cb >> 8));
                            // Products 2w took a block's first 16 elements
                            // (cc[gi][0]), 2w + 1 its last (cc[gi][1]).
                            acc0 = fmaf(sa.x, cc[gi][0][0] + cc[gi][0][1], acc0);
                            acc0 = fmaf(sa.y, cc[gi][1][0] + cc[gi][1][1], acc0);
                            acc1 = fmaf(sb.x, cc[gi][0][2] + cc[gi][0][3], acc1);
                            acc1 = fmaf(sb.y, cc[gi][1][2] + cc[gi][1][3], acc1);
                        } else {
                            acc0 = fmaf(d0[gi], (cc[gi][0][0] + cc[gi][1][0]) + (cc[gi][0][1] + cc[gi][1][1]), acc0);
                            acc1 = fmaf(d1[gi], (cc[gi][0][2] + cc[gi][1][2]) + (cc[gi][0][3] + cc[gi][1][3]), acc1);
                        }
                    }
                }
#endif
                __syncwarp();
                if (lane == 0) {
                    sd_mbar_arrive(&r.empty[s]);  // the stage is read
                    if constexpr (Q6) sd_mbar_arrive(&r.empty[s2]);
                }
                SD_CLK_END(2);
                c += Q6 ? 2 : 1;
            }
            acc0 += __shfl_xor_sync(0xffffffffu, acc0, 1);
            acc0 += __shfl_xor_sync(0xffffffffu, acc0, 2);
            acc1 += __shfl_xor_sync(0xffffffffu, acc1, 1);
            acc1 += __shfl_xor_sync(0xffffffffu, acc1, 2);
            // Rows of the box past the run belong to the next one (or to
            // another block): not this run's.
            const u32 valid = min(16u, sg[sj].n - i), p = sg[sj].part + i;
            if (t == 0 && g < valid) part[(p + g) * SD_CW + warp] = acc0;
            if (t == 0 && g + 8 < valid) part[(p + g + 8) * SD_CW + warp] = acc1;
        }
    }
    SD_MARK(15 + M);
    sd_csync();
}
#endif
__device__ __forceinline__ float sd_row_sum(const float* part, u32 r) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < SD_CW; ++j) s += part[r * SD_CW + j];
    return s;
}

// x = rmsnorm(h) * w into xs (sd_put): h the tagged words at src, or
// token's embedding row when src is null. Ends synchronised.
// SD_NORM_CALL (the Q4_0 form's default): one copy of it, called from its
// four sites, rather than inlined at each (about 600 SASS instructions a
// copy): the layer loop's code is about the size of the instruction cache
// (bench/RESULTS.md, session 41). -DSD_NORM_CALL=0 lets the compiler
// inline it again (A/B runs); the F16 form keeps it inlined (not measured).
#ifndef SD_NORM_CALL
#define SD_NORM_CALL SD_Q4
#endif
#if SD_NORM_CALL
#define SD_NORM_FN __noinline__
#else
#define SD_NORM_FN
#endif
// The consumers' sum of v, the same bits in every thread (red: SD_CW
// floats; one barrier). Tried and not kept (bench/RESULTS.md, session
// 44): the o and down sums publishing each block's sum of squares beside
// h, every warp of a norm adding the 132 of them itself: 8B Q4_0 6%
// slower greedy, 8% sampled (the norm for q|k|v 4.0 us after its latest
// writer, from 1.9: every warp of every block polled the same 1 KB).
__device__ __forceinline__ float sd_block_sum(float v, float* red) {
    v = warp_sum(v);
    if ((threadIdx.x & 31u) == 0) red[threadIdx.x >> 5] = v;
    sd_csync();
    float tot = 0.0f;
#pragma unroll
    for (int i = 0; i < SD_CW; ++i) tot += red[i];
    return tot;
}
// With SD_H_UNITS, x is stored unit by unit (sd_put_unit) from words the
// sums wrote in sd_hword's order; otherwise element by element (sd_put).
#if SD_H_UNITS
// 16 bytes of tagged words, each word loaded relaxed at GPU scope.
__device__ __forceinline__ void sd_tag_load2(const u64* p, u64& a, u64& b) {
    asm volatile("ld.relaxed.gpu.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}
// A thread's units of x (UPT of them: u = threadIdx.x + i SD_CT, up to
// n): their eight tagged words each (sd_uword), loaded together and
// reloaded, pair by pair, until every word carries the tag.
template <int UPT>
__device__ __forceinline__ void sd_load_units(const u64* src, u32 tag, u32 n, float (&v)[UPT][8]) {
    u64 w[UPT][8];
#pragma unroll
    for (int i = 0; i < UPT; ++i) {
        const u32 u = threadIdx.x + i * SD_CT;
#pragma unroll
        for (int k = 0; k < 8; k += 2) {
            if (u < n)
                sd_tag_load2(src + sd_uword(u, k), w[i][k], w[i][k + 1]);
            else
                w[i][k] = w[i][k + 1] = (u64)tag << 32;
        }
    }
    if ((SD_DIAG & 2) == 0) {
        SD_CLK_BEGIN(1);
        for (;;) {
            bool stale = false;
#pragma unroll
            for (int i = 0; i < UPT; ++i)
#pragma unroll
                for (int k = 0; k < 8; ++k) stale |= (u32)(w[i][k] >> 32) != tag;
            if (!stale) break;
#pragma unroll
            for (int i = 0; i < UPT; ++i)
#pragma unroll
                for (int k = 0; k < 8; k += 2)
                    if ((u32)(w[i][k] >> 32) != tag || (u32)(w[i][k + 1] >> 32) != tag)
                        sd_tag_load2(src + sd_uword(threadIdx.x + i * SD_CT, k), w[i][k], w[i][k + 1]);
        }
        SD_CLK_END(1);
    }
#pragma unroll
    for (int i = 0; i < UPT; ++i)
#pragma unroll
        for (int k = 0; k < 8; ++k) v[i][k] = sd_val(w[i][k]);
}
// sd_stage_norm in units: thread i takes units i, i + SD_CT, ... of d / 8.
// The weights as two 16-byte loads a unit measured level (session 45).
__device__ SD_NORM_FN void sd_stage_norm(float* xs, float* red, const u64* src, u32 tag, const SdArgs& a, u32 token,
                              const float* nw, float eps) {
    constexpr u32 NU = D / 8;
    constexpr int UPT = (NU + SD_CT - 1) / SD_CT;
    float v[UPT][8], wn[UPT][8];
#pragma unroll
    for (int i = 0; i < UPT; ++i) {
        const u32 u = threadIdx.x + i * SD_CT;
#pragma unroll
        for (int k = 0; k < 8; ++k) wn[i][k] = u < NU ? nw[sd_unit_elem(u, k)] : 0.0f;  // before the wait
    }
    if (src) {
        sd_load_units<UPT>(src, tag, NU, v);
    } else {
#pragma unroll
        for (int i = 0; i < UPT; ++i) {
            const u32 u = threadIdx.x + i * SD_CT;
#pragma unroll
            for (int k = 0; k < 8; ++k) v[i][k] = u < NU ? sd_emb(a.emb, a.vocab, token, sd_unit_elem(u, k)) : 0.0f;
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < UPT; ++i)
#pragma unroll
        for (int k = 0; k < 8; ++k) ss = fmaf(v[i][k], v[i][k], ss);
    const float ri = rms_inv(sd_block_sum(ss, red), D, eps);
#pragma unroll
    for (int i = 0; i < UPT; ++i) {
        const u32 u = threadIdx.x + i * SD_CT;
        if (u >= NU) continue;
        float x[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) x[k] = v[i][k] * ri * wn[i][k];
        sd_put_unit(xs, u, x);
    }
    sd_csync();
}
#else
__device__ SD_NORM_FN void sd_stage_norm(float* xs, float* red, const u64* src, u32 tag, const SdArgs& a, u32 token,
                              const float* nw, float eps) {
    constexpr int PER = D / SD_CT;
    static_assert(D % SD_CT == 0, "d is a multiple of the consumer threads");
    float v[PER], wn[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) wn[j] = nw[threadIdx.x + j * SD_CT];  // before the wait
    if (src) {
        u64 w[PER];
        auto addr = [&](int j) { return src + threadIdx.x + j * SD_CT; };
#pragma unroll
        for (int j = 0; j < PER; ++j) w[j] = tag_load(addr(j));
        sd_poll(w, addr, tag);
#pragma unroll
        for (int j = 0; j < PER; ++j) v[j] = sd_val(w[j]);
    } else {
#pragma unroll
        for (int j = 0; j < PER; ++j) v[j] = sd_emb(a.emb, a.vocab, token, threadIdx.x + j * SD_CT);
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < PER; ++j) ss = fmaf(v[j], v[j], ss);
    const float ri = rms_inv(sd_block_sum(ss, red), D, eps);
#pragma unroll
    for (int j = 0; j < PER; ++j) sd_put(xs, threadIdx.x + j * SD_CT, v[j] * ri * wn[j]);
    sd_csync();
}
#endif

// SD_O_UNITS (the default where h is in units and a head has one split):
// the attending block writes its head's values already divided by the
// sum, in unit order (sd_hword), and o's staging loads and stores them
// unit by unit as a norm's does: 8B Q4_0 +1.2% greedy, +2.7% sampled
// (bench/RESULTS.md, session 44). -DSD_O_UNITS=0 for A/B runs.
#ifndef SD_O_UNITS
#define SD_O_UNITS (SD_H_UNITS && SD_ATT_S == 1 && SD_QD % 256 == 0)
#endif
static_assert(!SD_O_UNITS || (SD_H_UNITS && SD_ATT_S == 1 && QD % 256 == 0), "o's input in units: one split");
#if SD_O_UNITS
__device__ void sd_stage_attn(float* xs, const u64* part, u32 tag) {
    constexpr u32 NU = QD / 8;
    constexpr int UPT = (NU + SD_CT - 1) / SD_CT;
    float v[UPT][8];
    sd_load_units<UPT>(part, tag, NU, v);
#pragma unroll
    for (int i = 0; i < UPT; ++i) {
        const u32 u = threadIdx.x + i * SD_CT;
        if (u < NU) sd_put_unit(xs, u, v[i]);
    }
    sd_csync();
}
#else
// The o product's input: every head's attention merged from its SD_ATT_S
// partials (max, sum, values); warp w merges heads 2w, 2w + 1, 2w + 2 SD_CW...
__device__ void sd_stage_attn(float* xs, const u64* part, u32 tag) {
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    constexpr int PW = HD + 2, VPL = HD / 32, HB = 2, NW = 1 + SD_ATT_S * VPL;
    static_assert(NH % (SD_CW * HB) == 0, "heads split evenly over the warps, two at a time");
    for (u32 h0 = warp * HB; h0 < NH; h0 += SD_CW * HB) {
        auto addr = [&](int j) {
            const u64* p = part + (u64)(h0 + j / NW) * SD_ATT_S * PW;
            const int i = j % NW;
            if (i == 0) return p + (lane < 2 * SD_ATT_S ? (lane >> 1) * PW + HD + (lane & 1u) : HD);
            return p + ((i - 1) / VPL) * PW + lane + 32 * ((i - 1) % VPL);
        };
        u64 w[HB * NW];
#pragma unroll
        for (int j = 0; j < HB * NW; ++j) w[j] = tag_load(addr(j));
        sd_poll(w, addr, tag);
#pragma unroll
        for (int hb = 0; hb < HB; ++hb) {
            const float mlv = sd_val(w[hb * NW]);
            float m = NEG_INF;  // over the splits that saw a position
#pragma unroll
            for (int s = 0; s < SD_ATT_S; ++s) {
                const float ms = __shfl_sync(0xffffffffu, mlv, 2 * s), ls = __shfl_sync(0xffffffffu, mlv, 2 * s + 1);
                m = fmaxf(m, ls > 0.0f ? ms : NEG_INF);
            }
            float den = 0.0f, out[VPL] = {};
#pragma unroll
            for (int s = 0; s < SD_ATT_S; ++s) {
                const float ms = __shfl_sync(0xffffffffu, mlv, 2 * s), ls = __shfl_sync(0xffffffffu, mlv, 2 * s + 1);
                const float e = ls > 0.0f ? __expf(ms - m) : 0.0f;
                den += ls * e;
#pragma unroll
                for (int k = 0; k < VPL; ++k) out[k] += e * sd_val(w[hb * NW + 1 + s * VPL + k]);
            }
            const float inv = 1.0f / den;
#pragma unroll
            for (int k = 0; k < VPL; ++k) sd_put(xs, (h0 + hb) * HD + lane + 32 * k, out[k] * inv);
        }
    }
    sd_csync();
}
#endif

// x = down's input (sd_act_store's words at src), one round trip for the
// 8B shape's 14,336 words with 16 consumer warps. SD_ACT_PACK (default):
// the Q4_0 form stores x unit by unit (sd_put_unit), 8B Q4_0 2.0% faster
// than element by element (sd_put; -DSD_ACT_PACK=0 for A/B runs). The
// F16 form stores element by element: four at once measured level on
// llama-1b F16 (session 43).
#ifndef SD_ACT_PACK
#define SD_ACT_PACK 1
#endif
__device__ void sd_stage_act(float* xs, const u32* src, u32 tag) {
#if SD_Q4 && SD_ACT_PACK
    static_assert(FF % 128 == 0, "whole groups of four blocks");
    constexpr int PIECES = 2, NU = FF / 8;
#else
    static_assert(FF % 4 == 0, "the activation in 16-byte pieces");
    constexpr int PIECES = 1, NU = FF / 4;
#endif
    constexpr int ROUND = (NU + SD_CT - 1) / SD_CT, PERU = ROUND < 8 / PIECES ? ROUND : 8 / PIECES,
                  PER = PERU * PIECES;
    // Piece k of this thread's units of round b: its unit and first word.
    auto unit = [&](u32 b, int k) { return b + threadIdx.x + (u32)(k / PIECES) * SD_CT; };
    auto addr = [&](u32 u, int k) -> const u32* {
#if SD_Q4 && SD_ACT_PACK
        return src + sd_unit_elem(u, (k % 2) * 4);
#else
        return src + 4 * u;
#endif
    };
    const u32 t8 = tag & 0xFFu, fill = t8 * 0x01010101u;
    for (u32 b = 0; b < (u32)NU; b += PERU * SD_CT) {
        uint4 w[PER];
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            const u32 u = unit(b, k);
            w[k] = u < (u32)NU ? sd_act_load4(addr(u, k)) : make_uint4(fill, fill, fill, fill);
        }
        if ((SD_DIAG & 2) == 0) {
            SD_CLK_BEGIN(1);
            for (;;) {
                bool stale = false;
#pragma unroll
                for (int k = 0; k < PER; ++k) stale |= sd_act_stale(w[k], t8);
                if (!stale) break;
#pragma unroll
                for (int k = 0; k < PER; ++k)
                    if (sd_act_stale(w[k], t8)) w[k] = sd_act_load4(addr(unit(b, k), k));
            }
            SD_CLK_END(1);
        }
#pragma unroll
        for (int i = 0; i < PERU; ++i) {
            const u32 u = unit(b, i * PIECES);
            if (u >= (u32)NU) continue;
#if SD_Q4 && SD_ACT_PACK
            const uint4 p = w[2 * i], q = w[2 * i + 1];
            const float v[8] = {sd_act_val(p.x), sd_act_val(p.y), sd_act_val(p.z), sd_act_val(p.w),
                                sd_act_val(q.x), sd_act_val(q.y), sd_act_val(q.z), sd_act_val(q.w)};
            sd_put_unit(xs, u, v);
#else
            sd_put(xs, 4 * u, sd_act_val(w[i].x));
            sd_put(xs, 4 * u + 1, sd_act_val(w[i].y));
            sd_put(xs, 4 * u + 2, sd_act_val(w[i].z));
            sd_put(xs, 4 * u + 3, sd_act_val(w[i].w));
#endif
        }
    }
    sd_csync();
}

// SD_ATT_V16 (default): attention reads the cached K and V rows 16 bytes
// a load (were 8 for K, 2 for V: a 512-position head then took four
// rounds of dependent V loads a warp, now two): 8B Q4_0 +0.7%, llama-1b
// F16 +0.9% (bench/RESULTS.md, session 44). Tried and not kept: the
// attending blocks asking L2 for their K and V rows when their q|k|v
// product ends (level), as session 29 found at each layer's start.
// -DSD_ATT_V16=0 for A/B runs.
#ifndef SD_ATT_V16
#define SD_ATT_V16 1
#endif
constexpr int SD_KV_CH = 16 / (int)sizeof(kv_t);  // cache elements in 16 bytes
__device__ __forceinline__ void sd_kv16(uint4 w, float (&f)[SD_KV_CH]) {
    if constexpr (sizeof(kv_t) == 2) {
        const float4 a = f16x4_to_f32(make_uint2(w.x, w.y)), b = f16x4_to_f32(make_uint2(w.z, w.w));
        f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
        f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
    } else {
        f[0] = __uint_as_float(w.x), f[1] = __uint_as_float(w.y);
        f[2] = __uint_as_float(w.z), f[3] = __uint_as_float(w.w);
    }
}
// One (head, split)'s attention over positions [p0, p1) of pos + 1: the
// current position's k and v from the tagged words (rounded as the cache
// holds them), the rest from the cache. Writes (max, sum, values) as
// tagged words. Tried and not kept (bench/RESULTS.md, session 46): each
// thread's first K row held in registers from before the wait for the
// q|k|v words, and the values' first loads issued before the scores' max
// (8B Q4_0 -6%, -8%, both -14%: the registers they hold made ptxas spill
// across the kernel, 31 local-memory instructions to 120-265).
__device__ void sd_attend(const SdArgs& a, const SdLayer& L, u32 pos, u32 h, u32 s, const u64* X, u64* part,
                          u32 tag_qkv, u32 tag_att, float* sm) {
    const u32 kvh = h / (NH / NKV), kv = pos + 1;
    const u32 p0 = (u32)((u64)kv * s / SD_ATT_S), p1 = (u32)((u64)kv * (s + 1) / SD_ATT_S);
    float* q = sm;
    float* kcur = q + HD;
    float* vcur = kcur + HD;
    float* acc = vcur + HD;           // SD_CW x HD
    float* red = acc + SD_CW * HD;    // 2 SD_CW
    float* sc = red + 2 * SD_CW;      // the split's scores
    const u32 tid = threadIdx.x, warp = tid >> 5, lane = tid & 31u;
    const kv_t* K = L.k + (u64)kvh * a.capacity * HD;
    const kv_t* V = L.v + (u64)kvh * a.capacity * HD;
    for (u32 i = tid; i < 3 * HD; i += SD_CT) {
        if (i < HD) {
            const u64* qs = X + X_Q + h * HD + i;
            u64 w[1] = {tag_load(qs)};
            sd_poll(w, [&](int) { return qs; }, tag_qkv);
            q[i] = sd_val(w[0]) * a.scale;
        } else if (p1 == kv) {
            const u32 j = i - HD;
            const u64* src = X + (j < HD ? X_K : X_V) + kvh * HD + (j % HD);
            u64 w[1] = {tag_load(src)};
            sd_poll(w, [&](int) { return src; }, tag_qkv);
            (j < HD ? kcur : vcur)[j % HD] = kv_round(sd_val(w[0]));
        }
    }
    sd_csync();
    float mx = NEG_INF;
    for (u32 p = p0 + tid; p < p1; p += SD_CT) {
        float d = 0.0f;
        if (p == pos) {
#pragma unroll 8
            for (int i = 0; i < HD; ++i) d = fmaf(q[i], kcur[i], d);
        } else {
#if SD_ATT_V16
#pragma unroll
            for (int i = 0; i < HD; i += SD_KV_CH) {
                float f[SD_KV_CH];
                sd_kv16(*(const uint4*)(K + (u64)p * HD + i), f);
#pragma unroll
                for (int j = 0; j < SD_KV_CH; ++j) d = fmaf(q[i + j], f[j], d);
            }
#else
#pragma unroll
            for (int i = 0; i < HD; i += 4) {
                const float4 k4 = ld4_f32(K, (u64)p * HD + i);
                d = fmaf(q[i], k4.x, d);
                d = fmaf(q[i + 1], k4.y, d);
                d = fmaf(q[i + 2], k4.z, d);
                d = fmaf(q[i + 3], k4.w, d);
            }
#endif
        }
        sc[p - p0] = d;
        mx = fmaxf(mx, d);
    }
    mx = warp_max(mx);
    if (lane == 0) red[warp] = mx;
    sd_csync();
    float m = NEG_INF;
#pragma unroll
    for (int i = 0; i < SD_CW; ++i) m = fmaxf(m, red[i]);
    float lsum = 0.0f;
    for (u32 p = p0 + tid; p < p1; p += SD_CT) {
        const float e = __expf(sc[p - p0] - m);
        sc[p - p0] = e;
        lsum += e;
    }
    lsum = warp_sum(lsum);
    if (lane == 0) red[SD_CW + warp] = lsum;
    sd_csync();
#if SD_ATT_V16
    // Values in 16-byte pieces: a lane takes SD_KV_CH columns of a
    // position, LP lanes a position, a warp PPW positions a load and UNR
    // loads in flight; the lanes of the same columns are summed at the end.
    {
        constexpr int LP = HD / SD_KV_CH, PPW = 32 / LP, UNR = 8;
        static_assert(HD % SD_KV_CH == 0 && 32 % LP == 0, "whole 16-byte pieces, whole positions a warp");
        float o[SD_KV_CH] = {};
        const u32 pc = min(p1, pos);  // cached positions end here
        const u32 sub = lane / LP, col = (lane % LP) * SD_KV_CH;
        for (u32 b = p0 + warp * (PPW * UNR) + sub; b < pc + sub; b += SD_CW * PPW * UNR) {
            uint4 vv[UNR];
#pragma unroll
            for (int u = 0; u < UNR; ++u)
                vv[u] = *(const uint4*)(V + (u64)min(b + u * PPW, pc - 1) * HD + col);
#pragma unroll
            for (int u = 0; u < UNR; ++u) {
                const u32 p = b + u * PPW;
                const float e = p < pc ? sc[p - p0] : 0.0f;
                float f[SD_KV_CH];
                sd_kv16(vv[u], f);
#pragma unroll
                for (int j = 0; j < SD_KV_CH; ++j) o[j] = fmaf(e, f[j], o[j]);
            }
        }
#pragma unroll
        for (int off = LP; off < 32; off <<= 1)
#pragma unroll
            for (int j = 0; j < SD_KV_CH; ++j) o[j] += __shfl_xor_sync(0xffffffffu, o[j], off);
        if (sub == 0) {
            if (p1 == kv && warp == SD_CW - 1) {
                const float e = sc[pos - p0];
#pragma unroll
                for (int j = 0; j < SD_KV_CH; ++j) o[j] = fmaf(e, vcur[col + j], o[j]);
            }
#pragma unroll
            for (int j = 0; j < SD_KV_CH; ++j) acc[warp * HD + col + j] = o[j];
        }
    }
#else
    // Values: warp w takes positions p0 + 8w .. in groups of 8 (loads in
    // flight together), lane the columns VPL lane .. VPL lane + VPL - 1.
    constexpr int VPL = HD / 32, UNR = 8;
    float o[VPL] = {};
    const u32 pc = min(p1, pos);  // cached positions end here
    for (u32 b = p0 + warp * UNR; b < pc; b += SD_CW * UNR) {
        float vv[UNR][VPL];
#pragma unroll
        for (int u = 0; u < UNR; ++u)
#pragma unroll
            for (int j = 0; j < VPL; ++j) vv[u][j] = ld_f32(V, (u64)min(b + u, pc - 1) * HD + VPL * lane + j);
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
            const float e = b + u < pc ? sc[b + u - p0] : 0.0f;
#pragma unroll
            for (int j = 0; j < VPL; ++j) o[j] = fmaf(e, vv[u][j], o[j]);
        }
    }
    if (p1 == kv && warp == SD_CW - 1) {
        const float e = sc[pos - p0];
#pragma unroll
        for (int j = 0; j < VPL; ++j) o[j] = fmaf(e, vcur[VPL * lane + j], o[j]);
    }
#pragma unroll
    for (int j = 0; j < VPL; ++j) acc[warp * HD + VPL * lane + j] = o[j];
#endif
    sd_csync();
#if SD_O_UNITS
    // One split: the head's values divided by its sum, in unit order.
    if (tid < HD) {
        float v = 0.0f, ls = 0.0f;
#pragma unroll
        for (int w = 0; w < SD_CW; ++w) {
            v += acc[w * HD + tid];
            ls += red[SD_CW + w];
        }
        sd_h_store(part, h * HD + tid, v * (1.0f / ls), tag_att);
    }
#else
    u64* dst = part + ((u64)h * SD_ATT_S + s) * (HD + 2);
    if (tid < HD) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < SD_CW; ++w) v += acc[w * HD + tid];
        tag_store(dst + tid, v, tag_att);
    } else if (tid < HD + 2) {
        float ls = 0.0f;
#pragma unroll
        for (int w = 0; w < SD_CW; ++w) ls += red[SD_CW + w];
        tag_store(dst + tid, tid == HD ? (p1 > p0 ? m : 0.0f) : ls, tag_att);
    }
#endif
}

// Shared memory: the ring; x, the row partials and the attention scratch
// in SD_REGION floats (stream.rs `layout`: a product's input from the
// start, the partials of every product but down at SD_IMG, down's at FF,
// the attention scratch at SD_ATT_OFF, after q|k|v's partials); this
// block's h rows (64), reductions (64); then the ring's mbarriers and the
// warps' keys, then (SD_SAMPLED without SD_SAMP_OFF) the sampler's areas
// (pd_samp_areas; stream.rs computes the same size).
constexpr int SD_IMG = D > QD ? D : QD;
#if SD_SAMP_OFF
constexpr int SD_SAMP_SS = 2048;
#endif
static_assert(SD_ATT_OFF >= SD_IMG && SD_REGION >= FF, "stream.rs lays the scratch out");
extern "C" __global__ void __launch_bounds__(SD_THREADS, 1) k_stream_decode(SdArgs a) {
    extern __shared__ __align__(128) unsigned char smem[];
    SdRing r;
    r.buf = smem;
    float* xs = (float*)(smem + (u64)SD_NST * SD_STB);
    float* part = xs + SD_IMG;  // every product's but down's
    float* part_dn = xs + FF;
    float* att = xs + SD_ATT_OFF;
    float* hloc = xs + SD_REGION;
    float* red = hloc + 64;
    // The barriers' address through a move the compiler cannot see into:
    // with it a constant, ptxas spilled 136 bytes where it spills 8
    // (session 29's layout).
    u64* bars;
    asm("mov.b64 %0, %1;" : "=l"(bars) : "l"(((u64)(red + 64) + 7) & ~(u64)7));
    r.full = bars;
    r.empty = bars + SD_NST;
    // What follows the barriers: the warps' keys, the zeros that B reads of
    // lanes that feed no B land on (sd_consume), the sampler's areas.
    // Derived from the barriers' opaque address, the compiler loses their
    // shared space and reaches them by generic loads; addressed from smem,
    // ptxas spills more. Measured (bench/RESULTS.md, session 30): greedy
    // the same either way, the Q4_0 sampled module 0.6-2.3% faster
    // addressed from smem, the F16 one 0.8% slower; so only the Q4_0
    // sampled module takes that. -DSD_OPAQUE_TAIL=0/1 picks one for A/B
    // runs.
#if SD_OPAQUE_TAIL
    u64* keys = bars + 2 * SD_NST;  // SD_CW
#if SD_Q4
    uint4* zeros = (uint4*)(((u64)(keys + SD_CW) + 15) & ~(u64)15);
    u8* after = (u8*)(zeros + 32);
#else
    const uint4* zeros = nullptr;
    u8* after = (u8*)(keys + SD_CW);
#endif
#else
    // The offset of bars (red + 64, 8-aligned) as a constant, past the
    // barriers. bars keeps its own expression: taken from this constant it
    // changed both modules' code, which was measured as it is.
    constexpr u64 keys_off = (((u64)SD_NST * SD_STB + 4ull * (SD_REGION + 128) + 7) & ~7ull) + 8ull * 2 * SD_NST;
    u64* keys = (u64*)(smem + keys_off);  // SD_CW
#if SD_Q4
    uint4* zeros = (uint4*)(smem + ((keys_off + 8ull * SD_CW + 15) & ~15ull));
    u8* after = (u8*)(zeros + 32);
#else
    const uint4* zeros = nullptr;
    u8* after = smem + keys_off + 8ull * SD_CW;
#endif
#endif
    // The last token of the chain, once the consumers know it (a stop token
    // or the host's cancel): the producer issues nothing past it.
    __shared__ volatile u32 s_last;
    // The token's RoPE angles (model.cu's rope_cs), the same in every layer:
    // computed once a token, published by the first staging's barriers.
    __shared__ float2 s_rope[HD / 2];
#if SD_SAMPLED
    // The slice's best key, the penalty window's header, the token of the
    // pick.
    __shared__ u64 s_bkey;
    __shared__ u32 s_wstart, s_wn, s_token;
    // The tokens this launch chose, block by block in global memory after
    // the parts and candidates (stream.rs): in shared memory they would
    // cost a ring stage.
    u32* hist = (u32*)(a.s.samp + 2 * (u64)gridDim.x * (PD_PARTS + PD_CANDS)) + (u64)blockIdx.x * a.max_pos;
    const u32 per = (a.vocab + gridDim.x - 1) / gridDim.x;
#if SD_SAMP_OFF
    // The sampler's scalars and per-token areas in the scratch's span that
    // nothing uses from the last layer's down rows to the next token's
    // first staging (stream.rs `samp_window`), and the recent ids read
    // where the host wrote them (at most repeat_last_n a token): in
    // shared memory after the rest they cost llama-1b F16 a ring stage.
    static_assert(sizeof(PdSampShared) <= SD_SAMP_SS && SD_SAMP_OFF % 4 == 0 && SD_SAMP_OFF >= SD_IMG &&
                      4 * SD_SAMP_OFF + SD_SAMP_SS <= 4 * FF,
                  "stream.rs samp_window");
    PdSampShared& ss = *(PdSampShared*)(xs + SD_SAMP_OFF);
    PdSamp sp = pd_samp_areas((u8*)(xs + SD_SAMP_OFF) + SD_SAMP_SS, per, a.max_pos, hist);
    sp.rec = const_cast<u32*>(a.s.recent + 2);
#else
    // The sampler's scalars; its areas follow the rest.
    __shared__ PdSampShared ss;
    const PdSamp sp = pd_samp_areas(after, per, a.max_pos, hist);
#endif
    const bool pen = a.s.mode != PD_SAMPLE_GREEDY && a.s.penalty != 1.0f;
#endif

    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    Ctl* ctl = a.ctl;
    const u32 pos0 = ctl->pos0, tok0 = ctl->tok0, limit = min(ctl->limit, a.max_pos - pos0);
    if (threadIdx.x == 0) {
        for (int s = 0; s < SD_NST; ++s) {
            mbar_init(&r.full[s], 1);
            mbar_init(&r.empty[s], SD_CW);
        }
        s_last = 0xffffffffu;
#if SD_DIAG & 64
        sd_bt_on = 0;
#endif
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
#if SD_Q4
    if (threadIdx.x < 32) zeros[threadIdx.x] = make_uint4(0, 0, 0, 0);
#endif
#if SD_DIAG & 4
    if (threadIdx.x == 0) {
        sd_clk[0] = sd_clk[1] = sd_clk[2] = sd_pclk = 0;
        for (int i = 0; i < 20; ++i) sd_sec[i] = 0;
    }
    const long long clk0 = clock64();
    if (threadIdx.x == 0) sd_last = clk0;
#endif
    __syncthreads();

    if (warp == SD_CW) {
        // The producer: the chain's schedule of this block's rows.
        if (lane == 0) {
            const u64 policy = l2_evict_first_policy();
            u32 c = 0;
            bool ended = false;
#if SD_Q4
            for (u32 t = 0; t < limit && !ended; ++t) {
                for (u32 l = 0; l < a.nl && !ended; ++l) {
                    sd_produce<M_QKV>(a, l, r, t, c, ended, policy, &s_last);
                    sd_produce<M_O>(a, l, r, t, c, ended, policy, &s_last);
                    sd_produce<M_GU>(a, l, r, t, c, ended, policy, &s_last);
                    sd_produce<M_DN>(a, l, r, t, c, ended, policy, &s_last);
                }
                sd_produce<M_LOG>(a, a.nl, r, t, c, ended, policy, &s_last);
            }
#else
            auto issue = [&](u32 t, const unsigned char* s0, u32 b0, const unsigned char* s1, u32 b1, u32) {
                if (ended) return;
                const u32 s = c % SD_NST, n = c / SD_NST;
                if (n > 0) {
#if SD_DIAG & 4
                    const long long p0 = clock64();
#endif
                    // Wait for the stage, or for the chain to end before t.
                    while (!sd_mbar_done<false>(&r.empty[s], (n - 1) & 1u)) {
                        if (t > s_last) {
                            ended = true;
                            return;
                        }
                    }
#if SD_DIAG & 4
                    sd_pclk += (unsigned long long)(clock64() - p0);
#endif
                }
                if (t > s_last || !sd_cap_inflight(r.full, c, t, &s_last)) {
                    ended = true;
                    return;
                }
                mbar_expect_tx(&r.full[s], b0 + b1);
                bulk_copy_hint(r.buf + (u64)s * SD_STB, s0, b0, &r.full[s], policy);
                if (b1) bulk_copy_hint(r.buf + (u64)s * SD_STB + b0, s1, b1, &r.full[s], policy);
                ++c;
            };
            for (u32 t = 0; t < limit && !ended; ++t) {
                for (u32 l = 0; l < a.nl && !ended; ++l) {
                    const SdLayer& L = a.layers[l];
                    auto f = [&](const unsigned char* s0, u32 b0, const unsigned char* s1, u32 b1, u32 rows) {
                        issue(t, s0, b0, s1, b1, rows);
                    };
                    sd_chunks<M_QKV>(a, L, f);
                    sd_chunks<M_O>(a, L, f);
                    sd_chunks<M_GU>(a, L, f);
                    sd_chunks<M_DN>(a, L, f);
                }
                sd_chunks<M_LOG>(a, a.layers[0], [&](const unsigned char* s0, u32 b0, const unsigned char* s1,
                                                     u32 b1, u32 rows) { issue(t, s0, b0, s1, b1, rows); });
            }
#endif
            // Every copy issued lands before the block exits (its shared
            // memory must not be written after that): the last SD_NST.
            for (u32 k = c > SD_NST ? c - SD_NST : 0; k < c; ++k) mbar_wait(&r.full[k % SD_NST], (k / SD_NST) & 1u);
#if SD_DIAG & 4
            printf("sd_clk P %u %llu %llu\n", blockIdx.x, sd_pclk, (unsigned long long)(clock64() - clk0));
#endif
        }
        return;
    }

    // The consumers.
#if SD_SAMPLED
    // The penalty window's recent ids, copied once (published by the first
    // layer's barriers); the host wrote them before the launch.
    if (pen) {
        const u32 nr = min(__ldg(a.s.recent + 1), a.s.recent_capacity);
        if (threadIdx.x == 0) {
            s_wstart = __ldg(a.s.recent);
            s_wn = nr;
        }
#if !SD_SAMP_OFF
        for (u32 i = threadIdx.x; i < nr; i += SD_CT) sp.rec[i] = __ldg(a.s.recent + 2 + i);
#endif
    }
#endif
    u32 c = 0;
    u32 h0, h1;
    sd_range(D, h0, h1);  // this block's h rows (o and down)
    u32 token = __ldcg(a.conveyor + tok0);
    const u32 xw = SD_XW;
    for (u32 t = 0; t < limit; ++t) {
        const u32 pos = pos0 + t;
        for (u32 i = h0 + threadIdx.x; i < h1; i += SD_CT) hloc[i - h0] = sd_emb(a.emb, a.vocab, token, i);
        if (threadIdx.x < HD / 2) {
            float cs, sn;
            rope_cs(pos, threadIdx.x, HD, a.theta, a.freq_scale, a.freq, cs, sn);
            s_rope[threadIdx.x] = make_float2(cs, sn);
        }
        SD_MARK(14);
        for (u32 l = 0; l < a.nl; ++l) {
            const SdLayer& L = a.layers[l];
            const u32 gl = t * a.nl + l;
            u64* X = a.x + (u64)(gl & 1u) * xw;
#if SD_DIAG & 64
            if (threadIdx.x == 0) {
                sd_bt_on = t == SD_BT_TOKEN && l == SD_BT_LAYER;
                if (sd_bt_on) sd_bt[13] = globaltimer_ns();
            }
#endif
            // q|k|v: the norm of h, the rows, RoPE, K and V into the cache.
            if (l == 0)
                sd_stage_norm(xs, red, nullptr, 0, a, token, L.attn_norm, a.eps);
            else
                sd_stage_norm(xs, red, a.x + (u64)((gl - 1) & 1u) * xw + X_HD, sd_tag(t, a.nl, l - 1, 4), a, 0,
                              L.attn_norm, a.eps);
            SD_MARK(0);
            sd_consume<M_QKV>(a, L, r, xs, part, c, zeros);
            SD_MARK(1);
            {
                u32 u0, u1;
                sd_range(QKV / 2, u0, u1);
                const u32 tg = sd_tag(t, a.nl, l, 0);
                for (u32 i = threadIdx.x; i < u1 - u0; i += SD_CT) {
                    const u32 row = 2 * (u0 + i);
                    float y0 = sd_row_sum(part, 2 * i), y1 = sd_row_sum(part, 2 * i + 1);
                    if (row < (u32)(QD + KVD)) {
                        const float2 cs = s_rope[(row % HD) / 2];
                        const float x0 = y0, x1 = y1;
                        rope_rotate(x0, x1, cs.x, cs.y, y0, y1);
                    }
                    // q, k and v words follow each other as the rows do.
                    tag_store(X + X_Q + row, y0, tg);
                    tag_store(X + X_Q + row + 1, y1, tg);
                    if (row >= (u32)QD) {
                        const bool isk = row < (u32)(QD + KVD);
                        const u32 rr = row - QD - (isk ? 0 : KVD);
                        kv_put2(isk ? L.k : L.v, ((u64)(rr / HD) * a.capacity + pos) * HD + rr % HD, y0, y1);
                    }
                }
            }
            SD_MARK(2);
            // Attention: blocks below NH * SD_ATT_S take one (head, split).
            if (blockIdx.x < NH * SD_ATT_S)
                sd_attend(a, L, pos, blockIdx.x / SD_ATT_S, blockIdx.x % SD_ATT_S, X, X + X_PART,
                          sd_tag(t, a.nl, l, 0), sd_tag(t, a.nl, l, 1), att);
            SD_MARK(3);
            // o: h += Wo att.
            sd_stage_attn(xs, X + X_PART, sd_tag(t, a.nl, l, 1));
            SD_MARK(4);
            sd_consume<M_O>(a, L, r, xs, part, c, zeros);
            SD_MARK(5);
            {
                const u32 tg = sd_tag(t, a.nl, l, 2);
                for (u32 i = threadIdx.x; i < h1 - h0; i += SD_CT) {
                    hloc[i] += sd_row_sum(part, i);
                    sd_h_store(X + X_HO, h0 + i, hloc[i], tg);
                }
            }
            SD_MARK(6);
            // gate|up: the norm of h, SiLU(gate) * up.
            sd_stage_norm(xs, red, X + X_HO, sd_tag(t, a.nl, l, 2), a, 0, L.ffn_norm, a.eps);
            SD_MARK(7);
            sd_consume<M_GU>(a, L, r, xs, part, c, zeros);
            SD_MARK(8);
            {
                using T = Mat<M_GU>;
                u32 u0, u1;
                sd_range(FF, u0, u1);
                const u32 tg = sd_tag(t, a.nl, l, 3);
                for (u32 i = threadIdx.x; i < u1 - u0; i += SD_CT) {
#if SD_Q4
                    // The gate rows, then the up rows (sd_segs).
                    const float g = sd_row_sum(part, i), u = sd_row_sum(part, u1 - u0 + i);
#else
                    // Chunk ci holds n gate rows, then their n up rows.
                    const u32 ci = i / T::UPC, j = i % T::UPC, n = min((u32)T::UPC, u1 - u0 - ci * T::UPC);
                    const float g = sd_row_sum(part, ci * T::RPC + j), u = sd_row_sum(part, ci * T::RPC + n + j);
#endif
                    sd_act_store((u32*)(X + X_ACT) + u0 + i, g / (1.0f + __expf(-g)) * u, tg);
                }
            }
            sd_csync();  // down's input lies over these partials
            SD_MARK(9);
            // down: h += Wd act.
            sd_stage_act(xs, (const u32*)(X + X_ACT), sd_tag(t, a.nl, l, 3));
            SD_MARK(10);
            sd_consume<M_DN>(a, L, r, xs, part_dn, c, zeros);
            SD_MARK(11);
            {
                const u32 tg = sd_tag(t, a.nl, l, 4);
                for (u32 i = threadIdx.x; i < h1 - h0; i += SD_CT) {
                    hloc[i] += sd_row_sum(part_dn, i);
                    sd_h_store(X + X_HD, h0 + i, hloc[i], tg);
                }
            }
            SD_MARK(12);
        }
        // Logits: the output norm, this block's rows, its best; block 0
        // also hands on the host's cancel word. With the sampler, the
        // repetition penalty applies to each logit of the window's tokens,
        // and DENSE and TOPK keep the slice's logits (sp.lg) for the part
        // this block publishes before its flag.
        u64* bset = a.best + (u64)(t & 1u) * (gridDim.x + 1);
        u32 done = 0;
        if (blockIdx.x == 0 && threadIdx.x == 0) done = *(volatile const u32*)&ctl->done;
        u32 v0, v1;
        sd_range(a.vocab, v0, v1);
#if SD_SAMPLED
        const u32 sbase = a.s.mode >= PD_SAMPLE_DENSE ? position_base(a.s.seed_lo, a.s.seed_hi, pos + 1) : 0u;
        // Two sets of parts, by the token's parity, as the bests.
        u64* sset = a.s.samp + (u64)(t & 1u) * gridDim.x * (PD_PARTS + PD_CANDS);
        if (pen) pd_window_mask<SdCfg>(sp, a.s, v0, v1 - v0, pos + 1, t, tok0, s_wstart, s_wn);
#endif
        sd_stage_norm(xs, red, a.x + (u64)((t * a.nl + a.nl - 1) & 1u) * xw + X_HD, sd_tag(t, a.nl, a.nl - 1, 4), a,
                      0, a.out_norm, a.eps);
        sd_consume<M_LOG>(a, a.layers[0], r, xs, part, c, zeros);
        SD_MARK(13);
        {
            u64 k = 0;
            for (u32 i = threadIdx.x; i < v1 - v0; i += SD_CT) {
                float l = sd_row_sum(part, i);
#if SD_SAMPLED
                if (pen && ((sp.mask[i >> 5] >> (i & 31)) & 1u)) l = pd_penalised(l, a.s.penalty);
                if (a.s.mode >= PD_SAMPLE_DENSE) sp.lg[i] = l;
#endif
                k = max(k, pd_key(l, v0 + i));
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) k = max(k, __shfl_xor_sync(0xffffffffu, k, o));
            if (lane == 0) keys[warp] = k;
#if SD_SAMPLED
            // The part's selection fields, published by this barrier.
            if (a.s.mode == PD_SAMPLE_TOPK) pd_select_begin(ss);
#endif
            sd_csync();
            if (threadIdx.x == 0) {
                u64 b = 0;
                for (int i = 0; i < SD_CW; ++i) b = max(b, keys[i]);
                bset[blockIdx.x] = b;
                if (blockIdx.x == 0) bset[gridDim.x] = done;
#if SD_SAMPLED
                s_bkey = b;
#else
                __threadfence();
                asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(a.flags + blockIdx.x), "r"(t + 1)
                             : "memory");
#endif
            }
#if SD_SAMPLED
            if (a.s.mode >= PD_SAMPLE_DENSE) {
                sd_csync();
                pd_sample_publish<SdCfg>(sp, ss, a.s, sset, v0, v1 - v0, s_bkey, sbase);
            }
            // Every thread's writes of the part, then the flag.
            sd_csync();
            if (threadIdx.x == 0) {
                __threadfence();
                asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(a.flags + blockIdx.x), "r"(t + 1)
                             : "memory");
            }
#endif
        }
        // The token: every block takes the argmax of the bests (their flags
        // also publish the K/V rows they wrote), so that all agree on it
        // and on stopping.
        if (threadIdx.x < gridDim.x) {
            u32 f;
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(f) : "l"(a.flags + threadIdx.x) : "memory");
            } while (f < t + 1);
        }
        sd_csync();
        u32 cancel = (u32)__ldcg(bset + gridDim.x);
#if SD_SAMPLED
        if (a.s.mode >= PD_SAMPLE_DENSE) {
            // The sampler's pick from every block's part (warp 0 has it).
            const u32 tok = pd_sample_pick<SdCfg>(sp, ss, a.s, sset, sbase);
            if (threadIdx.x == 0) {
                s_token = tok;
                sp.hist[t] = tok;
            }
            sd_csync();
            token = s_token;
        } else
#endif
        {
            u64 k = 0;
            for (u32 i = threadIdx.x; i < gridDim.x; i += SD_CT) k = max(k, __ldcg(bset + i));
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) k = max(k, __shfl_xor_sync(0xffffffffu, k, o));
            if (lane == 0) keys[warp] = k;
            sd_csync();
            u64 b = 0;
#pragma unroll
            for (int i = 0; i < SD_CW; ++i) b = max(b, keys[i]);
            token = 0xffffffffu - (u32)b;
#if SD_SAMPLED
            if (pen && threadIdx.x == 0) sp.hist[t] = token;
#endif
        }
        // The token goes to the host from the last block.
        if (blockIdx.x == gridDim.x - 1 && threadIdx.x == 0) publish_token(a.conveyor, tok0 + 1 + t, token, ctl);
        bool stop = cancel != 0u || t + 1 >= limit;
        const u32 ns = min(ctl->n_stop, (u32)MAX_STOP);
        for (u32 j = 0; j < ns; ++j) stop |= ctl->stop[j] == token;
        if (stop) {
            if (threadIdx.x == 0) s_last = t;
#if SD_DIAG & 64
            if (threadIdx.x == 0 && t >= SD_BT_TOKEN)
                printf("sd_bt %u %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu\n", blockIdx.x,
                       sd_bt[13], sd_bt[0], sd_bt[1], sd_bt[2], sd_bt[3], sd_bt[4], sd_bt[5], sd_bt[6], sd_bt[7],
                       sd_bt[8], sd_bt[9], sd_bt[10], sd_bt[11], sd_bt[12]);
#endif
#if SD_DIAG & 4
            if (threadIdx.x == 0) {
                printf("sd_clk C %u %llu %llu %llu %u %llu %u\n", blockIdx.x, sd_clk[0], sd_clk[1],
                       (unsigned long long)(clock64() - clk0), t + 1, sd_clk[2], c);
                printf("sd_sec %u %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu\n",
                       blockIdx.x, sd_sec[0], sd_sec[1], sd_sec[2], sd_sec[3], sd_sec[4], sd_sec[5], sd_sec[6],
                       sd_sec[7], sd_sec[8], sd_sec[9], sd_sec[10], sd_sec[11], sd_sec[12], sd_sec[13], sd_sec[14]);
                printf("sd_loop %u %llu %llu %llu %llu %llu\n", blockIdx.x, sd_sec[15], sd_sec[16], sd_sec[17],
                       sd_sec[18], sd_sec[19]);
            }
#endif
            break;
        }
        sd_csync();  // keys are read before the next token writes them
    }
}
