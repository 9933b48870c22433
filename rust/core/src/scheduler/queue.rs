//! The waiting queue under either scheduling policy.
//!
//! FCFS is a deque: new requests at the back, preempted ones back at the front. Priority is an
//! ordered set keyed by (priority, arrival), so a preempted request returns to where its key puts
//! it, which is ahead of every later arrival of equal priority. Both are O(1) or O(log n) per op;
//! `remove` (abort) is O(n) for FCFS, which aborts can afford.

use std::collections::{BTreeSet, VecDeque};

use crate::config::SchedulingPolicy;
use crate::request::ReqIdx;

/// Ordering key of a waiting request under the priority policy.
pub type PriorityKey = (i32, u64);

#[derive(Debug)]
pub enum RequestQueue {
    Fcfs(VecDeque<ReqIdx>),
    Priority(BTreeSet<(PriorityKey, ReqIdx)>),
}

impl RequestQueue {
    pub fn new(policy: SchedulingPolicy) -> Self {
        match policy {
            SchedulingPolicy::Fcfs => Self::Fcfs(VecDeque::new()),
            SchedulingPolicy::Priority => Self::Priority(BTreeSet::new()),
        }
    }

    /// Queues a newly arrived request.
    pub fn push_back(&mut self, idx: ReqIdx, key: PriorityKey) {
        match self {
            Self::Fcfs(q) => q.push_back(idx),
            Self::Priority(s) => {
                s.insert((key, idx));
            }
        }
    }

    /// Re-queues a preempted request ahead of those that arrived after it.
    pub fn push_front(&mut self, idx: ReqIdx, key: PriorityKey) {
        match self {
            Self::Fcfs(q) => q.push_front(idx),
            Self::Priority(s) => {
                s.insert((key, idx));
            }
        }
    }

    pub fn peek(&self) -> Option<ReqIdx> {
        match self {
            Self::Fcfs(q) => q.front().copied(),
            Self::Priority(s) => s.first().map(|&(_, i)| i),
        }
    }

    pub fn pop(&mut self) -> Option<ReqIdx> {
        match self {
            Self::Fcfs(q) => q.pop_front(),
            Self::Priority(s) => s.pop_first().map(|(_, i)| i),
        }
    }

    /// Removes a request wherever it is; returns whether it was queued.
    pub fn remove(&mut self, idx: ReqIdx, key: PriorityKey) -> bool {
        match self {
            Self::Fcfs(q) => match q.iter().position(|&i| i == idx) {
                Some(p) => q.remove(p).is_some(),
                None => false,
            },
            Self::Priority(s) => s.remove(&(key, idx)),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Self::Fcfs(q) => q.len(),
            Self::Priority(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn iter(&self) -> Box<dyn Iterator<Item = ReqIdx> + '_> {
        match self {
            Self::Fcfs(q) => Box::new(q.iter().copied()),
            Self::Priority(s) => Box::new(s.iter().map(|&(_, i)| i)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fcfs_puts_preempted_request_first() {
        let mut q = RequestQueue::new(SchedulingPolicy::Fcfs);
        q.push_back(1, (0, 1));
        q.push_back(2, (0, 2));
        q.push_front(3, (0, 3));
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![3, 1, 2]);
    }

    #[test]
    fn priority_orders_by_priority_then_arrival() {
        let mut q = RequestQueue::new(SchedulingPolicy::Priority);
        q.push_back(1, (5, 1));
        q.push_back(2, (0, 2));
        q.push_back(3, (0, 3));
        q.push_front(4, (5, 0));
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![2, 3, 4, 1]);
    }

    #[test]
    fn remove_takes_request_out_of_either_queue() {
        for policy in [SchedulingPolicy::Fcfs, SchedulingPolicy::Priority] {
            let mut q = RequestQueue::new(policy);
            q.push_back(1, (0, 1));
            q.push_back(2, (0, 2));
            assert!(q.remove(1, (0, 1)));
            assert!(!q.remove(1, (0, 1)));
            assert_eq!(q.pop(), Some(2));
            assert!(q.is_empty());
        }
    }
}
