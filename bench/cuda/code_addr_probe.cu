// Whether a device function's address (a function pointer) is a data
// address: the kernel's code could then be prefetched into L2 before it
// runs (bench/RESULTS.md, session 48: the sampler's code, read once a token,
// came from DRAM). Prints the pointer; with `read` a kernel loads 16 bytes
// from it, with `prefetch` one asks L2 for it (prefetch.global.L2 and a bulk
// prefetch). On an H200 with CUDA 13.0 the pointer was 0x8, an offset into
// the module's code, and both kernels faulted: the code cannot be reached
// as data. scripts/gpu.sh code-addr runs each mode in a process of its own.
#include <cstdio>
#include <cstring>
__device__ __noinline__ int probe_fn(int x) { return x * 3 + 1; }
__global__ void addr_of(unsigned long long* out) {
    int (*p)(int) = probe_fn;
    out[0] = (unsigned long long)p;
    out[3] = (unsigned long long)probe_fn(threadIdx.x);
}
__global__ void read_at(const unsigned long long* at, unsigned long long* out) {
    const unsigned long long* a = (const unsigned long long*)at[0];
    out[1] = *(volatile const unsigned long long*)a;
    out[2] = *((volatile const unsigned long long*)a + 1);
}
__global__ void prefetch_at(const unsigned long long* at, unsigned long long* out) {
    const char* a = (const char*)at[0];
    asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], 4096;" ::"l"(a) : "memory");
    out[4] = 1;
}
int main(int argc, char** argv) {
    unsigned long long* d;
    cudaMalloc(&d, 64);
    cudaMemset(d, 0, 64);
    addr_of<<<1, 1>>>(d);
    printf("addr_of: %s\n", cudaGetErrorString(cudaDeviceSynchronize()));
    if (argc > 1 && !strcmp(argv[1], "read")) {
        read_at<<<1, 1>>>(d, d);
        printf("read_at: %s\n", cudaGetErrorString(cudaDeviceSynchronize()));
    }
    if (argc > 1 && !strcmp(argv[1], "prefetch")) {
        prefetch_at<<<1, 1>>>(d, d);
        printf("prefetch_at: %s\n", cudaGetErrorString(cudaDeviceSynchronize()));
    }
    unsigned long long h[8] = {};
    cudaMemcpy(h, d, 64, cudaMemcpyDeviceToHost);
    printf("fnptr %#llx  bytes %016llx %016llx  f(0)=%llu prefetched=%llu\n", h[0], h[1], h[2], h[3], h[4]);
    return 0;
}
