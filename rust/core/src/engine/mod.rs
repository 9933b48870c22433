//! The engine handle a program drives: [`EngineCore`] runs schedule -> execute -> update with a
//! [`ModelRunner`]; [`AsyncEngine`] runs that loop on a tokio runtime with per-request streams.

mod async_engine;
mod core;
mod output;

pub use self::async_engine::{AsyncEngine, RequestStream};
pub use self::core::{EngineCore, ModelRunner};
pub use self::output::RequestOutput;
