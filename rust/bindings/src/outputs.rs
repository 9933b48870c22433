//! Python views of the core's outputs: the step arrays (moved into numpy without a copy) and
//! each finished request's `RequestOutput`.

use ferrollm_core::engine::RequestOutput;
use ferrollm_core::scheduler::{NewRequestData, SchedulerOutput};
use ferrollm_core::StopReason;
use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::IntoPyObjectExt;

use crate::sampling::PySamplingOptions;

/// A finished (or, when streaming, updated) request as the core reports it.
#[pyclass(name = "EngineCoreOutput", module = "ferrollm._core", get_all, frozen)]
pub struct PyRequestOutput {
    request_id: String,
    prompt_token_ids: Vec<u32>,
    token_ids: Vec<u32>,
    text: String,
    finished: bool,
    finish_reason: Option<&'static str>,
    stop_reason: Py<PyAny>,
    num_cached_tokens: usize,
}

#[pymethods]
impl PyRequestOutput {
    fn __repr__(&self) -> String {
        format!(
            "EngineCoreOutput(request_id={:?}, token_ids={:?}, text={:?}, finish_reason={:?})",
            self.request_id, self.token_ids, self.text, self.finish_reason
        )
    }
}

pub fn request_output(py: Python<'_>, o: RequestOutput) -> PyResult<PyRequestOutput> {
    let stop_reason = match o.stop_reason {
        None => py.None(),
        Some(StopReason::TokenId(t)) => t.into_py_any(py)?,
        Some(StopReason::Str(s)) => s.into_py_any(py)?,
    };
    Ok(PyRequestOutput {
        request_id: o.request_id,
        prompt_token_ids: o.prompt_token_ids,
        token_ids: o.token_ids,
        text: o.text,
        finished: o.finished,
        finish_reason: o.finish_reason.map(|r| r.as_str()),
        stop_reason,
        num_cached_tokens: o.num_cached_tokens,
    })
}

/// A request the runner sees for the first time.
#[pyclass(name = "NewRequestData", module = "ferrollm._core", get_all, frozen)]
pub struct PyNewRequestData {
    req_index: usize,
    request_id: String,
    prompt_token_ids: Vec<u32>,
    sampling: PySamplingOptions,
    block_ids: Vec<u32>,
    num_computed_tokens: usize,
}

impl From<NewRequestData> for PyNewRequestData {
    fn from(d: NewRequestData) -> Self {
        Self {
            req_index: d.req_index,
            request_id: d.request_id,
            prompt_token_ids: d.prompt_token_ids,
            sampling: PySamplingOptions(d.sampling),
            block_ids: d.block_ids,
            num_computed_tokens: d.num_computed_tokens,
        }
    }
}

/// One step for the model runner. Every array is a numpy array that owns the core's buffer.
#[pyclass(name = "SchedulerOutput", module = "ferrollm._core", get_all, frozen)]
pub struct PySchedulerOutput {
    step_id: u64,
    num_reqs: usize,
    total_num_scheduled_tokens: usize,
    req_indices: Py<PyAny>,
    num_scheduled_tokens: Py<PyAny>,
    input_ids: Py<PyAny>,
    positions: Py<PyAny>,
    slot_mapping: Py<PyAny>,
    block_tables: Py<PyAny>,
    query_start_loc: Py<PyAny>,
    seq_lens: Py<PyAny>,
    num_computed_tokens: Py<PyAny>,
    logits_indices: Py<PyAny>,
    needs_sample: Py<PyAny>,
    temperature: Py<PyAny>,
    top_p: Py<PyAny>,
    top_k: Py<PyAny>,
    min_p: Py<PyAny>,
    seeds: Py<PyAny>,
    presence_penalty: Py<PyAny>,
    frequency_penalty: Py<PyAny>,
    repetition_penalty: Py<PyAny>,
    scheduled_new_reqs: Vec<Py<PyNewRequestData>>,
    cached_req_indices: Py<PyAny>,
    cached_resumed: Py<PyAny>,
    cached_num_computed_tokens: Py<PyAny>,
    /// CSR layout: the new block ids of cached request `i` are
    /// `cached_new_block_ids[cached_new_block_offsets[i]:cached_new_block_offsets[i+1]]`.
    cached_new_block_ids: Py<PyAny>,
    cached_new_block_offsets: Py<PyAny>,
    finished_req_indices: Py<PyAny>,
    preempted_req_indices: Py<PyAny>,
}

#[pymethods]
impl PySchedulerOutput {
    fn __len__(&self) -> usize {
        self.num_reqs
    }

    fn __repr__(&self) -> String {
        format!(
            "SchedulerOutput(step_id={}, num_reqs={}, total_num_scheduled_tokens={})",
            self.step_id, self.num_reqs, self.total_num_scheduled_tokens
        )
    }
}

fn arr<T: numpy::Element>(py: Python<'_>, v: Vec<T>) -> Py<PyAny> {
    PyArray1::from_vec(py, v).into_any().unbind()
}

pub fn scheduler_output(py: Python<'_>, o: SchedulerOutput) -> PyResult<PySchedulerOutput> {
    let num_reqs = o.num_reqs();
    let tables = PyArray1::from_vec(py, o.block_tables).reshape([num_reqs, o.max_num_blocks])?;
    let mut ids = Vec::new();
    let mut offsets = vec![0i64];
    for c in &o.scheduled_cached_reqs {
        ids.extend(c.new_block_ids.iter().map(|&b| b as i32));
        offsets.push(ids.len() as i64);
    }
    let cached = &o.scheduled_cached_reqs;
    let new_reqs = o.scheduled_new_reqs.into_iter().map(|d| Py::new(py, PyNewRequestData::from(d)));
    let s = o.sampling;
    Ok(PySchedulerOutput {
        step_id: o.step_id,
        num_reqs,
        total_num_scheduled_tokens: o.total_num_scheduled_tokens,
        req_indices: arr(py, o.req_indices),
        num_scheduled_tokens: arr(py, o.num_scheduled_tokens),
        input_ids: arr(py, o.input_ids),
        positions: arr(py, o.positions),
        slot_mapping: arr(py, o.slot_mapping),
        block_tables: tables.into_any().unbind(),
        query_start_loc: arr(py, o.query_start_loc),
        seq_lens: arr(py, o.seq_lens),
        num_computed_tokens: arr(py, o.num_computed_tokens),
        logits_indices: arr(py, o.logits_indices),
        needs_sample: arr(py, o.needs_sample),
        temperature: arr(py, s.temperature),
        top_p: arr(py, s.top_p),
        top_k: arr(py, s.top_k),
        min_p: arr(py, s.min_p),
        seeds: arr(py, s.seeds),
        presence_penalty: arr(py, s.presence_penalty),
        frequency_penalty: arr(py, s.frequency_penalty),
        repetition_penalty: arr(py, s.repetition_penalty),
        scheduled_new_reqs: new_reqs.collect::<PyResult<_>>()?,
        cached_req_indices: arr(py, cached.iter().map(|c| c.req_index as i64).collect::<Vec<_>>()),
        cached_resumed: arr(py, cached.iter().map(|c| c.resumed_from_preemption).collect::<Vec<_>>()),
        cached_num_computed_tokens: arr(
            py,
            cached.iter().map(|c| c.num_computed_tokens as i32).collect::<Vec<_>>(),
        ),
        cached_new_block_ids: arr(py, ids),
        cached_new_block_offsets: arr(py, offsets),
        finished_req_indices: arr(py, o.finished_req_indices),
        preempted_req_indices: arr(py, o.preempted_req_indices),
    })
}
