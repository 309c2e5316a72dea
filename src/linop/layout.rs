//! Strided index walks shared by the kernels: row-major strides, merging of adjacent axes,
//! and an odometer that visits an index space one innermost run at a time.
//!
//! Rules:
//! - Strides are in elements and never negative; a stride of 0 broadcasts along that axis.
//! - [`walk`] calls its closure once per innermost run (not per element) with each operand's
//!   starting offset, the run length and each operand's stride along the run, so per-element
//!   work stays a plain loop the compiler can vectorise.
//! - An empty index space (some size 0) visits nothing; a 0-d space visits one run of 1.

/// Row-major (C order) strides for `shape`.
pub(crate) fn row_major(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1usize;
    for k in (0..shape.len()).rev() {
        strides[k] = acc;
        acc = acc.saturating_mul(shape[k]);
    }
    strides
}

/// Merges adjacent axes that every operand walks as one (stride of the outer axis equals
/// stride times size of the inner one), and drops axes of size 1. Returns the new shape and
/// strides per operand; an empty index space becomes one axis of size 0.
pub(crate) fn collapse<const N: usize>(
    shape: &[usize],
    strides: [&[usize]; N],
) -> (Vec<usize>, [Vec<usize>; N]) {
    if shape.contains(&0) {
        // Nothing to visit; the other sizes may multiply past usize.
        return (vec![0], std::array::from_fn(|_| vec![0]));
    }
    let mut out_shape: Vec<usize> = Vec::with_capacity(shape.len());
    let mut out_strides: [Vec<usize>; N] = std::array::from_fn(|_| Vec::with_capacity(shape.len()));
    for (axis, &size) in shape.iter().enumerate() {
        if size == 1 {
            continue;
        }
        let mergeable = match out_shape.last() {
            Some(_) => (0..N).all(|k| {
                let prev = *out_strides[k].last().unwrap_or(&0);
                strides[k][axis].checked_mul(size) == Some(prev)
            }),
            None => false,
        };
        if mergeable {
            if let Some(last) = out_shape.last_mut() {
                *last *= size;
            }
            for (k, s) in out_strides.iter_mut().enumerate() {
                if let Some(last) = s.last_mut() {
                    *last = strides[k][axis];
                }
            }
        } else {
            out_shape.push(size);
            for (k, s) in out_strides.iter_mut().enumerate() {
                s.push(strides[k][axis]);
            }
        }
    }
    (out_shape, out_strides)
}

/// Visits every innermost run of the index space `shape`: `f(offsets, run_len, run_strides)`
/// with each operand's offset at the run's start (from `bases`) and its stride along the run.
pub(crate) fn walk<const N: usize>(
    shape: &[usize],
    strides: [&[usize]; N],
    bases: [usize; N],
    mut f: impl FnMut([usize; N], usize, [usize; N]),
) {
    if shape.contains(&0) {
        return;
    }
    let Some((&run, outer)) = shape.split_last() else {
        f(bases, 1, [0; N]);
        return;
    };
    let inner = outer.len();
    let run_strides: [usize; N] = std::array::from_fn(|k| strides[k][inner]);
    let mut index = vec![0usize; inner];
    let mut offsets = bases;
    loop {
        f(offsets, run, run_strides);
        // Advance the odometer over the outer axes, last axis fastest.
        let mut axis = inner;
        loop {
            if axis == 0 {
                return;
            }
            axis -= 1;
            index[axis] += 1;
            for (k, o) in offsets.iter_mut().enumerate() {
                *o += strides[k][axis];
            }
            if index[axis] < outer[axis] {
                break;
            }
            for (k, o) in offsets.iter_mut().enumerate() {
                *o -= strides[k][axis] * outer[axis];
            }
            index[axis] = 0;
        }
    }
}

/// The largest offset (plus one) a view touches: `offset + sum (size-1)*stride`, or `offset`
/// for an empty view.
pub(crate) fn extent(offset: usize, shape: &[usize], strides: &[usize]) -> Option<usize> {
    if shape.contains(&0) {
        return Some(offset);
    }
    let mut end = offset.checked_add(1)?;
    for (&n, &s) in shape.iter().zip(strides) {
        end = end.checked_add((n - 1).checked_mul(s)?)?;
    }
    Some(end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walk_visits_every_index_once_in_row_major_order() {
        let shape = [2, 3, 4];
        let strides = row_major(&shape);
        let mut seen = Vec::new();
        walk(&shape, [&strides], [0], |[o], n, [s]| seen.extend((0..n).map(|i| o + i * s)));
        assert_eq!(seen, (0..24).collect::<Vec<_>>());
    }

    #[test]
    fn collapse_merges_contiguous_axes() {
        let shape = [2, 3, 4];
        let a = row_major(&shape);
        let b = [0, 4, 1];
        let (s, [sa, sb]) = collapse(&shape, [&a, &b]);
        assert_eq!(s, vec![2, 12]);
        assert_eq!(sa, vec![12, 1]);
        assert_eq!(sb, vec![0, 1]);
    }
}
