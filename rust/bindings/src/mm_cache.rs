//! `MultiModalCache`: the Python face of `ferrollm_core::mm_cache::MultiModalCache`, the
//! byte-bounded LRU of processed multimodal items. Python stores each item's tensors as bytes
//! plus a metadata string; the copies in and out happen with the GIL released.

use std::sync::{Mutex, MutexGuard};

use ferrollm_core::mm_cache::MultiModalCache;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

#[pyclass(name = "MultiModalCache", module = "ferrollm._core", frozen)]
pub struct PyMultiModalCache {
    inner: Mutex<MultiModalCache>,
}

impl PyMultiModalCache {
    fn lock(&self) -> MutexGuard<'_, MultiModalCache> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl PyMultiModalCache {
    #[new]
    fn new(capacity_bytes: usize) -> Self {
        Self { inner: Mutex::new(MultiModalCache::new(capacity_bytes)) }
    }

    /// The byte bound (0: the cache stores nothing).
    #[getter]
    fn capacity_bytes(&self) -> usize {
        self.lock().capacity()
    }

    /// The (buffer, metadata) stored under `key`, or None; counts a hit or a miss.
    fn get<'py>(&self, py: Python<'py>, key: &str) -> Option<(Bound<'py, PyBytes>, String)> {
        let found = py.detach(|| self.lock().get(key).map(|(d, m)| (d.to_vec(), m.to_string())));
        found.map(|(data, meta)| (PyBytes::new(py, &data), meta))
    }

    /// Whether `key` is stored (no counting, recency unchanged).
    fn contains(&self, key: &str) -> bool {
        self.lock().contains(key)
    }

    /// Stores a buffer and its metadata under `key`, evicting the least recently used items to
    /// make room; returns False when the item alone exceeds the capacity.
    fn put(&self, py: Python<'_>, key: String, data: &[u8], metadata: String) -> bool {
        let data = data.to_vec();
        py.detach(|| self.lock().put(key, data, metadata))
    }

    /// Drops every item (the counters stay).
    fn clear(&self) {
        self.lock().clear();
    }

    /// num_hits, num_misses, num_evictions, num_entries, num_bytes and capacity_bytes.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let cache = self.lock();
        let s = cache.stats();
        let d = PyDict::new(py);
        d.set_item("num_hits", s.num_hits)?;
        d.set_item("num_misses", s.num_misses)?;
        d.set_item("num_evictions", s.num_evictions)?;
        d.set_item("num_entries", s.num_entries)?;
        d.set_item("num_bytes", s.num_bytes)?;
        d.set_item("capacity_bytes", cache.capacity())?;
        Ok(d)
    }
}
