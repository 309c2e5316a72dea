//! The cubed-sphere geometry shared by the single-process and MPI halo tests: 6 tiles of
//! 48 x 48 cells with a halo of 3 and 79 levels, stored (z, y, x); the connectivity and every
//! edge and corner link are derived from the cube (see tests/halo_cubed_sphere.rs).
#![allow(dead_code)]

use std::ops::Range;

use super::common::Rng;
use cuferry::halo::{HaloExchange, HaloSpec};

pub const N: usize = 48;
pub const H: usize = 3;
pub const NZ: usize = 79;
pub const W: usize = N + 2 * H;

pub type V3 = [i64; 3];

pub const X: V3 = [1, 0, 0];
pub const Y: V3 = [0, 1, 0];
pub const Z: V3 = [0, 0, 1];

pub fn neg(a: V3) -> V3 {
    [-a[0], -a[1], -a[2]]
}
pub fn dot(a: V3, b: V3) -> i64 {
    a[0] * b[0] + a[1] * b[1] + a[2] * b[2]
}
pub fn cross(a: V3, b: V3) -> V3 {
    [a[1] * b[2] - a[2] * b[1], a[2] * b[0] - a[0] * b[2], a[0] * b[1] - a[1] * b[0]]
}
pub fn axpy(s: i64, a: V3, b: V3) -> V3 {
    [s * a[0] + b[0], s * a[1] + b[1], s * a[2] + b[2]]
}

/// (normal, x axis, y axis) of each face.
pub fn frames() -> [(V3, V3, V3); 6] {
    [(X, Y, Z), (Y, neg(X), Z), (neg(X), neg(Y), Z), (neg(Y), X, Z), (Z, Y, neg(X)), (neg(Z), Y, X)]
}

/// The sides of a tile, in the order of [`CONNECTIVITY`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    West,
    East,
    South,
    North,
}

pub const SIDES: [Side; 4] = [Side::West, Side::East, Side::South, Side::North];

/// For each face B and side (W, E, S, N): the neighbour A across it and the clockwise quarter
/// turns that bring A's data into B's frame. Derived by `connectivity_is_derived_from_the_cube`.
pub const CONNECTIVITY: [[(usize, u32); 4]; 6] = [
    [(3, 0), (1, 0), (5, 0), (4, 0)],
    [(0, 0), (2, 0), (5, 3), (4, 1)],
    [(1, 0), (3, 0), (5, 2), (4, 2)],
    [(2, 0), (0, 0), (5, 1), (4, 3)],
    [(3, 1), (1, 3), (0, 0), (2, 2)],
    [(3, 3), (1, 1), (2, 2), (0, 0)],
];

/// The outward direction of a side of a face.
pub fn side_dir(face: usize, side: Side) -> V3 {
    let (_, ex, ey) = frames()[face];
    match side {
        Side::West => neg(ex),
        Side::East => ex,
        Side::South => neg(ey),
        Side::North => ey,
    }
}

/// Position of cell (x, y) (array indices, halo included) of `face`, in units where the cube
/// has half-width N: tangential coordinates 2i + 1 - N for cell index i = x - H.
pub fn position(face: usize, x: usize, y: usize) -> V3 {
    let (n, ex, ey) = frames()[face];
    let u = 2 * (x as i64 - H as i64) + 1 - N as i64;
    let v = 2 * (y as i64 - H as i64) + 1 - N as i64;
    axpy(u, ex, axpy(v, ey, axpy(N as i64, n, [0, 0, 0])))
}

/// The face whose normal is `n`.
pub fn face_with_normal(n: V3) -> usize {
    frames().iter().position(|f| f.0 == n).expect("a cube face has every axis direction as normal")
}

/// Folds halo cell (x, y) of face `b` over `side` onto the neighbouring face: (face, x, y).
pub fn fold(b: usize, side: Side, x: usize, y: usize) -> (usize, usize, usize) {
    let p = position(b, x, y);
    let s = side_dir(b, side);
    let nb = frames()[b].0;
    let excess = dot(p, s) - N as i64;
    assert!(excess > 0, "cell ({x}, {y}) of face {b} is not beyond its {side:?} side");
    let q = axpy(-excess, nb, axpy(-excess, s, p));
    let a = face_with_normal(s);
    let (_, ex, ey) = frames()[a];
    let index = |c: i64| usize::try_from((c + N as i64 - 1) / 2 + H as i64).expect("inside the array");
    (a, index(dot(q, ex)), index(dot(q, ey)))
}

/// The halo regions of a side of B, as (x range, y range): its edge and its corner.
pub fn halo_regions(side: Side) -> [(Range<usize>, Range<usize>); 2] {
    let (lo, mid, hi) = (0..H, H..H + N, H + N..W);
    match side {
        Side::West => [(lo.clone(), mid), (lo, hi)],
        Side::South => [(mid, lo.clone()), (lo.clone(), lo)],
        Side::East => [(hi.clone(), mid), (hi, lo)],
        Side::North => [(mid, hi.clone()), (hi.clone(), hi)],
    }
}

/// The source of result cell (i, j) of rot90^k of an nx x ny block (the convention's map).
pub fn rot_source(k: u32, i: usize, j: usize, nx: usize, ny: usize) -> (usize, usize) {
    match k {
        0 => (i, j),
        1 => (nx - 1 - j, i),
        2 => (nx - 1 - i, ny - 1 - j),
        _ => (j, ny - 1 - i),
    }
}

/// One derived transfer: from face A's box R to face B's halo H, turned k times.
#[derive(Clone, Debug)]
pub struct Link {
    pub a: usize,
    pub b: usize,
    pub side: Side,
    pub k: u32,
    pub r: (Range<usize>, Range<usize>),
    pub h: (Range<usize>, Range<usize>),
}

/// Derives every link from the fold, finding k.
pub fn links() -> Vec<Link> {
    let mut out = Vec::new();
    for b in 0..6 {
        for side in SIDES {
            for (hx, hy) in halo_regions(side) {
                let mut cells = Vec::new();
                for y in hy.clone() {
                    for x in hx.clone() {
                        cells.push(((x - hx.start, y - hy.start), fold(b, side, x, y)));
                    }
                }
                let a = cells[0].1 .0;
                assert!(cells.iter().all(|c| c.1 .0 == a), "one region folds onto one face");
                let rx = cells.iter().map(|c| c.1 .1).min().unwrap()
                    ..cells.iter().map(|c| c.1 .1).max().unwrap() + 1;
                let ry = cells.iter().map(|c| c.1 .2).min().unwrap()
                    ..cells.iter().map(|c| c.1 .2).max().unwrap() + 1;
                assert_eq!(rx.len() * ry.len(), cells.len(), "the sources form a box");
                let ks: Vec<u32> = (0..4)
                    .filter(|&k| {
                        cells.iter().all(|&((i, j), (_, sx, sy))| {
                            let (si, sj) = rot_source(k, i, j, rx.len(), ry.len());
                            (rx.start + si, ry.start + sj) == (sx, sy)
                        })
                    })
                    .collect();
                assert_eq!(ks.len(), 1, "exactly one rotation maps face {a} onto face {b}'s {side:?} halo");
                out.push(Link { a, b, side, k: ks[0], r: (rx, ry), h: (hx, hy) });
            }
        }
    }
    out
}

/// Exchanges sent by each face: its links, edge and corner of every receiving side.
pub fn exchanges_by_sender(spec: &HaloSpec) -> Vec<(Vec<HaloExchange>, Vec<Link>)> {
    let links = links();
    (0..6)
        .map(|a| {
            let mine: Vec<Link> = links.iter().filter(|l| l.a == a).cloned().collect();
            let ex = mine
                .iter()
                .map(|l| {
                    HaloExchange::new(
                        spec,
                        &[0..NZ, l.r.1.clone(), l.r.0.clone()],
                        l.k,
                        &[0..NZ, l.h.1.clone(), l.h.0.clone()],
                    )
                    .unwrap()
                })
                .collect();
            (ex, mine)
        })
        .collect()
}

pub fn at(z: usize, y: usize, x: usize) -> usize {
    (z * W + y) * W + x
}

/// Random integer-valued fields: `count` arrays per face.
pub fn fields(rng: &mut Rng, count: usize) -> Vec<Vec<Vec<f64>>> {
    (0..6)
        .map(|_| {
            (0..count).map(|_| (0..NZ * W * W).map(|_| (rng.below(2001) as f64) - 1000.0).collect()).collect()
        })
        .collect()
}

/// The vector component rule (`src/halo/mod.rs`) for (u, v) turned k times.
pub fn turn_components(k: u32, u: f64, v: f64) -> (f64, f64) {
    match k {
        0 => (u, v),
        1 => (v, -u),
        2 => (-u, -v),
        _ => (-v, u),
    }
}

/// The exchanges from face `a` to face `b` (edges and corners), in link order.
pub fn exchanges_between(spec: &HaloSpec, a: usize, b: usize) -> Vec<HaloExchange> {
    links()
        .iter()
        .filter(|l| l.a == a && l.b == b)
        .map(|l| {
            HaloExchange::new(
                spec,
                &[0..NZ, l.r.1.clone(), l.r.0.clone()],
                l.k,
                &[0..NZ, l.h.1.clone(), l.h.0.clone()],
            )
            .unwrap()
        })
        .collect()
}

/// The faces face `b` receives from (its four neighbours), in order.
pub fn senders_to(b: usize) -> Vec<usize> {
    let mut v: Vec<usize> = CONNECTIVITY[b].iter().map(|&(a, _)| a).collect();
    v.sort_unstable();
    v.dedup();
    v
}
