//! The tokenizer pipeline: encoding prompts, incremental detokenization and stop-string checks.
//!
//! Owns [`Tokenizer`], a `Send + Sync` wrapper over a Hugging Face `tokenizer.json` that the engine
//! shares in an `Arc`, together with the special token ids read from the checkpoint's side files
//! and, when the decoder is recognised, a per-token piece table that makes
//! [`IncrementalDetokenizer::step`] a table lookup (see `table.rs`).
//!
//! Invariants: the detokenized text of an output equals `decode(prompt + output)` minus
//! `decode(prompt)` and never contains a broken character; `eos_token_ids()` lists the primary EOS
//! first with no duplicates. Costs: construction reads and parses the files and builds the table
//! (O(vocab)); `encode_batch` runs on the rayon pool; `vocab_size` and the id lookups are O(1).

mod bytes_char;
mod config;
pub mod detokenizer;
pub mod stop;
mod table;
#[cfg(test)]
pub(crate) mod test_support;
mod window;

use crate::error::{CoreError, CoreResult};
use crate::request::TokenId;
pub use detokenizer::IncrementalDetokenizer;
use rayon::prelude::*;
use std::path::Path;
use std::str::FromStr;
use table::DecodePlan;

/// A Hugging Face tokenizer plus what the engine needs around it: EOS/BOS ids and the piece table
/// for fast incremental detokenization.
#[derive(Clone)]
pub struct Tokenizer {
    hf: tokenizers::Tokenizer,
    plan: DecodePlan,
    eos_token_ids: Vec<TokenId>,
    bos_token_id: Option<TokenId>,
    vocab_size: usize,
}

impl Tokenizer {
    /// Loads a `tokenizer.json` file. No side files are read: EOS and BOS are unset.
    pub fn from_file(path: &Path) -> CoreResult<Self> {
        let json = std::fs::read_to_string(path)
            .map_err(|e| CoreError::Tokenizer(format!("could not read {}: {e}", path.display())))?;
        Self::parse(&json, &path.display().to_string())
    }

    /// Loads `dir/tokenizer.json` and, when present, `tokenizer_config.json`,
    /// `generation_config.json` and `config.json` for the EOS and BOS ids.
    pub fn from_dir(dir: &Path) -> CoreResult<Self> {
        let mut tok = Self::from_file(&dir.join("tokenizer.json"))?;
        let ids = config::read_special_ids(dir, |t| tok.token_to_id(t))?;
        tok.eos_token_ids = ids.eos;
        tok.bos_token_id = ids.bos;
        Ok(tok)
    }

    /// Parses the content of a `tokenizer.json`. EOS and BOS are unset.
    pub fn from_json_str(json: &str) -> CoreResult<Self> {
        Self::parse(json, "tokenizer JSON string")
    }

    fn parse(json: &str, source: &str) -> CoreResult<Self> {
        let hf = tokenizers::Tokenizer::from_str(json)
            .map_err(|e| CoreError::Tokenizer(format!("{source} is not a valid tokenizer.json: {e}")))?;
        Ok(Self::from_hf(hf))
    }

    /// Wraps an already-built Hugging Face tokenizer. EOS and BOS are unset.
    ///
    /// Its padding and truncation settings are dropped: the core encodes every prompt on its
    /// own, whole, and sentence-transformers exports often pad (and truncate) every encoding to
    /// a fixed length. transformers ignores both settings unless a call asks for them.
    pub fn from_hf(mut hf: tokenizers::Tokenizer) -> Self {
        hf.with_padding(None);
        // Only a truncation length shorter than the added special tokens is refused.
        let _ = hf.with_truncation(None);
        let plan = DecodePlan::build(&hf);
        let vocab_size = hf.get_vocab_size(true);
        Tokenizer { hf, plan, eos_token_ids: Vec::new(), bos_token_id: None, vocab_size }
    }

    /// Replaces the EOS ids (first = primary EOS); duplicates are dropped.
    pub fn with_eos_token_ids(mut self, mut ids: Vec<TokenId>) -> Self {
        let mut seen = std::collections::HashSet::new();
        ids.retain(|id| seen.insert(*id));
        self.eos_token_ids = ids;
        self
    }

    /// Replaces the BOS id.
    pub fn with_bos_token_id(mut self, id: Option<TokenId>) -> Self {
        self.bos_token_id = id;
        self
    }

    /// EOS ids, primary first; empty when the checkpoint names none.
    pub fn eos_token_ids(&self) -> &[TokenId] {
        &self.eos_token_ids
    }

    /// The BOS id, when the checkpoint names one.
    pub fn bos_token_id(&self) -> Option<TokenId> {
        self.bos_token_id
    }

    /// Number of tokens, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Encodes `prompts` in parallel; the result is in input order.
    pub fn encode_batch(
        &self,
        prompts: &[String],
        add_special_tokens: bool,
    ) -> CoreResult<Vec<Vec<TokenId>>> {
        prompts
            .par_iter()
            .enumerate()
            .map(|(i, prompt)| {
                self.hf
                    .encode_fast(prompt.as_str(), add_special_tokens)
                    .map(|enc| enc.get_ids().to_vec())
                    .map_err(|e| CoreError::Tokenizer(format!("could not encode prompt {i}: {e}")))
            })
            .collect()
    }

    /// Decodes `ids` to text; special tokens are dropped when `skip_special_tokens`.
    pub fn decode(&self, ids: &[TokenId], skip_special_tokens: bool) -> CoreResult<String> {
        self.hf
            .decode(ids, skip_special_tokens)
            .map_err(|e| CoreError::Tokenizer(format!("could not decode {} token ids: {e}", ids.len())))
    }

    /// A detokenizer for one output sequence that follows `prompt_ids`.
    pub fn new_detokenizer(
        &self,
        prompt_ids: &[TokenId],
        skip_special_tokens: bool,
    ) -> IncrementalDetokenizer {
        IncrementalDetokenizer::new(self, prompt_ids, skip_special_tokens)
    }

    /// The id of token string `token` (added tokens included).
    pub fn token_to_id(&self, token: &str) -> Option<TokenId> {
        self.hf.token_to_id(token)
    }

    /// The token string of `id` (added tokens included).
    pub fn id_to_token(&self, id: TokenId) -> Option<String> {
        self.hf.id_to_token(id)
    }

    /// Whether `id` is a special token (one that `skip_special_tokens` drops).
    pub fn is_special(&self, id: TokenId) -> bool {
        self.hf.id_to_token(id).is_some_and(|t| self.hf.get_added_vocabulary().is_special_token(&t))
    }

    /// The wrapped Hugging Face tokenizer.
    pub fn hf(&self) -> &tokenizers::Tokenizer {
        &self.hf
    }

    pub(crate) fn plan(&self) -> &DecodePlan {
        &self.plan
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let plan = match self.plan {
            DecodePlan::Table(_) => "table",
            DecodePlan::Window => "window",
        };
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("eos_token_ids", &self.eos_token_ids)
            .field("bos_token_id", &self.bos_token_id)
            .field("detokenize", &plan)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::{self, TempDir};
    use super::*;

    #[test]
    fn tokenizer_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Tokenizer>();
        assert_send_sync::<IncrementalDetokenizer>();
    }

    #[test]
    fn encode_batch_keeps_input_order() {
        let tok = test_support::byte_level_tokenizer();
        let prompts: Vec<String> =
            (0..64).map(|i| format!("prompt {i}: {}", "hello world ".repeat(i % 7))).collect();
        let batch = tok.encode_batch(&prompts, false).unwrap();
        for (prompt, ids) in prompts.iter().zip(&batch) {
            assert_eq!(&tok.decode(ids, false).unwrap(), prompt);
        }
    }

    #[test]
    fn padding_and_truncation_of_tokenizer_json_are_dropped() {
        let plain = test_support::byte_level_tokenizer();
        let mut json: serde_json::Value =
            serde_json::from_str(&plain.hf().to_string(false).unwrap()).unwrap();
        json["padding"] = serde_json::json!({"strategy": {"Fixed": 32}, "direction": "Right",
            "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "<unk>"});
        json["truncation"] = serde_json::json!({"max_length": 4, "strategy": "LongestFirst", "stride": 0,
            "direction": "Right"});
        let padded = Tokenizer::from_json_str(&json.to_string()).unwrap();
        let text = "hello world, the quick brown fox";
        let ids = test_support::encode(&plain, text, true);
        assert!(ids.len() > 4 && ids.len() < 32);
        assert_eq!(test_support::encode(&padded, text, true), ids);
    }

    #[test]
    fn from_dir_reads_eos_list_and_bos() {
        let tok = test_support::byte_level_tokenizer();
        let dir = TempDir::new();
        dir.write("tokenizer.json", &tok.hf().to_string(false).unwrap());
        dir.write("generation_config.json", r#"{"eos_token_id": [3, 2]}"#);
        dir.write("tokenizer_config.json", r#"{"bos_token": {"content": "<s>"}, "eos_token": "</s>"}"#);
        let loaded = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(loaded.eos_token_ids(), &[3, 2]);
        assert_eq!(loaded.bos_token_id(), tok.token_to_id("<s>"));
    }

    #[test]
    fn from_dir_falls_back_to_tokenizer_config_eos() {
        let tok = test_support::byte_level_tokenizer();
        let dir = TempDir::new();
        dir.write("tokenizer.json", &tok.hf().to_string(false).unwrap());
        dir.write("tokenizer_config.json", r#"{"eos_token": {"content": "</s>", "lstrip": false}}"#);
        let loaded = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(loaded.eos_token_ids(), &[tok.token_to_id("</s>").unwrap()]);
    }

    #[test]
    fn missing_tokenizer_json_names_the_file() {
        let dir = TempDir::new();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("tokenizer.json"), "{err}");
    }

    #[test]
    fn malformed_json_is_a_tokenizer_error() {
        let err = Tokenizer::from_json_str("{\"model\": 3}").unwrap_err();
        assert!(
            matches!(err, CoreError::Tokenizer(ref m) if m.contains("not a valid tokenizer.json")),
            "{err}"
        );
    }

    #[test]
    fn special_tokens_are_reported_and_vocab_counts_added_tokens() {
        let tok = test_support::byte_level_tokenizer();
        let eos = tok.token_to_id("</s>").unwrap();
        assert!(tok.is_special(eos));
        assert!(!tok.is_special(tok.token_to_id("a").unwrap()));
        assert_eq!(tok.id_to_token(eos).as_deref(), Some("</s>"));
        assert_eq!(tok.eos_token_ids(), &[eos]);
        assert!(tok.vocab_size() > eos as usize);
    }
}
