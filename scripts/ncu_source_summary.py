#!/usr/bin/env python3
"""Summarise Nsight Compute's source page of one kernel (SASS, CSV).

Input: `ncu --import R.ncu-rep --page source --csv --print-source sass`,
plain or gzipped. The kernel's called functions (a CALL target that ran)
are told apart from its body; for each, the warp-stall samples and their
reasons, then the hottest instructions of each function. Used by
`scripts/gpu.sh run ncu-persist` on the persistent decode kernel, whose
sampler's part and pick are called functions.

usage: ncu_source_summary.py FILE [TOP]
"""
import collections
import csv
import gzip
import re
import sys


def main() -> None:
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 12
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = [r for r in csv.reader(f)]
    head_i = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    head, data = rows[head_i], [r for r in rows[head_i + 1:] if len(r) == len(rows[head_i])]
    col = {h: i for i, h in enumerate(head)}
    samples, execd = col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"]
    stalls = [h for h in head if h.startswith("stall_") and "Not Issued" not in h]
    addr = [int(r[0], 16) for r in data]
    # Called functions: from each CALL target that ran to the next RET.
    starts = set()
    for r in data:
        m = re.search(r"CALL\.\S+\s+(0x[0-9a-f]+)", r[1])
        if m and int(r[execd]) > 0:
            starts.add(int(m.group(1), 16))
    regions = []
    for s in sorted(starts):
        if s not in addr:
            continue
        i = addr.index(s)
        j = i
        while j < len(data) and not (re.search(r"\bRET\b", data[j][1]) and "@" not in data[j][1]):
            j += 1
        regions.append((f"function at {s:#x}", i, min(j, len(data) - 1)))
    covered = set(k for _, i, j in regions for k in range(i, j + 1))
    total = sum(int(r[samples]) for r in data)

    def summary(label, idx):
        n = sum(int(data[k][samples]) for k in idx)
        by = collections.Counter()
        for k in idx:
            for h in stalls:
                by[h[6:]] += int(data[k][col[h]])
        runs = max((int(data[k][execd]) for k in idx), default=0)
        print(f"{label}: {len(idx)} instructions, most executed {runs} times; {n} samples "
              f"({100 * n / max(total, 1):.1f}%): " + ", ".join(f"{k} {v}" for k, v in by.most_common(8)))
        for k in sorted(sorted(idx, key=lambda k: -int(data[k][samples]))[:top]):
            r = data[k]
            why = ", ".join(f"{h[6:]} {r[col[h]]}" for h in stalls if int(r[col[h]]) > 0)
            print(f"  +{k - idx[0]:5d} {r[1].strip()[:58]:58s} {r[samples]:>6s}  ({why})")

    summary("kernel body", [k for k in range(len(data)) if k not in covered])
    for label, i, j in regions:
        summary(label, list(range(i, j + 1)))


if __name__ == "__main__":
    main()
