//! The store's publisher: accepted blocks are copied (descriptor page + value, as their DRAM slot
//! holds them) into staging buffers and handed to one background thread that appends them to the
//! shared tier's open data file in batches. The put path never waits for the shared filesystem: when
//! every staging buffer is in use (`publish_queue_bytes`), the block is not published and counted in
//! `shared_dropped_publishes` (it is a cache).

use super::SharedTier;
use crate::error::{Error, Result};
use crate::io::buffer::AlignedBuf;
use crate::key::BlockKey;
use crate::stats::Stats;
use crossbeam_channel::{bounded, Sender, TrySendError};
use parking_lot::Mutex;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Slots appended per batch (one pwritev each).
const BATCH_BLOCKS: usize = 32;

enum Msg {
    Block(BlockKey, AlignedBuf),
    Flush(Sender<()>),
}

struct Pool {
    free: Vec<AlignedBuf>,
    allocated: usize,
}

pub struct Publisher {
    tier: Arc<SharedTier>,
    tx: Mutex<Option<Sender<Msg>>>,
    pool: Arc<Mutex<Pool>>,
    max_buffers: usize,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Publisher {
    pub fn start(tier: Arc<SharedTier>) -> Result<Publisher> {
        let max_buffers = (tier.config().publish_queue_bytes / tier.slot_bytes()).max(1);
        let (tx, rx) = bounded::<Msg>(max_buffers + 4);
        let pool = Arc::new(Mutex::new(Pool { free: Vec::new(), allocated: 0 }));
        let thread_tier = Arc::clone(&tier);
        let thread_pool = Arc::clone(&pool);
        let handle = std::thread::Builder::new()
            .name("kvtier-publish".into())
            .spawn(move || {
                let mut flushes = Vec::new();
                while let Ok(first) = rx.recv() {
                    let mut batch: Vec<(BlockKey, AlignedBuf)> = Vec::new();
                    let mut msg = Some(first);
                    while let Some(m) = msg.take() {
                        match m {
                            Msg::Block(k, b) => batch.push((k, b)),
                            Msg::Flush(reply) => flushes.push(reply),
                        }
                        if batch.len() < BATCH_BLOCKS && flushes.is_empty() {
                            msg = rx.try_recv().ok();
                        }
                    }
                    if !batch.is_empty() {
                        let mut refs: Vec<(BlockKey, &mut [u8])> =
                            batch.iter_mut().map(|(k, b)| (*k, b.as_mut_slice())).collect();
                        thread_tier.append_slots(&mut refs);
                        thread_pool.lock().free.extend(batch.into_iter().map(|(_, b)| b));
                    }
                    if !flushes.is_empty() {
                        thread_tier.flush();
                        for reply in flushes.drain(..) {
                            let _ = reply.send(());
                        }
                    }
                }
                thread_tier.flush();
            })
            .map_err(|e| Error::io("spawning the shared publisher thread", e))?;
        Ok(Publisher { tier, tx: Mutex::new(Some(tx)), pool, max_buffers, thread: Mutex::new(Some(handle)) })
    }

    /// Queues a copy of `slot` (descriptor page + value) for publishing. `false`: dropped (queue full
    /// or closed) and counted; a block already in the shared index is not queued again (`true`).
    pub fn offer(&self, key: BlockKey, slot: &[u8]) -> bool {
        if self.tier.contains(&key) {
            return true;
        }
        let slot_bytes = self.tier.slot_bytes();
        // Never waits: the put path serves DRAM and NVMe, and a slow shared filesystem must not stall
        // it. Past `publish_queue_bytes` the block is not published (it is a cache) and counted.
        let buf = {
            let mut pool = self.pool.lock();
            match pool.free.pop() {
                Some(b) => Some(b),
                None if pool.allocated < self.max_buffers => {
                    pool.allocated += 1;
                    None
                }
                None => {
                    drop(pool);
                    Stats::add(&self.tier.stats().shared_dropped_publishes, 1);
                    return false;
                }
            }
        };
        let mut buf = buf.unwrap_or_else(|| AlignedBuf::zeroed(slot_bytes));
        buf.as_mut_slice()[..slot_bytes].copy_from_slice(&slot[..slot_bytes]);
        let tx = self.tx.lock();
        let Some(tx) = tx.as_ref() else {
            Stats::add(&self.tier.stats().shared_dropped_publishes, 1);
            return false;
        };
        match tx.try_send(Msg::Block(key, buf)) {
            Ok(()) => true,
            Err(TrySendError::Full(Msg::Block(_, b))) | Err(TrySendError::Disconnected(Msg::Block(_, b))) => {
                self.pool.lock().free.push(b);
                Stats::add(&self.tier.stats().shared_dropped_publishes, 1);
                false
            }
            Err(_) => false,
        }
    }

    /// Waits until every queued block is written and the open file is published.
    pub fn flush(&self, timeout: Duration) -> Result<()> {
        let (reply_tx, reply_rx) = bounded(1);
        {
            let tx = self.tx.lock();
            let Some(tx) = tx.as_ref() else { return Ok(()) };
            tx.send_timeout(Msg::Flush(reply_tx), timeout).map_err(|_| Error::Timeout {
                what: "the shared publisher queue".into(),
                timeout_ms: timeout.as_millis() as u64,
            })?;
        }
        reply_rx.recv_timeout(timeout).map_err(|_| Error::Timeout {
            what: "publishing to the shared tier".into(),
            timeout_ms: timeout.as_millis() as u64,
        })
    }

    /// Publishes what is queued, stops the thread and closes the tier. Idempotent.
    pub fn close(&self) {
        self.tx.lock().take();
        if let Some(h) = self.thread.lock().take() {
            let _ = h.join();
        }
        self.tier.close();
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.close();
    }
}
