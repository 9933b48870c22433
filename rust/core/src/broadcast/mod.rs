//! The broadcast of each step from rank 0's core to the other tensor-parallel ranks' runners.
//!
//! Rank 0 owns a [`StepBroadcaster`]: each step's [`SchedulerOutput`](crate::scheduler::SchedulerOutput)
//! is written in a flat binary layout ([`codec`]) into a shared-memory slot that every worker
//! rank's [`StepReceiver`] reads and acknowledges. Nothing is pickled or sent over a socket per
//! step; rare commands travel elsewhere and are only announced here ([`StepMessage::Control`]).
//! The channel is node-local by construction (shared memory).

mod channel;
pub mod codec;

pub use channel::{AbortHandle, StepBroadcaster, StepMessage, StepReceiver, MAX_READERS};
