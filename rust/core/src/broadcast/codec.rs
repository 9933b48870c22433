//! The flat binary layout of one step on the step channel: every array of a [`SchedulerOutput`]
//! as `len: u64` followed by its elements in native byte order, padded to 8 bytes, then the
//! new-request and cached-request records. Writer and readers run on the same machine from the
//! same build, so native endianness and no versioning beyond the channel's magic are enough.
//!
//! Encoding is one pass of `memcpy`s into a reused buffer; decoding copies each array once into
//! the `Vec`s the bindings then move into numpy without another copy.

use crate::error::{CoreError, CoreResult};
use crate::request::SamplingOptions;
use crate::scheduler::{CachedRequestData, NewRequestData, SamplingArrays, SchedulerOutput};

/// A plain number type that crosses the channel as its native bytes.
pub(crate) trait Scalar: Copy + Default {
    const SIZE: usize;
    fn put(self, out: &mut Vec<u8>);
    fn get(bytes: &[u8]) -> Self;
}

macro_rules! scalar {
    ($($t:ty),*) => {$(
        impl Scalar for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_ne_bytes());
            }
            fn get(bytes: &[u8]) -> Self {
                <$t>::from_ne_bytes(bytes.try_into().expect("caller passes SIZE bytes"))
            }
        }
    )*};
}
scalar!(u8, u32, i32, u64, i64, f32);

impl Scalar for bool {
    const SIZE: usize = 1;
    fn put(self, out: &mut Vec<u8>) {
        out.push(self as u8);
    }
    fn get(bytes: &[u8]) -> Self {
        bytes[0] != 0
    }
}

/// Appends values to a byte buffer.
pub(crate) struct Encoder<'a> {
    out: &'a mut Vec<u8>,
}

impl<'a> Encoder<'a> {
    pub fn new(out: &'a mut Vec<u8>) -> Self {
        out.clear();
        Self { out }
    }

    fn pad(&mut self) {
        let n = self.out.len().next_multiple_of(8);
        self.out.resize(n, 0);
    }

    fn u64(&mut self, v: u64) {
        v.put(self.out);
    }

    fn slice<T: Scalar>(&mut self, v: &[T]) {
        self.u64(v.len() as u64);
        self.out.reserve(v.len() * T::SIZE);
        for &x in v {
            x.put(self.out);
        }
        self.pad();
    }

    fn opt<T: Scalar>(&mut self, v: Option<T>) {
        self.slice(v.as_slice());
    }

    fn str(&mut self, s: &str) {
        self.slice(s.as_bytes());
    }
}

/// Reads values back in the order an [`Encoder`] wrote them.
pub(crate) struct Decoder<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Decoder<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, pos: 0 }
    }

    fn take(&mut self, n: usize) -> CoreResult<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or_else(|| {
            CoreError::StepChannel(format!(
                "truncated step: {n} bytes wanted at offset {} of {}",
                self.pos,
                self.bytes.len()
            ))
        })?;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn u64(&mut self) -> CoreResult<u64> {
        Ok(u64::get(self.take(8)?))
    }

    fn vec<T: Scalar>(&mut self) -> CoreResult<Vec<T>> {
        let n = self.u64()? as usize;
        let bytes = self.take(n.saturating_mul(T::SIZE))?;
        let out = bytes.chunks_exact(T::SIZE).map(T::get).collect();
        self.pos = self.pos.next_multiple_of(8).min(self.bytes.len());
        Ok(out)
    }

    fn opt<T: Scalar>(&mut self) -> CoreResult<Option<T>> {
        Ok(self.vec::<T>()?.first().copied())
    }

    fn string(&mut self) -> CoreResult<String> {
        String::from_utf8(self.vec::<u8>()?)
            .map_err(|e| CoreError::StepChannel(format!("a string in the step is not UTF-8: {e}")))
    }
}

/// Writes `step` into `out` (cleared first).
pub fn encode_step(step: &SchedulerOutput, out: &mut Vec<u8>) {
    let mut e = Encoder::new(out);
    e.u64(step.step_id);
    e.u64(step.total_num_scheduled_tokens as u64);
    e.u64(step.max_num_blocks as u64);
    e.slice(&step.req_indices);
    e.slice(&step.num_scheduled_tokens);
    e.slice(&step.input_ids);
    e.slice(&step.positions);
    e.slice(&step.slot_mapping);
    e.slice(&step.block_tables);
    e.slice(&step.query_start_loc);
    e.slice(&step.seq_lens);
    e.slice(&step.num_computed_tokens);
    e.slice(&step.logits_indices);
    e.slice(&step.needs_sample);
    encode_sampling_arrays(&mut e, &step.sampling);
    e.u64(step.scheduled_new_reqs.len() as u64);
    for r in &step.scheduled_new_reqs {
        e.u64(r.req_index as u64);
        e.str(&r.request_id);
        e.slice(&r.prompt_token_ids);
        encode_sampling_options(&mut e, &r.sampling);
        e.slice(&r.block_ids);
        e.u64(r.num_computed_tokens as u64);
    }
    e.u64(step.scheduled_cached_reqs.len() as u64);
    for c in &step.scheduled_cached_reqs {
        e.u64(c.req_index as u64);
        e.u64(c.resumed_from_preemption as u64);
        e.slice(&c.new_block_ids);
        e.u64(c.num_computed_tokens as u64);
    }
    e.slice(&step.finished_req_indices);
    e.slice(&step.preempted_req_indices);
}

/// Reads a step written by [`encode_step`].
pub fn decode_step(bytes: &[u8]) -> CoreResult<SchedulerOutput> {
    let mut d = Decoder::new(bytes);
    let step_id = d.u64()?;
    let total_num_scheduled_tokens = d.u64()? as usize;
    let max_num_blocks = d.u64()? as usize;
    let mut step = SchedulerOutput {
        step_id,
        total_num_scheduled_tokens,
        max_num_blocks,
        req_indices: d.vec()?,
        num_scheduled_tokens: d.vec()?,
        input_ids: d.vec()?,
        positions: d.vec()?,
        slot_mapping: d.vec()?,
        block_tables: d.vec()?,
        query_start_loc: d.vec()?,
        seq_lens: d.vec()?,
        num_computed_tokens: d.vec()?,
        logits_indices: d.vec()?,
        needs_sample: d.vec()?,
        sampling: decode_sampling_arrays(&mut d)?,
        ..Default::default()
    };
    for _ in 0..d.u64()? {
        step.scheduled_new_reqs.push(NewRequestData {
            req_index: d.u64()? as usize,
            request_id: d.string()?,
            prompt_token_ids: d.vec()?,
            sampling: decode_sampling_options(&mut d)?,
            block_ids: d.vec()?,
            num_computed_tokens: d.u64()? as usize,
        });
    }
    for _ in 0..d.u64()? {
        step.scheduled_cached_reqs.push(CachedRequestData {
            req_index: d.u64()? as usize,
            resumed_from_preemption: d.u64()? != 0,
            new_block_ids: d.vec()?,
            num_computed_tokens: d.u64()? as usize,
        });
    }
    step.finished_req_indices = d.vec()?;
    step.preempted_req_indices = d.vec()?;
    Ok(step)
}

fn encode_sampling_arrays(e: &mut Encoder<'_>, s: &SamplingArrays) {
    e.slice(&s.temperature);
    e.slice(&s.top_p);
    e.slice(&s.top_k);
    e.slice(&s.min_p);
    e.slice(&s.seeds);
    e.slice(&s.presence_penalty);
    e.slice(&s.frequency_penalty);
    e.slice(&s.repetition_penalty);
}

fn decode_sampling_arrays(d: &mut Decoder<'_>) -> CoreResult<SamplingArrays> {
    Ok(SamplingArrays {
        temperature: d.vec()?,
        top_p: d.vec()?,
        top_k: d.vec()?,
        min_p: d.vec()?,
        seeds: d.vec()?,
        presence_penalty: d.vec()?,
        frequency_penalty: d.vec()?,
        repetition_penalty: d.vec()?,
    })
}

fn encode_sampling_options(e: &mut Encoder<'_>, s: &SamplingOptions) {
    e.opt(s.max_tokens.map(|v| v as u64));
    e.u64(s.min_tokens as u64);
    e.slice(&[s.ignore_eos, s.include_stop_str_in_output, s.skip_special_tokens, s.detokenize]);
    e.u64(s.stop.len() as u64);
    for stop in &s.stop {
        e.str(stop);
    }
    e.slice(&s.stop_token_ids);
    e.opt(s.logprobs);
    e.opt(s.prompt_logprobs);
    e.slice(&[
        s.temperature,
        s.top_p,
        s.min_p,
        s.presence_penalty,
        s.frequency_penalty,
        s.repetition_penalty,
    ]);
    e.slice(&[s.top_k]);
    e.opt(s.seed);
}

fn decode_sampling_options(d: &mut Decoder<'_>) -> CoreResult<SamplingOptions> {
    let max_tokens = d.opt::<u64>()?.map(|v| v as usize);
    let min_tokens = d.u64()? as usize;
    let flags: Vec<bool> = d.vec()?;
    let stop = (0..d.u64()?).map(|_| d.string()).collect::<CoreResult<Vec<_>>>()?;
    let stop_token_ids = d.vec()?;
    let logprobs = d.opt()?;
    let prompt_logprobs = d.opt()?;
    let floats: Vec<f32> = d.vec()?;
    let ints: Vec<i32> = d.vec()?;
    if flags.len() != 4 || floats.len() != 6 || ints.len() != 1 {
        return Err(CoreError::StepChannel("malformed sampling options in a new request".into()));
    }
    Ok(SamplingOptions {
        max_tokens,
        min_tokens,
        ignore_eos: flags[0],
        stop,
        stop_token_ids,
        include_stop_str_in_output: flags[1],
        skip_special_tokens: flags[2],
        detokenize: flags[3],
        logprobs,
        prompt_logprobs,
        temperature: floats[0],
        top_p: floats[1],
        top_k: ints[0],
        min_p: floats[2],
        seed: d.opt()?,
        presence_penalty: floats[3],
        frequency_penalty: floats[4],
        repetition_penalty: floats[5],
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A step with every field set to something distinguishable.
    pub(crate) fn sample_step(num_tokens: usize) -> SchedulerOutput {
        let sampling = SamplingOptions {
            max_tokens: Some(7),
            stop: vec!["é!".into(), "end".into()],
            stop_token_ids: vec![2, 9],
            logprobs: Some(3),
            prompt_logprobs: Some(1),
            seed: Some(-5),
            top_k: 40,
            temperature: 0.5,
            ..Default::default()
        };
        let mut arrays = SamplingArrays::default();
        arrays.push(&sampling);
        arrays.push(&SamplingOptions::default());
        SchedulerOutput {
            step_id: 42,
            req_indices: vec![3, 0],
            num_scheduled_tokens: vec![num_tokens as i32 - 1, 1],
            total_num_scheduled_tokens: num_tokens,
            input_ids: (0..num_tokens as i64).collect(),
            positions: (0..num_tokens as i64).rev().collect(),
            slot_mapping: (100..100 + num_tokens as i64).collect(),
            block_tables: vec![1, 2, 0, 5, 0, 0],
            max_num_blocks: 3,
            query_start_loc: vec![0, num_tokens as i32 - 1, num_tokens as i32],
            seq_lens: vec![11, 4],
            num_computed_tokens: vec![0, 3],
            logits_indices: vec![num_tokens as i64 - 2, num_tokens as i64 - 1],
            needs_sample: vec![false, true],
            sampling: arrays,
            scheduled_new_reqs: vec![NewRequestData {
                req_index: 3,
                request_id: "req-ü".into(),
                prompt_token_ids: vec![5, 6, 7],
                sampling,
                block_ids: vec![1, 2],
                num_computed_tokens: 0,
            }],
            scheduled_cached_reqs: vec![CachedRequestData {
                req_index: 0,
                resumed_from_preemption: true,
                new_block_ids: vec![5],
                num_computed_tokens: 3,
            }],
            finished_req_indices: vec![7],
            preempted_req_indices: vec![],
        }
    }

    #[test]
    fn decodes_what_it_encodes() {
        let step = sample_step(9);
        let mut buf = Vec::new();
        encode_step(&step, &mut buf);
        assert_eq!(buf.len() % 8, 0);
        assert_eq!(decode_step(&buf).unwrap(), step);
    }

    #[test]
    fn empty_step_round_trips() {
        let mut buf = Vec::new();
        encode_step(&SchedulerOutput::default(), &mut buf);
        assert_eq!(decode_step(&buf).unwrap(), SchedulerOutput::default());
    }

    #[test]
    fn truncated_bytes_are_an_error_not_a_panic() {
        let mut buf = Vec::new();
        encode_step(&sample_step(5), &mut buf);
        for cut in [0, 8, 30, buf.len() - 8] {
            let err = decode_step(&buf[..cut]).unwrap_err();
            assert!(matches!(err, CoreError::StepChannel(_)), "{err}");
        }
    }
}
