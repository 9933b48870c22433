//! Tensors cross the boundary as `(address, element count)` pairs (the Python wrappers pass
//! `data_ptr()` and `numel()` of contiguous CPU tensors they keep alive for the call); these
//! turn them back into slices.

/// A tensor's memory: its first element's address and element count.
pub(crate) type Buffer = (usize, usize);

/// # Safety
/// `buf` must address `buf.1` initialised, live elements of `T` that nothing writes during the call.
pub(crate) unsafe fn view<'a, T>(buf: Buffer) -> &'a [T] {
    if buf.1 == 0 {
        return &[];
    }
    std::slice::from_raw_parts(buf.0 as *const T, buf.1)
}

/// # Safety
/// As [`view`], and nothing else reads or writes the elements during the call.
pub(crate) unsafe fn view_mut<'a, T>(buf: Buffer) -> &'a mut [T] {
    if buf.1 == 0 {
        return &mut [];
    }
    std::slice::from_raw_parts_mut(buf.0 as *mut T, buf.1)
}
