#!/usr/bin/env python3
"""The cuBLAS prefill products of one 8B layer, timed alone (issue 5).

akunu's exact prefill runs, per chunk of m weight rows of depth k,
`out = W_hi . X_hi` (depth k) then `out += [W_hi | W_lo] . [X_lo ; X_hi]`
(depth 2k): f16 operands, f32 output and accumulation, through
`cublasGemmEx` with the default algorithm (crates/akunu-cuda/src/blas.rs).
This probe times those calls for the chunks of a Llama-3-8B layer at 512
input rows, and every algorithm that cuBLASLt's heuristic offers for the
same product, to see how far the default choice is from the best one.

Runs on the GPU machine (PyTorch for buffers and events, cuBLAS through
ctypes): `python3 bench/cublas_probe.py [--rows 512] [--reps 20]`.
"""

import argparse
import ctypes as C
import statistics

import torch

F16, F32, COMPUTE_32F, OP_T, OP_N = 2, 0, 68, 1, 0
WORKSPACE = 32 << 20


class Algo(C.Structure):
    _fields_ = [("data", C.c_uint64 * 8)]


class Heuristic(C.Structure):
    _fields_ = [
        ("algo", Algo),
        ("workspace", C.c_size_t),
        ("state", C.c_int),
        ("waves", C.c_float),
        ("reserved", C.c_int * 4),
    ]


def check(status, what):
    if status != 0:
        raise RuntimeError(f"{what}: cuBLAS status {status}")


class Lib:
    def __init__(self):
        torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")
        self.b = C.CDLL("libcublas.so.13")
        self.lt = C.CDLL("libcublasLt.so.13")
        self.stream = C.c_void_p(torch.cuda.current_stream().cuda_stream)
        self.ws = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
        self.h = C.c_void_p()
        check(self.b.cublasCreate_v2(C.byref(self.h)), "cublasCreate")
        check(self.b.cublasSetStream_v2(self.h, self.stream), "cublasSetStream")
        check(
            self.b.cublasSetWorkspace_v2(self.h, C.c_void_p(self.ws.data_ptr()), C.c_size_t(WORKSPACE)),
            "cublasSetWorkspace",
        )
        self.lth = C.c_void_p()
        check(self.lt.cublasLtCreate(C.byref(self.lth)), "cublasLtCreate")

    def gemm_ex(self, m, n, k, a, lda, b, ldb, c, ldc, beta):
        alpha, beta = C.c_float(1.0), C.c_float(beta)
        check(
            self.b.cublasGemmEx(
                self.h, OP_T, OP_N, m, n, k, C.byref(alpha),
                C.c_void_p(a), F16, lda, C.c_void_p(b), F16, ldb, C.byref(beta),
                C.c_void_p(c), F32, ldc, COMPUTE_32F, -1,
            ),
            "cublasGemmEx",
        )

    def lt_plan(self, m, n, k, lda, ldb, ldc, count=32):
        desc = C.c_void_p()
        check(self.lt.cublasLtMatmulDescCreate(C.byref(desc), COMPUTE_32F, F32), "desc")
        t = C.c_int32(OP_T)
        check(self.lt.cublasLtMatmulDescSetAttribute(desc, 3, C.byref(t), 4), "transa")
        lay = []
        for typ, r, cc, ld in ((F16, k, m, lda), (F16, k, n, ldb), (F32, m, n, ldc)):
            l = C.c_void_p()
            check(self.lt.cublasLtMatrixLayoutCreate(C.byref(l), typ, C.c_uint64(r), C.c_uint64(cc), C.c_int64(ld)), "layout")
            lay.append(l)
        pref = C.c_void_p()
        check(self.lt.cublasLtMatmulPreferenceCreate(C.byref(pref)), "pref")
        w = C.c_uint64(WORKSPACE)
        check(self.lt.cublasLtMatmulPreferenceSetAttribute(pref, 1, C.byref(w), 8), "pref ws")
        res = (Heuristic * count)()
        got = C.c_int()
        check(
            self.lt.cublasLtMatmulAlgoGetHeuristic(
                self.lth, desc, lay[0], lay[1], lay[2], lay[2], pref, count, res, C.byref(got)
            ),
            "heuristic",
        )
        return desc, lay, [res[i] for i in range(got.value) if res[i].state == 0]

    def lt_run(self, plan, algo, a, b, c, beta):
        desc, lay, _ = plan
        alpha, beta = C.c_float(1.0), C.c_float(beta)
        check(
            self.lt.cublasLtMatmul(
                self.lth, desc, C.byref(alpha), C.c_void_p(a), lay[0], C.c_void_p(b), lay[1],
                C.byref(beta), C.c_void_p(c), lay[2], C.c_void_p(c), lay[2], C.byref(algo.algo),
                C.c_void_p(self.ws.data_ptr()), C.c_size_t(WORKSPACE), self.stream,
            ),
            "cublasLtMatmul",
        )


def timed(fn, reps, batch=10):
    """Median over `reps` of the time per call of `batch` calls back to back
    (launch latency hidden behind the queued calls)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(batch):
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / batch)
    return statistics.median(times)


def config(lib, h):
    out = []
    for attr in (0, 1, 2, 6, 8):  # id, tile, split-k, stages, cluster
        v, got = C.c_uint32(), C.c_size_t()
        lib.lt.cublasLtMatmulAlgoConfigGetAttribute(C.byref(h.algo), attr, C.byref(v), 4, C.byref(got))
        out.append(v.value)
    return "id%d tile%d split%d stages%d cl%d" % tuple(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    lib = Lib()
    n = args.rows
    # (name, weight rows m in the chunk, depth k): akunu's chunks of an 8B
    # Q4_0 layer at 256 MiB of [hi | lo] weights (blas.rs chunk_rows).
    chunks = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate|up a", 16384, 4096),
              ("gate|up b", 12288, 4096), ("down", 4096, 14336)]
    print(f"{torch.cuda.get_device_name()}, {n} input rows, medians of {args.reps}")
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    ms = timed(lambda: big @ big, args.reps)
    print(f"ceiling: 8192^3 f16 torch.matmul {ms:.3f} ms, {2 * 8192**3 / ms / 1e9:.0f} TFLOP/s")
    tot_ex = tot_best = 0.0
    for name, m, k in chunks:
        w = torch.randn(m, 2 * k, device="cuda", dtype=torch.float16)  # [W_hi | W_lo]
        x = torch.randn(n, 2 * k, device="cuda", dtype=torch.float16)  # [X_lo | X_hi]
        out = torch.randn(n, m, device="cuda", dtype=torch.float32)
        wp, xp, op = w.data_ptr(), x.data_ptr(), out.data_ptr()
        # As the engine runs them: the first product overwrites, the second adds.
        for depth, bptr, beta in ((k, xp + 2 * k, 0.0), (2 * k, xp, 1.0)):
            flop = 2.0 * m * n * depth
            ex = timed(lambda: lib.gemm_ex(m, n, depth, wp, 2 * k, bptr, 2 * k, op, m, beta), args.reps)
            plan = lib.lt_plan(m, n, depth, 2 * k, 2 * k, m)
            runs = []
            for i, h in enumerate(plan[2]):
                try:
                    t = timed(lambda: lib.lt_run(plan, h, wp, bptr, op, beta), args.reps)
                except RuntimeError:
                    continue
                runs.append((t, i, config(lib, h)))
            best = min(runs) if runs else (float("nan"), -1, "")
            tot_ex += ex
            tot_best += min(ex, best[0])
            print(f"{name:10s} m={m:6d} depth={depth:6d} beta={beta:.0f}: GemmEx {ex:.4f} ms "
                  f"{flop / ex / 1e9:4.0f} TFLOP/s; best Lt #{best[1]} {best[0]:.4f} ms "
                  f"{flop / best[0] / 1e9:4.0f} TFLOP/s")
            for t, i, cfg in runs:
                print(f"    Lt #{i}: {t:.4f} ms {flop / t / 1e9:4.0f} TFLOP/s  {cfg}")
        del w, x, out
    print(f"layer sum: GemmEx {tot_ex:.3f} ms, best {tot_best:.3f} ms; x32 layers: {32 * tot_ex:.1f} / {32 * tot_best:.1f} ms")


if __name__ == "__main__":
    main()
