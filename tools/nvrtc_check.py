#!/usr/bin/env python3
"""Compile akunu's CUDA kernel sources with NVRTC, without a GPU.

Usage: tools/nvrtc_check.py [--arch sm_90] [--lib PATH/libnvrtc.so.13] FILE.cu...

Each FILE is compiled as the backend compiles it: kernels/common.cuh and
kernels/noise.cuh prepended, no system headers, `-arch=sm_XX`, `-default-device`, `-std=c++17`.
Prints the compiler log and each kernel's register and spill report;
exits non-zero on any error. NVRTC comes from the `nvidia-cuda-nvrtc`
wheel (`pip download nvidia-cuda-nvrtc`), no driver needed.
"""
import argparse, ctypes, os, sys

p = argparse.ArgumentParser()
p.add_argument("--arch", default="sm_90")
p.add_argument("--lib", default=os.environ.get("AKUNU_NVRTC", "libnvrtc.so.13"))
p.add_argument("--cubin", help="write the (last) file's cubin here, for nvdisasm")
p.add_argument("--define", action="append", default=[], help="extra -D option, such as TCG_SV=1")
p.add_argument("files", nargs="+")
a = p.parse_args()
lib = ctypes.CDLL(a.lib)
here = os.path.dirname(os.path.abspath(__file__))
kdir = os.path.join(here, "..", "crates", "akunu-cuda", "kernels")
common = "".join(f"#line 1 \"{h}\"\n" + open(os.path.join(kdir, h)).read() + "\n" for h in ("common.cuh", "noise.cuh"))
ok = True
for f in a.files:
    src = common + "\n#line 1 \"" + os.path.basename(f) + "\"\n" + open(f).read()
    prog = ctypes.c_void_p()
    r = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), os.path.basename(f).encode(), 0, None, None)
    assert r == 0, r
    opts = [f"-arch={a.arch}", "-default-device", "-std=c++17", "-Xptxas=-v", "-lineinfo"]
    opts += [f"-D{d}" for d in a.define]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    r = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, buf)
    log = buf.value.decode(errors="replace").strip()
    print(f"== {f}: {'OK' if r == 0 else 'FAILED'}")
    if log:
        print(log)
    ok &= r == 0
    if r == 0 and a.cubin:
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
        cub = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetCUBIN(prog, cub)
        open(a.cubin, "wb").write(cub.raw)
sys.exit(0 if ok else 1)
