//! From generated tokens to the text a client receives: decoded incrementally (a byte-level
//! token may end inside a character), cut at the first stop string, and never sending a piece
//! that a later token could turn into the start of a stop string.

use crate::data::Tokenizer;
use std::sync::Arc;

/// The text of one generation as it grows.
pub struct TextOut {
    tokenizer: Arc<Tokenizer>,
    stops: Vec<String>,
    tokens: Vec<usize>,
    text: String,
    /// Bytes of `text` already handed out.
    sent: usize,
    /// Whether a stop string ended the text.
    pub stopped: bool,
}

impl TextOut {
    /// An empty text ending at any of `stops` (empty strings ignored).
    pub fn new(tokenizer: Arc<Tokenizer>, stops: Vec<String>) -> Self {
        Self {
            tokenizer,
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            tokens: Vec::new(),
            text: String::new(),
            sent: 0,
            stopped: false,
        }
    }

    /// Adds a token; returns the text that can be sent now (possibly empty). After a stop
    /// string, [`Self::stopped`] is set and further tokens add nothing.
    pub fn push(&mut self, token: usize) -> String {
        if self.stopped {
            return String::new();
        }
        self.tokens.push(token);
        self.text = self.tokenizer.decode(&self.tokens);
        if self.sent > self.text.len() || !self.text.is_char_boundary(self.sent) {
            // A byte-level decoding changed what was already sent (it cannot for character
            // tokenizers): keep what was sent, as the client has it.
            self.sent = self.sent.min(self.text.len());
            while !self.text.is_char_boundary(self.sent) {
                self.sent -= 1;
            }
        }
        let first_stop = self
            .stops
            .iter()
            .filter_map(|stop| self.text[self.sent..].find(stop.as_str()))
            .min();
        if let Some(at) = first_stop {
            self.stopped = true;
            let end = self.sent + at;
            let piece = self.text[self.sent..end].to_string();
            self.sent = end;
            self.text.truncate(end);
            return piece;
        }
        let safe = self.safe_end();
        let piece = self.text[self.sent..safe].to_string();
        self.sent = safe;
        piece
    }

    /// The text held back at the end (no more tokens will come).
    pub fn finish(&mut self) -> String {
        let piece = self.text[self.sent..].to_string();
        self.sent = self.text.len();
        piece
    }

    /// The text handed out so far (all of it after [`Self::finish`]).
    pub fn text(&self) -> &str {
        &self.text[..self.sent]
    }

    /// The tokenizer that decodes them.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Tokens generated.
    pub fn tokens(&self) -> usize {
        self.tokens.len()
    }

    /// The end of what may be sent: before the longest suffix that begins a stop string, and
    /// before a trailing replacement character (a character a later byte may complete).
    fn safe_end(&self) -> usize {
        let text = &self.text;
        let mut end = text.len();
        for (at, _) in text[self.sent..]
            .char_indices()
            .map(|(i, c)| (self.sent + i, c))
        {
            let rest = &text[at..];
            if self.stops.iter().any(|stop| stop.starts_with(rest)) {
                end = at;
                break;
            }
        }
        let trimmed = text[..end].trim_end_matches('\u{FFFD}').len();
        trimmed.max(self.sent)
    }
}
