//! A decode step through a whole stack of Llama-shaped decoder layers in one call.
//!
//! The model runner's layer-by-layer path calls a kernel per op from Python: ~10 calls per layer,
//! each with its argument checks, tensor allocations and torch dispatch around it. At batch 1 on
//! quantized weights the kernels' own work is small enough that this glue was half of a step
//! (SmolLM2-135M Q4_1: ~47% of a decode step outside the kernels, 2 threads), and the OpenMP team
//! fell asleep between kernels, so each product also paid a wake-up. Here the same kernels run
//! back to back, in the same order and with the same arguments, so the result is the layer path's
//! bit for bit.
//!
//! One layer, for `rows` tokens each at the end of its request (pre-norm Llama: Llama, Mistral,
//! Qwen2 with its q/k/v biases):
//!
//! ```text
//! x = rms_norm(hidden + residual)           (the first layer: residual = hidden)
//! qkv = x · W_qkvᵀ + b ; q, k = rotary(q, k) ; cache[slot] = k, v
//! hidden = attention(q, cache) · W_oᵀ
//! x = rms_norm(hidden + residual)
//! hidden = (silu(x · W_gateᵀ) * (x · W_upᵀ)) · W_downᵀ
//! ```
//!
//! The linear layers take any of the weight forms the CPU kernels compute from ([`Linear`]).
//! Activations, norms, the rotary table and the KV cache share one element type `T`: f32 (any
//! weight form) or bf16 (a bf16 model's packed bf16 weights; the quantized products take f32
//! only). Every kernel sums in f32 and rounds its output to `T`, as the layer path's calls do.
//! Scratch space is allocated once per call, a few rows wide.
//!
//! A step is decode rows (one token per request, the attention `attention::paged_decode`), or
//! any requests' rows (`DecodeStep::query_start_loc`): prompt chunks (the attention
//! `prefill::paged_prefill`) beside decode rows. A batch-1 prompt went through the layer path's
//! ~10 calls per layer as well (SmolLM2-135M: ~50 ms for 32 tokens, ~0.4 ms of each of 128
//! generated tokens), and so did every served step a new prompt joined (`decoder/attend.rs`).

use crate::activation::silu_and_mul;
use crate::element::{as_f32, as_f32_mut, Element};
use crate::error::{check_len, KernelError};
use crate::gemm::{gemm, gemm_silu_mul, GemmShape};
use crate::gemm_bf16::{gemm_bf16, Bf16Kernel};
use crate::norm::{fused_add_rms_norm, rms_norm, RmsNormWeight};
use crate::quant::matmul::{matmul_stacked_on, Activations, QuantWeight};
use crate::quant::w8a8::{w8a8_linear, ActQuant, W8a8Shape, W8a8Weight};
use crate::quant::wq::{wq_linear, WqShape, WqWeight};
use crate::quant::Isa;
use crate::simd::SimdElement;
use crate::Bf16;
use std::any::TypeId;

mod attend;
mod head;
use attend::{attention, check_requests, Requests};
pub use head::sample_tokens;

/// A linear layer's weight `[out_features, in_features]` in one of the CPU kernels' forms.
#[derive(Clone, Debug)]
pub enum Linear<'a> {
    /// GGUF blocks, several tensors stacked along the output features (q, k, v; gate, up), and
    /// how the activations meet them (`Activations::Residual` for an LM head).
    Gguf { weights: Vec<QuantWeight<'a>>, activations: Activations },
    /// Weight-only int4/int8 with group scales (GPTQ, AWQ, compressed-tensors W4A16/W8A16).
    Wq { weight: WqWeight<'a>, out_features: usize, in_features: usize, group_size: usize },
    /// int8 weights times int8 activations (compressed-tensors W8A8, `quantization="int8"`).
    W8a8 { weight: W8a8Weight<'a>, act: ActQuant, out_features: usize, in_features: usize },
    /// bf16 weights in the bf16 GEMM's packed form (`gemm_bf16::pack_weight_bf16`), multiplied by
    /// `kernel`.
    Bf16 { packed: &'a [Bf16], out_features: usize, in_features: usize, kernel: Bf16Kernel },
    /// f32 weights in the GEMM's packed form (`gemm::pack_weight`); `gated`: a `[gate, up]`
    /// projection packed as two halves for `gemm_silu_mul` (`out_features` counts both).
    F32 { packed: &'a [f32], out_features: usize, in_features: usize, gated: bool },
}

impl Linear<'_> {
    pub fn out_features(&self) -> usize {
        match self {
            Linear::Gguf { weights, .. } => weights.iter().map(|w| w.out_features).sum(),
            Linear::Wq { out_features, .. }
            | Linear::W8a8 { out_features, .. }
            | Linear::Bf16 { out_features, .. }
            | Linear::F32 { out_features, .. } => *out_features,
        }
    }

    pub fn in_features(&self) -> usize {
        match self {
            Linear::Gguf { weights, .. } => weights.first().map_or(0, |w| w.in_features),
            Linear::Wq { in_features, .. }
            | Linear::W8a8 { in_features, .. }
            | Linear::Bf16 { in_features, .. }
            | Linear::F32 { in_features, .. } => *in_features,
        }
    }

    /// `out = x · Wᵀ + bias` for `rows` rows.
    ///
    /// # Errors
    /// Mis-sized buffers, bf16 activations for a quantized or f32 weight, or a gated f32 weight
    /// (its product exists only fused with the activation: `silu_and_mul`).
    pub fn forward<T: Element>(
        &self,
        x: &[T],
        rows: usize,
        bias: Option<&[T]>,
        out: &mut [T],
        threads: usize,
    ) -> Result<(), KernelError> {
        if let Linear::Bf16 { packed, out_features, in_features, kernel } = *self {
            let shape = GemmShape { rows, out_features, in_features };
            return gemm_bf16(x, packed, bias, out, shape, kernel, threads);
        }
        let (x, out) = f32_activations(x, out)?;
        let bias = bias.and_then(as_f32);
        match *self {
            Linear::Gguf { ref weights, activations } => {
                matmul_stacked_on(Isa::detect(), activations, weights, x, rows, bias, out, threads)
            }
            Linear::Wq { weight, out_features, in_features, group_size } => {
                let shape = WqShape { rows, out_features, in_features, group_size };
                wq_linear(x, weight, bias, out, shape, threads)
            }
            Linear::W8a8 { weight, act, out_features, in_features } => {
                let shape = W8a8Shape { rows, out_features, in_features };
                w8a8_linear(x, weight, bias, act, out, shape, threads)
            }
            Linear::F32 { packed, out_features, in_features, gated: false } => {
                gemm(x, packed, bias, out, GemmShape { rows, out_features, in_features }, threads)
            }
            Linear::F32 { gated: true, .. } => {
                let limit = "a plain f32 weight (a gated one runs through silu_and_mul)".to_string();
                Err(KernelError::Param { name: "weight", limit, value: "gated".into() })
            }
            Linear::Bf16 { .. } => unreachable!("taken above"),
        }
    }

    /// `out = silu(gate) · up` of this `[gate, up]` projection of `x`: in one kernel where the
    /// weight is packed for it (a gated f32 weight), else the product into `gate_up` (`[rows,
    /// out_features]`) and the activation apart; the values are bit for bit the same.
    fn silu_and_mul<T: Element>(
        &self,
        x: &[T],
        rows: usize,
        gate_up: &mut [T],
        out: &mut [T],
        threads: usize,
    ) -> Result<(), KernelError> {
        if let Linear::F32 { packed, out_features, in_features, gated: true } = *self {
            let (x, out) = f32_activations(x, out)?;
            let shape = GemmShape { rows, out_features: out_features / 2, in_features };
            return gemm_silu_mul(x, packed, None, out, shape, threads);
        }
        self.forward(x, rows, None, gate_up, threads)?;
        silu_and_mul(gate_up, self.out_features() / 2, out, threads)
    }
}

/// `x` and `out` as f32, which every product but the bf16 GEMM takes.
fn f32_activations<'a, T: Element>(
    x: &'a [T],
    out: &'a mut [T],
) -> Result<(&'a [f32], &'a mut [f32]), KernelError> {
    match (as_f32(x), as_f32_mut(out)) {
        (Some(x), Some(out)) => Ok((x, out)),
        _ => {
            let limit = "float32 activations for a quantized or float32 weight".to_string();
            Err(KernelError::Param { name: "activations", limit, value: "bfloat16".into() })
        }
    }
}

/// One decoder layer's weights; norms and bias in the activations' element type.
#[derive(Clone, Debug)]
pub struct DecoderLayer<'a, T = f32> {
    /// `[hidden]`, before attention.
    pub input_norm: &'a [T],
    /// `[hidden]`, before the MLP.
    pub post_attention_norm: &'a [T],
    /// q, k and v side by side: `[(num_heads + 2 num_kv_heads) head_dim, hidden]`.
    pub qkv: Linear<'a>,
    pub qkv_bias: Option<&'a [T]>,
    /// `[hidden, num_heads head_dim]`.
    pub o: Linear<'a>,
    /// gate and up side by side: `[2 intermediate, hidden]`.
    pub gate_up: Linear<'a>,
    /// `[hidden, intermediate]`.
    pub down: Linear<'a>,
}

/// Sizes and settings every layer shares.
#[derive(Clone, Copy, Debug)]
pub struct DecoderShape {
    pub hidden: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Leading elements of each head that rotate (NeoX style).
    pub rotary_dim: usize,
    pub intermediate: usize,
    /// The norms' epsilon.
    pub eps: f32,
    /// Multiplier of `q · k`.
    pub scale: f32,
}

impl DecoderShape {
    fn q_size(&self) -> usize {
        self.num_heads * self.head_dim
    }

    fn kv_size(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    fn qkv_size(&self) -> usize {
        self.q_size() + 2 * self.kv_size()
    }
}

/// One layer's paged KV cache, `[num_blocks, block_size, num_kv_heads, head_dim]` each.
pub struct LayerCache<'a, T = f32> {
    pub key: &'a mut [T],
    pub value: &'a mut [T],
}

/// The step: one token per row, at the end of its request; or any requests' next rows
/// (`query_start_loc`): prompt chunks beside decode rows, as a served step mixes them.
#[derive(Clone, Copy, Debug)]
pub struct DecodeStep<'a, T = f32> {
    /// `[rows]` positions of the tokens.
    pub positions: &'a [i64],
    /// `[rows]` cache slots the tokens' keys and values go to.
    pub slot_mapping: &'a [i64],
    /// `[requests, max_blocks_per_seq]`.
    pub block_tables: &'a [i32],
    pub max_blocks_per_seq: usize,
    /// `[requests]` context lengths, the step's tokens included.
    pub seq_lens: &'a [i32],
    /// `None`: one row per request, at the end of its context (decode rows). `Some(starts)`:
    /// `[requests + 1]` cumulative rows (vLLM's `query_start_loc`): request `r`'s rows are
    /// `starts[r]..starts[r + 1]`, the last of its `seq_lens[r]` context tokens; a request of
    /// several rows (a prompt chunk) attends causally among them and its cached tokens.
    pub query_start_loc: Option<&'a [i32]>,
    /// Tokens per KV block.
    pub block_size: usize,
    /// `[max_position, rotary_dim]`: cosines, then sines.
    pub cos_sin: &'a [T],
}

/// Runs `layers` over `hidden` (`[rows, hidden]`, the embeddings), leaving the last layer's
/// output in `hidden` and the residual stream in `residual` (the model's final norm adds them);
/// with `final_norm` (`[hidden]`), that norm is applied here: `hidden` gets the normed sum and
/// `residual` the sum, as the layer path's last `fused_add_rms_norm` gives them, and the step
/// spends no call from Python on it. Every layer's weights and cache are checked before any
/// cache is written.
#[allow(clippy::too_many_arguments)]
pub fn decode_layers<T: SimdElement>(
    layers: &[DecoderLayer<'_, T>],
    final_norm: Option<&[T]>,
    caches: &mut [LayerCache<'_, T>],
    shape: DecoderShape,
    step: DecodeStep<'_, T>,
    hidden: &mut [T],
    residual: &mut [T],
    threads: usize,
) -> Result<(), KernelError> {
    let rows = step.positions.len();
    check(layers, caches, &shape, &step, hidden.len(), residual.len())?;
    if let Some(norm) = final_norm {
        check_len("final_norm", norm.len(), shape.hidden)?;
    }
    if rows == 0 {
        return Ok(());
    }
    let mut scratch = Scratch::new(rows, &shape);
    let requests = Requests::new(&step);
    for (i, (layer, cache)) in layers.iter().zip(caches.iter_mut()).enumerate() {
        let input_norm = RmsNormWeight { weight: layer.input_norm, eps: shape.eps, gemma: false };
        if i == 0 {
            scratch.stream.copy_from_slice(hidden);
            rms_norm(hidden, input_norm, &mut scratch.normed, threads)?;
        } else {
            add_norm(hidden, input_norm, &mut scratch, threads)?;
        }
        attention(layer, cache, &shape, &step, &requests, &mut scratch, threads)?;
        layer.o.forward(&scratch.attn, rows, None, hidden, threads)?;
        let post_norm = RmsNormWeight { weight: layer.post_attention_norm, eps: shape.eps, gemma: false };
        add_norm(hidden, post_norm, &mut scratch, threads)?;
        layer.gate_up.silu_and_mul(&scratch.normed, rows, &mut scratch.gate_up, &mut scratch.act, threads)?;
        layer.down.forward(&scratch.act, rows, None, hidden, threads)?;
    }
    if let Some(weight) = final_norm {
        add_norm(hidden, RmsNormWeight { weight, eps: shape.eps, gemma: false }, &mut scratch, threads)?;
        hidden.copy_from_slice(&scratch.normed);
    }
    residual.copy_from_slice(&scratch.stream);
    Ok(())
}

/// Per-call buffers, each `rows` rows wide.
struct Scratch<T> {
    normed: Vec<T>,
    /// The residual stream, and the buffer its next value is written to.
    stream: Vec<T>,
    next: Vec<T>,
    qkv: Vec<T>,
    q: Vec<T>,
    k: Vec<T>,
    attn: Vec<T>,
    gate_up: Vec<T>,
    act: Vec<T>,
}

impl<T: Element> Scratch<T> {
    fn new(rows: usize, s: &DecoderShape) -> Self {
        let zeros = |width: usize| vec![T::from_f32(0.0); rows * width];
        Scratch {
            normed: zeros(s.hidden),
            stream: zeros(s.hidden),
            next: zeros(s.hidden),
            qkv: zeros(s.qkv_size()),
            q: zeros(s.q_size()),
            k: zeros(s.kv_size()),
            attn: zeros(s.q_size()),
            gate_up: zeros(2 * s.intermediate),
            act: zeros(s.intermediate),
        }
    }
}

/// `stream += hidden; scratch.normed = norm(stream)`: the sum goes to `next`, which then becomes
/// the stream (a swap, not a copy).
fn add_norm<T: Element>(
    hidden: &[T],
    norm: RmsNormWeight<'_, T>,
    scratch: &mut Scratch<T>,
    threads: usize,
) -> Result<(), KernelError> {
    fused_add_rms_norm(hidden, &scratch.stream, norm, &mut scratch.normed, &mut scratch.next, threads)?;
    std::mem::swap(&mut scratch.stream, &mut scratch.next);
    Ok(())
}

/// The sizes that the kernels would only find wrong halfway through the stack.
fn check<T: 'static>(
    layers: &[DecoderLayer<'_, T>],
    caches: &[LayerCache<'_, T>],
    s: &DecoderShape,
    step: &DecodeStep<'_, T>,
    hidden_len: usize,
    residual_len: usize,
) -> Result<(), KernelError> {
    let rows = step.positions.len();
    check_len("caches", caches.len(), layers.len())?;
    check_len("hidden", hidden_len, rows * s.hidden)?;
    check_len("residual", residual_len, rows * s.hidden)?;
    check_len("slot_mapping", step.slot_mapping.len(), rows)?;
    check_requests(s, step)?;
    if s.rotary_dim > s.head_dim || !s.rotary_dim.is_multiple_of(2) {
        let limit = format!("even and at most head_dim ({})", s.head_dim);
        return Err(KernelError::Value { name: "rotary_dim", limit, value: s.rotary_dim as i64 });
    }
    let max_position = step.cos_sin.len() / s.rotary_dim.max(1);
    if let Some(&p) = step.positions.iter().find(|&&p| p < 0 || p as usize >= max_position) {
        let limit = format!("in 0..{max_position} (the rotary table's positions)");
        return Err(KernelError::Value { name: "positions", limit, value: p });
    }
    for layer in layers {
        check_len("input_norm", layer.input_norm.len(), s.hidden)?;
        check_len("post_attention_norm", layer.post_attention_norm.len(), s.hidden)?;
        for (name, linear, out, inp) in [
            ("qkv", &layer.qkv, s.qkv_size(), s.hidden),
            ("o", &layer.o, s.hidden, s.q_size()),
            ("gate_up", &layer.gate_up, 2 * s.intermediate, s.hidden),
            ("down", &layer.down, s.hidden, s.intermediate),
        ] {
            check_len(name, linear.out_features(), out)?;
            check_len(name, linear.in_features(), inp)?;
            if TypeId::of::<T>() != TypeId::of::<f32>() && !matches!(linear, Linear::Bf16 { .. }) {
                let limit = "bf16 weights with bf16 activations (the other products take f32)".to_string();
                return Err(KernelError::Param { name, limit, value: "a quantized or f32 weight".into() });
            }
            if matches!(linear, Linear::F32 { gated: true, .. }) && name != "gate_up" {
                let limit = "a plain f32 weight (only gate_up is gated)".to_string();
                return Err(KernelError::Param { name, limit, value: "gated".into() });
            }
        }
        if let Some(bias) = layer.qkv_bias {
            check_len("qkv_bias", bias.len(), s.qkv_size())?;
        }
    }
    // Slots are checked by `write_kv` before it writes; a bad one in layer 0 leaves every cache
    // as it was, and every layer is given the same slots.
    Ok(())
}

#[cfg(test)]
mod tests;
