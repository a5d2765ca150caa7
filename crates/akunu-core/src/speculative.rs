//! N-gram (prompt-lookup) drafting for speculative decode.
//!
//! The predictor keeps the whole sequence (prompts and generated tokens) and,
//! for every n in `min_n..=max_n`, a map from each n-gram to the position
//! right after its most recent occurrence. To draft, it looks up the last n
//! tokens, longest n first, and proposes what followed that earlier
//! occurrence. Adding a token is O(max_n - min_n + 1) map updates.

use std::collections::HashMap;

/// Speculative decode settings.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct SpecOptions {
    /// Shortest n-gram matched.
    pub ngram_min: u32,
    /// Longest n-gram matched (tried first).
    pub ngram_max: u32,
    /// Most drafted tokens per verification pass.
    pub draft: u32,
}

/// Most drafted tokens per verification pass any setting may ask for.
pub const MAX_DRAFT: u32 = 15;

impl Default for SpecOptions {
    fn default() -> Self {
        SpecOptions {
            ngram_min: 2,
            ngram_max: 4,
            // As long as a pass may be: drafts start short and earn their
            // length by full accepts, and the backend caps them at its exact
            // rows (CUDA: 7). On the CPU a copy task gains from the longer
            // passes: 1.8x at 8, 1.95-2.07x at 15 (bench/RESULTS.md).
            draft: MAX_DRAFT,
        }
    }
}

impl SpecOptions {
    pub fn validate(&self) -> Result<(), String> {
        if self.ngram_min == 0 || self.ngram_min > self.ngram_max || self.ngram_max > 16 {
            return Err(format!(
                "n-gram range {}..={} must satisfy 1 <= min <= max <= 16",
                self.ngram_min, self.ngram_max
            ));
        }
        if self.draft == 0 || self.draft > MAX_DRAFT {
            return Err(format!(
                "draft length {} must be in 1..={MAX_DRAFT}",
                self.draft
            ));
        }
        Ok(())
    }
}

/// Prompt-lookup predictor over one sequence.
pub struct NgramPredictor {
    min_n: usize,
    max_n: usize,
    tokens: Vec<u32>,
    /// `maps[n - min_n]`: hash of an n-gram -> index right after its most
    /// recent occurrence whose continuation is known.
    maps: Vec<HashMap<u64, u32>>,
}

fn hash(gram: &[u32]) -> u64 {
    // FNV-1a over the ids, then a final mix; collisions are caught by
    // comparing the tokens on lookup.
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &t in gram {
        h = (h ^ t as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^ (h >> 29)
}

impl NgramPredictor {
    pub fn new(opts: &SpecOptions) -> Self {
        let (min_n, max_n) = (opts.ngram_min.max(1) as usize, opts.ngram_max as usize);
        NgramPredictor {
            min_n,
            max_n: max_n.max(min_n),
            tokens: Vec::new(),
            maps: (min_n..=max_n.max(min_n)).map(|_| HashMap::new()).collect(),
        }
    }

    /// A predictor that has seen `seq`.
    pub fn with_tokens(opts: &SpecOptions, seq: &[u32]) -> Self {
        let mut p = Self::new(opts);
        p.tokens.reserve(seq.len() + 256);
        for &t in seq {
            p.push(t);
        }
        p
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Appends one token. The n-grams that end just before it now have a
    /// known continuation (this token), so they are recorded; the n-grams
    /// ending with it are recorded when the next token arrives, so that a
    /// lookup of the sequence's tail never finds the tail itself.
    pub fn push(&mut self, t: u32) {
        let end = self.tokens.len();
        self.tokens.push(t);
        for n in self.min_n..=self.max_n {
            if end >= n {
                let h = hash(&self.tokens[end - n..end]);
                self.maps[n - self.min_n].insert(h, end as u32);
            }
        }
    }

    /// Up to `k` tokens predicted to follow the sequence (empty when no
    /// n-gram of the tail occurred before). A copy that runs into the tail
    /// continues with its own output, so a loop of period p drafts a whole
    /// `k` tokens.
    pub fn propose(&self, k: usize, out: &mut Vec<u32>) {
        out.clear();
        let len = self.tokens.len();
        if k == 0 {
            return;
        }
        for n in (self.min_n..=self.max_n).rev() {
            if len < n {
                continue;
            }
            let tail = &self.tokens[len - n..];
            let Some(&e) = self.maps[n - self.min_n].get(&hash(tail)) else {
                continue;
            };
            let e = e as usize;
            if e < n || e >= len || &self.tokens[e - n..e] != tail {
                continue;
            }
            for j in 0..k {
                let i = e + j;
                let t = if i < len {
                    self.tokens[i]
                } else {
                    out[i - len]
                };
                out.push(t);
            }
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(min: u32, max: u32) -> SpecOptions {
        SpecOptions {
            ngram_min: min,
            ngram_max: max,
            draft: 8,
        }
    }

    #[test]
    fn proposes_what_followed_the_latest_match() {
        let p = NgramPredictor::with_tokens(&opts(2, 3), &[1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3]);
        let mut d = Vec::new();
        // Tail [2, 3] last occurred followed by 5, 7.
        p.propose(2, &mut d);
        assert_eq!(d, vec![5, 7]);
        // The longer match wins: [1, 2, 3] was followed by 4, while the
        // more recent [2, 3] was followed by 6.
        let p = NgramPredictor::with_tokens(&opts(2, 3), &[1, 2, 3, 4, 7, 2, 3, 6, 1, 2, 3]);
        p.propose(1, &mut d);
        assert_eq!(d, vec![4]);
    }

    #[test]
    fn loops_draft_a_full_window_and_nothing_matches_fresh_text() {
        let mut p = NgramPredictor::with_tokens(&opts(1, 2), &[5, 6, 7, 5, 6]);
        let mut d = Vec::new();
        p.propose(7, &mut d);
        assert_eq!(d, vec![7, 5, 6, 7, 5, 6, 7]);
        p.push(8);
        p.propose(4, &mut d);
        assert!(d.is_empty());
        let p = NgramPredictor::with_tokens(&opts(1, 3), &[1, 2, 3, 4, 5]);
        p.propose(4, &mut d);
        assert!(d.is_empty());
        let p = NgramPredictor::with_tokens(&opts(1, 3), &[]);
        p.propose(4, &mut d);
        assert!(d.is_empty());
    }

    #[test]
    fn options_are_checked() {
        assert!(SpecOptions::default().validate().is_ok());
        assert!(opts(0, 2).validate().is_err());
        assert!(opts(3, 2).validate().is_err());
        let o = SpecOptions {
            draft: MAX_DRAFT + 1,
            ..Default::default()
        };
        assert!(o.validate().is_err());
    }
}
