//! Topology: PCIe links, NVLink and how devices are connected, read through NVML.
//!
//! Rules:
//! - NVML (libnvidia-ml) is loaded at run time by nvml-wrapper; without a driver the topology
//!   is empty and says why ([`Topology::unavailable`]), it is never an error.
//! - Devices are matched to CUDA ordinals by PCI address (NVML and CUDA may number them
//!   differently); a device NVML cannot match has no CUDA ordinal.
//! - A field NVML cannot read on this device (a VM, a vGPU) is `None`, not a failure.
//!
//! # Examples
//!
//! ```
//! let topo = cuferry::topology();
//! // On a machine without a driver: no devices, and the reason.
//! assert!(!topo.devices.is_empty() || topo.unavailable.is_some());
//! ```

use nvml_wrapper::Nvml;

/// One device as NVML sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceLinks {
    /// NVML's index.
    pub nvml_index: u32,
    /// The CUDA ordinal with the same PCI address, when CUDA sees it.
    pub cuda_ordinal: Option<u32>,
    /// Name.
    pub name: Option<String>,
    /// PCI address as NVML prints it.
    pub pci_bus_id: Option<String>,
    /// (generation, width) of the PCIe link now.
    pub pcie_current: Option<(u32, u32)>,
    /// (generation, width) the device and slot allow.
    pub pcie_max: Option<(u32, u32)>,
    /// Active NVLink links.
    pub nvlinks_active: u32,
    /// Why NVML could not open the device (permissions, a container), when it could not; the
    /// other fields are then empty. The row is kept so NVML indices have no gaps.
    pub unreadable: Option<String>,
}

/// Devices and how each pair is connected.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Topology {
    /// The NVIDIA driver version, when NVML loaded.
    pub driver_version: Option<String>,
    /// Devices in NVML order.
    pub devices: Vec<DeviceLinks>,
    /// For each pair (i < j) of NVML indices, their closest common ancestor as NVML names it
    /// (e.g. "Internal", "Single", "HostBridge", "System").
    pub pairs: Vec<(u32, u32, String)>,
    /// Why the topology is empty, when it is.
    pub unavailable: Option<String>,
}

impl DeviceLinks {
    /// The row of a device NVML lists but cannot open.
    fn unopened(nvml_index: u32, why: String) -> Self {
        DeviceLinks {
            nvml_index,
            cuda_ordinal: None,
            name: None,
            pci_bus_id: None,
            pcie_current: None,
            pcie_max: None,
            nvlinks_active: 0,
            unreadable: Some(why),
        }
    }
}

/// (domain, bus, device) of a PCI address such as "00000000:65:00.0" or "0000:65:00.0".
fn pci_key(id: &str) -> Option<(u32, u32, u32)> {
    let mut parts = id.split([':', '.']);
    let domain = u32::from_str_radix(parts.next()?, 16).ok()?;
    let bus = u32::from_str_radix(parts.next()?, 16).ok()?;
    let device = u32::from_str_radix(parts.next()?, 16).ok()?;
    Some((domain, bus, device))
}

/// Reads the topology through NVML: empty, with the reason in [`Topology::unavailable`], when
/// there is no driver or NVML sees no device; a field NVML cannot read is `None`, and a device
/// NVML cannot open keeps its row with the reason in [`DeviceLinks::unreadable`].
pub fn topology() -> Topology {
    let nvml = match Nvml::init() {
        Ok(n) => n,
        Err(e) => {
            return Topology { unavailable: Some(format!("NVML not available: {e}")), ..Topology::default() }
        }
    };
    let count = match nvml.device_count() {
        Ok(n) => n,
        Err(e) => {
            return Topology {
                unavailable: Some(format!("NVML device count failed: {e}")),
                ..Topology::default()
            }
        }
    };
    let cuda: Vec<(u32, (u32, u32, u32))> = (0..crate::Device::cuda_count())
        .filter_map(|i| {
            let p = crate::Device::Cuda(i).properties().ok()?;
            Some((i, pci_key(&p.pci_bus_id)?))
        })
        .collect();
    let mut devices = Vec::new();
    let mut handles = Vec::new();
    for index in 0..count {
        let dev = match nvml.device_by_index(index) {
            Ok(dev) => dev,
            Err(e) => {
                devices.push(DeviceLinks::unopened(index, format!("NVML cannot open it: {e}")));
                continue;
            }
        };
        let pci_bus_id = dev.pci_info().ok().map(|p| p.bus_id);
        let key = pci_bus_id.as_deref().and_then(pci_key);
        let cuda_ordinal = cuda.iter().find(|(_, k)| Some(*k) == key).map(|(i, _)| *i);
        let both = |a: Result<u32, _>, b: Result<u32, _>| a.ok().zip(b.ok());
        let nvlinks_active =
            (0..18).filter(|&l| dev.link_wrapper_for(l).is_active().unwrap_or(false)).count() as u32;
        devices.push(DeviceLinks {
            nvml_index: index,
            cuda_ordinal,
            name: dev.name().ok(),
            pci_bus_id,
            pcie_current: both(dev.current_pcie_link_gen(), dev.current_pcie_link_width()),
            pcie_max: both(dev.max_pcie_link_gen(), dev.max_pcie_link_width()),
            nvlinks_active,
            unreadable: None,
        });
        handles.push((index, dev));
    }
    if devices.is_empty() {
        return Topology {
            driver_version: nvml.sys_driver_version().ok(),
            unavailable: Some("NVML loaded but sees no devices".to_string()),
            ..Topology::default()
        };
    }
    let mut pairs = Vec::new();
    for (a, (ia, da)) in handles.iter().enumerate() {
        for (ib, db) in handles.iter().skip(a + 1) {
            if let Ok(level) = nvml.topology_common_ancestor(da, db) {
                pairs.push((*ia, *ib, format!("{level:?}")));
            }
        }
    }
    Topology { driver_version: nvml.sys_driver_version().ok(), devices, pairs, unavailable: None }
}

#[cfg(test)]
mod tests {
    use super::pci_key;

    #[test]
    fn pci_addresses_of_both_spellings_match() {
        assert_eq!(pci_key("00000000:65:00.0"), Some((0, 0x65, 0)));
        assert_eq!(pci_key("0000:65:00.0"), pci_key("00000000:65:00.0"));
        assert_eq!(pci_key("garbage"), None);
    }
}
