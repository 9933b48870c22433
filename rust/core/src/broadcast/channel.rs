//! One writer, N readers, one slot, in a shared-memory file.
//!
//! Layout: a 1 KiB header, then the payload. The header holds the magic, the number of readers,
//! the sequence number of the last published message, its kind and length, the payload capacity,
//! an `aborted` flag, a count of attached readers and one acknowledgement word per reader.
//!
//! Protocol: the writer waits until every reader has acknowledged message `n`, writes message
//! `n + 1` (growing the file when it does not fit), then stores `seq = n + 1` with release
//! ordering. A reader waits for `seq == n + 1` with acquire ordering, copies the payload out and
//! stores its acknowledgement. One slot is enough because tensor-parallel ranks run in lockstep:
//! rank 0 cannot finish step `n` (whose collectives need every rank) before every rank has read
//! it, so the writer's wait is normally already over when it starts.
//!
//! Waiting spins briefly, then yields, then sleeps in steps growing to 1 ms; every wait has a
//! timeout, and either side can set `aborted` so the other stops waiting at once.
//!
//! The file lives in `/dev/shm` (the temp dir elsewhere). Every reader keeps its own file handle
//! (and remaps it when the writer grew the file), so the last reader to attach unlinks the file:
//! no file is left behind even if every process is killed afterwards. `close` (or drop) removes
//! it when some reader never attached.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap2::MmapMut;

use super::codec::{decode_step, encode_step};
use crate::error::{CoreError, CoreResult};
use crate::scheduler::SchedulerOutput;

const MAGIC: u64 = 0x6665_7272_6f73_7465; // "ferroste"
const HEADER_BYTES: usize = 1024;
/// Readers one channel serves (a node's ranks minus the writer).
pub const MAX_READERS: usize = 112;
const INITIAL_CAPACITY: usize = 1 << 20;

// Header offsets (bytes). Every field is 8-byte aligned.
const OFF_MAGIC: usize = 0;
const OFF_NUM_READERS: usize = 8;
const OFF_SEQ: usize = 16;
const OFF_KIND: usize = 24;
const OFF_LEN: usize = 32;
const OFF_CAPACITY: usize = 40;
const OFF_ABORTED: usize = 48;
const OFF_ATTACHED: usize = 56;
const OFF_ACKS: usize = 128;

/// What one message on the channel carries.
// Built once per step and moved, never stored in bulk: boxing the step would only add an allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum StepMessage {
    /// A step for the model runners.
    Step(SchedulerOutput),
    /// "Read your control pipe": a rare command (save weights, ...) that travels elsewhere.
    Control,
    /// The writer is closing; readers should exit.
    Shutdown,
}

impl StepMessage {
    fn kind(&self) -> u32 {
        match self {
            StepMessage::Step(_) => 1,
            StepMessage::Control => 2,
            StepMessage::Shutdown => 3,
        }
    }
}

/// The mapped file and typed access to its header.
struct Region {
    file: File,
    map: MmapMut,
}

impl Region {
    fn map(file: File) -> CoreResult<Self> {
        // SAFETY: the file is ours (created or opened by this channel); other processes write it
        // only through the atomics below or the payload area the protocol hands them.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| io_error("map", e))?;
        Ok(Self { file, map })
    }

    fn u64_at(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset.is_multiple_of(8) && offset + 8 <= HEADER_BYTES);
        // SAFETY: in bounds and 8-byte aligned (the map is page aligned); AtomicU64 has the
        // layout of u64, and every access to these words from any process is atomic.
        unsafe { &*(self.map.as_ptr().add(offset) as *const AtomicU64) }
    }

    fn u32_at(&self, offset: usize) -> &AtomicU32 {
        // SAFETY: as for `u64_at`.
        unsafe { &*(self.map.as_ptr().add(offset) as *const AtomicU32) }
    }

    fn ack(&self, reader: usize) -> &AtomicU64 {
        self.u64_at(OFF_ACKS + 8 * reader)
    }

    fn aborted(&self) -> bool {
        self.u32_at(OFF_ABORTED).load(Ordering::Acquire) != 0
    }

    /// Remaps when another process grew the file past this mapping.
    fn ensure_mapped(&mut self, bytes: usize) -> CoreResult<()> {
        if self.map.len() < bytes {
            let file = self.file.try_clone().map_err(|e| io_error("reopen", e))?;
            *self = Region::map(file)?;
        }
        Ok(())
    }
}

fn io_error(what: &str, e: std::io::Error) -> CoreError {
    CoreError::StepChannel(format!("could not {what} the step channel's shared memory: {e}"))
}

/// Sleeps a little longer each round, after a short spin: a reader is woken within a few
/// microseconds while steps follow each other, and costs little CPU while the engine idles.
struct Backoff {
    rounds: u32,
}

impl Backoff {
    fn wait(&mut self) {
        self.rounds += 1;
        if self.rounds < 200 {
            std::hint::spin_loop();
        } else if self.rounds < 400 {
            std::thread::yield_now();
        } else {
            let micros = (20 * (self.rounds - 399) as u64).min(1000);
            std::thread::sleep(Duration::from_micros(micros));
        }
    }
}

/// Rank 0's end: publishes each message to every reader.
pub struct StepBroadcaster {
    region: Region,
    path: PathBuf,
    num_readers: usize,
    seq: u64,
    unlinked: bool,
    buf: Vec<u8>,
}

impl StepBroadcaster {
    /// Creates the shared-memory file for `num_readers` readers.
    pub fn create(num_readers: usize) -> CoreResult<Self> {
        if !(1..=MAX_READERS).contains(&num_readers) {
            return Err(CoreError::config("num_readers", format!(">= 1 and <= {MAX_READERS}"), num_readers));
        }
        let dir = Path::new("/dev/shm");
        let dir = if dir.is_dir() { dir.to_path_buf() } else { std::env::temp_dir() };
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let path = dir.join(format!("ferrollm-steps-{}-{nanos}", std::process::id()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| io_error("create", e))?;
        file.set_len((HEADER_BYTES + INITIAL_CAPACITY) as u64).map_err(|e| io_error("size", e))?;
        let region = Region::map(file)?;
        region.u64_at(OFF_NUM_READERS).store(num_readers as u64, Ordering::Relaxed);
        region.u64_at(OFF_CAPACITY).store(INITIAL_CAPACITY as u64, Ordering::Relaxed);
        region.u64_at(OFF_MAGIC).store(MAGIC, Ordering::Release);
        Ok(Self { region, path, num_readers, seq: 0, unlinked: false, buf: Vec::new() })
    }

    /// Where readers open the channel (until they have all attached).
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn num_readers(&self) -> usize {
        self.num_readers
    }

    /// Messages published so far.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Publishes a step.
    pub fn publish_step(&mut self, step: &SchedulerOutput, timeout: Duration) -> CoreResult<()> {
        let mut buf = std::mem::take(&mut self.buf);
        encode_step(step, &mut buf);
        let result = self.publish_bytes(1, &buf, timeout);
        self.buf = buf;
        result
    }

    /// Publishes any message.
    pub fn publish(&mut self, msg: &StepMessage, timeout: Duration) -> CoreResult<()> {
        match msg {
            StepMessage::Step(step) => self.publish_step(step, timeout),
            other => self.publish_bytes(other.kind(), &[], timeout),
        }
    }

    fn publish_bytes(&mut self, kind: u32, payload: &[u8], timeout: Duration) -> CoreResult<()> {
        self.wait_for_acks(timeout)?;
        self.unlink_once_attached();
        let capacity = self.region.u64_at(OFF_CAPACITY).load(Ordering::Relaxed) as usize;
        if payload.len() > capacity {
            let capacity = payload.len().next_power_of_two();
            self.region.file.set_len((HEADER_BYTES + capacity) as u64).map_err(|e| io_error("grow", e))?;
            self.region.ensure_mapped(HEADER_BYTES + capacity)?;
            self.region.u64_at(OFF_CAPACITY).store(capacity as u64, Ordering::Relaxed);
        }
        self.region.map[HEADER_BYTES..HEADER_BYTES + payload.len()].copy_from_slice(payload);
        self.region.u64_at(OFF_LEN).store(payload.len() as u64, Ordering::Relaxed);
        self.region.u32_at(OFF_KIND).store(kind, Ordering::Relaxed);
        self.seq += 1;
        self.region.u64_at(OFF_SEQ).store(self.seq, Ordering::Release);
        Ok(())
    }

    fn wait_for_acks(&self, timeout: Duration) -> CoreResult<()> {
        let start = Instant::now();
        let mut backoff = Backoff { rounds: 0 };
        loop {
            if self.region.aborted() {
                return Err(CoreError::StepChannel("the step channel was aborted".into()));
            }
            let late = (0..self.num_readers).find(|&r| self.region.ack(r).load(Ordering::Acquire) < self.seq);
            let Some(reader) = late else { return Ok(()) };
            if start.elapsed() >= timeout {
                return Err(CoreError::StepChannel(format!(
                    "reader {reader} did not take message {} within {:.1}s",
                    self.seq,
                    timeout.as_secs_f64()
                )));
            }
            backoff.wait();
        }
    }

    fn unlink_once_attached(&mut self) {
        // The last reader to attach removed the file (see `StepReceiver::open`).
        let attached = self.region.u64_at(OFF_ATTACHED).load(Ordering::Acquire) as usize;
        self.unlinked |= attached >= self.num_readers;
    }

    /// Makes every current and future wait on this channel, on either side, fail at once.
    pub fn abort(&self) {
        self.region.u32_at(OFF_ABORTED).store(1, Ordering::Release);
    }

    /// Aborts the channel and removes its file if readers have not all attached yet (a rank
    /// failed to start). Publishing afterwards fails.
    pub fn close(&mut self) {
        self.abort();
        if !self.unlinked {
            let _ = std::fs::remove_file(&self.path);
            self.unlinked = true;
        }
    }

    /// A handle that can abort the channel from another thread while `publish` waits.
    pub fn abort_handle(&self) -> CoreResult<AbortHandle> {
        let file = self.region.file.try_clone().map_err(|e| io_error("reopen", e))?;
        Ok(AbortHandle { region: Region::map(file)? })
    }
}

/// Sets a channel's `aborted` flag; see [`StepBroadcaster::abort_handle`].
pub struct AbortHandle {
    region: Region,
}

impl AbortHandle {
    pub fn abort(&self) {
        self.region.u32_at(OFF_ABORTED).store(1, Ordering::Release);
    }
}

impl Drop for StepBroadcaster {
    fn drop(&mut self) {
        self.close();
    }
}

/// A worker rank's end: receives every message in order.
pub struct StepReceiver {
    region: Region,
    reader: usize,
    seq: u64,
}

impl StepReceiver {
    /// Attaches to the channel at `path` as reader `reader` (0-based, below `num_readers`).
    pub fn open(path: &Path, reader: usize) -> CoreResult<Self> {
        let file = OpenOptions::new().read(true).write(true).open(path).map_err(|e| io_error("open", e))?;
        let region = Region::map(file)?;
        if region.map.len() < HEADER_BYTES || region.u64_at(OFF_MAGIC).load(Ordering::Acquire) != MAGIC {
            return Err(CoreError::StepChannel(format!("{} is not a step channel", path.display())));
        }
        let num_readers = region.u64_at(OFF_NUM_READERS).load(Ordering::Relaxed) as usize;
        if reader >= num_readers {
            return Err(CoreError::config("reader", format!("< {num_readers}"), reader));
        }
        // The last reader to attach unlinks the file: every process now holds its own handle,
        // so nothing is left in /dev/shm whatever happens to them later.
        if region.u64_at(OFF_ATTACHED).fetch_add(1, Ordering::AcqRel) + 1 == num_readers as u64 {
            let _ = std::fs::remove_file(path);
        }
        let seq = region.u64_at(OFF_SEQ).load(Ordering::Acquire);
        region.ack(reader).store(seq, Ordering::Release);
        Ok(Self { region, reader, seq })
    }

    /// The next message, or `None` if none came within `timeout`.
    pub fn recv(&mut self, timeout: Duration) -> CoreResult<Option<StepMessage>> {
        let start = Instant::now();
        let mut backoff = Backoff { rounds: 0 };
        let seq = self.region.u64_at(OFF_SEQ);
        while seq.load(Ordering::Acquire) <= self.seq {
            if self.region.aborted() {
                return Err(CoreError::StepChannel("the step channel was aborted".into()));
            }
            if start.elapsed() >= timeout {
                return Ok(None);
            }
            backoff.wait();
        }
        self.seq += 1;
        let len = self.region.u64_at(OFF_LEN).load(Ordering::Relaxed) as usize;
        let kind = self.region.u32_at(OFF_KIND).load(Ordering::Relaxed);
        self.region.ensure_mapped(HEADER_BYTES + len)?;
        let msg = match kind {
            1 => StepMessage::Step(decode_step(&self.region.map[HEADER_BYTES..HEADER_BYTES + len])?),
            2 => StepMessage::Control,
            3 => StepMessage::Shutdown,
            k => return Err(CoreError::StepChannel(format!("unknown message kind {k}"))),
        };
        self.region.ack(self.reader).store(self.seq, Ordering::Release);
        Ok(Some(msg))
    }

    /// Makes every wait on this channel, on either side, fail at once.
    pub fn abort(&self) {
        self.region.u32_at(OFF_ABORTED).store(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broadcast::codec::tests::sample_step;

    const SEC: Duration = Duration::from_secs(5);

    #[test]
    fn readers_get_what_the_writer_published() {
        let mut tx = StepBroadcaster::create(2).unwrap();
        let mut rx: Vec<_> = (0..2).map(|r| StepReceiver::open(tx.path(), r).unwrap()).collect();
        let step = sample_step(12);
        tx.publish_step(&step, SEC).unwrap();
        for r in &mut rx {
            assert_eq!(r.recv(SEC).unwrap(), Some(StepMessage::Step(step.clone())));
        }
        tx.publish(&StepMessage::Shutdown, SEC).unwrap();
        for r in &mut rx {
            assert_eq!(r.recv(SEC).unwrap(), Some(StepMessage::Shutdown));
        }
    }

    #[test]
    fn file_is_unlinked_once_every_reader_attached() {
        let mut tx = StepBroadcaster::create(2).unwrap();
        let path = tx.path().to_path_buf();
        let _rx0 = StepReceiver::open(&path, 0).unwrap();
        assert!(path.exists());
        let mut rx = StepReceiver::open(&path, 1).unwrap();
        assert!(!path.exists());
        tx.publish(&StepMessage::Control, SEC).unwrap();
        assert_eq!(rx.recv(SEC).unwrap(), Some(StepMessage::Control));
    }

    #[test]
    fn one_slot_carries_thousands_of_steps_of_changing_sizes_across_threads() {
        let mut tx = StepBroadcaster::create(1).unwrap();
        let mut rx = StepReceiver::open(tx.path(), 0).unwrap();
        let reader = std::thread::spawn(move || {
            let mut ids = Vec::new();
            while let Some(StepMessage::Step(s)) = rx.recv(SEC).unwrap() {
                assert_eq!(s.input_ids.len(), s.total_num_scheduled_tokens);
                ids.push(s.step_id);
            }
            ids
        });
        for i in 0..3000u64 {
            let mut step = sample_step(2 + (i as usize * 7) % 300);
            step.step_id = i;
            tx.publish_step(&step, SEC).unwrap();
        }
        tx.publish(&StepMessage::Shutdown, SEC).unwrap();
        assert_eq!(reader.join().unwrap(), (0..3000).collect::<Vec<_>>());
    }

    #[test]
    fn a_step_larger_than_the_region_grows_it_and_readers_remap() {
        let mut tx = StepBroadcaster::create(1).unwrap();
        let mut rx = StepReceiver::open(tx.path(), 0).unwrap();
        let small = sample_step(4);
        tx.publish_step(&small, SEC).unwrap();
        assert_eq!(rx.recv(SEC).unwrap(), Some(StepMessage::Step(small.clone())));
        let large = sample_step(3 * INITIAL_CAPACITY / 8); // three 8-byte arrays of this length
        tx.publish_step(&large, SEC).unwrap();
        assert_eq!(rx.recv(SEC).unwrap(), Some(StepMessage::Step(large)));
        tx.publish_step(&small, SEC).unwrap();
        assert_eq!(rx.recv(SEC).unwrap(), Some(StepMessage::Step(small)));
    }

    #[test]
    fn reader_times_out_when_nothing_is_published() {
        let tx = StepBroadcaster::create(1).unwrap();
        let mut rx = StepReceiver::open(tx.path(), 0).unwrap();
        let start = Instant::now();
        assert_eq!(rx.recv(Duration::from_millis(50)).unwrap(), None);
        assert!(start.elapsed() >= Duration::from_millis(50));
    }

    #[test]
    fn writer_times_out_on_a_reader_that_stopped_reading() {
        let mut tx = StepBroadcaster::create(2).unwrap();
        let mut rx0 = StepReceiver::open(tx.path(), 0).unwrap();
        let _rx1 = StepReceiver::open(tx.path(), 1).unwrap();
        tx.publish(&StepMessage::Control, SEC).unwrap();
        rx0.recv(SEC).unwrap();
        let err = tx.publish(&StepMessage::Control, Duration::from_millis(50)).unwrap_err();
        assert!(err.to_string().contains("reader 1 did not take message 1"), "{err}");
    }

    #[test]
    fn abort_wakes_both_sides_at_once() {
        let mut tx = StepBroadcaster::create(1).unwrap();
        let mut rx = StepReceiver::open(tx.path(), 0).unwrap();
        tx.publish(&StepMessage::Control, SEC).unwrap();
        rx.abort();
        let start = Instant::now();
        assert!(tx.publish(&StepMessage::Control, SEC).unwrap_err().to_string().contains("aborted"));
        rx.recv(SEC).unwrap(); // the Control already published is still delivered
        assert!(rx.recv(SEC).unwrap_err().to_string().contains("aborted"));
        assert!(start.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn abort_handle_ends_a_publish_that_waits_on_a_silent_reader() {
        let mut tx = StepBroadcaster::create(1).unwrap();
        let _rx = StepReceiver::open(tx.path(), 0).unwrap();
        tx.publish(&StepMessage::Control, SEC).unwrap();
        let handle = tx.abort_handle().unwrap();
        let aborter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            handle.abort();
        });
        let start = Instant::now();
        assert!(tx.publish(&StepMessage::Control, SEC).unwrap_err().to_string().contains("aborted"));
        assert!(start.elapsed() < Duration::from_secs(1));
        aborter.join().unwrap();
    }

    #[test]
    fn close_removes_the_file_when_a_reader_never_attached() {
        let mut tx = StepBroadcaster::create(2).unwrap();
        let path = tx.path().to_path_buf();
        let _rx = StepReceiver::open(&path, 0).unwrap();
        tx.close();
        assert!(!path.exists());
        assert!(tx.publish(&StepMessage::Control, SEC).is_err());
    }

    #[test]
    fn rejects_a_reader_index_out_of_range() {
        let tx = StepBroadcaster::create(1).unwrap();
        assert!(StepReceiver::open(tx.path(), 1).is_err());
    }
}
