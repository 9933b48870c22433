//! `EngineCore`: the Python face of `ferrollm_core::engine::EngineCore`. Each method converts
//! its arguments, releases the GIL for the work, and converts the result. The core sits behind a
//! mutex only because Python may call from several threads; the hot path takes it once a call.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use ferrollm_core::engine::EngineCore;
use ferrollm_core::kv_cache::MultiModalFeature;
use ferrollm_core::{CacheConfig, EngineConfig, EngineRequest, SchedulerConfig};
use numpy::PyReadonlyArray1;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::broadcast::{PyStepBroadcaster, SharedBroadcaster};
use crate::errors::{PyCoreError, PyCoreResult};
use crate::outputs::{request_output, scheduler_output, PyRequestOutput, PySchedulerOutput};
use crate::sampling::PySamplingOptions;
use crate::tokenizer::PyTokenizer;

/// A prompt as Python passes it: text to tokenize, or token ids.
#[derive(FromPyObject)]
pub enum Prompt {
    Text(String),
    TokenIds(Vec<u32>),
}

#[pyclass(name = "EngineCore", module = "ferrollm._core", frozen)]
pub struct PyEngineCore {
    core: Mutex<EngineCore>,
    /// Set on rank 0 of a tensor-parallel engine: every step is published to the other ranks.
    broadcaster: Mutex<Option<SharedBroadcaster>>,
}

impl PyEngineCore {
    fn lock(&self) -> MutexGuard<'_, EngineCore> {
        // A panic inside the core poisons the lock; the state is still the core's own, so go on.
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl PyEngineCore {
    #[new]
    #[pyo3(signature = (
        *, tokenizer=None, block_size=16, num_blocks=1024, enable_prefix_caching=true,
        max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096,
        enable_chunked_prefill=true, long_prefill_token_threshold=0, scheduling_policy="fcfs",
        stream_outputs=false, sliding_window=None, max_num_encoder_input_tokens=None,
        disable_chunked_mm_input=false
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        tokenizer: Option<Bound<'_, PyAny>>,
        block_size: usize,
        num_blocks: usize,
        enable_prefix_caching: bool,
        max_num_seqs: usize,
        max_num_batched_tokens: usize,
        max_model_len: usize,
        enable_chunked_prefill: bool,
        long_prefill_token_threshold: usize,
        scheduling_policy: &str,
        stream_outputs: bool,
        sliding_window: Option<usize>,
        max_num_encoder_input_tokens: Option<usize>,
        disable_chunked_mm_input: bool,
    ) -> PyResult<Self> {
        let cfg = EngineConfig {
            cache: CacheConfig { block_size, num_blocks, enable_prefix_caching, sliding_window },
            scheduler: SchedulerConfig {
                max_num_seqs,
                max_num_batched_tokens,
                max_model_len,
                enable_chunked_prefill,
                long_prefill_token_threshold,
                policy: scheduling_policy.parse().map_err(crate::errors::PyCoreError)?,
                // vLLM's default: as many placeholder tokens as the step has tokens.
                max_num_encoder_input_tokens: max_num_encoder_input_tokens.unwrap_or(max_num_batched_tokens),
                disable_chunked_mm_input,
            },
            stream_outputs,
        };
        let tok = match tokenizer {
            None => None,
            Some(t) => match t.cast::<PyTokenizer>() {
                Ok(t) => Some(t.get().inner.clone()),
                Err(_) => Some(Arc::new(PyTokenizer::load_path(py, t.extract::<PathBuf>()?)?)),
            },
        };
        let core = py.detach(|| EngineCore::new(cfg, tok)).map_err(crate::errors::PyCoreError)?;
        Ok(Self { core: Mutex::new(core), broadcaster: Mutex::new(None) })
    }

    /// Adds requests atomically; text prompts are tokenized in parallel with the GIL released.
    #[pyo3(signature = (
        request_ids, prompts, params, priorities=None, cache_salts=None, add_special_tokens=true, mm_features=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn add_requests(
        &self,
        py: Python<'_>,
        request_ids: Vec<String>,
        prompts: Vec<Prompt>,
        params: Vec<PyRef<'_, PySamplingOptions>>,
        priorities: Option<Vec<i32>>,
        cache_salts: Option<Vec<Option<String>>>,
        add_special_tokens: bool,
        mm_features: Option<Vec<Vec<MmFeature>>>,
    ) -> PyCoreResult<()> {
        let n = request_ids.len();
        check_len("prompts", prompts.len(), n)?;
        check_len("params", params.len(), n)?;
        let priorities = priorities.unwrap_or_else(|| vec![0; n]);
        check_len("priorities", priorities.len(), n)?;
        let salts = cache_salts.unwrap_or_else(|| vec![None; n]);
        check_len("cache_salts", salts.len(), n)?;
        let features = mm_features.unwrap_or_else(|| vec![Vec::new(); n]);
        check_len("mm_features", features.len(), n)?;
        let sampling: Vec<_> = params.iter().map(|p| p.0.clone()).collect();
        py.detach(|| {
            let mut core = self.lock();
            let ids = tokenize(&core, prompts, add_special_tokens)?;
            let reqs =
                request_ids.into_iter().zip(ids).zip(sampling).zip(priorities).zip(salts).zip(features);
            let reqs = reqs
                .map(|(((((id, toks), s), priority), salt), feats)| EngineRequest {
                    priority,
                    cache_salt: salt,
                    mm_features: feats
                        .into_iter()
                        .map(|(identifier, offset, length)| MultiModalFeature { identifier, offset, length })
                        .collect(),
                    ..EngineRequest::new(id, toks, s)
                })
                .collect();
            core.add_requests(reqs)
        })?;
        Ok(())
    }

    /// Schedules the next step; its arrays are numpy arrays owning the core's buffers. With a
    /// step broadcaster attached, the step is first published to the other ranks.
    fn schedule(&self, py: Python<'_>) -> PyResult<PySchedulerOutput> {
        let broadcaster = self.broadcaster.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let out = py.detach(|| {
            let out = self.lock().schedule();
            match &broadcaster {
                Some(b) => b.publish_step(&out).map(|()| out),
                None => Ok(out),
            }
        });
        scheduler_output(py, out.map_err(PyCoreError)?)
    }

    /// Attaches (or, with None, detaches) the channel every later step is published on.
    fn set_step_broadcaster(&self, broadcaster: Option<PyRef<'_, PyStepBroadcaster>>) {
        *self.broadcaster.lock().unwrap_or_else(|p| p.into_inner()) = broadcaster.map(|b| b.shared.clone());
    }

    /// Applies one sampled token per scheduled request (int array in step order).
    fn update(&self, py: Python<'_>, sampled: Bound<'_, PyAny>) -> PyResult<Vec<PyRequestOutput>> {
        let tokens: Vec<u32> = match sampled.extract::<PyReadonlyArray1<'_, i64>>() {
            Ok(a) => to_token_ids(a.as_slice()?)?,
            Err(_) => sampled.extract::<Vec<u32>>()?,
        };
        let outs = py.detach(|| self.lock().update(&tokens)).map_err(crate::errors::PyCoreError)?;
        outs.into_iter().map(|o| request_output(py, o)).collect()
    }

    /// Aborts requests by id; returns how many were live. Their outputs come from the next update.
    fn abort_requests(&self, py: Python<'_>, request_ids: Vec<String>) -> usize {
        py.detach(|| self.lock().abort_requests(&request_ids))
    }

    /// Aborts every unfinished request (after a failed step, or on interrupt).
    fn abort_all_requests(&self, py: Python<'_>) -> usize {
        py.detach(|| self.lock().abort_all_requests())
    }

    fn has_unfinished_requests(&self) -> bool {
        self.lock().has_unfinished_requests()
    }

    fn reset_prefix_cache(&self, py: Python<'_>) -> bool {
        py.detach(|| self.lock().reset_prefix_cache())
    }

    /// Scheduler and cache counters.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let core = self.lock();
        let s = core.scheduler().stats();
        let kv = core.scheduler().kv_cache();
        let d = PyDict::new(py);
        d.set_item("num_running", s.num_running)?;
        d.set_item("num_waiting", s.num_waiting)?;
        d.set_item("num_preemptions", s.num_preemptions)?;
        d.set_item("num_free_blocks", s.num_free_blocks)?;
        d.set_item("kv_cache_usage", kv.usage())?;
        let prefix = kv.prefix_cache_stats();
        d.set_item("prefix_cache_queried_tokens", prefix.num_queried_tokens)?;
        d.set_item("prefix_cache_hit_tokens", prefix.num_hit_tokens)?;
        d.set_item("prefix_cache_hit_rate", prefix.hit_rate())?;
        Ok(d)
    }

    /// The KV block ids a live request holds, in table order.
    fn block_ids(&self, request_id: &str) -> Option<Vec<u32>> {
        let core = self.lock();
        let idx = core.scheduler().index_of(request_id)?;
        Some(core.scheduler().kv_cache().block_ids(idx).to_vec())
    }

    /// How many requests hold a KV block.
    fn block_ref_count(&self, block_id: u32) -> PyCoreResult<u32> {
        let core = self.lock();
        let pool = core.scheduler().kv_cache().pool();
        if block_id as usize >= pool.num_blocks() {
            let bound = format!("< num_blocks ({})", pool.num_blocks());
            return Err(ferrollm_core::CoreError::invalid("block_id", bound, block_id).into());
        }
        Ok(pool.ref_cnt(block_id))
    }

    /// The engine's tokenizer, if it has one.
    fn get_tokenizer(&self) -> Option<PyTokenizer> {
        self.lock().tokenizer().map(|t| PyTokenizer { inner: t.clone() })
    }
}

/// A multimodal item as Python passes it: (content hash, first prompt position, length). The
/// core checks that the items are sorted, disjoint and inside the prompt.
type MmFeature = (String, usize, usize);

fn check_len(param: &str, got: usize, want: usize) -> PyCoreResult<()> {
    if got == want {
        return Ok(());
    }
    Err(ferrollm_core::CoreError::invalid(
        param,
        format!("one entry per request id ({want})"),
        format!("{got} entries"),
    )
    .into())
}

fn to_token_ids(a: &[i64]) -> PyResult<Vec<u32>> {
    a.iter()
        .map(|&t| {
            u32::try_from(t).map_err(|_| {
                crate::errors::PyCoreError(ferrollm_core::CoreError::StepMismatch {
                    param: "sampled".into(),
                    bound: "token ids in [0, 2^32)".into(),
                    value: t.to_string(),
                })
                .into()
            })
        })
        .collect()
}

fn tokenize(
    core: &EngineCore,
    prompts: Vec<Prompt>,
    add_special_tokens: bool,
) -> ferrollm_core::CoreResult<Vec<Vec<u32>>> {
    let texts: Vec<String> = prompts
        .iter()
        .filter_map(|p| match p {
            Prompt::Text(t) => Some(t.clone()),
            Prompt::TokenIds(_) => None,
        })
        .collect();
    let mut encoded =
        if texts.is_empty() { Vec::new() } else { core.encode_prompts(&texts, add_special_tokens)? }
            .into_iter();
    Ok(prompts
        .into_iter()
        .map(|p| match p {
            Prompt::Text(_) => encoded.next().expect("one encoding per text prompt"),
            Prompt::TokenIds(ids) => ids,
        })
        .collect())
}
