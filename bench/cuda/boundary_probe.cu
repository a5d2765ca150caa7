// What a dependent step costs at a kernel boundary, against a grid barrier
// inside one persistent kernel (issue 5: the lead for latency-bound decode).
// Build and run on the GPU machine:
//   nvcc -O3 -arch=sm_90 -o /tmp/bp bench/cuda/boundary_probe.cu && /tmp/bp
//
// Every form runs STEPS dependent steps. A step reads W bytes of "weights"
// (a slice of a 96 MB buffer, more than the 60 MB L2, so it streams from
// DRAM as a decode product does), then reads the previous step's output
// (every block reads 256 values that all blocks wrote) and writes its own.
// So no step can finish before the one before it, as in a decode token.
//   graph+pdl: one kernel per step, captured in a CUDA graph with
//              programmatic dependent launch; the weights are read before
//              griddepcontrol.wait, as the engine's gemv issues its first
//              weight loads before the wait.
//   graph:     the same without PDL (each kernel starts after the last ends).
//   persistent: one cooperative kernel; steps are separated by a grid
//              barrier (one arrive counter and a generation word). The
//              weights of step s + 1 are requested before the barrier that
//              ends step s, the counterpart of PDL's early weight loads.
//   mono:      the same with a lighter barrier (a monotonic counter: one
//              release reduction per block, acquire polling).
// Printed: microseconds per step (median of 5 runs of the whole sequence).
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <cuda_runtime.h>
typedef uint32_t u32;

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

constexpr u32 THREADS = 256;
constexpr size_t WBUF = 96u << 20;

// Sum of this block's share of the step's weight slice (n4 float4s).
__device__ __forceinline__ float read_weights(const float4* __restrict__ w, u32 n4) {
    float acc = 0.0f;
    for (u32 i = blockIdx.x * THREADS + threadIdx.x; i < n4; i += gridDim.x * THREADS) {
        const float4 v = __ldg(w + i);
        acc += (v.x + v.y) + (v.z + v.w);
    }
    return acc;
}

// The dependent part of a step: read 256 of the previous step's values
// (written by every block), write this block's.
__device__ __forceinline__ void exchange(const float* in, float* out, float acc, u32 n) {
    const float s = in[(threadIdx.x * 37 + blockIdx.x) % n];
    out[blockIdx.x * THREADS + threadIdx.x] = acc * 1e-30f + s + 1.0f;
}

__global__ void __launch_bounds__(THREADS) k_step(const float* in, float* out, const float4* w, u32 n4, u32 n) {
    const float acc = read_weights(w, n4);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
    exchange(in, out, acc, n);
}

__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void grid_barrier(u32* count, u32* gen) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 g = ld_acquire(gen);
        __threadfence();
        if (atomicAdd(count, 1u) == gridDim.x - 1) {
            *count = 0;
            __threadfence();
            asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(gen), "r"(g + 1) : "memory");
        } else {
            while (ld_acquire(gen) == g) {
            }
        }
    }
    __syncthreads();
}

// The lighter barrier: a monotonic arrive counter (never reset) that each
// block's thread 0 bumps with a release reduction and then polls with
// acquire loads until every block of this step has arrived.
__device__ __forceinline__ void grid_barrier_mono(u32* count, u32 target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(count) : "memory");
        while (ld_acquire(count) < target) {
        }
    }
    __syncthreads();
}

template <bool MONO>
__global__ void __launch_bounds__(THREADS) k_persistent(float* a, float* b, const float4* w, u32 n4, u32 steps,
                                                        u32 n, u32* count, u32* gen) {
    const u32 slices = (u32)(WBUF / 16 / (n4 ? n4 : 1));
    float acc = read_weights(w, n4);
    for (u32 s = 0; s < steps; ++s) {
        const float* in = (s & 1) ? b : a;
        float* out = (s & 1) ? a : b;
        exchange(in, out, acc, n);
        // The next step's weights do not depend on this step: read them
        // before the barrier.
        acc = s + 1 < steps ? read_weights(w + (size_t)((s + 1) % slices) * n4, n4) : 0.0f;
        if (MONO) grid_barrier_mono(count, (s + 1) * gridDim.x);
        else grid_barrier(count, gen);
    }
}

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main() {
    int dev = 0, sms = 0;
    CK(cudaSetDevice(dev));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    printf("%s, %d SMs\n", prop.name, sms);
    const u32 STEPS = 1000;
    float4* w;
    CK(cudaMalloc(&w, WBUF));
    CK(cudaMemset(w, 0, WBUF));
    u32 *count, *gen;
    CK(cudaMalloc(&count, 8));
    gen = count + 1;
    CK(cudaMemset(count, 0, 8));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k_persistent<false>, THREADS, 0));
    printf("persistent kernel: %d blocks of %u threads per SM fit\n", per_sm, THREADS);
    printf("%-8s %-10s %12s %12s %12s %12s\n", "blocks", "bytes/step", "graph+pdl", "graph", "persistent", "mono");
    for (u32 blocks : {(u32)sms, 2u * sms}) {
        const u32 n = blocks * THREADS;
        float *a, *b;
        CK(cudaMalloc(&a, n * 4));
        CK(cudaMalloc(&b, n * 4));
        CK(cudaMemset(a, 0, n * 4));
        CK(cudaMemset(b, 0, n * 4));
        for (size_t bytes : {(size_t)0, (size_t)512 << 10, (size_t)2 << 20}) {
            const u32 n4 = (u32)(bytes / 16);
            const u32 slices = bytes ? (u32)(WBUF / bytes) : 1;
            float us[4];
            for (int form = 0; form < 2; ++form) {
                cudaGraph_t g;
                cudaGraphExec_t ge;
                CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
                for (u32 s = 0; s < STEPS; ++s) {
                    cudaLaunchConfig_t cfg = {};
                    cfg.gridDim = dim3(blocks);
                    cfg.blockDim = dim3(THREADS);
                    cfg.stream = st;
                    cudaLaunchAttribute at[1];
                    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                    at[0].val.programmaticStreamSerializationAllowed = 1;
                    cfg.attrs = at;
                    cfg.numAttrs = form == 0 ? 1 : 0;
                    const float* in = (s & 1) ? b : a;
                    float* out = (s & 1) ? a : b;
                    CK(cudaLaunchKernelEx(&cfg, k_step, in, out, (const float4*)(w + (size_t)(s % slices) * n4), n4, n));
                }
                CK(cudaStreamEndCapture(st, &g));
                CK(cudaGraphInstantiate(&ge, g, 0));
                CK(cudaGraphLaunch(ge, st));  // warm-up
                std::vector<float> t;
                for (int r = 0; r < 5; ++r) {
                    CK(cudaEventRecord(e0, st));
                    CK(cudaGraphLaunch(ge, st));
                    CK(cudaEventRecord(e1, st));
                    CK(cudaEventSynchronize(e1));
                    float ms;
                    CK(cudaEventElapsedTime(&ms, e0, e1));
                    t.push_back(ms * 1000.0f / STEPS);
                }
                us[form] = median(t);
                CK(cudaGraphExecDestroy(ge));
                CK(cudaGraphDestroy(g));
            }
            for (int mono = 0; mono < 2; ++mono) {
                us[2 + mono] = -1.0f;
                if ((u32)per_sm * sms < blocks) continue;
                u32 steps = STEPS;
                void* args[] = {&a, &b, &w, (void*)&n4, &steps, (void*)&n, &count, &gen};
                std::vector<float> t;
                for (int r = 0; r < 6; ++r) {
                    CK(cudaMemsetAsync(count, 0, 8, st));
                    CK(cudaEventRecord(e0, st));
                    CK(cudaLaunchCooperativeKernel(mono ? (void*)k_persistent<true> : (void*)k_persistent<false>,
                                                   blocks, THREADS, args, 0, st));
                    CK(cudaEventRecord(e1, st));
                    CK(cudaEventSynchronize(e1));
                    float ms;
                    CK(cudaEventElapsedTime(&ms, e0, e1));
                    if (r > 0) t.push_back(ms * 1000.0f / STEPS);  // the first is a warm-up
                }
                us[2 + mono] = median(t);
            }
            printf("%-8u %-10zu %12.2f %12.2f %12.2f %12.2f\n", blocks, bytes, us[0], us[1], us[2], us[3]);
        }
        CK(cudaFree(a));
        CK(cudaFree(b));
    }
    // The bytes a step reads at the plain-stream rate, for scale.
    printf("(a step of 512 KiB at 3.6 TB/s takes 0.15 us; 2 MiB takes 0.58 us)\n");
    return 0;
}
