//! The one place core and kernel errors become Python exceptions. The classes live in
//! `ferrollm.exceptions` (so users import them from Python and they subclass the built-ins a
//! user would catch); this module looks them up by name.

use ferrollm_core::CoreError;
use ferrollm_kernels::KernelError;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyType;

/// A core error on its way to Python. `?` converts `CoreError` into it, and pyo3 turns it into
/// the matching `ferrollm.exceptions` class.
pub struct PyCoreError(pub CoreError);

pub type PyCoreResult<T> = Result<T, PyCoreError>;

impl From<CoreError> for PyCoreError {
    fn from(e: CoreError) -> Self {
        Self(e)
    }
}

fn class_name(e: &CoreError) -> &'static str {
    match e {
        CoreError::InvalidParameter { .. } => "InvalidRequestError",
        CoreError::PromptTooLong { .. } => "PromptTooLongError",
        CoreError::DuplicateRequestId(_) => "DuplicateRequestError",
        CoreError::InvalidConfig { .. } => "ConfigError",
        CoreError::KvCacheTooSmall { .. } => "KVCacheTooSmallError",
        CoreError::Tokenizer(_) => "TokenizerError",
        CoreError::StepMismatch { .. } => "StepMismatchError",
        CoreError::Runner(_) => "EngineError",
        CoreError::StepChannel(_) => "StepChannelError",
        CoreError::EngineClosed => "EngineClosedError",
    }
}

impl From<PyCoreError> for PyErr {
    fn from(e: PyCoreError) -> PyErr {
        raise(class_name(&e.0), e.0.to_string())
    }
}

/// A CPU kernel's refusal, as `ferrollm.exceptions.KernelError`.
pub fn kernel_error(e: KernelError) -> PyErr {
    raise("KernelError", e.to_string())
}

/// `ferrollm.exceptions.<class>(msg)`, or a `RuntimeError` if that module cannot be imported.
pub fn raise(class: &str, msg: String) -> PyErr {
    Python::attach(|py| {
        let cls = py
            .import("ferrollm.exceptions")
            .and_then(|m| m.getattr(class))
            .and_then(|c| c.cast_into::<PyType>().map_err(PyErr::from));
        match cls {
            Ok(cls) => PyErr::from_type(cls, msg),
            Err(_) => PyRuntimeError::new_err(msg),
        }
    })
}
