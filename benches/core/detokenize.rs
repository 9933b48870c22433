//! Incremental detokenization throughput: 256 requests, one token per request per step.
//!
//! Builds its own byte-level BPE (trained here on a generated English / CJK / emoji corpus with a
//! 4,000-token vocabulary, since the bench cannot see the crate's test helpers), encodes a
//! different text per request, and times one engine step: `IncrementalDetokenizer::step` once for
//! each of the 256 requests, each appending to that request's cleared output buffer. Throughput is
//! reported per token. `window` runs the same tokens through the generic window path (the decoder
//! wrapped in a `Sequence`, which the piece table does not recognise) for comparison.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ferrollm_core::tokenizer::{IncrementalDetokenizer, Tokenizer};
use ferrollm_core::TokenId;
use std::hint::black_box;
use tokenizers::decoders::sequence::Sequence;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::AddedToken;

const NUM_REQUESTS: usize = 256;

const SENTENCES: &[&str] = &[
    "The quick brown fox jumps over the lazy dog while the engine schedules another batch.",
    "Paged attention stores keys and values in fixed-size blocks that requests share.",
    "你好，世界！今天天气很好，我们一起去公园散步，然后回家吃饭。",
    "大型语言模型的推理引擎需要高效的调度器和内存管理。",
    "日本語の文章も混ぜておきます。東京は今日も晴れです。",
    "Emoji keep splitting across tokens 😀🎉👍🏽 and flags 🇫🇷🇯🇵 and 👨‍👩‍👧‍👦 families.",
    "Café, naïve, résumé, jalapeño — accents cost two bytes each ∑ ≤ ∞.",
];

fn corpus() -> Vec<String> {
    (0..400)
        .map(|i| {
            let a = SENTENCES[i % SENTENCES.len()];
            let b = SENTENCES[(i * 3 + 1) % SENTENCES.len()];
            format!("{a} {i} {b}")
        })
        .collect()
}

fn train() -> tokenizers::Tokenizer {
    let mut hf = tokenizers::Tokenizer::new(BPE::default());
    hf.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    hf.with_decoder(Some(ByteLevel::default()));
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(4000)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(vec![AddedToken::from("</s>", true)])
        .build()
        .into();
    hf.train(&mut trainer, corpus().into_iter()).expect("training the bench tokenizer");
    hf
}

/// One token stream per request, each from a different mix of sentences.
fn streams(tok: &Tokenizer) -> Vec<Vec<TokenId>> {
    let texts: Vec<String> = (0..NUM_REQUESTS)
        .map(|r| (0..12).map(|k| SENTENCES[(r + k * 5) % SENTENCES.len()]).collect::<Vec<_>>().join(" "))
        .collect();
    tok.encode_batch(&texts, false).expect("encode")
}

/// Times one step of 256 requests.
fn bench_steps(c: &mut Criterion, name: &str, tok: &Tokenizer) {
    let streams = streams(tok);
    let prompt = tok.encode_batch(&["Tell me a story:".to_string()], false).expect("encode").remove(0);
    let mut detoks: Vec<IncrementalDetokenizer> =
        (0..NUM_REQUESTS).map(|_| tok.new_detokenizer(&prompt, true)).collect();
    let mut outs: Vec<String> = vec![String::with_capacity(256); NUM_REQUESTS];
    let mut pos = 0usize;
    let mut group = c.benchmark_group("detokenize");
    group.throughput(Throughput::Elements(NUM_REQUESTS as u64));
    group.bench_function(BenchmarkId::new(name, "256_requests_x_1_token"), |b| {
        b.iter(|| {
            for ((detok, out), ids) in detoks.iter_mut().zip(&mut outs).zip(&streams) {
                out.clear();
                detok.step(tok, ids[pos % ids.len()], out);
            }
            pos += 1;
            black_box(&outs);
        })
    });
    group.finish();
}

fn detokenize(c: &mut Criterion) {
    let hf = train();
    let table = Tokenizer::from_hf(hf.clone());
    bench_steps(c, "byte_level_table", &table);
    let mut wrapped = hf;
    wrapped.with_decoder(Some(Sequence::new(vec![ByteLevel::default().into()])));
    bench_steps(c, "window_fallback", &Tokenizer::from_hf(wrapped));
}

criterion_group!(benches, detokenize);
criterion_main!(benches);
