//! Incremental detokenization: one output token in, only complete UTF-8 text out.
//!
//! Owns [`IncrementalDetokenizer`], one per output sequence. With a recognised decoder (see
//! `table.rs`) a step is a table lookup, a push of the token's bytes and, only when bytes are
//! pending or the token is not valid UTF-8 alone, a UTF-8 check of the pending tail. Otherwise a
//! step decodes a small window of recent tokens (the prefix/read-offset scheme) and emits the text
//! past the previous window's text once it does not end in U+FFFD.
//!
//! Invariants: what the steps emit, concatenated, is `decode(prompt + output)` minus
//! `decode(prompt)` (the text of the output in the context of its prompt), up to a held incomplete
//! character at the end, which [`IncrementalDetokenizer::flush`] releases as U+FFFD. No emitted
//! piece splits a character. At most 3 bytes are ever held: bytes that can never complete a
//! character are replaced by U+FFFD as soon as that is known (one per maximal invalid run for
//! ByteLevel, one per byte for ByteFallback), so nothing stalls.
//!
//! Costs: table path, O(token bytes) per step with no allocation once the pending buffer has
//! grown; construction primes the state from the first tokens and the last few bytes of the
//! prompt, O(1) in the prompt length. Window path, two `decode` calls of a few tokens per step.

use super::table::{DecodePlan, InvalidBytes, Piece, PieceTable, StartRule};
use super::window::WindowState;
use super::Tokenizer;
use crate::request::TokenId;

/// Turns one output sequence's tokens into text, a token at a time.
#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    skip_special_tokens: bool,
    state: State,
}

#[derive(Debug, Clone)]
enum State {
    Table(TableState),
    Window(WindowState),
}

#[derive(Debug, Clone, Default)]
struct TableState {
    /// Bytes of an incomplete character (at most 3 after each step).
    pending: Vec<u8>,
    /// Whether a token that `decode` keeps has been seen (prompt included).
    seen_any: bool,
    /// Leading characters a `Strip` decoder may still remove.
    strip_left: usize,
}

impl IncrementalDetokenizer {
    pub(crate) fn new(tok: &Tokenizer, prompt_ids: &[TokenId], skip_special_tokens: bool) -> Self {
        let state = match tok.plan() {
            DecodePlan::Table(table) => {
                let mut st = TableState::default();
                if let StartRule::StripLeading { count, .. } = table.start_rule {
                    st.strip_left = count;
                }
                st.prime(tok, table, prompt_ids, skip_special_tokens);
                State::Table(st)
            }
            DecodePlan::Window => State::Window(WindowState::new(tok, prompt_ids, skip_special_tokens)),
        };
        IncrementalDetokenizer { skip_special_tokens, state }
    }

    /// Feeds one token and appends only complete UTF-8 text to `out`; returns bytes appended.
    /// `tok` must be the tokenizer that created this detokenizer.
    #[inline]
    pub fn step(&mut self, tok: &Tokenizer, id: TokenId, out: &mut String) -> usize {
        let before = out.len();
        match (&mut self.state, tok.plan()) {
            (State::Table(st), DecodePlan::Table(table)) => {
                st.step(tok, table, id, self.skip_special_tokens, out)
            }
            (State::Window(st), DecodePlan::Window) => st.step(tok, id, self.skip_special_tokens, out),
            _ => {}
        }
        out.len() - before
    }

    /// Releases what is held at the end of a sequence (an incomplete character becomes U+FFFD,
    /// as `decode` renders it); returns bytes appended.
    pub fn flush(&mut self, tok: &Tokenizer, out: &mut String) -> usize {
        let before = out.len();
        match (&mut self.state, tok.plan()) {
            (State::Table(st), DecodePlan::Table(table)) => st.flush(table, out),
            (State::Window(st), DecodePlan::Window) => st.flush(tok, self.skip_special_tokens, out),
            _ => {}
        }
        out.len() - before
    }
}

impl TableState {
    fn at_start(&self) -> bool {
        !self.seen_any || self.strip_left > 0
    }

    /// Runs the prompt's first tokens (until the start rules are settled) and last few bytes.
    fn prime(&mut self, tok: &Tokenizer, table: &PieceTable, prompt: &[TokenId], skip: bool) {
        let mut scratch = String::new();
        let mut next = 0;
        while next < prompt.len() && self.at_start() {
            self.step(tok, table, prompt[next], skip, &mut scratch);
            next += 1;
        }
        // An incomplete character starts within the last 3 bytes, so 4 bytes of tail rebuild
        // exactly the pending state of a full run.
        let mut tail = prompt.len();
        let mut num_bytes = 0;
        while tail > next && num_bytes < 4 {
            tail -= 1;
            num_bytes += kept_len(table, prompt[tail], skip);
        }
        if tail > next {
            self.pending.clear();
        }
        for &id in &prompt[tail..] {
            scratch.clear();
            self.step(tok, table, id, skip, &mut scratch);
        }
    }

    #[inline]
    fn step(&mut self, tok: &Tokenizer, table: &PieceTable, id: TokenId, skip: bool, out: &mut String) {
        let (piece, special) = table.piece(id);
        if special && skip {
            return;
        }
        if self.at_start() {
            return self.step_at_start(tok, table, id, piece, out);
        }
        match piece {
            Piece::Text(s) if self.pending.is_empty() => out.push_str(s),
            Piece::Text(s) => {
                self.pending.extend_from_slice(s.as_bytes());
                self.drain(table.invalid, out);
            }
            Piece::Bytes(b) => {
                self.pending.extend_from_slice(b);
                self.drain(table.invalid, out);
            }
            Piece::Missing => {}
        }
    }

    /// The slow path for the first kept tokens, where the decoder's start rules apply.
    fn step_at_start(
        &mut self,
        tok: &Tokenizer,
        table: &PieceTable,
        id: TokenId,
        piece: Piece<'_>,
        out: &mut String,
    ) {
        let first = !self.seen_any;
        match piece {
            Piece::Missing => return,
            Piece::Text(_) if first && matches!(table.start_rule, StartRule::DropReplacementInFirst(_)) => {
                let token = tok.id_to_token(id).unwrap_or_default();
                self.pending.extend_from_slice(&table.token_bytes(&token, true));
            }
            Piece::Text(s) => self.pending.extend_from_slice(s.as_bytes()),
            Piece::Bytes(b) => self.pending.extend_from_slice(b),
        }
        self.seen_any = true;
        let mut text = String::new();
        self.drain(table.invalid, &mut text);
        self.push_stripped(table, &text, out);
    }

    /// Appends `text`, less the leading characters the `Strip` rule still removes.
    fn push_stripped(&mut self, table: &PieceTable, mut text: &str, out: &mut String) {
        if let StartRule::StripLeading { content, .. } = table.start_rule {
            while self.strip_left > 0 {
                let Some(rest) = text.strip_prefix(content) else {
                    break;
                };
                text = rest;
                self.strip_left -= 1;
            }
            if !text.is_empty() {
                self.strip_left = 0;
            }
        }
        out.push_str(text);
    }

    /// Moves every complete character of `pending` to `out`, replacing bytes that can never
    /// complete one, and keeps an incomplete tail.
    fn drain(&mut self, invalid: InvalidBytes, out: &mut String) {
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or_default());
                    let Some(num_bad) = e.error_len() else {
                        self.pending.drain(..valid);
                        return;
                    };
                    push_replacements(invalid, num_bad, out);
                    self.pending.drain(..valid + num_bad);
                }
            }
        }
    }

    fn flush(&mut self, table: &PieceTable, out: &mut String) {
        if self.pending.is_empty() {
            return;
        }
        let mut text = String::new();
        push_replacements(table.invalid, self.pending.len(), &mut text);
        self.pending.clear();
        self.push_stripped(table, &text, out);
    }
}

/// Bytes `id` contributes when kept (0 when `decode` drops it).
fn kept_len(table: &PieceTable, id: TokenId, skip: bool) -> usize {
    match table.piece(id) {
        (_, true) if skip => 0,
        (Piece::Text(s), _) => s.len(),
        (Piece::Bytes(b), _) => b.len(),
        (Piece::Missing, _) => 0,
    }
}

/// U+FFFD for `num_bytes` bytes that can never form a character.
fn push_replacements(invalid: InvalidBytes, num_bytes: usize, out: &mut String) {
    let count = match invalid {
        InvalidBytes::Lossy => 1,
        InvalidBytes::PerByte => num_bytes,
    };
    out.extend(std::iter::repeat_n(char::REPLACEMENT_CHARACTER, count));
}

#[cfg(test)]
mod tests {
    use super::super::bytes_char::byte_level_char_to_byte;
    use super::super::test_support::{self, decode_in_context, encode, stream};
    use super::*;
    use proptest::prelude::*;

    /// The byte-level token that stands for the single byte `b`.
    fn byte_token(tok: &Tokenizer, b: u8) -> TokenId {
        let c = (0..0x200u32)
            .filter_map(char::from_u32)
            .find(|&c| byte_level_char_to_byte(c) == Some(b))
            .unwrap();
        tok.token_to_id(&c.to_string()).unwrap()
    }

    fn assert_streams_in_context(tok: &Tokenizer, prompt: &[TokenId], output: &[TokenId], skip: bool) {
        let (pieces, rest) = stream(tok, prompt, output, skip);
        for piece in &pieces {
            assert!(!piece.contains('\u{FFFD}'), "broken character emitted in {pieces:?}");
        }
        assert_eq!(rest, "");
        assert_eq!(pieces.concat(), decode_in_context(tok, prompt, output, skip));
    }

    #[test]
    fn byte_level_emoji_and_cjk_split_across_tokens_are_never_emitted_broken() {
        let tok = test_support::byte_level_tokenizer();
        let DecodePlan::Table(table) = tok.plan() else { panic!("expected a table") };
        let prompt = encode(&tok, "Hello, my name is", false);
        let output = encode(&tok, " 你好 🎉🇫🇷 👨‍👩‍👧 鬱 ∞ done", false);
        let split = output.iter().filter(|&&id| matches!(table.piece(id).0, Piece::Bytes(_))).count();
        assert!(split >= 3, "the test text should split characters across tokens");
        assert_streams_in_context(&tok, &prompt, &output, false);
    }

    #[test]
    fn sentencepiece_byte_fallback_holds_bytes_until_the_character_completes() {
        let tok = test_support::sentencepiece_tokenizer();
        let prompt = encode(&tok, "Hello", true);
        let mut detok = tok.new_detokenizer(&prompt, true);
        let mut out = String::new();
        let ids: Vec<TokenId> =
            ["<0xE4>", "<0xB8>", "<0xAD>"].iter().map(|t| tok.token_to_id(t).unwrap()).collect();
        assert_eq!(detok.step(&tok, ids[0], &mut out), 0);
        assert_eq!(detok.step(&tok, ids[1], &mut out), 0);
        assert_eq!(detok.step(&tok, ids[2], &mut out), 3);
        assert_eq!(out, "中");
        let output = encode(&tok, " the world 中文 😀, hello!", false);
        assert_streams_in_context(&tok, &prompt, &output, true);
    }

    #[test]
    fn sentencepiece_first_output_token_keeps_its_space_after_a_prompt() {
        let tok = test_support::sentencepiece_tokenizer();
        let prompt = encode(&tok, "Hello", true);
        let output = encode(&tok, " world", false);
        assert_eq!(stream(&tok, &prompt, &output, true).0.concat(), " world");
        // With only BOS before it (skipped), the output starts the decoded text: Strip applies.
        let bos = [tok.bos_token_id().unwrap()];
        assert_eq!(stream(&tok, &bos, &output, true).0.concat(), "world");
        assert_eq!(stream(&tok, &bos, &output, false).0.concat(), " world");
        assert_streams_in_context(&tok, &bos, &output, true);
    }

    #[test]
    fn metaspace_decoder_drops_the_replacement_only_in_the_first_token() {
        let tok = test_support::metaspace_tokenizer();
        let output = encode(&tok, "Hello the world", false);
        assert_streams_in_context(&tok, &[], &output, false);
        assert_eq!(stream(&tok, &[], &output, false).0.concat(), "Hello the world");
        let prompt = encode(&tok, "in", false);
        assert_streams_in_context(&tok, &prompt, &output, false);
    }

    #[test]
    fn skip_special_tokens_drops_special_tokens_only_when_asked() {
        let tok = test_support::byte_level_tokenizer();
        let prompt = encode(&tok, "Hi", false);
        let eos = tok.token_to_id("</s>").unwrap();
        let extra = tok.token_to_id("<extra>").unwrap();
        let a = encode(&tok, " the", false);
        let output = [&a[..], &[eos, extra], &a[..]].concat();
        let skipped = stream(&tok, &prompt, &output, true).0.concat();
        assert_eq!(skipped, " the<extra> the");
        let kept = stream(&tok, &prompt, &output, false).0.concat();
        assert_eq!(kept, " the</s><extra> the");
        assert_streams_in_context(&tok, &prompt, &output, true);
        assert_streams_in_context(&tok, &prompt, &output, false);
    }

    #[test]
    fn stray_continuation_byte_is_replaced_at_once() {
        let tok = test_support::byte_level_tokenizer();
        let mut detok = tok.new_detokenizer(&encode(&tok, "Hi", false), false);
        let mut out = String::new();
        detok.step(&tok, byte_token(&tok, 0x80), &mut out);
        assert_eq!(out, "\u{FFFD}");
        detok.step(&tok, byte_token(&tok, 0xE4), &mut out);
        detok.step(&tok, byte_token(&tok, b'a'), &mut out);
        assert_eq!(out, "\u{FFFD}\u{FFFD}a");
    }

    #[test]
    fn incomplete_tail_is_released_by_flush() {
        let tok = test_support::byte_level_tokenizer();
        let prompt = encode(&tok, "Hi", false);
        let (pieces, rest) = stream(&tok, &prompt, &[byte_token(&tok, 0xF0), byte_token(&tok, 0x9F)], false);
        assert_eq!(pieces.concat(), "");
        assert_eq!(rest, "\u{FFFD}");
        let sp = test_support::sentencepiece_tokenizer();
        let bytes: Vec<TokenId> = ["<0xF0>", "<0x9F>"].iter().map(|t| sp.token_to_id(t).unwrap()).collect();
        assert_eq!(stream(&sp, &[1], &bytes, true).1, "\u{FFFD}\u{FFFD}");
    }

    #[test]
    fn prompt_ending_mid_character_is_completed_by_the_output() {
        let tok = test_support::byte_level_tokenizer();
        let mut prompt = encode(&tok, "Hello, my name is", false);
        prompt.push(byte_token(&tok, 0xE4));
        let output = [byte_token(&tok, 0xB8), byte_token(&tok, 0xAD)];
        assert_eq!(stream(&tok, &prompt, &output, false).0.concat(), "中");
    }

    proptest! {
        #[test]
        fn byte_level_incremental_output_equals_decode_in_context(
            prompt_text in "[a-z 你好世界😀🎉é]{0,12}",
            output in proptest::collection::vec(0u32..440, 0..40),
            skip in any::<bool>(),
        ) {
            let tok = test_support::byte_level_tokenizer();
            let prompt = encode(&tok, &prompt_text, false);
            let (pieces, rest) = stream(&tok, &prompt, &output, skip);
            prop_assert_eq!(pieces.concat() + &rest, decode_in_context(&tok, &prompt, &output, skip));
        }

        #[test]
        fn sentencepiece_output_of_valid_text_equals_decode_in_context(
            prompt_text in "[a-z 中文😀]{0,8}",
            output_text in "[a-z HTW,.!中文😀é]{0,24}",
            skip in any::<bool>(),
        ) {
            let tok = test_support::sentencepiece_tokenizer();
            let prompt = encode(&tok, &prompt_text, true);
            let output = encode(&tok, &output_text, false);
            let (pieces, rest) = stream(&tok, &prompt, &output, skip);
            prop_assert_eq!(rest, "");
            prop_assert_eq!(pieces.concat(), decode_in_context(&tok, &prompt, &output, skip));
        }
    }
}
