//! Token sampling: turning one step's logits into the next token id.
//!
//! Two paths share one definition of "which tokens may be drawn, with which
//! probabilities" ([`candidates`]):
//!
//! * the **CPU pipeline** ([`sample_cpu`], [`sample_cpu_masked`]) filters the
//!   distribution and walks its CDF with one uniform number;
//! * the **in-chain path** ([`gumbel_transform`]) rewrites the logits so that a
//!   plain argmax over them is a draw from the same filtered distribution
//!   (Gumbel-max trick), which lets sampling stay inside a recorded command
//!   chain that ends in an argmax.
//!
//! Filtering order, for `temperature > 0`: repetition penalty (done by the
//! caller of [`candidates`]), temperature, stable softmax over the whole
//! vocabulary, top-k, min-p, top-p, renormalisation. Top-p measures mass
//! against the *full* softmax, not the top-k-renormalised one.
//!
//! Randomness is a stateless hash of `(seed, position, token)`, so a draw does
//! not depend on how many draws came before it, on batch/chunk boundaries, or
//! on which path made it.
//!
//! Ordering and ties: candidates are ranked by their (penalised) logit, larger
//! first, equal logits by lower token id. Ranking by the logit rather than by
//! the rounded probability keeps the ranking exact: two distinct logits can
//! round to the same f32 probability, but never swap order.

/// Candidate cap the CPU pipeline applies when `top_k == 0`, so min-p, top-p
/// and the CDF walk never touch the whole vocabulary.
pub const TOP_K_CAP: usize = 256;

/// Sampling parameters of one generation request.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SamplingConfig {
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep at most this many tokens; 0 means no explicit limit (the CPU
    /// pipeline still caps at [`TOP_K_CAP`]).
    pub top_k: u32,
    /// Nucleus mass in (0, 1]; 1 disables the filter.
    pub top_p: f32,
    /// Relative probability floor in [0, 1); 0 disables the filter.
    pub min_p: f32,
    /// Repetition penalty (> 0); 1 disables it.
    pub repeat_penalty: f32,
    /// How many of the most recent tokens the penalty looks at.
    pub repeat_last_n: u32,
    /// Seed of the stateless random stream.
    pub seed: u64,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
        }
    }
}

/// A sampling parameter outside its domain.
#[derive(Debug, thiserror::Error)]
pub enum SamplingError {
    #[error("temperature must be a finite number >= 0, got {0}")]
    Temperature(f32),
    #[error("top_p must be a number in (0, 1], got {0}")]
    TopP(f32),
    #[error("min_p must be a number in [0, 1), got {0}")]
    MinP(f32),
    #[error("repeat_penalty must be a finite number > 0, got {0}")]
    RepeatPenalty(f32),
}

impl SamplingConfig {
    /// Checks every float parameter; the comparisons are written so that NaN
    /// fails them.
    pub fn validate(&self) -> Result<(), SamplingError> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(SamplingError::Temperature(t));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        if !(self.min_p >= 0.0 && self.min_p < 1.0) {
            return Err(SamplingError::MinP(self.min_p));
        }
        // An infinite penalty is rejected too: it would map positive logits to
        // 0 rather than suppress them, which is never what the user meant.
        let r = self.repeat_penalty;
        if !(r.is_finite() && r > 0.0) {
            return Err(SamplingError::RepeatPenalty(r));
        }
        Ok(())
    }

    /// True when sampling reduces to argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// The part of `recent` the penalty applies to: its last `repeat_last_n`
    /// entries (callers may pass a longer history or just the window).
    fn penalty_window<'a>(&self, recent: &'a [u32]) -> &'a [u32] {
        let n = (self.repeat_last_n as usize).min(recent.len());
        &recent[recent.len() - n..]
    }
}

// ---------------------------------------------------------------------------
// Stateless randomness
// ---------------------------------------------------------------------------

/// Stateless 32-bit hash: one step of the 32-bit PCG linear congruential
/// generator (multiplier 747796405, increment 2891336453) followed by the
/// PCG-RXS-M-XS output permutation (random xorshift, multiply by 277803737,
/// fixed xorshift by 22). This is the "pcg_hash" of Jarzynski & Olano, "Hash
/// Functions for GPU Rendering" (JCGT 2020); it is a bijection on `u32`, so
/// distinct inputs never collide, and it is cheap enough for a GPU kernel to
/// evaluate per vocabulary entry.
#[inline(always)]
pub fn pcg_hash(x: u32) -> u32 {
    let state = x.wrapping_mul(747_796_405).wrapping_add(2_891_336_453);
    // The top 4 bits pick the shift (4..=19), so the high bits stay intact and
    // the step is invertible.
    let word = ((state >> ((state >> 28) + 4)) ^ state).wrapping_mul(277_803_737);
    (word >> 22) ^ word
}

/// Hashes `(seed, position, token)` to 32 bits. Each input is folded in and
/// then passed through a full hash, so neighbouring positions or tokens give
/// unrelated words. The 64-bit seed is reduced to 32 bits (high half hashed,
/// then xor-ed into the low half).
fn mix(seed: u64, position: u32, token: u32) -> u32 {
    let s = pcg_hash(seed as u32 ^ pcg_hash((seed >> 32) as u32));
    pcg_hash(pcg_hash(s ^ position) ^ token)
}

/// Uniform number in the open interval (0, 1), a pure function of
/// `(seed, position, token)`.
///
/// The top 23 hash bits `k` give `(2k + 1) / 2^24`: the midpoints of 2^23
/// equal cells. Every such value is exactly representable in f32 (24-bit
/// significand), the smallest is 2^-24 and the largest 1 - 2^-24, so neither 0
/// nor 1 can come out and `ln(u)`, `ln(-ln(u))` are always finite.
pub fn uniform(seed: u64, position: u32, token: u32) -> f32 {
    let k = mix(seed, position, token) >> 9;
    (2 * k + 1) as f32 * (1.0 / 16_777_216.0)
}

/// The part of [`mix`] that depends on (seed, position) only: per-token
/// noise is then one hash of `base ^ token`.
fn position_base(seed: u64, position: u32) -> u32 {
    let s = pcg_hash(seed as u32 ^ pcg_hash((seed >> 32) as u32));
    pcg_hash(s ^ position)
}

/// Natural logarithm of a positive normal f32 to about 1 ulp, branch-free so
/// that loops over the vocabulary vectorise. The mantissa is reduced to
/// [sqrt(1/2), sqrt(2)) so that near 1 the polynomial works on `x - 1`
/// (exact) and keeps full relative precision: that is where the Gumbel
/// noise's inner logarithm lands for its largest (winning) values.
#[inline(always)]
#[allow(clippy::excessive_precision)] // the coefficients as published
fn ln_fast(x: f32) -> f32 {
    const SQRT_HALF: f32 = std::f32::consts::FRAC_1_SQRT_2;
    let bits = x.to_bits();
    let mut e = ((bits >> 23) & 0xff) as i32 - 126;
    // Mantissa in [0.5, 1).
    let mut m = f32::from_bits((bits & 0x007f_ffff) | 0x3f00_0000);
    let small = m < SQRT_HALF;
    e -= small as i32;
    m = if small { m + m } else { m };
    let f = m - 1.0; // in [-0.293, 0.414]
    let z = f * f;
    // ln(1 + f) = f - f^2/2 + f^3 P(f): the classic single-precision
    // minimax polynomial.
    let mut y = 7.037_683_6e-2;
    y = y * f - 1.151_461_1e-1;
    y = y * f + 1.167_699_9e-1;
    y = y * f - 1.242_014_1e-1;
    y = y * f + 1.424_932_3e-1;
    y = y * f - 1.666_805_8e-1;
    y = y * f + 2.000_071_5e-1;
    y = y * f - 2.499_999_4e-1;
    y = y * f + 3.333_333_1e-1;
    y *= f * z;
    let ef = e as f32;
    y += ef * -2.121_944_4e-4;
    y -= 0.5 * z;
    (f + y) + ef * 0.693_359_4
}

/// Gumbel noise from a 32-bit hash: `u = (2k + 1) / 2^24` from its top 23
/// bits, then `-ln(-ln(u))`.
#[inline(always)]
fn gumbel_from_hash(h: u32) -> f32 {
    let u = (2 * (h >> 9) + 1) as f32 * (1.0 / 16_777_216.0);
    -ln_fast(-ln_fast(u))
}

/// Standard Gumbel noise `-ln(-ln(u))`, `u = uniform(seed, position, token)`.
/// Since u lies in [2^-24, 1 - 2^-24], the result lies in about [-2.81, 16.6];
/// the truncated tails hold about 6e-8 of the mass each. Computed in f32
/// with a vectorisable logarithm; this is the noise every path uses.
pub fn gumbel(seed: u64, position: u32, token: u32) -> f32 {
    gumbel_from_hash(pcg_hash(position_base(seed, position) ^ token))
}

/// A fresh seed for requests that did not set one: wall-clock nanoseconds, a
/// stack address (ASLR), a process-wide counter (two calls in the same
/// nanosecond still differ) and the OS-seeded keys of std's `RandomState`,
/// folded together with splitmix64.
pub fn random_seed() -> u64 {
    use std::hash::BuildHasher;
    use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
    use std::time::{SystemTime, UNIX_EPOCH};

    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let local = 0u8;
    let addr = std::ptr::addr_of!(local) as usize as u64;
    let count = COUNTER.fetch_add(1, AtomicOrdering::Relaxed);
    let keyed = std::collections::hash_map::RandomState::new().hash_one(count);
    splitmix64(nanos ^ splitmix64(addr ^ splitmix64(count ^ keyed)))
}

/// The splitmix64 finaliser: a strong 64-bit bit mixer.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

// ---------------------------------------------------------------------------
// Repetition penalty
// ---------------------------------------------------------------------------

/// Windows up to this length are de-duplicated by a quadratic scan (no
/// allocation); longer ones through a sorted copy.
const SMALL_WINDOW: usize = 128;

/// Applies the repetition penalty in place, once per distinct token of
/// `recent` (the caller passes only the window). Positive logits are divided
/// by `penalty` and the others multiplied, so the token always becomes less
/// likely when `penalty > 1`. Token ids outside `logits` are ignored.
pub fn apply_repetition_penalty(logits: &mut [f32], recent: &[u32], penalty: f32) {
    if penalty == 1.0 || recent.is_empty() {
        return;
    }
    let mut penalise = |tok: u32| {
        if let Some(l) = logits.get_mut(tok as usize) {
            *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
        }
    };
    if recent.len() <= SMALL_WINDOW {
        for (j, &tok) in recent.iter().enumerate() {
            // Only the first occurrence counts; a repeated token must not be
            // penalised twice.
            if !recent[..j].contains(&tok) {
                penalise(tok);
            }
        }
    } else {
        let mut ids = recent.to_vec();
        ids.sort_unstable();
        ids.dedup();
        ids.into_iter().for_each(penalise);
    }
}

// ---------------------------------------------------------------------------
// Candidate set
// ---------------------------------------------------------------------------

/// Reusable buffers for the sampling functions; keep one per decode thread so
/// that sampling allocates nothing once the buffers have grown to the
/// vocabulary size.
#[derive(Debug, Default)]
pub struct Scratch {
    /// Penalised copy of the logits (the caller's slice is never modified by
    /// the CPU pipeline).
    work: Vec<f32>,
    /// Rank keys (see [`rank_key`]) of the candidates.
    keys: Vec<u64>,
    /// `(token, probability)` handed out by [`candidates`].
    out: Vec<(u32, f32)>,
}

impl Scratch {
    pub fn new() -> Self {
        Self::default()
    }
}

/// Packs `(logit, token)` into one integer whose ascending order is the rank
/// order: larger logit first, equal logits by lower id. Selection and sorting
/// then run on plain `u64` comparisons (several times faster than a float
/// comparator with a tie-break), and the logit is recovered exactly.
///
/// The float is mapped to an order-preserving `u32` (flip all bits of a
/// negative, set the sign bit of a positive) and complemented, so larger
/// logits get smaller keys. `-0.0` is first folded into `+0.0` so the two
/// compare equal, as they do for `==`. Keys never hold NaN.
#[inline]
fn rank_key(l: f32, id: u32) -> u64 {
    let b = (l + 0.0).to_bits();
    let ord = if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    };
    (u64::from(!ord) << 32) | u64::from(id)
}

/// The logit packed into a [`rank_key`].
#[inline]
fn key_logit(key: u64) -> f32 {
    let ord = !((key >> 32) as u32);
    let b = if ord & 0x8000_0000 != 0 {
        ord & 0x7FFF_FFFF
    } else {
        !ord
    };
    f32::from_bits(b)
}

/// The token id packed into a [`rank_key`].
#[inline]
fn key_id(key: u64) -> u32 {
    key as u32
}

/// Argmax skipping NaN, lowest id on ties; 0 when nothing beats -inf.
fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0u32;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i as u32;
        }
    }
    best
}

/// Outcome of [`filter`].
enum Kept {
    /// A single certain token: greedy decoding, an all-masked vector (token 0,
    /// by the argmax convention) or a `+inf` logit (the lowest such id).
    Single(u32),
    /// `keys` holds the kept candidates. Token `i`'s weight is
    /// `exp((l_i - max) * inv_t)`; `sum` is the total weight of the kept ones.
    Weighted { max: f32, inv_t: f32, sum: f64 },
}

/// Unnormalised probability of logit `l` (the largest logit gets weight 1).
/// Both paths and every stage use this one expression, so they agree bit for
/// bit. With `inv_t == 1.0` (temperature 1) the multiply is the identity, so no
/// scaling error is introduced.
#[inline]
fn weight(l: f32, max: f32, inv_t: f32) -> f32 {
    ((l - max) * inv_t).exp()
}

/// Runs `$body` (an expression over its arguments) compiled for AVX2+FMA
/// when the CPU has them, else for the baseline. The crate is built for
/// baseline x86-64 (SSE2), where the dense sampling loops cannot vectorise
/// (per-lane shifts in the hash); the results are identical either way,
/// since Rust never fuses operations on its own.
macro_rules! multiversion {
    ($name:ident, $generic:ident, ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn wide($($arg: $ty),*) -> $ret {
                    $generic($($arg),*)
                }
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: the features `wide` is compiled for were just
                    // detected on this CPU.
                    return unsafe { wide($($arg),*) };
                }
            }
            $generic($($arg),*)
        }
    };
}

multiversion!(dense_gumbel, dense_gumbel_generic, (logits: &mut [f32], max: f32, inv_t: f32, base: u32) -> ());
multiversion!(softmax_mass, softmax_mass_generic, (logits: &[f32], max: f32, inv_t: f32) -> f64);

/// Every token a candidate: `(l - max) / T + G(token)`, masked tokens stay
/// -inf. The argmax needs no normaliser, so this stands in for `ln p + G`.
#[inline(always)]
fn dense_gumbel_generic(logits: &mut [f32], max: f32, inv_t: f32, base: u32) {
    for (i, l) in logits.iter_mut().enumerate() {
        let g = gumbel_from_hash(pcg_hash(base ^ i as u32));
        // `>` keeps -inf and NaN (masked tokens) out for good.
        *l = if *l > f32::NEG_INFINITY {
            (*l - max) * inv_t + g
        } else {
            f32::NEG_INFINITY
        };
    }
}

/// `sum(exp((l - max) / T))` over the unmasked logits, accumulated in f64
/// lanes from a branch-free f32 exp so that the loop vectorises.
#[inline(always)]
fn softmax_mass_generic(logits: &[f32], max: f32, inv_t: f32) -> f64 {
    let mut acc = [0f64; 8];
    let chunks = logits.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..8 {
            let w = exp_fast((c[j] - max) * inv_t);
            acc[j] += if c[j] > f32::NEG_INFINITY {
                w as f64
            } else {
                0.0
            };
        }
    }
    let mut total: f64 = acc.iter().sum();
    for &l in rest {
        if l > f32::NEG_INFINITY {
            total += exp_fast((l - max) * inv_t) as f64;
        }
    }
    total
}

/// e^x for x <= 0 (scaled logits), relative error below 1e-6, branch-free.
#[inline(always)]
fn exp_fast(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: rounds to an integer
    let x = x.clamp(-87.0, 0.0);
    let n = (x * std::f32::consts::LOG2_E + ROUND) - ROUND;
    // Cody-Waite: ln 2 in two parts keeps f exact.
    let f = (x - n * 0.693_145_75) - n * 1.428_606_8e-6;
    let p = 1.0
        + f * (1.0
            + f * (0.5
                + f * (1.0 / 6.0
                    + f * (1.0 / 24.0
                        + f * (1.0 / 120.0 + f * (1.0 / 720.0 + f * (1.0 / 5040.0)))))));
    p * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

/// A cheap, conservative test of which logits can be candidates: the
/// scaled distance `(max - l) / T` must fall in a histogram bin at or above
/// the one where the k-th largest lies, and must not exceed -ln(min_p) (plus
/// a margin: survivors still get the exact min-p test).
struct KeyBound {
    max: f32,
    inv_t: f32,
    scale: f32,
    last_bin: u32,
    min_p_dist: f32,
}

const KEY_BINS: usize = 1024;

impl KeyBound {
    #[inline(always)]
    fn new(logits: &[f32], max: f32, inv_t: f32, k: usize, min_w: f32) -> KeyBound {
        let min_p_dist = if min_w > 0.0 {
            -(min_w as f64).ln() as f32 * 1.001 + 1e-4
        } else {
            f32::INFINITY
        };
        let mut b = KeyBound {
            max,
            inv_t,
            scale: 0.0,
            last_bin: u32::MAX,
            min_p_dist,
        };
        if k >= logits.len() {
            return b;
        }
        // Scaled distances beyond the min-p bound never matter; otherwise
        // bin the whole finite range.
        let span = logits
            .iter()
            .filter(|l| l.is_finite())
            .map(|&l| (max - l) * inv_t)
            .fold(0f32, f32::max)
            .min(min_p_dist);
        if !(span > 0.0 && span.is_finite()) {
            return b;
        }
        b.scale = (KEY_BINS - 1) as f32 / span;
        let mut hist = [0u32; KEY_BINS];
        for &l in logits {
            if l > f32::NEG_INFINITY
                && let Some(bin) = b.bin(l)
            {
                hist[bin as usize] += 1;
            }
        }
        let mut seen = 0usize;
        for (i, &c) in hist.iter().enumerate() {
            seen += c as usize;
            if seen >= k {
                b.last_bin = i as u32;
                break;
            }
        }
        b
    }

    /// The bin of a finite logit, or None beyond the min-p bound.
    #[inline(always)]
    fn bin(&self, l: f32) -> Option<u32> {
        let d = (self.max - l) * self.inv_t;
        if d > self.min_p_dist {
            return None;
        }
        Some(((d * self.scale) as u32).min(KEY_BINS as u32 - 1))
    }

    #[inline(always)]
    fn admits(&self, l: f32) -> bool {
        if self.scale == 0.0 {
            return (self.max - l) * self.inv_t <= self.min_p_dist;
        }
        matches!(self.bin(l), Some(b) if b <= self.last_bin)
    }
}

/// Below this many keys the nucleus search just sorts and walks.
const NUCLEUS_SORT: usize = 64;

/// Top-p without a full sort: moves the smallest rank-order prefix of `keys`
/// whose weight reaches `target` to the front (in no particular order) and
/// returns its length, or `keys.len()` if the whole set falls short (rounding).
///
/// Quickselect on mass: split the undecided range at its middle rank with
/// `select_nth_unstable`, weigh the better half, and keep searching in the half
/// where the running mass crosses `target`. Each round costs O(range) and
/// halves the range, so the whole search is O(s) expected for s keys, whatever
/// the nucleus size.
fn nucleus(keys: &mut [u64], target: f64, max: f32, inv_t: f32) -> usize {
    let w = |k: &u64| weight(key_logit(*k), max, inv_t) as f64;
    // Invariant: keys[..lo] are the best `lo` keys, weigh `acc < target`, and
    // the answer lies in lo + 1..=hi.
    let (mut lo, mut hi) = (0usize, keys.len());
    let mut acc = 0.0f64;
    while hi - lo > NUCLEUS_SORT {
        let half = (hi - lo) / 2;
        keys[lo..hi].select_nth_unstable(half);
        let m: f64 = keys[lo..lo + half].iter().map(w).sum();
        if acc + m >= target {
            hi = lo + half;
        } else {
            acc += m;
            lo += half;
        }
    }
    keys[lo..hi].sort_unstable();
    for (j, k) in keys[lo..hi].iter().enumerate() {
        acc += w(k);
        if acc >= target {
            return lo + j + 1;
        }
    }
    // Summation order differs between the halving and the walk; if rounding
    // leaves the walk just short, the range known to reach the target stands.
    hi
}

multiversion!(filter, filter_generic, (logits: &[f32], cfg: &SamplingConfig, cap: usize, ordered: bool, keys: &mut Vec<u64>) -> Kept);

/// The body of `filter`, compiled once per SIMD level by `multiversion!`.
/// Computes the candidate set of (already penalised) `logits` into `keys`,
/// sorted in rank order when `ordered` (the in-chain path only needs the set).
///
/// `cap` is the top-k limit used when `cfg.top_k == 0`.
///
/// Cost, n = vocabulary size, s = tokens passing min-p, k = the top-k limit,
/// c = the number of kept tokens:
/// * one O(n) pass: max, then (only when top-p or min-p is on) one `exp` per
///   token for the softmax total and the min-p test. Min-p runs *before* any
///   ordering work: it is a threshold on the same ranking, so filtering first
///   keeps exactly the tokens that top-k followed by min-p would keep;
/// * top-k: `select_nth_unstable` over the s survivors, O(s) expected;
/// * top-p: a quickselect on probability mass ([`nucleus`]), O(min(s, k));
/// * order (CPU path and [`candidates`] only): sorting the c kept keys,
///   O(c log c).
///
/// So no stage sorts the vocabulary unless every token is kept and ordered
/// output is asked for (no top-k, `cap == usize::MAX`, top-p and min-p off):
/// then the sort is the O(n log n) output itself.
#[inline(always)]
fn filter_generic(
    logits: &[f32],
    cfg: &SamplingConfig,
    cap: usize,
    ordered: bool,
    keys: &mut Vec<u64>,
) -> Kept {
    keys.clear();
    let inv_t = 1.0 / cfg.temperature;
    // A subnormal temperature overflows 1/T; treat it like 0 rather than
    // produce inf * 0 = NaN for the top token.
    if cfg.is_greedy() || !inv_t.is_finite() || inv_t <= 0.0 || logits.is_empty() {
        return Kept::Single(argmax(logits));
    }
    let max = logits
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m });
    if max == f32::NEG_INFINITY {
        return Kept::Single(0);
    }
    if max == f32::INFINITY {
        let first = logits.iter().position(|&v| v == f32::INFINITY).unwrap_or(0);
        return Kept::Single(first as u32);
    }

    // NaN top_p or min_p count as "off"; an out-of-range min_p can at most
    // leave the top token(s), which always have weight 1.
    let use_top_p = cfg.top_p < 1.0;
    let min_w = if cfg.min_p > 0.0 {
        cfg.min_p.min(1.0)
    } else {
        0.0
    };
    // Top-p measures mass against the whole softmax: one dense pass,
    // written so that it vectorises (masked tokens and NaN add 0).
    let total = if use_top_p {
        softmax_mass(logits, max, inv_t)
    } else {
        0.0
    };

    let k = if cfg.top_k > 0 {
        cfg.top_k as usize
    } else {
        cap
    };
    // Only tokens that can survive top-k and min-p become keys: a histogram
    // of (max - l) / T finds a bin edge above which at least k tokens lie,
    // and min-p bounds the scaled distance by -ln(min_p). Survivors are
    // then filtered exactly as before, so the kept set does not change;
    // only the 49k-key selection and the full exp pass are avoided.
    let bound = KeyBound::new(logits, max, inv_t, k, min_w);
    for (i, &l) in logits.iter().enumerate() {
        // `l > -inf` drops masked tokens and NaN: they are never drawn.
        if l > f32::NEG_INFINITY
            && bound.admits(l)
            && (min_w <= 0.0 || weight(l, max, inv_t) >= min_w)
        {
            keys.push(rank_key(l, i as u32));
        }
    }

    // Top-k (the top token always survives min-p, so keys is not empty).
    let limit = k.max(1).min(keys.len());
    if limit < keys.len() {
        keys.select_nth_unstable(limit - 1);
        keys.truncate(limit);
    }
    // Top-p: mass is measured against the full softmax (`total`), and the
    // first token alone is always kept.
    if use_top_p {
        let target = f64::from(cfg.top_p.max(0.0)) * total;
        let keep = nucleus(keys, target, max, inv_t);
        keys.truncate(keep);
    }
    if ordered {
        keys.sort_unstable();
    }

    let sum = keys
        .iter()
        .map(|&k| weight(key_logit(k), max, inv_t) as f64)
        .sum::<f64>();
    Kept::Weighted { max, inv_t, sum }
}

/// The candidate set of already penalised `logits`: `(token, probability)` in
/// descending probability (equal logits by lower id), probabilities summing to
/// 1 (up to f32 rounding). Greedy configs give the argmax with probability 1.
///
/// `cap` is the top-k limit used when `cfg.top_k == 0`. The CPU pipeline passes
/// [`TOP_K_CAP`] (bounded work per token, like the reference engine); the
/// in-chain path passes `usize::MAX`, i.e. truly no limit. So with `top_k == 0`
/// the two paths can differ (the CPU one never draws beyond the 256 best
/// tokens); with `top_k > 0` both keep exactly the same set.
///
/// Tokens with logit `-inf` or NaN are never candidates. Allocation-free once
/// `scratch` has grown. Cost at vocabulary n: one O(n) pass (max, plus one
/// `exp` per token when top-p or min-p is on), O(s) selection for top-k and
/// top-p over the s tokens that pass min-p, and an O(c log c) sort of the c
/// kept tokens; only an all-tokens-kept set (no top-k, no cap, no top-p or
/// min-p) sorts the whole vocabulary.
pub fn candidates<'a>(
    logits: &[f32],
    cfg: &SamplingConfig,
    cap: usize,
    scratch: &'a mut Scratch,
) -> &'a [(u32, f32)] {
    let kept = filter(logits, cfg, cap, true, &mut scratch.keys);
    scratch.out.clear();
    match kept {
        Kept::Single(tok) => scratch.out.push((tok, 1.0)),
        Kept::Weighted { max, inv_t, sum } => {
            let inv_sum = 1.0 / sum;
            scratch.out.extend(scratch.keys.iter().map(|&k| {
                let p = weight(key_logit(k), max, inv_t) as f64 * inv_sum;
                (key_id(k), p as f32)
            }));
        }
    }
    &scratch.out
}

/// The kept token ids, ascending, of the candidate set of `logits` after the
/// repetition penalty over `recent` (its last `repeat_last_n` entries).
pub fn candidate_ids(
    logits: &[f32],
    recent: &[u32],
    cfg: &SamplingConfig,
    cap: usize,
    scratch: &mut Scratch,
) -> Vec<u32> {
    let mut work = std::mem::take(&mut scratch.work);
    work.clear();
    work.extend_from_slice(logits);
    apply_repetition_penalty(&mut work, cfg.penalty_window(recent), cfg.repeat_penalty);
    let mut ids: Vec<u32> = candidates(&work, cfg, cap, scratch)
        .iter()
        .map(|&(t, _)| t)
        .collect();
    scratch.work = work;
    ids.sort_unstable();
    ids
}

// ---------------------------------------------------------------------------
// CPU pipeline
// ---------------------------------------------------------------------------

/// Filters (already penalised) `logits` and draws one token by walking the
/// CDF with `u = uniform(seed, position, u32::MAX)`. Token id `u32::MAX` is
/// never a vocabulary entry, so this stream is disjoint from the per-token
/// Gumbel noise of the same position.
fn draw(logits: &[f32], cfg: &SamplingConfig, position: u32, keys: &mut Vec<u64>) -> u32 {
    match filter(logits, cfg, TOP_K_CAP, true, keys) {
        Kept::Single(tok) => tok,
        Kept::Weighted { max, inv_t, sum } => {
            // Walk the unnormalised weights against u * sum in f64: the same
            // distribution as the renormalised probabilities, one rounding
            // less.
            let target = uniform(cfg.seed, position, u32::MAX) as f64 * sum;
            let mut cum = 0.0f64;
            let mut last_positive = key_id(keys[0]);
            for &k in keys.iter() {
                let tok = key_id(k);
                let w = weight(key_logit(k), max, inv_t) as f64;
                if w > 0.0 {
                    last_positive = tok;
                }
                cum += w;
                if target <= cum {
                    return tok;
                }
            }
            // Only reachable through rounding of the running sum; never pick
            // a token whose probability underflowed to 0.
            last_positive
        }
    }
}

/// The CPU pipeline: copy the logits, repetition penalty over the last
/// `repeat_last_n` tokens of `recent`, temperature, softmax, top-k (capped at
/// [`TOP_K_CAP`]), min-p, top-p, renormalisation, and a categorical draw with
/// `u = uniform(cfg.seed, position, u32::MAX)`. Keying the draw by position
/// (not by a stateful generator) makes a generation reproducible from its seed
/// however it is chunked. Temperature 0 returns the argmax of the penalised
/// logits (lowest id on ties). `logits` itself is left untouched.
pub fn sample_cpu(
    logits: &[f32],
    recent: &[u32],
    cfg: &SamplingConfig,
    position: u32,
    scratch: &mut Scratch,
) -> u32 {
    let work = &mut scratch.work;
    work.clear();
    work.extend_from_slice(logits);
    apply_repetition_penalty(work, cfg.penalty_window(recent), cfg.repeat_penalty);
    if cfg.is_greedy() {
        return argmax(work);
    }
    draw(&scratch.work, cfg, position, &mut scratch.keys)
}

/// The F32 entry point for grammar-constrained decode: `logits` are already
/// masked (`-inf` for disallowed tokens), so no repetition penalty is applied
/// and no copy is needed. Temperature 1 leaves the logits unscaled (the scale
/// factor is exactly 1.0); otherwise identical to [`sample_cpu`]. A fully
/// masked vector yields token 0.
pub fn sample_cpu_masked(
    logits: &[f32],
    cfg: &SamplingConfig,
    position: u32,
    scratch: &mut Scratch,
) -> u32 {
    if cfg.is_greedy() {
        return argmax(logits);
    }
    draw(logits, cfg, position, &mut scratch.keys)
}

// ---------------------------------------------------------------------------
// In-chain (Gumbel-max) path
// ---------------------------------------------------------------------------

/// Rewrites `logits` in place so that `argmax(logits)` is a draw from the
/// candidate distribution (Gumbel-max: `argmax_i(ln p_i + G_i)` with i.i.d.
/// standard Gumbel `G_i` is distributed as `p`).
///
/// Steps: repetition penalty over the last `repeat_last_n` tokens of `recent`;
/// with temperature 0 stop there (the argmax is the greedy token); otherwise
/// compute the candidate set with `cap = usize::MAX` and write, for each kept
/// token i, `ln p_i + gumbel(seed, position, i)` (with `ln p_i` computed in
/// the log domain as `(l_i - max) / T - ln(kept weight)`, so tiny
/// probabilities do not underflow), and `-inf` for every other token.
///
/// Unlike the CPU pipeline, `top_k == 0` really means "no limit" here (no
/// [`TOP_K_CAP`]): the in-chain path has no per-token CPU cost to bound. With
/// `top_k > 0` the kept set is exactly the CPU path's.
pub fn gumbel_transform(
    logits: &mut [f32],
    recent: &[u32],
    cfg: &SamplingConfig,
    position: u32,
    scratch: &mut Scratch,
) {
    apply_repetition_penalty(logits, cfg.penalty_window(recent), cfg.repeat_penalty);
    if cfg.is_greedy() {
        return;
    }
    let inv_t = 1.0 / cfg.temperature;
    // (NaN top-p or min-p take the general path, which treats them as off.)
    let no_filter = cfg.top_k == 0 && cfg.top_p >= 1.0 && cfg.min_p <= 0.0;
    if no_filter && inv_t.is_finite() && inv_t > 0.0 {
        // Every token is a candidate: one dense, vectorisable pass. The
        // argmax needs no normaliser, so `(l - max) / T + G` stands in for
        // `ln p + G` (they differ by a constant).
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if max.is_finite() {
            dense_gumbel(logits, max, inv_t, position_base(cfg.seed, position));
            return;
        }
    }
    // Argmax needs no order among the kept tokens: skip the final sort.
    let kept = filter(logits, cfg, usize::MAX, false, &mut scratch.keys);
    match kept {
        Kept::Single(tok) => {
            logits.fill(f32::NEG_INFINITY);
            if let Some(l) = logits.get_mut(tok as usize) {
                *l = 0.0;
            }
        }
        Kept::Weighted { max, inv_t, sum } => {
            let ln_sum = sum.ln();
            let base = position_base(cfg.seed, position);
            // `keys` holds copies of the kept logits, so the vector can be
            // cleared before they are written back.
            logits.fill(f32::NEG_INFINITY);
            for &k in scratch.keys.iter() {
                let tok = key_id(k);
                let ln_p = ((key_logit(k) - max) * inv_t) as f64 - ln_sum;
                logits[tok as usize] = ln_p as f32 + gumbel_from_hash(pcg_hash(base ^ tok));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ln_fast_is_accurate_including_near_one() {
        let mut worst = 0f64;
        let mut check = |x: f32| {
            let (a, b) = (ln_fast(x) as f64, (x as f64).ln());
            let err = if b == 0.0 {
                a.abs()
            } else {
                ((a - b) / b).abs()
            };
            worst = worst.max(err);
        };
        let mut x = 1e-30f32;
        while x < 1e30 {
            check(x);
            x *= 1.0137;
        }
        // The Gumbel range: u in [2^-24, 1 - 2^-24], then -ln(u).
        for k in (0..(1u32 << 23))
            .step_by(997)
            .chain((1u32 << 23) - 64..1 << 23)
        {
            let u = (2 * k + 1) as f32 / 16_777_216.0;
            check(u);
            check(-(u as f64).ln() as f32);
        }
        assert!(worst < 1e-6, "worst relative error {worst}");
        // The noise agrees with an f64 evaluation.
        for t in 0..5000 {
            let u = uniform(9, 3, t) as f64;
            let want = -(-u.ln()).ln();
            assert!(
                (gumbel(9, 3, t) as f64 - want).abs() < 1e-5 * want.abs().max(1.0),
                "token {t}"
            );
        }
    }

    fn cfg(temperature: f32) -> SamplingConfig {
        SamplingConfig {
            temperature,
            ..Default::default()
        }
    }

    #[test]
    fn default_config_is_greedy_and_valid() {
        let c = SamplingConfig::default();
        assert!(c.is_greedy());
        c.validate().unwrap();
        assert_eq!(c.repeat_last_n, 64);
        assert_eq!(c.top_p, 1.0);
        assert_eq!(c.repeat_penalty, 1.0);
    }

    #[test]
    fn validate_names_parameter_and_value() {
        let bad: Vec<(SamplingConfig, &str, &str)> = vec![
            (cfg(-1.0), "temperature", "-1"),
            (cfg(f32::NAN), "temperature", "NaN"),
            (cfg(f32::INFINITY), "temperature", "inf"),
            (
                SamplingConfig {
                    top_p: 0.0,
                    ..cfg(1.0)
                },
                "top_p",
                "0",
            ),
            (
                SamplingConfig {
                    top_p: 1.5,
                    ..cfg(1.0)
                },
                "top_p",
                "1.5",
            ),
            (
                SamplingConfig {
                    top_p: f32::NAN,
                    ..cfg(1.0)
                },
                "top_p",
                "NaN",
            ),
            (
                SamplingConfig {
                    min_p: 1.0,
                    ..cfg(1.0)
                },
                "min_p",
                "1",
            ),
            (
                SamplingConfig {
                    min_p: -0.1,
                    ..cfg(1.0)
                },
                "min_p",
                "-0.1",
            ),
            (
                SamplingConfig {
                    min_p: f32::NAN,
                    ..cfg(1.0)
                },
                "min_p",
                "NaN",
            ),
            (
                SamplingConfig {
                    repeat_penalty: 0.0,
                    ..cfg(1.0)
                },
                "repeat_penalty",
                "0",
            ),
            (
                SamplingConfig {
                    repeat_penalty: -2.0,
                    ..cfg(1.0)
                },
                "repeat_penalty",
                "-2",
            ),
            (
                SamplingConfig {
                    repeat_penalty: f32::NAN,
                    ..cfg(1.0)
                },
                "repeat_penalty",
                "NaN",
            ),
        ];
        for (c, name, value) in bad {
            let msg = c.validate().unwrap_err().to_string();
            assert!(msg.starts_with(name), "{msg:?} should name {name}");
            assert!(
                msg.ends_with(&format!("got {value}")),
                "{msg:?} should show {value}"
            );
        }
        assert_eq!(
            cfg(-1.0).validate().unwrap_err().to_string(),
            "temperature must be a finite number >= 0, got -1"
        );
        let ok = SamplingConfig {
            temperature: 0.7,
            top_k: 40,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.1,
            ..Default::default()
        };
        ok.validate().unwrap();
    }

    #[test]
    fn penalty_divides_positive_multiplies_negative_once() {
        let mut l = vec![2.0, -2.0, 0.0, 4.0, 1.0];
        apply_repetition_penalty(&mut l, &[0, 1, 1, 0, 2, 99, u32::MAX, 1], 2.0);
        assert_eq!(l, vec![1.0, -4.0, 0.0, 4.0, 1.0]);
        // Penalty 1 is the identity.
        let mut m = vec![2.0, -2.0];
        apply_repetition_penalty(&mut m, &[0, 1], 1.0);
        assert_eq!(m, vec![2.0, -2.0]);
    }

    #[test]
    fn penalty_long_window_dedups_too() {
        let mut recent: Vec<u32> = (0..500).map(|i| i % 3).collect();
        recent.push(1_000_000);
        let mut l = vec![3.0, -3.0, 6.0, 5.0];
        apply_repetition_penalty(&mut l, &recent, 3.0);
        assert_eq!(l, vec![1.0, -9.0, 2.0, 5.0]);
    }

    #[test]
    fn penalty_window_takes_last_n() {
        let c = SamplingConfig {
            repeat_last_n: 2,
            ..Default::default()
        };
        assert_eq!(c.penalty_window(&[1, 2, 3]), &[2, 3]);
        assert_eq!(c.penalty_window(&[7]), &[7]);
    }

    #[test]
    fn pcg_hash_matches_reference_values() {
        // Computed independently (Python, 32-bit wrapping arithmetic).
        assert_eq!(pcg_hash(0), 129_708_002);
        assert_eq!(pcg_hash(1), 2_831_084_092);
        assert_eq!(pcg_hash(0xFFFF_FFFF), 3_861_530_882);
    }

    #[test]
    fn uniform_extremes_are_open() {
        // The mapping's extreme outputs are exactly 2^-24 and 1 - 2^-24.
        let lo = 1.0f32 / 16_777_216.0;
        let hi = (2 * ((u32::MAX >> 9) as u64) + 1) as f32 / 16_777_216.0;
        assert!(lo > 0.0 && hi < 1.0);
        for t in 0..10_000 {
            let u = uniform(42, 7, t);
            assert!(u > 0.0 && u < 1.0);
            assert!(gumbel(42, 7, t).is_finite());
        }
    }

    #[test]
    fn greedy_returns_penalised_argmax_lowest_id() {
        let mut s = Scratch::new();
        let l = [1.0, 3.0, 3.0, 2.5];
        assert_eq!(sample_cpu(&l, &[], &cfg(0.0), 0, &mut s), 1);
        // Penalising token 1 and 2 (3.0 -> 2.0) leaves 2.5 on top.
        let c = SamplingConfig {
            repeat_penalty: 1.5,
            ..cfg(0.0)
        };
        assert_eq!(sample_cpu(&l, &[1, 2], &c, 0, &mut s), 3);
        assert_eq!(sample_cpu_masked(&l, &cfg(0.0), 0, &mut s), 1);
    }

    #[test]
    fn candidates_sorted_normalised_with_ties_by_id() {
        let mut s = Scratch::new();
        let l = [0.5f32, 2.0, 1.0, 2.0, -1.0, 1.0];
        let c = SamplingConfig {
            top_k: 4,
            ..cfg(1.0)
        };
        let cand = candidates(&l, &c, TOP_K_CAP, &mut s).to_vec();
        let ids: Vec<u32> = cand.iter().map(|c| c.0).collect();
        assert_eq!(ids, vec![1, 3, 2, 5]);
        let sum: f32 = cand.iter().map(|c| c.1).sum();
        assert!((sum - 1.0).abs() < 1e-6);
        assert!(cand.windows(2).all(|w| w[0].1 >= w[1].1));
    }

    #[test]
    fn masked_tokens_and_nan_are_never_candidates() {
        let mut s = Scratch::new();
        let l = [f32::NEG_INFINITY, 1.0, f32::NAN, 0.5, f32::NEG_INFINITY];
        let c = cfg(1.0);
        let ids: Vec<u32> = candidates(&l, &c, usize::MAX, &mut s)
            .iter()
            .map(|c| c.0)
            .collect();
        assert_eq!(ids, vec![1, 3]);
        for pos in 0..2000 {
            let t = sample_cpu_masked(&l, &c, pos, &mut s);
            assert!(t == 1 || t == 3);
            let mut g = l;
            gumbel_transform(&mut g, &[], &c, pos, &mut s);
            let t = argmax(&g);
            assert!(t == 1 || t == 3);
        }
        // Fully masked: token 0 by convention, on both paths.
        let dead = [f32::NEG_INFINITY; 4];
        assert_eq!(sample_cpu_masked(&dead, &c, 0, &mut s), 0);
        let mut g = dead;
        gumbel_transform(&mut g, &[], &c, 0, &mut s);
        assert_eq!(argmax(&g), 0);
    }

    #[test]
    fn tiny_temperature_behaves_like_greedy() {
        let mut s = Scratch::new();
        let l = [0.0f32, 1.0, 0.5];
        let c = cfg(f32::from_bits(1)); // smallest subnormal: 1/T overflows
        assert_eq!(sample_cpu(&l, &[], &c, 3, &mut s), 1);
        let c = cfg(1e-6);
        assert_eq!(sample_cpu(&l, &[], &c, 3, &mut s), 1);
    }

    #[test]
    fn rank_key_orders_and_round_trips() {
        let vals = [
            f32::MIN,
            -1e30,
            -2.5,
            -1.0,
            -1e-40,
            -0.0,
            0.0,
            1e-40,
            0.5,
            1.0,
            3e38,
        ];
        for &v in &vals {
            assert_eq!(key_logit(rank_key(v, 9)), v + 0.0);
            assert_eq!(key_id(rank_key(v, 9)), 9);
        }
        for w in vals.windows(2) {
            // A larger logit ranks first whatever the ids; equal logits
            // (-0.0 and 0.0) go by id.
            if w[0] < w[1] {
                assert!(rank_key(w[1], 5) < rank_key(w[0], 4));
            } else {
                assert!(rank_key(w[0], 4) < rank_key(w[1], 5));
                assert!(rank_key(w[1], 4) < rank_key(w[0], 5));
            }
        }
        assert!(rank_key(-0.0, 1) < rank_key(0.0, 2));
    }

    #[test]
    fn nucleus_matches_sorted_walk() {
        // Deterministic pseudo-random logits, with repeats, against a plain
        // sort-and-walk.
        for case in 0..200u32 {
            let n = 1 + (pcg_hash(case) % 3000) as usize;
            let logits: Vec<f32> = (0..n as u32)
                .map(|i| ((pcg_hash(i ^ case.wrapping_mul(7919)) % 400) as f32 - 200.0) / 40.0)
                .collect();
            let max = logits.iter().copied().fold(f32::MIN, f32::max);
            let total: f64 = logits.iter().map(|&l| weight(l, max, 1.0) as f64).sum();
            let top_p = (pcg_hash(case + 1_000) % 1000) as f64 / 1000.0 * 0.98 + 0.01;
            let mut keys: Vec<u64> = (0..n).map(|i| rank_key(logits[i], i as u32)).collect();
            let mut sorted = keys.clone();
            sorted.sort_unstable();
            let mut cum = 0.0;
            let mut want = sorted.len();
            for (j, &k) in sorted.iter().enumerate() {
                cum += weight(key_logit(k), max, 1.0) as f64;
                if cum >= top_p * total {
                    want = j + 1;
                    break;
                }
            }
            let got = nucleus(&mut keys, top_p * total, max, 1.0);
            assert_eq!(got, want, "case {case}");
            keys.truncate(got);
            keys.sort_unstable();
            assert_eq!(keys, sorted[..want]);
        }
    }

    #[test]
    fn random_seed_varies() {
        let a = random_seed();
        let b = random_seed();
        assert_ne!(a, b);
    }
}
