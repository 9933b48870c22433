//! `CpuDecoder`: a model's decoder layers for `ferrollm_kernels::decoder::decode_layers`, built
//! once at load from the weights' addresses, then run once per decode step.
//!
//! Buffers cross as `(data_ptr, numel)` pairs, as in `cpu_kernels`. The one caller,
//! `ferrollm.kernels.cpu.decoder`, keeps every weight it described referenced for as long as
//! this object lives, and passes each step's tensors (contiguous, of the dtypes named below) for
//! the duration of `run`. A linear layer is described by a tuple whose first item names its form:
//!
//! - `("gguf", in_features, [(ggml_type, weight, row_stride, out_features), ...], residual=False)`:
//!   stacked GGUF blocks, as `cpu_gguf_linear` takes them (`residual`: the activations' residual
//!   too, as an LM head's);
//! - `("wq", bits, qweight, scales, mins | None, out_features, in_features, group_size)`: as
//!   `cpu_wq_linear`;
//! - `("w8a8", packed, weight_scale, input_scale | None, input_zero_point, out_features,
//!   in_features)`: as `cpu_w8a8_linear`;
//! - `("bf16", packed, out_features, in_features, kernel)`: as `cpu_gemm_bf16`;
//! - `("f32", packed, out_features, in_features, gated)`: as `cpu_gemm` (`gated`: the two halves
//!   of a `[gate, up]` pack, as `cpu_gemm_silu_mul`).
//!
//! The activations, norms, bias, rotary table and caches are all `dtype`: `float32`, or
//! `bfloat16` where every linear layer is `"bf16"`.

use ferrollm_kernels::decoder::{
    decode_layers, sample_tokens, DecodeStep, DecoderLayer, DecoderShape, LayerCache, Linear,
};
use ferrollm_kernels::gemm_bf16::Bf16Kernel;
use ferrollm_kernels::openmp;
use ferrollm_kernels::quant::w8a8::{ActQuant, W8a8Weight};
use ferrollm_kernels::quant::wq::{QWeight, WqWeight};
use ferrollm_kernels::quant::{Activations, GgmlType, QuantWeight};
use ferrollm_kernels::{Bf16, SimdElement};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::buffers::{view, view_mut, Buffer};
use crate::errors::{kernel_error, raise};
use crate::gguf::WeightSpec;

/// A linear layer's form and where its tensors are.
#[derive(Clone)]
enum LinearSpec {
    Gguf { in_features: usize, weights: Vec<(GgmlType, Buffer, usize, usize, bool)>, residual: bool },
    Wq { bits: u32, q: Buffer, scales: Buffer, mins: Option<Buffer>, out: usize, inp: usize, group: usize },
    W8a8 { packed: Buffer, scale: Buffer, act: ActQuant, out: usize, inp: usize },
    Bf16 { packed: Buffer, out: usize, inp: usize, kernel: Bf16Kernel },
    F32 { packed: Buffer, out: usize, inp: usize, gated: bool },
}

impl LinearSpec {
    fn parse(spec: &Bound<'_, PyTuple>) -> PyResult<Self> {
        let form: String = spec.get_item(0)?.extract()?;
        let rest = spec.get_slice(1, spec.len());
        Ok(match form.as_str() {
            "gguf" => {
                let (in_features, raw): (usize, Vec<WeightSpec>) = rest.get_slice(0, 2).extract()?;
                let residual = rest.len() > 2 && rest.get_item(2)?.extract::<bool>()?;
                let mut weights = Vec::with_capacity(raw.len());
                for (id, data, stride, out, interleaved) in raw {
                    let Some(t) = GgmlType::from_id(id) else {
                        return Err(raise("KernelError", format!("GGML type {id} has no block product")));
                    };
                    weights.push((t, data, stride, out, interleaved));
                }
                LinearSpec::Gguf { in_features, weights, residual }
            }
            "wq" => {
                let (bits, q, scales, mins, out, inp, group) = rest.extract()?;
                if bits != 4 && bits != 8 {
                    return Err(raise("KernelError", format!("`bits` must be 4 or 8. Given: {bits}")));
                }
                LinearSpec::Wq { bits, q, scales, mins, out, inp, group }
            }
            "w8a8" => {
                let (packed, scale, input_scale, zero_point, out, inp): (_, _, Option<f32>, i32, _, _) =
                    rest.extract()?;
                let act =
                    input_scale.map_or(ActQuant::Dynamic, |scale| ActQuant::Static { scale, zero_point });
                LinearSpec::W8a8 { packed, scale, act, out, inp }
            }
            "bf16" => {
                let (packed, out, inp, kernel): (_, _, _, String) = rest.extract()?;
                let Some(kernel) = Bf16Kernel::from_name(&kernel) else {
                    return Err(raise("KernelError", format!("no bf16 GEMM kernel named '{kernel}'")));
                };
                LinearSpec::Bf16 { packed, out, inp, kernel }
            }
            "f32" => {
                let (packed, out, inp, gated) = rest.extract()?;
                LinearSpec::F32 { packed, out, inp, gated }
            }
            other => {
                let msg = format!(
                    "a linear layer's form must be 'gguf', 'wq', 'w8a8', 'bf16' or 'f32'. Given: '{other}'"
                );
                return Err(raise("KernelError", msg));
            }
        })
    }

    /// # Safety
    /// The buffers must still be live (see the module doc).
    unsafe fn linear(&self) -> Linear<'_> {
        match *self {
            LinearSpec::Gguf { in_features, ref weights, residual } => Linear::Gguf {
                weights: weights
                    .iter()
                    .map(|&(ggml_type, data, row_stride, out_features, interleaved)| QuantWeight {
                        ggml_type,
                        data: view::<u8>(data),
                        row_stride,
                        out_features,
                        in_features,
                        interleaved,
                    })
                    .collect(),
                activations: if residual { Activations::Residual } else { Activations::Int8 },
            },
            LinearSpec::Wq { bits, q, scales, mins, out, inp, group } => {
                let q = if bits == 4 { QWeight::Int4(view::<u8>(q)) } else { QWeight::Int8(view::<i8>(q)) };
                let weight = WqWeight { q, scales: view(scales), mins: mins.map(|m| view(m)) };
                Linear::Wq { weight, out_features: out, in_features: inp, group_size: group }
            }
            LinearSpec::W8a8 { packed, scale, act, out, inp } => {
                let weight = W8a8Weight { packed: view(packed), weight_scale: view(scale) };
                Linear::W8a8 { weight, act, out_features: out, in_features: inp }
            }
            LinearSpec::Bf16 { packed, out, inp, kernel } => {
                Linear::Bf16 { packed: view(packed), out_features: out, in_features: inp, kernel }
            }
            LinearSpec::F32 { packed, out, inp, gated } => {
                Linear::F32 { packed: view(packed), out_features: out, in_features: inp, gated }
            }
        }
    }
}

#[derive(Clone)]
struct LayerSpec {
    input_norm: Buffer,
    post_attention_norm: Buffer,
    qkv: LinearSpec,
    qkv_bias: Option<Buffer>,
    o: LinearSpec,
    gate_up: LinearSpec,
    down: LinearSpec,
}

type LayerArgs<'py> = (
    Buffer,
    Buffer,
    Bound<'py, PyTuple>,
    Option<Buffer>,
    Bound<'py, PyTuple>,
    Bound<'py, PyTuple>,
    Bound<'py, PyTuple>,
);

#[pyclass(name = "CpuDecoder", module = "ferrollm._core", frozen)]
pub struct PyCpuDecoder {
    shape: DecoderShape,
    layers: Vec<LayerSpec>,
    /// The model's final norm (`[hidden]`, of `dtype`), applied after the last layer.
    final_norm: Option<Buffer>,
    /// The LM head and the vocabulary's size, for `run`'s sampled tokens.
    lm_head: Option<(LinearSpec, usize)>,
    bf16: bool,
}

#[pymethods]
impl PyCpuDecoder {
    /// `layers`: per layer `(input_norm, post_attention_norm, qkv, qkv_bias | None, o, gate_up,
    /// down)`, norms and bias of `dtype`, the linear layers as the module doc describes;
    /// `final_norm`: the model's norm after the last layer (see `decode_layers`), or None;
    /// `lm_head`: `(linear layer, vocab)`, the head `run` samples tokens from, or None.
    #[new]
    #[pyo3(signature = (hidden, num_heads, num_kv_heads, head_dim, rotary_dim, intermediate, eps, scale, layers, dtype = "float32", final_norm = None, lm_head = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        hidden: usize,
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        rotary_dim: usize,
        intermediate: usize,
        eps: f32,
        scale: f32,
        layers: Vec<LayerArgs<'_>>,
        dtype: &str,
        final_norm: Option<Buffer>,
        lm_head: Option<(Bound<'_, PyTuple>, usize)>,
    ) -> PyResult<Self> {
        let bf16 = match dtype {
            "float32" => false,
            "bfloat16" => true,
            other => {
                return Err(raise(
                    "KernelError",
                    format!("`dtype` must be 'float32' or 'bfloat16'. Given: '{other}'"),
                ))
            }
        };
        let shape =
            DecoderShape { hidden, num_heads, num_kv_heads, head_dim, rotary_dim, intermediate, eps, scale };
        let layers = layers
            .into_iter()
            .map(|(input_norm, post_attention_norm, qkv, qkv_bias, o, gate_up, down)| {
                Ok(LayerSpec {
                    input_norm,
                    post_attention_norm,
                    qkv: LinearSpec::parse(&qkv)?,
                    qkv_bias,
                    o: LinearSpec::parse(&o)?,
                    gate_up: LinearSpec::parse(&gate_up)?,
                    down: LinearSpec::parse(&down)?,
                })
            })
            .collect::<PyResult<_>>()?;
        let lm_head =
            lm_head.map(|(spec, vocab)| LinearSpec::parse(&spec).map(|s| (s, vocab))).transpose()?;
        Ok(Self { shape, layers, final_norm, lm_head, bf16 })
    }

    /// The number of layers.
    fn __len__(&self) -> usize {
        self.layers.len()
    }

    /// One decode step (see `decode_layers`): `hidden` (`[rows, hidden]`, the embeddings,
    /// overwritten with the last layer's output, normed by the final norm where there is one),
    /// `residual` (written), `positions` and
    /// `slot_mapping` int64 `[rows]`, `block_tables` int32 `[rows, max_blocks_per_seq]`,
    /// `seq_lens` int32 `[rows]`, `cos_sin`, and each layer's `(key_cache, value_cache)`; the
    /// float tensors all of the decoder's `dtype`. `query_start_loc`: int32 `[requests + 1]`,
    /// the rows are instead any requests' next tokens, prompt chunks among them (`block_tables`
    /// and `seq_lens` one row per request). `sample`: `(logits, tokens, uniforms | None)`, the LM head's
    /// product of the normed rows (`[rows, head out_features]`, of `dtype`, scratch) and each
    /// row's token (int64 `[rows]`, written): the greedy one, or the one drawn at its float64
    /// uniform number (see `sample_tokens`); for a decoder built with a final norm and an LM head.
    #[pyo3(signature = (hidden, residual, positions, slot_mapping, block_tables, max_blocks_per_seq, seq_lens, block_size, cos_sin, caches, threads, query_start_loc=None, sample=None))]
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        py: Python<'_>,
        hidden: Buffer,
        residual: Buffer,
        positions: Buffer,
        slot_mapping: Buffer,
        block_tables: Buffer,
        max_blocks_per_seq: usize,
        seq_lens: Buffer,
        block_size: usize,
        cos_sin: Buffer,
        caches: Vec<(Buffer, Buffer)>,
        threads: usize,
        query_start_loc: Option<Buffer>,
        sample: Option<SampleBuffers>,
    ) -> PyResult<()> {
        if sample.is_some() && (self.lm_head.is_none() || self.final_norm.is_none()) {
            let msg = "`sample` needs a decoder built with `final_norm` and `lm_head`";
            return Err(raise("KernelError", msg.to_string()));
        }
        let step = StepBuffers {
            positions,
            slot_mapping,
            block_tables,
            max_blocks_per_seq,
            seq_lens,
            block_size,
            query_start_loc,
            sample,
        };
        // SAFETY: the weights are live while `self` is (the caller's promise, see the module
        // doc); the step's buffers for this call. `hidden`, `residual` and the caches are
        // distinct tensors that nothing else reads or writes meanwhile.
        unsafe {
            if self.bf16 {
                self.run_as::<Bf16>(py, hidden, residual, step, cos_sin, caches, threads)
            } else {
                self.run_as::<f32>(py, hidden, residual, step, cos_sin, caches, threads)
            }
        }
    }
}

/// A step's integer buffers and sizes, as `run` receives them.
struct StepBuffers {
    positions: Buffer,
    slot_mapping: Buffer,
    block_tables: Buffer,
    max_blocks_per_seq: usize,
    seq_lens: Buffer,
    block_size: usize,
    query_start_loc: Option<Buffer>,
    sample: Option<SampleBuffers>,
}

/// `run`'s `sample`: logits (scratch), tokens, and the uniform numbers of a random draw.
type SampleBuffers = (Buffer, Buffer, Option<Buffer>);

impl PyCpuDecoder {
    /// `run` with the float buffers read as `T`.
    ///
    /// # Safety
    /// As `run`'s (see there).
    #[allow(clippy::too_many_arguments)]
    unsafe fn run_as<T: SimdElement>(
        &self,
        py: Python<'_>,
        hidden: Buffer,
        residual: Buffer,
        step: StepBuffers,
        cos_sin: Buffer,
        caches: Vec<(Buffer, Buffer)>,
        threads: usize,
    ) -> PyResult<()> {
        let layers: Vec<DecoderLayer<'_, T>> = self.layers.iter().map(|l| l.layer()).collect();
        let mut caches: Vec<LayerCache<'_, T>> =
            caches.into_iter().map(|(k, v)| LayerCache { key: view_mut(k), value: view_mut(v) }).collect();
        let decode = DecodeStep {
            positions: view(step.positions),
            slot_mapping: view(step.slot_mapping),
            block_tables: view(step.block_tables),
            max_blocks_per_seq: step.max_blocks_per_seq,
            seq_lens: view(step.seq_lens),
            block_size: step.block_size,
            cos_sin: view(cos_sin),
            query_start_loc: step.query_start_loc.map(|b| view::<i32>(b)),
        };
        let (hidden, residual) = (view_mut::<T>(hidden), view_mut::<T>(residual));
        let final_norm = self.final_norm.map(|b| view::<T>(b));
        let head = self.lm_head.as_ref().map(|(spec, vocab)| (spec.linear(), *vocab));
        let sample = step.sample.map(|(logits, tokens, uniforms)| {
            (view_mut::<T>(logits), view_mut::<i64>(tokens), uniforms.map(|u| view::<f64>(u)))
        });
        // One OpenMP region for the whole call: its kernels (~150 on SmolLM2-135M) hand their work
        // to a team already running instead of each opening a region. Alternating in one process
        // on the 2-core VM: 0.30 ms less per step on a 30-layer model of tiny weights (1.12 against
        // 1.42 ms), 0.15 ms of SmolLM2-135M Q4_1's ~7.9 ms.
        py.detach(|| {
            openmp::hold(threads, || {
                decode_layers(
                    &layers,
                    final_norm,
                    &mut caches,
                    self.shape,
                    decode,
                    hidden,
                    residual,
                    threads,
                )?;
                match (sample, head) {
                    (Some((logits, tokens, uniforms)), Some((head, vocab))) => {
                        sample_tokens(&head, hidden, vocab, logits, uniforms, tokens, threads)
                    }
                    _ => Ok(()),
                }
            })
        })
        .map_err(kernel_error)
    }
}

impl LayerSpec {
    /// # Safety
    /// As [`LinearSpec::linear`].
    unsafe fn layer<T>(&self) -> DecoderLayer<'_, T> {
        DecoderLayer {
            input_norm: view(self.input_norm),
            post_attention_norm: view(self.post_attention_norm),
            qkv: self.qkv.linear(),
            qkv_bias: self.qkv_bias.map(|b| view(b)),
            o: self.o.linear(),
            gate_up: self.gate_up.linear(),
            down: self.down.linear(),
        }
    }
}
