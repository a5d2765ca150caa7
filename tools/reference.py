#!/usr/bin/env python3
"""Independent NumPy reference forward pass for GGUF `llama`, `qwen2`, `qwen3`
and `gemma3` models.

Weights are dequantized once with `gguf.quants.dequantize` and kept in memory
(float32 by default, or float64 with --dtype float64).  Nothing here shares
code with the akunu engine; it follows llama.cpp's conventions for arch
`llama`:
  * GGML tensor shapes are (ne0, ne1, ...): a matrix with ne0=in, ne1=out is
    stored as `out` rows of `in` elements, so W has numpy shape (out, in), y = W @ x.
  * Q/K were permuted by the converter, so RoPE is GGML "normal" mode: rotate
    ADJACENT pairs (x[2i], x[2i+1]) by pos * base^(-2i/n_rot).
  * GQA: query head h uses KV head h // (n_head / n_head_kv); scale 1/sqrt(head_dim).
The other architectures follow their published (Hugging Face) definitions,
with GGUF's tensor names:
  * qwen2: Q/K/V projections have biases; RoPE rotates HALVES (x[i], x[i+d/2])
    ("rotate_half"; GGML "neox").  Not permuted by the converter.
  * qwen3: no biases; each Q and K head is RMS-normalised over head_dim with
    its own weight (q_norm / k_norm) before RoPE; halves RoPE.
  * gemma3: embeddings times sqrt(n_embd); RMSNorm weights are (1 + w) in the
    original model, and llama.cpp's converter stores 1 + w in the GGUF, so the
    GGUF value is the multiplier; Q/K head norms; attention output and FFN
    output each RMS-normalised (post_attention_norm / post_ffw_norm) before
    their residual add; FFN = down(gelu_tanh(gate) * up); scores scaled by
    query_pre_attn_scalar^-0.5 = head_dim^-0.5 (the 62-layer 27B model:
    (n_embd / n_head)^-0.5); layer i is global when (i + 1) % 6 == 0,
    otherwise it sees the last `sliding_window` keys (query - key <
    window) and uses RoPE base 10000 without scaling; optional tanh
    soft-caps of the scores and of the final logits
    (cap * tanh(x / cap)) where the metadata sets them.

CLI:
  python3 tools/reference.py MODEL.gguf --ids 1,2,3 [--ids ...] --out OUT.npz [--greedy N]
  python3 tools/reference.py MODEL.gguf --text "<|im_start|>user\\nHi<|im_end|>\\n" --greedy 20 --show
OUT.npz holds, per prompt i: ids_i (int32), logits_i (float32, last position),
and with --greedy: greedy_i (generated ids, int32), gap_i (top1-top2 logit gap
at each generated step, float32).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

# Single-threaded BLAS is much faster for these small matrices on few-core
# machines (threads mostly spin); set OPENBLAS_NUM_THREADS yourself to override.
# Only effective if numpy has not been imported yet.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import gguf
from gguf.quants import dequantize

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tokenize_ref import decode_with_vocab  # noqa: E402


def _field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


class LlamaReference:
    def __init__(self, path: str, dtype=np.float32, verbose: bool = False):
        t0 = time.time()
        self.path = path
        self.dtype = np.dtype(dtype)
        r = gguf.GGUFReader(path)
        arch = _field(r, "general.architecture")
        if arch not in ("llama", "qwen2", "qwen3", "gemma3"):
            print(f"warning: architecture {arch!r} is not known; treating it as llama", file=sys.stderr)
        self.arch = arch
        p = arch + "."
        self.n_layer = int(_field(r, p + "block_count"))
        self.n_embd = int(_field(r, p + "embedding_length"))
        self.n_head = int(_field(r, p + "attention.head_count"))
        self.n_head_kv = int(_field(r, p + "attention.head_count_kv", self.n_head))
        self.n_ff = int(_field(r, p + "feed_forward_length"))
        self.rope_base = float(_field(r, p + "rope.freq_base", 10000.0))
        self.eps = float(_field(r, p + "attention.layer_norm_rms_epsilon"))
        self.head_dim = int(_field(r, p + "attention.key_length", self.n_embd // self.n_head))
        self.n_rot = int(_field(r, p + "rope.dimension_count", self.head_dim))
        self.n_ctx = int(_field(r, p + "context_length", 0))
        # optional linear RoPE scaling (positions divided by factor)
        scaling = _field(r, p + "rope.scaling.type", "none")
        self.rope_pos_scale = 1.0
        if scaling == "linear":
            self.rope_pos_scale = 1.0 / float(_field(r, p + "rope.scaling.factor", 1.0))
        elif scaling not in ("none", None):
            raise NotImplementedError(f"rope scaling {scaling!r} not supported")
        assert self.n_head % self.n_head_kv == 0
        self.neox = arch in ("qwen2", "qwen3", "gemma3")
        self.gemma = arch == "gemma3"
        self.attn_softcap = float(_field(r, p + "attn_logit_softcapping", 0.0))
        self.final_softcap = float(_field(r, p + "final_logit_softcapping", 0.0))
        if self.gemma:
            self.window = int(_field(r, p + "attention.sliding_window", 0))
            pre_attn = self.n_embd // self.n_head if self.n_layer == 62 else self.head_dim
            self.attn_scale = 1.0 / np.sqrt(pre_attn)
            self.local_base = float(_field(r, p + "rope.freq_base_swa", 10000.0))
        else:
            self.window = 0
            self.attn_scale = 1.0 / np.sqrt(self.head_dim)
        self.tokens = _field(r, "tokenizer.ggml.tokens")
        self.token_types = _field(r, "tokenizer.ggml.token_type")
        self.eos_id = _field(r, "tokenizer.ggml.eos_token_id")

        # dequantize every tensor once; numpy shape = reversed GGML shape
        self.w: dict[str, np.ndarray] = {}
        for t in r.tensors:
            shape = tuple(int(x) for x in reversed(t.shape))
            a = dequantize(t.data, t.tensor_type).reshape(shape)
            self.w[t.name] = np.ascontiguousarray(a, dtype=self.dtype)
        self.out_w = self.w.get("output.weight", self.w["token_embd.weight"])
        self.n_vocab = self.out_w.shape[0]

        # RoPE inverse frequencies for the rotated pairs (optionally divided by rope_freqs)
        i = np.arange(self.n_rot // 2, dtype=np.float64)
        self.inv_freq = self.rope_base ** (-2.0 * i / self.n_rot)
        if "rope_freqs.weight" in self.w:
            self.inv_freq = self.inv_freq / self.w["rope_freqs.weight"].astype(np.float64)
        if self.gemma:
            self.inv_freq_local = self.local_base ** (-2.0 * i / self.n_rot)
        if verbose:
            nbytes = sum(a.nbytes for a in self.w.values())
            print(f"loaded {path}: {self.n_layer} layers, d={self.n_embd}, heads {self.n_head}/{self.n_head_kv}, "
                  f"head_dim {self.head_dim}, ff {self.n_ff}, vocab {self.n_vocab}, rope base {self.rope_base}, "
                  f"eps {self.eps:g}; {nbytes / 2**20:.0f} MiB of {self.dtype} weights in {time.time() - t0:.1f}s",
                  file=sys.stderr)

    # ---- building blocks ------------------------------------------------
    def rmsnorm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        ms = np.mean(x * x, axis=-1, keepdims=True)
        return (x / np.sqrt(ms + self.eps)) * w

    def rope(self, x: np.ndarray, pos: np.ndarray, local: bool = False) -> np.ndarray:
        """x: (T, heads, head_dim); rotate the first n_rot dims: adjacent pairs
        (llama) or the two halves (neox: qwen2, qwen3, gemma3)."""
        if local:  # gemma3 sliding-window layer: own base, no position scaling
            ang = pos.astype(np.float64)[:, None] * self.inv_freq_local[None, :]
        else:
            ang = (pos.astype(np.float64) * self.rope_pos_scale)[:, None] * self.inv_freq[None, :]  # (T, n_rot/2)
        cos = np.cos(ang).astype(self.dtype)[:, None, :]
        sin = np.sin(ang).astype(self.dtype)[:, None, :]
        out = x.copy()
        if self.neox:
            half = self.n_rot // 2
            x0 = x[..., 0:half]
            x1 = x[..., half:self.n_rot]
            out[..., 0:half] = x0 * cos - x1 * sin
            out[..., half:self.n_rot] = x0 * sin + x1 * cos
            return out
        x0 = x[..., 0:self.n_rot:2]
        x1 = x[..., 1:self.n_rot:2]
        out[..., 0:self.n_rot:2] = x0 * cos - x1 * sin
        out[..., 1:self.n_rot:2] = x0 * sin + x1 * cos
        return out

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos0: int, window: int = 0) -> np.ndarray:
        """q: (T, H, D) at positions q_pos0.., k/v: (S, Hkv, D) at positions 0..S-1. Returns (T, H*D).
        With window > 0 a query sees only keys less than `window` positions back."""
        T, S = q.shape[0], k.shape[0]
        g = self.n_head // self.n_head_kv
        qh = q.reshape(T, self.n_head_kv, g, self.head_dim).transpose(1, 2, 0, 3)  # (Hkv, g, T, D)
        kh = k.transpose(1, 0, 2)[:, None]  # (Hkv, 1, S, D)
        vh = v.transpose(1, 0, 2)[:, None]
        scores = (qh @ kh.transpose(0, 1, 3, 2)) * self.dtype.type(self.attn_scale)  # (Hkv, g, T, S)
        if self.attn_softcap > 0:
            scores = self.attn_softcap * np.tanh(scores / self.attn_softcap)
        qpos = q_pos0 + np.arange(T)[:, None]
        mask = np.arange(S)[None, :] > qpos  # causal: key position must be <= query position
        if window > 0:
            mask = mask | (qpos - np.arange(S)[None, :] >= window)
        scores = np.where(mask, -np.inf, scores)
        scores = scores - scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        o = p @ vh  # (Hkv, g, T, D)
        return o.transpose(2, 0, 1, 3).reshape(T, self.n_head * self.head_dim)

    # ---- forward --------------------------------------------------------
    def forward(self, ids, cache: list | None = None, all_logits: bool = False) -> np.ndarray:
        """Run tokens `ids` after whatever is already in `cache` (list of per-layer (K, V)).

        Returns logits of the last position (n_vocab,) or of all new positions.
        Pass cache=None for a from-scratch pass; pass a list (initially []) to reuse K/V.
        """
        ids = np.asarray(ids, dtype=np.int64)
        T = len(ids)
        if cache is None:
            cache = []
        p0 = cache[0][0].shape[0] if cache else 0
        if self.n_ctx and p0 + T > self.n_ctx:
            raise ValueError(f"sequence length {p0 + T} exceeds context length {self.n_ctx}")
        pos = np.arange(p0, p0 + T)
        x = self.w["token_embd.weight"][ids].astype(self.dtype)  # (T, d)
        if self.gemma:
            x = x * self.dtype.type(np.sqrt(self.n_embd))
        for L in range(self.n_layer):
            b = f"blk.{L}."
            local = self.gemma and self.window > 0 and (L + 1) % 6 != 0
            h = self.rmsnorm(x, self.w[b + "attn_norm.weight"])
            q = h @ self.w[b + "attn_q.weight"].T
            k = h @ self.w[b + "attn_k.weight"].T
            v = h @ self.w[b + "attn_v.weight"].T
            if b + "attn_q.bias" in self.w:  # qwen2
                q = q + self.w[b + "attn_q.bias"]
                k = k + self.w[b + "attn_k.bias"]
                v = v + self.w[b + "attn_v.bias"]
            q = q.reshape(T, self.n_head, self.head_dim)
            k = k.reshape(T, self.n_head_kv, self.head_dim)
            v = v.reshape(T, self.n_head_kv, self.head_dim)
            if b + "attn_q_norm.weight" in self.w:  # qwen3, gemma3: per-head RMSNorm
                q = self.rmsnorm(q, self.w[b + "attn_q_norm.weight"])
                k = self.rmsnorm(k, self.w[b + "attn_k_norm.weight"])
            q = self.rope(q, pos, local)
            k = self.rope(k, pos, local)
            if len(cache) > L:
                k = np.concatenate([cache[L][0], k], axis=0)
                v = np.concatenate([cache[L][1], v], axis=0)
                cache[L] = (k, v)
            else:
                cache.append((k, v))
            a = self.attention(q, k, v, p0, self.window if local else 0)
            o = a @ self.w[b + "attn_output.weight"].T
            if self.gemma:
                o = self.rmsnorm(o, self.w[b + "post_attention_norm.weight"])
            x = x + o
            h = self.rmsnorm(x, self.w[b + "ffn_norm.weight"])
            gate = h @ self.w[b + "ffn_gate.weight"].T
            up = h @ self.w[b + "ffn_up.weight"].T
            if self.gemma:  # gelu, tanh approximation
                c = self.dtype.type(np.sqrt(2.0 / np.pi))
                act = 0.5 * gate * (1.0 + np.tanh(c * (gate + 0.044715 * gate ** 3))) * up
            else:
                act = gate / (1.0 + np.exp(-gate)) * up  # silu(gate) * up
            f = act @ self.w[b + "ffn_down.weight"].T
            if self.gemma:
                f = self.rmsnorm(f, self.w[b + "post_ffw_norm.weight"])
            x = x + f
        if not all_logits:
            x = x[-1:]
        x = self.rmsnorm(x, self.w["output_norm.weight"])
        logits = x @ self.out_w.T
        if self.final_softcap > 0:
            logits = self.final_softcap * np.tanh(logits / self.final_softcap)
        return logits if all_logits else logits[0]

    def last_logits(self, ids) -> np.ndarray:
        return self.forward(ids).astype(np.float32)

    def greedy(self, ids, n: int, use_cache: bool = True):
        """Greedy continuation of `ids` by n tokens (never stops at EOS).

        Returns (prompt_last_logits, generated ids, top1-top2 gap per generated step).
        """
        ids = list(int(i) for i in ids)
        cache: list | None = [] if use_cache else None
        logits = self.forward(ids, cache)
        first = logits.astype(np.float32)
        gen, gaps = [], []
        for step in range(n):
            top2 = np.argpartition(-logits, 2)[:2]
            top2 = top2[np.argsort(-logits[top2], kind="stable")]
            tok = int(np.argmax(logits))  # lowest id on exact ties
            gaps.append(float(logits[top2[0]] - logits[top2[1]]))
            gen.append(tok)
            if step + 1 < n:
                if use_cache:
                    logits = self.forward([tok], cache)
                else:
                    logits = self.forward(ids + gen)
        return first, np.array(gen, dtype=np.int32), np.array(gaps, dtype=np.float32)

    def decode(self, ids) -> str:
        return decode_with_vocab(self.tokens, ids, self.token_types)


def parse_ids(s: str) -> list[int]:
    return [int(x) for x in s.replace(" ", "").split(",") if x != ""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--ids", action="append", default=[], help="comma-separated prompt token ids (repeatable)")
    ap.add_argument("--text", action="append", default=[],
                    help="prompt text (\\n and \\t escapes allowed), tokenized by tokenize_ref.py "
                         "with special tokens parsed (repeatable)")
    ap.add_argument("--out", help="output .npz")
    ap.add_argument("--greedy", type=int, default=0, help="extend each prompt greedily by N tokens")
    ap.add_argument("--no-cache", action="store_true", help="recompute the full sequence at every greedy step")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--show", action="store_true", help="print decoded prompt/continuation and top tokens")
    a = ap.parse_args()

    prompts = [parse_ids(s) for s in a.ids]
    if a.text:
        from tokenize_ref import BPETokenizer
        tok = BPETokenizer.from_gguf(a.model)
        prompts += [tok.encode(t.replace("\\n", "\n").replace("\\t", "\t"), parse_special=True) for t in a.text]
    if not prompts:
        ap.error("give at least one --ids or --text")

    m = LlamaReference(a.model, dtype=np.dtype(a.dtype), verbose=True)
    out: dict[str, np.ndarray] = {}
    for i, ids in enumerate(prompts):
        t0 = time.time()
        if a.greedy > 0:
            logits, gen, gaps = m.greedy(ids, a.greedy, use_cache=not a.no_cache)
            out[f"greedy_{i}"] = gen
            out[f"gap_{i}"] = gaps
        else:
            logits = m.last_logits(ids)
        out[f"logits_{i}"] = logits.astype(np.float32)
        out[f"ids_{i}"] = np.array(ids, dtype=np.int32)
        if not np.all(np.isfinite(logits)):
            print(f"prompt {i}: NON-FINITE logits", file=sys.stderr)
        top = np.argsort(-logits)[:5]
        print(f"prompt {i}: {len(ids)} tokens, {time.time() - t0:.1f}s, top5 {top.tolist()} "
              f"logits {np.round(logits[top], 3).tolist()}", file=sys.stderr)
        if a.show:
            print(f"--- prompt {i}: {m.decode(ids)!r}")
            print("    top5: " + ", ".join(f"{m.decode([t])!r}={logits[t]:.3f}" for t in top))
            if a.greedy > 0:
                print(f"    greedy ids: {gen.tolist()}")
                print(f"    min gap: {gaps.min():.4f}")
                print(f"    continuation: {m.decode(gen)!r}")
    if a.out:
        np.savez(a.out, **out)
        print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
