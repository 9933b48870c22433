//! A team held for the length of one call: [`hold`].
//!
//! Each [`parallel`](super::parallel) call opens an OpenMP region: `GOMP_parallel` wakes the
//! team, runs the work and joins it, ~2 µs on the 2-core development VM for an empty region
//! against ~0.5 µs for a barrier (C loops). A SmolLM2-135M decode step opens ~150 regions, one
//! per kernel of its 30 layers, so the forks alone cost ~0.3 ms of a ~7 ms step. Inside `hold`,
//! one region stays open: the calling thread runs the body, the other threads spin on the team's
//! job word, and each `parallel` call from the body hands its closure to them by bumping that
//! word, runs its own part, and waits until every helper has counted itself done: ~0.55 µs for
//! an empty job on two threads (the ignored `dispatch_cost` probe).

use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

/// Runs `body` on the calling thread with a team of `threads` held open around it: every
/// [`parallel`](super::parallel) call `body` makes (directly or through the kernels) runs on the
/// held team instead of opening a region of its own. Without a runtime, with one thread, or
/// inside another `hold`, `body` just runs. A panic in `body` is carried out of the region and
/// resumed here.
pub fn hold<R: Send, B: FnOnce() -> R + Send>(threads: usize, body: B) -> R {
    if threads <= 1 || !super::is_attached() || HELD.get().is_some() {
        return body();
    }
    let team = Team::new();
    // Thread 0 is the calling thread; the locks are taken once each, by it.
    let body = Mutex::new(Some(body));
    let result = Mutex::new(None);
    super::parallel(threads, |thread, size| {
        if thread == 0 {
            let body = lock(&body).take().expect("thread 0 runs the body once");
            *lock(&result) = Some(team.lead(size, body));
        } else {
            team.serve(thread);
        }
    });
    match result.into_inner().unwrap_or_else(PoisonError::into_inner) {
        Some(Ok(value)) => value,
        Some(Err(panic)) => resume_unwind(panic),
        None => unreachable!("thread 0 always runs"),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

thread_local! {
    /// The team the calling thread leads inside [`hold`], while it is not running a job itself.
    static HELD: Cell<Option<&'static Team>> = const { Cell::new(None) };
}

/// Runs `f` on the held team if the calling thread leads one (`Ok`), else gives `f` back.
pub(super) fn dispatch<F: Fn(usize, usize) + Sync>(threads: usize, f: F) -> Result<(), F> {
    match HELD.get() {
        Some(team) => {
            team.run(threads, &f);
            Ok(())
        }
        None => Err(f),
    }
}

/// The held team's state. The job and the word that posts it share a cache line, which the
/// helpers read while they spin and the leader writes once per job; the helpers' count of jobs
/// done is on a line of its own, which only the leader reads.
struct Team {
    job: Job,
    /// Helpers done with the current job (every helper counts, taking part or not).
    done: Padded,
    /// Threads in the region, the leader included: set by the leader once the region has them.
    members: AtomicUsize,
}

#[repr(align(128))]
struct Job {
    /// Bumped (Release) once the job below is in place; `CLOSED` closes the team.
    posted: AtomicUsize,
    /// A type-erased closure, its caller, and the threads that take part.
    data: AtomicUsize,
    call: AtomicUsize,
    size: AtomicUsize,
}

#[repr(align(128))]
struct Padded(AtomicUsize);

const CLOSED: usize = usize::MAX;

impl Team {
    fn new() -> Self {
        let zero = || AtomicUsize::new(0);
        let job = Job { posted: zero(), data: zero(), call: zero(), size: zero() };
        Team { job, done: Padded(zero()), members: zero() }
    }

    /// Thread 0: runs `body` with the team held, then closes it; a panic comes back as `Err`.
    fn lead<R, B: FnOnce() -> R>(&self, members: usize, body: B) -> std::thread::Result<R> {
        self.members.store(members, Ordering::Relaxed);
        // SAFETY (lifetime): `HELD` is cleared below before `self` can go; only this thread
        // reads it, so the `'static` never outlives the team.
        let team: &'static Team = unsafe { &*(self as *const Team) };
        HELD.set(Some(team));
        let result = catch_unwind(AssertUnwindSafe(body));
        HELD.set(None);
        self.job.posted.store(CLOSED, Ordering::Release);
        result
    }

    /// Threads 1..: run each posted job until the team closes.
    fn serve(&self, thread: usize) {
        let mut seen = 0;
        loop {
            let posted = spin_until(|| {
                let now = self.job.posted.load(Ordering::Acquire);
                (now != seen).then_some(now)
            });
            if posted == CLOSED {
                return;
            }
            seen = posted;
            let size = self.job.size.load(Ordering::Relaxed);
            if thread < size {
                let (data, call) =
                    (self.job.data.load(Ordering::Relaxed), self.job.call.load(Ordering::Relaxed));
                // SAFETY: `run` stored `call` as the caller of the closure at `data`, and waits
                // for this thread's count before that closure goes.
                unsafe { std::mem::transmute::<usize, Caller>(call)(data, thread, size) };
            }
            self.done.0.fetch_add(1, Ordering::Release);
        }
    }

    /// The leader: `f(thread, size)` on `min(threads, members)` threads, returning when all
    /// have run it. The leader's own part runs with the team unheld, so a `parallel` inside it
    /// opens a region of its own as it would anywhere else.
    fn run<F: Fn(usize, usize) + Sync>(&'static self, threads: usize, f: &F) {
        let members = self.members.load(Ordering::Relaxed);
        let size = threads.min(members).max(1);
        if size == 1 {
            f(0, 1);
            return;
        }
        self.done.0.store(0, Ordering::Relaxed);
        self.job.data.store(f as *const F as usize, Ordering::Relaxed);
        self.job.call.store(call::<F> as Caller as usize, Ordering::Relaxed);
        self.job.size.store(size, Ordering::Relaxed);
        let posted = self.job.posted.load(Ordering::Relaxed);
        // Never CLOSED: a job is posted ~10^3 times a call, far from usize::MAX.
        self.job.posted.store(posted + 1, Ordering::Release);
        HELD.set(None);
        {
            // A panic here would free `f` under the helpers still running it: abort instead, as a
            // panic in a region's work does anywhere (it unwinds into a C frame).
            let _abort = AbortOnUnwind;
            f(0, size);
        }
        HELD.set(Some(self));
        spin_until(|| (self.done.0.load(Ordering::Acquire) == members - 1).then_some(()));
    }
}

struct AbortOnUnwind;

impl Drop for AbortOnUnwind {
    fn drop(&mut self) {
        if std::thread::panicking() {
            std::process::abort();
        }
    }
}

type Caller = unsafe fn(usize, usize, usize);

/// # Safety
/// `data` is the address of a live `F`.
unsafe fn call<F: Fn(usize, usize)>(data: usize, thread: usize, size: usize) {
    (*(data as *const F))(thread, size);
}

fn spin_until<T>(mut ready: impl FnMut() -> Option<T>) -> T {
    loop {
        if let Some(value) = ready() {
            return value;
        }
        std::hint::spin_loop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The region as `hold` opens it, on plain threads (the test binary has no OpenMP runtime).
    fn held_on_threads<R: Send>(members: usize, body: impl FnOnce() -> R + Send) -> R {
        let team = Team::new();
        std::thread::scope(|scope| {
            let team = &team;
            for thread in 1..members {
                scope.spawn(move || team.serve(thread));
            }
            match team.lead(members, body) {
                Ok(value) => value,
                Err(panic) => resume_unwind(panic),
            }
        })
    }

    #[test]
    fn every_job_runs_once_on_each_thread_of_its_size() {
        let calls = Mutex::new(Vec::new());
        let jobs = held_on_threads(3, || {
            for (job, threads) in [4, 2, 1, 3, 2].into_iter().enumerate() {
                let ran = dispatch(threads, |thread, size| calls.lock().unwrap().push((job, thread, size)));
                assert!(ran.is_ok(), "the team is held");
            }
            5
        });
        let mut calls = calls.into_inner().unwrap();
        calls.sort_unstable();
        let expected: Vec<_> = [3, 2, 1, 3, 2]
            .into_iter()
            .enumerate()
            .flat_map(|(job, size)| (0..size).map(move |t| (job, t, size)))
            .collect();
        assert_eq!((jobs, calls), (5, expected));
    }

    #[test]
    fn a_job_sees_the_writes_before_it_and_the_leader_sees_its_writes() {
        held_on_threads(2, || {
            let cells: Vec<AtomicUsize> = (0..2).map(|_| AtomicUsize::new(0)).collect();
            for round in 1..=1000 {
                let _ = dispatch(2, |thread, _| {
                    // Relaxed on purpose: the posting and the count carry the ordering.
                    let before = cells[thread].load(Ordering::Relaxed);
                    cells[thread].store(before + round, Ordering::Relaxed);
                });
                let sum: usize = cells.iter().map(|c| c.load(Ordering::Relaxed)).sum();
                assert_eq!(sum, round * (round + 1), "round {round}");
            }
        });
    }

    #[test]
    fn nothing_is_held_outside_the_region_or_inside_a_job() {
        assert!(dispatch(2, |_, _| {}).is_err());
        held_on_threads(2, || {
            let _ = dispatch(2, |thread, _| {
                // A job's own `parallel` calls do not post to the team that runs it.
                assert!(dispatch(2, |_, _| {}).is_err(), "thread {thread}");
            });
        });
        assert!(dispatch(2, |_, _| {}).is_err());
    }

    #[test]
    fn a_panic_in_the_body_closes_the_team_and_comes_back() {
        let caught = catch_unwind(|| held_on_threads(2, || panic!("in the body")));
        assert!(caught.is_err());
        assert!(dispatch(2, |_, _| {}).is_err());
    }

    #[test]
    #[ignore = "a timing probe: cargo test --release -- --ignored --nocapture dispatch_cost"]
    fn dispatch_cost() {
        let n = 200_000;
        let took = held_on_threads(2, || {
            let start = std::time::Instant::now();
            for _ in 0..n {
                let _ = dispatch(2, |_, _| {});
            }
            start.elapsed()
        });
        println!("{:.0} ns per empty job on 2 threads", took.as_nanos() as f64 / n as f64);
    }
}
