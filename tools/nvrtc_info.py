#!/usr/bin/env python3
"""Compiles an akunu CUDA module with NVRTC (no GPU needed) and prints
ptxas's resource report: registers, shared memory, stack frame and spills
of every kernel. For checking a kernel change here before spending device
time on it.

    python3 tools/nvrtc_info.py persist -DPD_D=576 -DPD_QD=576 ... [-DPD_BULK=1]
    python3 tools/nvrtc_info.py main [-DSOME_SWITCH=1]

NVRTC comes from the nvidia-cuda-nvrtc wheel (tools/requirements.txt), as in
scripts/test.sh; pass --lib DIR to use another libnvrtc.so. The sources are
joined as crates/akunu-cuda/src/compile.rs joins them.
"""
import argparse
import ctypes
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KDIR = os.path.join(ROOT, "crates", "akunu-cuda", "kernels")
MODULES = {
    "main": ["common.cuh", "model.cu", "gemv_tc.cu", "sampling.cu"],
    "persist": ["common.cuh", "persist.cu"],
}


def find_lib(explicit):
    if explicit:
        return explicit
    for pattern in (
        os.path.join(ROOT, "target/tools-venv/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so*"),
        "/usr/local/cuda*/lib64/libnvrtc.so*",
    ):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    sys.exit("libnvrtc.so not found: run scripts/test.sh once (it installs the wheel) or pass --lib")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("module", choices=sorted(MODULES))
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--lib", help="path of libnvrtc.so")
    args, defines = ap.parse_known_args()
    bad = [d for d in defines if not d.startswith("-D")]
    if bad:
        sys.exit(f"only -DNAME[=VALUE] options are taken, not {bad}")
    src = "".join(f'#line 1 "{n}"\n' + open(os.path.join(KDIR, n)).read() + "\n" for n in MODULES[args.module])
    nv = ctypes.CDLL(find_lib(args.lib))
    prog = ctypes.c_void_p()
    if nv.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"akunu.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = [f"-arch={args.arch}", "-default-device", "-std=c++17", "-lineinfo", "--ptxas-options=-v"] + defines
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = nv.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    nv.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    nv.nvrtcGetProgramLog(prog, log)
    print(log.value.decode(errors="replace"))
    if rc:
        sys.exit(f"compilation failed (nvrtcResult {rc})")


if __name__ == "__main__":
    main()
