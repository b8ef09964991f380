//! Corpus BLEU (Papineni et al. 2002) as sacreBLEU computes it by default: the `13a`
//! tokenization of mteval-v13a, n-grams up to 4, clipped counts against every reference, the
//! brevity penalty from the closest reference length, and `exp` smoothing of zero counts.
//! Scores are on the 0–100 scale and compare with sacreBLEU's.

use regex::Regex;
use std::collections::HashMap;
use std::sync::LazyLock;

const MAX_ORDER: usize = 4;

/// A corpus BLEU score and its parts.
#[derive(Clone, Debug, PartialEq)]
pub struct Bleu {
    /// BLEU, 0–100.
    pub score: f64,
    /// n-gram precisions, 0–100, n = 1..4 (after smoothing).
    pub precisions: [f64; MAX_ORDER],
    /// Brevity penalty `min(1, exp(1 − r/c))`.
    pub brevity_penalty: f64,
    /// Hypothesis length `c` in tokens.
    pub hypothesis_len: usize,
    /// Effective reference length `r` (the closest reference per sentence).
    pub reference_len: usize,
}

impl std::fmt::Display for Bleu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p: Vec<String> = self.precisions.iter().map(|p| format!("{p:.1}")).collect();
        write!(
            f,
            "BLEU = {:.2} {} (BP = {:.3} ratio = {:.3} hyp_len = {} ref_len = {})",
            self.score,
            p.join("/"),
            self.brevity_penalty,
            self.hypothesis_len as f64 / self.reference_len.max(1) as f64,
            self.hypothesis_len,
            self.reference_len
        )
    }
}

static PUNCTUATION: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"([\{-~\[-` -&\(-\+:-@/])").expect("valid regex"));
static PERIOD_COMMA_BEFORE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"([^0-9])([\.,])").expect("valid regex"));
static PERIOD_COMMA_AFTER: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"([\.,])([^0-9])").expect("valid regex"));
static DASH_AFTER_DIGIT: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"([0-9])(-)").expect("valid regex"));

/// The `13a` tokenization (mteval-v13a, sacreBLEU's default): unescape a few SGML entities,
/// split off punctuation and symbols, and split periods/commas except inside numbers.
pub fn tokenize_13a(line: &str) -> Vec<String> {
    let mut line = line
        .replace("<skipped>", "")
        .replace("-\n", "")
        .replace('\n', " ");
    if line.contains('&') {
        line = line
            .replace("&quot;", "\"")
            .replace("&amp;", "&")
            .replace("&lt;", "<")
            .replace("&gt;", ">");
    }
    let line = format!(" {line} ");
    let line = PUNCTUATION.replace_all(&line, " $1 ");
    let line = PERIOD_COMMA_BEFORE.replace_all(&line, "$1 $2 ");
    let line = PERIOD_COMMA_AFTER.replace_all(&line, " $1 $2");
    let line = DASH_AFTER_DIGIT.replace_all(&line, "$1 $2 ");
    line.split_whitespace().map(str::to_owned).collect()
}

fn ngram_counts(tokens: &[String], n: usize) -> HashMap<&[String], usize> {
    let mut counts = HashMap::new();
    for gram in tokens.windows(n) {
        *counts.entry(gram).or_insert(0) += 1;
    }
    counts
}

/// Corpus BLEU of `hypotheses` against `references` (`references[i]` holds every reference
/// translation of sentence `i`; at least one each).
///
/// # Panics
/// If the two lists differ in length or a sentence has no reference.
pub fn corpus_bleu(hypotheses: &[String], references: &[Vec<String>]) -> Bleu {
    assert_eq!(
        hypotheses.len(),
        references.len(),
        "one list of references per hypothesis"
    );
    let mut correct = [0usize; MAX_ORDER];
    let mut total = [0usize; MAX_ORDER];
    let (mut hyp_len, mut ref_len) = (0usize, 0usize);
    for (hypothesis, refs) in hypotheses.iter().zip(references) {
        assert!(!refs.is_empty(), "every hypothesis needs a reference");
        let hyp = tokenize_13a(hypothesis);
        let refs: Vec<Vec<String>> = refs.iter().map(|r| tokenize_13a(r)).collect();
        hyp_len += hyp.len();
        // The closest reference length; ties go to the shorter (sacreBLEU, mteval).
        ref_len += refs
            .iter()
            .map(|r| r.len())
            .min_by_key(|&len| (len.abs_diff(hyp.len()), len))
            .expect("at least one reference");
        for n in 1..=MAX_ORDER {
            let mut max_ref: HashMap<&[String], usize> = HashMap::new();
            for r in &refs {
                for (gram, count) in ngram_counts(r, n) {
                    let slot = max_ref.entry(gram).or_insert(0);
                    *slot = (*slot).max(count);
                }
            }
            for (gram, count) in ngram_counts(&hyp, n) {
                correct[n - 1] += count.min(max_ref.get(gram).copied().unwrap_or(0));
                total[n - 1] += count;
            }
        }
    }
    score(correct, total, hyp_len, ref_len)
}

/// BLEU from n-gram statistics, with sacreBLEU's `exp` smoothing: the k-th precision with no
/// match counts as `1 / (2^k · total)`. No unigram match at all scores 0.
fn score(
    correct: [usize; MAX_ORDER],
    total: [usize; MAX_ORDER],
    hyp_len: usize,
    ref_len: usize,
) -> Bleu {
    let brevity_penalty = if hyp_len == 0 {
        0.0
    } else if hyp_len < ref_len {
        (1.0 - ref_len as f64 / hyp_len as f64).exp()
    } else {
        1.0
    };
    let mut precisions = [0.0; MAX_ORDER];
    let mut smooth = 1.0;
    for n in 0..MAX_ORDER {
        if total[n] == 0 {
            break;
        }
        precisions[n] = if correct[n] == 0 {
            smooth *= 2.0;
            100.0 / (smooth * total[n] as f64)
        } else {
            100.0 * correct[n] as f64 / total[n] as f64
        };
    }
    let score = if correct[0] == 0 {
        0.0
    } else {
        let log_mean = precisions
            .iter()
            .map(|&p| if p > 0.0 { p.ln() } else { f64::NEG_INFINITY })
            .sum::<f64>()
            / MAX_ORDER as f64;
        brevity_penalty * log_mean.exp()
    };
    Bleu {
        score,
        precisions,
        brevity_penalty,
        hypothesis_len: hyp_len,
        reference_len: ref_len,
    }
}
