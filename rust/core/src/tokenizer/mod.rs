//! CONTRACT STUB — to be implemented.
pub mod detokenizer;
pub mod stop;

use std::path::Path;
use crate::error::CoreResult;
use crate::request::TokenId;
pub use detokenizer::IncrementalDetokenizer;

pub struct Tokenizer;

impl Tokenizer {
    pub fn from_file(_path: &Path) -> CoreResult<Self> { todo!() }
    pub fn from_dir(_dir: &Path) -> CoreResult<Self> { todo!() }
    pub fn from_json_str(_json: &str) -> CoreResult<Self> { todo!() }
    pub fn eos_token_ids(&self) -> &[TokenId] { todo!() }
    pub fn vocab_size(&self) -> usize { todo!() }
    pub fn encode_batch(&self, _prompts: &[String], _add_special_tokens: bool) -> CoreResult<Vec<Vec<TokenId>>> { todo!() }
    pub fn decode(&self, _ids: &[TokenId], _skip_special_tokens: bool) -> CoreResult<String> { todo!() }
    pub fn bos_token_id(&self) -> Option<TokenId> { todo!() }
    pub fn token_to_id(&self, _t: &str) -> Option<TokenId> { todo!() }
    pub fn id_to_token(&self, _id: TokenId) -> Option<String> { todo!() }
    pub fn new_detokenizer(&self, _prompt_ids: &[TokenId], _skip_special_tokens: bool) -> IncrementalDetokenizer { todo!() }
}
