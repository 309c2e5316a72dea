//! Named dimensions: the ordered `(name, size)` lists of an operator's input and output.
//!
//! Rules:
//! - Names within one [`Dims`] are unique and non-empty; sizes may be 0.
//! - Position matters: axis `k` of an array fed to an operator is the operator's `k`-th
//!   input dim.
//! - A name in both an operator's input and output dims is a *batch* dim: the operator acts
//!   independently on each index of it, so its size is the same on both sides.
//!
//! # Examples
//!
//! ```
//! use cuferry::linop::Dims;
//! let d = Dims::new(&[("x", 4), ("y", 3)])?;
//! assert_eq!(d.names(), ["x", "y"]);
//! assert_eq!(d.size_of("y"), Some(3));
//! assert_eq!(d.numel(), 12);
//! assert!(Dims::new(&[("x", 1), ("x", 2)]).is_err());
//! # Ok::<(), cuferry::Error>(())
//! ```

use crate::error::{Error, Result};
use std::fmt;

/// An ordered list of named dimensions with sizes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Dims {
    names: Vec<String>,
    sizes: Vec<usize>,
}

impl Dims {
    /// Dims from `(name, size)` pairs in axis order.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an empty or repeated name.
    pub fn new<S: AsRef<str>>(dims: &[(S, usize)]) -> Result<Self> {
        let mut out = Dims::default();
        for (name, size) in dims {
            out.push(name.as_ref(), *size)?;
        }
        Ok(out)
    }

    /// Appends a dim.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an empty or repeated name.
    pub fn push(&mut self, name: &str, size: usize) -> Result<()> {
        if name.is_empty() {
            return Err(Error::invalid("a dimension name is empty"));
        }
        if self.contains(name) {
            return Err(Error::invalid(format!("dimension {name:?} appears twice in {self}")));
        }
        self.names.push(name.to_owned());
        self.sizes.push(size);
        Ok(())
    }

    /// The names in axis order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The sizes in axis order.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// Number of dims.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether there are no dims (a scalar).
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// The axis of `name`.
    pub fn position(&self, name: &str) -> Option<usize> {
        self.names.iter().position(|n| n == name)
    }

    /// Whether `name` is one of the dims.
    pub fn contains(&self, name: &str) -> bool {
        self.position(name).is_some()
    }

    /// The size of `name`.
    pub fn size_of(&self, name: &str) -> Option<usize> {
        self.position(name).map(|k| self.sizes[k])
    }

    /// The product of the sizes (1 for no dims, 0 when a size is 0), saturating at
    /// `usize::MAX`.
    pub fn numel(&self) -> usize {
        if self.sizes.contains(&0) {
            return 0;
        }
        self.sizes.iter().fold(1usize, |acc, &n| acc.saturating_mul(n))
    }

    /// The same dims with `name` resized to `size` (unchanged when `name` is absent).
    pub fn with_size(&self, name: &str, size: usize) -> Dims {
        let mut out = self.clone();
        if let Some(k) = out.position(name) {
            out.sizes[k] = size;
        }
        out
    }
}

impl fmt::Display for Dims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("(")?;
        for (k, (n, s)) in self.names.iter().zip(&self.sizes).enumerate() {
            if k > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{n}={s}")?;
        }
        f.write_str(")")
    }
}

/// The error for a dim an operator does not know.
pub(crate) fn unknown_dim(what: &str, name: &str) -> Error {
    Error::invalid(format!("{what} has no dimension named {name:?}"))
}
