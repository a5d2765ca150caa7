#!/usr/bin/env python3
"""Architecture parity: akunu against the NumPy reference on random-weight
models of every architecture akunu runs.

  python3 tools/arch_parity.py --akunu target/release/akunu --workdir target/arch-parity
      [--archs llama,llama+rope_freqs,qwen2,qwen3,gemma3] [--types f32,f16,q8_0] [--device cpu]

For each architecture and tensor type:
  (a) `akunu synth --shape tiny --arch ARCH --type TYPE` writes a small
      random-weight GGUF (Qwen3 and Gemma 3 with heads wider than
      dim / n_heads; Gemma 3 with six layers, an 8-position sliding window on
      five of them, and attention and logit soft-caps; `llama+rope_freqs`
      is llama with `--rope-freqs`, Llama 3.1-style per-frequency RoPE
      divisors: for its prompts longer than one token the tolerance becomes
      a tenth of what leaving the divisors out moves the reference's logits
      (about 3e-4 to 1e-3 on this shape), so that an engine ignoring them
      fails);
  (b) tools/reference.py (float64, over `gguf`-dequantized weights) computes
      the last-position logits of fixed prompts, some longer than the window,
      and a greedy continuation that runs past it;
  (c) `akunu eval` gives the engine's logits, with the whole prompt in one
      prefill step and in steps of 5 rows; each must satisfy
        rel L2 = ||engine - ref|| / ||ref|| < 1e-3
      with the same top-1 token unless the reference's top-2 gap is < 1e-3;
  (d) `akunu generate --json` (chain decode) must produce the reference's
      greedy ids up to the first step whose reference top-2 gap is < 1e-3.
Prints one row per check and `N passed, M failed`; exits non-zero on failure.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS_DIR)

import parity  # noqa: E402  (sets single-threaded BLAS before numpy loads)
import numpy as np  # noqa: E402

import reference  # noqa: E402

TOL = 1e-3
NEAR_TIE = 1e-3
ARCHS = ["llama", "llama+rope_freqs", "qwen2", "qwen3", "gemma3"]
TYPES = ["f32", "f16", "q8_0"]
N_GREEDY = 20


def prompts(n_vocab: int) -> list[tuple[str, list[int]]]:
    rng = np.random.default_rng(1234)
    out = [("one", [7])]
    for n in (6, 29):
        out.append((f"len{n}", [int(x) for x in rng.integers(3, n_vocab, size=n)]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--akunu", required=True, help="path to the akunu binary")
    ap.add_argument("--workdir", required=True, help="directory for the synthetic models and engine outputs")
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--device", default="cpu", help="akunu --device (cpu or cuda)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per engine call")
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    res = parity.Results()
    dev = ["--device", a.device]
    for arch in a.archs.split(","):
        for ty in a.types.split(","):
            tag = f"{arch}/{ty}"
            base, _, extra = arch.partition("+")
            flags = [f"--{extra.replace('_', '-')}"] if extra else []
            model = os.path.join(a.workdir, f"tiny-{arch}-{ty}.gguf")
            p = subprocess.run([a.akunu, "synth", "--shape", "tiny", "--arch", base, "--type", ty,
                                "--seed", "5", *flags, model], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            if p.returncode != 0:
                res.row(False, "synth", tag, "-", p.stderr.decode(errors="replace").strip())
                continue
            ref = reference.LlamaReference(model, dtype=np.float64)
            plain = None
            if extra == "rope_freqs":
                # The same model without the divisors, to show they matter.
                plain = reference.LlamaReference(model, dtype=np.float64)
                i = np.arange(plain.n_rot // 2, dtype=np.float64)
                plain.inv_freq = plain.rope_base ** (-2.0 * i / plain.n_rot)
            for name, ids in prompts(ref.n_vocab):
                want = ref.last_logits(ids).astype(np.float64)
                tol = TOL
                if plain is not None and len(ids) > 1:
                    off = plain.last_logits(ids).astype(np.float64)
                    moved = float(np.linalg.norm(off - want) / np.linalg.norm(want))
                    tol = min(TOL, moved / 10)
                    res.row(moved > 1e-5, "factors", tag, name,
                            f"leaving the divisors out moves the reference {moved:.2e}; tolerance {tol:.1e}")
                r1, gap = parity.top2(want)
                for chunk in (512, 5):
                    out = os.path.join(a.workdir, f"{arch}-{ty}-{name}-{chunk}.f32")
                    cmd = [a.akunu, "eval", "--model", model, *dev, "--prefill-chunk", str(chunk),
                           "--ids", parity.ids_arg(ids), "--out", out]
                    ok, _, err = parity.run_engine(cmd, a.timeout)
                    label = f"{name}/prefill{chunk}"
                    if not ok:
                        res.row(False, "logits", tag, label, err)
                        continue
                    got = np.fromfile(out, dtype="<f4").astype(np.float64)
                    if got.size != want.size or not np.all(np.isfinite(got)):
                        res.row(False, "logits", tag, label, f"{got.size} values (want {want.size}) or non-finite")
                        continue
                    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
                    e1 = int(np.argmax(got))
                    top_ok = e1 == r1 or gap < NEAR_TIE
                    res.row(rel < tol and top_ok, "logits", tag, label,
                            f"n={len(ids):<3} relL2={rel:.2e} (tol {tol:.1e}) top1 ref={r1} eng={e1} gap={gap:.4f}")
            # Greedy continuation past the sliding window, through chain decode.
            ids = prompts(ref.n_vocab)[1][1]
            _, gen, gaps = ref.greedy(ids, N_GREEDY)
            cmd = [a.akunu, "generate", "--model", model, *dev, "--prompt-ids", parity.ids_arg(ids),
                   "-n", str(N_GREEDY), "--ignore-eos", "--json"]
            ok, stdout, err = parity.run_engine(cmd, a.timeout)
            if not ok:
                res.row(False, "greedy", tag, "len6", err)
                continue
            eng = parity.parse_generate_json(stdout)
            limit = next((j for j in range(N_GREEDY) if gaps[j] < NEAR_TIE), N_GREEDY)
            same = eng[:limit] == [int(t) for t in gen[:limit]]
            res.row(same, "greedy", tag, "len6",
                    f"compared {limit}/{N_GREEDY} steps; ref {gen[:limit].tolist()} eng {eng[:limit]}")
    print(f"{res.passed} passed, {res.failed} failed")
    return 0 if res.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
