//! A cubed sphere: 6 tiles of 48 x 48 cells with a halo of 3 and 79 levels, stored (z, y, x).
//! Every tile packs what its neighbours need (edges AND corners, turned into each receiver's
//! frame), and the receivers unpack it into their halos.
//!
//! Geometry (derived here, not assumed): the cube [-1, 1]^3 with faces 0-3 around the equator
//! (normals +X, +Y, -X, -Y), 4 north (+Z), 5 south (-Z). Each face has an outward right-handed
//! frame (x axis, y axis, normal):
//!
//! | face | normal | x axis | y axis |
//! |------|--------|--------|--------|
//! | 0    | +X     | +Y     | +Z     |
//! | 1    | +Y     | -X     | +Z     |
//! | 2    | -X     | -Y     | +Z     |
//! | 3    | -Y     | +X     | +Z     |
//! | 4    | +Z     | +Y     | -X     |
//! | 5    | -Z     | +Y     | +X     |
//!
//! A halo cell of face B beyond one of its sides is folded over that edge onto the neighbouring
//! face A (the one whose normal is the side's outward direction); the cell it lands on is its
//! source. Corner halos (3 x 3) are folded over one side each (NW over W, SW over S, SE over E,
//! NE over N), so they land in A's own halo; every halo cell has exactly one source. For each
//! (B, side, edge or corner) region H the sources form a box R of A, and the test finds the one
//! number of clockwise quarter turns k with B[H] = rot90^k(A[R]) cell by cell; the resulting
//! connectivity table ([`CONNECTIVITY`]) is checked against the one written down here.
//!
//! Then, for scalar and vector quantities, on the host backend (and CUDA when present, which
//! must agree bit for bit): pack every tile, unpack into the neighbours, and check
//! - the physics-independent invariant: B[H] == rot90^k(A[R]) with the convention's index map
//!   (and, for vectors, the component rule), for every edge and corner region;
//! - the geometry: each halo cell equals its folded source cell, and a vector tangent to A,
//!   carried over the edge by the fold, has in B's frame exactly the components unpacked;
//! - interiors are untouched.

mod common;
mod cubed_sphere;

use common::Rng;
use cubed_sphere::*;
use cuferry::halo::{ElementType, HaloExchange, HaloPacker, HaloSpec, HorizontalDims};
use cuferry::{Device, DeviceBuffer, Stream};

#[test]
fn connectivity_is_derived_from_the_cube() {
    for f in frames() {
        assert_eq!(cross(f.1, f.2), f.0, "frames are right-handed and outward");
    }
    let links = links();
    for l in &links {
        let side = SIDES.iter().position(|&s| s == l.side).unwrap();
        assert_eq!(CONNECTIVITY[l.b][side], (l.a, l.k), "face {} side {:?}", l.b, l.side);
    }
    // Each ordered pair of neighbours: the turns there and back add up to a full turn.
    for (b, row) in CONNECTIVITY.iter().enumerate() {
        for &(a, k) in row {
            let back = CONNECTIVITY[a].iter().find(|&&(f, _)| f == b).expect("neighbours are mutual");
            assert_eq!((k + back.1) % 4, 0, "faces {a} and {b}");
        }
    }
}

/// Packs every face's sends, then unpacks them into the receivers, on `device`. `data[face][q]`;
/// vector quantities come in (u, v) pairs. Returns the arrays after the exchange.
fn exchange(device: Device, data: &[Vec<Vec<f64>>], vector: bool) -> Vec<Vec<Vec<f64>>> {
    let spec = HaloSpec::contiguous(ElementType::F64, &[NZ, W, W], HorizontalDims::xy(2, 1)).unwrap();
    let per_face = exchanges_by_sender(&spec);
    let stream = Stream::new(device).unwrap();
    let arrays: Vec<Vec<DeviceBuffer<f64>>> = data
        .iter()
        .map(|f| f.iter().map(|a| DeviceBuffer::from_slice(&stream, a).unwrap()).collect())
        .collect();
    let quantities = if vector { data[0].len() / 2 } else { data[0].len() };
    let mut packers = Vec::new();
    for (a, (ex, links)) in per_face.iter().enumerate() {
        // Quantity-major lists: every link of quantity 0, then of quantity 1, ...
        let list: Vec<HaloExchange> = (0..quantities).flat_map(|_| ex.iter().cloned()).collect();
        let mut packer = HaloPacker::new(device, &list, vector.then_some(&list[..])).unwrap();
        assert_eq!(packer.launches_per_call(), 1);
        let comp = |q: usize, c: usize| if vector { 2 * q + c } else { q };
        let src = |c: usize| -> Vec<&DeviceBuffer<f64>> {
            (0..quantities)
                .flat_map(|q| links.iter().map(move |_| (q, c)))
                .map(|(q, c)| &arrays[a][comp(q, c)])
                .collect()
        };
        let (sx, sy) = (src(0), src(1));
        packer.pack(&sx, vector.then_some(&sy[..])).unwrap();
        packers.push(packer);
    }
    for (a, packer) in packers.iter_mut().enumerate() {
        let links = &per_face[a].1;
        packer.copy_pack_to_unpack().unwrap();
        let comp = |q: usize, c: usize| if vector { 2 * q + c } else { q };
        let dst = |c: usize| -> Vec<&DeviceBuffer<f64>> {
            (0..quantities)
                .flat_map(|q| links.iter().map(move |l| (q, l.b)))
                .map(|(q, b)| &arrays[b][comp(q, c)])
                .collect()
        };
        let (dx, dy) = (dst(0), dst(1));
        packer.unpack(&dx, vector.then_some(&dy[..])).unwrap();
    }
    arrays.iter().map(|f| f.iter().map(|a| a.to_vec(&stream).unwrap()).collect()).collect()
}

/// Checks the invariant, the geometry and the untouched interiors.
fn check(before: &[Vec<Vec<f64>>], after: &[Vec<Vec<f64>>], vector: bool) {
    let links = links();
    let quantities = if vector { before[0].len() / 2 } else { before[0].len() };
    let mut halo = vec![vec![vec![false; W]; W]; 6];
    for l in &links {
        let (nx, ny) = (l.r.0.len(), l.r.1.len());
        for (j, y) in l.h.1.clone().enumerate() {
            for (i, x) in l.h.0.clone().enumerate() {
                halo[l.b][y][x] = true;
                let (si, sj) = rot_source(l.k, i, j, nx, ny);
                let (sx, sy) = (l.r.0.start + si, l.r.1.start + sj);
                // The fold's source is the rotation's source.
                assert_eq!(fold(l.b, l.side, x, y), (l.a, sx, sy));
                for z in 0..NZ {
                    for q in 0..quantities {
                        if !vector {
                            let want = before[l.a][q][at(z, sy, sx)];
                            assert_eq!(
                                after[l.b][q][at(z, y, x)],
                                want,
                                "scalar {q} face {} ({x}, {y}, {z})",
                                l.b
                            );
                            continue;
                        }
                        let (u, v) =
                            (before[l.a][2 * q][at(z, sy, sx)], before[l.a][2 * q + 1][at(z, sy, sx)]);
                        let got = (after[l.b][2 * q][at(z, y, x)], after[l.b][2 * q + 1][at(z, y, x)]);
                        assert_eq!(
                            got,
                            turn_components(l.k, u, v),
                            "vector {q} face {} ({x}, {y}, {z})",
                            l.b
                        );
                        if z == 0 {
                            assert_eq!(got, folded_vector(l, u, v), "geometry of vector {q} on face {}", l.b);
                        }
                    }
                }
            }
        }
    }
    for b in 0..6 {
        for y in 0..W {
            for x in 0..W {
                let inside = (H..H + N).contains(&x) && (H..H + N).contains(&y);
                assert_eq!(halo[b][y][x], !inside, "face {b} cell ({x}, {y}): every halo cell exactly once");
                if inside {
                    for (q, arr) in after[b].iter().enumerate() {
                        for z in 0..NZ {
                            assert_eq!(
                                arr[at(z, y, x)],
                                before[b][q][at(z, y, x)],
                                "interior of face {b} changed"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The vector (u, v) of face A carried over the edge by the fold, in B's frame: the edge
/// direction stays, A's direction into its face (-normal of B) becomes B's outward side.
fn folded_vector(l: &Link, u: f64, v: f64) -> (f64, f64) {
    let (_, ex_a, ey_a) = frames()[l.a];
    let (nb, ex_b, ey_b) = frames()[l.b];
    let s = side_dir(l.b, l.side);
    let w = axpy(u as i64, ex_a, axpy(v as i64, ey_a, [0, 0, 0]));
    let into_a = neg(nb);
    let along = dot(w, into_a);
    let carried = axpy(along, s, axpy(-along, into_a, w));
    (dot(carried, ex_b) as f64, dot(carried, ey_b) as f64)
}

fn run(vector: bool, seed: u64) {
    let mut rng = Rng::new(seed);
    let data = fields(&mut rng, 2); // two scalars, or one (u, v) pair
    let host = exchange(Device::Host, &data, vector);
    check(&data, &host, vector);
    if let Some(device) = common::cuda_device() {
        let cuda = exchange(device, &data, vector);
        assert!(cuda == host, "CUDA and host differ after the cubed-sphere exchange");
    }
}

#[test]
fn cubed_sphere_scalars_edges_and_corners() {
    run(false, 21);
}

#[test]
fn cubed_sphere_vectors_edges_and_corners() {
    run(true, 22);
}
