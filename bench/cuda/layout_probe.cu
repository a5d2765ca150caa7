// Load-only probe of decode-gemv weight layouts (issue 5): does the order in
// which a warp's 16-row tile is stored change the bandwidth a tensor-core
// gemv's loads can reach? Build and run on the GPU machine:
//   nvcc -O3 -arch=sm_90 -o /tmp/probe bench/cuda/layout_probe.cu && /tmp/probe
// Pattern 0 ("rows"): the current repacked layout, quants row-major then
// scales; lane (g, t) reads lane-block 4*grp + t of rows g and g + 8.
// Pattern 1 ("tiles"): each group (16 rows x 4 lane-blocks, quants then
// scales) contiguous, in the order the lanes read it: every load of a warp
// is one contiguous 512-byte (or 128-byte) span.
// Pattern 2 ("gmaj"): the same group blocks stored group-major (group g of
// every tile, then group g + 1): the warps that run together read one
// contiguous front instead of one stream each.
// Pattern 3 ("rowsh"): pattern 0 with the engine's `L2::128B` weight loads.
// "stream": a plain grid-stride read of the same bytes, for the ceiling.
#include <cstdio>
#include <cstdint>
#include <vector>
#include <cuda_runtime.h>
typedef uint32_t u32;
typedef uint64_t u64;

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

template <int QB, int SB> struct W {
    uint4 q[2][QB / 16];
    u32 sc[2];
};

__device__ __forceinline__ uint4 ld128(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

template <int PAT, int QB, int SB>
__device__ __forceinline__ void load(W<QB, SB>& w, const uint8_t* base, u32 R, u32 n_lb, u32 tile, u32 grp, u32 lane) {
    const u32 g = lane >> 2, t = lane & 3;
    if (PAT == 0 || PAT == 3) {
        const u64 r0 = tile * 16 + g, r1 = r0 + 8, lb = grp * 4 + t;
        const uint4* a = (const uint4*)(base + (r0 * n_lb + lb) * QB);
        const uint4* c = (const uint4*)(base + (r1 * n_lb + lb) * QB);
#pragma unroll
        for (int i = 0; i < QB / 16; ++i) {
            w.q[0][i] = PAT == 3 ? ld128(a + i) : a[i];
            w.q[1][i] = PAT == 3 ? ld128(c + i) : c[i];
        }
        if (SB) {
            const uint8_t* s = base + (u64)R * n_lb * QB;
            w.sc[0] = *(const unsigned short*)(s + (r0 * n_lb + lb) * SB);
            w.sc[1] = *(const unsigned short*)(s + (r1 * n_lb + lb) * SB);
        }
    } else {
        const u64 G = PAT == 1 ? (u64)tile * (n_lb / 4) + grp : (u64)grp * (R / 16) + tile;
        const u64 gbytes = 16 * 4 * (QB + SB);
        const uint4* a = (const uint4*)(base + G * gbytes);
#pragma unroll
        for (int i = 0; i < QB / 16; ++i) { w.q[0][i] = a[(2 * i) * 32 + lane]; w.q[1][i] = a[(2 * i + 1) * 32 + lane]; }
        if (SB) {
            const u32 s = ((const u32*)(base + G * gbytes + 16 * 4 * QB))[lane];
            w.sc[0] = s & 0xffff; w.sc[1] = s >> 16;
        }
    }
}

template <int QB, int SB>
__device__ __forceinline__ u32 use(const W<QB, SB>& w) {
    u32 h = w.sc[0] ^ w.sc[1];
#pragma unroll
    for (int i = 0; i < QB / 16; ++i)
        h += (w.q[0][i].x ^ w.q[1][i].y) + (w.q[0][i].z ^ w.q[1][i].w) + (w.q[0][i].y ^ w.q[1][i].x) + (w.q[0][i].w ^ w.q[1][i].z);
    return h;
}

// S warps split each tile's groups; 8 / S tiles per block; D groups in flight per warp.
template <int PAT, int QB, int SB, int D, int MINB>
__global__ void __launch_bounds__(256, MINB) probe(const uint8_t* base, u32 R, u32 K, u32 S, u32* out) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 LB = QB == 32 && SB == 0 ? 16 : 32;
    const u32 n_lb = K / LB, ng = n_lb / 4, n_tiles = R / 16;
    const u32 tpb = 8 / S, my_tile = warp / S, split = warp % S;
    const u32 n_rg = (n_tiles + tpb - 1) / tpb;
    const u32 my_n = (ng - split + S - 1) / S;
    u32 h = 0;
    W<QB, SB> w[D];
    for (u32 rg = blockIdx.x; rg < n_rg; rg += gridDim.x) {
        const u32 tile = rg * tpb + my_tile;
        if (tile >= n_tiles) continue;
#pragma unroll
        for (u32 u = 0; u < D; ++u) if (u < my_n) load<PAT>(w[u], base, R, n_lb, tile, split + u * S, lane);
        for (u32 n0 = 0; n0 < my_n; n0 += D) {
#pragma unroll
            for (u32 u = 0; u < D; ++u) {
                const u32 n = n0 + u;
                if (n < my_n) {
                    h += use(w[u]);
                    if (n + D < my_n) load<PAT>(w[u], base, R, n_lb, tile, split + (n + D) * S, lane);
                }
            }
        }
    }
    if (h == 0x12345678u) out[0] = h;
}

__global__ void __launch_bounds__(256) stream(const uint4* p, size_t n, u32* out) {
    u32 h = 0;
    const size_t step = (size_t)gridDim.x * blockDim.x;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    for (; i + 3 * step < n; i += 4 * step) {
        uint4 a = p[i], b = p[i + step], c = p[i + 2 * step], d = p[i + 3 * step];
        h += a.x ^ b.y ^ c.z ^ d.w;
    }
    for (; i < n; i += step) h += p[i].x;
    if (h == 0x12345678u) out[0] = h;
}

void run_stream(uint8_t* pool, size_t pool_bytes, size_t bytes, u32 grid, u32* out) {
    const int copies = (int)(pool_bytes / bytes);
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    for (int i = 0; i < 8; ++i) stream<<<grid, 256>>>((const uint4*)(pool + (size_t)(i % copies) * bytes), bytes / 16, out);
    const int iters = 200;
    CK(cudaEventRecord(e0));
    for (int i = 0; i < iters; ++i) stream<<<grid, 256>>>((const uint4*)(pool + (size_t)(i % copies) * bytes), bytes / 16, out);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
    const double us = ms * 1000.0 / iters;
    printf("stream %9zu bytes grid=%4u: %7.2f us  %6.0f GB/s\n", bytes, grid, us, bytes / us / 1e3);
}

template <int PAT, int QB, int SB, int D, int MINB>
void run(const char* name, uint8_t* pool, size_t pool_bytes, u32 R, u32 K, u32 S, u32 grid_mult, u32* out, int sms) {
    const u32 LB = QB == 32 && SB == 0 ? 16 : 32;
    const size_t bytes = (size_t)R * (K / LB) * (QB + SB);
    const int copies = (int)(pool_bytes / bytes);
    const u32 n_tiles = R / 16, tpb = 8 / S, n_rg = (n_tiles + tpb - 1) / tpb;
    u32 grid = sms * grid_mult;
    if (grid > n_rg) grid = n_rg;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    for (int i = 0; i < 8; ++i) probe<PAT, QB, SB, D, MINB><<<grid, 256>>>(pool + (size_t)(i % copies) * bytes, R, K, S, out);
    const int iters = 200;
    CK(cudaEventRecord(e0));
    for (int i = 0; i < iters; ++i) probe<PAT, QB, SB, D, MINB><<<grid, 256>>>(pool + (size_t)(i % copies) * bytes, R, K, S, out);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
    const double us = ms * 1000.0 / iters;
    printf("%-6s %s R=%5u K=%5u S=%u D=%d minb=%d grid=%4u: %7.2f us  %6.0f GB/s\n", name, PAT == 3 ? "rowsh" : PAT == 2 ? "gmaj " : PAT ? "tiles" : "rows ", R, K, S, D, MINB, grid, us, bytes / us / 1e3);
}

int main() {
    int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const size_t pool_bytes = (size_t)1 << 30;
    uint8_t* pool; CK(cudaMalloc(&pool, pool_bytes));
    CK(cudaMemset(pool, 1, pool_bytes));
    u32* out; CK(cudaMalloc(&out, 4));
    struct Shape { u32 R, K; } shapes[] = {{28672, 4096}, {49152, 4096}, {4096, 14336}, {6144, 4096}, {4096, 4096}, {16384, 2048}, {2048, 8192}, {2048, 2048}};
    for (auto s : shapes) {
        const size_t q4 = (size_t)s.R * (s.K / 32) * 18, f16 = (size_t)s.R * s.K * 2;
        for (u32 m : {2u, 4u, 8u}) run_stream(pool, pool_bytes, q4, sms * m, out);
        for (u32 S : {1u, 2u, 4u, 8u}) {
            if ((s.K / 128) < S * 4) continue;
            run<0, 16, 2, 4, 2>("q4_0", pool, pool_bytes, s.R, s.K, S, 2, out, sms);
            run<1, 16, 2, 4, 2>("q4_0", pool, pool_bytes, s.R, s.K, S, 2, out, sms);
            run<2, 16, 2, 4, 2>("q4_0", pool, pool_bytes, s.R, s.K, S, 2, out, sms);
            run<3, 16, 2, 4, 2>("q4_0", pool, pool_bytes, s.R, s.K, S, 2, out, sms);
        }
        run<1, 16, 2, 4, 4>("q4_0", pool, pool_bytes, s.R, s.K, 1, 4, out, sms);
        run<1, 16, 2, 8, 2>("q4_0", pool, pool_bytes, s.R, s.K, 1, 2, out, sms);
        run<2, 16, 2, 8, 2>("q4_0", pool, pool_bytes, s.R, s.K, 1, 2, out, sms);
        run<2, 16, 2, 2, 2>("q4_0", pool, pool_bytes, s.R, s.K, 1, 2, out, sms);
        run_stream(pool, pool_bytes, f16, sms * 4, out);
        for (u32 S : {1u, 4u}) {
            run<0, 32, 0, 3, 2>("f16", pool, pool_bytes, s.R, s.K, S, 2, out, sms);
            run<1, 32, 0, 3, 2>("f16", pool, pool_bytes, s.R, s.K, S, 2, out, sms);
            run<2, 32, 0, 3, 2>("f16", pool, pool_bytes, s.R, s.K, S, 2, out, sms);
        }
        run<1, 32, 0, 6, 2>("f16", pool, pool_bytes, s.R, s.K, 1, 2, out, sms);
        run<1, 32, 0, 3, 4>("f16", pool, pool_bytes, s.R, s.K, 1, 4, out, sms);
    }
    // Device-to-device copy for the floor.
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    CK(cudaEventRecord(e0));
    for (int i = 0; i < 10; ++i) CK(cudaMemcpyAsync(pool + pool_bytes / 2, pool, pool_bytes / 2, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
    printf("d2d copy: %.0f GB/s (read + write)\n", 10.0 * pool_bytes / (ms * 1e-3) / 1e9);
    return 0;
}
