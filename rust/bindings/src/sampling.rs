//! `SamplingOptions`: the sampling fields the core acts on, built once per request by the
//! Python `SamplingParams` (which owns validation messages for the Python-only fields).

use ferrollm_core::SamplingOptions;
use pyo3::prelude::*;

#[pyclass(name = "SamplingOptions", module = "ferrollm._core", frozen)]
#[derive(Clone)]
pub struct PySamplingOptions(pub SamplingOptions);

#[pymethods]
impl PySamplingOptions {
    #[new]
    #[pyo3(signature = (
        *, max_tokens=Some(16), min_tokens=0, ignore_eos=false, stop=Vec::new(),
        stop_token_ids=Vec::new(), include_stop_str_in_output=false, skip_special_tokens=true,
        detokenize=true, logprobs=None, prompt_logprobs=None, temperature=1.0, top_p=1.0, top_k=0,
        min_p=0.0, seed=None, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        max_tokens: Option<usize>,
        min_tokens: usize,
        ignore_eos: bool,
        stop: Vec<String>,
        stop_token_ids: Vec<u32>,
        include_stop_str_in_output: bool,
        skip_special_tokens: bool,
        detokenize: bool,
        logprobs: Option<u32>,
        prompt_logprobs: Option<u32>,
        temperature: f32,
        top_p: f32,
        top_k: i32,
        min_p: f32,
        seed: Option<i64>,
        presence_penalty: f32,
        frequency_penalty: f32,
        repetition_penalty: f32,
    ) -> Self {
        Self(SamplingOptions {
            max_tokens,
            min_tokens,
            ignore_eos,
            stop,
            stop_token_ids,
            include_stop_str_in_output,
            skip_special_tokens,
            detokenize,
            logprobs,
            prompt_logprobs,
            temperature,
            top_p,
            top_k,
            min_p,
            seed,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
        })
    }

    #[getter]
    fn max_tokens(&self) -> Option<usize> {
        self.0.max_tokens
    }

    #[getter]
    fn stop(&self) -> Vec<String> {
        self.0.stop.clone()
    }

    #[getter]
    fn stop_token_ids(&self) -> Vec<u32> {
        self.0.stop_token_ids.clone()
    }

    #[getter]
    fn logprobs(&self) -> Option<u32> {
        self.0.logprobs
    }

    /// Set when the request asked for prompt logprobs: every rank then takes part in computing
    /// the prompt rows' logits.
    #[getter]
    fn prompt_logprobs(&self) -> Option<u32> {
        self.0.prompt_logprobs
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.0)
    }
}
