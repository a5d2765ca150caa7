// How the SM's instruction caches treat straight-line code of growing size
// (the persistent decode kernel runs ~100-190 KB of code a token, its
// sampler's steps once each): 132 blocks of 12 warps, as that kernel, each
// warp running N distinct FMAs (8 independent chains) several times over;
// block 0 prints the cycles of each pass, so the first (cold) pass and the
// later ones show what a line of code costs when it is not cached.
// Run: scripts/gpu.sh run icache (nvcc -O3 -arch=sm_90, then the binary).
#include <cstdio>

#define F(i) asm volatile("fma.rn.f32 %0, %0, %1, %2;" : "+f"(a##i) : "f"(b), "f"(c));
#define S8 F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7)
#define X2(x) x x
#define X4(x) X2(X2(x))
#define X8(x) X2(X4(x))
#define B64 X8(S8)
#define B512 X8(B64)
#define B1K X2(B512)
#define B2K X4(B512)
#define B4K X8(B512)
#define B8K X2(B4K)
#define B16K X4(B4K)

constexpr int PASSES = 5;

#define KERN(name, BODY)                                                              \
    __global__ void name(float* out, long long* cyc) {                              \
        float a0 = threadIdx.x, a1 = a0 + 1, a2 = a0 + 2, a3 = a0 + 3, a4 = a0 + 4, \
              a5 = a0 + 5, a6 = a0 + 6, a7 = a0 + 7;                                \
        const float b = out[0], c = out[1];                                          \
        for (int p = 0; p < PASSES; ++p) {                                           \
            __syncthreads();                                                         \
            const long long t0 = clock64();                                          \
            BODY                                                                     \
            __syncthreads();                                                         \
            if (threadIdx.x == 0) cyc[blockIdx.x * PASSES + p] = clock64() - t0;     \
        }                                                                            \
        out[2 + blockIdx.x * blockDim.x + threadIdx.x] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7; \
    }

KERN(k512, B512)
KERN(k1k, B1K)
KERN(k2k, B2K)
KERN(k4k, B4K)
KERN(k8k, B8K)
KERN(k16k, B16K)

int main() {
    const int blocks = 132, threads = 384;
    float* out;
    long long* cyc;
    cudaMalloc(&out, (2 + blocks * threads) * sizeof(float));
    cudaMemset(out, 0, (2 + blocks * threads) * sizeof(float));
    cudaMalloc(&cyc, blocks * PASSES * sizeof(long long));
    long long h[blocks * PASSES];
    struct K { void (*f)(float*, long long*); int n; };
    const K ks[] = {{k512, 512}, {k1k, 1024}, {k2k, 2048}, {k4k, 4096}, {k8k, 8192}, {k16k, 16384}};
    for (const K& k : ks) {
        for (int rep = 0; rep < 2; ++rep) {
            k.f<<<blocks, threads>>>(out, cyc);
            cudaDeviceSynchronize();
        }
        cudaMemcpy(h, cyc, sizeof h, cudaMemcpyDeviceToHost);
        printf("N=%5d instructions (%4d KB):", k.n, k.n * 16 / 1024);
        for (int p = 0; p < PASSES; ++p) printf(" pass%d %lld (%.2f cyc/instr)", p, h[p], (double)h[p] / k.n);
        printf("\n");
    }
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) printf("error: %s\n", cudaGetErrorString(e));
    return 0;
}
