//! Page-aligned heap buffers for O_DIRECT I/O outside the DRAM arena (superblocks, trailers, scans).

use std::alloc::{alloc_zeroed, dealloc, Layout};

use crate::format::{round_up, ALIGN_BYTES};

pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes rounded up to 4096, aligned to 4096.
    pub fn zeroed(len: usize) -> Self {
        let len = round_up(len.max(1), ALIGN_BYTES);
        let layout = Layout::from_size_align(len, ALIGN_BYTES).expect("aligned layout");
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        debug_assert!((ptr as usize).is_multiple_of(ALIGN_BYTES), "an O_DIRECT buffer off its alignment");
        assert!(len.is_multiple_of(ALIGN_BYTES) && len > 0);
        AlignedBuf { ptr, len }
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    #[cfg(any(test, feature = "testing"))]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes for the life of self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, ALIGN_BYTES).unwrap();
        // SAFETY: allocated with this layout in `zeroed`.
        unsafe { dealloc(self.ptr, layout) }
    }
}
