//! The packed layout of an exchange set and the strided transfers that fill and drain it,
//! computed once per packer and shared by the CPU and CUDA implementations.
//!
//! Rules:
//! - Slots follow the pack order of the [halo module](super) rules: quantities in the order given, for
//!   each the x component then (vectors) the y component; each slot holds its region in
//!   row-major order of the rotated region. Slots are contiguous, without padding (every
//!   exchange has the same element type, so every slot offset is a multiple of its size).
//! - Vector rule, applied once at pack: k=1: (u, v) -> (v, -u); k=2: (-u, -v); k=3: (-v, u).
//!   So after an odd rotation the x slot is filled from the y array and vice versa.
//! - A transfer is a strided copy between an array view and a slot, in "atoms" (the largest
//!   power of two <= 8 dividing the element size; raw elements get an extra innermost dim).
//!   Dims of extent 1 are dropped and dims contiguous on both sides are merged, so a
//!   contiguous region becomes one long row.
//! - Empty regions give empty slots and no transfer.

use super::spec::{ElemKind, ElementType, HaloExchange, View};
use crate::error::{Error, Result};

/// Which argument array a transfer reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Component {
    /// A scalar quantity, or the x component of a vector quantity (`arrays_x`).
    X,
    /// The y component of a vector quantity (`arrays_y`).
    Y,
}

/// Where one component of one quantity sits in the packed buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PackedSlot {
    /// Index of the quantity (the exchange) in the lists given to the packer.
    pub quantity: usize,
    /// The slot's component (what the receiver unpacks it into).
    pub component: Component,
    /// Byte offset in the packed buffer.
    pub offset: usize,
    /// Bytes in the slot.
    pub bytes: usize,
}

/// The argument array of a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ArrayRef {
    pub(crate) component: Component,
    pub(crate) quantity: usize,
}

/// One strided copy between an array view and a slot of the packed buffer.
#[derive(Clone, Debug)]
pub(crate) struct Transfer {
    pub(crate) array: ArrayRef,
    /// Atoms from the array's start to the view's first element.
    pub(crate) array_offset: usize,
    /// Byte offset of the slot in the packed buffer.
    pub(crate) packed_offset: usize,
    /// Extents, outermost first (at least one dim).
    pub(crate) extent: Vec<usize>,
    /// Strides in atoms on the array side (signed: flips and turns).
    pub(crate) array_strides: Vec<isize>,
    /// Strides in atoms on the packed side (row-major).
    pub(crate) packed_strides: Vec<isize>,
    /// Bytes per atom: 1, 2, 4 or 8.
    pub(crate) atom: usize,
    /// How an atom is negated.
    pub(crate) kind: ElemKind,
    /// Negate while packing.
    pub(crate) negate: bool,
}

impl Transfer {
    /// Atoms moved.
    pub(crate) fn atoms(&self) -> usize {
        super::spec::box_elements(self.extent.iter().copied())
    }

    /// Bytes moved.
    pub(crate) fn bytes(&self) -> usize {
        self.atoms() * self.atom
    }
}

/// The layout and transfers of one exchange set.
#[derive(Debug)]
pub(crate) struct Plan {
    pub(crate) element: Option<ElementType>,
    pub(crate) exchanges_x: Vec<HaloExchange>,
    pub(crate) exchanges_y: Option<Vec<HaloExchange>>,
    pub(crate) slots: Vec<PackedSlot>,
    pub(crate) pack: Vec<Transfer>,
    pub(crate) unpack: Vec<Transfer>,
    pub(crate) bytes: usize,
}

/// What fills one slot: the component whose pack region is read, and whether it is negated.
fn slot_source(component: Component, rotation: u32) -> (Component, bool) {
    match (component, rotation) {
        (Component::X, 0) => (Component::X, false),
        (Component::Y, 0) => (Component::Y, false),
        (Component::X, 1) => (Component::Y, false),
        (Component::Y, 1) => (Component::X, true),
        (Component::X, 2) => (Component::X, true),
        (Component::Y, 2) => (Component::Y, true),
        (Component::X, _) => (Component::Y, true),
        (Component::Y, _) => (Component::X, false),
    }
}

impl Plan {
    /// Checks the exchange set and lays it out.
    pub(crate) fn new(exchanges_x: &[HaloExchange], exchanges_y: Option<&[HaloExchange]>) -> Result<Plan> {
        let all = exchanges_x.iter().chain(exchanges_y.unwrap_or(&[]));
        let mut element = None;
        for ex in all {
            let e = ex.spec().element();
            match element {
                None => element = Some(e),
                Some(first) if first != e => {
                    return Err(Error::invalid(format!(
                        "every exchange of a packer must have one element type; found {first:?} and {e:?}"
                    )))
                }
                Some(_) => {}
            }
        }
        if let Some(ys) = exchanges_y {
            if ys.len() != exchanges_x.len() {
                return Err(Error::invalid(format!(
                    "{} x exchanges but {} y exchanges: a vector quantity needs both",
                    exchanges_x.len(),
                    ys.len()
                )));
            }
            if let Some(e) = element.filter(|e| !e.is_signed()) {
                return Err(Error::invalid(format!(
                    "vector quantities need a signed element type (f32, f64, i32) to negate; got {e:?}"
                )));
            }
            for (q, (x, y)) in exchanges_x.iter().zip(ys).enumerate() {
                if x.rotation() != y.rotation() {
                    return Err(Error::invalid(format!(
                        "quantity {q}: the x exchange turns {} time(s) and the y exchange {}",
                        x.rotation(),
                        y.rotation()
                    )));
                }
            }
        }
        let mut plan = Plan {
            element,
            exchanges_x: exchanges_x.to_vec(),
            exchanges_y: exchanges_y.map(<[HaloExchange]>::to_vec),
            slots: Vec::new(),
            pack: Vec::new(),
            unpack: Vec::new(),
            bytes: 0,
        };
        let components: &[Component] =
            if exchanges_y.is_some() { &[Component::X, Component::Y] } else { &[Component::X] };
        for q in 0..exchanges_x.len() {
            for &component in components {
                plan.add_slot(q, component)?;
            }
        }
        Ok(plan)
    }

    /// The exchange of one component of one quantity.
    pub(crate) fn exchange(&self, array: ArrayRef) -> &HaloExchange {
        match (array.component, &self.exchanges_y) {
            (Component::Y, Some(ys)) => &ys[array.quantity],
            _ => &self.exchanges_x[array.quantity],
        }
    }

    fn add_slot(&mut self, quantity: usize, component: Component) -> Result<()> {
        let dest = ArrayRef { component, quantity };
        let rotation = self.exchange(dest).rotation();
        let (src_component, negate) =
            if self.exchanges_y.is_some() { slot_source(component, rotation) } else { (Component::X, false) };
        let src = ArrayRef { component: src_component, quantity };
        let (src_ex, dest_ex) = (self.exchange(src), self.exchange(dest));
        let (rotated, target) = (src_ex.rotated_pack_shape(), dest_ex.unpack_shape());
        if rotated != target {
            return Err(Error::invalid(format!(
                "quantity {quantity}, {component:?} slot: the {src_component:?} pack region turned {rotation} \
                 time(s) has shape {rotated:?}, but the unpack region has shape {target:?}"
            )));
        }
        let element = src_ex.spec().element();
        let (pack_view, unpack_view) = (src_ex.pack_view(), dest_ex.unpack_view());
        let bytes = dest_ex
            .elements()
            .checked_mul(element.size())
            .ok_or_else(|| Error::invalid("the packed buffer's size overflows"))?;
        let offset = self.bytes;
        self.bytes = offset
            .checked_add(bytes)
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| Error::invalid("the packed buffer's size overflows"))?;
        self.slots.push(PackedSlot { quantity, component, offset, bytes });
        if bytes > 0 {
            self.pack.push(transfer(src, pack_view, offset, element, negate));
            self.unpack.push(transfer(dest, unpack_view, offset, element, false));
        }
        Ok(())
    }
}

/// Row-major strides of `shape`, in elements.
fn row_major(shape: &[usize]) -> Vec<isize> {
    let mut strides = vec![0isize; shape.len()];
    let mut acc = 1isize;
    for (d, &e) in shape.iter().enumerate().rev() {
        strides[d] = acc;
        acc *= e as isize;
    }
    strides
}

/// The transfer between a (non-empty) view and the slot at `packed_offset`.
fn transfer(
    array: ArrayRef,
    view: View,
    packed_offset: usize,
    element: ElementType,
    negate: bool,
) -> Transfer {
    let size = element.size();
    let atom = [8usize, 4, 2, 1].into_iter().find(|a| size % a == 0).unwrap_or(1);
    let per = size / atom;
    let packed = row_major(&view.shape);
    // Dims of extent 1 go first: their strides are arbitrary (the spec checks only strides it
    // steps along), so scaling them could overflow. The others step inside the array, whose
    // size in bytes fits an isize (checked by the spec), so their scaled strides fit.
    let scale = |s: isize| s * per as isize;
    let mut dims: Vec<(usize, isize, isize)> = view
        .shape
        .iter()
        .zip(view.strides.iter().zip(&packed))
        .filter(|(&e, _)| e != 1)
        .map(|(&e, (&a, &p))| (e, scale(a), scale(p)))
        .collect();
    if per > 1 {
        dims.push((per, 1, 1));
    }
    let mut merged: Vec<(usize, isize, isize)> = Vec::with_capacity(dims.len());
    for (e, a, p) in dims {
        // Checked: `a * e` is one step past the dim's last element and may not fit.
        let spans = |inner: isize, outer: isize| inner.checked_mul(e as isize) == Some(outer);
        match merged.last_mut() {
            Some(outer) if spans(a, outer.1) && spans(p, outer.2) => *outer = (outer.0 * e, a, p),
            _ => merged.push((e, a, p)),
        }
    }
    if merged.is_empty() {
        merged.push((1, 1, 1));
    }
    Transfer {
        array,
        array_offset: view.offset * per,
        packed_offset,
        extent: merged.iter().map(|d| d.0).collect(),
        array_strides: merged.iter().map(|d| d.1).collect(),
        packed_strides: merged.iter().map(|d| d.2).collect(),
        atom,
        kind: if per == 1 { element.kind() } else { ElemKind::Bits },
        negate: negate && per == 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::halo::spec::{HaloSpec, HorizontalDims};

    #[test]
    fn contiguous_rows_merge_and_raw_elements_split_into_atoms() {
        let spec = HaloSpec::contiguous(ElementType::F64, &[5, 6, 7], HorizontalDims::xy(2, 1)).unwrap();
        let whole = HaloExchange::new(&spec, &[0..5, 0..6, 0..7], 0, &[0..5, 0..6, 0..7]).unwrap();
        let plan = Plan::new(&[whole], None).unwrap();
        assert_eq!(plan.pack[0].extent, vec![210]);
        assert_eq!(plan.bytes, 210 * 8);

        let raw =
            HaloSpec::contiguous(ElementType::Raw { size: 12 }, &[4, 4], HorizontalDims::xy(1, 0)).unwrap();
        let ex = HaloExchange::new(&raw, &[1..3, 0..4], 0, &[1..3, 0..4]).unwrap();
        let plan = Plan::new(&[ex], None).unwrap();
        let t = &plan.pack[0];
        assert_eq!((t.atom, t.extent.clone(), t.array_offset), (4, vec![24], 12));
    }

    #[test]
    fn odd_vector_turns_swap_the_slot_sources() {
        assert_eq!(slot_source(Component::X, 1), (Component::Y, false));
        assert_eq!(slot_source(Component::Y, 1), (Component::X, true));
        assert_eq!(slot_source(Component::X, 3), (Component::Y, true));
        assert_eq!(slot_source(Component::Y, 3), (Component::X, false));
    }
}
