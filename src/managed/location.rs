//! Where managed pages should live, and the advice that can be given about them.
//!
//! Rules: a [`Location`] maps one-to-one to CUDA 13's `cudaMemLocation`; [`Advice`] to
//! `cudaMemoryAdvise` with its location argument. The combinations CUDA refuses whatever the
//! memory (a negative NUMA node; accessed-by advice naming a NUMA node) are refused by
//! cuferry on every backend, with [`Error::InvalidArgument`].

use crate::device::Device;
use crate::error::{Error, Result};
use crate::sys;

/// A place for managed memory pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Location {
    /// A CUDA device's memory.
    Device(u32),
    /// Host memory (any NUMA node).
    Host,
    /// Host memory on this NUMA node.
    HostNuma(i32),
    /// Host memory on the NUMA node closest to the calling thread.
    HostNumaCurrent,
}

impl Location {
    /// The location of a device's own memory: [`Location::Host`] for the host backend.
    pub fn of(device: Device) -> Location {
        match device {
            Device::Host => Location::Host,
            Device::Cuda(i) => Location::Device(i),
        }
    }

    /// Whether the pages are in host memory.
    pub fn is_host(self) -> bool {
        !matches!(self, Location::Device(_))
    }

    /// Refuses what CUDA refuses of any location: a negative NUMA node. `what` names the
    /// operation in the error.
    pub(crate) fn check(self, what: &str) -> Result<()> {
        match self {
            Location::HostNuma(n) if n < 0 => {
                Err(Error::invalid(format!("{what}: host NUMA node {n} (NUMA nodes are numbered from 0)")))
            }
            _ => Ok(()),
        }
    }

    pub(crate) fn raw(self) -> Result<sys::cuferry_location> {
        let (type_, id) = match self {
            Location::Device(i) => (
                sys::CUFERRY_LOCATION_DEVICE,
                i32::try_from(i).map_err(|_| Error::invalid(format!("device {i}")))?,
            ),
            Location::Host => (sys::CUFERRY_LOCATION_HOST, 0),
            Location::HostNuma(n) => (sys::CUFERRY_LOCATION_HOST_NUMA, n),
            Location::HostNumaCurrent => (sys::CUFERRY_LOCATION_HOST_NUMA_CURRENT, 0),
        };
        Ok(sys::cuferry_location { type_, id })
    }
}

/// A hint about how managed memory will be used (`cudaMemAdvise`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Advice {
    /// Mostly read: devices that read it get their own read-only copy.
    SetReadMostly,
    /// Undo [`Advice::SetReadMostly`].
    UnsetReadMostly,
    /// Keep the pages at this location when possible.
    SetPreferredLocation(Location),
    /// Undo [`Advice::SetPreferredLocation`].
    UnsetPreferredLocation,
    /// Map the pages for this device so it reads them without faults wherever they are.
    SetAccessedBy(Location),
    /// Undo [`Advice::SetAccessedBy`] for this device.
    UnsetAccessedBy(Location),
}

impl Advice {
    /// (cudaMemoryAdvise value, location argument). Advice that names no location still passes
    /// a valid one (the host): CUDA 13 ignores it for those kinds but answers a location of
    /// type none with `cudaErrorInvalidValue` (seen on an H100, driver 580.159).
    pub(crate) fn raw(self) -> Result<(i32, sys::cuferry_location)> {
        let ignored = sys::cuferry_location { type_: sys::CUFERRY_LOCATION_HOST, id: 0 };
        Ok(match self {
            Advice::SetReadMostly => (sys::CUFERRY_ADVISE_SET_READ_MOSTLY, ignored),
            Advice::UnsetReadMostly => (sys::CUFERRY_ADVISE_UNSET_READ_MOSTLY, ignored),
            Advice::SetPreferredLocation(l) => (sys::CUFERRY_ADVISE_SET_PREFERRED_LOCATION, l.raw()?),
            Advice::UnsetPreferredLocation => (sys::CUFERRY_ADVISE_UNSET_PREFERRED_LOCATION, ignored),
            Advice::SetAccessedBy(l) => (sys::CUFERRY_ADVISE_SET_ACCESSED_BY, l.raw()?),
            Advice::UnsetAccessedBy(l) => (sys::CUFERRY_ADVISE_UNSET_ACCESSED_BY, l.raw()?),
        })
    }

    /// Refuses advice CUDA refuses whatever the memory: accessed-by advice naming a NUMA node
    /// (CUDA takes a device or the host), and a location [`Location::check`] refuses. The host
    /// backend, which ignores advice, refuses it too, so host tests catch it.
    pub(crate) fn check(self) -> Result<()> {
        match self {
            Advice::SetAccessedBy(l) | Advice::UnsetAccessedBy(l)
                if !matches!(l, Location::Device(_) | Location::Host) =>
            {
                Err(Error::invalid(format!(
                    "advise: accessed-by advice names a device or the host, not {l:?} (CUDA refuses NUMA locations for it)"
                )))
            }
            _ => self.location().map_or(Ok(()), |l| l.check("advise")),
        }
    }

    /// The location the advice names, if any.
    pub(crate) fn location(self) -> Option<Location> {
        match self {
            Advice::SetPreferredLocation(l) | Advice::SetAccessedBy(l) | Advice::UnsetAccessedBy(l) => {
                Some(l)
            }
            _ => None,
        }
    }
}
