use thiserror::Error;

/// A kernel refused its arguments; nothing was written.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum KernelError {
    /// A buffer's length does not match the shape it was described with.
    #[error("`{name}` has {actual} elements, the shape needs {expected}")]
    Size { name: &'static str, expected: usize, actual: usize },
    /// A shape value is out of range.
    #[error("`{name}` must be {limit}. Given: {value}")]
    Value { name: &'static str, limit: String, value: i64 },
    /// A setting is out of range (one that is not an integer, such as a scale).
    #[error("`{name}` must be {limit}. Given: {value}")]
    Param { name: &'static str, limit: String, value: String },
    /// The OpenMP runtime could not be attached.
    #[error("cannot use the OpenMP runtime at {path:?}: {reason}")]
    OpenMp { path: String, reason: String },
}

pub(crate) fn check_len(name: &'static str, actual: usize, expected: usize) -> Result<(), KernelError> {
    if actual == expected {
        Ok(())
    } else {
        Err(KernelError::Size { name, expected, actual })
    }
}
