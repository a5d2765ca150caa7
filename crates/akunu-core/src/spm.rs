//! SentencePiece-style vocabularies (GGUF `tokenizer.ggml.model = "llama"`:
//! Llama 2, Gemma), encoded as llama.cpp's SPM tokenizer does.
//!
//! A fragment of plain text has its spaces replaced by `▁` (U+2581) and
//! starts as one symbol per UTF-8 character. Every adjacent pair whose
//! concatenation is a vocabulary token is a candidate merge, ranked by that
//! token's score (higher first; the leftmost on ties). The best candidate is
//! merged, its new neighbours become candidates, and so on until none is
//! left. Each final symbol is its token; a symbol that is not in the
//! vocabulary (a character without a token) becomes one `<0xNN>` byte token
//! per UTF-8 byte (byte fallback).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// The space marker of SentencePiece pieces.
pub const SPACE: &str = "\u{2581}";

pub struct SpmModel {
    ids: HashMap<String, u32>,
    scores: Vec<f32>,
    /// The `<0xNN>` token of every byte, where the vocabulary has one.
    byte_tokens: Vec<Option<u32>>,
    unk: Option<u32>,
}

/// A candidate merge of the symbols `left` and `right`.
#[derive(PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Bytes of the merged text when the candidate was made; a merge of
    /// either side since then makes the candidate stale.
    len: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    fn cmp(&self, o: &Self) -> Ordering {
        // Max-heap: the higher score first, then the leftmost pair.
        self.score
            .total_cmp(&o.score)
            .then_with(|| o.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

/// A symbol of the text being merged: bytes `start..start + len`, linked to
/// its live neighbours (`len == 0` once merged into its left neighbour).
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl SpmModel {
    /// `pieces[i]` and `scores[i]` describe token `i`; `unk` is the id used
    /// for a byte the vocabulary has no token for.
    pub fn new(pieces: &[String], scores: Vec<f32>, unk: Option<u32>) -> SpmModel {
        let mut ids = HashMap::with_capacity(pieces.len());
        for (i, p) in pieces.iter().enumerate() {
            // Later duplicates win, as in llama.cpp's token_to_id.
            ids.insert(p.clone(), i as u32);
        }
        let mut byte_tokens = vec![None; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            // As llama.cpp: the `<0xNN>` token, else the byte as a string.
            *slot = ids.get(&format!("<0x{b:02X}>")).copied().or_else(|| {
                std::str::from_utf8(&[b as u8])
                    .ok()
                    .and_then(|s| ids.get(s).copied())
            });
        }
        SpmModel {
            ids,
            scores,
            byte_tokens,
            unk,
        }
    }

    /// The byte a `<0xNN>` piece stands for.
    pub fn byte_of_piece(piece: &str) -> Option<u8> {
        let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
        if hex.len() != 2 {
            return None;
        }
        u8::from_str_radix(hex, 16).ok()
    }

    /// Appends the tokens of `text` (spaces not yet escaped) to `out`.
    pub fn encode(&self, text: &str, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        let text = text.replace(' ', SPACE);
        let mut syms: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            syms.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: Some(i + 1),
            });
        }
        if let Some(last) = syms.last_mut() {
            last.next = None;
        }
        let mut heap = BinaryHeap::new();
        let candidate = |syms: &[Symbol], heap: &mut BinaryHeap<Bigram>, l: usize, r: usize| {
            let (a, b) = (syms[l], syms[r]);
            let merged = &text[a.start..b.start + b.len];
            if let Some(&id) = self.ids.get(merged) {
                heap.push(Bigram {
                    score: self.scores.get(id as usize).copied().unwrap_or(0.0),
                    left: l,
                    right: r,
                    len: merged.len(),
                });
            }
        };
        for i in 1..syms.len() {
            candidate(&syms, &mut heap, i - 1, i);
        }
        while let Some(bg) = heap.pop() {
            let (l, r) = (syms[bg.left], syms[bg.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != bg.len {
                continue; // stale: one side has merged since
            }
            syms[bg.left].len += r.len;
            syms[bg.right].len = 0;
            syms[bg.left].next = r.next;
            if let Some(n) = r.next {
                syms[n].prev = Some(bg.left);
            }
            if let Some(p) = syms[bg.left].prev {
                candidate(&syms, &mut heap, p, bg.left);
            }
            if let Some(n) = syms[bg.left].next {
                candidate(&syms, &mut heap, bg.left, n);
            }
        }
        let mut at = Some(0);
        while let Some(i) = at {
            let s = syms[i];
            let piece = &text[s.start..s.start + s.len];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        out.extend(self.byte_tokens[b as usize].or(self.unk));
                    }
                }
            }
            at = s.next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(tokens: &[(&str, f32)]) -> SpmModel {
        let mut pieces: Vec<String> = tokens.iter().map(|t| t.0.to_string()).collect();
        let mut scores: Vec<f32> = tokens.iter().map(|t| t.1).collect();
        for b in 0..=255u8 {
            pieces.push(format!("<0x{b:02X}>"));
            scores.push(0.0);
        }
        SpmModel::new(&pieces, scores, Some(0))
    }

    #[test]
    fn merges_by_score_and_falls_back_to_bytes() {
        let m = model(&[
            ("<unk>", 0.0),
            ("\u{2581}", -1.0),
            ("a", -1.0),
            ("b", -1.0),
            ("ab", -3.0),
            ("\u{2581}a", -2.0),
            ("\u{2581}ab", -0.5),
        ]);
        let mut out = Vec::new();
        // "▁" + "a" (score -2) merges before "a" + "b" (-3); then "▁a" + "b"
        // is "▁ab".
        m.encode(" ab", &mut out);
        assert_eq!(out, vec![6]);
        out.clear();
        // "ba": no "ba" token, so two symbols.
        m.encode("ba", &mut out);
        assert_eq!(out, vec![3, 2]);
        out.clear();
        // "é" has no token: its two UTF-8 bytes.
        m.encode("é", &mut out);
        assert_eq!(out, vec![7 + 0xC3, 7 + 0xA9]);
        assert_eq!(SpmModel::byte_of_piece("<0xC3>"), Some(0xC3));
        assert_eq!(SpmModel::byte_of_piece("<0xC>"), None);
        assert_eq!(SpmModel::byte_of_piece("a"), None);
    }
}
