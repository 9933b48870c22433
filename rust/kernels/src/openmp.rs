//! Running a kernel on the host process's OpenMP team.
//!
//! torch's CPU ops run on an OpenMP team whose threads spin for a while after each op before
//! they sleep. A second pool started beside them (rayon, or threads of our own) finds both cores
//! busy with spinning workers: measured on the 2-core development machine, a two-thread matrix-
//! vector product fell from 24 to 14 GB/s when torch's attention ran between calls. Joining
//! torch's own team instead, through the GNU OpenMP entry point `GOMP_parallel` that libgomp and
//! LLVM's libomp both export, runs the same product at 28 GB/s.
//!
//! [`attach`] looks the entry points up in a runtime the process has already loaded (it never
//! loads one); until then, and where there is none, [`parallel`] runs on the calling thread.

use std::ffi::{c_int, c_uint, c_void, CString};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use crate::KernelError;

mod team;
pub use team::hold;

type GompParallel = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);
type OmpQuery = unsafe extern "C" fn() -> c_int;

struct Runtime {
    parallel: GompParallel,
    thread_num: OmpQuery,
    num_threads: OmpQuery,
}

static RUNTIME: OnceLock<Runtime> = OnceLock::new();

/// Joins the OpenMP runtime loaded from `path` (a shared library already in this process).
/// Once one is joined, attaching again checks `path` the same way but keeps the first.
pub fn attach(path: &str) -> Result<(), KernelError> {
    let runtime = open(path).map_err(|reason| KernelError::OpenMp { path: path.to_owned(), reason })?;
    let _ = RUNTIME.set(runtime);
    Ok(())
}

/// Whether [`parallel`] runs on an OpenMP team.
pub fn is_attached() -> bool {
    RUNTIME.get().is_some()
}

#[cfg(unix)]
fn open(path: &str) -> Result<Runtime, String> {
    let name = CString::new(path).map_err(|_| "the path holds a NUL byte".to_owned())?;
    // SAFETY: `name` is NUL-terminated; RTLD_NOLOAD only returns a library already loaded, so no
    // initialiser runs and the handle stays valid for the life of the process.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
    if handle.is_null() {
        return Err("it is not loaded in this process".to_owned());
    }
    let symbol = |name: &std::ffi::CStr| {
        // SAFETY: `handle` is a live library handle and `name` is NUL-terminated.
        let address = unsafe { libc::dlsym(handle, name.as_ptr()) };
        if address.is_null() {
            Err(format!("it has no `{}`", name.to_string_lossy()))
        } else {
            Ok(address)
        }
    };
    let (parallel, thread_num, num_threads) =
        (symbol(c"GOMP_parallel")?, symbol(c"omp_get_thread_num")?, symbol(c"omp_get_num_threads")?);
    // SAFETY: these are the OpenMP ABI's functions, with the signatures the types spell.
    unsafe {
        Ok(Runtime {
            parallel: std::mem::transmute::<*mut c_void, GompParallel>(parallel),
            thread_num: std::mem::transmute::<*mut c_void, OmpQuery>(thread_num),
            num_threads: std::mem::transmute::<*mut c_void, OmpQuery>(num_threads),
        })
    }
}

#[cfg(not(unix))]
fn open(_path: &str) -> Result<Runtime, String> {
    Err("OpenMP runtimes are only joined on Unix".to_owned())
}

/// Calls `f(thread, team_size)` once on each thread of a team of up to `threads` (the calling
/// thread is thread 0), returning when all have. `f` must not panic: it runs under a C frame.
/// Inside [`hold`], the held team runs `f` without opening a region.
pub fn parallel<F: Fn(usize, usize) + Sync>(threads: usize, f: F) {
    let Err(f) = team::dispatch(threads, f) else { return };
    match RUNTIME.get() {
        Some(runtime) if threads > 1 => {
            let team = c_uint::try_from(threads).unwrap_or(c_uint::MAX);
            // SAFETY: `member::<F>` reads `data` back as the `&F` passed here, which outlives the
            // call: GOMP_parallel returns only after every thread has finished.
            unsafe { (runtime.parallel)(member::<F>, (&f as *const F).cast_mut().cast(), team, 0) };
        }
        _ => f(0, 1),
    }
}

extern "C" fn member<F: Fn(usize, usize) + Sync>(data: *mut c_void) {
    let runtime = RUNTIME.get().expect("GOMP_parallel runs only once a runtime is attached");
    // SAFETY: `parallel` passes a pointer to a live `F`; the queries are plain OpenMP calls.
    let (f, thread, size) =
        unsafe { (&*(data as *const F), (runtime.thread_num)(), (runtime.num_threads)()) };
    f(thread.max(0) as usize, size.max(1) as usize);
}

/// Splits `out`, `units` pieces of `unit_len` elements, over the team: `f(units, piece)` gets
/// each thread's share of units and their elements. Each thread gets `min_units` or more, so small
/// outputs run on the calling thread alone (waking the team costs more than they do).
pub fn for_each_share<T, F>(out: &mut [T], unit_len: usize, min_units: usize, threads: usize, f: F)
where
    T: Send,
    F: Fn(Range<usize>, &mut [T]) + Sync,
{
    for_each_share_pair(out, &mut [] as &mut [T], unit_len, 0, min_units, threads, |units, a, _| f(units, a));
}

/// [`for_each_share`] over two outputs split by the same units (`b` may have another unit length).
pub fn for_each_share_pair<A, B, F>(
    a: &mut [A],
    b: &mut [B],
    a_unit: usize,
    b_unit: usize,
    min_units: usize,
    threads: usize,
    f: F,
) where
    A: Send,
    B: Send,
    F: Fn(Range<usize>, &mut [A], &mut [B]) + Sync,
{
    let units = a.len().checked_div(a_unit).unwrap_or(0);
    let team = team_size(units, min_units, threads);
    // SAFETY: `share` splits `0..units` into consecutive, disjoint pieces.
    unsafe { run_shares(a, b, (a_unit, b_unit), team, |thread, size| share(units, thread, size), f) };
}

/// [`for_each_share`] with shares of near-equal total `costs` (one per unit) instead of near-equal
/// unit counts, for units whose work differs. Each thread gets `min_units` or more on average.
pub fn for_each_weighted_share<T, F>(
    out: &mut [T],
    unit_len: usize,
    costs: &[usize],
    min_units: usize,
    threads: usize,
    f: F,
) where
    T: Send,
    F: Fn(Range<usize>, &mut [T]) + Sync,
{
    let units = out.len().checked_div(unit_len).unwrap_or(0).min(costs.len());
    let line = CostLine::new(&costs[..units]);
    let team = team_size(units, min_units, threads);
    let span_of = |thread, size| line.share(thread, size);
    // SAFETY: `CostLine::share` gives consecutive, disjoint pieces of its units.
    unsafe {
        run_shares(out, &mut [] as &mut [T], (unit_len, 0), team, span_of, |units, piece, _| f(units, piece))
    };
}

/// Threads for `units` when each should get `min_units` or more: at least the calling one.
fn team_size(units: usize, min_units: usize, threads: usize) -> usize {
    threads.min(units / min_units.max(1)).max(1)
}

/// Runs `f(span, a's piece, b's piece)` on a team of `team`, each thread's units given by
/// `span_of(thread, size)`; `unit_lens` are the elements of `a` and `b` per unit.
///
/// # Safety
/// `span_of` must give the threads of one team disjoint ranges.
unsafe fn run_shares<A, B, S, F>(
    a: &mut [A],
    b: &mut [B],
    unit_lens: (usize, usize),
    team: usize,
    span_of: S,
    f: F,
) where
    A: Send,
    B: Send,
    S: Fn(usize, usize) -> Range<usize> + Sync,
    F: Fn(Range<usize>, &mut [A], &mut [B]) + Sync,
{
    let (a_unit, b_unit) = unit_lens;
    let (pa, pb) = (SharedMut(a.as_mut_ptr()), SharedMut(b.as_mut_ptr()));
    let (a_len, b_len) = (a.len(), b.len());
    parallel(team, |thread, size| {
        let span = span_of(thread, size);
        let (a_start, a_end) = ((span.start * a_unit).min(a_len), (span.end * a_unit).min(a_len));
        let (b_start, b_end) = ((span.start * b_unit).min(b_len), (span.end * b_unit).min(b_len));
        // SAFETY: `span_of` gives distinct threads disjoint ranges (the caller's promise), clamped
        // to the slices' lengths, and the slices outlive `parallel`.
        let (sa, sb) = unsafe {
            (
                std::slice::from_raw_parts_mut(pa.get().add(a_start), a_end - a_start),
                std::slice::from_raw_parts_mut(pb.get().add(b_start), b_end - b_start),
            )
        };
        f(span, sa, sb);
    });
}

/// Units on the line of their running total cost, each placed at its middle (doubled, so it
/// stays an integer: `2 * cost before + cost`).
struct CostLine {
    doubled_middles: Vec<usize>,
    doubled_total: usize,
}

impl CostLine {
    fn new(costs: &[usize]) -> Self {
        let mut before = 0;
        let doubled_middles = costs
            .iter()
            .map(|&c| {
                let middle = 2 * before + c;
                before += c;
                middle
            })
            .collect();
        CostLine { doubled_middles, doubled_total: 2 * before }
    }

    /// The `thread`-th of `parts` shares: a unit goes to the share whose slice of the total cost
    /// holds its middle. Shares are consecutive and cover every unit once; with no cost at all
    /// they split the count evenly.
    fn share(&self, thread: usize, parts: usize) -> Range<usize> {
        let (parts, units) = (parts.max(1), self.doubled_middles.len());
        if self.doubled_total == 0 {
            return share(units, thread, parts);
        }
        let bound = |t: usize| {
            if t >= parts {
                units
            } else {
                self.doubled_middles.partition_point(|&m| m * parts < self.doubled_total * t)
            }
        };
        bound(thread)..bound(thread + 1)
    }
}

pub(crate) struct SharedMut<T>(pub(crate) *mut T);
// SAFETY: used only to hand disjoint pieces of one slice to the team's threads.
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    /// The pointer. A method, so closures capture the `Sync` wrapper and not its raw field.
    pub(crate) fn get(&self) -> *mut T {
        self.0
    }
}

/// Units `0..len` that the threads of a team take one at a time: each thread first takes the
/// units of its own share, in order, then those left at the end of the others' shares.
///
/// A fixed share waits for the slower thread, and on a shared machine a thread is often slower
/// for reasons outside the process: a hyperthread sibling busy with another guest, a vCPU the
/// hypervisor took away. On the loaded 2-core development VM, the two threads of a 128-row fp32
/// GEMM over fixed column shares finished 11% of its time apart, on average, and the GEMM ran at
/// 0.86 of oneDNN's speed; taking its tiles this way, at 0.96-1.00 (0.99 at 266 rows; alternating
/// rounds of 8 Qwen2-0.5B layers). A thread's own share keeps its weight stream whole until it runs out.
/// Only for units whose results do not depend on which thread computes them.
///
/// Not every product gains: the GGUF block products of a SmolLM2-135M decode step (50 µs each)
/// were no faster in pieces, however many, and keep fixed shares.
pub struct Claims {
    /// Per share: the first and the end of its units not yet taken, `first << 32 | end`.
    shares: Vec<Share>,
}

/// A share's word on a cache line of its own, so an owner taking its own units keeps the line in
/// its core's cache; only another thread's look at the share moves it.
#[repr(align(128))]
struct Share(AtomicU64);

impl Claims {
    /// `len` units over `team` shares (the threads of a team of that size).
    pub fn new(len: usize, team: usize) -> Self {
        assert!(u32::try_from(len).is_ok(), "{len} units: at most u32::MAX");
        let team = team.max(1);
        let shares = (0..team).map(|t| Share(AtomicU64::new(pack(share(len, t, team))))).collect();
        Self { shares }
    }

    /// For thread `thread`: the next unit of its share, else the last one left in the share with
    /// the most left, else `None`: every unit has been taken.
    pub fn take(&self, thread: usize) -> Option<usize> {
        if let Some(own) = self.shares.get(thread) {
            if let Some(unit) = take_from(&own.0, |r| (r.start, r.start + 1..r.end)) {
                return Some(unit);
            }
        }
        loop {
            let (fullest, left) = self
                .shares
                .iter()
                .map(|s| (s, unpack(s.0.load(Ordering::Relaxed)).len()))
                .max_by_key(|&(_, n)| n)?;
            if left == 0 {
                return None;
            }
            if let Some(unit) = take_from(&fullest.0, |r| (r.end - 1, r.start..r.end - 1)) {
                return Some(unit);
            }
        }
    }
}

fn pack(r: Range<usize>) -> u64 {
    ((r.start as u64) << 32) | r.end as u64
}

fn unpack(v: u64) -> Range<usize> {
    (v >> 32) as usize..(v & u64::from(u32::MAX)) as usize
}

/// One unit of `share`, as `split` cuts it from what is left (`(unit, rest)`), unless nothing is.
fn take_from(share: &AtomicU64, split: impl Fn(Range<usize>) -> (usize, Range<usize>)) -> Option<usize> {
    let mut current = share.load(Ordering::Relaxed);
    loop {
        let left = unpack(current);
        if left.is_empty() {
            return None;
        }
        let (unit, rest) = split(left);
        match share.compare_exchange_weak(current, pack(rest), Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return Some(unit),
            Err(now) => current = now,
        }
    }
}

/// The `thread`-th of `parts` near-equal pieces of `0..len`, as a range.
pub fn share(len: usize, thread: usize, parts: usize) -> Range<usize> {
    let parts = parts.max(1);
    let (base, extra) = (len / parts, len % parts);
    let start = thread * base + thread.min(extra);
    let end = start + base + usize::from(thread < extra);
    start.min(len)..end.min(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_on_the_calling_thread_without_a_runtime() {
        use std::sync::atomic::AtomicUsize;
        // The test binary has no OpenMP runtime loaded, so attaching fails and nothing changes.
        assert!(matches!(attach("libgomp-not-loaded.so.1"), Err(KernelError::OpenMp { .. })));
        assert!(!is_attached());
        let calls = AtomicUsize::new(0);
        parallel(4, |thread, size| {
            assert_eq!((thread, size), (0, 1));
            calls.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(calls.into_inner(), 1);
    }

    #[test]
    fn every_claim_goes_to_exactly_one_thread() {
        // Plain threads: the test binary has no OpenMP team. Thread 3 has no share of its own
        // and thread 2 never comes, so its share is taken by the others.
        let claims = &Claims::new(1000, 3);
        let taken: Vec<Vec<usize>> = std::thread::scope(|scope| {
            let workers: Vec<_> = [0, 1, 3]
                .map(|t| scope.spawn(move || std::iter::from_fn(|| claims.take(t)).collect::<Vec<_>>()))
                .into_iter()
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).collect()
        });
        let mut all: Vec<usize> = taken.concat();
        all.sort_unstable();
        assert_eq!(all, (0..1000).collect::<Vec<_>>());
        assert_eq!((claims.take(0), claims.take(5)), (None, None));
        assert!(Claims::new(0, 2).take(0).is_none());
    }

    #[test]
    fn a_thread_takes_its_own_share_in_order_then_the_ends_of_the_others() {
        let claims = Claims::new(10, 2);
        let first: Vec<_> = std::iter::from_fn(|| claims.take(0)).take(5).collect();
        assert_eq!(first, [0, 1, 2, 3, 4]);
        // Thread 0's share is done: it takes from the end of thread 1's, which keeps its front.
        assert_eq!((claims.take(0), claims.take(1), claims.take(0)), (Some(9), Some(5), Some(8)));
        assert_eq!(std::iter::from_fn(|| claims.take(1)).collect::<Vec<_>>(), [6, 7]);
    }

    #[test]
    fn small_outputs_stay_on_the_calling_thread() {
        let mut out = vec![0u32; 12];
        for_each_share(&mut out, 3, 8, 4, |units, piece| {
            assert_eq!((units, piece.len()), (0..4, 12));
            piece.iter_mut().enumerate().for_each(|(i, v)| *v = i as u32);
        });
        assert_eq!(out, (0..12).collect::<Vec<_>>());
    }

    #[test]
    fn weighted_shares_balance_cost_and_cover_every_unit() {
        // One long unit among short ones: each unit goes where its middle falls.
        let line = CostLine::new(&[1, 9, 1, 1, 1]);
        assert_eq!((line.doubled_middles.as_slice(), line.doubled_total), (&[1, 11, 21, 23, 25][..], 26));
        assert_eq!((line.share(0, 2), line.share(1, 2)), (0..2, 2..5));
        // Equal costs, and no cost at all, split the count evenly.
        for costs in [vec![3; 7], vec![0; 7]] {
            let line = CostLine::new(&costs);
            for parts in 1..=4 {
                let shares: Vec<_> = (0..parts).map(|t| line.share(t, parts)).collect();
                assert_eq!((shares[0].start, shares[parts - 1].end), (0, 7));
                assert!(shares.windows(2).all(|w| w[0].end == w[1].start));
                assert!(shares.iter().all(|r| r.len().abs_diff(7 / parts) <= 1), "{shares:?}");
            }
        }
        assert_eq!(CostLine::new(&[]).share(1, 2), 0..0);
        // Without a runtime the team is the calling thread alone, with every unit.
        let mut out = vec![0u32; 10];
        for_each_weighted_share(&mut out, 2, &[1, 9, 1, 1, 1], 1, 2, |units, piece| {
            assert_eq!((units, piece.len()), (0..5, 10));
        });
    }

    #[test]
    fn shares_cover_the_range_once() {
        for len in [0, 1, 5, 896, 151_936] {
            for parts in 1..=5 {
                let ranges: Vec<_> = (0..parts).map(|t| share(len, t, parts)).collect();
                assert_eq!(ranges[0].start, 0);
                assert_eq!(ranges[parts - 1].end, len);
                assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
                assert!(ranges.iter().all(|r| r.len() <= len.div_ceil(parts)));
            }
        }
    }
}
