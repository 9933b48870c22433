//! CONTRACT STUB — to be implemented.

/// A stop string found in the text: byte offset where it starts, and which one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopMatch { pub start: usize, pub stop_index: usize }

/// Searches the tail of `text` that the last `new_len` bytes could complete; the stop that
/// completes earliest wins.
pub fn find_stop_string(_text: &str, _new_len: usize, _stops: &[String]) -> Option<StopMatch> { todo!() }

/// Bytes a streaming output must hold back so that no partial stop string is ever emitted.
pub fn hold_back_len(_stops: &[String]) -> usize { todo!() }
