#!/usr/bin/env python3
"""PyTorch peer for `akunu bench --device cuda`: a minimal Llama decode loop on
random weights of the issue's shapes, measured the way akunu is (a 512-token
prompt, then 128 greedy tokens, medians of several runs).

It is the peer the CUDA speed issue names ("PyTorch compiled with CUDA graphs
in a minimal decode loop"), written here from the Llama definition, not
copied from any project:

- one decode step = embedding row, per layer RMSNorm -> fused q|k|v product ->
  rotary embedding -> write K/V at the position into a static cache ->
  attention over the whole static cache under a position mask (SDPA, grouped
  heads) -> o product + residual -> RMSNorm -> fused gate|up product ->
  SiLU(gate)*up -> down product + residual; final RMSNorm, logits, argmax;
- the step keeps its token and position on the device (the argmax is written
  into the next step's input, the position is incremented inside the step),
  so N replays of its CUDA graph are N dependent tokens with no host work,
  as akunu's chains are;
- `--compile` first runs the step through torch.compile (Inductor's default
  mode: no cudagraphs of its own, the capture is ours), which fuses the
  elementwise work into Triton kernels.

Floors are computed as `akunu bench` computes them: weight bytes read per
token over the device-to-device copy bandwidth (read + write bytes) measured
in the same process.

    python3 tools/peer_torch.py --shape llama-1b --dtype f16 [--compile]
"""

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

# (layers, dim, heads, kv heads, ffn, RoPE base, tied); head dim = dim / heads;
# vocab 49,152 (crates/akunu-core/src/synth.rs `Shape::params`).
SHAPES = {
    "smollm2-135m": (30, 576, 9, 3, 1536, 100000.0, True),
    "llama-1b": (16, 2048, 32, 8, 8192, 500000.0, True),
    "llama-8b": (32, 4096, 32, 8, 14336, 500000.0, False),
}
VOCAB = 49152
# Where the model lives (a CPU smoke test of the model code may set "cpu").
DEV = "cuda"
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}


class Model:
    def __init__(self, shape, dtype, max_len, seed):
        nl, d, nh, nkv, ff, rope_base, tied = SHAPES[shape]
        self.nl, self.nh, self.nkv, self.ff = nl, nh, nkv, ff
        self.hd = d // nh
        g = torch.Generator(device=DEV).manual_seed(seed)

        def w(*size, scale=None):
            s = scale if scale is not None else 1.0 / math.sqrt(size[-1])
            return (torch.randn(*size, device=DEV, generator=g) * s).to(dtype)

        qkv_rows = (nh + 2 * nkv) * self.hd
        self.emb = w(VOCAB, d, scale=1.0)
        self.out = self.emb if tied else w(VOCAB, d)
        self.layers = []
        for _ in range(nl):
            self.layers.append(
                dict(
                    attn_norm=torch.ones(d, device=DEV, dtype=dtype),
                    wqkv=w(qkv_rows, d),
                    wo=w(d, nh * self.hd),
                    ffn_norm=torch.ones(d, device=DEV, dtype=dtype),
                    wgu=w(2 * ff, d),
                    wdown=w(d, ff),
                    k=torch.zeros(1, nkv, max_len, self.hd, device=DEV, dtype=dtype),
                    v=torch.zeros(1, nkv, max_len, self.hd, device=DEV, dtype=dtype),
                )
            )
        self.final_norm = torch.ones(d, device=DEV, dtype=dtype)
        inv = 1.0 / (rope_base ** (torch.arange(0, self.hd, 2, device=DEV).float() / self.hd))
        ang = torch.outer(torch.arange(max_len, device=DEV).float(), inv)
        self.cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
        self.sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
        self.positions = torch.arange(max_len, device=DEV)

    def weight_bytes_per_token(self):
        per_layer = sum(
            t.numel() * t.element_size()
            for name, t in self.layers[0].items()
            if name in ("wqkv", "wo", "wgu", "wdown")
        )
        return self.nl * per_layer + self.out.numel() * self.out.element_size()

    @staticmethod
    def rms(x, w, eps=1e-5):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w

    @staticmethod
    def rope(x, cos, sin):
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    def forward(self, tokens, pos):
        """tokens [T] at positions pos [T] (prefill: T rows; decode: one)."""
        t = tokens.shape[0]
        x = self.emb[tokens]
        cos = self.cos[pos][None, None]
        sin = self.sin[pos][None, None]
        # A row may see the cache entries at or before its own position.
        mask = (self.positions[None, :] <= pos[:, None])[None, None]
        nh, nkv, hd = self.nh, self.nkv, self.hd
        for L in self.layers:
            h = self.rms(x, L["attn_norm"])
            qkv = h @ L["wqkv"].t()
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], -1)
            q = self.rope(q.view(t, nh, hd).transpose(0, 1)[None], cos, sin)
            k = self.rope(k.view(t, nkv, hd).transpose(0, 1)[None], cos, sin)
            v = v.view(t, nkv, hd).transpose(0, 1)[None]
            L["k"].index_copy_(2, pos, k)
            L["v"].index_copy_(2, pos, v)
            a = F.scaled_dot_product_attention(q, L["k"], L["v"], attn_mask=mask, enable_gqa=True)
            x = x + a[0].transpose(0, 1).reshape(t, nh * hd) @ L["wo"].t()
            h = self.rms(x, L["ffn_norm"])
            gate, up = (h @ L["wgu"].t()).split([self.ff, self.ff], -1)
            x = x + (F.silu(gate) * up) @ L["wdown"].t()
        return self.rms(x[-1:], self.final_norm) @ self.out.t()

    def step(self, tok, pos):
        """One dependent decode step on device buffers: tok [1] and pos [1]
        are read and then overwritten with the next token and position."""
        logits = self.forward(tok, pos)
        tok.copy_(logits.argmax(-1))
        pos.add_(1)


def copy_bandwidth():
    """Device-to-device copy of 1 GiB, bytes read + written per second."""
    n = 1 << 29
    a = torch.empty(n, dtype=torch.float16, device=DEV)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 0.0
    for _ in range(10):
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        best = max(best, 2 * n * 2 / (s.elapsed_time(e) / 1e3))
    del a, b
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="f16")
    ap.add_argument("-p", "--prompt", type=int, default=512, help="prompt tokens (default 512)")
    ap.add_argument("-n", "--tokens", type=int, default=128, help="decoded tokens a run (default 128)")
    ap.add_argument("-r", "--runs", type=int, default=5, help="runs (default 5)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the step before capture")
    ap.add_argument(
        "--compile-mode",
        default="default",
        help="torch.compile mode (default: Inductor's default, cuBLAS products, no autotuning)",
    )
    ap.add_argument("--json", help="also write the figures to this file")
    a = ap.parse_args()
    if a.prompt < 1 or a.tokens < 1 or a.runs < 1:
        sys.exit("peer_torch.py: -p, -n and -r must be at least 1")
    if not torch.cuda.is_available():
        sys.exit("peer_torch.py: no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = DTYPES[a.dtype]
    max_len = a.prompt + a.tokens
    t0 = time.time()
    m = Model(a.shape, dtype, max_len, seed=1)
    bw = copy_bandwidth()
    wbytes = m.weight_bytes_per_token()
    prompt = torch.randint(0, VOCAB, (a.prompt,), device=DEV, generator=torch.Generator(device=DEV).manual_seed(2))
    ppos = torch.arange(a.prompt, device=DEV)

    # Prefill (eager; a forward of the whole prompt), timed over the runs.
    with torch.inference_mode():
        m.forward(prompt, ppos)
        torch.cuda.synchronize()
        pp = []
        for _ in range(a.runs):
            s = time.perf_counter()
            logits = m.forward(prompt, ppos)
            torch.cuda.synchronize()
            pp.append(a.prompt / (time.perf_counter() - s))

        tok = logits.argmax(-1).to(torch.long).reshape(1).clone()
        first = tok.clone()
        pos = torch.full((1,), a.prompt, device=DEV, dtype=torch.long)
        step = m.step
        if a.compile:
            step = torch.compile(m.step, mode=a.compile_mode, fullgraph=True)
        # Warm up (and compile) outside the capture, on a side stream as
        # graph capture wants, then capture one step.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        tc = time.time()
        with torch.cuda.stream(side):
            for _ in range(3):
                pos.fill_(a.prompt)
                step(tok, pos)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        warm_s = time.time() - tc
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(tok, pos)

        tg = []
        ids = []
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(a.runs + 1):
            tok.copy_(first)
            pos.fill_(a.prompt)
            out = torch.empty(a.tokens, dtype=torch.long, device=DEV)
            torch.cuda.synchronize()
            s.record()
            # Each token is recorded as it comes (one small copy a token
            # after the graph, as a decode loop must keep its tokens).
            for i in range(a.tokens):
                graph.replay()
                out[i : i + 1].copy_(tok)
            e.record()
            e.synchronize()
            tg.append(a.tokens / (s.elapsed_time(e) / 1e3))
            ids.append(out.tolist())
        tg = tg[1:]  # the first run pays the graph's upload
    same = all(x == ids[0] for x in ids)
    med = statistics.median(tg)
    floor = bw / wbytes
    res = dict(
        peer="pytorch",
        torch=torch.__version__,
        gpu=torch.cuda.get_device_name(),
        shape=a.shape,
        dtype=a.dtype,
        compiled=a.compile,
        prompt=a.prompt,
        tokens=a.tokens,
        pp_tok_s=statistics.median(pp),
        tg_tok_s=med,
        tg_runs=[round(x, 1) for x in tg],
        copy_gb_s=bw / 1e9,
        weight_mb=wbytes / 1e6,
        floor_tok_s=floor,
        share_of_floor=med / floor,
        runs_agree=same,
        setup_s=round(time.time() - t0, 1),
        warmup_s=round(warm_s, 1),
    )
    print(
        f"| pytorch {torch.__version__} {'compiled' if a.compile else 'eager'}+graph | {a.shape} {a.dtype} "
        f"| pp{a.prompt} {res['pp_tok_s']:,.0f} | tg{a.tokens} {med:,.1f} ({min(tg):,.1f}-{max(tg):,.1f}) "
        f"| {100 * med / floor:.0f}% of floor ({floor:,.0f} tok/s at {bw / 1e9:,.0f} GB/s) "
        f"| runs agree: {same} | warm-up {warm_s:.1f} s |"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
