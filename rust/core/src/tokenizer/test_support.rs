//! Tiny tokenizers built in code, and helpers, for the crate's tests (never the network).
//!
//! Owns: a byte-level BPE trained at first use on a small English / CJK / emoji corpus, with
//! special tokens `<s>` and `</s>` (EOS) and a non-special added token `<extra>`; a Llama-style
//! SentencePiece BPE (byte fallback, Metaspace pre-tokenizer, Replace/ByteFallback/Fuse/Strip
//! decoder); a Metaspace-decoder variant; and a WordPiece tokenizer, whose decoder takes the
//! generic window path. Each is built once per test binary and cloned. Costs: training takes a
//! few milliseconds; a clone copies a table of a few hundred tokens.

use super::Tokenizer;
use crate::request::TokenId;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use tokenizers::decoders::sequence::Sequence;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::AddedToken;

/// Text the byte-level tokenizer is trained on.
pub(crate) const CORPUS: &[&str] = &[
    "Hello, my name is Ferro and I like the world of language models.",
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "你好，世界！今天天气很好。我们一起去公园散步吧。",
    "中文分词和字节级编码：中国，中心，中间。",
    "日本語のテキストも少し入れておきます。こんにちは。",
    "Emoji time 😀😀 🎉 party 🎉 and 👍 thumbs, flags 🇫🇷 and family 👨‍👩‍👧.",
    "Café naïve résumé — «quotes» and math: ∑ x² ≤ ∞.",
    "the the the and and and hello hello world world",
];

/// The byte-level BPE tokenizer, with EOS `</s>` and BOS `<s>` set.
pub(crate) fn byte_level_tokenizer() -> Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let tok = Tokenizer::from_hf(train_byte_level());
        let eos = tok.token_to_id("</s>").into_iter().collect();
        let bos = tok.token_to_id("<s>");
        tok.with_eos_token_ids(eos).with_bos_token_id(bos)
    })
    .clone()
}

fn train_byte_level() -> tokenizers::Tokenizer {
    let mut hf = tokenizers::Tokenizer::new(BPE::default());
    hf.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    hf.with_decoder(Some(ByteLevel::default()));
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(420)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(vec![AddedToken::from("<s>", true), AddedToken::from("</s>", true)])
        .build()
        .into();
    hf.train(&mut trainer, CORPUS.iter()).expect("training the test tokenizer");
    hf.add_tokens([AddedToken::from("<extra>", false)]).expect("a plain added token");
    hf
}

/// Llama-style SentencePiece BPE: byte fallback, Metaspace pre-tokenizer, and the
/// Replace('▁', ' ') / ByteFallback / Fuse / Strip(' ', 1, 0) decoder; BOS `<s>` is prepended.
pub(crate) fn sentencepiece_tokenizer() -> Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let decoder = json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}
        ]});
        let pre = json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false});
        let tok = Tokenizer::from_json_str(&sentencepiece_json(true, pre, decoder)).expect("valid test JSON");
        tok.with_eos_token_ids(vec![2]).with_bos_token_id(Some(1))
    })
    .clone()
}

/// The same vocabulary without byte fallback, decoded by a `Metaspace` decoder.
pub(crate) fn metaspace_tokenizer() -> Tokenizer {
    let meta = json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true});
    Tokenizer::from_json_str(&sentencepiece_json(false, meta.clone(), meta)).expect("valid test JSON")
}

fn sentencepiece_json(byte_fallback: bool, pre_tokenizer: Value, decoder: Value) -> String {
    let mut vocab = serde_json::Map::new();
    let mut add = |t: &str| {
        let id = vocab.len();
        vocab.entry(t.to_string()).or_insert(json!(id));
    };
    for t in ["<unk>", "<s>", "</s>"] {
        add(t);
    }
    (0..=255u8).for_each(|b| add(&format!("<0x{b:02X}>")));
    "▁abcdefghijklmnopqrstuvwxyzHTW,.!?'文".chars().for_each(|c| add(&c.to_string()));
    let pairs = [
        ("▁", "t"),
        ("h", "e"),
        ("▁t", "he"),
        ("▁", "a"),
        ("l", "l"),
        ("o", "r"),
        ("▁", "w"),
        ("▁w", "or"),
        ("l", "d"),
        ("▁wor", "ld"),
        ("e", "l"),
        ("▁", "H"),
        ("▁H", "el"),
        ("▁Hel", "l"),
        ("▁Hell", "o"),
        ("i", "n"),
        ("▁", "i"),
        ("▁i", "n"),
        ("▁", "文"),
    ];
    let mut merges = Vec::new();
    for (a, b) in pairs {
        add(&format!("{a}{b}"));
        merges.push(format!("{a} {b}"));
    }
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let bos = json!({"SpecialToken": {"id": "<s>", "type_id": 0}});
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {"type": "TemplateProcessing",
            "single": [bos.clone(), {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": decoder,
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
            "byte_fallback": byte_fallback, "ignore_merges": false, "vocab": vocab, "merges": merges}
    })
    .to_string()
}

/// A BERT-style WordPiece tokenizer (its decoder is not table-decodable).
pub(crate) fn wordpiece_tokenizer() -> Tokenizer {
    let words =
        ["[UNK]", "[CLS]", "[SEP]", "hello", "world", "play", "##ing", "##ed", "the", "game", "we", "##s"];
    let vocab: serde_json::Map<String, Value> =
        words.iter().enumerate().map(|(i, w)| (w.to_string(), json!(i))).collect();
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let json = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "[UNK]"), special(1, "[CLS]"), special(2, "[SEP]")],
        "normalizer": null, "pre_tokenizer": {"type": "BertPreTokenizer"}, "post_processor": null,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
            "max_input_chars_per_word": 100, "vocab": vocab}
    });
    Tokenizer::from_json_str(&json.to_string()).expect("valid test JSON")
}

/// `text` encoded, as one prompt.
pub(crate) fn encode(tok: &Tokenizer, text: &str, add_special_tokens: bool) -> Vec<TokenId> {
    let mut batch = tok.encode_batch(&[text.to_string()], add_special_tokens).expect("encode");
    batch.pop().unwrap_or_default()
}

/// The byte-level tokenizer with its decoder wrapped in a `Sequence`, which the piece table does
/// not recognise: it exercises the generic window path on byte-level text.
pub(crate) fn byte_level_window_tokenizer() -> Tokenizer {
    let mut hf = byte_level_tokenizer().hf().clone();
    hf.with_decoder(Some(Sequence::new(vec![ByteLevel::default().into()])));
    Tokenizer::from_hf(hf)
}

/// `decode(prompt + output)` minus `decode(prompt)`: the output's text in context.
pub(crate) fn decode_in_context(
    tok: &Tokenizer,
    prompt: &[TokenId],
    output: &[TokenId],
    skip: bool,
) -> String {
    let all: Vec<TokenId> = prompt.iter().chain(output).copied().collect();
    let full = tok.decode(&all, skip).expect("decode");
    let head = tok.decode(prompt, skip).expect("decode");
    assert!(full.starts_with(&head), "{full:?} does not start with {head:?}");
    full[head.len()..].to_string()
}

/// Feeds `output` token by token; returns each step's emitted piece, then the flushed rest.
pub(crate) fn stream(
    tok: &Tokenizer,
    prompt: &[TokenId],
    output: &[TokenId],
    skip: bool,
) -> (Vec<String>, String) {
    let mut detok = tok.new_detokenizer(prompt, skip);
    let pieces = output
        .iter()
        .map(|&id| {
            let mut piece = String::new();
            let n = detok.step(tok, id, &mut piece);
            assert_eq!(n, piece.len());
            piece
        })
        .collect();
    let mut rest = String::new();
    detok.flush(tok, &mut rest);
    (pieces, rest)
}

/// A fresh directory under the system temp dir, removed on drop.
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    pub(crate) fn new() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("ferrollm-tok-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir(path)
    }

    pub(crate) fn path(&self) -> &Path {
        &self.0
    }

    pub(crate) fn write(&self, name: &str, content: &str) {
        std::fs::write(self.0.join(name), content).expect("write temp file");
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
