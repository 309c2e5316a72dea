//! Devices: where memory lives and streams run.
//!
//! Rules:
//! - [`Device::Host`] is the portable backend: ordinary host memory, streams served by worker
//!   threads. It exists on every machine.
//! - [`Device::Cuda`] names a CUDA ordinal. Nothing is checked when the value is made; the first
//!   operation on it reports a typed error when CUDA is not built in, there is no driver
//!   ([`Error::NoDriver`]), no device ([`Error::NoDevice`]) or no such ordinal.
//! - [`Device::cuda_count`] never fails: it is 0 whenever CUDA cannot be used, and
//!   [`Device::try_cuda_count`] says why.
//! - Peer access is probed, never assumed: [`can_access_peer`] asks the driver.
//! - CUDA calls behind cuferry's functions that need a current device (allocations and frees,
//!   streams and events, memory info, the L2 fetch granularity and host-wait settings (read
//!   or written: both live in the device's context), enabling peer access, synchronizing a
//!   device, drops of CUDA buffers) make their device current on the calling thread with
//!   `cudaSetDevice` and leave it so, as the CUDA runtime's own calls do. Work queued on a
//!   stream, and waits on streams and events, make their device current only on a thread with
//!   no context (so that none is created on device 0). Queries that name their ordinal
//!   (properties, the device count, whether peer access is possible) leave the current device
//!   as it is. Code mixing cuferry with other runtime-API code sets its device again before
//!   its own calls.

use std::fmt;

use crate::cuda;
use crate::error::{Error, Result};
use crate::stream::Stream;
use crate::sys;

/// A place where memory lives and work runs.
///
/// # Examples
///
/// ```
/// use cuferry::Device;
/// assert_eq!(Device::Host.to_string(), "host");
/// assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
/// assert!(Device::Host.is_host());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Device {
    /// The host backend: host memory and worker-thread streams.
    Host,
    /// A CUDA device by ordinal.
    Cuda(u32),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Host => write!(f, "host"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl Device {
    /// Whether this is [`Device::Host`].
    pub fn is_host(self) -> bool {
        matches!(self, Device::Host)
    }

    /// The CUDA ordinal, or `None` for the host.
    pub fn cuda_ordinal(self) -> Option<u32> {
        match self {
            Device::Host => None,
            Device::Cuda(i) => Some(i),
        }
    }

    /// The number of usable CUDA devices: 0 when CUDA is not built in, there is no driver or
    /// no device.
    ///
    /// # Examples
    ///
    /// ```
    /// let n = cuferry::Device::cuda_count();
    /// assert!(n == 0 || cuferry::Device::try_cuda_count().is_ok());
    /// ```
    pub fn cuda_count() -> u32 {
        Self::try_cuda_count().unwrap_or(0)
    }

    /// The number of CUDA devices, or why there are none usable.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] when cuferry was built without nvcc, [`Error::NoDriver`] without
    /// a driver, [`Error::NoDevice`] when the driver sees no device.
    pub fn try_cuda_count() -> Result<u32> {
        cuda::device::count()
    }

    /// Checks that `self` can be used: always for the host, and for a CUDA ordinal when it is
    /// below [`Device::try_cuda_count`].
    ///
    /// # Errors
    ///
    /// As [`Device::try_cuda_count`], and [`Error::InvalidArgument`] for an ordinal past the
    /// last device.
    pub fn check_available(self) -> Result<()> {
        match self {
            Device::Host => Ok(()),
            Device::Cuda(i) => {
                let n = Self::try_cuda_count()?;
                if i < n {
                    Ok(())
                } else {
                    Err(Error::invalid(format!("{self} does not exist: {n} CUDA device(s) present")))
                }
            }
        }
    }

    /// The properties of a CUDA device.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for [`Device::Host`]; CUDA errors as for
    /// [`Device::try_cuda_count`], or `cudaErrorInvalidDevice` for a bad ordinal.
    pub fn properties(self) -> Result<DeviceProperties> {
        let Device::Cuda(i) = self else {
            return Err(Error::unsupported("device properties exist for CUDA devices only"));
        };
        let p = cuda::device::properties(i)?;
        let name_bytes: Vec<u8> = p.name.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        let flag = |v: i32| v != 0;
        Ok(DeviceProperties {
            ordinal: i,
            name: String::from_utf8_lossy(&name_bytes).into_owned(),
            total_memory: p.total_global_mem,
            compute_capability: (p.compute_major, p.compute_minor),
            multiprocessor_count: p.multiprocessor_count,
            l2_cache_bytes: p.l2_cache_size,
            pci_bus_id: format!("{:04x}:{:02x}:{:02x}.0", p.pci_domain_id, p.pci_bus_id, p.pci_device_id),
            async_engine_count: p.async_engine_count,
            unified_addressing: flag(p.unified_addressing),
            managed_memory: flag(p.managed_memory),
            concurrent_managed_access: flag(p.concurrent_managed_access),
            pageable_memory_access: flag(p.pageable_memory_access),
            memory_pools_supported: flag(p.memory_pools_supported),
            host_register_supported: flag(p.host_register_supported),
            can_map_host_memory: flag(p.can_map_host_memory),
            integrated: flag(p.integrated),
        })
    }

    /// Free and total memory of a CUDA device in bytes.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for [`Device::Host`]; CUDA errors otherwise.
    pub fn memory_info(self) -> Result<MemoryInfo> {
        let Device::Cuda(i) = self else {
            return Err(Error::unsupported("memory_info exists for CUDA devices only"));
        };
        let (free, total) = cuda::device::mem_info(i)?;
        Ok(MemoryInfo { free, total })
    }

    /// The most bytes a CUDA device's L2 cache fetches from DRAM on a miss (CUDA's
    /// `cudaLimitMaxL2FetchGranularity`): a read of fewer bytes may still move this many. This
    /// is the limit as the runtime stores it; the hardware may treat it as a hint.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for [`Device::Host`]; CUDA errors otherwise.
    pub fn l2_fetch_granularity(self) -> Result<usize> {
        let Device::Cuda(i) = self else {
            return Err(Error::unsupported("the L2 fetch granularity exists for CUDA devices only"));
        };
        cuda::device::l2_fetch_granularity(i)
    }

    /// Asks a CUDA device's L2 cache to fetch at most `bytes` (0..=[`MAX_L2_FETCH_GRANULARITY`])
    /// from DRAM per miss, and returns the limit read back from the runtime (which may round
    /// the request). CUDA documents the limit as a performance hint that a platform may
    /// ignore or clamp, so the value read back does not prove the hardware's behaviour
    /// changed: measure DRAM traffic (Nsight Compute's `dram__bytes_read.sum`) to know.
    ///
    /// Sparse reads, such as a halo pack's x-faces (24-byte runs at a pitch of kilobytes), move
    /// less DRAM traffic at 32 bytes (one sector); streaming reads can lose the prefetch that
    /// larger fetches give. The setting belongs to the device's primary context: it applies to
    /// every stream, thread and library of the process using the device, for kernels launched
    /// afterwards. Set it once at start-up, or put the old value back when done.
    ///
    /// # Examples
    ///
    /// ```
    /// use cuferry::Device;
    /// if Device::cuda_count() > 0 {
    ///     let device = Device::Cuda(0);
    ///     let old = device.l2_fetch_granularity()?;
    ///     let now = device.set_l2_fetch_granularity(32)?;
    ///     assert!(now <= cuferry::MAX_L2_FETCH_GRANULARITY);
    ///     device.set_l2_fetch_granularity(old)?;
    /// }
    /// # Ok::<(), cuferry::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for [`Device::Host`]; [`Error::InvalidArgument`] for more than
    /// [`MAX_L2_FETCH_GRANULARITY`] bytes; CUDA errors otherwise.
    pub fn set_l2_fetch_granularity(self, bytes: usize) -> Result<usize> {
        let Device::Cuda(i) = self else {
            return Err(Error::unsupported("the L2 fetch granularity exists for CUDA devices only"));
        };
        if bytes > MAX_L2_FETCH_GRANULARITY {
            return Err(Error::invalid(format!(
                "an L2 fetch granularity of {bytes} bytes: CUDA takes 0..={MAX_L2_FETCH_GRANULARITY}"
            )));
        }
        cuda::device::set_l2_fetch_granularity(i, bytes)?;
        cuda::device::l2_fetch_granularity(i)
    }

    /// How host threads wait for this CUDA device ([`HostWait`]), as CUDA reports it for the
    /// device's primary context. Reading it creates that context if the process had none.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for [`Device::Host`] (its streams' waits always block); CUDA
    /// errors otherwise.
    pub fn host_wait(self) -> Result<HostWait> {
        let Device::Cuda(i) = self else {
            return Err(Error::unsupported("the host wait mode exists for CUDA devices only"));
        };
        HostWait::from_schedule_flag(cuda::device::host_wait(i)?)
    }

    /// Sets how host threads wait for this CUDA device from now on (CUDA's
    /// `cudaSetDeviceFlags`; only the scheduling flag changes).
    ///
    /// Choose [`HostWait::Block`] when the host has more to do than wait, for example a
    /// [`PackExecutor`](crate::ring::PackExecutor) with a thread per core: a thread blocked in
    /// `Stream::synchronize` then leaves its core to the fill threads. The setting belongs to
    /// the device's primary context, so it applies to every thread and library of the process
    /// using the device (PyTorch and CuPy included). Set it once at start-up.
    ///
    /// The call leaves this device current on the calling thread, as other calls that work on
    /// a CUDA device do.
    ///
    /// # Examples
    ///
    /// ```
    /// use cuferry::{Device, HostWait};
    /// if Device::cuda_count() > 0 {
    ///     let device = Device::Cuda(0);
    ///     let old = device.host_wait()?;
    ///     device.set_host_wait(HostWait::Block)?;
    ///     assert_eq!(device.host_wait()?, HostWait::Block);
    ///     device.set_host_wait(old)?;
    /// }
    /// # Ok::<(), cuferry::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for [`Device::Host`]; CUDA errors otherwise.
    pub fn set_host_wait(self, wait: HostWait) -> Result<()> {
        let Device::Cuda(i) = self else {
            return Err(Error::unsupported("the host wait mode exists for CUDA devices only"));
        };
        cuda::device::set_host_wait(i, wait.schedule_flag())
    }
}

/// How a host thread waits for a CUDA device: in `Stream::synchronize`, `Event::synchronize`
/// and every other call that blocks on device work (CUDA's device scheduling flag,
/// [`Device::set_host_wait`]).
///
/// CUDA fixes how an event is waited for when the event is made: events made while the device
/// is set to [`HostWait::Block`] block their waiters (cuferry adds `cudaEventBlockingSync`);
/// events made before keep spinning. The buffers' use tracking and a ring make their events
/// as they go, so set the mode before creating streams, buffers and rings.
///
/// A spinning waiter answers within a microsecond or two but keeps a core busy for the whole
/// wait, a core that a [`PackExecutor`](crate::ring::PackExecutor) filling ring slots, or any
/// other host thread, then does not get. A blocked waiter costs no CPU and wakes later (tens
/// of microseconds in a VM).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HostWait {
    /// CUDA's default: spin while the process has no more CUDA contexts than logical
    /// processors (nearly always), yield otherwise.
    Auto,
    /// Poll without giving up the core: the lowest latency, one core busy per waiting thread.
    Spin,
    /// Poll, yielding the core to other threads between polls.
    Yield,
    /// Sleep on an operating-system primitive until the device signals: no CPU spent waiting.
    Block,
}

impl HostWait {
    fn schedule_flag(self) -> u32 {
        let flag = match self {
            HostWait::Auto => sys::CUFERRY_HOST_WAIT_AUTO,
            HostWait::Spin => sys::CUFERRY_HOST_WAIT_SPIN,
            HostWait::Yield => sys::CUFERRY_HOST_WAIT_YIELD,
            HostWait::Block => sys::CUFERRY_HOST_WAIT_BLOCK,
        };
        flag.unsigned_abs()
    }

    fn from_schedule_flag(flag: u32) -> Result<Self> {
        [HostWait::Auto, HostWait::Spin, HostWait::Yield, HostWait::Block]
            .into_iter()
            .find(|w| w.schedule_flag() == flag)
            .ok_or_else(|| Error::unsupported(format!("CUDA reported an unknown scheduling flag {flag:#x}")))
    }
}

impl fmt::Display for HostWait {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HostWait::Auto => "auto",
            HostWait::Spin => "spin",
            HostWait::Yield => "yield",
            HostWait::Block => "block",
        })
    }
}

/// The largest L2 fetch granularity CUDA accepts, in bytes
/// ([`Device::set_l2_fetch_granularity`]).
pub const MAX_L2_FETCH_GRANULARITY: usize = 128;

/// What a CUDA device is and can do (capabilities are probed from the driver).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceProperties {
    /// The CUDA ordinal.
    pub ordinal: u32,
    /// The marketing name, e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
    /// Global memory in bytes.
    pub total_memory: usize,
    /// (major, minor), e.g. (9, 0) for Hopper.
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors.
    pub multiprocessor_count: i32,
    /// L2 cache size in bytes.
    pub l2_cache_bytes: i32,
    /// PCI address, `domain:bus:device.0`.
    pub pci_bus_id: String,
    /// Copy engines; 2 or more let H2D and D2H overlap.
    pub async_engine_count: i32,
    /// Unified virtual addressing.
    pub unified_addressing: bool,
    /// `cudaMallocManaged` works.
    pub managed_memory: bool,
    /// Managed memory may be touched by host and device at once; prefetch and advise need it.
    pub concurrent_managed_access: bool,
    /// The device can read pageable host memory directly.
    pub pageable_memory_access: bool,
    /// Stream-ordered memory pools.
    pub memory_pools_supported: bool,
    /// `cudaHostRegister` works.
    pub host_register_supported: bool,
    /// Pinned host memory can be mapped into the device's address space.
    pub can_map_host_memory: bool,
    /// The GPU shares memory with the host.
    pub integrated: bool,
}

/// Free and total bytes of a device's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryInfo {
    /// Bytes free now.
    pub free: usize,
    /// Bytes in all.
    pub total: usize,
}

/// A CUDA version number split as CUDA encodes it (1000 * major + 10 * minor).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct CudaVersion {
    /// Major version, e.g. 13.
    pub major: i32,
    /// Minor version, e.g. 0.
    pub minor: i32,
}

impl CudaVersion {
    fn from_encoded(v: i32) -> Self {
        CudaVersion { major: v / 1000, minor: (v % 1000) / 10 }
    }
}

impl fmt::Display for CudaVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// The CUDA runtime version cuferry was linked with.
///
/// # Errors
///
/// [`Error::Unsupported`] when cuferry was built without nvcc.
pub fn cuda_runtime_version() -> Result<CudaVersion> {
    cuda::device::runtime_version().map(CudaVersion::from_encoded)
}

/// The CUDA version of the installed driver, `None` when no driver is installed.
///
/// # Errors
///
/// [`Error::Unsupported`] when cuferry was built without nvcc.
pub fn cuda_driver_version() -> Result<Option<CudaVersion>> {
    let v = cuda::device::driver_version()?;
    Ok((v > 0).then(|| CudaVersion::from_encoded(v)))
}

/// Whether cuferry was compiled with its CUDA library (nvcc was found at build time).
pub fn cuda_built() -> bool {
    cuda::is_built()
}

/// How the CUDA part was built: the nvcc used, or why there is none.
///
/// # Examples
///
/// ```
/// assert!(!cuferry::cuda_build_note().is_empty());
/// ```
pub fn cuda_build_note() -> &'static str {
    cuda::NOT_BUILT_REASON
}

/// Whether `device` can read and write `peer`'s memory directly. A device and itself: true.
/// Any pair involving the host: false (host memory is reached by copies, not peer access).
///
/// # Errors
///
/// As [`Device::check_available`] for either device (a missing driver or CUDA build, an
/// ordinal past the last device: also for a device and itself); CUDA errors of the query.
pub fn can_access_peer(device: Device, peer: Device) -> Result<bool> {
    device.check_available()?;
    peer.check_available()?;
    match (device, peer) {
        (Device::Cuda(a), Device::Cuda(b)) if a == b => Ok(true),
        (Device::Cuda(a), Device::Cuda(b)) => cuda::device::can_access_peer(a, b),
        _ => Ok(false),
    }
}

/// Lets `device` access `peer`'s memory directly (one direction). Enabling twice, or for a
/// device and itself, is a success.
///
/// # Errors
///
/// As [`Device::check_available`] for either device; [`Error::Unsupported`] when a host
/// device is named or the pair cannot use peer access (check [`can_access_peer`] first); CUDA
/// errors otherwise.
pub fn enable_peer_access(device: Device, peer: Device) -> Result<()> {
    device.check_available()?;
    peer.check_available()?;
    match (device, peer) {
        (Device::Cuda(a), Device::Cuda(b)) if a == b => Ok(()),
        (Device::Cuda(a), Device::Cuda(b)) => {
            if !cuda::device::can_access_peer(a, b)? {
                return Err(Error::unsupported(format!("{device} cannot access {peer}'s memory (no P2P)")));
            }
            cuda::device::enable_peer_access(a, b)
        }
        _ => {
            Err(Error::unsupported(format!("peer access between {device} and {peer}: host memory has none")))
        }
    }
}

/// A device together with the streams used for work on it: one for computation, and
/// optionally one dedicated to transfers to or from it (the seed's `DeviceSpec`).
///
/// # Examples
///
/// ```
/// use cuferry::{Device, DeviceSpec};
/// let spec = DeviceSpec::new(Device::Host)?;
/// assert_eq!(spec.device, Device::Host);
/// assert_eq!(spec.compute_stream.device(), Device::Host);
/// assert!(spec.transfer_stream.is_none());
/// # Ok::<(), cuferry::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct DeviceSpec {
    /// Where the work runs.
    pub device: Device,
    /// The stream computation on this device is queued on.
    pub compute_stream: Stream,
    /// The stream transfers to or from this device use, when one was chosen.
    pub transfer_stream: Option<Stream>,
}

impl DeviceSpec {
    /// A spec for `device` with a new compute stream and no transfer stream.
    ///
    /// # Errors
    ///
    /// As [`Stream::new`].
    pub fn new(device: Device) -> Result<Self> {
        Ok(DeviceSpec { device, compute_stream: Stream::new(device)?, transfer_stream: None })
    }

    /// A spec for `device` with the given streams.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when a stream belongs to another device.
    pub fn with_streams(
        device: Device,
        compute_stream: Stream,
        transfer_stream: Option<Stream>,
    ) -> Result<Self> {
        for s in std::iter::once(&compute_stream).chain(transfer_stream.as_ref()) {
            if s.device() != device {
                return Err(Error::invalid(format!("a stream of {} given for {device}", s.device())));
            }
        }
        Ok(DeviceSpec { device, compute_stream, transfer_stream })
    }
}
