#!/usr/bin/env python3
"""End-to-end parity test: akunu engine vs. the independent NumPy reference.

  python3 tools/parity.py --akunu PATH_TO_AKUNU --model BASE.gguf --workdir DIR
  python3 tools/parity.py --self-test --model BASE.gguf          (reference only, no engine)

Steps:
  (a) derive F16 and Q8_0 copies of BASE into DIR (tools/derive.py logic; skipped
      when the output exists and is newer than BASE),
  (b) for a fixed set of prompts compute reference last-position logits and a
      greedy continuation (tools/reference.py logic),
  (c) for every file and prompt run
        AKUNU eval --model FILE --ids 1,2,3 --out OUT.f32
      (OUT.f32 = raw little-endian float32 logits of the last prompt position,
      n_vocab values) and require
        rel L2 = ||engine - ref|| / ||ref||  <  1e-3 (F32/F16 files), 1e-2 (quantized files)
      and equal top-1 token unless the reference's top1-top2 gap < 0.05 (near-tie),
  (d) run
        AKUNU generate --model FILE --prompt-ids 1,2,3 -n 16 --ignore-eos --json
      (stdout: ONE JSON object with key "generated_ids": list of ints) and compare
      with the reference's greedy ids up to the first step whose reference
      top1-top2 gap is < 0.05.
Prints one row per check and finally a line `N passed, M failed`; exits non-zero
on any failure.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

# environment for the engine subprocesses, captured before we tune BLAS threads
ENGINE_ENV = dict(os.environ)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # see reference.py

import numpy as np  # noqa: E402

TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS_DIR)

import gguf  # noqa: E402

import derive  # noqa: E402
import reference  # noqa: E402
import tokenize_ref  # noqa: E402

NEAR_TIE = 0.05
TOL_FLOAT = 1e-3  # F32 / F16 / BF16 weights
TOL_QUANT = 1e-2  # Q8_0, Q4_x, ... weights
DERIVED_TYPES = ["f16", "q8_0"]

# Fixed prompts: (name, text). Tokenized with tokenize_ref.py (special tokens parsed).
_CODE = '''def merge_sort(items):
    """Sort a list with merge sort and return a new list."""
    if len(items) <= 1:
        return list(items)
    mid = len(items) // 2
    left = merge_sort(items[:mid])
    right = merge_sort(items[mid:])
    out, i, j = [], 0, 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            out.append(left[i])
            i += 1
        else:
            out.append(right[j])
            j += 1
    out.extend(left[i:])
    out.extend(right[j:])
    return out


if __name__ == "__main__":
    print(merge_sort([5, 3, 9, 1, 4]))
'''
PROMPTS = [
    ("chatml", "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"),
    ("short", "Hello"),
    ("code", _CODE),
    ("repeat", "The cat sat on the mat. " * 12),
    ("prose", "In the early morning, the small fishing village woke slowly. Boats rocked against the pier "
              "while gulls circled overhead, and the smell of salt and bread drifted through the narrow streets."),
    ("mixed", "On 2024-03-15, 1,234 visitors paid €56.78 each at the café in São Paulo; 東京 had 99%."),
]


class Results:
    def __init__(self) -> None:
        self.passed = 0
        self.failed = 0

    def row(self, ok: bool, kind: str, file_tag: str, prompt: str, detail: str) -> None:
        if ok:
            self.passed += 1
        else:
            self.failed += 1
        print(f"{'PASS' if ok else 'FAIL'}  {kind:<7} {file_tag:<6} {prompt:<8} {detail}", flush=True)


# ---- helpers -----------------------------------------------------------------
def file_tolerance(path: str) -> tuple[str, float]:
    """(type tag, rel-L2 tolerance) from the types of the file's 2-D tensors."""
    r = gguf.GGUFReader(path)
    types = {t.tensor_type for t in r.tensors if len(t.shape) >= 2}
    floats = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    # tag = type of the attention-q matrix (representative of the file), else the first matrix
    tag = None
    for t in r.tensors:
        if t.name.endswith("attn_q.weight"):
            tag = t.tensor_type.name.lower()
            break
    if tag is None:
        tag = next(iter(types)).name.lower() if types else "f32"
    return tag, (TOL_FLOAT if types <= floats else TOL_QUANT)


def tokenize_prompts(model: str) -> list[tuple[str, list[int]]]:
    """Token ids of PROMPTS; synthetic (fixed-seed) id lists if the vocab is not supported."""
    try:
        tok = tokenize_ref.BPETokenizer.from_gguf(model)
    except (ValueError, KeyError) as e:
        print(f"# warning: tokenize_ref cannot tokenize for this model ({e}); using synthetic prompt ids", flush=True)
        n_vocab = len(gguf.GGUFReader(model).fields["tokenizer.ggml.tokens"].data)
        rng = np.random.default_rng(0)
        lo = min(256, n_vocab // 2)
        rand = lambda n: rng.integers(lo, n_vocab, n).tolist()  # noqa: E731
        unit = rand(7)
        return [("rand16", rand(16)), ("short", rand(2)), ("rand150", rand(150)),
                ("repeat", unit * 12), ("rand40", rand(40)), ("rand45", rand(45))]
    return [(name, tok.encode(text, parse_special=True)) for name, text in PROMPTS]


def fit_context(model: str, prompts, n_greedy: int):
    """Prompts cut to the model's context length less the greedy steps (small
    random-weight models with a byte-level vocabulary have short contexts)."""
    r = gguf.GGUFReader(model)
    arch = reference._field(r, "general.architecture", "llama")
    n_ctx = int(reference._field(r, f"{arch}.context_length", 0))
    if not n_ctx:
        return prompts
    room = max(1, n_ctx - n_greedy)
    out = []
    for name, ids in prompts:
        if len(ids) > room:
            print(f"# prompt {name}: {len(ids)} tokens cut to {room} (context {n_ctx})", flush=True)
            ids = ids[:room]
        out.append((name, ids))
    return out


def ids_arg(ids) -> str:
    return ",".join(str(int(i)) for i in ids)


def reference_results(model: str, prompts, n_greedy: int, cache_dir: str | None):
    """[(logits, greedy ids, gaps)] per prompt; cached in cache_dir keyed on model, prompts and code."""
    st = os.stat(model)
    h = hashlib.sha256()
    h.update(f"{os.path.abspath(model)}|{st.st_size}|{st.st_mtime_ns}|{n_greedy}|".encode())
    h.update(repr([ids for _, ids in prompts]).encode())
    with open(reference.__file__, "rb") as fh:
        h.update(fh.read())
    key = h.hexdigest()
    cache = os.path.join(cache_dir, f"ref-{os.path.basename(model)}.npz") if cache_dir else None
    if cache and os.path.exists(cache):
        try:
            d = np.load(cache)
            if str(d["key"]) == key:
                return [(d[f"logits_{i}"], d[f"greedy_{i}"], d[f"gap_{i}"]) for i in range(len(prompts))]
        except Exception:  # unreadable cache: recompute
            pass
    t0 = time.time()
    m = reference.LlamaReference(model)
    res = [m.greedy(ids, n_greedy) for _, ids in prompts]
    del m
    gc.collect()
    print(f"# reference for {os.path.basename(model)}: {time.time() - t0:.1f}s", flush=True)
    if cache:
        out = {"key": np.array(key)}
        for i, (lg, g, gap) in enumerate(res):
            out[f"logits_{i}"], out[f"greedy_{i}"], out[f"gap_{i}"] = lg, g, gap
        np.savez(cache, **out)
    return res


def fmt_cmd(cmd: list[str]) -> str:
    """Command line for messages, with very long arguments (id lists) shortened."""
    return " ".join(c if len(c) <= 60 else f"{c[:40]}...({len(c)} chars)" for c in cmd)


def run_engine(cmd: list[str], timeout: float) -> tuple[bool, str, str]:
    """Run the engine; returns (ok, stdout, error message)."""
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout, env=ENGINE_ENV)
    except subprocess.TimeoutExpired:
        return False, "", f"timed out after {timeout:.0f}s: {fmt_cmd(cmd)}"
    except OSError as e:
        return False, "", f"could not run {cmd[0]}: {e}"
    out = p.stdout.decode("utf-8", errors="replace")
    if p.returncode != 0:
        err = p.stderr.decode("utf-8", errors="replace").strip().splitlines()
        tail = " | ".join(err[-5:])
        return False, out, f"exit status {p.returncode}: {fmt_cmd(cmd)} ; stderr: {tail}"
    return True, out, ""


def parse_generate_json(stdout: str):
    """The engine prints ONE JSON object; accept it alone or as the last JSON line."""
    s = stdout.strip()
    candidates = [s] + [ln.strip() for ln in reversed(s.splitlines()) if ln.strip().startswith("{")]
    for c in candidates:
        try:
            obj = json.loads(c)
        except ValueError:
            continue
        if isinstance(obj, dict) and "generated_ids" in obj:
            return [int(x) for x in obj["generated_ids"]]
    raise ValueError(f"no JSON object with 'generated_ids' in stdout: {s[:200]!r}")


def top2(logits: np.ndarray) -> tuple[int, float]:
    """(argmax, top1 - top2 gap)."""
    i = np.argpartition(-logits, 2)[:2]
    v = np.sort(logits[i])[::-1]
    return int(np.argmax(logits)), float(v[0] - v[1])


# ---- checks ------------------------------------------------------------------
def check_logits(res: Results, akunu: str, model: str, tag: str, tol: float, name: str, ids,
                 ref_logits: np.ndarray, tmpdir: str, timeout: float) -> None:
    out = os.path.join(tmpdir, f"{os.path.basename(model)}-{name}.f32")
    if os.path.exists(out):
        os.remove(out)
    ok, _, err = run_engine([akunu, "eval", "--model", model, "--ids", ids_arg(ids), "--out", out], timeout)
    if not ok:
        res.row(False, "logits", tag, name, f"engine failed: {err}")
        return
    if not os.path.exists(out):
        res.row(False, "logits", tag, name, f"engine wrote no {out}")
        return
    eng = np.fromfile(out, dtype="<f4")
    if eng.size != ref_logits.size:
        res.row(False, "logits", tag, name, f"engine wrote {eng.size} floats, expected n_vocab={ref_logits.size}")
        return
    if not np.all(np.isfinite(eng)):
        res.row(False, "logits", tag, name, f"engine logits contain {int(np.sum(~np.isfinite(eng)))} non-finite values")
        return
    ref = ref_logits.astype(np.float64)
    rel = float(np.linalg.norm(eng.astype(np.float64) - ref) / np.linalg.norm(ref))
    r1, gap = top2(ref)
    e1 = int(np.argmax(eng))
    top_ok = e1 == r1
    near_tie = (not top_ok) and gap < NEAR_TIE
    ok = rel < tol and (top_ok or near_tie)
    note = " NEAR-TIE (top-1 differs, ref gap < %.2f)" % NEAR_TIE if near_tie else ""
    res.row(ok, "logits", tag, name,
            f"n={len(ids):<4} relL2={rel:.3e} (tol {tol:.0e})  top1 ref={r1} eng={e1} ref_gap={gap:.3f}{note}")


def check_greedy(res: Results, akunu: str, model: str, tag: str, name: str, ids, ref_gen, ref_gap,
                 n: int, timeout: float) -> None:
    cmd = [akunu, "generate", "--model", model, "--prompt-ids", ids_arg(ids), "-n", str(n), "--ignore-eos", "--json"]
    ok, stdout, err = run_engine(cmd, timeout)
    if not ok:
        res.row(False, "greedy", tag, name, f"engine failed: {err}")
        return
    try:
        eng = parse_generate_json(stdout)
    except ValueError as e:
        res.row(False, "greedy", tag, name, str(e))
        return
    # compare up to (not including) the first reference near-tie step
    limit = n
    for j in range(n):
        if ref_gap[j] < NEAR_TIE:
            limit = j
            break
    if len(eng) < limit:
        res.row(False, "greedy", tag, name, f"engine generated {len(eng)} ids, need at least {limit}: {eng}")
        return
    for j in range(limit):
        if eng[j] != int(ref_gen[j]):
            res.row(False, "greedy", tag, name,
                    f"step {j}: engine {eng[j]} != ref {int(ref_gen[j])} (ref gap {ref_gap[j]:.3f}); "
                    f"ref {list(map(int, ref_gen[:limit]))} eng {eng[:limit]}")
            return
    stop = f", stopped at near-tie step {limit} (ref gap {ref_gap[limit]:.3f})" if limit < n else ""
    res.row(True, "greedy", tag, name, f"compared {limit}/{n} steps{stop}")


# ---- modes -------------------------------------------------------------------
def self_test(model: str, n: int) -> int:
    res = Results()
    name, text = PROMPTS[0]
    tok = tokenize_ref.BPETokenizer.from_gguf(model)
    ids = tok.encode(text, parse_special=True)
    m = reference.LlamaReference(model, verbose=True)
    logits, gen, gaps = m.greedy(ids, n)
    finite = bool(np.all(np.isfinite(logits)))
    res.row(finite, "finite", "ref", name, f"n={len(ids)} logits finite={finite} max={float(np.max(logits)):.3f}")
    try:
        raw = b"".join(tok.token_bytes(int(t)) for t in gen)
        txt = raw.decode("utf-8")
        ok = len(txt.strip()) > 0 and sum(c.isalpha() for c in txt) >= 3
    except UnicodeDecodeError as e:
        txt, ok = f"<undecodable: {e}>", False
    res.row(ok, "decode", "ref", name, f"greedy {gen.tolist()} -> {txt!r}")
    print(f"{res.passed} passed, {res.failed} failed")
    return 0 if res.failed == 0 else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--akunu", help="path to the akunu binary")
    ap.add_argument("--model", required=True, help="base GGUF model")
    ap.add_argument("--workdir", help="directory for derived models, reference cache and engine outputs")
    ap.add_argument("--types", default=",".join(DERIVED_TYPES),
                    help="comma-separated derived types (f16,q8_0,q4_0,f32); default %(default)s")
    ap.add_argument("-n", "--greedy-n", type=int, default=16, help="greedy steps (default 16)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per engine call")
    ap.add_argument("--self-test", action="store_true", help="run the reference alone (no engine)")
    a = ap.parse_args()

    if a.self_test:
        return self_test(a.model, a.greedy_n)
    if not a.akunu or not a.workdir:
        ap.error("--akunu and --workdir are required (or use --self-test)")
    akunu = a.akunu if os.path.sep in a.akunu else (shutil.which(a.akunu) or a.akunu)
    if not (os.path.isfile(akunu) and os.access(akunu, os.X_OK)):
        print(f"ERROR: akunu binary not found or not executable: {a.akunu}", file=sys.stderr)
        print("0 passed, 1 failed")
        return 2
    os.makedirs(a.workdir, exist_ok=True)
    res = Results()

    # (a) model files: base + derived
    files = [a.model]
    base_mtime = os.path.getmtime(a.model)
    stem = os.path.splitext(os.path.basename(a.model))[0]
    for t in [x for x in a.types.split(",") if x]:
        dst = os.path.join(a.workdir, f"{stem}.{t}.gguf")
        if os.path.exists(dst) and os.path.getmtime(dst) > base_mtime:
            print(f"# reusing {dst}", flush=True)
        else:
            try:
                derive.derive(a.model, dst, t)
            except Exception as e:  # report and continue with the other files
                res.row(False, "derive", t, "-", f"{type(e).__name__}: {e}")
                continue
        files.append(dst)

    prompts = fit_context(a.model, tokenize_prompts(a.model), a.greedy_n)
    for name, ids in prompts:
        print(f"# prompt {name}: {len(ids)} tokens: {ids_arg(ids)}", flush=True)

    tmpdir = tempfile.mkdtemp(prefix="engine-out-", dir=a.workdir)
    try:
        for path in files:
            tag, tol = file_tolerance(path)
            print(f"# file {path}: {tag}, rel-L2 tolerance {tol:.0e}, near-tie gap {NEAR_TIE}", flush=True)
            refs = reference_results(path, prompts, a.greedy_n, a.workdir)
            for (name, ids), (ref_logits, ref_gen, ref_gap) in zip(prompts, refs):
                check_logits(res, akunu, path, tag, tol, name, ids, ref_logits, tmpdir, a.timeout)
                check_greedy(res, akunu, path, tag, name, ids, ref_gen, ref_gap, a.greedy_n, a.timeout)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)

    print(f"{res.passed} passed, {res.failed} failed")
    return 0 if res.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
