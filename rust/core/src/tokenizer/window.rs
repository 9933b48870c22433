//! The generic incremental detokenization path, for decoders without a piece table.
//!
//! Owns the prefix/read-offset window: the last few tokens already emitted (the prefix) and the
//! tokens not yet emitted. A step decodes the window and emits the text past the prefix's text
//! once it does not end in U+FFFD; the unread tokens then become the new prefix. The window is
//! seeded with the prompt's last tokens so the first output token is decoded in context.
//!
//! Invariants: the window holds the prefix plus fewer than `MAX_WINDOW_TOKENS` unread tokens; a
//! trailing U+FFFD is held for at most `MAX_PENDING_TOKENS` tokens, so a byte sequence that never
//! completes does not stall the output. Costs: two `decode` calls of a few tokens per step (one
//! when nothing is emitted), plus small allocations.

use super::Tokenizer;
use crate::request::TokenId;

/// Prompt tokens seeding the window of the generic path.
const WINDOW_SEED_TOKENS: usize = 6;
/// Tokens the window path waits on a trailing U+FFFD before emitting it anyway.
const MAX_PENDING_TOKENS: usize = 4;
/// Tokens after which the window path restarts its window even when no text appeared.
const MAX_WINDOW_TOKENS: usize = 16;

#[derive(Debug, Clone, Default)]
pub(super) struct WindowState {
    ids: Vec<TokenId>,
    read_offset: usize,
    prefix_text: String,
}

impl WindowState {
    pub(super) fn new(tok: &Tokenizer, prompt: &[TokenId], skip: bool) -> Self {
        let ids = prompt[prompt.len().saturating_sub(WINDOW_SEED_TOKENS)..].to_vec();
        let prefix_text = tok.decode(&ids, skip).unwrap_or_default();
        WindowState { read_offset: ids.len(), ids, prefix_text }
    }

    pub(super) fn step(&mut self, tok: &Tokenizer, id: TokenId, skip: bool, out: &mut String) {
        self.ids.push(id);
        let Ok(text) = tok.decode(&self.ids, skip) else {
            return;
        };
        let num_unread = self.ids.len() - self.read_offset;
        let cut = self.prefix_text.len();
        if text.len() <= cut || !text.is_char_boundary(cut) {
            if num_unread >= MAX_WINDOW_TOKENS {
                self.advance(tok, skip);
            }
            return;
        }
        if text.ends_with(char::REPLACEMENT_CHARACTER) && num_unread < MAX_PENDING_TOKENS {
            return;
        }
        out.push_str(&text[cut..]);
        self.advance(tok, skip);
    }

    /// The unread tokens become the new prefix.
    fn advance(&mut self, tok: &Tokenizer, skip: bool) {
        self.ids.drain(..self.read_offset);
        self.read_offset = self.ids.len();
        self.prefix_text = tok.decode(&self.ids, skip).unwrap_or_default();
    }

    pub(super) fn flush(&mut self, tok: &Tokenizer, skip: bool, out: &mut String) {
        let Ok(text) = tok.decode(&self.ids, skip) else {
            return;
        };
        let cut = self.prefix_text.len();
        if text.len() > cut && text.is_char_boundary(cut) {
            out.push_str(&text[cut..]);
            self.advance(tok, skip);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::table::DecodePlan;
    use super::super::test_support::{self, decode_in_context, encode, stream};

    #[test]
    fn wordpiece_output_equals_decode_in_context() {
        let tok = test_support::wordpiece_tokenizer();
        let prompt = encode(&tok, "hello world we", false);
        let output = encode(&tok, "played the games playing", false);
        let (pieces, rest) = stream(&tok, &prompt, &output, true);
        assert_eq!(pieces.concat(), " played the games playing");
        assert_eq!(pieces.concat(), decode_in_context(&tok, &prompt, &output, true));
        assert_eq!(rest, "");
    }

    #[test]
    fn window_holds_split_characters_until_complete() {
        let tok = test_support::byte_level_window_tokenizer();
        assert!(matches!(tok.plan(), DecodePlan::Window));
        let prompt = encode(&tok, "Hello, my name is", false);
        let output = encode(&tok, " 你好 🎉🇫🇷 👨‍👩‍👧 鬱 done", false);
        let (pieces, rest) = stream(&tok, &prompt, &output, false);
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
        assert_eq!(pieces.concat() + &rest, decode_in_context(&tok, &prompt, &output, false));
    }

    #[test]
    fn window_emits_a_trailing_replacement_after_a_few_tokens() {
        let tok = test_support::byte_level_window_tokenizer();
        let prompt = encode(&tok, "Hi", false);
        let lead = tok.token_to_id("ä").expect("byte-level char for 0xE4");
        let output = [lead; 6];
        let (pieces, rest) = stream(&tok, &prompt, &output, false);
        assert_eq!(pieces[..3].concat(), "");
        assert_eq!(pieces[3], "\u{FFFD}".repeat(4));
        assert_eq!(pieces.concat() + &rest, decode_in_context(&tok, &prompt, &output, false));
    }
}
