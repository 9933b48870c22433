//! The per-token piece table behind fast incremental detokenization.
//!
//! Owns the recognition of a tokenizer's decoder and, when it is one whose output is a plain
//! concatenation of per-token byte strings, a table holding each token's bytes. Recognised
//! decoders: `ByteLevel` (GPT-2 style byte-to-char mapping); `Metaspace`; and a `Sequence` of
//! per-token `Replace` (string pattern) / `Metaspace` steps, an optional `ByteFallback`, an optional
//! `Fuse` and, after the fuse, an optional `Strip` of leading characters (Llama / Mistral / Gemma).
//! Anything else yields [`DecodePlan::Window`] and the detokenizer decodes a window of tokens.
//!
//! Invariants: `pieces[id]` describes exactly the bytes `tokenizers`' own `decode` contributes for
//! `id` when it is not the first token of the decoded sequence; text pieces live in `text` (valid
//! UTF-8), pieces that are not valid UTF-8 on their own (byte tokens, split characters) in `bytes`.
//! The rules that apply only at the very start of a sequence (Metaspace dropping the replacement
//! in the first token, `Strip` of the fused text) are kept as [`StartRule`].
//!
//! Costs: built once per tokenizer, O(vocab × token length) time and about 12 bytes per token plus
//! the tokens' bytes; a lookup is one bounds-checked index.

use super::bytes_char::{byte_level_char_to_byte, is_byte_level_char};
use crate::request::TokenId;
use tokenizers::{DecoderWrapper, Tokenizer as HfTokenizer};

/// How the detokenizer turns tokens into text for one tokenizer.
#[derive(Debug, Clone)]
pub(crate) enum DecodePlan {
    /// Table lookup per token (recognised decoder).
    Table(PieceTable),
    /// Decode a small window of recent tokens (any other decoder).
    Window,
}

/// How bytes that can never form a character are replaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InvalidBytes {
    /// One U+FFFD per maximal invalid subpart, as `String::from_utf8_lossy` (ByteLevel).
    Lossy,
    /// One U+FFFD per invalid byte, as the `ByteFallback` decoder.
    PerByte,
}

/// Decoder behaviour that only applies at the start of the decoded sequence.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum StartRule {
    /// Nothing special at the start.
    None,
    /// `Metaspace` with a prepend scheme: the first token drops its replacement characters.
    DropReplacementInFirst(char),
    /// `Strip` after `Fuse`: up to `count` leading `content` characters of the text are removed.
    StripLeading { content: char, count: usize },
}

/// One per-token transform applied to the token string before it becomes bytes.
#[derive(Debug, Clone, PartialEq)]
enum Transform {
    Replace { pattern: String, content: String },
    Metaspace(char),
}

/// What a token contributes to the decoded text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Piece<'a> {
    /// Valid UTF-8 text.
    Text(&'a str),
    /// Bytes that are not valid UTF-8 on their own.
    Bytes(&'a [u8]),
    /// The id has no token: `decode` drops it.
    Missing,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    start: u32,
    len: u32,
    is_text: bool,
    special: bool,
}

/// Each token's bytes, flattened, plus the decoder's start-of-sequence rule.
#[derive(Debug, Clone)]
pub(crate) struct PieceTable {
    text: String,
    bytes: Vec<u8>,
    entries: Vec<Entry>,
    transforms: Vec<Transform>,
    byte_level: bool,
    byte_fallback: bool,
    pub(crate) invalid: InvalidBytes,
    pub(crate) start_rule: StartRule,
}

/// The rules read off a recognised decoder.
#[derive(Debug, Default)]
struct Rules {
    byte_level: bool,
    byte_fallback: bool,
    fused: bool,
    transforms: Vec<Transform>,
    start_rule: Option<StartRule>,
}

impl DecodePlan {
    /// Recognises `hf`'s decoder and builds the table, or falls back to [`DecodePlan::Window`].
    pub(crate) fn build(hf: &HfTokenizer) -> Self {
        match recognise(hf.get_decoder()) {
            Some(rules) => DecodePlan::Table(PieceTable::build(hf, rules)),
            None => DecodePlan::Window,
        }
    }
}

fn recognise(decoder: Option<&DecoderWrapper>) -> Option<Rules> {
    let mut rules = Rules::default();
    match decoder? {
        DecoderWrapper::ByteLevel(_) => rules.byte_level = true,
        DecoderWrapper::Sequence(seq) => {
            for step in seq.get_decoders() {
                add_sequence_step(&mut rules, step)?;
            }
        }
        other => add_sequence_step(&mut rules, other)?,
    }
    Some(rules)
}

/// Adds one member of a decoder `Sequence`; `None` when the sequence is not table-decodable.
fn add_sequence_step(rules: &mut Rules, step: &DecoderWrapper) -> Option<()> {
    let per_token_ok = !rules.fused && !rules.byte_fallback;
    match step {
        DecoderWrapper::Replace(replace) if per_token_ok => {
            let json = serde_json::to_value(replace).ok()?;
            let pattern = json.get("pattern")?.get("String")?.as_str()?.to_string();
            let content = json.get("content")?.as_str()?.to_string();
            if pattern.is_empty() {
                return None;
            }
            rules.transforms.push(Transform::Replace { pattern, content });
        }
        DecoderWrapper::Metaspace(meta) if per_token_ok => {
            let rep = meta.get_replacement();
            rules.transforms.push(Transform::Metaspace(rep));
            if meta.get_prepend_scheme() != tokenizers::pre_tokenizers::metaspace::PrependScheme::Never {
                set_start_rule(rules, StartRule::DropReplacementInFirst(rep))?;
            }
        }
        DecoderWrapper::ByteFallback(_) if !rules.fused && !rules.byte_fallback => {
            rules.byte_fallback = true;
        }
        DecoderWrapper::Fuse(_) => rules.fused = true,
        DecoderWrapper::Strip(strip) if rules.fused && strip.stop == 0 => {
            if strip.start > 0 {
                let rule = StartRule::StripLeading { content: strip.content, count: strip.start };
                set_start_rule(rules, rule)?;
            }
        }
        _ => return None,
    }
    Some(())
}

fn set_start_rule(rules: &mut Rules, rule: StartRule) -> Option<()> {
    if rules.start_rule.is_some() {
        return None;
    }
    rules.start_rule = Some(rule);
    Some(())
}

impl PieceTable {
    fn build(hf: &HfTokenizer, rules: Rules) -> Self {
        let added = hf.get_added_vocabulary();
        let max_added = added.get_added_tokens_decoder().keys().max().map_or(0, |id| *id as usize + 1);
        let len = hf.get_vocab_size(false).max(max_added);
        let mut table = PieceTable {
            text: String::new(),
            bytes: Vec::new(),
            entries: Vec::with_capacity(len),
            transforms: rules.transforms,
            byte_level: rules.byte_level,
            byte_fallback: rules.byte_fallback,
            invalid: if rules.byte_fallback { InvalidBytes::PerByte } else { InvalidBytes::Lossy },
            start_rule: rules.start_rule.unwrap_or(StartRule::None),
        };
        for id in 0..len as u32 {
            let entry = match hf.id_to_token(id) {
                Some(token) => {
                    let special = added.is_special_token(&token);
                    let bytes = table.token_bytes(&token, false);
                    table.push(bytes, special)
                }
                None => Entry { start: 0, len: 0, is_text: false, special: true },
            };
            table.entries.push(entry);
        }
        table
    }

    fn push(&mut self, bytes: Vec<u8>, special: bool) -> Entry {
        match String::from_utf8(bytes) {
            Ok(s) => {
                let start = self.text.len() as u32;
                self.text.push_str(&s);
                Entry { start, len: s.len() as u32, is_text: true, special }
            }
            Err(e) => {
                let start = self.bytes.len() as u32;
                let bytes = e.into_bytes();
                self.bytes.extend_from_slice(&bytes);
                Entry { start, len: bytes.len() as u32, is_text: false, special }
            }
        }
    }

    /// The bytes `decode` produces for `token`; `first` applies the first-token rule.
    pub(crate) fn token_bytes(&self, token: &str, first: bool) -> Vec<u8> {
        if self.byte_level {
            return byte_level_bytes(token);
        }
        if self.byte_fallback {
            if let Some(b) = parse_byte_token(token) {
                return vec![b];
            }
        }
        let mut s = token.to_string();
        for t in &self.transforms {
            s = match t {
                Transform::Replace { pattern, content } => s.replace(pattern.as_str(), content),
                Transform::Metaspace(rep) if first => s.replace(*rep, ""),
                Transform::Metaspace(rep) => s.replace(*rep, " "),
            };
        }
        s.into_bytes()
    }

    /// The piece for `id` and whether it is a special token.
    #[inline]
    pub(crate) fn piece(&self, id: TokenId) -> (Piece<'_>, bool) {
        let Some(e) = self.entries.get(id as usize) else {
            return (Piece::Missing, true);
        };
        let range = e.start as usize..(e.start + e.len) as usize;
        if e.is_text {
            (Piece::Text(&self.text[range]), e.special)
        } else if e.len == 0 {
            (Piece::Missing, true)
        } else {
            (Piece::Bytes(&self.bytes[range]), e.special)
        }
    }
}

/// ByteLevel decoding of one token: every char through the byte map, or the raw UTF-8 of the
/// token when any char is outside the map (added tokens such as `"<|im_start|> "`).
fn byte_level_bytes(token: &str) -> Vec<u8> {
    if token.chars().all(is_byte_level_char) {
        token.chars().filter_map(byte_level_char_to_byte).collect()
    } else {
        token.as_bytes().to_vec()
    }
}

/// `<0xAB>` → `0xAB`, as the `ByteFallback` decoder reads it.
fn parse_byte_token(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    if token.len() != 6 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::test_support;

    #[test]
    fn byte_level_decoder_builds_a_table() {
        let tok = test_support::byte_level_tokenizer();
        let DecodePlan::Table(table) = tok.plan() else { panic!("expected a table") };
        assert_eq!(table.start_rule, StartRule::None);
        assert_eq!(table.invalid, InvalidBytes::Lossy);
    }

    #[test]
    fn llama_style_sequence_builds_a_table_with_strip_rule() {
        let tok = test_support::sentencepiece_tokenizer();
        let DecodePlan::Table(table) = tok.plan() else { panic!("expected a table") };
        assert_eq!(table.start_rule, StartRule::StripLeading { content: ' ', count: 1 });
        assert_eq!(table.invalid, InvalidBytes::PerByte);
        let id = tok.token_to_id("<0xE4>").unwrap();
        assert_eq!(table.piece(id), (Piece::Bytes(&[0xE4]), false));
    }

    #[test]
    fn wordpiece_decoder_falls_back_to_window() {
        let tok = test_support::wordpiece_tokenizer();
        assert!(matches!(tok.plan(), DecodePlan::Window));
    }

    #[test]
    fn byte_token_parsing_matches_byte_fallback() {
        assert_eq!(parse_byte_token("<0x0A>"), Some(0x0A));
        assert_eq!(parse_byte_token("<0xZZ>"), None);
        assert_eq!(parse_byte_token("<0x0A0>"), None);
        assert_eq!(parse_byte_token("0x0A"), None);
    }
}
