//! Stop strings: finding one that the newest text completed, and how much text to hold back.
//!
//! Owns the rule for several matches: the stop that completes earliest (smallest end offset) wins,
//! and among stops completing at the same offset the earlier-listed one. Only matches that end
//! inside the newest `new_len` bytes count (older text was checked when it arrived), so a step
//! searches a tail of at most `new_len + max_stop_len - 1` bytes per stop. Empty stop strings
//! never match. Costs: O(number of stops × searched tail), no allocation.

/// A stop string found in the text: byte offset where it starts, and which one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopMatch {
    /// Byte offset of the match in the searched text.
    pub start: usize,
    /// Index of the matching stop string in the list given.
    pub stop_index: usize,
}

/// Searches the tail of `text` that the last `new_len` bytes could complete; the stop that
/// completes earliest wins.
pub fn find_stop_string(text: &str, new_len: usize, stops: &[String]) -> Option<StopMatch> {
    let new_len = new_len.min(text.len());
    if new_len == 0 {
        return None;
    }
    let new_start = text.len() - new_len;
    let mut best: Option<(usize, StopMatch)> = None;
    for (stop_index, stop) in stops.iter().enumerate().filter(|(_, s)| !s.is_empty()) {
        // A match must end after `new_start`, so it starts at or after this offset.
        let from = ceil_char_boundary(text, (new_start + 1).saturating_sub(stop.len()));
        let Some(pos) = text[from..].find(stop.as_str()) else {
            continue;
        };
        let start = from + pos;
        let end = start + stop.len();
        if best.is_none_or(|(best_end, _)| end < best_end) {
            best = Some((end, StopMatch { start, stop_index }));
        }
    }
    best.map(|(_, m)| m)
}

/// Bytes a streaming output must hold back so that no partial stop string is ever emitted.
pub fn hold_back_len(stops: &[String]) -> usize {
    stops.iter().map(String::len).max().unwrap_or(0).saturating_sub(1)
}

/// The smallest char boundary of `text` at or after `i` (or `text.len()`).
fn ceil_char_boundary(text: &str, mut i: usize) -> usize {
    while i < text.len() && !text.is_char_boundary(i) {
        i += 1;
    }
    i.min(text.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::test_support;

    fn stops(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn stop_string_straddling_two_tokens_is_found() {
        let tok = test_support::byte_level_tokenizer();
        let prompt = tok.encode_batch(&["Say:".to_string()], false).unwrap().remove(0);
        let output = tok.encode_batch(&[" hello world, bye".to_string()], false).unwrap().remove(0);
        let stop_list = stops(&["lo wor"]);
        let mut detok = tok.new_detokenizer(&prompt, false);
        let mut text = String::new();
        let mut found = None;
        for &id in &output {
            let n = detok.step(&tok, id, &mut text);
            if let Some(m) = find_stop_string(&text, n, &stop_list) {
                found = Some((m, n));
                break;
            }
        }
        let (m, n) = found.expect("stop string found");
        assert_eq!(&text[m.start..m.start + 6], "lo wor");
        assert!(m.start < text.len() - n, "the match straddles the last token");
    }

    #[test]
    fn earliest_completing_stop_wins_over_earlier_starting_one() {
        let text = "say hello world";
        let m = find_stop_string(text, text.len(), &stops(&["hello world", "wor"])).unwrap();
        assert_eq!(m, StopMatch { start: 10, stop_index: 1 });
    }

    #[test]
    fn stops_completing_together_go_to_the_earlier_listed() {
        let m = find_stop_string("xabcd", 2, &stops(&["cd", "bcd"])).unwrap();
        assert_eq!(m, StopMatch { start: 3, stop_index: 0 });
        let m = find_stop_string("xabcd", 2, &stops(&["bcd", "cd"])).unwrap();
        assert_eq!(m, StopMatch { start: 2, stop_index: 0 });
    }

    #[test]
    fn matches_entirely_in_old_text_are_ignored() {
        assert_eq!(find_stop_string("ab--", 2, &stops(&["ab"])), None);
        assert_eq!(find_stop_string("ab--ab", 0, &stops(&["ab"])), None);
        let m = find_stop_string("ab--ab", 1, &stops(&["ab"])).unwrap();
        assert_eq!(m.start, 4);
    }

    #[test]
    fn search_start_snaps_to_char_boundaries() {
        let text = "中文停止";
        let m = find_stop_string(text, 3, &stops(&["止", "文停止"])).unwrap();
        assert_eq!(m, StopMatch { start: 9, stop_index: 0 });
        let m = find_stop_string(text, 3, &stops(&["x", "停止"])).unwrap();
        assert_eq!(m, StopMatch { start: 6, stop_index: 1 });
    }

    #[test]
    fn empty_stops_never_match() {
        assert_eq!(find_stop_string("abc", 3, &stops(&[""])), None);
        assert_eq!(find_stop_string("abc", 3, &[]), None);
    }

    #[test]
    fn hold_back_is_longest_stop_minus_one() {
        assert_eq!(hold_back_len(&[]), 0);
        assert_eq!(hold_back_len(&stops(&["a"])), 0);
        assert_eq!(hold_back_len(&stops(&["ab", "中文"])), 5);
    }
}
