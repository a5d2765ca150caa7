// Standalone timing of the decode gemv kernels (issue 5): the engine's own
// kernel sources, launched the way crates/akunu-cuda/src/launch.rs launches
// them, on random weights of the big models' shapes, back to back with
// programmatic dependent launch as in a chunk graph. Compares the register
// form (k_gemv_tc_*) with the bulk-copy form (k_gemv_tcb_*) and checks that
// they agree. On the GPU machine:
//   nvcc -O3 -std=c++17 -arch=sm_90 --expt-relaxed-constexpr -o /tmp/gp bench/cuda/gemv_probe.cu && /tmp/gp
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include "../../crates/akunu-cuda/kernels/common.cuh"
#include "../../crates/akunu-cuda/kernels/model.cu"
#include "../../crates/akunu-cuda/kernels/gemv_tc.cu"

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

__global__ void fill_rand(u8* p, size_t n, u32 seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        u32 h = (u32)i * 2654435761u ^ seed;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
        p[i] = (u8)h;
    }
}
// f16 values in [-0.05, 0.05) (F16 weights) or (0.001, 0.02) (scales).
__global__ void fill_f16(u16* p, size_t n, u32 seed, int positive) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        u32 h = (u32)i * 2654435761u ^ seed;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
        const float u = (h & 0xffff) / 65536.0f;
        const float v = positive ? 0.001f + 0.019f * u : (u - 0.5f) * 0.1f;
        p[i] = __half_as_ushort(__float2half(v));
    }
}
__global__ void fill_x(float* p, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = sinf(0.37f * i + 0.1f);
}

typedef void (*Kern)(Bind, GemvParams, StepArg, GemvExtra);

// launch.rs `tcg_split`: rounds x (groups / S + 2), two blocks per SM.
static u32 tcg_split_host(u32 tiles, u32 groups, u32 sms) {
    u32 cap = 1;
    while (cap < groups && cap < 8) cap *= 2;
    u64 best = ~0ull;
    u32 bs = 1;
    for (u32 s = 1; s <= cap; s *= 2) {
        const u64 rounds = ((tiles + 8 / s - 1) / (8 / s) + 2 * sms - 1) / (2 * sms);
        const u64 cost = rounds * ((groups + s - 1) / s + 2);
        if (cost <= best) { best = cost; bs = s; }
    }
    return bs;
}

struct Res { double us; std::vector<float> out; };

static Res time_kernel(Kern f, u8* pool, size_t bytes, int copies, float* x, float* out, u32 R, u32 K, u32 dt,
                       u32 S, u32 smem, u32 sms, bool pdl) {
    CK(cudaFuncSetAttribute((const void*)f, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int occ = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, f, 256, smem));
    const u32 tiles = (R + 15) / 16, tpb = 8 / S, row_groups = (tiles + tpb - 1) / tpb;
    u32 grid = sms * occ;
    if (grid > row_groups) grid = row_groups;
    GemvParams p = {};
    p.k = K; p.x_stride = K; p.out_stride = R; p.n_seg = 1; p.n[0] = R; p.dtype[0] = dt;
    // The FFN's down products stage silu(gate) * up (PROBE_ACT=1), as the engine's act_down.
    if (getenv("PROBE_ACT")) { p.input_act = ACT_SWIGLU; p.x_stride = 2 * K; }
    StepArg a = {}; a.rows = 1;
    GemvExtra ex = {}; ex.tc_split = S;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid); cfg.blockDim = dim3(256); cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr; cfg.numAttrs = pdl ? 1 : 0;
    auto launch = [&](int i) {
        Bind b = {};
        b.p[0] = (char*)x; b.p[1] = (char*)out; b.p[2] = (char*)(pool + (size_t)(i % copies) * bytes);
        CK(cudaLaunchKernelEx(&cfg, f, b, p, a, ex));
    };
    for (int i = 0; i < 10; ++i) launch(i);
    CK(cudaDeviceSynchronize());
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    const int iters = 300;
    CK(cudaEventRecord(e0));
    for (int i = 0; i < iters; ++i) launch(i);
    CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
    Res r; r.us = ms * 1000.0 / iters;
    // Output of copy 0.
    launch(0);
    CK(cudaDeviceSynchronize());
    r.out.resize(R);
    CK(cudaMemcpy(r.out.data(), out, R * 4, cudaMemcpyDeviceToHost));
#ifdef TCB_TIMING
    if (smem > 100000) {  // the bulk-copy form: its phases, one isolated launch
        static u64 st[4096][4];
        CK(cudaMemcpyFromSymbol(st, tcb_stamps, sizeof(u64) * 4 * grid));
        u64 t0 = ~0ull;
        for (u32 i = 0; i < grid; ++i) t0 = st[i][0] < t0 ? st[i][0] : t0;
        double sum[4] = {0, 0, 0, 0}, mx[4] = {0, 0, 0, 0};
        for (u32 i = 0; i < grid; ++i)
            for (int j = 0; j < 4; ++j) {
                const double v = (st[i][j] - t0) / 1e3;
                sum[j] += v;
                mx[j] = v > mx[j] ? v : mx[j];
            }
        printf("      phases (us from the first block's start, mean / max over blocks): start %.2f/%.2f, "
               "waited %.2f/%.2f, staged %.2f/%.2f, end %.2f/%.2f\n",
               sum[0] / grid, mx[0], sum[1] / grid, mx[1], sum[2] / grid, mx[2], sum[3] / grid, mx[3]);
    }
#endif
    printf("    grid %u x 256 (occ %d), S %u, smem %u: %7.2f us %6.0f GB/s\n", grid, occ, S, smem, r.us, bytes / r.us / 1e3);
    return r;
}

int main(int argc, char** argv) {
    int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    // Arguments: [0 = plain launches] [shape substring] [Q4_0|F16]
    const bool pdl = !(argc > 1 && argv[1][0] == '0');
    const char* only_shape = argc > 2 ? argv[2] : nullptr;
    const char* only_type = argc > 3 ? argv[3] : nullptr;
    const size_t pool_bytes = (size_t)1 << 30;
    u8* pool; CK(cudaMalloc(&pool, pool_bytes));
    float *x, *out; CK(cudaMalloc(&x, 64 << 10 << 2)); CK(cudaMalloc(&out, 64 << 10 << 2));
    fill_x<<<64, 256>>>(x, 64 << 10);
    struct Shape { const char* name; u32 R, K; } shapes[] = {
        {"8b gate_up", 28672, 4096}, {"8b down", 4096, 14336}, {"8b qkv", 6144, 4096}, {"8b o", 4096, 4096},
        {"1b gate_up", 16384, 2048}, {"1b down", 2048, 8192}, {"1b qkv", 3072, 2048}, {"1b o", 2048, 2048},
        {"logits 49152x4096", 49152, 4096}};
    for (u32 dt : {(u32)DT_Q4_0, (u32)DT_F16}) {
        if (only_type && strcmp(only_type, dt == DT_F16 ? "F16" : "Q4_0") != 0) continue;
        for (auto s : shapes) {
            if (only_shape && !strstr(s.name, only_shape)) continue;
            const u32 LB = dt == DT_F16 ? 16 : 32, n_lb = s.K / LB, ng = (n_lb + 3) / 4;
            const size_t bytes = dt == DT_F16 ? (size_t)s.R * s.K * 2 : (size_t)s.R * (s.K / 32) * 18;
            int copies = (int)(pool_bytes / bytes);
            if (copies > 8) copies = 8;
            if (copies < 1) { printf("%s too big\n", s.name); continue; }
            for (int c = 0; c < copies; ++c) {
                u8* w = pool + (size_t)c * bytes;
                if (dt == DT_F16) fill_f16<<<1024, 256>>>((u16*)w, bytes / 2, 17 + c, 0);
                else {
                    const size_t qb = (size_t)s.R * (s.K / 32) * 16;
                    fill_rand<<<1024, 256>>>(w, qb, 17 + c);
                    fill_f16<<<1024, 256>>>((u16*)(w + qb), (bytes - qb) / 2, 91 + c, 1);
                }
            }
            CK(cudaDeviceSynchronize());
            const u32 IMG = 16 * (dt == DT_F16 ? 4 : 8);
            const u32 smem_img = ng * (IMG + 1) * 4;  // image and groups' sums of squares (launch.rs tcg_smem)
            const u32 tiles = (s.R + 15) / 16;
            printf("%s %s (%u x %u, %.1f MB): floor %.2f us at 4.2 TB/s\n", dt == DT_F16 ? "F16" : "Q4_0", s.name,
                   s.R, s.K, bytes / 1e6, bytes / 4.2e6);
            // PROBE_S=1|2|4|8 forces the register form's split (AKUNU_CUDA_TCG_SPLIT).
            const u32 S0 = getenv("PROBE_S") ? (u32)atoi(getenv("PROBE_S")) : tcg_split_host(tiles, ng, sms);
            printf("  register form\n");
            // As launch.rs: warps with 2+ rounds of groups take the unguarded instance.
            const bool full = (ng + S0 - 1) / S0 >= 2 * (dt == DT_F16 ? tcg_ahead<DT_F16>() : tcg_ahead<DT_Q4_0>());
            const Kern reg = dt == DT_F16 ? (full ? k_gemv_tcf_f16 : k_gemv_tc_f16)
                                          : (full ? k_gemv_tcf_q4_0 : k_gemv_tc_q4_0);
            printf("  (%s instance)\n", full ? "unguarded" : "guarded");
            Res r0 = time_kernel(reg, pool, bytes, copies, x, out, s.R, s.K,
                                 dt, S0, smem_img, sms, pdl);
            if (getenv("PROBE_NO_TCB")) continue;
            const u32 CG = TCB_QROW / (4 * (dt == DT_F16 ? 32 : 16));
            const u32 n_ch = (ng + CG - 1) / CG;
            const u32 stage = dt == DT_F16 ? TcbT<DT_F16>::STAGE : TcbT<DT_Q4_0>::STAGE;
            const u32 smem_b = ((smem_img + 127) & ~127u) + 8 * TCB_NST * stage;
            printf("  bulk-copy form (chunk %u groups, %u chunks a row, stage %u B)\n", CG, n_ch, stage);
            for (u32 S : {1u, 2u, 4u, 8u}) {
                if (S > n_ch) break;
                Res r1 = time_kernel(dt == DT_F16 ? k_gemv_tcb_f16 : k_gemv_tcb_q4_0, pool, bytes, copies, x, out, s.R,
                                     s.K, dt, S, smem_b, sms, pdl);
                double md = 0, mx = 0;
                for (u32 i = 0; i < s.R; ++i) {
                    md = fmax(md, fabs((double)r1.out[i] - r0.out[i]));
                    mx = fmax(mx, fabs((double)r0.out[i]));
                }
                if (md > 1e-5 * mx || std::isnan(md)) printf("      MISMATCH: max diff %.3g of max %.3g\n", md, mx);
            }
        }
    }
    printf("max abs diffs within 1e-5 of the largest output unless MISMATCH is printed\n");
    return 0;
}
