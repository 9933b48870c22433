//! `StepBroadcaster` and `StepReceiver`: the Python faces of the core's shared-memory step
//! channel. Rank 0 attaches its broadcaster to its `EngineCore`, so every `schedule()` publishes
//! the step (GIL released) before handing it to Python; a worker rank's receiver returns the
//! same `SchedulerOutput` class, so every rank runs the same `execute_model`.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ferrollm_core::broadcast::{AbortHandle, StepBroadcaster, StepMessage, StepReceiver};
use ferrollm_core::scheduler::SchedulerOutput;
use ferrollm_core::CoreError;
use pyo3::prelude::*;
use pyo3::IntoPyObjectExt;

use crate::errors::{PyCoreError, PyCoreResult};
use crate::outputs::scheduler_output;

fn seconds(param: &str, s: f64) -> PyCoreResult<Duration> {
    Duration::try_from_secs_f64(s).map_err(|_| CoreError::invalid(param, ">= 0 seconds", s).into())
}

/// The writer's end, shared with the `EngineCore` that publishes through it.
#[derive(Clone)]
pub struct SharedBroadcaster {
    inner: Arc<Mutex<StepBroadcaster>>,
    timeout: Duration,
}

impl SharedBroadcaster {
    fn lock(&self) -> MutexGuard<'_, StepBroadcaster> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Publishes a step; called with the GIL released.
    pub fn publish_step(&self, step: &SchedulerOutput) -> Result<(), CoreError> {
        self.lock().publish_step(step, self.timeout)
    }
}

/// Rank 0's end of the step channel.
#[pyclass(name = "StepBroadcaster", module = "ferrollm._core", frozen)]
pub struct PyStepBroadcaster {
    pub shared: SharedBroadcaster,
    abort: AbortHandle,
    path: PathBuf,
}

#[pymethods]
impl PyStepBroadcaster {
    #[new]
    #[pyo3(signature = (num_readers, timeout_s=60.0))]
    fn new(num_readers: usize, timeout_s: f64) -> PyCoreResult<Self> {
        let timeout = seconds("timeout_s", timeout_s)?;
        let tx = StepBroadcaster::create(num_readers)?;
        let path = tx.path().to_path_buf();
        let abort = tx.abort_handle()?;
        Ok(Self { shared: SharedBroadcaster { inner: Arc::new(Mutex::new(tx)), timeout }, abort, path })
    }

    /// The shared-memory file readers open (it is unlinked once they all have).
    #[getter]
    fn path(&self) -> PathBuf {
        self.path.clone()
    }

    #[getter]
    fn num_readers(&self) -> usize {
        self.shared.lock().num_readers()
    }

    /// Messages published so far.
    #[getter]
    fn seq(&self) -> u64 {
        self.shared.lock().seq()
    }

    /// Tells every reader to read its control pipe next.
    fn publish_control(&self, py: Python<'_>) -> PyCoreResult<()> {
        let s = &self.shared;
        Ok(py.detach(|| s.lock().publish(&StepMessage::Control, s.timeout))?)
    }

    /// Aborts the channel and removes its shared-memory file if it is still there.
    fn close(&self, py: Python<'_>) {
        self.abort.abort();
        py.detach(|| self.shared.lock().close());
    }

    /// Tells every reader to exit.
    fn publish_shutdown(&self, py: Python<'_>) -> PyCoreResult<()> {
        let s = &self.shared;
        Ok(py.detach(|| s.lock().publish(&StepMessage::Shutdown, s.timeout))?)
    }

    /// Makes every wait on the channel, on either side, fail at once (a rank died). Safe to
    /// call from another thread while `schedule()` waits in a publish.
    fn abort(&self) {
        self.abort.abort();
    }
}

/// A worker rank's end of the step channel.
#[pyclass(name = "StepReceiver", module = "ferrollm._core", frozen)]
pub struct PyStepReceiver {
    inner: Mutex<StepReceiver>,
}

#[pymethods]
impl PyStepReceiver {
    #[new]
    fn new(path: PathBuf, reader: usize) -> PyCoreResult<Self> {
        Ok(Self { inner: Mutex::new(StepReceiver::open(&path, reader)?) })
    }

    /// The next message: a `SchedulerOutput`, `"control"` (read the control pipe) or
    /// `"shutdown"`; `None` when nothing came within `timeout_s`.
    fn recv(&self, py: Python<'_>, timeout_s: f64) -> PyResult<Py<PyAny>> {
        let timeout = seconds("timeout_s", timeout_s)?;
        let msg = py
            .detach(|| self.inner.lock().unwrap_or_else(|p| p.into_inner()).recv(timeout))
            .map_err(PyCoreError)?;
        match msg {
            None => Ok(py.None()),
            Some(StepMessage::Step(step)) => scheduler_output(py, step)?.into_py_any(py),
            Some(StepMessage::Control) => "control".into_py_any(py),
            Some(StepMessage::Shutdown) => "shutdown".into_py_any(py),
        }
    }
}
