//! Where one rank's slice of a block lies inside the block object in the pool.
//!
//! By default a rank's slice is one contiguous range, rank after rank. An engine whose KV cache
//! has a rank-independent ("canonical") form places each piece of its slice where that form puts it
//! instead: for vLLM's CPU layout, rank `r` of `tp` owns heads `r/tp..(r+1)/tp` of every layer's
//! page. The object is then the same bytes at every TP size, and engines of different TP sizes
//! share blocks. The service never looks inside objects; only the ranks' copies use this.

use crate::error::{Error, Result};

/// `len` bytes at `slice_offset` in the rank's slice (the concatenation of its buffer segments) lie
/// at `object_offset` in the block object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlacementRun {
    pub slice_offset: usize,
    pub object_offset: usize,
    pub len: usize,
}

/// A rank's slice as runs that tile it in order and land on disjoint ranges of the object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    runs: Vec<PlacementRun>,
}

impl Placement {
    /// The default: the slice is one range, at `rank * slice_bytes`.
    pub fn contiguous(rank: u32, slice_bytes: usize) -> Placement {
        Placement {
            runs: vec![PlacementRun { slice_offset: 0, object_offset: rank as usize * slice_bytes, len: slice_bytes }],
        }
    }

    /// Checks that `runs` tile `[0, slice_bytes)` in order, stay inside the object and never land
    /// on one object byte twice; merges runs that continue each other.
    pub fn new(runs: Vec<PlacementRun>, slice_bytes: usize, object_bytes: usize) -> Result<Placement> {
        let bad = |what: String| Err(Error::config("placement", what));
        let mut expected = 0usize;
        for run in &runs {
            if run.len == 0 || run.slice_offset != expected {
                return bad(format!(
                    "runs must tile the slice in order without gaps or empty runs: a run starts at {} (expected {expected})",
                    run.slice_offset
                ));
            }
            if run.object_offset.checked_add(run.len).is_none_or(|end| end > object_bytes) {
                return bad(format!(
                    "a run of {} bytes at object offset {} ends past the {object_bytes}-byte object",
                    run.len, run.object_offset
                ));
            }
            expected += run.len;
        }
        if expected != slice_bytes {
            return bad(format!("runs cover {expected} bytes, the slice is {slice_bytes}"));
        }
        let mut by_object: Vec<(usize, usize)> = runs.iter().map(|r| (r.object_offset, r.len)).collect();
        by_object.sort_unstable();
        if by_object.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0) {
            return bad("two runs land on the same object bytes".to_string());
        }
        let mut merged: Vec<PlacementRun> = Vec::with_capacity(runs.len());
        for run in runs {
            match merged.last_mut() {
                Some(last) if last.object_offset + last.len == run.object_offset => last.len += run.len,
                _ => merged.push(run),
            }
        }
        Ok(Placement { runs: merged })
    }

    pub fn runs(&self) -> &[PlacementRun] {
        &self.runs
    }

    /// Copies between the rank's buffer `segments` and the object at `object`: into the object
    /// (`to_object`) or out of it.
    ///
    /// # Safety
    /// The segments tile the slice (checked by the caller: their total is the slice size), are
    /// valid for the direction's access, and `object` is valid for the whole object.
    pub unsafe fn copy(&self, object: *mut u8, segments: &[(*mut u8, usize)], to_object: bool) {
        let mut segs = segments.iter().copied().filter(|&(_, len)| len > 0);
        let mut seg = segs.next();
        let mut seg_pos = 0usize;
        for run in &self.runs {
            let mut run_pos = 0usize;
            while run_pos < run.len {
                let Some((seg_ptr, seg_len)) = seg else { return };
                let n = (run.len - run_pos).min(seg_len - seg_pos);
                let local = seg_ptr.add(seg_pos);
                let remote = object.add(run.object_offset + run_pos);
                if to_object {
                    std::ptr::copy_nonoverlapping(local, remote, n);
                } else {
                    std::ptr::copy_nonoverlapping(remote, local, n);
                }
                run_pos += n;
                seg_pos += n;
                if seg_pos == seg_len {
                    seg = segs.next();
                    seg_pos = 0;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(slice_offset: usize, object_offset: usize, len: usize) -> PlacementRun {
        PlacementRun { slice_offset, object_offset, len }
    }

    #[test]
    fn bad_runs_are_refused_with_the_reason() {
        let err = |runs: Vec<PlacementRun>| Placement::new(runs, 8, 16).unwrap_err().to_string();
        assert!(err(vec![run(0, 0, 4)]).contains("cover 4 bytes"));
        assert!(err(vec![run(0, 0, 4), run(2, 4, 4)]).contains("in order"));
        assert!(err(vec![run(0, 14, 8)]).contains("past the 16-byte object"));
        assert!(err(vec![run(0, 0, 4), run(4, 2, 4)]).contains("same object bytes"));
    }

    /// Two ranks of a two-layer block whose canonical page holds rank 0's part, then rank 1's:
    /// each rank's two segments (its page of each layer) land interleaved, and read back whole.
    #[test]
    fn interleaved_ranks_fill_the_object_and_read_back() {
        let (page, layers, tp) = (3usize, 2usize, 2usize);
        let object_bytes = page * layers * tp;
        let mut object = vec![0u8; object_bytes];
        let mut ranks: Vec<Vec<Vec<u8>>> =
            (0..tp).map(|r| (0..layers).map(|l| vec![(10 * r + l + 1) as u8; page]).collect()).collect();
        for (r, layers_of_rank) in ranks.iter_mut().enumerate() {
            let runs = (0..layers).map(|l| run(l * page, l * page * tp + r * page, page)).collect();
            let placement = Placement::new(runs, page * layers, object_bytes).unwrap();
            let segments: Vec<(*mut u8, usize)> =
                layers_of_rank.iter_mut().map(|s| (s.as_mut_ptr(), s.len())).collect();
            unsafe { placement.copy(object.as_mut_ptr(), &segments, true) };
        }
        assert_eq!(object, vec![1, 1, 1, 11, 11, 11, 2, 2, 2, 12, 12, 12]);
        // A TP=1 reader sees the whole object as its slice; one run, one segment of another split.
        let whole = Placement::new(vec![run(0, 0, object_bytes)], object_bytes, object_bytes).unwrap();
        let mut a = vec![0u8; 5];
        let mut b = vec![0u8; object_bytes - 5];
        unsafe { whole.copy(object.as_mut_ptr(), &[(a.as_mut_ptr(), 5), (b.as_mut_ptr(), object_bytes - 5)], false) };
        assert_eq!([a, b].concat(), object);
    }

    #[test]
    fn continuing_runs_merge() {
        let p = Placement::new(vec![run(0, 4, 2), run(2, 6, 2)], 4, 8).unwrap();
        assert_eq!(p.runs(), &[run(0, 4, 4)]);
        assert_eq!(Placement::contiguous(1, 4).runs(), &[run(0, 4, 4)]);
    }
}
