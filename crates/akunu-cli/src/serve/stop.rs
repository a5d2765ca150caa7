//! Text-level stop sequences over a stream of text pieces: text is released
//! only once it cannot be the start of a stop string, and nothing from a stop
//! string on is ever released.

pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not released: the longest tail that could still
    /// begin a stop string.
    held: String,
}

/// What one piece of text gives.
#[derive(Debug, PartialEq)]
pub struct Released {
    /// Text safe to send now.
    pub text: String,
    /// A stop string was found: generation must end, and `text` ends where
    /// the stop string began.
    pub stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    pub fn push(&mut self, piece: &str) -> Released {
        self.held.push_str(piece);
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s)).min() {
            let text = self.held[..at].to_string();
            self.held.clear();
            return Released {
                text,
                stopped: true,
            };
        }
        let keep = self.partial_tail();
        let cut = self.held.len() - keep;
        let text = self.held[..cut].to_string();
        self.held.drain(..cut);
        Released {
            text,
            stopped: false,
        }
    }

    /// Releases what is held at the end of generation.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length of the longest tail of `held` that is a proper prefix of a
    /// stop string (tails start at character boundaries).
    fn partial_tail(&self) -> usize {
        let h = &self.held;
        h.char_indices()
            .map(|(i, _)| &h[i..])
            .find(|tail| self.stops.iter().any(|s| s.starts_with(tail)))
            .map_or(0, str::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `pieces`, returns (released text, stopped).
    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let r = m.push(p);
            out.push_str(&r.text);
            if r.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stop_inside_one_piece() {
        assert_eq!(run(&["END"], &["abcENDdef"]), ("abc".into(), true));
    }

    #[test]
    fn stop_across_pieces_is_never_released() {
        let mut m = StopMatcher::new(vec!["\n\n".into()]);
        let r = m.push("hello\n");
        assert_eq!(r.text, "hello", "a newline could begin the stop string");
        assert!(!r.stopped);
        let r = m.push("\nworld");
        assert_eq!(
            r,
            Released {
                text: "".into(),
                stopped: true
            }
        );
    }

    #[test]
    fn held_text_is_released_when_it_diverges() {
        assert_eq!(run(&["abc"], &["xab", "d"]), ("xabd".into(), false));
        assert_eq!(run(&["abc"], &["xab"]), ("xab".into(), false));
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        assert_eq!(
            run(&["world", "lo"], &["hello world"]),
            ("hel".into(), true)
        );
    }

    #[test]
    fn multibyte_text_and_no_stops() {
        assert_eq!(run(&[], &["été", "🙂"]), ("été🙂".into(), false));
        assert_eq!(run(&["é!"], &["caf", "é", "!x"]), ("caf".into(), true));
        assert_eq!(run(&[""], &["a"]), ("a".into(), false));
    }
}
