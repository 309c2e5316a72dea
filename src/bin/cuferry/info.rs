//! `cuferry info`: devices, memory, versions, or why only the host backend runs.
//!
//! Rules: it succeeds on a machine without a GPU, driver or CUDA build, reporting the host
//! backend and the reason; a device that exists but cannot be read (its properties, memory,
//! L2 fetch granularity or host wait mode) fails the exit code.

use std::process::ExitCode;

use cuferry::{Device, Error};

/// CUDA errors that, like `NoDriver`, mean there is no usable driver here: the toolkit's stub
/// `libcuda` found instead of a driver (`cudaErrorStubLibrary`), and a driver that does not
/// match the kernel module or the device (`cudaErrorSystemDriverMismatch`,
/// `cudaErrorCompatNotSupportedOnDevice`).
const NO_USABLE_DRIVER: [i32; 3] = [34, 803, 804];

/// Whether the device count's failure means this machine runs the host backend only (no
/// driver, no device, no CUDA build), rather than a device that failed.
fn host_only(e: &Error) -> bool {
    match e {
        Error::NoDriver { .. } | Error::NoDevice { .. } | Error::Unsupported { .. } => true,
        Error::Cuda { code, .. } => NO_USABLE_DRIVER.contains(code),
        _ => false,
    }
}

fn gib(bytes: usize) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Prints the report.
pub fn run() -> ExitCode {
    println!("cuferry {}", env!("CARGO_PKG_VERSION"));
    println!("build: {}", cuferry::cuda_build_note());
    if !cuferry::cuda_built() {
        println!("backend: host only (CUDA support was not compiled in)");
        return ExitCode::SUCCESS;
    }
    match cuferry::cuda_runtime_version() {
        Ok(v) => println!("CUDA runtime: {v}"),
        Err(e) => println!("CUDA runtime: unknown ({e})"),
    }
    match cuferry::cuda_driver_version() {
        Ok(Some(v)) => println!("CUDA driver: {v}"),
        Ok(None) => println!("CUDA driver: none installed"),
        Err(e) => println!("CUDA driver: unknown ({e})"),
    }
    let count = match Device::try_cuda_count() {
        Ok(n) => n,
        Err(e) if host_only(&e) => {
            println!("backend: host only ({e})");
            print_topology();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            println!("backend: host only (device count failed: {e})");
            return ExitCode::FAILURE;
        }
    };
    println!("backend: CUDA, {count} device(s), plus the host backend");
    let mut ok = true;
    for i in 0..count {
        let dev = Device::Cuda(i);
        match dev.properties() {
            Ok(p) => {
                let mem = dev.memory_info().map(|m| format!("{} free of {}", gib(m.free), gib(m.total)));
                ok &= mem.is_ok();
                println!(
                    "{dev}: {} | sm_{}{} | {} SMs | L2 {} MiB | PCI {} | {} copy engine(s)",
                    p.name,
                    p.compute_capability.0,
                    p.compute_capability.1,
                    p.multiprocessor_count,
                    p.l2_cache_bytes >> 20,
                    p.pci_bus_id,
                    p.async_engine_count
                );
                println!("  memory: {}", mem.unwrap_or_else(|e| format!("unknown ({e})")));
                let fetch = dev.l2_fetch_granularity();
                ok &= fetch.is_ok();
                let fetch = fetch.map_or_else(|e| format!("unknown ({e})"), |b| format!("{b} B"));
                println!("  L2 fetch granularity (max bytes per DRAM fetch): {fetch}");
                let wait = dev.host_wait();
                ok &= wait.is_ok();
                let wait = wait.map_or_else(|e| format!("unknown ({e})"), |w| w.to_string());
                println!("  host wait mode (Device::set_host_wait): {wait}");
                println!(
                    "  managed memory: {} | concurrent managed access: {} | pageable access: {} | \
                     memory pools: {} | host register: {}",
                    p.managed_memory,
                    p.concurrent_managed_access,
                    p.pageable_memory_access,
                    p.memory_pools_supported,
                    p.host_register_supported
                );
            }
            Err(e) => {
                ok = false;
                println!("{dev}: properties unavailable: {e}");
            }
        }
    }
    print_topology();
    if count > 1 {
        println!("peer access (row can access column):");
        for a in 0..count {
            let row: Vec<&str> = (0..count)
                .map(|b| match cuferry::can_access_peer(Device::Cuda(a), Device::Cuda(b)) {
                    Ok(true) => "yes",
                    Ok(false) => "no",
                    Err(_) => "?",
                })
                .collect();
            println!("  cuda:{a}: {}", row.join(" "));
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// PCIe and NVLink from NVML; a missing NVML is reported, not failed.
fn print_topology() {
    let topo = cuferry::topology();
    if let Some(why) = &topo.unavailable {
        println!("topology: {why}");
        return;
    }
    println!("NVIDIA driver: {}", topo.driver_version.as_deref().unwrap_or("unknown"));
    for d in &topo.devices {
        if let Some(why) = &d.unreadable {
            println!("  nvml {}: {why}", d.nvml_index);
            continue;
        }
        let link = |l: Option<(u32, u32)>| l.map_or("?".to_string(), |(g, w)| format!("Gen{g} x{w}"));
        println!(
            "  nvml {} ({}): PCIe {} (max {}), {} active NVLink(s)",
            d.nvml_index,
            d.cuda_ordinal.map_or("not visible to CUDA".to_string(), |i| format!("cuda:{i}")),
            link(d.pcie_current),
            link(d.pcie_max),
            d.nvlinks_active
        );
    }
    for (a, b, level) in &topo.pairs {
        println!("  nvml {a} <-> nvml {b}: {level}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cuda_error(code: i32) -> Error {
        Error::Cuda { call: "cudaGetDeviceCount", code, name: "", description: "" }
    }

    #[test]
    fn a_stub_or_mismatched_driver_means_host_only_and_a_failing_device_does_not() {
        assert!(host_only(&Error::NoDriver { call: "cudaGetDeviceCount" }));
        assert!(host_only(&Error::NoDevice { call: "cudaGetDeviceCount" }));
        for code in NO_USABLE_DRIVER {
            assert!(host_only(&cuda_error(code)), "{code}");
        }
        // cudaErrorUnknown, cudaErrorInitializationError: a device that is there and fails.
        assert!(!host_only(&cuda_error(999)) && !host_only(&cuda_error(3)));
    }
}
