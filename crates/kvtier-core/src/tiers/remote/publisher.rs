//! A remote tier's publisher: accepted blocks are copied (descriptor page + value, as their DRAM
//! slot holds them) into staging buffers and handed to one background thread that appends them to
//! the tier's open file or segment in batches (the tier's [`PublishSink`]).
//!
//! The put path never waits for remote storage. When every staging buffer is in use
//! (`publish_queue_bytes`), the block's key joins a backlog instead, and the publisher copies the
//! block again from its DRAM slot when a buffer is free (the store hands it that copy function,
//! `set_refetch`). A burst larger than the queue is therefore published whole, late rather than never,
//! as long as its blocks are still in DRAM when their turn comes. A block that left DRAM first, or an
//! offer past the backlog's bound, is not published (it is a cache) and counted in the tier's
//! dropped publishes (`PublishSink::dropped`). A flush waits for what was backlogged before it, not for later offers.

use crate::error::{Error, Result};
use crate::io::buffer::AlignedBuf;
use crate::key::BlockKey;
use crate::stats::Stats;
use crossbeam_channel::{bounded, Receiver, Sender, TryRecvError, TrySendError};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

/// Slots appended per batch (one pwritev each).
const BATCH_BLOCKS: usize = 32;

/// Keys waiting for a staging buffer. A key costs 32 bytes, so the bound (2 MiB of keys) only stops
/// a publisher that is hopelessly behind from growing without limit.
const BACKLOG_BLOCKS: usize = 1 << 16;

/// Copies a block's slot (descriptor page + value) into the buffer; `false` when the block is no
/// longer in DRAM.
pub type Refetch = Box<dyn Fn(&BlockKey, &mut [u8]) -> bool + Send + Sync>;

/// Told how many offered blocks were not written after all (dropped, found published already, or
/// refused by the tier), so that the tier's write budget, which paid for them at the offer, gets
/// their bytes back.
pub type Unwritten = Box<dyn Fn(usize) + Send + Sync>;

/// What a publisher publishes into: each remote tier implements it in its own folder, with its own
/// counters of deferred and dropped offers.
pub trait PublishSink: Send + Sync {
    fn slot_bytes(&self) -> usize;
    fn publish_queue_bytes(&self) -> usize;
    fn contains(&self, key: &BlockKey) -> bool;
    /// Appends whole slots; returns how many were taken.
    fn append_slots(&self, slots: &mut [(BlockKey, &mut [u8])]) -> usize;
    /// Publishes what was appended.
    fn flush(&self);
    /// The store starts closing: what the publisher's last flush and `close` still send must end
    /// by a deadline the sink sets (a bucket's requests; a filesystem's writes are not bounded here).
    fn closing(&self) {}
    fn close(&self);
    fn deferred(&self) -> &AtomicU64;
    fn dropped(&self) -> &AtomicU64;
}

enum Msg {
    Block(BlockKey, AlignedBuf),
    Flush(Sender<()>),
}

struct Pool {
    free: Vec<AlignedBuf>,
    allocated: usize,
    /// Blocks offered while no buffer was free, oldest first. While it is not empty new offers join
    /// it too, so that blocks are published in the order they were stored (a prompt's first blocks
    /// are the ones that make a prefix hit).
    backlog: VecDeque<BlockKey>,
    /// Keys ever pushed to and popped from the backlog: a flush waits until `popped` reaches what
    /// `pushed` was when the publisher took the flush request.
    pushed: u64,
    popped: u64,
}

/// A staging buffer to fill: one from the pool, or room to allocate one (outside the lock).
enum Staging {
    Reused(AlignedBuf),
    New,
}

impl Pool {
    fn staging(&mut self, max_buffers: usize) -> Option<Staging> {
        if let Some(b) = self.free.pop() {
            return Some(Staging::Reused(b));
        }
        if self.allocated < max_buffers {
            self.allocated += 1;
            return Some(Staging::New);
        }
        None
    }
}

/// What the caller and the publisher thread share.
struct Inner {
    tier: Arc<dyn PublishSink>,
    pool: Mutex<Pool>,
    max_buffers: usize,
    refetch: OnceLock<Refetch>,
    unwritten: OnceLock<Unwritten>,
}

impl Inner {
    fn buffer(&self, staging: Staging) -> AlignedBuf {
        match staging {
            Staging::Reused(b) => b,
            Staging::New => AlignedBuf::zeroed(self.tier.slot_bytes()),
        }
    }

    fn dropped(&self, blocks: u64) {
        Stats::add(self.tier.dropped(), blocks);
        self.not_written(blocks as usize);
    }

    /// `blocks` offered blocks will not be written (`Unwritten`).
    fn not_written(&self, blocks: usize) {
        if let (Some(unwritten), true) = (self.unwritten.get(), blocks > 0) {
            unwritten(blocks);
        }
    }

    /// Up to `room` backlogged blocks, copied again from DRAM into staging buffers.
    fn take_backlogged(&self, room: usize) -> Vec<(BlockKey, AlignedBuf)> {
        let mut taken = Vec::new();
        {
            let mut pool = self.pool.lock();
            while taken.len() < room && !pool.backlog.is_empty() {
                let Some(staging) = pool.staging(self.max_buffers) else { break };
                let key = pool.backlog.pop_front().expect("checked non-empty");
                pool.popped += 1;
                taken.push((key, staging));
            }
        }
        let mut ready = Vec::with_capacity(taken.len());
        for (key, staging) in taken {
            let mut buf = self.buffer(staging);
            if self.tier.contains(&key) {
                self.pool.lock().free.push(buf);
                self.not_written(1);
                continue;
            }
            let copied = self.refetch.get().is_some_and(|copy| copy(&key, buf.as_mut_slice()));
            if copied {
                ready.push((key, buf));
            } else {
                self.pool.lock().free.push(buf);
                self.dropped(1);
            }
        }
        ready
    }

    fn backlog_empty(&self) -> bool {
        self.pool.lock().backlog.is_empty()
    }

    /// Appends a batch to the open data file and gives its buffers back.
    fn append(&self, mut batch: Vec<(BlockKey, AlignedBuf)>) {
        if batch.is_empty() {
            return;
        }
        let mut refs: Vec<(BlockKey, &mut [u8])> = batch.iter_mut().map(|(k, b)| (*k, b.as_mut_slice())).collect();
        let taken = self.tier.append_slots(&mut refs);
        self.not_written(refs.len().saturating_sub(taken));
        self.pool.lock().free.extend(batch.into_iter().map(|(_, b)| b));
    }

    /// Answers the flush requests whose backlogged keys have all been taken (published, or dropped
    /// because they left DRAM), once the open file is published.
    fn answer_flushes(&self, flushes: &mut Vec<(Sender<()>, u64)>) {
        let popped = self.pool.lock().popped;
        if !flushes.iter().any(|&(_, target)| target <= popped) {
            return;
        }
        self.tier.flush();
        flushes.retain(|(reply, target)| {
            let done = *target <= popped;
            if done {
                let _ = reply.send(());
            }
            !done
        });
    }

    /// The publisher thread: queued blocks first (they are older than the backlog), topped up from the
    /// backlog. It only blocks for a message while the backlog is empty, so that a flush waiting for
    /// the backlog never waits on buffers queued behind it.
    fn run(&self, rx: Receiver<Msg>) {
        let mut flushes: Vec<(Sender<()>, u64)> = Vec::new();
        let mut open = true;
        while open || !self.backlog_empty() {
            let mut batch: Vec<(BlockKey, AlignedBuf)> = Vec::new();
            // Block for the next message only while the backlog has nothing to do.
            let mut msg = if !open {
                None
            } else if self.backlog_empty() {
                rx.recv().ok().or_else(|| {
                    open = false;
                    None
                })
            } else {
                match rx.try_recv() {
                    Ok(m) => Some(m),
                    Err(TryRecvError::Empty) => None,
                    Err(TryRecvError::Disconnected) => {
                        open = false;
                        None
                    }
                }
            };
            while let Some(m) = msg.take() {
                match m {
                    Msg::Block(k, b) => batch.push((k, b)),
                    Msg::Flush(reply) => flushes.push((reply, self.pool.lock().pushed)),
                }
                if batch.len() < BATCH_BLOCKS {
                    msg = rx.try_recv().ok();
                }
            }
            if batch.len() < BATCH_BLOCKS {
                let room = BATCH_BLOCKS - batch.len();
                batch.extend(self.take_backlogged(room));
            }
            self.append(batch);
            if !flushes.is_empty() {
                self.answer_flushes(&mut flushes);
            }
        }
        self.tier.flush();
        for (reply, _) in flushes {
            let _ = reply.send(());
        }
    }
}

pub struct Publisher {
    inner: Arc<Inner>,
    tx: Mutex<Option<Sender<Msg>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Publisher {
    pub fn start(tier: Arc<dyn PublishSink>) -> Result<Publisher> {
        let max_buffers = (tier.publish_queue_bytes() / tier.slot_bytes()).max(1);
        let (tx, rx) = bounded::<Msg>(max_buffers + 4);
        let inner = Arc::new(Inner {
            tier,
            pool: Mutex::new(Pool { free: Vec::new(), allocated: 0, backlog: VecDeque::new(), pushed: 0, popped: 0 }),
            max_buffers,
            refetch: OnceLock::new(),
            unwritten: OnceLock::new(),
        });
        let thread_inner = Arc::clone(&inner);
        let handle = std::thread::Builder::new()
            .name("kvtier-publish".into())
            .spawn(move || thread_inner.run(rx))
            .map_err(|e| Error::io("spawning the shared publisher thread", e))?;
        Ok(Publisher { inner, tx: Mutex::new(Some(tx)), thread: Mutex::new(Some(handle)) })
    }

    /// Gives the publisher its way to copy a backlogged block out of DRAM. Without one (until the
    /// store sets it), backlogged blocks are dropped and counted.
    pub fn set_refetch(&self, refetch: Refetch) {
        if self.inner.refetch.set(refetch).is_err() {
            log::warn!("kvtier: the shared publisher's refetch was set twice; keeping the first");
        }
    }

    /// Gives the publisher its way to tell the tier's write budget of blocks not written after all.
    pub fn set_unwritten(&self, unwritten: Unwritten) {
        if self.inner.unwritten.set(unwritten).is_err() {
            log::warn!("kvtier: a publisher's unwritten hook was set twice; keeping the first");
        }
    }

    /// Queues a copy of `slot` (descriptor page + value) for publishing, or its key in the backlog
    /// when every staging buffer is in use. `false`: dropped (backlog full, or publisher closed) and
    /// counted; a block already in the shared index is not queued again (`true`). Either way a block
    /// not written is told to `set_unwritten`'s hook.
    pub fn offer(&self, key: BlockKey, slot: &[u8]) -> bool {
        let inner = &self.inner;
        if inner.tier.contains(&key) {
            inner.not_written(1);
            return true;
        }
        let slot_bytes = inner.tier.slot_bytes();
        // Never waits: the put path serves DRAM and NVMe, and a slow shared filesystem must not stall it.
        let staging = {
            let mut pool = inner.pool.lock();
            let staging = if pool.backlog.is_empty() { pool.staging(inner.max_buffers) } else { None };
            match staging {
                Some(s) => s,
                None if pool.backlog.len() < BACKLOG_BLOCKS => {
                    pool.backlog.push_back(key);
                    pool.pushed += 1;
                    drop(pool);
                    Stats::add(inner.tier.deferred(), 1);
                    return true;
                }
                None => {
                    drop(pool);
                    inner.dropped(1);
                    return false;
                }
            }
        };
        let mut buf = inner.buffer(staging);
        buf.as_mut_slice()[..slot_bytes].copy_from_slice(&slot[..slot_bytes]);
        let tx = self.tx.lock();
        let Some(tx) = tx.as_ref() else {
            inner.pool.lock().free.push(buf);
            inner.dropped(1);
            return false;
        };
        match tx.try_send(Msg::Block(key, buf)) {
            Ok(()) => true,
            Err(TrySendError::Full(Msg::Block(_, b))) | Err(TrySendError::Disconnected(Msg::Block(_, b))) => {
                inner.pool.lock().free.push(b);
                inner.dropped(1);
                false
            }
            Err(_) => false,
        }
    }

    /// Waits until every block offered before the call is written (or, backlogged, found gone from
    /// DRAM) and the open file is published; blocks offered meanwhile do not hold it up.
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

    /// Publishes what is queued and backlogged, stops the thread and closes the tier. Idempotent.
    pub fn close(&self) {
        self.tx.lock().take();
        if let Some(h) = self.thread.lock().take() {
            // The last reference to the store can be dropped on the publisher thread itself (its
            // refetch holds one while it copies); it must not wait for itself.
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
        self.inner.tier.close();
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.close();
    }
}
