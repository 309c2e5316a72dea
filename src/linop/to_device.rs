//! [`ToDevice`]: moving data between placements as a linear operator.
//!
//! Rules:
//! - Forward copies an array from `ispec`'s device to `ospec`'s; the result lives on `ospec`
//!   (later operators compute on its compute stream). The input must be on `ispec`'s device.
//! - The adjoint is the reverse transfer; the normal is the identity on `ispec` (a round
//!   trip is lossless): it takes arrays of `ispec`'s device and returns them under `ispec`. Splitting restricts the dims (the operator is diagonal in every dim).
//! - Transfers are asynchronous and pipelined on the pair's transfer stream; see
//!   [`transfer_stream`](super::transfer_stream) for the stream choice and the ordering. The
//!   stream is resolved on the first copy and kept by the operator (and its clones and
//!   splits); between two specs of one device nothing is copied and no stream is made.
//! - Works between any devices: host and host (two host "devices" are two specs), host and
//!   CUDA, CUDA and CUDA.
//!
//! # Examples
//!
//! ```
//! use cuferry::linop::{Array, Dims, Linop, ToDevice};
//! use cuferry::{Device, DeviceSpec};
//!
//! let (a, b) = (DeviceSpec::new(Device::Host)?, DeviceSpec::new(Device::Host)?);
//! let t = ToDevice::new(a.clone(), b.clone(), Dims::new(&[("x", 3)])?);
//! let x = Array::from_slice(&a, &[3], &[1.0f32, 2.0, 3.0])?;
//! let y = t.apply(&x)?;
//! assert_eq!(y.spec().compute_stream.id(), b.compute_stream.id());
//! assert_eq!(y.to_vec()?, vec![1.0, 2.0, 3.0]);
//! # Ok::<(), cuferry::Error>(())
//! ```

use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use super::array::Array;
use super::dims::Dims;
use super::field::Field;
use super::op::{check_input, check_split, restrict, Linop, LinopRef};
use super::transfer::{relabel, transfer_on, transfer_stream};
use crate::device::DeviceSpec;
use crate::error::{Error, Result};
use crate::stream::Stream;

/// A transfer from `ispec` to `ospec` over `dims`. See the [module docs](crate::linop).
#[derive(Clone)]
pub struct ToDevice {
    ispec: DeviceSpec,
    ospec: DeviceSpec,
    dims: Dims,
    /// The pair's transfer stream, resolved on first use; shared by clones and splits.
    stream: Arc<Mutex<Option<Arc<Stream>>>>,
}

impl fmt::Debug for ToDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToDevice")
            .field("from", &self.ispec.device)
            .field("to", &self.ospec.device)
            .field("dims", &self.dims)
            .finish()
    }
}

impl ToDevice {
    /// A transfer of arrays with `dims` from `ispec` to `ospec`.
    pub fn new(ispec: DeviceSpec, ospec: DeviceSpec, dims: Dims) -> Self {
        ToDevice { ispec, ospec, dims, stream: Arc::default() }
    }

    /// The source placement.
    pub fn ispec(&self) -> &DeviceSpec {
        &self.ispec
    }

    /// The target placement.
    pub fn ospec(&self) -> &DeviceSpec {
        &self.ospec
    }

    fn stream(&self) -> Result<Arc<Stream>> {
        let mut slot = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = slot.as_ref() {
            return Ok(Arc::clone(s));
        }
        let s = transfer_stream(&self.ispec, &self.ospec)?;
        *slot = Some(Arc::clone(&s));
        Ok(s)
    }
}

impl<T: Field> Linop<T> for ToDevice {
    fn name(&self) -> &'static str {
        "ToDevice"
    }
    fn idims(&self) -> &Dims {
        &self.dims
    }
    fn odims(&self) -> &Dims {
        &self.dims
    }
    fn apply(&self, x: &Array<T>) -> Result<Array<T>> {
        check_input::<T>(self, x)?;
        if x.device() != self.ispec.device {
            return Err(Error::invalid(format!(
                "ToDevice from {} got an array on {}",
                self.ispec.device,
                x.device()
            )));
        }
        if x.device() == self.ospec.device {
            // No copy within one device, so no transfer stream either.
            return relabel(x, &self.ospec);
        }
        transfer_on(x, &self.ospec, &*self.stream()?)
    }
    fn adjoint(&self) -> LinopRef<T> {
        Arc::new(ToDevice::new(self.ospec.clone(), self.ispec.clone(), self.dims.clone()))
    }
    fn normal(&self) -> LinopRef<T> {
        // The identity on `ispec`: it refuses arrays of other devices and returns its result
        // under `ispec`, as the round trip there and back does.
        Arc::new(ToDevice::new(self.ispec.clone(), self.ispec.clone(), self.dims.clone()))
    }
    fn split(&self, dim: &str, range: Range<usize>) -> Result<LinopRef<T>> {
        check_split::<T>(self, dim, &range)?;
        Ok(Arc::new(ToDevice { dims: restrict(&self.dims, dim, &range), ..self.clone() }))
    }
    fn place_on(&self, _spec: &DeviceSpec) -> Result<LinopRef<T>> {
        Ok(Arc::new(self.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;

    #[test]
    fn no_transfer_stream_within_one_device() {
        let (a, b) = (DeviceSpec::new(Device::Host).unwrap(), DeviceSpec::new(Device::Host).unwrap());
        let t = ToDevice::new(a.clone(), b.clone(), Dims::new(&[("x", 2)]).unwrap());
        let x = Array::from_slice(&a, &[2], &[1.0f64, 2.0]).unwrap();
        let y = Linop::<f64>::apply(&t, &x).unwrap();
        assert_eq!(y.spec().compute_stream.id(), b.compute_stream.id());
        assert_eq!(y.to_vec().unwrap(), [1.0, 2.0]);
        assert!(t.stream.lock().unwrap().is_none(), "a transfer stream was made for no copy");
    }

    /// The normal takes an array as the round trip there and back does: its result is under
    /// `ispec` (it used to be the plain identity, which kept the input's spec and accepted
    /// arrays of any device).
    #[test]
    fn the_normal_returns_under_the_source_spec() {
        let spec = || DeviceSpec::new(Device::Host).unwrap();
        let (a, b, elsewhere) = (spec(), spec(), spec());
        let t = ToDevice::new(a.clone(), b, Dims::new(&[("x", 2)]).unwrap());
        let x = Array::from_slice(&elsewhere, &[2], &[1.0f64, 2.0]).unwrap();
        let round_trip = Linop::<f64>::adjoint(&t).apply(&Linop::<f64>::apply(&t, &x).unwrap()).unwrap();
        let normal = Linop::<f64>::normal(&t).apply(&x).unwrap();
        assert_eq!(round_trip.spec().compute_stream.id(), a.compute_stream.id());
        assert_eq!(normal.spec().compute_stream.id(), a.compute_stream.id());
        assert_eq!(normal.to_vec().unwrap(), [1.0, 2.0]);
    }
}
