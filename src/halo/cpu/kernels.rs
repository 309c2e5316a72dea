//! The typed inner loops of the CPU halo path: contiguous rows, short rows, tiled transposes
//! and strided rows, each generic over the atom type `E` and the map `f` applied to every atom
//! (the identity, or a negation).
//!
//! Rules:
//! - Every function reads atoms only through `src` pointers and writes only through `dst`
//!   pointers, with unaligned loads and stores (raw elements give atoms of any alignment); the
//!   caller guarantees the two sides never overlap (an array and the packed buffer are distinct
//!   allocations, and threads write disjoint atoms).
//! - Loads and stores go in fixed-size blocks (`[E; N]`) so that the compiler keeps several
//!   loads in flight and uses vector registers; a reversed run (`REV`, source stride -1) is
//!   loaded as a block and reversed in registers.
//! - Nothing here allocates, branches on data, or panics.

/// Loads `N` atoms starting at `s` (with `REV`: at `s`, `s - 1`, ..., `s - (N - 1)`), mapped.
///
/// # Safety
///
/// 1. The `N` atoms are readable.
#[inline(always)]
unsafe fn load<E: Copy, const N: usize, const REV: bool>(s: *const E, f: impl Fn(E) -> E) -> [E; N] {
    // SAFETY: precondition 1 (the block starts N - 1 atoms below `s` when reversed).
    let mut v = unsafe { s.wrapping_sub(if REV { N - 1 } else { 0 }).cast::<[E; N]>().read_unaligned() };
    if REV {
        v.reverse();
    }
    // Plain loops rather than `map`/`from_fn`: they always inline (into the AVX2 copy too).
    for x in &mut v {
        *x = f(*x);
    }
    v
}

/// Stores `N` atoms at `d`.
///
/// # Safety
///
/// 1. The `N` atoms at `d` are writable.
#[inline(always)]
unsafe fn store<E: Copy, const N: usize>(d: *mut E, v: [E; N]) {
    // SAFETY: precondition 1.
    unsafe { d.cast::<[E; N]>().write_unaligned(v) }
}

/// The address of atom `i` of a run starting at `s` that goes forwards, or backwards (`REV`).
#[inline(always)]
fn at<E, const REV: bool>(s: *const E, i: usize) -> *const E {
    if REV {
        s.wrapping_sub(i)
    } else {
        s.wrapping_add(i)
    }
}

/// Copies one run of `n` atoms: `dst[i] = f(src[i])`, or `f(src[-i])` with `REV`. `C` is the
/// block length (64 bytes of atoms).
///
/// # Safety
///
/// 1. Atoms `src ± i` are readable and `dst + i` writable for `i < n`.
#[inline(always)]
pub(super) unsafe fn run<E: Copy, const C: usize, const REV: bool>(
    src: *const E,
    dst: *mut E,
    n: usize,
    f: impl Fn(E) -> E + Copy,
) {
    let mut i = 0;
    // SAFETY (every block): its atoms are among the run's (precondition 1).
    unsafe {
        while i + C <= n {
            store(dst.add(i), load::<E, C, REV>(at::<E, REV>(src, i), f));
            i += C;
        }
        if i < n && n >= C {
            // The last block overlaps the previous one: rewriting equal values is harmless.
            let j = n - C;
            store(dst.add(j), load::<E, C, REV>(at::<E, REV>(src, j), f));
            return;
        }
        while i + 4 <= n {
            store(dst.add(i), load::<E, 4, REV>(at::<E, REV>(src, i), f));
            i += 4;
        }
        while i < n {
            dst.add(i).write_unaligned(f(at::<E, REV>(src, i).read_unaligned()));
            i += 1;
        }
    }
}

/// Copies `rows` runs of `n` atoms, the `r`-th from `src + r * s_step` to `dst + r * d_step`.
/// Runs of 1 to 8 atoms (x-faces are 3) use a loop specialised on the length.
///
/// # Safety
///
/// 1. For every run, the atoms are as in [`run`]'s precondition.
#[inline(always)]
pub(super) unsafe fn rows<E: Copy, const C: usize, const REV: bool>(
    src: *const E,
    dst: *mut E,
    n: usize,
    (rows, s_step, d_step): (usize, isize, isize),
    f: impl Fn(E) -> E + Copy,
) {
    /// `rows` runs of the fixed length `N`.
    ///
    /// # Safety
    ///
    /// As [`rows`].
    #[inline(always)]
    unsafe fn fixed<E: Copy, const N: usize, const REV: bool>(
        mut s: *const E,
        mut d: *mut E,
        (rows, s_step, d_step): (usize, isize, isize),
        f: impl Fn(E) -> E + Copy,
    ) {
        for _ in 0..rows {
            // SAFETY: the run's atoms (precondition 1 of `rows`).
            unsafe { store(d, load::<E, N, REV>(s, f)) };
            s = s.wrapping_offset(s_step);
            d = d.wrapping_offset(d_step);
        }
    }
    let steps = (rows, s_step, d_step);
    // SAFETY (every arm): precondition 1.
    unsafe {
        match n {
            1 => fixed::<E, 1, REV>(src, dst, steps, f),
            2 => fixed::<E, 2, REV>(src, dst, steps, f),
            3 => fixed::<E, 3, REV>(src, dst, steps, f),
            4 => fixed::<E, 4, REV>(src, dst, steps, f),
            5 => fixed::<E, 5, REV>(src, dst, steps, f),
            6 => fixed::<E, 6, REV>(src, dst, steps, f),
            7 => fixed::<E, 7, REV>(src, dst, steps, f),
            8 => fixed::<E, 8, REV>(src, dst, steps, f),
            _ => {
                let (mut s, mut d) = (src, dst);
                for _ in 0..rows {
                    run::<E, C, REV>(s, d, n, f);
                    s = s.wrapping_offset(s_step);
                    d = d.wrapping_offset(d_step);
                }
            }
        }
    }
}

/// Atoms a strided run loads before it stores them: element-by-element load/store
/// interleaving makes the CPU serialise loads behind possibly-aliasing stores (measured 2x
/// slower than `memcpy` on 24-byte rows); batches keep several loads in flight.
const BATCH: usize = 8;

/// Copies one strided run: `dst[i * ds] = f(src[i * ss])` for `i < n`.
///
/// # Safety
///
/// 1. Atoms `src + i * ss` are readable and `dst + i * ds` writable for `i < n`.
#[inline(always)]
pub(super) unsafe fn strided<E: Copy>(
    src: *const E,
    dst: *mut E,
    n: usize,
    (ss, ds): (isize, isize),
    f: impl Fn(E) -> E + Copy,
) {
    let mut i = 0usize;
    // SAFETY: every atom touched is one of the run's (precondition 1).
    unsafe {
        while i + BATCH <= n {
            let mut v = [src.wrapping_offset(i as isize * ss).read_unaligned(); BATCH];
            for (k, x) in v.iter_mut().enumerate().skip(1) {
                *x = src.wrapping_offset((i + k) as isize * ss).read_unaligned();
            }
            for (k, x) in v.into_iter().enumerate() {
                let x = f(x);
                dst.wrapping_offset((i + k) as isize * ds).write_unaligned(x);
            }
            i += BATCH;
        }
        while i < n {
            dst.wrapping_offset(i as isize * ds)
                .write_unaligned(f(src.wrapping_offset(i as isize * ss).read_unaligned()));
            i += 1;
        }
    }
}

/// Side of the square blocks of a tiled transpose, in atoms.
pub(super) const TILE: usize = 8;

/// One `TA x TILE` block of a transpose: `TA` source runs of `TILE` contiguous atoms (forwards,
/// or backwards with `REV`), `sa` atoms apart, become `TILE` destination runs of `TA`
/// contiguous atoms, `db` atoms apart. Atoms are loaded one by one and stored as runs: the
/// block stays in L1 either way, and scalar loads beat extracting lanes from vector registers.
///
/// # Safety
///
/// 1. Atoms `src + a * sa ± b` are readable and `dst + b * db + a` writable, for `a < TA`,
///    `b < TILE`.
#[inline(always)]
unsafe fn tile<E: Copy, const TA: usize, const REV: bool>(
    src: *const E,
    dst: *mut E,
    (sa, db): (isize, isize),
    f: impl Fn(E) -> E + Copy,
) {
    // SAFETY: the block's atoms (precondition 1).
    unsafe {
        for b in 0..TILE {
            let mut out = [f(at::<E, REV>(src, b).read_unaligned()); TA];
            for (a, x) in out.iter_mut().enumerate().skip(1) {
                *x = f(at::<E, REV>(src.wrapping_offset(a as isize * sa), b).read_unaligned());
            }
            store(dst.wrapping_offset(b as isize * db), out);
        }
    }
}

/// `count` panels of a transpose, each `TILE` atoms wide along `b` (panel `k` starts at
/// atom `k * TILE` of `b`): for `a < na` and `b < count * TILE`,
/// `dst[b * db + a] = f(src[a * sa ± b])`, in `TILE x TILE` blocks (the last `na % TILE` rows
/// in narrower blocks). The block shape is picked once for all the panels, so short `a` sides
/// (a y-face turned has 3) run one tight loop.
///
/// # Safety
///
/// 1. Those atoms are readable and writable, respectively.
#[inline(always)]
pub(super) unsafe fn panels<E: Copy, const REV: bool>(
    src: *const E,
    dst: *mut E,
    (na, count): (usize, usize),
    (sa, db): (isize, isize),
    f: impl Fn(E) -> E + Copy,
) {
    /// `count` panels of `TA`-row blocks, the first at `src`/`dst`.
    ///
    /// # Safety
    ///
    /// As [`panels`], for `TA` rows.
    #[inline(always)]
    unsafe fn narrow<E: Copy, const TA: usize, const REV: bool>(
        src: *const E,
        dst: *mut E,
        count: usize,
        (sa, db): (isize, isize),
        f: impl Fn(E) -> E + Copy,
    ) {
        for k in 0..count {
            let s = at::<E, REV>(src, k * TILE);
            let d = dst.wrapping_offset((k * TILE) as isize * db);
            // SAFETY: panel k's atoms (precondition 1 of `panels`).
            unsafe { tile::<E, TA, REV>(s, d, (sa, db), f) };
        }
    }
    let steps = (sa, db);
    // SAFETY (every arm): the panels' atoms (precondition 1).
    unsafe {
        match na {
            0 => {}
            1 => narrow::<E, 1, REV>(src, dst, count, steps, f),
            2 => narrow::<E, 2, REV>(src, dst, count, steps, f),
            3 => narrow::<E, 3, REV>(src, dst, count, steps, f),
            4 => narrow::<E, 4, REV>(src, dst, count, steps, f),
            5 => narrow::<E, 5, REV>(src, dst, count, steps, f),
            6 => narrow::<E, 6, REV>(src, dst, count, steps, f),
            7 => narrow::<E, 7, REV>(src, dst, count, steps, f),
            _ => {
                for k in 0..count {
                    let (src, dst) =
                        (at::<E, REV>(src, k * TILE), dst.wrapping_offset((k * TILE) as isize * db));
                    let mut a = 0;
                    while a + TILE <= na {
                        tile::<E, TILE, REV>(
                            src.wrapping_offset(a as isize * sa),
                            dst.wrapping_add(a),
                            steps,
                            f,
                        );
                        a += TILE;
                    }
                    let (s, d) = (src.wrapping_offset(a as isize * sa), dst.wrapping_add(a));
                    match na - a {
                        1 => tile::<E, 1, REV>(s, d, steps, f),
                        2 => tile::<E, 2, REV>(s, d, steps, f),
                        3 => tile::<E, 3, REV>(s, d, steps, f),
                        4 => tile::<E, 4, REV>(s, d, steps, f),
                        5 => tile::<E, 5, REV>(s, d, steps, f),
                        6 => tile::<E, 6, REV>(s, d, steps, f),
                        7 => tile::<E, 7, REV>(s, d, steps, f),
                        _ => {}
                    }
                }
            }
        }
    }
}
