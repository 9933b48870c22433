//! `Tokenizer`: the core's tokenizer pipeline (HF `tokenizers` crate) for Python, with batch
//! encoding and decoding done with the GIL released.

use std::path::PathBuf;
use std::sync::Arc;

use ferrollm_core::tokenizer::Tokenizer;
use pyo3::prelude::*;

use crate::errors::{PyCoreError, PyCoreResult};

#[pyclass(name = "Tokenizer", module = "ferrollm._core", frozen)]
pub struct PyTokenizer {
    pub inner: Arc<Tokenizer>,
}

impl PyTokenizer {
    /// Loads a `tokenizer.json` file, or a folder with it and its side files.
    pub fn load_path(py: Python<'_>, path: PathBuf) -> PyCoreResult<Tokenizer> {
        py.detach(|| if path.is_dir() { Tokenizer::from_dir(&path) } else { Tokenizer::from_file(&path) })
            .map_err(PyCoreError)
    }
}

#[pymethods]
impl PyTokenizer {
    /// Loads from a `tokenizer.json` path or a model folder.
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyCoreResult<Self> {
        Ok(Self { inner: Arc::new(Self::load_path(py, path)?) })
    }

    #[getter]
    fn eos_token_ids(&self) -> Vec<u32> {
        self.inner.eos_token_ids().to_vec()
    }

    #[getter]
    fn bos_token_id(&self) -> Option<u32> {
        self.inner.bos_token_id()
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    #[pyo3(signature = (text, add_special_tokens=true))]
    fn encode(&self, py: Python<'_>, text: String, add_special_tokens: bool) -> PyCoreResult<Vec<u32>> {
        let mut v = py.detach(|| self.inner.encode_batch(&[text], add_special_tokens))?;
        Ok(v.pop().unwrap_or_default())
    }

    /// Encodes many texts in parallel.
    #[pyo3(signature = (texts, add_special_tokens=true))]
    fn encode_batch(
        &self,
        py: Python<'_>,
        texts: Vec<String>,
        add_special_tokens: bool,
    ) -> PyCoreResult<Vec<Vec<u32>>> {
        Ok(py.detach(|| self.inner.encode_batch(&texts, add_special_tokens))?)
    }

    #[pyo3(signature = (token_ids, skip_special_tokens=true))]
    fn decode(&self, py: Python<'_>, token_ids: Vec<u32>, skip_special_tokens: bool) -> PyCoreResult<String> {
        Ok(py.detach(|| self.inner.decode(&token_ids, skip_special_tokens))?)
    }

    /// Detokenizes `token_ids` one at a time after `prompt_token_ids`, as the engine does,
    /// returning the piece of text each token released.
    #[pyo3(signature = (prompt_token_ids, token_ids, skip_special_tokens=true))]
    fn decode_incrementally(
        &self,
        py: Python<'_>,
        prompt_token_ids: Vec<u32>,
        token_ids: Vec<u32>,
        skip_special_tokens: bool,
    ) -> Vec<String> {
        py.detach(|| {
            let mut detok = self.inner.new_detokenizer(&prompt_token_ids, skip_special_tokens);
            let mut pieces = Vec::with_capacity(token_ids.len());
            for id in token_ids {
                let mut s = String::new();
                detok.step(&self.inner, id, &mut s);
                pieces.push(s);
            }
            pieces
        })
    }
}
