//! Reads: a load's blocks grouped into runs of adjacent slots of one segment, each run one ranged
//! GET (docs/object-tier.md, "Index and reads"). Every block is still verified alone
//! (`BucketTier::finish_started`): a bad block in a run is a miss, the others are served.

use super::BucketTier;
use crate::io::device::OnDone;
use crate::stats::Stats;
use futures_util::StreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{GetOptions, GetRange, ObjectStore};
use std::io;
use std::sync::Arc;
use std::time::Duration;

/// Where one block of a run lands: its DRAM slot's address, and whom to tell when it is there.
pub(super) struct Landing {
    pub(super) addr: usize,
    pub(super) on_done: OnDone,
}

/// Adjacent slots of one segment, read with one ranged GET from `start`.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Run<T> {
    pub(super) stem: Arc<str>,
    pub(super) start: u64,
    pub(super) blocks: Vec<T>,
}

/// Groups blocks, given as (segment, offset of the slot, payload) in any order, into runs of
/// adjacent slots of one segment, `max_blocks` at most per run.
pub(super) fn plan_runs<T>(mut blocks: Vec<(Arc<str>, u64, T)>, slot_bytes: u64, max_blocks: usize) -> Vec<Run<T>> {
    assert!(max_blocks >= 1 && slot_bytes > 0, "a run holds at least one slot");
    blocks.sort_by(|a, b| (&*a.0, a.1).cmp(&(&*b.0, b.1)));
    let mut runs: Vec<Run<T>> = Vec::new();
    for (stem, offset, payload) in blocks {
        if let Some(run) = runs.last_mut() {
            let next = run.start + run.blocks.len() as u64 * slot_bytes;
            if run.stem == stem && offset == next && run.blocks.len() < max_blocks {
                run.blocks.push(payload);
                continue;
            }
        }
        runs.push(Run { stem, start: offset, blocks: vec![payload] });
    }
    runs
}

impl BucketTier {
    /// Reads `run` on the tier's runtime (one of `bucket_reads_in_flight` permits), then calls each
    /// block's `on_done` with its result, within `MAX_GET_TIMEOUTS` request timeouts in all.
    pub(super) fn spawn_run(&self, run: Run<Landing>) {
        let get = RangedGet {
            store: Arc::clone(&self.read_store),
            path: self.segment_path(&run.stem),
            slot_bytes: self.slot_bytes,
            stats: Arc::clone(&self.stats),
            idle: self.timeout(),
        };
        let (permits, timeout) = (Arc::clone(&self.read_permits), self.bounded(self.timeout() * MAX_GET_TIMEOUTS));
        self.rt.spawn(async move {
            let addrs: Vec<usize> = run.blocks.iter().map(|landing| landing.addr).collect();
            // On timeout the future is dropped: nothing writes into a slot after its on_done.
            let got = tokio::time::timeout(timeout, async {
                let _permit = permits.acquire_owned().await.map_err(io::Error::other)?;
                Ok::<_, io::Error>(get.run(run.start, &addrs).await)
            })
            .await;
            let results = match got {
                Ok(Ok(results)) => results,
                Ok(Err(e)) => addrs.iter().map(|_| Err(same_error(&e))).collect(),
                Err(_) => {
                    Stats::add(&get.stats.bucket_request_errors, 1);
                    addrs.iter().map(|_| Err(io::Error::new(io::ErrorKind::TimedOut, "ranged GET timed out"))).collect()
                }
            };
            debug_assert_eq!(results.len(), run.blocks.len(), "one result per block");
            for (landing, result) in run.blocks.into_iter().zip(results) {
                (landing.on_done)(result);
            }
        });
    }
}

/// A run's GETs, its retries block by block included, end within this many request timeouts
/// (`bucket_request_timeout_ms`), however steadily their bytes arrive: a trickle is not waited for.
const MAX_GET_TIMEOUTS: u32 = 6;

/// Ranged GETs of one segment object into DRAM slots.
struct RangedGet {
    store: Arc<dyn ObjectStore>,
    path: ObjectPath,
    slot_bytes: usize,
    stats: Arc<Stats>,
    /// The longest wait for the response, and then for each next chunk of its body.
    idle: Duration,
}

impl RangedGet {
    /// Reads the adjacent slots from `start` into `addrs` with one GET. When that fails other than
    /// with a 404 (a truncated segment answers a range past its end with an error), each slot is
    /// read with a GET of its own, so that the whole ones are still served.
    async fn run(&self, start: u64, addrs: &[usize]) -> Vec<io::Result<()>> {
        match self.get(start, addrs).await {
            Ok(()) => addrs.iter().map(|_| Ok(())).collect(),
            // A server that went quiet would keep the retries waiting as long, one by one.
            Err(e) if addrs.len() == 1 || matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::TimedOut) => {
                addrs.iter().map(|_| Err(same_error(&e))).collect()
            }
            Err(_) => {
                let mut results = Vec::with_capacity(addrs.len());
                for (i, addr) in addrs.iter().enumerate() {
                    results.push(self.get(start + (i * self.slot_bytes) as u64, std::slice::from_ref(addr)).await);
                }
                results
            }
        }
    }

    /// One ranged GET of `addrs.len()` slots from `start`, copied into them; counted, and a failure
    /// other than a 404 counted as a request error.
    async fn get(&self, start: u64, addrs: &[usize]) -> io::Result<()> {
        Stats::add(&self.stats.bucket_get_requests, 1);
        self.receive(start, addrs).await.inspect_err(|e| {
            if e.kind() != io::ErrorKind::NotFound {
                Stats::add(&self.stats.bucket_request_errors, 1);
            }
        })
    }

    /// Lands the body in the slots as it arrives, counting it in `bucket_bytes_received`: on a slow
    /// link a run of 8 MiB takes seconds, and a load waiting on it is told from a stalled one by
    /// these bytes (a worker's watchdog asks for them), not by whole blocks.
    async fn receive(&self, start: u64, addrs: &[usize]) -> io::Result<()> {
        let run_bytes = self.slot_bytes * addrs.len();
        let wanted = start..start + run_bytes as u64;
        let options = GetOptions { range: Some(GetRange::Bounded(wanted.clone())), ..GetOptions::default() };
        let got = self.within_idle(self.store.get_opts(&self.path, options)).await?.map_err(io::Error::from)?;
        if got.range != wanted {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "short ranged GET"));
        }
        let (mut body, mut landed) = (got.into_stream(), 0);
        while let Some(chunk) = self.within_idle(body.next()).await? {
            let chunk = chunk.map_err(io::Error::from)?;
            if landed + chunk.len() > run_bytes {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "ranged GET longer than its range"));
            }
            self.land(landed, &chunk, addrs);
            landed += chunk.len();
            Stats::add(&self.stats.bucket_bytes_received, chunk.len() as u64);
        }
        if landed != run_bytes {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "short ranged GET"));
        }
        Ok(())
    }

    /// `step`'s outcome, or a timeout once it waited `idle`: a server that stopped answering.
    async fn within_idle<T>(&self, step: impl std::future::Future<Output = T>) -> io::Result<T> {
        tokio::time::timeout(self.idle, step)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "ranged GET: no bytes for bucket_request_timeout_ms"))
    }

    /// Copies `chunk`, the body's bytes from offset `at`, into the slots it spans.
    fn land(&self, mut at: usize, mut chunk: &[u8], addrs: &[usize]) {
        while !chunk.is_empty() {
            let (slot, within) = (at / self.slot_bytes, at % self.slot_bytes);
            let n = chunk.len().min(self.slot_bytes - within);
            // SAFETY: each slot is the reader's until its on_done, which runs after the GET returns
            // (`BucketTier::start_reads`' contract); the slots of a run are distinct, and `receive`
            // keeps `at + n` within the run's slots.
            unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), (addrs[slot] as *mut u8).add(within), n) };
            (chunk, at) = (&chunk[n..], at + n);
        }
    }
}

/// `io::Error` is not `Clone`: the same kind and message for each block of a failed run.
fn same_error(e: &io::Error) -> io::Error {
    io::Error::new(e.kind(), e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(list: &[(&str, u64)]) -> Vec<(Arc<str>, u64, u64)> {
        list.iter().map(|&(stem, offset)| (Arc::from(stem), offset, offset)).collect()
    }

    fn shape(runs: &[Run<u64>]) -> Vec<(&str, u64, usize)> {
        runs.iter().map(|r| (&*r.stem, r.start, r.blocks.len())).collect()
    }

    #[test]
    fn adjacent_slots_of_one_segment_make_one_run() {
        let runs = plan_runs(blocks(&[("a", 4096 + 20), ("a", 4096), ("a", 4096 + 10)]), 10, 8);
        assert_eq!(shape(&runs), [("a", 4096, 3)]);
        assert_eq!(runs[0].blocks, [4096, 4106, 4116], "in slot order, whatever the load's order");
    }

    #[test]
    fn runs_break_at_gaps_segments_and_the_bound() {
        let list = [("a", 4096), ("a", 4106), ("a", 4126), ("b", 4136), ("b", 4146), ("b", 4156), ("b", 4166)];
        let runs = plan_runs(blocks(&list), 10, 3);
        assert_eq!(shape(&runs), [("a", 4096, 2), ("a", 4126, 1), ("b", 4136, 3), ("b", 4166, 1)]);
        let singles = plan_runs(blocks(&list), 10, 1);
        assert_eq!(singles.len(), list.len(), "a bound of one block: one GET per block");
        let repeated = plan_runs(blocks(&[("a", 4096), ("a", 4096)]), 10, 8);
        assert_eq!(shape(&repeated), [("a", 4096, 1), ("a", 4096, 1)], "the same slot twice is two reads");
        assert!(plan_runs(Vec::<(Arc<str>, u64, u64)>::new(), 10, 4).is_empty());
    }
}
