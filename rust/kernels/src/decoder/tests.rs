//! The stack against an f64 recomputation of the whole sequence, token by token, with int8
//! weights (exact in f32, so only the float sums differ); in bf16 with the same weights packed
//! for the bf16 GEMM; its argument checks in `refusals`.

use super::*;
use crate::gemm::{pack_weight, packed_len};
use crate::gemm_bf16::{pack_weight_bf16, packed_len_bf16};
use crate::quant::wq::QWeight;
use crate::test_support::{linear, reference_attention, values};

const HIDDEN: usize = 32;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const DIM: usize = 64;
const ROTARY: usize = 32;
const INTER: usize = 48;
const BLOCK: usize = 4;
const MAX_POS: usize = 32;
const BLOCKS_PER_SEQ: usize = 8;

/// An int8 weight `[out, in]` with one scale per row, as the kernel and the reference see it.
struct Int8 {
    q: Vec<i8>,
    scales: Vec<f32>,
    out: usize,
    inp: usize,
}

impl Int8 {
    fn new(out: usize, inp: usize, seed: u32) -> Self {
        let q = values(out * inp, seed).iter().map(|v| (v * 127.0).round() as i8).collect();
        let scales = values(out, seed + 1).iter().map(|v| 0.02 + 0.01 * v.abs()).collect();
        Int8 { q, scales, out, inp }
    }

    /// Scales of 2^-9: every weight (7 significant bits) is exact in bf16, and attention logits
    /// stay near 1 (bf16 rounds a logit of 100 by 0.25: a different softmax).
    fn exact_in_bf16(out: usize, inp: usize, seed: u32) -> Self {
        Int8 { scales: vec![1.0 / 512.0; out], ..Int8::new(out, inp, seed) }
    }

    /// The weight packed for the f32 GEMM; `gated`: each half on its own (a `[gate, up]` pack).
    fn packed_f32(&self, gated: bool) -> Vec<f32> {
        let dense = self.dense();
        let parts = if gated { 2 } else { 1 };
        let (width, len) = (self.out / parts, packed_len(self.out / parts, self.inp));
        let mut packed = vec![0.0; parts * len];
        for (half, out) in dense.chunks_exact(width * self.inp).zip(packed.chunks_exact_mut(len)) {
            pack_weight(half, out, width, self.inp, 1).unwrap();
        }
        packed
    }

    /// The weight packed for the bf16 GEMM.
    fn packed_bf16(&self) -> Vec<Bf16> {
        let dense: Vec<Bf16> = self.dense().into_iter().map(Bf16::from_f32).collect();
        let mut packed = vec![Bf16::default(); packed_len_bf16(self.out, self.inp)];
        pack_weight_bf16(&dense, &mut packed, self.out, self.inp, 1).unwrap();
        packed
    }

    fn linear(&self) -> Linear<'_> {
        let weight = WqWeight { q: QWeight::Int8(&self.q), scales: &self.scales, mins: None };
        Linear::Wq { weight, out_features: self.out, in_features: self.inp, group_size: self.inp }
    }

    fn dense(&self) -> Vec<f32> {
        self.q.iter().enumerate().map(|(i, &q)| f32::from(q) * self.scales[i / self.inp]).collect()
    }
}

struct Weights {
    norms: Vec<Vec<f32>>,
    qkv: Int8,
    bias: Vec<f32>,
    o: Int8,
    gate_up: Int8,
    down: Int8,
}

fn weights(seed: u32) -> Weights {
    weights_with(seed, Int8::new, |v| v)
}

/// Weights, norms and bias that bf16 holds exactly, so the reference sees what the kernels do.
fn weights_exact_in_bf16(seed: u32) -> Weights {
    weights_with(seed, Int8::exact_in_bf16, to_bf16)
}

fn weights_with(seed: u32, int8: fn(usize, usize, u32) -> Int8, round: fn(f32) -> f32) -> Weights {
    let qkv_size = (HEADS + 2 * KV_HEADS) * DIM;
    Weights {
        norms: vec![values(HIDDEN, seed).iter().map(|v| round(1.0 + 0.5 * v)).collect(); 2],
        qkv: int8(qkv_size, HIDDEN, seed + 2),
        bias: values(qkv_size, seed + 3).iter().map(|v| round(0.1 * v)).collect(),
        o: int8(HIDDEN, HEADS * DIM, seed + 4),
        gate_up: int8(2 * INTER, HIDDEN, seed + 5),
        down: int8(HIDDEN, INTER, seed + 6),
    }
}

fn to_bf16(v: f32) -> f32 {
    Bf16::from_f32(v).to_f32()
}

fn layer(w: &Weights) -> DecoderLayer<'_> {
    DecoderLayer {
        input_norm: &w.norms[0],
        post_attention_norm: &w.norms[1],
        qkv: w.qkv.linear(),
        qkv_bias: Some(&w.bias),
        o: w.o.linear(),
        gate_up: w.gate_up.linear(),
        down: w.down.linear(),
    }
}

fn shape() -> DecoderShape {
    let scale = (DIM as f32).powf(-0.5);
    DecoderShape {
        hidden: HIDDEN,
        num_heads: HEADS,
        num_kv_heads: KV_HEADS,
        head_dim: DIM,
        rotary_dim: ROTARY,
        intermediate: INTER,
        eps: 1e-6,
        scale,
    }
}

fn cos_sin() -> Vec<f32> {
    let half = ROTARY / 2;
    let mut table = vec![0.0; MAX_POS * ROTARY];
    for p in 0..MAX_POS {
        for i in 0..half {
            let angle = p as f64 / 10000f64.powf(2.0 * i as f64 / ROTARY as f64);
            table[p * ROTARY + i] = angle.cos() as f32;
            table[p * ROTARY + half + i] = angle.sin() as f32;
        }
    }
    table
}

fn norm(x: &[f64], weight: &[f32]) -> Vec<f64> {
    let mean = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (mean + 1e-6).sqrt();
    x.iter().zip(weight).map(|(v, w)| v * r * f64::from(*w)).collect()
}

fn rotate(head: &mut [f32], pos: usize, table: &[f32]) {
    let half = ROTARY / 2;
    let (cos, sin) = table[pos * ROTARY..][..ROTARY].split_at(half);
    let x = head.to_vec();
    for i in 0..half {
        head[i] = x[i] * cos[i] - x[i + half] * sin[i];
        head[i + half] = x[i + half] * cos[i] + x[i] * sin[i];
    }
}

fn matvec(w: &Int8, x: &[f64], bias: Option<&[f32]>) -> Vec<f64> {
    let x32: Vec<f32> = x.iter().map(|v| *v as f32).collect();
    linear(&x32, &w.dense(), bias, 1, w.out, w.inp).into_iter().map(f64::from).collect()
}

/// The whole sequence `embeddings` through `layers` in f64: `(hidden, residual)` of its last token.
fn reference(layers: &[Weights], embeddings: &[Vec<f32>], table: &[f32]) -> (Vec<f64>, Vec<f64>) {
    let (q_size, kv_size) = (HEADS * DIM, KV_HEADS * DIM);
    let mut streams: Vec<(Vec<f64>, Option<Vec<f64>>)> =
        embeddings.iter().map(|e| (e.iter().map(|v| f64::from(*v)).collect(), None)).collect();
    for w in layers {
        let mut keys = Vec::new();
        let mut vals = Vec::new();
        let mut queries = Vec::new();
        for (pos, (hidden, residual)) in streams.iter_mut().enumerate() {
            let sum: Vec<f64> = match residual {
                Some(r) => hidden.iter().zip(r.iter()).map(|(a, b)| a + b).collect(),
                None => hidden.clone(),
            };
            let qkv: Vec<f32> =
                matvec(&w.qkv, &norm(&sum, &w.norms[0]), Some(&w.bias)).iter().map(|v| *v as f32).collect();
            let (mut q, mut k) = (qkv[..q_size].to_vec(), qkv[q_size..q_size + kv_size].to_vec());
            q.chunks_exact_mut(DIM).for_each(|h| rotate(h, pos, table));
            k.chunks_exact_mut(DIM).for_each(|h| rotate(h, pos, table));
            queries.push(q);
            keys.push(k);
            vals.push(qkv[q_size + kv_size..].to_vec());
            *residual = Some(sum);
        }
        for (pos, (hidden, residual)) in streams.iter_mut().enumerate() {
            let mut attn = Vec::new();
            for h in 0..HEADS {
                let kv = h / (HEADS / KV_HEADS);
                let ks: Vec<&[f32]> = keys[..=pos].iter().map(|k| &k[kv * DIM..][..DIM]).collect();
                let vs: Vec<&[f32]> = vals[..=pos].iter().map(|v| &v[kv * DIM..][..DIM]).collect();
                let q = &queries[pos][h * DIM..][..DIM];
                attn.extend(reference_attention(q, &ks, &vs, shape().scale, None));
            }
            let attn: Vec<f64> = attn.iter().map(|v| f64::from(*v)).collect();
            let residual = residual.as_mut().unwrap();
            let o = matvec(&w.o, &attn, None);
            residual.iter_mut().zip(&o).for_each(|(r, v)| *r += v);
            let gu = matvec(&w.gate_up, &norm(residual, &w.norms[1]), None);
            let act: Vec<f64> = (0..INTER).map(|i| gu[i] / (1.0 + (-gu[i]).exp()) * gu[INTER + i]).collect();
            *hidden = matvec(&w.down, &act, None);
        }
    }
    let (hidden, residual) = streams.pop().unwrap();
    (hidden, residual.unwrap())
}

/// Each element within `tol` of the recompute, relative to the larger of itself and the vector's
/// root mean square (sums cancel: an element near zero keeps the rounding of its large terms).
fn assert_close(got: &[f32], want: &[f64], what: &str, tol: f32) {
    let rms = (want.iter().map(|w| w * w).sum::<f64>() / want.len() as f64).sqrt() as f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let w = *w as f32;
        assert!((g - w).abs() <= tol * w.abs().max(rms), "{what}[{i}]: {g} vs {w} (rms {rms})");
    }
}

#[test]
fn decode_steps_match_an_f64_recompute_of_the_sequence() {
    let stack = [weights(10), weights(20)];
    let layers: Vec<DecoderLayer<'_>> = stack.iter().map(layer).collect();
    run_steps(&stack, &layers, cos_sin(), |v| v, 1e-3);
}

/// The f32 GEMM's packed weights, gate and up through the fused SiLU-and-mul product.
#[test]
fn f32_packed_weights_match_the_recompute() {
    let stack = [weights(10), weights(20)];
    let packed: Vec<[Vec<f32>; 4]> = stack
        .iter()
        .map(|w| {
            [
                w.qkv.packed_f32(false),
                w.o.packed_f32(false),
                w.gate_up.packed_f32(true),
                w.down.packed_f32(false),
            ]
        })
        .collect();
    let layers: Vec<DecoderLayer<'_>> = stack
        .iter()
        .zip(&packed)
        .map(|(w, p)| DecoderLayer {
            qkv: f32_linear(&p[0], &w.qkv, false),
            o: f32_linear(&p[1], &w.o, false),
            gate_up: f32_linear(&p[2], &w.gate_up, true),
            down: f32_linear(&p[3], &w.down, false),
            ..layer(w)
        })
        .collect();
    run_steps(&stack, &layers, cos_sin(), |v| v, 1e-3);
}

/// bf16 weights (exact in bf16) under f32 activations: the bf16 GEMM's products are exact, so
/// the f32 test's tolerance holds.
#[test]
fn bf16_weights_with_f32_activations_match_the_recompute() {
    let stack = [weights_exact_in_bf16(10), weights_exact_in_bf16(20)];
    let packed = packed_bf16(&stack);
    let layers: Vec<DecoderLayer<'_>> = stack
        .iter()
        .zip(&packed)
        .map(|(w, p)| bf16_layer(w, p, [&w.norms[0], &w.norms[1]], &w.bias))
        .collect();
    run_steps(&stack, &layers, cos_sin(), |v| v, 1e-3);
}

/// The bf16 stack: activations, norms, bias, the rotary table and the cache in bf16, the weights
/// packed for the bf16 GEMM. Every kernel rounds its output to bf16 (8 significant bits); through
/// two layers the outputs stayed within 3.2% of the vector's RMS of the f64 recompute (measured;
/// 5% allowed).
#[test]
fn bf16_decode_steps_match_the_recompute_within_bf16_rounding() {
    let stack = [weights_exact_in_bf16(10), weights_exact_in_bf16(20)];
    let packed = packed_bf16(&stack);
    let halves: Vec<(Vec<Bf16>, Vec<Bf16>, Vec<Bf16>)> =
        stack.iter().map(|w| (bf16s(&w.norms[0]), bf16s(&w.norms[1]), bf16s(&w.bias))).collect();
    let layers: Vec<DecoderLayer<'_, Bf16>> = stack
        .iter()
        .zip(&packed)
        .zip(&halves)
        .map(|((w, p), (n0, n1, b))| bf16_layer(w, p, [n0, n1], b))
        .collect();
    let table: Vec<f32> = cos_sin().into_iter().map(to_bf16).collect();
    run_steps(&stack, &layers, table, to_bf16, 5e-2);
}

fn f32_linear<'a>(packed: &'a [f32], w: &Int8, gated: bool) -> Linear<'a> {
    Linear::F32 { packed, out_features: w.out, in_features: w.inp, gated }
}

fn bf16_linear<'a>(packed: &'a [Bf16], w: &Int8) -> Linear<'a> {
    Linear::Bf16 { packed, out_features: w.out, in_features: w.inp, kernel: Bf16Kernel::best() }
}

/// Each layer's four weights packed for the bf16 GEMM: qkv, o, gate_up, down.
fn packed_bf16(stack: &[Weights]) -> Vec<[Vec<Bf16>; 4]> {
    stack.iter().map(|w| [&w.qkv, &w.o, &w.gate_up, &w.down].map(Int8::packed_bf16)).collect()
}

/// A layer of `w`'s weights as `packed` ([`packed_bf16`]) holds them, with `norms` and `bias`
/// in the activations' element type.
fn bf16_layer<'a, T>(
    w: &Weights,
    packed: &'a [Vec<Bf16>; 4],
    norms: [&'a [T]; 2],
    bias: &'a [T],
) -> DecoderLayer<'a, T> {
    DecoderLayer {
        input_norm: norms[0],
        post_attention_norm: norms[1],
        qkv: bf16_linear(&packed[0], &w.qkv),
        qkv_bias: Some(bias),
        o: bf16_linear(&packed[1], &w.o),
        gate_up: bf16_linear(&packed[2], &w.gate_up),
        down: bf16_linear(&packed[3], &w.down),
    }
}

fn bf16s(x: &[f32]) -> Vec<Bf16> {
    x.iter().map(|&v| Bf16::from_f32(v)).collect()
}

/// Seven decode steps of two requests through `layers` (the stack of `stack`'s weights in `T`),
/// each request's outputs against [`reference`] over its whole sequence, within `tol` (see
/// [`assert_close`]). `round` is what the embeddings and the rotary table pass through into `T`.
fn run_steps<T: SimdElement + std::fmt::Debug>(
    stack: &[Weights],
    layers: &[DecoderLayer<'_, T>],
    table: Vec<f32>,
    round: fn(f32) -> f32,
    tol: f32,
) {
    let cache_len = 2 * BLOCKS_PER_SEQ * BLOCK * KV_HEADS * DIM;
    let zero = T::from_f32(0.0);
    let mut kv: Vec<(Vec<T>, Vec<T>)> =
        (0..layers.len()).map(|_| (vec![zero; cache_len], vec![zero; cache_len])).collect();
    let table_t: Vec<T> = table.iter().map(|&v| T::from_f32(v)).collect();
    // Two requests, the second two tokens behind; each has its own blocks, in reverse order.
    let tables: Vec<i32> = (0..2 * BLOCKS_PER_SEQ as i32).rev().collect();
    let embed = |seq: u32, pos: usize| -> Vec<f32> {
        values(HIDDEN, 100 * seq + pos as u32).into_iter().map(round).collect()
    };
    for step in 0..7usize {
        let positions = [step as i64, step.saturating_sub(2) as i64];
        let slot = |row: usize, pos: i64| {
            let table = &tables[row * BLOCKS_PER_SEQ..];
            i64::from(table[pos as usize / BLOCK]) * BLOCK as i64 + pos % BLOCK as i64
        };
        let slots = [slot(0, positions[0]), slot(1, positions[1])];
        let seq_lens = [positions[0] as i32 + 1, positions[1] as i32 + 1];
        let mut hidden: Vec<T> =
            [embed(0, step), embed(1, positions[1] as usize)].concat().into_iter().map(T::from_f32).collect();
        let mut residual = vec![zero; 2 * HIDDEN];
        let mut caches: Vec<LayerCache<'_, T>> =
            kv.iter_mut().map(|(k, v)| LayerCache { key: k, value: v }).collect();
        let decode = DecodeStep {
            positions: &positions,
            slot_mapping: &slots,
            block_tables: &tables,
            max_blocks_per_seq: BLOCKS_PER_SEQ,
            seq_lens: &seq_lens,
            block_size: BLOCK,
            cos_sin: &table_t,
            query_start_loc: None,
        };
        let embeddings = hidden.clone();
        decode_layers(layers, None, &mut caches, shape(), decode, &mut hidden, &mut residual, 2).unwrap();
        // Again with the final norm: the same keys and values go to the same slots.
        let (mut normed, mut sum) = (embeddings, vec![zero; 2 * HIDDEN]);
        let final_norm: Vec<T> = stack[0].norms[1].iter().map(|&v| T::from_f32(v)).collect();
        decode_layers(layers, Some(&final_norm), &mut caches, shape(), decode, &mut normed, &mut sum, 2)
            .unwrap();
        if step < 2 {
            continue; // the second request's repeated token 0 is not a real sequence
        }
        let f32s = |x: &[T]| -> Vec<f32> { x.iter().map(|v| v.to_f32()).collect() };
        for (row, seq) in [(0usize, 0u32), (1, 1)] {
            let tokens: Vec<Vec<f32>> = (0..=positions[row] as usize).map(|p| embed(seq, p)).collect();
            let (want_hidden, want_residual) = reference(stack, &tokens, &table);
            assert_close(&f32s(&hidden[row * HIDDEN..][..HIDDEN]), &want_hidden, "hidden", tol);
            assert_close(&f32s(&residual[row * HIDDEN..][..HIDDEN]), &want_residual, "residual", tol);
            let want_sum: Vec<f64> = want_hidden.iter().zip(&want_residual).map(|(h, r)| h + r).collect();
            let weight: Vec<f32> = final_norm.iter().map(|v| v.to_f32()).collect();
            assert_close(
                &f32s(&normed[row * HIDDEN..][..HIDDEN]),
                &norm(&want_sum, &weight),
                "final norm",
                tol,
            );
            assert_close(&f32s(&sum[row * HIDDEN..][..HIDDEN]), &want_sum, "final sum", tol);
        }
    }
}

mod mixed;
mod refusals;
