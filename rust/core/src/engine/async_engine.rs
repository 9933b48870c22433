//! [`AsyncEngine`]: the step loop on a tokio runtime. Any number of tasks submit requests while
//! the loop runs; each request's outputs stream back on its own channel as tokens are produced.
//!
//! The loop task is the single owner of the [`EngineCore`] and the runner; tasks talk to it over
//! an unbounded command channel, so no lock guards the core. Each step runs on tokio's blocking
//! pool (model execution is CPU/GPU bound) and the loop sleeps on the channel when idle. A runner
//! error ends the loop and is delivered to every open stream.

use std::collections::HashMap;

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::core::{EngineCore, ModelRunner};
use super::output::RequestOutput;
use crate::error::{CoreError, CoreResult};
use crate::request::EngineRequest;

type OutputSender = mpsc::UnboundedSender<CoreResult<RequestOutput>>;

enum Command {
    Add(Box<EngineRequest>, OutputSender, oneshot::Sender<CoreResult<()>>),
    Abort(String),
}

/// One request's outputs, in order; the last one has `finished == true`.
pub struct RequestStream {
    rx: mpsc::UnboundedReceiver<CoreResult<RequestOutput>>,
}

impl RequestStream {
    /// The next output, `None` once the final one has been received.
    pub async fn next(&mut self) -> Option<CoreResult<RequestOutput>> {
        self.rx.recv().await
    }
}

/// Handle to a running step loop. Cheap to share by reference across tasks.
pub struct AsyncEngine {
    commands: mpsc::UnboundedSender<Command>,
    task: JoinHandle<CoreResult<()>>,
}

impl AsyncEngine {
    /// Starts the loop on the current tokio runtime. The core should be built with
    /// `stream_outputs: true` for per-token deltas; otherwise each stream gets one final output.
    pub fn start<R: ModelRunner + Send + 'static>(core: EngineCore, runner: R) -> Self {
        let (commands, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(run_loop(core, runner, rx));
        Self { commands, task }
    }

    /// Submits a request; fails if the request is invalid or the loop has stopped.
    pub async fn submit(&self, req: EngineRequest) -> CoreResult<RequestStream> {
        let (tx, rx) = mpsc::unbounded_channel();
        let (ack, acked) = oneshot::channel();
        self.commands.send(Command::Add(Box::new(req), tx, ack)).map_err(|_| CoreError::EngineClosed)?;
        acked.await.map_err(|_| CoreError::EngineClosed)??;
        Ok(RequestStream { rx })
    }

    /// Aborts a request; its stream ends with a final output whose finish reason is "abort".
    pub fn abort(&self, request_id: &str) {
        let _ = self.commands.send(Command::Abort(request_id.to_string()));
    }

    /// Stops accepting requests, lets the running ones finish and waits for the loop to end.
    pub async fn shutdown(self) -> CoreResult<()> {
        drop(self.commands);
        self.task.await.map_err(|e| CoreError::Runner(format!("step loop panicked: {e}")))?
    }
}

struct LoopState<R> {
    core: EngineCore,
    runner: R,
    sinks: HashMap<String, OutputSender>,
}

async fn run_loop<R: ModelRunner + Send + 'static>(
    core: EngineCore,
    runner: R,
    mut rx: mpsc::UnboundedReceiver<Command>,
) -> CoreResult<()> {
    let mut st = Some(LoopState { core, runner, sinks: HashMap::new() });
    let mut open = true;
    loop {
        let state = st.as_mut().expect("state is returned after every step");
        while let Ok(cmd) = rx.try_recv() {
            handle(state, cmd);
        }
        if !state.core.has_unfinished_requests() {
            if !open {
                return Ok(());
            }
            match rx.recv().await {
                Some(cmd) => handle(state, cmd),
                None => open = false,
            }
            continue;
        }
        let mut owned = st.take().expect("state present");
        let (back, result) = tokio::task::spawn_blocking(move || {
            let result = owned.core.step(&mut owned.runner);
            (owned, result)
        })
        .await
        .map_err(|e| CoreError::Runner(format!("step panicked: {e}")))?;
        let state = st.insert(back);
        match result {
            Ok(outputs) => route(state, outputs),
            Err(e) => {
                for (_, sink) in state.sinks.drain() {
                    let _ = sink.send(Err(e.clone()));
                }
                return Err(e);
            }
        }
    }
}

fn handle<R>(state: &mut LoopState<R>, cmd: Command) {
    match cmd {
        Command::Add(req, sink, ack) => {
            let id = req.request_id.clone();
            let result = state.core.add_request(*req);
            if result.is_ok() {
                state.sinks.insert(id, sink);
            }
            let _ = ack.send(result);
        }
        Command::Abort(id) => {
            state.core.abort_requests(&[id]);
        }
    }
}

/// Sends each output to its stream; a dropped stream aborts its request.
fn route<R>(state: &mut LoopState<R>, outputs: Vec<RequestOutput>) {
    let mut gone = Vec::new();
    for out in outputs {
        let id = out.request_id.clone();
        let finished = out.finished;
        let delivered = state.sinks.get(&id).is_some_and(|s| s.send(Ok(out)).is_ok());
        if finished {
            state.sinks.remove(&id);
        } else if !delivered {
            gone.push(id);
        }
    }
    if !gone.is_empty() {
        state.core.abort_requests(&gone);
    }
}
