#!/usr/bin/env python3
"""Independent reference tokenizer for GPT-2-style byte-level BPE GGUF vocabularies.

This is a from-scratch Python implementation (numpy-free; uses `gguf` to read
the vocabulary and the `regex` module for Unicode-aware pre-tokenization).  It
is deliberately INDEPENDENT of akunu's own (Rust) tokenizer and exists only to
produce expected token ids for tests.  It follows llama.cpp's behaviour for
`tokenizer.ggml.model == "gpt2"`:

  1. special-token partition (longest token text first; CONTROL/UNKNOWN tokens
     only when parse_special is on, USER_DEFINED tokens always),
  2. pre-tokenizer regex splits selected by `tokenizer.ggml.pre`, applied in
     sequence; text between matches is kept as its own piece (llama.cpp's
     unicode_regex_split semantics),
  3. GPT-2 bytes_to_unicode mapping of each piece's UTF-8 bytes,
  4. rank-based BPE merges from `tokenizer.ggml.merges` (lowest rank first,
     leftmost on ties).

No BOS/EOS is added (SmolLM2 sets add_bos_token = false).

CLI:
  python3 tools/tokenize_ref.py MODEL.gguf --cases FILE --out FILE.json [--no-special]
  python3 tools/tokenize_ref.py MODEL.gguf --check FILE.inp FILE.out
  python3 tools/tokenize_ref.py MODEL.gguf --text "hello world"
"""
from __future__ import annotations

import argparse
import heapq
import json
import sys

import regex

import gguf

# llama.cpp token types (tokenizer.ggml.token_type)
TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED, TT_BYTE = 1, 2, 3, 4, 5, 6

CASE_SEPARATOR = "\n__ggml_vocab_test__\n"

# GPT-2 pattern (also llama.cpp's "default" BPE pre-tokenizer)
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# Pre-tokenizer regex sequences by tokenizer.ggml.pre (the subset of llama.cpp's table
# that uses the plain GPT-2 pattern; llama.cpp's "default" is different and unsupported).
PRE_TOKENIZER_REGEXES: dict[str, list[str]] = {
    "gpt-2": [_GPT2],
    "starcoder": [r"\p{N}", _GPT2],
    "smollm": [r"\p{N}", _GPT2],
    "refact": [r"\p{N}", _GPT2],
    "codeshell": [r"\p{N}", _GPT2],
    "command-r": [r"\p{N}", _GPT2],
    "exaone": [r"\p{N}", _GPT2],
    "minerva-7b": [r"\p{N}", _GPT2],
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode char table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_ENCODER = bytes_to_unicode()
BYTE_DECODER = {c: b for b, c in BYTE_ENCODER.items()}


def split_keep_gaps(pat: regex.Pattern, text: str) -> list[str]:
    """Split text into regex matches AND the (non-empty) text between them, in order."""
    out, pos = [], 0
    for m in pat.finditer(text):
        if m.start() > pos:
            out.append(text[pos:m.start()])
        if m.end() > m.start():
            out.append(m.group())
        pos = m.end()
    if pos < len(text):
        out.append(text[pos:])
    return out


class BPETokenizer:
    def __init__(self, tokens: list[str], token_types: list[int], merges: list[str], pre: str):
        self.tokens = tokens
        self.token_types = token_types
        self.token_to_id = {t: i for i, t in enumerate(tokens)}
        # merges: "left right" -> rank (llama.cpp splits at the first space after index 0)
        self.ranks: dict[tuple[str, str], int] = {}
        for rank, m in enumerate(merges):
            p = m.find(" ", 1)
            if p < 0:
                continue
            self.ranks[(m[:p], m[p + 1:])] = rank
        if pre not in PRE_TOKENIZER_REGEXES:
            raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r}; known: {sorted(PRE_TOKENIZER_REGEXES)}")
        self.pre = pre
        self.pre_regexes = [regex.compile(r) for r in PRE_TOKENIZER_REGEXES[pre]]
        # special tokens, longest text first (stable on id for equal lengths)
        self.special = [i for i, t in enumerate(token_types) if t in (TT_CONTROL, TT_USER_DEFINED, TT_UNKNOWN)]
        self.special.sort(key=lambda i: -len(tokens[i]))
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def from_gguf(cls, path: str) -> "BPETokenizer":
        r = gguf.GGUFReader(path)
        f = r.fields
        model = f["tokenizer.ggml.model"].contents()
        if model != "gpt2":
            raise ValueError(f"tokenizer.ggml.model is {model!r}, only 'gpt2' (byte-level BPE) is supported")
        pre = f["tokenizer.ggml.pre"].contents() if "tokenizer.ggml.pre" in f else "default"
        tokens = f["tokenizer.ggml.tokens"].contents()
        types = f["tokenizer.ggml.token_type"].contents() if "tokenizer.ggml.token_type" in f else [TT_NORMAL] * len(tokens)
        merges = f["tokenizer.ggml.merges"].contents()
        return cls(tokens, types, merges, pre)

    # ---- encoding -------------------------------------------------------
    def _partition_special(self, text: str, parse_special: bool) -> list[tuple[bool, str | int]]:
        """Split text into [(is_token, token_id | raw_text)], longest special first."""
        frags: list[tuple[bool, str | int]] = [(False, text)]
        for tid in self.special:
            if not parse_special and self.token_types[tid] in (TT_CONTROL, TT_UNKNOWN):
                continue
            s = self.tokens[tid]
            if not s:
                continue
            new: list[tuple[bool, str | int]] = []
            for is_tok, frag in frags:
                if is_tok or s not in frag:
                    new.append((is_tok, frag))
                    continue
                parts = frag.split(s)
                for k, part in enumerate(parts):
                    if k > 0:
                        new.append((True, tid))
                    if part:
                        new.append((False, part))
            frags = new
        return frags

    def _pretokenize(self, text: str) -> list[str]:
        pieces = [text]
        for pat in self.pre_regexes:
            pieces = [p for piece in pieces for p in split_keep_gaps(pat, piece)]
        return pieces

    def _bpe(self, word: str) -> list[int]:
        """BPE-merge one byte-mapped word; returns token ids."""
        if word in self._cache:
            return self._cache[word]
        syms = list(word)  # one symbol per (byte-mapped) character
        # doubly linked list + heap of (rank, left_index, left_text, right_text)
        prev = list(range(-1, len(syms) - 1))
        nxt = list(range(1, len(syms) + 1))
        nxt[-1] = -1
        heap: list[tuple[int, int, str, str]] = []

        def push(i: int) -> None:
            j = nxt[i]
            if j == -1:
                return
            r = self.ranks.get((syms[i], syms[j]))
            if r is not None:
                heapq.heappush(heap, (r, i, syms[i], syms[j]))

        for i in range(len(syms) - 1):
            push(i)
        while heap:
            r, i, left, right = heapq.heappop(heap)
            j = nxt[i]
            # skip stale entries (symbols changed since the pair was queued)
            if j == -1 or syms[i] != left or syms[j] != right:
                continue
            syms[i] = left + right
            syms[j] = ""
            nxt[i] = nxt[j]
            if nxt[j] != -1:
                prev[nxt[j]] = i
            if prev[i] != -1:
                push(prev[i])
            push(i)
        ids: list[int] = []
        i = 0
        while i != -1:
            s = syms[i]
            tid = self.token_to_id.get(s)
            if tid is not None:
                ids.append(tid)
            else:  # llama.cpp fallback: per-byte lookup of the symbol's UTF-8 bytes
                for b in s.encode("utf-8"):
                    t = self.token_to_id.get(chr(b)) if b < 128 else None
                    if t is not None:
                        ids.append(t)
            i = nxt[i]
        self._cache[word] = ids
        return ids

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        ids: list[int] = []
        for is_tok, frag in self._partition_special(text, parse_special):
            if is_tok:
                ids.append(frag)  # type: ignore[arg-type]
                continue
            for piece in self._pretokenize(frag):  # type: ignore[arg-type]
                word = "".join(BYTE_ENCODER[b] for b in piece.encode("utf-8"))
                ids.extend(self._bpe(word))
        return ids

    # ---- decoding -------------------------------------------------------
    def token_bytes(self, tid: int) -> bytes:
        t = self.tokens[tid]
        if self.token_types[tid] in (TT_CONTROL, TT_USER_DEFINED, TT_UNKNOWN):
            return t.encode("utf-8")
        return bytes(BYTE_DECODER[c] for c in t if c in BYTE_DECODER)

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")


def decode_with_vocab(tokens: list[str], ids, token_types: list[int] | None = None) -> str:
    """Decode ids using just a GGUF tokens array (GPT-2 byte-level mapping)."""
    out = bytearray()
    for i in ids:
        t = tokens[int(i)]
        if token_types is not None and token_types[int(i)] in (TT_CONTROL, TT_USER_DEFINED, TT_UNKNOWN):
            out += t.encode("utf-8")
        elif all(c in BYTE_DECODER for c in t):
            out += bytes(BYTE_DECODER[c] for c in t)
        else:
            out += t.encode("utf-8")
    return out.decode("utf-8", errors="replace")


def read_cases(path: str) -> list[str]:
    """llama.cpp test .inp format: texts separated by '\\n__ggml_vocab_test__\\n'."""
    with open(path, encoding="utf-8", newline="") as fh:
        data = fh.read()
    parts = data.split(CASE_SEPARATOR)
    if parts and parts[-1] == "":
        parts.pop()  # file ends with a separator
    return parts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--cases", help="case file (texts separated by a __ggml_vocab_test__ line)")
    ap.add_argument("--out", help="write JSON list of {text, ids}")
    ap.add_argument("--check", nargs=2, metavar=("INP", "OUT"), help="compare against llama.cpp .inp/.out vectors")
    ap.add_argument("--text", help="tokenize one string and print ids")
    ap.add_argument("--no-special", action="store_true", help="do not parse special tokens in the text")
    a = ap.parse_args()
    tok = BPETokenizer.from_gguf(a.model)
    parse_special = not a.no_special

    if a.text is not None:
        print(" ".join(map(str, tok.encode(a.text, parse_special))))
    if a.check:
        cases = read_cases(a.check[0])
        with open(a.check[1], encoding="utf-8") as fh:
            expected = [[int(x) for x in line.split()] for line in fh.read().split("\n")[: len(cases)]]
        bad = 0
        for k, (text, exp) in enumerate(zip(cases, expected)):
            # llama.cpp's test-tokenizer-0 uses parse_special = false
            got = tok.encode(text, parse_special=False)
            if got != exp:
                bad += 1
                print(f"MISMATCH case {k}: {text!r}\n  expected {exp}\n  got      {got}")
        print(f"{len(cases) - bad}/{len(cases)} cases match")
        if bad:
            return 1
    if a.cases:
        texts = read_cases(a.cases)
        result = [{"text": t, "ids": tok.encode(t, parse_special)} for t in texts]
        for t in result:  # round-trip sanity: decoding must give the text back
            if tok.decode(t["ids"]) != t["text"]:
                print(f"warning: decode round-trip differs for {t['text']!r}", file=sys.stderr)
        if a.out:
            with open(a.out, "w", encoding="utf-8") as fh:
                json.dump(result, fh, ensure_ascii=False, indent=1)
                fh.write("\n")
            print(f"wrote {len(result)} cases to {a.out}")
        else:
            for t in result:
                print(json.dumps(t, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
