#!/usr/bin/env python3
"""Where a kernel's machine code comes from: SASS instructions by source line.

Usage: tools/sass_sites.py [--nvdisasm PATH] [--top N] [--range A-B ...] CUBIN

Disassembles CUBIN with `nvdisasm -c -gi` (line table with inlining) and
counts each function's instructions by the source line they belong to at
the function's own level: an instruction inlined from a helper counts
toward the line of the call that inlined it, so a helper inlined at four
sites shows as four lines. Prints each function's total, its N largest
lines (with the source text where the file is found under
crates/akunu-cuda/kernels/), and the sum over each --range of lines of the
kernel's own file.

The cubins: run any bench on the GPU machine with
AKUNU_KERNEL_CACHE=$OUT/kc (the modules' cache then lands in $OUT and comes
back; the names are hashes, one per module). nvdisasm: the CUDA toolkit's,
or `pip install nvidia-cuda-nvdisasm` (no GPU needed). Why: the streaming
kernel's speed moves with its layer loop's code size (bench/RESULTS.md,
session 41).
"""
import argparse, collections, os, re, shutil, subprocess, sys

p = argparse.ArgumentParser()
p.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
p.add_argument("--top", type=int, default=25)
p.add_argument("--range", action="append", default=[], help="A-B: lines of the kernel's file to sum")
p.add_argument("cubin")
a = p.parse_args()

try:
    sass = subprocess.run([a.nvdisasm, "-c", "-gi", a.cubin], check=True, capture_output=True, text=True).stdout
except (OSError, subprocess.CalledProcessError) as e:
    sys.exit(f"nvdisasm failed ({e}); pass --nvdisasm PATH")

here = os.path.dirname(os.path.abspath(__file__))
kdir = os.path.join(here, "..", "crates", "akunu-cuda", "kernels")
sources = {}


def text(file, line):
    if file not in sources:
        path = os.path.join(kdir, file)
        sources[file] = open(path).read().split("\n") if os.path.exists(path) else []
    lines = sources[file]
    return lines[line - 1].strip()[:90] if 0 < line <= len(lines) else ""


# Each instruction follows a block of `//## File "...", line N [inlined at
# ...]` lines whose last one is the function's own level.
fn, site = None, None
counts = collections.defaultdict(collections.Counter)
for l in sass.split("\n"):
    m = re.match(r"\s*\.text\.(\S+):", l)
    if m:
        fn, site = m.group(1), None
        continue
    m = re.search(r'//## File "([^"]*)", line (\d+)', l)
    if m:
        site = (os.path.basename(m.group(1)), int(m.group(2)))
        continue
    if fn and re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+\S", l):
        counts[fn][site] += 1

if not counts:
    sys.exit("no instructions found (is it a cubin with -lineinfo?)")
for f, c in counts.items():
    total = sum(c.values())
    print(f"== {f}: {total} instructions ({total * 16 / 1024:.0f} KB)")
    lines = [(k, n) for k, n in c.items() if k is not None]
    for (file, line), n in sorted(lines, key=lambda x: -x[1])[: a.top]:
        print(f"  {n:6d}  {file}:{line}  {text(file, line)}")
    # The kernel's own file: the one most of its instructions are charged to.
    by_file = collections.Counter()
    for (file, _), n in lines:
        by_file[file] += n
    main = by_file.most_common(1)[0][0] if by_file else None
    for r in a.range:
        lo, hi = (int(x) for x in r.split("-"))
        n = sum(v for (file, line), v in c.items() if file == main and lo <= line <= hi)
        print(f"  lines {lo}-{hi} of {main}: {n} instructions ({n * 16 / 1024:.0f} KB)")
