//! The bf16 GEMM on AMX tiles (Intel Sapphire Rapids and later). `tdpbf16ps` multiplies a tile
//! of `x` (16 rows × 16 pairs of `k`) by a tile of the weight (16 pairs of `k` × 16 columns) into
//! a 16 × 16 tile of f32 sums: 8,192 multiply-adds, 256 times one `vdpbf16ps`. A block of 32 rows
//! × 32 columns keeps four sum tiles, two of `x` and two of the weight: all eight tile registers.
//!
//! The packed weight needs no layout of its own: a panel row holds the pair words of its columns,
//! which is what a weight tile's row holds (16 columns × 2 bf16), so a tile is 16 panel rows read
//! at the panel's stride; `x` as bf16 pairs is likewise 16 rows × 16 words at its row stride.
//! Rows short of a whole 16-row tile go through the AVX512-BF16 loop, and so does the `k` past the
//! last whole 32 (added to the tiles' sums), so every shape is exact to the same f32 sums.
//!
//! Rust has no stable AMX intrinsics, so the instructions are inline assembly. The tile
//! registers, which the compiler never allocates, keep their values from one `asm!` to the next.
//! Linux hands a process the tiles' state only on request ([`available`]).

use std::any::TypeId;
use std::arch::asm;
use std::arch::x86_64::*;
use std::ops::Range;
use std::sync::OnceLock;

use super::avx512::{dot_rows, dot_tail};
use super::{Job, Sink, Tile};
use crate::gemm::PANEL_WIDTH;
use crate::{Bf16, Element};

/// Rows of a tile: rows of `x`, pairs of `k` of the weight, rows of sums.
const TILE: usize = 16;
/// Bytes of a tile's row: 16 pair words of `x`, 16 columns of the weight or the sums.
const ROW_BYTES: usize = 64;
/// Sum tiles per block, each way: 2 × 2, with the two of `x` and two of the weight.
const BLOCK_TILES: usize = 2;
/// Columns of the block's sums as they leave the tiles.
const SUMS_COLS: usize = BLOCK_TILES * TILE;

/// Whether the CPU has AMX's bf16 tiles and the kernel lets this process use them.
pub(super) fn available() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| cpu_has_amx_bf16() && request_tile_state())
}

/// CPUID leaf 7: AMX-BF16 is EDX bit 22, AMX-TILE bit 24.
fn cpu_has_amx_bf16() -> bool {
    // CPUID exists on every x86-64 CPU; leaf 7 reads as zeros where it is not defined.
    let leaf = std::arch::x86_64::__cpuid_count(7, 0);
    leaf.edx & (1 << 22) != 0 && leaf.edx & (1 << 24) != 0
}

/// Asks Linux for the tile data state (`ARCH_REQ_XCOMP_PERM`, `XFEATURE_XTILEDATA`): until then a
/// tile instruction kills the process. The grant is process-wide.
fn request_tile_state() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: the system call takes two integers and touches no memory of ours.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

/// The 64-byte tile configuration: palette 1, all eight tiles 16 rows of 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn full_tiles() -> Self {
        let mut bytes = [0u8; 64];
        bytes[0] = 1;
        for t in 0..8 {
            bytes[16 + 2 * t..18 + 2 * t].copy_from_slice(&(ROW_BYTES as u16).to_le_bytes());
            bytes[48 + t] = TILE as u8;
        }
        Self(bytes)
    }
}

/// # Safety
/// As [`Job::run`](super::Job); the CPU has AVX-512F, AVX512-BF16 and AMX-BF16, and
/// [`available`] said so (the tile state was granted); `job.x_pairs` holds `x`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
pub(super) unsafe fn run<T: Element>(job: &Job<'_, T>, cols: Range<usize>) {
    let config = TileConfig::full_tiles();
    asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack, readonly, preserves_flags));
    for slab in job.slabs(4 * job.panels.pairs, BLOCK_TILES * TILE) {
        for tile in job.tiles(cols.clone(), PANEL_WIDTH) {
            let mut r0 = slab.start;
            while slab.end - r0 >= BLOCK_TILES * TILE {
                by_columns::<2, T>(job, tile, r0);
                r0 += BLOCK_TILES * TILE;
            }
            if slab.end - r0 >= TILE {
                by_columns::<1, T>(job, tile, r0);
                r0 += TILE;
            }
            dot_rows(job, tile, r0..slab.end);
        }
    }
    asm!("tilerelease", options(nostack, nomem, preserves_flags));
}

/// Rows `r0..r0 + 16 · RT` across the tile, two weight tiles (32 columns) at a time.
#[inline(always)]
unsafe fn by_columns<const RT: usize, T: Element>(job: &Job<'_, T>, tile: Tile, r0: usize) {
    let vectors = tile.span.div_ceil(TILE);
    for v in (0..vectors).step_by(BLOCK_TILES) {
        if vectors - v >= BLOCK_TILES {
            block::<RT, 2, T>(job, tile, r0, v);
        } else {
            block::<RT, 1, T>(job, tile, r0, v);
        }
    }
}

/// `RT` × `CT` sum tiles: rows `r0..r0 + 16 · RT`, the tile's columns from its vector `v`.
#[inline(always)]
unsafe fn block<const RT: usize, const CT: usize, T: Element>(
    job: &Job<'_, T>,
    tile: Tile,
    r0: usize,
    v: usize,
) {
    let pairs = job.panels.pairs;
    let steps = pairs / TILE;
    let x_stride = 4 * pairs;
    let x = job.x_pairs.as_ptr().add(r0 * pairs).cast::<u8>();
    let w_stride = 4 * tile.stride;
    let w = tile.words.add(v * TILE).cast::<u8>();
    each::<RT, CT>(|rt, ct| zero(rt * 2 + ct));
    for s in 0..steps {
        for rt in 0..RT {
            load(4 + rt, x.add(rt * TILE * x_stride + s * ROW_BYTES), x_stride);
        }
        for ct in 0..CT {
            load(6 + ct, w.add(s * TILE * w_stride + ct * ROW_BYTES), w_stride);
        }
        each::<RT, CT>(|rt, ct| dot(rt, ct));
    }
    let mut sums = [[0.0f32; SUMS_COLS]; BLOCK_TILES * TILE];
    let sums = &mut sums[..RT * TILE];
    let out = sums.as_mut_ptr().cast::<u8>();
    let row_bytes = SUMS_COLS * 4;
    each::<RT, CT>(|rt, ct| store(rt * 2 + ct, out.add(rt * TILE * row_bytes + ct * ROW_BYTES), row_bytes));
    let at = Tile {
        words: tile.words.add(v * TILE),
        col: tile.col + v * TILE,
        span: tile.span - v * TILE,
        ..tile
    };
    dot_tail(job, at, r0, CT, steps * TILE..pairs, sums);
    let span = at.span.min(CT * TILE);
    for (r, row) in sums.iter().enumerate() {
        write_row(&job.sink, r0 + r, at.col, &row[..span]);
    }
}

/// [`Sink::write`] sixteen columns at a time: a tile makes a sum in under two cycles at the
/// model's widths, a scalar write would take longer than the sum. Rounds to bf16 as
/// [`Bf16::from_f32`] does, bit for bit.
#[inline(always)]
unsafe fn write_row<T: Element>(sink: &Sink<'_, T>, row: usize, col: usize, values: &[f32]) {
    let dst = sink.out.add(row * sink.n + col);
    for (j, chunk) in values.chunks(TILE).enumerate() {
        let mask = ((1u32 << chunk.len()) - 1) as __mmask16;
        let mut sum = _mm512_maskz_loadu_ps(mask, chunk.as_ptr());
        if let Some(bias) = sink.bias {
            sum = _mm512_add_ps(sum, load(bias.as_ptr().add(col + j * TILE), mask));
        }
        store(dst.add(j * TILE), sum, mask);
    }

    #[inline(always)]
    unsafe fn load<T: Element>(src: *const T, mask: __mmask16) -> __m512 {
        if TypeId::of::<T>() == TypeId::of::<Bf16>() {
            let bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, src.cast()));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(bits))
        } else {
            _mm512_maskz_loadu_ps(mask, src.cast())
        }
    }

    #[inline(always)]
    unsafe fn store<T: Element>(dst: *mut T, sum: __m512, mask: __mmask16) {
        if TypeId::of::<T>() == TypeId::of::<Bf16>() {
            let bits = _mm512_castps_si512(sum);
            let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
            let even = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
            let quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x40 << 16));
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(sum, sum);
            let rounded = _mm512_srli_epi32::<16>(_mm512_mask_blend_epi32(nan, even, quiet));
            _mm512_mask_cvtepi32_storeu_epi16(dst.cast(), mask, rounded);
        } else {
            _mm512_mask_storeu_ps(dst.cast(), mask, sum);
        }
    }
}

/// Calls `f(rt, ct)` for each sum tile of an `RT` × `CT` block.
#[inline(always)]
fn each<const RT: usize, const CT: usize>(mut f: impl FnMut(usize, usize)) {
    for rt in 0..RT {
        for ct in 0..CT {
            f(rt, ct);
        }
    }
}

// One function per instruction, the tile register picked by a `match` on a value that is a
// constant after inlining: an `asm!` template must name its registers literally.

/// `tmm[t] = 0`.
#[inline(always)]
unsafe fn zero(t: usize) {
    match t {
        0 => asm!("tilezero tmm0", options(nostack, nomem, preserves_flags)),
        1 => asm!("tilezero tmm1", options(nostack, nomem, preserves_flags)),
        2 => asm!("tilezero tmm2", options(nostack, nomem, preserves_flags)),
        _ => asm!("tilezero tmm3", options(nostack, nomem, preserves_flags)),
    }
}

/// `tmm[t]` = 16 rows of 64 bytes from `src`, `stride` bytes apart.
#[inline(always)]
unsafe fn load(t: usize, src: *const u8, stride: usize) {
    match t {
        4 => {
            asm!("tileloadd tmm4, [{} + {}*1]", in(reg) src, in(reg) stride, options(nostack, readonly, preserves_flags))
        }
        5 => {
            asm!("tileloadd tmm5, [{} + {}*1]", in(reg) src, in(reg) stride, options(nostack, readonly, preserves_flags))
        }
        6 => {
            asm!("tileloadd tmm6, [{} + {}*1]", in(reg) src, in(reg) stride, options(nostack, readonly, preserves_flags))
        }
        _ => {
            asm!("tileloadd tmm7, [{} + {}*1]", in(reg) src, in(reg) stride, options(nostack, readonly, preserves_flags))
        }
    }
}

/// Sum tile `2 · rt + ct` += `x` tile `4 + rt` · weight tile `6 + ct`.
#[inline(always)]
unsafe fn dot(rt: usize, ct: usize) {
    match (rt, ct) {
        (0, 0) => asm!("tdpbf16ps tmm0, tmm4, tmm6", options(nostack, nomem, preserves_flags)),
        (0, 1) => asm!("tdpbf16ps tmm1, tmm4, tmm7", options(nostack, nomem, preserves_flags)),
        (1, 0) => asm!("tdpbf16ps tmm2, tmm5, tmm6", options(nostack, nomem, preserves_flags)),
        _ => asm!("tdpbf16ps tmm3, tmm5, tmm7", options(nostack, nomem, preserves_flags)),
    }
}

/// Writes sum tile `t` to 16 rows at `dst`, `stride` bytes apart.
#[inline(always)]
unsafe fn store(t: usize, dst: *mut u8, stride: usize) {
    match t {
        0 => {
            asm!("tilestored [{} + {}*1], tmm0", in(reg) dst, in(reg) stride, options(nostack, preserves_flags))
        }
        1 => {
            asm!("tilestored [{} + {}*1], tmm1", in(reg) dst, in(reg) stride, options(nostack, preserves_flags))
        }
        2 => {
            asm!("tilestored [{} + {}*1], tmm2", in(reg) dst, in(reg) stride, options(nostack, preserves_flags))
        }
        _ => {
            asm!("tilestored [{} + {}*1], tmm3", in(reg) dst, in(reg) stride, options(nostack, preserves_flags))
        }
    }
}
