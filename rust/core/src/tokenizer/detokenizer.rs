//! CONTRACT STUB — to be implemented.
use super::Tokenizer;
use crate::request::TokenId;

pub struct IncrementalDetokenizer;

impl IncrementalDetokenizer {
    /// Feeds one token and appends only complete UTF-8 text to `out`; returns bytes appended.
    pub fn step(&mut self, _tok: &Tokenizer, _id: TokenId, _out: &mut String) -> usize { todo!() }
}
